"""``tilec viz``: a picture of one tile of a tiled segment, at one node and through the whole DAG.

A tile's *share* of a tensor on one axis is its interval of that tensor with the overlap with its
neighbours cut in the middle: the boundary between tiles ``i - 1`` and ``i`` is the midpoint of
where tile ``i - 1``'s interval ends and tile ``i``'s starts (see ``share_bounds``). For a
segment output the shares are the owned parts. The *halo* is the rest of the tile's interval:
what it reads or recomputes of its neighbours' shares.

Panels (rows and columns are the two axes of a tensor's image, intervals half-open):

* regions (top left), in the coordinates of the chosen node's first sliced input: the tensor's
  extent, the tile grid (share boundaries), every tile's slice faintly (grids of up to 1024
  tiles), and for the chosen tile its share, halo, input slice and the border padding it applies
  (for a reduction with a small result, the part of its input its partial covers: no halo);
* halo growth (top right): per node of the segment, the area the tile computes next to the area
  of its share; the gap is the halo, growing towards the segment's inputs;
* the cone (bottom, rows then columns): one line per tensor of the segment (its sliced inputs,
  then its nodes in execution order): the interval the tile computes of it (for an input: reads),
  as a fraction of the tensor's extent so resolutions line up, with its share darker and every
  consumer's read as a thin line below. A tensor read by two consumers (a skip connection) spans
  the hull of their reads.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from tilec.errors import OutputError, TilecError
from tilec.graph import Graph
from tilec.ir import AxisTile, Plan, Segment
from tilec.ops import rule
from tilec.planio import write_files
from tilec.regions import Interval
from tilec.report import node_position

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}

SHARE, HALO, SLICE, PADDING = "#3b75af", "#f5c27a", "#c0392b", "#7f7f7f"

#: Grids with more tiles than this draw only the chosen tile's slice, not every tile's.
MAX_OUTLINED = 1024


def share_bounds(intervals: Sequence[Interval], size: int) -> list[int]:
    """Boundaries (``len(intervals) + 1``) of the tiles' shares of a tensor of ``size`` on one axis.

    ``intervals[i]`` is tile ``i``'s interval of the tensor. Inner boundaries are the midpoints
    (rounded down) of neighbouring tiles' stop and start, clipped to ``[0, size]`` and made
    non-decreasing; the ends are ``0`` and ``size``. Tile ``i``'s share is ``[b[i], b[i + 1])``.
    """
    bounds = [0]
    for before, after in zip(intervals[:-1], intervals[1:], strict=True):
        bounds.append(min(max((before.stop + after.start) // 2, bounds[-1]), size))
    return [*bounds, size]


@dataclass(frozen=True)
class Choice:
    """What to draw: ``tile`` of ``segment`` at the node at ``position`` (its index in the segment: ``step``)."""

    segment: Segment
    position: int
    tile: tuple[int, int]

    @property
    def step(self) -> int:
        return self.position - self.segment.first


def pick(plan: Plan, node: str | None = None, tile: tuple[int, int] | None = None) -> Choice:
    """The node (default: the first of the first tiled segment) and tile (default: the middle one)."""
    if node is None:
        segment = next((s for s in plan.segments if s.mode == "tiled"), None)
        if segment is None:
            raise TilecError("the plan has no tiled segment, so there are no tiles to draw (compile it with a grid "
                             "larger than 1x1)")
        position = segment.first
    else:
        position = node_position(plan, node)
        segment = plan.segment_of(position)
        if segment.mode != "tiled":
            raise TilecError(f"node {node} is in segment {segment.index}, which is stored (runs untiled): there are "
                             f"no tiles to draw; pick a node of a tiled segment (`tilec inspect PLAN --nodes`)")
        if not segment.rows[0].steps[position - segment.first].reads and _partial(segment, node) is None:
            raise TilecError(f"node {node} is a small op of segment {segment.index}, computed once per sweep from its "
                             f"reductions' results: no tile computes a region of it; pick a node the tiles compute "
                             f"(`tilec inspect PLAN --nodes`)")
    if tile is None:
        tile = (segment.grid[0] // 2, segment.grid[1] // 2)
    if not (0 <= tile[0] < segment.grid[0] and 0 <= tile[1] < segment.grid[1]):
        raise TilecError(f"--tile {tile[0]},{tile[1]} is outside segment {segment.index}'s "
                         f"{segment.grid[0]}x{segment.grid[1]} grid")
    return Choice(segment, position, tile)


def _rect(rows, cols, **style) -> Rectangle:
    """A rectangle over half-open ``rows`` x ``cols`` in (x = column, y = row) coordinates."""
    return Rectangle((cols[0], rows[0]), cols[1] - cols[0], rows[1] - rows[0], **style)


def _partial(segment: Segment, name: str) -> int | None:
    """Where node ``name``'s partials are in ``AxisTile.partials``, if it is a reduction of
    ``segment`` whose partials cover part of an input in some tile (``None``: else)."""
    if name not in segment.reductions:
        return None
    k = segment.reductions.index(name)
    return k if any(tile.partials[k].length for tile in segment.rows) else None


def _axis_reads(tiles: Sequence[AxisTile], step: int, partial: int | None) -> list[Interval]:
    """Every tile's first read at ``step``, or its partial's part of the input (``partial``: its index)."""
    return [tile.steps[step].reads[0].read if partial is None else tile.partials[partial] for tile in tiles]


def _regions_panel(axes, plan: Plan, choice: Choice, graph: Graph) -> None:
    segment, (i, j) = choice.segment, choice.tile
    node = plan.model.nodes[choice.position]
    rstep, cstep = segment.rows[i].steps[choice.step], segment.cols[j].steps[choice.step]
    if rstep.reads:
        source, partial, rpad, cpad = rstep.reads[0].input, None, rstep.reads[0].pad, cstep.reads[0].pad
    else:  # a reduction with a small result: what its partial covers, no halo, no padding
        source, partial, rpad, cpad = rule(node).reduced(node, graph)[0], _partial(segment, node.name), (0, 0), (0, 0)
    height, width = graph.size(source, 0), graph.size(source, 1)
    row_reads = _axis_reads(segment.rows, choice.step, partial)
    col_reads = _axis_reads(segment.cols, choice.step, partial)
    row_bounds, col_bounds = share_bounds(row_reads, height), share_bounds(col_reads, width)
    read_rows, read_cols = tuple(row_reads[i]), tuple(col_reads[j])
    padded_rows, padded_cols = (read_rows[0] - rpad[0], read_rows[1] + rpad[1]), (read_cols[0] - cpad[0],
                                                                                  read_cols[1] + cpad[1])
    share_rows = (max(row_bounds[i], read_rows[0]), min(row_bounds[i + 1], read_rows[1]))
    share_cols = (max(col_bounds[j], read_cols[0]), min(col_bounds[j + 1], read_cols[1]))

    axes.add_patch(_rect((0, height), (0, width), facecolor="#f4f4f4", edgecolor="black", linewidth=1.2))
    if segment.grid[0] * segment.grid[1] <= MAX_OUTLINED:
        for rows in row_reads:
            for cols in col_reads:
                axes.add_patch(_rect(tuple(rows), tuple(cols), fill=False, edgecolor=SLICE, alpha=0.18,
                                     linewidth=0.6))
    for bound in row_bounds[1:-1]:
        axes.plot([0, width], [bound, bound], color="#555555", linestyle="--", linewidth=0.8)
    for bound in col_bounds[1:-1]:
        axes.plot([bound, bound], [0, height], color="#555555", linestyle="--", linewidth=0.8)
    if padded_rows != read_rows or padded_cols != read_cols:
        axes.add_patch(_rect(padded_rows, padded_cols, facecolor="white", edgecolor=PADDING, hatch="///",
                             linewidth=0.8))
    axes.add_patch(_rect(read_rows, read_cols, facecolor=HALO, linewidth=0))
    if share_rows[0] < share_rows[1] and share_cols[0] < share_cols[1]:
        axes.add_patch(_rect(share_rows, share_cols, facecolor=SHARE, linewidth=0))
    axes.add_patch(_rect(read_rows, read_cols, fill=False, edgecolor=SLICE, linewidth=2))

    margin_rows = max(1, height // 20, *rpad)
    margin_cols = max(1, width // 20, *cpad)
    axes.set_xlim(-margin_cols, width + margin_cols)
    axes.set_ylim(height + margin_rows, -margin_rows)
    axes.set_aspect("equal")
    axes.set_xlabel("column")
    axes.set_ylabel("row")
    where = f", {node.path}" if node.path else ""
    verb, part = ("reads", "input slice") if partial is None else ("reduces", "partial over")
    axes.set_title(f"node {node.name} (aten.{node.op}{where}) {verb} {source} {height}x{width}: tile {i},{j}\n"
                   f"{part} rows [{read_rows[0]}, {read_rows[1]}) cols [{read_cols[0]}, {read_cols[1]}), "
                   f"pad t/b/l/r {rpad[0]}/{rpad[1]}/{cpad[0]}/{cpad[1]}", fontsize=9)
    axes.legend(
        handles=[
            Patch(facecolor=SHARE, label="tile's own share"),
            Patch(facecolor=HALO, label="halo (read from neighbours)"),
            Patch(fill=False, edgecolor=SLICE, linewidth=2, label="input slice"),
            Patch(facecolor="white", edgecolor=PADDING, hatch="///", label="border padding"),
            Patch(fill=False, edgecolor=SLICE, alpha=0.3, label="other tiles' slices"),
        ],
        loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8, frameon=False,
    )


@dataclass(frozen=True)
class Line:
    """One tensor of the cone on one axis: every tile's interval of it, and the chosen tile's
    consumers' reads of it (``(consumer, read)``)."""

    name: str
    size: int
    intervals: tuple[Interval, ...]
    reads: tuple[tuple[str, Interval], ...]


