"""Search: ``choose`` picks segments, a mode and a grid per segment for a memory budget.

Dynamic programming over candidate cut points of the node order, left to right. A partial
plan ending at a cut is summarised by (estimated seconds, bytes held for later segments, peak
so far), the held bytes and the peak both counting the kernel state so far; only the Pareto
front of those is kept per cut, since a later segment's feasibility depends on the held bytes
and the peak, and the objective adds up seconds. A segment ``[first, stop)`` is stored
(untiled), or tiled when all its nodes are tileable, with a square-ish grid: tiles of one period
of input pixels where every tensor it partitions is the input at a stride (``periods_for``; the
tensors at every resolution then line up, all inner tiles one shape class), else that many parts
of each tensor (``tilec.regions.split``). Finer grids add time for a lower peak, which later
segments may need (each adds its kernel state to every peak), so for each of ``MARGINS`` the
coarsest grid that fits with that share of the budget to spare is offered, and the finest; where
that finds no plan, a search offering the fine grids ``smallest_budget`` builds on
(``_Costs.fine_grids``) follows, so that the smallest budget it names has one.

Rolled gradients: a tiled segment whose input a tiled segment produced may hold a band of that
input's gradient instead of all of it (``Estimator.made_tiled``), so a segment's peak depends on
the modes of the segments before it; partial plans are compared only with those whose tiled
segments made the same tensors the next segment may roll, or more of them.

Bounds: segments only add seconds, so a partial plan slower than a whole plan already found is
not extended. Each search first runs with its fronts thinned to ``BEAM`` partial plans spread
over their peaks, a quick way to a good plan; the exact search then extends only the partial
plans no slower than it, nor than the best plan of the searches before (``choose``).

Recompute: the search is run on the graph as traced and on ``variants`` of it where the
cheapest long-lived tensors (a U-Net's skips) are recomputed from the model input by their late
readers instead of kept (``tilec.recompute``); the fastest plan that fits wins.

Aligned plans: with a known background, the search is also run with every tiled segment in tiles
of one period over the input (``aligned_periods``, about ``ALIGNED`` tiles a side), so that the
gradients over the background repeat from segment to segment (``Estimator.tiled``'s ``aligned``).

``smallest_budget`` runs the same recursion on (peak, held bytes) instead, with the fine grids
for tiled segments (``_Costs.fine_grids``: finer tiles shrink the working set, but a halo
spanning several tiles makes more tile shapes, each with its own kernels), so an infeasible
budget is refused at once with about the smallest one that would do.

Cut candidates (``cut_points``): never between a node returning several tensors and a getitem
taking one of them or between a buffer's reader and a write into it (``Graph.ties``), nor right
before a per-pixel op reading only the node before it (recomputing it is cheaper than storing its
input), unless it is a reduction (which then reads a kept input: a direct level, ``tilec.sweeps``);
always where tileability changes;
besides those, at most ``MAX_CUTS``: the order is split into that many equal stretches and each
contributes the cut the fewest bytes cross.
Planning like a plan of the model at another input size (``near``), its cuts are candidates too,
and only ``MIN_CUTS`` stretches contribute one: a narrower search, several times faster.

Speed: the axis tiles of every tiled segment ending at ``stop`` are the tail of those of the
longest tileable run ending there (a node's region depends only on its readers, all after it),
so they are computed once per ``stop`` and axis, for every tile of every grid at once, as
arrays (``prefix_arrays``). Options that cannot fit (or, for ``smallest_budget``, cannot beat a
known plan) by a lower bound of their peak are not costed in full.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from math import inf
from typing import NamedTuple

import numpy as np

from tilec.cone import cone
from tilec.cost.arrays import AxisArrays
from tilec.cost.background import Background
from tilec.cost.estimator import Estimator, SegmentCost
from tilec.errors import BudgetError
from tilec.graph import Graph
from tilec.ops import rule
from tilec.planner import SegmentChoice, misfit
from tilec.recompute import candidates, recompute
from tilec.regions import Period, parts_of, strides_of
from tilec.sweeps import batchable, owned_sizes, role
from tilec.target import Target

#: Tiles per side tried for a tiled segment: every count to 16 (one step from 8 to 12 tiles per
#: side cost VGG16's 5% plan at 2048² a tenth of its step), coarser steps beyond.
GRIDS = (*range(1, 17), 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
#: Shares of the budget a tiled segment may leave to spare for later ones (their kernel state,
#: their working set): the search offers the coarsest grid that fits with each.
MARGINS = (0, 1 / 256, 1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8)
#: With a known background (``Estimator.backgrounds``), the search also offers every grid up to
#: this many times the coarsest that fits, in tiles a side.
FINER = 4
#: With a known background, the search also plans with every tiled segment in tiles of one period
#: over the input, about this many a side (``aligned_periods``): the owned output gradients over
#: the background then repeat too, and the tiles computed once share their input gradients
#: (``Estimator.tiled``'s ``aligned``).
ALIGNED = (4, 6, 8, 12, 16, 24, 32, 48, 64)
#: Tiles of one shape class per call a tiled segment may run besides one by one
#: (``tilec.runtime.batches``): the search offers the fastest that fits the budget.
BATCHES = (2, 4, 8, 16, 32, 64)
#: A search first finds a good plan keeping this many partial plans per front (``_thin``): no
#: partial plan slower than it is extended after.
BEAM = 16
#: The coarsest grid, in tiles a side, ``smallest_budget`` tries besides the finest.
FINE_GRIDS_FROM = 8
#: Share of the budget a plan's predicted peak may use. The rest is headroom for what the cost
#: model does not count: library code the first step of a process pages in (0-18 MiB measured on
#: CPU), the kernels it compiles and caches (oneDNN: one per convolution, tile shape and pass),
#: allocator metadata, Python objects, and its error (measured later steps at 0.84-1.15 times the
#: prediction, README).
USABLE_PERCENT = 90
#: Most cut candidates chosen besides those where tileability changes (at least ``MIN_CUTS``).
MAX_CUTS = 36
MIN_CUTS = 12
#: Most nodes recomputed for their late readers, and the largest share of the forward FLOPs the
#: recomputed cone of one may cost (``variants``).
MAX_RECOMPUTED = 3
RECOMPUTE_SHARE = 0.25


def usable(budget: int) -> int:
    """Bytes of ``budget`` a plan's predicted peak may use."""
    return budget * USABLE_PERCENT // 100


