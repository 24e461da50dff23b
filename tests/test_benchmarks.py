"""Smoke tests of the benchmark scripts: every variant of benchmarks/step.py runs on a tiny model and
prints a sane JSON line; the drivers around it, benchmarks/graphs.py and benchmarks/calls.py run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from support.exactness import max_errors
from support.published import published

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "benchmarks" / "step.py"

pytestmark = pytest.mark.slow

TINY_MODEL = """
from torch import nn

INPUT_SHAPE = (1, 3, 64, 64)


def model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True),
    )
"""

#: label -> (variant, options)
VARIANTS = {
    "plain": ("plain", []),
    "checkpoint": ("checkpoint", ["--segments", "2"]),
    "tilec": ("tilec", ["--grid", "2x2"]),
    "auto": ("auto", ["--budget", "256MiB"]),
    "tilec-heap": ("tilec", ["--grid", "2x2", "--allocator", "heap"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run all variants at once (separate processes, one thread each) to keep the test fast."""
    model = tmp_path_factory.mktemp("bench") / "tiny.py"
    model.write_text(TINY_MODEL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs = {
        label: subprocess.Popen(
            [sys.executable, str(STEP), "--model", str(model), "--size", "64", "--variant", variant,
             "--threads", "1", "--device", "cpu", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        )
        for label, (variant, extra) in VARIANTS.items()
    }
    out = {}
    for label, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"step.py ({label}) failed:\n{stderr}"
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert len(lines) == 1, f"step.py ({label}) printed {stdout!r}"
        out[label] = json.loads(lines[0])
    return out


@pytest.mark.parametrize("label", list(VARIANTS))
def test_step_prints_measurements(results, label):
    record = results[label]
    variant = VARIANTS[label][0]
    assert record["variant"] == variant
    assert record["model"] == "tiny" and record["size"] == 64
    assert record["peak_bytes"] > 0
    assert record["step_s"] > 0
    assert record["memory_method"] in ("vmhwm-reset", "rss-sampled", "cuda-allocated")
    assert record["output_shape"] == [1, 8, 32, 32]
    # Same seed in every process: gradients must agree with plain PyTorch's.
    plain = results["plain"]["grad_checksum"]
    assert abs(record["grad_checksum"] - plain) <= 1e-4 * abs(plain)
    if variant == "checkpoint":
        assert record["inplace_replaced"] == 2 and record["segments"] == 2
    if variant == "tilec":
        assert record["plan_segments"] == ["0:5@2x2"]
    if variant in ("tilec", "auto"):
        assert record["allocator"] == ("heap" if label == "tilec-heap" else "pinned")
        assert 0 < record["predicted_peak_bytes"] <= record.get("budget_bytes", record["predicted_peak_bytes"])


def test_background_driver_runs_given_segments_on_a_textured_and_a_background_slide(tmp_path):
    """benchmarks/background.py with ``--segments`` as it prints them: one plan, a process per
    slide; the mostly-background slide reuses tiles, the textured one none, and the folder keeps
    the rendered module."""
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    segments = "0:4@4x4,4:7@4x4/2"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "background.py"), "--model", str(model), "--size", "128",
         "--segments", segments, "--backgrounds", "0", "0.7", "--repeats", "1", "--warmup", "0",
         "--known", "0.7", "--folder", str(tmp_path / "kept")],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    textured, background = (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    assert textured["segments"] == background["segments"] == segments
    assert textured["tiles_reused"] == 0 and background["tiles_reused"] > 0
    assert textured["tiles_ran"] == background["tiles_ran"] + background["tiles_reused"]
    assert (tmp_path / "kept" / "background_tiled.py").is_file()


def test_frames_driver_runs_each_size_searched_like_and_framed(tmp_path):
    """benchmarks/frames.py with a grid: per slide size a plan of its own, one like the frame's
    (the frame's segments) and the frame's, each step in a process of its own, the same size
    computing the same output on its own plan and on the like one."""
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "frames.py"), "--model", str(model), "--frame", "64",
         "--sides", "64", "48", "--grid", "2x2", "--repeats", "1", "--warmup", "0"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    full, smaller = (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    assert smaller["like"]["segments"] == smaller["frame_segments"] == full["searched"]["segments"]
    assert smaller["like"]["output"] == pytest.approx(smaller["searched"]["output"], rel=1e-4)
    framed = [r["framed"]["tiles_ran"] + r["framed"]["tiles_reused"] for r in (full, smaller)]
    assert framed[0] == framed[1] > 0  # both on the frame's plan
    assert "| 48² | 44% |" in done.stdout


def test_recorded_segments_of_either_form_plan_again():
    """Results files record a plan's segments as ``--segments`` takes them; older ones wrote
    ``FIRST:STOP:RxC`` (`` stored`` after a stored one), which ``estimate.current`` converts."""
    from benchmarks.estimate import current
    from benchmarks.step import parse_segments

    recorded = [["0:13:16x16", "13:14:1x1 stored"], ["0:13@16x16", "13:14@1x1"]]
    assert [parse_segments(",".join(current(t) for t in texts)) for texts in recorded] == [
        ((0, 13, (16, 16), None, 1), (13, 14, (1, 1), None, 1))] * 2
    assert current("0:13@16x16/4") == "0:13@16x16/4"


def test_lightstream_over_one_tile_computes_plain_outputs_and_gradients():
    """step.py's ``lightstream`` variant (where the package imports): over an image as large as
    its tile, Lightstream's streaming computes the ResNet-34's output and parameter gradients as
    plain PyTorch does (several tiles need cuDNN: step.py's docstring)."""
    pytest.importorskip("lightstream.core.constructor")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    common = ["--model", str(ROOT / "examples" / "resnet18.py"), "--attr", "resnet34_frozen", "--size", "128",
              "--threads", "1", "--device", "cpu", "--tile-size", "128"]
    procs = [subprocess.Popen([sys.executable, str(STEP), *common, "--variant", variant], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for variant in ("plain", "lightstream")]
    records = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        records.append(json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1]))
    plain, streamed = records
    assert streamed["variant"] == "lightstream" and streamed["tile_size"] == 128
    assert streamed["output_shape"] == plain["output_shape"] == [1, 1000]
    assert streamed["output_checksum"] == pytest.approx(plain["output_checksum"], rel=1e-5)
    assert streamed["grad_checksum"] == pytest.approx(plain["grad_checksum"], rel=1e-5)


