"""``benchmarks/flop_floor.py``: the fewest FLOPs a plan within a budget does, against plain's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import flop_floor  # noqa: E402

MODEL = """
from torch import nn


def model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1),
    ).train()
"""


def _floor(tmp_path, capsys, budget: str) -> dict:
    path = tmp_path / "bn_chain.py"
    path.write_text(MODEL)
    assert flop_floor.main(["--model", str(path), "--size", "96", "--budget", budget]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_roomy_budget_needs_no_more_flops_than_plain(tmp_path, capsys):
    found = _floor(tmp_path, capsys, "1GiB")
    assert found["ratio"] == pytest.approx(1.0, abs=0.01)
    assert all(segment.endswith("stored") for segment in found["segments"])


def test_a_tight_budget_pays_recompute_and_sweeps(tmp_path, capsys):
    found = _floor(tmp_path, capsys, "1300KiB")
    assert found["ratio"] > 1.5
    assert not all(segment.endswith("stored") for segment in found["segments"])
