"""Unit tests of the generated modules' runtime (``tilec/runtime/``), imported directly and run
against aten's own kernels, without rendering a module.

The arena (``Arena``: where it carves tensors, that it gives scratch back, that past its capacity
or on the generic kernels it hands out fresh tensors), the tile kernels (``conv2d`` on oneDNN into
the arena or on aten, its matrix-product weight gradient ``weight_grad``, ``max_pool``,
``pad_border``, ``gather`` / ``lerp``, activations ``in_place``), input gradients rolled over the
input (``Rolled``) against whole ones (``Whole``), tile shares among ranks (``share``), the
kernels table (``kernels_for``, ``uses_onednn``, ``uses_gemm_weight_grad``), and one tiled segment
run through ``Tiled`` by hand.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from tilec.runtime import kernels as runtime_kernels
from tilec.runtime import sweeps as runtime_sweeps
from tilec.runtime import tiles as runtime_tiles
from tilec.runtime.arena import Arena
from tilec.runtime.device import (
    CONVOLVE_INTO,
    CUDA,
    GENERIC,
    PACK,
    Kernels,
    kernels_for,
    uses_gemm_weight_grad,
    uses_onednn,
)
from tilec.runtime.kernels import (
    conv2d,
    dense,
    gather,
    gemm_weight_grad,
    hardtanh_grad_,
    in_place,
    layout_of,
    leaky_relu_grad_,
    lerp,
    max_pool,
    onednn,
    pad_border,
    relu_grad_,
    weight_grad,
)
from tilec.runtime.memory import expand_cuda_segments
from tilec.runtime.sweeps import Tiled, add_input_grads, backward_into
from tilec.runtime.tiles import Rolled, Run, TiledSegment, Whole, input_gradient, share
from tilec.target import GEMM_MIN_CHANNELS

aten = torch.ops.aten
CPU = torch.device("cpu")
#: The CPU's tile kernels as a plan with the reference weight-gradient race gets them.
CPU_KERNELS = kernels_for("cpu", GEMM_MIN_CHANNELS)
#: The CPU's, with every stride-1 convolution's weight gradient from matrix products.
GEMM_KERNELS = Kernels(arena=True, onednn=CPU_KERNELS.onednn, gemm_min_channels=1, pin_allocator=False)
KERNELS = {"cpu": CPU_KERNELS, "generic": GENERIC}
HAS_ONEDNN = CONVOLVE_INTO is not None and PACK is not None


def _inside(tensor: torch.Tensor, arena: Arena) -> bool:
    start = arena.buffer.data_ptr()
    return start <= tensor.data_ptr() < start + arena.buffer.numel()


# --- the kernels table --------------------------------------------------------------------------


def test_kernels_for_each_device():
    assert kernels_for("cuda", 32) is CUDA and kernels_for("cuda", 32, "generic") is CUDA
    assert kernels_for("mps", None) is GENERIC and kernels_for("cpu", 32, "generic") is GENERIC
    for base, device in ((GENERIC, "cpu"), (CUDA, "cuda")):
        assert kernels_for(device, 32, "compiled") == replace(base, compiler="compiled")
        assert kernels_for(device, 32, "cudagraphs") == replace(base, compiler="cudagraphs")
        assert kernels_for(device, 32, "reduce-overhead") == replace(base, compiler="reduce-overhead")
    assert not any(kernels_for(device, 32, choice).compiled or kernels_for(device, 32, choice).graphs
                   for device in ("cpu", "cuda") for choice in ("auto", "generic"))
    assert [kernels_for("cuda", 32, choice).graphs for choice in ("compiled", "cudagraphs", "reduce-overhead")] == [
        False, True, True]
    assert GENERIC == Kernels(arena=False, onednn=False, gemm_min_channels=None, pin_allocator=False)
    assert CUDA == Kernels(arena=False, onednn=False, gemm_min_channels=None, pin_allocator=False,
                           expand_segments=True)
    cpu = kernels_for("cpu", 48)
    assert cpu.arena and cpu.gemm_min_channels == 48 and cpu.onednn == HAS_ONEDNN
    assert cpu.pin_allocator == sys.platform.startswith("linux")
    assert kernels_for("cpu", None).gemm_min_channels is None


def test_expandable_segments_unless_the_allocator_is_configured(monkeypatch):
    settings = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    expand_cuda_segments.cache_clear()
    assert expand_cuda_segments() and expand_cuda_segments() and settings == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    expand_cuda_segments.cache_clear()
    assert not expand_cuda_segments() and settings == ["expandable_segments:True"]
    expand_cuda_segments.cache_clear()


@pytest.mark.parametrize(("dtype", "autocast", "expected"), [
    (torch.float32, False, True), (torch.float32, True, False), (torch.float64, False, False),
    (torch.bfloat16, False, False), (torch.float16, True, False),
])
def test_uses_onednn_for_float32_outside_autocast(dtype, autocast, expected):
    assert uses_onednn(CPU_KERNELS, dtype, autocast) == (expected and HAS_ONEDNN)
    assert not uses_onednn(GENERIC, dtype, autocast)


@pytest.mark.parametrize(("dtype", "groups", "stride", "taps", "channels", "expected"), [
    (torch.float32, 1, (1, 1), 9, GEMM_MIN_CHANNELS, True),
    (torch.float64, 1, (1, 1), 2, GEMM_MIN_CHANNELS + 5, True),
    (torch.float32, 1, (1, 1), 9, GEMM_MIN_CHANNELS - 1, False),  # too few input channels
    (torch.bfloat16, 1, (1, 1), 9, GEMM_MIN_CHANNELS, False),
    (torch.float16, 1, (1, 1), 9, GEMM_MIN_CHANNELS, False),
    (torch.float32, 2, (1, 1), 9, GEMM_MIN_CHANNELS, False),  # grouped
    (torch.float32, 1, (2, 1), 9, GEMM_MIN_CHANNELS, False),  # strided
    (torch.float32, 1, (1, 2), 9, GEMM_MIN_CHANNELS, False),
    (torch.float32, 1, (1, 1), 1, GEMM_MIN_CHANNELS, False),  # 1x1
])
def test_uses_gemm_weight_grad(dtype, groups, stride, taps, channels, expected):
    assert uses_gemm_weight_grad(CPU_KERNELS, dtype, groups, stride, taps, channels) == expected
    assert not uses_gemm_weight_grad(GENERIC, dtype, groups, stride, taps, channels)
    assert not uses_gemm_weight_grad(kernels_for("cpu", None), dtype, groups, stride, taps, channels)


def test_the_gemm_path_also_needs_a_channels_last_input():
    x = torch.randn(1, GEMM_MIN_CHANNELS, 6, 6).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, GEMM_MIN_CHANNELS, 3, 3)
    arena = Arena(CPU, CPU_KERNELS)
    assert gemm_weight_grad(x, w, (1, 1), 1, arena)
    assert not gemm_weight_grad(x.contiguous(), w, (1, 1), 1, arena)
    assert not gemm_weight_grad(x.bfloat16(), w.bfloat16(), (1, 1), 1, arena)
    assert not gemm_weight_grad(x, w, (2, 1), 1, arena)
    assert not gemm_weight_grad(x, w[:, :, :1, :1], (1, 1), 1, arena)
    assert not gemm_weight_grad(x[:, :GEMM_MIN_CHANNELS - 1], w[:, :GEMM_MIN_CHANNELS - 1], (1, 1), 1, arena)
    assert not gemm_weight_grad(x, w, (1, 1), 1, Arena(CPU, GENERIC))


# --- the arena ----------------------------------------------------------------------------------


def test_take_carves_aligned_non_view_tensors_one_after_the_other():
    arena = Arena(CPU, CPU_KERNELS, 1 << 16)
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


def test_take_rounds_each_start_up_to_64_bytes():
    arena = Arena(CPU, CPU_KERNELS, 1 << 12)
    for count, start in ((3, 0), (5, 64), (1, 128), (16, 192)):
        t = arena.take((count,), torch.float32, CPU)
        assert t.data_ptr() - arena.buffer.data_ptr() - arena.base == start
        assert arena.top == start + 4 * count
    assert arena.need == 192 + 64


def test_past_its_capacity_or_without_one_the_arena_hands_out_fresh_tensors_and_learns_its_need():
    arena = Arena(CPU, CPU_KERNELS, 256)
    inside = arena.take((8, 8), torch.float32, CPU)
    beyond = arena.take((8, 8), torch.float32, CPU)
    assert _inside(inside, arena) and not _inside(beyond, arena)
    assert arena.need == 64 * 4 + 64 * 4
    empty = Arena(CPU, CPU_KERNELS)
    assert empty.buffer is None
    t = empty.take((2, 3, 4, 5), torch.float32, CPU, torch.channels_last)
    assert t.is_contiguous(memory_format=torch.channels_last) and empty.need == 2 * 3 * 4 * 5 * 4
    meta = Arena(torch.device("meta"), kernels_for("meta", None), 1 << 10)  # caching allocators reuse blocks
    assert meta.buffer is None and meta.take((4,), torch.float32, torch.device("meta")).is_meta


def test_the_generic_kernels_take_fresh_tensors_and_count_nothing():
    """No buffer, and no count a compiled tile would read (and be compiled again for)."""
    arena = Arena(CPU, GENERIC, 1 << 16, pack=True)
    assert arena.buffer is None and arena.packed_weights is None
    a = arena.take((2, 3, 4, 5), torch.float64, CPU, torch.channels_last)
    b = arena.take((7,), torch.float32, CPU)
    assert a.is_contiguous(memory_format=torch.channels_last) and b.is_contiguous()
    assert arena.need == arena.top == 0
    w = torch.randn(8, 4, 3, 3)
    copy = arena.channels_last(w)
    assert torch.equal(copy, w) and copy.is_contiguous(memory_format=torch.channels_last)


def test_a_channels_last_weight_copy_is_scratch():
    arena = Arena(CPU, CPU_KERNELS, 1 << 16)
    w = torch.randn(8, 4, 3, 3)
    copy = arena.channels_last(w)
    assert _inside(copy, arena) and copy.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(copy, w)
    already = w.contiguous(memory_format=torch.channels_last)
    assert arena.channels_last(already) is already


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN weight reorder")
def test_a_packing_arena_reorders_each_weight_once_per_pass():
    x = torch.randn(1, 4, 9, 9).contiguous(memory_format=torch.channels_last)
    w = torch.randn(8, 4, 3, 3)
    packing = Arena(CPU, CPU_KERNELS, 1 << 16, pack=True)
    first = packing.packed(w, x, (1, 1), (1, 1), (1, 1), 1)
    assert packing.packed(w, x, (1, 1), (1, 1), (1, 1), 1) is first and packing.top == 0  # outside the buffer
    plain = Arena(CPU, CPU_KERNELS, 1 << 16)
    copy = plain.packed(w, x, (1, 1), (1, 1), (1, 1), 1)
    assert torch.equal(copy, w) and _inside(copy, plain)


# --- convolution -------------------------------------------------------------------------------


def _conv_grads(conv, x, w, b, stride, padding, dilation, groups, g):
    """Output and input, weight and bias gradients of ``conv`` back-propagating ``g``."""
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    y = conv(leaves[0], leaves[1], leaves[2] if b is not None else None, stride, padding, dilation, groups)
    y.backward(g(y))
    return [y.detach(), *(leaf.grad for leaf in leaves)]


def _reference(x, *args):  # torch's channels-last conv2d crashes on the first example below
    return F.conv2d(x.contiguous(), *args)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 2), groups=st.sampled_from([1, 2, 4]), per_group=st.integers(1, 3),
       out_per_group=st.integers(1, 3), kernel=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       padding=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       size=st.tuples(st.integers(1, 12), st.integers(1, 12)), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]), pack=st.booleans(),
       kernels=st.sampled_from(sorted(KERNELS)))
@example(batch=2, groups=1, per_group=2, out_per_group=2, kernel=(1, 1), stride=(2, 3), dilation=(1, 2),
         padding=(2, 2), size=(6, 1), bias=True, dtype=torch.float32, pack=False, kernels="cpu")  # crashed oneDNN
@example(batch=2, groups=1, per_group=2, out_per_group=1, kernel=(1, 1), stride=(1, 1), dilation=(1, 2),
         padding=(1, 1), size=(7, 10), bias=True, dtype=torch.float32, pack=False,
         kernels="cpu")  # a bias gradient summing to ~0
def test_tile_convolution_equals_pytorch(batch, groups, per_group, out_per_group, kernel, stride, dilation,
                                         padding, size, bias, dtype, pack, kernels):
    """``conv2d`` (oneDNN into the arena for channels-last float32 on the CPU's kernels, with the
    weight packed where the arena packs; aten otherwise, and always on the generic kernels):
    output, input, weight and bias gradients against ``F.conv2d`` of the NCHW input; the arena's
    scratch is given back."""
    assume(all(s + 2 * p >= d * (k - 1) + 1 for s, p, d, k in zip(size, padding, dilation, kernel, strict=True)))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, groups * per_group, *size, dtype=dtype, generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(groups * out_per_group, per_group, *kernel, dtype=dtype, generator=generator)
    b = torch.randn(groups * out_per_group, dtype=dtype, generator=generator) if bias else None
    arena = Arena(CPU, KERNELS[kernels], 1 << 20, pack=pack)
    g = lambda y: torch.linspace(-1, 1, y.numel(), dtype=dtype).view_as(y)  # noqa: E731
    ours = _conv_grads(lambda *args: conv2d(*args, arena), x, w, b, stride, padding, dilation, groups, g)
    theirs = _conv_grads(_reference, x, w, b, stride, padding, dilation, groups, g)
    assert onednn(x, w, arena) == (kernels == "cpu" and dtype == torch.float32 and HAS_ONEDNN)
    assert arena.top == (ours[0].numel() * x.element_size() if onednn(x, w, arena) else 0)
    # float32 gradients sum up to a few hundred terms of size ~1 in another order than aten's (about
    # 1e-5 apart where the sum cancels to ~0); float64 ones must agree
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0, "atol": 1e-10}
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference, **tolerance)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 2), channels=st.integers(1, 6), out=st.integers(1, 6),
       kernel=st.tuples(st.integers(1, 5), st.integers(2, 5)),
       dilation=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       padding=st.tuples(st.integers(0, 3), st.integers(0, 3)),
       size=st.tuples(st.integers(1, 9), st.integers(1, 9)), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_matrix_product_weight_gradient_equals_pytorch(batch, channels, out, kernel, dilation, padding, size, bias,
                                                       dtype):
    """``conv2d`` with its weight gradient from ``weight_grad`` (kernels racing it from one input
    channel on): input, weight and bias gradients equal ``F.conv2d``'s (output ``size``, so the
    input is ``size + dilation * (kernel - 1) - 2 * padding``); the scratch is given back."""
    height, width = (s + d * (k - 1) - 2 * p for s, d, k, p in zip(size, dilation, kernel, padding, strict=True))
    assume(height >= 1 and width >= 1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, height, width, dtype=dtype, generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(out, channels, *kernel, dtype=dtype, generator=generator)
    b = torch.randn(out, dtype=dtype, generator=generator) if bias else None
    g = torch.randn(batch, out, *size, dtype=dtype, generator=generator)
    arena = Arena(CPU, GEMM_KERNELS, 1 << 20)
    assert gemm_weight_grad(x, w, (1, 1), 1, arena)
    ours = _conv_grads(lambda *args: conv2d(*args, arena), x, w, b, (1, 1), padding, dilation, 1, lambda y: g)
    theirs = _conv_grads(_reference, x, w, b, (1, 1), padding, dilation, 1, lambda y: g)
    assert arena.top == (ours[0].numel() * x.element_size() if onednn(x, w, arena) else 0) and arena.need > 0
    tolerance = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0, "atol": 1e-10}
    for mine, reference in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference, **tolerance)


def test_matrix_product_weight_gradient_accumulates_into_the_leaf():
    """A leaf weight's gradient is added into its ``grad`` by ``conv2d`` itself (no weight-sized
    copy for autograd to add): two backward passes sum like aten's."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 9, 8, dtype=torch.float64, generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 5, 3, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    arena = Arena(CPU, GEMM_KERNELS, 1 << 20)
    for _ in range(2):
        arena.reset()
        conv2d(x, w, None, (1, 1), (1, 1), (1, 1), 1, arena).square().sum().backward()
    reference = w.detach().clone().requires_grad_()
    for _ in range(2):
        F.conv2d(x.contiguous(), reference, None, 1, 1).square().sum().backward()
    torch.testing.assert_close(w.grad, reference.grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize(("kernel", "dilation"), [((3, 3), (1, 1)), ((2, 5), (2, 1)), ((1, 3), (1, 3))])
def test_weight_grad_is_aten_weight_gradient_of_the_padded_input(kernel, dilation):
    """``weight_grad(g, x, ...)`` of an already padded channels-last ``x``: aten's weight gradient
    of an unpadded, stride-1 convolution; its result is a view of the taps in the arena."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 11, 10, dtype=torch.float64, generator=generator)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(3, 6, *kernel, dtype=torch.float64, generator=generator)
    size = [x.shape[2 + a] - dilation[a] * (kernel[a] - 1) for a in range(2)]
    g = torch.randn(2, 3, *size, dtype=torch.float64, generator=generator)
    arena = Arena(CPU, GEMM_KERNELS, 1 << 20)
    ours = weight_grad(g, x, kernel, dilation, arena)
    _, theirs, _ = aten.convolution_backward(g, x.contiguous(), w, None, [1, 1], [0, 0], list(dilation), False,
                                             [0, 0], 1, [False, True, False])
    assert _inside(ours, arena) and ours.shape == w.shape
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-10)


# --- pooling, padding, resampling --------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)), stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       padding=st.tuples(st.integers(0, 1), st.integers(0, 1)), size=st.tuples(st.integers(3, 9), st.integers(3, 9)),
       pads=st.tuples(*(st.integers(0, 2) for _ in range(4))), channels_last=st.booleans(),
       narrowed=st.booleans(), kernels=st.sampled_from(sorted(KERNELS)))
def test_tile_max_pooling_and_padding_equal_pytorch(kernel, stride, padding, size, pads, channels_last, narrowed,
                                                    kernels):
    """``pad_border`` then ``max_pool`` in the arena against ``F.pad`` then ``F.max_pool2d``, both
    ways (float64, distinct values: no ties), on a map or a view of one narrowed by a column (as a
    tile pools part of what it computed)."""
    assume(all(2 * p <= k for p, k in zip(padding, kernel, strict=True)))
    x = torch.randperm(2 * 3 * size[0] * (size[1] + narrowed), generator=torch.Generator().manual_seed(1))
    x = x.double().view(2, 3, size[0], size[1] + narrowed)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x = x[:, :, :, narrowed:]
    arena = Arena(CPU, KERNELS[kernels], 1 << 20)
    results = []
    for pad, pool in ((lambda t: pad_border(arena, t, pads, -1e9),
                       lambda t: max_pool(arena, t, kernel, stride, padding, (1, 1))),
                      (lambda t: F.pad(t, pads, value=-1e9), lambda t: F.max_pool2d(t, kernel, stride, padding))):
        leaf = x.detach().requires_grad_()
        y = pool(pad(leaf))
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        results.append((y.detach(), leaf.grad))
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)
    assert (arena.buffer is not None) == (kernels == "cpu") == (arena.need > 0)


def _one_sample_with_a_small_batch_stride(x):
    """``x`` of one sample as elementwise ops leave a channels-last map: batch stride = channels."""
    return x.as_strided(x.shape, (x.shape[1], *x.stride()[1:]))


@pytest.mark.parametrize(("make", "layout", "copies"), [
    (lambda x: x, torch.contiguous_format, False),
    (lambda x: x[:, :, :, 1:], torch.contiguous_format, True),
    (lambda x: x.contiguous(memory_format=torch.channels_last), torch.channels_last, False),
    (lambda x: x.contiguous(memory_format=torch.channels_last)[:, :, :, 1:], torch.channels_last, True),
    (lambda x: _one_sample_with_a_small_batch_stride(x[:1].contiguous(memory_format=torch.channels_last)),
     torch.channels_last, False),
])
def test_dense_keeps_the_layout_aten_reads_and_gives_it_canonical_strides(make, layout, copies):
    """``layout_of`` is the layout aten reads (a view of a channels-last map too) but for a one-sample
    batch's stride; ``dense`` is contiguous in it with that layout's strides, a copy only of views."""
    base = torch.arange(2 * 4 * 5 * 6, dtype=torch.float64).view(2, 4, 5, 6)
    x = make(base)
    assert layout_of(x) is layout
    y = dense(x)
    assert torch.equal(y, x) and y.is_contiguous(memory_format=layout)
    assert y.stride() == torch.empty(y.shape, memory_format=layout).stride()
    assert (y.data_ptr() != x.data_ptr()) == copies


@settings(max_examples=200, deadline=None)
@given(sizes=st.tuples(*(st.integers(1, 4) for _ in range(4))), order=st.permutations(range(4)),
       start=st.tuples(*(st.integers(0, 1) for _ in range(4))))
def test_layout_of_reads_a_map_as_aten_does_but_for_a_one_sample_batch_stride(sizes, order, start):
    """``layout_of`` against torch's own mirror of ``suggest_memory_format``, on views (permuted
    storage order, a leading element dropped per dim) of maps of more than one sample."""
    from torch._prims_common import suggest_memory_format
    assume(sizes[0] > 1)
    stored = torch.empty([sizes[d] + start[d] for d in order]).permute(*sorted(range(4), key=order.__getitem__))
    x = stored[start[0]:, start[1]:, start[2]:, start[3]:]
    assert layout_of(x) is suggest_memory_format(x)


def _index_map(mode: str, in_size: int, out_size: int, align_corners: bool | None):
    """PyTorch's own index map of one axis: ``(low, high, frac)``, read off a probe."""
    probe = torch.arange(in_size, dtype=torch.float64).view(1, 1, in_size, 1)
    values = F.interpolate(probe, size=(out_size, 1), mode=mode, align_corners=align_corners).view(-1).tolist()
    if mode != "bilinear":
        low = tuple(round(v) for v in values)
        return low, low, None
    low = tuple(min(int(v), in_size - 1) for v in values)
    high = tuple(min(lo + 1, in_size - 1) for lo in low)
    return low, high, tuple(v - lo if hi > lo else 0.0 for v, lo, hi in zip(values, low, high, strict=True))


