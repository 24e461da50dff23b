"""Run ONE variant of ONE training step in this process and print one JSON line.

    python benchmarks/step.py --model examples/vgg16.py --size 1024 --variant tilec --grid 4x4

A step is forward + backward (of ``out.sum()``, or of a random output gradient with
``--grad randn``) in float32; the input does not require grad, the parameters do.

Variants:
  plain       the model itself;
  checkpoint  for an ``nn.Sequential``: ``torch.utils.checkpoint.checkpoint_sequential``
              (``use_reentrant=False``) with ``--segments`` segments (default: round(sqrt(#layers)));
              in-place ReLU/LeakyReLU are made out-of-place for this variant only
              (checkpoint_sequential breaks on them at segment edges), and the JSON says so.
              For any other module: ``torch.utils.checkpoint.checkpoint`` around each of the
              top-level children named by ``--checkpoint-modules`` (default: every direct child
              holding two or more convolutions, e.g. ResNet's four stages);
  tilec       tilec with ``--grid RxC`` (one fused segment), or explicit segments with
              ``--tilec-segments``; ``--tiles-per-call K`` stacks up to K tiles of one shape
              class per call (``tilec compile --batch``);
  auto        tilec planning for ``--budget`` bytes (``memory_budget``);
  lightstream Lightstream 1.0.7's ``StreamingCNN`` (``pip install lightstream``) over a
              torchvision-layout ResNet's convolutional part (stem and the four stages), with
              ``--tile-size`` tiles (default 2880, its README's), its normalisation off; the head
              (global pooling, flatten, ``fc``) runs as is. Lightstream keeps BatchNorm as it is
              (its users freeze it: ``examples/resnet18.py``'s ``resnet34_frozen``) and trains
              its own copies of the stages' parameters. It is written for CUDA: its convolutions'
              weight gradients are taken over a tile's input and a cropped output gradient, which
              the CPU's kernels refuse (oneDNN and the native one), so on a CPU its backward fails.
For tilec and auto the JSON line also has the plan's segments, ``predicted_peak_bytes`` (of a
first step), ``kernel_state_bytes`` (of it, what the first step creates and later steps find) and
``estimated_seconds`` (the plan's time estimate, ``tilec.cost.Speed``; auto's from this machine's
rates, ``tilec.clock``);
``--allocator`` picks how their process's malloc returns memory: ``pinned`` (the default: the
generated module pins glibc's mmap threshold), ``as-is`` (``return_freed_memory=False``) or
``heap`` (as-is, and glibc keeps freed blocks below 32 MiB in its heap, untrimmed);
``--kernels`` the tile kernels (``TiledModel(kernels=...)``: ``auto``, ``generic``, ``compiled``,
``cudagraphs`` or ``reduce-overhead``, whose ``torch.compile`` runs in the first step:
``first_step_s``).

Peak memory ("peak_bytes") is the growth of the process's memory during the first step over
its state just before it (model, input and tilec module already built, warm-up done):
  CPU   baseline = VmRSS just before the step; VmHWM is reset by writing "5" to
        /proc/self/clear_refs, and the peak is VmHWM after the step (method "vmhwm-reset").
        If the reset is not permitted, a thread samples VmRSS every millisecond during the step
        (method "rss-sampled", a lower bound on the true peak).
  CUDA  torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated(), after
        torch.cuda.reset_peak_memory_stats() (method "cuda-allocated"); "reserved_bytes" is the
        same of max_memory_reserved() (the caching allocator's segments; None on CPU).
Parameter gradients are created by the measured step (the warm-up's are set to None), so they
count in every variant. On CPU the first step also pages in library code it runs for the first
time ("code_paged_in_bytes": growth of RssFile, file-backed and shared, not data), and with
``--repeats K`` "last_peak_bytes" is the same measurement of the last step.

Step time ("step_s") is the wall time of a step; with ``--repeats K`` the best of K steps (the
"peak_bytes" is always the first's). Because the machine may be shared, every step also records
the process's CPU time (user + system, all threads; "cpu_s" is the best step's, "cpus_s" all of
them) and the fraction of its wall time during which some task waited for a CPU
("cpu_stall_fraction", the best step's, from /proc/pressure/cpu; near 0 on an idle machine). A
tiled module's first step also sizes the arenas of its later ones (``_Arena``).

On CUDA, ``--busy`` runs one more step after the timed ones under ``torch.profiler`` with the
CUDA activity alone (no CPU-side op events; CUPTI adds its small cost to each launch) and records
"gpu_busy_fraction": the time some kernel, copy or fill ran on the device (the union of their
intervals) over that step's wall time, and "busy_step_s", that wall time. It is a lower bound: the
profiled step is no faster than an unprofiled one.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import json
import math
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

# Run from a checkout without installing: make ``tilec`` importable from the repository root.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import covered  # noqa: E402
from tilec.calibrate import cpu_stall_seconds, reset_high_water_mark, status_bytes  # noqa: E402
from tilec.config import parse_segments as config_segments  # noqa: E402
from tilec.errors import BudgetError, GridError  # noqa: E402
from tilec.ir import segments_text  # noqa: E402
from tilec.modelfile import load_model  # noqa: E402
from tilec.planio import load as load_plan  # noqa: E402
from tilec.planner import SegmentChoice  # noqa: E402
from tilec.runtime.device import KERNEL_CHOICES  # noqa: E402

VARIANTS = ("plain", "checkpoint", "tilec", "auto", "lightstream")
UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
         "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


# ----------------------------------------------------------------------------------- parsing


def parse_bytes(text: str) -> int:
    """``"2GiB"``, ``"1.5G"``, ``"500MB"``, ``"123456"`` -> bytes (K/M/G/T alone are binary)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2GiB, 512MiB, 3e9 is not accepted)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def parse_grid(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX,]\s*(\d+)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a grid: {text!r} (write ROWSxCOLS, e.g. 4x4)")
    return int(match.group(1)), int(match.group(2))


