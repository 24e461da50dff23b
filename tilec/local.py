"""What a tile's code depends on beyond lengths and padding: per-op local constants.

``extras(node, step, context)`` returns a hashable value that, with the step's lengths and pads,
fixes the generated statement of ``node`` in one tile: the crop offset and local output padding
of a transposed convolution, the local index maps of upsampling, avg-pool divisors at borders.
Tiles of one shape class have equal extras, so they share code.
"""

from __future__ import annotations

from tilec.ir import AxisStep, NodeSpec
from tilec.ops import Context, const, transpose_args, window_args
from tilec.regions import Window
from tilec.resample import resample_map


def transpose_local(node: NodeSpec, step: AxisStep, axis: int, context: Context) -> tuple[int, int]:
    """``(crop, output_padding)``: a tile runs the transposed conv on its read without padding,
    which yields outputs from ``read.start * stride - padding`` on; it keeps ``[crop, crop + len)``
    and asks for just enough output padding to reach the end of that."""
    args = transpose_args(node, context.tensor_shapes[node.args[1].value])
    kernel, stride, padding, dilation = (args[k][axis] for k in ("kernel", "stride", "padding", "dilation"))
    read = step.reads[0].read
    crop = step.out.start + padding - read.start * stride
    produced = (read.length - 1) * stride + (kernel - 1) * dilation + 1 if read.length else 0
    return crop, max(0, crop + step.out.length - produced)


def resample_local(node: NodeSpec, step: AxisStep, axis: int, context: Context):
    """Local ``(low, high, frac)`` index maps of upsampling over the tile's output."""
    source = node.inputs[0]
    mapping = resample_map(node, axis, context.size(source, axis), node.shape[2 + axis])
    start, stop, base = step.out.start, step.out.stop, step.reads[0].read.start
    low = tuple(i - base for i in mapping.low[start:stop])
    high = tuple(i - base for i in mapping.high[start:stop])
    return low, high, None if mapping.frac is None else mapping.frac[start:stop]


def avg_divisors(node: NodeSpec, step: AxisStep, axis: int, context: Context) -> tuple[int, ...] | None:
    """Per-output divisors PyTorch's avg-pool uses on this axis where the tile pads, else None."""
    if step.reads[0].pad == (0, 0):
        return None
    args = window_args(node)
    win = Window(args.kernel[axis], args.stride[axis], 1, args.padding[axis], args.padding[axis], args.ceil_mode)
    return win.avg_divisors(step.out, context.size(node.inputs[0], axis), bool(const(node, 5, True)))


def extras(node: NodeSpec, step: AxisStep, context: Context, axis: int | None = None):
    """The hashable local constants of ``node`` in this axis step (``None`` for most ops)."""
    if step.out.length == 0:
        return None
    if node.op == "conv_transpose2d":
        return transpose_local(node, step, _axis(node, step, axis), context)
    if node.op in ("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d"):
        return resample_local(node, step, _axis(node, step, axis), context)
    if node.op == "avg_pool2d":
        return avg_divisors(node, step, _axis(node, step, axis), context)
    return None


def _axis(node: NodeSpec, step: AxisStep, axis: int | None) -> int:
    if axis is None:
        raise ValueError(f"extras of {node.name} need the axis")
    return axis
