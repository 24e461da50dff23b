"""``tilec.distribute``: tiles shared among ranks by their FLOPs, recorded in the plan, shown by
the CLI; the generated module follows the recorded shares (see test_distributed.py for the
multi-process runs, and test_runtime.py for ``tilec.runtime.tiles.share`` itself)."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from tilec.cli import main
from tilec.codegen import load_source, render
from tilec.distribute import distribute
from tilec.errors import GridError, PlanError
from tilec.pipeline import plan_for
from tilec.planio import dumps, loads
from tilec.target import REFERENCE
from tilec.trace import trace

from support.zoo import SHAPES, ZOO


def _plan(ranks):
    name = "resnet_head"
    graph = trace(ZOO[name](), SHAPES[name])
    segments = [(0, 9, (2, 3)), (9, 19, (3, 1)), (19, 22, (1, 1))]
    return distribute(plan_for(graph, REFERENCE, name, segments=segments), ranks)


def test_distribute_records_shares_and_the_busiest_rank():
    plan = _plan(4)
    assert plan.ranks == 4
    tiled, second, head = plan.segments
    assert sorted(len(indices) for indices in tiled.shares) == [1, 1, 2, 2]  # 6 tiles, costliest first
    assert len(second.shares) == 4 and any(not indices for indices in second.shares)  # 3 tiles, 4 ranks
    assert head.shares == () and head.rank_seconds == head.estimated_seconds
    for segment in (tiled, second):
        assert segment.estimated_seconds / 4 <= segment.rank_seconds < segment.estimated_seconds
    assert loads(dumps(plan)) == plan  # validates and round-trips


def test_no_ranks_leaves_the_plan_alone():
    plan = _plan(None)
    assert plan.ranks is None and all(not s.shares and s.rank_seconds is None for s in plan.segments)


@pytest.mark.parametrize("ranks", [0, 2**31])
def test_ranks_beyond_a_count_are_refused(ranks):
    with pytest.raises(GridError, match=f"--ranks must be from 1 to 2147483647, got {ranks}"):
        _plan(ranks)


def test_forged_shares_are_refused():
    data = json.loads(dumps(_plan(2)))
    data["segments"][0]["shares"][0] = [0]
    with pytest.raises(PlanError, match=r"segment 0's shares do not give each of its 6 tiles"):
        loads(json.dumps(data))


def test_generated_module_uses_the_recorded_shares():
    plan = _plan(3)
    module = load_source(render(plan), "ranked")
    assert module.PLAN.ranks == 3
    segments = [step.run for step in module.TiledModel.steps if isinstance(step.run, module.TiledSegment)]
    recorded = [s for s in plan.segments if s.mode == "tiled"]
    assert [[segment.share(3, rank) for rank in range(3)] for segment in segments] == [
        [set(indices) for indices in s.shares] for s in recorded]


def test_a_module_compiled_without_ranks_shares_its_tiles_as_a_plan_for_them_would():
    """The generated module shares the tiles of a group the plan did not name by the same costs
    and rule as ``distribute``."""
    module = load_source(render(_plan(None)), "unranked")
    segments = [step.run for step in module.TiledModel.steps if isinstance(step.run, module.TiledSegment)]
    for ranks in (2, 3, 4):
        recorded = [s for s in _plan(ranks).segments if s.mode == "tiled"]
        assert [[segment.share(ranks, rank) for rank in range(ranks)] for segment in segments] == [
            [set(indices) for indices in s.shares] for s in recorded]


def test_cli_compiles_and_inspects_for_ranks(tmp_path):
    model_file = tmp_path / "net.py"
    model_file.write_text("from torch import nn\nINPUT_SHAPE = (1, 3, 33, 31)\n"
                          "model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))\n")
    result = CliRunner().invoke(main, ["compile", str(model_file), "--grid", "3x2", "--ranks", "4",
                                       "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for output in (result.output, CliRunner().invoke(main, ["inspect", str(tmp_path / "net.plan.json")]).output):
        assert "4 ranks share the tiles" in output and "tiles per rank" in output
        assert re.search(r"\b[12]/[12]/[12]/[12]\b", output)
    assert json.loads((tmp_path / "net.plan.json").read_text())["ranks"] == 4


def test_cli_refuses_zero_ranks(tmp_path):
    result = CliRunner().invoke(main, ["compile", "examples/vgg16.py", "--grid", "2x2", "--ranks", "0",
                                       "--out-dir", str(tmp_path), "--plan-dir", str(tmp_path)])
    assert result.exit_code == 2 and "--ranks" in result.output
    assert list(tmp_path.iterdir()) == []
