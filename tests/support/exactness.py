"""Shared check: tiled outputs and gradients equal untiled PyTorch's, in float64.

``check_exact(model, shape, grid=..., segments=...)`` runs ``model`` untiled and through the
``TiledModel`` that ``tilec.pipeline.build`` generates, with the same float64 input, the same
random output gradients and the same seed before each forward (``torch.manual_seed``: dropout
masks and stochastic depth draw alike), and compares every output leaf (tensors, tuples,
dicts...), the input gradient, every parameter gradient and every buffer after the step (BatchNorm
in training mode updates its running statistics and batch count): the untiled step runs on a deep
copy of the model taken before compiling, so each side updates its own buffers, and compiling
must leave them as they were. The model runs in the mode it is given (``model.train()`` for
batch statistics). The suite's conftest fills ``new_empty`` / ``empty_like``
with NaN, so an output element no tile writes shows up as an error too. ``kernels="generic"``
runs the generic tile kernels (``tilec.runtime.device``: CUDA's path) instead of the CPU's.
``eval_after=True`` then puts both models in eval mode and compares one more forward's outputs
(``eval output...``): a plan compiled in training mode validates with plain's outputs.
``batch``: tiles of one shape class per call (``tilec.runtime.batches``).
``check_close`` compares in float32, within rounding, relative to each tensor's scale.
``traced_as``: a name for the model's architecture (a zoo name): every build under one name, shape,
mode and dtype in a test process reuses the first one's graphs (``traced_once``; they hold shapes and
ops, not values), so that the checks of one model on many grids trace it once.
``tiled_segments(tiled)`` gives the ``TiledSegment`` s behind a ``TiledModel``.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import tilec.pipeline
from tilec.pipeline import build
from tilec.runtime.dropout import counter_dropout

TOLERANCE = 1e-10
#: Largest difference of a float32 result from untiled float32, relative to the largest magnitude
#: of the untiled tensor: tiles sum their convolutions and gradients in another order.
FLOAT32_RTOL = 1e-4
#: ``check_close(noise_floor=True)``: a tensor whose true value is about 0 (the gradient of a
#: convolution's bias before a training-mode BatchNorm) is rounding noise in both float32 steps; its
#: difference is allowed this many times untiled float32's own max error against float64 (seen: up
#: to 6x on an AMD EPYC, EfficientNet's projection BatchNorm biases, tiles summing in another order).
NOISE_FACTOR = 10.0


#: ``traced_once``'s graphs per (name, shape, mode, dtype), for this test process.
TRACES: dict[tuple, object] = {}


@contextmanager
def traced_once(key: tuple | None):
    """While it lasts, the pipeline's ``trace_modes`` gives the graphs first traced under ``key``
    (``None``: it traces as usual)."""
    if key is None:
        yield
        return
    original = tilec.pipeline.trace_modes

    def trace_modes(model, inputs, autocast=None):
        if key not in TRACES:
            TRACES[key] = original(model, inputs, autocast)
        return TRACES[key]

    tilec.pipeline.trace_modes = trace_modes
    try:
        yield
    finally:
        tilec.pipeline.trace_modes = original


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


def counted(model: nn.Module):
    """``model``'s forward run under tilec's counter-based dropout masks (``counter_dropout``)."""
    def forward(*inputs):
        with counter_dropout(model):
            return model(*inputs)

    return forward


def max_errors(model: nn.Module, shape, *, grid=None, segments=None, batch=None, recomputed=(), seed: int = 0,
               tiled: nn.Module | None = None, kernels: str = "auto", dtype: torch.dtype = torch.float64,
               device: str = "cpu", relative: bool = False, noise_floor: float | None = None,
               counter: bool = False, eval_after: bool = False, traced_as: str | None = None) -> dict[str, float]:
    """Max abs difference per tensor: every output leaf, the input gradient, each parameter
    gradient (``grad NAME``) and each buffer after the step (``buffer NAME``); with
    ``eval_after``, every output leaf of an eval-mode forward after the step (``eval output...``).

    ``model`` is converted to ``dtype`` (float64) and moved to ``device`` in place; the untiled
    reference step runs on a deep copy of it taken before compiling. ``tiled``: an already built
    ``TiledModel`` of ``model``; else one is built with ``kernels``. ``relative``: each difference
    divided by the largest magnitude of the untiled tensor (1 where that is 0). ``noise_floor``
    (with ``relative``): the divisor is at least ``noise_floor`` times the max difference of the
    untiled step from the same step in float64 (run on another deep copy, converted). ``counter``:
    the untiled step draws element-wise dropout masks as tiles do (``counted``).
    """
    generator = torch.Generator().manual_seed(seed)
    model = model.to(dtype)
    randomise_buffers(model, generator)
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).double() if noise_floor else None
    key = None if traced_as is None else (traced_as, tuple(shape), model.training, dtype)
    if tiled is None:  # compiled on the CPU; the TiledModel reads the model's tensors where they are
        with traced_once(key):
            tiled = build(model, shape, grid, segments=segments, batch=batch, recomputed=recomputed,
                          dtype=str(dtype).removeprefix("torch."), kernels=kernels)
    model, reference = model.to(device), reference.to(device)
    x = torch.randn(shape, dtype=dtype, generator=generator).to(device)
    named = [name for name, p in model.named_parameters() if p.requires_grad]
    want, want_spec, grads_out, want_grads = _run(counted(reference) if counter else reference, x,
                                                  _parameters(reference, named), seed)
    got, got_spec, _, got_grads = _run(tiled, x, _parameters(model, named), seed, grads_out)
    assert got_spec == want_spec, f"tiled output structure {got_spec} != untiled {want_spec}"
    floors = [0.0] * (len(want) + len(want_grads))
    if exact is not None:
        exact = exact.to(device)
        doubled = [None if g is None else g.double() for g in grads_out]
        best, _, _, best_grads = _run(exact, x.double(), _parameters(exact, named), seed, doubled)
        floors = [noise_floor * _error(a.to(b.dtype) if b is not None else a, b)
                  for a, b in zip([*best, *best_grads], [*want, *want_grads], strict=True)]
    errors: dict[str, float] = {}
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        errors[f"output[{index}]" if len(want) > 1 else "output"] = _error(a, b, relative, floors[index])
    for k, (name, a, b) in enumerate(zip(["input", *named], want_grads, got_grads, strict=True)):
        errors[f"grad {name}"] = _error(a, b, relative, floors[len(want) + k])
    errors.update(buffer_errors(reference, model, relative))
    if eval_after:
        model.eval(), reference.eval()
        with torch.no_grad():
            want, got = tree_flatten(reference(x))[0], tree_flatten(tiled(x))[0]
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            errors[f"eval output[{index}]" if len(want) > 1 else "eval output"] = _error(a, b, relative)
    return errors


def buffer_errors(want: nn.Module, got: nn.Module, relative: bool = False) -> dict[str, float]:
    """``buffer NAME``: the max difference of each buffer of ``got`` from ``want``'s (the same
    architecture); a buffer one has and the other has not is infinitely wrong."""
    a, b = dict(want.named_buffers()), dict(got.named_buffers())
    errors = {f"buffer {name}": float("inf") for name in a.keys() ^ b.keys()}
    errors.update({f"buffer {name}": _error(a[name], b[name], relative) for name in a if name in b})
    return errors


def _parameters(model: nn.Module, names: list[str]) -> list[torch.Tensor]:
    parameters = dict(model.named_parameters())
    return [parameters[name] for name in names]


def _run(forward, x: torch.Tensor, params: list[torch.Tensor], seed: int, grads_out=None):
    """Forward with ``torch.manual_seed(seed)``, then gradients of the flattened outputs."""
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    leaves, spec = tree_flatten(forward(x))
    if grads_out is None:
        generator = torch.Generator().manual_seed(seed + 1)
        grads_out = [torch.randn(leaf.shape, dtype=leaf.dtype, generator=generator).to(leaf.device)
                     if leaf.is_floating_point() else None for leaf in leaves]  # none for indices
    pairs = [(leaf, g) for leaf, g in zip(leaves, grads_out, strict=True) if leaf.requires_grad]
    grads = torch.autograd.grad([a for a, _ in pairs], [x, *params], [b for _, b in pairs], allow_unused=True)
    return leaves, spec, grads_out, grads


def _error(a: torch.Tensor | None, b: torch.Tensor | None, relative: bool = False, floor: float = 0.0) -> float:
    """Max abs difference (``relative``: over ``a``'s largest magnitude, or ``floor`` where that is
    larger); ``None`` (no gradient) equals zeros; NaN anywhere is infinitely wrong, as are
    different shapes or dtypes."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    difference = (a.detach().double() - b.detach().double()).abs()
    if torch.isnan(difference).any():
        return float("inf")
    scale = max(a.detach().double().abs().max().item(), floor) if relative else 1.0
    return difference.max().item() / (scale or 1.0)


