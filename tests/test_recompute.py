"""Recomputing long-lived tensors (``tilec.recompute``): exact, chosen by the budget search
when it pays, refused with one line when impossible."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tilec.recompute
from tilec.errors import GridError
from tilec.planner import plan
from tilec.recompute import MIN_GAP, candidates, cone, late_readers, recompute
from tilec.search import _budget_for, _Costs, _smallest, choose, smallest_budget, variants
from tilec.trace import trace

from support.exactness import check_exact
from support.zoo import SHAPES, TINY, ZOO


@pytest.fixture
def short_gaps(monkeypatch):
    """Both skips of the small three-level U-Nets count as long-lived."""
    monkeypatch.setattr(tilec.recompute, "MIN_GAP", 6)


def _unet(name: str = "unet_transposed"):
    model = ZOO[name]().double()
    return model, trace(model, SHAPES[name])


def _skips(graph) -> list[str]:
    return candidates(graph, dict.fromkeys(graph.order, 1.0), 1.0)


def test_the_skips_of_a_unet_are_the_candidates_cheapest_first(short_gaps):
    _, graph = _unet()
    skips = _skips(graph)
    assert len(skips) == 2  # the two skips of the three-level U-Net, full resolution first
    assert len(cone(graph, skips[0])) < len(cone(graph, skips[1]))
    for name in skips:
        readers = late_readers(graph, name)
        assert [graph.nodes[r].op for r in readers] == ["cat"]


def test_recompute_copies_the_cone_before_the_late_reader():
    _, graph = _unet()
    skip = _skips(graph)[0]
    reader = late_readers(graph, skip)[0]
    copied = recompute(graph, [skip])
    order = list(copied.order)
    copies = [n for n in order if copied.nodes[n].recomputes is not None]
    assert [copied.nodes[n].recomputes for n in copies] == cone(graph, skip)
    assert all(n == f"{copied.nodes[n].recomputes}_recomputed0" for n in copies)
    assert order.index(copies[-1]) + 1 == order.index(reader)
    assert copied.nodes[reader].inputs[0] == copies[-1]
    assert copied.users[skip] != () and reader not in copied.users[skip]
    assert list(graph.order) == [n for n in order if n not in copies]  # the original is untouched
    assert reader in graph.users[skip]


@pytest.mark.parametrize("name", ["unet_transposed", "unet_nearest", "unet_bilinear", "unet_crop"])
def test_recomputed_skips_are_exact_through_cuts(name, short_gaps):
    model, graph = _unet(name)
    skips = _skips(graph)
    count = len(recompute(graph, skips))
    middle = count // 2
    segments = [(0, 7, (2, 3)), (7, middle, (1, 1)), (middle, count, (3, 2))]
    check_exact(model, SHAPES[name], segments=segments, recomputed=skips)


@pytest.mark.parametrize("grid", [(1, 1), (2, 2), (4, 3)])
def test_recomputed_skips_are_exact_with_one_grid(grid):
    model, graph = _unet()
    check_exact(model, SHAPES["unet_transposed"], grid=grid, recomputed=_skips(graph)[:1])


def test_recompute_lowers_the_smallest_budget_of_a_unet_whose_skips_dominate():
    """Wide full-resolution skips with a cheap cone: keeping them costs more than recomputing."""

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU())
            self.deep = nn.Sequential(*[m for _ in range(MIN_GAP) for m in (nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())])
            self.squeeze = nn.Conv2d(16, 2, 1)
            self.out = nn.Conv2d(18, 1, 3, padding=1)

        def forward(self, x):
            skip = self.enc(x)
            return self.out(torch.cat([skip, self.deep(self.squeeze(skip))], 1))

    graph = trace(Wide(), (1, 1, 64, 64))
    assert [recomputed for recomputed, _ in variants(graph, TINY)] == [(), (_skips(graph)[0],)]
    kept = smallest_budget(graph, TINY)
    chosen = choose(graph, TINY, kept)
    planned = plan(chosen.graph, TINY, name="m", segments=chosen.segments, memory_budget=kept)
    assert planned.predicted_peak_bytes <= kept
    # with recompute the smallest budget is lower than the best plan keeping the skip can do
    assert kept < _budget_for(_smallest(_Costs(graph, TINY, "float32")))
    check_exact(Wide(), (1, 1, 64, 64), segments=chosen.segments, recomputed=chosen.recomputed)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", r"--recompute nope: cannot recompute node nope: there is no such node"),
        ("input", r"--recompute input: cannot recompute node input: there is no such node"),
    ],
)
def test_bad_names_are_refused_in_one_line(name, message):
    _, graph = _unet()
    with pytest.raises(GridError, match=message) as error:
        recompute(graph, [name])
    assert "\n" not in str(error.value)


def test_a_node_without_late_readers_or_from_an_untiled_part_is_refused():
    _, graph = _unet()
    first = graph.order[0]
    with pytest.raises(GridError, match=rf"--recompute {first}: .*no reader comes {MIN_GAP} or more nodes after"):
        recompute(graph, [first])
    heads = ZOO["heads"]()
    graph = trace(heads, SHAPES["heads"])
    with pytest.raises(GridError, match=r"--recompute linear: .*it is a model output"):
        recompute(graph, ["linear"])


class _SwappedSkip(nn.Module):
    """A skip computed through an H/W transpose (no tile rule), read again after six conv + ReLU."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(1, 2, 3, padding=1)
        self.deep = nn.Sequential(*[m for _ in range(6) for m in (nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())])
        self.out = nn.Conv2d(4, 1, 3, padding=1)

    def forward(self, x):
        skip = self.enc(x).transpose(2, 3)
        return self.out(torch.cat([skip, self.deep(skip)], 1))