@pytest.fixture
def fresh_constants():
    """``constant`` caches by the id of its tuple: tuples of one test must not meet another's ids."""
    runtime_kernels.CONSTANTS.clear()
    yield
    runtime_kernels.CONSTANTS.clear()


@pytest.mark.parametrize(("mode", "align_corners"), [("nearest", None), ("nearest-exact", None),
                                                     ("bilinear", False), ("bilinear", True)])
@pytest.mark.parametrize(("size", "out"), [((4, 5), (8, 10)), ((3, 7), (7, 4)), ((5, 2), (9, 9)), ((1, 3), (2, 6))])
def test_gather_and_lerp_equal_interpolate(fresh_constants, mode, align_corners, size, out):
    """Nearest upsampling (``gather``) and bilinear (``lerp``) with PyTorch's index maps equal
    ``F.interpolate``, forward and backward (float64)."""
    maps = [_index_map(mode, size[a], out[a], align_corners) for a in range(2)]
    x = torch.randn(2, 3, *size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    results = []
    for upsample in (lambda t: gather(t, maps[0][0], maps[1][0]) if maps[0][2] is None else lerp(t, *maps[0], *maps[1]),
                     lambda t: F.interpolate(t, size=out, mode=mode, align_corners=align_corners)):
        leaf = x.clone().requires_grad_()
        y = upsample(leaf)
        y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y))
        results.append((y.detach(), leaf.grad))
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


