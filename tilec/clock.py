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
a few copies of ``COPY_BYTES``. Cached with the other measurements (``tilec.calibrate.cached``),
keyed by torch version, device and dtype; delete the cache file to measure again.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import astuple

import networkx as nx
import torch
from torch import nn

from tilec.calibrate import cached, machine_key, search_device
from tilec.cost import Estimator, Speed

#: The timed chain: two 3x3 convolutions with ReLUs, this many channels in and out.
CHANNELS = 64
#: (image side, grid side) of the FLOP-bound and of the call-bound step.
LARGE, SMALL = (192, 2), (32, 16)
#: Each step time is the best of this many steps; each copy time the best of this many copies.
REPEATS = 3
COPY_BYTES = 64 << 20


def clock(graph: nx.DiGraph, dtype: str) -> nx.DiGraph:
    """``graph`` with ``speed``: the rates of its device and of ``dtype`` (autocast's, under autocast)."""
    autocast = graph.graph.get("autocast")
    device, dtype = search_device(graph, dtype)
    timed = graph.copy()
    timed.graph["speed"] = cached(f"speed | {machine_key(device, dtype)}",
                                  lambda: list(astuple(measure(device, dtype, autocast))), _speed)
    return timed


def _speed(entry) -> Speed:
    flop_rate, call_seconds, copy_rate = (float(value) for value in entry)
    if not (0 < flop_rate < math.inf and 0 <= call_seconds < math.inf and 0 < copy_rate < math.inf):
        raise ValueError(f"not a speed: {entry!r}")
    return Speed(flop_rate, call_seconds, copy_rate)


def measure(device: str, dtype: str, autocast: str | None = None) -> Speed:
    """Time the chain's tiled step on ``device`` in ``dtype`` (see the module docstring)."""
    from tilec.codegen import render
    from tilec.pipeline import load_source
    from tilec.planner import Boundaries, plan
    from tilec.trace import trace

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        chain = nn.Sequential(nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU(),
                              nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU())
        inputs = [torch.randn(1, CHANNELS, side, side) for side, _ in (LARGE, SMALL)]
    graphs = [trace(chain, (1, CHANNELS, side, side), autocast) for side, _ in (LARGE, SMALL)]
    planned = "float32" if autocast else dtype
    chain.to(device=device, dtype=getattr(torch, planned))
    copy_rate = COPY_BYTES / _best(_copy(device), device)
    copies_only = Speed(flop_rate=math.inf, call_seconds=0.0, copy_rate=copy_rate)  # what the fit need not solve for
    rows = []
    for graph, x, (_, grid) in zip(graphs, inputs, (LARGE, SMALL), strict=True):
        the_plan = plan(graph, name="clock", grid=(grid, grid), dtype=planned)
        estimator = Estimator(Boundaries(graph), planned)
        costs = [estimator.segment(s.first, s.stop, s.rows, s.cols, s.mode == "stored") for s in the_plan.segments]
        tiled = load_source(render(the_plan), "tilec_clock").TiledModel(chain)
        x = x.to(device=device, dtype=getattr(torch, planned))
        seconds = _best(lambda: _step(tiled, x, autocast), device)  # noqa: B023 - called within the iteration
        known = sum(copies_only.seconds(0, 0, c.copied) for c in costs)
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
