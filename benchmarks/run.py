"""Compare plain PyTorch, checkpointing, Lightstream and tilec on one model: one training step each.

    python benchmarks/run.py --model examples/vgg16.py --sizes 1024,2048 --grid 4x4,8x8 \\
        --variants plain,checkpoint,tilec --name vgg16_cpu

Each variant and size runs in its own process (benchmarks/step.py), one after another. Prints a
markdown table (peak memory, step time, tilec/plain and tilec/checkpoint ratios, all from this
run) and writes it to benchmarks/results/<name>.md, with the raw JSON in <name>.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import (
    ROOT,
    TUNED_MALLOC,
    MiB,
    Point,
    add_malloc_option,
    environment,
    grads_agree,
    header,
    load_records,
    log,
    measure,
    ratio,
    value,
    write_results,
)
from step import KERNEL_CHOICES, VARIANTS, parse_bytes


def budget_bytes(budget: str, measured: dict) -> int | None:
    """``--budget``: bytes (``600MiB``), a share of plain's measured peak at that size (``10%``),
    or ``lightstream``: Lightstream's measured peak there (None where it failed: no point)."""
    if budget == "lightstream":
        record = measured.get("lightstream")
        if record is None:
            raise SystemExit("--budget lightstream needs a lightstream measurement of that size (--variants ...)")
        return record.get("peak_bytes")
    if not budget.endswith("%"):
        return parse_bytes(budget)
    plain = measured.get("plain")
    if plain is None or "peak_bytes" not in plain:
        raise SystemExit(f"--budget {budget} needs a plain measurement of that size (--variants plain,...)")
    return int(plain["peak_bytes"] * float(budget[:-1]) / 100)


def point(args, size: int, variant: str, **options) -> Point:
    """One point of this run: the run's model, step options and allocator unless overridden."""
    extra = (*(("--attr", args.attr) if args.attr != "model" else ()), *(("--batch", str(args.batch)) if args.batch != 1
                                                                         else ()), "--grad", args.grad,
             "--repeats", str(args.repeats), *(("--busy",) if args.busy else ()),
             *(("--autocast", args.autocast) if args.autocast else ()),
             *(("--tile-size", str(args.tile_size)) if variant == "lightstream" else ()))
    return Point(args.model, size, variant, extra=extra, **{"malloc": args.malloc, **options})


#: Variants measured first at each size: the others' budgets may be shares of their peaks.
FIRST = ("plain", "lightstream")


def points(args, size: int, measured: dict) -> list[Point]:
    """The points of one image size but ``FIRST``'s; ``measured``: their records by variant."""
    result = []
    for variant in args.variants:
        if variant == "tilec":
            result += [point(args, size, "tilec", grid=grid, kernels=kernels)
                       for grid in args.grid for kernels in args.kernels]
            result += [point(args, size, "tilec", tilec_segments=segments, kernels=kernels)
                       for segments in args.tilec_segments for kernels in args.kernels]
        elif variant == "auto":
            budgets = [budget_bytes(budget, measured) for budget in args.budget]
            result += [point(args, size, "auto", budget=budget, malloc=malloc, kernels=kernels)
                       for budget in budgets if budget for malloc in args.auto_malloc for kernels in args.kernels]
        elif variant == "checkpoint":
            result.append(point(args, size, "checkpoint", segments=args.segments))
    return result


