"""Tiled == untiled (float64, max abs error <= 1e-10) on the model zoo, for one grid or explicit segments.

Outputs, the input gradient, every parameter gradient and every buffer after the step are compared
(``support.exactness.check_exact``); the conftest fills ``new_empty`` with NaN, so an output
element no tile writes fails too. The zoo runs on the CPU's tile kernels (``kernels="auto"``: the
arena, oneDNN, matrix-product weight gradients) and on the generic ones (``kernels="generic"``:
aten on fresh tensors, as on CUDA), in float64 and, within float32 rounding, in float32.
Training-mode models (reductions by sweeps) are ``test_sweeps.py``'s.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilec.codegen import render
from tilec.errors import GridError
from tilec.pipeline import build, plan_for
from tilec.planner import default_segments
from tilec.target import REFERENCE
from tilec.trace import trace, trace_modes

from support.exactness import TOLERANCE, check_close, check_exact, max_errors
from support.models import Lambda
from support.zoo import SHAPES, ZOO

#: 1x1 (stored, plain autograd), coarse and uneven grids, a fine one, and the finest: the planner
#: clips a grid per tiled run to the smallest output of that run, so (999, 999) gives one tile per
#: output pixel of the run's smallest output (left out for the full-resolution U-Nets: ~1800
#: tiles, 11 s each; they get (7, 5) here and finer grids in the segmented cases).
GRIDS = [(1, 1), (2, 2), (3, 2), (4, 3), (7, 5), (999, 999)]
FULL_RESOLUTION = {"unet_transposed", "unet_nearest", "unet_bilinear"}


@pytest.mark.parametrize("kernels", ["auto", "generic"])
@pytest.mark.parametrize(("name", "grid"), [(name, grid) for name in sorted(ZOO) for grid in GRIDS
                                            if grid != (999, 999) or name not in FULL_RESOLUTION],
                         ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v)
def test_zoo(name, grid, kernels):
    check_exact(ZOO[name](), SHAPES[name], grid=grid, kernels=kernels, traced_as=name)


@pytest.mark.parametrize("kernels", ["auto", "generic"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_float32_within_rounding(name, kernels):
    """In float32, tiles sum in another order than the untiled kernels: outputs and gradients agree
    within ``FLOAT32_RTOL`` of each tensor's largest magnitude."""
    check_close(ZOO[name](), SHAPES[name], grid=(3, 2), kernels=kernels, traced_as=name)


def test_zoo_train_head_dropout_is_live():
    """The efficientnet_train_head comparison is not vacuous: its head Dropout draws a mask."""
    model = ZOO["efficientnet_train_head"]().double()
    x = torch.randn(SHAPES["efficientnet_train_head"], dtype=torch.float64)
    with torch.no_grad():
        torch.manual_seed(1)
        first = model(x)
        torch.manual_seed(2)
        second = model(x)
    assert not torch.equal(first, second)


# --- explicit segmentations ---------------------------------------------------------------------


def _segments(name: str, cuts: list[str], grids: list[tuple]) -> list[tuple]:
    """Segments of zoo model ``name`` cut before the first node in each module (or its children) of
    ``cuts`` (``"path"`` or ``"path:op"``), with ``grids[i]`` (a grid, or a grid and a mode) for segment i."""
    nodes = list(trace(ZOO[name](), SHAPES[name]))

    def position(spec: str) -> int:
        path, _, op = spec.partition(":")
        inside = [i for i, n in enumerate(nodes) if (n.path == path or path and n.path.startswith(path + "."))
                  and (not op or n.op == op)]
        assert inside, f"{name} has no node in module {path!r}" + (f" with op {op}" if op else "")
        return inside[0]

    edges = [0, *sorted(position(cut) for cut in cuts), len(nodes)]
    assert len(set(edges)) == len(edges), f"cuts {cuts} collide: {edges}"
    assert len(grids) == len(edges) - 1
    return [(first, stop, *(g if isinstance(g[0], tuple) else (g,)))
            for first, stop, g in zip(edges[:-1], edges[1:], grids, strict=True)]


