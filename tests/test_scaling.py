"""Generated code scales with the tile shape classes, not the number of tiles."""

from __future__ import annotations

import re

from torch import nn

from tilec.codegen import render
from tilec.planner import plan
from tilec.trace import trace


def model():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1),
    )


def _classes(segment) -> int:
    return len({t.shape_class for t in segment.rows}) * len({t.shape_class for t in segment.cols})


def test_module_has_one_function_pair_per_shape_class_not_per_tile():
    graph = trace(model(), (1, 3, 1024, 1024))
    coarse, fine = (plan(graph, name="m", grid=grid) for grid in ((8, 8), (64, 64)))
    sources = [render(p) for p in (coarse, fine)]
    for the_plan, source in zip((coarse, fine), sources, strict=True):
        functions = re.findall(r"^def _s0_(forward|backward)_\d+_\d+\(", source, flags=re.MULTILINE)
        assert len(functions) == 2 * _classes(the_plan.segments[0])
    # 64x as many tiles; the classes are the same (first, interior, last per axis) ...
    assert _classes(fine.segments[0]) == _classes(coarse.segments[0]) == 9
    # ... so the module grows only by the per-axis tile tables (128 entries, not 4096).
    assert len(sources[1]) - len(sources[0]) < 60 * (64 - 8) * 2
