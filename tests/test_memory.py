"""The memory budget holds in the default environment: a budget plan's predicted peak covers the
resident memory a training step of the generated module takes, measured in a fresh process with
no allocator variables set (glibc's malloc as configured; the module pins its mmap threshold)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

#: Runs in the subprocess: plan VGG16's layout at a quarter of its widths (1024², 48 MiB), run one
#: step (it creates the kernels of every tile shape), then measure the resident memory a second
#: step adds (VmHWM reset through /proc/self/clear_refs).
STEP = """
import gc, json, sys, torch
from pathlib import Path
from tilec.codegen import render
from tilec.modelfile import load_model
from tilec.pipeline import load_source, plan_for
from tilec.trace import trace

def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))

model, _ = load_model(Path("examples/vgg16.py"), "vgg16_quarter")
shape = (1, 3, 1024, 1024)
plan = plan_for(trace(model, shape), "vgg16", memory_budget=int(sys.argv[1]))
tiled = load_source(render(plan), "vgg16_tiled").TiledModel(model)
x = torch.randn(shape)
peaks = []
for _ in range(2):
    model.zero_grad(set_to_none=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    base = status("VmRSS")
    tiled(x).sum().backward()
    peaks.append(status("VmHWM") - base)
print(json.dumps({"predicted": plan.predicted_peak_bytes, "peaks": peaks}))
"""


def _clear_refs_allowed() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_allowed(),
                    reason="needs Linux and a resettable VmHWM")
def test_budget_plan_covers_the_measured_peak_in_the_default_environment():
    budget = 48 * MiB
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "THP_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", STEP, str(budget)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    measured, predicted = result["peaks"][1], result["predicted"]
    assert predicted <= 0.9 * budget
    assert measured <= budget, f"measured {measured / MiB:.1f} MiB over the {budget / MiB:.0f} MiB budget"
    assert abs(measured / predicted - 1) <= 0.15, (
        f"measured {measured / MiB:.1f} MiB, predicted {predicted / MiB:.1f} MiB")