def format_bytes(count: int, up: bool = False) -> str:
    """``count`` bytes to a tenth of its unit, rounded up with ``up`` (a budget that, given back as
    written, is no smaller)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= size:
            return f"{(math.ceil(count * 10 / size) / 10 if up else count / size):.1f} {unit}"
    return f"{count} B"


def cut_points(graph: Graph, full: dict[str, int], near: Sequence[int] = ()) -> list[int]:
    """Candidate cuts: positions where a segment may end (0 and the end included). ``near``: the
    cuts of a plan of the model at another input size (``choose``): those allowed here, and
    ``MIN_CUTS`` stretches' cuts besides instead of up to ``MAX_CUTS``."""
    nodes, order, count = graph.nodes, graph.order, len(graph)
    crossing = np.zeros(count + 2)
    for position, name in enumerate(order):  # name crosses cuts position+1 .. its last use
        crossing[position + 1] += full[name]
        crossing[min(graph.last_use[name], count) + 1] -= full[name]
    crossing = np.cumsum(crossing)
    changes = {cut for cut in range(1, count) if nodes[order[cut - 1]].tileable != nodes[order[cut]].tileable
               and cut not in graph.ties}
    allowed = [cut for cut in range(1, count) if cut not in graph.ties and (
        cut in changes or role(graph, order[cut]) == "reduction"
        or not (rule(nodes[order[cut]]).pixel and nodes[order[cut]].inputs == (order[cut - 1],)))]
    stretches = MIN_CUTS if near else max(MIN_CUTS, MAX_CUTS - len(changes))
    chosen = set(changes) | set(near).intersection(allowed)
    if len(allowed) <= stretches + len(changes):
        chosen.update(allowed)
    else:
        for k in range(stretches):
            low, high = 1 + k * (count - 1) // stretches, 1 + (k + 1) * (count - 1) // stretches
            inside = [cut for cut in allowed if low <= cut < high]
            if inside:
                chosen.add(min(inside, key=lambda cut: (crossing[cut], cut)))
    return [0, *sorted(chosen), count]


def run_start(graph: Graph, stop: int) -> int:
    """Where the longest tileable run ending at ``stop`` starts."""
    low = stop
    while low > 0 and graph.nodes[graph.order[low - 1]].tileable:
        low -= 1
    return low


