"""Planner: ``plan`` computes every tile's regions, per axis, from a traced graph.

Segments are contiguous runs of the node order. For a tiled segment and each axis, every
segment output is split into owned intervals whose lengths differ by at most one (tile ``i``
owns part ``i`` of every output). Walking the segment's nodes from consumers to producers
(reverse execution order), a node's output interval is the hull of what its consumers read
and, for an output, of its owned part. The node's rule (``tilec.ops.RULES``) gives what it
needs of each sliced input; that is clipped to the real input, and what was clipped is the
border padding the tile applies itself (the op then runs without its own padding). What a
segment input must provide is the hull of its readers' reads.

Backward regions follow the owned-output strategy (see ``tilec.ir``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import astuple

import networkx as nx

from tilec.errors import GridError
from tilec.ir import (
    INPUT,
    AxisStep,
    AxisTile,
    ModelFingerprint,
    NodeSpec,
    OutputTree,
    Plan,
    Read,
    Segment,
    SegmentInput,
)
from tilec.ops import KINDS, RULES, Context, is_image
from tilec.regions import Interval, split
from tilec.trace import nodes_in_order

#: A segment choice: positions ``[first, stop)``, grid ``(rows, cols)``, optionally a mode.
SegmentChoice = tuple


def context_of(graph: nx.DiGraph) -> Context:
    nodes = {spec.name: spec for spec in nodes_in_order(graph)}
    return Context(nodes, {t.name: t.shape for t in graph.graph["tensors"]}, graph.graph["input_shape"])


def fingerprint(graph: nx.DiGraph) -> ModelFingerprint:
    """Digest of everything a plan depends on about the model."""
    nodes, tensors, output = nodes_in_order(graph), graph.graph["tensors"], graph.graph["output"]
    payload = json.dumps([[n.model_dump(mode="json") for n in nodes], [t.model_dump(mode="json") for t in tensors],
                          output.model_dump(mode="json")], sort_keys=True)
    return ModelFingerprint(digest=hashlib.sha256(payload.encode()).hexdigest(), tensors=tensors, nodes=nodes,
                            output=output)


def model_outputs(graph: nx.DiGraph) -> list[str]:
    return output_leaves(graph.graph["output"])


def output_leaves(tree: OutputTree) -> list[str]:
    """The node names of an output tree's tensors, in order (with repeats)."""
    leaves, stack = [], [tree]
    while stack:
        tree = stack.pop()
        if tree.kind == "tensor":
            leaves.append(tree.node)
        stack.extend(reversed(tree.items))
    return leaves


class Boundaries:
    """Which tensors enter and leave each run of the node order."""

    def __init__(self, graph: nx.DiGraph):
        self.graph = graph
        self.order = list(graph.graph["order"])
        self.position = {name: index for index, name in enumerate(self.order)}
        self.position[INPUT] = -1
        self.context = context_of(graph)
        ends = {name: max((self.position[c] for c in graph.successors(name)), default=-1) for name in self.order}
        for name in model_outputs(graph):
            ends[name] = len(self.order)
        ends[INPUT] = max((self.position[c] for c in graph.successors(INPUT)), default=-1)
        self.last_use = ends
        #: Per tensor, the position of its first reader (the node count if none).
        self.first_use = {name: min((self.position[c] for c in graph.successors(name)), default=len(self.order))
                          for name in [INPUT, *self.order]}

    def inputs(self, first: int, stop: int) -> tuple[SegmentInput, ...]:
        seen: dict[str, None] = {}
        for name in self.order[first:stop]:
            for producer in self.context.nodes[name].inputs:
                if self.position[producer] < first:
                    seen.setdefault(producer)
        return tuple(SegmentInput(name=name, sliced=is_image(self.context, name)) for name in seen)

    def outputs(self, first: int, stop: int) -> tuple[str, ...]:
        return tuple(name for name in self.order[first:stop] if self.last_use[name] >= stop)

    def crossing(self, cut: int) -> list[str]:
        """Tensors alive across cut ``cut``: produced before it, read at or after it."""
        return [name for name in [INPUT, *self.order[:cut]] if self.last_use[name] >= cut]

    def may_roll(self, cut: int) -> frozenset[str]:
        """The tensors whose gradient the tiled backward of a segment starting at ``cut`` may write
        over the tensor itself, if a tiled segment (which keeps no activations) produced it: image
        tensors crossing ``cut`` that no node before it reads (whose backward runs after this one
        and may read them), neither the model input nor a model output (which the caller holds)."""
        outputs = set(model_outputs(self.graph))
        return frozenset(name for name in self.crossing(cut) if name != INPUT and name not in outputs
                         and self.first_use[name] >= cut and is_image(self.context, name))

    def members(self, first: int, stop: int) -> list[NodeSpec]:
        return [self.context.nodes[name] for name in self.order[first:stop]]

    def tileable(self, first: int, stop: int) -> bool:
        return all(node.tileable for node in self.members(first, stop))


