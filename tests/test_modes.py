"""Both modes, exactly: a forward that branches on ``self.training`` traces another graph in each
mode (``tilec.trace.trace_modes``); the generated module carries a plan per mode and runs the one
of the modules' modes, or refuses a mode it has no plan for in one line.

Each model of ``MODE_ZOO`` (drop-connect, drop-path and stochastic depth at p > 0, an auxiliary
head returned only in training) trains one float64 step in training mode, then runs one step in
eval mode, through one ``TiledModel``: outputs, the input gradient, every parameter gradient and
every buffer equal plain PyTorch's (``max_errors``: the same seed before each forward, so the
per-sample masks draw alike).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from tilec.codegen import render
from tilec.config import CompileConfig
from tilec.errors import PlanError
from tilec.pipeline import build, compile_model, plan_modes, target_for
from tilec.planio import dumps, load, loads
from tilec.trace import trace_modes

from support.exactness import TOLERANCE, max_errors
from support.published import published
from support.zoo import MODE_SHAPES, MODE_ZOO, TRAIN_SHAPES, TRAIN_ZOO, DropPathNet, conv_bn

GRIDS = [(1, 1), (2, 2), (4, 3)]


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda item: item[1])


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("name", sorted(MODE_ZOO))
def test_a_training_step_then_an_eval_step_are_exact(name, grid):
    model = MODE_ZOO[name]().double()
    tiled = build(model, MODE_SHAPES[name], grid, dtype="float64")
    assert tiled.plan.mode == "train" and type(tiled).other.plan.mode == "eval"
    trained = max_errors(model, MODE_SHAPES[name], tiled=tiled, seed=1)
    assert _worst(trained)[1] <= TOLERANCE, f"training step: {_worst(trained)}"
    model.eval()
    evaluated = max_errors(model, MODE_SHAPES[name], tiled=tiled, seed=2)
    assert _worst(evaluated)[1] <= TOLERANCE, f"eval step: {_worst(evaluated)}"


def test_the_eval_plan_has_no_training_branch():
    """The eval-mode graph of drop-connect draws no mask and does not scale by 1 / keep."""
    traced = trace_modes(MODE_ZOO["drop_connect"]().double(), MODE_SHAPES["drop_connect"])
    train, evaluated = traced.graphs
    assert (train.mode, evaluated.mode) == ("train", "eval")
    assert any(node.op == "rand" for node in train) and not any(node.op in ("rand", "floor") for node in evaluated)
    assert len(evaluated) < len(train)


def test_modes_are_restored_after_tracing():
    model = DropPathNet().double().train()
    model.blocks[1].eval()
    model.stem[1].eval()  # a frozen BatchNorm
    before = [m.training for m in model.modules()]
    traced = trace_modes(model, (2, 3, 9, 9))
    assert [m.training for m in model.modules()] == before
    flipped = traced.graphs[0].flipped
    assert "blocks.1" in flipped and all(path.startswith("blocks.1") for path in flipped)
    assert "blocks.1.branch.0.1" not in flipped  # BatchNorm follows its flag at run time


def test_a_model_without_branches_has_one_plan_for_both_modes():
    """BatchNorm's batch statistics and Dropout modules follow their flags at run time: one graph."""
    model = TRAIN_ZOO["resnet_basic"]().double()
    tiled = build(model, TRAIN_SHAPES["resnet_basic"], (2, 2), dtype="float64")
    assert tiled.plan.mode is None and type(tiled).other is None
    model.eval()
    assert _worst(max_errors(model, TRAIN_SHAPES["resnet_basic"], tiled=tiled))[1] <= TOLERANCE


def test_an_eval_compiled_model_trains_by_its_training_plan():
    model = MODE_ZOO["drop_path"]().double().eval()
    tiled = build(model, MODE_SHAPES["drop_path"], (3, 2), dtype="float64")
    assert tiled.plan.mode == "eval" and type(tiled).other.plan.mode == "train"
    model.train()
    assert _worst(max_errors(model, MODE_SHAPES["drop_path"], tiled=tiled, seed=3))[1] <= TOLERANCE


def test_a_frozen_batch_norm_runs_by_the_plan_of_the_others_mode():
    model = MODE_ZOO["drop_path"]().double()
    tiled = build(model, MODE_SHAPES["drop_path"], (2, 3), dtype="float64")
    model.stem[1].eval()
    assert _worst(max_errors(model, MODE_SHAPES["drop_path"], tiled=tiled, seed=4))[1] <= TOLERANCE