# --- activations in place ----------------------------------------------------------------------


@pytest.mark.parametrize(("op", "grad", "args", "reference"), [
    (aten.relu_.default, relu_grad_, (), F.relu),
    (aten.hardtanh_.default, hardtanh_grad_, (-0.5, 0.7), lambda t: F.hardtanh(t, -0.5, 0.7)),
    (aten.leaky_relu_.default, leaky_relu_grad_, (0.1,), lambda t: F.leaky_relu(t, 0.1)),
], ids=["relu", "hardtanh", "leaky_relu"])
def test_activations_in_place_and_their_gradients(op, grad, args, reference):
    """``in_place(x, op, grad, *args)`` overwrites ``x`` with the activation and, in backward,
    the output gradient with the input gradient; both equal the out-of-place activation's."""
    generator = torch.Generator().manual_seed(0)
    leaf = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    g = torch.randn(2, 3, 5, 4, dtype=torch.float64, generator=generator)
    x = leaf * 1.0  # a fresh result, as a convolution's
    y = in_place(x, op, grad, *args)
    assert y.data_ptr() == x.data_ptr()
    given = g.clone()
    y.backward(given)
    want_leaf = leaf.detach().clone().requires_grad_()
    want = reference(want_leaf * 1.0)
    want.backward(g)
    torch.testing.assert_close(y.detach(), want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, want_leaf.grad, rtol=0, atol=0)
    torch.testing.assert_close(given, want_leaf.grad, rtol=0, atol=0)  # the output gradient, overwritten


