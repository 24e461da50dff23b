"""Plans of other input sizes from one search (``tilec.compile(..., like=tiled)``): the segments of
a plan, in input pixels, with its recomputed nodes, plan the same model at another size without a
search, exactly; with a budget, only where their prediction fits it (else the search runs), each
tiled segment stored instead where that fits and is faster; per mode, where the model has a plan
per mode; anything but a ``TiledModel`` is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

import tilec
from tilec import pipeline
from tilec.config import parse_segments
from tilec.errors import PlanError

from support.exactness import TOLERANCE, max_errors
from support.zoo import MODE_SHAPES, MODE_ZOO, TRAIN_ZOO, UNet

LARGE, SMALL = (1, 3, 96, 96), (1, 3, 61, 75)


@pytest.fixture
def searches(monkeypatch):
    """The budget searches run while the test runs, as the sizes they searched."""
    ran, choose = [], pipeline.choose

    def counted(graph, *args, **kwargs):
        ran.append(graph.size(graph.input_names[0], 0))
        return choose(graph, *args, **kwargs)

    monkeypatch.setattr(pipeline, "choose", counted)
    return ran


def _model():
    torch.manual_seed(0)
    return TRAIN_ZOO["resnet_basic"]().double()


def test_another_size_plans_the_segments_of_the_plan_it_is_like_and_runs_exactly(searches):
    model = _model()
    large = tilec.compile(model, LARGE, memory_budget="6MiB", dtype="float64")
    # at the small size the same tiles predict 6.2 MiB (their uneven last tiles are more call shapes)
    small = tilec.compile(model, SMALL, memory_budget="7MiB", like=large, dtype="float64")
    assert searches == [96]  # the small size was not searched
    (segments, recomputed), (found, found_recomputed) = type(large).plan.planned_as, type(small).plan.planned_as
    assert "px" in segments and found_recomputed == recomputed
    for want, got in zip(parse_segments(segments), parse_segments(found), strict=True):
        assert got[:2] == want[:2] and got[2] in (want[2], (1, 1))  # the same tiles, or stored
    worst = max(max_errors(model, SMALL, tiled=small).values())
    assert worst <= TOLERANCE


def test_with_room_in_the_budget_tiled_segments_are_stored_where_that_is_faster(searches):
    """The small size with twice the budget: every segment fits stored, which the estimate finds
    faster than tiles, so the plan like the large one stores them all."""
    model = _model()
    large = tilec.compile(model, LARGE, memory_budget="6MiB", dtype="float64")
    small = tilec.compile(model, SMALL, memory_budget="12MiB", like=large, dtype="float64")
    assert searches == [96]
    assert all(grid == (1, 1) for _, _, grid in type(small).plan.segments)
    assert "px" in type(large).plan.planned_as[0]


def test_segments_that_do_not_fit_the_budget_at_this_size_are_searched_again(searches):
    model = _model()
    large = tilec.compile(model, LARGE, memory_budget="6MiB", dtype="float64")
    tight = tilec.compile(model, LARGE, memory_budget="5MiB", like=large, dtype="float64")
    assert searches == [96, 96]
    assert type(tight).plan.planned_as != type(large).plan.planned_as


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
