"""The generated module refuses models, inputs and plans it was not built for, naming what differs.

``check_model(PLAN, model)`` (parameters, buffers and modules), ``check_inputs(PLAN, inputs, tensors)``
(count, type, shape, dtype against the plan's and the model's tensors), ``check_modes`` (eval-only modules of tiled
segments) and ``check_plan`` (a plan JSON file) all raise ``ValueError`` with a one-line message.
"""

from __future__ import annotations

import json
import platform
import sys

import pytest
import torch
from torch import nn

from tilec.codegen import load_source, render
from tilec.ir import SCHEMA_VERSION
from tilec.pipeline import plan_for
from tilec.planio import dumps
from tilec.target import REFERENCE
from tilec.trace import trace

SHAPE = (1, 3, 15, 13)


class Net(nn.Module):
    """conv + BN + ReLU, a residual block with an (eval) Dropout inside, pool, head conv."""

    def __init__(self, width: int = 4, kernel: int = 3, bias: bool = True, activation=nn.ReLU):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, kernel, padding=kernel // 2, bias=bias), nn.BatchNorm2d(width),
                                  activation())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Dropout(0.2), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.last = nn.Conv2d(width, 2, 3)
        self.eval()

    def forward(self, x):
        x = self.stem(x)
        return self.last(self.pool(x + self.block(x)))


def _plan(model=None, shape=SHAPE, **options):
    return plan_for(trace((model or Net()).eval(), shape), REFERENCE, "checked", **(options or {"grid": (2, 2)}))


@pytest.fixture(scope="module")
def plan():
    return _plan()


@pytest.fixture(scope="module")
def generated(plan):
    return load_source(render(plan), "checked_tiled")


# --- check_model ---------------------------------------------------------------------------------


class Renamed(nn.Module):
    """Net's tensors, but the block lives at another path."""

    def __init__(self):
        super().__init__()
        net = Net()
        self.stem, self.other, self.pool, self.last = net.stem, net.block, net.pool, net.last
        self.eval()


@pytest.mark.parametrize(
    ("make_model", "message"),
    [
        (lambda: Net(width=6), r"^block\.0\.bias has shape \(6,\), plan 'checked' has \(4,\)$"),
        (lambda: Net(kernel=5), r"^stem\.0\.weight has shape \(4, 3, 5, 5\), plan 'checked' has \(4, 3, 3, 3\)$"),
        (lambda: Net(bias=False), r"^the model has no parameter or buffer 'stem\.0\.bias', which plan 'checked' uses$"),
        (Renamed, r"^the model has no parameter or buffer 'block\.0\.bias', which plan 'checked' uses$"),
        (lambda: Net(activation=nn.ReLU6), r"^module stem\.2 is a ReLU6, plan 'checked' has a ReLU$"),
        (lambda: nn.Conv2d(3, 4, 3), r"^the model has no parameter or buffer 'block\.0\.bias'"),
        (lambda: 42, r"^plan 'checked' needs a torch\.nn\.Module, got int$"),
    ],
    ids=["channels", "kernel_size", "missing_bias", "other_path", "module_type", "other_model", "not_a_module"],
)
def test_mismatched_model_is_refused(generated, make_model, message):
    with pytest.raises(ValueError, match=message):
        generated.check_model(generated.PLAN, make_model())
    with pytest.raises(ValueError, match=message):
        generated.TiledModel(make_model())


def test_missing_parameter_free_module_is_refused(generated):
    model = Net()
    del model.pool
    model.add_module("pool2", nn.MaxPool2d(2))
    with pytest.raises(ValueError, match=r"^the model has no module 'pool' \(MaxPool2d\), which plan 'checked' uses$"):
        generated.check_model(generated.PLAN, model)


def test_matching_model_is_accepted(generated):
    model = Net()
    generated.check_model(generated.PLAN, model)
    tiled = generated.TiledModel(model)
    assert tiled.model is model
    assert set(dict(tiled.named_parameters())) == {f"model.{name}" for name, _ in model.named_parameters()}