def _refusal(tiled, shape) -> str:
    with pytest.raises(ValueError) as caught:
        tiled(torch.randn(shape, dtype=torch.float64))
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_modules_in_mixed_modes_are_refused_naming_the_module():
    model = MODE_ZOO["drop_path"]().double()
    tiled = build(model, MODE_SHAPES["drop_path"], (2, 2), dtype="float64")
    model.blocks[1].eval()
    message = _refusal(tiled, MODE_SHAPES["drop_path"])
    assert message.startswith("module blocks.1 (DropPathBlock) is in eval mode, but the training-mode plan")
    model.train()
    model.eval()
    model.blocks[0].train()
    assert _refusal(tiled, MODE_SHAPES["drop_path"]).startswith("module blocks.0 (DropPathBlock) is in training mode")


class EvalOnlyRefused(nn.Module):
    """Traces in training mode; in eval mode its head makes a tensor constant, which tilec refuses."""

    def __init__(self):
        super().__init__()
        self.body = conv_bn(3, 4)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        x = self.head(self.body(x))
        return x if self.training else x + torch.tensor([1.0, 2.0], dtype=x.dtype).view(1, 2, 1, 1)


def test_a_mode_that_does_not_trace_is_refused_at_run_time_in_one_line():
    model = EvalOnlyRefused().double().train()
    tiled = build(model, (1, 3, 9, 8), (2, 2), dtype="float64")
    assert tiled.plan.mode == "train" and type(tiled).other is None and "eval mode" in tiled.plan.refused
    assert _worst(max_errors(model, (1, 3, 9, 8), tiled=tiled))[1] <= TOLERANCE
    model.eval()
    message = _refusal(tiled, (1, 3, 9, 8))
    assert message.startswith("the model is in eval mode, but plan 'model' has a training-mode graph only: the model "
                              "does not trace in eval mode:"), message
    assert "tensor constant" in message


def test_a_plan_of_two_modes_round_trips_and_renders_the_same_bytes():
    model = MODE_ZOO["aux_head"]().double()
    traced = trace_modes(model, MODE_SHAPES["aux_head"])
    plan = plan_modes(traced, target_for(traced.graphs[0], "float64"), "aux", grid=(2, 2), dtype="float64")
    assert plan.other is not None and plan.other.mode == "eval" and plan.refused is None
    assert loads(dumps(plan)) == plan
    again = plan_modes(trace_modes(model, MODE_SHAPES["aux_head"]), target_for(traced.graphs[0], "float64"), "aux",
                       grid=(2, 2), dtype="float64")
    assert dumps(again) == dumps(plan) and render(again) == render(plan)
    broken = plan.model_copy(update={"other": plan.other.model_copy(update={"mode": "train"})})
    with pytest.raises(PlanError, match="^plan is inconsistent: the other mode's plan has mode 'train'"):
        loads(dumps(broken))
    with pytest.raises(PlanError, match="needs exactly one of the other mode's plan"):
        loads(dumps(plan.model_copy(update={"other": None})))


def test_explicit_segments_plan_the_other_mode_by_their_largest_grid():
    model = MODE_ZOO["drop_connect"]().double()
    traced = trace_modes(model, MODE_SHAPES["drop_connect"])
    count = len(traced.graphs[0])
    plan = plan_modes(traced, target_for(traced.graphs[0], "float64"), "s",
                      segments=[(0, count // 2, (3, 2)), (count // 2, count, (1, 1))], dtype="float64")
    assert {s.grid for s in plan.other.segments if s.mode == "tiled"} == {(3, 2)}


MODEL_FILE = """
from support.zoo import MODE_ZOO

INPUT_SHAPE = (2, 3, 14, 11)
model = MODE_ZOO["drop_connect"]
"""


def test_compile_writes_one_plan_file_and_module_of_both_modes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    path = tmp_path / "drop.py"
    path.write_text(textwrap.dedent(MODEL_FILE), encoding="utf-8")
    result = compile_model(CompileConfig(model_path=path, grid=(2, 2), out_dir=tmp_path, plan_dir=tmp_path,
                                         dtype="float64"))
    plan = load(result.plan_path)
    assert plan == result.plan and plan.other.mode == "eval"
    spec = importlib.util.spec_from_file_location("drop_tiled", result.module_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.pop("drop_tiled", None)
    spec.loader.exec_module(module)
    module.check_plan(str(result.plan_path))
    model = MODE_ZOO["drop_connect"]().double()
    reference = copy.deepcopy(model).eval()
    tiled = module.TiledModel(model.eval())
    x = torch.randn(2, 3, 14, 11, dtype=torch.float64)
    assert (tiled(x) - reference(x)).abs().max() <= TOLERANCE


def test_timm_drop_path_model_is_exact_in_both_modes():
    timm = published("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=3, drop_path_rate=0.2).double().train()
    shape = (2, 3, 37, 35)
    tiled = build(model, shape, (2, 2), dtype="float64")
    assert type(tiled).other is not None
    assert _worst(max_errors(model, shape, tiled=tiled, seed=5))[1] <= TOLERANCE
    model.eval()
    assert _worst(max_errors(model, shape, tiled=tiled, seed=6))[1] <= TOLERANCE
