"""Shared check: tiled outputs and gradients equal untiled PyTorch's, in float64.

``check_exact(model, shape, grid=..., segments=...)`` runs ``model`` untiled and through the
``TiledModel`` that ``tilec.pipeline.build`` generates, with the same float64 input and the same
random output gradients, and compares every output leaf (tensors, tuples, dicts...), the input
gradient and every parameter gradient. The suite's conftest fills ``new_empty`` / ``empty_like``
with NaN, so an output element no tile writes shows up as an error too. ``generated(tiled)``
gives the globals of the generated module behind a ``TiledModel`` (its helpers and segments).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tilec.pipeline import build

TOLERANCE = 1e-10


def generated(tiled: nn.Module | None = None) -> dict:
    """The globals of the generated module of ``tiled``; by default of a small one (the helpers,
    ``_conv2d``, ``_Arena`` and the rest, are the same in every generated module)."""
    if tiled is None:
        tiled = build(nn.Sequential(nn.Conv2d(1, 1, 3)), (1, 1, 8, 8), grid=(2, 2))
    return type(tiled).__init__.__globals__


def randomise_buffers(model: nn.Module, generator: torch.Generator) -> None:
    """Give BatchNorm non-trivial running statistics and affine parameters."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                if module.running_mean is not None:
                    module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator))
                    module.running_var.copy_(torch.rand(module.running_var.shape, generator=generator) + 0.5)
                if module.affine:
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator))
                    module.bias.copy_(torch.randn(module.bias.shape, generator=generator))


def _run(forward, x: torch.Tensor, params: list[torch.Tensor], seed: int, grads_out=None):
    """Forward with ``torch.manual_seed(seed)``, then gradients of the flattened outputs."""
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    leaves, spec = tree_flatten(forward(x))
    if grads_out is None:
        generator = torch.Generator().manual_seed(seed + 1)
        grads_out = [torch.randn(leaf.shape, dtype=leaf.dtype, generator=generator) for leaf in leaves]
    pairs = [(leaf, g) for leaf, g in zip(leaves, grads_out, strict=True) if leaf.requires_grad]
    grads = torch.autograd.grad([a for a, _ in pairs], [x, *params], [b for _, b in pairs], allow_unused=True)
    return leaves, spec, grads_out, grads


def max_errors(model: nn.Module, shape, *, grid=None, segments=None, recomputed=(), seed: int = 0,
               tiled: nn.Module | None = None) -> dict[str, float]:
    """Max abs difference per tensor: every output leaf, the input gradient, each parameter gradient.

    ``model`` is converted to float64 in place. ``tiled``: an already built ``TiledModel`` of it.
    """
    generator = torch.Generator().manual_seed(seed)
    model = model.double()
    randomise_buffers(model, generator)
    if tiled is None:
        tiled = build(model, shape, grid, segments=segments, recomputed=recomputed, dtype="float64")
    x = torch.randn(shape, dtype=torch.float64, generator=generator)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    want, want_spec, grads_out, want_grads = _run(model, x, params, seed)
    got, got_spec, _, got_grads = _run(tiled, x, params, seed, grads_out)
    assert got_spec == want_spec, f"tiled output structure {got_spec} != untiled {want_spec}"
    errors: dict[str, float] = {}
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        errors[f"output[{index}]" if len(want) > 1 else "output"] = _error(a, b)
    for name, a, b in zip(["input"] + [name for name, _ in named], want_grads, got_grads, strict=True):
        errors[f"grad {name}"] = _error(a, b)
    return errors


def _error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Max abs difference; ``None`` (no gradient) equals zeros; NaN anywhere is infinitely wrong."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    difference = (a.detach() - b.detach()).abs()
    if torch.isnan(difference).any():
        return float("inf")
    return difference.max().item()


def check_exact(model: nn.Module, shape, *, grid=None, segments=None, recomputed=(), tolerance: float = TOLERANCE,
                seed: int = 0) -> dict[str, float]:
    """Assert tiled == untiled within ``tolerance`` (float64) for outputs and every gradient."""
    errors = max_errors(model, shape, grid=grid, segments=segments, recomputed=recomputed, seed=seed)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, (
        f"tiled != untiled: worst is {worst} with max abs error {errors[worst]:.3g} > {tolerance:g}; "
        f"beyond tolerance: { {k: v for k, v in errors.items() if not v <= tolerance} }"
    )
    return errors