def prefix_arrays(graph: Graph, stop: int, axis: int, grids: Sequence[int | Period]) -> dict[int | Period, AxisArrays]:
    """Axis arrays of the longest tileable run ending at ``stop``, planned as one segment, for
    each grid in ``grids`` (a number of tiles or a ``Period``, ``tilec.cone``)."""
    arrays = AxisArrays.of_cone(graph, cone(graph, run_start(graph, stop), stop, axis, grids))
    counts = [parts_of(grid) for grid in grids]
    starts = np.cumsum([0, *counts])
    return {grid: arrays.window(start, start + parts)
            for grid, parts, start in zip(grids, counts, starts, strict=False)}


def _pareto(entries: list[tuple], fields: int, shield: list[tuple] = ()) -> list[tuple]:
    """Keep entries not dominated in their first ``fields`` (2 or 3) fields, all minimised, by
    each other or by an entry of ``shield`` (kept elsewhere; an equal one dominates).

    In order of the first field, an entry is kept unless an earlier kept one is no worse in the
    others. The kept ones' other fields are tracked as a staircase (the second rising, the
    third falling; each point one no kept entry beats in both), so one bisection finds the kept
    entry with the least third field among those whose second is no worse.
    """
    front: list[tuple] = []
    rising: list[int] = []  # the staircase's second fields
    falling: list[int] = []  # and its third fields
    tagged = [(entry, True) for entry in shield] + [(entry, False) for entry in entries]
    for entry, shielding in sorted(tagged, key=lambda tag: (tag[0][:fields], not tag[1])):
        second, third = entry[1], entry[2] if fields == 3 else 0
        below = bisect_right(rising, second)
        if below and falling[below - 1] <= third:
            continue
        if not shielding:
            front.append(entry)
        start = stop = bisect_left(rising, second)
        while stop < len(falling) and falling[stop] >= third:
            stop += 1
        rising[start:stop], falling[start:stop] = [second], [third]
    return front


class Partial(NamedTuple):
    """A partial plan up to a cut: its estimated ``seconds``, the bytes ``held`` for later segments
    (their kept bytes and kernel state), its ``peak`` so far (with the kernel state so far:
    ``Estimator.step_peaks`` counts all of it in every peak), and its ``choices``."""

    seconds: float
    held: int
    peak: int
    choices: tuple[SegmentChoice, ...]


class Smallest(NamedTuple):
    """A partial plan of ``smallest_budget``'s search: its ``peak`` so far, bytes ``held`` and ``choices``."""

    peak: int
    held: int
    choices: tuple[SegmentChoice, ...]


