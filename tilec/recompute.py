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
and runs the same twice: no random op, no buffer update and no reduction over the image (a
BatchNorm with batch statistics would update its running statistics again). Copies are named
``<node>_recomputed<k>`` (``k``: the index of ``t`` in ``names``) and record the node they copy
in ``NodeSpec.recomputes``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tilec.errors import GridError
from tilec.graph import Graph
from tilec.ir import Arg, NodeSpec
from tilec.ops import rule, updates_buffer

#: Fewest nodes between a tensor's early and late readers for it to be worth recomputing.
MIN_GAP = 12


def late_readers(graph: Graph, name: str) -> tuple[str, ...]:
    """The readers of ``name`` after the widest gap in their positions (empty: none is late)."""
    position = graph.position
    readers = graph.users[name]
    marks = [position[name], *(position[r] for r in readers)]
    gaps = [marks[k + 1] - marks[k] for k in range(len(readers))]
    if not gaps or gaps.index(max(gaps)) == 0 or max(gaps) < MIN_GAP:
        return ()
    return tuple(readers[gaps.index(max(gaps)):])


def cone(graph: Graph, name: str) -> list[str]:
    """``name`` and every node it depends on, in execution order (the model input excluded)."""
    needed = graph.ancestors(name) | {name}
    return [n for n in graph.order if n in needed]


def why_not(graph: Graph, name: str) -> str | None:
    """Why node ``name`` cannot be recomputed, or ``None`` when it can."""
    if graph.is_input(name) or name not in graph.nodes:
        return "there is no such node (see tilec inspect --nodes)"
    if name in graph.outputs:
        return "it is a model output"
    if not late_readers(graph, name):
        return f"no reader comes {MIN_GAP} or more nodes after the others"
    for node in (graph.nodes[n] for n in cone(graph, name)):
        where = f" in {node.path}" if node.path else ""
        if not node.tileable or rule(node).draws(node):
            return f"it depends on node {node.name} (aten.{node.op}{where}), which cannot be recomputed tile by tile"
        if rule(node).reduces(node, graph) or updates_buffer(node):
            return (f"it depends on node {node.name} (aten.{node.op}{where}), a reduction over the image or a buffer "
                    f"update, which runs once per step")
    return None


def recompute(graph: Graph, names: Sequence[str]) -> Graph:
    """``graph`` with each of ``names`` recomputed for its late readers."""
    for k, name in enumerate(names):
        if name in names[:k]:
            raise GridError(f"--recompute {name}: the node is named twice")
        reason = why_not(graph, name)
        if reason is not None:
            raise GridError(f"--recompute {name}: cannot recompute node {name}: {reason}")
    for index, name in enumerate(names):
        graph = _copy_cone(graph, name, f"_recomputed{index}")
    return graph


def _copy_cone(graph: Graph, name: str, suffix: str) -> Graph:
    late = set(late_readers(graph, name))
    copies = {n: n + suffix for n in cone(graph, name)}
    if set(graph.nodes) & set(copies.values()):
        raise GridError(f"--recompute {name}: node names ending in {suffix!r} are taken")
    specs = [_renamed(graph.nodes[n], copies, recomputes=n) for n in copies]
    at = min(graph.position[r] for r in late)
    nodes = [_renamed(node, {name: copies[name]}, recomputes=node.recomputes) if node.name in late else node
             for node in graph]
    return graph.with_nodes([*nodes[:at], *specs, *nodes[at:]])


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


def candidates(graph: Graph, flops: dict[str, float], share: float) -> list[str]:
    """Recomputable nodes whose cone costs at most ``share`` of the model's forward FLOPs
    (``flops``: per node), cheapest cone first (ties: execution order)."""
    total = sum(flops.values())
    found = []
    for node in graph:
        if why_not(graph, node.name) is None:
            cost = sum(flops[n] for n in cone(graph, node.name))
            if cost <= share * total:
                found.append((cost, graph.position[node.name], node.name))
    return [name for _, _, name in sorted(found)]