SEGMENTED = {
    # the skip (block input) crosses the cut between layer1's first conv and its add; layer2 is cut
    # between its main branch and its downsample shortcut, with a stored segment in between
    "resnet_block_cut": ("resnet_basic", ["layer1.bn1", "layer2.conv2", "layer2.downsample.1"],
                         [(3, 2), (2, 3), (1, 1), (4, 5)]),
    "bottleneck_cut": ("resnet_bottleneck", ["layer1.0.conv2", "layer1.1.bn3", "layer2.0.downsample.0"],
                       [(5, 4), (2, 2), (3, 1), (2, 3)]),
    "preact_cut": ("preact_resnet", ["layer1.conv2", "layer2.bn2", "layer3"],
                   [(4, 4), (1, 3), (3, 2), (2, 5)]),
    "mobilenetv2_cut": ("mobilenetv2", ["blocks.0.conv.1", "blocks.2.conv.1.0"], [(2, 3), (4, 2), (3, 3)]),
    # the encoder features x1, x2 cross two and three cuts to reach the decoder
    "unet_transposed_skips": ("unet_transposed", ["down1.0", "up1.up", "up2.up"],
                              [(4, 3), (2, 2), (3, 5), (5, 4)]),
    "unet_transposed_pad_cat": ("unet_transposed", ["up1.conv.0", "up2:pad"], [(3, 3), (2, 4), (6, 5)]),
    "unet_nearest_skips": ("unet_nearest", ["pool:max_pool2d", "up1.reduce", "up2.conv.0"],
                           [(5, 3), (3, 4), ((1, 1), "tiled"), (4, 6)]),
    "unet_bilinear_skips": ("unet_bilinear", ["down2.0", "up1.conv.0", "up2"], [(2, 3), (4, 4), (3, 2), (7, 5)]),
    "unet_crop_skips": ("unet_crop", ["down1.0", "up1", "conv2.0"], [(3, 4), (2, 2), (4, 3), (5, 5)]),
    # the growing feature list of a dense block crosses every cut
    "densenet_features": ("densenet", ["dense.1", "dense.2.conv1", "transition"], [(3, 3), (2, 4), (4, 2), (2, 2)]),
    # the four branches are cut apart: several tensors cross
    "inception_branches": ("inception", ["inception.branch2.1", "inception.branch4"], [(3, 4), (5, 2), (2, 3)]),
    # channels-last tensors (after the permute) cross the cut
    "convnext_channels_last": ("convnext", ["blocks.0.pwconv1", "blocks.1.pwconv2"], [(4, 3), (2, 5), (3, 3)]),
    "shufflenet_cut": ("shufflenet", ["stage.0.branch2.1", "stage.1.branch2"], [(2, 2), (3, 4), (4, 2)]),
    # dict output: the features are an output and feed the head
    "heads_cut": ("heads", ["trunk.1", ":mean"], [(3, 4), (4, 3), (1, 1)]),
}


@pytest.mark.parametrize("case", sorted(SEGMENTED))
def test_segmented(case):
    name, cuts, grids = SEGMENTED[case]
    check_exact(ZOO[name](), SHAPES[name], segments=_segments(name, cuts, grids), traced_as=name)


@pytest.mark.parametrize("name", ["squeeze_excite", "efficientnet", "mobilenetv3_block", "resnet_head"])
def test_default_runs_with_other_grids(name):
    """Models with reductions (SE branches, heads): each segment of the default plan gets its own
    grid, and the first tiled one is split in two (the SE branch or head then in another segment)."""
    graph = trace(ZOO[name](), SHAPES[name])
    runs = default_segments(graph, (7, 7))
    grids = iter([(2, 3), (3, 2), (4, 1), (1, 4), (5, 5)] * 4)
    segments, split = [], False
    for first, stop, _, mode, _ in runs:
        if mode == "stored":
            segments.append((first, stop, (1, 1)))
        elif not split and stop - first > 1:
            middle = (first + stop) // 2
            segments += [(first, middle, next(grids)), (middle, stop, next(grids))]
            split = True
        else:
            segments.append((first, stop, next(grids)))
    assert split
    check_exact(ZOO[name](), SHAPES[name], segments=segments)


def test_every_node_its_own_segment():
    name = "resnet_basic"
    count = len(trace(ZOO[name](), SHAPES[name]))
    grids = [(2, 3), (3, 2), (1, 1), (4, 4)]
    check_exact(ZOO[name](), SHAPES[name], segments=[(i, i + 1, grids[i % 4]) for i in range(count)])


