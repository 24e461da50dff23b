"""Recompute: a graph pass that lets a long-lived tensor be recomputed instead of kept.

A tensor read early and again much later (a U-Net's full-resolution skip) would stay
materialised across every segment in between. ``recompute(graph, names)`` copies, for each
named node ``t``, its *cone* (``t`` and every node it depends on, back to the model input) and
places the copy in execution order right before ``t``'s first *late reader*; the late readers
then read the copy. The original serves only the early readers, so it dies early; the segment
holding the late readers recomputes the cone tile by tile from the model input, with the same
parameters (their gradients add up over both uses, as for any shared weight).

Readers: ordered by position, ``t``'s readers split at the widest gap between consecutive
positions (``t``'s own position first); those after it are late. A node is recomputable when
that gap spans at least ``MIN_GAP`` nodes, it is not a model output, and its cone is tileable
and deterministic. Copies are named ``<node>_recomputed<k>`` (``k``: the index of ``t`` in
``names``) and record the node they copy in ``NodeSpec.recomputes``.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from tilec.errors import GridError
from tilec.ir import INPUT, Arg, NodeSpec
from tilec.planner import model_outputs
from tilec.trace import nodes_in_order

#: Fewest nodes between a tensor's early and late readers for it to be worth recomputing.
MIN_GAP = 12
#: Ops whose result changes from one run to the next: never recomputed.
RANDOM = frozenset({"dropout", "feature_dropout", "alpha_dropout", "native_dropout", "bernoulli", "rand", "randn",
                    "rand_like", "randn_like"})


def late_readers(graph: nx.DiGraph, name: str) -> tuple[str, ...]:
    """The readers of ``name`` after the widest gap in their positions (empty: none is late)."""
    position = {n: i for i, n in enumerate(graph.graph["order"])}
    readers = sorted(graph.successors(name), key=position.__getitem__)
    marks = [position[name], *(position[r] for r in readers)]
    gaps = [marks[k + 1] - marks[k] for k in range(len(readers))]
    if not gaps or gaps.index(max(gaps)) == 0 or max(gaps) < MIN_GAP:
        return ()
    return tuple(readers[gaps.index(max(gaps)):])


def cone(graph: nx.DiGraph, name: str) -> list[str]:
    """``name`` and every node it depends on, in execution order (the model input excluded)."""
    needed = nx.ancestors(graph, name) | {name}
    return [n for n in graph.graph["order"] if n in needed]


def why_not(graph: nx.DiGraph, name: str) -> str | None:
    """Why node ``name`` cannot be recomputed, or ``None`` when it can."""
    if name == INPUT or name not in graph.graph["order"]:
        return "there is no such node (see tilec inspect --nodes)"
    if name in model_outputs(graph):
        return "it is a model output"
    if not late_readers(graph, name):
        return f"no reader comes {MIN_GAP} or more nodes after the others"
    for node in (graph.nodes[n]["spec"] for n in cone(graph, name)):
        if not node.tileable or node.op in RANDOM:
            where = f" in {node.path}" if node.path else ""
            return f"it depends on node {node.name} (aten.{node.op}{where}), which cannot be recomputed tile by tile"
    return None


def recompute(graph: nx.DiGraph, names: Sequence[str]) -> nx.DiGraph:
    """A copy of ``graph`` where each of ``names`` is recomputed for its late readers."""
    for name in names:
        reason = why_not(graph, name)
        if reason is not None:
            raise GridError(f"--recompute {name}: cannot recompute node {name}: {reason}")
    result = graph.copy()
    for index, name in enumerate(names):
        result = _copy_cone(result, name, f"_recomputed{index}")
    return result


def _copy_cone(graph: nx.DiGraph, name: str, suffix: str) -> nx.DiGraph:
    late = late_readers(graph, name)
    copies = {n: n + suffix for n in cone(graph, name)}
    taken = set(graph.graph["order"])
    if taken & set(copies.values()):
        raise GridError(f"--recompute {name}: node names ending in {suffix!r} are taken")
    specs = [_renamed(graph.nodes[n]["spec"], copies, recomputes=n) for n in copies]
    order = list(graph.graph["order"])
    at = min(order.index(r) for r in late)
    graph.graph["order"] = (*order[:at], *(s.name for s in specs), *order[at:])
    for spec in specs:
        graph.add_node(spec.name, spec=spec)
        graph.add_edges_from((producer, spec.name) for producer in spec.inputs)
    for reader in late:
        spec = graph.nodes[reader]["spec"]
        graph.nodes[reader]["spec"] = _renamed(spec, {name: copies[name]}, recomputes=spec.recomputes)
        graph.remove_edge(name, reader)
        graph.add_edge(copies[name], reader)
    return graph


def _renamed(node: NodeSpec, names: dict[str, str], recomputes: str | None) -> NodeSpec:
    """``node`` reading (and, if it is among them, named) ``names[old]`` instead of ``old``."""
    def arg(a: Arg) -> Arg:
        if a.kind == "node":
            return a.model_copy(update={"value": names.get(a.value, a.value)})
        if a.kind == "nodes":
            return a.model_copy(update={"value": tuple(names.get(v, v) for v in a.value)})
        return a

    return node.model_copy(update={"name": names.get(node.name, node.name), "args": tuple(map(arg, node.args)),
                                   "inputs": tuple(names.get(i, i) for i in node.inputs), "recomputes": recomputes})


def candidates(graph: nx.DiGraph, flops: dict[str, float], share: float) -> list[str]:
    """Recomputable nodes whose cone costs at most ``share`` of the model's forward FLOPs
    (``flops``: per node), cheapest cone first (ties: execution order)."""
    total = sum(flops.values())
    found = []
    for node in nodes_in_order(graph):
        if why_not(graph, node.name) is None:
            cost = sum(flops[n] for n in cone(graph, node.name))
            if cost <= share * total:
                found.append((cost, graph.graph["order"].index(node.name), node.name))
    return [name for _, _, name in sorted(found)]
