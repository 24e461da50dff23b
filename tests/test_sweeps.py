"""Reductions inside tiled segments (``tilec.sweeps``): training-mode models tile exactly.

Tiled == untiled in float64 (max abs error <= 1e-10) for every output, the input gradient, every
parameter gradient and every buffer after the step (``support.exactness``: the untiled step runs
on a deep copy, so BatchNorm's running statistics and batch counter are compared too): BatchNorm
with batch statistics in ResNets, MobileNets and EfficientNets (with squeeze-and-excitation,
stochastic depth and Dropout2d drawn under one seed), GroupNorm ResNets, instance-norm U-Nets,
ConvNeXt's head, global max pooling with ties, losses with ignored pixels; one grid per model,
explicit segments holding several levels of reductions, segments cut right before a reduction
(a direct level); float32 within rounding; a plan compiled in training mode run in eval mode,
and a plan compiled in eval mode refusing a BatchNorm switched to training.
"""

from __future__ import annotations

import copy

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilec.codegen import load_source, render
from tilec.cone import axis_tiles
from tilec.cost.arrays import AxisArrays
from tilec.cost.constants import PARTIAL_TENSOR_BYTES
from tilec.cost.estimator import Estimator
from tilec.errors import TilecError
from tilec.ops import rule
from tilec.pipeline import build, plan_for
from tilec.planio import dumps, loads
from tilec.planner import default_segments, plan
from tilec.search import choose, cut_points, smallest_budget
from tilec.sweeps import dependent_masks, levels, prefix_masks, role
from tilec.target import REFERENCE
from tilec.trace import trace
from tilec.validate import validate

from support.exactness import TOLERANCE, buffer_errors, check_close, check_exact, max_errors
from support.zoo import SHAPES, TINY, TRAIN_SHAPES, TRAIN_ZOO, ZOO

GRIDS = [(1, 1), (2, 2), (3, 2), (4, 3)]


@pytest.mark.parametrize(("name", "grid"), [pytest.param(name, grid, id=f"{name}-{grid[0]}x{grid[1]}")
                                            for name in sorted(TRAIN_ZOO) for grid in GRIDS])
def test_training_zoo(name, grid):
    model = TRAIN_ZOO[name]()
    has_batch_norm = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    errors = check_exact(model, TRAIN_SHAPES[name], grid=grid, traced_as=f"train {name}")
    assert any(key.endswith("num_batches_tracked") for key in errors) == has_batch_norm


@pytest.mark.parametrize("name", sorted(TRAIN_ZOO))
def test_training_zoo_on_the_generic_kernels(name):
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], grid=(3, 2), kernels="generic", traced_as=f"train {name}")


@pytest.mark.parametrize("name", ["resnet_bottleneck", "mobilenetv2", "efficientnet", "basic_unet",
                                  "groupnorm_resnet", "convnext_head"])
def test_training_zoo_float32_within_rounding(name):
    """Float32 within ``FLOAT32_RTOL`` of each tensor's magnitude; the gradients that are 0 in
    exact arithmetic (a convolution's bias before a training-mode BatchNorm) within a few times
    untiled float32's own rounding error."""
    check_close(TRAIN_ZOO[name](), TRAIN_SHAPES[name], grid=(3, 2), noise_floor=True)


def test_the_untiled_step_changes_what_is_compared():
    """The buffer comparison is not vacuous: a training step moves the running statistics and the
    batch counter, and an error in them would show."""
    model = TRAIN_ZOO["resnet_basic"]().double()
    before = copy.deepcopy(model)
    model(torch.randn(TRAIN_SHAPES["resnet_basic"], dtype=torch.float64))
    moved = buffer_errors(before, model)
    assert moved["buffer bn1.num_batches_tracked"] == 1 and moved["buffer layer2.bn2.running_mean"] > 1e-3
    assert all(value > 0 for value in moved.values())


