"""The ``tilec`` command line, through click's CliRunner: compile, inspect, help and refusals."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tilec.cli import main
from tilec.modelfile import load_model

ROOT = Path(__file__).resolve().parents[1]
VGG16 = ROOT / "examples" / "vgg16.py"

SMALL = """
from torch import nn

INPUT_SHAPE = (1, 2, 15, 13)
model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), {extra})
"""


def _invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def vgg_files(tmp_path_factory) -> tuple[Path, Path, str]:
    out = tmp_path_factory.mktemp("vgg")
    result = _invoke("compile", VGG16, "--input-shape", "1,3,64,64", "--grid", "2x2", "--out-dir", out,
                     "--plan-dir", out)
    assert result.exit_code == 0, result.output
    return out / "vgg16_tiled.py", out / "vgg16.plan.json", result.output


def test_compile_writes_both_files(vgg_files):
    module_path, plan_path, output = vgg_files
    assert module_path.is_file() and plan_path.is_file()
    assert sorted(p.name for p in module_path.parent.iterdir()) == ["vgg16.plan.json", "vgg16_tiled.py"]
    assert "plan vgg16: input 1x3x64x64 -> output 1x512x2x2" in output
    assert f"wrote {plan_path} and {module_path}" in " ".join(output.split())


def test_compiled_module_imports_and_trains(vgg_files):
    module = _import(vgg_files[0])
    assert module.INPUT_SHAPE == (1, 3, 64, 64) and module.OUTPUT_SHAPE == (1, 512, 2, 2)
    torch.manual_seed(0)
    model, _ = load_model(VGG16)
    tiled = module.TiledModel(model)
    x = torch.randn(1, 3, 64, 64)
    y = tiled(x)
    reference = model(x)
    assert y.shape == (1, 512, 2, 2)
    torch.testing.assert_close(y, reference, rtol=1e-4, atol=1e-5)
    y.square().sum().backward()
    tiled_grad = model[0].weight.grad.clone()
    model.zero_grad()
    model(x).square().sum().backward()
    torch.testing.assert_close(tiled_grad, model[0].weight.grad, rtol=1e-3, atol=1e-6)


def test_inspect_tile(vgg_files):
    result = _invoke("inspect", vgg_files[1], "--tile", "1,0")
    assert result.exit_code == 0, result.output
    assert "segment 0, tile 1,0" in result.output
    for header in ("output rows", "reads cols", "padded input", "pad", "grad in"):
        assert header in result.output
    assert result.output.count("│ 1,0 ") == 31  # one row per layer of VGG16's conv part
    assert "MaxPool2d" in result.output and "66x66" in result.output and "1/1/1/1" in result.output


def test_inspect_layer(vgg_files):
    result = _invoke("inspect", vgg_files[1], "--layer", "3")
    assert result.exit_code == 0, result.output
    assert "segment 0, layer 3" in result.output
    for tile in ("0,0", "0,1", "1,0", "1,1"):
        assert f"│ {tile} " in result.output
    assert result.output.count("ReLU") == 4


def test_inspect_summary_only(vgg_files):
    result = _invoke("inspect", vgg_files[1])
    assert result.exit_code == 0, result.output
    assert "plan vgg16" in result.output and "2x2" in result.output and "segment 0," not in result.output


@pytest.mark.parametrize("args", [["--help"], ["compile", "--help"], ["inspect", "--help"], ["-h"]])
def test_help(args):
    result = _invoke(*args)
    assert result.exit_code == 0
    assert "Usage:" in result.output
    if "compile" in args:
        assert all(flag in result.output for flag in ("--input-shape", "--grid", "--out-dir", "--plan-dir", "--attr"))
    if "inspect" in args:
        assert all(flag in result.output for flag in ("--tile", "--layer", "--segment"))
    if args in (["--help"], ["-h"]):
        assert "compile" in result.output and "inspect" in result.output


def test_version():
    result = _invoke("--version")
    assert result.exit_code == 0 and "0.1.0" in result.output


# --- refusals -------------------------------------------------------------------------------------


def _assert_refused(result, *culprits: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: "), lines[0]
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])


COMPILE_REFUSALS = {
    "missing_file": (None, ["--grid", "2x2"], ["nope.py", "does not exist"]),
    "grid_one_number": (SMALL.format(extra=""), ["--grid", "4"], ["--grid", "'4'"]),
    "grid_zero": (SMALL.format(extra=""), ["--grid", "0x2"], ["--grid", "'0x2'"]),
    "grid_words": (SMALL.format(extra=""), ["--grid", "twoxtwo"], ["'twoxtwo'"]),
    "grid_too_fine": (SMALL.format(extra=""), ["--grid", "7x4"], ["grid 7x4", "finer", "(6x5)"]),
    "no_grid": (SMALL.format(extra=""), [], ["--grid"]),
    "shape_letters": (SMALL.format(extra=""), ["--grid", "2x2", "--input-shape", "1,2,a,9"], ["'1,2,a,9'"]),
    "shape_three_numbers": (SMALL.format(extra=""), ["--grid", "2x2", "--input-shape", "1,2,15"],
                            ["N,C,H,W", "(1, 2, 15)"]),
    "shape_zero": (SMALL.format(extra=""), ["--grid", "2x2", "--input-shape", "1,2,0,9"], ["(1, 2, 0, 9)"]),
    "shape_wrong_channels": (SMALL.format(extra=""), ["--grid", "1x1", "--input-shape", "1,5,15,13"],
                             ["layer 0 (Conv2d)", "expects 2 input channels", "gives 5"]),
    "shape_too_small": (SMALL.format(extra=""), ["--grid", "1x1", "--input-shape", "1,2,3,13"],
                        ["input is too small", "layer 2 (MaxPool2d)"]),
    "linear": (SMALL.format(extra="nn.Flatten(0), nn.Linear(3, 2)"), ["--grid", "1x1"],
               ["layer 3 (Flatten)", "not supported"]),
    "linear_only": ("from torch import nn\nINPUT_SHAPE = (1, 4, 8, 8)\nmodel = nn.Sequential(nn.ReLU(), "
                    "nn.Linear(8, 2))\n", ["--grid", "1x1"], ["layer 1 (Linear)", "not supported"]),
    "bn_training": ("from torch import nn\nINPUT_SHAPE = (1, 2, 9, 9)\nmodel = nn.Sequential(nn.Conv2d(2, 2, 3), "
                    "nn.Sequential(nn.BatchNorm2d(2)))\n", ["--grid", "2x2"],
                    ["layer 1.0 (BatchNorm2d)", "training mode", ".eval()"]),
    "dropout_training": ("from torch import nn\nINPUT_SHAPE = (1, 2, 9, 9)\nmodel = nn.Sequential(nn.Dropout(0.5))\n",
                         ["--grid", "2x2"], ["layer 0 (Dropout)", "training mode"]),
    "syntax_error": ("from torch import nn\nmodel = nn.Sequential(\n", ["--grid", "1x1"], ["syntax error"]),
    "raises": ("from torch import nn\nmodel = nn.Sequential(nn.Conv2d(2, 2, 3, groups=3))\n", ["--grid", "1x1"],
               ["running the model file raised"]),
    "no_attribute": ("from torch import nn\nnet = nn.Sequential(nn.ReLU())\n", ["--grid", "1x1"],
                     ["'model'", "--attr"]),
    "not_sequential": ("from torch import nn\nINPUT_SHAPE = (1, 1, 4, 4)\nmodel = nn.Conv2d(1, 1, 1)\n",
                       ["--grid", "1x1"], ["Conv2d", "not an nn.Sequential"]),
    "no_input_shape": ("from torch import nn\nmodel = nn.Sequential(nn.ReLU())\n", ["--grid", "1x1"],
                       ["--input-shape", "INPUT_SHAPE"]),
}


@pytest.mark.parametrize("case", list(COMPILE_REFUSALS))
def test_compile_refusals(case, tmp_path):
    source, flags, culprits = COMPILE_REFUSALS[case]
    model_file = tmp_path / "nope.py" if source is None else _write(tmp_path, "model_file.py", source)
    out = tmp_path / "out"
    result = _invoke("compile", model_file, *flags, "--out-dir", out, "--plan-dir", out / "plans")
    _assert_refused(result, *culprits)
    assert not out.exists(), "a refused compile wrote output"


def test_unwritable_output_writes_nothing(tmp_path):
    model_file = _write(tmp_path, "model_file.py", SMALL.format(extra=""))
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a directory should be", encoding="utf-8")
    plans = tmp_path / "plans"
    result = _invoke("compile", model_file, "--grid", "2x2", "--out-dir", blocker / "sub", "--plan-dir", plans)
    _assert_refused(result, "cannot write")
    assert not any(plans.glob("*")) if plans.exists() else True
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*_tiled.py"))


def test_refused_compile_keeps_existing_files(tmp_path):
    model_file = _write(tmp_path, "model_file.py", SMALL.format(extra=""))
    out = tmp_path / "out"
    assert _invoke("compile", model_file, "--grid", "2x2", "--out-dir", out, "--plan-dir", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _assert_refused(_invoke("compile", model_file, "--grid", "9x9", "--out-dir", out, "--plan-dir", out), "9x9")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(
    ("flags", "culprits"),
    [
        (["--tile", "2,0"], ["--tile 2,0", "2x2"]),
        (["--tile", "1"], ["--tile", "'1'"]),
        (["--tile", "a,b"], ["'a,b'"]),
        (["--layer", "31"], ["--layer 31", "31 layers"]),
        (["--tile", "0,0", "--segment", "1"], ["--segment 1", "1 segment"]),
    ],
)
def test_inspect_refusals(vgg_files, flags, culprits):
    _assert_refused(_invoke("inspect", vgg_files[1], *flags), *culprits)


@pytest.mark.parametrize(
    ("text", "culprits"),
    [(None, ["cannot read plan", "missing.plan.json"]), ("{not json", ["is not JSON"]),
     ('{"schema_version": 1}', ["violates the plan schema"]), ('{"schema_version": 7}', ["schema_version 7"])],
)
def test_inspect_bad_plan_files(tmp_path, text, culprits):
    path = tmp_path / "missing.plan.json"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    _assert_refused(_invoke("inspect", path), *culprits)


def test_usage_errors_exit_2():
    result = _invoke("compile")
    assert result.exit_code == 2 and "Missing argument" in result.output and "Traceback" not in result.output
    result = _invoke("inspect", "x.json", "--layer", "three")
    assert result.exit_code == 2 and "three" in result.output
