"""Rolled input gradients: a tiled segment's backward writes the gradient of an input that nothing
reads afterwards over the input itself, row of tiles by row of tiles, holding one band of rows
(``tilec.runtime.tiles.Rolled``, unit-tested in ``test_runtime.py``); which inputs roll
(``Estimator.rollable``, ``Estimator.made_tiled``), and what the cost model counts for them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilec.cost.estimator import Estimator
from tilec.pipeline import build
from tilec.planner import plan
from tilec.target import Target
from tilec.trace import trace

from support.exactness import check_exact


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Conv2d(6, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU())


SHAPE = (2, 3, 27, 23)


def test_which_inputs_roll():
    """Inputs produced by a tiled segment roll in their first reader; not those of a stored
    segment, whose autograd may have saved them (ReLU keeps its result)."""
    graph = trace(chain(), SHAPE)
    planned = plan(graph, name="m", segments=[(0, 2, (3, 2)), (2, 5, (2, 3)), (5, 7, (1, 1), "stored"),
                                              (7, 9, (3, 3))])
    assert [s.rolled for s in planned.segments] == [(), ("relu",), (), ()]


def test_only_the_first_reader_rolls_and_never_an_output():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Conv2d(4, 4, 3, padding=1) for _ in range(3))

        def forward(self, x):
            y = self.a(x).relu()
            z = self.b(y).relu()
            return self.c(z) + y, z

    graph = trace(Skip(), (1, 4, 19, 17))
    order = graph.order
    cuts = [graph.position[name] for name in ("conv2d_1", "conv2d_2")]
    planned = plan(graph, name="m", segments=[(0, cuts[0], (2, 2)), (cuts[0], cuts[1], (3, 2)),
                                              (cuts[1], len(order), (2, 3))])
    # y (relu) is read by b (segment 1) and by the add (segment 2): segment 1 rolls it; z is an output
    assert [s.rolled for s in planned.segments] == [(), ("relu",), ()]
    check_exact(Skip(), (1, 4, 19, 17), segments=[(0, cuts[0], (2, 2)), (cuts[0], cuts[1], (3, 2)),
                                                  (cuts[1], len(order), (2, 3))])


@pytest.mark.parametrize("segments", [[(0, 2, (3, 2)), (2, 5, (2, 3)), (5, 9, (4, 3))],
                                      [(0, 4, (5, 4)), (4, 6, (1, 1)), (6, 9, (2, 2))],
                                      [(0, 1, (2, 2)), (1, 3, (7, 5)), (3, 8, (3, 3)), (8, 9, (2, 4))]])
def test_rolled_plans_are_exact(segments):
    check_exact(chain(), SHAPE, segments=segments)


def test_the_input_itself_holds_the_gradient_afterwards():
    """A second backward through the graph finds the rolled input changed and says so."""
    model = chain().double()
    tiled = build(model, SHAPE, segments=[(0, 2, (3, 2)), (2, 9, (2, 3))], dtype="float64")
    out = tiled(torch.randn(SHAPE, dtype=torch.float64))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        out.sum().backward()


def test_the_cost_model_counts_a_band_for_a_rolled_gradient():
    """Rolling takes off the gradient's full size less its band: the tallest read of a row of
    tiles, across the full width."""
    graph = trace(chain(), (1, 3, 96, 64))
    estimator = Estimator(graph, Target(), "float32")
    planned = plan(graph, name="m", segments=[(0, 2, (2, 2)), (2, 9, (6, 2))])
    second = planned.segments[1]
    cost = estimator.segment(second.first, second.stop, second.rows, second.cols, False)
    (name, saved), = cost.rolls
    assert name == "relu" and second.rolled == ("relu",)
    band = max(tile.inputs[0].stop - tile.inputs[0].start for tile in second.rows)
    full = 6 * 96 * 64 * 4
    assert saved == full - full * band // 96 and band < 96 // 2
    rolled = estimator.local(cost, frozenset({"relu"}))
    assert rolled == max(cost.forward_local, cost.backward_local - saved) < estimator.local(cost)


def test_no_gradient_rolls_where_ranks_share_the_tiles():
    """A rank runs its share of the tiles, not every row in order: plans for ranks roll nothing."""
    graph = trace(chain(), SHAPE)
    segments = [(0, 2, (3, 2)), (2, 9, (2, 3))]
    assert plan(graph, name="m", segments=segments).segments[1].rolled == ("relu",)
    assert plan(graph, Target(shared_tiles=True), name="m", segments=segments).segments[1].rolled == ()
