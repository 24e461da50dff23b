"""Codegen: ``render`` turns a plan into the source of a standalone tiled-training module.

Python prepares a small view model here (names, literal arguments, which tensors die when);
the jinja2 templates in ``templates/`` only loop and branch over it. One forward and one
backward function are generated per segment and shape class (a pair of row and column
classes), never per tile; per-tile data is a table of slice bounds.

The names inside generated functions come from ``tilec.schedule``; ``g`` is the running
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import jinja2

from tilec import __version__
from tilec.ir import AxisTile, LayerSpec, Plan, Segment
from tilec.regions import Interval
from tilec.schedule import Op, schedule


@dataclass
class Step(Op):
    """A scheduled op plus the literal Python its template needs."""

    pad: str | None = None
    unpad: str | None = None
    pad_value: str = "0.0"
    args: dict[str, str] = field(default_factory=dict)
    slots: dict[str, int] = field(default_factory=dict)
    empty_out: str = ""
    empty_grad: str = ""


@dataclass
class ShapeClass:
    row: int
    col: int
    in_hw: tuple[int, int]
    out_hw: tuple[int, int]
    steps: list[Step]


@dataclass
class SegmentView:
    segment: Segment
    tensors: list[tuple[int, str]]
    rows: str
    cols: str
    gaps: str
    out_channels: int
    classes: list[ShapeClass]


@dataclass
class LayerRow:
    """Literal Python for one layer's entry in the generated ``LAYERS`` table."""

    path: str
    type: str
    attrs: str
    tensors: str


def _layer_row(layer: LayerSpec) -> LayerRow:
    tensors = {tensor.name.rsplit(".", 1)[1]: tuple(tensor.shape) for tensor in layer.tensors}
    return LayerRow(repr(layer.path), repr(layer.type), repr(dict(layer.attrs)), repr(tensors))


def _tuple(values) -> str:
    values = tuple(values)
    return repr(values)


def _args(layer: LayerSpec, rows: AxisTile, cols: AxisTile, position: int) -> dict[str, str]:
    r, c = layer.rows, layer.cols
    options = layer.options
    if layer.op == "conv2d":
        return {
            "stride": _tuple((r.stride, c.stride)),
            "dilation": _tuple((r.dilation, c.dilation)),
            "groups": repr(options["groups"]),
            "bias_sizes": f"[{layer.out_shape[1]}]" if options["bias"] else "None",
        }
    if layer.op in ("max_pool2d", "avg_pool2d"):
        args = {
            "kernel": _tuple((r.kernel, c.kernel)),
            "stride": _tuple((r.stride, c.stride)),
            "dilation": _tuple((r.dilation, c.dilation)),
        }
        if layer.op == "avg_pool2d":
            args.update(_avg_divisors(layer, rows.steps[position].out, cols.steps[position].out))
        return args
    keys = {"hardtanh": ("min_val", "max_val"), "leaky_relu": ("negative_slope",), "elu": ("alpha",),
            "gelu": ("approximate",), "batch_norm": ("eps",)}.get(layer.fn, ())
    return {key: repr(options[key]) for key in keys}


def _avg_divisors(layer: LayerSpec, out_rows: Interval, out_cols: Interval) -> dict[str, str]:
    """Avg-pool divisors: PyTorch's own when uniform, else explicit per-axis counts."""
    override = layer.options["divisor_override"]
    if override is not None:
        return {"override": repr(override), "div_rows": "None", "div_cols": "None"}
    include = layer.options["count_include_pad"]
    rows = layer.rows.avg_divisors(out_rows, layer.in_shape[2], include)
    cols = layer.cols.avg_divisors(out_cols, layer.in_shape[3], include)
    if set(rows) == {layer.rows.kernel} and set(cols) == {layer.cols.kernel}:
        return {"override": "None", "div_rows": "None", "div_cols": "None"}
    return {"override": "1", "div_rows": _tuple(rows), "div_cols": _tuple(cols)}


def _slots(layers: list[LayerSpec]) -> tuple[list[tuple[int, str]], list[dict[str, int]]]:
    """Flat tensor order of a segment and, per layer, each tensor role's index in it."""
    flat, slots = [], []
    for layer in layers:
        roles = {}
        for tensor in layer.tensors:
            roles[tensor.name.rsplit(".", 1)[1]] = len(flat)
            flat.append((layer.index, tensor.name.rsplit(".", 1)[1]))
        slots.append(roles)
    return flat, slots


def _pad_literals(rows_pad, cols_pad) -> tuple[str | None, str | None]:
    if rows_pad == (0, 0) and cols_pad == (0, 0):
        return None, None
    pad = _tuple((cols_pad[0], cols_pad[1], rows_pad[0], rows_pad[1]))

    def axis(before: int, after: int) -> str:
        return f"{before or ''}:{-after if after else ''}"

    return pad, f"[:, :, {axis(*rows_pad)}, {axis(*cols_pad)}]"


