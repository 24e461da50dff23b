"""``tilec verify``: compile a model file into a temporary folder and check the tiled step is exact.

The generated module is imported from the file the compiler wrote, so the check covers the
whole pipeline (plan file, validated reload, the module's own ``check_plan``). Tiled and
untiled steps run in float64 on the same random inputs and output gradient; the result is
the max absolute error per tensor: output, each floating input's gradient, each parameter
gradient. Floating inputs are drawn from a normal distribution, ``uint8`` images (4-D) over
0..255 and other integer or boolean inputs (masks, labels) over 0..1.
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tilec.config import CompileConfig
from tilec.errors import ShapeError, TilecError
from tilec.ir import Plan
from tilec.modelfile import load_model
from tilec.pipeline import compile_model
from tilec.planio import load
from tilec.trace import check_inputs

TOLERANCE = 1e-10


@dataclass(frozen=True)
class TensorCheck:
    name: str
    shape: tuple[int, ...]
    error: float


@dataclass(frozen=True)
class Verdict:
    plan: Plan
    grid: tuple[int, int]
    checks: tuple[TensorCheck, ...]
    tolerance: float

    @property
    def exact(self) -> bool:
        return all(check.error <= self.tolerance for check in self.checks)


def default_grid(in_shape: Sequence[int], wanted: tuple[int, int] = (2, 2)) -> tuple[int, int]:
    """``wanted``, clipped to an image input's size (each tiled segment clips it to its outputs)."""
    return min(wanted[0], in_shape[-2]), min(wanted[1], in_shape[-1])


def random_inputs(inputs, generator: torch.Generator) -> list[torch.Tensor]:
    """Per ``(shape, dtype)`` of ``inputs`` (``None``: float64), random values (module docstring)."""
    found = []
    for shape, dtype in inputs:
        kind = getattr(torch, dtype) if dtype else torch.float64
        if kind.is_floating_point:
            found.append(torch.randn(shape, dtype=torch.float64, generator=generator))
        else:
            high = 256 if kind == torch.uint8 and len(shape) == 4 else 2
            found.append(torch.randint(0, high, shape, generator=generator).to(kind))
    return found


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(f"tilec_verify_{path.stem.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        raise TilecError(f"--device {name!r} is not usable here: {str(error).splitlines()[0]}") from None
    if device.type == "meta":
        raise TilecError(f"--device {name!r} holds no data; verify runs on a device that computes (cpu, cuda)")
    return device


def _flat(value) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def compare(tiled_class, model: nn.Module, inputs, *, seed: int = 0, device: str = "cpu") -> list[TensorCheck]:
    """Max abs error per tensor between ``tiled_class(model)`` and ``model`` in float64: every
    output, every floating input's gradient and every parameter gradient, for random inputs
    (``inputs``: ``(shape, dtype)`` each, or one shape) and output gradients."""
    target = _device(device)
    model = copy.deepcopy(model).to(device=target, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    xs = [x.to(target) for x in random_inputs(check_inputs(inputs), generator)]
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    grads_of = [k for k, x in enumerate(xs) if x.is_floating_point()]

    def leaves(values):
        return [x.clone().requires_grad_(x.is_floating_point()) for x in values]

    x_ref = leaves(xs)
    y_ref = _flat(model(*x_ref))
    grad_out = [torch.randn(tuple(y.shape), dtype=torch.float64, generator=generator).to(target) for y in y_ref]
    expected = torch.autograd.grad(y_ref, [*(x_ref[k] for k in grads_of), *params], grad_out, allow_unused=True)

    tiled = tiled_class(model)
    x_tiled = leaves(xs)
    y_tiled = _flat(tiled(*x_tiled))
    got = torch.autograd.grad(y_tiled, [*(x_tiled[k] for k in grads_of), *params], grad_out, allow_unused=True)

    def error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
        if a is None or b is None:
            return 0.0 if a is None and b is None else float("inf")
        return (a - b).abs().max().item() if a.numel() else 0.0

    checks = [TensorCheck(f"output {index}" if len(y_ref) > 1 else "output", tuple(a.shape), error(b, a))
              for index, (a, b) in enumerate(zip(y_ref, y_tiled, strict=True))]
    names = [f"gradient of input {k + 1}" if len(xs) > 1 else "input gradient" for k in grads_of]
    names += [f"gradient of {name}" for name, _ in named]
    for name, a, b in zip(names, expected, got, strict=True):
        checks.append(TensorCheck(name, tuple(a.shape) if a is not None else (), error(a, b)))
    return checks


def verify(
    model_path: Path,
    *,
    attr: str = "model",
    inputs=None,
    grid: tuple[int, int] | None = None,
    seed: int = 0,
    tolerance: float = TOLERANCE,
    device: str = "cpu",
) -> Verdict:
    """Compile ``model_path`` into a temporary folder and compare tiled with untiled training."""
    model_path = Path(model_path)
    model, default_inputs = load_model(model_path, attr)
    inputs = inputs or default_inputs
    if inputs is None:
        raise ShapeError(f"give --input-shape N,C,H,W or --input SHAPE:DTYPE per input: {model_path} defines "
                         f"neither INPUTS nor INPUT_SHAPE")
    inputs = tuple(check_inputs(inputs))
    if grid is None:
        images = [shape for shape, _ in inputs if len(shape) in (3, 4)]
        grid = default_grid(images[0]) if images else (1, 1)
    if not tolerance >= 0:
        raise TilecError(f"--tolerance must be a non-negative number, got {tolerance}")
    with tempfile.TemporaryDirectory(prefix="tilec-verify-") as folder:
        config = CompileConfig(model_path=model_path, attr=attr, inputs=inputs, grid=grid,
                               name="verify", out_dir=Path(folder), plan_dir=Path(folder))
        result = compile_model(config)
        plan = load(result.plan_path)
        module = _import(result.module_path)
        module.check_plan(str(result.plan_path))
        checks = compare(module.TiledModel, model, inputs, seed=seed, device=device)
    tiled = [segment.grid for segment in plan.segments if segment.mode == "tiled"]
    return Verdict(plan=plan, grid=tiled[0] if tiled else (1, 1), checks=tuple(checks), tolerance=tolerance)
