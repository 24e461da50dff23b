"""``benchmarks/flop_floor.py``: the fewest FLOPs a plan within a budget does, against plain's;
``benchmarks/estimate.py``: measured plans estimated again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import flop_floor  # noqa: E402

from tilec.config import parse_segments  # noqa: E402
from tilec.target import REFERENCE  # noqa: E402

from support.zoo import reference_kernels  # noqa: E402

MODEL = """
from torch import nn


def model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1),
    ).train()
"""


def _floor(tmp_path, capsys, monkeypatch, budget: str) -> dict:
    """The floor with ``KERNEL_STATE_BYTES`` per kernel, not this machine's kernel state: the
    smallest feasible budget does not move with the machine."""
    monkeypatch.setattr(flop_floor, "measure_kernels", reference_kernels)
    path = tmp_path / "bn_chain.py"
    path.write_text(MODEL)
    assert flop_floor.main(["--model", str(path), "--size", "96", "--budget", budget]) == 0
    return json.loads(capsys.readouterr().out)


def _all_stored(found: dict) -> bool:
    """Whether every segment of the floor's plan (``--segments`` text) is stored: 1x1, not ``:tiled``."""
    return all(grid == (1, 1) and mode is None for _, _, grid, mode, _ in parse_segments(found["segments"]))


def test_a_roomy_budget_needs_no_more_flops_than_plain(tmp_path, capsys, monkeypatch):
    found = _floor(tmp_path, capsys, monkeypatch, "1GiB")
    assert found["ratio"] == pytest.approx(1.0, abs=0.01)
    assert _all_stored(found)


def test_a_tight_budget_pays_recompute_and_sweeps(tmp_path, capsys, monkeypatch):
    found = _floor(tmp_path, capsys, monkeypatch, "1600KiB")
    assert found["ratio"] > 1.5
    assert not _all_stored(found)


def test_measured_plans_are_estimated_again(tmp_path, capsys, monkeypatch):
    import estimate

    monkeypatch.setattr(estimate, "clock", lambda target, dtype, autocast: REFERENCE)
    records = [{"variant": "auto", "model": "vgg16", "input_shape": [1, 3, 64, 48], "budget_bytes": 1,
                "plan_segments": ["0:10:2x2", "10:31:1x1 stored"], "step_s": 2.0, "estimated_seconds": 1.0},
               {"variant": "plain", "model": "vgg16"}]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"records": records}))
    assert estimate.main([str(path)]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["step_s"] == 2.0 and found["estimated_s"] > 0
    assert found["measured_over_estimated"] * found["estimated_s"] == pytest.approx(2.0, rel=0.02)
