"""``conv_workspace_of`` and ``measure_kernels``: measure, once per machine, what tile convolutions
allocate beyond their tensors, and what their kernels keep (``tilec.target.Target``).

Which convolution kernel torch picks depends on the device, the dtype and the build: on a CPU
without bfloat16 instructions, a bfloat16 convolution falls back to an im2col kernel whose backward
takes a buffer of the input times the kernel's taps; oneDNN's float32 channels-last kernels take
none. So the cost model does not hard-code it: a plan traced for autocast (``tilec.trace``) gets
``Target.conv_workspace = (tile, stored)``, each ``(forward, backward)``: the bytes a
convolution with a kernel larger than 1x1 allocates beyond its output (forward) and its input and
weight gradients (backward), in multiples of its input's bytes times its kernel taps; ``tile`` for
channels-last inputs (as tiles compute), ``stored`` for contiguous ones (stored segments). Measured
on a small convolution of the autocast device and dtype (on CPU as resident memory, as the
benchmarks measure: kernels may allocate outside torch's allocator, e.g. float32 buffers of an
emulated bfloat16 matrix product; with glibc's mmap threshold pinned as ``TiledModel`` pins it and
freed heap pages trimmed first, so that the growth does not depend on what the process freed
before), the median of three, rounded to 1/4, and cached in
``$XDG_CACHE_HOME/tilec/calibration.json`` (default ``~/.cache``), keyed by torch version, device
and dtype; delete the file to measure again.

``measure_kernels`` gives the target of a budget search ``kernel_state``: the bytes a process
keeps per convolution kernel it runs for the first time (``tilec.target.KERNEL_STATE_BYTES``),
measured as the growth of anonymous resident memory (pinned and trimmed as above) over new
convolution shapes, and cached alike.

Timings (``tilec.clock``) are cached as the machine's only if it was quiet while they ran: where Linux
reports CPU pressure, a timing during which some task waited for a CPU ``BUSY_STALL`` of its
time or more (another process competing for the cores, which slows each kernel several times
over) is used for the plan at hand with a warning and kept apart: later compiles reuse it while
the machine is still busy (``busy_now``: the pressure during a quarter of a second of matrix
products), so that a machine kept busy is not timed again for every compile, and the first that
finds it quiet measures again.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from tilec.ir import is_int
from tilec.runtime.memory import pin_allocator
from tilec.target import KERNEL_STATE_BYTES, Target

T = TypeVar("T")

#: The measured convolution: channels in and out, input height and width, kernel size.
CHANNELS, SIDE, KERNEL = 16, 256, 3
#: Each peak is the median of this many measurements.
REPEATS = 3
#: Kernel state: a 3x3 convolution of this many channels in and out runs, forward and both
#: gradients, on square channels-last inputs of these sides, each new to the process, in
#: ``KERNEL_ROUNDS`` rounds of as many sides each.
KERNEL_CHANNELS, KERNEL_SIDES, KERNEL_ROUNDS = 64, tuple(range(24, 40)), 3


def conv_workspace_of(autocast: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """The convolution workspace ``(tile, stored)`` on autocast's ``"DEVICE:DTYPE"`` (cached)."""
    device, dtype = autocast.split(":")
    return cached(machine_key(device, dtype), lambda: _measured_workspace(device, dtype), _workspace)


def measure_kernels(target: Target, dtype: str) -> Target:
    """``target`` with ``kernel_state``: the bytes a process keeps per convolution kernel it runs
    for the first time (``tilec.target.KERNEL_STATE_BYTES``) on its device in ``dtype``, measured in
    a fresh process (in one that has run much already, freed heap absorbs new kernels: readings of
    a few hundred bytes) and cached."""
    key = f"kernel state | {machine_key(target.device, dtype)}"
    return replace(target, kernel_state=cached(key, lambda: _fresh_kernel_state(target.device, dtype), _bytes))


