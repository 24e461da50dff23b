"""Plan loading rejects inconsistent plans with one ``PlanError`` line; random mutations never crash it."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from tilec.errors import PlanError
from tilec.graph import Graph
from tilec.ir import SCHEMA_VERSION, Plan
from tilec.pipeline import plan_for
from tilec.planio import dumps, loads
from tilec.target import REFERENCE
from tilec.trace import trace
from tilec.validate import check_version, validate

from support.hardening import run
from support.models import SE_SPLIT, grid_plan, segment_plan

#: Two segments cutting the residual block (two outputs cross) and the U-Net skip.
SPLIT = {"residual": ((0, 4, (3, 2)), (4, 8, (2, 2))), "unet": ((0, 3, (2, 2)), (3, 10, (3, 2)))}


def plans() -> dict[str, Plan]:
    """"se 3x2" is one tiled segment whose SE branch runs by a sweep (a level with a reduction and
    small ops, partials per tile); "se split" stores the branch between two tiled segments."""
    found = {f"{name} 3x2": grid_plan(name) for name in ("residual", "unet", "se", "swap")}
    found.update({f"{name} split": segment_plan(name, segments) for name, segments in SPLIT.items()})
    found["se split"] = segment_plan("se", SE_SPLIT)
    found["unet 7x5"] = grid_plan("unet", (7, 5))
    return found


@pytest.mark.parametrize("name", list(plans()))
def test_valid_plans_pass_and_round_trip(name):
    plan = plans()[name]
    assert validate(plan, "p") is plan
    text = dumps(plan)
    assert loads(text) == plan
    assert dumps(loads(text)) == text


@pytest.mark.parametrize("grid", [(7, 7), (4, 4), (1, 4)])
def test_tiles_that_read_only_padding_are_valid(grid):
    """A tile may read only a node's border padding (empty read), or compute nothing (empty out)."""
    model = nn.Sequential(nn.Conv2d(1, 2, 1, padding=1), nn.ReLU(), nn.Conv2d(2, 1, 1, padding=1))
    plan = plan_for(trace(model, (1, 1, 5, 5)), REFERENCE, "pad", grid=grid)
    segment = plan.segments[0]
    reads = [read for tile in segment.rows + segment.cols for step in tile.steps for read in step.reads]
    assert any(read.read.length == 0 for read in reads)
    assert loads(dumps(plan)) == plan


