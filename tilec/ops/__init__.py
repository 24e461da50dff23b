"""The op table: one rule object per op family, registered by aten op name (``RULES``).

Each entry is everything tilec knows about its ops (``tilec.ops.base.Op``): the layout of the
result, whether and how it tiles (its per-axis halo rule), the output size the rule implies,
the local constants and the expression a tile computes it with, its FLOPs, and what its
backward keeps. Adding an op is one entry here (or one class beside the family it joins).

Families: window ops (``window``), transposed convolution (``transpose``), upsampling
(``resample``), padding and slicing (``crop``), per-pixel ops (``pixel``), and ops that
read the whole map (``Whole``: they and what is computed only from their results run untiled).
An op with no entry has no tiling rule (``UNKNOWN``): it runs in untiled segments only.
"""

from __future__ import annotations

from tilec.graph import Shapes
from tilec.ir import NodeSpec
from tilec.ops.base import Need, Op, Whole, const, fail
from tilec.ops.crop import Pad, Slice
from tilec.ops.pixel import (
    BatchNorm,
    ChannelReduction,
    Channels,
    Dropout,
    GetItem,
    LayerNorm,
    Linear,
    Move,
    Pixel,
    Reshape,
    Softmax,
    Squeeze,
)
from tilec.ops.resample import Upsample
from tilec.ops.transpose import ConvTranspose2d
from tilec.ops.window import AvgPool2d, Conv2d, MaxPool2d

#: Every op family, one entry per group of aten ops that share their rules.
OPS: tuple[Op, ...] = (
    Conv2d("conv2d"),
    MaxPool2d("max_pool2d"),
    AvgPool2d("avg_pool2d"),
    ConvTranspose2d("conv_transpose2d"),
    Upsample("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d"),
    Pad("pad", "constant_pad_nd"),
    Slice("slice"),
    # activations whose backward reads their result, run in place by tiles where that is safe
    Pixel("relu", saves="output", in_place="aten.relu_.default", in_place_grad="relu_grad_"),
    Pixel("hardtanh", saves="output", in_place="aten.hardtanh_.default", in_place_grad="hardtanh_grad_"),
    Pixel("leaky_relu", in_place="aten.leaky_relu_.default", in_place_grad="leaky_relu_grad_"),
    Pixel("relu6", "sigmoid", "tanh", "exp", "sqrt", "rsqrt", saves="output"),
    Pixel("elu", "selu", "celu", "gelu", "silu", "hardswish", "hardsigmoid", "mish", "softplus", "prelu",
          "log_sigmoid", "clamp", "clamp_min", "clamp_max", "abs", "square"),
    Pixel("neg", saves="nothing"),
    # arithmetic of same-shape tensors and per-channel scales
    Pixel("add", pass_through=True, saves="nothing", fresh_result=True),
    Pixel("sub", saves="nothing", fresh_result=True),
    Pixel("rsub", saves="nothing"),
    Pixel("mul", "div", "maximum", "minimum", saves="inputs"),
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
    Reshape("view", "reshape", "_unsafe_view"),
    Move("permute", "transpose"),
    LayerNorm("layer_norm"),
    Linear("linear"),
    Softmax("softmax", "_softmax", "log_softmax"),
    ChannelReduction("mean", "sum", saves="nothing"),
    ChannelReduction("amax"),
    Squeeze("squeeze", "unsqueeze"),
    # ops that read the whole map: untiled
    Whole("adaptive_avg_pool2d", "_adaptive_avg_pool2d", "adaptive_max_pool2d", "amin", "max", "std", "var",
          "norm", "flatten", "instance_norm"),
    Whole("group_norm", flop_count=5),
    # views and random ops without a tiling rule (untiled segments only)
    Op("expand", "select", view=True, pass_through=True, saves="nothing"),
    Op("native_dropout", "bernoulli", "rand", "randn", "rand_like", "randn_like", random=True),
)

RULES: dict[str, Op] = {name: op for op in OPS for name in op.names}
#: The rules of an op with no entry: no tiling rule.
UNKNOWN = Op()


def rule(node_or_op) -> Op:
    """The rule object of a node (or an aten op name)."""
    return RULES.get(node_or_op if isinstance(node_or_op, str) else node_or_op.op, UNKNOWN)


def tileable(node: NodeSpec, shapes: Shapes) -> bool:
    """Whether ``node`` runs tile by tile: it reads an image, its rule has no objection
    (``Op.check``, which raises for what tilec cannot compute at all), and it outputs an image."""
    return (bool(shapes.sliced_inputs(node)) and rule(node).check(node, shapes) is None
            and node.spatial is not None and node.shape[node.spatial[0]] * node.shape[node.spatial[1]] > 1)


__all__ = ["OPS", "RULES", "UNKNOWN", "Need", "Op", "const", "fail", "rule", "tileable"]
