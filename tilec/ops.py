"""The op table: which aten ops tile, and each one's per-axis halo rule.

Every tileable op has exactly one rule, ``RULES[kind](node, axis, out, producers)``: for an
output interval ``out`` on one axis, the *unclipped* interval it needs of each sliced input
and whether clipping that interval means border padding (conv, pooling, constant pad) or
simply nothing to read (transposed convolution). The planner clips and records the padding.
Rules are 1-D; the 2-D problem is the product of the row and the column problem.

Kinds: ``window`` (conv2d, max/avg pooling), ``conv_transpose``, ``upsample`` (nearest,
nearest-exact, bilinear; index maps come from PyTorch's own kernels in ``tilec.resample``),
``pad`` (constant), ``slice`` and ``pixel`` (everything that maps a position to itself:
activations, eval BatchNorm, elementwise arithmetic, channel concat/chunk/shuffle, the
channels-last LayerNorm/Linear pair and permutes).

``NONLOCAL`` ops read the whole map (global pooling, means over H/W, flatten, group norm...):
they and everything computed only from their results run untiled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tilec.errors import UnsupportedLayerError
from tilec.ir import NodeSpec, Plan
from tilec.regions import Interval, Window
from tilec.resample import resample_map


@dataclass(frozen=True)
class Need:
    """What ``out`` needs of one sliced input on one axis. ``pads``: the clipped part of
    ``interval`` is border padding the tile applies (else it just does not exist)."""

    input: str
    interval: Interval
    pads: bool


def _pair(value) -> tuple[int, int]:
    if isinstance(value, int | float):
        return int(value), int(value)
    values = tuple(int(v) for v in value)
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def const(node: NodeSpec, index: int, default=None):
    """Positional constant ``index`` of ``node`` (``default`` when the call left it out)."""
    return node.args[index].value if index < len(node.args) else default


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
        stride, dilation = (_pair(const(node, i, 1)) for i in (3, 5))
        (rows, _), (cols, _) = conv_padding(node, weight_shape)
        return WindowArgs(kernel, stride, (rows, cols), dilation, False)
    kernel = _pair(const(node, 1))
    stride_value = const(node, 2, ())
    stride = _pair(stride_value) if stride_value not in ((), None) else kernel
    padding = _pair(const(node, 3, 0))
    if node.op == "max_pool2d":
        return WindowArgs(kernel, stride, padding, _pair(const(node, 4, 1)), bool(const(node, 5, False)))
    return WindowArgs(kernel, stride, padding, (1, 1), bool(const(node, 4, False)))


def conv_padding(node: NodeSpec, weight_shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per axis ``(before, after)`` padding of a conv2d, resolving ``'same'`` and ``'valid'``."""
    padding = const(node, 4, 0)
    if padding == "valid":
        return (0, 0), (0, 0)
    if padding == "same":
        dilation = _pair(const(node, 5, 1))
        result = []
        for axis in range(2):
            total = dilation[axis] * (weight_shape[2 + axis] - 1)
            result.append((total // 2, total - total // 2))
        return result[0], result[1]
    rows, cols = _pair(padding)
    return (rows, rows), (cols, cols)


@dataclass(frozen=True)
class Context:
    """What a rule may look up: every node by name, and model tensor shapes by name."""

    nodes: dict[str, NodeSpec]
    tensor_shapes: dict[str, tuple[int, ...]]
    input_shape: tuple[int, ...]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.input_shape if name == "input" else self.nodes[name].shape

    def spatial(self, name: str) -> tuple[int, int] | None:
        return (2, 3) if name == "input" else self.nodes[name].spatial

    def size(self, name: str, axis: int) -> int:
        return self.shape(name)[self.spatial(name)[axis]]


def plan_context(plan: Plan) -> Context:
    """The look-ups over a plan's own nodes and tensors."""
    return Context({n.name: n for n in plan.model.nodes}, {t.name: t.shape for t in plan.model.tensors},
                   tuple(plan.input_shape))


def sliced_inputs(node: NodeSpec, context: Context) -> tuple[str, ...]:
    """The inputs a tile of ``node`` slices: image tensors (others are broadcast whole)."""
    return tuple(dict.fromkeys(name for name in node.inputs if is_image(context, name)))


def is_image(context: Context, name: str) -> bool:
    spatial = context.spatial(name)
    if spatial is None:
        return False
    shape = context.shape(name)
    return shape[spatial[0]] * shape[spatial[1]] > 1


def _window_rule(node: NodeSpec, axis: int, out: Interval, context: Context) -> list[Need]:
    source = node.inputs[0]
    if node.op == "conv2d":
        weight = context.tensor_shapes[node.args[1].value]
        args = window_args(node, weight)
        before, after = conv_padding(node, weight)[axis]
        win = Window(args.kernel[axis], args.stride[axis], args.dilation[axis], before, after)
    else:
        win = window_args(node).axis(axis)
    return [Need(source, win.input_interval(out), True)]


def transpose_args(node: NodeSpec, weight_shape) -> dict[str, tuple[int, int]]:
    """``conv_transpose2d(x, w, b, stride, padding, output_padding, groups, dilation)``."""
    return {
        "kernel": tuple(weight_shape[2:]),
        "stride": _pair(const(node, 3, 1)),
        "padding": _pair(const(node, 4, 0)),
        "output_padding": _pair(const(node, 5, 0)),
        "dilation": _pair(const(node, 7, 1)),
    }


def transpose_interval(out: Interval, kernel: int, stride: int, padding: int, dilation: int) -> Interval:
    """Inputs ``i`` feeding outputs ``[a, b)``: ``o = i*s - p + j*d`` for some ``j`` in ``[0, k)``."""
    start = -(-(out.start + padding - (kernel - 1) * dilation) // stride)
    stop = (out.stop - 1 + padding) // stride + 1
    return Interval(start, max(start, stop))


def _transpose_rule(node: NodeSpec, axis: int, out: Interval, context: Context) -> list[Need]:
    """The inputs feeding ``out``, widened so that the tile's local transposed convolution starts
    at or before ``out.start`` (it crops, never pads in front) and reads at least one real input:
    outputs no input reaches (gaps when the stride exceeds the kernel's span, output padding past
    the last tap) are the bias alone, computed by the local convolution like any other."""
    args = transpose_args(node, context.tensor_shapes[node.args[1].value])
    kernel, stride, padding, dilation = (args[k][axis] for k in ("kernel", "stride", "padding", "dilation"))
    interval = transpose_interval(out, kernel, stride, padding, dilation)
    if out.length:
        first_covering = (out.start + padding) // stride  # the last input whose outputs start <= out.start
        last_input = context.size(node.inputs[0], axis) - 1
        interval = Interval(min(interval.start, first_covering, last_input), interval.stop)
    return [Need(node.inputs[0], interval, False)]


def _upsample_rule(node: NodeSpec, axis: int, out: Interval, context: Context) -> list[Need]:
    source = node.inputs[0]
    if not out.length:
        return [Need(source, Interval(0, 0), False)]
    mapping = resample_map(node, axis, context.size(source, axis), node.shape[2 + axis])
    return [Need(source, Interval(*mapping.reads(out.start, out.stop)), False)]


def pad_amounts(node: NodeSpec, axis: int) -> tuple[int, int]:
    """``(before, after)`` of ``aten.pad`` / ``constant_pad_nd`` on a spatial axis (negative crops)."""
    pad = tuple(node.args[1].value)
    dim_from_end = 1 - axis  # pad lists the last dim first: columns, then rows
    if 2 * dim_from_end + 1 >= len(pad):
        return 0, 0
    return pad[2 * dim_from_end], pad[2 * dim_from_end + 1]


def _pad_rule(node: NodeSpec, axis: int, out: Interval, context: Context) -> list[Need]:
    before, _ = pad_amounts(node, axis)
    return [Need(node.inputs[0], out.shift(-before), True)]


def slice_start(node: NodeSpec, context: Context) -> int:
    """Start of a ``slice`` along its (spatial) dim, normalised to ``[0, size]``."""
    size = context.shape(node.inputs[0])[_dim(const(node, 1, 0), len(node.shape))]
    start = const(node, 2, None)
    start = 0 if start is None else start
    return min(max(start + size if start < 0 else start, 0), size)


def _slice_rule(node: NodeSpec, axis: int, out: Interval, context: Context) -> list[Need]:
    source = node.inputs[0]
    dim = _dim(const(node, 1, 0), len(node.shape))
    offset = slice_start(node, context) if dim == context.spatial(source)[axis] else 0
    return [Need(source, out.shift(offset), False)]


def _pixel_rule(node: NodeSpec, axis: int, out: Interval, context: Context) -> list[Need]:
    return [Need(name, out, False) for name in sliced_inputs(node, context)]


RULES: dict[str, Callable[[NodeSpec, int, Interval, Context], list[Need]]] = {
    "window": _window_rule,
    "conv_transpose": _transpose_rule,
    "upsample": _upsample_rule,
    "pad": _pad_rule,
    "slice": _slice_rule,
    "pixel": _pixel_rule,
}


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


#: aten op name -> rule kind. Ops not listed here have no tiling rule.
KINDS: dict[str, str] = {
    "conv2d": "window", "max_pool2d": "window", "avg_pool2d": "window",
    "conv_transpose2d": "conv_transpose",
    "upsample_nearest2d": "upsample", "_upsample_nearest_exact2d": "upsample", "upsample_bilinear2d": "upsample",
    "pad": "pad", "constant_pad_nd": "pad",
    "slice": "slice",
    **dict.fromkeys((
        # activations
        "relu", "relu6", "hardtanh", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "sigmoid", "tanh",
        "hardswish", "hardsigmoid", "mish", "softplus", "prelu", "log_sigmoid", "clamp", "clamp_min", "clamp_max",
        "abs", "neg", "exp", "square", "sqrt", "rsqrt",
        # normalisation and dropout in eval mode, identity copies
        "batch_norm", "_native_batch_norm_legit_no_training", "dropout", "feature_dropout", "alpha_dropout",
        "clone", "contiguous", "alias", "detach", "lift_fresh_copy",
        # arithmetic of same-shape tensors and per-channel scales
        "add", "sub", "mul", "div", "rsub", "maximum", "minimum",
        # channels: concat, chunk, shuffles, channels-last LayerNorm / Linear, channel reductions
        "cat", "chunk", "split", "split_with_sizes", "getitem", "view", "reshape", "_unsafe_view", "permute",
        "transpose", "layer_norm", "linear", "softmax", "_softmax", "log_softmax",
        "mean", "sum", "amax", "squeeze", "unsqueeze",
    ), "pixel"),
}

#: Ops that read the whole map: run untiled (with everything computed only from their result).
NONLOCAL = frozenset({
    "adaptive_avg_pool2d", "adaptive_max_pool2d", "_adaptive_avg_pool2d", "mean", "sum", "amax", "amin", "max",
    "flatten", "view", "reshape", "_unsafe_view", "linear", "group_norm", "instance_norm", "batch_norm",
    "dropout", "feature_dropout", "alpha_dropout", "layer_norm", "std", "var", "norm", "softmax", "_softmax",
    "log_softmax", "transpose", "permute",
})


#: Per-pixel ops a tile runs in place (op -> aten overload): their backward reads their result,
#: as it does out of place (leaky ReLU only with a non-negative slope).
IN_PLACE = {"relu": "aten.relu_.default", "leaky_relu": "aten.leaky_relu_.default",
            "hardtanh": "aten.hardtanh_.default"}
#: Ops whose result is a fresh tensor that their backward does not read: overwriting it in place
#: is invisible to autograd (convolutions keep their input, eval BatchNorm its input and
#: statistics, max-pooling its input and indices).
FRESH_RESULT = frozenset({"conv2d", "conv_transpose2d", "batch_norm", "_native_batch_norm_legit_no_training",
                          "add", "sub", "max_pool2d", "avg_pool2d"})
#: Ops whose backward hands their input a fresh gradient that nothing else reads (add and sub
#: hand the same one to both inputs; views hand on a view of theirs).
FRESH_GRADIENT = frozenset({"conv2d", "conv_transpose2d", "max_pool2d", "avg_pool2d"})


def _reader_counts(nodes: Iterable[NodeSpec]) -> Counter:
    """Per tensor name, how many nodes read it."""
    return Counter(name for node in nodes for name in dict.fromkeys(node.inputs))


def overwrites_input(node: NodeSpec, producer: NodeSpec | None, readers: int, model_output: bool) -> bool:
    """Whether a tile computes ``node`` in place on its first input, the result of ``producer``
    (``None``: a tensor from outside the tile): ``node`` is in ``IN_PLACE``, ``producer`` in
    ``FRESH_RESULT``, and nothing else reads the input (``readers``), which is no model output.
    Saves an allocation per activation in both tile passes; the values are the same."""
    if node.op not in IN_PLACE or producer is None or producer.op not in FRESH_RESULT:
        return False
    if node.op == "leaky_relu" and const(node, 1, 0.01) < 0:
        return False
    return readers == 1 and not model_output


def overwrites_gradient(node: NodeSpec, reader: NodeSpec | None, readers: int, model_output: bool) -> bool:
    """Whether a tile's in-place ``node`` (``overwrites_input``) also back-propagates in place,
    overwriting the output gradient it is handed with its input gradient: when its one reader
    ``reader`` (``None``: outside the tile, whose gradient is the caller's) is in
    ``FRESH_GRADIENT`` and ``node`` is no model output. Saves one gradient-sized allocation per
    activation in the tile backward; the values are the same."""
    return node.op in IN_PLACE and reader is not None and reader.op in FRESH_GRADIENT and readers == 1 \
        and not model_output


def activations_in_place(nodes: Sequence[NodeSpec], model_outputs: Iterable[str]) -> dict[str, str | None]:
    """The activations among ``nodes`` (the model's, in order) that a tile computes in place
    when their input's producer is in its segment (``overwrites_input``), each mapped to its one
    reader's name if it also back-propagates in place when that reader is in its segment
    (``overwrites_gradient``), else ``None``."""
    by_name = {node.name: node for node in nodes}
    readers = _reader_counts(nodes)
    outputs = set(model_outputs)
    first_reader: dict[str, NodeSpec] = {}
    for node in nodes:
        for name in node.inputs:
            first_reader.setdefault(name, node)
    chosen = {}
    for node in nodes:
        source = node.inputs[0] if node.inputs else None
        if source in by_name and overwrites_input(node, by_name[source], readers[source], source in outputs):
            reader = first_reader.get(node.name)
            gradient = overwrites_gradient(node, reader, readers[node.name], node.name in outputs)
            chosen[node.name] = reader.name if gradient else None
    return chosen


def _fail(node: NodeSpec, why: str):
    where = f"module {node.path} ({node.module_type})" if node.path else f"the model's forward ({node.module_type})"
    raise UnsupportedLayerError(f"op aten.{node.op} from {where} is not supported: {why}")


def _reduced_dims(node: NodeSpec, ndim: int) -> set[int]:
    dims = const(node, 1, None)
    if dims is None:
        return set(range(ndim))
    dims = (dims,) if isinstance(dims, int) else dims
    return {_dim(d, ndim) for d in dims}


def tile_check(node: NodeSpec, context: Context) -> str | None:
    """Why ``node`` (which reads an image tensor) cannot run tile by tile, or ``None``.

    The reason is ``"nonlocal"`` when the op reads the whole map (it then runs untiled).
    Raises ``UnsupportedLayerError`` for an op or mode tilec cannot compute at all here.
    """
    op = node.op
    images = sliced_inputs(node, context)
    first = images[0]
    layout = context.spatial(first)
    ndim = len(context.shape(first))
    kind = KINDS.get(op)
    if op in ("batch_norm",) and const(node, 5, False):
        _fail(node, "BatchNorm with batch statistics (training mode, or track_running_stats=False) needs "
                    "statistics of the whole image; call .eval() on the BatchNorm modules (exact training-mode "
                    "BatchNorm is not supported yet)")
    if op in ("dropout", "feature_dropout", "alpha_dropout") and const(node, 2, False) and const(node, 1, 0):
        _fail(node, "Dropout in training mode draws a mask over the whole image; call .eval() on it")
    if op in ("mean", "sum", "amax", "amin", "max", "std", "var", "norm"):
        if len(node.args) < 2 or _reduced_dims(node, ndim) & set(layout):
            return "nonlocal"
    if op in ("softmax", "_softmax", "log_softmax") and _dim(const(node, 1, 0), ndim) in layout:
        return "nonlocal"
    if op in ("view", "reshape", "_unsafe_view"):
        shape = tuple(node.shape)
        source = context.shape(first)
        if layout != (ndim - 2, ndim - 1) or shape[-2:] != source[-2:] or shape[0] != source[0]:
            return "nonlocal"
    if op == "layer_norm" and set(range(ndim - len(const(node, 1, ())), ndim)) & set(layout):
        return "nonlocal"
    if op == "linear" and ndim - 1 in layout:
        return "nonlocal"
    if op in ("transpose", "permute") and node.spatial is None:
        return "nonlocal"
    if op in ("cat", "chunk", "split", "split_with_sizes") and _dim(const(node, 1 if op == "cat" else 2, 0),
                                                                      ndim) in layout:
        _fail(node, "concatenating or splitting along an image axis is not supported")
    if op in ("squeeze", "unsqueeze"):
        return "nonlocal"
    if op in NONLOCAL and kind is None:
        return "nonlocal"
    if kind is None:
        _fail(node, "tilec has no tiling rule for it")
    if kind == "pad" and op == "pad" and const(node, 2, "constant") not in ("constant", None):
        _fail(node, f"padding mode {const(node, 2)!r} is not supported (only 'constant')")
    if kind == "slice" and const(node, 4, 1) != 1:
        _fail(node, "slicing with a step other than 1 is not supported")
    if kind == "pixel" and len(images) > 1 and any(context.spatial(n) != layout for n in images):
        _fail(node, "its inputs hold the image axes in different dims")
    if kind == "pixel":
        for name in node.inputs:
            if name in images:
                if tuple(context.shape(name)[d] for d in layout) != tuple(node.shape[d] for d in node.spatial or ()):
                    _fail(node, "it broadcasts one image over another of a different size")
    if kind == "upsample" and (layout != (2, 3) or len(node.shape) != 4):
        _fail(node, "upsampling needs an NCHW input")
    return None