def parse_segments(text: str) -> tuple[tuple, ...]:
    """Segments as ``tilec compile --segments`` takes them (``FIRST:STOP@ROWSxCOLS[/BATCH],...``,
    ``tilec.config.parse_segments``), refused as an argparse type refuses."""
    try:
        return config_segments(text)
    except GridError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# ------------------------------------------------------------------------------- measurement


class _Sampler(threading.Thread):
    """Fallback when VmHWM cannot be reset: sample VmRSS every ``period`` seconds."""

    def __init__(self, period: float = 0.001):
        super().__init__(daemon=True)
        self.period, self.peak, self.done = period, status_bytes("VmRSS"), threading.Event()

    def run(self):
        while not self.done.is_set():
            self.peak = max(self.peak, status_bytes("VmRSS"))
            time.sleep(self.period)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, status_bytes("VmRSS"))


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Meter:
    """Peak memory growth of one region of code, on CPU (RSS) or CUDA (allocator)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.method = None

    def __enter__(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.baseline = torch.cuda.memory_allocated()
            self.reserved_baseline = torch.cuda.memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            self.method = "cuda-allocated"
        else:
            self.sampler = None
            if reset_high_water_mark():
                self.method = "vmhwm-reset"
            else:
                self.method = "rss-sampled"
                self.sampler = _Sampler()
                self.sampler.start()
            self.baseline = status_bytes("VmRSS")
            self.file_baseline = status_bytes("RssFile")
        self.pressure = cpu_stall_seconds()
        self.cpu = _cpu_seconds()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.start
            self.peak = torch.cuda.max_memory_allocated()
            self.reserved_growth = torch.cuda.max_memory_reserved() - self.reserved_baseline
        else:
            self.seconds = time.perf_counter() - self.start
            self.peak = self.sampler.stop() if self.sampler else status_bytes("VmHWM")
            self.file_growth = status_bytes("RssFile") - self.file_baseline
        self.cpu_seconds = _cpu_seconds() - self.cpu
        pressure = cpu_stall_seconds()
        self.stalled = None if pressure is None or self.pressure is None else \
            (pressure - self.pressure) / max(self.seconds, 1e-9)
        self.growth = self.peak - self.baseline
        return False


# ---------------------------------------------------------------------------------- variants


def out_of_place(model: nn.Module) -> int:
    """Make in-place activations out-of-place; return how many were changed."""
    changed = 0
    for module in model.modules():
        if getattr(module, "inplace", False) and isinstance(module, (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.ELU,
                                                                    nn.Hardtanh, nn.SiLU, nn.Mish,
                                                                    nn.Hardswish, nn.Hardsigmoid)):
            module.inplace = False
            changed += 1
    return changed


def checkpoint_children(model: nn.Module, names: list[str] | None) -> list[str]:
    """Wrap each named direct child's forward in ``torch.utils.checkpoint``; return the names."""
    if names is None:
        names = [name for name, child in model.named_children()
                 if sum(isinstance(m, nn.Conv2d | nn.ConvTranspose2d) for m in child.modules()) >= 2]
    for name in names:
        child = getattr(model, name)
        forward = child.forward
        child.forward = lambda *a, f=forward: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)
    return names