def test_tiled_segment_with_one_tile_equals_stored():
    name = "unet_nearest"
    count = len(trace(ZOO[name](), SHAPES[name]))
    check_exact(ZOO[name](), SHAPES[name], segments=[(0, count, (1, 1), "tiled")])


def test_squeeze_and_excitation_blocks_in_one_tiled_segment():
    """Each SE branch (global pooling, two 1x1 convolutions) runs by a sweep inside the segment."""
    name = "squeeze_excite"
    count = len(trace(ZOO[name](), SHAPES[name]))
    check_exact(ZOO[name](), SHAPES[name], segments=[(0, count, (2, 2))])


def test_non_tileable_node_in_a_tiled_segment_is_refused():
    model = Body(lambda x: x.transpose(2, 3)).eval()
    count = len(trace(model, (1, 3, 11, 9)))
    with pytest.raises(GridError, match=r"cannot be tiled: node transpose \(aten\.transpose in stage\.op\).*grid 1x1"):
        build(model, (1, 3, 11, 9), segments=[(0, count, (2, 2))])


# --- gradients: frozen parameters, no input gradient, accumulation ---------------------------------


def test_frozen_parameters_and_input_without_grad():
    name = "resnet_basic"
    model = ZOO[name]().double()
    for parameter in model.layer1.parameters():
        parameter.requires_grad_(False)
    tiled = build(model, SHAPES[name], (3, 2))
    x = torch.randn(SHAPES[name], dtype=torch.float64)
    grads = []
    for forward in (model, tiled):
        out = forward(x)
        out.backward(torch.ones_like(out))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and not any(n.startswith("layer1.") for n in grads[1])
    assert max((grads[0][n] - grads[1][n]).abs().max().item() for n in grads[0]) <= TOLERANCE


def test_gradients_accumulate_like_pytorch():
    name = "unet_bilinear"
    model = ZOO[name]().double()
    tiled = build(model, SHAPES[name], (3, 4))
    x = torch.randn(SHAPES[name], dtype=torch.float64)
    accumulated = []
    for forward in (model, tiled):
        model.zero_grad(set_to_none=True)
        for _ in range(2):
            forward(x).square().sum().backward()
        accumulated.append([p.grad.clone() for p in model.parameters()])
    assert max((a - b).abs().max().item() for a, b in zip(*accumulated, strict=True)) <= 1e-9


# --- BatchNorm and Dropout modes -----------------------------------------------------------------


