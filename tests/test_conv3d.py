"""A ``conv3d`` whose kernel spans one element of a dim becomes a grouped ``conv2d`` (``tilec.conv3d``),
which tiles: the rewritten program computes what the model computes (random shapes, strides,
padding, dilation, groups, with and without bias, float64), one with no such dim is left as exported
and runs untiled, and timm's ``LambdaLayer`` (position lambdas by a (r, r, 1) ``Conv3d``, queries
times them per pixel, content lambdas by sweeps) tiles every node and equals plain PyTorch in both
modes on odd sizes and grids."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tilec.conv3d import fold_conv3d
from tilec.pipeline import plan_for
from tilec.search import choose, smallest_budget
from tilec.trace import trace
from tilec.validate import validate

from support.exactness import check_exact
from support.models import Lambda
from support.published import published
from support.zoo import TINY


class Volume(nn.Module):
    """A convolution, its map viewed as a volume (N, C', H, W, D) or (N, C', D, H, W) with the
    channels split into ``depth``, a ``Conv3d``, viewed back as an image."""

    def __init__(self, conv: nn.Conv3d, depth: int, depth_last: bool):
        super().__init__()
        self.stem, self.conv = nn.Conv2d(3, 2 * depth, 3, padding=1), conv
        self.depth, self.depth_last = depth, depth_last

    def forward(self, x):
        y = self.stem(x)
        n, _, h, w = y.shape
        if self.depth_last:
            v = self.conv(y.reshape(n, 2, self.depth, h, w).permute(0, 1, 3, 4, 2))
            return v.permute(0, 1, 4, 2, 3).reshape(n, -1, *v.shape[2:4])
        v = self.conv(y.reshape(n, 2, self.depth, h, w))
        return v.reshape(n, -1, *v.shape[3:])


@st.composite
def volumes(draw):
    groups = draw(st.sampled_from([1, 2]))
    kernel, stride, padding, dilation = [], [], [], []
    flat = draw(st.integers(0, 2))
    for axis in range(3):
        if axis == flat:
            kernel.append(1), stride.append(1), padding.append(0), dilation.append(draw(st.integers(1, 2)))
        else:
            kernel.append(draw(st.integers(1, 3))), stride.append(draw(st.integers(1, 2)))
            padding.append(draw(st.integers(0, 2))), dilation.append(draw(st.integers(1, 2)))
    conv = nn.Conv3d(2, 2 * draw(st.integers(1, 2)), kernel, stride, padding, dilation, groups,
                     bias=draw(st.booleans()))
    return Volume(conv, draw(st.integers(1, 3)), depth_last=flat == 2)


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(volumes(), st.integers(7, 12), st.integers(7, 12))
def test_the_folded_program_computes_what_the_model_computes(model, height, width):
    model = model.double()
    x = torch.randn(2, 3, height, width, dtype=torch.float64)
    program = torch.export.export(model, (x,), strict=False)
    assert fold_conv3d(program)
    assert "aten.conv3d.default" not in [str(n.target) for n in program.graph.nodes]
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [f(i) for f, i in zip((model, program.module()), inputs, strict=True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-13, atol=1e-14)
    weight = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(out, [i, model.conv.weight], weight) for out, i in zip(outs, inputs, strict=True)]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-13)


def test_a_conv3d_over_three_dims_is_left_as_exported_and_runs_untiled():
    torch.manual_seed(0)
    model = Volume(nn.Conv3d(2, 2, 3, padding=1), 3, depth_last=True)
    program = torch.export.export(model, (torch.randn(1, 3, 9, 8),), strict=False)
    assert not fold_conv3d(program)
    assert [n.op for n in trace(model, (1, 3, 9, 8)) if not n.tileable][0] == "conv3d"
    check_exact(model, (1, 3, 9, 8), grid=(2, 2))


@pytest.mark.parametrize("grid", [(2, 2), (3, 2), (5, 4)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("depth_last", [True, False], ids=["depth_last", "depth_first"])
def test_folded_conv3d_tiles_exactly(depth_last, grid):
    torch.manual_seed(0)
    kernel, padding = ((3, 3, 1), (1, 1, 0)) if depth_last else ((1, 3, 3), (0, 1, 1))
    model = Volume(nn.Conv3d(2, 4, kernel, padding=padding), 3, depth_last)
    assert all(node.tileable for node in trace(model, (2, 3, 15, 13)))
    check_exact(model, (2, 3, 15, 13), grid=grid)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("grid", [(2, 2), (3, 2), (5, 4)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("stride", [1, 2])
def test_timm_lambda_layer(stride, grid, train):
    """Content lambdas: a softmax of the keys over the pixels and their product with the values (a
    sweep); position lambdas: the values convolved 5x5 per value channel, times the queries pixel by
    pixel; BatchNorm on queries and values; average pooling where the layer strides."""
    layer = published("timm.layers.lambda_layer").LambdaLayer(16, num_heads=2, dim_head=4, r=5, stride=stride)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), layer)
    assert all(node.tileable for node in trace(model, (2, 3, 15, 13)))
    check_exact(model.train(train), (2, 3, 15, 13), grid=grid, eval_after=train)


def test_budget_plans_of_a_lambda_layer_train_exactly():
    """The search weighs stacking the tiles of a one-sample image in each segment it tries, the
    folded weight (a parameter squeezed) among their nodes; its plans at twice the smallest budget
    validate, and two samples' trains exactly (one sample's is checked against the formula in
    ``test_unflatten.py``: plain PyTorch's own gradient is wrong there)."""
    layer = published("timm.layers.lambda_layer").LambdaLayer(16, num_heads=2, dim_head=4, r=5)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), layer).train()
    for batch in (1, 2):
        graph = trace(model, (batch, 3, 40, 36))
        chosen = choose(graph, TINY, 2 * smallest_budget(graph, TINY))
        validate(plan_for(chosen.graph, TINY, "lambda", segments=chosen.segments), "lambda")
    check_exact(model, (2, 3, 40, 36), segments=chosen.segments, recomputed=chosen.recomputed)


def test_a_matmul_of_two_images_over_their_image_axes_runs_untiled():
    """Attention between pixels written as a matmul of two images: no rule, it runs untiled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1),
                          Lambda(lambda y: y + torch.tanh(y @ y.transpose(2, 3) @ y * 0.01)))
    graph = trace(model, (1, 3, 6, 6))
    assert {n.op for n in graph if not n.tileable} >= {"matmul"}
    check_exact(model, (1, 3, 6, 6), grid=(2, 2))
