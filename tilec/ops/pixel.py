"""Per-pixel ops: everything that maps a position to itself.

Activations, eval-mode BatchNorm and Dropout, elementwise arithmetic, channel concat / chunk /
shuffle, the channels-last LayerNorm / Linear pair and permutes, and reductions over channels.
An output interval needs the same interval of every sliced input. Some of them read the whole
map in other uses (a mean over H and W, a Linear after flatten): their ``check`` says so.
"""

from __future__ import annotations

from math import prod

from tilec.graph import Shapes
from tilec.ir import NodeSpec
from tilec.ops.base import INDEX_BYTES, WHOLE_MAP, Need, Op, const, dim
from tilec.ops.reduce import Normalise, Statistic, image_dims
from tilec.regions import Interval
from tilec.runtime.dropout import op_key


class Pixel(Op):
    pixel = True
    #: Element-wise arithmetic whose tensor arguments broadcast against each other.
    broadcasts = False

    def layout(self, node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
        images = [name for name in node.inputs if shapes.spatial(name) is not None]
        if not images:
            return None  # from small tensors only (a reduction's result reshaped): no image axes
        rows, cols = shapes.spatial(images[0])
        return self.image_layout(node, shapes, images[0], rows, cols)

    def image_layout(self, node: NodeSpec, shapes: Shapes, source: str, rows: int, cols: int):
        """The layout of an output computed from image ``source`` with image axes ``rows, cols``."""
        return (rows, cols) if len(node.shape) == len(shapes.shape(source)) else None

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        images = shapes.sliced_inputs(node)
        layout = shapes.spatial(images[0])
        if len(images) > 1 and any(shapes.spatial(name) != layout for name in images):
            return "its inputs hold the image axes in different dims"
        for name in images:
            if tuple(shapes.shape(name)[d] for d in layout) != tuple(node.shape[d] for d in node.spatial or ()):
                return "it broadcasts one image over another of a different size"
        if self.broadcasts and any(_spans_image(shapes.arg_shape(arg), node) for arg in node.args
                                   if arg.kind == "tensor" or arg.kind == "node" and arg.value not in images):
            return ("it combines the image with a tensor spanning its image axes that the model does not compute "
                    "from its input (a positional embedding)")
        return None

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        return [Need(name, out, False) for name in shapes.sliced_inputs(node)]


def _spans_image(shape: tuple[int, ...], node: NodeSpec) -> bool:
    """Whether a tensor of ``shape``, broadcast against ``node``'s output, has more than one element
    along an image axis of it."""
    offset = len(node.shape) - len(shape)
    return any(0 <= d - offset and shape[d - offset] > 1 for d in node.spatial or ())


def after_inserting(axes: tuple[int, int], at: int) -> tuple[int, int]:
    """The image axes ``axes`` once a dim is inserted at ``at`` (``stack``, ``unsqueeze``)."""
    return tuple(d + (d >= at) for d in axes)


def after_removing(axes: tuple[int, int], removed) -> tuple[int, int] | None:
    """The image axes ``axes`` once the dims ``removed`` are gone (``unbind``, ``squeeze``, a
    reduction without keepdim); ``None`` where one of them is an image axis."""
    if set(removed) & set(axes):
        return None
    return tuple(d - sum(r < d for r in removed) for d in axes)


def is_batch_norm_module(node: NodeSpec) -> bool:
    """``batch_norm`` run by an ``nn.BatchNorm*`` module: at run time its training flag and
    momentum come from the module (``tilec.runtime.checks.batch_norm_mode``)."""
    return node.op == "batch_norm" and "BatchNorm" in node.module_type


class BatchNorm(Pixel):
    """``batch_norm`` with running statistics (eval mode) is per pixel, as is
    ``_native_batch_norm_legit_no_training``; with batch statistics (training mode, or
    ``track_running_stats=False``) it is a reduction over (N, H, W) per channel, whose running
    statistics its combine updates as ``nn.BatchNorm`` does. A module's training flag and momentum
    are read at run time: a plan compiled in training mode also runs in eval mode."""

    fresh_result = True
    channels_last_backward_copy = True  # in a tile, its scale's gradient: the output gradient times the input
    widens_input = True
    flop_count = 5

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        return "norm", node.shape[1]

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if node.op == "batch_norm" and const(node, 5, False):
            return WHOLE_MAP
        return super().check(node, shapes)

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return node.op == "batch_norm" and bool(const(node, 5, False)) and image_dims(node, shapes) is not None

    def partial(self, node: NodeSpec, tile) -> str:
        return f"partial_moments({tile.owned(node.inputs[0])}, (0, 2, 3))"

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return (shapes.shape(node.inputs[0])[1],) * 2  # (mean, M2) per channel; the count is a number

    def merge(self, node: NodeSpec) -> str:
        return "moments"

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        mode = view.mode(node.path) if is_batch_norm_module(node) else f"(True, {const(node, 6)!r})"
        stats = (f"batch_norm_stats({combined}, {view.arg(node.args[3])}, {view.arg(node.args[4])}, {mode}, "
                 f"{const(node, 7)!r}, update)")
        return f"norm_affine({stats}, None, {node.shape[1]}, {view.arg(node.args[1])}, {view.arg(node.args[2])})"

    def apply(self, node: NodeSpec, tile) -> str:
        return f"norm_apply({tile.read(node.inputs[0])}, {tile.leaf(node.name)})"

    def switch(self, node: NodeSpec) -> str | None:
        return node.path if is_batch_norm_module(node) else None


def is_element_dropout(node: NodeSpec, shapes: Shapes) -> bool:
    """Element-wise ``dropout`` on a 4-D tensor, traced in training mode, with ``p > 0``: its masks
    come from the counter-based generator (``tilec.runtime.dropout``), not from PyTorch's stream."""
    return node.op == "dropout" and bool(const(node, 2, False)) and len(node.shape) == 4 and const(node, 1, 0) != 0


def dropout_key(node: NodeSpec, shapes: Shapes) -> int:
    """The key of an element-wise dropout (``tilec.runtime.dropout.op_key``): its module path and how
    many dropouts on 4-D tensors that module ran before it."""
    count = 0
    for other in shapes.nodes.values():
        if other.name == node.name:
            return op_key(node.path, count)
        count += other.op == "dropout" and other.path == node.path and len(other.shape) == 4
    raise KeyError(node.name)


class Dropout(Pixel):
    """Dropout in eval mode is the identity. In training mode, ``feature_dropout`` (``Dropout2d``)
    draws one mask value per sample and channel: a reduction of nothing, drawn once per step in the
    model's op order (so a seeded tiled step draws what a seeded untiled one does) and multiplied
    into every tile. Element-wise ``dropout`` on a 4-D tensor is a reduction of nothing too: its
    result is the step's stream of the op (``tilec.runtime.dropout``), and each tile draws its own
    elements' keep decisions from it, their absolute indices and its origin at the node (its
    ``AxisTile.partials`` interval, the node's own output interval: ``positional``). Element-wise
    dropout on a 3-D image and alpha dropout in training mode are refused."""

    view = True
    pass_through = True
    saves = "nothing"
    random = True
    training_flag = 2

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if const(node, 2, False) and const(node, 1, 0) and not self.reduces(node, shapes):
            what = "alpha dropout" if "alpha" in node.op else "element-wise Dropout on a 3-D image"
            return f"{what} in training mode draws a mask over the whole image, which no tile can reproduce"
        return super().check(node, shapes)

    def draws(self, node: NodeSpec) -> bool:
        return const(node, 1, 0) != 0  # p = 0 (timm's MLPs' default): the identity

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return (node.op in ("feature_dropout", "dropout") and self.draws(node) and bool(const(node, 2, False))
                and image_dims(node, shapes) is not None)

    def positional(self, node: NodeSpec, shapes: Shapes) -> bool:
        return is_element_dropout(node, shapes)

    def reduced(self, node: NodeSpec, shapes: Shapes) -> tuple[str, ...]:
        return ()

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        if node.op == "dropout":
            return f"step_stream(train, {dropout_key(node, view.shapes)}, {view.train(node.path)}, like.device)"
        flag = view.train(node.path) if node.path else "True"
        return f"channel_dropout(like, {tuple(node.shape[:2]) + (1, 1)!r}, {const(node, 1)!r}, {flag})"

    def apply(self, node: NodeSpec, tile) -> str:
        if node.op == "dropout":
            origin = tile.origin(node.name)
            starts = [f"{origin}[{node.spatial.index(d)}]" if d in node.spatial else "0" for d in range(4)]
            return (f"element_dropout({tile.read(node.inputs[0])}, {tile.leaf(node.name)}, {const(node, 1)!r}, "
                    f"({', '.join(starts)}), {tuple(node.shape)!r})")
        return f"{tile.read(node.inputs[0])} * {tile.leaf(node.name)}"

    def untiled(self, node: NodeSpec, args: list[str], shapes: Shapes) -> str | None:
        if not is_element_dropout(node, shapes):
            return None
        stream = f"step_stream(train, {dropout_key(node, shapes)}, {args[2]}, {args[0]}.device)"
        return (f"element_dropout({args[0]}, {stream}, "
                f"{args[1]}, (0, 0, 0, 0), {tuple(node.shape)!r})")


class ChannelReduction(Pixel):
    """``mean`` / ``sum`` / ``amax`` / ``amin`` / ``max`` / ``min`` / ``logsumexp`` /
    ``linalg_vector_norm`` / ``var`` / ``std`` / ``var_mean`` over dims other than the image axes
    (channels: ``F.normalize``, timm's ``SimpleNorm2d``, CBAM's ``torch.max(x, 1)``); over both image
    axes, a reduction (``tilec.ops.reduce.Statistic``)."""

    statistic = Statistic()

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return self.statistic.reduces(node, shapes)

    def partial(self, node: NodeSpec, tile) -> str:
        return self.statistic.partial(node, tile)

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return self.statistic.partial_elements(node, shapes)

    def merge(self, node: NodeSpec) -> str:
        return self.statistic.merge(node)

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        return self.statistic.finish(node, combined, view)

    def image_layout(self, node: NodeSpec, shapes: Shapes, source: str, rows: int, cols: int):
        keepdim = Statistic.arguments(node)[1]
        if keepdim is None or not const(node, keepdim, False):
            return after_removing((rows, cols), self.statistic.dims(node, shapes))
        return super().image_layout(node, shapes, source, rows, cols)

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        source = shapes.sliced_inputs(node)[0]
        if set(self.statistic.dims(node, shapes)) & set(shapes.spatial(source)):
            return WHOLE_MAP
        return super().check(node, shapes)


class ChannelArgMax(ChannelReduction):
    """``argmax`` over channels (a segmentation's predicted class per pixel)."""

    def element_bytes(self, node: NodeSpec, shapes: Shapes, floating: int) -> int:
        return INDEX_BYTES

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return False


class Softmax(Pixel):
    """``softmax`` / ``log_softmax`` along the channels."""

    saves = "output"

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        source = shapes.sliced_inputs(node)[0]
        if dim(const(node, 1, 0), len(shapes.shape(source))) in shapes.spatial(source):
            return WHOLE_MAP
        return super().check(node, shapes)


class Reshape(Pixel):
    """``view`` / ``reshape`` of the dims before the image axes (channel shuffles) and after them
    (channels-last heads split off), keeping the samples along dim 0 and rows and columns whole."""

    view = True
    pass_through = True
    saves = "nothing"

    def image_layout(self, node: NodeSpec, shapes: Shapes, source: str, rows: int, cols: int):
        source_shape, shape = shapes.shape(source), node.shape
        if cols != rows + 1:
            return None
        before = prod(source_shape[:rows])
        for at in range(len(shape) - 1):
            if prod(shape[:at]) == before and shape[at:at + 2] == source_shape[rows:rows + 2]:
                return at, at + 1
        return None

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        source = shapes.sliced_inputs(node)[0]
        if node.spatial is None or node.shape[0] != shapes.shape(source)[0]:
            return WHOLE_MAP
        return super().check(node, shapes)

    def emit(self, node: NodeSpec, tile) -> str:
        shape = list(node.shape)
        shape[node.spatial[0]], shape[node.spatial[1]] = tile.row.out.length, tile.col.out.length
        shape[0] = -1  # the samples (``check``): as many as the tiles stacked (``tilec.runtime.batches``)
        return tile.call(node, [tile.read(node.inputs[0]), repr(shape)])


class Move(Pixel):
    """``permute`` / ``transpose`` keeping rows before columns (channels-last blocks). One that swaps
    rows and columns is no layout tile rules can follow: it runs untiled."""

    view = True
    pass_through = True
    saves = "nothing"

    def image_layout(self, node: NodeSpec, shapes: Shapes, source: str, rows: int, cols: int):
        ndim = len(shapes.shape(source))
        if node.op == "permute":
            order = [d % ndim for d in node.args[1].value]
            moved = order.index(rows), order.index(cols)
        else:
            a, b = (d % ndim for d in (node.args[1].value, node.args[2].value))
            swap = {a: b, b: a}
            moved = swap.get(rows, rows), swap.get(cols, cols)
        return moved if moved[0] < moved[1] else None

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if node.spatial is None:
            return WHOLE_MAP
        return super().check(node, shapes)


class LayerNorm(Pixel):
    """``layer_norm`` over trailing dims that are not image axes (channels-last); over (C, H, W)
    without a per-pixel weight, a reduction (``tilec.ops.reduce.Normalise``)."""

    flop_count = 5
    normalise = Normalise()

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return self.normalise.reduces(node, shapes)

    def partial(self, node: NodeSpec, tile) -> str:
        return self.normalise.partial(node, tile)

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return self.normalise.partial_elements(node, shapes)

    def merge(self, node: NodeSpec) -> str:
        return self.normalise.merge(node)

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        return self.normalise.finish(node, combined, view)

    def apply(self, node: NodeSpec, tile) -> str:
        return self.normalise.apply(node, tile)

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        source = shapes.sliced_inputs(node)[0]
        ndim = len(shapes.shape(source))
        if set(range(ndim - len(const(node, 1, ())), ndim)) & set(shapes.spatial(source)):
            return WHOLE_MAP
        return super().check(node, shapes)


class Linear(Pixel):
    """``linear`` over a last dim that is not an image axis (channels-last)."""

    casts_parameters = True
    backward_factor = 2
    weight_gradient_factor = 1

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        source = shapes.sliced_inputs(node)[0]
        if len(shapes.shape(source)) - 1 in shapes.spatial(source):
            return WHOLE_MAP
        return super().check(node, shapes)

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        return 2 * shapes.arg_shape(node.args[1])[1]

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        return "conv1x1", shapes.arg_shape(node.args[1])[1]


class MatMul(Pixel):
    """``matmul(a, b)`` of an image ``a`` whose image axes are batch or row dims, not the
    contracted last one, by a small ``b`` that spans neither image axis: each pixel's row of ``a``
    times ``b`` (a linear map per sample or head, as linear attention applies its summary); or of
    two images of one rank whose image axes are the same batch dims: a matrix product per pixel (a
    lambda layer's queries by its position lambdas)."""

    backward_factor = 2
    weight_gradient_factor = 1

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        a, b = node.args[:2]
        images = shapes.sliced_inputs(node)
        if a.kind == b.kind == "node" and images == (a.value, b.value):
            ranks = [len(shapes.shape(name)) for name in images]
            if ranks[0] != ranks[1] or any(d >= ranks[0] - 2 for d in shapes.spatial(a.value)):
                return "a matmul of two images over their image axes"
            return super().check(node, shapes)
        if images != (a.value,):
            return "a matmul whose right operand is the image"
        if len(shapes.shape(a.value)) - 1 in shapes.spatial(a.value):
            return WHOLE_MAP
        rank, shape = len(node.shape), shapes.arg_shape(b)
        offset = rank - len(shape)
        if len(shape) < 2 or any(0 <= d - offset < len(shape) - 2 and shape[d - offset] > 1 for d in node.spatial):
            return "its right operand spans the image axes"
        return super().check(node, shapes)

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        return 2 * shapes.shape(node.inputs[0])[-1]

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        return "conv1x1", shapes.shape(node.inputs[0])[-1]


class Channels(Pixel):
    """``cat`` / ``chunk`` / ``split`` along channels (``dim_arg``: the argument holding the dim)."""

    def __init__(self, *names: str, dim_arg: int, **attributes):
        super().__init__(*names, **attributes)
        self.dim_arg = dim_arg

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        source = shapes.sliced_inputs(node)[0]
        if dim(const(node, self.dim_arg, 0), len(shapes.shape(source))) in shapes.spatial(source):
            return "concatenating or splitting along an image axis is not supported"
        return super().check(node, shapes)


class Stack(Pixel):
    """``stack`` along a new dim ``d`` and ``unbind`` of a dim ``d`` that is not an image axis
    (smp's FPN merges its pyramid by ``torch.stack(features).sum(0)``): per pixel, the image axes
    at or after ``d`` shift by one dim (``stack``: later, ``unbind``: earlier)."""

    view = True
    pass_through = True
    saves = "nothing"

    def image_layout(self, node: NodeSpec, shapes: Shapes, source: str, rows: int, cols: int):
        ndim = len(shapes.shape(source))
        if node.op == "stack":
            return after_inserting((rows, cols), dim(const(node, 1, 0), ndim + 1))
        return after_removing((rows, cols), (dim(const(node, 1, 0), ndim),))

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if node.spatial is None:
            return "unbinding an image axis is not supported"
        return super().check(node, shapes)

    def batchable(self, node: NodeSpec, shapes: Shapes) -> bool:
        ndim = len(shapes.shape(node.inputs[0])) + (node.op == "stack")
        return dim(const(node, 1, 0), ndim) > 0  # the samples stay along dim 0


class Squeeze(Pixel):
    """``unsqueeze`` / ``squeeze`` of a dim other than the image axes: per pixel, the image axes after
    it shift by one. ``squeeze()`` of every unit dim runs untiled: a tile's axis may be one pixel long
    where the image's is not."""

    view = True
    pass_through = True
    saves = "nothing"

    def dims(self, node: NodeSpec, ndim: int) -> tuple[int, ...] | None:
        """The dim ``unsqueeze`` inserts (of ``ndim + 1``) or those ``squeeze`` removes (of ``ndim``);
        ``None`` for ``squeeze()``."""
        if node.op == "unsqueeze":
            return (dim(const(node, 1), ndim + 1),)
        if node.target.endswith(".default"):
            return None
        value = const(node, 1)
        return tuple(dim(d, ndim) for d in ((value,) if isinstance(value, int) else value))

    def image_layout(self, node: NodeSpec, shapes: Shapes, source: str, rows: int, cols: int):
        dims = self.dims(node, len(shapes.shape(source)))
        if dims is None:
            return None
        return after_inserting((rows, cols), dims[0]) if node.op == "unsqueeze" else after_removing((rows, cols), dims)

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if node.spatial is None:
            return WHOLE_MAP
        return super().check(node, shapes)

    def batchable(self, node: NodeSpec, shapes: Shapes) -> bool:
        dims = self.dims(node, len(shapes.arg_shape(node.args[0])))  # of a parameter too (a weight squeezed)
        return dims is not None and 0 not in dims  # the samples stay along dim 0


class GetItem(Pixel):
    """``getitem`` of an op's list result (chunks, splits): the element, cropped to the tile's read."""

    view = True
    pass_through = True
    saves = "nothing"

    def element_bytes(self, node: NodeSpec, shapes: Shapes, floating: int) -> int:
        """The indices of a pair of values and indices (``Op.index_output``) take 8 bytes each."""
        from tilec.ops import rule  # the op table imports this module

        source = shapes.nodes.get(node.args[0].value)
        paired = source is not None and rule(source).index_output and node.args[1].value == 1
        return INDEX_BYTES if paired else floating

    def emit(self, node: NodeSpec, tile) -> str:
        source = node.args[0].value
        rows, cols = tile.local(source)
        return f"{tile.var(source)}[{node.args[1].value}]{tile.index(len(node.shape), node.spatial, rows, cols)}"