def _stored_batch_norm_step(momentum):
    """Untiled and tiled training-mode steps of a BatchNorm in a stored segment that was compiled
    in eval mode and switched to training afterwards: (output, running mean, batch count) each."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3, momentum=momentum)).double().eval()
    tiled = build(model, (2, 2, 9, 9), segments=[(0, 1, (2, 2)), (1, 2, (1, 1))])
    model[1].train()
    x = torch.randn(2, 2, 9, 9, dtype=torch.float64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    results = []
    for forward in (model, tiled):
        model.load_state_dict(state)
        out = forward(x)
        results.append((out, model[1].running_mean.clone(), int(model[1].num_batches_tracked)))
    return results


def test_training_mode_batch_norm_in_a_stored_segment_follows_pytorch():
    """A stored segment runs the model's own training-mode BatchNorm: batch statistics and the
    same running-mean update."""
    (want, want_mean, _), (got, got_mean, _) = _stored_batch_norm_step(0.1)
    assert (got - want).abs().max().item() <= TOLERANCE
    assert (got_mean - want_mean).abs().max().item() <= 1e-12


@pytest.mark.parametrize("momentum", [0.1, None])
def test_training_mode_batch_norm_in_a_stored_segment_updates_buffers_like_pytorch(momentum):
    (_, want_mean, want_count), (_, got_mean, got_count) = _stored_batch_norm_step(momentum)
    assert got_count == want_count
    assert (got_mean - want_mean).abs().max().item() <= 1e-12


@pytest.mark.parametrize("grid", [(2, 2), (4, 3)])
def test_one_training_mode_batch_norm_in_an_eval_body_is_exact(grid):
    """A single BatchNorm in training mode (its statistics reduced by a sweep, its running ones
    updated as nn.BatchNorm does) among eval-mode ones."""
    model = ZOO["resnet_basic"]()
    model.layer1.bn2.train()
    errors = check_exact(model, SHAPES["resnet_basic"], grid=grid)
    assert "buffer layer1.bn2.running_var" in errors and "buffer layer1.bn2.num_batches_tracked" in errors


def test_body_batch_norm_switched_to_training_after_compiling_is_refused():
    name = "resnet_basic"
    model = ZOO[name]()
    tiled = build(model, SHAPES[name], (2, 2))
    x = torch.randn(SHAPES[name])
    tiled(x)
    model.layer2.downsample[1].train()
    with pytest.raises(ValueError, match=r"module layer2\.downsample\.1 \(BatchNorm2d\) is in training mode.*"
                                         r"\.eval\(\)"):
        tiled(x)
    model.eval()
    tiled(x)


# --- ops in other layouts ------------------------------------------------------------------------


class Body(nn.Module):
    """A conv, then ``op`` inside a submodule at path ``stage.op``, then another conv."""

    def __init__(self, op):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.stage = nn.Sequential()
        self.stage.add_module("op", Lambda(op))
        self.last = nn.Conv2d(4, 2, 3)

    def forward(self, x):
        return self.last(self.stage(self.conv(x)))


class UnitDims(nn.Module):
    """``unsqueeze`` and ``squeeze`` of dims other than the image axes: a per-branch scale on a 5-D
    stack of two maps, summed over the branches, and a unit dim added and removed again."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.scale = nn.Parameter(torch.rand(1, 2, 4, 1, 1) + 0.5)

    def forward(self, x):
        y = self.conv(x)
        branches = torch.cat([y.unsqueeze(1), torch.relu(y).unsqueeze(1)], dim=1) * self.scale
        return F.max_pool2d(branches.sum(1).unsqueeze(-1).squeeze(-1), 3, 1, 1)


@pytest.mark.parametrize("grid", [(2, 2), (3, 2)])
def test_unsqueeze_and_squeeze_of_other_dims_tile(grid):
    graph = trace(UnitDims(), (1, 3, 13, 11))
    assert all(node.tileable for node in graph if node.op in ("unsqueeze", "squeeze"))
    check_exact(UnitDims(), (2, 3, 13, 11), grid=grid)


class PaddedChannels(nn.Module):
    """Constant padding of dims besides the image axes: the channels of a map along with its rows and
    columns, and the last dim of a 5-D map whose image axes are dims 2 and 3 (channels-last heads),
    then matrices per pixel (``matmul``) by a parameter and by a per-sample reduction."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.weight = nn.Parameter(torch.randn(3, 2) / 2)

    def forward(self, x):
        y = F.pad(self.conv(x), (1, 2, 0, 1, 1, 2), value=0.5)  # 7 channels, one more row, three more columns
        heads = F.pad(y[:, :6].reshape(y.shape[0], 2, 3, *y.shape[2:]).permute(0, 1, 3, 4, 2), (0, 1), value=1.0)
        summary = heads.amax((2, 3)).unsqueeze(-2).unsqueeze(-2)  # (N, 2, 1, 1, 4)
        mixed = (heads[..., :3] @ self.weight) * (heads @ summary.transpose(-1, -2))  # (N, 2, H, W, 2)
        return F.max_pool2d(mixed.permute(0, 1, 4, 2, 3).flatten(1, 2), 3, 1, 1)


@pytest.mark.parametrize("grid", [(2, 2), (3, 2), (5, 4)])
def test_padding_other_dims_and_matrices_per_pixel_tile(grid):
    graph = trace(PaddedChannels(), (1, 3, 13, 11))
    assert all(node.tileable for node in graph if node.op in ("pad", "constant_pad_nd", "matmul"))
    check_exact(PaddedChannels(), (2, 3, 13, 11), grid=grid)


class ListedTensors(nn.Module):
    """Model tensors inside list arguments: a stack of two parameters and a buffer, an einsum of
    two parameters (small ops, computed once per step)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.a, self.b = nn.Parameter(torch.rand(4) + 0.5), nn.Parameter(torch.rand(4))
        self.register_buffer("c", torch.rand(4))

    def forward(self, x):
        scale = torch.stack([self.a, self.b, self.c]).sum(0) * torch.einsum("i,i->", self.a, self.b)
        return F.max_pool2d(self.conv(x) * scale.view(1, -1, 1, 1), 3, 1, 1)


