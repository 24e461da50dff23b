"""Every bad input gets one line naming the culprit, exit code 2, no traceback, no files left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tilec.codegen import load_source, render
from tilec.config import CompileConfig
from tilec.errors import (
    GridError,
    ModelFileError,
    OutputError,
    PlanError,
    ShapeError,
    TilecError,
    UnsupportedLayerError,
)
from tilec.pipeline import build, compile_model
from tilec.planio import write_files
from tilec.planner import plan
from tilec.trace import trace

from support.hardening import SMALL, run, small_model, snapshot

ROOT = Path(__file__).resolve().parents[1]

HEADER = "from torch import nn\n"

#: Model files the cases refer to by name.
FILES = {
    "ok.py": SMALL,
    "syntax.py": HEADER + "model = nn.Sequential(\n    nn.ReLU(),\n",
    "raises.py": HEADER + "\n\nraise RuntimeError('boom')\n",
    "exits.py": "import sys\nsys.exit(3)\n",
    "noattr.py": HEADER + "net = nn.Sequential(nn.ReLU())\n",
    "notmodule.py": HEADER + "model = 3\n",
    "viewinplace.py": "import torch\nfrom torch import nn\nclass V(nn.Module):\n    def forward(self, x):\n"
                      "        y = x * 2\n        z = y.view(1, 3, 64)[..., :8]\n        z.mul_(3)\n        return y\n"
                      "model = V()\nINPUT_SHAPE = (1, 3, 8, 8)\n",
    "callfails.py": HEADER + "def model():\n    return nn.Sequential(nn.Conv2d(3, 3, 'x'))\n",
    "subclass.py": HEADER + (
        "class Twice(nn.Sequential):\n    def forward(self, x):\n        return 2 * super().forward(x)\n"
        "model = Twice(nn.Conv2d(3, 3, 3))\nINPUT_SHAPE = (1, 3, 8, 8)\n"
    ),
    "empty.py": HEADER + "model = nn.Sequential()\nINPUT_SHAPE = (1, 3, 8, 8)\n",
    "linear.py": HEADER + "model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.Flatten(), nn.Linear(3, 3))\n"
                          "INPUT_SHAPE = (1, 3, 8, 8)\n",
    "custom.py": HEADER + "class Mine(nn.Module):\n    def forward(self, x):\n        return x\n"
                          "model = nn.Sequential(nn.Conv2d(3, 3, 3), Mine())\nINPUT_SHAPE = (1, 3, 8, 8)\n",
    "constant.py": "import torch\nfrom torch import nn\nclass Shifted(nn.Module):\n    def forward(self, x):\n"
                   "        return x + torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)\n"
                   "model = Shifted()\nINPUT_SHAPE = (1, 3, 8, 8)\n",
    "bntrain.py": HEADER + "model = nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3))\n"
                           "INPUT_SHAPE = (1, 3, 8, 8)\n",
    "bnstats.py": HEADER + "model = nn.Sequential(nn.BatchNorm2d(3, track_running_stats=False)).eval()\n"
                           "INPUT_SHAPE = (1, 3, 8, 8)\n",
    "chain.py": HEADER + "model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(5, 2, 3))\n"
                         "INPUT_SHAPE = (1, 3, 8, 8)\n",
    "noshape.py": HEADER + "model = nn.Sequential(nn.Conv2d(3, 3, 3))\n",
    "badshape.py": HEADER + "model = nn.Sequential(nn.Conv2d(3, 3, 3))\nINPUT_SHAPE = '1,3,8,8'\n",
    "datadep.py": "import torch\nfrom torch import nn\nclass D(nn.Module):\n    def forward(self, x):\n"
                  "        return x * 2 if x.sum() > 0 else x\nmodel = D()\nINPUT_SHAPE = (1, 3, 8, 8)\n",
    "latin1.py": None,  # written as bytes below
}

#: (case id, arguments, words the one-line message must contain). Every case exits with 2.
COMPILE_CASES = [
    ("file missing", ["compile", "missing.py", "--grid", "2x2"], ["missing.py", "does not exist"]),
    ("file is a folder", ["compile", "folder", "--grid", "2x2"], ["folder", "is not a file"]),
    ("syntax error", ["compile", "syntax.py"], ["syntax.py:2", "syntax error"]),
    ("file raises", ["compile", "raises.py"], ["raises.py:4", "RuntimeError", "boom"]),
    ("file exits", ["compile", "exits.py"], ["exits.py:2", "SystemExit"]),
    ("not utf-8", ["compile", "latin1.py"], ["cannot read model file", "latin1.py"]),
    ("no attribute", ["compile", "noattr.py"], ["noattr.py", "no attribute 'model'", "--attr"]),
    ("other attribute missing", ["compile", "ok.py", "--attr", "net"], ["no attribute 'net'"]),
    ("not a module", ["compile", "notmodule.py"], ["notmodule.py", "int", "not a torch.nn.Module"]),
    ("factory raises", ["compile", "callfails.py"], ["callfails.py:3", "calling model()", "TypeError"]),
    ("no ops", ["compile", "empty.py", "--grid", "1x1"], ["no ops"]),
    ("Linear on the wrong size", ["compile", "linear.py", "--grid", "1x1"], ["does not run on input shape"]),
    ("tensor constant in forward", ["compile", "constant.py", "--grid", "2x2"],
     ["makes a tensor constant in its forward", "register_buffer"]),
    ("in place through a view", ["compile", "viewinplace.py", "--grid", "1x1"], ["in place through an aten.view"]),
    ("channels inside the model", ["compile", "chain.py", "--grid", "1x1"],
     ["does not run on input shape (1, 3, 8, 8)", "5 channels"]),
    ("no input shape", ["compile", "noshape.py", "--grid", "1x1"], ["--input-shape", "INPUT_SHAPE"]),
    ("bad INPUT_SHAPE", ["compile", "badshape.py", "--grid", "1x1"], ["badshape.py", "INPUT_SHAPE", "'1,3,8,8'"]),
    ("shape malformed", ["compile", "ok.py", "--input-shape", "1,3,a,8", "--grid", "2x2"],
     ["--input-shape", "'1,3,a,8'"]),
    ("shape empty", ["compile", "ok.py", "--input-shape", "", "--grid", "2x2"], ["--input-shape", "''"]),
    ("shape negative", ["compile", "ok.py", "--input-shape", "1,3,-8,8", "--grid", "2x2"], ["--input-shape"]),
    ("shape rank 3", ["compile", "ok.py", "--input-shape", "1,3,8", "--grid", "2x2"], ["(1, 3, 8)", "3 dimension"]),
    ("shape rank 5", ["compile", "ok.py", "--input-shape", "1,3,8,8,1", "--grid", "2x2"], ["5 dimension", "N,C,H,W"]),
    ("shape zero", ["compile", "ok.py", "--input-shape", "1,0,16,16", "--grid", "2x2"], ["(1, 0, 16, 16)", "positive"]),
    ("channels mismatch", ["compile", "ok.py", "--input-shape", "1,5,16,16", "--grid", "2x2"],
     ["does not run on input shape (1, 5, 16, 16)", "channels"]),
    ("shape too large", ["compile", "ok.py", "--input-shape", "1,3,4294967296,4294967296", "--grid", "2x2"],
     ["(1, 3, 4294967296, 4294967296)", "more elements than a tensor can hold"]),
    ("size beyond 64 bits", ["compile", "ok.py", "--input-shape", "1,3,99999999999999999999,8", "--grid", "2x2"],
     ["99999999999999999999", "more elements"]),
    ("data-dependent branch", ["compile", "datadep.py", "--grid", "2x2"],
     ["does not run on input shape (1, 3, 8, 8)", "data-dependent"]),
    ("shape too small", ["compile", "ok.py", "--input-shape", "1,3,3,3", "--grid", "1x1"],
     ["does not run on input shape (1, 3, 3, 3)"]),
    ("grid malformed", ["compile", "ok.py", "--grid", "2by2"], ["--grid", "'2by2'"]),
    ("grid three axes", ["compile", "ok.py", "--grid", "2x2x2"], ["--grid", "'2x2x2'"]),
    ("grid negative", ["compile", "ok.py", "--grid", "-1x2"], ["--grid", "'-1x2'"]),
    ("grid zero", ["compile", "ok.py", "--grid", "0x2"], ["--grid", "at least one tile", "'0x2'"]),
    ("grid beyond a count", ["compile", "ok.py", "--grid", "99999999999999999999x2"],
     ["grid 99999999999999999999x2 has more than 2147483647 tiles a side"]),
    ("segment grid finer than output", ["compile", "ok.py", "--segments", "0:4@7x1"],
     ["grid 7x1", "finer than the output", "6x6"]),
    ("segments do not cover", ["compile", "ok.py", "--segments", "0:2@2x2"], ["segments must cover nodes 0..3"]),
    ("segment batch beyond a count", ["compile", "ok.py", "--segments", "0:4@2x2/99999999999999999999"],
     ["batch", "up to 2147483647"]),
    ("budget beyond a number", ["compile", "ok.py", "--memory-budget", "1" + "0" * 400],
     ["--memory-budget", "too large"]),
    ("grid missing", ["compile", "ok.py"], ["--grid"]),
    ("bad name", ["compile", "ok.py", "--grid", "2x2", "--name", "../evil"], ["--name", "'../evil'"]),
    ("out-dir under a file", ["compile", "ok.py", "--grid", "2x2", "--out-dir", "ok.py/sub"],
     ["cannot write", "ok.py/sub"]),
    ("plan-dir under a file", ["compile", "ok.py", "--grid", "2x2", "--plan-dir", "ok.py/plans"],
     ["cannot write", "ok.py/plans"]),
    ("new plan-dir, bad out-dir", ["compile", "ok.py", "--grid", "2x2", "--plan-dir", "new/deep/plans",
                                   "--out-dir", "ok.py/sub"], ["cannot write", "ok.py/sub"]),
    ("name too long for the file system", ["compile", "ok.py", "--grid", "2x2", "--name", "x" * 250,
                                           "--plan-dir", "folder", "--out-dir", "folder"],
     ["cannot write", "folder/xxx", "too long"]),
    ("module target is a folder", ["compile", "ok.py", "--grid", "2x2", "--out-dir", "taken"],
     ["cannot write", "ok_tiled.py", "directory"]),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name, text in FILES.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    (tmp_path / "latin1.py").write_bytes(b"# caf\xe9\nmodel = 1\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "taken" / "ok_tiled.py").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def assert_refused(result, words, before, after):
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert "Traceback" not in result.output
    assert before == after, f"files changed: {set(after) ^ set(before)}"


@pytest.mark.parametrize("case, args, words", COMPILE_CASES, ids=[c[0] for c in COMPILE_CASES])
def test_compile_refuses(workdir, case, args, words):
    before = snapshot(workdir)
    result = run(args)
    assert_refused(result, words, before, snapshot(workdir))


@pytest.mark.parametrize("name", ["bntrain.py", "bnstats.py"])
def test_batch_statistics_compile(workdir, name):
    """BatchNorm in training mode (or without running statistics) was refused before reductions ran
    inside tiled segments: it compiles now, its statistics reduced by a sweep."""
    result = run(["compile", name, "--grid", "2x2"])
    assert result.exit_code == 0, result.output
    assert "reduces by sweeps" in result.output and "batch_norm" in result.output


def test_compile_succeeds_in_the_same_setup(workdir):
    """The fixture itself is fine: the good model compiles."""
    result = run(["compile", "ok.py", "--grid", "2x2"])
    assert result.exit_code == 0, result.output
    assert (workdir / "plans" / "ok.plan.json").is_file() and (workdir / "ok_tiled.py").is_file()
    assert not [p for p in workdir.rglob(".*.tmp")]


def test_failed_compile_keeps_older_outputs(workdir):
    """A refusal after an earlier success leaves the earlier files byte for byte."""
    assert run(["compile", "ok.py", "--grid", "2x2", "--out-dir", "out"]).exit_code == 0
    before = snapshot(workdir)
    result = run(["compile", "ok.py", "--grid", "2x2", "--out-dir", "taken"])
    assert_refused(result, ["cannot write"], before, snapshot(workdir))


@pytest.mark.parametrize("args, words", [
    (["compile", "syntax.py"], ["syntax.py:2"]),
    (["inspect", "ok.py"], ["is not JSON"]),
])
def test_real_process_prints_one_line(workdir, args, words):
    """Through a real interpreter: stderr is one line, stdout empty, exit code 2, no traceback."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "tilec", *args], capture_output=True, text=True, env=env,
                          cwd=workdir, timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert all(word in done.stderr for word in words)


