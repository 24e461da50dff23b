"""Budget search: plans fit, are optimal under the cost model, and train exactly."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from exactness import TOLERANCE, max_errors
from torch import nn

from tilec.cli import main
from tilec.errors import BudgetError
from tilec.planner import plan
from tilec.search import _Costs, choose, format_bytes, smallest_budget, usable
from tilec.trace import trace

SHAPE = (1, 3, 52, 44)


def model() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(),
    )


@pytest.fixture(scope="module")
def graph():
    return trace(model(), SHAPE)


def _budgets(graph) -> list[int]:
    """From the smallest feasible budget to one where everything is stored."""
    low = smallest_budget(graph)
    high = plan(graph, name="m", grid=(1, 1)).predicted_peak_bytes
    return sorted({low, *(low + (high - low) * k // 6 for k in range(1, 7)), 2 * high})


def _brute_force(costs: _Costs, budget: int) -> float:
    """Least estimated seconds over every segmentation and every option of every segment."""
    best, last = float("inf"), len(costs.layers)

    def extend(first: int, seconds: float, kept: int) -> None:
        nonlocal best
        if first == last:
            best = min(best, seconds)
            return
        for stop in (c for c in costs.cuts if c > first):
            options = [costs.option(first, stop, 1, True)]
            options += [costs.option(first, stop, grid, False) for grid in costs.grids(stop)]
            for cost in options:
                if kept + costs.local(cost, stop) <= budget:
                    extend(stop, seconds + cost.seconds, kept + cost.kept)

    extend(0, 0.0, 0)
    return best


def _seconds(graph, segments) -> float:
    return sum(s.estimated_seconds for s in plan(graph, name="m", segments=segments).segments)


def test_every_budget_gets_a_plan_that_fits_it(graph):
    for budget in _budgets(graph):
        chosen = plan(graph, name="m", segments=choose(graph, budget), memory_budget=budget)
        assert chosen.predicted_peak_bytes <= usable(budget) < budget
        assert chosen.predicted_peak_bytes == max(s.predicted_peak_bytes for s in chosen.segments)


def test_dynamic_programming_matches_brute_force(graph):
    costs = _Costs(graph, "float32")
    for budget in _budgets(graph):
        found = sum(costs.option(first, stop, max(grid), mode == "stored").seconds
                    for first, stop, grid, mode in choose(graph, budget))
        assert found == pytest.approx(_brute_force(costs, usable(budget)), rel=1e-12), format_bytes(budget)


def test_more_memory_is_never_slower(graph):
    times = [_seconds(graph, choose(graph, budget)) for budget in _budgets(graph)]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(times, times[1:], strict=False)), times


def test_a_generous_budget_stores_everything(graph):
    generous = _budgets(graph)[-1]
    chosen = plan(graph, name="m", segments=choose(graph, generous))
    assert {s.mode for s in chosen.segments} == {"stored"}
    assert all(s.flop_overhead == 0 for s in chosen.segments)


def test_tight_budgets_tile_and_cut(graph):
    chosen = plan(graph, name="m", segments=choose(graph, smallest_budget(graph)))
    assert any(s.mode == "tiled" and s.grid != (1, 1) for s in chosen.segments)


def test_a_budget_below_the_smallest_names_the_smallest(graph):
    smallest = smallest_budget(graph)
    choose(graph, smallest)
    with pytest.raises(BudgetError, match=re.escape(f"smallest feasible budget is about {format_bytes(smallest)}")):
        choose(graph, smallest - 1)


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_budget_plans_train_exactly(share):
    doubled = trace(model().double(), SHAPE)
    low = smallest_budget(doubled, "float64")
    high = plan(doubled, name="m", grid=(1, 1), dtype="float64").predicted_peak_bytes
    segments = choose(doubled, int(low + share * (high - low)), "float64")
    errors = max_errors(model(), SHAPE, segments=segments)
    assert max(errors.values()) < TOLERANCE, errors


SMALL = """
from torch import nn
INPUT_SHAPE = (1, 3, 40, 36)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1))
"""


def test_cli_compiles_for_a_budget_and_reports_the_plan(tmp_path):
    (tmp_path / "m.py").write_text(SMALL)
    result = CliRunner().invoke(main, ["compile", str(tmp_path / "m.py"), "--memory-budget", "0.1MiB",
                                       "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "m.plan.json").read_text())
    assert data["memory_budget"] == 104858  # round(0.1 * 2**20)
    assert 0 < data["predicted_peak_bytes"] <= 104858
    assert "predicted peak" in result.output and "FLOP overhead" in result.output
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "m.plan.json")])
    assert shown.exit_code == 0 and "predicted peak" in shown.output


def test_cli_refuses_an_infeasible_budget(tmp_path):
    (tmp_path / "m.py").write_text(SMALL)
    result = CliRunner().invoke(main, ["compile", str(tmp_path / "m.py"), "--memory-budget", "1KiB",
                                       "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "smallest feasible budget is about" in lines[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.py"]


def test_stored_segments_count_in_place_activations_once():
    """Autograd saves an in-place activation's result, which is its input's buffer."""
    def stack(inplace: bool) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.LeakyReLU(0.1, inplace=inplace),
                             nn.Conv2d(8, 8, 3, padding=1)).eval()

    shape = (1, 3, 64, 48)
    peaks = [plan(trace(stack(inplace), shape), name="m", grid=(1, 1)).predicted_peak_bytes for inplace in (0, 1)]
    assert peaks[0] - peaks[1] == 8 * 64 * 48 * 4