@pytest.mark.parametrize("name", sorted(TRAIN_ZOO))
def test_default_plans_reduce_inside_tiled_segments(name):
    """With --grid every reduction runs in a tiled segment, each segment has at most one level of
    reductions (the grid cuts before a reduction whose level would be 2), and a level-1 reduction
    of a segment input is direct; a classifier head runs in the last tiled segment."""
    graph = trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name])
    plan = plan_for(graph, REFERENCE, name, grid=(2, 2))
    reductions = [node.name for node in graph if role(graph, node.name) == "reduction"]
    assert reductions
    for segment in plan.segments:
        found = [name for level in segment.levels for name in level.reductions]
        assert segment.mode == "tiled" or not found
        assert all(level.index <= 1 for level in segment.levels), segment.levels
        assert segment.levels == (levels(graph, segment.first, segment.stop) if segment.mode == "tiled" else ())
        inputs = {i.name for i in segment.inputs}
        for level in segment.levels:
            reduced = [rule(graph.nodes[r]).reduced(graph.nodes[r], graph) for r in level.reductions]
            reads_inputs = bool(reduced) and all(names and set(names) <= inputs for names in reduced)
            assert level.direct == (level.index == 1 and reads_inputs), level
    assert sorted(name for s in plan.segments for level in s.levels for name in level.reductions) == sorted(
        reductions)
    if name in ("resnet_head", "groupnorm_resnet", "convnext_head"):
        last = plan.segments[-1]
        assert last.mode == "tiled" and last.outputs == (graph.order[-1],) and not graph.is_image(last.outputs[0])


# --- several levels in one tiled segment, and direct levels ---------------------------------------


def _chain(momentum=0.1, affine: bool = True, track: bool = True) -> nn.Module:
    """conv -> BN -> ReLU -> conv -> BN (momentum None) -> ReLU -> global pooling: 7 nodes whose
    reductions depend on each other (levels 1, 2, 3 in one segment)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum, affine=affine, track_running_stats=track),
        nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
    ).train()


CHAIN_SHAPE = (2, 3, 11, 9)

#: segments of the chain, and per segment its levels as (index, direct, swept)
CHAIN_SEGMENTS = {
    "three levels": ([(0, 7, (2, 3))], [[(1, False, True), (2, False, True), (3, False, False)]]),
    "three levels, one tile": ([(0, 7, (1, 1), "tiled")], [[(1, False, True), (2, False, True), (3, False, False)]]),
    "three levels, fine grid": ([(0, 7, (5, 4))], [[(1, False, True), (2, False, True), (3, False, False)]]),
    "cut before the first BN": ([(0, 1, (2, 2)), (1, 7, (3, 3))],
                                [[], [(1, True, True), (2, False, True), (3, False, False)]]),
    "cut before the second BN": ([(0, 4, (2, 2)), (4, 7, (2, 3))], [[(1, False, True)], [(1, True, True),
                                                                                          (2, False, False)]]),
    "cut before the pooling": ([(0, 6, (3, 2)), (6, 7, (4, 3))], [[(1, False, True), (2, False, True)],
                                                                 [(1, True, False)]]),
    "stored, then tiled": ([(0, 3, (1, 1)), (3, 7, (4, 3))], [[], [(1, False, True), (2, False, False)]]),
}


@pytest.mark.parametrize("case", list(CHAIN_SEGMENTS))
def test_levels_of_explicit_segments(case):
    segments, expected = CHAIN_SEGMENTS[case]
    plan = plan_for(trace(_chain(), CHAIN_SHAPE), REFERENCE, "chain", segments=segments)
    assert [[(level.index, level.direct, level.swept) for level in s.levels] for s in plan.segments] == expected
    assert loads(dumps(plan)) == plan and validate(plan) is plan
    check_exact(_chain(), CHAIN_SHAPE, segments=segments)


@pytest.mark.parametrize("options", [{"momentum": None}, {"momentum": 0.7}, {"affine": False}, {"track": False}],
                         ids=["cumulative", "momentum", "no_affine", "no_running_stats"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_batch_norm_options(options, mode):
    """Momentum None (cumulative average), another momentum, no affine parameters, no running
    statistics (batch statistics in eval mode too), in a three-level segment."""
    check_exact(_chain(**options).train(mode == "train"), CHAIN_SHAPE, segments=[(0, 7, (3, 2))])


@pytest.mark.parametrize("name", ["resnet_bottleneck", "basic_unet", "efficientnet"])
def test_whole_network_in_one_tiled_segment(name):
    """Many levels in one segment: each BatchNorm (or instance norm) one level above the last."""
    graph = trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name])
    count = len(graph)
    stop = next((k for k, n in enumerate(graph.order) if not graph.nodes[n].tileable), count)
    assert len(levels(graph, 0, stop)) >= 5
    segments = [(0, stop, (3, 2))] + ([(stop, count, (1, 1))] if stop < count else [])
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], segments=segments)


# --- statistics, losses, maxima --------------------------------------------------------------------


class Statistics(nn.Module):
    """var / std / var_mean / mean / sum / amax over dims holding both image axes, max and min over
    all dims, and LayerNorm over (C, H, W) without affine parameters."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.LayerNorm([4, 9, 11], elementwise_affine=False)
        self.last = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        variance, mean = torch.var_mean(y, (2, 3), keepdim=True)
        return (self.last(self.norm(y) * variance + mean), y.var((2, 3)), y.std((0, 2, 3), correction=0), y.mean(),
                y.sum((1, 2, 3)), y.amax((0, 2, 3)), y.max(), y.min())


