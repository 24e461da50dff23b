"""Spatial parallelism and DDP on real gloo process groups: float64 results equal single-process
untiled PyTorch's. Each test spawns its ranks (``support.distributed.launch``), bounded in time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tilec.calibrate import search_device
from tilec.codegen import render
from tilec.distribute import distribute
from tilec.pipeline import plan_for, target_for
from tilec.search import smallest_budget
from tilec.trace import trace

from support import distributed
from support.exactness import TOLERANCE
from support.zoo import SHAPES, TRAIN_SHAPES, TRAIN_ZOO, ZOO, reference_kernels

pytestmark = pytest.mark.slow


def _source(tmp_path, name: str, label: str = "tiled", ranks: int | None = None, train: bool = False,
            **options) -> str:
    """Render the float64 module of zoo model ``name`` (``train``: of ``TRAIN_ZOO``) into a file;
    return its path."""
    path = tmp_path / f"{label}.py"
    graph = trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name]) if train else trace(ZOO[name](), SHAPES[name])
    # not planned for shared tiles: segments may roll gradients, which ranks sharing tiles must not
    plan = plan_for(graph, target_for(graph, "float64"), name, dtype="float64", **options)
    path.write_text(render(distribute(plan, ranks)))
    return str(path)


def _results(outcomes: list[dict]) -> list:
    errors = [f"rank {rank}: {o['error']}\n{o['trace']}" for rank, o in enumerate(outcomes) if "error" in o]
    assert not errors, "\n".join(errors)
    return [o["result"] for o in outcomes]


def _assert_exact(per_rank: list[dict[str, float]]) -> None:
    for rank, errors in enumerate(per_rank):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOLERANCE, f"rank {rank}: {worst} off by {errors[worst]:.3g}"


SPATIAL = {
    # model, ranks, planning options
    "head_2_ranks": ("resnet_head", 2, {"grid": (2, 3)}),
    "head_3_ranks": ("resnet_head", 3, {"grid": (2, 2)}),
    "head_3_ranks_planned": ("resnet_head", 3, {"grid": (3, 2), "ranks": 3}),  # shares recorded by --ranks
    # cuts through a residual block, a stored segment, and a 1x2 segment: one of 3 ranks gets no tile
    "segments_3_ranks": ("resnet_basic", 3, {"segments": [(0, 4, (3, 2)), (4, 9, (1, 1)), (9, 14, (1, 2)),
                                                          (14, None, (2, 3))]}),
    "unet_2_ranks": ("unet_bilinear", 2, {"grid": (3, 2)}),
}


@pytest.mark.parametrize("case", sorted(SPATIAL))
def test_spatial_ranks_match_untiled(case, tmp_path):
    name, ranks, options = SPATIAL[case]
    if "segments" in options:
        count = len(trace(ZOO[name](), SHAPES[name]))
        options = {**options, "segments": [(a, count if b is None else b, g) for a, b, g in options["segments"]]}
    source = _source(tmp_path, name, **options)
    _assert_exact(_results(distributed.launch(ranks, distributed.spatial, source, name, SHAPES[name],
                                              folder=tmp_path)))


SPATIAL_TRAIN = {
    # BatchNorm in training mode: every rank combines all ranks' partials into the batch statistics
    # and updates the running ones alike; the head in a segment with three levels
    "head_levels_2_ranks": ("resnet_head", {"segments": [(0, 4, (2, 3)), (4, 14, (3, 2)), (14, None, (2, 2))]}),
    "squeeze_excite_2_ranks": ("squeeze_excite", {"grid": (3, 2)}),
    # with --grid the pooled head is its own segment with a direct level and tiles costing nothing
    "head_grid_2_ranks": ("resnet_head", {"grid": (2, 3)}),
    # the last block's and the head's levels in one tile (the head's direct): the rank without it still
    # exchanges partials (zeros)
    "head_one_tile_2_ranks": ("resnet_head", {"segments": [(0, 14, (3, 2)), (14, 19, (1, 1), "tiled"),
                                                           (19, None, (1, 1), "tiled")]}),
}


@pytest.mark.parametrize(("name", "options"), list(SPATIAL_TRAIN.values()), ids=list(SPATIAL_TRAIN))
def test_spatial_ranks_match_untiled_in_training_mode(name, options, tmp_path):
    """Every rank's outputs, input and parameter gradients and buffers equal untiled's."""
    if "segments" in options:
        count = len(trace(TRAIN_ZOO[name](), TRAIN_SHAPES[name]))
        options = {**options, "segments": [(a, count if b is None else b, *rest) for a, b, *rest in
                                           options["segments"]]}
    source = _source(tmp_path, name, train=True, **options)
    _assert_exact(_results(distributed.launch(2, distributed.spatial_train, source, name, TRAIN_SHAPES[name],
                                              folder=tmp_path)))


def test_tiles_are_shared_by_cost_and_a_rank_may_get_none(tmp_path):
    source = _source(tmp_path, "resnet_basic", segments=[(0, 9, (2, 3)), (9, 14, (1, 2)), (14, 19, (1, 1))])
    shares = _results(distributed.launch(3, distributed.shares, source, "resnet_basic", folder=tmp_path))
    assert [sum(s[0] for s in shares), sum(s[1] for s in shares)] == [6, 2]
    assert sorted(s[1] for s in shares) == [0, 1, 1]
    assert all(s[0] >= 1 for s in shares)


@pytest.mark.parametrize("planning", ["grid", "budget"])
def test_ddp_over_tiled_models_averages_like_untiled(planning, tmp_path):
    name = "resnet_head"
    if planning == "grid":
        source = _source(tmp_path, name, grid=(2, 2))
    else:  # the smallest feasible budget, with the kernel state the budget search counts in tests
        graph = trace(ZOO[name](), SHAPES[name])
        device, dtype = search_device(graph.autocast, "float64")
        target = reference_kernels(replace(target_for(graph, "float64"), device=device), dtype)
        budget = smallest_budget(graph, target, "float64")
        source = _source(tmp_path, name, memory_budget=budget)
    results = _results(distributed.launch(2, distributed.ddp, source, name, SHAPES[name], folder=tmp_path))
    _assert_exact(results)


def test_two_d_images_by_tiles(tmp_path):
    name = "resnet_head"
    source = _source(tmp_path, name, grid=(3, 2))
    _assert_exact(_results(distributed.launch(4, distributed.two_d, source, name, SHAPES[name], folder=tmp_path)))


@pytest.mark.parametrize(("what", "message"), [
    ("plan", "different plans"),
    ("weights", "different parameters"),
    ("input", "different inputs"),
    ("ranks", "the process group has 2 ranks, but plan 'resnet_head' was compiled for --ranks 3"),
])
def test_ranks_that_disagree_are_refused(what, message, tmp_path):
    name = "resnet_head"
    sources = [_source(tmp_path, name, "a", grid=(2, 2)), _source(tmp_path, name, "b", grid=(3, 2)),
               _source(tmp_path, name, "c", grid=(2, 2), ranks=3)]
    outcomes = distributed.launch(2, distributed.mismatch, sources, name, SHAPES[name], what, folder=tmp_path)
    for rank, outcome in enumerate(outcomes):
        assert "error" in outcome, f"rank {rank} ran: {outcome}"
        assert outcome["error"].startswith("ValueError") and message in outcome["error"]
        assert "\n" not in outcome["error"]