class _Streamed(torch.autograd.Function):
    """Lightstream's streaming forward as an op: its backward streams the tiles again
    (``StreamingCNN.backward``), which accumulates the parameters' gradients itself."""

    @staticmethod
    def forward(ctx, network, x, *params):
        ctx.network, ctx.x, ctx.count = network, x, len(params)
        return network(x)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():  # autograd runs a backward without it
            ctx.network.backward(ctx.x, grad.contiguous())
        return (None, None) + (None,) * ctx.count


def streamed(model: nn.Module, tile: int, device: torch.device) -> tuple[object, nn.Module]:
    """``(step function, trained module)``: Lightstream's ``StreamingCNN`` over ``model``'s stem
    and stages, then its head, as its streaming ResNets split them (step.py's docstring)."""
    from lightstream.core.constructor import StreamingConstructor
    from lightstream.core.scnn.scnn import StreamingCNN

    class Constructor(StreamingConstructor):
        """Lightstream's constructor, its tile statistics taken on the model's device (on a CPU
        its defaults move the model to CUDA)."""

        def create_streaming_model(self):
            return StreamingCNN(self.model, tile_shape=(1, 3, tile, tile), deterministic=self.deterministic,
                                copy_to_gpu=False, verbose=False, statistics_on_cpu=device.type == "cuda",
                                normalize_on_gpu=False, mean=self.mean, std=self.std)

    stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool,
                         model.layer1, model.layer2, model.layer3, model.layer4)
    head = nn.Sequential(model.avgpool, nn.Flatten(1), model.fc)
    with contextlib.redirect_stdout(sys.stderr):
        network = Constructor(stem, tile, verbose=False, mean=[0, 0, 0], std=[1, 1, 1], normalize_on_gpu=False,
                              add_keep_modules=[nn.BatchNorm2d]).prepare_streaming_model().to(device)
    network.device = device
    gc.collect()
    if device.type == "cpu":  # the tile statistics' freed heap pages: a step should not find them
        ctypes.CDLL(None).malloc_trim(0)
    trained = nn.ModuleList([network.stream_module, head])
    params = [p for p in network.stream_module.parameters() if p.requires_grad]
    return (lambda x: head(_Streamed.apply(network, x, *params))), trained


def prepare(args, model: nn.Module, shape: tuple[int, ...], record: dict, device: torch.device):
    """Return ``(the function a step calls on the input, the module it trains)`` for
    ``args.variant``; fill ``record``."""
    autocast = f"{device.type}:{args.autocast}" if args.autocast else None
    if args.variant == "lightstream":
        start = time.perf_counter()
        found = streamed(model, args.tile_size, device)
        record.update(tile_size=args.tile_size, build_s=time.perf_counter() - start)
        return found
    return variant(args, model, shape, record, autocast), model