class Losses(nn.Module):
    """Every supported loss reduced by mean or sum, targets derived from the input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("class_weight", torch.tensor([1.0, 0.5, 2.0, 1.5]))

    def forward(self, x):
        target = x.argmax(1)
        logits = self.conv(x)
        prediction = logits[:, :3]
        return {
            "cross_entropy": F.cross_entropy(logits, target, weight=self.class_weight, ignore_index=2,
                                             label_smoothing=0.1),
            "cross_entropy_sum": F.cross_entropy(logits, target, reduction="sum", label_smoothing=0.2),
            "nll": F.nll_loss(F.log_softmax(logits, 1), target, weight=self.class_weight, ignore_index=1),
            "bce": F.binary_cross_entropy_with_logits(prediction, torch.sigmoid(x)),
            "mse": F.mse_loss(prediction, x, reduction="sum"),
            "l1": F.l1_loss(prediction, x),
            "smooth_l1": F.smooth_l1_loss(prediction, x, beta=0.5),
            "huber": F.huber_loss(prediction, x, delta=0.7),
        }


class Norms(nn.Module):
    """2-norms over both image axes (NCHW with keepdim or without; channels-last, as ConvNeXt-V2's
    Global Response Norm takes them, then ``addcmul``), over the channels (``F.normalize``: per
    pixel, with ``expand_as``; ECA's ``expand_as`` of a small result), a 1-norm over the image
    (untiled), of a channel that is zero everywhere: its 2-norm's gradient is zero, as PyTorch's;
    a standard deviation over the image axes of a channels-last tensor."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.register_buffer("alive", torch.tensor([1.0, 0.0, 1.0, 1.0]).view(1, 4, 1, 1))
        self.weight, self.bias = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(4))

    def forward(self, x):
        raw = self.conv(x)
        y = raw * self.alive
        last = y.permute(0, 2, 3, 1)
        norm = last.norm(p=2, dim=(1, 2), keepdim=True)
        response = last * (norm / (norm.mean(dim=-1, keepdim=True) + 1e-6))
        grn = (last + torch.addcmul(self.bias, self.weight, response)).permute(0, 3, 1, 2)
        scale = torch.linalg.vector_norm(y, dim=(2, 3))
        return (F.normalize(grn, dim=1) * scale[:, :, None, None].expand_as(grn),
                torch.linalg.vector_norm(y, dim=(0, 2, 3)), torch.linalg.vector_norm(y, ord=1, dim=(2, 3)),
                raw.permute(0, 2, 3, 1).std((1, 2)))


@pytest.mark.parametrize("grid", [(1, 1), (2, 2), (4, 3)])
@pytest.mark.parametrize("model", [Statistics, Losses, Norms])
def test_statistics_and_losses(model, grid):
    check_exact(model(), (2, 3, 9, 11), grid=grid)


