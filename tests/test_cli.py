"""The ``tilec`` command line, through click's CliRunner: compile, inspect, verify, help, refusals."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import textwrap
import warnings
from pathlib import Path

import click
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tilec.cli import main, refusals
from tilec.ir import segments_text
from tilec.modelfile import load_model
from tilec.planio import load

RESIDUAL = """
import torch
from torch import nn

INPUT_SHAPE = (1, 3, 19, 17)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        x = self.stem(x)
        x = x + self.body(x)
        return self.fc(torch.flatten(self.pool(x), 1))


model = lambda: Net().eval()
"""


def _invoke(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args], prog_name="tilec")


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
def compiled(tmp_path_factory) -> tuple[Path, Path, Path]:
    out = tmp_path_factory.mktemp("net")
    model_file = _write(out, "net.py", RESIDUAL)
    result = _invoke("compile", model_file, "--grid", "3x2", "--out-dir", out, "--plan-dir", out)
    assert result.exit_code == 0, result.output
    # the pooling and the linear head run by a sweep inside the one tiled segment
    assert "wrote" in result.output and "tiled" in result.output and "stored" not in result.output
    assert "reduces by sweeps" in result.output and "adaptive_avg_pool2d" in result.output
    return model_file, out / "net.plan.json", out / "net_tiled.py"


def test_compile_writes_a_module_that_trains_exactly(compiled):
    model_file, plan_path, module_path = compiled
    module = _import(module_path)
    module.check_plan(str(plan_path))
    model, ((shape, _),) = load_model(model_file)
    model.double()
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    y = model(x)
    g = torch.randn_like(y)
    expected = torch.autograd.grad(y, [x, *model.parameters()], g)
    got = torch.autograd.grad(module.TiledModel(model)(x), [x, *model.parameters()], g)
    assert max((a - b).abs().max().item() for a, b in zip(expected, got, strict=True)) < 1e-10


def test_import_loads_the_bytecode_compile_wrote_unless_the_source_changed(compiled, tmp_path, monkeypatch):
    _, _, module_path = compiled
    compiled_on_import = []
    source_to_code = importlib.machinery.SourceFileLoader.source_to_code
    monkeypatch.setattr(importlib.machinery.SourceFileLoader, "source_to_code",
                        lambda *args, **kwargs: compiled_on_import.append(1) or source_to_code(*args, **kwargs))
    assert _import(module_path).TiledModel and not compiled_on_import
    edited = tmp_path / module_path.name
    edited.write_text(module_path.read_text(encoding="utf-8") + "EDITED = True\n", encoding="utf-8")
    cache = Path(importlib.util.cache_from_source(str(edited)))
    cache.parent.mkdir()
    cache.write_bytes(Path(importlib.util.cache_from_source(str(module_path))).read_bytes())
    assert _import(edited).EDITED and compiled_on_import


def test_inspect_lists_segments_nodes_and_tiles(compiled):
    _, plan_path, _ = compiled
    result = _invoke("inspect", plan_path, "--nodes")
    assert result.exit_code == 0, result.output
    assert "add" in result.output and "adaptive_avg_pool2d" in result.output
    result = _invoke("inspect", plan_path, "--tile", "1,1", "--node", "conv2d_1")
    assert result.exit_code == 0, result.output
    assert "conv2d_1" in result.output


@pytest.mark.parametrize("args, words", [
    (["--tile", "9,9"], ["--tile", "9,9"]),
    (["--node", "nope"], ["nope"]),
    (["--tile", "a,b"], ["--tile", "'a,b'"]),
    (["--segment", "7", "--tile", "0,0"], ["--segment", "7"]),
])
def test_inspect_refusals(compiled, args, words):
    _, plan_path, _ = compiled
    result = _invoke("inspect", plan_path, *args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert all(word in result.output for word in words), result.output


@pytest.mark.parametrize("dim, words", [(1, ["inputs[0].shape", "cannot be read by node conv2d", "channels"]),
                                         (0, ["inputs[0].shape (2,", "gives node conv2d (aten.conv2d) shape (2,"])])
def test_inspect_refuses_a_plan_whose_input_shape_its_graph_cannot_read(compiled, tmp_path, dim, words):
    _, plan_path, _ = compiled
    data = json.loads(plan_path.read_text(encoding="utf-8"))
    data["inputs"][0]["shape"][dim] += 1
    edited = tmp_path / "edited.plan.json"
    edited.write_text(json.dumps(data), encoding="utf-8")
    result = _invoke("inspect", edited)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: ") and all(word in result.output for word in words), result.output


def test_compile_with_segments_and_budget(tmp_path):
    model_file = _write(tmp_path, "net.py", RESIDUAL)
    result = _invoke("compile", model_file, "--segments", "0:1@2x2,1:5@3x3,5:8@1x1", "--out-dir", tmp_path,
                     "--plan-dir", tmp_path)
    assert result.exit_code == 0, result.output
    result = _invoke("compile", model_file, "--memory-budget", "64MiB", "--out-dir", tmp_path, "--plan-dir",
                     tmp_path, "--name", "budget")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "budget_tiled.py").is_file()


SKIP = """
import torch
from torch import nn

