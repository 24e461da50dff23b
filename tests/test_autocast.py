"""Mixed precision: under ``torch.autocast`` (CPU, bfloat16) a ``TiledModel`` computes in the dtypes
autocast picks for each op, forward and in the backward's re-run, returns autocast's output
dtypes, keeps parameter gradients in the parameters' dtype, and is as close to a float32
reference as untiled autocast is; it trains with ``torch.amp.GradScaler``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

from tilec.pipeline import build

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
