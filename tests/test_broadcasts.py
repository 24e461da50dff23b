"""A statistic ``expand``-ed to an image's shape stays small until it meets the image
(``tilec.broadcasts``): the rewritten program computes what the model computes, every node of
EvoNorm-like groups and instances tiles and equals plain PyTorch on odd grids, and timm's EvoNorm
layers (each variant, batch and group statistics) tile and equal it in both modes within the float32
rounding of the statistics they compute in float32; an expanded statistic that
meets no image of its shape is left as exported."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilec.broadcasts import narrow_broadcasts
from tilec.errors import GridError
from tilec.planner import check_segments
from tilec.trace import trace

from support.exactness import check_exact, max_errors
from support.models import Lambda
from support.published import published

SHAPE = (2, 3, 13, 11)


def group_std(y, groups):
    """timm's ``group_std``: each group's standard deviation broadcast to every channel and pixel."""
    n, c, h, w = y.shape
    z = y.reshape(n, groups, c // groups, h, w)
    return z.var(dim=(2, 3, 4), unbiased=False, keepdim=True).add(1e-5).sqrt().expand(z.shape).reshape(n, c, h, w)


def instance_std(y):
    """timm's ``instance_std``: each channel's standard deviation, expanded to the map."""
    return y.var(dim=(2, 3), unbiased=False, keepdim=True).add(1e-5).sqrt().expand(y.shape)


def normalised(statistic):
    """A convolution, its map times its sigmoid divided by ``statistic`` of it, a convolution."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                         Lambda(lambda y: y * torch.sigmoid(y) / statistic(y)), nn.Conv2d(8, 4, 3, padding=1))


MODELS = {
    "group_std": lambda: normalised(lambda y: group_std(y, 2)),
    "instance_std": lambda: normalised(instance_std),
    "one_group": lambda: normalised(lambda y: group_std(y, 1)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_narrowed_program_computes_what_the_model_computes(name):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x = torch.randn(SHAPE, dtype=torch.float64)
    program = torch.export.export(model, (x,), strict=False)
    assert narrow_broadcasts(program)
    image = SHAPE[2:]
    expanded = [n for n in program.graph.nodes if str(n.target) == "aten.expand.default"]
    assert all(tuple(n.meta["val"].shape[-2:]) != image for n in expanded)
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [f(i) for f, i in zip((model, program.module()), inputs, strict=True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-13, atol=1e-14)
    weight = torch.randn_like(outs[0])
    grads = [torch.autograd.grad(out, [i, model[0].weight], weight) for out, i in zip(outs, inputs, strict=True)]
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("grid", [(2, 2), (3, 2), (5, 4)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("name", list(MODELS))
def test_expanded_statistics_tile_exactly(name, grid):
    torch.manual_seed(0)
    model = MODELS[name]()
    assert all(node.tileable for node in trace(model, SHAPE))
    check_exact(model, SHAPE, grid=grid)


def test_an_expanded_statistic_meeting_no_image_of_its_shape_is_left_as_exported():
    """Concatenated beside the image, the expanded statistic is an image the model does not compute
    pixel by pixel from its input: it stays, runs untiled, and the step is still exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Lambda(lambda y: torch.cat([y, instance_std(y)], 1)),
                          nn.Conv2d(8, 2, 3, padding=1))
    program = torch.export.export(model, (torch.randn(SHAPE),), strict=False)
    assert not narrow_broadcasts(program)
    assert "expand" in {n.op for n in trace(model, SHAPE) if not n.tileable}
    check_exact(model, SHAPE, grid=(2, 2))


EVONORMS = ["EvoNorm2dB0", "EvoNorm2dB1", "EvoNorm2dB2", "EvoNorm2dS0", "EvoNorm2dS0a", "EvoNorm2dS1",
            "EvoNorm2dS1a", "EvoNorm2dS2", "EvoNorm2dS2a"]
#: timm's EvoNorm layers compute their statistics in float32 (``x.float()``) whatever the model's
#: dtype, so tiled and plain sum them in other orders in float32: each tensor within this much of its
#: own largest magnitude (an error of the rule would be of the order of 1).
EVONORM_RTOL = 1e-5


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", EVONORMS)
def test_timm_evonorm(name, train):
    """B: batch statistics (a running variance) and each sample's per-channel deviation; S: each
    sample's group deviation (S2: root mean square) and a sigmoid gate. Every node tiles, and the
    step and an eval-mode forward after it equal plain's within float32 rounding."""
    evo = published("timm.layers.evo_norm")
    torch.manual_seed(0)
    norm = getattr(evo, name)(8, **({} if "B" in name else {"groups": 2}))
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm, nn.Conv2d(8, 4, 3, padding=1, stride=2))
    for parameter in norm.parameters():
        parameter.data.uniform_(0.5, 1.5)
    assert all(node.tileable for node in trace(model.train(train), SHAPE))
    errors = max_errors(model.train(train), SHAPE, grid=(3, 2), relative=True, eval_after=train)
    assert max(errors.values()) <= EVONORM_RTOL, errors


def test_no_segment_ends_between_a_buffer_read_and_its_write():
    """EvoNorm-B0 in training mode reads its running variance and writes it back; explicit segments
    ending in between are refused in one line naming both nodes (a segment before the write would
    keep the buffer for its backward), and segments ending elsewhere train exactly, the running
    variance updated once."""
    evo = published("timm.layers.evo_norm")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), evo.EvoNorm2dB0(8), nn.Conv2d(8, 4, 3, padding=1)).train()
    graph = trace(model, SHAPE)
    write = graph.position["copy_"]
    read = min(graph.position[n.name] for n in graph if any(a.value == "1.running_var" for a in n.args))
    assert graph.ties[write] == (graph.order[read], "copy_")
    count = len(graph.order)
    with pytest.raises(GridError, match="reads buffer 1.running_var, and node copy_ .aten.copy_., which writes"):
        check_segments([(0, write, (2, 2)), (write, count, (1, 1))], graph)
    segments = [(0, write + 1, (2, 2)), (write + 1, count, (3, 2))]
    errors = max_errors(model, SHAPE, segments=segments, relative=True)
    assert max(errors.values()) <= EVONORM_RTOL, errors
