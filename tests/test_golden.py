"""Golden files: the generated module and plan for ``tests/golden/small_model.py`` are byte-stable.

If a change to the planner or the code generator is intended, regenerate them from the
repository root with

    python tests/golden/regenerate.py

and review the diff of ``tests/golden/small_tiled.py`` and ``tests/golden/small.plan.json``.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import torch
from exactness import TOLERANCE, randomise_buffers

from tilec.modelfile import load_model
from tilec.pipeline import compile_model, load_source
from tilec.planio import load

GOLDEN = Path(__file__).resolve().parent / "golden"


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("tilec_golden_regenerate", GOLDEN / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGEN = _regenerate_module()


def _assert_same(committed: Path, fresh: Path) -> None:
    want, got = committed.read_text(encoding="utf-8"), fresh.read_text(encoding="utf-8")
    if want != got:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(committed), "fresh", n=1))
        raise AssertionError(
            f"{committed.name} differs from a fresh compile. If the change is intended, run "
            f"`{REGEN.COMMAND}` from the repository root and commit the result.\n{diff[:4000]}"
        )


def test_golden_files_are_byte_identical(tmp_path):
    result = compile_model(REGEN.config(tmp_path))
    assert result.module_path == tmp_path / REGEN.MODULE_FILE.name
    assert result.plan_path == tmp_path / REGEN.PLAN_FILE.name
    _assert_same(REGEN.MODULE_FILE, result.module_path)
    _assert_same(REGEN.PLAN_FILE, result.plan_path)


def test_golden_plan_describes_the_model():
    plan = load(REGEN.PLAN_FILE)
    assert plan.name == "small" and plan.input_shape == (1, 3, 13, 11) and plan.output_shape == (1, 5, 4, 3)
    (segment,) = plan.segments
    assert segment.grid == REGEN.GRID
    assert [layer.type for layer in plan.model.layers] == [
        "Conv2d", "ReLU", "MaxPool2d", "Conv2d", "BatchNorm2d", "LeakyReLU"]


def test_golden_module_runs_exactly():
    """The committed module, executed as is, matches the untiled model in float64."""
    model, shape = load_model(REGEN.MODEL_FILE)
    model = model.double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        randomise_buffers(model, generator)
    tiled = load_source(REGEN.MODULE_FILE.read_text(encoding="utf-8"), "small_tiled").TiledModel(model)
    for batch in (shape[0], 3):
        x = torch.randn(batch, *shape[1:], dtype=torch.float64, generator=generator)
        params = list(model.parameters())
        x_ref = x.clone().requires_grad_()
        y_ref = model(x_ref)
        grad_out = torch.randn(y_ref.shape, dtype=torch.float64, generator=generator)
        want = (y_ref, *torch.autograd.grad(y_ref, [x_ref, *params], grad_out))
        x_tiled = x.clone().requires_grad_()
        y = tiled(x_tiled)
        got = (y, *torch.autograd.grad(y, [x_tiled, *params], grad_out))
        errors = [(a - b).abs().max().item() for a, b in zip(want, got, strict=True)]
        assert max(errors) <= TOLERANCE, errors


def test_golden_module_is_an_importable_file(tmp_path, monkeypatch):
    """The file on disk imports as a regular module, not only through ``load_source``."""
    spec = importlib.util.spec_from_file_location("small_tiled_file", REGEN.MODULE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, _ = load_model(REGEN.MODEL_FILE)
    assert module.PLAN_NAME == "small" and module.OUTPUT_SHAPE == (1, 5, 4, 3)
    assert module.TiledModel(model)(torch.randn(1, 3, 13, 11)).shape == (1, 5, 4, 3)