def cone(plan: Plan, segment: Segment, axis: int, index: int, graph: Graph) -> list[Line]:
    """Axis tile ``index``'s cone: the segment's sliced inputs, then its nodes, in that order."""
    tiles = segment.rows if axis == 0 else segment.cols
    tile = tiles[index]
    reads: dict[str, list[tuple[str, Interval]]] = {}
    for step in tile.steps:
        for read in step.reads:
            reads.setdefault(read.input, []).append((step.node, read.read))
    sliced = [i.name for i in segment.inputs if i.sliced]
    lines = [Line(name, graph.size(name, axis), tuple(t.inputs[k] for t in tiles), tuple(reads.get(name, ())))
             for k, name in enumerate(sliced)]
    for k, node in enumerate(plan.model.nodes[segment.first:segment.stop]):
        size = graph.size(node.name, axis) if graph.spatial(node.name) else 0  # a head's flatten: no image axes
        lines.append(Line(node.name, size, tuple(t.steps[k].out for t in tiles), tuple(reads.get(node.name, ()))))
    return lines


def _bars(spans: list[tuple[float, float]], color: str, zorder: int) -> PolyCollection:
    """Horizontal bars, one per line ``y``: ``(left, width)`` each, 0.55 high, as one artist."""
    boxes = [[(x, y - 0.275), (x + w, y - 0.275), (x + w, y + 0.275), (x, y + 0.275)]
             for y, (x, w) in enumerate(spans)]
    return PolyCollection(boxes, facecolors=color, linewidths=0, zorder=zorder)


