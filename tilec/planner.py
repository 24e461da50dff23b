"""Planner: ``plan`` computes every tile's regions, per axis, from a traced graph.

For each segment and each axis, the segment's output is split into owned intervals whose
lengths differ by at most one. Walking the segment's layers from consumers to producers, each
layer's output interval is the union (hull) of what its consumers read; the layer's halo rule
gives the input interval it reads, clipped to the real input. What was clipped is the border
padding the tile applies itself (the layer then runs with padding 0).

Backward regions follow the owned-output strategy the generated code executes: a tile
back-propagates only its owned output gradient, so at every layer the output gradient it
consumes is that layer's forward output interval, and the input gradient it produces is the
interval it read; overlapping input gradients are summed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from math import prod

import networkx as nx

from tilec.cost import ELEMENT_BYTES, SegmentCost, parameter_bytes, segment_cost
from tilec.errors import GridError
from tilec.ir import AxisStep, AxisTile, LayerSpec, ModelFingerprint, Plan, Segment
from tilec.regions import Interval, Window, split
from tilec.trace import layer_specs

#: A segment choice: layers ``[first, stop)``, grid ``(rows, cols)``, optionally a mode.
SegmentChoice = tuple


def fingerprint(layers: Sequence[LayerSpec]) -> ModelFingerprint:
    """Digest of everything a plan depends on about the model."""
    payload = json.dumps([layer.model_dump(mode="json") for layer in layers], sort_keys=True)
    return ModelFingerprint(digest=hashlib.sha256(payload.encode()).hexdigest(), layers=tuple(layers))


def window(spec: LayerSpec, axis: int) -> Window:
    return spec.rows if axis == 0 else spec.cols


def _cone(graph: nx.DiGraph, members: Sequence[int], axis: int, owned: Interval) -> list[AxisStep]:
    """Per-layer steps of one axis tile; ``members`` are the segment's layers in order."""
    needed = {members[-1]: owned}
    steps = {}
    for node in reversed(members):
        spec = graph.nodes[node]["spec"]
        out = needed[node]
        read, before, after = window(spec, axis).read(out, spec.in_shape[2 + axis])
        steps[node] = AxisStep.model_construct(out=out, read=read, pad=(before, after), grad_out=out, grad_in=read)
        for producer in graph.predecessors(node):
            if producer in steps or producer not in members:
                continue
            needed[producer] = needed[producer].hull(read) if producer in needed else read
    return [steps[node] for node in members]


def _signature(steps: Sequence[AxisStep]) -> tuple:
    return tuple((s.out.length, s.read.length, s.pad) for s in steps)


def _axis_tiles(graph: nx.DiGraph, members: Sequence[int], axis: int, parts: int,
                tick: Callable[[], None] | None = None) -> tuple[AxisTile, ...]:
    last = graph.nodes[members[-1]]["spec"]
    size = last.out_shape[2 + axis]
    tiles, classes = [], {}
    for index, owned in enumerate(split(size, parts)):
        steps = _cone(graph, members, axis, owned)
        shape_class = classes.setdefault(_signature(steps), len(classes))
        tiles.append(AxisTile.model_construct(index=index, owned=owned, shape_class=shape_class, steps=tuple(steps)))
        if tick is not None:
            tick()
    return tuple(tiles)


def suffix_tiles(tiles: Sequence[AxisTile], offset: int) -> tuple[AxisTile, ...]:
    """The axis tiles of the segment's last ``len(steps) - offset`` layers.

    Cones are walked from the last layer back, so a shorter segment ending at the same layer
    has exactly the tail of the longer one's steps; only the shape classes are recounted.
    """
    classes: dict[tuple, int] = {}
    return tuple(
        AxisTile.model_construct(index=tile.index, owned=tile.owned, steps=tile.steps[offset:],
                                 shape_class=classes.setdefault(_signature(tile.steps[offset:]), len(classes)))
        for tile in tiles
    )