def _steps(layers: list[LayerSpec], slots: list[dict[str, int]], rows: AxisTile, cols: AxisTile) -> list[Step]:
    steps = []
    for op in schedule(layers, rows, cols):
        pad, unpad = (None, None) if op.empty else _pad_literals(op.rows.pad, op.cols.pad)
        steps.append(
            Step(
                **vars(op),
                pad=pad,
                unpad=unpad,
                pad_value="float('-inf')" if op.op == "max_pool2d" else "0.0",
                args=_args(op.layer, rows, cols, op.position),
                slots=slots[op.position],
                empty_out=_tuple((op.layer.out_shape[1], op.rows.out.length, op.cols.out.length)),
                empty_grad=_tuple((op.layer.in_shape[1], op.rows.read.length, op.cols.read.length)),
            )
        )
    return steps


def _table(tiles: tuple[AxisTile, ...]) -> str:
    """Per axis tile: read start, fresh start (see ``_scatter``), read stop, owned interval, class.

    Non-empty reads grow monotonically with the tile index, so the part of a read that earlier
    tiles also read is a prefix, ending where the furthest earlier non-empty read stops.
    """
    entries, reached = [], 0
    for t in tiles:
        read = t.steps[0].read
        fresh = min(max(read.start, reached), read.stop)
        entries.append(_tuple((read.start, fresh, read.stop, t.owned.start, t.owned.stop, t.shape_class)))
        if read.length:
            reached = max(reached, read.stop)
    return f"({', '.join(entries)},)"


def _gaps(tiles: tuple[AxisTile, ...], size: int) -> tuple[tuple[int, int], ...]:
    """Intervals of ``[0, size)`` no tile reads (e.g. a stride-2 1x1 convolution's skipped rows)."""
    gaps, reached = [], 0
    for read in sorted((t.steps[0].read for t in tiles if t.steps[0].read.length), key=lambda r: r.start):
        if read.start > reached:
            gaps.append((reached, read.start))
        reached = max(reached, read.stop)
    if reached < size:
        gaps.append((reached, size))
    return tuple(gaps)


def _first_of_class(tiles: tuple[AxisTile, ...]) -> list[AxisTile]:
    seen: dict[int, AxisTile] = {}
    for tile in tiles:
        seen.setdefault(tile.shape_class, tile)
    return list(seen.values())


def _segment_view(plan: Plan, segment: Segment) -> SegmentView:
    layers = list(plan.model.layers[segment.first:segment.stop])
    flat, slots = _slots(layers)
    classes = []
    for rows in _first_of_class(segment.rows) if segment.mode == "tiled" else ():
        for cols in _first_of_class(segment.cols):
            steps = _steps(layers, slots, rows, cols)
            _check_class(layers, segment, rows, cols, steps)
            classes.append(
                ShapeClass(
                    row=rows.shape_class,
                    col=cols.shape_class,
                    in_hw=(rows.steps[0].read.length, cols.steps[0].read.length),
                    out_hw=(rows.owned.length, cols.owned.length),
                    steps=steps,
                )
            )
    return SegmentView(
        segment=segment,
        tensors=flat,
        rows=_table(segment.rows),
        cols=_table(segment.cols),
        gaps=_tuple((_gaps(segment.rows, layers[0].in_shape[2]), _gaps(segment.cols, layers[0].in_shape[3]))),
        out_channels=layers[-1].out_shape[1],
        classes=classes,
    )


def _check_class(layers, segment: Segment, rows: AxisTile, cols: AxisTile, steps: list[Step]) -> None:
    """Every tile of a class must get the same avg-pool divisors as its representative."""
    for position, layer in enumerate(layers):
        if layer.op != "avg_pool2d":
            continue
        for other in segment.rows:
            if other.shape_class == rows.shape_class:
                assert _args(layer, other, cols, position) == steps[position].args
        for other in segment.cols:
            if other.shape_class == cols.shape_class:
                assert _args(layer, rows, other, position) == steps[position].args


def _environment() -> jinja2.Environment:
    packaged = resources.files("tilec") / "templates"
    folder = Path(str(packaged)) if packaged.is_dir() else Path(__file__).parent.parent / "templates"
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(plan: Plan) -> str:
    """Source of the generated module for ``plan``; the same plan gives the same bytes."""
    template = _environment().get_template("module.py.j2")
    return template.render(
        plan=plan,
        version=__version__,
        layer_rows=[_layer_row(layer) for layer in plan.model.layers],
        segments=[_segment_view(plan, segment) for segment in plan.segments],
        pyrepr=repr,
    )
