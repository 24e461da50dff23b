"""Background tiles computed once: one plan, a slide mostly background against the same slide textured.

    python benchmarks/background.py --model examples/resnet50.py --size 8192 --budget 4GiB \\
        --backgrounds 0 0.7 --repeats 2 [--known 0.7] [--warmup 0]

The model file's ``model()`` is wrapped to read a uint8 slide and convert it itself
(``image.to(float32) / 255``). The driver plans it once (``--budget`` bytes, or ``--grid RxC``) for
a (1, 3, size, size) uint8 input and renders the module once; then, per background fraction ``f``,
it writes a uint8 ``.npy`` slide: random texture (the same seed for every fraction) whose right
``f`` of the columns are set to one colour, touching the top, right and bottom borders; and it runs
each fraction in a process of its own (``--run``), which memory-maps the slide, builds the
``TiledModel`` from the rendered module and times ``--repeats`` steps (forward and ``out.sum()``'s
backward; the best is reported, after ``--warmup`` untimed steps that size the arenas). With
``--known F`` the one plan is chosen (``--budget``) or estimated knowing where the slide of fraction
``F`` is background (``tilec.cost.background``: the estimate counts the tiles computed once), as
``tilec.compile`` plans for a masked slide, and every fraction runs that plan. ``--segments`` takes
the segments a driver printed (``FIRST:STOP@ROWSxCOLS[/BATCH],...``, as ``tilec compile`` takes
them) instead of a search; ``--folder`` keeps the module and the last slide there. Each child prints
one JSON line: ``step_s`` (best), ``steps_s`` (all), the tiles ran and reused in the last step
(``TiledModel.reuse``) and the output checksum; the driver adds the plan's segments and estimate.
It prints a table with each step's ratio to the first fraction's (give 0 first: the textured slide).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import driver_main, timed_steps  # noqa: E402
from benchmarks.step import import_file, parse_bytes, parse_grid, parse_segments  # noqa: E402
from tilec.codegen import load_source, render  # noqa: E402
from tilec.cost.background import Background  # noqa: E402
from tilec.ir import segments_text  # noqa: E402
from tilec.pipeline import plan_for, target_for  # noqa: E402
from tilec.trace import trace  # noqa: E402

BACKGROUND = (242, 240, 245)


class Slide(nn.Module):
    """``model`` reading a uint8 slide, which it converts itself."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, image):
        return self.model(image.to(torch.float32) / 255)


def slide_model(path: Path) -> nn.Module:
    torch.manual_seed(0)
    return Slide(import_file(path).model())


def write_slide(path: Path, size: int, background: float) -> None:
    """A (1, 3, size, size) uint8 slide, textured, with its right ``background`` of the columns one colour."""
    slide = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(1, 3, size, size))
    rng = np.random.default_rng(0)
    first = size - round(background * size)
    for start in range(0, size, 1024):  # band by band: no full-size temporary
        stop = min(size, start + 1024)
        slide[0, :, start:stop] = rng.integers(0, 256, (3, stop - start, size), dtype=np.uint8)
        slide[0, :, start:stop, first:] = np.array(BACKGROUND, dtype=np.uint8)[:, None, None]
    slide.flush()


def run(args) -> dict:
    """One fraction's steps in this process (``--run``)."""
    model = slide_model(args.model)
    tiled = load_source(args.run.read_text(), "background_tiled").TiledModel(model)
    image = np.load(args.slide, mmap_mode="r")
    timed, out = timed_steps(model, tiled, (image,), args.repeats, args.warmup)
    reuse = getattr(tiled, "reuse", None)  # None: a module rendered before tiles were reused
    return {"background": args.background, "step_s": min(timed), "steps_s": timed,
            "tiles_ran": reuse and reuse.ran, "tiles_reused": reuse and reuse.reused,
            "checksum": float(out.detach().sum())}


def background_of(size: int, background: float) -> Background:
    """Where ``write_slide``'s slide is background: its right ``background`` of the columns."""
    mask = np.zeros((1, size), dtype=bool)
    mask[:, size - round(background * size):] = True
    return Background(mask, size, size)


def drive(args) -> list[dict]:
    shape = (1, 3, args.size, args.size)
    model = slide_model(args.model)
    graph = trace(model, [(shape, "uint8")])
    target = target_for(graph, "float32")
    known = {} if args.known is None else {graph.input_names[0]: background_of(args.size, args.known)}
    plan = plan_for(graph, target, "background", grid=args.grid, segments=args.segments, memory_budget=args.budget,
                    backgrounds=known)
    label = "blind" if args.known is None else f"knowing {args.known:.0%}"
    records = []
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.folder or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        slide, module = folder / "slide.npy", folder / "background_tiled.py"
        module.write_text(render(plan))
        for background in args.backgrounds:
            write_slide(slide, args.size, background)
            command = [sys.executable, __file__, "--model", str(args.model), "--size", str(args.size),
                       "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--run", str(module),
                       "--slide", str(slide), "--background", str(background)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            records.append(json.loads(done.stdout.strip().splitlines()[-1]))
            records[-1].update(plan=label, segments=segments_text(plan.segments),
                               estimated_s=round(sum(s.estimated_seconds for s in plan.segments), 1))
    return records


def table(records: list[dict]) -> str:
    first = records[0]["step_s"]
    lines = ["| background | plan | step (s) | vs first | estimate (s) | tiles ran | tiles reused |",
             "|---|---|--:|--:|--:|--:|--:|"]
    lines += [f"| {r['background']:.0%} | {r['plan']} | {r['step_s']:.2f} | {r['step_s'] / first:.2f}x | "
              f"{r['estimated_s']} | {r['tiles_ran']} | {r['tiles_reused']} |" for r in records]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a model file with model()")
    parser.add_argument("--size", type=int, default=8192)
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--budget", type=parse_bytes, help="plan for this memory budget (e.g. 4GiB)")
    how.add_argument("--grid", type=parse_grid, help="plan one tiled segment of this grid (ROWSxCOLS)")
    how.add_argument("--segments", type=parse_segments, help="these segments, as the driver prints them")
    parser.add_argument("--backgrounds", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before the timed ones")
    parser.add_argument("--known", type=float, metavar="F",
                        help="plan knowing where the slide of background fraction F is background")
    parser.add_argument("--folder", type=Path, help="write the module and the slides here and keep them")
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)  # a child: the rendered module
    parser.add_argument("--slide", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--background", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run is None and args.budget is None and args.grid is None and args.segments is None:
        parser.error("give --budget, --grid or --segments")
    return args


def main(argv=None) -> int:
    return driver_main(parse_args(argv), run, drive, table)


if __name__ == "__main__":
    sys.exit(main())
