"""Window ops: ``conv2d``, ``max_pool2d`` and ``avg_pool2d``.

Output index ``o`` reads input indices ``o * stride - pad_before + j * dilation`` for ``j`` in
``[0, kernel)`` (``tilec.regions.Window``); a border tile pads its read itself (zeros for
convolutions and average pooling, ``-inf`` for max pooling) and the op runs without padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from tilec.graph import Shapes
from tilec.ir import AxisStep, NodeSpec
from tilec.ops.base import Need, Op, const, pair
from tilec.regions import Interval, Window


@dataclass(frozen=True)
class WindowArgs:
    """Normalised arguments of a conv / pooling node, per axis."""

    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    ceil_mode: bool

    def axis(self, axis: int) -> Window:
        return Window(self.kernel[axis], self.stride[axis], self.dilation[axis], self.padding[axis],
                      self.padding[axis], self.ceil_mode)


def window_args(node: NodeSpec, weight_shape: tuple[int, ...] | None = None) -> WindowArgs:
    """Conv2d: ``conv2d(x, w, b, stride, padding, dilation, groups)``; pooling: ``max_pool2d(x,
    kernel, stride, padding, dilation, ceil_mode)``, ``avg_pool2d(x, kernel, stride, padding,
    ceil_mode, count_include_pad, divisor_override)``."""
    if node.op == "conv2d":
        kernel = tuple(weight_shape[2:])
        stride, dilation = (pair(const(node, i, 1)) for i in (3, 5))
        (rows, _), (cols, _) = conv_padding(node, weight_shape)
        return WindowArgs(kernel, stride, (rows, cols), dilation, False)
    kernel = pair(const(node, 1))
    stride_value = const(node, 2, ())
    stride = pair(stride_value) if stride_value not in ((), None) else kernel
    padding = pair(const(node, 3, 0))
    if node.op in ("max_pool2d", "max_pool2d_with_indices"):
        return WindowArgs(kernel, stride, padding, pair(const(node, 4, 1)), bool(const(node, 5, False)))
    return WindowArgs(kernel, stride, padding, (1, 1), bool(const(node, 4, False)))


def conv_padding(node: NodeSpec, weight_shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per axis ``(before, after)`` padding of a conv2d, resolving ``'same'`` and ``'valid'``."""
    padding = const(node, 4, 0)
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        dilation = pair(const(node, 5, 1))
        result = []
        for axis in range(2):
            total = dilation[axis] * (weight_shape[2 + axis] - 1)
            result.append((total // 2, total - total // 2))
        return result[0], result[1]
    rows, cols = pair(padding)
    return (rows, rows), (cols, cols)


class _WindowOp(Op):
    window = True
    padded_copy = True
    fresh_result = True
    fresh_gradient = True

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return None

    def copies(self, before, after):
        """Whether a border tile padding ``before`` / ``after`` on an axis makes a padded copy of
        its read (arrays allowed): where the padding is asymmetric (symmetric padding is passed to
        the op natively)."""
        return before != after

    def axis_window(self, node: NodeSpec, axis: int, shapes: Shapes) -> Window:
        return window_args(node).axis(axis)

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        return [Need(node.inputs[0], self.axis_window(node, axis, shapes).input_interval(out), True)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        return self.axis_window(node, axis, shapes).output_size(shapes.size(node.inputs[0], axis))

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        return prod(window_args(node).kernel)

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        return "pool", node.shape[1]


def weight_check(node: NodeSpec, shapes: Shapes) -> str | None:
    """A convolution whose weight is computed from the model's input (with image axes: a dynamic
    convolution) runs untiled; one computed from the model's tensors alone (weight
    standardisation: ``tilec.trace`` gives those no image axes) tiles."""
    weight = node.args[1]
    if weight.kind == "node" and shapes.spatial(weight.value) is not None:
        return "its weight is sliced from the image"
    return None


class Conv2d(_WindowOp):
    convolution = True
    casts_parameters = True
    backward_factor = 2
    weight_gradient_factor = 1

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return weight_check(node, shapes)

    def axis_window(self, node: NodeSpec, axis: int, shapes: Shapes) -> Window:
        weight = shapes.arg_shape(node.args[1])
        args = window_args(node, weight)
        before, after = conv_padding(node, weight)[axis]
        return Window(args.kernel[axis], args.stride[axis], args.dilation[axis], before, after)

    def emit(self, node: NodeSpec, tile) -> str:
        source, native = tile.padded(node.inputs[0], "0.0")
        args = window_args(node, tile.shapes.arg_shape(node.args[1]))
        return (f"conv2d({source}, {tile.arg(node.args[1])}, {tile.arg(node.args[2])}, {args.stride!r}, {native!r}, "
                f"{args.dilation!r}, {const(node, 6, 1)}, arena)")

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        weight = shapes.arg_shape(node.args[1])
        return 2 * weight[1] * weight[2] * weight[3]

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        """``depthwise`` (a group per input channel), ``conv1x1`` or ``conv``, with the smaller of
        the input channels per group and the output channels."""
        weight = shapes.arg_shape(node.args[1])
        if const(node, 6, 1) > 1 and weight[1] == 1:
            return "depthwise", weight[0]
        return ("conv1x1" if weight[2] * weight[3] == 1 else "conv"), min(weight[0], weight[1])


class MaxPool2d(_WindowOp):
    keeps_indices = True

    def pooled(self, node: NodeSpec, tile) -> tuple[WindowArgs, str, tuple[int, int]]:
        """The node's window arguments, the tile's read of its input padded with ``-inf`` where the
        padding is asymmetric, and the symmetric padding left to the op itself."""
        args = window_args(node)
        source, native = tile.padded(node.inputs[0], "float('-inf')", (args.kernel[0] // 2, args.kernel[1] // 2))
        return args, source, native

    def emit(self, node: NodeSpec, tile) -> str:
        args, source, native = self.pooled(node, tile)
        return f"max_pool(arena, {source}, {args.kernel!r}, {args.stride!r}, {native!r}, {args.dilation!r})"


class AvgPool2d(_WindowOp):
    def copies(self, before, after):
        """Any border padding: avg-pooling's own would count it in the divisors differently."""
        return before + after > 0

    def extras(self, node: NodeSpec, step: AxisStep, axis: int, shapes: Shapes):
        """Per-output divisors PyTorch's avg-pool uses on this axis where the tile pads, else None."""
        if step.out.length == 0 or step.reads[0].pad == (0, 0):
            return None
        args = window_args(node)
        win = Window(args.kernel[axis], args.stride[axis], 1, args.padding[axis], args.padding[axis],
                     args.ceil_mode)
        return win.avg_divisors(step.out, shapes.size(node.inputs[0], axis), bool(const(node, 5, True)))

    def emit(self, node: NodeSpec, tile) -> str:
        args = window_args(node)
        source = tile.read(node.inputs[0])
        (rb, ra), (cb, ca) = tile.pads[node.inputs[0]]
        override = const(node, 6, None)
        call = f"aten.avg_pool2d.default({{}}, {args.kernel!r}, {args.stride!r}, (0, 0), False, True, {{}})"
        if (rb, ra, cb, ca) == (0, 0, 0, 0):
            return call.format(source, repr(override))
        padded = f"pad_border(arena, {source}, {(cb, ca, rb, ra)!r}, 0.0)"
        rows = self.extras(node, tile.row, 0, tile.shapes)
        cols = self.extras(node, tile.col, 1, tile.shapes)
        kernel_rows, kernel_cols = args.kernel
        uniform = set(rows or (kernel_rows,)) == {kernel_rows} and set(cols or (kernel_cols,)) == {kernel_cols}
        if override is not None or uniform:
            return call.format(padded, repr(override))
        rows = rows or (kernel_rows,) * tile.row.out.length
        cols = cols or (kernel_cols,) * tile.col.out.length
        return f"{call.format(padded, 1)} / divisor({tile.constant(rows)}, {tile.constant(cols)}, {source})"
