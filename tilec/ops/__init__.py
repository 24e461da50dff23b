"""The op table: one rule object per op family, registered by aten op name (``RULES``).

Each entry is everything tilec knows about its ops (``tilec.ops.base.Op``): the layout of the
result, whether and how it tiles (its per-axis halo rule), the output size the rule implies,
the local constants and the expression a tile computes it with, its FLOPs, and what its
backward keeps. Adding an op is one entry here (or one class beside the family it joins).

Families: window ops (``window``), max pooling's indices and unpooling to them (``unpool``),
transposed convolution (``transpose``), upsampling (``resample``), pixel shuffles (``shuffle``),
padding and slicing (``crop``), per-pixel ops (``pixel``), reductions over the image (``reduce``,
``loss``: computed by sweeps inside tiled segments), and ops that read the whole map otherwise
(``Whole``: they and what is computed only from their results run untiled).
An op with no entry has no tiling rule (``UNKNOWN``): it runs untiled, in stored segments
(``why_untiled`` says so for each node).
"""

from __future__ import annotations

from math import prod

from tilec.graph import Shapes, updates_buffer
from tilec.ir import NodeSpec
from tilec.ops.base import WHOLE_MAP, Need, Op, Whole, const
from tilec.ops.crop import Pad, Slice
from tilec.ops.factory import Factory
from tilec.ops.loss import Loss
from tilec.ops.pixel import (
    BatchNorm,
    ChannelArgMax,
    ChannelReduction,
    Channels,
    Dropout,
    GetItem,
    LayerNorm,
    Linear,
    MatMul,
    Move,
    Pixel,
    Reshape,
    Softmax,
    Squeeze,
    Stack,
    is_batch_norm_module,
)
from tilec.ops.reduce import Contraction, MaxPool, Normalise, Pool
from tilec.ops.resample import Upsample
from tilec.ops.shuffle import PixelShuffle, PixelUnshuffle
from tilec.ops.transpose import ConvTranspose2d
from tilec.ops.unpool import MaxPoolIndices, MaxUnpool2d
from tilec.ops.window import AvgPool2d, Conv2d, MaxPool2d

