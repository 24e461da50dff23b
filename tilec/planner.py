"""Planner: ``plan`` computes every tile's regions, per axis, from a traced graph.

Segments are contiguous runs of the node order, each ``stored`` (untiled through autograd) or
``tiled`` with a grid. For a tiled segment and each axis, its cone (``tilec.cone``) gives every
tile's output interval, reads and border padding per node; tiles whose generated code would be
the same share a *shape class* (``class_key``). The cost model (``tilec.cost``) predicts each
segment's peak, time and FLOP overhead. Backward regions follow the owned-output strategy
(``tilec.ir``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import astuple
from typing import NamedTuple

from tilec.cone import axis_tiles
from tilec.cost.background import Background
from tilec.cost.estimator import Estimator
from tilec.errors import GridError
from tilec.graph import Graph
from tilec.ir import MAX_COUNT, AxisTile, Plan, Segment, SegmentInput, is_int
from tilec.ops import rule
from tilec.regions import Period, parts_of
from tilec.sweeps import batchable, levels, owned_sizes, role
from tilec.target import REFERENCE, Target


class SegmentChoice(NamedTuple):
    """A segment: node positions ``[first, stop)``, its grid ``(rows, cols)`` (numbers of tiles, or
    a ``tilec.regions.Period`` each), mode (``None``: stored for a 1x1 grid, else tiled) and how
    many tiles of one shape class run as one call (``batch``, ``Segment.batch``)."""

    first: int
    stop: int
    grid: tuple[int, int] | tuple[Period, Period]
    mode: str | None = None
    batch: int = 1

    @property
    def chosen_mode(self) -> str:
        return self.mode or ("stored" if tuple(self.grid) == (1, 1) else "tiled")

    @property
    def period(self) -> tuple[int, int] | None:
        """The tiles' length in input pixels where the grid is a ``Period`` each (``Segment.period``)."""
        return tuple(g.pixels for g in self.grid) if all(isinstance(g, Period) for g in self.grid) else None


def periods_on(graph: Graph, pixels: Sequence[int], where: str) -> tuple[Period, Period]:
    """Tiles ``pixels`` (rows, columns) long in the model's first image input, as ``Period`` s."""
    image = graph.image_size()
    if image is None:
        raise GridError(f"{where} cannot be tiled in input pixels: the model has no image input")
    return tuple(Period(length, full) for length, full in zip(pixels, image, strict=False))


def misfit(periods: Sequence[Period], sizes: Sequence[tuple[int, int]]) -> tuple[Period, int] | None:
    """The first period and size of ``sizes`` (rows, columns each) it does not tile
    (``Period.length``); ``None`` where the periods tile them all."""
    return next(((period, size[axis]) for size in sizes for axis, period in enumerate(periods)
                 if period.length(size[axis]) is None), None)


def class_key(tile: AxisTile, graph: Graph, inputs: Sequence[SegmentInput], outputs: Sequence[str],
              axis: int, reductions: Sequence[str] = ()) -> tuple:
    """What generated code depends on: every length, pad and offset relative to the producer's
    region, the owned parts' and the partials' offsets (``reductions``: the segment's, in
    ``AxisTile.partials`` order), plus per-op extras (``Op.extras``)."""
    base = {i.name: interval for i, interval in zip([i for i in inputs if i.sliced], tile.inputs, strict=True)}
    parts: list = [tuple(i.length for i in tile.inputs)]
    for step in tile.steps:
        node = graph.nodes[step.node]
        reads = tuple((r.read.start - base[r.input].start, r.read.length, r.pad) for r in step.reads)
        extras = rule(node).extras(node, step, axis, graph) if step.out.length else None
        parts.append((step.out.length, reads, extras))
        base[step.node] = step.out
    images = [name for name in outputs if graph.is_image(name)]
    parts.append(tuple((o.start - base[name].start, o.length) for name, o in zip(images, tile.owned, strict=True)))
    for name, owned in zip(reductions, tile.partials, strict=True):
        node = graph.nodes[name]
        parts.append(tuple((owned.start - base[i].start, owned.length) for i in rule(node).reduced(node, graph)))
    return tuple(parts)


def classified(graph: Graph, first: int, stop: int, axis: int, parts: int | Period) -> tuple[AxisTile, ...]:
    """The axis tiles of segment ``[first, stop)``, numbered by shape class in order of first appearance."""
    inputs, outputs = graph.inputs_of(first, stop), graph.outputs_of(first, stop)
    reductions = [name for level in levels(graph, first, stop) for name in level.reductions]
    classes: dict[tuple, int] = {}
    return tuple(tile.model_copy(update={"shape_class": classes.setdefault(
        class_key(tile, graph, inputs, outputs, axis, reductions), len(classes))})
        for tile in axis_tiles(graph, first, stop, axis, parts))