INPUT_SHAPE = (1, 2, 23, 21)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU())
        self.deep = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()) for _ in range(6)])
        self.out = nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x):
        skip = self.enc(x)
        return self.out(torch.cat([skip, self.deep(skip)], 1))


model = Net
"""


def test_compile_recomputes_a_named_skip(tmp_path):
    model_file = _write(tmp_path, "skip.py", SKIP)
    result = _invoke("compile", model_file, "--recompute", "relu", "--segments", "0:5@2x2,5:14@1x1,14:18@3x2",
                     "--out-dir", tmp_path, "--plan-dir", tmp_path)
    assert result.exit_code == 0, result.output
    assert "recomputed from the input by later readers instead of kept: relu (2 nodes)" in result.output
    result = _invoke("inspect", tmp_path / "skip.plan.json", "--nodes")
    assert "relu_recomputed0" in result.output and "conv2d_recomputed0" in result.output
    module = _import(tmp_path / "skip_tiled.py")
    model, ((shape, _),) = load_model(model_file)
    model.double()
    x = torch.randn(shape, dtype=torch.float64)
    expected = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    got = torch.autograd.grad(module.TiledModel(model)(x).square().sum(), list(model.parameters()))
    assert max((a - b).abs().max().item() for a, b in zip(expected, got, strict=True)) < 1e-10


def test_inspect_prints_the_flags_that_compile_the_same_plan(tmp_path):
    """``tilec inspect`` ends its summary with ``--segments`` (tiles per call included) and
    ``--recompute``: compiled with them, the model gives the same plan file, byte for byte."""
    model_file = _write(tmp_path, "skip.py", SKIP)
    first, again = tmp_path / "first", tmp_path / "again"
    result = _invoke("compile", model_file, "--recompute", "relu", "--segments",
                     "0:5@2x2/2,5:9@1x1:tiled,9:14@1x1,14:18@3x2", "--out-dir", first, "--plan-dir", first)
    assert result.exit_code == 0, result.output
    result = _invoke("inspect", first / "skip.plan.json")
    line, = [line for line in result.output.splitlines() if line.startswith("the same segments: ")]
    assert line == "the same segments: --segments 0:5@2x2/2,5:9@1x1:tiled,9:14@1x1,14:18@3x2 --recompute relu"
    flags = line.removeprefix("the same segments: ").split()
    result = _invoke("compile", model_file, *flags, "--out-dir", again, "--plan-dir", again)
    assert result.exit_code == 0, result.output
    assert (again / "skip.plan.json").read_bytes() == (first / "skip.plan.json").read_bytes()


def test_segments_in_tiles_of_one_period_compile_and_inspect_gives_them_back(tmp_path):
    """``FIRST:STOP@ROWSxCOLSpx``: tiles that many input pixels long, the last taking the rest (19
    rows in 6-pixel tiles: 4 of them); ``tilec inspect`` prints them so, and they compile the same
    plan again."""
    model_file = _write(tmp_path, "net.py", RESIDUAL)
    first, again = tmp_path / "first", tmp_path / "again"
    result = _invoke("compile", model_file, "--segments", "0:5@6x5px,5:8@1x1", "--out-dir", first, "--plan-dir", first)
    assert result.exit_code == 0, result.output
    segment = json.loads((first / "net.plan.json").read_text())["segments"][0]
    assert segment["period"] == [6, 5] and segment["grid"] == [4, 4]
    assert [row["owned"][0] for row in segment["rows"]] == [[0, 6], [6, 12], [12, 18], [18, 19]]
    result = _invoke("inspect", first / "net.plan.json")
    line, = [line for line in result.output.splitlines() if line.startswith("the same segments: ")]
    assert line == "the same segments: --segments 0:5@6x5px,5:8@1x1"
    result = _invoke("compile", model_file, *line.removeprefix("the same segments: ").split(), "--out-dir", again,
                     "--plan-dir", again)
    assert result.exit_code == 0, result.output
    assert (again / "net.plan.json").read_bytes() == (first / "net.plan.json").read_bytes()


STRIDED = """
from torch import nn

