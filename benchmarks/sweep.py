"""Sweep image sizes: peak memory and step time of each variant, a table, a log-log plot, a budget report.

    python benchmarks/sweep.py --models examples/vgg16.py,examples/darknet19.py \\
        --sizes 256,512,1024,2048 --variants plain,checkpoint,tilec,auto --grid 8x8 --budget 2GiB

Each point runs in its own process (benchmarks/step.py), one after another. A point is skipped
when the previous size of the same variant predicts (quadratic growth in the image side) a peak
above --mem-limit or a process time above --timeout. ``auto`` plans for --budget.
Writes benchmarks/results/<name>.md, .json and .png.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import (
    ROOT,
    MiB,
    Point,
    add_malloc_option,
    describe,
    environment,
    format_bytes,
    header,
    load_records,
    log,
    memory_total,
    reusable,
    run_point,
    write_results,
)
from step import VARIANTS, parse_bytes, parse_grid


def series_points(args, model: Path) -> dict[str, list[Point]]:
    """Points of one model, per series (a line of the plot), in increasing size."""
    extra = ("--grad", args.grad, "--repeats", str(args.repeats))
    series = {}
    for variant in args.variants:
        if variant == "tilec" and args.tile:
            name = f"tilec tile {args.tile}px"
            series[name] = [Point(model, s, "tilec", grid="{0}x{0}".format(-(-s // args.tile)), extra=extra,
                                  malloc=args.malloc) for s in args.sizes]
        elif variant == "tilec":
            series[f"tilec {args.grid}"] = [Point(model, s, "tilec", grid=args.grid, extra=extra, malloc=args.malloc)
                                            for s in args.sizes]
        elif variant == "auto":
            for budget in args.budget:
                series[f"auto {format_bytes(budget)}"] = [Point(model, s, "auto", budget=budget, extra=extra,
                                                                malloc=args.malloc) for s in args.sizes]
        else:
            series[variant] = [Point(model, s, variant, segments=args.segments if variant == "checkpoint" else None,
                                     extra=extra, malloc=args.malloc) for s in args.sizes]
    return series


def predicted_skip(previous: dict | None, size: int, args) -> str | None:
    """Why to skip ``size``, judging from the previous (smaller) point of the same series."""
    if previous is None:
        return None
    if "error" in previous or "skipped" in previous:
        return f"skipped: {previous['size']}px already {'failed' if 'error' in previous else 'skipped'}"
    scale = (size / previous["size"]) ** 2
    memory = previous["baseline_bytes"] + previous["peak_bytes"] * scale
    if memory > args.mem_limit:
        return f"skipped: predicted {format_bytes(memory)} > --mem-limit {format_bytes(args.mem_limit)}"
    seconds = previous["wall_s"] + (previous["step_s"] * len(previous["times_s"])) * (scale - 1)
    if seconds > args.timeout:
        return f"skipped: predicted {seconds:.0f} s > --timeout {args.timeout:.0f} s"
    return None


def sweep(args) -> list[dict]:
    reuse = load_records(args.reuse)
    records = []
    plan = {model: series_points(args, model) for model in args.models}
    total = sum(len(points) for series in plan.values() for points in series.values())
    number = 0
    for model, series in plan.items():
        for name, points in series.items():
            previous = None
            for point in points:
                number += 1
                where = f"[{number}/{total}] {model.stem} {point.size}px {name}"
                old = reusable(point, reuse, args.max_stall)
                why = None if old else predicted_skip(previous, point.size, args)
                if old:
                    record = {**old[-1], "reused": True}
                    log(f"{where}: reused {describe(record)}")
                elif why:
                    record = {"model": model.stem, "size": point.size, "variant": point.variant,
                              "label": point.label, "skipped": why}
                    log(f"{where}: {why}")
                else:
                    log(f"{where} ...")
                    record = run_point(point, args.timeout)
                    log(f"{where}: {describe(record)} (process wall {record['wall_s']:.0f} s)")
                record["series"] = name
                records.append(record)
                previous = record
    return records


def ok(record: dict) -> bool:
    return "error" not in record and "skipped" not in record


def cell(record: dict) -> str:
    if "error" in record:
        return "failed" + (" (timeout)" if record.get("timeout") else "")
    if "skipped" in record:
        return "—"
    busy = "*" if (record.get("cpu_stall_fraction") or 0) > 0.2 else ""
    guess = record.get("predicted_peak_bytes")
    error = f" (predicted {(guess - record['peak_bytes']) / record['peak_bytes']:+.0%})" if guess else ""
    return f"{record['peak_bytes'] / MiB:,.0f} MiB{error} / {record['step_s']:.1f} s{busy}"


def tables(records: list[dict], args) -> str:
    out = []
    for model in dict.fromkeys(r["model"] for r in records):
        rows = [r for r in records if r["model"] == model]
        names = list(dict.fromkeys(r["series"] for r in rows))
        out.append(f"## {model}: peak memory / step wall time\n")
        out.append("| image | " + " | ".join(names) + " |")
        out.append("|---|" + "--:|" * len(names))
        for size in sorted({r["size"] for r in rows}):
            by = {r["series"]: r for r in rows if r["size"] == size}
            out.append(f"| {size}² | " + " | ".join(cell(by[n]) if n in by else "" for n in names) + " |")
        out.append("")
    if any(ok(r) and (r.get("cpu_stall_fraction") or 0) > 0.2 for r in records):
        out.append("\\* the machine was busy during this step (CPU stall > 20 %, see step.py): its time is inflated.\n")
    names = list(dict.fromkeys(r["series"] for r in records))
    out.append("## Largest image trained within a budget (step peak memory)\n")
    out.append("| model | budget | " + " | ".join(names) + " |")
    out.append("|---|--:|" + "--:|" * len(names))
    for model in dict.fromkeys(r["model"] for r in records):
        for budget in args.budget:
            cells = []
            for name in names:
                rows = sorted((r for r in records if r["model"] == model and r["series"] == name),
                              key=lambda r: r["size"])
                cells.append(largest_within(rows, budget))
            out.append(f"| {model} | {format_bytes(budget)} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("\"≥ N\": N was the largest size measured for that variant (larger ones were not run); "
               "\"< N\": already the smallest size measured, N, exceeded the budget.")
    out.append("")
    return "\n".join(out)


def largest_within(rows: list[dict], budget: int) -> str:
    measured = [r for r in rows if ok(r)]
    if not measured:
        return "n/a"
    fits = [r for r in measured if r["peak_bytes"] <= budget]
    if not fits:
        return f"< {measured[0]['size']}²"
    best = max(r["size"] for r in fits)
    larger = [r for r in rows if r["size"] > best]
    if any(ok(r) for r in larger):
        return f"{best}²"
    return f"≥ {best}²"


def plot(records: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    models = list(dict.fromkeys(r["model"] for r in records))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.8), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [r for r in records if r["model"] == model]
        for name in dict.fromkeys(r["series"] for r in rows):
            points = sorted((r for r in rows if r["series"] == name and ok(r)), key=lambda r: r["size"])
            if points:
                ax.plot([r["size"] for r in points], [r["peak_bytes"] / MiB for r in points], marker="o", label=name)
        for budget in args.budget:
            ax.axhline(budget / MiB, color="grey", linestyle="--", linewidth=1)
            ax.annotate(f"budget {format_bytes(budget)}", (min(r["size"] for r in rows), budget / MiB),
                        fontsize=7, color="grey", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["size"] for r in rows})
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.minorticks_off()
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("image side (px)")
        ax.set_ylabel("peak memory of one training step (MiB)")
        ax.set_title(f"{model}, float32, batch 1")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="examples/vgg16.py,examples/darknet19.py", help="comma-separated")
    parser.add_argument("--sizes", default="256,512,1024,2048", help="comma-separated image sides")
    parser.add_argument("--variants", default="plain,checkpoint,tilec,auto", help=f"comma-separated of {VARIANTS}")
    parser.add_argument("--grid", default="8x8", help="tilec's fixed grid (default 8x8)")
    parser.add_argument("--tile", type=int, help="instead of a fixed grid: tiles of at most this many px per side")
    parser.add_argument("--segments", type=int, help="checkpoint segments (default round(sqrt(#layers)))")
    parser.add_argument("--budget", default="2GiB",
                        help="memory budgets, comma-separated: one auto series each, and the largest-size report "
                             "(default 2GiB)")
    add_malloc_option(parser)
    parser.add_argument("--mem-limit", type=parse_bytes, default=int(0.8 * memory_total()),
                        help="skip points predicted to need more (default 80%% of RAM)")
    parser.add_argument("--timeout", type=float, default=540, help="seconds per process (default 540)")
    parser.add_argument("--grad", choices=("sum", "randn"), default="sum")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--reuse", nargs="*", default=[], help="JSON results whose matching points are reused")
    parser.add_argument("--max-stall", type=float,
                        help="with --reuse: re-measure points whose CPU stall fraction exceeded this (e.g. 0.2)")
    parser.add_argument("--name", default="sweep", help="results file stem (default sweep)")
    args = parser.parse_args(argv)
    args.models = [(Path.cwd() / m).resolve() for m in args.models.split(",")]
    args.sizes = sorted(int(s) for s in args.sizes.split(","))
    args.variants = args.variants.split(",")
    args.budget = [parse_bytes(budget) for budget in args.budget.split(",")]
    parse_grid(args.grid)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")

    env = environment(sys.argv)
    records = sweep(args)
    png = ROOT / "benchmarks" / "results" / f"{args.name}.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(records, args, png)
    skipped = sorted({f"{r['model']} {r['size']}px {r['series']}: {r['skipped']}" for r in records
                      if "skipped" in r and not r["skipped"].startswith("skipped: ")} |
                     {f"{r['model']} {r['size']}px {r['series']}: {r['skipped'][9:]}" for r in records
                      if "skipped" in r and r["skipped"].startswith("skipped: ")})
    failed = [f"{r['model']} {r['size']}px {r['series']}: {r['error']}" for r in records if "error" in r]
    reused = sorted({f"{r['model']} {r['size']}px {r['series']}" for r in records if r.get("reused")})
    lines = ["# Sweep: peak memory vs image size\n", header(env), tables(records, args),
             f"Plot: `benchmarks/results/{png.name}`\n", "## Notes\n"]
    lines += [f"- failed: {f}" for f in failed]
    lines += [f"- not run: {s}" for s in skipped]
    if reused:
        lines.append(f"- reused from {', '.join(args.reuse)}: {'; '.join(reused)}")
    lines.append("- peak memory: growth of the process (VmHWM reset via /proc/self/clear_refs, minus VmRSS "
                 "before the step) during one training step; input, parameters and tilec module exist before "
                 "and are not counted, parameter gradients are. Step time: wall time of that step.")
    markdown = "\n".join(lines) + "\n"
    md, js = write_results(args.name, markdown, {"environment": env, "records": records})
    print(markdown)
    log(f"wrote {md.relative_to(ROOT)}, {js.relative_to(ROOT)}, {png.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
