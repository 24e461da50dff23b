"""``tilec.clock``: the time estimate's rates are measured on the device, once, and steer the search."""

from __future__ import annotations

import json
import math
from dataclasses import astuple, replace

import numpy as np
import pytest
import torch
from torch import nn

import tilec.calibrate
import tilec.clock
import tilec.pipeline
from tilec.calibrate import measure_kernels
from tilec.clock import clock
from tilec.cost.estimator import Estimator
from tilec.cost.facts import Facts
from tilec.pipeline import plan_for
from tilec.planner import plan
from tilec.search import choose, smallest_budget
from tilec.target import GEMM_MIN_CHANNELS, REFERENCE, REFERENCE_SPEED, Speed, Target
from tilec.trace import trace


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())


SHAPE = (1, 3, 64, 64)


@pytest.fixture
def timed(monkeypatch):
    """``measure``'s timings replaced by those of a device running at a given ``Speed``: the copy
    takes ``COPY_BYTES`` over its copy rate, each step the sum of its segments' ``Speed.seconds``
    (the costs ``_tiled_module`` estimated for the modules it built), without running anything.
    ``timed(speed)`` returns the measured speed and the rows ``(segment costs, seconds)``."""
    built = []
    real = tilec.clock._tiled_module

    def tiled_module(*args, **kwargs):
        module, costs = real(*args, **kwargs)
        built.append(costs)
        return module, costs

    def run(speed: Speed, steps: list[float] | None = None):
        built.clear()
        rows, timings = [], iter([None, *(steps or [None, None])])

        def best(step, device):
            if not rows:  # the copy comes first
                rows.append(None)
                next(timings)
                return tilec.clock.COPY_BYTES / speed.copy_rate
            costs = built[len(rows) - 1]
            seconds = next(timings)
            if seconds is None:  # the chain's convolutions and ReLUs are kinds ``speed`` has no rate for
                seconds = sum(speed.seconds(c.flops / speed.flop_rate, c.calls, c.copied) for c in costs)
            rows.append((costs, seconds))
            return seconds

        monkeypatch.setattr(tilec.clock, "_tiled_module", tiled_module)
        monkeypatch.setattr(tilec.clock, "_best", best)
        measured = tilec.clock.measure("cpu", "float32")
        return measured, rows[1:]

    return run


@pytest.mark.parametrize("speed", [Speed(2e10, 4e-5, 8e9), Speed(3e11, 0.0, 1e10), Speed(1e9, 1e-3, 1e9)])
def test_the_rates_are_solved_from_the_two_timed_steps(timed, speed):
    """The FLOP rate and call cost are the solution of the two timed steps' estimates (one mostly
    FLOPs, one mostly calls): they reproduce the step times they were solved from, and a device
    that runs at ``speed`` is measured at ``speed``."""
    measured, rows = timed(speed)
    assert len(rows) == 2
    (large, _), (small, _) = rows
    assert sum(c.calls for c in small) > 4 * sum(c.calls for c in large)  # two distinct equations
    assert sum(c.flops for c in large) > sum(c.flops for c in small)
    for costs, seconds in rows:
        estimate = sum(measured.seconds(c.flops / measured.flop_rate, c.calls, c.copied) for c in costs)
        assert estimate == pytest.approx(seconds, rel=1e-9)
    assert measured.flop_rate == pytest.approx(speed.flop_rate, rel=1e-9)
    assert measured.call_seconds == pytest.approx(speed.call_seconds, rel=1e-9, abs=1e-15)
    assert measured.copy_rate == pytest.approx(speed.copy_rate, rel=1e-12)


def test_noisy_timings_cost_no_call_less_than_nothing(timed):
    """Where the call-bound step ran faster than its FLOPs allow (noise), calls cost nothing and
    the FLOP rate reproduces the FLOP-bound step alone."""
    measured, rows = timed(Speed(1e10, 1e-4, 1e10), steps=[0.5, 1e-6])
    (large, seconds), _ = rows
    assert measured.call_seconds == 0.0
    estimate = sum(measured.seconds(c.flops / measured.flop_rate, c.calls, c.copied) for c in large)
    assert estimate == pytest.approx(seconds, rel=1e-9)


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
def kinds(monkeypatch):
    """Every measurement of the rates per kind of kernel (``tilec.clock.kind_rates``) made; the
    n-th measures 3x3 convolutions of 64 channels at n * 10 GFLOP/s."""
    calls = []

    def kind_rates(device, dtype, autocast, gemm):
        assert gemm == 64, "the kinds are timed with the race's weight gradient"
        calls.append((device, dtype, autocast))
        return [("conv@64@4096", 1e10 * len(calls)), ("conv@64@65536", 2e10 * len(calls)), ("pixel@64@4096", 1e8)]

    monkeypatch.setattr(tilec.clock, "kind_rates", kind_rates)
    return calls


