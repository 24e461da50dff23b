"""Plan loading rejects bad plans with one ``PlanError`` line; random mutations never crash it."""

from __future__ import annotations

import copy
import json

import pytest
from hardening import rich_model, run, small_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tilec.codegen import render
from tilec.errors import PlanError
from tilec.ir import SCHEMA_VERSION, Plan
from tilec.pipeline import load_source
from tilec.planio import dumps, load, loads
from tilec.planner import plan
from tilec.trace import trace

SHAPE = (1, 3, 23, 19)
SEGMENTS = [(0, 4, (3, 2)), (4, 7, (2, 2))]

#: Keys whose integers the structure determines: changing one by a nonzero amount is always caught.
STRUCTURAL = {"owned", "out", "read", "pad", "grad_out", "grad_in", "first", "stop", "grid", "index",
              "input_shape", "output_shape", "in_shape", "out_shape", "shape", "kernel", "stride",
              "dilation", "pad_before", "pad_after", "in_channels", "out_channels", "kernel_size",
              "padding", "groups", "schema_version"}


def _plan() -> Plan:
    return plan(trace(rich_model(), SHAPE), name="rich", segments=SEGMENTS)


PLAN = _plan()
TEXT = dumps(PLAN)
DATA = json.loads(TEXT)


def mutated(edit) -> str:
    data = copy.deepcopy(DATA)
    edit(data)
    return json.dumps(data)


def refused(text: str) -> str:
    with pytest.raises(PlanError) as caught:
        loads(text, "p.json")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("p.json"), message
    return message


def test_valid_plan_round_trips():
    assert loads(TEXT) == PLAN
    assert dumps(loads(TEXT)) == TEXT


@pytest.mark.parametrize("grid", [(9, 9), (4, 4), (1, 4)])
def test_tiles_that_read_only_padding_are_valid(grid):
    """A tile may read only a layer's border padding (empty read), or compute nothing (empty out)."""
    model = nn.Sequential(nn.Conv2d(1, 2, 1, padding=1), nn.ReLU(), nn.Conv2d(2, 1, 1, padding=1))
    the_plan = plan(trace(model, (1, 1, 5, 5)), name="pad", grid=grid)
    segment = the_plan.segments[0]
    steps = [step for tile in segment.rows + segment.cols for step in tile.steps]
    assert any(step.read.length == 0 for step in steps)
    assert loads(dumps(the_plan)) == the_plan