def variant(args, model: nn.Module, shape: tuple[int, ...], record: dict, autocast: str | None):
    """The function a step calls on the input, for ``args.variant`` but Lightstream's."""
    if args.variant == "plain":
        return model
    if args.variant == "checkpoint" and type(model) is not nn.Sequential:
        record["checkpointed"] = checkpoint_children(model, args.checkpoint_modules)
        return model
    if args.variant == "checkpoint":
        layers = len(model)
        segments = args.segments or max(1, round(math.sqrt(layers)))
        changed = out_of_place(model)
        record["segments"] = segments
        record["inplace_replaced"] = changed
        if changed:
            record["notes"].append(f"checkpoint only: {changed} in-place activations made out-of-place "
                                   f"(checkpoint_sequential fails on in-place ReLU at segment edges)")
        checkpoint_sequential = torch.utils.checkpoint.checkpoint_sequential
        return lambda x: checkpoint_sequential(model, segments, x, use_reentrant=False)
    if args.variant == "tilec":
        if args.tilec_segments:
            return compile_tiled(args, model, shape, record, autocast, segments=args.tilec_segments)
        return compile_tiled(args, model, shape, record, autocast, grid=args.grid or (4, 4))
    if args.variant == "auto":
        if args.budget is None:
            raise SystemExit("step.py: --variant auto needs --budget (e.g. --budget 2GiB)")
        record["budget_bytes"] = args.budget
        return compile_tiled(args, model, shape, record, autocast, memory_budget=args.budget)
    raise SystemExit(f"step.py: unknown variant {args.variant!r}")


#: glibc's mallopt parameters for ``--allocator heap``: blocks below 32 MiB (the most glibc allows)
#: come from its heap, and freed ones stay there (no trimming).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def compile_tiled(args, model: nn.Module, shape, record: dict, autocast: str | None, **how) -> nn.Module:
    """Compile as users do: ``tilec compile`` in a process of its own (so that its planning leaves
    no freed blocks in this process's heap for the measured steps to reuse), then import the
    generated module from its bytecode and wrap ``model``; record the plan's segments and predicted peak.
    ``autocast``: "DEVICE:DTYPE" the plan budgets for (``--autocast``); ``how``: one of ``grid``,
    ``segments`` or ``memory_budget`` (bytes). ``args.allocator``: "pinned" (the module's
    default), "as-is" (``return_freed_memory=False``) or "heap" (as-is, with glibc keeping every
    block below 32 MiB in its heap: no page faults after the first tiles, but a fragmented heap)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "tilec", "compile", str(args.model.resolve()), "--attr", args.attr,
                   "--input-shape", ",".join(map(str, shape)), "--name", "model", "--out-dir", out,
                   "--plan-dir", out, *compile_flags(**how), *(["--autocast", autocast] if autocast else []),
                   *(["--batch", str(args.tiles_per_call)] if args.tiles_per_call else [])]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
            raise (BudgetError if "no plan fits" in message else SystemExit)(f"step.py: tilec compile: {message}")
        plan = load_plan(Path(out) / "model.plan.json")
        module = import_file(Path(out) / "model_tiled.py")
    if args.allocator == "heap":
        libc = ctypes.CDLL(None)
        if not (libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)):
            raise SystemExit("step.py: --allocator heap needs glibc's mallopt")
    record["allocator"] = args.allocator
    record["kernels"] = args.kernels
    tiled = module.TiledModel(model, return_freed_memory=args.allocator == "pinned", kernels=args.kernels)
    record["build_s"] = time.perf_counter() - start
    record["predicted_peak_bytes"] = plan.predicted_peak_bytes
    record["kernel_state_bytes"] = plan.kernel_state_bytes
    record["plan_segments"] = [segments_text([s]) for s in plan.segments]
    record["tiles_per_call"] = [s.batch for s in plan.segments]
    record["estimated_seconds"] = sum(s.estimated_seconds for s in plan.segments)
    return tiled


def import_file(path: Path):
    """The module at ``path``, imported as ``import`` does: from the bytecode ``tilec compile``
    wrote beside it."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_flags(grid=None, segments=None, memory_budget=None) -> list[str]:
    """``tilec compile``'s flags for one of a grid, segments (``parse_segments``'s) or a budget."""
    if grid is not None:
        return ["--grid", f"{grid[0]}x{grid[1]}"]
    if segments is not None:
        return ["--segments", segments_text(SegmentChoice(*segment) for segment in segments)]
    return ["--memory-budget", f"{memory_budget}B"]


