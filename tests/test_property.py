"""Property tests: random DAG models, input sizes, grids and segmentations tile exactly.

A model is a drawn *program*: a list of steps over a growing list of tensors (the input first).
A step reads earlier tensors, so skips cross any number of steps: window ops (conv with random
kernel / stride / padding / dilation / groups, some standardising their weights in the forward,
max and avg pooling with ceil_mode, transposed conv, nearest or bilinear upsampling followed by a
conv), per-pixel ops (activations, eval
BatchNorm), residual adds of same-shape tensors, channel concat of same-size tensors, and
constant pad / crop of one tensor to another's size before an add or concat. Each model is
checked on the CPU's tile kernels and on the generic ones (``kernels="generic"``, CUDA's path).

With ``reductions``, a program also draws ops that reduce over the image inside tiled segments
(``tilec.sweeps``): BatchNorm with batch statistics (training mode, updating its running
statistics, or without them), GroupNorm, squeeze-and-excitation blocks, ConvNeXt-V2's global
response norm (a 2-norm over the image, NCHW or channels-last), EvoNorm's group deviation
``expand``-ed to the map with a gate of maxima over the channels, and may end in a pooled
classifier head; drawn grids and segmentations then put one, two or more levels of reductions in
a tiled segment, or cut right before a reduction (a direct level).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from tilec.errors import GridError
from tilec.ops import rule
from tilec.pipeline import build, plan_for
from tilec.regions import Interval, Period
from tilec.sweeps import owned_sizes, role
from tilec.target import REFERENCE
from tilec.trace import trace
from tilec.validate import validate

from support.exactness import check_exact

#: Fixed examples (derandomized) for reproducible CI. Shrinking a failure of these models takes
#: minutes, so it is off unless TILEC_SHRINK=1 is set; the failing example is printed either way.
PROPERTY = settings(
    max_examples=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if os.environ.get("TILEC_SHRINK") == "1" else []),
)

#: The tile kernels every drawn model runs on: the CPU's and the generic ones.
KERNELS = ("auto", "generic")

#: Numbers the drawn models' traces apart (``check_exact(traced_as=...)``).
_DRAWN = itertools.count()


def check_on_both_kernels(model: nn.Module, shape, **options) -> None:
    """``check_exact`` on each of ``KERNELS``, both compiles from one trace of ``model``."""
    name = f"drawn {next(_DRAWN)}"
    for kernels in KERNELS:
        check_exact(model, shape, kernels=kernels, traced_as=name, **options)


@dataclass(frozen=True)
class Step:
    kind: str  # "module", "add", "cat" or "pad"
    inputs: tuple[int, ...]
    pad: tuple[int, ...] = ()


class Program(nn.Module):
    """Runs ``steps`` over a list of tensors that starts with the input; returns ``outputs``."""

    def __init__(self, steps: list[Step], modules: list[nn.Module], outputs: tuple[int, ...], tree: str):
        super().__init__()
        self.steps, self.outputs, self.tree = steps, outputs, tree
        self.layers = nn.ModuleList(modules)

    def forward(self, x):
        values = [x]
        for step, layer in zip(self.steps, self.layers, strict=True):
            args = [values[i] for i in step.inputs]
            if step.kind == "module":
                values.append(layer(args[0]))
            elif step.kind == "add":
                values.append(args[0] + args[1])
            elif step.kind == "cat":
                values.append(torch.cat(args, dim=1))
            else:
                values.append(F.pad(args[0], step.pad))
        results = [values[i] for i in self.outputs]
        if self.tree == "tuple":
            return tuple(results)
        if self.tree == "dict":
            return {f"out{i}": r for i, r in enumerate(results)}
        return results[0]

    def extra_repr(self) -> str:
        return f"steps={self.steps}, outputs={self.outputs}, tree={self.tree}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def _conv(draw, channels: int, convolution: type = nn.Conv2d) -> nn.Module:
    out = draw(st.integers(1, 4))
    groups = draw(st.sampled_from([g for g in _divisors(channels) if out % g == 0]))
    kernel = draw(st.one_of(st.integers(1, 4), st.tuples(st.integers(1, 4), st.integers(1, 4))))
    if channels // groups * (kernel * kernel if isinstance(kernel, int) else kernel[0] * kernel[1]) == 1:
        convolution = nn.Conv2d  # one weight per output channel: no statistics to standardise it by
    return convolution(channels, out, kernel, stride=draw(st.sampled_from([1, 1, 2, 3, (1, 2), (2, 1)])),
                     padding=draw(st.one_of(st.integers(0, 3), st.tuples(st.integers(0, 3), st.integers(0, 3)))),
                     dilation=draw(st.sampled_from([1, 1, 2, (1, 2)])), groups=groups, bias=draw(st.booleans()))


@st.composite
def _conv_relu_inplace(draw, channels: int) -> nn.Module:
    """A conv followed by an in-place activation (the conv's output is not saved for backward)."""
    activation = draw(st.sampled_from([nn.ReLU(inplace=True), nn.LeakyReLU(0.1, inplace=True),
                                       nn.Hardtanh(-0.5, 0.5, inplace=True)]))
    return nn.Sequential(draw(_conv(channels)), activation)


@st.composite
def _pool(draw, channels: int) -> nn.Module:
    kernel = draw(st.integers(1, 4))
    stride = draw(st.sampled_from([None, 1, 2, 3]))
    padding = draw(st.integers(0, kernel // 2))
    ceil_mode = draw(st.booleans())
    if draw(st.booleans()):
        return nn.MaxPool2d(kernel, stride=stride, padding=padding, dilation=draw(st.sampled_from([1, 1, 2])),
                            ceil_mode=ceil_mode)
    return nn.AvgPool2d(kernel, stride=stride, padding=padding, ceil_mode=ceil_mode,
                        count_include_pad=draw(st.booleans()),
                        divisor_override=draw(st.sampled_from([None, None, 3])))


@st.composite
def _transpose(draw, channels: int) -> nn.Module:
    kernel = draw(st.integers(1, 4))
    dilation = draw(st.sampled_from([1, 1, 2]))
    # Strides beyond the taps' spacing and output padding past the last tap leave outputs no
    # input reaches (the bias alone): drawn on purpose.
    stride = draw(st.integers(1, 3))
    padding = draw(st.integers(0, kernel - 1))
    groups = draw(st.sampled_from([1, 2])) if channels % 2 == 0 else 1
    return nn.ConvTranspose2d(channels, groups * draw(st.integers(1, 2)), kernel, stride=stride, padding=padding,
                              output_padding=draw(st.integers(0, max(stride, dilation) - 1)),
                              dilation=dilation, groups=groups)


class Upsample(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, x):
        return F.interpolate(x, **self.options)


@st.composite
def _upsample_conv(draw, channels: int) -> nn.Module:
    mode = draw(st.sampled_from(["nearest", "nearest-exact", "bilinear", "bilinear_corners"]))
    options = {"mode": "bilinear", "align_corners": mode == "bilinear_corners"} if "bilinear" in mode else {
        "mode": mode}
    if draw(st.booleans()):
        options["scale_factor"] = draw(st.sampled_from([2, 1.5, 1.7, 2.5, (2, 1.7)]))
    else:
        options["size"] = draw(st.tuples(st.integers(2, 40), st.integers(2, 40)))
    return nn.Sequential(Upsample(**options), nn.Conv2d(channels, draw(st.integers(1, 4)), 3, padding=1))


class Shuffle(nn.Module):
    """Sub-pixel upsampling (a 1x1 convolution to ``r²`` times the channels, ``pixel_shuffle``), or
    space to depth (``pixel_unshuffle`` of the image cropped to multiples of ``r``, a 1x1 convolution)."""

    def __init__(self, channels: int, out: int, r: int, up: bool):
        super().__init__()
        self.r, self.up = r, up
        self.conv = nn.Conv2d(channels, out * r * r, 1) if up else nn.Conv2d(channels * r * r, out, 1)

    def forward(self, x):
        if self.up:
            return F.pixel_shuffle(self.conv(x), self.r)
        rows, cols = x.shape[2] // self.r * self.r, x.shape[3] // self.r * self.r
        return self.conv(F.pixel_unshuffle(x[:, :, :rows, :cols], self.r))


@st.composite
def _shuffle(draw, channels: int) -> nn.Module:
    return Shuffle(channels, draw(st.integers(1, 3)), draw(st.integers(2, 3)), draw(st.booleans()))


class Untiled(nn.Module):
    """An op tilec runs untiled, in a stored segment between tiled ones: a flip, a roll or a
    running sum along an image axis, or the rows unbound (they leave the image axes) and stacked."""

    def __init__(self, kind: str, axis: int):
        super().__init__()
        self.kind, self.axis = kind, axis

    def forward(self, x):
        if self.kind == "flip":
            return x.flip(self.axis)
        if self.kind == "roll":
            return x.roll(1, self.axis)
        if self.kind == "cumsum":
            return x.cumsum(self.axis) / x.shape[self.axis]
        return torch.stack([row * (k + 1) for k, row in enumerate(x.unbind(self.axis))], self.axis)

    def extra_repr(self) -> str:
        return f"{self.kind}, axis={self.axis}"


class PoolUnpool(nn.Module):
    """SegNet's pair: max pooling with indices, a convolution, unpooling to the indices at the
    input's size (tiled where the windows do not overlap, untiled where they do)."""

    def __init__(self, channels: int, kernel: int, stride: int, padding: int, ceil_mode: bool):
        super().__init__()
        self.pool = {"kernel_size": kernel, "stride": stride, "padding": padding}
        self.ceil_mode, self.conv = ceil_mode, nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        pooled, indices = F.max_pool2d(x, **self.pool, ceil_mode=self.ceil_mode, return_indices=True)
        return F.max_unpool2d(self.conv(pooled), indices, **self.pool, output_size=x.shape[2:])


@st.composite
def _pool_unpool(draw, channels: int) -> nn.Module:
    kernel, stride, padding = draw(st.sampled_from([(2, 2, 0), (3, 3, 1), (2, 3, 0), (3, 2, 1)]))
    return PoolUnpool(channels, kernel, stride, padding, draw(st.booleans()))


@st.composite
def _untiled(draw, channels: int) -> nn.Module:
    return Untiled(draw(st.sampled_from(["flip", "roll", "cumsum", "unbind"])), draw(st.sampled_from([2, 3])))


class StdConv2d(nn.Conv2d):
    """A convolution whose weights its forward standardises per output channel (timm's
    ``StdConv2d``, BiT's): ``batch_norm`` with the weights' batch statistics, in either mode."""

    def forward(self, x):
        weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                              momentum=0.0, eps=1e-5).reshape_as(self.weight)
        return self._conv_forward(x, weight, self.bias)


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2's GRN as timm writes it, on NCHW or through a channels-last permute: each
    channel's 2-norm over the image, over its mean across channels, scales the input."""

    def __init__(self, channels: int, channels_last: bool):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(channels)), nn.Parameter(torch.randn(channels))
        self.channels_last = channels_last

    def forward(self, x):
        if self.channels_last:
            x, dims, channel, shape = x.permute(0, 2, 3, 1), (1, 2), -1, (1, 1, 1, -1)
        else:
            dims, channel, shape = (2, 3), 1, (1, -1, 1, 1)
        norm = x.norm(p=2, dim=dims, keepdim=True)
        y = x + torch.addcmul(self.bias.view(shape), self.weight.view(shape),
                              x * (norm / (norm.mean(dim=channel, keepdim=True) + 1e-6)))
        return y.permute(0, 3, 1, 2) if self.channels_last else y


class TrainingBatchNorm(nn.BatchNorm2d):
    """BatchNorm that stays in training mode (batch statistics, running ones updated) whatever
    mode the program is put in."""

    def train(self, mode: bool = True):
        return super().train(True)


class SqueezeExcite(nn.Module):
    """``norm``: a training-mode BatchNorm between its convolutions (ReXNet's, SK's)."""

    def __init__(self, channels: int, squeeze: int, norm: bool = False):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.norm = TrainingBatchNorm(squeeze) if norm else nn.Identity()
        self.fc2 = nn.Conv2d(squeeze, channels, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(F.relu(self.norm(self.fc1(F.adaptive_avg_pool2d(x, 1))))))


class GroupDeviation(nn.Module):
    """EvoNorm-S0's normalisation, each group's standard deviation ``expand``-ed to the map, then
    CBAM's spatial gate from the maximum and minimum over the channels."""

    def __init__(self, groups: int):
        super().__init__()
        self.groups = groups

    def forward(self, x):
        n, c, h, w = x.shape
        grouped = x.reshape(n, self.groups, c // self.groups, h, w)
        std = grouped.var((2, 3, 4), unbiased=False, keepdim=True).add(1e-5).sqrt()
        y = x * torch.sigmoid(x) / std.expand(grouped.shape).reshape(n, c, h, w)
        return y * torch.sigmoid(y.max(1, keepdim=True)[0] - torch.min(y, 1, keepdim=True).values)


class ImagePooling(nn.Module):
    """DeepLab's image pooling: pooled, a 1x1 convolution, training-mode BatchNorm, upsampled back
    (bilinear or nearest) to the image's size and concatenated with it."""

    def __init__(self, channels: int, out: int, mode: str):
        super().__init__()
        self.mode = mode
        self.conv, self.norm = nn.Conv2d(channels, out, 1), TrainingBatchNorm(out)

    def forward(self, x):
        pooled = self.norm(self.conv(F.adaptive_avg_pool2d(x, 1)))
        options = {"align_corners": False} if self.mode == "bilinear" else {}
        return torch.cat([x, F.interpolate(pooled, size=x.shape[-2:], mode=self.mode, **options)], 1)


class PooledHead(nn.Module):
    """Global average (or max) pooling, flatten, linear: a classifier head."""

    def __init__(self, channels: int, classes: int, pool: str):
        super().__init__()
        self.pool, self.fc = pool, nn.Linear(channels, classes)

    def forward(self, x):
        pooled = x.mean((2, 3)) if self.pool == "mean" else F.adaptive_max_pool2d(x, 1).flatten(1)
        return self.fc(pooled)


@st.composite
def _reduction(draw, channels: int, extras: bool) -> nn.Module:
    kind = draw(st.sampled_from(["batch_norm", "batch_norm", "batch_stats", "group_norm", "se"]
                                + ["grn", "se_norm", "image_pooling", "group_deviation"] * extras))
    if kind == "batch_norm":
        return TrainingBatchNorm(channels, momentum=draw(st.sampled_from([0.1, 0.5, None])))
    if kind == "batch_stats":
        return nn.BatchNorm2d(channels, affine=draw(st.booleans()), track_running_stats=False)
    if kind == "group_norm":
        return nn.GroupNorm(draw(st.sampled_from(_divisors(channels))), channels)
    if kind == "grn":
        return GlobalResponseNorm(channels, draw(st.booleans()))
    if kind == "image_pooling":
        return ImagePooling(channels, draw(st.integers(1, 3)), draw(st.sampled_from(["bilinear", "nearest"])))
    if kind == "group_deviation":
        return GroupDeviation(draw(st.sampled_from(_divisors(channels))))
    if kind == "se_norm":
        return SqueezeExcite(channels, draw(st.integers(1, 3)), norm=True)
    return SqueezeExcite(channels, draw(st.integers(1, 3)))


def _pointwise(kind: str, channels: int) -> nn.Module:
    return {
        "relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh,
        "hardswish": nn.Hardswish, "elu": nn.ELU, "leaky_relu": lambda: nn.LeakyReLU(0.2),
        "batch_norm": lambda: nn.BatchNorm2d(channels).eval(), "dropout": lambda: nn.Dropout(0.3).eval(),
        "identity": nn.Identity,
    }[kind]()


POINTWISE = ("relu", "gelu", "silu", "sigmoid", "tanh", "hardswish", "elu", "leaky_relu", "batch_norm", "dropout",
             "identity")
WINDOWS = {"conv": _conv, "conv_relu_": _conv_relu_inplace, "pool": _pool, "transpose": _transpose,
           "upsample": _upsample_conv}
#: Drawn only for ``programs(extras=True)``: the suite's older properties keep their examples.
EXTRA_WINDOWS = {"std_conv": lambda channels: _conv(channels, StdConv2d), "shuffle": _shuffle, "untiled": _untiled,
                 "pool_unpool": _pool_unpool}


@st.composite
def programs(draw, shape: tuple[int, int, int, int], max_steps: int = 12, reductions: bool = False,
             extras: bool = False) -> Program:
    """A random program over an input of ``shape``; each step's output has at least 2x2 pixels.
    ``reductions``: also reductions over the image (module docstring) and maybe a pooled head;
    ``extras``: also weight-standardised convolutions, pixel shuffles, ops that run untiled, pooling
    with indices and unpooling to them, global response norms, squeeze-and-excitation with a
    BatchNorm and DeepLab's image pooling."""
    values = [torch.zeros(shape)]
    steps, modules = [], []

    def source() -> int:  # mostly the latest tensor (a chain), sometimes any earlier one (a skip)
        last = len(values) - 1
        return last if draw(st.integers(0, 3)) else draw(st.integers(0, last))

    def extend(new_steps: list[Step], new_modules: list[nn.Module]) -> bool:
        """Append the steps if every new tensor has at least 2x2 pixels (and PyTorch runs them)."""
        try:
            with torch.no_grad():
                outs = [Program([*steps, *new_steps[:k + 1]], [*modules, *new_modules[:k + 1]], (len(values) + k,),
                                "tensor").eval()(values[0]) for k in range(len(new_steps))]
        except (RuntimeError, ValueError):
            return False  # the input is too small for this op (a batch of one for a pooled BatchNorm)
        if any(min(out.shape[2:]) < 2 for out in outs):
            return False
        steps.extend(new_steps)
        modules.extend(new_modules)
        values.extend(outs)
        return True

    for _ in range(draw(st.integers(2, max_steps))):
        kind = draw(st.sampled_from(["window", "window", "window", "pointwise", "add", "cat", "pad"]
                                    + ["reduction"] * (2 * reductions)))
        shapes = [tuple(v.shape[1:]) for v in values]
        if kind == "add":
            pairs = [(i, j) for i in range(len(values)) for j in range(i + 1, len(values)) if shapes[i] == shapes[j]]
            if pairs:
                extend([Step("add", draw(st.sampled_from(pairs)))], [nn.Identity()])
        elif kind == "cat":
            pairs = [(i, j) for i in range(len(values)) for j in range(len(values))
                     if shapes[i][1:] == shapes[j][1:] and i != j]
            if pairs:
                extend([Step("cat", draw(st.sampled_from(pairs)))], [nn.Identity()])
        elif kind == "pad":  # pad or crop tensor a to b's size, then add it to b or concat it with b
            a, b = source(), draw(st.integers(0, len(values) - 1))
            pad = []
            for dim in (3, 2):  # F.pad lists the last dim first
                total = values[b].shape[dim] - values[a].shape[dim]
                before = draw(st.integers(min(0, total) - 2, max(0, total) + 2))
                pad += [before, total - before]
            combine = "add" if shapes[a][0] == shapes[b][0] and draw(st.booleans()) else "cat"
            extend([Step("pad", (a,), tuple(pad)), Step(combine, (len(values), b))], [nn.Identity(), nn.Identity()])
        else:
            index = source()
            channels = values[index].shape[1]
            if kind == "pointwise":
                module = _pointwise(draw(st.sampled_from(POINTWISE)), channels)
            elif kind == "reduction":
                module = draw(_reduction(channels, extras))
            else:
                name = draw(st.sampled_from(sorted(WINDOWS) + sorted(EXTRA_WINDOWS) * extras))
                if name in ("transpose", "upsample", "shuffle") and max(values[index].shape[2:]) > 24:
                    name = "conv"
                module = draw({**WINDOWS, **EXTRA_WINDOWS}[name](channels))
            extend([Step("module", (index,))], [module])
    assume(any(s.kind != "module" or not isinstance(m, nn.Identity | nn.Dropout)
               for s, m in zip(steps, modules, strict=True)))
    if reductions and draw(st.booleans()):  # a classifier head on the last tensor
        last = len(values) - 1
        head = PooledHead(values[last].shape[1], draw(st.integers(1, 3)), draw(st.sampled_from(["mean", "max"])))
        steps.append(Step("module", (last,)))
        modules.append(head)
        values.append(head(values[last]))
    last = len(values) - 1
    tree = draw(st.sampled_from(["tensor", "tensor", "tuple", "dict"]))
    outputs = (last,) if tree == "tensor" else (last, draw(st.integers(1, last)))
    live = set(outputs)  # the values the outputs read; 0 is the input
    for k in range(len(steps), 0, -1):
        if k in live:
            live.update(steps[k - 1].inputs)
    assume(any(not isinstance(modules[k - 1], nn.Identity | nn.Dropout) or steps[k - 1].kind != "module"
               for k in live if k))  # an output computed by an op: not the input itself
    if reductions:  # a BatchNorm whose result nothing reads is traced away: its buffers would not update
        modules = [module if k + 1 in live or not isinstance(module, TrainingBatchNorm) else nn.Identity()
                   for k, module in enumerate(modules)]
    return Program(steps, modules, outputs, tree).eval()


@st.composite
def cases(draw, reductions: bool = False, extras: bool = False):
    top = 24 if reductions else 40
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(9, top)), draw(st.integers(9, top)))
    return draw(programs(shape, reductions=reductions, extras=extras)), shape