# --- rolled input gradients -------------------------------------------------------------------


@st.composite
def rows_of_tiles(draw):
    """An input of ``height`` rows and, per row of tiles, the rows it reads, their starts rising."""
    height = draw(st.integers(1, 30))
    starts = sorted(draw(st.lists(st.integers(0, height - 1), min_size=1, max_size=6)))
    reads = [(start, draw(st.integers(start + 1, height))) for start in starts]
    return height, reads


@settings(max_examples=200, deadline=None)
@given(case=rows_of_tiles(), seed=st.integers(0, 2**16), channels_last=st.booleans())
def test_a_rolled_gradient_equals_a_whole_one(case, seed, channels_last):
    """Every row of tiles adds random parts within its reads; the rolled result, written over the
    input, equals the whole gradient everywhere (zeros where no tile read)."""
    height, reads = case
    generator = torch.Generator().manual_seed(seed)
    width, spatial = 5, (2, 3)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 3, height, width, generator=generator, dtype=torch.float64).contiguous(memory_format=layout)
    rolled, whole = Rolled(x, spatial, reads), Whole(x, spatial)
    assert rolled.band.shape[2] == max(stop - start for start, stop in reads)
    for start, stop in reads:
        for accumulated in (rolled, whole):
            accumulated.move(start)
        for _ in range(3):
            low = int(torch.randint(start, stop, (1,), generator=generator))
            high = int(torch.randint(low + 1, stop + 1, (1,), generator=generator))
            cols = sorted(int(c) for c in torch.randint(0, width + 1, (2,), generator=generator))
            part = torch.randn(2, 3, high - low, cols[1] - cols[0], generator=generator, dtype=torch.float64)
            for accumulated in (rolled, whole):
                accumulated.add((low, high), cols, part)
    result = rolled.result()
    assert result.data_ptr() == x.data_ptr()
    torch.testing.assert_close(result, whole.result(), rtol=0, atol=1e-12)