def table(records: list[dict]) -> str:
    """One row per record; on CUDA the peak is ``max_memory_allocated``'s growth, a column after it
    gives ``max_memory_reserved``'s (first step / last step), and two after the step's wall time its
    megapixels per second and the share of a profiled step's wall time the GPU was busy (``--busy``)."""
    cuda = any(r.get("reserved_bytes") is not None for r in records)
    lines = [
        "| image | variant | peak memory (MiB) | " + ("reserved, first / last (MiB) | " if cuda else "")
        + "code paged in (MiB) | later step (MiB) | predicted (MiB) "
        "| step wall (s) | " + ("Mpx/s | GPU busy | " if cuda else "")
        + "step CPU (s) | memory / plain | wall / plain | CPU / plain | memory / checkpoint "
        "| wall / checkpoint | CPU / checkpoint | CPU stall | grads = plain's |",
        "|---|---|--:|" + ("--:|" if cuda else "") + "--:|--:|--:|--:|" + ("--:|--:|" if cuda else "")
        + "--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for size in sorted({r["size"] for r in records}):
        rows = [r for r in records if r["size"] == size]
        plain = next((r for r in rows if r["variant"] == "plain"), None)
        ckpt = next((r for r in rows if r["variant"] == "checkpoint"), None)
        for r in rows:
            label = r["label"]
            if r["variant"] == "checkpoint" and "segments" in r:
                label += f" ({r['segments']} segments)"
            if "error" in r or "skipped" in r:
                why = r.get("error") or r.get("skipped")
                lines.append(f"| {size}² | {label} | {'failed' if 'error' in r else 'skipped'}: {why} "
                             + "| " * (16 if cuda else 13) + "|")
                continue
            mem, sec, cpu = r["peak_bytes"], r["step_s"], r.get("cpu_s")
            vs_plain = r["variant"] != "plain"
            vs_ckpt = r["variant"] in ("tilec", "auto")
            stall = r.get("cpu_stall_fraction")
            reserved = f"{mebibytes(r.get('reserved_bytes'))} / {mebibytes(r.get('last_reserved_bytes'))}"
            busy = r.get("gpu_busy_fraction")
            device = [f"{size * size / sec / 1e6:.1f}", f"{busy:.0%}" if busy is not None else "—"]
            cells = [
                f"{size}²", label, f"{mem / MiB:,.0f}",
                *([reserved] if cuda else []),
                mebibytes(r.get("code_paged_in_bytes")),
                mebibytes(r.get("last_peak_bytes")) if vs_ckpt and len(r.get("times_s", [])) > 1 else "", predicted(r),
                f"{sec:.1f}",
                *(device if cuda else []),
                f"{cpu:.1f}" if cpu is not None else "—",
                ratio(mem, value(plain, "peak_bytes")) if vs_plain else "",
                ratio(sec, value(plain, "step_s")) if vs_plain else "",
                ratio(cpu, value(plain, "cpu_s")) if vs_plain else "",
                ratio(mem, value(ckpt, "peak_bytes")) if vs_ckpt else "",
                ratio(sec, value(ckpt, "step_s")) if vs_ckpt else "",
                ratio(cpu, value(ckpt, "cpu_s")) if vs_ckpt else "",
                f"{stall:.0%}" if stall is not None else "—",
                grads_agree(r, plain) if vs_plain else "",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mebibytes(count: int | None) -> str:
    return "—" if count is None else f"{count / MiB:,.0f}"


def predicted(record: dict) -> str:
    """tilec's predicted peak of a first step and the first step as a multiple of it; with later
    steps, the last as a multiple of the prediction less the kernel state the first one created."""
    if "predicted_peak_bytes" not in record:
        return ""
    guess = record["predicted_peak_bytes"]
    text = f"{guess / MiB:,.0f} (first {record['peak_bytes'] / guess:.2f}x"
    if len(record.get("times_s", [])) > 1:
        later = guess - record.get("kernel_state_bytes", 0)
        text += f", later {record['last_peak_bytes'] / later:.2f}x"
    return text + ")"


def notes(records: list[dict]) -> str:
    seen, out = set(), []
    for r in records:
        if r["variant"] == "auto" and "plan_segments" in r:
            estimate = ""
            if "estimated_seconds" in r and "step_s" in r:
                guess = r["estimated_seconds"]
                estimate = f", estimated step {guess:.1f} s (measured {r['step_s'] / guess:.2f}x)"
            out.append(f"- {r['size']}² {r['label']}: chose segments {', '.join(r['plan_segments'])} "
                       f"(FIRST:STOP@grid/tiles per call), planning took {r['build_s']:.1f} s{estimate}")
    out.append("- malloc: every process runs in the environment as is (no allocator variables; tilec's module "
               "pins glibc's mmap threshold itself) unless its label says tuned malloc: "
               + ", ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items()))
    for r in records:
        for note in r.get("notes", []):
            if note not in seen:
                seen.add(note)
                out.append(f"- {note}")
    methods = sorted({r["memory_method"] for r in records if "memory_method" in r})
    out.append(f"- peak memory: growth of the process's resident memory during the first step over its state "
               f"just before it (model, input and tilec module built, tiny warm-up done); method: "
               f"{', '.join(methods)} (see benchmarks/step.py). Code paged in: library code the first step "
               f"ran for the first time (growth of RssFile; file-backed, shared, not data). Later step (tilec): "
               f"the same measurement of the last step. Predicted: the plan's predicted peak of a first step, "
               f"with the kernel state it creates and keeps (oneDNN's compiled kernels); the first step is "
               f"compared with it, a later step with it less that state. Plain and checkpoint are shown by "
               f"their first step: their later steps reuse what glibc's heap kept from the first")
    if "cuda-allocated" in methods:
        out.append("- on CUDA, peak memory is the growth of torch.cuda.max_memory_allocated() during the step "
                   "(memory_allocated() before it as the baseline), and reserved the same of "
                   "max_memory_reserved(): the caching allocator's segments")
    repeats = sorted({len(r["times_s"]) for r in records if "times_s" in r})
    out.append(f"- step time: wall time, best of {'/'.join(map(str, repeats))} step(s); float32; "
               f"backward of {records[0].get('grad', 'out.sum()') if records else ''}")
    out.append("- step CPU: user+system CPU time of the process during that (fastest) step (all threads); CPU "
               "stall: share of its wall time during which some task on the machine waited for a CPU "
               "(/proc/pressure/cpu); high values mean the machine was shared and wall times are inflated")
    reused = [f"{r['size']}² {r['label']}" for r in records if r.get("reused")]
    if reused:
        out.append(f"- reused from an earlier run (--reuse): {', '.join(reused)}")
    out.append("- grads = plain's: relative difference of sum|param grads| against the plain process "
               "(same seed, separate processes)")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("examples/vgg16.py"))
    parser.add_argument("--attr", default="model", help="attribute of the model file (default: model)")
    parser.add_argument("--tile-size", type=int, default=2880, help="lightstream's tiles' side (default 2880)")
    parser.add_argument("--sizes", default="1024,2048", help="comma-separated image sizes (square)")
    parser.add_argument("--grid", default="4x4", help="tilec grid(s), comma-separated, e.g. 4x4,8x8")
    parser.add_argument("--tilec-segments", action="append", default=[], metavar="FIRST:STOP@RxC[/B],...",
                        help="also run tilec with these explicit segments (repeatable), e.g. 0:17@16x16,17:31@4x4")
    parser.add_argument("--variants", default="plain,checkpoint,tilec", help=f"comma-separated of {VARIANTS}")
    parser.add_argument("--segments", type=int, help="checkpoint segments (default round(sqrt(#layers)))")
    parser.add_argument("--budget", default="10%",
                        help="auto's memory budget(s), comma-separated: bytes (600MiB), a share of plain's "
                             "measured peak at each size (10%%, the default) or lightstream (its measured peak)")
    add_malloc_option(parser)
    parser.add_argument("--auto-malloc", help="auto's allocator settings, comma-separated (default: --malloc), "
                                              "e.g. tuned,default to show both")
    parser.add_argument("--kernels", default="auto",
                        help=f"tilec's and auto's tile kernels, comma-separated of {', '.join(KERNEL_CHOICES)} "
                             "(TiledModel(kernels=...); default auto)")
    parser.add_argument("--batch", type=int, default=1, help="images per step (a training-mode BatchNorm of a "
                        "pooled map needs two)")
    parser.add_argument("--grad", choices=("sum", "randn"), default="sum")
    parser.add_argument("--repeats", type=int, default=1, help="steps timed per process (best is shown)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process (default 600)")
    parser.add_argument("--autocast", choices=("bfloat16", "float16"),
                        help="every variant's forward under torch.autocast with this dtype (tilec plans for it)")
    parser.add_argument("--busy", action="store_true",
                        help="CUDA: each process also profiles one step for the share of time the GPU was busy")
    parser.add_argument("--reuse", nargs="*", default=[], help="JSON results whose matching points are reused")
    parser.add_argument("--max-stall", type=float,
                        help="with --reuse: re-measure points whose CPU stall fraction exceeded this (e.g. 0.2)")
    parser.add_argument("--name", help="results file stem (default <model>_<variants>)")
    args = parser.parse_args(argv)
    args.model = args.model if args.model.is_absolute() else (Path.cwd() / args.model).resolve()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.grid = [g for g in args.grid.split(",") if g]
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    args.budget = args.budget.split(",")
    args.auto_malloc = (args.auto_malloc or args.malloc).split(",")
    args.kernels = args.kernels.split(",")
    if set(args.kernels) - set(KERNEL_CHOICES):
        parser.error(f"unknown kernels in --kernels {','.join(args.kernels)}; choose from {', '.join(KERNEL_CHOICES)}")
    reuse = load_records(args.reuse)  # read before the results file may be overwritten
    name = args.name or f"{args.model.stem}_cpu"

    env = environment(sys.argv)
    records = []
    for size in args.sizes:
        measured = {}
        for variant in (v for v in FIRST if v in args.variants):
            records += measure([point(args, size, variant)], args.timeout, reuse, args.max_stall)
            measured[variant] = records[-1]
        records += measure(points(args, size, measured), args.timeout, reuse, args.max_stall)
    markdown = (f"# {args.model.stem}: one training step\n\n{header(env)}\n{table(records)}\n{notes(records)}")
    md, js = write_results(name, markdown, {"environment": env, "records": records})
    print(markdown)
    log(f"wrote {md.relative_to(ROOT)} and {js.relative_to(ROOT)}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