def test_two_norms_over_the_image_reduce_by_sweeps_and_others_run_untiled():
    graph = trace(Norms(), (2, 3, 9, 11))
    norms = [node for node in graph if node.op == "linalg_vector_norm"]
    assert [role(graph, node.name) for node in norms] == ["reduction", "reduction", "tile", "reduction", "tile"]
    assert [node.tileable for node in norms] == [True] * 4 + [False]  # the 1-norm


@pytest.mark.parametrize("name", ["resnet_head", "groupnorm_resnet", "basic_unet", "convnext_head", "max_heads",
                                  "segmentation_loss", "statistics", "losses"])
def test_the_estimate_counts_the_partials_the_step_keeps(name):
    """What the step keeps of the tiles' partials for its backward (their elements at 8 bytes in
    float64, and ``PARTIAL_TENSOR_BYTES`` per tensor), recorded from every tiled segment's forward
    of a 3x2 plan, is what the estimate counts (``Estimator.partials``): one merged partial per
    reduction, as many as a 1x2 plan keeps."""
    models = {"statistics": (Statistics, (2, 3, 9, 11)), "losses": (Losses, (2, 3, 9, 11))}
    make, shape = models.get(name, (TRAIN_ZOO.get(name), TRAIN_SHAPES.get(name)))
    model = make().double()
    graph = trace(model, shape)
    the_plan = plan(graph, REFERENCE, name=name, grid=(3, 2), dtype="float64")

    def kept_by(a_plan):
        kept = []
        module = load_source(render(a_plan)).__dict__
        forward = module["Tiled"].forward

        def recorded(ctx, *args):
            found = forward(ctx, *args)
            kept.extend(t for level in ctx.parts.values() for part in level for t in part)
            return found

        module["Tiled"].forward = staticmethod(recorded)
        module["TiledModel"](model)(torch.randn(shape, dtype=torch.float64))
        return sum(8 * t.numel() + PARTIAL_TENSOR_BYTES for t in kept if isinstance(t, torch.Tensor))

    estimator = Estimator(graph, REFERENCE, "float64")
    expected = sum(estimator.partials(s.first, s.stop) for s in the_plan.segments if s.mode == "tiled")
    coarser = plan(graph, REFERENCE, name=name, grid=(1, 2), dtype="float64")
    assert expected and kept_by(the_plan) == expected == kept_by(coarser)


def test_per_pixel_cross_entropy_with_ignored_pixels_in_one_segment():
    """The loss one level above the BatchNorm in the same segment (explicit segments); the target
    ``x.argmax(1)`` ignores class 2, about a third of the pixels."""
    name = "segmentation_loss"
    count = len(trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name]))
    x = torch.randn(TRAIN_SHAPES[name], generator=torch.Generator().manual_seed(0))
    assert 0.1 < (x.argmax(1) == 2).double().mean() < 0.6
    for grid in [(2, 2), (4, 3)]:
        check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], segments=[(0, count, grid)])


def test_global_maxima_with_all_zero_channels_and_ties():
    """Channels 0 and 2 are all zero after the ReLU; a 0/1 map ties everywhere: the values, the
    indices (the first maximum, as PyTorch picks it) and the gradients (``amax`` shares it evenly
    among the ties) equal untiled."""
    name = "max_heads"
    model = TRAIN_ZOO[name]().double()
    x = torch.randn(TRAIN_SHAPES[name], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tiled = build(copy.deepcopy(model), TRAIN_SHAPES[name], (3, 4), dtype="float64")
    want, got = model(x), tiled(x)
    assert (want[1][:, 0::2] == 0).all() and (want[1][:, 1::2] > 0).all()
    assert (want[4] == 1).all() and want[2].dtype == got[2].dtype == torch.int64
    for k in (2, 5):  # the indices
        assert torch.equal(want[k], got[k])
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], grid=(3, 4))


class TupleHeads(nn.Module):
    """Two reductions returning tuples, each taken apart by getitems later in the order: the
    moments of one convolution (both parts read, the second two nodes on), and the global maxima
    (with their indices) of another."""

    def __init__(self):
        super().__init__()
        self.conv, self.conv2 = nn.Conv2d(1, 3, 3, stride=2, padding=(2, 3)), nn.Conv2d(1, 3, 3)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        var, mean = torch.var_mean(self.conv(x), (2, 3))
        return self.fc(F.adaptive_max_pool2d(F.leaky_relu(self.conv2(x), 0.1), 1).flatten(1) + mean) + var.sum()


