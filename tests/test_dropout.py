"""Element-wise Dropout in training mode on 4-D images: tilec's counter-based masks.

A tiled step equals the plain model run under ``counter_dropout`` with the same seed, in float64
(outputs, input gradient, parameter gradients, buffers), on grids from 1x1 (stored) to 4x3 and odd
sizes; the masks do not depend on the grid, and their statistics are those of dropout: the keep
rate within a binomial bound, kept elements scaled by 1 / (1 - p), neighbours uncorrelated, a new
mask every step and the same one under the same seed.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tilec.codegen import render
from tilec.ops import rule
from tilec.pipeline import build
from tilec.planner import plan
from tilec.runtime.dropout import counter_dropout, keep_mask, op_key, step_stream
from tilec.trace import trace

from support.exactness import check_exact, counted
from support.zoo import dropout_segmenter

SHAPE = (2, 3, 17, 15)


@pytest.mark.parametrize("grid", [(1, 1), (2, 2), (3, 1), (4, 3)])
def test_segmentation_heads_with_dropout_train_exactly(grid):
    """DeepLabV3's ASPP (global pooling branch, Dropout 0.5), FCN's head (Dropout 0.1) and an
    ``F.dropout`` in the model's forward, with BatchNorm in training mode."""
    errors = check_exact(dropout_segmenter(), SHAPE, grid=grid, counter=True)
    assert any(name.startswith("grad aspp.project") for name in errors)


@pytest.mark.parametrize("grid", [(2, 3), (4, 4)])
def test_segmenter_without_pooling_branch_trains_exactly(grid):
    check_exact(dropout_segmenter(pooling=False), (1, 3, 19, 13), grid=grid, counter=True, seed=3)


def test_segments_cut_at_the_dropouts_train_exactly():
    """Each Dropout first in a tiled segment, or in a stored one of its own."""
    graph = trace(dropout_segmenter(pooling=False).double(), SHAPE)
    names = list(graph.nodes)
    drops = [k for k, name in enumerate(names) if graph.nodes[name].op == "dropout"]
    assert len(drops) == 3
    first, last = drops[0], drops[-1]
    segments = [(0, first, (2, 2)), (first, first + 1, (1, 1)), (first + 1, last, (3, 2)), (last, len(names), (2, 3))]
    check_exact(dropout_segmenter(pooling=False), SHAPE, segments=segments, counter=True)


def _masks(model: nn.Module, forward, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return forward(x)


def _dropout_model(p: float) -> nn.Module:
    """ReLU then Dropout on a positive input: its output over ``x * 1 / (1 - p)`` is the mask."""
    return nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU(), nn.Dropout(p)).double().train()


def test_the_mask_does_not_depend_on_the_grid():
    """Grids 1x1 (stored), 2x2, 4x3 and 5x1 and the plain model draw the same elements."""
    model = _dropout_model(0.5)
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(3).view(3, 3, 1, 1))
        model[0].bias.fill_(1.0)
    x = torch.rand(2, 3, 23, 19, dtype=torch.float64)
    want = _masks(model, counted(model), x, 7)
    assert 0.3 < (want == 0).double().mean().item() < 0.7
    for grid in [(1, 1), (2, 2), (4, 3), (5, 1)]:
        got = _masks(model, build(model, x.shape, grid), x, 7)
        assert torch.equal(got == 0, want == 0), grid
        assert (got - want).abs().max().item() <= 1e-12


def test_masks_differ_across_steps_and_repeat_under_a_seed():
    model = _dropout_model(0.5)
    tiled = build(model, (1, 3, 16, 16), (2, 2))
    x = torch.rand(1, 3, 16, 16, dtype=torch.float64) + 1.0
    torch.manual_seed(0)
    with torch.no_grad():
        first, second = tiled(x), tiled(x)
    again = _masks(model, tiled, x, 0)
    assert torch.equal(first, again)
    agree = ((first == 0) == (second == 0)).double().mean().item()
    assert agree < 0.7  # two independent masks at p = 0.5 agree on about half the elements


def test_eval_mode_is_the_identity_and_draws_nothing():
    model = dropout_segmenter(pooling=False).double()
    tiled = build(model, SHAPE, (2, 2))
    model.eval()
    x = torch.randn(SHAPE, dtype=torch.float64)
    torch.manual_seed(0)
    with torch.no_grad():
        got = tiled(x)
        state = torch.get_rng_state()
        want = model(x)
    assert torch.equal(state, torch.get_rng_state())
    assert (got - want).abs().max().item() <= 1e-10


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_p_zero_and_one_are_pytorchs(p):
    """p = 0 keeps everything unscaled, p = 1 drops everything (gradients zero), as PyTorch."""
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Dropout(p)).double().train()
    x = torch.randn(1, 3, 12, 10, dtype=torch.float64, requires_grad=True)
    got = build(model, x.shape, (2, 2))(x)
    want = nn.functional.dropout(model[0](x), p, True)
    assert torch.equal(got, want) if p == 1 else (got - want).abs().max().item() <= 1e-12
    got.sum().backward()
    assert (x.grad.abs().max().item() == 0) == (p == 1)


