"""The fewest FLOPs of a training step any plan within a memory budget does, against plain's.

    python benchmarks/flop_floor.py --model examples/resnet18.py --size 2048 --budget 199MiB

The budget search (``tilec.search.choose``) ranks plans by estimated seconds. Here every FLOP
costs the same and op calls and copies cost nothing, so it finds the plan with the fewest FLOPs
over its cut candidates and grids: halo recompute, the backward's recompute of tiled segments,
and each sweep of a segment's reductions. Its FLOPs over the untiled step's (every node's forward
and backward once) bound from below what a plan within that budget costs against plain PyTorch,
were its kernels as fast as plain's. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from step import parse_bytes  # noqa: E402

from tilec.calibrate import measure_kernels  # noqa: E402
from tilec.cost.estimator import Estimator  # noqa: E402
from tilec.ir import segments_text  # noqa: E402
from tilec.modelfile import load_model  # noqa: E402
from tilec.search import choose  # noqa: E402
from tilec.target import SEGMENT_SECONDS, Speed, Target  # noqa: E402
from tilec.trace import trace  # noqa: E402

#: One FLOP per nanosecond, calls and copies free: estimated seconds are FLOPs / 1e9.
FLOPS_ONLY = Speed(flop_rate=1e9, call_seconds=0.0, copy_rate=1e30)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--attr", default="model")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--budget", type=parse_bytes, required=True)
    args = parser.parse_args(argv)
    model, _ = load_model(args.model, args.attr)
    graph = trace(model, (1, 3, args.size, args.size))
    target = replace(measure_kernels(Target(), "float32"), speed=FLOPS_ONLY)
    choice = choose(graph, target, args.budget)
    fewest = (choice.seconds - len(choice.segments) * SEGMENT_SECONDS) * 1e9
    untiled = Estimator(graph, target, "float32").segment(0, len(graph.order), (), (), stored=True).flops
    print(json.dumps({
        "model": args.model.stem, "size": args.size, "budget_bytes": args.budget,
        "segments": segments_text(choice.segments),
        "recomputed": list(choice.recomputed), "plan_gflops": round(fewest / 1e9, 1),
        "untiled_gflops": round(untiled / 1e9, 1), "ratio": round(fewest / untiled, 2),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