def test_graphs_counts_the_calls_outside_the_tile_graphs(tmp_path):
    """benchmarks/graphs.py on the tiny model in 2x2 tiles: each tile's forward runs in the forward
    pass and again, back-propagated, in the backward; their ops run traced, and the runtime's
    slicing and copies around them are counted outside."""
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "graphs.py"), "--model", str(model), "--size",
                           "64", "--grid", "2x2"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    found = re.fullmatch(r"([\d,]+) tile calls \(([\d,]+) of them back-propagated\): ([\d,]+) aten calls inside "
                         r"their graphs, ([\d,]+) outside \([\d.]+ per graph run\)", first)
    assert found, first
    tiles, backwards, inside, outside = (int(group.replace(",", "")) for group in found.groups())
    assert (tiles, backwards) == (8, 4) and inside > 0 and outside > 0, first
    assert "| `aten::convolution` |" not in done.stdout and "| `copy_in` |" in done.stdout, done.stdout


@pytest.mark.parametrize("as_cuda, functions", [(True, {"InPlace", "PadBorder", "GradChannelsLast", "Tiled"}),
                                                (False, {"Conv2d", "CopyIn", "MaxPool2d"})])
def test_calls_counts_aten_calls_and_python_functions(tmp_path, as_cuda, functions):
    """benchmarks/calls.py on the tiny model in 2x2 tiles: aten calls by op and by runtime function,
    and the Python autograd functions by class. CUDA's path (the generic kernels) convolves, copies
    tiles in and max-pools with aten's own calls; the CPU's through functions into its arena."""
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "calls.py"), "--model", str(model), "--size",
                           "64", "--grid", "2x2", "--top", "40", *(["--as-cuda"] if as_cuda else [])],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.match(r"[\d,]+ aten calls in a step", done.stdout) and "| `aten.relu_` |" in done.stdout
    table = done.stdout.split("| autograd function | calls |")[1]
    applied = set(re.findall(r"\| `(\w+)` \|", table))
    assert functions <= applied and ({"Conv2d", "CopyIn", "MaxPool2d"} & applied) == (set() if as_cuda else functions)


def test_published_rows_name_the_worst_errors():
    """``benchmarks/published.py``: one model and mode in this process, then its markdown row."""
    from benchmarks.published import ChannelsLast, Swapped, draws_masks, one, row

    published("torchvision.models")
    record = one("squeezenet1_1", "eval")
    assert record["model"] == "squeezenet1_1" and 0 <= record["worst"] <= 1e-10 and "relative" not in record
    assert row(record).startswith("| squeezenet1_1 | eval | ")
    assert row({"model": "m", "mode": "train", "refused": "op aten.x is not supported"}) == (
        "| m | train | refused: op aten.x is not supported | | |")
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Dropout(0.5)).train()
    plain = max_errors(model, (2, 3, 9, 8), tiled=ChannelsLast(model), relative=True, counter=True)
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert 0 <= max(plain.values()) <= 1e-12 and "grad 0.weight" in plain
    assert draws_masks(model) and not draws_masks(model[:2]) and not draws_masks(nn.Dropout(0.0))
    swapped = max_errors(model[:2], (2, 3, 9, 8), tiled=Swapped(model[:2]), relative=True)
    assert 0 <= max(swapped.values()) <= 1e-12 and "grad 0.weight" in swapped
    seen, x = [], torch.randn(2, 3)
    identity = nn.Identity()
    identity.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    assert torch.equal(Swapped(identity)(x), x) and torch.equal(seen[0], x[[1, 0]])
    above = {"model": "m", "mode": "train", "worst": 2e-9, "relative": 3e-12, "relative_of": "grad w", "plain": 1e-12}
    assert row(above) == "| m | train | 2.0e-09 | 3.0e-12 (grad w) | 1.0e-12 |"
