"""Max pooling with indices and unpooling to them: SegNet's and ENet's encoder and decoder.

``max_pool2d_with_indices`` gives each pooled value the flat index, ``row * width + column``, of
its input pixel over the whole input. A tile pools its slice as ``max_pool2d`` does and turns
aten's indices, local to the slice, into the whole input's from the absolute first row and column
of what it pooled. ``max_unpool2d`` puts each value at its index in a zero output the size of the
pooling's input; a tile of its output reads the pooled values (and indices) whose windows overlap
it and keeps those that land in it. Both read their tile's position at run time (``Op.anchor``):
their segments never stack or reuse tiles.
"""

from __future__ import annotations

from tilec.graph import Shapes
from tilec.ir import AxisStep, NodeSpec
from tilec.ops.base import Need, Op
from tilec.ops.window import MaxPool2d, window_args
from tilec.regions import Interval


class MaxPoolIndices(MaxPool2d):
    """``max_pool2d_with_indices``: max pooling's window rule; its indices PyTorch's."""

    index_output = True

    def positional(self, node: NodeSpec, shapes: Shapes) -> bool:
        return True

    def batchable(self, node: NodeSpec, shapes: Shapes) -> bool:
        return False

    def anchor(self, step: AxisStep) -> int:
        return step.reads[0].read.start

    def emit(self, node: NodeSpec, tile) -> str:
        args, source, native = self.pooled(node, tile)
        (rows, _), (cols, _) = tile.pads[node.inputs[0]]
        shift = (rows - native[0], cols - native[1])  # the rows and columns a padded copy put before the read
        width = tile.shapes.size(node.inputs[0], 1)
        return (f"max_pool_indices({source}, {args.kernel!r}, {args.stride!r}, {native!r}, {args.dilation!r}, "
                f"{tile.origin(node.name)}, {shift!r}, {width})")


def _pooling(node: NodeSpec, shapes: Shapes) -> NodeSpec | None:
    """The ``max_pool2d_with_indices`` whose indices ``max_unpool2d`` node ``node`` reads, if any."""
    indices = shapes.nodes.get(node.args[1].value) if node.args[1].kind == "node" else None
    if indices is None or indices.op != "getitem" or indices.args[1].value != 1:
        return None
    pooling = shapes.nodes.get(indices.args[0].value)
    return pooling if pooling is not None and pooling.op == "max_pool2d_with_indices" else None


class MaxUnpool2d(Op):
    """``max_unpool2d(values, indices, output_size)`` of the indices a ``max_pool2d_with_indices``
    made, with windows that do not overlap (kernel at most the stride, no dilation: no two values
    go to one place) and an output the size of its input. Outputs ``[a, b)`` on an axis read the
    pooled positions whose windows overlap them."""

    vectorised = False
    saves = "inputs"
    fresh_result = True

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        pooling = _pooling(node, shapes)
        if pooling is None:
            return "its indices do not come from a max_pool2d_with_indices"
        args = window_args(pooling)
        if any(k > s for k, s in zip(args.kernel, args.stride, strict=True)) or args.dilation != (1, 1):
            return "its pooling's windows overlap or are dilated: two values may go to one place"
        source = pooling.inputs[0]
        if (len(node.shape) != 4 or shapes.spatial(source) != (2, 3) or tuple(node.shape[2:]) != tuple(
                shapes.shape(source)[2:]) or shapes.sliced_inputs(node) != tuple(a.value for a in node.args[:2])):
            return "its output is not an NCHW image the size of its pooling's input"
        return None

    def positional(self, node: NodeSpec, shapes: Shapes) -> bool:
        return True

    def batchable(self, node: NodeSpec, shapes: Shapes) -> bool:
        return False

    def anchor(self, step: AxisStep) -> int:
        return step.out.start

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        window = window_args(_pooling(node, shapes)).axis(axis)
        pooled = Interval(0, 0) if not out.length else Interval(
            (out.start + window.pad_before - window.span) // window.stride + 1,
            -(-(out.stop + window.pad_before) // window.stride))
        return [Need(arg.value, pooled, False) for arg in node.args[:2]]

    def emit(self, node: NodeSpec, tile) -> str:
        values, indices = (tile.read(arg.value) for arg in node.args[:2])
        size = (tile.row.out.length, tile.col.out.length)
        return f"unpool({values}, {indices}, {tile.origin(node.name)}, {size!r}, {node.shape[3]})"