def test_model_tensors_in_list_arguments():
    check_exact(ListedTensors(), (2, 3, 13, 11), grid=(3, 2))


@pytest.mark.parametrize("swap", [lambda x: x.transpose(2, 3), lambda x: x.permute(0, 1, 3, 2)],
                         ids=["transpose", "permute"])
def test_swapping_height_and_width_runs_untiled_and_exact(swap):
    """Tile rules are per axis and cannot follow rows into columns: the swap and what reads it run
    stored, between tiled segments."""
    segments = plan_for(trace(Body(swap).eval(), (1, 3, 11, 9)), REFERENCE, "m", grid=(2, 3)).segments
    assert [s.mode for s in segments] == ["tiled", "stored"]
    check_exact(Body(swap).eval(), (1, 3, 11, 9), grid=(2, 3))


# --- the generated TiledModel refuses a model its plan does not fit -------------------------------


def _plain(width: int = 4, pool: bool = True, activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    layers = [nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), activation()]
    return nn.Sequential(*layers, *([nn.MaxPool2d(2)] if pool else [nn.Identity()]),
                         nn.Conv2d(width, 2, 3)).eval()


@pytest.fixture(scope="module")
def tiled_class():
    return type(build(_plain(), (1, 3, 15, 13), (2, 2)))


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_plain(width=6), r"0\.bias has shape \(6,\), plan 'model' has \(4,\)"),
        (nn.Sequential(*list(_plain())[:3], nn.MaxPool2d(2)), r"the model has no parameter or buffer '4\.bias'"),
        (_plain(pool=False), r"module 3 is a Identity, plan 'model' has a MaxPool2d"),
        (_plain(activation=nn.ReLU6), r"module 2 is a ReLU6, plan 'model' has a ReLU"),
        (nn.Sequential(*list(_plain())[:3]), r"no parameter or buffer '4\.bias', which plan 'model' uses"),
        (nn.Conv2d(3, 4, 3), r"no parameter or buffer"),
    ],
    ids=["parameter_shape", "missing_parameter", "module_type", "activation_type", "missing_modules", "other_model"],
)
def test_tiled_model_refuses_a_model_that_does_not_fit(tiled_class, model, message):
    with pytest.raises(ValueError, match=message):
        tiled_class(model)


def test_tiled_model_refuses_a_missing_parameter_free_module(tiled_class):
    class NoPool(nn.Module):  # same parameters as _plain(), but no module "3"
        def __init__(self):
            super().__init__()
            plain = _plain()
            for index in (0, 1, 2, 4):
                self.add_module(str(index), plain[index])

        def forward(self, x):
            return x

    with pytest.raises(ValueError, match=r"the model has no module '3' \(MaxPool2d\)"):
        tiled_class(NoPool())


# --- edge cases of single ops ---------------------------------------------------------------------


