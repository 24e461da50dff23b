"""Shifts of the interval: constant padding (negative widths crop) and slicing along an image axis."""

from __future__ import annotations

from tilec.graph import Shapes
from tilec.ir import NodeSpec
from tilec.ops.base import Need, Op, const, dim, fail
from tilec.regions import Interval


def pad_amounts(node: NodeSpec, axis: int) -> tuple[int, int]:
    """``(before, after)`` of ``aten.pad`` / ``constant_pad_nd`` on a spatial axis (negative crops)."""
    pad = tuple(node.args[1].value)
    dim_from_end = 1 - axis  # pad lists the last dim first: columns, then rows
    if 2 * dim_from_end + 1 >= len(pad):
        return 0, 0
    return pad[2 * dim_from_end], pad[2 * dim_from_end + 1]


class ConstantPad(Op):
    """``pad(x, widths, "constant", value)`` / ``constant_pad_nd``: the clipped part of a tile's read
    is its share of the padding."""

    pass_through = True
    saves = "nothing"

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if node.op == "pad" and const(node, 2, "constant") not in ("constant", None):
            fail(node, f"padding mode {const(node, 2)!r} is not supported (only 'constant')")
        return None

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        before, _ = pad_amounts(node, axis)
        return [Need(node.inputs[0], out.shift(-before), True)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        return shapes.size(node.inputs[0], axis) + sum(pad_amounts(node, axis))

    def emit(self, node: NodeSpec, tile) -> str:
        (rb, ra), (cb, ca) = tile.pads[node.inputs[0]]
        source = tile.read(node.inputs[0])
        if (rb, ra, cb, ca) == (0, 0, 0, 0):
            return source
        value = const(node, 3 if node.op == "pad" else 2, None)
        value = 0.0 if value is None else value
        rest = tuple(const(node, 1))[4:]
        return f"aten.constant_pad_nd.default({source}, {(cb, ca, rb, ra, *rest)!r}, {value!r})"


def slice_start(node: NodeSpec, shapes: Shapes) -> int:
    """Start of a ``slice`` along its dim, normalised to ``[0, size]``."""
    size = shapes.shape(node.inputs[0])[dim(const(node, 1, 0), len(node.shape))]
    start = const(node, 2, None)
    start = 0 if start is None else start
    return min(max(start + size if start < 0 else start, 0), size)


class Slice(Op):
    """``slice(x, dim, start, stop, step)``: a crop along an image axis shifts the interval;
    along another dim, a per-pixel view."""

    view = True
    pass_through = True
    saves = "nothing"

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if const(node, 4, 1) != 1:
            fail(node, "slicing with a step other than 1 is not supported")
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