def test_no_segment_ends_between_a_tuple_and_its_getitem():
    """A segment hands on tensors, not tuples: a tiled segment ending at ``var_mean`` or
    ``adaptive_max_pool2d`` dropped their gradients (its autograd function returned the tuple
    whole), and a tiled segment reading a stored one's tuple crashed. No cut candidate (nor one a
    like plan names), no run of one grid and no budget plan ends there; explicit segments that do
    are refused naming both nodes, and so is a plan edited to; every other boundary tiles exactly."""
    model, shape = TupleHeads(), (1, 1, 17, 17)
    graph = trace(model, shape)
    positions = {node.name: k for k, node in enumerate(graph)}
    assert set(graph.ties) == {2, 3, 7}, graph.ties  # var_mean at 1 (getitems 2, 3), the maxima at 6 (getitem 7)
    assert positions["var_mean"] == 1 and positions["adaptive_max_pool2d"] == 6
    full = {name: 1 for name in graph.order}
    assert not set(cut_points(graph, full)) & set(graph.ties)
    assert not set(cut_points(graph, full, near=graph.ties)) & set(graph.ties)  # nor where a like plan cut
    assert not {choice.stop for choice in default_segments(graph, (2, 2))} & set(graph.ties)
    for cut in graph.ties:
        with pytest.raises(TilecError, match=f"segment nodes 0:{cut} ends between node "
                                             f"(var_mean|adaptive_max_pool2d), which returns several tensors"):
            plan(graph, REFERENCE, name="t", segments=[(0, cut, (2, 2)), (cut, len(graph), (1, 1))])
    for cut in sorted(set(range(1, len(graph))) - set(graph.ties))[:6]:
        check_exact(model, shape, segments=[(0, cut, (2, 2)), (cut, len(graph), (1, 1))])
    chosen = choose(graph, REFERENCE, smallest_budget(graph, REFERENCE) * 2)
    assert not {choice.stop for choice in chosen.segments} & set(graph.ties)
    text = dumps(plan(graph, REFERENCE, name="t", segments=[(0, 4, (2, 2)), (4, len(graph), (1, 1))]))
    edited = text.replace('"stop": 4,', '"stop": 3,', 1).replace('"first": 4,', '"first": 3,', 1)
    with pytest.raises(TilecError, match="segment 0 ends at 3, between node var_mean, which returns several tensors, "
                                         "and node getitem_1"):
        loads(edited, "p")


# --- modes: a plan compiled in training mode run in eval mode, and the converse ------------------


def _sweep_lines(text: str) -> list[str]:
    return [part for part in text.replace("\r", "\n").splitlines() if " level " in part or "backward sweep" in part]


def test_a_training_plan_runs_in_eval_mode_without_sweeps(capsys):
    name = "resnet_basic"
    model = TRAIN_ZOO[name]().double()
    tiled = build(model, TRAIN_SHAPES[name], (2, 2), dtype="float64", progress=True)
    model.eval()
    errors = max_errors(model, TRAIN_SHAPES[name], tiled=tiled)
    assert max(errors.values()) <= TOLERANCE, errors
    assert _sweep_lines(capsys.readouterr().err) == []
    model.train()  # and back: batch statistics by sweeps again
    errors = max_errors(model, TRAIN_SHAPES[name], tiled=tiled)
    assert max(errors.values()) <= TOLERANCE, errors
    lines = _sweep_lines(capsys.readouterr().err)
    assert any("level 1" in line for line in lines) and any("backward sweep" in line for line in lines)


def test_a_training_plan_with_some_batch_norms_switched_to_eval():
    name = "mobilenetv2"
    model = TRAIN_ZOO[name]().double()
    tiled = build(model, TRAIN_SHAPES[name], (3, 2), dtype="float64")
    model.blocks[1].eval()
    model.last[1].eval()
    errors = max_errors(model, TRAIN_SHAPES[name], tiled=tiled)
    assert max(errors.values()) <= TOLERANCE, errors


