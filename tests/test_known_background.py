"""A background known when compiling (a masked slide given to ``tilec.compile``): the time estimate
counts the tiles the runtime computes once (``Segment.reused``), and a budget search plans with it.
"""

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reuse import Slide
from torch import nn

import tilec
from tilec.config import parse_segments
from tilec.cost.background import Background
from tilec.cost.estimator import Estimator
from tilec.errors import PlanError
from tilec.ir import segments_text
from tilec.pipeline import described, plan_for
from tilec.planio import dumps, loads
from tilec.planner import aligned_segments, classified
from tilec.regions import Period
from tilec.report import describe_plan
from tilec.search import _Costs, _search, aligned_periods, choose, tiles_a_side, usable
from tilec.slides import slide
from tilec.target import Speed, Target
from tilec.trace import trace

from support.exactness import TOLERANCE
from support.zoo import TINY, ResNetHead

SIZE = 256
BACKGROUND = 245


def masked_slide(tissue=(slice(0, 9), slice(0, 12)), cells=32):
    """A SIZE² RGB slide, textured, masked to the ``tissue`` cells of a ``cells``² mask: everything
    outside reads as white."""
    image = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    mask = np.zeros((cells, cells), dtype=bool)
    mask[tissue] = True
    return slide(image).masked(mask)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 40), st.integers(1, 40), st.data())
