"""The runtime inside generated modules: a tiled step through the arenas equals the first step
(which learns their sizes with fresh tensors) bit for bit; tiles and the cost model agree on which
convolutions take the matrix-product weight gradient; ``kernels="generic"`` runs aten's kernels on
fresh tensors only (the CUDA path, forced on the CPU). Unit tests of the runtime itself, without a
module: ``test_runtime.py``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tilec.codegen import load_source, render
from tilec.cost.estimator import Estimator
from tilec.pipeline import build
from tilec.planner import plan
from tilec.runtime.device import CONVOLVE_INTO
from tilec.target import GEMM_MIN_CHANNELS, Target
from tilec.trace import trace

from support.exactness import tiled_segments
from support.generated import Recorded, counting
from support.zoo import SHAPES, ZOO

ROOT = Path(__file__).resolve().parents[1]


def _vgg_like() -> nn.Module:
    """Float32 layers of every arena path: padded, strided, dilated, grouped and 1x1
    convolutions, with and without bias, max pooling."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(16, 16, 3, padding=2, dilation=2),
        nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 16, 3, padding=1, groups=4, bias=False), nn.ReLU(),
        nn.Conv2d(16, 24, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Conv2d(24, 8, 1))


def _step(forward, model, x):
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = forward(x)
    y.square().sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("grid", [(3, 2), (4, 5)])
def test_float32_tiled_steps_through_the_arena_match_untiled_and_the_first_step(grid):
    """The first step learns each segment's arena size with fresh tensors; the next steps carve
    them from the arena and compute the same numbers bit for bit. Both match untiled float32 to
    float32 rounding (oneDNN's convolution rounds as channels-last PyTorch does)."""
    torch.manual_seed(0)
    model = _vgg_like()
    shape = (2, 3, 45, 38)
    tiled = build(model, shape, grid)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    first, second, third = (_step(tiled, model, x) for _ in range(3))
    segments = tiled_segments(tiled)
    assert segments and all(s._capacity and min(s._capacity.values()) > 0 for s in segments)
    plain = _step(model, model, x)
    for a, b, c, want in zip(first, second, third, plain, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
        torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("min_channels", "count"), [(GEMM_MIN_CHANNELS, 3), (None, 0)])
def test_tiles_and_cost_model_agree_on_the_gemm_path(min_channels, count):
    """Every convolution the cost model counts as GEMM gets its weight gradient from
    ``weight_grad`` in the tiles' backward, and no other; with the plan's ``gemm_min_channels``
    (``None``: the weight gradients are all the library's, as raced on some CPUs)."""
    model, shape = ZOO["wide_convs"]().double(), SHAPES["wide_convs"]
    graph = trace(model, shape)
    target = Target(gemm_min_channels=min_channels)
    estimator = Estimator(graph, target, "float64")
    expected = {graph.tensor_shapes[graph.nodes[name].args[1].value]
                for name, facts in zip(graph.order, estimator.facts.nodes, strict=True) if facts.gemm}
    assert len(expected) == count
    the_plan = plan(graph, target, name="wide", grid=(3, 2), dtype="float64")
    assert the_plan.gemm_min_channels == min_channels
    module = load_source(render(the_plan)).__dict__
    tiled = module["TiledModel"](model)
    seen = []
    counting(module, "weight_grad", seen)
    tiled(torch.randn(shape, dtype=torch.float64)).sum().backward()
    assert {(g.shape[1], x.shape[1], *kernel) for g, x, kernel, _, _ in seen} == {tuple(s) for s in expected}
    assert len(seen) == count * 6  # in every tile of the 3x2 grid


@pytest.mark.skipif(CONVOLVE_INTO is None, reason="this torch has no oneDNN convolution-into")
def test_generic_kernels_run_aten_on_fresh_tensors():
    """``TiledModel(model, kernels="generic")`` on the CPU: no arena buffer, no oneDNN convolution,
    no matrix-product weight gradient, no allocator pin; the same results as the CPU's kernels
    to float32 rounding. The default kernels use all of them."""
    model, shape = ZOO["wide_convs"](), SHAPES["wide_convs"]
    graph = trace(model, shape)
    module = load_source(render(plan(graph, Target(), name="wide", grid=(3, 2)))).__dict__
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    results = {}
    for kernels in ("generic", "auto"):
        with Recorded(module) as recorded:
            for _ in range(2):  # the second step finds the arenas' sizes
                results[kernels] = _step(module["TiledModel"](model, kernels=kernels), model, x)
        used = recorded.used()
        assert recorded.arenas and used == dict.fromkeys(used, kernels == "auto"), (kernels, used)
    for generic, auto in zip(results["generic"], results["auto"], strict=True):
        torch.testing.assert_close(generic, auto, rtol=1e-4, atol=1e-4)


def test_an_unknown_kernels_choice_is_refused():
    tiled_class = type(build(nn.Sequential(nn.Conv2d(1, 1, 3)), (1, 1, 8, 8), grid=(2, 2)))
    choices = r"\('auto', 'generic', 'compiled', 'cudagraphs', 'reduce-overhead'\)"
    with pytest.raises(ValueError, match=rf"kernels must be one of {choices}, got 'cuda'"):
        tiled_class(nn.Sequential(nn.Conv2d(1, 1, 3)), kernels="cuda")


CRASH = textwrap.dedent("""
    import torch
    from torch.nn import functional as F
    from tilec.runtime.arena import Arena
    from tilec.runtime.device import GENERIC
    from tilec.runtime.kernels import conv2d
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 6, 1, generator=generator).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(2, 2, 1, 1, generator=generator), torch.randn(2, generator=generator)
    y = conv2d(x, w, b, (2, 3), (2, 2), (1, 2), 1, Arena(x.device, GENERIC))
    torch.testing.assert_close(y, F.conv2d(x.contiguous(), w, b, (2, 3), (2, 2), (1, 2)))
""")


def test_generic_convolution_survives_a_dilated_one_tap_axis():
    """A tile convolution on the generic kernels equals the NCHW one, where aten's channels-last
    float32 convolution with a bias crashes (SIGSEGV) on a one-tap axis dilated (1x1, dilation
    (1, 2), stride (2, 3), padding 2, a 6x1 input): ``convolve`` dilates one-tap axes by 1. In a
    subprocess, so that a crash fails the test instead of the suite."""
    done = subprocess.run([sys.executable, "-c", CRASH], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit code {done.returncode}: {done.stderr[-1000:]}"
