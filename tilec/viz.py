"""``tilec viz``: a picture of one tile's regions at one layer, and of its halo growth.

Left panel, in the coordinates of the chosen layer's INPUT: the tensor's extent, the tile
grid (the owned output boundaries projected back through the layers, see ``share_bounds``),
every tile's input slice outlined lightly, and for the chosen tile its own share of the
input, the halo (the part of its input slice outside its share), the input slice itself,
and the border padding it applies outside the tensor.

Right panel: for each layer of the tile's segment, the area of the tile's input slice next
to its own share of that input and its output: the gap is the halo, growing towards the
first layer.
"""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from tilec.errors import OutputError, TilecError
from tilec.ir import Plan, Segment
from tilec.planio import write_files

FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}

SHARE, HALO, SLICE, PADDING = "#3b75af", "#f5c27a", "#c0392b", "#7f7f7f"


def share_bounds(plan: Plan, segment: Segment, axis: int, layer: int) -> list[int]:
    """Boundaries (``parts + 1`` of them) of the tiles' shares of layer ``layer``'s input.

    The owned output boundaries are mapped back layer by layer through each window's centre
    (``o * stride - pad_before + (span - 1) // 2``), clipped to the tensor; the ends stay at
    ``0`` and the size. Tile ``i``'s share is ``[bounds[i], bounds[i + 1])``.
    """
    tiles = segment.rows if axis == 0 else segment.cols
    inner = [tile.owned.start for tile in tiles[1:]]
    for spec in reversed(plan.model.layers[layer:segment.stop]):
        window = spec.rows if axis == 0 else spec.cols
        size = spec.in_shape[2 + axis]
        inner = [min(max(b * window.stride - window.pad_before + (window.span - 1) // 2, 0), size)
                 for b in inner]
    size = plan.model.layers[layer].in_shape[2 + axis]
    return [0, *inner, size]


def _pick(plan: Plan, layer: int, tile: tuple[int, int] | None) -> tuple[Segment, tuple[int, int]]:
    count = len(plan.model.layers)
    if not 0 <= layer < count:
        raise TilecError(f"--layer {layer} is out of range: the plan has layers 0..{count - 1}")
    segment = plan.segment_of(layer)
    if tile is None:
        tile = (segment.grid[0] // 2, segment.grid[1] // 2)
    if not (0 <= tile[0] < segment.grid[0] and 0 <= tile[1] < segment.grid[1]):
        raise TilecError(f"--tile {tile[0]},{tile[1]} is outside segment {segment.index}'s "
                         f"{segment.grid[0]}x{segment.grid[1]} grid")
    return segment, tile


def _rect(rows, cols, **style) -> Rectangle:
    """A rectangle over half-open ``rows`` x ``cols`` in (x = column, y = row) coordinates."""
    return Rectangle((cols[0], rows[0]), cols[1] - cols[0], rows[1] - rows[0], **style)


def _regions_panel(axes, plan: Plan, segment: Segment, tile: tuple[int, int], layer: int) -> None:
    spec = plan.model.layers[layer]
    position = layer - segment.first
    height, width = spec.in_shape[2], spec.in_shape[3]
    i, j = tile
    row_bounds, col_bounds = share_bounds(plan, segment, 0, layer), share_bounds(plan, segment, 1, layer)
    rstep, cstep = segment.rows[i].steps[position], segment.cols[j].steps[position]
    read_rows, read_cols = tuple(rstep.read), tuple(cstep.read)
    padded_rows = (rstep.read.start - rstep.pad[0], rstep.read.stop + rstep.pad[1])
    padded_cols = (cstep.read.start - cstep.pad[0], cstep.read.stop + cstep.pad[1])
    share_rows = (max(row_bounds[i], read_rows[0]), min(row_bounds[i + 1], read_rows[1]))
    share_cols = (max(col_bounds[j], read_cols[0]), min(col_bounds[j + 1], read_cols[1]))

    axes.add_patch(_rect((0, height), (0, width), facecolor="#f4f4f4", edgecolor="black", linewidth=1.2))
    if segment.grid[0] * segment.grid[1] <= 1024:
        for r in segment.rows:
            for c in segment.cols:
                axes.add_patch(_rect(tuple(r.steps[position].read), tuple(c.steps[position].read),
                                     fill=False, edgecolor=SLICE, alpha=0.18, linewidth=0.6))
    for bound in row_bounds[1:-1]:
        axes.plot([0, width], [bound, bound], color="#555555", linestyle="--", linewidth=0.8)
    for bound in col_bounds[1:-1]:
        axes.plot([bound, bound], [0, height], color="#555555", linestyle="--", linewidth=0.8)
    if padded_rows != read_rows or padded_cols != read_cols:
        axes.add_patch(_rect(padded_rows, padded_cols, facecolor="white", edgecolor=PADDING,
                             hatch="///", linewidth=0.8))
    axes.add_patch(_rect(read_rows, read_cols, facecolor=HALO, linewidth=0))
    if share_rows[0] < share_rows[1] and share_cols[0] < share_cols[1]:
        axes.add_patch(_rect(share_rows, share_cols, facecolor=SHARE, linewidth=0))
    axes.add_patch(_rect(read_rows, read_cols, fill=False, edgecolor=SLICE, linewidth=2))

    margin_rows = max(1, height // 20, rstep.pad[0], rstep.pad[1])
    margin_cols = max(1, width // 20, cstep.pad[0], cstep.pad[1])
    axes.set_xlim(-margin_cols, width + margin_cols)
    axes.set_ylim(height + margin_rows, -margin_rows)
    axes.set_aspect("equal")
    axes.set_xlabel("column (W)")
    axes.set_ylabel("row (H)")
    axes.set_title(f"layer {layer} ({spec.path}, {spec.type}) input {height}x{width}: tile {i},{j}\n"
                   f"input slice rows [{read_rows[0]}, {read_rows[1]}) cols [{read_cols[0]}, {read_cols[1]}), "
                   f"pad t/b/l/r {rstep.pad[0]}/{rstep.pad[1]}/{cstep.pad[0]}/{cstep.pad[1]}", fontsize=9)
    axes.legend(
        handles=[
            Patch(facecolor=SHARE, label="tile's own share"),
            Patch(facecolor=HALO, label="halo (read from neighbours)"),
            Patch(fill=False, edgecolor=SLICE, linewidth=2, label="input slice"),
            Patch(facecolor="white", edgecolor=PADDING, hatch="///", label="border padding"),
            Patch(fill=False, edgecolor=SLICE, alpha=0.3, label="other tiles' slices"),
        ],
        loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8, frameon=False,
    )


def _growth_panel(axes, plan: Plan, segment: Segment, tile: tuple[int, int], layer: int) -> None:
    i, j = tile
    layers = plan.model.layers[segment.first:segment.stop]
    xs, read, share, out = [], [], [], []
    for position, spec in enumerate(layers):
        rstep, cstep = segment.rows[i].steps[position], segment.cols[j].steps[position]
        rows, cols = share_bounds(plan, segment, 0, spec.index), share_bounds(plan, segment, 1, spec.index)
        xs.append(spec.index)
        read.append(rstep.read.length * cstep.read.length)
        share.append((rows[i + 1] - rows[i]) * (cols[j + 1] - cols[j]))
        out.append(rstep.out.length * cstep.out.length)
    axes.fill_between(xs, share, read, color=HALO, alpha=0.6, label="halo")
    axes.plot(xs, read, marker="o", color=SLICE, label="input slice (pixels)")
    axes.plot(xs, share, marker="s", color=SHARE, label="own share of the input")
    axes.plot(xs, out, marker=".", linestyle=":", color="#333333", label="output computed")
    axes.axvline(layer, color="#999999", linestyle="--", linewidth=0.8)
    axes.set_yscale("log")
    axes.set_xticks(xs)
    labels = [f"{spec.index} {spec.type}" for spec in layers]
    axes.set_xticklabels(labels, rotation=90, fontsize=7 if len(xs) <= 24 else 5)
    axes.set_xlabel("layer")
    axes.set_ylabel("area per channel (pixels)")
    axes.set_title(f"halo growth of tile {i},{j} (segment {segment.index}, grid "
                   f"{segment.grid[0]}x{segment.grid[1]})", fontsize=9)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8)


def draw(plan: Plan, layer: int = 0, tile: tuple[int, int] | None = None) -> Figure:
    """The two-panel figure for ``tile`` (default: the middle tile) at ``layer``."""
    segment, tile = _pick(plan, layer, tile)
    figure = Figure(figsize=(13, 6.2), layout="constrained")
    left, right = figure.subplots(1, 2, width_ratios=(1.1, 1))
    _regions_panel(left, plan, segment, tile, layer)
    _growth_panel(right, plan, segment, tile, layer)
    figure.suptitle(f"tilec plan {plan.name}: input {'x'.join(map(str, plan.input_shape))}", fontsize=11)
    return figure


def save(plan: Plan, path: Path, layer: int = 0, tile: tuple[int, int] | None = None) -> Path:
    """Draw and write the figure atomically; the format follows the suffix (.png, .svg, .pdf)."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise OutputError(f"cannot write {path}: the picture must end in .png, .svg or .pdf")
    figure = draw(plan, layer, tile)
    buffer = io.BytesIO()
    metadata = {"Date": None} if fmt == "svg" else {"Software": None} if fmt == "png" else {"CreationDate": None}
    with matplotlib.rc_context({"svg.hashsalt": "tilec"}):
        figure.savefig(buffer, format=fmt, dpi=110, metadata=metadata)
    write_files({path: buffer.getvalue()})
    return path
