"""The generated module's tile arena (``_Arena``): where it carves tensors, that it gives scratch
back, and that the kernels writing into it (``_convolve``/``_conv2d``, ``_max_pool``, ``_pad``)
compute what PyTorch's do; a tiled step through an arena equals the first step, which learns the
arena's size with fresh tensors, bit for bit."""

from __future__ import annotations

import pytest
import torch
from exactness import generated
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from tilec.pipeline import build

GENERATED = generated()
Arena = GENERATED["_Arena"]
CPU = torch.device("cpu")


def _inside(tensor: torch.Tensor, arena) -> bool:
    start = arena.buffer.data_ptr()
    return start <= tensor.data_ptr() < start + arena.buffer.numel()


def test_take_carves_aligned_non_view_tensors_one_after_the_other():
    arena = Arena(CPU, 1 << 16)
    a = arena.take((1, 3, 5, 7), torch.float32, CPU)
    b = arena.take((2, 4, 3, 3), torch.float64, CPU, torch.channels_last)
    assert _inside(a, arena) and _inside(b, arena) and a._base is None and b._base is None
    assert a.is_contiguous() and b.is_contiguous(memory_format=torch.channels_last)
    assert a.data_ptr() % (2 << 20) == 0  # the arena starts on a huge page
    assert b.data_ptr() % 64 == 0 and b.data_ptr() >= a.data_ptr() + a.numel() * 4
    assert arena.top == b.data_ptr() - a.data_ptr() + b.numel() * 8 == arena.need
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.eq(1.0).all() and b.eq(2.0).all()  # disjoint
    arena.reset()
    assert arena.top == 0 and arena.need > 0
    assert arena.take((1, 3, 5, 7), torch.float32, CPU).data_ptr() == a.data_ptr()


def test_past_its_capacity_or_without_one_the_arena_hands_out_fresh_tensors_and_learns_its_need():
    arena = Arena(CPU, 256)
    inside = arena.take((8, 8), torch.float32, CPU)
    beyond = arena.take((8, 8), torch.float32, CPU)
    assert _inside(inside, arena) and not _inside(beyond, arena)
    assert arena.need == 64 * 4 + 64 * 4
    empty = Arena(CPU)
    assert empty.buffer is None
    t = empty.take((2, 3, 4, 5), torch.float32, CPU, torch.channels_last)
    assert t.is_contiguous(memory_format=torch.channels_last) and empty.need == 2 * 3 * 4 * 5 * 4
    meta = Arena(torch.device("meta"), 1 << 10)  # caching allocators reuse blocks themselves
    assert meta.buffer is None and meta.take((4,), torch.float32, torch.device("meta")).is_meta


def test_a_channels_last_weight_copy_is_scratch():
    arena = Arena(CPU, 1 << 16)
    w = torch.randn(8, 4, 3, 3)
    copy = arena.channels_last(w)
    assert _inside(copy, arena) and copy.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(copy, w)
    already = w.contiguous(memory_format=torch.channels_last)
    assert arena.channels_last(already) is already


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 2), groups=st.sampled_from([1, 2, 4]), per_group=st.integers(1, 3),
       out_per_group=st.integers(1, 3), kernel=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       padding=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       size=st.tuples(st.integers(1, 12), st.integers(1, 12)), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]), pack=st.booleans())
@example(batch=2, groups=1, per_group=2, out_per_group=2, kernel=(1, 1), stride=(2, 3), dilation=(1, 2),
         padding=(2, 2), size=(6, 1), bias=True, dtype=torch.float32, pack=False)  # crashed oneDNN
@example(batch=2, groups=1, per_group=2, out_per_group=1, kernel=(1, 1), stride=(1, 1), dilation=(1, 2),
         padding=(1, 1), size=(7, 10), bias=True, dtype=torch.float32, pack=False)  # a bias gradient summing to ~0
def test_tile_convolution_equals_pytorch(batch, groups, per_group, out_per_group, kernel, stride, dilation,
                                         padding, size, bias, dtype, pack):
    """``_conv2d`` (oneDNN into the arena for channels-last float32, with the weight packed where
    the arena packs, aten otherwise): output, input, weight and bias gradients against
    ``F.conv2d`` of the NCHW input (torch's channels-last conv2d crashes on the example below);
    the arena's scratch is given back."""
    assume(all(s + 2 * p >= d * (k - 1) + 1 for s, p, d, k in zip(size, padding, dilation, kernel, strict=True)))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, groups * per_group, *size, dtype=dtype, generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(groups * out_per_group, per_group, *kernel, dtype=dtype, generator=generator)
    b = torch.randn(groups * out_per_group, dtype=dtype, generator=generator) if bias else None
    arena = Arena(CPU, 1 << 20, pack=pack)
    results = []
    for conv in (lambda *args: GENERATED["_conv2d"](*args, arena), lambda x, *args: F.conv2d(x.contiguous(), *args)):
        leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
        y = conv(leaves[0], leaves[1], leaves[2] if bias else None, stride, padding, dilation, groups)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y))
        results.append([y.detach(), *(leaf.grad for leaf in leaves)])
    assert arena.top == (results[0][0].numel() * x.element_size() if GENERATED["_onednn"](x, w) else 0)
    # float32 gradients sum up to a few hundred terms of size ~1 in another order than aten's (about
    # 1e-5 apart where the sum cancels to ~0); float64 ones must agree
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0, "atol": 1e-10}
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, **tolerance)


@settings(max_examples=30, deadline=None)
@given(kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       padding=st.tuples(st.integers(0, 1), st.integers(0, 1)), size=st.tuples(st.integers(3, 9), st.integers(3, 9)),
       pads=st.tuples(*(st.integers(0, 2) for _ in range(4))), channels_last=st.booleans())
def test_tile_max_pooling_and_padding_equal_pytorch(kernel, stride, padding, size, pads, channels_last):
    """``_pad`` then ``_max_pool`` in the arena against ``F.pad`` then ``F.max_pool2d``, both ways
    (float64, distinct values: no ties)."""
    assume(all(2 * p <= k for p, k in zip(padding, kernel, strict=True)))
    x = torch.randperm(2 * 3 * size[0] * size[1], generator=torch.Generator().manual_seed(1))
    x = x.double().view(2, 3, *size)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    arena = Arena(CPU, 1 << 20)
    results = []
    for pad, pool in ((lambda t: GENERATED["_pad"](arena, t, pads, -1e9),
                       lambda t: GENERATED["_max_pool"](arena, t, kernel, stride, padding, (1, 1))),
                      (lambda t: F.pad(t, pads, value=-1e9), lambda t: F.max_pool2d(t, kernel, stride, padding))):
        leaf = x.detach().requires_grad_()
        y = pool(pad(leaf))
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        results.append((y.detach(), leaf.grad))
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)


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
    segments = [v for v in generated(tiled).values() if type(v).__name__ == "_Segment"]
    assert segments and all(s._capacity and min(s._capacity.values()) > 0 for s in segments)
    plain = _step(model, model, x)
    for a, b, c, want in zip(first, second, third, plain, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
        torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-4)
