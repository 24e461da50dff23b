"""``clock``: the time estimate's rates (``tilec.cost.Speed``) on the device a budget plan is for,
measured once per machine.

The budget search ranks plans by estimated seconds: FLOPs over a FLOP rate, op calls per tile
times a call cost, copied bytes over a copy rate. Their ratios decide between fewer, larger tiles
and more, smaller ones with more halo FLOPs, and they differ by orders of magnitude between a CPU
and a GPU, and between dtypes. So they are measured on the device the step runs on (autocast's,
else CUDA if this torch can use it, else the CPU), in its dtype: the training step of a generated
tiled module of a small convolution chain is timed at two grids, large tiles (mostly FLOPs) and
tiny ones (mostly calls), each the best of ``REPEATS`` steps after two warm-up steps, and the time
estimate of that step is solved for the FLOP rate and the call cost; the copy rate is the best of
a few copies of ``COPY_BYTES``.

Which weight gradient tiles compute is raced first (``gemm_min_channels``): the generated
module's matrix products against the library's kernel, for 3x3 convolutions of ``RACE_CHANNELS``
channels. On a 2-core AVX2 CPU the matrix products took half to a third of oneDNN's time from 32
channels on; on a 2-core AVX-512 one, oneDNN took half of theirs. The plan records the winner, and
the cost model counts its memory. Cached with the other measurements (``tilec.calibrate.cached``),
keyed by torch version, device and dtype, unless the machine was busy while they ran
(``tilec.calibrate.cached``); delete the cache file to measure again.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import astuple, replace
from functools import cache

import torch
from torch import nn

from tilec.calibrate import busy_now, cached, machine_key
from tilec.codegen import load_source, render
from tilec.cost.estimator import Estimator
from tilec.ir import is_int
from tilec.planner import plan
from tilec.runtime.arena import Arena
from tilec.runtime.device import kernels_for
from tilec.runtime.kernels import conv2d, max_pool, weight_grad
from tilec.runtime.memory import pin_allocator
from tilec.runtime.reduce import norm_apply
from tilec.target import GEMM_MIN_CHANNELS, Speed, Target
from tilec.trace import trace

#: The timed chain: two 3x3 convolutions with ReLUs, this many channels in and out.
CHANNELS = 64
#: (image side, grid side) of the FLOP-bound and of the call-bound step.
LARGE, SMALL = (192, 2), (32, 16)
#: Each step time is the best of this many steps; each copy time the best of this many copies.
REPEATS = 3
COPY_BYTES = 64 << 20
#: The weight-gradient race: 3x3 convolutions of these many channels in and out, each on a
#: channels-last input of about ``RACE_BYTES`` (a small tile: where tiles are small, the weights
#: weigh most); the library's kernel wins only where it takes less than ``RACE_MARGIN`` of the
#: matrix products' time, which take one weight-sized copy less (``tilec.cost``).
RACE_CHANNELS = (32, 64, 128, 256, 512)
RACE_BYTES = 1 << 20
RACE_MARGIN = 0.9
#: How the generated module runs tiles, as far as their timings depend on it; part of the cache
#: keys, so that a machine times again what an earlier runtime timed (2: backward passes on fresh
#: tensors; 3: normalisation in one pass; 4: its per-channel scale and shift made once per level,
#: partials' shares of the merged gradients in closed form).
TILES_REVISION = 4


def clock(target: Target, dtype: str, autocast: str | None) -> Target:
    """``target`` with ``gemm_min_channels`` and ``speed``: which weight gradient tiles compute, and
    the rates, on its device in ``dtype`` (autocast's dtype under ``autocast``)."""
    device, busy = target.device, cache(busy_now)  # one look at the machine serves the three timings
    gemm_key, speed_key, rates_key = cache_keys(device, dtype)
    gemm = cached(gemm_key, lambda: gemm_min_channels(device, dtype), _channels, busy)
    speed = cached(speed_key, lambda: list(astuple(measure(device, dtype, autocast, gemm))[:3]), _speed, busy)
    rates = cached(rates_key, lambda: [list(r) for r in kind_rates(device, dtype, autocast, gemm)], _rates, busy)
    return replace(target, gemm_min_channels=gemm, speed=replace(speed, rates=rates))


def cache_keys(device: str, dtype: str) -> tuple[str, str, str]:
    """The calibration cache's keys (``tilec.calibrate.cached``) of the weight-gradient race, the
    speed and the kinds' rates on ``device`` in ``dtype``."""
    key = f"tiles {TILES_REVISION} | {machine_key(device, dtype)}"
    return f"gemm weight gradient | {key}", f"speed | {key}", f"rates | {key}"


def _rates(entry) -> tuple[tuple[str, float], ...]:
    rates = tuple((str(key), float(rate)) for key, rate in entry)
    if not all(key.count("@") == 2 and 0 < rate < math.inf for key, rate in rates):
        raise ValueError(f"not rates: {entry!r}")
    return rates


#: The kinds of kernel timed for their FLOP rates (``tilec.ops.base.Op.time_class``), each at these
#: channel counts, on inputs of about each of ``KIND_ELEMENTS`` elements (a small tile's size and a
#: large one's: measured on the Xeon, 3x3 convolutions of 512 channels ran 1.5x as fast on 4 Mi
#: elements as on 256 Ki), as a tile runs it: forward without autograd, forward with it, backward.
KINDS = {"conv": (16, 64, 256, 512), "conv1x1": (64, 256, 1024), "depthwise": (32, 128, 512), "pixel": (64,),
         "norm": (64,), "pool": (64,)}
KIND_ELEMENTS = (1 << 18, 1 << 22)


def kind_rates(device: str, dtype: str, autocast: str | None, gemm: int | None) -> list[tuple[str, float]]:
    """FLOP/s of each kind of kernel at each channel count of ``KINDS`` and size of
    ``KIND_ELEMENTS`` (keyed ``kind@channels@elements``), counting FLOPs as the cost model does (a
    tile's three passes: the forward's FLOPs times 2 plus the backward's), with the device's tile
    kernels and the weight gradient the race chose."""
    kernels = kernels_for(device, gemm)
    if kernels.pin_allocator:
        pin_allocator(trim=True)  # as the generated module runs: fresh blocks are faulted in, which ops pay
    torch_dtype = getattr(torch, "float32" if autocast else dtype)
    generator = torch.Generator().manual_seed(0)
    found = []
    for kind, counts in KINDS.items():
        for channels in counts:
            for elements in KIND_ELEMENTS:
                side = max(4, round(math.sqrt(elements / channels)))
                x = torch.randn(1, channels, side, side, generator=generator).to(device=device, dtype=torch_dtype)
                x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
                op, flops = _kind_op(kind, x, generator)
                probe = Arena(x.device, kernels, pack=True)  # a first step: fresh tensors, learning the arena's need
                _three_passes(op, probe, Arena(x.device, kernels), autocast)
                arena = Arena(x.device, kernels, probe.need, pack=True)  # a later step's forward arena
                seconds = _best(lambda: _three_passes(op, arena, Arena(x.device, kernels), autocast),  # noqa: B023
                                device)
                found.append((f"{kind}@{channels}@{channels * side * side}", flops / seconds))
    return found


def _kind_op(kind: str, x: torch.Tensor, generator: torch.Generator):
    """A kernel of ``kind`` on ``x`` as a tile runs it, taking its tensors from the arena it is
    given, and its FLOPs over a tile's three passes."""
    channels, options = x.shape[1], {"device": x.device, "dtype": x.dtype}
    if kind in ("conv", "conv1x1", "depthwise"):
        taps, groups = (1, 1) if kind == "conv1x1" else (3, channels if kind == "depthwise" else 1)
        w = torch.randn(channels, channels // groups, taps, taps, generator=generator).to(**options).requires_grad_()
        b = torch.zeros(channels, **options).requires_grad_()
        padding = [taps // 2] * 2
        return (lambda arena: conv2d(x, w, b, [1, 1], padding, [1, 1], groups, arena),
                2 * (channels // groups) * taps * taps * x.numel() * (2 + 2))
    if kind == "pool":
        return lambda arena: max_pool(arena, x, (3, 3), (2, 2), (1, 1), (1, 1)), 9 * (x.numel() // 4) * 3
    if kind == "norm":  # with batch statistics, their gradient too (a sweep's leaves)
        affine = [torch.zeros(1, channels, 1, 1, **options).requires_grad_() for _ in range(2)]
        return lambda arena: norm_apply(x, affine), 5 * x.numel() * 3
    return lambda arena: torch.relu(x), x.numel() * 3


def _three_passes(op, arena, fresh, autocast: str | None) -> None:
    """What a tile does with one op: forward without autograd in the forward pass's ``arena``,
    then forward with autograd and backward in an arena without a buffer, ``fresh``
    (``tilec.runtime.sweeps``)."""
    device, dtype = autocast.split(":") if autocast else ("cpu", None)
    with torch.autocast(device, dtype=getattr(torch, dtype)) if autocast else nullcontext():
        arena.reset()
        with torch.no_grad():
            op(arena)
        y = op(fresh)
    y.backward(torch.ones_like(y))


def _channels(entry) -> int | None:
    if entry is not None and (not is_int(entry) or entry < 1):
        raise ValueError(f"not a channel count: {entry!r}")
    return entry


def gemm_min_channels(device: str, dtype: str) -> int | None:
    """The fewest input channels from which the generated module's matrix-product weight gradient
    (``tilec.runtime.kernels.weight_grad``, its scratch in an arena) held its own against the library's
    (``convolution_backward``: not ``RACE_MARGIN`` of its time or less) at that count and at every
    larger one raced (3x3, stride 1, channels-last, the best of ``REPEATS`` calls each); ``None``
    if it did not at the largest, or where that path does not serve (devices other than the CPU,
    dtypes other than float32 and float64)."""
    if device != "cpu" or dtype not in ("float32", "float64"):
        return None
    pin_allocator(trim=True)  # as the generated module runs: fresh blocks are faulted in, which both pay
    generator = torch.Generator().manual_seed(0)
    wins = [_matrix_products_win(channels, getattr(torch, dtype), generator, device) for channels in RACE_CHANNELS]
    fewest = None
    for channels, won in reversed(list(zip(RACE_CHANNELS, wins, strict=True))):
        if not won:
            break
        fewest = channels
    return fewest


def _speed(entry) -> Speed:
    flop_rate, call_seconds, copy_rate = (float(value) for value in entry[:3])
    if not (0 < flop_rate < math.inf and 0 <= call_seconds < math.inf and 0 < copy_rate < math.inf):
        raise ValueError(f"not a speed: {entry!r}")
    return Speed(flop_rate, call_seconds, copy_rate)


def _matrix_products_win(channels: int, dtype: torch.dtype, generator: torch.Generator, device: str) -> bool:
    """Whether ``tilec.runtime.kernels.weight_grad`` (and the bias gradient) hold their own against the library's
    weight and bias gradients of a 3x3 convolution of ``channels`` in and out on a ``RACE_BYTES``
    input (``RACE_MARGIN``)."""
    side = max(8, round(math.sqrt(RACE_BYTES / (channels * dtype.itemsize))))

    def tensor(*shape):
        return torch.randn(shape, generator=generator, dtype=dtype).contiguous(memory_format=torch.channels_last)

    x, w, g = tensor(1, channels, side, side), tensor(channels, channels, 3, 3), tensor(1, channels, side - 2, side - 2)
    kernels = kernels_for(device, channels)
    grad = torch.zeros_like(w)

    def ours():  # as a tile's backward runs it: into the weight's gradient, its scratch fresh
        grad.add_(weight_grad(g, x, (3, 3), (1, 1), Arena(x.device, kernels)))
        g.sum((0, 2, 3))

    def library():  # and autograd adds the result
        grad.add_(torch.ops.aten.convolution_backward(g, x, w, [channels], [1, 1], [0, 0], [1, 1], False, [0, 0],
                                                      1, [False, True, True])[1])

    mine = _best(ours, device)
    return _best(library, device) > RACE_MARGIN * mine


def _chain() -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU())


def _tiled_module(chain: nn.Sequential, side: int, grid: int, dtype: str, target: Target, autocast=None):
    """The generated module of ``chain`` on ``side``² inputs tiled ``grid`` x ``grid`` for
    ``target``, and the estimated costs of its segments."""
    graph = trace(chain, (1, CHANNELS, side, side), autocast)
    the_plan = plan(graph, target, name="clock", grid=(grid, grid), dtype=dtype)
    estimator = Estimator(graph, target, dtype)
    costs = [estimator.segment(s.first, s.stop, s.rows, s.cols, s.mode == "stored") for s in the_plan.segments]
    return load_source(render(the_plan), "tilec_clock"), costs


def measure(device: str, dtype: str, autocast: str | None = None,
            gemm_min_channels: int | None = GEMM_MIN_CHANNELS) -> Speed:
    """Time the chain's tiled step on ``device`` in ``dtype`` (see the module docstring), its
    weight gradients from matrix products from ``gemm_min_channels`` channels."""
    chain = _chain()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inputs = [torch.randn(1, CHANNELS, side, side) for side, _ in (LARGE, SMALL)]
    planned = "float32" if autocast else dtype
    target = Target(device=device, gemm_min_channels=gemm_min_channels)
    modules = [_tiled_module(chain, side, grid, planned, target, autocast) for side, grid in (LARGE, SMALL)]
    chain.to(device=device, dtype=getattr(torch, planned))
    copy_rate = COPY_BYTES / _best(_copy(device), device)
    copies_only = Speed(flop_rate=math.inf, call_seconds=0.0, copy_rate=copy_rate)  # what the fit need not solve for
    rows = []
    for (module, costs), x in zip(modules, inputs, strict=True):
        tiled = module.TiledModel(chain)
        x = x.to(device=device, dtype=getattr(torch, planned))
        seconds = _best(lambda: _step(tiled, x, autocast), device)  # noqa: B023 - called within the iteration
        known = sum(copies_only.seconds(0.0, 0, c.copied) for c in costs)
        rows.append((sum(c.flops for c in costs), sum(c.calls for c in costs), max(seconds - known, 0.0)))
    (large_flops, large_calls, large), (small_flops, small_calls, small) = rows
    determinant = large_flops * small_calls - small_flops * large_calls
    call_seconds = max((large_flops * small - small_flops * large) / determinant, 0.0)
    flop_seconds = (large - large_calls * call_seconds) / large_flops
    if flop_seconds <= 0:  # noise: the large step's calls cannot have taken all of its time
        flop_seconds = max(large, 1e-9) / large_flops
    return Speed(flop_rate=1 / flop_seconds, call_seconds=call_seconds, copy_rate=copy_rate)


def _step(tiled: nn.Module, x: torch.Tensor, autocast: str | None) -> None:
    device, dtype = autocast.split(":") if autocast else (x.device.type, None)
    with torch.autocast(device, dtype=getattr(torch, dtype)) if autocast else nullcontext():
        y = tiled(x)
    y.float().sum().backward()


def _copy(device: str):
    source = torch.empty(COPY_BYTES // 4, device=device)
    target = torch.empty_like(source)
    return lambda: target.copy_(source)


def _best(step, device: str) -> float:
    """Best seconds of ``REPEATS`` calls of ``step`` after two unmeasured ones."""
    times = []
    for attempt in range(2 + REPEATS):
        _synchronize(device)
        start = time.perf_counter()
        step()
        _synchronize(device)
        if attempt >= 2:
            times.append(time.perf_counter() - start)
    return min(times)


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