def test_a_skip_from_an_untiled_part_is_refused():
    graph = trace(_SwappedSkip(), (1, 1, 12, 12))
    assert not graph.nodes["transpose"].tileable
    with pytest.raises(GridError, match=r"--recompute transpose: .*depends on node transpose .*cannot be recomputed "
                                        r"tile by tile") as error:
        recompute(graph, ["transpose"])
    assert "\n" not in str(error.value)


class _NormalisedSkip(nn.Module):
    """A U-Net-like skip whose cone holds a BatchNorm (in training mode: batch statistics)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.deep = nn.Sequential(*[m for _ in range(6) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())])
        self.out = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        skip = self.enc(x)
        return self.out(torch.cat([skip, self.deep(skip)], 1))


def test_a_skip_after_an_eval_mode_batch_norm_is_recomputed_exactly():
    check_exact(_NormalisedSkip().eval(), (1, 1, 16, 16), grid=(2, 2), recomputed=["relu"])


@pytest.mark.parametrize("segments", [None, [(0, 3, (2, 2)), (3, 17, (1, 1)), (17, 20, (2, 2))]],
                         ids=["grid", "segments"])
def test_a_skip_after_a_training_mode_batch_norm_is_refused_or_exact(segments):
    model = _NormalisedSkip().train()
    try:
        recompute(trace(model, (1, 1, 16, 16)), ["relu"])
    except GridError as error:  # refused: as good as exact
        assert "batch_norm" in str(error) and "\n" not in str(error)
        return
    check_exact(model, (1, 1, 16, 16), grid=None if segments else (2, 2), segments=segments, recomputed=["relu"])


def test_the_search_offers_no_recompute_of_a_training_mode_batch_norm():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
            self.deep = nn.Sequential(*[m for _ in range(MIN_GAP) for m in (nn.Conv2d(2, 2, 3, padding=1), nn.ReLU())])
            self.squeeze = nn.Conv2d(16, 2, 1)
            self.out = nn.Conv2d(18, 1, 3, padding=1)

        def forward(self, x):
            skip = self.enc(x)
            return self.out(torch.cat([skip, self.deep(self.squeeze(skip))], 1))

    graph = trace(Wide().train(), (1, 1, 64, 64))
    offered = [name for recomputed, _ in variants(graph, TINY) for name in recomputed]
    assert all(graph.nodes[node].op != "batch_norm" for name in offered for node in cone(graph, name)), offered
