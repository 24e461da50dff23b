"""Property tests: random valid layer stacks, shapes and grids tile exactly."""

from __future__ import annotations

import pytest
import torch
from exactness import assert_exact
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from stacks import stacks

from tilec.errors import GridError, ShapeError
from tilec.pipeline import build
from tilec.planner import plan
from tilec.trace import trace

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _draw_case(data):
    """A random stack, an input shape it accepts, and its output shape."""
    model, channels = data.draw(stacks(), label="model")
    shape = (data.draw(st.integers(1, 2), label="batch"), channels,
             data.draw(st.integers(5, 33), label="height"), data.draw(st.integers(5, 33), label="width"))
    try:
        graph = trace(model, shape)
    except ShapeError:
        assume(False)  # the input is too small for this stack: an empty output
    out_shape = graph.nodes[graph.graph["output"]]["spec"].out_shape
    return model, shape, graph, out_shape


def _finite_reference(model, shape) -> bool:
    """A max-pool window of only (dilated) padding gives -inf in PyTorch itself; skip those stacks."""
    with torch.no_grad():
        return bool(torch.isfinite(model.double()(torch.randn(shape, dtype=torch.float64))).all())


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@PROPERTY
@given(st.data())
def test_random_stacks_tile_exactly(data):
    model, shape, _, out_shape = _draw_case(data)
    assume(_finite_reference(model, shape))
    grid = (data.draw(st.integers(1, out_shape[2]), label="grid rows"),
            data.draw(st.integers(1, out_shape[3]), label="grid cols"))
    assert_exact(model, shape, grid, seed=data.draw(st.integers(0, 2**16), label="seed"))


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_stacks_with_random_segments(data):
    model, shape, graph, _ = _draw_case(data)
    assume(_finite_reference(model, shape))
    count = graph.number_of_nodes() - 1
    cuts = sorted(data.draw(st.sets(st.integers(1, count - 1), max_size=3), label="cuts")) if count > 1 else []
    bounds = [0, *cuts, count]
    segments = []
    for first, stop in zip(bounds[:-1], bounds[1:], strict=True):
        out = graph.nodes[stop - 1]["spec"].out_shape
        grid = (data.draw(st.integers(1, out[2])), data.draw(st.integers(1, out[3])))
        segments.append((first, stop, grid))
    assert_exact(model, shape, segments=segments)


@PROPERTY
@given(st.data())
def test_grid_finer_than_output_is_refused(data):
    model, shape, graph, out_shape = _draw_case(data)
    rows = data.draw(st.integers(1, out_shape[2] + 3), label="grid rows")
    cols = data.draw(st.integers(1, out_shape[3] + 3), label="grid cols")
    if rows <= out_shape[2] and cols <= out_shape[3]:
        rows = out_shape[2] + data.draw(st.integers(1, 3), label="rows beyond")
    with pytest.raises(GridError, match=rf"grid {rows}x{cols} is finer than the output .*"
                                        rf"\({out_shape[2]}x{out_shape[3]}\)"):
        plan(graph, name="m", grid=(rows, cols))
    with pytest.raises(GridError):
        build(model, shape, (rows, cols))


@pytest.mark.parametrize("grid", [(0, 1), (1, 0), (-1, 2), (2,), (1, 2, 3), (1.5, 2)])
def test_malformed_grids_are_refused(grid):
    graph = trace(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 3)), (1, 1, 9, 9))
    with pytest.raises(GridError, match="grid must be two positive integers"):
        plan(graph, name="m", grid=grid)


@PROPERTY
@given(st.data())
def test_planned_regions_are_consistent(data):
    """Owned tiles partition the output; every step reads inside its input; the chain links up."""
    _, _, graph, out_shape = _draw_case(data)
    grid = (data.draw(st.integers(1, out_shape[2])), data.draw(st.integers(1, out_shape[3])))
    the_plan = plan(graph, name="m", grid=grid)
    (segment,) = the_plan.segments
    layers = the_plan.model.layers
    for axis, tiles in ((0, segment.rows), (1, segment.cols)):
        size = out_shape[2 + axis]
        assert tiles[0].owned.start == 0 and tiles[-1].owned.stop == size
        assert all(a.owned.stop == b.owned.start for a, b in zip(tiles[:-1], tiles[1:], strict=True))
        signatures = {}
        for tile in tiles:
            assert tile.steps[-1].out == tile.owned
            for position, (layer, step) in enumerate(zip(layers, tile.steps, strict=True)):
                in_size = layer.in_shape[2 + axis]
                assert 0 <= step.read.start <= step.read.stop <= in_size
                assert step.grad_out == step.out and step.grad_in == step.read
                if position:
                    assert tile.steps[position - 1].out == step.read
                window = layer.rows if axis == 0 else layer.cols
                if step.out.length:
                    assert window.input_interval(step.out).clip(in_size) == (step.read, *step.pad)
                else:
                    assert step.read.length == 0 and step.pad == (0, 0)
            key = tuple((s.out.length, s.read.length, s.pad) for s in tile.steps)
            assert signatures.setdefault(key, tile.shape_class) == tile.shape_class
        assert len(set(signatures.values())) == len(signatures)
