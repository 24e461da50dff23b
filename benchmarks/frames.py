"""Slides of several sizes: each on a plan searched for its size, on a plan of its size made
``like`` the largest's (no search), and framed to the largest size (``Slide.framed``) on its plan.

    python benchmarks/frames.py --model examples/resnet50.py --frame 2048 --sides 2048 1536 1024 \\
        --budget 1GiB --repeats 1

The model file's ``model()`` is wrapped to read a uint8 slide and convert it itself
(``benchmarks.background.Slide``). The driver plans the model for a ``--frame``² uint8 input
(``--budget`` bytes, or ``--grid RxC``), then per side ``S`` writes a textured (H, W, 3) uint8
``.npy`` slide of ``S`` pixels a side (random pixels, no background) and plans the model for it
twice: by the search, and like the frame's plan (its segments in input pixels, and its recomputed
nodes: ``tilec.compile(..., like=)``; with a budget, the search where they do not fit it), timing
each compile (trace, plan, render). Each slide then runs in a process of its own per variant: on
its searched plan, on its ``like`` plan, and framed (``tilec.slide(npy).framed(F, F)``, the padding
white) on the frame's plan; each process times ``--repeats`` steps (forward and ``out.sum()``'s
backward; the best is reported, after ``--warmup`` untimed ones) and prints one JSON line:
``step_s`` (best), ``steps_s`` (all), the tiles ran and reused in the last step
(``TiledModel.reuse``) and the output. The driver prints a table: per side, the padding's share
of the frame, each variant's step and compile, and each step's ratio to the searched plan's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.background import slide_model  # noqa: E402
from benchmarks.common import driver_main, timed_steps  # noqa: E402
from benchmarks.step import parse_bytes, parse_grid  # noqa: E402
from tilec.codegen import load_source, render  # noqa: E402
from tilec.ir import segments_text  # noqa: E402
from tilec.pipeline import plan_for, target_for  # noqa: E402
from tilec.slides import slide  # noqa: E402
from tilec.trace import trace  # noqa: E402


def write_slide(path: Path, side: int) -> None:
    """A ``side`` x ``side`` x 3 uint8 slide of random pixels (the seed of its side), band by band."""
    image = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(side, side, 3))
    rng = np.random.default_rng(side)
    for start in range(0, side, 1024):
        stop = min(side, start + 1024)
        image[start:stop] = rng.integers(0, 256, (stop - start, side, 3), dtype=np.uint8)
    image.flush()


def compiled(args, side: int, folder: Path, label: str, like=None) -> tuple[Path, float, object]:
    """The module of the model planned for a ``side``² uint8 input (``like``: ``plan_for``'s), the
    seconds its compile took and its plan."""
    start = time.perf_counter()
    model = slide_model(args.model)
    graph = trace(model, [((1, 3, side, side), "uint8")])
    plan = plan_for(graph, target_for(graph, "float32"), "frames", grid=None if like else args.grid,
                    memory_budget=args.budget, like=like)
    module = folder / f"frames_{side}_{label}_tiled.py"
    module.write_text(render(plan))
    return module, time.perf_counter() - start, plan


def run(args) -> dict:
    """One slide's steps in this process (``--run``), framed to ``--frame`` where given."""
    model = slide_model(args.model)
    tiled = load_source(args.run.read_text(), "frames_tiled").TiledModel(model)
    image = slide(args.slide)
    image = image.framed(args.frame, args.frame) if args.frame else image
    timed, out = timed_steps(model, tiled, (image,), args.repeats, args.warmup)
    return {"step_s": min(timed), "steps_s": timed, "tiles_ran": tiled.reuse.ran,
            "tiles_reused": tiled.reuse.reused, "output": out.detach().flatten().tolist()[:4]}


def child(args, module: Path, npy: Path, frame: int | None) -> dict:
    command = [sys.executable, __file__, "--model", str(args.model), "--repeats", str(args.repeats),
               "--warmup", str(args.warmup), "--run", str(module), "--slide", str(npy)]
    command += ["--frame", str(frame)] if frame else []
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def drive(args) -> list[dict]:
    records = []
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        framed_module, framed_compile, frame_plan = compiled(args, args.frame, folder, "frame")
        like = frame_plan.planned_as()
        for side in args.sides:
            npy = folder / f"slide_{side}.npy"
            write_slide(npy, side)
            record = {"side": side, "frame": args.frame, "frame_segments": like[0]}
            if side == args.frame:
                searched = like_plan = (framed_module, framed_compile, frame_plan)
            else:
                searched = compiled(args, side, folder, "searched")
                like_plan = compiled(args, side, folder, "like", like=like)
            for label, (module, seconds, plan) in (("searched", searched), ("like", like_plan)):
                record[label] = child(args, module, npy, None)
                record[label].update(compile_s=round(seconds, 1), segments=segments_text(plan.segments),
                                     predicted_mib=round(plan.predicted_peak_bytes / 2**20))
            record["framed"] = child(args, framed_module, npy, args.frame)
            records.append(record)
            npy.unlink()
    return records


def table(records: list[dict]) -> str:
    lines = ["| slide | padding | searched: step (s) | compile (s) | like: step (s) | / searched | compile (s) "
             "| framed: step (s) | / searched | tiles reused |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in records:
        padding = 1 - min(r["side"], r["frame"]) ** 2 / r["frame"] ** 2
        searched, like, framed = r["searched"], r["like"], r["framed"]
        lines.append(f"| {r['side']}² | {padding:.0%} | {searched['step_s']:.1f} | {searched['compile_s']} | "
                     f"{like['step_s']:.1f} | {like['step_s'] / searched['step_s']:.2f} | {like['compile_s']} | "
                     f"{framed['step_s']:.1f} | {framed['step_s'] / searched['step_s']:.2f} | "
                     f"{framed['tiles_reused']} of {framed['tiles_ran'] + framed['tiles_reused']} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a model file with model()")
    parser.add_argument("--frame", type=int, help="the frame's side in pixels")
    parser.add_argument("--sides", type=int, nargs="+", default=[2048, 1536, 1024], help="the slides' sides")
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--budget", type=parse_bytes, help="plan for this memory budget (e.g. 1GiB)")
    how.add_argument("--grid", type=parse_grid, help="plan one tiled segment of this grid (ROWSxCOLS)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)  # a child: the rendered module
    parser.add_argument("--slide", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run is None and (args.frame is None or (args.budget is None and args.grid is None)):
        parser.error("give --frame and one of --budget or --grid")
    return args


def main(argv=None) -> int:
    return driver_main(parse_args(argv), run, drive, table)


if __name__ == "__main__":
    sys.exit(main())