class ComputedWeights(nn.Module):
    """Convolutions whose weights the forward computes: from parameters, standardised by
    ``F.batch_norm`` with batch statistics in either mode and a gain (timm's ``ScaledStdConv2d``),
    or scaled (a transposed convolution's); from the input (a dynamic convolution, batch 1)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(3, 6, 3, padding=1)
        self.gain = nn.Parameter(torch.rand(6) + 0.5)
        self.up = nn.ConvTranspose2d(6, 4, 3, stride=2)
        self.route = nn.Linear(4, 4 * 4 * 3 * 3)

    def forward(self, x):
        weight = F.batch_norm(self.first.weight.reshape(1, 6, -1), None, None, weight=self.gain, training=True,
                              momentum=0.0, eps=1e-5).reshape_as(self.first.weight)
        y = F.relu(F.conv2d(x, weight, self.first.bias, padding=1))
        z = F.conv_transpose2d(y, self.up.weight * 0.5, self.up.bias, stride=2)
        return F.conv2d(z, self.route(z.mean((2, 3))).view(4, 4, 3, 3), padding=1)


@pytest.mark.parametrize("grid", [(2, 3), (3, 2)])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_convolutions_with_computed_weights(train, grid):
    check_exact(ComputedWeights().train(train), (1, 3, 13, 11), grid=grid, eval_after=train)


def test_weights_computed_from_parameters_or_a_reduction_of_the_input_tile():
    """The dynamic convolution's weight, a linear layer of the input's mean, is small: computed
    once per step by a sweep, like a squeeze-and-excitation branch, and read by every tile."""
    graph = trace(ComputedWeights(), (1, 3, 13, 11))
    convolutions = [node for node in graph if node.op in ("conv2d", "conv_transpose2d")]
    assert [node.tileable for node in convolutions] == [True, True, True]
    assert [graph.spatial(node.args[1].value) for node in convolutions] == [None, None, None]
    assert len(trace_modes(ComputedWeights(), (1, 3, 13, 11)).graphs) == 1  # the flag is the forward's, not the mode's


class BlurPool(nn.Module):
    """Anti-aliased downsampling as timm's ``BlurPool2d`` (TResNet's; ``aa_layer=BlurPool2d``) does
    it: a binomial filter in a non-persistent buffer, per channel, after reflect padding, stride 2."""

    def __init__(self, channels: int):
        super().__init__()
        taps = torch.tensor([1.0, 2.0, 1.0]) / 4
        self.register_buffer("filt", (taps[:, None] * taps[None, :]).repeat(channels, 1, 1, 1), persistent=False)
        self.conv = nn.Conv2d(3, channels, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.conv(x))
        return F.conv2d(F.pad(x, [1, 1, 1, 1], mode="reflect"), self.filt, stride=2, groups=x.shape[1])


@pytest.mark.parametrize("grid", [(2, 3), (3, 2)])
def test_a_non_persistent_buffer_reaches_the_tiles(grid):
    check_exact(BlurPool(4), (2, 3, 15, 13), grid=grid)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_conv_with_string_padding(padding):
    model = nn.Sequential(nn.Conv2d(2, 3, (4, 3), padding=padding, dilation=(1, 2)), nn.ReLU())
    check_exact(model, (1, 2, 13, 11), grid=(2, 3))


@pytest.mark.parametrize(
    ("module", "shape", "grid"),
    [
        (nn.ConvTranspose2d(1, 1, 1, stride=2), (1, 1, 9, 9), (1, 2)),  # stride beyond the kernel: gaps
        (nn.ConvTranspose2d(2, 2, 2, stride=3), (1, 2, 9, 9), (4, 4)),
        (nn.ConvTranspose2d(1, 1, 1, dilation=2, output_padding=1), (1, 1, 3, 3), (1, 3)),  # past the last tap
    ],
    ids=["k1_s2", "k2_s3", "output_padding_beyond_taps"],
)
def test_conv_transpose_outputs_no_input_reaches(module, shape, grid):
    check_exact(module, shape, grid=grid)


class UpsampleThenPad(nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode

    def forward(self, x):
        return F.pad(F.interpolate(x, scale_factor=2, mode=self.mode), (8, 0, 0, 0))


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_upsample_with_an_empty_tile_region(mode):
    check_exact(UpsampleThenPad(mode), (1, 1, 4, 4), grid=(1, 2))


class Bicubic(nn.Module):
    """Bicubic resampling between convolutions (by scale or to a size, up or down), and a skip
    resampled bilinearly to the same size."""

    def __init__(self, **options):
        super().__init__()
        self.options = options
        self.first, self.last = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        y = F.interpolate(self.first(x), mode="bicubic", **self.options)
        skip = F.interpolate(x[:, :1], size=y.shape[-2:], mode="bilinear", align_corners=False)
        return self.last(y * torch.sigmoid(skip))


@pytest.mark.parametrize("grid", [(2, 3), (4, 4), (7, 5)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("options", [{"scale_factor": 2}, {"scale_factor": 1.7, "align_corners": True},
                                     {"size": (29, 17)}, {"size": (8, 5)}, {"scale_factor": (3, 0.6)}],
                         ids=["x2", "x1.7_corners", "to_29x17", "down_to_8x5", "x3_x0.6"])
def test_bicubic_resampling_tiles_exactly(options, grid):
    """Each output reads PyTorch's own four taps with its weights (``tilec.ops.resample``)."""
    graph = trace(Bicubic(**options), (2, 3, 13, 11))
    assert all(node.tileable for node in graph)
    check_exact(Bicubic(**options), (2, 3, 13, 11), grid=grid)