def aligned_segments(estimator: Estimator, segments: Sequence[Segment]) -> list[bool]:
    """Per segment, whether it is tiled with the ``Estimator.period`` of every later tiled segment
    (``Estimator.tiled``'s ``aligned``)."""
    periods = [estimator.period(s.rows, s.cols) if s.mode == "tiled" else None for s in segments]
    return [period is not None and all(later == period for later, s in zip(periods[k:], segments[k:], strict=True)
                                       if s.mode == "tiled")
            for k, period in enumerate(periods)]


def check_grid(grid: Sequence[int | Period], sizes: Sequence[tuple[int, int]], where: str) -> tuple:
    """``grid`` (two numbers of tiles, or two ``Period`` s) checked against the sizes a segment's
    tiles partition."""
    if isinstance(grid, tuple) and len(grid) == 2 and all(isinstance(g, Period) for g in grid):
        if any(not isinstance(g.pixels, int) or g.pixels < 1 for g in grid):
            raise GridError(f"tiles of one period must be a positive number of pixels, got {grid!r}")
        found = misfit(grid, sizes)
        if found is not None:
            period, size = found
            raise GridError(f"{where} cannot be tiled every {period.pixels} input pixels: a size it partitions "
                            f"({size}) is not the input's ({period.full}) at a stride dividing it")
        return grid
    _check_counts(grid)
    height, width = min(s[0] for s in sizes), min(s[1] for s in sizes)
    if grid[0] > height or grid[1] > width:
        raise GridError(f"grid {grid[0]}x{grid[1]} is finer than the output of {where} ({height}x{width})")
    return (grid[0], grid[1])


def _check_counts(grid) -> None:
    if not isinstance(grid, list | tuple) or len(grid) != 2 or any(not is_int(g) or g < 1 for g in grid):
        raise GridError(f"grid must be two positive integers ROWSxCOLS, got {grid!r}")


def _check_network_grid(grid) -> None:
    """A grid for the whole network: two positive integers up to ``MAX_COUNT`` (each segment clips
    it to what its tiles partition, ``default_segments``)."""
    _check_counts(grid)
    if max(grid) > MAX_COUNT:
        raise GridError(f"grid {grid[0]}x{grid[1]} has more than {MAX_COUNT} tiles a side")


def check_segments(segments: Sequence[tuple], graph: Graph) -> None:
    """Segments cover the node order in order, and none ends between a node returning several
    tensors and a getitem taking one of them, or between a buffer's reader and a write into it
    (``Graph.ties``)."""
    expected, count = 0, len(graph)
    for first, stop, *_ in segments:
        if first != expected or stop <= first:
            break
        expected = stop
    if expected != count or any(first >= stop for first, stop, *_ in segments):
        raise GridError(f"segments must cover nodes 0..{count - 1} in order; got {list(segments)}")
    for first, stop, *_ in segments[:-1]:
        if (parting := graph.parting(stop)) is not None:
            source, reader = graph.ties[stop]
            raise GridError(f"segment nodes {first}:{stop} ends {parting}: segments may end at "
                            f"{graph.position[source]} or before, or at {graph.position[reader] + 1} or after")


def _runs(graph: Graph) -> list[tuple[int, int]]:
    """Maximal runs of tileable nodes and of the others, each tileable one cut further before any
    reduction whose level in it would be 2 or more (its input is then kept, and the reduction reads
    it directly: ``tilec.sweeps``); never cut between a node returning several tensors and a getitem
    taking one of them (``Graph.ties``: a run holding both kinds of node is stored)."""
    runs, start = [], 0
    for index in range(1, len(graph) + 1):
        node = graph.nodes[graph.order[index]] if index < len(graph) else None
        if node is not None and index in graph.ties:
            continue
        if node is None or node.tileable != graph.nodes[graph.order[start]].tileable:
            runs.append((start, index))
            start = index
        elif node.tileable and role(graph, node.name) == "reduction" and any(
                level.index >= 2 and node.name in level.reductions for level in levels(graph, start, index + 1)):
            runs.append((start, index))
            start = index
    return runs


def default_segments(graph: Graph, grid: tuple[int, int]) -> list[SegmentChoice]:
    """One grid for the network: runs of tileable nodes (``_runs``) are tiled with ``grid`` (clipped
    to what their tiles partition, ``owned_sizes``), the rest run stored, as do runs whose tiles
    would partition nothing."""
    choices = []
    for first, stop in _runs(graph):
        sizes = owned_sizes(graph, first, stop)
        if not graph.tileable(first, stop) or tuple(grid) == (1, 1) or not sizes:
            choices.append(SegmentChoice(first, stop, (1, 1), "stored"))
            continue
        clipped = (min(grid[0], *(s[0] for s in sizes)), min(grid[1], *(s[1] for s in sizes)))
        choices.append(SegmentChoice(first, stop, clipped, "tiled"))
    return choices


