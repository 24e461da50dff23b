"""``tilec viz`` draws a non-trivial picture, and refuses bad layers, tiles and outputs."""

from __future__ import annotations

import numpy as np
import pytest
from hardening import rich_model, run, snapshot
from matplotlib import image

from tilec.planio import dumps
from tilec.planner import plan
from tilec.regions import split
from tilec.trace import trace
from tilec.viz import draw, share_bounds

SEGMENTS = [(0, 4, (3, 2)), (4, 7, (2, 2))]


@pytest.fixture(scope="module")
def the_plan():
    return plan(trace(rich_model(), (1, 3, 23, 19)), name="rich", segments=SEGMENTS)


@pytest.fixture
def plan_file(the_plan, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "rich.plan.json"
    path.write_text(dumps(the_plan))
    return path


def test_png_is_produced_and_non_trivial(plan_file):
    result = run(["viz", str(plan_file), "-o", "pictures/tiles.png"])
    assert result.exit_code == 0, result.output
    path = plan_file.parent / "pictures" / "tiles.png"
    assert path.stat().st_size > 20_000
    pixels = image.imread(path)
    assert pixels.shape[0] > 400 and pixels.shape[1] > 800
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]).round(2), axis=0)
    assert len(colours) > 20


def test_svg_at_a_later_layer_and_tile(plan_file):
    result = run(["viz", str(plan_file), "-o", "tiles.svg", "--layer", "5", "--tile", "0,1"])
    assert result.exit_code == 0, result.output
    text = (plan_file.parent / "tiles.svg").read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text and len(text) > 20_000
    assert "tile 0,1" in text or "tile 0,1".replace(" ", "") in text.replace(" ", "")


def test_same_plan_same_svg(plan_file):
    assert run(["viz", str(plan_file), "-o", "a.svg"]).exit_code == 0
    assert run(["viz", str(plan_file), "-o", "b.svg"]).exit_code == 0
    assert (plan_file.parent / "a.svg").read_bytes() == (plan_file.parent / "b.svg").read_bytes()


def test_shares_partition_each_layer_input(the_plan):
    """The projected tile grid is a partition of every layer's input, ending at the owned split."""
    for segment in the_plan.segments:
        for axis in range(2):
            tiles = segment.rows if axis == 0 else segment.cols
            last = the_plan.model.layers[segment.stop - 1]
            for layer in range(segment.first, segment.stop):
                bounds = share_bounds(the_plan, segment, axis, layer)
                assert bounds[0] == 0 and bounds[-1] == the_plan.model.layers[layer].in_shape[2 + axis]
                assert bounds == sorted(bounds) and len(bounds) == len(tiles) + 1
            size = last.out_shape[2 + axis]
            assert [t.owned for t in tiles] == list(split(size, len(tiles)))


def test_draw_defaults_to_the_middle_tile(the_plan):
    figure = draw(the_plan)
    left, right = figure.axes[:2]
    assert "tile 1,1" in left.get_title() and "layer 0" in left.get_title()
    assert len(right.get_lines()) >= 3


@pytest.mark.parametrize("args, words", [
    (["-o", "t.jpg"], ["t.jpg", ".png, .svg or .pdf"]),
    (["-o", "rich.plan.json/t.png"], ["cannot write", "rich.plan.json/t.png"]),
    (["-o", "t.png", "--layer", "7"], ["--layer 7", "0..6"]),
    (["-o", "t.png", "--layer", "-1"], ["--layer -1"]),
    (["-o", "t.png", "--layer", "4", "--tile", "2,0"], ["--tile 2,0", "segment 1", "2x2"]),
    (["-o", "t.png", "--tile", "one"], ["--tile", "'one'"]),
])
def test_viz_refuses(plan_file, args, words):
    before = snapshot(plan_file.parent)
    result = run(["viz", str(plan_file), *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    assert all(word in result.output for word in words), result.output
    assert snapshot(plan_file.parent) == before


def test_viz_refuses_bad_plans(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    result = run(["viz", str(bad), "-o", str(tmp_path / "t.png")])
    assert result.exit_code == 2 and "is not JSON" in result.output
    assert not (tmp_path / "t.png").exists()
