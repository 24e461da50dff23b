"""Mixed precision: under ``torch.autocast`` (CPU, bfloat16) a ``TiledModel`` computes in the dtypes
autocast picks for each op, forward and in the backward's re-run, returns autocast's output
dtypes, keeps parameter gradients in the parameters' dtype, and is as close to a float32
reference as untiled autocast is; it trains with ``torch.amp.GradScaler``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from tilec.errors import UnsupportedLayerError
from tilec.pipeline import build
from tilec.trace import trace

from support.published import published
from support.zoo import SHAPES, ZOO

MODELS = ["resnet_head", "unet_bilinear", "unet_transposed", "convnext", "efficientnet", "densenet"]


def _step(forward, model, x, autocast: bool):
    """Outputs, input gradient and parameter gradients of ``sum(y.float()**2)``."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outputs = tree_leaves(forward(x))
    sum(y.float().square().sum() for y in outputs).backward()
    return outputs, [x.grad, *(p.grad for p in model.parameters())]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", MODELS)
def test_tiled_autocast_matches_untiled_autocast(name):
    model = ZOO[name]()
    tiled = build(model, SHAPES[name], (2, 3))
    x = torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(0))
    reference_out, reference_grads = _step(model, model, x, autocast=False)
    plain_out, plain_grads = _step(model, model, x, autocast=True)
    tiled_out, tiled_grads = _step(tiled, model, x, autocast=True)
    assert [y.dtype for y in tiled_out] == [y.dtype for y in plain_out]
    assert [g.dtype for g in tiled_grads] == [g.dtype for g in reference_grads]
    for got, want in zip(tiled_out, plain_out, strict=True):  # the same ops in the same dtypes
        assert _relative(got, want) <= 2e-3
    for got, plain, want in zip(tiled_grads, plain_grads, reference_grads, strict=True):
        assert _relative(got, want) <= 1.5 * _relative(plain, want) + 0.01


def test_grad_scaler_steps_a_tiled_model_like_an_untiled_one():
    name = "resnet_head"
    model = ZOO[name]()
    tiled = build(model, SHAPES[name], (2, 2))
    x = torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(1))
    start = [p.detach().clone() for p in model.parameters()]
    after = []
    for forward in (model, tiled):
        with torch.no_grad():
            for p, value in zip(model.parameters(), start, strict=True):
                p.copy_(value)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(x).float().square().mean()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        after.append([p.detach().clone() for p in model.parameters()])
    moved = [_relative(a - s, b - s) for a, b, s in zip(after[1], after[0], start, strict=True) if (b - s).any()]
    assert moved and max(moved) <= 0.05


NORMS = {"batch": lambda: nn.BatchNorm2d(8), "group": lambda: nn.GroupNorm(2, 8),
         "instance": lambda: nn.InstanceNorm2d(8, affine=True)}