# -- the library raises typed errors ---------------------------------------------------------


def test_library_raises_typed_errors(tmp_path):
    with pytest.raises(ModelFileError):
        compile_model(CompileConfig(model_path=tmp_path / "nope.py", grid=(1, 1)))
    with pytest.raises(ShapeError, match="does not run"):
        trace(nn.Sequential(nn.Linear(3, 3)), (1, 3, 8, 8))
    with pytest.raises(UnsupportedLayerError, match="more than once"):
        trace(nn.Sequential(nn.Conv2d(3, 3, 3), *[nn.BatchNorm2d(3)] * 2), (1, 3, 8, 8))
    with pytest.raises(ShapeError, match="does not run"):
        trace(small_model(), (1, 3, 4, 4))
    with pytest.raises(ShapeError, match="positive"):
        trace(small_model(), (1, 3, True, 8))
    with pytest.raises(GridError, match="finer"):
        build(small_model(), (1, 3, 16, 16), segments=[(0, 4, (1, 7))])
    with pytest.raises(GridError, match="two positive integers"):
        build(small_model(), (1, 3, 16, 16), (2,))
    with pytest.raises(GridError, match="two positive integers"):
        build(small_model(), (1, 3, 16, 16), (0, 1))
    assert issubclass(PlanError, TilecError) and issubclass(OutputError, TilecError)