def _leaves(value) -> list[torch.Tensor]:
    return [leaf for leaf in torch.utils._pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _autocast(device: torch.device, autocast: str | None):
    """``torch.autocast`` on ``device`` with dtype ``autocast``; disabled if that is None."""
    return torch.autocast(device.type, dtype=getattr(torch, autocast or "bfloat16"), enabled=autocast is not None)


def one_step(fn, x: torch.Tensor, grad: str, generator: torch.Generator | None, autocast: str | None = None):
    """Forward (under ``torch.autocast`` with dtype ``autocast`` if given), then backward."""
    with _autocast(x.device, autocast):
        outs = _leaves(fn(x))
    if grad == "sum":
        torch.autograd.backward([out.sum() for out in outs])
    else:
        grads = [torch.randn(out.shape, dtype=out.dtype, device=out.device, generator=generator) for out in outs]
        torch.autograd.backward(outs, grads)
        del grads
    shape = tuple(outs[0].shape)
    checksum = sum(float(out.detach().sum()) for out in outs)  # no full-size float64 copy
    del outs
    return shape, checksum


def gpu_busy(step) -> tuple[float, float]:
    """``(busy fraction, wall seconds)`` of one call of ``step`` on CUDA (module docstring): kernels,
    copies and fills count, the profiler's annotations do not."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    intervals = [(event.start_ns(), event.start_ns() + event.duration_ns())
                 for event in prof.profiler.kineto_results.events()
                 if event.device_type() == DeviceType.CUDA and not event.is_user_annotation()]
    return covered(intervals) / 1e9 / wall, wall


def warm_up(model: nn.Module, shape, device, autocast: str | None = None) -> None:
    """A tiny forward+backward of the plain model (its batch at a small side: loads kernels, starts threads), under
    ``torch.autocast`` with dtype ``autocast`` if given (the measured steps' kernels); grads reset."""
    pools = [m for m in model.modules() if isinstance(m, (nn.MaxPool2d, nn.AvgPool2d))]
    side = max(64, 2 ** len(pools)) if type(model) is not nn.Sequential else max(32, 2 ** len(pools))
    x = torch.randn((shape[0], shape[1], side, side), device=device)
    with _autocast(device, autocast):
        outs = _leaves(model(x))
    torch.autograd.backward([out.sum() for out in outs])
    model.zero_grad(set_to_none=True)
    del x
    gc.collect()


def grad_checksum(model: nn.Module) -> float:
    return sum(p.grad.double().abs().sum().item() for p in model.parameters() if p.grad is not None)


# -------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "vgg16.py",
                        help="model file defining `model` (an nn.Module or a function returning one)")
    parser.add_argument("--attr", default="model", help="attribute of the model file (default: model)")
    parser.add_argument("--size", type=int, required=True, help="image height and width")
    parser.add_argument("--width", type=int, help="image width if it differs from --size")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--channels", type=int, help="input channels (default: from INPUT_SHAPE, else 3)")
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--grid", type=parse_grid, help="tilec grid ROWSxCOLS (default 4x4)")
    parser.add_argument("--tilec-segments", type=parse_segments, metavar="FIRST:STOP@RxC[/B],...",
                        help="tilec with explicit fused segments instead of --grid, e.g. 0:17@16x16,17:31@4x4")
    parser.add_argument("--segments", type=int, help="checkpoint segments (default round(sqrt(#layers)))")
    parser.add_argument("--tiles-per-call", type=int, help="tilec: stack up to K tiles of one class per call")
    parser.add_argument("--checkpoint-modules", type=lambda text: text.split(","), metavar="NAME,...",
                        help="children to checkpoint for a non-Sequential model (default: those with >= 2 convs)")
    parser.add_argument("--budget", type=parse_bytes, help="memory budget for auto, e.g. 2GiB")
    parser.add_argument("--tile-size", type=int, default=2880, help="lightstream: its tiles' side (default 2880)")
    parser.add_argument("--grad", choices=("sum", "randn"), default="sum",
                        help="backward of out.sum() (default) or of a random output gradient")
    parser.add_argument("--allocator", choices=("pinned", "as-is", "heap"), default="pinned",
                        help="tilec/auto: the module pins glibc's mmap threshold (pinned, default), leaves "
                             "malloc as is, or keeps freed blocks below 32 MiB in the heap (heap)")
    parser.add_argument("--kernels", choices=KERNEL_CHOICES, default="auto",
                        help="tilec and auto: TiledModel's tile kernels (default auto; compiled: torch.compile, "
                             "whose compiling the first step's time includes)")
    parser.add_argument("--repeats", type=int, default=1, help="steps to time; step_s is the best (default 1)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--no-warmup", action="store_true", help="skip the tiny warm-up step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--busy", action="store_true",
                        help="CUDA: one more, profiled step for the share of wall time the GPU was busy")
    parser.add_argument("--autocast", choices=("bfloat16", "float16"),
                        help="run every step's forward under torch.autocast with this dtype (tilec plans for it)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)
    model, inputs = load_model(args.model, args.attr)
    channels = args.channels or (inputs[0][0][1] if inputs else 3)
    shape = (args.batch, channels, args.size, args.width or args.size)
    record = {
        "variant": args.variant,
        "model": args.model.stem,
        "size": args.size,
        "input_shape": list(shape),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "grad": args.grad,
        "autocast": args.autocast,
        "torch": torch.__version__,
        "host": platform.node(),
        "notes": [],
    }
    model = model.to(device)
    x = torch.randn(shape, device=device)  # images: no requires_grad; parameters as the model file has them
    if not args.no_warmup:
        warm_up(model, shape, device, args.autocast)
    try:
        fn, model = prepare(args, model, shape, record, device)
    except BudgetError as error:  # no plan fits: a result of the sweep, not a failure
        record["skipped"] = str(error)
        print(json.dumps(record), flush=True)
        return 0
    model.zero_grad(set_to_none=True)
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)

    with Meter(device) as meter:
        out_shape, out_checksum = one_step(fn, x, args.grad, generator, args.autocast)
    checksum = grad_checksum(model)  # outside the measurement
    meters = [meter]
    for _ in range(args.repeats - 1):
        model.zero_grad(set_to_none=True)
        with Meter(device) as later:
            one_step(fn, x, args.grad, generator, args.autocast)
        meters.append(later)
    times = [m.seconds for m in meters]
    best = meters[times.index(min(times))]
    busy = busy_seconds = None
    if args.busy and device.type == "cuda":
        model.zero_grad(set_to_none=True)
        busy, busy_seconds = gpu_busy(lambda: one_step(fn, x, args.grad, generator, args.autocast))

    record.update(
        peak_bytes=meter.growth,
        code_paged_in_bytes=getattr(meter, "file_growth", None),
        reserved_bytes=getattr(meter, "reserved_growth", None),
        last_peak_bytes=meters[-1].growth,
        last_reserved_bytes=getattr(meters[-1], "reserved_growth", None),
        step_s=min(times),
        first_step_s=times[0],
        cpu_s=best.cpu_seconds,
        cpus_s=[m.cpu_seconds for m in meters],
        cpu_stall_fraction=best.stalled,
        gpu_busy_fraction=busy,
        busy_step_s=busy_seconds,
        loadavg_1m=os.getloadavg()[0],
        times_s=times,
        memory_method=meter.method,
        baseline_bytes=meter.baseline,
        peak_abs_bytes=meter.peak,
        input_bytes=x.numel() * x.element_size(),
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        output_shape=list(out_shape),
        output_checksum=out_checksum,
        grad_checksum=checksum,
        pid=os.getpid(),
    )
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