def test_an_eval_plan_refuses_a_batch_norm_switched_to_training():
    name = "mobilenetv2"
    model = ZOO[name]()
    tiled = build(model, SHAPES[name], (2, 2))
    x = torch.randn(SHAPES[name])
    tiled(x)
    model.blocks[1].conv[0][1].train()
    with pytest.raises(ValueError, match=r"module blocks\.1\.conv\.0\.1 \(BatchNorm2d\) is in training mode") as error:
        tiled(x)
    assert "\n" not in str(error.value) and "compile the plan with the module in training mode" in str(error.value)
    model.eval()
    tiled(x)


def test_compiling_leaves_the_model_as_it_was():
    """Tracing a training-mode model runs no real step: buffers and modes are unchanged."""
    name = "efficientnet"
    model = TRAIN_ZOO[name]()
    before = copy.deepcopy(model.state_dict())
    build(model, TRAIN_SHAPES[name], (2, 2))
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert all(module.training for module in model.modules())


def test_steps_accumulate_and_update_buffers_like_pytorch():
    """Two training steps (gradients accumulating) with a no-grad forward in between: the
    gradients and the buffers (the batch counter at 3) equal untiled's."""
    name = "resnet_bottleneck"
    model = TRAIN_ZOO[name]().double()
    reference = copy.deepcopy(model)
    tiled = build(model, TRAIN_SHAPES[name], (3, 2), dtype="float64")
    generator = torch.Generator().manual_seed(5)
    images = [torch.randn(TRAIN_SHAPES[name], dtype=torch.float64, generator=generator) for _ in range(3)]
    for forward, owner in ((reference, reference), (tiled, model)):
        forward(images[0]).square().sum().backward()
        with torch.no_grad():
            forward(images[1])
        forward(images[2]).mul(images[2][:, :1, :9, :8].mean()).sum().backward()
        assert int(owner.bn1.num_batches_tracked) == 3
    grads = [(p.grad - q.grad).abs().max().item() for p, q in zip(reference.parameters(), model.parameters(),
                                                                  strict=True)]
    assert max(grads) <= TOLERANCE
    assert max(buffer_errors(reference, model).values()) <= TOLERANCE


# --- random masks: stochastic depth and Dropout2d under one seed ------------------------------------


def _efficientnet_drop(dropout2d: bool = True) -> nn.Module:
    model = TRAIN_ZOO["efficientnet_drop"]()
    if not dropout2d:
        model.drop2d = nn.Identity()
    return model


def test_the_masks_are_live():
    """Seeds change the stochastic depth and Dropout2d masks: the seeded comparisons are not vacuous."""
    model = _efficientnet_drop().double()
    x = torch.randn(TRAIN_SHAPES["efficientnet_drop"], dtype=torch.float64)
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        outputs.append(model.blocks(model.stem(x)))
    assert not torch.equal(*outputs)
    model.blocks.eval()
    torch.manual_seed(1)
    dropped = model.drop2d(outputs[0])
    assert (dropped.abs().sum((2, 3)) == 0).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("grid", [(2, 2), (4, 3)])
def test_stochastic_depth_under_one_seed(seed, grid):
    check_exact(_efficientnet_drop(dropout2d=False), TRAIN_SHAPES["efficientnet_drop"], grid=grid, seed=seed)


@pytest.mark.parametrize("seed", [0, 3])
def test_stochastic_depth_and_dropout2d_under_one_seed(seed):
    """Dropout2d reads a segment input (a cut right before it): its mask, one value per sample and
    channel, is drawn once per step in the model's op order, as the untiled step draws it."""
    name = "efficientnet_drop"
    graph = trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name])
    cut = next(k for k, n in enumerate(graph.order) if graph.nodes[n].op == "feature_dropout")
    segments = []
    for first, stop, grid, mode, _ in default_segments(graph, (2, 2)):
        segments += [(first, cut, grid, mode), (cut, stop, grid, mode)] if first < cut < stop else [
            (first, stop, grid, mode)]
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], segments=segments, seed=seed)