@pytest.mark.parametrize(("segments", "bound"), [
    ([(0, 5, (3, 2), "tiled")], 1.1),  # both normalisations swept: partial and apply in one tile
    ([(0, 4, (3, 2)), (4, 5, (3, 2))], 2.0),  # the last direct: its share added to a rounded gradient
], ids=["swept", "direct"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_normalisations_input_gradient_rounds_as_plains(norm, segments, bound):
    """A training-mode normalisation's input gradient is its own term plus its statistics' share,
    which PyTorch adds in float32 and rounds once. In a tile both read one float32 copy of the input,
    so tiled gradients are as far from float32 as plain's; a direct level's share is added in float32
    to the rounded own term (``docs/runtime.md``). A loss of the normalised output alone makes the
    two terms nearly cancel: without the shared copy the first case drifts 1.6-2.6x as far."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), NORMS[norm](), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, bias=False), NORMS[norm]())
    tiled = build(model, (2, 3, 34, 30), segments=segments)
    x = torch.randn(2, 3, 34, 30, generator=torch.Generator().manual_seed(1))
    _, reference = _step(model, model, x, autocast=False)
    _, plain = _step(model, model, x, autocast=True)
    _, got = _step(tiled, model, x, autocast=True)
    ratios = [_relative(g, want) / _relative(p, want) for g, p, want in zip(got, plain, reference, strict=True)]
    assert max(ratios) <= bound, ratios


class FullPrecisionBlock(nn.Module):
    """A block of ``forward`` computing in float32 whatever autocast does, as EfficientViT's
    attention does: ``.float()`` inside ``torch.autocast(..., enabled=False)``; a per-pixel
    product by a parameter (autocast would run it in bfloat16) and a mean over the image."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.weight = nn.Parameter(torch.randn(8, 5) / 3)

    def forward(self, x):
        y = self.conv(x)
        with torch.autocast(device_type=y.device.type, enabled=False):
            pixels = y.float().permute(0, 2, 3, 1) @ self.weight
            means = pixels.mean((1, 2))
        return pixels.permute(0, 3, 1, 2), means


class AutocastOnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return self.conv(x)


def test_a_block_with_autocast_off_computes_with_it_off_in_the_tiles():
    model = FullPrecisionBlock()
    graph = trace(model, (1, 3, 13, 11), autocast="cpu:bfloat16")
    assert {n.op for n in graph if n.autocast_off} >= {"matmul", "mean"}
    assert all(n.autocast_dtype is None for n in graph if n.autocast_off)
    assert [n.op for n in graph if n.autocast_dtype] == ["conv2d"]
    tiled = build(model, (1, 3, 13, 11), (3, 2), autocast="cpu:bfloat16")
    x = torch.randn(1, 3, 13, 11, generator=torch.Generator().manual_seed(0))
    plain_out, plain_grads = _step(model, model, x, autocast=True)
    tiled_out, tiled_grads = _step(tiled, model, x, autocast=True)
    assert [y.dtype for y in plain_out] == [y.dtype for y in tiled_out] == [torch.float32, torch.float32]
    for got, want in zip(tiled_out, plain_out, strict=True):
        assert _relative(got, want) <= 1e-5
    for got, want in zip(tiled_grads, plain_grads, strict=True):  # bfloat16 convolutions' gradients, tile by tile
        assert _relative(got, want) <= 5e-3


def test_timm_efficientvit_attention_under_autocast_matches_plain():
    """timm's ``LiteMLA``: its ReLU attention in float32, the convolutions around it in bfloat16
    (BatchNorm frozen; ``test_a_normalisations_input_gradient_rounds_as_plains`` trains one)."""
    lite = published("timm.models.efficientvit_mit").LiteMLA
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), lite(16, 16, dim=8)).eval()
    tiled = build(model, (1, 3, 17, 15), (3, 2))
    x = torch.randn(1, 3, 17, 15, generator=torch.Generator().manual_seed(0))
    reference_out, reference_grads = _step(model, model, x, autocast=False)
    plain_out, plain_grads = _step(model, model, x, autocast=True)
    tiled_out, tiled_grads = _step(tiled, model, x, autocast=True)
    assert [y.dtype for y in tiled_out] == [y.dtype for y in plain_out]
    for got, want in zip(tiled_out, plain_out, strict=True):
        assert _relative(got, want) <= 2e-3
    for got, plain, want in zip(tiled_grads, plain_grads, reference_grads, strict=True):
        assert _relative(got, want) <= 1.5 * _relative(plain, want) + 0.01


class NestedBlocks(AutocastOnBlock):
    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            y = self.conv(x).float() * 2
            with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
                return y + 1


@pytest.mark.parametrize(("model", "message"), [
    (AutocastOnBlock, r"AutocastOnBlock\) turns torch.autocast on inside forward"),
    (NestedBlocks, r"NestedBlocks\) nests another block inside a torch.autocast\(enabled=False\) block"),
], ids=["on", "nested"])
def test_other_autocast_blocks_are_refused_in_one_line(model, message):
    with pytest.raises(UnsupportedLayerError, match=message):
        trace(model(), (1, 3, 8, 8))
