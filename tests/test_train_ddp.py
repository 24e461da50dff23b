"""``examples/train_ddp.py`` under torchrun (gloo, CPU): two ranks, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow

MODEL = '''
from torch import nn

model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
'''


@pytest.mark.parametrize("options", [["--tile-ranks", "1"], ["--tile-ranks", "2", "--accumulate", "2"]],
                         ids=["ddp", "tiles_shared"])
def test_train_ddp_runs_under_torchrun(options, tmp_path):
    model = tmp_path / "small.py"
    model.write_text(MODEL)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "examples" / "train_ddp.py"), str(model), "--input-shape", "1,3,21,19", "--grid", "2x2",
               "--out-dir", str(tmp_path / "out"), *options]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and "loss" in lines[0]
    groups = "2 image groups x 1 tile ranks" if options[1] == "1" else "1 image groups x 2 tile ranks"
    assert groups in lines[-1]
