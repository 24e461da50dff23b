"""The exported plan schema is current, and plans survive a JSON round trip unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from tilec import schema
from tilec.errors import PlanError
from tilec.ir import SCHEMA_VERSION, Plan
from tilec.modelfile import load_model
from tilec.planio import dumps, load, loads
from tilec.planner import plan
from tilec.trace import trace

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "plans" / "plan.schema.json"
REGENERATE = "python -m tilec.schema  (run from the repository root)"


def _plan(grid=(2, 3), segments=None) -> Plan:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), nn.Conv2d(4, 2, (1, 3), dilation=2, bias=False),
        nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False), nn.GELU(approximate="tanh"),
    ).eval()
    return plan(trace(model, (1, 3, 19, 23)), name="sample", grid=grid, segments=segments)


def test_committed_schema_is_current():
    assert COMMITTED.is_file(), f"plans/plan.schema.json is missing; regenerate it with: {REGENERATE}"
    assert COMMITTED.read_text(encoding="utf-8") == schema.schema_text(), (
        f"plans/plan.schema.json is out of date with tilec.ir; regenerate it with: {REGENERATE}"
    )


def test_schema_describes_plan():
    exported = schema.plan_schema()
    assert exported["properties"] == Plan.model_json_schema()["$defs"]["Plan"]["properties"]
    assert exported["properties"]["other"]["anyOf"][0] == {"$ref": "#/$defs/Plan"}
    assert exported["title"] == "Plan" and exported["type"] == "object"
    assert set(exported["required"]) <= set(exported["properties"])
    data = json.loads(dumps(_plan()))
    assert set(data) == set(exported["properties"])
    assert exported["additionalProperties"] is False


def test_schema_main_writes_file(tmp_path, capsys):
    target = tmp_path / "nested" / "plan.schema.json"
    schema.main([str(target)])
    assert target.read_text(encoding="utf-8") == schema.schema_text()
    assert str(target) in capsys.readouterr().out


def test_schema_main_default_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    schema.main([])
    assert (tmp_path / "plans" / "plan.schema.json").read_text(encoding="utf-8") == COMMITTED.read_text("utf-8")


@pytest.mark.parametrize(
    "kwargs", [{"grid": (1, 1)}, {"grid": (2, 3)}, {"grid": (5, 4)}, {"segments": [(0, 4, (3, 3)), (4, 7, (2, 1))]}]
)
def test_round_trip(kwargs, tmp_path):
    original = _plan(**kwargs)
    text = dumps(original)
    assert loads(text) == original
    assert dumps(loads(text)) == text
    path = tmp_path / "sample.plan.json"
    path.write_text(text, encoding="utf-8")
    assert load(path) == original
    assert text.endswith("\n") and json.loads(text)["schema_version"] == SCHEMA_VERSION


def test_schema_1_plan_is_refused_with_recompile_advice():
    text = dumps(_plan()).replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 1')
    with pytest.raises(PlanError, match="older tilec.*recompile") as caught:
        loads(text, source="old.plan.json")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda text: text[: len(text) // 2], "is not JSON"),
        (lambda text: "[1, 2]", "top level is not an object"),
        (lambda text: text.replace(f'"schema_version": {SCHEMA_VERSION}', '"schema_version": 99'),
         "newer than this tilec"),
        (lambda text: text.replace('"name": "sample"', '"name": "sample", "extra": 1'), "at extra"),
        (lambda text: text.replace('"shape": [1, 3, 19, 23]', '"shape": "1, 3"', 1), "at inputs.0.shape"),
    ],
)
def test_invalid_plan_text_is_one_plan_error(mutate, message):
    with pytest.raises(PlanError, match=message) as caught:
        loads(mutate(dumps(_plan())), source="x.plan.json")
    assert "\n" not in str(caught.value) and str(caught.value).startswith("x.plan.json")


@pytest.mark.parametrize("path", sorted((ROOT / "plans").glob("*.plan.json")), ids=lambda p: p.name)
def test_committed_plans_are_current(path):
    """Each committed plan is what the planner now makes of its example at its shape and grid (or
    segments). Regenerate them with::

        for NAME in vgg16 resnet50 darknet19 attention_mil; do
            tilec compile examples/$NAME.py --grid 2x2 --out-dir /tmp/gen --plan-dir plans; done
        tilec compile examples/unet.py --input-shape 1,3,256,256 --grid 4x4 --out-dir /tmp/gen --plan-dir plans
    """
    committed = load(path)
    name = path.name.removesuffix(".plan.json")
    assert committed.memory_budget is None and committed.ranks is None and committed.autocast is None
    model, _ = load_model(ROOT / "examples" / f"{name}.py", "model")
    graph = trace(model, [(spec.shape, spec.dtype) for spec in committed.inputs])
    if committed.grid is not None:
        again = plan(graph, name=name, grid=committed.grid, dtype=committed.dtype)
    else:
        segments = [(s.first, s.stop, s.grid, s.mode) for s in committed.segments]
        again = plan(graph, name=name, segments=segments, dtype=committed.dtype)
    assert dumps(again) == path.read_text(encoding="utf-8"), (
        f"plans/{path.name} is out of date; regenerate it as this test's docstring says")
