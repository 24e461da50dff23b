"""Generated code scales with the tile shape classes, not the number of tiles.

A tile function is generated per segment and (row class, column class); the tiles themselves
are two per-axis tables. On a 1024x1024 input, a 64x64 grid (4096 tiles per segment) must
give a module barely larger than an 8x8 grid (64 tiles): the same functions plus 112 more
table rows per segment.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tilec.codegen import render
from tilec.pipeline import plan_for
from tilec.target import REFERENCE
from tilec.trace import trace

SHAPE = (1, 3, 1024, 1024)


class Net(nn.Module):
    """Residual block, pool, transposed conv, nearest upsampling, concat: a small U-Net-like DAG."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.down = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.side = nn.Conv2d(4, 2, 1)
        self.last = nn.Conv2d(10, 2, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.stem(x))
        x = F.relu(x + self.conv(x))
        low = self.down(self.pool(x))
        side = F.interpolate(self.side(low), scale_factor=2, mode="nearest")
        return self.last(torch.cat([x, self.up(low), side], 1))


def _classes(segment) -> tuple[int, int]:
    return len({t.shape_class for t in segment.rows}), len({t.shape_class for t in segment.cols})


def _functions(source: str) -> list[str]:
    return re.findall(r"^def (_s\d+_\d+_\d+)\(", source, flags=re.MULTILINE)


def test_module_has_one_function_per_shape_class_not_per_tile():
    graph = trace(Net(), SHAPE)
    count = len(graph)
    segments = {grid: [(0, 4, grid), (4, count, (grid[0] // 2, grid[1]))] for grid in ((8, 8), (64, 64))}
    plans = [plan_for(graph, REFERENCE, "m", segments=segments[grid]) for grid in segments]
    sources = [render(p) for p in plans]
    for the_plan, source in zip(plans, sources, strict=True):
        want = [f"_s{s.index}_{r}_{c}" for s in the_plan.segments
                for r in sorted({t.shape_class for t in s.rows}) for c in sorted({t.shape_class for t in s.cols})]
        assert _functions(source) == want
    coarse, fine = plans
    # 64x as many tiles; the classes (first, interior, last per axis and so on) are the same ...
    assert [_classes(s) for s in fine.segments] == [_classes(s) for s in coarse.segments]
    assert all(max(_classes(s)) <= 4 for s in fine.segments)
    assert _functions(sources[0]) == _functions(sources[1])
    # ... so the module grows only by the per-axis tile tables: 112 + 56 more rows, not 4096 tiles
    extra_rows = (64 - 8) * 2 + (32 - 4) + (64 - 8)
    row_length = max(len(line) for line in sources[1].splitlines() if line.startswith("    (((")) + 1
    assert len(sources[1]) - len(sources[0]) < extra_rows * row_length
    assert len(sources[1]) < 1.5 * len(sources[0])


def test_one_grid_for_the_network_scales_the_same():
    graph = trace(Net(), SHAPE)
    small, large = (render(plan_for(graph, REFERENCE, "m", grid=grid)) for grid in ((8, 8), (64, 64)))
    assert _functions(small) == _functions(large)
    assert len(large) < 1.5 * len(small)