def _cone_panel(axes, lines: list[Line], index: int, axis: int, chosen: str) -> None:
    ys = range(len(lines))
    computed, share, reads = [], [], []
    for y, line in enumerate(lines):
        scale = max(line.size, 1)
        bounds = share_bounds(line.intervals, line.size)
        mine = line.intervals[index]
        computed.append((mine.start / scale, mine.length / scale))
        low, high = max(bounds[index], mine.start), min(bounds[index + 1], mine.stop)
        share.append((low / scale, max(high - low, 0) / scale))
        reads += [[(r.start / scale, y + 0.34 + 0.08 * k), (r.stop / scale, y + 0.34 + 0.08 * k)]
                  for k, (_, r) in enumerate(line.reads[:4])]
        if len(lines) <= 48:
            axes.text(1.02, y, f"[{mine.start}, {mine.stop}) of {line.size}", fontsize=6, va="center",
                      transform=axes.get_yaxis_transform())
    axes.add_collection(LineCollection([[(0, y), (1, y)] for y in ys], colors="#dddddd", linewidths=1, zorder=1))
    axes.add_collection(_bars(computed, HALO, 2))
    axes.add_collection(_bars(share, SHARE, 3))
    axes.add_collection(LineCollection(reads, colors=SLICE, linewidths=0.8, zorder=4))
    axes.set_yticks(range(len(lines)))
    fontsize = 7 if len(lines) <= 40 else 4
    axes.set_yticklabels([line.name for line in lines], fontsize=fontsize)
    for label in axes.get_yticklabels():
        if label.get_text() == chosen:
            label.set_fontweight("bold")
            label.set_color(SLICE)
    axes.set_ylim(len(lines) - 0.3, -0.7)
    axes.set_xlim(-0.02, 1.02)
    name = ("rows", "columns")[axis]
    axes.set_xlabel(f"{name}, as a fraction of each tensor's extent")
    axes.set_title(f"cone of the tile through the segment: {name} computed (halo light, share dark; "
                   f"thin: each consumer's read)", fontsize=8)


