"""Compiling is deterministic: the same model gives byte-identical plan and module everywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tilec.config import CompileConfig
from tilec.pipeline import compile_model

ROOT = Path(__file__).resolve().parents[1]
MODEL = textwrap.dedent(
    """
    from torch import nn

    INPUT_SHAPE = (1, 3, 29, 27)

    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4).eval(), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        nn.Sequential(nn.Conv2d(4, 4, (3, 1), padding="same", groups=2), nn.GELU()),
        nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False, ceil_mode=True),
        nn.Conv2d(4, 2, 1, padding=1, bias=False), nn.Hardswish(),
    )
    """
)


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _compile_in_process(model_file: Path, out: Path) -> dict[str, bytes]:
    compile_model(CompileConfig(model_path=model_file, grid=(3, 4), name="det", out_dir=out, plan_dir=out))
    return _files(out)


@pytest.fixture
def model_file(tmp_path) -> Path:
    path = tmp_path / "det_model.py"
    path.write_text(MODEL, encoding="utf-8")
    return path


def test_twice_in_two_directories(model_file, tmp_path):
    first = _compile_in_process(model_file, tmp_path / "a")
    second = _compile_in_process(model_file, tmp_path / "b" / "deeper")
    assert set(first) == {"det.plan.json", "det_tiled.py"}
    assert first == second


def test_fresh_subprocesses_with_other_hash_seeds(model_file, tmp_path):
    expected = _compile_in_process(model_file, tmp_path / "in-process")
    script = (
        "import sys; from pathlib import Path; from tilec.config import CompileConfig; "
        "from tilec.pipeline import compile_model; "
        "compile_model(CompileConfig(model_path=Path(sys.argv[1]), grid=(3, 4), name='det', "
        "out_dir=Path(sys.argv[2]), plan_dir=Path(sys.argv[2])))"
    )
    for seed in ("0", "12345"):
        out = tmp_path / f"subprocess-{seed}"
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path}
        subprocess.run([sys.executable, "-c", script, str(model_file), str(out)], check=True, env=env, cwd=tmp_path,
                       timeout=120)
        assert _files(out) == expected, f"PYTHONHASHSEED={seed}"
