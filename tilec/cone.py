"""Cones: every tile's regions through a run of nodes, per axis, all tiles at once.

For a tiled run ``[low, stop)`` of the execution order and one axis, every output of the run is
split into owned intervals (``tilec.regions.partition``), one per tile. Walking the run's nodes from
consumers to producers (reverse execution order), a node's output interval is the hull of what
its consumers read and, for an output, of its owned part. The node's rule (``tilec.ops``) gives
what it needs of each sliced input; that is clipped to the real input, and what was clipped is
the border padding the tile applies itself where the rule says so (the op then runs without its
own padding). An empty output interval reads nothing. A tensor read by several consumers gets
the hull of their non-empty reads (the first empty read where all are empty). A reduction's partial
covers the tile's owned part of its reduced inputs; a positional reduction of nothing's (element-wise
dropout) is its own output interval.

``cone`` computes this for the tiles of several grids at once, as arrays of interval bounds:
the budget search evaluates every grid of a run in one pass, and the planner one grid
(``axis_tiles``, which makes the plan's ``AxisTile`` s). A shorter run ending at ``stop`` has the
tail of a longer one's steps: a node's region depends only on its readers, all after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from tilec.graph import Graph
from tilec.ir import AxisStep, AxisTile, Read
from tilec.ops import Need, rule
from tilec.regions import Interval, Period, partition, parts_of
from tilec.sweeps import levels, role

Bounds = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Step:
    """One node of the cone: its output interval per tile, per read ``(input, start, stop,
    pad before, pad after)``, and for a reduction the interval of its reduced inputs the tile owns
    (``owned``: ``(start, stop)``; ``None`` for other nodes), each an array over the tiles."""

    node: str
    start: np.ndarray
    stop: np.ndarray
    reads: tuple[tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray], ...]
    owned: Bounds | None = None


@dataclass(frozen=True)
class Cone:
    """The cone of run ``[low, stop)`` on one axis over ``tiles`` tiles (those of ``grids``
    concatenated): ``owned`` per output, ``steps`` in execution order, and ``regions``, the hull
    of the reads of every tensor the run reads (its own nodes' and its inputs')."""

    low: int
    stop: int
    tiles: int
    owned: dict[str, Bounds]
    steps: tuple[Step, ...]
    regions: dict[str, Bounds]


def _needs(node, axis: int, start: np.ndarray, stop: np.ndarray, graph: Graph) -> list[Need]:
    """The node's rule for every tile: on arrays at once where the rule allows it. A small op reads
    nothing in the tiles; a reduction reads its input where its image output is (a normalisation)."""
    kind = role(graph, node.name)
    if kind == "small":
        return []
    if kind == "reduction":
        return [Need(name, Interval(start, stop), False) for name in graph.sliced_inputs(node)
                if graph.is_image(node.name)]
    op = rule(node)
    if op.vectorised:
        return op.need(node, axis, Interval(start, stop), graph)
    per_tile = [op.need(node, axis, Interval(int(a), int(b)), graph) for a, b in zip(start, stop, strict=True)]
    return [Need(need.input, Interval(np.array([t[k].interval.start for t in per_tile]),
                                      np.array([t[k].interval.stop for t in per_tile])), need.pads)
            for k, need in enumerate(per_tile[0])]


def _merged(known: Bounds | None, start: np.ndarray, stop: np.ndarray) -> Bounds:
    """A tensor's region after one more read: the hull of the non-empty reads, per tile."""
    if known is None:
        return start, stop
    known_start, known_stop = known
    full, known_full = stop > start, known_stop > known_start
    hull_start = np.where(known_full, np.minimum(known_start, start), start)
    hull_stop = np.where(known_full, np.maximum(known_stop, stop), stop)
    return np.where(full, hull_start, known_start), np.where(full, hull_stop, known_stop)


@lru_cache(maxsize=256)
def _split(size: int, grids: tuple[int | Period, ...]) -> Bounds:
    """``partition(size, grid)`` for each grid in ``grids``, concatenated, as read-only arrays
    (kept: the tensors of a network share a few sizes)."""
    intervals = [interval for grid in grids for interval in partition(size, grid)]
    bounds = (np.array([i.start for i in intervals], dtype=np.int64), np.array([i.stop for i in intervals],
                                                                                dtype=np.int64))
    for array in bounds:
        array.flags.writeable = False
    return bounds