def _checked(graph: Graph, choice: SegmentChoice, batch: int | None) -> SegmentChoice:
    """``choice`` checked, its batch ``batch`` where given (only a tiled segment whose tiles may run
    stacked, ``tilec.sweeps.batchable``, runs more than one tile per call)."""
    first, stop, grid, mode = choice.first, choice.stop, choice.grid, choice.chosen_mode
    batch = choice.batch if batch is None else batch
    if not is_int(batch) or not 1 <= batch <= MAX_COUNT:
        raise GridError(f"batch must be a positive number of tiles up to {MAX_COUNT}, got {batch!r}")
    where = f"nodes {first}:{stop}"
    if mode == "tiled":
        blocker = next((n for n in graph.members(first, stop) if not n.tileable), None)
        if blocker is not None:
            raise GridError(f"segment {where} cannot be tiled: node {blocker.name} (aten.{blocker.op}"
                            f"{' in ' + blocker.path if blocker.path else ''}) cannot run in a tiled segment; "
                            f"give that segment grid 1x1")
        sizes = owned_sizes(graph, first, stop)
        if not sizes:
            raise GridError(f"segment {where} cannot be tiled: it makes no image and reduces none; give it grid 1x1")
        if choice.period is not None:
            grid = periods_on(graph, choice.period, f"segment {where}")
        grid = check_grid(grid, sizes, f"segment {where}")
    if mode == "stored" or not batchable(graph, first, stop):
        batch = 1
    return SegmentChoice(first, stop, (1, 1) if mode == "stored" else grid, mode, batch)


def plan(
    graph: Graph,
    target: Target = REFERENCE,
    *,
    name: str,
    grid: tuple[int, int] | None = None,
    segments: Sequence[tuple] | None = None,
    dtype: str = "float32",
    memory_budget: int | None = None,
    batch: int | None = None,
    backgrounds: Mapping[str, Background] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Plan:
    """Plan ``graph`` for ``target`` (default: nothing measured) with one grid for the network, or
    an explicit segmentation.

    A segment is a ``SegmentChoice`` or a tuple ``(first, stop, (rows, cols)[, mode[, batch]])``
    over positions in the node order. ``batch``: tiles of one shape class per call in every tiled
    segment whose tiles may run stacked (else the segments' own, 1 by default). ``backgrounds``:
    per model input, where it is known to be background (``tilec.cost.background``): the estimate
    counts the tiles computed once. ``progress(done, total)`` is called after each axis of each
    tiled segment is planned.
    """
    segments_given = segments
    if segments is None:
        if grid is not None:
            _check_network_grid(grid)
        segments = default_segments(graph, tuple(grid))
    check_segments(segments, graph)
    choices = [_checked(graph, SegmentChoice(*choice), batch) for choice in segments]
    total, done = 2 * sum(choice.mode == "tiled" for choice in choices), 0
    estimator = Estimator(graph, target, dtype, backgrounds)
    planned = []
    for index, (first, stop, seg_grid, mode, seg_batch) in enumerate(choices):
        rows = cols = ()
        if mode == "tiled":
            axes = []
            for axis in range(2):
                axes.append(classified(graph, first, stop, axis, seg_grid[axis]))
                done += 1
                if progress is not None:
                    progress(done, total)
            rows, cols = axes
        planned.append(Segment(
            index=index, first=first, stop=stop, grid=tuple(parts_of(g) for g in seg_grid), mode=mode,
            inputs=graph.inputs_of(first, stop),
            outputs=graph.outputs_of(first, stop), predicted_peak_bytes=0, flop_overhead=0.0, estimated_seconds=0.0,
            rows=rows, cols=cols, levels=levels(graph, first, stop) if mode == "tiled" else (), batch=seg_batch,
            period=choices[index].period,
        ))
    costs = [estimator.segment(s.first, s.stop, s.rows, s.cols, s.mode == "stored", s.batch, aligned)
             for s, aligned in zip(planned, aligned_segments(estimator, planned), strict=True)]
    rolls = [cost.rolled(estimator.made_tiled(s.first, planned)) for s, cost in zip(planned, costs, strict=True)]
    peaks = estimator.step_peaks(costs, rolls)
    planned = [
        s.model_copy(update={"predicted_peak_bytes": peak, "flop_overhead": round(cost.flop_overhead, 6),
                             "estimated_seconds": round(cost.seconds, 6), "reused": cost.reused,
                             "rolled": tuple(i.name for i in s.inputs if i.name in names)})
        for s, cost, peak, names in zip(planned, costs, peaks, rolls, strict=True)
    ]
    return Plan(
        name=name,
        inputs=graph.inputs,
        dtype=dtype,
        autocast=graph.autocast,
        conv_workspace=target.conv_workspace,
        speed=astuple(target.speed)[:3] if target.speed is not None else None,
        rates=target.speed.rates if target.speed is not None else (),
        gemm_min_channels=target.gemm_min_channels,
        kernel_state=target.kernel_state,
        memory_budget=memory_budget,
        grid=tuple(grid) if grid is not None and segments_given is None else None,
        predicted_peak_bytes=max(peaks),
        kernel_state_bytes=sum(cost.kernels for cost in costs),
        staging_bytes=max(cost.staging for cost in costs),
        model=graph.fingerprint(),
        segments=tuple(planned),
        mode=graph.mode,
        flipped=graph.flipped,
        backgrounds=tuple(name for name in graph.input_names if name in (backgrounds or {})),
    )