def _cone(bounds: Boundaries, members: Sequence[NodeSpec], inputs: Sequence[SegmentInput], outputs: Sequence[str],
          axis: int, index: int, parts: int) -> AxisTile:
    """One axis tile: owned parts of the outputs, then regions from consumers to producers."""
    context = bounds.context
    owned = tuple(split(context.size(name, axis), parts)[index] for name in outputs)
    region: dict[str, Interval] = dict(zip(outputs, owned, strict=True))
    steps = []
    for node in reversed(members):
        out = region.get(node.name, Interval(0, 0))
        reads = []
        for need in RULES[KINDS[node.op]](node, axis, out, context):
            read, before, after = need.interval.clip(context.size(need.input, axis))
            if out.length == 0:
                read, before, after = Interval(read.start, read.start), 0, 0
            pad = (before, after) if need.pads else (0, 0)
            reads.append(Read.model_construct(input=need.input, read=read, pad=pad, grad=read))
            if read.length:
                known = region.get(need.input)
                region[need.input] = read if known is None or not known.length else known.hull(read)
            else:
                region.setdefault(need.input, read)
        steps.append(AxisStep.model_construct(node=node.name, out=out, grad_out=out, reads=tuple(reads)))
    slices = tuple(region.get(i.name, Interval(0, 0)) for i in inputs if i.sliced)
    return AxisTile.model_construct(index=index, shape_class=0, inputs=slices, owned=owned, steps=tuple(steps[::-1]))


def axis_tiles(bounds: Boundaries, first: int, stop: int, axis: int, parts: int,
               tick: Callable[[], None] | None = None) -> tuple[AxisTile, ...]:
    members = bounds.members(first, stop)
    inputs, outputs = bounds.inputs(first, stop), bounds.outputs(first, stop)
    tiles, classes = [], {}
    for index in range(parts):
        tile = _cone(bounds, members, inputs, outputs, axis, index, parts)
        key = class_key(tile, bounds, inputs, outputs, axis)
        tiles.append(tile.model_copy(update={"shape_class": classes.setdefault(key, len(classes))}))
        if tick is not None:
            tick()
    return tuple(tiles)


def class_key(tile: AxisTile, bounds: Boundaries, inputs: Sequence[SegmentInput], outputs: Sequence[str],
              axis: int) -> tuple:
    """What generated code depends on: every length, pad and offset relative to the producer's
    region, the owned parts' offsets, plus per-op extras (``tilec.local.extras``)."""
    from tilec.local import extras

    base = {i.name: interval for i, interval in zip([i for i in inputs if i.sliced], tile.inputs, strict=True)}
    parts: list = [tuple(i.length for i in tile.inputs)]
    for step in tile.steps:
        node = bounds.context.nodes[step.node]
        reads = tuple((r.read.start - base[r.input].start, r.read.length, r.pad) for r in step.reads)
        parts.append((step.out.length, reads, extras(node, step, bounds.context, axis)))
        base[step.node] = step.out
    parts.append(tuple((o.start - base[name].start, o.length) for name, o in zip(outputs, tile.owned, strict=True)))
    return tuple(parts)


def check_grid(grid: Sequence[int], sizes: Sequence[tuple[int, int]], where: str) -> tuple[int, int]:
    if not isinstance(grid, list | tuple) or len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid):
        raise GridError(f"grid must be two positive integers ROWSxCOLS, got {grid!r}")
    height, width = min(s[0] for s in sizes), min(s[1] for s in sizes)
    if grid[0] > height or grid[1] > width:
        raise GridError(f"grid {grid[0]}x{grid[1]} is finer than the output of {where} ({height}x{width})")
    return (grid[0], grid[1])


def check_segments(segments: Sequence[SegmentChoice], count: int) -> None:
    expected = 0
    for first, stop, *_ in segments:
        if first != expected or stop <= first:
            break
        expected = stop
    if expected != count or any(first >= stop for first, stop, *_ in segments):
        raise GridError(f"segments must cover nodes 0..{count - 1} in order; got {list(segments)}")


def output_sizes(bounds: Boundaries, first: int, stop: int) -> list[tuple[int, int]]:
    return [(bounds.context.size(name, 0), bounds.context.size(name, 1)) for name in bounds.outputs(first, stop)]