def _assert_within(errors: dict[str, float], tolerance: float, what: str) -> None:
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tolerance, (
        f"tiled != untiled: worst is {worst} with max {what} error {errors[worst]:.3g} > {tolerance:g}; "
        f"beyond tolerance: { {k: v for k, v in errors.items() if not v <= tolerance} }"
    )


def check_exact(model: nn.Module, shape, *, grid=None, segments=None, batch=None, recomputed=(),
                tolerance: float = TOLERANCE, seed: int = 0, kernels: str = "auto", device: str = "cpu",
                counter: bool = False, eval_after: bool = False, traced_as: str | None = None) -> dict[str, float]:
    """Assert tiled == untiled within ``tolerance`` (float64) for outputs, every gradient and every
    buffer (``counter``: ``max_errors``'s; with ``eval_after``, an eval-mode forward's outputs after
    the step)."""
    errors = max_errors(model, shape, grid=grid, segments=segments, batch=batch, recomputed=recomputed, seed=seed,
                        kernels=kernels, device=device, counter=counter, eval_after=eval_after, traced_as=traced_as)
    _assert_within(errors, tolerance, "abs")
    return errors


def check_close(model: nn.Module, shape, *, grid=None, segments=None, rtol: float = FLOAT32_RTOL, seed: int = 0,
                kernels: str = "auto", device: str = "cpu", noise_floor: bool = False,
                traced_as: str | None = None) -> dict[str, float]:
    """Assert tiled == untiled in float32 within ``rtol`` of each tensor's largest magnitude, for
    outputs, every gradient and every buffer. ``noise_floor``: a difference within
    ``NOISE_FACTOR`` times untiled float32's own error against float64 passes too (tensors whose
    true value is about 0, as in training-mode BatchNorm's input bias gradients)."""
    errors = max_errors(model, shape, grid=grid, segments=segments, seed=seed, kernels=kernels,
                        dtype=torch.float32, device=device, relative=True,
                        noise_floor=NOISE_FACTOR / rtol if noise_floor else None, traced_as=traced_as)
    _assert_within(errors, rtol, "relative")
    return errors
