"""The generated module's tile convolution ``_conv2d``: its weight gradient by matrix products
(``_weight_grad``, from ``GEMM_MIN_CHANNELS`` input channels, with its scratch in the tile's
arena) equals PyTorch's, and the tiles and the cost model agree on which convolutions take that
path."""

from __future__ import annotations

import pytest
import torch
from exactness import generated
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from zoo import SHAPES, ZOO

from tilec.codegen import render
from tilec.cost import GEMM_MIN_CHANNELS, Estimator
from tilec.pipeline import load_source
from tilec.planner import Boundaries, plan
from tilec.trace import trace

GENERATED = generated()


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), channels=st.integers(GEMM_MIN_CHANNELS, GEMM_MIN_CHANNELS + 9),
       out=st.integers(1, 12), kernel=st.tuples(st.integers(1, 5), st.integers(2, 5)),
       dilation=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       padding=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       size=st.tuples(st.integers(1, 9), st.integers(1, 9)), bias=st.booleans())
def test_gemm_gradients_equal_pytorch(batch, channels, out, kernel, dilation, padding, size, bias):
    """Input, weight and bias gradients of ``_conv2d`` on the GEMM path equal ``torch.conv2d``'s
    (output ``size``, so the input is ``size + dilation * (kernel - 1) - 2 * padding``)."""
    height, width = (s + d * (k - 1) - 2 * p for s, d, k, p in zip(size, dilation, kernel, padding, strict=True))
    assume(height >= 1 and width >= 1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, height, width, dtype=torch.float64, generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(out, channels, *kernel, dtype=torch.float64, generator=generator)
    b = torch.randn(out, dtype=torch.float64, generator=generator) if bias else None
    g = torch.randn(batch, out, *size, dtype=torch.float64, generator=generator)
    assert GENERATED["_gemm_weight_grad"](x, w, (1, 1), 1)
    arena = GENERATED["_Arena"](x.device, 1 << 20)
    grads = []
    for conv in (lambda *args: GENERATED["_conv2d"](*args, arena), torch.nn.functional.conv2d):
        leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
        y = conv(leaves[0], leaves[1], leaves[2] if bias else None, (1, 1), padding, dilation, 1)
        y.backward(g)
        grads.append([leaf.grad for leaf in leaves])
    assert arena.top == 0 and arena.need > 0  # the scratch was given back
    for ours, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


def test_gemm_path_needs_channels_last_cpu_float_stride_one():
    x = torch.randn(1, GEMM_MIN_CHANNELS, 6, 6).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, GEMM_MIN_CHANNELS, 3, 3)
    eligible = GENERATED["_gemm_weight_grad"]
    assert eligible(x, w, (1, 1), 1)
    assert not eligible(x.contiguous(), w, (1, 1), 1)
    assert not eligible(x.bfloat16(), w.bfloat16(), (1, 1), 1)
    assert not eligible(x, w, (2, 1), 1)
    assert not eligible(x, w[:, :, :1, :1], (1, 1), 1)
    assert not eligible(x[:, :GEMM_MIN_CHANNELS - 1], w[:, :GEMM_MIN_CHANNELS - 1], (1, 1), 1)


@pytest.mark.parametrize(("min_channels", "count"), [(GEMM_MIN_CHANNELS, 3), (None, 0)])
def test_tiles_and_cost_model_agree_on_the_gemm_path(min_channels, count):
    """Every convolution the cost model counts as GEMM gets its weight gradient from
    ``_weight_grad`` in the tiles' backward, and no other; with the plan's ``gemm_min_channels``
    (``None``: the weight gradients are all the library's, as raced on some CPUs)."""
    model, shape = ZOO["wide_convs"]().double(), SHAPES["wide_convs"]
    graph = trace(model, shape)
    graph.graph["gemm_min_channels"] = min_channels
    bounds = Boundaries(graph)
    estimator = Estimator(bounds, "float64")
    shapes = bounds.context.tensor_shapes
    expected = {shapes[bounds.context.nodes[name].args[1].value]
                for name, gemm in zip(bounds.order, estimator.gemm, strict=True) if gemm}
    assert len(expected) == count
    the_plan = plan(graph, name="wide", grid=(3, 2), dtype="float64")
    assert the_plan.gemm_min_channels == min_channels
    module = load_source(render(the_plan)).__dict__
    tiled = module["TiledModel"](model)
    weight_grad, seen = module["_weight_grad"], []

    def counted(g, x, kernel, dilation, arena):
        seen.append((g.shape[1], x.shape[1], *kernel))
        return weight_grad(g, x, kernel, dilation, arena)

    module["_weight_grad"] = counted
    tiled(torch.randn(shape, dtype=torch.float64)).sum().backward()
    assert set(seen) == {tuple(s) for s in expected}
    assert len(seen) == count * 6  # in every tile of the 3x2 grid