class RowPositions(nn.Module):
    """A positional map made in ``forward`` from the image's shape, as EdgeNeXt's Fourier encoding
    makes it: a running count over the rows of a (N, H, W) mask (not an image: no channels),
    divided by its last row (a slice of that count), added to the image."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        count = torch.ones(x.shape[0], *x.shape[2:]).cumsum(1)
        return self.conv(x) + (count / count[:, -1:, :]).unsqueeze(1)


def test_slices_of_tensors_that_are_not_images_are_valid():
    plan = plan_for(trace(RowPositions(), (1, 2, 9, 7)), REFERENCE, "rows", grid=(2, 2))
    assert any(node.op == "slice" and node.spatial is None for node in plan.model.nodes)
    assert validate(plan, "p") is plan and loads(dumps(plan)) == plan


# -- versions -----------------------------------------------------------------------------------

#: The start of a schema-1 plan: a chain of layers.
SCHEMA_1 = {
    "schema_version": 1, "name": "vgg", "input_shape": [1, 3, 8, 8], "output_shape": [1, 4, 8, 8],
    "dtype": "float32", "memory_budget": None, "predicted_peak_bytes": 1,
    "model": {"digest": "0" * 64, "layers": [{"index": 0, "path": "0", "type": "Conv2d", "op": "conv2d"}]},
    "segments": [{"index": 0, "first": 0, "stop": 1, "grid": [1, 1], "rows": [], "cols": []}],
}


def refused(text: str, *words: str) -> str:
    with pytest.raises(PlanError) as caught:
        loads(text, "p.json")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("p.json"), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


def test_schema_1_plan_is_refused_with_the_recompile_message():
    refused(json.dumps(SCHEMA_1), "older tilec", "recompile", "tilec compile")


@pytest.mark.parametrize("data, words", [
    (SCHEMA_1, ["schema_version 1", "older tilec", "`tilec compile`"]),
    ({k: v for k, v in SCHEMA_1.items() if k != "schema_version"}, ["model.layers", "older tilec", "recompile"]),
    ({"schema_version": 0}, ["schema_version 0", "older tilec"]),
    ({"schema_version": SCHEMA_VERSION + 1}, ["newer", "upgrade tilec"]),
    ({}, ["has no schema_version"]),
])
def test_check_version_refuses_other_versions(data, words):
    with pytest.raises(PlanError) as caught:
        check_version(data, "p.json")
    assert str(caught.value).startswith("p.json") and all(word in str(caught.value) for word in words)


@pytest.mark.parametrize("data", [{"schema_version": SCHEMA_VERSION}, {"schema_version": True},
                                  {"schema_version": SCHEMA_VERSION, "model": {"nodes": [], "layers": []}}])
def test_check_version_leaves_the_rest_to_the_schema(data):
    check_version(data, "p.json")


def test_validate_refuses_a_plan_object_of_another_version():
    plan = grid_plan("residual").model_copy(update={"schema_version": 1})
    with pytest.raises(PlanError, match="^p: .*older tilec"):
        validate(plan, "p:")


# -- single-field mutations ---------------------------------------------------------------------


def data_of(plan: Plan) -> dict:
    return json.loads(dumps(plan))


def redigest(data: dict) -> None:
    """Give a mutated plan the digest of its (mutated) model, so the later checks are reached."""
    plan = Plan.model_validate(data)
    data["model"]["digest"] = Graph.of_plan(plan).fingerprint().digest


def node_index(data: dict, name: str) -> int:
    return next(k for k, node in enumerate(data["model"]["nodes"]) if node["name"] == name)


def step_of(data: dict, segment: int, axis: str, tile: int, node: str) -> dict:
    return next(s for s in data["segments"][segment][axis][tile]["steps"] if s["node"] == node)


def shift(interval: list, delta: int, end: int = 1) -> None:
    interval[end] += delta


def _swap_classes(data):
    rows = data["segments"][0]["rows"]
    rows[0]["shape_class"], rows[1]["shape_class"] = rows[1]["shape_class"], rows[0]["shape_class"]


def _merge_classes(data):
    data["segments"][0]["rows"][1]["shape_class"] = 0


def _rename_read(data):
    step_of(data, 0, "rows", 0, "add")["reads"][0]["input"] = "conv2d"


def _drop_node(data):
    del data["model"]["nodes"][node_index(data, "batch_norm")]


def _swap_nodes(data):
    nodes = data["model"]["nodes"]
    nodes[1], nodes[2] = nodes[2], nodes[1]


def _edit_const(data):
    data["model"]["nodes"][node_index(data, "conv2d_1")]["args"][4]["value"] = [1, 1]


def _uneven_owned(data):
    rows = data["segments"][0]["rows"]
    rows[0]["owned"][0][1] += 1
    rows[1]["owned"][0][0] += 1


def _owned_gap(data):
    data["segments"][0]["cols"][0]["owned"][0][1] -= 1


def _boundary(data):
    data["segments"][1]["first"] -= 1


def _stored_gets_tiles(data):
    data["segments"][1]["grid"] = [2, 1]


def _stored_tiled(data):
    data["segments"][1]["mode"] = "tiled"


def _unslice(data):
    data["segments"][2]["inputs"][0]["sliced"] = False


def _drop_output(data):
    data["segments"][0]["outputs"] = data["segments"][0]["outputs"][:1]


def _flip_tileable(data):
    data["model"]["nodes"][node_index(data, "mul")]["tileable"] = False
    redigest(data)


def _unknown_tensor(data):
    data["model"]["nodes"][0]["args"][1]["value"] = "nowhere.weight"
    redigest(data)


def _wrong_inputs(data):
    data["model"]["nodes"][node_index(data, "add")]["inputs"] = ["relu"]
    redigest(data)


def _twice(data):
    data["model"]["nodes"][1]["name"] = data["model"]["nodes"][0]["name"]
    redigest(data)


def _forged_stride(data):
    data["model"]["nodes"][node_index(data, "conv2d_1")]["args"][3]["value"] = "two"
    redigest(data)


def _forged_output(data):
    data["model"]["output"]["node"] = "ghost"
    redigest(data)


def _node_edit(field: str, value: str):
    """Set the first node's ``field`` to ``value``, with the digest of the edited model."""
    def edit(data):
        data["model"]["nodes"][0][field] = value
        redigest(data)
    return edit


