"""The top-level API: ``import tilec`` is light and exposes compile, load, slide and the errors;
``tilec.compile`` takes budgets as bytes or text and grids as tuples or text; ``tilec.load`` loads
what ``tilec compile`` wrote, and refuses what it did not, in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import tilec
from tilec.config import CompileConfig
from tilec.graph import Graph
from tilec.pipeline import compile_model, plan_for
from tilec.planio import dumps
from tilec.target import Target
from tilec.trace import trace

ROOT = Path(__file__).resolve().parent.parent
SHAPE = (1, 3, 29, 35)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)).double()


def _errors(model, tiled) -> float:
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, got = model(x), tiled(x)
    grads = [torch.autograd.grad(y.square().sum(), list(model.parameters())) for y in (want, got)]
    return max([(want - got).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(*grads, strict=True)])


def test_import_tilec_is_light_and_exposes_the_api():
    code = "import sys, tilec; print(sorted(m for m in ('torch', 'numpy', 'tilec.pipeline') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"
    assert set(tilec.__all__) == {"compile", "load", "slide", "TilecError", "ModelFileError", "UnsupportedLayerError",
                                  "ShapeError", "GridError", "PlanError", "BudgetError", "OutputError", "SlideError"}
    assert all(issubclass(getattr(tilec, name), tilec.TilecError) for name in tilec.__all__ if name.endswith("Error"))
    with pytest.raises(AttributeError):
        tilec.build  # noqa: B018


def test_compile_takes_grids_as_text_and_is_exact():
    model = _model()
    assert _errors(model, tilec.compile(model, SHAPE, grid="3x2", dtype="float64")) <= 1e-10


def test_budgets_are_bytes_or_text():
    graph: Graph = trace(_model(), SHAPE)
    as_text = plan_for(graph, Target(), "m", memory_budget="1.5MiB", dtype="float64")
    as_bytes = plan_for(graph, Target(), "m", memory_budget=3 << 19, dtype="float64")
    assert dumps(as_text) == dumps(as_bytes) and as_text.memory_budget == 3 << 19
    for bad in ("2 parsecs", -5, 1.5, True):
        with pytest.raises(tilec.BudgetError, match="budget") as raised:
            tilec.compile(_model(), SHAPE, memory_budget=bad)
        assert "\n" not in str(raised.value)


def test_load_returns_the_tiled_model_of_a_written_module(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text("import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
                          "model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, "
                          "stride=2, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))\n"
                          f"INPUT_SHAPE = {SHAPE}\n")
    result = compile_model(CompileConfig(model_path=model_file, grid=(2, 3), dtype="float64", out_dir=tmp_path,
                                         plan_dir=tmp_path))
    model = _model()
    tiled = tilec.load(result.module_path, model, read_ahead=False)
    assert tiled.model is model and _errors(model, tiled) <= 1e-10


@pytest.mark.parametrize(("options", "error", "words"), [
    ({"inputs": None}, tilec.ShapeError, "inputs must be a shape"),
    ({"inputs": "1,3,29,35"}, tilec.ShapeError, "inputs must be a shape"),
    ({"segments": [(0, 6)]}, tilec.GridError, "segments must be"),
    ({"segments": [(0, 6, (2, 2), "bogus")]}, tilec.GridError, "mode None, 'tiled' or 'stored'"),
    ({"recomputed": None}, tilec.GridError, "recomputed must be a list of node names"),
    ({"dtype": torch.float32}, tilec.ShapeError, "dtype must be one of"),
    ({"dtype": "int8"}, tilec.ShapeError, "dtype must be one of"),
    ({"autocast": ("cuda", "float16")}, tilec.TilecError, "autocast must be a text"),
    ({"autocast": "x"}, tilec.TilecError, "--autocast must be DEVICE:DTYPE"),
    ({"name": None}, tilec.TilecError, "name must be a text"),
    ({"ranks": "2"}, tilec.GridError, "ranks must be a number"),
    ({"kernels": "bogus"}, tilec.TilecError, "kernels must be one of"),
])
def test_compile_refuses_arguments_of_the_wrong_kind_in_one_line(options, error, words):
    arguments = {"inputs": SHAPE, "grid": (2, 2), **options}
    with pytest.raises(error, match=words) as raised:
        tilec.compile(_model(), arguments.pop("inputs"), **arguments)
    assert "\n" not in str(raised.value)


def test_load_refuses_what_tilec_did_not_write(tmp_path):
    (tmp_path / "other.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('no')\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "net.plan.json").write_text("{}\n")
    for path, words in [(tmp_path / "missing_tiled.py", "does not exist"), (tmp_path / "other.py", "no TiledModel"),
                        (tmp_path / "broken.py", "RuntimeError"), (tmp_path / "exits.py", "SystemExit: 3"),
                        (tmp_path / "net.plan.json", "is not a Python module"), (None, "module_path must be")]:
        with pytest.raises(tilec.PlanError, match=words) as raised:
            tilec.load(path, _model())
        assert "\n" not in str(raised.value)
