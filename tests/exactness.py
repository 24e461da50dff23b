"""Shared check: tiled outputs and gradients equal untiled PyTorch's, in float64."""

from __future__ import annotations

import torch
from torch import nn

from tilec.pipeline import build

TOLERANCE = 1e-10


def randomise_buffers(model: nn.Module, generator: torch.Generator) -> None:
    """Give eval-mode BatchNorm non-trivial statistics and affine parameters."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator))
            module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
            if module.affine:
                module.weight.data.copy_(torch.randn(module.weight.shape, generator=generator))
                module.bias.data.copy_(torch.randn(module.bias.shape, generator=generator))


def max_errors(model: nn.Sequential, shape, grid=(1, 1), *, segments=None, seed: int = 0) -> dict[str, float]:
    """Max abs difference per tensor (output, input grad, each parameter grad)."""
    generator = torch.Generator().manual_seed(seed)
    model = model.double()
    with torch.no_grad():
        randomise_buffers(model, generator)
    x = torch.randn(shape, dtype=torch.float64, generator=generator)
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    x_ref = x.clone().requires_grad_()
    y_ref = model(x_ref)
    grad_out = torch.randn(y_ref.shape, dtype=torch.float64, generator=generator)
    ref = torch.autograd.grad(y_ref, [x_ref, *params], grad_out)

    tiled = build(model, shape, None if segments else grid, segments=segments)
    x_tiled = x.clone().requires_grad_()
    y_tiled = tiled(x_tiled)
    got = torch.autograd.grad(y_tiled, [x_tiled, *params], grad_out)

    errors = {"output": (y_tiled - y_ref).abs().max().item()}
    for name, a, b in zip(["input"] + names, ref, got, strict=True):
        errors[f"grad {name}"] = (a - b).abs().max().item()
    return errors


def assert_exact(model: nn.Sequential, shape, grid=(1, 1), *, segments=None, seed: int = 0) -> None:
    errors = max_errors(model, shape, grid, segments=segments, seed=seed)
    bad = {name: error for name, error in errors.items() if not error <= TOLERANCE}
    assert not bad, f"tiled != untiled beyond {TOLERANCE}: {bad}"
