"""The memory budget holds in the default environment: a budget plan's predicted peak covers the
resident memory a training step of the generated module takes, measured in a fresh process with
no allocator variables set (glibc's malloc as configured; the module pins its mmap threshold).

The measurement is the benchmarks' own (``benchmarks/step.py``): VGG16's layout at a quarter of
its widths, 1024², a 48 MiB budget (and 512² under CPU bfloat16 autocast); two steps. The first
creates the kernels of every tile shape, which the prediction counts (``kernel_state_bytes``),
and pages in library code, which it does not (file-backed pages, reported apart): its data, the
growth less that code, must stay within the budget. The second, which finds the kernels made,
is compared with the prediction less their state. The budget searches rank plans at the reference
speed the suite seeds into its cache (``support.zoo.seed_reference_speed``): timing this machine
while the suite's other workers keep it busy took minutes a search.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.zoo import seed_reference_speed

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

pytestmark = pytest.mark.slow


def _measured_budget_step(budget: int, *args: str, timeout: int = 300,
                          model: tuple[str, str] = ("examples/vgg16.py", "vgg16_quarter")) -> tuple[int, int]:
    """Run ``benchmarks/step.py --variant auto --budget BUDGET --repeats 2 ARGS`` on ``model`` (a
    model file and its attribute; VGG16's layout at a quarter of its widths) in a fresh process with
    the default environment, check both steps against the budget and return the later
    step's measured peak and its prediction."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "THP_"))}
    argv = [sys.executable, str(ROOT / "benchmarks" / "step.py"), "--model", model[0], "--attr", model[1],
            "--variant", "auto", "--budget", str(budget), "--repeats", "2", *args]
    proc = subprocess.run(argv, cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    if record["memory_method"] != "vmhwm-reset":
        pytest.skip("VmHWM cannot be reset here: only a sampled lower bound of the peak")
    measured, predicted = record["last_peak_bytes"], record["predicted_peak_bytes"]
    first = record["peak_bytes"] - record["code_paged_in_bytes"]
    assert 0 < record["kernel_state_bytes"] < predicted <= 0.9 * budget
    assert first <= budget, f"first step's data {first / MiB:.1f} MiB over the {budget / MiB:.0f} MiB budget"
    assert measured <= budget, f"measured {measured / MiB:.1f} MiB over the {budget / MiB:.0f} MiB budget"
    return measured, predicted - record["kernel_state_bytes"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self resident memory")
def test_budget_plan_covers_the_measured_peak_in_the_default_environment():
    measured, predicted = _measured_budget_step(48 * MiB, "--size", "1024")
    assert abs(measured / predicted - 1) <= 0.15, (
        f"measured {measured / MiB:.1f} MiB, predicted {predicted / MiB:.1f} MiB")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self resident memory")
def test_a_budget_plan_with_an_untiled_op_covers_the_measured_peak():
    """The same layout with its map rolled along the rows in the middle (``tests/support/rolled.py``):
    the roll runs untiled, in a stored segment that keeps its maps whole, and the prediction counts
    them."""
    measured, predicted = _measured_budget_step(48 * MiB, "--size", "1024", model=("tests/support/rolled.py", "model"))
    assert abs(measured / predicted - 1) <= 0.15, (
        f"measured {measured / MiB:.1f} MiB, predicted {predicted / MiB:.1f} MiB")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self resident memory")
def test_a_segnet_budget_plan_counts_its_pooling_indices():
    """SegNet at a quarter of its widths (``examples/segnet.py``), 512², 80 MiB: the int64 indices
    of its poolings live until the decoder unpools to them, twice the bytes of float32 values."""
    measured, predicted = _measured_budget_step(80 * MiB, "--size", "512", model=("examples/segnet.py",
                                                                                  "segnet_quarter"))
    assert 0.75 <= measured / predicted <= 1.15, (
        f"measured {measured / MiB:.1f} MiB, predicted {predicted / MiB:.1f} MiB")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self resident memory")
def test_autocast_budget_plan_holds_its_budget_under_autocast(tmp_path, monkeypatch):
    """A plan compiled for CPU bfloat16 autocast (its convolution workspace calibrated into a fresh
    cache, which has the reference speed), run under that autocast."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seed_reference_speed()
    measured, predicted = _measured_budget_step(48 * MiB, "--size", "512", "--autocast", "bfloat16", timeout=400)
    # covered, not within +-15%: under CPU bfloat16 autocast predictions ran 0.65-0.89x (AVX2, planned in the
    # measured process) and 0.84-1.00x (AVX-512, planned apart)
    assert measured <= 1.15 * predicted, f"measured {measured / MiB:.1f} MiB, predicted {predicted / MiB:.1f} MiB"