def _set(path, value):
    def edit(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


ROW0 = ["segments", 0, "rows", 0]

CASES = [
    ("not JSON", lambda: "{not json", ["is not JSON", "line 1"]),
    ("empty", lambda: "", ["is not JSON"]),
    ("top-level list", lambda: "[1, 2]", ["not a plan", "not an object"]),
    ("deeply nested", lambda: "[" * 100000 + "]" * 100000, ["JSON"]),
    ("huge integer", lambda: '{"schema_version": ' + "9" * 5000 + "}", ["JSON"]),
    ("future version", lambda: mutated(_set(["schema_version"], SCHEMA_VERSION + 1)), ["newer", "upgrade tilec"]),
    ("old version", lambda: mutated(_set(["schema_version"], 0)), ["schema_version 0", "recompile"]),
    ("missing field", lambda: mutated(lambda d: d.pop("segments")), ["plan schema", "segments", "Field required"]),
    ("wrong type", lambda: mutated(_set(["input_shape"], "1x3")), ["plan schema", "input_shape"]),
    ("unknown field in a step", lambda: mutated(_set(ROW0 + ["steps", 0, "halo"], 1)), ["plan schema", "halo"]),
    ("owned gap", lambda: mutated(_set(ROW0 + ["owned"], [0, DATA["segments"][0]["rows"][0]["owned"][1] - 1])),
     ["segment 0 rows tile 1", "must partition the output [0, 12)"]),
    ("owned short", lambda: mutated(lambda d: d["segments"][0]["cols"][-1].update(owned=[10, 18])),
     ["segment 0 cols tile 1 owns [10, 18)"]),
    ("owned overlap", lambda: mutated(lambda d: d["segments"][1]["cols"][1].update(owned=[1, 3])),
     ["segment 1 cols tile 1 owns [1, 3)", "partition"]),
    ("read out of bounds", lambda: mutated(_set(ROW0 + ["steps", 0, "read"], [-1, 9])),
     ["rows tile 0", "layer 0 (0, Conv2d)", "read [-1, 9)", "outside the input [0, 23)"]),
    ("read past the end", lambda: mutated(lambda d: d["segments"][0]["rows"][-1]["steps"][0].update(read=[14, 24])),
     ["read [14, 24)", "outside the input [0, 23)"]),
    ("read not the window", lambda: mutated(lambda d: d["segments"][0]["rows"][0]["steps"][0].update(
        read=[0, 10], grad_in=[0, 10])), ["read [0, 10) is not the window of out [0, 8), which is [0, 9)"]),
    ("pad not the clipped amount", lambda: mutated(_set(ROW0 + ["steps", 0, "pad"], [0, 0])),
     ["pad (0, 0) does not match the clipped amount (1, 0)"]),
    ("grad_in differs", lambda: mutated(lambda d: d["segments"][0]["rows"][0]["steps"][1].update(grad_in=[0, 1])),
     ["grad_out/grad_in"]),
    ("chain broken", lambda: mutated(lambda d: d["segments"][0]["rows"][0]["steps"][1].update(
        out=[0, 7], grad_out=[0, 7])), ["out [0, 7) is not what the next layer reads [0, 8)"]),
    ("grid differs", lambda: mutated(_set(["segments", 0, "grid"], [2, 2])), ["grid 2x2", "3 row tiles"]),
    ("segments gap", lambda: mutated(_set(["segments", 1, "first"], 5)), ["segment 1 covers layers [5, 7)"]),
    ("segments short", lambda: mutated(lambda d: d["segments"].pop()), ["cover layers [0, 4)", "7 layers"]),
    ("shape class lies", lambda: mutated(_set(["segments", 0, "rows", 1, "shape_class"], 0)), ["shape_class 0"]),
    ("layer edited", lambda: mutated(_set(["model", "layers", 2, "attrs", "negative_slope"], 0.2)),
     ["digest", "edited"]),
    ("digest edited", lambda: mutated(_set(["model", "digest"], "0" * 64)), ["digest"]),
    ("layer shapes break", lambda: mutated(_set(["model", "layers", 4, "in_shape"], [1, 4, 12, 11])),
     ["layer 4", "(1, 4, 12, 11)", "(1, 4, 12, 10)"]),
    ("zero stride", lambda: mutated(_set(["model", "layers", 4, "rows", "stride"], 0)), ["stride", "at least 1"]),
    ("output shape", lambda: mutated(_set(["output_shape"], [1, 2, 3, 4])), ["output_shape"]),
    ("no layers", lambda: mutated(_set(["model", "layers"], [])), ["model.layers is empty"]),
]


@pytest.mark.parametrize("case, make, words", CASES, ids=[c[0] for c in CASES])
def test_loads_refuses(case, make, words):
    message = refused(make())
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"


def test_load_refuses_unreadable_files(tmp_path):
    with pytest.raises(PlanError, match="cannot read plan .*missing.json"):
        load(tmp_path / "missing.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PlanError, match="cannot read plan"):
        load(tmp_path / "binary.json")
    with pytest.raises(PlanError, match="cannot read plan"):
        load(tmp_path)


@pytest.mark.parametrize("case, make, words", [CASES[0], CASES[5], CASES[10], CASES[13], CASES[16]],
                         ids=["not JSON", "future", "partition", "out of bounds", "padding"])
def test_inspect_refuses(tmp_path, case, make, words):
    path = tmp_path / "p.plan.json"
    path.write_text(make())
    result = run(["inspect", str(path)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("Error: ")
    assert all(word in result.output for word in words) and "Traceback" not in result.output


# -- property tests -----------------------------------------------------------------------------


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, (*prefix, index))


def _get(data, path):
    for key in path:
        data = data[key]
    return data


PATHS = list(_paths(DATA))[1:]
#: Integers (not bools) under a structural key, e.g. ("segments", 0, "rows", 1, "owned", 0).
INT_PATHS = [p for p in PATHS if any(isinstance(k, str) and k in STRUCTURAL for k in p[-2:])
             and type(_get(DATA, p)) is int]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def mutations(draw):
    data = copy.deepcopy(DATA)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        try:
            parent, key = _get(data, path[:-1]), path[-1]
            parent[key]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or reshaped it
        kind = draw(st.sampled_from(["replace", "delete", "perturb", "duplicate", "add key", "swap"]))
        value = parent[key]
        if kind == "replace":
            parent[key] = draw(json_values)
        elif kind == "delete":
            del parent[key]
        elif kind == "perturb" and isinstance(value, int | float):
            parent[key] = value + draw(st.sampled_from([-1, 1, -value - 1, 2**31, -(2**62)]))
        elif kind == "duplicate" and isinstance(value, list) and value:
            value.insert(draw(st.integers(0, len(value))), copy.deepcopy(draw(st.sampled_from(value))))
        elif kind == "add key" and isinstance(value, dict):
            value[draw(st.text(max_size=6))] = draw(json_values)
        elif kind == "swap" and isinstance(parent, list) and len(parent) > 1:
            other = draw(st.integers(0, len(parent) - 1))
            parent[key], parent[other] = parent[other], parent[key]
        else:
            parent[key] = draw(json_values)
    return json.dumps(data)


def _loads_or_plan_error(text: str) -> Plan | None:
    try:
        return loads(text, "mutant")
    except PlanError as error:
        assert "\n" not in str(error) and str(error).startswith("mutant")
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_random_mutations_raise_only_plan_error(text):
    result = _loads_or_plan_error(text)
    if result is not None:
        # What survives validation is consistent enough to compile into a module.
        render(result)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(INT_PATHS), st.sampled_from([-2, -1, 1, 2, 7]))
def test_structural_integer_changes_are_always_caught(path, delta):
    def edit(data):
        parent = _get(data, path[:-1])
        parent[path[-1]] += delta
    assert _loads_or_plan_error(mutated(edit)) is None, f"{path} += {delta} was accepted"


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(TEXT) - 1), st.sampled_from(["truncate", "flip", "insert"]), st.characters())
def test_corrupted_text_raises_only_plan_error(position, kind, char):
    if kind == "truncate":
        text = TEXT[:position]
    elif kind == "flip":
        text = TEXT[:position] + char + TEXT[position + 1:]
    else:
        text = TEXT[:position] + char + TEXT[position:]
    _loads_or_plan_error(text)