def test_dropout2d_between_batch_norm_and_pooling():
    """A reduction after BatchNorm -> Dropout2d is level 2: Dropout2d's image output depends on its
    input's level, not only on its mask's (level 0)."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Dropout2d(0.5),
                          nn.AdaptiveAvgPool2d(1)).train()
    check_exact(model, (2, 3, 8, 8), grid=(2, 2))


def test_a_batch_norm_whose_result_is_unused_still_counts():
    """Its running statistics and batch counter update as nn.BatchNorm's do."""
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.out = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 3)

        def forward(self, x):
            y = self.conv(x)
            self.bn(y)
            return self.out(y)

    check_exact(Unused().train(), (2, 3, 8, 8), grid=(2, 2))


def test_a_batch_norm_called_twice():
    """In training mode: refused in one line naming the module (or exact)."""
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.bn(self.b(F.relu(self.bn(self.a(x)))))

    try:
        trace(Twice().train(), (2, 3, 9, 8))
    except TilecError as error:  # refused in one line naming the module: acceptable
        assert "\n" not in str(error) and "module bn (BatchNorm2d)" in str(error)
        return
    check_exact(Twice().train(), (2, 3, 9, 8), grid=(2, 2))


# --- budget plans, autocast ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["squeeze_excite", "groupnorm_resnet"])
def test_budget_plans_of_training_mode_models(name):
    """The search's plan at the smallest feasible budget (segments, grids, levels of its choice)."""
    graph = trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name])
    chosen = choose(graph, TINY, smallest_budget(graph, TINY))
    assert any(level.reductions for s in plan_for(chosen.graph, TINY, name, segments=chosen.segments).segments
               for level in s.levels)
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], segments=chosen.segments, recomputed=chosen.recomputed)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _autocast_step(forward, model, x, enabled: bool):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        outputs = [forward(x)]
    sum(y.float().square().sum() for y in outputs).backward()
    return outputs, [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("name", ["resnet_head", "basic_unet"])
def test_training_mode_under_autocast(name):
    """Under CPU bfloat16 autocast a training step computes what untiled autocast computes: the same
    outputs and dtypes, gradients as close to float32's as untiled autocast's (the gradients that
    are 0 in exact arithmetic, a bias before a normalisation, are bfloat16 noise on both sides:
    only finite), and the running statistics alike."""
    model = TRAIN_ZOO[name]()
    reference, plain = copy.deepcopy(model), copy.deepcopy(model)
    tiled = build(model, TRAIN_SHAPES[name], (2, 3))
    x = torch.randn(TRAIN_SHAPES[name], generator=torch.Generator().manual_seed(0))
    _, want = _autocast_step(reference, reference, x, False)
    plain_out, plain_grads = _autocast_step(plain, plain, x, True)
    tiled_out, tiled_grads = _autocast_step(tiled, model, x, True)
    assert [y.dtype for y in tiled_out] == [y.dtype for y in plain_out]
    assert all(_relative(a, b) <= 2e-3 for a, b in zip(tiled_out, plain_out, strict=True))
    for got, near, exact in zip(tiled_grads, plain_grads, want, strict=True):
        assert torch.isfinite(got).all() and got.dtype == exact.dtype
        if _relative(near, exact) < 0.5:  # not noise
            assert _relative(got, exact) <= 1.5 * _relative(near, exact) + 0.01
    assert max(buffer_errors(plain, model, relative=True).values(), default=0.0) <= 1e-5


def test_a_backward_sweep_for_leaves_adds_no_weight_gradient():
    """A swept level's backward sweep wants the gradients of its results only: the convolutions of
    its tiles must not add their weight gradients as they go (a tile convolution with 32 input
    channels or more adds its matrix-product weight gradient into ``grad`` itself)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.InstanceNorm2d(32, affine=True), nn.LeakyReLU(0.1),
                          nn.Conv2d(32, 32, 3, padding=1), nn.InstanceNorm2d(32, affine=True), nn.LeakyReLU(0.1),
                          nn.Conv2d(32, 2, 1)).train()
    errors = check_exact(model, (1, 3, 21, 19), segments=[(0, 4, (3, 2)), (4, 7, (2, 2))])
    assert errors["grad 3.weight"] <= TOLERANCE


def test_the_estimate_counts_each_sweep_once():
    """One tile, so no halo: every node runs twice in the last sweep (forward, and recomputed in
    backward), once per forward sweep whose prefix holds it and once per backward sweep of a
    swept level; its backward runs in the last sweep, and its input gradient alone (no weight
    gradient) in each swept level's sweep whose results it depends on."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).train()
    graph = trace(model, (1, 3, 12, 10))
    stop = len(graph.order)
    found = levels(graph, 0, stop)
    assert [(level.index, level.swept) for level in found] == [(1, True), (2, True)]
    estimator = Estimator(graph, REFERENCE, "float32")
    tiles = [AxisArrays.of_tiles(graph, 0, stop, axis_tiles(graph, 0, stop, axis, 1)) for axis in (0, 1)]
    flops = estimator.sweep_work(0, stop, *tiles).flops
    facts = estimator.facts
    conv = graph.position[graph.order[3]]
    assert facts.backward_flops[conv] == 2 * facts.flops[conv] == 2 * facts.input_backward_flops[conv]
    prefixes = [_positions(prefix_masks(graph, 0, stop), 0, level) for level in found]
    after = [_positions(dependent_masks(graph, 0, stop), 0, level) for level in found]
    expected = sum(facts.flops[p] * (2 + sum(p in ran for ran in prefixes) + len(found)) + facts.backward_flops[p]
                   + sum(p in back for back in after) * facts.input_backward_flops[p] for p in range(stop))
    assert flops == pytest.approx(expected)


def _positions(masks: tuple[int, ...], first: int, level) -> set[int]:
    """The positions of the nodes whose mask (``prefix_masks``, ``dependent_masks``) has ``level``'s bit."""
    return {first + k for k, mask in enumerate(masks) if mask >> level.index & 1}


@pytest.mark.parametrize("name", ["squeeze_excite", "efficientnet_drop", "basic_unet", "max_heads"])
def test_prefixes_and_dependents_are_ancestors_and_descendants_inside_the_segment(name):
    """A level's prefix is its reductions and what they depend on inside the segment; its
    dependents are its results and what depends on them there: on every segment, against
    networkx's ancestors and descendants in the whole graph."""
    graph = trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name])
    count, checked = len(graph.order), 0
    for first in range(count):
        for stop in range(first + 1, count + 1):
            inside = set(graph.order[first:stop])
            for level in levels(graph, first, stop):
                needed = {*level.reductions}.union(*(nx.ancestors(graph.dag, r) for r in level.reductions)) & inside
                results = {*level.reductions, *level.small}
                after = results.union(*(nx.descendants(graph.dag, r) for r in results)) & inside
                assert _positions(prefix_masks(graph, first, stop), first, level) == {graph.position[n] for n in needed}
                assert _positions(dependent_masks(graph, first, stop), first, level) == {
                    graph.position[n] for n in after}
                checked += 1
    assert checked > count


def test_a_pass_computes_only_the_partials_it_uses():
    """Two BatchNorms training at levels 1 and 2 of one segment of T tiles: the forward sweeps
    compute T partials each (a level's prefix), the last forward sweep none; backward, level 2's
    sweep none (no level above it), level 1's the T of level 2, and the last sweep 2T: 5T in all
    (every pass computing every partial took 10T), and the step stays exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                          nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)).double().train()
    shape, grid = (1, 3, 14, 17), (2, 3)
    reference = copy.deepcopy(model)
    tiled = build(model, shape, segments=[(0, len(trace(model, shape)), grid)], dtype="float64")
    names = type(tiled).__init__.__globals__  # the generated module's copy of the runtime
    computed, partial_moments = [], names["partial_moments"]
    names["partial_moments"] = lambda *args: computed.append(1) or partial_moments(*args)
    x = torch.randn(shape, dtype=torch.float64)
    out = tiled(x)
    out.backward(torch.ones_like(out))
    want = reference(x)
    want.backward(torch.ones_like(want))
    assert len(computed) == 5 * grid[0] * grid[1]
    assert (out - want).abs().max() <= TOLERANCE
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert (a.grad - b.grad).abs().max() <= TOLERANCE