def test_write_files_is_all_or_nothing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    files = {tmp_path / "a" / "b" / "one.txt": "1", blocker / "two.txt": "2"}
    with pytest.raises(OutputError, match="two.txt|file"):
        write_files(files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    write_files({tmp_path / "a" / "one.txt": "1", tmp_path / "two.bin": b"\x00\x01"})
    assert (tmp_path / "a" / "one.txt").read_text() == "1" and (tmp_path / "two.bin").read_bytes() == b"\x00\x01"


# -- the generated module refuses models and inputs it cannot serve -----------------------------


def _module():
    return load_source(render(plan(trace(small_model(), (1, 3, 16, 16)), name="small", grid=(2, 2))))


MODULE = None


def module():
    global MODULE
    if MODULE is None:
        MODULE = _module()
    return MODULE


@pytest.mark.parametrize("model, words", [
    (nn.Conv2d(3, 4, 3), ["no parameter or buffer", "0.bias"]),
    (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()), ["no parameter or buffer", "3.bias"]),
    (nn.Sequential(nn.Conv2d(3, 4, 5, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3)),
     ["0.weight", "(4, 3, 5, 5)", "(4, 3, 3, 3)"]),
    (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(4, 2, 3)),
     ["module 2", "AvgPool2d", "MaxPool2d"]),
    (nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 3, 3)),
     ["3.bias", "(3,)", "(2,)"]),
])
def test_generated_module_refuses_other_models(model, words):
    with pytest.raises(ValueError) as caught:
        module().TiledModel(model)
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.parametrize("make_input, words", [
    (lambda: [[1.0]], ["torch.Tensor", "list"]),
    (lambda: torch.zeros(3, 16, 16), ["(3, 16, 16)", "(1, 3, 16, 16)"]),
    (lambda: torch.zeros(1, 3, 16, 18), ["(1, 3, 16, 18)", "(1, 3, 16, 16)"]),
    (lambda: torch.zeros(1, 4, 16, 16), ["(1, 4, 16, 16)"]),
    (lambda: torch.zeros(1, 3, 16, 16, dtype=torch.int64), ["'input' is int64", "needs float32"]),
    (lambda: torch.zeros(1, 3, 16, 16, dtype=torch.float64), ["float64", "model's tensors are float32"]),
    (lambda: torch.zeros(1, 3, 16, 16, device="meta"), ["meta", "cpu"]),
])
def test_generated_module_refuses_inputs(make_input, words):
    tiled = module().TiledModel(small_model())
    with pytest.raises(ValueError) as caught:
        tiled(make_input())
    message = str(caught.value)
    assert all(word in message for word in words), message


def test_generated_module_refuses_training_mode():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    tiled = build(model, (1, 3, 8, 8), (2, 2))
    model.train()
    with pytest.raises(ValueError, match=r"module 1 \(BatchNorm2d\) is in training mode.*eval\(\)"):
        tiled(torch.zeros(1, 3, 8, 8))
