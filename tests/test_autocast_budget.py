"""Budgets for mixed precision: ``trace(..., autocast="DEVICE:DTYPE")`` records the dtype autocast
computes each op in, the cost model counts those bytes, ``tilec.calibrate`` measures (once,
cached) the workspace of the device's convolutions in that dtype. That a budget plan compiled for
autocast holds its budget under autocast is measured in ``tests/test_memory.py``."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils._pytree import tree_leaves

import tilec.calibrate as calibration
from tilec.calibrate import conv_workspace_of
from tilec.cli import main
from tilec.cost.estimator import Estimator
from tilec.graph import output_leaves
from tilec.pipeline import build, plan_for, target_for
from tilec.trace import trace

from support.zoo import SHAPES, ZOO

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["resnet_head", "convnext", "efficientnet", "unet_bilinear"])
def test_trace_records_the_dtypes_autocast_computes_in(name):
    model = ZOO[name]()
    graph = trace(model, SHAPES[name], "cpu:bfloat16")
    nodes = graph.nodes
    assert graph.autocast == "cpu:bfloat16"
    assert all(n.autocast_dtype == "bfloat16" for n in nodes.values() if n.op == "conv2d")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = tree_leaves(model(torch.randn(SHAPES[name])))
    leaves = output_leaves(graph.output)
    assert len(leaves) == len(outputs)
    for leaf, output in zip(leaves, outputs, strict=True):
        assert str(output.dtype).removeprefix("torch.") == (nodes[leaf].autocast_dtype or "float32")


def test_untraced_for_autocast_no_op_is_lowered():
    graph = trace(ZOO["resnet_head"](), SHAPES["resnet_head"])
    assert graph.autocast is None
    assert all(node.autocast_dtype is None for node in graph)


def _planned(graph, **options):
    return plan_for(graph, target_for(graph, "float32"), "m", **options)


def test_autocast_plans_predict_fewer_bytes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, shape = ZOO["resnet_head"](), (1, 3, 96, 96)
    full = _planned(trace(model, shape), grid=(2, 2))
    mixed = _planned(trace(model, shape, "cpu:bfloat16"), grid=(2, 2))
    assert mixed.autocast == "cpu:bfloat16" and mixed.conv_workspace is not None
    assert full.autocast is None and full.conv_workspace is None
    assert mixed.predicted_peak_bytes < full.predicted_peak_bytes
    assert mixed.model.digest != full.model.digest


def test_stored_segments_keep_autocasts_parameter_copies(tmp_path, monkeypatch):
    """Under autocast a stored segment keeps the lower-precision copies of its convolutions' and
    linear layers' parameters (autocast caches them, autograd saves them); without it, none."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model, shape = ZOO["resnet_head"](), SHAPES["resnet_head"]
    copied = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in model.modules()
                 if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)) * 2
    for autocast, expected in ((None, 0), ("cpu:bfloat16", copied)):
        graph = trace(model, shape, autocast)
        target = target_for(graph, "float32")
        estimator = Estimator(graph, target, "float32")
        nodes = len(graph)
        assert estimator.cast_bytes(0, nodes) == expected
        uncounted = Estimator(graph, target, "float32")
        uncounted.facts.casts_after = [0] * (nodes + 1)
        stored, without = (e.segment(0, nodes, (), (), stored=True) for e in (estimator, uncounted))
        assert stored.kept - without.kept == stored.forward_local - without.forward_local == expected


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    graph = trace(ZOO["resnet_head"](), SHAPES["resnet_head"], "cpu:bfloat16")
    measured = conv_workspace_of(graph.autocast)
    entries = json.loads((tmp_path / "tilec" / "calibration.json").read_text())
    assert list(entries.values()) == [[list(pair) for pair in measured]]
    assert all(v >= 0 and v * 4 == int(v * 4) for pair in measured for v in pair)
    assert target_for(graph, "float32").conv_workspace == measured and target_for(graph, "float32").device == "cpu"

    def fail(*args):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "conv_workspace", fail)
    assert conv_workspace_of("cpu:bfloat16") == measured
    (tmp_path / "tilec" / "calibration.json").write_text("{not json")
    monkeypatch.setattr(calibration, "conv_workspace", lambda device, dtype, last: (0.5, 1.25))
    assert conv_workspace_of("cpu:bfloat16") == ((0.5, 1.25), (0.5, 1.25))


def test_calibration_measures_an_im2col_fallback():
    """A bfloat16 convolution on a CPU without bfloat16 instructions runs an im2col kernel: its
    backward takes the input times the kernel's taps (1.0 in these units); float32 takes none."""
    assert calibration.conv_workspace("cpu", torch.float32, True) == (0.0, 0.0)
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX"):
        pytest.skip("this CPU may convolve bfloat16 natively")
    assert calibration.conv_workspace("cpu", torch.bfloat16, True)[1] >= 1.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="measures /proc/self resident memory")
def test_calibration_does_not_depend_on_what_the_process_freed_before():
    """Freed heap pages a kernel's buffers could reuse without growing the resident set (as a trace
    leaves them) do not lower the measurement: ``calibrate`` runs inside ``tilec compile``."""
    before = [calibration.conv_workspace("cpu", torch.bfloat16, last) for last in (True, False)]
    churn = [torch.empty(n * 4096, dtype=torch.uint8).fill_(1) for n in range(1, 2000, 7)]  # small, heap-served
    del churn
    after = [calibration.conv_workspace("cpu", torch.bfloat16, last) for last in (True, False)]
    assert after == before


@pytest.mark.parametrize(("flag", "words"), [
    ("cuda", "--autocast must be DEVICE:DTYPE"),
    ("cpu:float64", "--autocast must be DEVICE:DTYPE"),
    pytest.param("cuda:float16", "compile on the machine that trains",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")),
])
def test_cli_refuses_a_bad_autocast(tmp_path, flag, words):
    result = CliRunner().invoke(main, ["compile", str(ROOT / "examples" / "vgg16.py"), "--grid", "2x2",
                                       "--autocast", flag, "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["resnet_basic", "resnet_head"])
def test_an_autocast_plan_warns_when_the_step_runs_without_autocast(tmp_path, monkeypatch, name):
    """Without autocast the step computes in the model's dtype, reductions in tiled segments (the
    head's pooling) included; under autocast in autocast's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = ZOO[name]()
    tiled = build(model, SHAPES[name], (2, 2), autocast="cpu:bfloat16")
    x = torch.randn(SHAPES[name])
    with pytest.warns(UserWarning, match=r"budgets the step under torch.autocast\('cpu', dtype=torch.bfloat16\)"):
        assert tiled(x).dtype == model(x).dtype
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert tiled(x).dtype == model(x).dtype
        with torch.no_grad():
            tiled(x)
