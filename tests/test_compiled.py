"""``TiledModel(model, kernels="compiled")``: every tile function compiled by ``torch.compile``
(``tilec.runtime.compiled``) gives untiled PyTorch's outputs, gradients and buffers in float64;
dynamo traces the tiles whole (no graph break); where compiling fails, each segment says so once
and its tiles run uncompiled, as exactly."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from support.exactness import check_exact
from support.zoo import TRAIN_SHAPES, TRAIN_ZOO


def test_compiled_tiles_equal_untiled_in_float64():
    """MONAI's BasicUNet in training mode: instance norm by sweeps (moments by ``var_mean``), max
    pooling and LeakyReLU in place in the forms dynamo traces, transposed convolutions,
    concatenated skips; two shape classes (each compiles in several variants: some 50 s)."""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tilec: torch.compile failed")
        check_exact(TRAIN_ZOO["basic_unet"](), TRAIN_SHAPES["basic_unet"], grid=(2, 1), kernels="compiled")
    assert counters["stats"]["unique_graphs"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


def _compile_raising(error):
    """A stand-in for ``torch.compile`` whose compiled functions raise ``error`` when called."""
    def compile(fn, **options):
        def compiled(*args):
            raise error
        return compiled

    return compile


def test_a_tile_function_that_does_not_compile_runs_uncompiled_and_says_so_once(monkeypatch):
    monkeypatch.setattr(torch, "compile", _compile_raising(torch._dynamo.exc.TorchDynamoException("no C++ compiler")))
    model, shape = TRAIN_ZOO["resnet_head"](), TRAIN_SHAPES["resnet_head"]
    with pytest.warns(RuntimeWarning, match="torch.compile failed") as caught:
        check_exact(model, shape, grid=(2, 3), kernels="compiled")
    said = [str(w.message) for w in caught if "torch.compile failed" in str(w.message)]
    assert said and len(said) == len(set(said)), said  # once per segment
    for line in said:
        assert re.fullmatch(r"tilec: torch.compile failed on segment \d+ \(no C\+\+ compiler\); its tiles run "
                            r"uncompiled", line), line


def test_other_errors_in_a_compiled_tile_are_raised(monkeypatch):
    monkeypatch.setattr(torch, "compile", _compile_raising(RuntimeError("out of memory")))
    with pytest.raises(RuntimeError, match="out of memory"):
        check_exact(TRAIN_ZOO["resnet_head"](), TRAIN_SHAPES["resnet_head"], grid=(2, 1), kernels="compiled")