def default_segments(bounds: Boundaries, grid: tuple[int, int]) -> list[SegmentChoice]:
    """One grid for the network: maximal runs of tileable nodes are tiled with ``grid`` (clipped
    to their outputs' sizes), the rest (heads, global pooling, SE branches) run stored."""
    runs, start = [], 0
    for index in range(1, len(bounds.order) + 1):
        if index == len(bounds.order) or (bounds.context.nodes[bounds.order[index]].tileable
                                          != bounds.context.nodes[bounds.order[start]].tileable):
            runs.append((start, index))
            start = index
    choices = []
    for first, stop in runs:
        if not bounds.tileable(first, stop) or tuple(grid) == (1, 1):
            choices.append((first, stop, (1, 1), "stored"))
            continue
        sizes = output_sizes(bounds, first, stop)
        choices.append((first, stop, (min(grid[0], *(s[0] for s in sizes)), min(grid[1], *(s[1] for s in sizes))),
                        "tiled"))
    return choices


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


def _checked(bounds: Boundaries, choice: SegmentChoice) -> tuple[int, int, tuple[int, int], str]:
    first, stop, grid = choice[0], choice[1], choice[2]
    mode = _mode(choice)
    where = f"nodes {first}:{stop}"
    if mode == "tiled":
        blocker = next((n for n in bounds.members(first, stop) if not n.tileable), None)
        if blocker is not None:
            raise GridError(f"segment {where} cannot be tiled: node {blocker.name} (aten.{blocker.op}"
                            f"{' in ' + blocker.path if blocker.path else ''}) reads the whole map or no image; "
                            f"give that segment grid 1x1")
        grid = check_grid(grid, output_sizes(bounds, first, stop), f"segment {where}")
    return first, stop, (1, 1) if mode == "stored" else grid, mode


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
    """Plan ``graph`` with one grid for the network, or an explicit segmentation.

    A segment choice is ``(first, stop, (rows, cols))`` or ``(first, stop, grid, mode)`` over
    positions in the node order. ``progress(done, total)`` is called after each axis tile.
    """
    from tilec.cost import Estimator

    bounds = Boundaries(graph)
    if segments is None:
        if grid is not None:
            check_grid(grid, [(10**12, 10**12)], "the network")
        segments = default_segments(bounds, tuple(grid))
    check_segments(segments, len(bounds.order))
    choices = [_checked(bounds, choice) for choice in segments]
    tick = _ticker(progress, sum(g[0] + g[1] for _, _, g, mode in choices if mode == "tiled"))
    estimator = Estimator(bounds, dtype)
    planned = []
    for index, (first, stop, seg_grid, mode) in enumerate(choices):
        rows = cols = ()
        if mode == "tiled":
            rows = axis_tiles(bounds, first, stop, 0, seg_grid[0], tick)
            cols = axis_tiles(bounds, first, stop, 1, seg_grid[1], tick)
        planned.append(Segment(
            index=index, first=first, stop=stop, grid=seg_grid, mode=mode, inputs=bounds.inputs(first, stop),
            outputs=bounds.outputs(first, stop), predicted_peak_bytes=0, flop_overhead=0.0, estimated_seconds=0.0,
            rows=rows, cols=cols,
        ))
    costs = [estimator.segment(s.first, s.stop, s.rows, s.cols, s.mode == "stored") for s in planned]
    spans = [(s.first, s.stop, s.mode) for s in planned]
    rolls = [cost.rolled(estimator.made_tiled(s.first, spans)) for s, cost in zip(planned, costs, strict=True)]
    peaks = estimator.step_peaks(costs, rolls)
    planned = [
        s.model_copy(update={"predicted_peak_bytes": peak, "flop_overhead": round(cost.flop_overhead, 6),
                             "estimated_seconds": round(cost.seconds, 6),
                             "rolled": tuple(i.name for i in s.inputs if i.name in names)})
        for s, cost, peak, names in zip(planned, costs, peaks, rolls, strict=True)
    ]
    return Plan(
        name=name,
        input_shape=graph.graph["input_shape"],
        dtype=dtype,
        autocast=graph.graph.get("autocast"),
        conv_workspace=graph.graph.get("conv_workspace"),
        speed=astuple(graph.graph["speed"]) if "speed" in graph.graph else None,
        gemm_min_channels=estimator.gemm_min_channels,
        kernel_state=estimator.kernel_state,
        memory_budget=memory_budget,
        predicted_peak_bytes=max(peaks),
        kernel_state_bytes=sum(cost.kernels for cost in costs),
        model=fingerprint(graph),
        segments=tuple(planned),
    )