def test_a_tile_reading_no_row_of_an_input_adds_nothing_to_its_gradient():
    """A first row of tiles whose read of the input is only border padding (rows [0, 0)) hands on
    an empty gradient: a rolled accumulator, which has not moved to any row yet, skips it as the
    whole one does (it added it at no row)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 7, 3, generator=generator, dtype=torch.float64)
    rolled, whole = Rolled(x, (2, 3), [(0, 0), (0, 4), (2, 7)]), Whole(x, (2, 3))
    tiles = [((0, 0), torch.zeros(1, 2, 0, 3, dtype=torch.float64)),
             *(((start, stop), torch.randn(1, 2, stop - start, 3, generator=generator, dtype=torch.float64))
               for start, stop in ((0, 4), (2, 7)))]
    for rows, grad in tiles:
        add_input_grads([rolled, whole], ((rows, rows), (), 0), (((0, 3), (0, 3)), (), 0), [grad, grad])
    torch.testing.assert_close(rolled.result(), whole.result(), rtol=0, atol=1e-12)


def _segment(rows, rolled):
    return SimpleNamespace(sliced=((2, 3),), rolled=rolled, rows=rows)


@pytest.mark.parametrize(("rows", "rolled", "group", "kind"), [
    ([(((0, 4),), (), 0), (((2, 7),), (), 0)], (True,), None, Rolled),
    ([(((0, 4),), (), 0), (((2, 7),), (), 0)], (False,), None, Whole),  # the plan does not roll it
    ([(((0, 4),), (), 0), (((2, 7),), (), 0)], (True,), "group", Whole),  # ranks share the tiles
    ([(((3, 7),), (), 0), (((0, 4),), (), 0)], (True,), None, Whole),  # the reads' starts fall
    ([(((0, 0),), (), 0), (((0, 0),), (), 0)], (True,), None, Whole),  # no row of tiles reads it
])
def test_which_input_gradients_roll(rows, rolled, group, kind):
    x = torch.zeros(1, 2, 7, 3)
    assert type(input_gradient(_segment(rows, rolled), 0, x, group)) is kind


# --- tiles shared among ranks ------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(costs=st.lists(st.integers(0, 1000), min_size=0, max_size=40), ranks=st.integers(1, 6))
def test_every_tile_goes_to_one_rank_and_loads_are_balanced(costs, ranks):
    shares = share(costs, ranks)
    assert len(shares) == ranks and all(list(indices) == sorted(indices) for indices in shares)
    assert sorted(i for indices in shares for i in indices) == list(range(len(costs)))
    loads = [sum(costs[i] for i in indices) for indices in shares]
    assert max(loads) - min(loads) <= max(costs, default=0)  # greedy, costliest first
    assert share(costs, ranks) == shares


def test_costlier_tiles_are_spread_not_counted():
    assert share([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == ((0,), tuple(range(1, 11)))
    assert share([1, 1, 1], 2) == ((0, 2), (1,))  # ties: the lowest index first, to the lowest rank
    assert share([5, 5], 3) == ((0,), (1,), ())
    assert share([0, 0, 0, 0], 3) == ((0, 3), (1,), (2,))  # costing nothing: round the ranks


# --- one tiled segment, by hand ------------------------------------------------------------------


def _pointwise_tile(xs, bs, p, arena, r, o, want):
    """A tile of ``relu(conv1x1(x) * s)``: no halo, so each tile reads what it owns."""
    x, = xs
    s, = bs
    return (torch.relu(conv2d(x, p[0], p[1], [1, 1], [0, 0], [1, 1], 1, arena) * s),), ()


def _hand_made_segment(rolled: bool) -> TiledSegment:
    """Rows [0, 4) and [4, 7), columns [0, 2), [2, 5) and [5, 6), one shape class: 6 tiles."""
    rows = tuple((((a, b),), ((a, b),), 0, ()) for a, b in ((0, 4), (4, 7)))
    cols = tuple((((a, b),), ((a, b),), 0, ()) for a, b in ((0, 2), (2, 5), (5, 6)))
    return TiledSegment("segment 0", {(0, 0): _pointwise_tile}, rows, cols, [(2, 3)], 1,
                        [("image", (2, 4, 7, 6), (2, 3), False)], ((1, 1), (1, 1, 1)), (), (rolled,))


@pytest.mark.parametrize("kernels", ["auto", "generic"])
@pytest.mark.parametrize("rolled", [False, True])
def test_tiled_runs_a_segment_tile_by_tile(kernels, rolled):
    """``Tiled.apply`` of a hand-made segment (sliced input, broadcast scale, parameters) equals
    the untiled ops, forward and backward, and learns its forward arena's size (0 on the generic
    kernels, which use none; the backward's tensors are fresh); a rolled input gradient is written over
    the input."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 6, dtype=torch.float64, generator=generator)
    scale = torch.randn(1, 4, 1, 1, dtype=torch.float64, generator=generator)
    w = torch.randn(4, 3, 1, 1, dtype=torch.float64, generator=generator)
    b = torch.randn(4, dtype=torch.float64, generator=generator)
    g = torch.randn(2, 4, 7, 6, dtype=torch.float64, generator=generator)
    leaves = [t.clone().requires_grad_() for t in (x, scale, w, b)]
    want = torch.relu(F.conv2d(leaves[0], leaves[2], leaves[3]) * leaves[1])
    want_grads = torch.autograd.grad(want, leaves, g)
    segment = _hand_made_segment(rolled)
    run = Run("hand", False, None, kernels, GEMM_MIN_CHANNELS, device=x.device, dtype=x.dtype)
    leaves = [t.clone().requires_grad_() for t in (x, scale, w, b)]
    got, = Tiled.apply(segment, run, *leaves)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    got_grads = torch.autograd.grad(got, leaves, g)
    for mine, reference in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-12)
    assert (got_grads[0].data_ptr() == leaves[0].data_ptr()) == rolled
    assert len(segment._capacity) == 1 and all((need > 0) == (kernels == "auto") for need in segment._capacity.values())
    assert [(row[0], col[0]) for _, row, col in segment.tiles()] == [
        (rows, cols) for rows in (((0, 4),), ((4, 7),)) for cols in (((0, 2),), ((2, 5),), ((5, 6),))]
    assert segment.count() == 6 and [len(segment.share(4, rank)) for rank in range(4)] == [2, 2, 1, 1]