def check_grid(grid: Sequence[int], out_shape: Sequence[int], where: str) -> tuple[int, int]:
    if not isinstance(grid, list | tuple) or len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid):
        raise GridError(f"grid must be two positive integers ROWSxCOLS, got {grid!r}")
    height, width = out_shape[2], out_shape[3]
    if grid[0] > height or grid[1] > width:
        raise GridError(
            f"grid {grid[0]}x{grid[1]} is finer than the output of {where} ({height}x{width})"
        )
    return (grid[0], grid[1])


def check_segments(segments: Sequence[SegmentChoice], count: int) -> None:
    expected = 0
    for first, stop, *_ in segments:
        if first != expected or stop <= first:
            break
        expected = stop
    if expected != count or any(first >= stop for first, stop, *_ in segments):
        raise GridError(f"segments must cover layers 0..{count - 1} in order; got {list(segments)}")


def _mode(choice: SegmentChoice) -> str:
    """A choice may name its mode; a 1x1 grid defaults to stored (plain autograd, no recompute)."""
    return choice[3] if len(choice) > 3 else ("stored" if tuple(choice[2]) == (1, 1) else "tiled")


def _ticker(progress: Callable[[int, int], None] | None, total: int) -> Callable[[], None] | None:
    if progress is None:
        return None
    done = 0

    def tick() -> None:
        nonlocal done
        done += 1
        progress(done, total)

    return tick


def plan(
    graph: nx.DiGraph,
    *,
    name: str,
    grid: tuple[int, int] | None = None,
    segments: Sequence[SegmentChoice] | None = None,
    dtype: str = "float32",
    memory_budget: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """Plan ``graph`` with one grid for the whole network, or an explicit segmentation.

    A segment choice is ``(first, stop, (rows, cols))`` or ``(first, stop, grid, mode)``.
    ``progress(done, total)`` is called after each axis tile is planned.
    """
    layers = layer_specs(graph)
    if segments is None:
        segments = [(0, len(layers), grid)]
    check_segments(segments, len(layers))
    element = ELEMENT_BYTES[dtype]
    grids = []
    for _, stop, seg_grid, *_ in segments:
        where = f"layer {layers[stop - 1].path}" if len(segments) > 1 else "the network"
        grids.append(check_grid(seg_grid, layers[stop - 1].out_shape, where))
    tick = _ticker(progress, sum(rows + cols for rows, cols in grids))
    tiled = []
    for (first, stop, *_), (rows, cols) in zip(segments, grids, strict=True):
        members = [layer.index for layer in layers[first:stop]]
        tiled.append((_axis_tiles(graph, members, 0, rows, tick), _axis_tiles(graph, members, 1, cols, tick)))
    costs = [
        segment_cost(list(layers[c[0]:c[1]]), rows, cols, stored=_mode(c) == "stored", element=element,
                     first=c[0] == 0)
        for c, (rows, cols) in zip(segments, tiled, strict=True)
    ]
    peaks = step_peaks(costs, parameter_bytes(list(layers), element), prod(layers[-1].out_shape) * element)
    planned = tuple(
        Segment(
            index=index,
            first=choice[0],
            stop=choice[1],
            grid=(len(rows), len(cols)),
            mode=_mode(choice),
            predicted_peak_bytes=peak,
            flop_overhead=round(cost.flop_overhead, 6),
            estimated_seconds=round(cost.seconds, 6),
            rows=rows,
            cols=cols,
        )
        for index, (choice, (rows, cols), cost, peak) in enumerate(zip(segments, tiled, costs, peaks, strict=True))
    )
    return Plan(
        name=name,
        input_shape=graph.graph["input_shape"],
        output_shape=layers[-1].out_shape,
        dtype=dtype,
        memory_budget=memory_budget,
        predicted_peak_bytes=max(peaks),
        model=fingerprint(layers),
        segments=planned,
    )


def step_peaks(costs: Sequence[SegmentCost], parameter_grads: int, output: int) -> list[int]:
    """Predicted step peak while each segment runs (forward or backward), per ``tilec.cost``."""
    peaks, prefix = [], 0
    for index, cost in enumerate(costs):
        held = output if index < len(costs) - 1 else 0
        peaks.append(prefix + max(cost.forward_local, cost.backward_local + parameter_grads + held))
        prefix += cost.kept
    return peaks
