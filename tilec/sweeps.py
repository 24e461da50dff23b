"""Sweeps: the levels of the reductions in a run of nodes that a tiled segment computes.

Inside a tiled segment, every node is one of:

* a *tile* op: it computes an image tile by tile (``Op.check``);
* a *reduction* (``Op.reduces``): a partial per tile over the part of its reduced inputs the tile
  owns, combined across tiles into a small result; a normalisation then computes its image
  output in the tiles from its input and that result;
* a *small* op: no image in or out, computed once per sweep from the results it depends on
  (a squeeze-and-excitation branch, a classifier head, a mask drawn once per step).

A reduction's *level* is one more than the highest level of the results its reduced inputs
depend on in the segment, through tile ops and normalisations (whose image output depends on
their input as well as on their result; segment inputs are level 0); a reduction of nothing (a
Dropout2d mask) is level 0. A small op's level is the highest of its inputs'. Level ``l``'s partials need the
results of the levels below it: the forward runs one sweep per level, then the last one, which
makes the segment's image outputs. See ``tilec.runtime.tiles`` for the backward.
"""

from __future__ import annotations

import weakref

from tilec.graph import Graph
from tilec.ir import Level
from tilec.ops import rule


def role(graph: Graph, name: str) -> str:
    """``"tile"``, ``"reduction"`` or ``"small"`` (module docstring)."""
    node = graph.nodes[name]
    if not graph.sliced_inputs(node) and not graph.is_image(name):
        return "small"
    return "reduction" if rule(node).reduces(node, graph) else "tile"


def batchable(graph: Graph, first: int, stop: int) -> bool:
    """Whether the tiles of nodes ``[first, stop)`` tiled may run several in one call, stacked along
    dim 0 (``tilec.runtime.batches``): its images hold one sample each, and every node computes
    each sample on its own (``Op.batchable``) and reads no absolute position (``Op.positional``)."""
    names = [*(i.name for i in graph.inputs_of(first, stop)), *graph.order[first:stop]]
    if any(graph.shape(name)[0] != 1 for name in names if graph.is_image(name)):
        return False
    return all(rule(node).batchable(node, graph) and not rule(node).positional(node, graph)
               for node in graph.members(first, stop))


def _levels(graph: Graph, first: int, stop: int) -> tuple[Level, ...]:
    depth: dict[str, int] = {}
    reductions: dict[int, list[str]] = {}
    small: dict[int, list[str]] = {}
    direct: dict[int, bool] = {}
    swept: set[int] = set()
    inside = set(graph.order[first:stop])
    for node in graph.members(first, stop):
        kind = role(graph, node.name)
        if kind == "small":
            depth[node.name] = max((depth.get(name, 0) for name in node.inputs), default=0)
            small.setdefault(depth[node.name], []).append(node.name)
            continue
        # tiles compute this node (or its partial, or its image output): they read its small inputs
        swept.update(depth[name] for name in node.inputs if name in inside and not graph.is_image(name))
        if kind == "tile":
            depth[node.name] = max((depth.get(name, 0) for name in node.inputs), default=0)
            continue
        reduced = rule(node).reduced(node, graph)
        level = 1 + max((depth.get(name, 0) for name in reduced), default=-1)
        reductions.setdefault(level, []).append(node.name)
        direct[level] = direct.get(level, True) and bool(reduced) and not set(reduced) & inside
        depth[node.name] = level
        if graph.is_image(node.name):  # a normalisation: its tiles read its result and its input
            swept.add(level)
            depth[node.name] = max(level, *(depth.get(name, 0) for name in node.inputs))
    return tuple(Level(index=level, reductions=tuple(reductions.get(level, ())), small=tuple(small.get(level, ())),
                       direct=level == 1 and direct.get(1, False), swept=level > 0 and level in swept)
                 for level in sorted({*reductions, *small}))


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _once(graph: Graph, key: tuple, compute):
    """``compute()``, computed once per graph and ``key`` (graphs are immutable)."""
    found = _CACHE.setdefault(graph, {})
    if key not in found:
        found[key] = compute()
    return found[key]


def levels(graph: Graph, first: int, stop: int) -> tuple[Level, ...]:
    """The levels of segment ``[first, stop)`` that have a reduction or a small op (module
    docstring), computed once per graph and segment."""
    return _once(graph, ("levels", first, stop), lambda: _levels(graph, first, stop))


def may_roll(graph: Graph, cut: int) -> frozenset[str]:
    """``Graph.may_roll(cut)`` less the tensors a reduction at or after ``cut`` reduces: a direct
    one (``Level.direct``) reads its input after the tiles' backward has run."""
    reduced = {name for node in graph.members(cut, len(graph)) if role(graph, node.name) == "reduction"
               for name in rule(node).reduced(node, graph)}
    return graph.may_roll(cut) - reduced


def prefix_masks(graph: Graph, first: int, stop: int) -> tuple[int, ...]:
    """Per node of segment ``[first, stop)``, in order, a bit mask of the ``levels`` (bit
    ``Level.index``) whose forward sweep computes it: the reductions of the level and what their
    reduced inputs depend on in the segment (once per graph and segment). One pass back from the
    end: a path between two nodes of the segment stays inside it (the order is topological)."""
    return _once(graph, ("prefixes", first, stop), lambda: _prefix_masks(graph, first, stop))


def _prefix_masks(graph: Graph, first: int, stop: int) -> tuple[int, ...]:
    masks: dict[str, int] = {}
    for level in levels(graph, first, stop):
        for name in level.reductions:
            masks[name] = masks.get(name, 0) | 1 << level.index
    for name in reversed(graph.order[first:stop]):
        mask = masks.get(name, 0)
        if mask:
            for source in graph.nodes[name].inputs:
                masks[source] = masks.get(source, 0) | mask
    return tuple(masks.get(name, 0) for name in graph.order[first:stop])


def dependent_masks(graph: Graph, first: int, stop: int) -> tuple[int, ...]:
    """Per node of segment ``[first, stop)``, in order, a bit mask of the ``levels`` whose results
    it depends on in the segment (or is): what a backward sweep of such a level back-propagates
    through (once per graph and segment; one pass in order)."""
    return _once(graph, ("dependents", first, stop), lambda: _dependent_masks(graph, first, stop))


def _dependent_masks(graph: Graph, first: int, stop: int) -> tuple[int, ...]:
    made: dict[str, int] = {}
    for level in levels(graph, first, stop):
        for name in (*level.reductions, *level.small):
            made[name] = made.get(name, 0) | 1 << level.index
    masks: dict[str, int] = {}
    for name in graph.order[first:stop]:
        mask = made.get(name, 0)
        for source in graph.nodes[name].inputs:
            mask |= masks.get(source, 0)
        masks[name] = mask
    return tuple(masks.values())


def owned_sizes(graph: Graph, first: int, stop: int) -> list[tuple[int, int]]:
    """The image sizes of what a tiled segment's tiles partition: its image outputs and the inputs
    its reductions reduce."""
    names = [name for name in graph.outputs_of(first, stop) if graph.is_image(name)]
    for node in graph.members(first, stop):
        if role(graph, node.name) == "reduction":
            names += rule(node).reduced(node, graph)
    return [(graph.size(name, 0), graph.size(name, 1)) for name in dict.fromkeys(names)]