def test_p_zero_in_training_mode_is_the_identity_inside_the_tiles():
    """timm's blocks carry ``Dropout(0.0)`` on images: it draws nothing and hashes no element, so it
    neither sweeps nor cuts a tiled segment."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.0), nn.Dropout2d(0.0), nn.Conv2d(4, 2, 3),
                          nn.BatchNorm2d(2)).train()
    graph = trace(model, (1, 3, 13, 11))
    assert [n.name for n in graph if rule(n).reduces(n, graph)] == ["batch_norm"]
    assert "= element_dropout(" not in render(plan(graph, name="p0", grid=(3, 2)))
    check_exact(model, (2, 3, 13, 11), grid=(3, 2))


def test_p_zero_draws_no_seed_in_the_reference_either():
    """A ``Dropout(0.0)`` on an image before a ``Dropout2d`` (timm's ConvNeXt encoder under smp's FPN
    head), and an element-wise one after it: ``counter_dropout`` draws the step's seed where the
    tiles do, at the first dropout of ``p > 0``, so the ``Dropout2d`` masks drawn from torch's
    generator are the same and the seeded steps equal."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Dropout(0.0), nn.Dropout2d(0.5), nn.Conv2d(4, 4, 3),
                          nn.Dropout(0.3), nn.Conv2d(4, 2, 3)).train()
    check_exact(model, (2, 3, 13, 11), grid=(3, 2), counter=True)


# --- statistics ----------------------------------------------------------------------------------


def _keep(p: float, seed: int, shape=(2, 4, 96, 80), key: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    stream = step_stream({}, op_key("head", key), True, "cpu")
    return keep_mask(int(stream), shape, (0,) * len(shape), shape, p, "cpu")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_binomial(p):
    keep = _keep(p, 0)
    n = keep.numel()
    assert abs(keep.double().mean().item() - (1 - p)) <= 5 * math.sqrt(p * (1 - p) / n)


def test_kept_elements_are_scaled_as_pytorch_scales_them():
    x = torch.rand(1, 2, 30, 30, dtype=torch.float64) + 1.0
    with counter_dropout(model := nn.Sequential(nn.Dropout(0.3)).train()):
        torch.manual_seed(0)
        out = model(x)
    kept = out != 0
    assert (out[kept] - x[kept] / 0.7).abs().max().item() <= 1e-15
    assert 0.5 < kept.double().mean().item() < 0.9


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return (a * b).sum().item() / math.sqrt((a * a).sum().item() * (b * b).sum().item())


def test_neighbouring_elements_steps_and_ops_are_independent():
    """The keep indicators of neighbours (along columns, rows, channels, samples), of two steps and
    of two ops are uncorrelated within 5 standard errors."""
    keep = _keep(0.5, 0)
    pairs = [(keep[..., 1:], keep[..., :-1]), (keep[:, :, 1:], keep[:, :, :-1]), (keep[:, 1:], keep[:, :-1]),
             (keep[1:], keep[:-1]), (keep, _keep(0.5, 1)), (keep, _keep(0.5, 0, key=2))]
    for a, b in pairs:
        assert abs(_correlation(a, b)) <= 5 / math.sqrt(a.numel()), a.shape
    assert torch.equal(keep, _keep(0.5, 0))


def test_a_block_draws_its_own_elements():
    """A block at an origin draws what the full tensor draws there (what a tile relies on)."""
    shape, full = (2, 3, 7, 5), (2, 3, 40, 33)
    stream = int(step_stream({}, 12345, True, "cpu"))
    whole = keep_mask(stream, full, (0, 0, 0, 0), full, 0.5, "cpu")
    block = keep_mask(stream, shape, (0, 0, 30, 21), full, 0.5, "cpu")
    assert torch.equal(block, whole[:, :, 30:37, 21:26])


def test_under_autocast_tiles_draw_the_plain_masks():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Dropout(0.4), nn.Conv2d(4, 2, 1)).train()
    x = torch.randn(1, 3, 14, 13)
    tiled = build(model, x.shape, (2, 2))
    results = []
    for forward in (tiled, counted(model)):
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            results.append(forward(x).float())
    assert (results[0] - results[1]).abs().max().item() <= 0.05 * results[1].abs().max().item()
