"""Estimate the measured tilec plans of results files again, with this machine's rates now.

    python benchmarks/estimate.py benchmarks/results/time_vgg16_2048_cpu.json [...]

For every ``auto`` record of each ``benchmarks/run.py`` results file, the plan its step ran (its
segments, re-planned on the traced model) is estimated with the rates ``tilec.clock`` measures on
this machine (or finds cached), and printed as one JSON line: the measured step, the estimate the
run printed, the estimate now, and the measured step over the estimate now. Plans whose search
recomputed nodes (their segments count the copies) are skipped.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step import parse_segments  # noqa: E402

from tilec.calibrate import measure_kernels  # noqa: E402
from tilec.clock import clock  # noqa: E402
from tilec.modelfile import load_model  # noqa: E402
from tilec.planner import plan  # noqa: E402
from tilec.target import Target  # noqa: E402
from tilec.trace import trace  # noqa: E402


def current(text: str) -> str:
    """A recorded segment as ``--segments`` takes it: records before it gained tiles per call wrote
    ``FIRST:STOP:RxC``, `` stored`` after a stored one."""
    return re.sub(r"^(\d+):(\d+):(\S+?)( stored)?$", r"\1:\2@\3", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+")
    args = parser.parse_args(argv)
    target = clock(measure_kernels(Target(), "float32"), "float32", None)
    for path in args.results:
        for record in json.loads(path.read_text())["records"]:
            if record.get("variant") != "auto" or "plan_segments" not in record:
                continue
            model, _ = load_model(ROOT / "examples" / f"{record['model']}.py")
            graph = trace(model, tuple(record["input_shape"]))
            segments = parse_segments(",".join(current(text) for text in record["plan_segments"]))
            if segments[-1][1] != len(graph.order):
                continue
            estimate = sum(s.estimated_seconds for s in plan(graph, target, name="m", segments=segments).segments)
            print(json.dumps({
                "model": record["model"], "size": record["input_shape"][-1], "budget_bytes": record["budget_bytes"],
                "step_s": round(record["step_s"], 1), "estimated_then_s": round(record["estimated_seconds"], 1),
                "estimated_s": round(estimate, 3), "measured_over_estimated": round(record["step_s"] / estimate, 2),
            }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