INPUT_SHAPE = (1, 3, 19, 17)
model = lambda: nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
"""


def test_tiles_of_a_period_no_stride_divides_are_refused(tmp_path):
    """At stride 2 (10 rows of 19), 3-pixel tiles have no length: one line naming the segment."""
    model_file = _write(tmp_path, "net.py", STRIDED)
    result = _invoke("compile", model_file, "--segments", "0:3@3x4px", "--out-dir", tmp_path, "--plan-dir", tmp_path)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert "segment nodes 0:3 cannot be tiled every 3 input pixels" in result.output, result.output
    assert list(tmp_path.iterdir()) == [model_file]
    result = _invoke("compile", model_file, "--segments", "0:3@4x4px", "--out-dir", tmp_path, "--plan-dir", tmp_path)
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(("names", "words"), [("conv2d_3", "no reader comes"), ("relu,", "must be node names"),
                                               ("nothing", "there is no such node"),
                                               ("relu,relu", "the node is named twice")])
def test_compile_refuses_what_cannot_be_recomputed(tmp_path, names, words):
    model_file = _write(tmp_path, "skip.py", SKIP)
    result = _invoke("compile", model_file, "--recompute", names, "--grid", "2x2", "--out-dir", tmp_path,
                     "--plan-dir", tmp_path)
    assert result.exit_code == 2, result.output
    assert words in result.output and "--recompute" in result.output and len(result.output.splitlines()) == 1
    assert list(tmp_path.iterdir()) == [model_file]


SWAP = """
import torch
from torch import nn

INPUT_SHAPE = (1, 3, 12, 12)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.b(self.a(x).transpose(2, 3))