def cone(graph: Graph, low: int, stop: int, axis: int, grids: Sequence[int | Period]) -> Cone:
    """The cone of run ``[low, stop)`` on ``axis`` for each grid in ``grids`` (a number of tiles or
    a ``Period``)."""
    grids = tuple(grids)
    tiles = sum(parts_of(grid) for grid in grids)
    owned = {name: _split(graph.size(name, axis), grids) for name in graph.outputs_of(low, stop)
             if graph.is_image(name)}
    region: dict[str, Bounds] = dict(owned)
    empty = np.zeros(tiles, dtype=np.int64)
    steps = []
    for node in reversed(graph.members(low, stop)):
        start, stop_ = region.get(node.name, (empty, empty))
        none = stop_ == start
        reads = []
        for need in _needs(node, axis, start, stop_, graph):
            size = graph.size(need.input, axis)
            lo, hi = (bound if np.ndim(bound) else np.full(tiles, bound) for bound in need.interval)
            read_start = np.minimum(np.maximum(lo, 0), size)
            read_stop = np.where(none, read_start, np.maximum(np.maximum(np.minimum(hi, size), 0), read_start))
            if need.pads:
                before = np.where(none, 0, np.maximum(0, np.minimum(hi, 0) - lo))
                after = np.where(none, 0, np.maximum(0, hi - np.maximum(lo, size)))
            else:
                before = after = empty
            reads.append((need.input, read_start, read_stop, before, after))
            region[need.input] = _merged(region.get(need.input), read_start, read_stop)
        partial = None
        if role(graph, node.name) == "reduction" and (reduced := rule(node).reduced(node, graph)):
            partial = _split(graph.size(reduced[0], axis), grids)
            for name in reduced:
                region[name] = _merged(region.get(name), *partial)
        elif role(graph, node.name) == "reduction" and rule(node).positional(node, graph):
            partial = start, stop_
        steps.append(Step(node.name, start, stop_, tuple(reads), partial))
    return Cone(low, stop, tiles, owned, tuple(steps[::-1]), region)


def axis_tiles(graph: Graph, first: int, stop: int, axis: int, parts: int | Period) -> tuple[AxisTile, ...]:
    """The axis tiles of segment ``[first, stop)`` split by ``parts`` along ``axis`` (shape class 0)."""
    found = cone(graph, first, stop, axis, [parts])
    inputs = [i.name for i in graph.inputs_of(first, stop) if i.sliced]
    outputs = graph.outputs_of(first, stop)
    columns = {name: (bounds[0].tolist(), bounds[1].tolist()) for name, bounds in found.regions.items()}
    steps = [(step.node, step.start.tolist(), step.stop.tolist(),
              [(read[0], *(bound.tolist() for bound in read[1:])) for read in step.reads]) for step in found.steps]
    owned = [(found.owned[name][0].tolist(), found.owned[name][1].tolist()) for name in outputs if name in found.owned]
    partials = {step.node: (step.owned[0].tolist(), step.owned[1].tolist()) for step in found.steps
                if step.owned is not None}
    order = [name for level in levels(graph, first, stop) for name in level.reductions]
    tiles = []
    for t in range(found.tiles):
        tile_steps = []
        for name, start, stop_, reads in steps:
            out = Interval(start[t], stop_[t])
            tile_reads = tuple(Read.model_construct(input=source, read=Interval(a[t], b[t]), pad=(before[t], after[t]),
                                                    grad=Interval(a[t], b[t]))
                               for source, a, b, before, after in reads)
            tile_steps.append(AxisStep.model_construct(node=name, out=out, grad_out=out, reads=tile_reads))
        slices = tuple(Interval(columns[name][0][t], columns[name][1][t]) if name in columns else Interval(0, 0)
                       for name in inputs)
        tiles.append(AxisTile.model_construct(
            index=t, shape_class=0, inputs=slices, owned=tuple(Interval(a[t], b[t]) for a, b in owned),
            steps=tuple(tile_steps), partials=tuple(Interval(partials[name][0][t], partials[name][1][t])
                                                    if name in partials else Interval(0, 0) for name in order)))
    return tuple(tiles)

