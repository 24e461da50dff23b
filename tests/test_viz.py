"""``tilec viz`` and the ``tilec inspect`` tables: pictures and tables of DAG plans, and their refusals."""

from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib import image
from rich.console import Console

from tilec.errors import OutputError, TilecError
from tilec.graph import Graph
from tilec.planio import dumps
from tilec.regions import Interval, split
from tilec.report import describe_plan, node_table, tile_table
from tilec.viz import cone, draw, pick, save, share_bounds

from support.hardening import run, snapshot
from support.models import SE_SPLIT, grid_plan, segment_plan

UNET_SPLIT = ((0, 3, (2, 2)), (3, 10, (3, 2)))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def plan_file(folder, plan):
    path = folder / f"{plan.name}.plan.json"
    path.write_text(dumps(plan))
    return path


def test_png_of_a_residual_model_is_non_trivial(folder):
    result = run(["viz", str(plan_file(folder, grid_plan("residual"))), "-o", "pictures/tiles.png"])
    assert result.exit_code == 0, result.output
    path = folder / "pictures" / "tiles.png"
    assert path.stat().st_size > 20_000
    pixels = image.imread(path)
    assert pixels.shape[0] > 800 and pixels.shape[1] > 1200
    rgb = (pixels[..., :3] * 255).round().astype(np.uint32)
    assert len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2])) > 20


def test_svg_of_a_unet_piece_at_a_node_and_tile(folder):
    path = plan_file(folder, segment_plan("unet", UNET_SPLIT))
    result = run(["viz", str(path), "-o", "tiles.svg", "--node", "cat", "--tile", "2,1"])
    assert result.exit_code == 0, result.output
    text = (folder / "tiles.svg").read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) > 20_000


def test_same_plan_same_svg(folder):
    path = plan_file(folder, grid_plan("residual"))
    assert run(["viz", str(path), "-o", "a.svg"]).exit_code == 0
    assert run(["viz", str(path), "-o", "b.svg"]).exit_code == 0
    assert (folder / "a.svg").read_bytes() == (folder / "b.svg").read_bytes()


def se_split():
    """The squeeze-and-excitation plan with its branch stored between two tiled segments."""
    return segment_plan("se", SE_SPLIT)


def test_draw_defaults_to_the_middle_tile_at_the_first_tiled_node():
    figure = draw(se_split())
    regions, growth, rows, cols = figure.axes
    assert "node conv2d" in regions.get_title() and "tile 1,1" in regions.get_title()
    assert "segment 0" in growth.get_title() and len(growth.get_lines()) >= 2
    assert [label.get_text() for label in rows.get_yticklabels()] == ["x", "conv2d", "relu"]


def test_draw_a_segment_that_reduces_by_a_sweep():
    """With --grid the SE branch is in the one tiled segment: the default picture is its first node."""
    figure = draw(grid_plan("se"))
    regions, growth, _, _ = figure.axes
    assert "node conv2d" in regions.get_title() and "tile 1,1" in regions.get_title()
    assert "segment 0" in growth.get_title()


def test_picking_a_node_picks_its_segment():
    choice = pick(se_split(), "mul", (0, 1))
    assert (choice.segment.index, choice.position, choice.step, choice.tile) == (2, 7, 0, (0, 1))
    choice = pick(grid_plan("se"), "mul", (0, 1))  # one tiled segment: mul is its step 7
    assert (choice.segment.index, choice.position, choice.step, choice.tile) == (0, 7, 7, (0, 1))


def test_shares_of_an_output_are_its_owned_parts():
    plan = segment_plan("unet", UNET_SPLIT)
    graph = Graph.of_plan(plan)
    for segment in plan.segments:
        for axis, tiles in enumerate((segment.rows, segment.cols)):
            for k, name in enumerate(segment.outputs):
                size = graph.size(name, axis)
                bounds = share_bounds([t.owned[k] for t in tiles], size)
                assert [Interval(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)] == list(
                    split(size, len(tiles)))


@pytest.mark.parametrize("intervals, size, bounds", [
    ([Interval(0, 9), Interval(7, 17), Interval(15, 23)], 23, [0, 8, 16, 23]),
    ([Interval(0, 0), Interval(0, 5)], 5, [0, 0, 5]),
    ([Interval(0, 12), Interval(0, 12)], 12, [0, 6, 12]),
])
def test_share_bounds_cut_overlaps_in_the_middle(intervals, size, bounds):
    assert share_bounds(intervals, size) == bounds


def test_cone_shows_the_hull_of_a_skip_connection():
    """relu_1 feeds the transposed conv and the bilinear upsampling: the tile computes the hull of both reads."""
    plan = segment_plan("unet", UNET_SPLIT)
    segment = plan.segments[1]
    for axis in range(2):
        for index in range(segment.grid[axis]):
            lines = {line.name: line for line in cone(plan, segment, axis, index, Graph.of_plan(plan))}
            assert list(lines)[:2] == ["max_pool2d", "relu"]  # the sliced segment inputs come first
            skip = lines["relu_1"]
            assert [consumer for consumer, _ in skip.reads] == ["conv_transpose2d", "upsample_bilinear2d"]
            reads = [read for _, read in skip.reads]
            hull = Interval(min(r.start for r in reads), max(r.stop for r in reads))
            assert skip.intervals[index] == hull