#: Every op family, one entry per group of aten ops that share their rules.
OPS: tuple[Op, ...] = (
    Conv2d("conv2d"),
    MaxPool2d("max_pool2d"),
    AvgPool2d("avg_pool2d"),
    MaxPoolIndices("max_pool2d_with_indices"),
    MaxUnpool2d("max_unpool2d"),
    ConvTranspose2d("conv_transpose2d"),
    Upsample("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d", "upsample_bicubic2d"),
    PixelShuffle("pixel_shuffle"),
    PixelUnshuffle("pixel_unshuffle"),
    Pad("pad", "constant_pad_nd"),
    Slice("slice"),
    # activations whose backward reads their result, run in place by tiles where that is safe
    Pixel("relu", saves="output", in_place="aten.relu_.default", in_place_grad="relu_grad_"),
    Pixel("hardtanh", saves="output", in_place="aten.hardtanh_.default", in_place_grad="hardtanh_grad_"),
    Pixel("leaky_relu", in_place="aten.leaky_relu_.default", in_place_grad="leaky_relu_grad_"),
    Pixel("relu6", "sigmoid", "tanh", "exp", "sqrt", "rsqrt", saves="output"),
    Pixel("elu", "selu", "celu", "gelu", "silu", "hardswish", "hardsigmoid", "mish", "softplus", "prelu",
          "log_sigmoid", "clamp", "clamp_min", "clamp_max", "abs", "square"),
    Pixel("log", "log2", "log10", "log1p", "expm1", "exp2", "sin", "cos", "tan", "atan", "asinh", "sinh", "cosh",
          "erf", "erfc", "logit", "hardshrink", "softshrink", "threshold"),
    Pixel("reciprocal", saves="output"),
    Pixel("neg", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", saves="nothing"),
    # arithmetic of same-shape tensors and per-channel scales
    Pixel("add", pass_through=True, saves="nothing", fresh_result=True, broadcasts=True),
    Pixel("sub", saves="nothing", fresh_result=True, broadcasts=True),
    Pixel("rsub", saves="nothing", broadcasts=True),
    Pixel("mul", "div", "maximum", "minimum", "addcmul", "addcdiv", "pow", saves="inputs", broadcasts=True),
    # casts, and writes of a tensor into channels of another (``tilec.functionalize``)
    Pixel("to", "_to_copy", "copy", saves="nothing"),
    Channels("slice_scatter", dim_arg=2, saves="nothing"),
    # normalisation and dropout in eval mode, identity copies
    BatchNorm("batch_norm", training_flag=5),
    BatchNorm("_native_batch_norm_legit_no_training"),
    Dropout("dropout", "feature_dropout", "alpha_dropout"),
    Pixel("clone", "contiguous", "alias", "detach", "lift_fresh_copy", view=True, pass_through=True,
          saves="nothing"),
    # channels: concat, chunk, shuffles, channels-last LayerNorm / Linear, channel reductions
    Channels("cat", dim_arg=1, pass_through=True, saves="nothing"),
    Channels("chunk", "split", "split_with_sizes", dim_arg=2, view=True, pass_through=True, saves="nothing"),
    GetItem("getitem"),
    Stack("stack", "unbind"),
    Reshape("view", "reshape", "_unsafe_view"),
    Move("permute", "transpose"),
    LayerNorm("layer_norm"),
    Linear("linear"),
    MatMul("matmul"),
    Softmax("softmax", "_softmax", "log_softmax"),
    ChannelReduction("mean", "sum", saves="nothing"),
    ChannelReduction("linalg_vector_norm"),
    ChannelReduction("amax", "amin", "logsumexp"),
    ChannelReduction("var", "std", "var_mean", "max", "min"),
    Squeeze("squeeze", "unsqueeze"),
    ChannelArgMax("argmax", saves="nothing"),
    Pixel("gt", "lt", "ge", "le", "eq", "ne", "logical_and", "logical_or", "logical_not", "where", saves="nothing",
          broadcasts=True),
    Pixel("broadcast_tensors", view=True, pass_through=True, saves="nothing"),
    Pixel("expand_as", view=True, saves="nothing"),  # a small tensor to an image's shape (ECA's channel scale)
    # reductions over the image axes: by sweeps inside tiled segments (``tilec.ops.reduce``)
    Pool("adaptive_avg_pool2d", "_adaptive_avg_pool2d"),
    MaxPool("adaptive_max_pool2d"),
    Contraction("einsum"),
    Normalise("group_norm", "instance_norm"),
    Loss("cross_entropy_loss", "nll_loss_nd", reduction_arg=3, weighted=True),
    Loss("binary_cross_entropy_with_logits", reduction_arg=4),
    Loss("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", reduction_arg=2),
    # ops that read the whole map otherwise: untiled
    Whole("norm", "flatten"),
    # constant maps of an image's shape, made by each tile; of other shapes, small ops
    Factory("empty", "zeros", "ones", "full"),
    Pixel("fill", "zeros_like", "ones_like", "full_like", "empty_like", saves="nothing"),
    # views and random ops without a tiling rule (untiled segments, or once per step in tiled ones)
    Op("expand", "select", view=True, pass_through=True, saves="nothing"),
    Op("native_dropout", "bernoulli", "bernoulli_", "uniform_", "normal_", "exponential_", "random_", "rand",
       "randn", "randint", "randperm", "rand_like", "randn_like", "normal", "poisson", "multinomial", random=True),
)

RULES: dict[str, Op] = {name: op for op in OPS for name in op.names}
#: The rules of an op with no entry: no tiling rule.
UNKNOWN = Op()


def rule(node_or_op) -> Op:
    """The rule object of a node (or an aten op name)."""
    return RULES.get(node_or_op if isinstance(node_or_op, str) else node_or_op.op, UNKNOWN)


def mode_flag(node: NodeSpec) -> int | None:
    """The argument holding ``node``'s training flag where the flag follows its module's mode at run
    time: ``batch_norm`` run by an ``nn.BatchNorm*`` module, dropout by an ``nn.Dropout*`` one.
    Elsewhere the flag is the constant the forward passed (weight standardisation's batch
    statistics in either mode); where it follows ``self.training``, the modes' graphs differ."""
    flag = rule(node).training_flag
    if flag is None or flag >= len(node.args):
        return None
    follows = is_batch_norm_module(node) if node.op == "batch_norm" else "Dropout" in node.module_type
    return flag if follows else None


def _after_reduction(name: str, shapes: Shapes, seen: dict[str, bool]) -> bool:
    """Whether tensor ``name`` depends on a reduction (an op reading an image to a small result)."""
    if name not in shapes.nodes:
        return False
    if name not in seen:
        node = shapes.nodes[name]
        seen[name] = (bool(shapes.sliced_inputs(node)) and not shapes.is_image(name)) or any(
            _after_reduction(i, shapes, seen) for i in node.inputs)
    return seen[name]


def lost(name: str, shapes: Shapes, seen: dict[str, bool] | None = None) -> bool:
    """Whether tensor ``name`` holds an image's values without its image axes: the result of an op
    that runs untiled on an image for another reason than reading the whole map (an ``unbind`` of
    its rows, an op with no rule on a 5-D view), or reading it whole into as many elements (a
    ``flatten`` of the pixels into tokens, not a pooling), or computed from such a result without
    image axes.
    What computes on it runs untiled too, up to the first op that makes an image of it again
    (``tilec.trace`` gives a 4-D result image axes 2 and 3), so that no small op of a tiled segment
    holds an image's worth of values."""
    seen = {} if seen is None else seen
    if name not in shapes.nodes or shapes.is_image(name):
        return False
    if name not in seen:
        node = shapes.nodes[name]
        op = rule(node)
        if images := shapes.sliced_inputs(node):
            why = None if op.reduces(node, shapes) else op.check(node, shapes)
            whole = why == WHOLE_MAP and prod(node.shape) >= prod(shapes.shape(images[0]))
            seen[name] = why not in (None, WHOLE_MAP) or whole
        else:
            seen[name] = any(lost(i, shapes, seen) for i in node.inputs)
    return seen[name]


def why_untiled(node: NodeSpec, shapes: Shapes) -> str | None:
    """Why ``node`` runs untiled, in a stored segment, in a few words; ``None``: it may run in a
    tiled segment, tile by tile (it reads an image, its rule has no objection, ``Op.check``, and it
    outputs an image; or it makes an image of small inputs, ``Op.spreads``), as a reduction by
    sweeps (``Op.reduces``), or once per sweep as a *small* op (no image in or out; one writing into
    a buffer, as EvoNorm's running variance, and a training-mode BatchNorm's running statistics
    update it in the forward pass alone, ``tilec.codegen``); a random small op only where no reduction
    precedes it, so that it is drawn once per step."""
    op = rule(node)
    image = node.spatial is not None and node.shape[node.spatial[0]] * node.shape[node.spatial[1]] > 1
    if not shapes.sliced_inputs(node):
        if image:
            return None if op.spreads(node, shapes) else "it makes an image of tensors that are not images"
        if any(lost(i, shapes) for i in node.inputs):
            return "it computes on an image's values without its image axes"
        if op.draws(node) and any(_after_reduction(i, shapes, {}) for i in node.inputs):
            return "it draws random numbers from a reduction's result"
        return None
    if op.reduces(node, shapes):
        return None
    return op.check(node, shapes) or (None if image else "it makes a tensor without image axes of an image")


def tileable(node: NodeSpec, shapes: Shapes) -> bool:
    """Whether ``node`` may run in a tiled segment (``why_untiled``)."""
    return why_untiled(node, shapes) is None


__all__ = ["OPS", "RULES", "UNKNOWN", "Need", "Op", "const", "lost", "mode_flag", "rule", "tileable", "why_untiled",
           "updates_buffer"]
