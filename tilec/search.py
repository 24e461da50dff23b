"""Search: ``choose`` picks segment boundaries and a grid per segment for a memory budget.

Dynamic programming over cut points, left to right. A partial plan ending at cut ``i`` is
summarised by (estimated seconds, bytes kept alive for later segments); only the Pareto
front of those pairs is kept per cut, since a later segment's feasibility depends on the
kept bytes and the objective adds up seconds. Each segment option is stored (untiled) or
tiled with a square-ish grid; for a tiled segment, finer grids only add time, so grids are
tried from coarse to fine and the first that fits is taken.
"""

from __future__ import annotations

from functools import cache
from math import inf, prod

import networkx as nx

from tilec.cost import ELEMENT_BYTES, SegmentCost, parameter_bytes, segment_cost
from tilec.errors import BudgetError
from tilec.planner import SegmentChoice, _axis_tiles, suffix_tiles
from tilec.trace import layer_specs

GRIDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def cut_points(layers) -> list[int]:
    """Where a segment may end: never right before a pointwise layer (same-size boundary)."""
    return [j for j in range(1, len(layers) + 1) if j == len(layers) or layers[j].op != "pointwise"]


def _pareto(entries: list[tuple]) -> list[tuple]:
    """Keep entries not dominated in (seconds, kept bytes)."""
    front, best_kept = [], inf
    for entry in sorted(entries, key=lambda e: (e[0], e[1])):
        if entry[1] < best_kept:
            front.append(entry)
            best_kept = entry[1]
    return front


def choose(graph: nx.DiGraph, budget: int, dtype: str = "float32") -> list[SegmentChoice]:
    """Segments minimising estimated time with predicted peak <= ``budget`` bytes."""
    found = _search(graph, budget, dtype)
    if found is None:
        raise BudgetError(f"no plan fits the memory budget of {format_bytes(budget)}; the smallest "
                          f"feasible budget is about {format_bytes(smallest_budget(graph, dtype))}")
    return found


def _search(graph: nx.DiGraph, budget: int, dtype: str) -> list[SegmentChoice] | None:
    layers = layer_specs(graph)
    element = ELEMENT_BYTES[dtype]
    fixed = parameter_bytes(list(layers), element)
    output = prod(layers[-1].out_shape) * element

    @cache
    def prefix_tiles(stop: int, axis: int, parts: int):
        """Axis tiles of layers ``[0, stop)``; every segment ending at ``stop`` is a suffix."""
        return _axis_tiles(graph, [layer.index for layer in layers[:stop]], axis, parts)

    @cache
    def option(first: int, stop: int, grid: int, stored: bool) -> SegmentCost:
        height, width = layers[stop - 1].out_shape[2:]
        rows = suffix_tiles(prefix_tiles(stop, 0, min(grid, height)), first)
        cols = suffix_tiles(prefix_tiles(stop, 1, min(grid, width)), first)
        return segment_cost(list(layers[first:stop]), rows, cols, stored=stored, element=element, first=first == 0)

    def local(cost: SegmentCost, stop: int) -> int:
        held = output if stop < len(layers) else 0
        return max(cost.forward_local, cost.backward_local + fixed + held)

    def options(first: int, stop: int, kept: int):
        cost = option(first, stop, 1, True)
        if kept + local(cost, stop) <= budget:
            yield (1, 1), "stored", cost
        height, width = layers[stop - 1].out_shape[2:]
        for grid in GRIDS:
            if grid > max(height, width):
                break
            cost = option(first, stop, grid, False)
            if kept + local(cost, stop) <= budget:
                yield (min(grid, height), min(grid, width)), "tiled", cost
                break

    cuts = [0, *cut_points(layers)]
    fronts: dict[int, list[tuple]] = {0: [(0.0, 0, 0, ())]}
    for first in cuts[:-1]:
        for seconds, kept, peak, choices in fronts.pop(first, []):
            for stop in (c for c in cuts if c > first):
                for grid, mode, cost in options(first, stop, kept):
                    entry = (seconds + cost.seconds, kept + cost.kept, max(peak, kept + local(cost, stop)),
                             (*choices, (first, stop, grid, mode)))
                    fronts.setdefault(stop, []).append(entry)
        for stop in list(fronts):
            fronts[stop] = _pareto(fronts[stop])
    finished = fronts.get(len(layers), [])
    return list(min(finished)[3]) if finished else None


def smallest_budget(graph: nx.DiGraph, dtype: str = "float32") -> int:
    """Smallest predicted peak over the plans the search can build (bisection on the budget)."""
    low, high = 1, 1 << 50
    while high - low > max(1, high // 200):
        middle = (low + high) // 2
        if _search(graph, middle, dtype) is None:
            low = middle
        else:
            high = middle
    return high


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
