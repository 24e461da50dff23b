"""The generated module refuses models and inputs its plan does not fit, naming what differs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilec.codegen import render
from tilec.pipeline import load_source
from tilec.planner import plan
from tilec.trace import trace

SHAPE = (1, 3, 15, 13)


def _model(**changes) -> nn.Sequential:
    kernel = changes.get("kernel", 3)
    width = changes.get("width", 4)
    layers = [
        nn.Conv2d(3, width, kernel, padding=1, bias=changes.get("bias", True)),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Sequential(nn.Dropout(0.2), nn.MaxPool2d(2)),
        nn.Conv2d(width, 2, 3),
    ]
    layers += changes.get("extra", [])
    return nn.Sequential(*layers).eval()


@pytest.fixture(scope="module")
def generated():
    return load_source(render(plan(trace(_model(), SHAPE), name="checked", grid=(2, 2))), "checked_tiled")


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (_model(kernel=5), r"layer 0 \(Conv2d\): kernel_size is \(5, 5\), plan 'checked' has \(3, 3\)"),
        (_model(width=6), r"layer 0 \(Conv2d\): out_channels is 6, plan 'checked' has 4"),
        (_model(bias=False), r"layer 0 \(Conv2d\): tensors .*'weight'.* differ .*'bias': \(4,\)"),
        (_model(extra=[nn.ReLU()]), r"the model has 7 layers, plan 'checked' has 6"),
        (nn.Sequential(*list(_model())[:-1]), r"the model has 5 layers, plan 'checked' has 6"),
        (nn.Sequential(*list(_model())[:2], nn.ReLU6(), *list(_model())[3:]).eval(),
         r"layer 2 \(ReLU\): the model has 2 \(ReLU6\) there"),
        (nn.Sequential(*list(_model())[:3], nn.Dropout(0.2), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3)).eval(),
         r"layer 3.0 \(Dropout\): the model has 3 \(Dropout\) there"),
        (nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, eps=1e-3), nn.ReLU(),
            nn.Sequential(nn.Dropout(0.2), nn.MaxPool2d(2)), nn.Conv2d(4, 2, 3)).eval(),
         r"layer 1 \(BatchNorm2d\): eps is 0.001, plan 'checked' has 1e-05"),
        (nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Sequential(nn.Dropout(0.2), nn.MaxPool2d(2, ceil_mode=True)), nn.Conv2d(4, 2, 3)).eval(),
         r"layer 3.1 \(MaxPool2d\): ceil_mode is True, plan 'checked' has False"),
        (nn.Conv2d(3, 4, 3), r"needs an nn.Sequential, got Conv2d"),
    ],
    ids=["kernel_size", "channels", "missing_bias", "extra_layer", "missing_layer", "other_type", "flattened_path",
         "bn_eps", "pool_ceil_mode", "not_sequential"],
)
def test_mismatched_model_is_refused(generated, model, message):
    with pytest.raises(ValueError, match=message):
        generated.TiledModel(model)


def test_matching_model_is_accepted(generated):
    model = _model()
    tiled = generated.TiledModel(model)
    assert tiled.model is model
    assert set(dict(tiled.named_parameters())) == {f"model.{name}" for name, _ in model.named_parameters()}


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (lambda: torch.randn(1, 3, 16, 13), r"input has shape \(1, 3, 16, 13\), plan 'checked' needs \(N, 3, 15, 13\)"),
        (lambda: torch.randn(1, 3, 15, 12), r"input has shape \(1, 3, 15, 12\).*\(N, 3, 15, 13\)"),
        (lambda: torch.randn(1, 2, 15, 13), r"input has shape \(1, 2, 15, 13\).*\(N, 3, 15, 13\)"),
        (lambda: torch.randn(3, 15, 13), r"input has shape \(3, 15, 13\)"),
        (lambda: torch.ones(1, 3, 15, 13, dtype=torch.int64), r"input dtype torch.int64 is not a floating-point type"),
        (lambda: torch.randn(1, 3, 15, 13, dtype=torch.float64),
         r"input is torch.float64 .* tensors are torch.float32"),
        (lambda: torch.randn(1, 3, 15, 13, dtype=torch.bfloat16), r"input is torch.bfloat16 .* torch.float32"),
        (lambda: [[0.0]], r"input must be a torch.Tensor, got list"),
    ],
    ids=["height", "width", "channels", "three_dims", "int_dtype", "float64_vs_float32", "bfloat16_vs_float32", "list"],
)
def test_mismatched_input_is_refused(generated, make_input, message):
    tiled = generated.TiledModel(_model())
    with pytest.raises(ValueError, match=message):
        tiled(make_input())


def test_params_in_other_dtype_than_input_are_refused(generated):
    tiled = generated.TiledModel(_model().double())
    with pytest.raises(ValueError, match=r"input is torch.float32 .* tensors are torch.float64"):
        tiled(torch.randn(SHAPE))
    assert tiled(torch.randn(SHAPE, dtype=torch.float64)).dtype == torch.float64


def test_other_batch_size_is_accepted(generated):
    assert generated.TiledModel(_model())(torch.randn(4, *SHAPE[1:])).shape == (4, 2, 5, 4)


@pytest.mark.parametrize(
    ("switch", "message"),
    [
        (lambda model: model[1].train(), r"layer 1 \(BatchNorm2d\) is in training mode.*\.eval\(\)"),
        (lambda model: model[3][0].train(), r"layer 3.0 \(Dropout\) is in training mode"),
        (lambda model: model.train(), r"layer 1 \(BatchNorm2d\) is in training mode"),
    ],
    ids=["batch_norm", "dropout", "whole_model"],
)
def test_training_mode_at_forward_time_is_refused(generated, switch, message):
    model = _model()
    tiled = generated.TiledModel(model)
    tiled(torch.randn(SHAPE))  # fine in eval mode
    switch(model)
    with pytest.raises(ValueError, match=message):
        tiled(torch.randn(SHAPE))
    model.eval()
    tiled(torch.randn(SHAPE))


def test_dropout_with_p_zero_may_stay_in_training_mode():
    model = nn.Sequential(nn.Conv2d(1, 1, 3), nn.Dropout(0.0), nn.ReLU())
    tiled = load_source(render(plan(trace(model, (1, 1, 9, 9)), name="p0", grid=(2, 2)))).TiledModel(model)
    x = torch.randn(1, 1, 9, 9)
    torch.testing.assert_close(tiled(x), model(x), rtol=0, atol=1e-6)


def test_progress_reports_every_tile(capsys):
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU())
    x = torch.randn(1, 1, 9, 9, requires_grad=True)
    generated = load_source(render(plan(trace(model, (1, 1, 9, 9)), name="loud", grid=(2, 3))))
    generated.TiledModel(model, progress=True)(x).sum().backward()
    err = capsys.readouterr().err
    assert "tilec loud segment 0 forward: tile 6/6\n" in err
    assert "tilec loud segment 0 backward: tile 6/6\n" in err
    generated.TiledModel(model)(x)
    assert capsys.readouterr().err == ""