def _finite(model: nn.Module, shape) -> bool:
    """PyTorch itself gives -inf where a max-pool window holds only (dilated) padding: skip those."""
    with torch.no_grad():
        out = model.double()(torch.randn(shape, dtype=torch.float64))
    leaves = out.values() if isinstance(out, dict) else out if isinstance(out, tuple) else [out]
    return all(bool(torch.isfinite(leaf).all()) for leaf in leaves)


@pytest.mark.filterwarnings("ignore::UserWarning")
@PROPERTY
@given(cases(), st.tuples(st.integers(1, 4), st.integers(1, 4)))
def test_random_dags_tile_exactly_with_one_grid(case, grid):
    model, shape = case
    assume(_finite(model, shape))
    check_on_both_kernels(model, shape, grid=grid)


@st.composite
def segmentations(draw, model: nn.Module, shape) -> list[tuple]:
    """Random cuts of the node order; each tileable run gets a random grid, or tiles of a random
    period of input pixels where every size it partitions has them (``tilec.regions.Period``), or
    is stored."""
    graph = trace(model, shape)
    count = len(graph)
    free = [cut for cut in range(1, count) if cut not in graph.ties]  # none between a tuple and its getitem
    cuts = sorted(draw(st.sets(st.sampled_from(free), max_size=4))) if free else []
    edges = [0, *cuts, count]
    segments = []
    for first, stop in zip(edges[:-1], edges[1:], strict=True):
        sizes = owned_sizes(graph, first, stop)
        if not sizes or not graph.tileable(first, stop) or not draw(st.integers(0, 4)):
            segments.append((first, stop, (1, 1)))
            continue
        rows = draw(st.integers(1, min(4, *(s[0] for s in sizes))))
        cols = draw(st.integers(1, min(4, *(s[1] for s in sizes))))
        mode = draw(st.sampled_from([(), ("tiled",)])) if (rows, cols) == (1, 1) else ()
        periods = tuple(Period(draw(st.integers(1, 12)), full) for full in graph.image_size())
        if draw(st.booleans()) and all(period.length(size[axis]) is not None
                                       for size in sizes for axis, period in enumerate(periods)):
            segments.append((first, stop, periods))
            continue
        segments.append((first, stop, (rows, cols), *mode))
    return segments