def test_a_later_step_carves_its_forward_from_the_arena_and_backs_up_on_fresh_tensors(monkeypatch):
    """The first step's forward learns the arena's size and a later one carves its tiles' tensors
    from it; every backward pass takes fresh tensors, which autograd releases as it goes (what the
    cost model counts), not an arena's that would keep each until the tile's backward ends."""
    made = []

    class Recorded(Arena):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(runtime_tiles, "Arena", Recorded)
    monkeypatch.setattr(runtime_sweeps, "Arena", Recorded)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=generator) for shape in ((2, 3, 7, 6), (1, 4, 1, 1), (4, 3, 1, 1), (4,))]
    segment = _hand_made_segment(False)
    run = Run("hand", False, None, "auto", GEMM_MIN_CHANNELS, device=CPU, dtype=torch.float32)
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in tensors]
        Tiled.apply(segment, run, *leaves)[0].square().sum().backward()
    first_forward, first_backward, later_forward, later_backward = made
    assert first_forward.buffer is None and later_forward.buffer is not None
    assert later_forward.capacity == first_forward.need > 0
    assert first_backward.buffer is None and later_backward.buffer is None and later_backward.need > 0


def test_runtime_files_define_each_top_level_name_once():
    """The generated module holds every runtime file in one namespace: a name two files define
    (a function, a class, a constant) would shadow the first file's at run time."""
    import ast
    from importlib import resources

    from tilec.runtime import SOURCES

    seen = {}
    for name in SOURCES:
        tree = ast.parse((resources.files("tilec.runtime") / name).read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            for defined in names:
                assert seen.setdefault(defined, name) == name, f"{defined} is defined in {seen[defined]} and {name}"


def test_backward_into_adds_into_grad_without_aliasing_what_autograd_hands_on():
    """An addition's backward hands its incoming gradient itself to both inputs: the held leaves
    get copies of it, so that later tiles' gradients add into each alone and the incoming
    gradient stays as it was; the other tensors' gradients come back."""
    w1, w2, x = (torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    incoming = [torch.full((3,), 1.0 + k, dtype=torch.float64) for k in range(2)]
    for grad in incoming:
        tile = x.detach().requires_grad_()
        got, = backward_into([(w1 + w2, grad), (tile * 2.0, grad)], [w1, w2], [tile])
        torch.testing.assert_close(got, 2.0 * grad, rtol=0, atol=0)
    assert torch.equal(incoming[0], torch.ones(3, dtype=torch.float64))
    for w in (w1, w2):
        torch.testing.assert_close(w.grad, torch.full((3,), 3.0, dtype=torch.float64), rtol=0, atol=0)
    assert x.grad is None