class _Costs:
    """Cached costs of the segment options of one traced model on one target (``backgrounds``: the
    model inputs' known background, ``Estimator``); with ``aligned``, one ``Period`` per axis
    (``aligned_periods``), the options of the tiled segments are tiles of that period only, where
    it tiles everything they partition: every tiled segment of a plan is aligned with the later
    ones. ``near``: ``cut_points``'s."""

    def __init__(self, graph: Graph, target: Target, dtype: str, backgrounds: Mapping[str, Background] | None = None,
                 aligned: tuple[Period, Period] | None = None, near: Sequence[int] = ()):
        self.graph, self.aligned = graph, aligned
        self.estimator = Estimator(graph, target, dtype, backgrounds)
        self.cuts = cut_points(graph, self.estimator.full, near)
        self.option = cache(self._option)
        self.fit = cache(self._fit)
        self.batches = cache(self._batches)
        self.grids = cache(self._grids)
        self.prefix = cache(self._prefix)
        self.periods = cache(self._periods)

    def _option(self, first: int, stop: int, grid: tuple[int, int] | None, batch: int = 1) -> SegmentCost:
        """Stored for ``grid=None``, else tiled with ``grid``, ``batch`` tiles of one class per call."""
        if grid is None:
            return self.estimator.stored(first, stop)
        return self.estimator.tiled(first, stop, self.prefix(stop, 0)[grid[0]], self.prefix(stop, 1)[grid[1]], batch,
                                    self.aligned is not None)

    def _fit(self, first: int, stop: int, grid: tuple[int, int] | None, made: frozenset[str],
             batch: int = 1) -> tuple[SegmentCost, int]:
        """``option`` and the bytes it needs on top of those held before it (``Estimator.local``),
        ``made`` the gradients its tiles may roll: what ``_peak`` adds."""
        cost = self.option(first, stop, grid, batch)
        return cost, self.estimator.local(cost, made)

    def _batches(self, first: int, stop: int) -> tuple[int, ...]:
        """The batches a tiled segment ``[first, stop)`` may run its tiles in besides one by one
        (``BATCHES``; none where its tiles cannot run stacked, ``tilec.sweeps.batchable``)."""
        return BATCHES if batchable(self.graph, first, stop) else ()

    def _prefix(self, stop: int, axis: int) -> dict[int | Period, AxisArrays]:
        """Axis arrays for every grid a segment ending at ``stop`` may take."""
        grids = {grid[axis] for first in self.cuts if first < stop for grid in self.grids(first, stop)}
        return prefix_arrays(self.graph, stop, axis, sorted(grids, key=lambda grid: (isinstance(grid, Period), grid)))

    def _grids(self, first: int, stop: int) -> list[tuple[int, int] | tuple[Period, Period]]:
        """Distinct grids for a tiled segment, coarse to fine: per count of tiles a side in
        ``GRIDS``, tiles of one period (``periods_for``) where they tile what the longest tileable run
        ending at ``stop`` partitions, else that many parts, clipped to its outputs' sizes (none when
        the segment cannot be tiled)."""
        sizes = owned_sizes(self.graph, first, stop) if self.graph.tileable(first, stop) else []
        if not sizes:
            return []
        height, width = min(s[0] for s in sizes), min(s[1] for s in sizes)
        if self.aligned is not None:
            partitioned = owned_sizes(self.graph, run_start(self.graph, stop), stop)
            return [self.aligned] if misfit(self.aligned, partitioned) is None else []
        periods = self.periods(stop)
        grids = [periods[g] or (min(g, height), min(g, width)) for g in GRIDS if g <= max(height, width)]
        return list(dict.fromkeys(grids))

    def _periods(self, stop: int) -> dict[int, tuple[Period, Period] | None]:
        """Per count of tiles a side in ``GRIDS``, ``periods_for`` the longest tileable run ending at
        ``stop``: its image tensors (its inputs' and its nodes') and what its tiles partition
        (``owned_sizes``)."""
        low = run_start(self.graph, stop)
        names = [i.name for i in self.graph.inputs_of(low, stop)] + [n.name for n in self.graph.members(low, stop)]
        images = [(self.graph.size(name, 0), self.graph.size(name, 1)) for name in names if self.graph.is_image(name)]
        partitioned = owned_sizes(self.graph, low, stop)
        return {g: periods_for(self.graph, images, partitioned, g) for g in GRIDS}

    def fine_grids(self, first: int, stop: int) -> list[tuple[int, int] | tuple[Period, Period]]:
        """The finest grid and coarser ones down to ``FINE_GRIDS_FROM`` tiles a side (where the
        grids reach that far), halving: finer tiles shrink the working set, but a grid whose halo
        spans several tiles has more tile shapes, each with its own kernels (``SegmentCost.kernels``)."""
        grids = self.grids(first, stop)
        chosen = [grids[-1]]
        while tiles_a_side(chosen[-1]) // 2 >= FINE_GRIDS_FROM:
            half = tiles_a_side(chosen[-1]) // 2
            coarser = next((grid for grid in reversed(grids) if tiles_a_side(grid) <= half), None)
            if coarser is None:
                break
            chosen.append(coarser)
        return chosen

    def recurse(self, start: tuple, extend, fields: int, beam: int | None = None) -> list[tuple]:
        """Left-to-right dynamic programming over cut points.

        An entry is a named tuple (``Partial``, ``Smallest``) whose first ``fields`` fields are
        minimised and whose last is its ``SegmentChoice`` s; a Pareto front is kept per cut and
        per set of the tensors crossing it whose gradients the next segment may roll, because
        tiled segments made them (``Estimator.made_tiled``, found once per entry), and pruned where it grew.
        An entry also prunes those of the sets it holds less than: rolling more leaves every later
        peak no higher (``Estimator.local``), and a tensor a later segment may roll that an earlier
        one made crosses this cut, rollable here too (``Graph.may_roll``).
        ``extend(entry, first, stop, made)`` yields the entries one more segment ``[first, stop)``
        makes of it, ``made`` the entry's ``Estimator.made_tiled`` at ``first``. Returns the fronts at the
        last cut. With ``beam``, each front of ``Partial`` s keeps only ``_thin``'s entries: a quick
        search for a good plan, not the best.
        """
        fronts: dict[int, dict[frozenset[str], list[tuple]]] = {0: {self.estimator.made_tiled(0, start[-1]): [start]}}
        for first in self.cuts[:-1]:
            grown = set()
            groups = fronts.pop(first, {})
            for made, entries in groups.items():
                shield = [entry for more, kept in groups.items() if more > made for entry in kept]
                for entry in _pareto(entries, fields, shield) if shield else entries:
                    for stop in (c for c in self.cuts if c > first):
                        for new in extend(entry, first, stop, made):
                            group = self.estimator.made_tiled(stop, new[-1])
                            fronts.setdefault(stop, {}).setdefault(group, []).append(new)
                            grown.add((stop, group))
            for stop, group in grown:
                front = _pareto(fronts[stop][group], fields)
                fronts[stop][group] = front if beam is None or len(front) <= beam else _thin(front, beam)
        return [entry for group in fronts.get(self.cuts[-1], {}).values() for entry in group]