@pytest.mark.filterwarnings("ignore::UserWarning")
@PROPERTY
@given(cases(), st.data())
def test_random_dags_tile_exactly_with_random_segments(case, data):
    model, shape = case
    assume(_finite(model, shape))
    segments = data.draw(segmentations(model, shape), label="segments")
    check_on_both_kernels(model, shape, segments=segments)


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(PROPERTY, max_examples=40)
@given(cases(reductions=True), st.data())
def test_random_dags_with_reductions_tile_exactly(case, data):
    """Outputs, gradients and buffers (running statistics) equal untiled, with one grid or random
    segments; every tiled segment's levels are its nodes' (``tilec.sweeps.levels``)."""
    model, shape = case
    assume(_finite(model, shape))
    if data.draw(st.booleans(), label="one grid"):
        options = {"grid": data.draw(st.tuples(st.integers(1, 4), st.integers(1, 4)), label="grid")}
    else:
        options = {"segments": data.draw(segmentations(model, shape), label="segments")}
    check_exact(model, shape, kernels=data.draw(st.sampled_from(KERNELS), label="kernels"), **options)


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(PROPERTY, max_examples=25)
@given(cases(reductions=True, extras=True), st.data())
def test_random_dags_with_standardised_weights_and_response_norms_tile_exactly(case, data):
    """As above, with convolutions whose weights the forward standardises (once per step, in no
    tile) and ConvNeXt-V2's global response norms (2-norms by sweeps) among the drawn ops."""
    test_random_dags_with_reductions_tile_exactly.hypothesis.inner_test(case, data)