def test_a_rectangle_is_background_where_every_pixel_is(cell_rows, cell_cols, height, width, data):
    mask = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=cell_cols, max_size=cell_cols),
                                       min_size=cell_rows, max_size=cell_rows)))
    pixels = mask[np.arange(height)[:, None] * cell_rows // height, np.arange(width)[None, :] * cell_cols // width]
    intervals = st.tuples(st.integers(0, 40), st.integers(0, 40))
    rows = np.array(data.draw(st.lists(intervals, min_size=1, max_size=4)))
    cols = np.array(data.draw(st.lists(intervals, min_size=1, max_size=4)))
    rows, cols = np.minimum(rows, height), np.minimum(cols, width)
    found = Background(mask, height, width).constant(rows, cols)
    for i, (r0, r1) in enumerate(rows):
        for j, (c0, c1) in enumerate(cols):
            assert found[i, j] == bool(pixels[r0:r1, c0:c1].all()), (rows[i], cols[j])


def test_a_masked_slide_tells_its_background_and_an_unmasked_one_none():
    masked = masked_slide()
    specs, known = described([masked, ((1,), "int64")])
    assert specs == [((1, 3, SIZE, SIZE), "uint8"), ((1,), "int64")] and list(known) == [0]
    assert slide(np.zeros((8, 8, 3), dtype=np.uint8)).background() is None


@pytest.mark.parametrize("grid", [(8, 8), (6, 7)])
def test_the_estimate_reuses_what_the_runtime_reuses(grid):
    """One tiled segment over a slide whose tissue is the top-left corner: the tiles whose cone is
    all background, all but one per shape class, are the ones the runtime computes once."""
    torch.manual_seed(0)
    model = Slide(ResNetHead()).double().eval()
    masked = masked_slide()
    count = len(trace(model, [((1, 3, SIZE, SIZE), "uint8")]))
    graph = trace(model, [((1, 3, SIZE, SIZE), "uint8")])
    blind = plan_for(graph, TINY, "m", segments=[(0, count - 2, grid), (count - 2, count, (1, 1))])
    known = plan_for(graph, TINY, "m", segments=[(0, count - 2, grid), (count - 2, count, (1, 1))],
                     backgrounds={graph.input_names[0]: masked.background()})
    assert known.backgrounds == (graph.input_names[0],) and blind.backgrounds == ()
    reused = known.segments[0].reused
    assert blind.segments[0].reused == 0 and 0 < reused < grid[0] * grid[1]
    assert known.segments[0].estimated_seconds < blind.segments[0].estimated_seconds
    tiled = tilec.compile(model, [masked], segments=[(0, count - 2, grid), (count - 2, count, (1, 1))],
                          dtype="float64")
    want = model(torch.from_numpy(np.ascontiguousarray(masked[...])))
    assert (tiled(masked) - want).abs().max().item() <= TOLERANCE
    assert tiled.reuse.passes["segment 0 level 1"][1] == reused


def test_a_budget_search_knowing_the_background_batches_the_tissue_tiles_on_a_launch_bound_device():
    """Where each op call costs far more than its FLOPs (a GPU's launches) and the background is
    known (scattered specks of tissue), the search takes finer tiles, most of them computed once,
    and stacks the others; blind to it, a coarser grid one tile at a time is fastest (stacked tiles
    hold more than a coarser grid of as many calls, and compute more halo)."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 2))
    model = Slide(body).double().eval()
    image = np.random.default_rng(0).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    masked = slide(image).masked(np.random.default_rng(1).random((32, 32)) < 0.02)
    graph = trace(model, [((1, 3, SIZE, SIZE), "uint8")])
    launch_bound = Target(speed=Speed(flop_rate=1e13, call_seconds=1e-4, copy_rate=1e11), kernel_state=256)
    known = choose(graph, launch_bound, 1 << 20, "float64", {graph.input_names[0]: masked.background()})
    blind = choose(graph, launch_bound, 1 << 20, "float64")
    assert max(c.batch for c in blind.segments) == 1
    tiled_known = [c for c in known.segments if c.mode == "tiled"]
    assert max(c.batch for c in tiled_known) > 1, known.segments
    assert max(tiles_a_side(c.grid) for c in tiled_known) > max(tiles_a_side(c.grid) for c in blind.segments
                                                                if c.mode == "tiled")
    assert known.seconds < blind.seconds
    tiled = tilec.compile(model, [masked], segments=[tuple(c) for c in known.segments], dtype="float64")
    want = model(torch.from_numpy(np.ascontiguousarray(masked[...])))
    assert (tiled(masked) - want).abs().max().item() <= TOLERANCE
    assert sum(reused for _, reused in tiled.reuse.passes.values()) > 0


def test_inspect_says_what_the_estimate_left_out():
    torch.manual_seed(0)
    model = Slide(ResNetHead()).double().eval()
    graph = trace(model, [((1, 3, SIZE, SIZE), "uint8")])
    planned = plan_for(graph, TINY, "m", grid=(8, 8), backgrounds={graph.input_names[0]: masked_slide().background()})
    caption = describe_plan(planned).caption
    assert f"background of {graph.input_names[0]} known when compiling" in caption
    assert f"{planned.segments[0].reused} of segment 0's 64" in caption


def test_a_plan_counting_every_tile_as_computed_once_is_refused():
    """A segment computes at least one tile of its grid: its ``reused`` stays below its tiles."""
    torch.manual_seed(0)
    model = Slide(ResNetHead()).double().eval()
    graph = trace(model, [((1, 3, SIZE, SIZE), "uint8")])
    planned = plan_for(graph, TINY, "m", grid=(8, 8), backgrounds={graph.input_names[0]: masked_slide().background()})
    assert 0 < planned.segments[0].reused < 64
    assert loads(dumps(planned)) == planned
    data = json.loads(dumps(planned))
    data["segments"][0]["reused"] = 64
    with pytest.raises(PlanError, match="segment 0 counts 64 tiles as computed once.*fewer than its 8x8 tiles"):
        loads(json.dumps(data), "p.json")


def _resnet_slide():
    """ResNetHead (one stride-2 block) reading a uint8 slide, its graph, where its node 'layer2'
    starts (half resolution from there) and the known background of ``masked_slide``."""
    torch.manual_seed(0)
    model = Slide(ResNetHead()).double().eval()
    graph = trace(model, [((1, 3, SIZE, SIZE), "uint8")])
    half = next(k for k, name in enumerate(graph.order) if graph.size(name, 0) == SIZE // 2)
    return model, graph, half, {graph.input_names[0]: masked_slide().background()}


def _period(estimator, graph, first, stop, grid):
    return estimator.period(*(classified(graph, first, stop, axis, grid[axis]) for axis in range(2)))


def test_a_segment_repeats_with_one_period_in_input_pixels_where_its_tiles_line_up():
    """8x8 tiles a side repeat every 32 input pixels at full and at half resolution; 6x6 ones every
    43 at full resolution but 22 x 2 = 44 at half; tiles of one ``Period`` of 44 pixels repeat
    every 44 at both; an uneven split and a grid finer than the period has none; nothing is known
    without a background."""
    _, graph, half, known = _resnet_slide()
    estimator = Estimator(graph, TINY, "float64", known)
    count = len(graph)
    assert _period(estimator, graph, 0, half, (8, 8)) == _period(estimator, graph, half, count - 3, (8, 8)) == (32, 32)
    assert _period(estimator, graph, 0, half, (6, 6)) == (43, 43)
    assert _period(estimator, graph, half, count - 3, (6, 6)) == (44, 44)
    period = (Period(44, SIZE), Period(44, SIZE))
    assert _period(estimator, graph, 0, half, period) == _period(estimator, graph, half, count - 3, period) == (44, 44)
    assert _period(estimator, graph, 0, half, (1, 8)) == (SIZE, 32)
    assert _period(estimator, graph, 0, half, (120, 8)) is None  # 256 in 120: lengths 3 and 2
    assert _period(Estimator(graph, TINY, "float64"), graph, 0, half, (8, 8)) is None


def test_aligned_segments_count_the_input_gradients_of_their_tiles_computed_once_in_classes():
    """Two tiled segments of one period: the later one's input wants a gradient, and its tiles
    computed once back-propagate it in classes (``Sweep.alike``), which the estimate counts; of a
    later segment of another period, each its own."""
    _, graph, half, known = _resnet_slide()
    count = len(graph)
    aligned = plan_for(graph, TINY, "m", segments=[(0, half, (8, 8)), (half, count - 3, (8, 8)),
                                                 (count - 3, count, (1, 1))], backgrounds=known)
    assert aligned_segments(Estimator(graph, TINY, "float32", known), aligned.segments) == [True, True, False]
    apart = Estimator(graph, TINY, "float32", known).segment(half, count - 3, aligned.segments[1].rows,
                                                            aligned.segments[1].cols, False)
    assert aligned.segments[1].reused == apart.reused > 0
    assert aligned.segments[1].estimated_seconds < apart.seconds
    mixed = plan_for(graph, TINY, "m", segments=[(0, half, (6, 6)), (half, count - 3, (8, 8)),
                                               (count - 3, count, (1, 1))], backgrounds=known)
    assert aligned_segments(Estimator(graph, TINY, "float32", known), mixed.segments) == [False, True, False]


def test_tiles_of_one_period_line_up_where_grids_do_not_and_run_exactly(monkeypatch):
    """At 246 pixels a side, 8 parts a side are 31 pixels at full resolution and 16 x 2 = 32 at
    half: the middle segment's tiles do not line up with the last one's, whose input gradient
    reaches them (through a stride-2 convolution), and its tiles computed once each back-propagate
    their own input gradient. Tiles of a ``Period`` of 32 pixels (the last one shorter) line up:
    they share input gradients in fewer classes (``Sweep.alike``), as the estimate counts, and the
    step is exact."""
    side = 246
    torch.manual_seed(0)
    model = Slide(ResNetHead()).double().eval()
    image = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    mask = np.zeros((32, 32), dtype=bool)
    mask[:9, :12] = True
    masked = slide(image).masked(mask)
    graph = trace(model, [((1, 3, side, side), "uint8")])
    half = next(k for k, name in enumerate(graph.order) if graph.size(name, 0) == side // 2)
    known = {graph.input_names[0]: masked.background()}
    count = len(graph)
    estimator = Estimator(graph, TINY, "float64", known)
    period = (Period(32, side), Period(32, side))
    classes = {}
    for grid in ((8, 8), period):
        segments = [(0, 5, grid), (5, half, grid), (half, count - 3, grid), (count - 3, count, (1, 1))]
        planned = plan_for(graph, TINY, "m", segments=segments, backgrounds=known)
        assert [s.grid for s in planned.segments[:3]] == [(8, 8)] * 3
        aligned = aligned_segments(estimator, planned.segments)
        assert aligned == ([False, False, True, False] if grid == (8, 8) else [True, True, True, False])
        assert [s.period for s in planned.segments] == [None if grid == (8, 8) else (32, 32)] * 3 + [None]
        again = plan_for(graph, TINY, "m", segments=parse_segments(segments_text(planned.segments)), backgrounds=known)
        assert dumps(again) == dumps(planned)
        tiled = tilec.compile(model, [masked], segments=segments, dtype="float64")
        sweep = type(tiled).__init__.__globals__["Sweep"]
        alike, found = sweep.alike, []
        monkeypatch.setattr(sweep, "alike", lambda self, tiles, alike=alike, found=found: found.append(
            (len(tiles), len(alike(self, tiles)))) or alike(self, tiles))
        want_model = copy.deepcopy(model)
        pixels = torch.from_numpy(np.ascontiguousarray(masked[...]))
        want = want_model(pixels)
        got = tiled(masked)
        assert (want - got).abs().max().item() <= TOLERANCE
        grad = torch.randn_like(want, generator=torch.Generator().manual_seed(1))
        want_grads = torch.autograd.grad(want, list(want_model.parameters()), grad)
        got_grads = torch.autograd.grad(got, list(model.parameters()), grad)
        assert max((a - b).abs().max().item() for a, b in zip(want_grads, got_grads, strict=True)) <= TOLERANCE
        monkeypatch.undo()
        classes[grid == period] = sum(n for _, n in found), sum(tiles for tiles, _ in found)
    assert classes[True][0] < classes[True][1] and classes[False][0] == classes[False][1], classes


def test_a_budget_search_knowing_the_background_offers_plans_of_one_period():
    """Each aligned search (``search.aligned_periods``) plans every tiled segment in tiles of its
    period, and the budget search takes the fastest of those and of its own."""
    _, graph, _, known = _resnet_slide()
    budget = 8 << 20
    chosen = choose(graph, TINY, budget, "float64", known)
    estimator = Estimator(graph, TINY, "float64", known)
    periods = aligned_periods(graph, known)
    assert (Period(64, SIZE), Period(64, SIZE)) in periods and (Period(44, SIZE), Period(44, SIZE)) in periods
    for period in periods[:3]:
        best = _search(_Costs(graph, TINY, "float64", known, period), usable(budget))
        assert best is not None
        tiled = [c for c in best.choices if c.mode == "tiled"]
        assert tiled and {c.grid for c in tiled} == {period}
        planned = plan_for(graph, TINY, "m", segments=best.choices, backgrounds=known)
        found = {estimator.period(s.rows, s.cols) for s in planned.segments if s.mode == "tiled"}
        assert found == {(period[0].pixels,) * 2}
        assert chosen.seconds <= best.seconds
