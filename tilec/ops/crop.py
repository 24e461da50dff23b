"""Padding (constant, replicate, reflect; negative widths crop) and slicing along an image axis."""

from __future__ import annotations

from tilec.graph import Shapes
from tilec.ir import NodeSpec
from tilec.ops.base import Need, Op, const, dim
from tilec.regions import Interval


def pad_amounts(node: NodeSpec, axis: int) -> tuple[int, int]:
    """``(before, after)`` of ``aten.pad`` / ``constant_pad_nd`` on image axis ``axis`` (negative crops)."""
    pad = tuple(node.args[1].value)
    dim_from_end = len(node.shape) - 1 - node.spatial[axis]  # pad lists the last dim first
    if 2 * dim_from_end + 1 >= len(pad):
        return 0, 0
    return pad[2 * dim_from_end], pad[2 * dim_from_end + 1]


def same_layout(node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
    """The image axes of ``node``'s input, for an op keeping its dims (``None``: it has none)."""
    return shapes.spatial(node.inputs[0]) if node.inputs else None


#: ``pad`` modes that read their border from the input itself: output ``o`` of an axis padded
#: ``before`` reads input index ``map(o - before)``, as PyTorch's kernels do.
INDEX_MODES = {
    "replicate": lambda i, size: min(max(i, 0), size - 1),
    "reflect": lambda i, size: -i if i < 0 else 2 * (size - 1) - i if i >= size else i,
}


def pad_mode(node: NodeSpec) -> str:
    """``"constant"``, ``"replicate"``, ``"reflect"``... (``constant_pad_nd`` is constant)."""
    return const(node, 2, "constant") or "constant" if node.op == "pad" else "constant"


class Pad(Op):
    """``pad(x, widths, mode, value)`` / ``constant_pad_nd``, per axis.

    Constant: the clipped part of a tile's read is its share of the padding (negative widths
    crop); other dims (the channels of a tensor whose image axes are not its last two) are padded
    as they are. Replicate and reflect: each output reads one input index (``INDEX_MODES``); a
    tile reads the hull of its outputs' indices and gathers them, so a border tile pads itself in
    the same mode, and a tile that reaches no border (or zero widths) just passes its read on.
    """

    pass_through = True
    saves = "nothing"
    vectorised = False

    def layout(self, node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
        return same_layout(node, shapes)

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        mode = pad_mode(node)
        if mode != "constant" and mode not in INDEX_MODES:
            return f"padding mode {mode!r} is not supported (only 'constant', 'replicate' and 'reflect')"
        ndim = len(node.shape)
        if mode != "constant" and (node.spatial != (ndim - 2, ndim - 1) or len(const(node, 1)) > 4):
            return f"{mode} padding of dims other than the image's last two is not supported"
        return None

    def index_map(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[int]:
        """Per output of ``out``, the input index it reads (replicate and reflect)."""
        before, _ = pad_amounts(node, axis)
        size, read = shapes.size(node.inputs[0], axis), INDEX_MODES[pad_mode(node)]
        return [read(o - before, size) for o in range(out.start, out.stop)]

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        if pad_mode(node) == "constant":
            before, _ = pad_amounts(node, axis)
            return [Need(node.inputs[0], out.shift(-before), True)]
        indices = self.index_map(node, axis, out, shapes)
        return [Need(node.inputs[0], Interval(min(indices), max(indices) + 1) if indices else Interval(0, 0), False)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        return shapes.size(node.inputs[0], axis) + sum(pad_amounts(node, axis))

    def extras(self, node: NodeSpec, step, axis: int, shapes: Shapes):
        """Replicate and reflect: the tile's local index map on this axis, ``None`` where it is its
        read in order (no border reached)."""
        if pad_mode(node) == "constant" or step.out.length == 0:
            return None
        start = step.reads[0].read.start
        local = tuple(i - start for i in self.index_map(node, axis, step.out, shapes))
        return None if local == tuple(range(len(local))) and len(local) == step.reads[0].read.length else local

    def emit(self, node: NodeSpec, tile) -> str:
        source = tile.read(node.inputs[0])
        if pad_mode(node) != "constant":
            rows, cols = (self.extras(node, step, axis, tile.shapes) for axis, step in enumerate((tile.row, tile.col)))
            if rows is None and cols is None:
                return source
            rows = rows or tuple(range(tile.row.out.length))
            cols = cols or tuple(range(tile.col.out.length))
            return f"gather({source}, {tile.constant(rows)}, {tile.constant(cols)})"
        widths = list(const(node, 1))
        for axis, pads in enumerate(tile.pads[node.inputs[0]]):
            at = 2 * (len(node.shape) - 1 - node.spatial[axis])
            widths.extend([0] * (at + 2 - len(widths)))
            widths[at:at + 2] = pads
        if not any(widths):
            return source
        value = const(node, 3 if node.op == "pad" else 2, None)
        value = 0.0 if value is None else value
        return f"aten.constant_pad_nd.default({source}, {tuple(widths)!r}, {value!r})"


def slice_start(node: NodeSpec, shapes: Shapes) -> int:
    """Start of a ``slice`` along its dim, normalised to ``[0, size]``."""
    size = shapes.shape(node.inputs[0])[dim(const(node, 1, 0), len(node.shape))]
    start = const(node, 2, None)
    start = 0 if start is None else start
    return min(max(start + size if start < 0 else start, 0), size)


class Slice(Op):
    """``slice(x, dim, start, stop, step)``: a crop along an image axis shifts the interval;
    along another dim (with any step: every other channel), a per-pixel view."""

    view = True
    pass_through = True
    saves = "nothing"

    def layout(self, node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
        return same_layout(node, shapes)

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        source = node.inputs[0]
        along = dim(const(node, 1, 0), len(shapes.shape(source))) in (shapes.spatial(source) or ())
        if along and const(node, 4, 1) != 1:
            return "slicing an image axis with a step other than 1 is not supported"
        return None

    def _offset(self, node: NodeSpec, axis: int, shapes: Shapes) -> int:
        source = node.inputs[0]
        along = dim(const(node, 1, 0), len(node.shape)) == shapes.spatial(source)[axis]
        return slice_start(node, shapes) if along else 0

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        return [Need(node.inputs[0], out.shift(self._offset(node, axis, shapes)), False)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        source = node.inputs[0]
        size = shapes.size(source, axis)
        if const(node, 1, 0) % len(shapes.shape(source)) != shapes.spatial(source)[axis]:
            return size
        stop = const(node, 3, None)
        stop = size if stop is None else stop + size if stop < 0 else stop
        return max(0, min(stop, size) - slice_start(node, shapes))

    def emit(self, node: NodeSpec, tile) -> str:
        if const(node, 1, 0) % len(node.shape) in node.spatial:
            return tile.read(node.inputs[0])
        return super().emit(node, tile)