def test_max_errors_reports_every_tensor():
    errors = max_errors(ZOO["heads"](), SHAPES["heads"], grid=(2, 2))
    assert {"output[0]", "output[1]", "grad input", "grad fc.weight", "grad trunk.0.0.weight"} <= set(errors)


class Outputs(nn.Module):
    """A list holding one tensor twice, the input itself, and a nested tuple with a scalar."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.pool = nn.AvgPool2d(2, ceil_mode=True)

    def forward(self, x):
        y = self.conv(x)
        return [y, y, x, (self.pool(y) * 2, y.mean())]


@pytest.mark.parametrize("grid", [(1, 1), (2, 3), (5, 4)])
def test_output_structures(grid):
    check_exact(Outputs(), (2, 2, 11, 9), grid=grid)


def test_uninitialised_memory_is_poisoned():
    """The conftest fixture is active: what the generated code allocates with new_empty is NaN
    until a tile writes it."""
    assert torch.isnan(torch.zeros(2).new_empty((3, 4))).all()
    assert torch.isnan(torch.empty_like(torch.zeros(5, dtype=torch.float64))).all()


# --- activations computed in place --------------------------------------------------------------


class _InPlaceCases(nn.Module):
    """Each activation's input is, in turn: a convolution's result read by it alone (in place), a
    ReLU's result (it keeps it for its backward: not in place), a result two ops read, a model
    output, and a leaky ReLU's input with a negative slope (not in place). Of those in place,
    those read by a convolution or a pooling alone back-propagate in place too; one read by an
    add does not, nor one the next segment reads."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e, self.f, self.g = (nn.Conv2d(4, 4, 3, padding=1) for _ in range(7))
        self.norm = nn.BatchNorm2d(4).eval()

    def forward(self, x):
        x = F.relu(self.a(x))                       # in place; read by relu6: gradient out of place
        x = F.relu(F.relu6(x))                      # relu6 of a ReLU's result: out of place
        y = self.b(x)
        x = F.relu(y) + F.leaky_relu(y, 0.1)        # y read twice: out of place
        z = self.norm(self.c(x))
        x = F.leaky_relu(z, -0.2)                   # negative slope: out of place
        x = F.hardtanh(self.e(x), -2.0, 2.0)        # in place, and its gradient (read by a conv)
        x = F.leaky_relu(self.f(x), 0.1)            # in place, and its gradient (read by max-pooling)
        x = F.max_pool2d(x, 3, 1, 1)
        x = F.relu(self.g(x)) + x                   # in place; read by an add: gradient out of place
        w = self.d(x)
        return F.hardtanh(w, -1.0, 1.0), w          # w is a model output: out of place


def test_activations_in_place_only_where_nothing_else_needs_the_input():
    plan = plan_for(trace(_InPlaceCases(), (1, 4, 19, 23)), REFERENCE, "cases", grid=(3, 2))
    source = render(plan)
    functions = source.count("\ndef _s0_")
    assert functions == 6  # 3 row classes (top, inner, bottom) x 2 column classes
    for forward_only in ("aten.relu_.default(v_conv2d)", "aten.relu_.default(v_conv2d_5)"):
        assert source.count(forward_only) == functions
    for both in ("= in_place(v_conv2d_3, aten.hardtanh_.default", "= in_place(v_conv2d_4, aten.leaky_relu_.default"):
        assert source.count(both) == functions
    for kept in ("aten.relu_.default(v_relu", "aten.leaky_relu_.default(v_batch_norm", "(v_conv2d_6, aten.hardtanh_"):
        assert kept not in source
    check_exact(_InPlaceCases(), (1, 4, 19, 23), grid=(3, 2))


def test_an_activation_the_next_segment_reads_back_propagates_out_of_place():
    segments = [(0, 13, (3, 2)), (13, 21, (2, 2))]  # the hardtanh (node 12) is the first's output
    source = render(plan_for(trace(_InPlaceCases(), (1, 4, 19, 23)), REFERENCE, "cases", segments=segments))
    assert "aten.hardtanh_.default(v_conv2d_3, -2.0, 2.0)" in source
    assert "= in_place(v_conv2d_3" not in source
    check_exact(_InPlaceCases(), (1, 4, 19, 23), segments=segments)
