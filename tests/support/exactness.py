"""Shared check: tiled outputs and gradients equal untiled PyTorch's, in float64.

``check_exact(model, shape, grid=..., segments=...)`` runs ``model`` untiled and through the
``TiledModel`` that ``tilec.pipeline.build`` generates, with the same float64 input and the same
random output gradients, and compares every output leaf (tensors, tuples, dicts...), the input
gradient and every parameter gradient. The suite's conftest fills ``new_empty`` / ``empty_like``
with NaN, so an output element no tile writes shows up as an error too. ``kernels="generic"``
runs the generic tile kernels (``tilec.runtime.device``: CUDA's path) instead of the CPU's.
``check_close`` compares in float32, within rounding, relative to each tensor's scale.
``tiled_segments(tiled)`` gives the ``TiledSegment`` s behind a ``TiledModel``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tilec.pipeline import build

TOLERANCE = 1e-10
#: Largest difference of a float32 result from untiled float32, relative to the largest magnitude
#: of the untiled tensor: tiles sum their convolutions and gradients in another order.
FLOAT32_RTOL = 1e-4


def tiled_segments(tiled: nn.Module) -> list:
    """The ``TiledSegment`` s of a ``TiledModel`` (each generated module has its own class)."""
    return [step.run for step in type(tiled).steps if type(step.run).__name__ == "TiledSegment"]


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


def max_errors(model: nn.Module, shape, *, grid=None, segments=None, recomputed=(), seed: int = 0,
               tiled: nn.Module | None = None, kernels: str = "auto", dtype: torch.dtype = torch.float64,
               device: str = "cpu", relative: bool = False) -> dict[str, float]:
    """Max abs difference per tensor: every output leaf, the input gradient, each parameter gradient.

    ``model`` is converted to ``dtype`` (float64) and moved to ``device`` in place. ``tiled``: an
    already built ``TiledModel`` of it; else one is built with ``kernels``. ``relative``: each
    difference divided by the largest magnitude of the untiled tensor (1 where that is 0).
    """
    generator = torch.Generator().manual_seed(seed)
    model = model.to(dtype)
    randomise_buffers(model, generator)
    if tiled is None:  # compiled on the CPU; the TiledModel reads the model's tensors where they are
        tiled = build(model, shape, grid, segments=segments, recomputed=recomputed,
                      dtype=str(dtype).removeprefix("torch."), kernels=kernels)
    model = model.to(device)
    x = torch.randn(shape, dtype=dtype, generator=generator).to(device)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    want, want_spec, grads_out, want_grads = _run(model, x, params, seed)
    got, got_spec, _, got_grads = _run(tiled, x, params, seed, grads_out)
    assert got_spec == want_spec, f"tiled output structure {got_spec} != untiled {want_spec}"
    errors: dict[str, float] = {}
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        errors[f"output[{index}]" if len(want) > 1 else "output"] = _error(a, b, relative)
    for name, a, b in zip(["input"] + [name for name, _ in named], want_grads, got_grads, strict=True):
        errors[f"grad {name}"] = _error(a, b, relative)
    return errors


def _run(forward, x: torch.Tensor, params: list[torch.Tensor], seed: int, grads_out=None):
    """Forward with ``torch.manual_seed(seed)``, then gradients of the flattened outputs."""
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    leaves, spec = tree_flatten(forward(x))
    if grads_out is None:
        generator = torch.Generator().manual_seed(seed + 1)
        grads_out = [torch.randn(leaf.shape, dtype=leaf.dtype, generator=generator).to(leaf.device)
                     for leaf in leaves]
    pairs = [(leaf, g) for leaf, g in zip(leaves, grads_out, strict=True) if leaf.requires_grad]
    grads = torch.autograd.grad([a for a, _ in pairs], [x, *params], [b for _, b in pairs], allow_unused=True)
    return leaves, spec, grads_out, grads


def _error(a: torch.Tensor | None, b: torch.Tensor | None, relative: bool = False) -> float:
    """Max abs difference (``relative``: over ``a``'s largest magnitude); ``None`` (no gradient)
    equals zeros; NaN anywhere is infinitely wrong."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    difference = (a.detach().double() - b.detach().double()).abs()
    if torch.isnan(difference).any():
        return float("inf")
    scale = a.detach().double().abs().max().item() if relative else 1.0
    return difference.max().item() / (scale or 1.0)


def _assert_within(errors: dict[str, float], tolerance: float, what: str) -> None:
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, (
        f"tiled != untiled: worst is {worst} with max {what} error {errors[worst]:.3g} > {tolerance:g}; "
        f"beyond tolerance: { {k: v for k, v in errors.items() if not v <= tolerance} }"
    )


def check_exact(model: nn.Module, shape, *, grid=None, segments=None, recomputed=(), tolerance: float = TOLERANCE,
                seed: int = 0, kernels: str = "auto", device: str = "cpu") -> dict[str, float]:
    """Assert tiled == untiled within ``tolerance`` (float64) for outputs and every gradient."""
    errors = max_errors(model, shape, grid=grid, segments=segments, recomputed=recomputed, seed=seed,
                        kernels=kernels, device=device)
    _assert_within(errors, tolerance, "abs")
    return errors


def check_close(model: nn.Module, shape, *, grid=None, segments=None, rtol: float = FLOAT32_RTOL, seed: int = 0,
                kernels: str = "auto", device: str = "cpu") -> dict[str, float]:
    """Assert tiled == untiled in float32 within ``rtol`` of each tensor's largest magnitude, for
    outputs and every gradient."""
    errors = max_errors(model, shape, grid=grid, segments=segments, seed=seed, kernels=kernels,
                        dtype=torch.float32, device=device, relative=True)
    _assert_within(errors, rtol, "relative")
    return errors