def test_the_property_tests_see_the_whole_plan():
    """Sanity: the mutation paths reach the tiles, and the integer paths cover every region field."""
    keys = {k for p in INT_PATHS for k in p if isinstance(k, str)}
    assert {"owned", "out", "read", "pad", "grad_out", "grad_in", "first", "stop", "grid"} <= keys
    assert len(INT_PATHS) > 500


# -- the generated module checks a plan file with the standard library only ---------------------


def test_generated_module_checks_plan_files(tmp_path):
    module = load_source(render(PLAN), "rich_tiled")
    good = tmp_path / "good.json"
    good.write_text(TEXT)
    module.check_plan(str(good))
    other = plan(trace(rich_model(), SHAPE), name="rich", grid=(2, 2))
    small = plan(trace(small_model(), (1, 3, 16, 16)), name="rich", grid=(2, 2))
    cases = {
        "other grid": (dumps(other), "segments"),
        "other model": (dumps(small), "digest"),
        "other shape": (mutated(_set(["input_shape"], [2, 3, 23, 19])), "input shape"),
        "future": (mutated(_set(["schema_version"], 99)), "schema_version 99"),
        "no digest": (mutated(lambda d: d["model"].pop("digest")), "'digest'"),
        "bad segments": (mutated(_set(["segments"], [1])), "malformed segments"),
        "not JSON": ("{", "cannot read plan"),
        "top-level list": ("[]", "no 'schema_version'"),
    }
    for name, (text, words) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=words):
            module.check_plan(str(path))
    with pytest.raises(ValueError, match="cannot read plan"):
        module.check_plan(str(tmp_path / "missing.json"))
