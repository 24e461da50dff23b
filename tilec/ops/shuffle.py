"""``pixel_shuffle`` and ``pixel_unshuffle``: blocks of ``r`` x ``r`` pixels to and from channels.

``pixel_unshuffle(x, r)`` (space to depth) moves each ``r`` x ``r`` block of pixels into ``C * r²``
channels: output ``o`` of an axis reads inputs ``[o * r, o * r + r)``, so outputs ``[a, b)`` read
``[a * r, b * r)`` and a tile computes them from exactly that. ``pixel_shuffle(x, r)`` (depth to
space) is its inverse: output ``o`` reads input ``o // r``, so outputs ``[a, b)`` read
``[a // r, ceil(b / r))``; a tile shuffles its read and crops its own outputs out of the result.
"""

from __future__ import annotations

from tilec.graph import Shapes
from tilec.ir import AxisStep, NodeSpec
from tilec.ops.base import Need, Op, const
from tilec.regions import Interval


class _Shuffle(Op):
    saves = "nothing"
    fresh_result = True
    fresh_gradient = True

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        """Blocks of other dims than an NCHW image's rows and columns run untiled."""
        if shapes.spatial(shapes.sliced_inputs(node)[0]) == (2, 3) and len(node.shape) == 4:
            return None
        return "it shuffles other dims than an NCHW image's"

    def emit(self, node: NodeSpec, tile) -> str:
        return f"aten.{node.op}.default({tile.read(node.inputs[0])}, {const(node, 1)})"


class PixelUnshuffle(_Shuffle):
    """Space to depth: outputs ``[a, b)`` read inputs ``[a * r, b * r)``."""

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        r = const(node, 1)
        return [Need(node.inputs[0], Interval(out.start * r, out.stop * r), False)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        return shapes.size(node.inputs[0], axis) // const(node, 1)


class PixelShuffle(_Shuffle):
    """Depth to space: outputs ``[a, b)`` read inputs ``[a // r, ceil(b / r))``; the tile crops."""

    vectorised = False

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        r = const(node, 1)
        if not out.length:
            return [Need(node.inputs[0], Interval(0, 0), False)]
        return [Need(node.inputs[0], Interval(out.start // r, -(-out.stop // r)), False)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        return shapes.size(node.inputs[0], axis) * const(node, 1)

    def extras(self, node: NodeSpec, step: AxisStep, axis: int, shapes: Shapes):
        """Where the tile's outputs start in the shuffle of its read."""
        return None if step.out.length == 0 else step.out.start - step.reads[0].read.start * const(node, 1)

    def emit(self, node: NodeSpec, tile) -> str:
        crop_r, crop_c = (self.extras(node, step, axis, tile.shapes) for axis, step in enumerate((tile.row, tile.col)))
        return super().emit(node, tile) + tile.index(4, (2, 3), (crop_r, crop_r + tile.row.out.length),
                                                    (crop_c, crop_c + tile.col.out.length))
