"""Slides of several sizes on one plan: each slide framed to one size (``Slide.framed``) against the
same slide on a plan of its own size.

    python benchmarks/frames.py --model examples/resnet50.py --frame 2048 --sides 2048 1536 1024 \\
        --budget 1GiB --repeats 1

The model file's ``model()`` is wrapped to read a uint8 slide and convert it itself
(``benchmarks.background.Slide``). Per side ``S`` the driver writes a textured (H, W, 3) uint8
``.npy`` slide of ``S`` pixels a side (random pixels, no background) and plans the model
(``--budget`` bytes, or ``--grid RxC``) once for the ``--frame`` size and once for each other side,
timing each compile (trace, plan, render). Each slide then runs in a process of its own twice: framed
(``tilec.slide(npy).framed(F, F)``, the padding white) on the frame's plan, and as it is on its own
plan; each process times ``--repeats`` steps (forward and ``out.sum()``'s backward; the best is
reported, after ``--warmup`` untimed ones). Each child prints one JSON line: ``step_s`` (best),
``steps_s`` (all), the tiles ran and reused in the last step (``TiledModel.reuse``) and the
output. The driver prints a table: per side, the padding's share of the frame, both steps and
their ratio, and the compile each plan took.
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
from benchmarks.step import parse_bytes, parse_grid  # noqa: E402
from tilec.codegen import load_source, render  # noqa: E402
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


def compiled(args, side: int, folder: Path) -> tuple[Path, float]:
    """The module of the model planned for a ``side``² uint8 input, and the seconds its compile took."""
    start = time.perf_counter()
    model = slide_model(args.model)
    graph = trace(model, [((1, 3, side, side), "uint8")])
    plan = plan_for(graph, target_for(graph, "float32"), "frames", grid=args.grid, memory_budget=args.budget)
    module = folder / f"frames_{side}_tiled.py"
    module.write_text(render(plan))
    return module, time.perf_counter() - start


def run(args) -> dict:
    """One slide's steps in this process (``--run``), framed to ``--frame`` where given."""
    model = slide_model(args.model)
    tiled = load_source(args.run.read_text(), "frames_tiled").TiledModel(model)
    image = slide(args.slide)
    image = image.framed(args.frame, args.frame) if args.frame else image
    times = []
    for _ in range(args.repeats + args.warmup):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = tiled(image)
        out.sum().backward()
        times.append(time.perf_counter() - start)
    timed = times[args.warmup:]
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
        framed_module, framed_compile = compiled(args, args.frame, folder)
        for side in args.sides:
            npy = folder / f"slide_{side}.npy"
            write_slide(npy, side)
            own_module, own_compile = (framed_module, framed_compile) if side == args.frame else compiled(
                args, side, folder)
            framed, own = child(args, framed_module, npy, args.frame), child(args, own_module, npy, None)
            records.append({"side": side, "frame": args.frame, "framed": framed, "own": own,
                            "framed_compile_s": round(framed_compile, 1), "own_compile_s": round(own_compile, 1)})
            npy.unlink()
    return records


def table(records: list[dict]) -> str:
    lines = ["| slide | padding | step, own plan (s) | step, framed (s) | framed / own | tiles reused, framed | "
             "compile, own plan (s) |", "|---|--:|--:|--:|--:|--:|--:|"]
    for r in records:
        padding = 1 - min(r["side"], r["frame"]) ** 2 / r["frame"] ** 2
        framed, own = r["framed"], r["own"]
        lines.append(f"| {r['side']}² | {padding:.0%} | {own['step_s']:.1f} | {framed['step_s']:.1f} | "
                     f"{framed['step_s'] / own['step_s']:.2f} | {framed['tiles_reused']} of "
                     f"{framed['tiles_ran'] + framed['tiles_reused']} | {r['own_compile_s']} |")
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
    args = parse_args(argv)
    if args.run is not None:
        print(json.dumps(run(args)))
        return 0
    records = drive(args)
    for record in records:
        print(json.dumps(record))
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