# --- check_inputs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (lambda: torch.randn(1, 3, 16, 13),
         r"^input 'x' has shape \(1, 3, 16, 13\), plan 'checked' needs \(1, 3, 15, 13\)$"),
        (lambda: torch.randn(1, 3, 15, 12), r"^input 'x' has shape \(1, 3, 15, 12\), plan 'checked' needs"),
        (lambda: torch.randn(1, 2, 15, 13), r"^input 'x' has shape \(1, 2, 15, 13\)"),
        (lambda: torch.randn(2, 3, 15, 13), r"^input 'x' has shape \(2, 3, 15, 13\)"),
        (lambda: torch.randn(3, 15, 13), r"^input 'x' has shape \(3, 15, 13\)"),
        (lambda: torch.ones(SHAPE, dtype=torch.int64), r"^input 'x' is int64, plan 'checked' needs float32"),
        (lambda: torch.randn(SHAPE, dtype=torch.float64), r"^input 'x' is float64 but the model's tensors are "
                                                          r"float32; move one to match the other$"),
        (lambda: torch.randn(SHAPE, dtype=torch.bfloat16), r"^input 'x' is bfloat16 .* float32"),
        (lambda: [[0.0]], r"^input 'x' must be a torch\.Tensor or an array with shape, dtype and slicing, got list$"),
    ],
    ids=["height", "width", "channels", "batch", "three_dims", "int_dtype", "float64_vs_float32",
         "bfloat16_vs_float32", "list"],
)
def test_mismatched_input_is_refused(generated, make_input, message):
    model = Net()
    with pytest.raises(ValueError, match=message):
        generated.check_inputs(generated.PLAN, [make_input()], generated.model_tensors(generated.PLAN, model))
    with pytest.raises(ValueError, match=message):
        generated.TiledModel(model)(make_input())


def test_model_in_another_dtype_than_the_input_is_refused(generated):
    tiled = generated.TiledModel(Net().eval().double())
    with pytest.raises(ValueError, match=r"input 'x' is float32 but the model's tensors are float64"):
        tiled(torch.randn(SHAPE))
    assert tiled(torch.randn(SHAPE, dtype=torch.float64)).dtype == torch.float64


# --- check_modes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("switch", "message"),
    [
        (lambda model: model.stem[1].train(),
         r"^module stem\.1 \(BatchNorm2d\) is in training mode, .*compile the plan with the module in training "
         r"mode, or call \.eval\(\) on it$"),
        (lambda model: model.block[1].train(), r"^module block\.1 \(Dropout\) is in training mode"),
        (lambda model: model.train(), r"^module (stem\.1 \(BatchNorm2d\)|block\.1 \(Dropout\)) is in training mode"),
    ],
    ids=["batch_norm", "dropout", "whole_model"],
)
def test_training_mode_at_forward_time_is_refused(generated, switch, message):
    model = Net().eval()
    tiled = generated.TiledModel(model)
    tiled(torch.randn(SHAPE))  # fine in eval mode
    switch(model)
    with pytest.raises(ValueError, match=message):
        tiled(torch.randn(SHAPE))
    model.eval()
    tiled(torch.randn(SHAPE))


def test_dropout_with_p_zero_may_stay_in_training_mode():
    model = nn.Sequential(nn.Conv2d(1, 1, 3), nn.Dropout(0.0), nn.ReLU())
    generated = load_source(render(plan_for(trace(model, (1, 1, 9, 9)), REFERENCE, "p0", grid=(2, 2))))
    x = torch.randn(1, 1, 9, 9)
    torch.testing.assert_close(generated.TiledModel(model)(x), model(x), rtol=0, atol=1e-6)


# --- check_plan ----------------------------------------------------------------------------------


@pytest.fixture
def plan_file(plan, tmp_path):
    path = tmp_path / "checked.plan.json"
    path.write_text(dumps(plan), encoding="utf-8")
    return path


