"""The memory budget holds in the default environment: a budget plan's predicted peak covers the
resident memory a training step of the generated module takes, measured in a fresh process with
no allocator variables set (glibc's malloc as configured; the module pins its mmap threshold).

The measurement is the benchmarks' own (``benchmarks/step.py``): VGG16's layout at a quarter of
its widths, 1024², a 48 MiB budget; two steps, the first of which creates the kernels of every
tile shape and pages in library code; the second is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self resident memory")
def test_budget_plan_covers_the_measured_peak_in_the_default_environment():
    budget = 48 * MiB
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "THP_"))}
    argv = [sys.executable, str(ROOT / "benchmarks" / "step.py"), "--model", "examples/vgg16.py", "--attr",
            "vgg16_quarter", "--size", "1024", "--variant", "auto", "--budget", str(budget), "--repeats", "2"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    if record["memory_method"] != "vmhwm-reset":
        pytest.skip("VmHWM cannot be reset here: only a sampled lower bound of the peak")
    measured, predicted = record["last_peak_bytes"], record["predicted_peak_bytes"]
    assert predicted <= 0.9 * budget
    assert measured <= budget, f"measured {measured / MiB:.1f} MiB over the {budget / MiB:.0f} MiB budget"
    assert abs(measured / predicted - 1) <= 0.15, (
        f"measured {measured / MiB:.1f} MiB, predicted {predicted / MiB:.1f} MiB")