@pytest.mark.parametrize("args, words", [
    (["-o", "t.jpg"], ["t.jpg", ".png, .svg or .pdf"]),
    (["-o", "se.plan.json/t.png"], ["cannot write", "se.plan.json/t.png"]),
    (["-o", "t.png", "--node", "nope"], ["no node 'nope'", "tilec inspect PLAN --nodes"]),
    (["-o", "t.png", "--node", "sigmoid"], ["node sigmoid", "segment 1", "stored"]),
    (["-o", "t.png", "--node", "mul", "--tile", "3,0"], ["--tile 3,0", "segment 2", "3x2"]),
    (["-o", "t.png", "--tile", "0,2"], ["--tile 0,2", "segment 0", "3x2"]),
    (["-o", "t.png", "--tile", "one"], ["--tile", "'one'"]),
])
def test_viz_refuses(folder, args, words):
    path = plan_file(folder, se_split())
    before = snapshot(folder)
    result = run(["viz", str(path), *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert all(word in result.output for word in words), result.output
    assert snapshot(folder) == before


@pytest.mark.parametrize("node", ["adaptive_avg_pool2d", "sigmoid"])
def test_viz_of_a_node_a_sweep_computes_draws_or_refuses_in_one_line(folder, node):
    path = plan_file(folder, grid_plan("se"))
    result = run(["viz", str(path), "-o", "t.png", "--node", node])
    assert result.exit_code in (0, 2) and "Traceback" not in result.output, result.output
    if result.exit_code == 2:
        assert result.output.startswith("Error: ") and result.output.count("\n") == 1 and node in result.output


def test_viz_refuses_a_plan_without_tiles(folder):
    with pytest.raises(TilecError, match="no tiled segment"):
        save(grid_plan("residual", (1, 1)), folder / "t.png")
    with pytest.raises(OutputError, match="must end in"):
        save(grid_plan("residual"), folder / "t.gif")
    assert not list(folder.iterdir())


def test_viz_refuses_bad_plans(folder):
    (folder / "bad.json").write_text("{")
    result = run(["viz", "bad.json", "-o", "t.png"])
    assert result.exit_code == 2 and "is not JSON" in result.output
    assert not (folder / "t.png").exists()


# -- tables ---------------------------------------------------------------------------------------


def text(*tables) -> str:
    console = Console(record=True, width=250, file=io.StringIO())
    for table in tables:
        console.print(table)
    return console.export_text()


def test_describe_plan_has_a_row_per_segment():
    out = text(describe_plan(se_split()))
    assert "inputs x 1x3x23x19 float32" in out and "float32" in out and "predicted peak" in out
    assert "0..1: conv2d (conv) .. relu (-)" in out and "7..8: mul (-) .. conv2d_3 (out)" in out
    assert "stored" in out and "1, largest 1x4x1x1" in out and "(x)" in out


def test_describe_plan_names_the_levels_of_a_sweep():
    out = text(describe_plan(grid_plan("se")))
    assert "0..8: conv2d (conv) .. conv2d_3 (out)" in out and "stored" not in out
    assert ("segment 0 reduces by sweeps: level 1 (swept): adaptive_avg_pool2d, conv2d_1 (small), relu_1 (small), "
            "conv2d_2 (small), sigmoid (small)") in out


def test_node_table_lists_positions_and_segments():
    out = text(node_table(se_split()))
    lines = [line for line in out.splitlines() if "adaptive_avg_pool2d" in line]
    assert len(lines) == 1 and "2 " in lines[0] and "yes" in lines[0] and "1 (stored)" in lines[0]
    out = text(node_table(grid_plan("se")))
    lines = [line for line in out.splitlines() if "adaptive_avg_pool2d" in line]
    assert len(lines) == 1 and "2 " in lines[0] and "yes" in lines[0] and "0 (tiled)" in lines[0]


def test_tile_table_shows_every_read_of_a_node():
    plan = segment_plan("unet", UNET_SPLIT)
    (table,) = tile_table(plan, (2, 1), None, None)
    assert table.row_count == 7 + 2  # seven nodes, cat reads three tensors
    out = text(table)
    assert "segment 1 (grid 3x2), tile 2,1" in out and "upsample_bilinear2d" in out
    (table,) = tile_table(plan, None, "cat", None)
    assert table.row_count == 6 * 3  # every tile of the 3x2 grid, three reads each


def test_tile_table_shows_the_tile_in_every_segment_holding_it():
    plan = segment_plan("unet", UNET_SPLIT)
    assert len(tile_table(plan, (1, 1), None, None)) == 2
    assert len(tile_table(plan, (2, 0), None, None)) == 1


def test_tile_table_shows_what_a_reductions_partial_covers():
    """A reduction with a small result reads the part of its input the tile owns; a small op has no
    tile region."""
    plan = grid_plan("se")
    (table,) = tile_table(plan, (1, 0), "adaptive_avg_pool2d", None)
    out = text(table)
    assert table.row_count == 1 and "relu (partial)" in out and "[8, 16)" in out and "0/0/0/0" in out
    with pytest.raises(TilecError, match="node sigmoid is a small op of segment 0") as caught:
        tile_table(plan, (1, 0), "sigmoid", None)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("tile, node, segment, words", [
    (None, "ghost", None, ["no node 'ghost'", "--nodes"]),
    (None, "sigmoid", None, ["node sigmoid", "stored"]),
    ((0, 0), None, 1, ["segment 1 is stored"]),
    ((0, 0), None, 5, ["--segment 5", "3 segment(s)"]),
    ((0, 0), "mul", 0, ["node mul is in segment 2, not segment 0"]),
    ((3, 0), None, None, ["--tile 3,0", "segment 0 3x2", "segment 2 3x2"]),
])
def test_tile_table_refuses(tile, node, segment, words):
    with pytest.raises(TilecError) as caught:
        tile_table(se_split(), tile, node, segment)
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message


def test_inspect_shows_a_node_of_every_tile(folder):
    result = run(["inspect", str(plan_file(folder, grid_plan("residual"))), "--node", "add", "--nodes"])
    assert result.exit_code == 0, result.output
    assert "every tile, node add" in result.output and "positions for --segments" in result.output
