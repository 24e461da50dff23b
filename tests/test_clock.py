"""``tilec.clock``: the time estimate's rates are measured on the device, once, and steer the search."""

from __future__ import annotations

import json
import math
from dataclasses import astuple

import pytest
import torch
from torch import nn

import tilec.clock
import tilec.pipeline
from tilec.calibrate import measure_kernels
from tilec.clock import clock
from tilec.cost import GEMM_MIN_CHANNELS, REFERENCE_SPEED, Estimator, Speed
from tilec.pipeline import plan_for
from tilec.planner import Boundaries, plan
from tilec.search import choose, smallest_budget
from tilec.trace import trace


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())


SHAPE = (1, 3, 64, 64)


def test_measured_rates_are_plausible():
    speed = tilec.clock.measure("cpu", "float32")
    assert 1e8 < speed.flop_rate < 1e15 and 0 <= speed.call_seconds < 0.1 and 1e8 < speed.copy_rate < 1e13


@pytest.fixture
def raced(monkeypatch):
    """Every weight-gradient race run; each finds matrix products faster from 64 channels."""
    calls = []

    def race(device, dtype):
        calls.append((device, dtype))
        return 64

    monkeypatch.setattr(tilec.clock, "gemm_min_channels", race)
    return calls


@pytest.fixture
def measured(tmp_path, monkeypatch, raced):
    """Every measurement of the rates made, into an empty cache; the n-th measures a FLOP rate of
    n GFLOP/s."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure(device, dtype, autocast=None, gemm_min_channels=None):
        assert gemm_min_channels == 64, "the rates are measured with the race's weight gradient"
        calls.append((device, dtype, autocast))
        return Speed(1e9 * len(calls), 1e-4, 1e9)

    monkeypatch.setattr(tilec.clock, "measure", measure)
    return calls


def speed_keys(cache):
    return [key for key in json.loads(cache.read_text()) if key.startswith("speed | ")]


def test_rates_are_measured_once_per_device_and_dtype(measured, tmp_path):
    graph = trace(chain(), SHAPE)
    first = clock(graph, "float32").graph["speed"]
    assert first == Speed(1e9, 1e-4, 1e9) and clock(graph, "float32").graph["speed"] == first
    assert clock(graph, "float64").graph["speed"] == Speed(2e9, 1e-4, 1e9)
    assert clock(trace(chain(), SHAPE, "cpu:bfloat16"), "float32").graph["speed"] == Speed(3e9, 1e-4, 1e9)
    assert measured == [("cpu", "float32", None), ("cpu", "float64", None), ("cpu", "bfloat16", "cpu:bfloat16")]
    assert "speed" not in graph.graph, "clock returns a copy"
    cache = tmp_path / "tilec" / "calibration.json"
    assert sorted(key.split(" | ")[-1] for key in speed_keys(cache)) == ["bfloat16", "float32", "float64"]


def test_the_weight_gradient_is_raced_once_per_device_and_dtype(measured, raced):
    graph = trace(chain(), SHAPE)
    assert clock(graph, "float32").graph["gemm_min_channels"] == 64
    clock(graph, "float32")
    clock(graph, "float64")
    assert raced == [("cpu", "float32"), ("cpu", "float64")]
    assert "gemm_min_channels" not in graph.graph, "clock returns a copy"


@pytest.mark.parametrize(("wins", "fewest"), [((True,) * 5, 32), ((False, True, False, True, True), 256),
                                               ((True, True, True, True, False), None), ((False,) * 5, None)])
def test_the_race_picks_the_fewest_channels_from_which_matrix_products_always_win(monkeypatch, wins, fewest):
    """The race times each of ``RACE_CHANNELS``: the module's matrix products (``ours``), then the
    library's kernel."""
    assert len(wins) == len(tilec.clock.RACE_CHANNELS)
    raced = iter(wins)

    def best(step, device):
        if step.__name__ == "ours":
            best.won = next(raced)
            return 0.1 if best.won else 0.2
        return 0.2 if best.won else 0.1

    monkeypatch.setattr(tilec.clock, "_best", best)
    assert tilec.clock.gemm_min_channels("cpu", "float32") == fewest


def test_no_race_where_matrix_products_do_not_serve(monkeypatch):
    monkeypatch.setattr(tilec.clock, "_best", lambda step, device: pytest.fail("raced"))
    assert tilec.clock.gemm_min_channels("cpu", "bfloat16") is None
    assert tilec.clock.gemm_min_channels("cuda", "float32") is None


@pytest.mark.parametrize("entry", ["{not json", '{"KEY": [1.0, 0.001]}', '{"KEY": [-1.0, 0.001, 1.0]}',
                                   '{"KEY": [1.0, "x", 1.0]}'])
def test_a_malformed_cache_entry_is_measured_again(measured, tmp_path, entry):
    graph = trace(chain(), SHAPE)
    clock(graph, "float32")
    cache = tmp_path / "tilec" / "calibration.json"
    key, = speed_keys(cache)
    cache.write_text(entry.replace("KEY", key))
    assert clock(graph, "float32").graph["speed"] == Speed(2e9, 1e-4, 1e9) and len(measured) == 2


def test_budget_plans_record_the_rates_they_were_ranked_by(measured, monkeypatch):
    monkeypatch.setattr(tilec.pipeline, "clock", clock)
    graph = trace(chain(), SHAPE)
    budgeted = plan_for(graph, "m", memory_budget=2 * smallest_budget(graph))
    assert budgeted.speed == (1e9, 1e-4, 1e9) and budgeted.gemm_min_channels == 64
    gridded = plan_for(graph, "m", grid=(2, 2))
    assert gridded.speed is None and gridded.gemm_min_channels == GEMM_MIN_CHANNELS


def test_the_rates_steer_the_search():
    """Where calls are dear the search takes fewer tiles; where FLOPs are, fewer halo FLOPs."""
    graph = trace(chain(), SHAPE)
    low, high = smallest_budget(graph), plan(graph, name="m", grid=(1, 1)).predicted_peak_bytes
    differs = False
    for budget in (low + (high - low) * k // 6 for k in range(7)):
        picked = []
        for speed in (Speed(1e15, 1.0, 1e15), Speed(1e6, 0.0, 1e15)):
            timed = graph.copy()
            timed.graph["speed"] = speed
            chosen = choose(timed, budget)
            planned = plan(chosen.graph, name="m", segments=chosen.segments)
            estimator = Estimator(Boundaries(chosen.graph), "float32")
            costs = [estimator.segment(s.first, s.stop, s.rows, s.cols, s.mode == "stored") for s in planned.segments]
            tiles = sum(math.prod(s.grid) for s in planned.segments if s.mode == "tiled")
            picked.append((tiles, sum(cost.flops for cost in costs)))
        (call_tiles, call_flops), (flop_tiles, flop_flops) = picked
        assert call_tiles <= flop_tiles and call_flops >= flop_flops, budget
        differs |= picked[0] != picked[1]
    assert differs


def test_the_suite_ranks_at_the_reference_rates():
    graph = trace(chain(), SHAPE)
    budget = 2 * smallest_budget(measure_kernels(graph, "float32"))  # with the kernel state plan_for measures
    assert plan_for(graph, "m", memory_budget=budget).speed == astuple(REFERENCE_SPEED)
