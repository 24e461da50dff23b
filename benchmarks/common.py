"""Shared by the benchmark scripts: one benchmark point per subprocess, results files, formatting,
the steps a child times and a driver's main."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "benchmarks" / "step.py"
RESULTS = ROOT / "benchmarks" / "results"
MiB = 2**20
#: Allocator settings of ``--malloc tuned`` (the default is the environment as users have it; the
#: generated module pins glibc's mmap threshold itself). Kept to compare with earlier tables: a
#: fixed threshold returns large blocks to the kernel on free; torch's transparent huge pages
#: (2 MiB, for blocks of 2 MiB and up) make the page faults of fresh blocks cheaper.
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "THP_MEM_ALLOC_ENABLE": "1"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def covered(intervals) -> float:
    """The length of the union of half-open intervals ``(start, stop)``: of a step's GPU
    activities, the time some kernel or copy ran."""
    total, reach = 0, -math.inf
    for start, stop in sorted(intervals):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total


def add_malloc_option(parser) -> None:
    parser.add_argument("--malloc", choices=("tuned", "default"), default="default",
                        help="allocator settings of every process: the environment as is (default) or tuned "
                             "(common.TUNED_MALLOC)")


@dataclass(frozen=True)
class Point:
    """One measurement to make: a model file, an image size and a variant with its options."""

    model: Path
    size: int
    variant: str
    grid: str | None = None  # tilec: one fused segment with this grid, or
    tilec_segments: str | None = None  # tilec: explicit segments FIRST:STOP@RxC[/B],...
    segments: int | None = None  # checkpoint
    budget: int | None = None  # auto
    malloc: str = "default"  # "default" (the environment as is) or "tuned" (TUNED_MALLOC)
    kernels: str = "auto"  # tilec and auto: TiledModel's tile kernels (tilec.runtime.device.KERNEL_CHOICES)
    extra: tuple[str, ...] = field(default_factory=tuple)

    @property
    def label(self) -> str:
        """Variant name as shown in tables: ``tilec 4x4``, ``auto 2.0 GiB``..."""
        if self.malloc == "tuned":
            return f"{replace(self, malloc='default').label}, tuned malloc"
        if self.kernels != "auto":
            return f"{replace(self, kernels='auto').label}, {self.kernels}"
        if self.variant == "tilec" and self.tilec_segments:
            return f"tilec {self.tilec_segments}"
        if self.variant == "tilec" and self.grid:
            return f"tilec {self.grid}"
        if self.variant == "auto" and self.budget:
            return f"auto {format_bytes(self.budget)}"
        return self.variant

    def argv(self) -> list[str]:
        argv = [sys.executable, str(STEP), "--model", str(self.model), "--size", str(self.size),
                "--variant", self.variant]
        if self.grid:
            argv += ["--grid", self.grid]
        if self.tilec_segments:
            argv += ["--tilec-segments", self.tilec_segments]
        if self.segments:
            argv += ["--segments", str(self.segments)]
        if self.budget:
            argv += ["--budget", str(self.budget)]
        if self.kernels != "auto":
            argv += ["--kernels", self.kernels]
        return argv + list(self.extra)

    def matches(self, record: dict) -> bool:
        """Is ``record`` (a JSON line from step.py) a measurement of this point?"""
        return (record.get("model") == self.model.stem and record.get("size") == self.size
                and record.get("variant") == self.variant and record.get("label") == self.label
                and record.get("extra", []) == list(self.extra))


def run_point(point: Point, timeout: float) -> dict:
    """Run step.py for ``point`` in its own process; return its JSON record (or an error record)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    for name in TUNED_MALLOC:
        env.pop(name, None)
    if point.malloc == "tuned":
        env.update(TUNED_MALLOC)
    base = {"model": point.model.stem, "size": point.size, "variant": point.variant, "label": point.label,
            "extra": list(point.extra), "command": " ".join(point.argv()[1:])}
    start = time.perf_counter()
    try:
        proc = subprocess.run(point.argv(), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**base, "error": f"timed out after {timeout:.0f} s", "timeout": True,
                "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raised = any(line.startswith("Traceback") for line in said)
        tail = said[-1:] if raised and said[-1][:1].strip() else said[-6:]  # the exception, else the tail
        reason = f"exit {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
        return {**base, "error": f"{reason}: " + " | ".join(tail), "wall_s": wall}
    return {**json.loads(lines[-1]), **base, "wall_s": wall}


def describe(record: dict) -> str:
    if "error" in record:
        return f"FAILED ({record['error'][:200]})"
    if "skipped" in record:
        return f"skipped ({record['skipped']})"
    return f"{record['peak_bytes'] / MiB:,.0f} MiB, {record['step_s']:.1f} s"


def reusable(point: Point, reuse: list[dict], max_stall: float | None) -> list[dict]:
    """Records of ``point`` that may be reused: not failed, and (with ``max_stall``) not measured
    while the machine was busy (CPU stall fraction above ``max_stall``)."""
    return [r for r in reuse if point.matches(r) and "error" not in r
            and (max_stall is None or (r.get("cpu_stall_fraction") or 0) <= max_stall)]


def measure(points: list[Point], timeout: float, reuse: list[dict] = (), max_stall: float | None = None) -> list[dict]:
    """Run every point one after another (never two at once), logging progress on stderr."""
    records = []
    for number, point in enumerate(points, 1):
        old = reusable(point, reuse, max_stall)
        where = f"[{number}/{len(points)}] {point.model.stem} {point.size}px {point.label}"
        if old:
            record = {**old[-1], "reused": True}
            log(f"{where}: reused {describe(record)}")
        else:
            log(f"{where} ...")
            record = run_point(point, timeout)
            log(f"{where}: {describe(record)} (process wall {record['wall_s']:.0f} s)")
        records.append(record)
    return records


def load_records(paths) -> list[dict]:
    records = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        records += data["records"] if isinstance(data, dict) else data
    return records


def environment(argv: list[str]) -> dict:
    """What the results depend on besides the code: the command, machine, versions, commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
    except OSError:
        commit = ""
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return {
        "command": " ".join(["python"] + [os.path.relpath(argv[0], ROOT)] + argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": commit,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory_total(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def memory_total() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def header(env: dict) -> str:
    device = env["cuda"] or f"CPU ({env['cpu']}, {env['cores']} cores, {format_bytes(env['memory_bytes'])} RAM)"
    return (f"Command: `{env['command']}`  \n"
            f"Date: {env['date']}, commit {env['commit'] or '?'}, torch {env['torch']}, python {env['python']}  \n"
            f"Device: {device}\n")


def write_results(name: str, markdown: str, payload: dict, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{name}.md", out_dir / f"{name}.json"
    md.write_text(markdown)
    js.write_text(json.dumps(payload, indent=1) + "\n")
    return md, js


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a is not None and b else "—"


def value(record: dict | None, key: str) -> float | None:
    if record is None or "error" in record or "skipped" in record:
        return None
    return record.get(key)


def grads_agree(record: dict, reference: dict | None, tolerance: float = 1e-4) -> str:
    """Compare the sum of |parameter gradients| with the reference process's (same seed)."""
    a, b = value(record, "grad_checksum"), value(reference, "grad_checksum")
    if a is None or b is None or record is reference:
        return "—"
    error = abs(a - b) / max(abs(b), 1e-30)
    return f"{'yes' if error <= tolerance else 'NO'} ({error:.0e})"


def timed_steps(model, tiled, inputs, repeats: int, warmup: int) -> tuple[list[float], object]:
    """Seconds of ``warmup + repeats`` steps of ``tiled`` (forward on ``inputs`` and ``out.sum()``'s
    backward, ``model``'s gradients cleared before each), the timed ones only, and the last output."""
    times = []
    for _ in range(repeats + warmup):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = tiled(*inputs)
        out.sum().backward()
        times.append(time.perf_counter() - start)
    return times[warmup:], out


def driver_main(args, run, drive, table) -> int:
    """A benchmark driver's ``main``: as a child (``args.run`` given), ``run(args)`` printed as one
    JSON line; else ``drive(args)``'s records, one JSON line each, then ``table`` of them."""
    if args.run is not None:
        print(json.dumps(run(args)))
        return 0
    records = drive(args)
    for record in records:
        print(json.dumps(record))
    print(table(records))
    return 0
