"""Plans of other input sizes like one plan (``tilec.compile(..., like=tiled)``): the segments of a
plan, in input pixels, with its recomputed nodes, plan the same model at another size, exactly;
with a budget, a search narrowed to their cuts and a few others (the whole search where no plan
there fits); per mode, where the model has a plan per mode; anything but a ``TiledModel`` is
refused in one line.
"""

from __future__ import annotations

import pytest
import torch

import tilec
from tilec import pipeline, search
from tilec.config import parse_segments
from tilec.errors import BudgetError, PlanError

from support.exactness import TOLERANCE, max_errors
from support.zoo import MODE_SHAPES, MODE_ZOO, TRAIN_ZOO, UNet

LARGE, SMALL = (1, 3, 96, 96), (1, 3, 61, 75)


@pytest.fixture
def searches(monkeypatch):
    """The budget searches run while the test runs: the rows they searched and the cuts they were
    narrowed to (``choose``'s ``near``), each with the candidate cuts it searched."""
    ran, choose, cut_points = [], pipeline.choose, search.cut_points

    def counted(graph, *args, **kwargs):
        ran.append((graph.size(graph.input_names[0], 0), tuple(kwargs.get("near", ())), set()))
        return choose(graph, *args, **kwargs)

    def cuts(*args):
        found = cut_points(*args)
        ran[-1][2].update(found)
        return found

    monkeypatch.setattr(pipeline, "choose", counted)
    monkeypatch.setattr(search, "cut_points", cuts)
    return ran


def _cuts(segments: str) -> set[int]:
    return {cut for first, stop, *_ in parse_segments(segments) for cut in (first, stop)}


def _model():
    torch.manual_seed(0)
    return TRAIN_ZOO["resnet_basic"]().double()


def test_another_size_is_searched_over_the_cuts_of_the_plan_it_is_like_and_runs_exactly(searches):
    model = _model()
    large = tilec.compile(model, LARGE, memory_budget="6MiB", dtype="float64")
    small = tilec.compile(model, SMALL, memory_budget="6MiB", like=large, dtype="float64")
    (segments, recomputed), (found, found_recomputed) = type(large).plan.planned_as, type(small).plan.planned_as
    assert "px" in segments and found_recomputed == recomputed
    (rows, near, everywhere), (small_rows, small_near, narrowed) = searches
    assert (rows, near, small_rows, set(small_near)) == (96, (), 61, _cuts(segments))
    assert _cuts(segments) <= narrowed and len(narrowed) < len(everywhere)
    assert _cuts(found) <= narrowed
    worst = max(max_errors(model, SMALL, tiled=small).values())
    assert worst <= TOLERANCE


def test_with_room_in_the_budget_tiled_segments_are_stored_where_that_is_faster(searches):
    """The small size with twice the budget: every segment fits stored, which the estimate finds
    faster than tiles, so the plan like the large one stores them all."""
    model = _model()
    large = tilec.compile(model, LARGE, memory_budget="6MiB", dtype="float64")
    small = tilec.compile(model, SMALL, memory_budget="12MiB", like=large, dtype="float64")
    assert [near != () for _, near, _ in searches] == [False, True]
    assert all(grid == (1, 1) for _, _, grid in type(small).plan.segments)
    assert "px" in type(large).plan.planned_as[0]


def test_a_budget_no_plan_over_its_cuts_fits_is_searched_over_all_cuts(searches):
    model = _model()
    large = tilec.compile(model, LARGE, memory_budget="6MiB", dtype="float64")
    with pytest.raises(BudgetError, match="smallest feasible budget"):
        tilec.compile(model, LARGE, memory_budget="1MiB", like=large, dtype="float64")
    assert [near != () for _, near, _ in searches] == [False, True, False]


def test_like_alone_plans_its_segments_with_its_recomputed_nodes():
    torch.manual_seed(0)
    model = UNet("transposed").double().eval()
    recomputed = ("relu__1",)
    large = tilec.compile(model, (1, 3, 64, 64), segments="0:45@32x32px", recomputed=recomputed, dtype="float64")
    assert type(large).plan.planned_as[1] == recomputed
    small = tilec.compile(model, (1, 3, 40, 56), like=large, dtype="float64")
    assert type(small).plan.planned_as == type(large).plan.planned_as
    assert max(max_errors(model, (1, 3, 40, 56), tiled=small).values()) <= TOLERANCE


def test_a_model_of_two_plans_plans_each_mode_like_its_own():
    torch.manual_seed(0)
    model = MODE_ZOO["drop_path"]().double()
    height, width = MODE_SHAPES["drop_path"][2:]
    large = tilec.compile(model, (1, 3, height * 2, width * 2), grid=(3, 2), dtype="float64")
    assert type(large).plan.mode == "train" and type(large).other.plan.mode == "eval"
    small = tilec.compile(model, (1, 3, height, width), like=large, dtype="float64")
    for got, want in ((type(small), type(large)), (type(small).other, type(large).other)):
        assert got.plan.mode == want.plan.mode and got.plan.planned_as == want.plan.planned_as


def test_like_must_be_a_tiled_model():
    with pytest.raises(PlanError, match="like must be a TiledModel") as raised:
        tilec.compile(_model(), SMALL, memory_budget="6MiB", like=_model())
    assert "\n" not in str(raised.value)
