"""Budget search: plans fit, are optimal under the cost model, and train exactly."""

from __future__ import annotations

import json
import re

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tilec import search
from tilec.cli import main
from tilec.cone import axis_tiles
from tilec.config import parse_bytes
from tilec.errors import BudgetError
from tilec.ops import rule
from tilec.planner import SegmentChoice, classified, plan
from tilec.regions import Period
from tilec.search import (
    MARGINS,
    MAX_CUTS,
    _Costs,
    _pareto,
    _search,
    choose,
    format_bytes,
    smallest_budget,
    usable,
    variants,
)
from tilec.target import REFERENCE
from tilec.trace import trace

from support.exactness import TOLERANCE, max_errors
from support.zoo import TINY


def conv_bn(inputs: int, outputs: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU())


class Residual(nn.Module):
    """A stem, one downsampling residual block and a classifier head (global pooling, linear)."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8)
        self.branch = nn.Sequential(conv_bn(8, 16, 2), nn.Conv2d(16, 16, 3, padding=1, bias=False),
                                    nn.BatchNorm2d(16))
        self.shortcut = nn.Conv2d(8, 16, 1, stride=2, bias=False)
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = torch.relu(self.branch(x) + self.shortcut(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class UNet(nn.Module):
    """Two levels: a skip at full size, max-pooling, a transposed-convolution up-sampling and concat."""

    def __init__(self):
        super().__init__()
        self.down = conv_bn(3, 8)
        self.bottom = conv_bn(8, 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.fuse = conv_bn(16, 8)
        self.out = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down(x)
        x = self.up(self.bottom(nn.functional.max_pool2d(skip, 2)))
        return self.out(self.fuse(torch.cat([skip, x], dim=1)))


MODELS = {"residual": (Residual, (1, 3, 22, 18)), "unet": (UNet, (1, 3, 14, 16))}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


@pytest.fixture(scope="module", params=sorted(MODELS))
def graph(request):
    return trace(build(request.param), MODELS[request.param][1])


def _budgets(graph) -> list[int]:
    """From the smallest feasible budget to one where everything is stored."""
    low = smallest_budget(graph, TINY)
    high = plan(graph, TINY, name="m", grid=(1, 1)).predicted_peak_bytes
    return sorted({low, *(low + (high - low) * k // 6 for k in range(1, 7)), 2 * high})


def _brute_force(costs: _Costs, budget: int) -> float:
    """Least estimated seconds over every segmentation at the cut candidates, each segment stored
    or tiled with, per margin, the coarsest grid that fits with that share of the budget to spare,
    or the finest, each also with every batch that is faster and fits (the search's options), its
    peaks as the planner predicts them (``Estimator.step_peaks``); a partial plan already slower
    than the best complete one, or over the budget, is abandoned."""
    best, last = float("inf"), costs.cuts[-1]

    def fits(chosen: list, limit: float = budget) -> bool:
        """``chosen``: ``((first, stop, mode), cost)`` per segment so far."""
        spans = [SegmentChoice(first, stop, (1, 1), mode) for (first, stop, mode), _ in chosen]
        rolls = [costs.estimator.made_tiled(first, spans) for (first, _, _), _ in chosen]
        return max(costs.estimator.step_peaks([cost for _, cost in chosen], rolls), default=0) <= limit

    def extend(first: int, seconds: float, chosen: list) -> None:
        nonlocal best
        if seconds >= best or not fits(chosen):
            return
        if first == last:
            best = seconds
            return
        for stop in (c for c in costs.cuts if c > first):
            grids = costs.grids(first, stop)
            tiled = [((first, stop, "tiled"), costs.option(first, stop, grid)) for grid in grids]
            coarsest = [next((option for option in tiled if fits([*chosen, option], budget - budget * share)), None)
                        for share in MARGINS]
            stored = ((first, stop, "stored"), costs.option(first, stop, None))
            offered = {id(o[1]): o for o in [stored, *coarsest, *tiled[-1:]] if o}
            for grid, (span, cost) in zip(grids, tiled, strict=True):
                if id(cost) in offered:
                    batched = [(span, costs.option(first, stop, grid, batch)) for batch in costs.batches(first, stop)]
                    offered.update({id(o[1]): o for o in batched if o[1].seconds < cost.seconds})
            for option in offered.values():
                extend(stop, seconds + option[1].seconds, [*chosen, option])

    extend(0, 0.0, [])
    return best


def test_the_search_costs_segments_as_the_planner_does(graph):
    """The search's tiles (all grids of a cut at once) give the costs of the planner's tiles."""
    costs = _Costs(graph, TINY, "float32")
    for first in costs.cuts:
        for stop in (c for c in costs.cuts if c > first):
            for grid in costs.grids(first, stop):
                tiles = [axis_tiles(graph, first, stop, axis, grid[axis]) for axis in (0, 1)]
                expected = costs.estimator.segment(first, stop, *tiles, stored=False)
                assert costs.option(first, stop, grid) == expected, (first, stop, grid)


def test_a_batch_past_the_longest_run_of_a_class_costs_the_same(graph):
    """Where no call of a batch takes as many tiles (``SegmentCost.largest_call``), no run of
    consecutive tiles of one class is that long: a larger batch costs the same, and the search
    stops offering them."""
    costs = _Costs(graph, TINY, "float32")
    past = full = 0
    for first in costs.cuts:
        for stop in (c for c in costs.cuts if c > first and costs.batches(first, c)):
            for grid in costs.grids(first, stop):
                for batch in (2, 3, 4):
                    cost = costs.option(first, stop, grid, batch)
                    if cost.largest_call < batch:
                        past += 1
                        assert costs.option(first, stop, grid, 2 * batch + 1) == cost, (first, stop, grid, batch)
                    else:
                        full += 1
                        assert cost.largest_call == batch
    assert past and full


def test_cut_candidates(graph):
    costs = _Costs(graph, TINY, "float32")
    nodes, order = graph.nodes, graph.order
    assert costs.cuts[0] == 0 and costs.cuts[-1] == len(order) and len(costs.cuts) <= MAX_CUTS + 2
    for cut in range(1, len(order)):
        node, before = nodes[order[cut]], nodes[order[cut - 1]]
        if node.tileable != before.tileable:
            assert cut in costs.cuts
        elif rule(node).pixel and node.inputs == (before.name,):
            assert cut not in costs.cuts


def _planned(graph, budget: int):
    chosen = choose(graph, TINY, budget)
    return plan(chosen.graph, TINY, name="m", segments=chosen.segments, memory_budget=budget)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(*[st.integers(0, 5)] * 3), max_size=30), st.sampled_from([2, 3]))
def test_the_pareto_front_keeps_exactly_the_undominated(values, fields):
    entries = [(*v, index) for index, v in enumerate(values)]  # the index: ties keep the first
    expected = []
    for entry in sorted(entries, key=lambda e: e[:fields]):
        if not any(all(kept[k] <= entry[k] for k in range(1, fields)) for kept in expected):
            expected.append(entry)
    assert _pareto(entries, fields) == expected


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(*[st.integers(0, 5)] * 3), max_size=20), st.lists(st.tuples(*[st.integers(0, 5)] * 3),
       max_size=10), st.sampled_from([2, 3]))
def test_a_shield_prunes_what_it_dominates_and_stays_out(values, shielding, fields):
    """Entries of another front (``shield``) prune the entries they are no worse than in every
    field, equal ones included, and are not returned."""
    entries = [(*v, index) for index, v in enumerate(values)]
    shield = [(*v, -1) for v in shielding]
    unshielded = [e for e in entries if not any(all(s[k] <= e[k] for k in range(fields)) for s in shield)]
    assert _pareto(entries, fields, shield) == [e for e in _pareto(entries, fields) if e in unshielded]


def test_every_budget_gets_a_plan_that_fits_it(graph):
    for budget in _budgets(graph):
        chosen = _planned(graph, budget)
        assert chosen.predicted_peak_bytes <= usable(budget) < budget
        assert chosen.predicted_peak_bytes == max(s.predicted_peak_bytes for s in chosen.segments)


@pytest.mark.parametrize("beam", [1, search.BEAM])
def test_dynamic_programming_matches_brute_force(graph, monkeypatch, beam):
    """The search's plans are the brute force's, however poor the bound its quick search finds."""
    monkeypatch.setattr(search, "BATCHES", (4,))  # one batch besides one by one: the brute force stays small
    monkeypatch.setattr(search, "BEAM", beam)
    for recomputed, variant in variants(graph, TINY):
        costs = _Costs(variant, TINY, "float32")
        for budget in _budgets(graph):
            best = _search(costs, usable(budget))
            expected = _brute_force(costs, usable(budget))
            if best is None:
                assert expected == float("inf"), (recomputed, format_bytes(budget))
                continue
            found = sum(costs.option(first, stop, None if mode == "stored" else grid, batch).seconds
                        for first, stop, grid, mode, batch in best.choices)
            assert found == pytest.approx(expected, rel=1e-12), (recomputed, format_bytes(budget))


def test_the_fastest_variant_that_fits_is_chosen(graph):
    for budget in _budgets(graph):
        fits = [best.seconds for _, variant in variants(graph, TINY)
                if (best := _search(_Costs(variant, TINY, "float32"), usable(budget))) is not None]
        assert choose(graph, TINY, budget).seconds == min(fits)


def test_more_memory_is_never_slower(graph):
    times = [choose(graph, TINY, budget).seconds for budget in _budgets(graph)]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(times, times[1:], strict=False)), times


def test_a_generous_budget_stores_everything(graph):
    chosen = _planned(graph, _budgets(graph)[-1])
    assert [s.mode for s in chosen.segments] == ["stored"]
    assert chosen.segments[0].flop_overhead == 0


def test_tight_budgets_tile(graph):
    chosen = _planned(graph, smallest_budget(graph, TINY))
    assert any(s.mode == "tiled" and s.grid != (1, 1) for s in chosen.segments)


@pytest.mark.parametrize("size", [(64, 77), (120, 97), (181, 160)])
def test_the_smallest_budget_named_has_a_plan(size):
    """A downsampling, training-mode BatchNorm and upsampling: at some sizes the smallest plan
    tiles a segment with a fine grid that is neither the finest nor the coarsest to fit a margin
    (the finest holds more kernel state), which the search offers where it finds no plan without."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Upsample(scale_factor=2), nn.Conv2d(8, 2, 3, padding=1)).double()
    graph = trace(model, (1, 3, *size))
    smallest = smallest_budget(graph, REFERENCE, "float64")
    assert choose(graph, REFERENCE, smallest, "float64").segments


def test_a_budget_below_the_smallest_names_the_smallest(graph):
    """The budget named, rounded up to a tenth of its unit, is accepted as written."""
    smallest = smallest_budget(graph, TINY)
    choose(graph, TINY, smallest)
    named = format_bytes(smallest, up=True)
    with pytest.raises(BudgetError, match=re.escape(f"smallest feasible budget is about {named}")):
        choose(graph, TINY, smallest - 1)
    assert parse_bytes(named.replace(" ", "")) >= smallest


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_budget_plans_train_exactly(name, share):
    shape = MODELS[name][1]
    doubled = trace(build(name).double(), shape)
    low = smallest_budget(doubled, TINY, "float64")
    high = plan(doubled, TINY, name="m", grid=(1, 1), dtype="float64").predicted_peak_bytes
    chosen = choose(doubled, TINY, int(low + share * (high - low)), "float64")
    errors = max_errors(build(name), shape, segments=chosen.segments, recomputed=chosen.recomputed)
    assert max(errors.values()) < TOLERANCE, errors


SMALL = """
from torch import nn
INPUT_SHAPE = (1, 3, 40, 36)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1))
"""


def test_cli_compiles_for_a_budget_and_reports_the_plan(tmp_path):
    (tmp_path / "m.py").write_text(SMALL)
    result = CliRunner().invoke(main, ["compile", str(tmp_path / "m.py"), "--memory-budget", "1.5MiB",
                                       "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "m.plan.json").read_text())
    assert data["memory_budget"] == 1572864  # 1.5 * 2**20
    assert 0 < data["kernel_state_bytes"] < data["predicted_peak_bytes"] <= 1572864
    assert "predicted peak" in result.output and "FLOP overhead" in result.output


def test_cli_refuses_an_infeasible_budget(tmp_path):
    (tmp_path / "m.py").write_text(SMALL)
    result = CliRunner().invoke(main, ["compile", str(tmp_path / "m.py"), "--memory-budget", "1KiB",
                                       "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "smallest feasible budget is about" in lines[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.py"]


def _padded(tile) -> bool:
    """Whether a tile pads any of its reads at the border itself."""
    return any(read.pad != (0, 0) for step in tile.steps for read in step.reads)


def test_the_search_cuts_every_tensor_of_a_segment_alike():
    """The search tiles a segment in tiles of one period of input pixels where it can (every
    tensor its tiles partition is the input at a stride): a U-Net's tensors at full and half
    resolution then line up, and the inner tiles that pad nothing are one shape class (one kernel
    per call shape, tiles that can run stacked). Six parts of the output instead (11 rows long)
    start at odd and even rows in turn, and read the half-resolution tensors in two ways."""
    graph = trace(build("unet"), (1, 3, 62, 58))
    stop = len(graph.order)
    assert search.periods_for(graph, [(62, 58), (31, 29)], [(62, 58)], 6) == (Period(12, 62), Period(10, 58))
    grids = _Costs(graph, TINY, "float32").grids(0, stop)
    assert len(grids) > 10 and all(isinstance(g, Period) for grid in grids for g in grid)
    for grid in grids:
        for axis in (0, 1):
            inner = [tile for tile in classified(graph, 0, stop, axis, grid[axis])[1:-1] if not _padded(tile)]
            assert len({tile.shape_class for tile in inner}) <= 1, (grid, axis)
    split = [tile for tile in classified(graph, 0, stop, 0, 6)[1:-1] if not _padded(tile)]
    assert len({tile.shape_class for tile in split}) == 2 and len(split) == 4


def test_a_segment_partitioning_a_size_no_stride_gives_is_split_into_parts():
    """An unpadded convolution's output (14 of 16 pixels) is no stride's: a segment whose tiles
    partition it is split into that many parts instead."""
    graph = trace(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1)), (1, 3, 16, 16))
    assert search.periods_for(graph, [(16, 16), (14, 14)], [(14, 14)], 2) is None
    grids = _Costs(graph, TINY, "float32").grids(0, len(graph.order))
    assert grids and all(isinstance(g, int) for grid in grids for g in grid)


def test_period_budget_plans_train_exactly():
    """A tight budget's plan for the U-Net at 62x58, in tiles of one period, trains exactly."""
    shape = (1, 3, 62, 58)
    doubled = trace(build("unet").double(), shape)
    chosen = choose(doubled, TINY, smallest_budget(doubled, TINY, "float64"), "float64")
    assert any(isinstance(g, Period) for s in chosen.segments for g in s.grid)
    errors = max_errors(build("unet"), shape, segments=chosen.segments, recomputed=chosen.recomputed)
    assert max(errors.values()) < TOLERANCE, errors