model = Net
"""


def test_a_whole_network_with_its_head_compiles_as_one_tiled_segment(tmp_path):
    model_file = _write(tmp_path, "net.py", RESIDUAL)
    result = _invoke("compile", model_file, "--segments", "0:8@2x2", "--out-dir", tmp_path, "--plan-dir", tmp_path)
    assert result.exit_code == 0, result.output
    result = _invoke("inspect", tmp_path / "net.plan.json", "--nodes")
    assert result.exit_code == 0 and "stored" not in result.output, result.output


def test_segment_that_cannot_be_tiled_is_refused(tmp_path):
    """Swapping H and W cannot run tile by tile (rules are per axis)."""
    model_file = _write(tmp_path, "net.py", SWAP)
    result = _invoke("compile", model_file, "--segments", "0:3@2x2", "--out-dir", tmp_path, "--plan-dir", tmp_path)
    assert result.exit_code == 2, result.output
    assert "cannot be tiled" in result.output and "1x1" in result.output
    assert list(tmp_path.iterdir()) == [model_file]


def test_verify_reports_exact(tmp_path):
    model_file = _write(tmp_path, "net.py", RESIDUAL)
    result = _invoke("verify", model_file, "--grid", "2x3")
    assert result.exit_code == 0, result.output
    assert "exact" in result.output and "gradient of fc.weight" in result.output


def test_viz_writes_a_picture(compiled, tmp_path):
    _, plan_path, _ = compiled
    result = _invoke("viz", plan_path, "-o", tmp_path / "tiles.png")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "tiles.png").stat().st_size > 1000


def test_help_lists_every_command():
    result = _invoke("--help")
    assert result.exit_code == 0
    assert all(command in result.output for command in ("compile", "inspect", "verify", "viz"))
    result = _invoke("inspect", "--help")
    assert all(flag in result.output for flag in ("--tile", "--node", "--nodes", "--segment"))


@pytest.mark.parametrize("args, words", [
    (("compile", "net.py", "--batch", "0"), "Invalid value for '--batch': 0 is not in the range"),
    (("compile",), "Missing argument 'MODEL_FILE' (see 'tilec compile --help')"),
    (("compile", "net.py", "--batc", "2"), "No such option '--batc'"),
    (("inspect", "p.plan.json", "--segment", "x"), "Invalid value for '--segment': 'x' is not a valid integer"),
    (("compil", "net.py"), "No such command 'compil'"),
    (("--bogus",), "No such option '--bogus' (see 'tilec --help')"),
])
def test_usage_errors_are_one_line(args, words):
    result = _invoke(*args)
    assert result.exit_code == 2 and result.output.startswith("Error: ") and words in result.output, result.output
    assert len(result.output.splitlines()) == 1 and "Usage:" not in result.output


def test_no_command_shows_the_help():
    result = _invoke()
    assert "Usage: tilec" in result.output and "Commands:" in result.output


def test_compile_with_a_tissue_mask_counts_the_background_tiles_computed_once(tmp_path):
    """``--tissue-mask``: a grid's tiles whose reads lie outside the mask's tissue are counted as
    computed once, as ``tilec.compile`` counts them for a masked slide."""
    model_file = _write(tmp_path, "net.py", RESIDUAL.replace("(1, 3, 19, 17)", "(1, 3, 64, 64)"))
    mask = np.zeros((8, 8), dtype=bool)
    mask[:2, :2] = True
    np.save(tmp_path / "mask.npy", mask)
    common = ["--grid", "8x8", "--out-dir", tmp_path, "--plan-dir", tmp_path]
    result = _invoke("compile", model_file, "--tissue-mask", tmp_path / "mask.npy", *common)
    assert result.exit_code == 0, result.output
    known = json.loads((tmp_path / "net.plan.json").read_text())
    assert known["backgrounds"] and 0 < known["segments"][0]["reused"] < 64
    assert _invoke("compile", model_file, *common, "--name", "blind").exit_code == 0
    assert json.loads((tmp_path / "blind.plan.json").read_text())["segments"][0]["reused"] == 0


@pytest.mark.parametrize(("mask", "words"), [(np.zeros((2, 3, 4), dtype=bool), "2-D boolean"),
                                             (np.zeros((4, 4), dtype=np.uint8), "2-D boolean"),
                                             (None, "not a readable .npy")])
def test_compile_refuses_a_tissue_mask_it_cannot_use(tmp_path, mask, words):
    model_file = _write(tmp_path, "net.py", RESIDUAL)
    path = tmp_path / "mask.npy"
    if mask is None:
        path.write_text("not an array")
    else:
        np.save(path, mask)
    result = _invoke("compile", model_file, "--tissue-mask", path, "--grid", "2x2", "--out-dir", tmp_path,
                     "--plan-dir", tmp_path)
    assert result.exit_code == 2, result.output
    assert words in result.output and "--tissue-mask" in result.output and len(result.output.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mask.npy", "net.py"]


def test_verify_refuses_a_device_without_data(tmp_path):
    model_file = _write(tmp_path, "net.py", RESIDUAL)
    result = _invoke("verify", model_file, "--device", "meta")
    assert result.exit_code == 2 and "--device 'meta' holds no data" in result.output, result.output
    assert len(result.output.splitlines()) == 1


def test_a_warning_in_a_command_is_one_line():
    @click.command()
    def warns():
        with refusals():
            warnings.warn("tilec: timed while\n  busy", RuntimeWarning, stacklevel=1)

    result = CliRunner().invoke(warns, [])
    assert result.exit_code == 0 and result.output == "RuntimeWarning: tilec: timed while busy\n", result.output


def test_compile_like_a_plan_of_another_size_plans_its_segments(compiled, tmp_path):
    model_file, plan_path, _ = compiled
    result = _invoke("compile", model_file, "--input-shape", "1,3,25,21", "--like", plan_path, "--name", "wider",
                     "--out-dir", tmp_path, "--plan-dir", tmp_path)
    assert result.exit_code == 0, result.output
    first, wider = load(plan_path), load(tmp_path / "wider.plan.json")
    assert tuple(wider.inputs[0].shape) == (1, 3, 25, 21)
    assert segments_text(wider.segments) == segments_text(first.segments)
    missing = _invoke("compile", model_file, "--like", tmp_path / "missing.plan.json", "--out-dir", tmp_path,
                      "--plan-dir", tmp_path)
    assert missing.exit_code == 2 and "missing.plan.json" in missing.output
    assert len(missing.output.strip().splitlines()) == 1
