"""``tilec.distribute``: tiles shared among ranks by their FLOPs, recorded in the plan, shown by
the CLI; the generated module follows the recorded shares (see test_distributed.py for the
multi-process runs)."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from zoo import SHAPES, ZOO

from tilec.cli import main
from tilec.codegen import render
from tilec.distribute import distribute, share
from tilec.errors import GridError, PlanError
from tilec.pipeline import load_source, plan_for
from tilec.planio import dumps, loads
from tilec.trace import trace


@settings(max_examples=60, deadline=None, derandomize=True)
@given(costs=st.lists(st.integers(0, 1000), min_size=0, max_size=40), ranks=st.integers(1, 6))
def test_every_tile_goes_to_one_rank_and_loads_are_balanced(costs, ranks):
    shares = share(costs, ranks)
    assert len(shares) == ranks
    assert sorted(i for indices in shares for i in indices) == list(range(len(costs)))
    loads = [sum(costs[i] for i in indices) for indices in shares]
    assert max(loads) - min(loads) <= max(costs, default=0)  # greedy, costliest first
    assert share(costs, ranks) == shares


def test_costlier_tiles_are_spread_not_counted():
    assert share([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == ((0,), tuple(range(1, 11)))


def _plan(ranks):
    name = "resnet_head"
    graph = trace(ZOO[name](), SHAPES[name])
    return distribute(plan_for(graph, name, segments=[(0, 9, (2, 3)), (9, 19, (3, 1)), (19, 22, (1, 1))]), ranks)


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


def test_zero_ranks_is_refused():
    with pytest.raises(GridError, match="--ranks must be at least 1"):
        _plan(0)


def test_forged_shares_are_refused():
    data = json.loads(dumps(_plan(2)))
    data["segments"][0]["shares"][0] = [0]
    with pytest.raises(PlanError, match=r"segment 0's shares do not give each of its 6 tiles"):
        loads(json.dumps(data))


def test_generated_module_uses_the_recorded_shares():
    plan = _plan(3)
    module = load_source(render(plan), "ranked")
    assert module.PLAN_RANKS == 3
    segments = [value for value in vars(module).values() if isinstance(value, module._Segment)]
    recorded = [s for s in plan.segments if s.mode == "tiled"]
    assert [[segment.share(3, rank) for rank in range(3)] for segment in segments] == [
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
