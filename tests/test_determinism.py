"""Compiling is deterministic: the same model gives byte-identical plan, module and module
bytecode everywhere (the bytecode: on one Python version).

One test per property: the same inputs twice in one process; the CLI's output files, written
twice into two directories; fresh interpreters with other hash seeds; a compile in the caller's
process under its autocast, ``no_grad`` or inference mode. (That a fresh compile
equals the committed golden files is ``test_golden.py``.) The model is a DAG whose traced graph
has fan-out, fan-in, a dict output and several segment inputs and outputs: everything a set or
dict iteration order could leak into.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tilec import pipeline
from tilec.codegen import render
from tilec.config import CompileConfig
from tilec.modelfile import load_model
from tilec.pipeline import compile_model, plan_for
from tilec.planio import dumps
from tilec.target import REFERENCE
from tilec.trace import trace

from support.hardening import run

ROOT = Path(__file__).resolve().parents[1]
MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch import nn

    INPUT_SHAPE = (1, 3, 29, 27)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
            self.a = nn.Conv2d(4, 4, 3, padding=1)
            self.b = nn.Conv2d(4, 4, (3, 1), padding=(1, 0), groups=2)
            self.pool = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
            self.avg = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False, ceil_mode=True)
            self.up = nn.ConvTranspose2d(8, 4, 2, stride=2)
            self.se = nn.Conv2d(4, 4, 1)
            self.out = nn.Conv2d(8, 2, 1, bias=False)

        def forward(self, x):
            x = self.stem(x)
            y = torch.cat([self.pool(self.a(x)), self.avg(F.gelu(self.b(x)))], 1)
            y = F.pad(self.up(y), [0, -1, 0, -1])
            y = y + x * torch.sigmoid(self.se(x.mean((2, 3), keepdim=True)))
            z = F.interpolate(y, scale_factor=1.5, mode="bilinear")
            return {"main": self.out(torch.cat([y, x], 1)), "aux": z, "score": z.mean()}


    model = Net().eval()
    """
)


def _files(directory: Path) -> dict[str, bytes]:
    return {path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _compile_in_process(model_file: Path, out: Path, grid=(3, 4)) -> dict[str, bytes]:
    compile_model(CompileConfig(model_path=model_file, grid=grid, name="det", out_dir=out, plan_dir=out))
    return _files(out)


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "det_model.py"
    path.write_text(MODEL, encoding="utf-8")
    return path


def test_plan_and_source_are_the_same_for_the_same_inputs(model_file):
    model, shape = load_model(model_file)
    texts = set()
    for _ in range(2):
        the_plan = plan_for(trace(model, shape), REFERENCE, "det", grid=(3, 4))
        texts.add((dumps(the_plan), render(the_plan)))
    assert len(texts) == 1
    # a freshly built model of the same architecture and another grid: also stable
    model, _ = load_model(model_file)
    plans = {dumps(plan_for(trace(model, shape), REFERENCE, "det", grid=(5, 2))) for _ in range(2)}
    assert len(plans) == 1 and plans != {text for text, _ in texts}


def test_the_cli_writes_the_same_files_twice_in_two_directories(model_file, tmp_path):
    outputs = []
    for out in (tmp_path / "a", tmp_path / "b" / "deeper"):
        result = run(["compile", str(model_file), "--grid", "3x4", "--name", "det", "--out-dir", str(out),
                      "--plan-dir", str(out)])
        assert result.exit_code == 0, result.output
        outputs.append(_files(out))
    bytecode = Path(importlib.util.cache_from_source("det_tiled.py")).as_posix()
    assert set(outputs[0]) == {"det.plan.json", "det_tiled.py", bytecode}
    assert outputs[0] == outputs[1]


def test_fresh_subprocesses_with_other_hash_seeds(model_file, tmp_path):
    expected = _compile_in_process(model_file, tmp_path / "in-process")
    script = (
        "import sys; from pathlib import Path; from tilec.config import CompileConfig; "
        "from tilec.pipeline import compile_model; "
        "compile_model(CompileConfig(model_path=Path(sys.argv[1]), grid=(3, 4), name='det', "
        "out_dir=Path(sys.argv[2]), plan_dir=Path(sys.argv[2])))"
    )
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for seed in ("0", "12345"):
        out = tmp_path / f"subprocess-{seed}"
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path}
        subprocess.run([sys.executable, "-c", script, str(model_file), str(out)], check=True, env=env, cwd=tmp_path,
                       timeout=120, capture_output=True)
        assert _files(out) == expected, f"PYTHONHASHSEED={seed}"


def test_a_compile_under_the_callers_autocast_no_grad_or_inference_mode_is_the_same(model_file, tmp_path,
                                                                                  monkeypatch):
    """As inside a Lightning step or its validation loop: the same module as outside them, and the
    convolution workspace, measured with a backward, measured (a cache of its own) in inference mode."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, shape = load_model(model_file, "model")
    rendered = []
    monkeypatch.setattr(pipeline, "render", lambda plan: rendered.append(render(plan)) or rendered[-1])
    callers = [torch.inference_mode, torch.no_grad, lambda: torch.autocast("cpu", torch.bfloat16)]
    for modes in [*callers, lambda: torch.enable_grad()]:
        with modes():
            pipeline.build(model, shape, (2, 3), autocast="cpu:bfloat16", name="m")
    assert len(rendered) == 4 and len(set(rendered)) == 1
