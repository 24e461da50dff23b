"""Search: ``choose`` picks segment boundaries and a grid per segment for a memory budget.

Dynamic programming over cut points, left to right. A partial plan ending at cut ``i`` is
summarised by (estimated seconds, bytes kept alive for later segments); only the Pareto
front of those pairs is kept per cut, since a later segment's feasibility depends on the
kept bytes and the objective adds up seconds. Each segment option is stored (untiled) or
tiled with a square-ish grid; for a tiled segment, finer grids only add time, so grids are
tried from coarse to fine and the first that fits is taken.

``smallest_budget`` runs the same recursion on (peak, kept bytes) instead, with the finest
grid for tiled segments (finer tiles only shrink the working set), so an infeasible budget is
refused at once with the smallest one that would do.
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
#: Share of the budget a plan's predicted peak may use. The rest is headroom for what the cost
#: model does not count (allocator metadata, kernel scratch, Python objects): measured peaks
#: were within -10% .. +9% of the prediction on the examples (README).
USABLE_PERCENT = 95


def usable(budget: int) -> int:
    """Bytes of ``budget`` a plan's predicted peak may use."""
    return budget * USABLE_PERCENT // 100


def cut_points(layers) -> list[int]:
    """Where a segment may end: never right before a pointwise layer (same-size boundary)."""
    return [j for j in range(1, len(layers) + 1) if j == len(layers) or layers[j].op != "pointwise"]


def _pareto(entries: list[tuple]) -> list[tuple]:
    """Keep entries not dominated in their first two fields (both minimised)."""
    front, best = [], inf
    for entry in sorted(entries, key=lambda e: (e[0], e[1])):
        if entry[1] < best:
            front.append(entry)
            best = entry[1]
    return front


class _Costs:
    """Cached costs of the segment options of one traced model."""

    def __init__(self, graph: nx.DiGraph, dtype: str):
        self.graph = graph
        self.layers = layer_specs(graph)
        self.element = ELEMENT_BYTES[dtype]
        self.fixed = parameter_bytes(list(self.layers), self.element)
        self.output = prod(self.layers[-1].out_shape) * self.element
        self.cuts = [0, *cut_points(self.layers)]
        self.option = cache(self._option)
        self.prefix_tiles = cache(self._prefix_tiles)

    def _prefix_tiles(self, stop: int, axis: int, parts: int):
        """Axis tiles of layers ``[0, stop)``; every segment ending at ``stop`` is a suffix."""
        return _axis_tiles(self.graph, [layer.index for layer in self.layers[:stop]], axis, parts)

    def _option(self, first: int, stop: int, grid: int, stored: bool) -> SegmentCost:
        parts = self.grid_of(grid, stop)
        rows = suffix_tiles(self.prefix_tiles(stop, 0, parts[0]), first)
        cols = suffix_tiles(self.prefix_tiles(stop, 1, parts[1]), first)
        return segment_cost(list(self.layers[first:stop]), rows, cols, stored=stored, element=self.element,
                            first=first == 0)

    def grids(self, stop: int) -> list[int]:
        return [grid for grid in GRIDS if grid <= max(self.layers[stop - 1].out_shape[2:])]

    def local(self, cost: SegmentCost, stop: int) -> int:
        """Peak bytes while the segment ending at ``stop`` runs, beyond what earlier ones keep."""
        held = self.output if stop < len(self.layers) else 0
        return max(cost.forward_local, cost.backward_local + self.fixed + held)

    def grid_of(self, grid: int, stop: int) -> tuple[int, int]:
        """The square-ish ``grid`` for the output of the segment ending at ``stop``."""
        height, width = self.layers[stop - 1].out_shape[2:]
        return min(grid, height), min(grid, width)

    def recurse(self, start: tuple, extend) -> list[tuple]:
        """Left-to-right dynamic programming over cut points.

        An entry is a tuple whose first two fields are minimised (a Pareto front is kept per
        cut); ``extend(entry, first, stop)`` yields the entries one more segment
        ``[first, stop)`` makes of it. Returns the front at the last cut.
        """
        fronts: dict[int, list[tuple]] = {0: [start]}
        for first in self.cuts[:-1]:
            for entry in fronts.pop(first, []):
                for stop in (c for c in self.cuts if c > first):
                    fronts.setdefault(stop, []).extend(extend(entry, first, stop))
            for stop in list(fronts):
                fronts[stop] = _pareto(fronts[stop])
        return fronts[len(self.layers)]


def choose(graph: nx.DiGraph, budget: int, dtype: str = "float32") -> list[SegmentChoice]:
    """Segments minimising estimated time with predicted peak <= ``usable(budget)`` bytes."""
    costs = _Costs(graph, dtype)
    smallest = _budget_for(_smallest(costs))
    if budget < smallest:
        raise BudgetError(f"no plan fits the memory budget of {format_bytes(budget)}; the smallest "
                          f"feasible budget is about {format_bytes(smallest)}")
    return _search(costs, usable(budget))


def _budget_for(peak: int) -> int:
    """The smallest budget whose usable part holds ``peak`` bytes."""
    return -(-peak * 100 // USABLE_PERCENT)


def _search(costs: _Costs, budget: int) -> list[SegmentChoice]:
    """Least estimated seconds with every predicted peak <= ``budget`` (already the usable part)."""
    def extend(entry: tuple, first: int, stop: int):
        seconds, kept, choices = entry

        def grown(grid: tuple[int, int], mode: str, cost: SegmentCost) -> tuple:
            return seconds + cost.seconds, kept + cost.kept, (*choices, (first, stop, grid, mode))

        stored = costs.option(first, stop, 1, True)
        if kept + costs.local(stored, stop) <= budget:
            yield grown((1, 1), "stored", stored)
        for grid in costs.grids(stop):  # finer grids only add time: the coarsest that fits
            tiled = costs.option(first, stop, grid, False)
            if kept + costs.local(tiled, stop) <= budget:
                yield grown(costs.grid_of(grid, stop), "tiled", tiled)
                break

    return list(min(costs.recurse((0.0, 0, ()), extend))[2])


def _smallest(costs: _Costs) -> int:
    """Smallest predicted peak over the plans ``_search`` can build."""
    def extend(entry: tuple, first: int, stop: int):
        peak, kept = entry
        finest = costs.grids(stop)[-1]
        for cost in (costs.option(first, stop, 1, True), costs.option(first, stop, finest, False)):
            yield max(peak, kept + costs.local(cost, stop)), kept + cost.kept

    return min(peak for peak, _ in costs.recurse((0, 0), extend))


def smallest_budget(graph: nx.DiGraph, dtype: str = "float32") -> int:
    """Smallest budget ``choose`` accepts: the smallest predicted peak plus the headroom."""
    return _budget_for(_smallest(_Costs(graph, dtype)))


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