def _thin(front: list[tuple], beam: int) -> list[tuple]:
    """``beam`` entries of ``front`` (``Partial`` s) spread over its peaks so far (room for later
    segments): in order of the peak, the fastest of each of ``beam`` equal stretches."""
    ordered = sorted(front, key=lambda entry: (entry[2], entry[0], entry[1]))
    bounds = [len(ordered) * k // beam for k in range(beam + 1)]
    return [min(ordered[start:stop], key=lambda entry: entry[:3])
            for start, stop in zip(bounds, bounds[1:], strict=False)]


@dataclass(frozen=True)
class Choice:
    """What ``choose`` picked: the graph to plan (the traced one, or with ``recomputed`` nodes
    recomputed for their late readers, ``tilec.recompute``) and its segments."""

    graph: Graph
    recomputed: tuple[str, ...]
    segments: tuple[SegmentChoice, ...]
    seconds: float


def variants(graph: Graph, target: Target, dtype: str = "float32") -> list[tuple[tuple[str, ...], Graph]]:
    """The graph as traced, then with its 1, 2, ... ``MAX_RECOMPUTED`` cheapest recomputable
    nodes recomputed (cones costing at most ``RECOMPUTE_SHARE`` of the forward FLOPs)."""
    estimator = Estimator(graph, target, dtype)
    flops = dict(zip(graph.order, estimator.facts.flops.tolist(), strict=True))
    names = candidates(graph, flops, RECOMPUTE_SHARE)[:MAX_RECOMPUTED]
    return [((), graph)] + [(tuple(names[:k]), recompute(graph, names[:k])) for k in range(1, len(names) + 1)]


def choose(graph: Graph, target: Target, budget: int, dtype: str = "float32",
           backgrounds: Mapping[str, Background] | None = None, near: Sequence[int] = ()) -> Choice:
    """The plan of least estimated time on ``target``, over ``variants`` (and with known
    ``backgrounds``, plans of one period: ``ALIGNED``), with every predicted step peak <=
    ``usable(budget)`` bytes (its time counting the tiles computed once where the inputs'
    ``backgrounds`` are known). ``near``: the cuts of a plan of the model at another input size
    (``tilec.compile(..., like=)``): a narrower search, of ``graph`` alone (no ``variants``: it
    recomputes what that plan did) over those cuts and ``MIN_CUTS`` others (``cut_points``)."""
    found, costs = [], []
    searched = [((), graph)] if near else variants(graph, target, dtype)
    for recomputed, variant in searched:
        costs.append(_Costs(variant, target, dtype, backgrounds, near=near))
        best = _search(costs[-1], usable(budget), min((choice.seconds for choice in found), default=inf))
        if best is not None:
            found.append(Choice(variant, recomputed, best.choices, best.seconds))
    for periods in aligned_periods(graph, backgrounds):
        best = _search(_Costs(graph, target, dtype, backgrounds, periods, near), usable(budget),
                       min((choice.seconds for choice in found), default=inf))
        if best is not None:
            found.append(Choice(graph, (), best.choices, best.seconds))
    if not found:
        # near the smallest budget: the plans ``smallest_budget`` builds on, every fine grid offered
        peaks = [_smallest(cost) for cost in costs]
        for (recomputed, variant), cost, peak in zip(searched, costs, peaks, strict=True):
            best = _search(cost, usable(budget), fine=True) if peak <= usable(budget) else None
            if best is not None:
                found.append(Choice(variant, recomputed, best.choices, best.seconds))
        if not found:
            raise BudgetError(f"no plan fits the memory budget of {format_bytes(budget)}; the smallest "
                              f"feasible budget is about {format_bytes(_budget_for(min(peaks)), up=True)}")
    return min(found, key=lambda choice: (choice.seconds, len(choice.recomputed)))


def aligned_periods(graph: Graph, backgrounds: Mapping[str, Background] | None) -> list[tuple[Period, Period]]:
    """The periods (rows, columns) of the aligned searches: about ``ALIGNED`` tiles a side of the
    model input whose background is known, each tile a multiple of every stride at which the
    network's images of at least that many pixels are that input (``tilec.regions.Period``), so
    that one period tiles them all. None where no background is known or a known one is not of
    the size of the model's first image input (``Graph.image_size``), whose pixels they count."""
    sizes = {(known.height, known.width) for known in (backgrounds or {}).values()}
    full = graph.image_size()
    if sizes != {full}:
        return []
    images = [(graph.size(name, 0), graph.size(name, 1)) for name in graph.order if graph.is_image(name)]
    return list(dict.fromkeys(periods_for(graph, images, (), tiles) for tiles in ALIGNED))


def periods_for(graph: Graph, images: Sequence[tuple[int, int]], partitioned: Sequence[tuple[int, int]],
                tiles: int) -> tuple[Period, Period] | None:
    """About ``tiles`` tiles a side of the model's first image input, each a multiple of the least
    stride at which each of ``images`` (rows, columns) at least ``tiles`` pixels long is that input
    (``strides_of``; sizes no stride gives are left out): a tensor at stride ``s`` is then cut into
    tiles of ``period / s`` pixels, and its inner tiles line up with every other's, alike (one shape
    class). ``None`` where the model has no image input or the periods do not tile ``partitioned``
    (``misfit``)."""
    full = graph.image_size()
    if full is None:
        return None
    periods = []
    for axis in range(2):
        strides = [strides_of(size[axis], full[axis], full[axis]) for size in images if size[axis] >= tiles]
        periods.append(Period.of(full[axis], math.lcm(*(s[0] for s in strides if s)), tiles))
    return tuple(periods) if misfit(periods, partitioned) is None else None


def tiles_a_side(grid: tuple[int, int] | tuple[Period, Period]) -> int:
    """The most tiles ``grid`` has on either axis."""
    return max(parts_of(g) for g in grid)


def _budget_for(peak: int) -> int:
    """The smallest budget whose usable part holds ``peak`` bytes."""
    return -(-peak * 100 // USABLE_PERCENT)


def _search(costs: _Costs, budget: int, bound: float = inf, fine: bool = False) -> Partial | None:
    """The plan of least estimated seconds with a predicted peak <= ``budget`` (already the
    usable part) and seconds <= ``bound`` (a plan found before: a partial plan slower than it
    cannot end faster, segments adding seconds); ``None`` when no plan fits. With ``fine``, a
    tiled segment is offered every grid of ``_Costs.fine_grids`` that fits, not only the finest:
    the options ``_smallest`` builds on, so that the smallest budget it finds has a plan."""
    limits = [budget - budget * share for share in MARGINS]

    def extend(entry: Partial, first: int, stop: int, made: frozenset[str]):
        seconds, held, peak, choices = entry

        def grown(grid: tuple[int, int], mode: str, fit: tuple[SegmentCost, int], batch: int = 1):
            cost = fit[0]
            if seconds + cost.seconds <= bound:
                yield Partial(seconds + cost.seconds, _held(held, cost), _peak(held, peak, fit),
                              (*choices, SegmentChoice(first, stop, grid, mode, batch)))

        if held + costs.estimator.stored_floor(first, stop) <= budget:
            stored = costs.fit(first, stop, None, made)
            if _peak(held, peak, stored) <= budget:
                yield from grown((1, 1), "stored", stored)
        grids = costs.grids(first, stop)
        if grids and held + costs.estimator.floor(first, stop) <= budget:
            # finer grids add time for a lower peak so far, which later segments' kernel state
            # may need: per margin, the coarsest grid that fits with that much to spare (one pass
            # from coarse to fine: a grid that fits with a margin fits with the smaller ones), and
            # the finest (with ``fine``, each fine grid: a finer one may hold more kernel state)
            chosen = []
            for grid in grids:
                grid_peak = _peak(held, peak, costs.fit(first, stop, grid, made))
                while len(chosen) < len(limits) and grid_peak <= limits[len(chosen)]:
                    chosen.append(grid)
                if len(chosen) == len(limits):
                    break
            chosen += [grid for grid in (costs.fine_grids(first, stop) if fine else grids[-1:])
                       if _peak(held, peak, costs.fit(first, stop, grid, made)) <= budget]
            if chosen and costs.estimator.backgrounds and costs.aligned is None:
                # a known background favours finer tiles, more of them computed once: every grid up
                # to ``FINER`` times the coarsest that fits, tiles a side
                coarsest = tiles_a_side(chosen[0])
                chosen += [grid for grid in grids if coarsest < tiles_a_side(grid) <= FINER * coarsest]
            for grid in dict.fromkeys(chosen):
                fit = costs.fit(first, stop, grid, made)
                yield from grown(grid, "tiled", fit)
                # the same grid with several tiles per call, where that is faster and fits (a larger
                # batch holds more: past the budget, none larger fits; past the longest run of tiles
                # of one class, it costs the same)
                for batch in costs.batches(first, stop):
                    batched = costs.fit(first, stop, grid, made, batch)
                    if _peak(held, peak, batched) > budget:
                        break
                    if batched[0].seconds < fit[0].seconds:
                        yield from grown(grid, "tiled", batched, batch)
                    if batched[0].largest_call < batch:
                        break

    start = Partial(0.0, 0, 0, ())
    quick = min(costs.recurse(start, extend, 3, BEAM), default=None)
    bound = min(bound, quick.seconds) if quick is not None else bound
    return min(costs.recurse(start, extend, 3), default=None)


def _held(held: int, cost: SegmentCost) -> int:
    """Bytes held after one more segment: its kept bytes and its kernel state."""
    return held + cost.kept + cost.kernels


def _peak(held: int, peak: int, fit: tuple[SegmentCost, int]) -> int:
    """The peak so far after one more segment (``_Costs.fit``): every peak also finds that
    segment's kernel state."""
    cost, local = fit
    return max(peak, held + local) + cost.kernels


def _smallest(costs: _Costs) -> int:
    """Smallest predicted peak over the plans ``_search`` can build.

    Options that cannot beat the plan cutting at every candidate (a quick upper bound) are
    not costed in full.
    """
    def options(first: int, stop: int, peak: int, held: int, bound: float, made: frozenset[str]):
        """``(choice, fit)`` of the segment stored and tiled with the fine grids (``_Costs.fit``)."""
        if max(peak, held + costs.estimator.stored_floor(first, stop)) <= bound:
            yield SegmentChoice(first, stop, (1, 1), "stored"), costs.fit(first, stop, None, made)
        if costs.grids(first, stop) and max(peak, held + costs.estimator.floor(first, stop)) <= bound:
            for grid in costs.fine_grids(first, stop):
                yield SegmentChoice(first, stop, grid, "tiled"), costs.fit(first, stop, grid, made)

    peak, held, choices = 0, 0, ()
    for first, stop in zip(costs.cuts, costs.cuts[1:], strict=False):
        made = costs.estimator.made_tiled(first, choices)
        choice, best = min(options(first, stop, peak, held, inf, made), key=lambda option: (  # noqa: B023
            _peak(held, peak, option[1]), _held(held, option[1][0])))  # noqa: B023
        peak, held, choices = _peak(held, peak, best), _held(held, best[0]), (*choices, choice)
    bound = peak

    def extend(entry: Smallest, first: int, stop: int, made: frozenset[str]):
        peak, held, choices = entry
        for choice, fit in options(first, stop, peak, held, bound, made):
            yield Smallest(_peak(held, peak, fit), _held(held, fit[0]), (*choices, choice))

    return min(entry.peak for entry in costs.recurse(Smallest(0, 0, ()), extend, 2))


def smallest_budget(graph: Graph, target: Target, dtype: str = "float32") -> int:
    """Smallest budget ``choose`` accepts on ``target``: the smallest predicted peak over
    ``variants`` plus the headroom."""
    return _budget_for(min(_smallest(_Costs(variant, target, dtype)) for _, variant in variants(graph, target, dtype)))
