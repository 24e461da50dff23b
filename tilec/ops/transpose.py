"""``conv_transpose2d``: output ``o`` receives input ``i`` when ``o = i*s - p + j*d`` for some ``j``
in ``[0, k)``. Its ``padding`` crops the output rather than padding the input, so a tile runs
the transposed convolution on its read without padding and crops its own outputs out of the
result; ``output_padding`` only lengthens the last tile."""

from __future__ import annotations

from math import prod

from tilec.graph import Shapes
from tilec.ir import AxisStep, NodeSpec
from tilec.ops.base import Need, Op, const, pair
from tilec.ops.window import weight_check
from tilec.regions import Interval


def transpose_args(node: NodeSpec, weight_shape) -> dict[str, tuple[int, int]]:
    """``conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation)``."""
    return {
        "kernel": tuple(weight_shape[2:]),
        "stride": pair(const(node, 3, 1)),
        "padding": pair(const(node, 4, 0)),
        "output_padding": pair(const(node, 5, 0)),
        "dilation": pair(const(node, 7, 1)),
    }


def transpose_interval(out: Interval, kernel: int, stride: int, padding: int, dilation: int) -> Interval:
    """Inputs ``i`` feeding outputs ``[a, b)``: ``o = i*s - p + j*d`` for some ``j`` in ``[0, k)``."""
    start = -(-(out.start + padding - (kernel - 1) * dilation) // stride)
    stop = (out.stop - 1 + padding) // stride + 1
    return Interval(start, max(start, stop))


class ConvTranspose2d(Op):
    convolution = True
    casts_parameters = True
    window = True
    backward_factor = 2
    weight_gradient_factor = 1
    fresh_result = True
    fresh_gradient = True
    vectorised = False

    def _axis(self, node: NodeSpec, axis: int, shapes: Shapes) -> tuple[int, int, int, int, int]:
        args = transpose_args(node, shapes.arg_shape(node.args[1]))
        return tuple(args[k][axis] for k in ("kernel", "stride", "padding", "dilation", "output_padding"))

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return weight_check(node, shapes)

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        """The inputs feeding ``out``, widened so that the tile's local transposed convolution starts
        at or before ``out.start`` (it crops, never pads in front) and reads at least one real input:
        outputs no input reaches (gaps when the stride exceeds the kernel's span, output padding past
        the last tap) are the bias alone, computed by the local convolution like any other."""
        kernel, stride, padding, dilation, _ = self._axis(node, axis, shapes)
        interval = transpose_interval(out, kernel, stride, padding, dilation)
        if out.length:
            first_covering = (out.start + padding) // stride  # the last input whose outputs start <= out.start
            last_input = shapes.size(node.inputs[0], axis) - 1
            interval = Interval(min(interval.start, first_covering, last_input), interval.stop)
        return [Need(node.inputs[0], interval, False)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        kernel, stride, padding, dilation, output_padding = self._axis(node, axis, shapes)
        size = shapes.size(node.inputs[0], axis)
        return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1

    def extras(self, node: NodeSpec, step: AxisStep, axis: int, shapes: Shapes):
        """``(crop, output_padding)``: a tile runs the transposed conv on its read without padding,
        which yields outputs from ``read.start * stride - padding`` on; it keeps ``[crop, crop + len)``
        and asks for just enough output padding to reach the end of that."""
        if step.out.length == 0:
            return None
        kernel, stride, padding, dilation, _ = self._axis(node, axis, shapes)
        read = step.reads[0].read
        crop = step.out.start + padding - read.start * stride
        produced = (read.length - 1) * stride + (kernel - 1) * dilation + 1 if read.length else 0
        return crop, max(0, crop + step.out.length - produced)

    def emit(self, node: NodeSpec, tile) -> str:
        (crop_r, extra_r), (crop_c, extra_c) = (self.extras(node, step, axis, tile.shapes)
                                                for axis, step in enumerate((tile.row, tile.col)))
        stride, dilation = pair(const(node, 3, 1)), pair(const(node, 7, 1))
        call = (f"aten.conv_transpose2d.input({tile.read(node.inputs[0])}, {tile.arg(node.args[1])}, "
                f"{tile.arg(node.args[2])}, {stride!r}, (0, 0), ({extra_r}, {extra_c}), {const(node, 6, 1)}, "
                f"{dilation!r})")
        return call + tile.index(4, (2, 3), (crop_r, crop_r + tile.row.out.length),
                                 (crop_c, crop_c + tile.col.out.length))

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        weight = shapes.arg_shape(node.args[1])
        return "conv", min(weight[0], weight[1])

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        """Every input element meets ``Cout/groups * kh * kw`` weights."""
        weight = shapes.arg_shape(node.args[1])
        return 2 * weight[1] * weight[2] * weight[3] * prod(shapes.shape(node.inputs[0])) / prod(node.shape)
