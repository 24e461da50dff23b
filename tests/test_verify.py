"""``tilec verify``, progress reporting, and what the generated module imports.

(Byte-identical outputs: ``test_determinism.py``; no pickle anywhere: ruff's banned-API rule,
``test_lint.py``; a TiledModel's per-tile progress: ``test_generated_checks.py``.)"""

from __future__ import annotations

import ast
import io
import sys

import pytest
from rich.console import Console

import tilec.cli
import tilec.verify
from tilec.codegen import render
from tilec.planner import plan
from tilec.trace import trace

from support.hardening import SMALL, run, small_model, snapshot

BN_MODEL = """\
from torch import nn
INPUT_SHAPE = (2, 3, 64, 64)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                      nn.AvgPool2d(3, stride=2, padding=1), nn.Conv2d(4, 2, 3)).eval()
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "ok.py").write_text(SMALL)
    (tmp_path / "bn.py").write_text(BN_MODEL)
    (tmp_path / "linear.py").write_text("from torch import nn\nmodel = nn.Sequential(nn.Linear(3, 3))\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_verify_reports_every_tensor(workdir):
    before = snapshot(workdir)
    result = run(["verify", "ok.py"])
    assert result.exit_code == 0, result.output
    assert "grid 2x2" in result.output and "input 1x3x16x16" in result.output
    for name in ("output", "input gradient", "gradient of 0.weight", "gradient of 0.bias",
                 "gradient of 3.weight", "gradient of 3.bias"):
        assert name in result.output
    assert "exact" in result.output and "MISMATCH" not in result.output
    assert snapshot(workdir) == before  # compiled into a temporary folder only


def test_verify_takes_a_smaller_shape_and_a_grid(workdir):
    result = run(["verify", "bn.py", "--input-shape", "1,3,20,24", "--grid", "3x2", "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert "inputs input 1x3x20x24 float32, grid 3x2" in result.output and "gradient of 1.weight" in result.output


def test_verify_clips_the_grid_to_the_output(workdir):
    result = run(["verify", "ok.py", "--input-shape", "1,3,6,16", "--grid", "9x9"])  # output 1x2x1x6
    assert result.exit_code == 0, result.output
    assert "grid 1x6" in result.output


def test_verify_exits_1_on_a_mismatch(workdir, monkeypatch):
    real = tilec.verify._import

    def broken(path):
        module = real(path)

        class Off(module.TiledModel):
            def forward(self, x):
                return super().forward(x) * (1 + 1e-6)

        module.TiledModel = Off
        return module

    monkeypatch.setattr(tilec.verify, "_import", broken)
    result = run(["verify", "ok.py"])
    assert result.exit_code == 1, result.output
    assert "MISMATCH" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, words", [
    (["verify", "missing.py"], ["missing.py", "does not exist"]),
    (["verify", "linear.py", "--input-shape", "1,3,8,8"], ["does not run on input shape"]),
    (["verify", "ok.py", "--input-shape", "1,3,16"], ["3 dimension"]),
    (["verify", "ok.py", "--device", "nonsense"], ["--device", "nonsense"]),
    (["verify", "ok.py", "--tolerance", "-1"], ["--tolerance"]),
])
def test_verify_refuses_bad_input(workdir, args, words):
    before = snapshot(workdir)
    result = run(args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert all(word in result.output for word in words), result.output
    assert snapshot(workdir) == before


# -- progress -----------------------------------------------------------------------------------


def test_planner_reports_progress():
    """``progress(done, total)`` counts the planned axes of the tiled segments (two each), up to
    ``total``; stored segments count none."""
    calls = []
    graph = trace(small_model(), (1, 3, 16, 16))
    plan(graph, name="p", segments=[(0, 2, (3, 5)), (2, 3, (1, 1)), (3, 4, (2, 2))],
         progress=lambda *a: calls.append(a))
    assert calls and all(total == 4 for _, total in calls)
    assert [done for done, _ in calls] == sorted({done for done, _ in calls}) and calls[-1] == (4, 4)
    calls.clear()
    plan(graph, name="p", grid=(1, 1), progress=lambda *a: calls.append(a))
    assert calls == []


def test_compile_is_quiet_when_piped(workdir):
    result = run(["compile", "ok.py", "--grid", "3x3"])
    assert result.exit_code == 0
    assert "planning" not in result.output and "\r" not in result.output and "\x1b" not in result.output


def test_compile_shows_a_bar_on_a_terminal(workdir, monkeypatch):
    stream = io.StringIO()
    real = Console

    def terminal(*args, **kwargs):
        if kwargs.get("stderr"):
            return real(file=stream, force_terminal=True, width=100)
        return real(*args, **kwargs)

    monkeypatch.setattr(tilec.cli, "Console", terminal)
    result = run(["compile", "ok.py", "--grid", "6x6"])
    assert result.exit_code == 0, result.output
    assert "planning tiles" in stream.getvalue() and "2/2" in stream.getvalue()  # one tiled segment: two axes


# -- the generated module ------------------------------------------------------------------------


def test_generated_module_imports_only_torch_and_the_standard_library():
    generated = render(plan(trace(small_model(), (1, 3, 16, 16)), name="x", grid=(2, 2)))
    names = set()
    for node in ast.walk(ast.parse(generated)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    assert "torch" in names
    assert names - {"torch"} <= set(sys.stdlib_module_names)