@pytest.mark.parametrize("grid", [(0, 1), (1, 0), (-1, 2), (2,), (1, 2, 3), (1.5, 2)])
def test_malformed_grids_are_refused(grid):
    model = nn.Sequential(nn.Conv2d(1, 1, 3))
    with pytest.raises(GridError, match="grid must be two positive integers"):
        build(model, (1, 1, 9, 9), grid)


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(PROPERTY, max_examples=40)
@given(cases(extras=True), st.data())
def test_planned_regions_are_consistent(case, data):
    """Without running anything: in every tiled segment and axis, the owned parts partition each
    output; every step computes what its consumers read and the tile owns; every read is the
    op's rule clipped to the input, with the clipped part as padding where the op pads."""
    model, shape = case
    graph = trace(model, shape)
    segments = data.draw(segmentations(model, shape), label="segments")
    the_plan = plan_for(graph, REFERENCE, "m", segments=segments)
    assert validate(the_plan, "m") is the_plan  # what the planner writes, loading it accepts
    for segment in the_plan.segments:
        if segment.mode == "stored":
            assert segment.grid == (1, 1) and not segment.rows and not segment.cols
            continue
        images = [name for name in segment.outputs if graph.is_image(name)]  # a standardised weight is not
        for axis, tiles in ((0, segment.rows), (1, segment.cols)):
            assert len(tiles) == segment.grid[axis]
            for position, name in enumerate(images):
                owned = [tile.owned[position] for tile in tiles]
                assert owned[0].start == 0 and owned[-1].stop == graph.size(name, axis)
                assert all(part.length >= 1 for part in owned)
                assert all(a.stop == b.start for a, b in zip(owned[:-1], owned[1:], strict=True))
            for tile in tiles:
                needed: dict[str, list[Interval]] = {n: [o] for n, o in zip(images, tile.owned, strict=True)}
                for step in reversed(tile.steps):
                    node = graph.nodes[step.node]
                    assert step.grad_out == step.out
                    if role(graph, node.name) == "small":  # a standardised weight: once per sweep, in no tile
                        assert not step.out.length and not step.reads
                        continue
                    assert 0 <= step.out.start <= step.out.stop <= graph.size(node.name, axis)
                    for want in needed.get(node.name, []):
                        if want.length:
                            assert step.out.start <= want.start and want.stop <= step.out.stop, (node.name, axis)
                    needs = rule(node).need(node, axis, step.out, graph)
                    assert [r.input for r in step.reads] == [n.input for n in needs]
                    for read, need in zip(step.reads, needs, strict=True):
                        size = graph.size(read.input, axis)
                        assert read.grad == read.read and 0 <= read.read.start <= read.read.stop <= size
                        if step.out.length:
                            clipped, before, after = need.interval.clip(size)
                            assert read.read == clipped
                            assert read.pad == ((before, after) if need.pads else (0, 0))
                        needed.setdefault(read.input, []).append(read.read)
                sliced = [i.name for i in segment.inputs if i.sliced]
                for name, interval in zip(sliced, tile.inputs, strict=True):
                    for want in needed.get(name, []):
                        if want.length:
                            assert interval.start <= want.start and want.stop <= interval.stop