def _edit(path, change) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_the_plan_it_was_built_from_is_accepted(generated, plan_file):
    generated.check_plan(plan_file)
    generated.check_plan(str(plan_file))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(schema_version=1), rf"has schema_version 1, this module has {SCHEMA_VERSION}$"),
        (lambda d: d.update(schema_version="3"), rf"has schema_version '3', this module has {SCHEMA_VERSION}$"),
        (lambda d: d["model"].update(digest="0" * 64), r"is for model digest '0{64}', this module for '[0-9a-f]{64}'$"),
        (lambda d: d["inputs"][0].update(shape=[1, 3, 15, 14]),
         r"has inputs \(\('x', \(1, 3, 15, 14\), 'float32'\),\), "
         r"this module \(\('x', \(1, 3, 15, 13\), 'float32'\),\)$"),
        (lambda d: d["inputs"][0].pop("dtype"), r"has malformed inputs: KeyError\('dtype'\)$"),
        (lambda d: d["segments"][0].update(grid=[3, 2]),
         r"has segments \(first, stop, grid\) \(\(0, \d+, \(3, 2\)\),\).*this module \(\(0, \d+, \(2, 2\)\),\)$"),
        (lambda d: d["segments"][0].pop("grid"), r"has malformed segments: KeyError\('grid'\)$"),
        (lambda d: d.update(segments=[3]), r"has malformed segments: TypeError"),
        (lambda d: d.pop("inputs"), r"has no 'inputs' field$"),
        (lambda d: d.update(model=[]), r"has no 'digest' field$"),
    ],
    ids=["old_schema", "schema_as_string", "digest", "inputs", "input_dtype", "grid", "missing_grid",
         "segment_not_object", "missing_field", "model_not_object"],
)
def test_another_plan_is_refused(generated, plan_file, change, message):
    _edit(plan_file, change)
    with pytest.raises(ValueError, match=rf"^plan {plan_file} " + message):
        generated.check_plan(plan_file)


def test_another_segmentation_is_refused(generated, tmp_path):
    count = len(trace(Net().eval(), SHAPE))
    path = tmp_path / "other.plan.json"
    path.write_text(dumps(_plan(segments=[(0, 3, (2, 2)), (3, count, (2, 2))])), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"has segments \(first, stop, grid\) \(\(0, 3, \(2, 2\)\), \(3, {count}, "
                                         rf"\(2, 2\)\)\), this module \(\(0, {count}, \(2, 2\)\),\)$"):
        generated.check_plan(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, r"cannot read plan .*: \[Errno 2\]"), ("{not json", r"cannot read plan .*: Expecting property name"),
     ("[1, 2]", r"has no 'schema_version' field$"), ("", r"cannot read plan .*: Expecting value")],
    ids=["missing_file", "bad_json", "not_an_object", "empty"],
)
def test_unreadable_plan_is_refused(generated, tmp_path, content, message):
    path = tmp_path / "broken.plan.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        generated.check_plan(path)


def test_check_plan_reports_a_directory(generated, tmp_path):
    with pytest.raises(ValueError, match=r"cannot read plan .*"):
        generated.check_plan(tmp_path)


# --- progress ------------------------------------------------------------------------------------


def test_progress_reports_every_tile(capsys):
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU())
    x = torch.randn(1, 1, 9, 9, requires_grad=True)
    generated = load_source(render(plan_for(trace(model, (1, 1, 9, 9)), REFERENCE, "loud", grid=(2, 3))))
    generated.TiledModel(model, progress=True)(x).sum().backward()
    err = capsys.readouterr().err
    assert "tilec loud segment 0 forward: tile 6/6\n" in err
    assert "tilec loud segment 0 backward: tile 6/6\n" in err
    generated.TiledModel(model)(x)
    assert capsys.readouterr().err == ""


# --- the allocator -------------------------------------------------------------------------------


def test_freed_memory_is_returned_once_per_process_unless_opted_out(generated, monkeypatch):
    calls = []
    monkeypatch.setattr(generated, "return_freed_memory", lambda: calls.append(True))
    model = Net()
    generated.TiledModel(model, return_freed_memory=False)(torch.randn(SHAPE))
    assert calls == []
    tiled = generated.TiledModel(model)
    tiled(torch.randn(SHAPE))
    tiled(torch.randn(SHAPE))
    assert calls == [True, True]  # called on every CPU forward; the function itself pins once


def test_a_cpu_forward_leaves_the_cuda_allocator_alone(generated, monkeypatch):
    calls = []
    monkeypatch.setattr(generated, "expand_cuda_segments", lambda: calls.append(True))
    generated.TiledModel(Net())(torch.randn(SHAPE))
    generated.TiledModel(Net(), kernels="generic")(torch.randn(SHAPE))
    assert calls == []


@pytest.mark.skipif(not sys.platform.startswith("linux") or not platform.libc_ver()[0] == "glibc",
                    reason="glibc's mallopt")
def test_mmap_threshold_is_pinned_on_glibc(generated):
    assert generated.return_freed_memory() is True
    assert generated.return_freed_memory() is True  # idempotent