def _growth_panel(axes, row_lines: list[Line], col_lines: list[Line], choice: Choice, first_node: int) -> None:
    i, j = choice.tile
    xs, computed, share = [], [], []
    for k, (rows, cols) in enumerate(zip(row_lines[first_node:], col_lines[first_node:], strict=True)):
        row_bounds, col_bounds = share_bounds(rows.intervals, rows.size), share_bounds(cols.intervals, cols.size)
        xs.append(k)
        computed.append(rows.intervals[i].length * cols.intervals[j].length)
        share.append((row_bounds[i + 1] - row_bounds[i]) * (col_bounds[j + 1] - col_bounds[j]))
    axes.fill_between(xs, share, computed, color=HALO, alpha=0.6, label="halo (recomputed)")
    axes.plot(xs, computed, marker="o", markersize=3, color=SLICE, label="computed (pixels)")
    axes.plot(xs, share, marker="s", markersize=3, color=SHARE, label="own share")
    axes.axvline(choice.step, color="#999999", linestyle="--", linewidth=0.8)
    axes.set_yscale("log", nonpositive="mask")
    axes.set_xticks(xs)
    labels = [line.name for line in row_lines[first_node:]]
    axes.set_xticklabels(labels, rotation=90, fontsize=7 if len(xs) <= 24 else 4)
    axes.set_xlabel("node (execution order)")
    axes.set_ylabel("area per channel (pixels)")
    segment = choice.segment
    axes.set_title(f"halo growth of tile {i},{j} (segment {segment.index}, grid "
                   f"{segment.grid[0]}x{segment.grid[1]})", fontsize=9)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8)


def draw(plan: Plan, node: str | None = None, tile: tuple[int, int] | None = None) -> Figure:
    """The figure for ``tile`` (default: the middle one) at ``node`` (default: the first tiled node)."""
    choice = pick(plan, node, tile)
    graph = Graph.of_plan(plan)
    segment, (i, j) = choice.segment, choice.tile
    row_lines, col_lines = cone(plan, segment, 0, i, graph), cone(plan, segment, 1, j, graph)
    first_node = len(row_lines) - (segment.stop - segment.first)
    cone_height = max(4.0, 0.16 * len(row_lines))
    figure = Figure(figsize=(15, 6.5 + cone_height), layout="constrained")
    grid = figure.add_gridspec(2, 2, height_ratios=(6.5, cone_height), width_ratios=(1.1, 1))
    chosen = plan.model.nodes[choice.position].name
    _regions_panel(figure.add_subplot(grid[0, 0]), plan, choice, graph)
    _growth_panel(figure.add_subplot(grid[0, 1]), row_lines, col_lines, choice, first_node)
    rows_axes = figure.add_subplot(grid[1, 0])
    _cone_panel(rows_axes, row_lines, i, 0, chosen)
    cols_axes = figure.add_subplot(grid[1, 1], sharey=rows_axes)
    _cone_panel(cols_axes, col_lines, j, 1, chosen)
    cols_axes.tick_params(labelleft=False)
    inputs = ", ".join(f"{spec.name} {'x'.join(map(str, spec.shape))}" for spec in plan.inputs)
    figure.suptitle(f"tilec plan {plan.name}: {inputs}, tile {i},{j} of "
                    f"segment {segment.index} at node {chosen}", fontsize=11)
    return figure


def save(plan: Plan, output: Path, node: str | None = None, tile: tuple[int, int] | None = None) -> Path:
    """Draw and write the figure atomically; the format follows the suffix (.png, .svg, .pdf)."""
    output = Path(output)
    fmt = FORMATS.get(output.suffix.lower())
    if fmt is None:
        raise OutputError(f"cannot write {output}: the picture must end in .png, .svg or .pdf")
    figure = draw(plan, node, tile)
    buffer = io.BytesIO()
    metadata = {"Date": None} if fmt == "svg" else {"Software": None} if fmt == "png" else {"CreationDate": None}
    with matplotlib.rc_context({"svg.hashsalt": "tilec"}):
        figure.savefig(buffer, format=fmt, dpi=110, metadata=metadata)
    write_files({output: buffer.getvalue()})
    return output
