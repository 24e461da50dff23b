"""Codegen: ``render`` turns a plan into the source of a standalone tiled-training module.

Python prepares a small view model here (names, literal arguments, which tensors die when);
the jinja2 templates in ``templates/`` only loop and branch over it. One forward and one
backward function are generated per segment and shape class (a pair of row and column
classes), never per tile; per-tile data is a table of slice bounds.

Naming inside a generated backward function: ``t{k}`` is the activation entering layer ``k``
(``t0`` is the tile's input slice), ``t{k}p`` the same after border padding, ``i{k}`` the
max-pool indices of layer ``k``, and ``g`` the running gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import jinja2

from tilec import __version__
from tilec.ir import AxisTile, LayerSpec, Plan, Segment
from tilec.layers import IN_PLACE, SAVES
from tilec.regions import Interval


@dataclass
class Step:
    """One layer inside one generated function pair."""

    layer: LayerSpec
    position: int
    src: str
    padded: str
    dst: str
    pad: str | None
    pad_value: str
    unpad: str | None
    in_place: bool
    in_place_forward: bool
    recompute: bool
    first: bool
    args: dict[str, str]
    slots: dict[str, int]
    empty: bool = False
    empty_out: str = ""
    empty_grad: str = ""
    free_forward: list[str] = field(default_factory=list)
    free_backward: list[str] = field(default_factory=list)

    @property
    def op(self) -> str:
        return self.layer.op

    @property
    def fn(self) -> str | None:
        return self.layer.fn


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


def _backward_reads(layer: LayerSpec, src: str, padded: str, dst: str, index: int) -> list[str]:
    """Names the backward kernel of ``layer`` reads."""
    if layer.op == "max_pool2d":
        return [padded, f"i{index}"]
    if layer.op in ("conv2d", "avg_pool2d"):
        return [padded]
    return {"input": [src], "output": [dst], "none": []}[SAVES[layer.fn]]


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


def _pad_literals(layer: LayerSpec, rows_pad, cols_pad) -> tuple[str | None, str | None]:
    if rows_pad == (0, 0) and cols_pad == (0, 0):
        return None, None
    pad = _tuple((cols_pad[0], cols_pad[1], rows_pad[0], rows_pad[1]))

    def axis(before: int, after: int) -> str:
        return f"{before or ''}:{-after if after else ''}"

    return pad, f"[:, :, {axis(*rows_pad)}, {axis(*cols_pad)}]"


def _steps(layers: list[LayerSpec], slots: list[dict[str, int]], rows: AxisTile, cols: AxisTile) -> list[Step]:
    steps: list[Step] = []
    name, fresh = "t0", False
    reads_backward: dict[str, int] = {}
    for position, layer in enumerate(layers):
        row, col = rows.steps[position], cols.steps[position]
        # An empty output: a consumer reads only border padding here; the tile makes an empty
        # tensor of the right shape instead of running the layer, and its gradient is empty.
        empty = row.out.length == 0 or col.out.length == 0
        pad, unpad = (None, None) if empty else _pad_literals(layer, row.pad, col.pad)
        src = name
        padded = f"{src}p" if pad else src
        dst = src if layer.fn == "identity" and not empty else f"t{position + 1}"
        last = position == len(layers) - 1
        needs_output = layer.op == "max_pool2d" or (layer.op == "pointwise" and SAVES[layer.fn] == "output")
        in_place = layer.fn in IN_PLACE and fresh and src not in reads_backward
        steps.append(
            Step(
                layer=layer,
                position=position,
                src=src,
                padded=padded,
                dst=dst,
                pad=pad,
                pad_value="float('-inf')" if layer.op == "max_pool2d" else "0.0",
                unpad=unpad,
                in_place=in_place,
                in_place_forward=layer.fn in IN_PLACE and fresh,
                recompute=not last or needs_output,
                first=position == 0,
                args=_args(layer, rows, cols, position),
                slots=slots[position],
                empty=empty,
                empty_out=_tuple((layer.out_shape[1], row.out.length, col.out.length)),
                empty_grad=_tuple((layer.in_shape[1], row.read.length, col.read.length)),
            )
        )
        for read in [] if empty else _backward_reads(layer, src, padded, dst, position):
            reads_backward.setdefault(read, position)
        fresh = fresh if layer.fn == "identity" else True
        name = dst
    _free(steps, reads_backward)
    return steps


def _free(steps: list[Step], reads_backward: dict[str, int]) -> None:
    """Attach ``del`` lists. A tensor no backward kernel reads dies after its forward consumer;
    a saved tensor dies after the last backward kernel reading it, which is the earliest layer
    reading it since backward runs in reverse (``reads_backward`` maps name -> that layer)."""
    for step in steps:
        if step.recompute:
            for name in dict.fromkeys((step.src, step.padded)):
                if name not in ("t0", step.dst) and name not in reads_backward:
                    step.free_forward.append(name)
    last = steps[-1]
    if last.recompute and last.dst not in reads_backward:
        last.free_forward.append(last.dst)
    for name, position in reads_backward.items():
        if name != "t0":
            steps[position].free_backward.append(name)


def _table(tiles: tuple[AxisTile, ...]) -> str:
    rows = ", ".join(
        _tuple((t.steps[0].read.start, t.steps[0].read.stop, t.owned.start, t.owned.stop, t.shape_class))
        for t in tiles
    )
    return f"({rows},)"


def _first_of_class(tiles: tuple[AxisTile, ...]) -> list[AxisTile]:
    seen: dict[int, AxisTile] = {}
    for tile in tiles:
        seen.setdefault(tile.shape_class, tile)
    return list(seen.values())


def _segment_view(plan: Plan, segment: Segment) -> SegmentView:
    layers = list(plan.model.layers[segment.first:segment.stop])
    flat, slots = _slots(layers)
    classes = []
    for rows in _first_of_class(segment.rows):
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