def _uneven_partials(data):
    rows = data["segments"][0]["rows"]
    rows[0]["partials"][0][1] += 1
    rows[1]["partials"][0][0] += 1


def _level_of_a_stored_segment(data):
    data["segments"][1]["levels"] = [{"index": 1, "reductions": ["adaptive_avg_pool2d"], "small": [],
                                      "direct": True, "swept": False}]


def _dropped_and_redigested(data):
    _drop_node(data)
    redigest(data)


#: (plan, edit, words in the message). The residual plan is "residual 3x2", one segment of 8 nodes.
CASES = {
    "out shifted": ("residual 3x2", lambda d: shift(step_of(d, 0, "rows", 1, "relu")["out"], 1),
                    ["segment 0 rows tile 1, node relu", "hull of its consumers' reads"]),
    "out shifted back": ("residual 3x2", lambda d: shift(step_of(d, 0, "cols", 0, "conv2d")["out"], -1, 0),
                         ["segment 0 cols tile 0, node conv2d", "out [-1, "]),
    "read shifted": ("residual 3x2", lambda d: shift(step_of(d, 0, "rows", 0, "conv2d_1")["reads"][0]["read"], -1),
                     ["node conv2d_1", "is not what its rule needs"]),
    "read past the input": ("residual 3x2", lambda d: shift(step_of(d, 0, "rows", 2, "conv2d")["reads"][0]["read"],
                                                            1), ["rows tile 2, node conv2d", "clipped to the input"]),
    "pad changed": ("residual 3x2", lambda d: step_of(d, 0, "rows", 0, "conv2d")["reads"][0].update(pad=[0, 0]),
                    ["node conv2d: pad (0, 0) of x", "clipped amount (1, 0)"]),
    "pad on a pointwise read": ("residual 3x2", lambda d: step_of(d, 0, "cols", 1, "relu")["reads"][0].update(
        pad=[0, 1]), ["node relu: pad (0, 1)", "(0, 0)"]),
    "grad in differs": ("residual 3x2", lambda d: shift(step_of(d, 0, "rows", 0, "add")["reads"][1]["grad"], 1),
                        ["node add: grad", "differs from read"]),
    "grad out differs": ("residual 3x2", lambda d: shift(step_of(d, 0, "cols", 1, "max_pool2d")["grad_out"], -1),
                         ["node max_pool2d: grad_out"]),
    "tile input shifted": ("residual 3x2", lambda d: shift(d["segments"][0]["rows"][1]["inputs"][0], 1),
                           ["rows tile 1 reads", "of input x", "hull of its readers' reads"]),
    "read input renamed": ("residual 3x2", _rename_read, ["node add reads ['conv2d', 'conv2d_1']", "its rule reads"]),
    "step node renamed": ("residual 3x2", lambda d: step_of(d, 0, "rows", 0, "relu_1").update(node="relu"),
                          ["has a step for node relu where", "relu_1"]),
    "shape classes swapped": ("residual 3x2", _swap_classes, ["rows tile", "shape_class"]),
    "shape classes merged": ("residual 3x2", _merge_classes, ["rows tile 1 shares shape_class 0 with tile 0"]),
    "tile index": ("residual 3x2", lambda d: d["segments"][0]["cols"][1].update(index=0),
                   ["cols tile 1 has index 0"]),
    "owned uneven": ("residual 3x2", _uneven_owned, ["rows tile 0 owns [0, 5) of output conv2d_2", "grid's split"]),
    "owned gap": ("residual 3x2", _owned_gap, ["cols tile 1 owns [5, 10)", "must partition [0, 10)"]),
    "owned short": ("residual 3x2", lambda d: shift(d["segments"][0]["cols"][1]["owned"][0], -1),
                    ["owned parts of output conv2d_2 cover [0, 9), not [0, 10)"]),
    "grid": ("residual 3x2", lambda d: d["segments"][0].update(grid=[2, 2]), ["grid 2x2", "3 row tiles"]),
    "node dropped": ("residual 3x2", _drop_node, ["node relu reads 'batch_norm'", "earlier node"]),
    "node dropped and redigested": ("residual 3x2", _dropped_and_redigested, ["earlier node"]),
    "nodes swapped": ("residual 3x2", _swap_nodes, ["reads 'batch_norm'", "execution order"]),
    "node edited": ("residual 3x2", _edit_const, ["digest", "edited"]),
    "digest changed": ("residual 3x2", lambda d: d["model"].update(digest="0" * 64), ["model.digest"]),
    "input taller": ("residual 3x2", lambda d: shift(d["inputs"][0]["shape"], 1, 2),
                     ["node conv2d (aten.conv2d) has rows size 23", "gives 24"]),
    "input narrower": ("unet 3x2", lambda d: shift(d["inputs"][0]["shape"], -1, 3), ["cols size 19", "gives 18"]),
    "input channels": ("residual 3x2", lambda d: shift(d["inputs"][0]["shape"], 1, 1),
                       ["inputs[0].shape (1, 4, 23, 19) cannot be read by node conv2d (aten.conv2d)", "3 channels"]),
    "input batch": ("residual 3x2", lambda d: shift(d["inputs"][0]["shape"], 1, 0),
                    ["inputs[0].shape (2, 3, 23, 19) gives node conv2d (aten.conv2d) shape (2, 4, 23, 19)",
                     "graph has (1, 4, 23, 19)"]),
    "negative peak": ("se split", lambda d: d["segments"][2].update(predicted_peak_bytes=-1),
                      ["segment 2 has predictions out of range"]),
    "budget zero": ("se split", lambda d: d.update(memory_budget=0), ["memory_budget 0"]),
    "input renamed": ("residual 3x2", lambda d: d["inputs"][0].update(name="y"), ["reads 'x'", "neither an input"]),
    "input twice": ("residual 3x2", lambda d: d["inputs"].append(dict(d["inputs"][0])), ["distinct names"]),
    "input empty": ("residual 3x2", lambda d: d["inputs"][0].update(shape=[1, 3, 0, 19]), ["not positive sizes"]),
    "segment boundary": ("se split", _boundary, ["segment 1 covers nodes [1, 7)", "starting at 2"]),
    "segment end": ("se split", lambda d: d["segments"][2].update(stop=10), ["segment 2 covers nodes [7, 10)"]),
    "segments short": ("se split", lambda d: d["segments"].pop(), ["cover nodes [0, 7)", "9 nodes"]),
    "segment index": ("se split", lambda d: d["segments"][1].update(index=2), ["segment 1 has index 2"]),
    "stored with a grid": ("se split", _stored_gets_tiles, ["segment 1 is stored", "grid 2x1"]),
    "untileable node tiled": ("swap 3x2", _stored_tiled, ["segment 1 is tiled", "node transpose"]),
    "input not sliced": ("se split", _unslice, ["segment 2 has inputs [relu (whole), sigmoid (whole)]"]),
    "model input rolled": ("residual split", lambda d: d["segments"][0].update(rolled=["input"]),
                           ["segment 0 rolls the gradient of input", "another backward may still read"]),
    "skip rolled by a later reader": ("residual split", lambda d: d["segments"][1].update(rolled=["relu", "conv2d_1"]),
                                      ["segment 1 rolls the gradient of relu"]),
    "stored segment's output rolled": ("se split", lambda d: d["segments"][2].update(rolled=["sigmoid"]),
                                       ["segment 2 rolls the gradient of sigmoid"]),
    "output dropped": ("unet split", _drop_output, ["segment 0 has outputs ['relu']", "['relu', 'max_pool2d']"]),
    "owned of a second output": ("unet split", lambda d: shift(d["segments"][0]["rows"][0]["owned"][1], 1),
                                 ["of output max_pool2d"]),
    "levels dropped": ("se 3x2", lambda d: d["segments"][0].update(levels=[]),
                       ["segment 0 has levels []", "but its nodes make", "adaptive_avg_pool2d"]),
    "small op left out": ("se 3x2", lambda d: d["segments"][0]["levels"][0]["small"].pop(),
                          ["segment 0 has levels", "'conv2d_2'), 'direct'", "but its nodes make",
                           "'sigmoid'), 'direct'"]),
    "level made direct": ("se 3x2", lambda d: d["segments"][0]["levels"][0].update(direct=True),
                          ["segment 0 has levels", "'direct': True", "'direct': False"]),
    "level not swept": ("se 3x2", lambda d: d["segments"][0]["levels"][0].update(swept=False),
                        ["segment 0 has levels", "'swept': False", "'swept': True"]),
    "level index": ("se 3x2", lambda d: d["segments"][0]["levels"][0].update(index=2), ["segment 0 has levels"]),
    "levels of a stored segment": ("se split", _level_of_a_stored_segment,
                                   ["segment 1 has levels", "but its nodes make []"]),
    "partials uneven": ("se 3x2", _uneven_partials, ["rows tile 0's partial of adaptive_avg_pool2d", "grid's split"]),
    "partial gap": ("se 3x2", lambda d: shift(d["segments"][0]["cols"][1]["partials"][0], 1, 0),
                    ["cols tile 1 owns", "of the input of reduction adaptive_avg_pool2d", "must partition"]),
    "partials short": ("se 3x2", lambda d: shift(d["segments"][0]["rows"][2]["partials"][0], -1),
                       ["the input of reduction adaptive_avg_pool2d cover [0, 22), not [0, 23)"]),
    "partials missing": ("se 3x2", lambda d: d["segments"][0]["cols"][0].update(partials=[]),
                         ["cols tile 0 has 0 partials for 1 reductions"]),
    "owned of a small output": ("residual 3x2", lambda d: d["segments"][0]["rows"][0]["owned"].append([0, 1]),
                                ["rows tile 0 owns 2 intervals for 1 image outputs"]),
    "tileable flipped": ("se split", _flip_tileable, ["node mul (aten.mul) is marked tileable=False"]),
    "unknown tensor": ("residual 3x2", _unknown_tensor, ["'nowhere.weight', which is not in model.tensors"]),
    "inputs differ from args": ("residual 3x2", _wrong_inputs, ["node add lists inputs ['relu']"]),
    "name twice": ("residual 3x2", _twice, ["'conv2d' is used twice"]),
    "forged stride": ("residual 3x2", _forged_stride, ["node conv2d_1 (aten.conv2d) cannot be evaluated"]),
    "unknown aten op": ("residual 3x2", _node_edit("target", "aten.bogus.default"),
                        ["node conv2d has target 'aten.bogus.default', not an overload of its op: 'aten.conv2d."]),
    "not an aten op": ("residual 3x2", _node_edit("target", "builtins.print"), ["target 'builtins.print'"]),
    "another op's target": ("residual 3x2", _node_edit("target", "aten.relu.default"), ["target 'aten.relu.default'"]),
    "unknown overload": ("residual 3x2", _node_edit("target", "aten.conv2d.bogus"),
                         ["target 'aten.conv2d.bogus', which is not an aten op of this torch"]),
    "op and target unknown": ("residual 3x2", lambda d: (d["model"]["nodes"][0].update(op="bogus"),
                                                         _node_edit("target", "aten.bogus.default")(d)),
                              ["target 'aten.bogus.default', which is not an aten op"]),
    "getitem target": ("residual 3x2", _node_edit("target", "getitem"), ["op 'conv2d' and target 'getitem'"]),
    "forged output": ("residual 3x2", _forged_output, ["output tree's tensor 'ghost'"]),
    "reuse without a background": ("se 3x2", lambda d: d["segments"][0].update(reused=2),
                                   ["segment 0 counts 2 tiles as computed once", "needs a known background"]),
    "period of a stored segment": ("se split", lambda d: d["segments"][1].update(period=[4, 4]),
                                   ["segment 1 is stored but has a period"]),
    "period off the grid": ("residual 3x2", lambda d: d["segments"][0].update(period=[4, 4]),
                            ["segment 0 has period (4, 4)", "grid 3x2"]),
    "period unlike the tiles": ("residual 3x2", lambda d: d["segments"][0].update(period=[10, 10]),
                                ["rows tile 0 owns [0, 4) of output conv2d_2", "split [0, 5)"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_single_mutations_are_refused(case):
    name, edit, words = CASES[case]
    data = data_of(plans()[name])
    edit(data)
    refused(json.dumps(data), "p.json is inconsistent: ", *words)


def test_inspect_refuses_an_inconsistent_plan_in_one_line(tmp_path):
    data = data_of(plans()["residual 3x2"])
    step_of(data, 0, "rows", 0, "conv2d")["reads"][0].update(pad=[0, 0])
    path = tmp_path / "p.plan.json"
    path.write_text(json.dumps(data))
    result = run(["inspect", str(path)])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: ")
    assert "is inconsistent: segment 0 rows tile 0, node conv2d" in result.output


def test_refusal_names_the_segment_axis_tile_and_node():
    data = data_of(plans()["unet split"])
    shift(step_of(data, 1, "cols", 1, "upsample_bilinear2d")["reads"][0]["read"], 1, 0)
    refused(json.dumps(data), "segment 1 cols tile 1, node upsample_bilinear2d: read")


# -- property tests -----------------------------------------------------------------------------

PLAN = plans()["se 3x2"]
TEXT = dumps(PLAN)
DATA = json.loads(TEXT)

#: Integers validation does not constrain: predictions, the measured bytes per kernel and weight
#: gradient path, the input's batch and channels (tiles depend on the image sizes only; the
#: generated module checks the whole input shape), and the tiles per call of a segment whose tiles
#: may run stacked (a choice; tests/test_batches.py checks a segment whose tiles may not).
FREE = {("predicted_peak_bytes",), ("kernel_state",), ("kernel_state_bytes",), ("gemm_min_channels",),
        ("staging_bytes",), ("inputs", 0, "shape", 0), ("inputs", 0, "shape", 1), ("segments", 0, "batch")}


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
INT_PATHS = [p for p in PATHS if type(_get(DATA, p)) is int and p[-1] != "predicted_peak_bytes"
             and p not in FREE]


def _loads_or_plan_error(text: str) -> Plan | None:
    try:
        return loads(text, "mutant")
    except PlanError as error:
        assert "\n" not in str(error) and str(error).startswith("mutant")
        return None


def test_the_integer_paths_reach_every_region_field():
    keys = {k for p in INT_PATHS for k in p if isinstance(k, str)}
    assert {"owned", "out", "read", "pad", "grad_out", "grad", "inputs", "first", "stop", "grid", "shape_class",
            "index", "shape", "partials", "levels"} <= keys
    assert len(INT_PATHS) > 300


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(INT_PATHS), st.sampled_from([-2, -1, 1, 3]))
def test_structural_integer_changes_are_always_caught(path, delta):
    data = copy.deepcopy(DATA)
    _get(data, path[:-1])[path[-1]] += delta
    assert _loads_or_plan_error(json.dumps(data)) is None, f"{path} += {delta} was accepted"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _mutate(draw, data) -> None:
    path = draw(st.sampled_from(PATHS))
    try:
        parent, key = _get(data, path[:-1]), path[-1]
        value = parent[key]
    except (KeyError, IndexError, TypeError):
        return  # an earlier mutation removed or reshaped it
    kind = draw(st.sampled_from(["replace", "delete", "perturb", "duplicate", "swap"]))
    if kind == "delete":
        del parent[key]
    elif kind == "perturb" and type(value) is int:
        parent[key] = value + draw(st.sampled_from([-1, 1, -value - 1, 2**31]))
    elif kind == "duplicate" and isinstance(value, list) and value:
        value.insert(draw(st.integers(0, len(value))), copy.deepcopy(draw(st.sampled_from(value))))
    elif kind == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = draw(st.integers(0, len(parent) - 1))
        parent[key], parent[other] = parent[other], parent[key]
    else:
        parent[key] = draw(json_values)


@st.composite
def mutations(draw):
    data = copy.deepcopy(DATA)
    for _ in range(draw(st.integers(1, 3))):
        _mutate(draw, data)
    return json.dumps(data)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_random_mutations_raise_only_plan_error(text):
    result = _loads_or_plan_error(text)
    if result is not None:
        assert validate(result) is result


@settings(max_examples=50, deadline=None)
@given(st.integers(0, len(TEXT) - 1), st.sampled_from(["truncate", "flip", "insert"]), st.characters())
def test_corrupted_text_raises_only_plan_error(position, kind, char):
    if kind == "truncate":
        text = TEXT[:position]
    elif kind == "flip":
        text = TEXT[:position] + char + TEXT[position + 1:]
    else:
        text = TEXT[:position] + char + TEXT[position:]
    _loads_or_plan_error(text)


# -- speed ---------------------------------------------------------------------------------------


class Deep(nn.Module):
    """A stem and residual blocks: about 170 nodes at 64x64 pixels, so a 64x64 grid has 1-pixel tiles."""

    def __init__(self, blocks: int = 24):
        super().__init__()
        self.stem = nn.Conv2d(3, 2, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU(), nn.Conv2d(2, 2, 3, padding=1),
                          nn.BatchNorm2d(2)) for _ in range(blocks))

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return x


def test_a_64x64_grid_on_170_nodes_validates():
    plan = plan_for(trace(Deep().eval(), (1, 3, 64, 64)), REFERENCE, "deep", grid=(64, 64))
    assert len(plan.model.nodes) >= 165 and plan.segments[0].grid == (64, 64)
    assert validate(plan) is plan
