"""Max pooling with indices and unpooling to them tile exactly (SegNet's encoder and decoder,
``tilec/ops/unpool.py``): on uneven sizes, odd grids, with padding and ``ceil_mode``, in training
and eval mode; the indices a model returns are PyTorch's, flat over the whole input; overlapping
windows run the unpooling untiled."""

from __future__ import annotations

from math import prod

import pytest
import torch.nn.functional as F
from torch import nn

from tilec.cost.facts import Facts
from tilec.ops import rule
from tilec.pipeline import plan_for
from tilec.regions import Interval
from tilec.target import REFERENCE
from tilec.trace import trace

from support.exactness import check_exact

SHAPE = (2, 3, 23, 19)
GRIDS = [(2, 2), (3, 2), (4, 5), (7, 5)]


def _block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.BatchNorm2d(outputs), nn.ReLU())


class SegNet(nn.Module):
    """Two encoder blocks, each pooled with indices, and two decoder blocks, each unpooling to the
    indices of its encoder block (to the encoder's size, odd ones included); ``indices``: also
    returns the first pooling's indices."""

    def __init__(self, kernel: int = 2, stride: int = 2, padding: int = 0, ceil_mode: bool = False,
                 indices: bool = False):
        super().__init__()
        self.pool = {"kernel_size": kernel, "stride": stride, "padding": padding}
        self.ceil_mode, self.indices = ceil_mode, indices
        self.encode1, self.encode2 = _block(3, 4), _block(4, 6)
        self.decode2, self.decode1 = _block(6, 4), _block(4, 2)

    def forward(self, x):
        a = self.encode1(x)
        pooled_a, indices_a = F.max_pool2d(a, **self.pool, ceil_mode=self.ceil_mode, return_indices=True)
        b = self.encode2(pooled_a)
        pooled_b, indices_b = F.max_pool2d(b, **self.pool, ceil_mode=self.ceil_mode, return_indices=True)
        up_b = F.max_unpool2d(pooled_b, indices_b, **self.pool, output_size=b.shape[2:])
        up_a = F.max_unpool2d(self.decode2(up_b), indices_a, **self.pool, output_size=a.shape[2:])
        out = self.decode1(up_a)
        return (out, indices_a) if self.indices else out


POOLINGS = {"2x2": {}, "3x3_padded": {"kernel": 3, "stride": 3, "padding": 1}, "ceil": {"ceil_mode": True},
            "2x3": {"kernel": 2, "stride": 3}}


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("pooling", list(POOLINGS))
def test_segnet_tiles_exactly(pooling, train, grid):
    model = SegNet(**POOLINGS[pooling]).train(train)
    graph = trace(model, SHAPE)
    assert all(node.tileable for node in graph)
    segments = plan_for(graph, REFERENCE, "m", grid=grid).segments
    assert all(s.mode == "tiled" and s.batch == 1 for s in segments)
    check_exact(SegNet(**POOLINGS[pooling]).train(train), SHAPE, grid=grid, traced_as=f"segnet {pooling}")


@pytest.mark.parametrize("grid", [(3, 2), (5, 4)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_the_indices_a_model_returns_are_pytorchs(grid):
    """Each tile's indices, local to its padded slice, become the whole input's."""
    errors = check_exact(SegNet(kernel=3, stride=3, padding=1, indices=True).eval(), SHAPE, grid=grid)
    assert errors["output[1]"] == 0


@pytest.mark.parametrize("segments", [[(0, 12, (3, 2)), (12, 20, (2, 3))], [(0, 6, (1, 1)), (6, 20, (4, 3))],
                                      [(0, 13, (3, 3)), (13, 20, (1, 1))]], ids=["tiled_tiled", "stored_tiled",
                                                                                 "tiled_stored"])
def test_indices_cross_segments(segments):
    """Indices made in one segment and unpooled in another, tiled or stored (the training-mode graph's
    nodes: the poolings at 3 and 9, the unpoolings at 12 and 16, of 20)."""
    check_exact(SegNet().train(), SHAPE, segments=segments)


def test_overlapping_windows_unpool_untiled_and_exact():
    """With windows that overlap, two values may go to one place: the unpooling runs untiled."""
    model = SegNet(kernel=3, stride=2, padding=1)
    untiled = [(node.op, rule(node).check(node, graph)) for graph in [trace(model, SHAPE)] for node in graph
               if not node.tileable]
    assert untiled == [("max_unpool2d", "its pooling's windows overlap or are dilated: two values may go to one "
                                        "place")] * 2
    check_exact(model, SHAPE, grid=(3, 2))


def test_segments_that_unpool_neither_stack_nor_reuse_tiles():
    """Their tiles read their positions: a batch asked for is left at 1, and reuse is off."""
    graph = trace(SegNet().eval(), (1, 3, 64, 64))
    plan = plan_for(graph, REFERENCE, "m", grid=(4, 4), batch=4)
    assert [s.batch for s in plan.segments] == [1]
    check_exact(SegNet().eval(), (1, 3, 64, 64), grid=(4, 4), batch=4)


@pytest.mark.parametrize(("out", "pooled"), [((0, 4), (0, 2)), ((3, 5), (1, 3)), ((5, 6), (2, 3)), ((0, 0), (0, 0))])
def test_the_unpool_rule_reads_the_windows_that_overlap(out, pooled):
    """Kernel 2, stride 2: outputs [a, b) read pooled [a // 2, ceil(b / 2))."""
    graph = trace(SegNet().eval(), SHAPE)
    node = next(node for node in graph if node.op == "max_unpool2d")
    needs = rule(node).need(node, 0, Interval(*out), graph)
    assert [(n.interval.start, n.interval.stop) for n in needs] == [pooled, pooled]


def test_the_memory_estimate_counts_the_indices_beside_the_values():
    """A pooling's result is its float32 values and its int64 indices, which live until the unpooling."""
    graph = trace(SegNet().eval(), SHAPE)
    pooling = next(node for node in graph if node.op == "max_pool2d_with_indices")
    assert Facts(graph, REFERENCE, "float32").full[pooling.name] == prod(pooling.shape) * (4 + 8)