def _fresh_kernel_state(device: str, dtype: str) -> int:
    """``kernel_state`` measured in a new Python process."""
    code = f"import torch, tilec.calibrate as c; print(c.kernel_state({device!r}, torch.{dtype}))"
    package_root = str(Path(__file__).resolve().parent.parent)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root,
                                                                              os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                              timeout=600, check=True)
        return int(done.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return kernel_state(device, getattr(torch, dtype))


def search_device(autocast: str | None, dtype: str) -> tuple[str, str]:
    """The device and dtype a budget plan is for: autocast's, else CUDA if this torch can use it,
    else the CPU, in ``dtype``."""
    return tuple(autocast.split(":")) if autocast else ("cuda" if torch.cuda.is_available() else "cpu", dtype)


def kernel_state(device: str, dtype: torch.dtype) -> int:
    """Growth of anonymous resident memory per kernel over ``KERNEL_SIDES[1:]``, each a new shape of
    three kernels (the first side runs before, so that one-time state does not count), the least
    of ``KERNEL_ROUNDS`` rounds on new sides each (what else the process allocates meanwhile only
    adds: one reading after other calibrations in the same process was 3x the others). 0 on CUDA:
    cuDNN keeps its state in host memory, not in the device memory a budget is for."""
    if device != "cpu":
        return 0
    if not pin_allocator(trim=True):
        return KERNEL_STATE_BYTES
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(KERNEL_CHANNELS, KERNEL_CHANNELS, 3, 3, generator=generator).to(dtype).requires_grad_()

    def run(side: int) -> None:
        x = torch.randn(1, KERNEL_CHANNELS, side, side, generator=generator).to(
            dtype=dtype, memory_format=torch.channels_last).requires_grad_()
        y = torch.nn.functional.conv2d(x, weight, padding=1)
        torch.autograd.grad(y, (x, weight), torch.ones_like(y))

    readings = []
    for offset in range(0, KERNEL_ROUNDS * len(KERNEL_SIDES), len(KERNEL_SIDES)):
        sides = [side + offset for side in KERNEL_SIDES]
        run(sides[0])
        pin_allocator(trim=True)
        before = status_bytes("RssAnon")
        for side in sides[1:]:
            run(side)
        readings.append(max(0, status_bytes("RssAnon") - before) // (3 * (len(sides) - 1)))
    return min(readings)


def _bytes(entry) -> int:
    if not is_int(entry) or entry < 0:
        raise ValueError(f"not a byte count: {entry!r}")
    return entry


def cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tilec" / "calibration.json"


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.machine()} {_cpu_model()} {torch.backends.cpu.get_cpu_capability()}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def machine_key(device: str, dtype: str) -> str:
    """What a measurement depends on: the torch version, the device's model and the dtype."""
    return f"torch {torch.__version__} | {_device_name(device)} | {dtype}"


#: The share of a timing's wall time during which tasks waited for a CPU that makes it not cached.
BUSY_STALL = 0.1


def cpu_stall_seconds() -> float | None:
    """Seconds during which some task waited for a CPU since boot (``/proc/pressure/cpu``), or
    ``None`` where the kernel does not report it."""
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as pressure:
            return int(pressure.readline().split("total=")[1]) / 1e6
    except (OSError, IndexError, ValueError):
        return None


#: Seconds a compile watches the CPU pressure before it reuses timings taken while the machine was
#: busy, running products of matrices of this side meanwhile.
PROBE_SECONDS, PROBE_SIDE = 0.25, 512


def cached(key: str, measure: Callable[[], Any], parse: Callable[[Any], T],
           busy: Callable[[], bool] | None = None) -> T:
    """``parse`` of the cache's entry ``key``; if absent, or malformed (``parse`` raises
    ``TypeError`` or ``ValueError``), ``parse(measure())``, stored under ``key`` first. A timing
    (``busy`` given: whether the machine is busy now, ``busy_now``) during which the machine was
    busy is stored apart, under ``key | busy``, and reused only while ``busy()``; the first compile
    that finds it quiet measures again (module docstring)."""
    path = cache_path()
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        entries = {}
    entries = entries if isinstance(entries, dict) else {}
    provisional = f"{key} | busy"
    for found in (key, provisional):
        if found in entries and (found == key or busy is not None and busy()):
            try:
                value = parse(entries[found])
            except (TypeError, ValueError):
                continue  # malformed: measure again
            if found == provisional:
                warnings.warn(f"tilec: this machine is busy; the plan uses timings of its kernels "
                              f"({key.split(' | ')[0]}) taken while it was busy too, measured again once it is "
                              "quiet", RuntimeWarning, stacklevel=2)
            return value
    start, stalled = time.perf_counter(), cpu_stall_seconds() if busy is not None else None
    measured = measure()
    kept = {name: value for name, value in entries.items() if name != provisional}
    if stalled is not None:
        share = (cpu_stall_seconds() - stalled) / max(time.perf_counter() - start, 1e-9)
        if share >= BUSY_STALL:
            warnings.warn(f"tilec: other tasks waited for a CPU {share:.0%} of the time while timing this "
                          f"machine's kernels ({key.split(' | ')[0]}); the plan uses these timings, which are "
                          "measured again once the machine is quiet", RuntimeWarning, stacklevel=2)
            key = provisional
    _store(path, {**kept, key: measured})
    return parse(measured)


def busy_now() -> bool:
    """Whether some task waited for a CPU ``BUSY_STALL`` of the time or more while this process kept
    its threads busy with matrix products for ``PROBE_SECONDS``, as a timing does (an idle process
    sees no contention on a machine another process loads only in part); ``False`` where Linux
    does not report CPU pressure."""
    before = cpu_stall_seconds()
    if before is None:
        return False
    start, x = time.perf_counter(), torch.ones(PROBE_SIDE, PROBE_SIDE)
    while time.perf_counter() - start < PROBE_SECONDS:
        torch.mm(x, x)
    return (cpu_stall_seconds() - before) / (time.perf_counter() - start) >= BUSY_STALL


def _store(path: Path, entries: dict) -> None:
    """Write the cache file whole, through a temporary file (an unwritable cache only means
    measuring again next time)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        partial.replace(path)
    except OSError:
        partial.unlink(missing_ok=True)


def _workspace(entry) -> tuple[tuple[float, float], tuple[float, float]]:
    (tile_forward, tile_backward), (stored_forward, stored_backward) = entry
    return (float(tile_forward), float(tile_backward)), (float(stored_forward), float(stored_backward))


def _measured_workspace(device: str, dtype: str) -> list[list[float]]:
    return [list(conv_workspace(device, getattr(torch, dtype), last)) for last in (True, False)]


def conv_workspace(device: str, dtype: torch.dtype, channels_last: bool) -> tuple[float, float]:
    """Measure ``(forward, backward)`` workspace of a convolution (module docstring)."""
    generator = torch.Generator().manual_seed(0)

    def tensor(*shape, last=False):
        t = torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        return t.contiguous(memory_format=torch.channels_last) if last else t

    x = tensor(1, CHANNELS, SIDE, SIDE, last=channels_last).requires_grad_()
    w = tensor(CHANNELS, CHANNELS, KERNEL, KERNEL).requires_grad_()
    g = tensor(1, CHANNELS, SIDE, SIDE, last=channels_last)

    def forward():
        return torch.nn.functional.conv2d(x, w, padding=KERNEL // 2)

    def backward(y):
        torch.autograd.grad(y, (x, w), g, retain_graph=True)

    backward(forward())  # first calls pick and cache kernels
    y = forward()
    forward_peak = statistics.median(_peak(device, forward) for _ in range(REPEATS))
    backward_peak = statistics.median(_peak(device, lambda: backward(y)) for _ in range(REPEATS))
    unit = x.numel() * x.element_size() * KERNEL * KERNEL
    inputs, weights = x.numel() * x.element_size(), w.numel() * w.element_size()
    return (_quarters((forward_peak - inputs) / unit), _quarters((backward_peak - inputs - weights) / unit))


def _quarters(value: float) -> float:
    return max(0.0, round(value * 4) / 4)


def _peak(device: str, step) -> int:
    """Peak bytes allocated by ``step`` beyond what was allocated before it."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    resident = _resident_peak(step)
    return resident if resident is not None else _allocated_peak(step)


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (Linux), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_high_water_mark() -> bool:
    """Reset VmHWM to the current VmRSS (Linux); True if the kernel allowed it and it took effect."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return status_bytes("VmHWM") <= status_bytes("VmRSS") + (1 << 20)
    except (OSError, RuntimeError):
        return False


def _resident_peak(step) -> int | None:
    """Growth of resident memory during ``step`` (Linux with glibc), else None."""
    if not pin_allocator(trim=True) or not reset_high_water_mark():
        return None
    before = status_bytes("VmRSS")
    step()
    return status_bytes("VmHWM") - before


def _allocated_peak(step) -> int:
    """Peak bytes torch's CPU allocator hands out during ``step`` (from the profiler's events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        pending.extend(node.children)
    alive = peak = 0
    for _, size in sorted(events):
        alive += size
        peak = max(peak, alive)
    return peak