def rates(n: int) -> tuple:
    """What the n-th ``kind_rates`` of the ``kinds`` fixture measures."""
    return (("conv@64@4096", 1e10 * n), ("conv@64@65536", 2e10 * n), ("pixel@64@4096", 1e8))


@pytest.fixture
def measured(tmp_path, monkeypatch, raced, kinds):
    """Every measurement of the rates made, into an empty cache; the n-th measures a FLOP rate of
    n GFLOP/s (and the kinds as the ``kinds`` fixture does)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(tilec.calibrate, "cpu_stall_seconds", lambda: 0.0)  # a quiet machine
    calls = []

    def measure(device, dtype, autocast=None, gemm_min_channels=None):
        assert gemm_min_channels == 64, "the rates are measured with the race's weight gradient"
        calls.append((device, dtype, autocast))
        return Speed(1e9 * len(calls), 1e-4, 1e9)

    monkeypatch.setattr(tilec.clock, "measure", measure)
    return calls


def speed_keys(cache):
    return [key for key in json.loads(cache.read_text()) if key.startswith("speed | ")]


def test_rates_are_measured_once_per_device_and_dtype(measured, kinds, tmp_path):
    first = clock(REFERENCE, "float32", None).speed
    assert first == Speed(1e9, 1e-4, 1e9, rates(1)) and clock(REFERENCE, "float32", None).speed == first
    assert clock(REFERENCE, "float64", None).speed == Speed(2e9, 1e-4, 1e9, rates(2))
    assert clock(REFERENCE, "bfloat16", "cpu:bfloat16").speed == Speed(3e9, 1e-4, 1e9, rates(3))
    assert measured == [("cpu", "float32", None), ("cpu", "float64", None), ("cpu", "bfloat16", "cpu:bfloat16")]
    assert kinds == measured
    conv = [(4096.0, 1e10), (65536.0, 2e10)]
    assert first.points("conv", 48) == conv and first.points("conv", 512) == conv  # the nearest count measured
    assert first.points("pixel", 8) == [(4096.0, 1e8)]
    assert first.points("pool", 64) == [(1.0, 1e9)]  # a kind not measured: flop_rate
    assert REFERENCE.speed is None, "clock returns a copy"
    cache = tmp_path / "tilec" / "calibration.json"
    assert sorted(key.split(" | ")[-1] for key in speed_keys(cache)) == ["bfloat16", "float32", "float64"]


def test_clock_keeps_the_rest_of_the_target(measured):
    target = Target(kernel_state=123, shared_tiles=True, conv_workspace=((0.5, 1.0), (1.0, 2.0)))
    timed = clock(target, "float32", None)
    assert timed == replace(target, speed=Speed(1e9, 1e-4, 1e9, rates(1)), gemm_min_channels=64)


def test_the_weight_gradient_is_raced_once_per_device_and_dtype(measured, raced):
    assert clock(REFERENCE, "float32", None).gemm_min_channels == 64
    clock(REFERENCE, "float32", None)
    clock(REFERENCE, "float64", None)
    assert raced == [("cpu", "float32"), ("cpu", "float64")]
    assert REFERENCE.gemm_min_channels == GEMM_MIN_CHANNELS, "clock returns a copy"


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
    clock(REFERENCE, "float32", None)
    cache = tmp_path / "tilec" / "calibration.json"
    key, = speed_keys(cache)
    cache.write_text(entry.replace("KEY", key))
    assert clock(REFERENCE, "float32", None).speed.flop_rate == 2e9 and len(measured) == 2


def test_timings_taken_on_a_busy_machine_are_reused_only_while_it_is_busy(measured, monkeypatch, tmp_path):
    """Other tasks waited for a CPU for half of each timing (a clock read before and after it): the
    timings serve the plan and are kept apart; a later compile reuses them while the machine is
    still busy (no timing), and the first that finds it quiet times it again and keeps those."""
    stalls = iter(range(100))
    monkeypatch.setattr(tilec.calibrate, "cpu_stall_seconds", lambda: next(stalls) * 1e3)
    with pytest.warns(RuntimeWarning, match=r"other tasks waited for a CPU .* measured again once the machine is"):
        assert clock(REFERENCE, "float32", None).speed.flop_rate == 1e9
    cache = tmp_path / "tilec" / "calibration.json"
    (key,) = speed_keys(cache)
    assert key.endswith(" | busy")
    with pytest.warns(RuntimeWarning, match=r"this machine is busy; the plan uses timings .* taken while it was busy"):
        assert clock(REFERENCE, "float32", None).speed.flop_rate == 1e9
    assert len(measured) == 1
    monkeypatch.setattr(tilec.calibrate, "cpu_stall_seconds", lambda: 0.0)
    assert clock(REFERENCE, "float32", None).speed.flop_rate == 2e9  # measured again, and now kept
    assert clock(REFERENCE, "float32", None).speed.flop_rate == 2e9 and len(measured) == 2
    assert not any(key.endswith(" | busy") for key in json.loads(cache.read_text()))


def test_budget_plans_record_the_rates_they_were_ranked_by(measured, monkeypatch):
    monkeypatch.setattr(tilec.pipeline, "clock", clock)
    graph = trace(chain(), SHAPE)
    budgeted = plan_for(graph, REFERENCE, "m", memory_budget=2 * smallest_budget(graph, REFERENCE))
    assert budgeted.speed == (1e9, 1e-4, 1e9) and budgeted.rates == rates(1) and budgeted.gemm_min_channels == 64
    gridded = plan_for(graph, REFERENCE, "m", grid=(2, 2))
    assert gridded.speed is None and gridded.rates == () and gridded.gemm_min_channels == GEMM_MIN_CHANNELS


def test_the_rates_steer_the_search():
    """Where calls are dear the search takes fewer tiles; where FLOPs are, fewer halo FLOPs."""
    graph = trace(chain(), SHAPE)
    low, high = smallest_budget(graph, REFERENCE), plan(graph, name="m", grid=(1, 1)).predicted_peak_bytes
    differs = False
    for budget in (low + (high - low) * k // 6 for k in range(7)):
        picked = []
        for speed in (Speed(1e15, 1.0, 1e15), Speed(1e6, 0.0, 1e15)):
            target = Target(speed=speed)
            chosen = choose(graph, target, budget)
            planned = plan(chosen.graph, target, name="m", segments=chosen.segments)
            estimator = Estimator(chosen.graph, target, "float32")
            costs = [estimator.segment(s.first, s.stop, s.rows, s.cols, s.mode == "stored") for s in planned.segments]
            tiles = sum(math.prod(s.grid) for s in planned.segments if s.mode == "tiled")
            picked.append((tiles, sum(cost.flops for cost in costs)))
        (call_tiles, call_flops), (flop_tiles, flop_flops) = picked
        assert call_tiles <= flop_tiles and call_flops >= flop_flops, budget
        differs |= picked[0] != picked[1]
    assert differs


def test_the_suite_ranks_at_the_reference_rates():
    graph = trace(chain(), SHAPE)
    measured = measure_kernels(REFERENCE, "float32")  # the kernel state plan_for measures
    budget = 2 * smallest_budget(graph, measured)
    planned = plan_for(graph, REFERENCE, "m", memory_budget=budget)
    assert planned.speed == astuple(REFERENCE_SPEED)[:3] and planned.rates == REFERENCE_SPEED.rates == ()


def test_a_node_runs_at_the_rate_of_its_tiles_size():
    """Interpolated in the logarithm of the tile output's elements between the sizes measured,
    held beyond them."""
    speed = Speed(1e9, 0.0, 1e9, (("conv@64@4096", 1e10), ("conv@64@65536", 2e10)))
    graph = trace(nn.Sequential(nn.Conv2d(64, 64, 3, padding=1)), (1, 64, 64, 64))
    facts = Facts(graph, replace(REFERENCE, speed=speed), "float32")
    assert facts.seconds_per_flop(0, 1, np.array([4.0 * 4]))[0] == pytest.approx(1 / 1e10)  # 1024 elements
    assert facts.seconds_per_flop(0, 1, np.array([8.0 * 8]))[0] == pytest.approx(1 / 1e10)  # 4096 elements
    assert facts.seconds_per_flop(0, 1, np.array([16.0 * 16]))[0] == pytest.approx(1 / 1.5e10)
    assert facts.full_seconds_per_flop[0] == pytest.approx(1 / 2e10)  # 64 * 64 * 64 elements: held
