"""``Estimator``: FLOPs, time and peak bytes of one training step of a segmented plan.

Memory convention (``Plan.predicted_peak_bytes``): bytes the step allocates above the input, the
parameters and the final output gradient, plus the kernel state a process's first step creates
and keeps (``Target.kernel_state`` per distinct convolution call shape; all of it is counted in
every segment's peak, as the first segment's backward, which runs last, finds it all). The input
is assumed not to need a gradient (images).

Step timeline. Segments run in order in forward, then in reverse in backward. Every segment
output (a boundary tensor) stays alive from its creation until the backward of its last reader;
the gradient of a boundary tensor exists from the backward of its last reader until the backward
of its producer. While segment ``k`` runs:

* forward: the kept bytes of earlier segments + ``forward_local`` (its outputs at full size and
  its working set);
* backward: the kept bytes of earlier segments + ``backward_local``: the gradients of the
  tensors crossing its stop cut and of its inputs, the model outputs produced from its first node
  on (the caller holds them), the gradients of its own parameters and of those of later segments
  (created by their backward, which ran first; gradients that exist before the step, as with
  ``zero_grad(set_to_none=False)``, are not the step's), and its working set.

``kept``: a tiled segment keeps its outputs until its backward; a stored segment (untiled,
through autograd) also keeps what autograd saves for its backward, under autocast the
lower-precision copies of its parameters too. The step's forward is assumed to run under
autocast and its backward outside it, as PyTorch's mixed-precision recipe does. Working sets
come from the liveness simulation (``tilec.cost.liveness``); a tile tensor's bytes are its shape
with the image axes replaced by the tile's lengths, times the element size.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from tilec.cone import cone
from tilec.cost.arrays import AxisArrays
from tilec.cost.background import Background
from tilec.cost.constants import PARTIAL_TENSOR_BYTES
from tilec.cost.facts import Facts
from tilec.cost.liveness import COPY, KINDS, Forward, Program, program
from tilec.graph import Graph
from tilec.ir import AxisTile
from tilec.ops import rule
from tilec.regions import Interval, strides_of
from tilec.sweeps import dependent_masks, levels, may_roll, prefix_masks
from tilec.target import Target


@dataclass(frozen=True)
class SegmentCost:
    """What one segment choice costs; bytes are per the module docstring's timeline; ``calls``
    and ``copied`` bytes as ``Speed`` counts them."""

    forward_local: int
    backward_local: int
    kept: int
    flops: int
    flop_overhead: float
    calls: int
    copied: int
    seconds: float
    #: Bytes of kernel state its convolutions create and the process keeps (``Target.kernel_state``).
    kernels: int = 0
    #: Of both locals, bytes of the staging of model inputs read by region: twice the most any
    #: tile reads of them (one tile's slices read ahead while another computes).
    staging: int = 0
    #: Per sliced input whose gradient the tiles may roll (``Estimator.rollable``), its name and
    #: the bytes ``backward_local`` holds less if they do: its full gradient less the band.
    rolls: tuple[tuple[str, int], ...] = ()
    #: Tiles per pass computed once for their identical ones, where the inputs' background is known
    #: (``Estimator.constant_tiles``): ``seconds`` counts the others.
    reused: int = 0
    #: The most tiles of one call (``tilec.runtime.batches``): under the batch it was costed with,
    #: no run of consecutive tiles of one class is longer, and a larger batch costs the same.
    largest_call: int = 1

    def rolled(self, made: frozenset[str]) -> frozenset[str]:
        """The inputs the tiles roll, of those tiled segments made (``Estimator.made_tiled``)."""
        return frozenset(name for name, _ in self.rolls if name in made)


@dataclass(frozen=True)
class SweepWork:
    """One step of a tiled segment (``Estimator.sweep_work``): its FLOPs; the seconds of those
    FLOPs at each node's rate in the forward sweeps, the backward's sweeps of the leaves and its
    last sweep (and of the latter, its back-propagation into the inputs); op calls per call of a
    tile function in each; and the halo's FLOP ratio."""

    flops: float
    forward_seconds: float
    sweep_seconds: float
    last_seconds: float
    #: of ``last_seconds``, those of back-propagating into the sliced inputs alone
    input_seconds: float
    forward_calls: int
    sweep_calls: int
    last_calls: int
    halo: float


@dataclass(frozen=True)
class Sweeps:
    """The sweeps of a tiled segment, whatever its tiles (``Estimator.sweeps``): which of its nodes
    are images, their untiled FLOPs, per node the forward sweeps computing it, the number of other
    backward sweeps (each recomputes every node), per node those of them back-propagating through
    it into its inputs, and the op calls per tile of the forward and of those backward sweeps."""

    images: np.ndarray
    untiled: float
    forward: np.ndarray
    swept: int
    after: np.ndarray
    forward_calls: int
    sweep_calls: int


class Estimator:
    """Costs of segment choices for one traced graph on one target (module docstring);
    ``backgrounds``: per model input, where it is known to be background (``Background``), so
    that the time counts the tiles computed once."""

    def __init__(self, graph: Graph, target: Target, dtype: str, backgrounds: Mapping[str, Background] | None = None):
        self.graph, self.target = graph, target
        self.backgrounds = dict(backgrounds or {})
        self.facts = facts = Facts(graph, target, dtype)
        self.speed = target.rates
        self.full = facts.full
        self.forward = cache(self._forward)
        self.program = cache(self._program)
        self.stored = cache(self._stored)
        self.stored_forward = cache(self._stored_forward)
        self.gradients = cache(self._gradients)
        self.boundary = cache(self._boundary)
        self.rollable = cache(self._rollable)
        self.partials = cache(self._partials)
        self.constant_tiles = cache(self._constant_tiles)
        self.input_regions = cache(self._input_regions)
        self.sweeps = cache(self._sweeps)
        self.floor = cache(self._floor)

    def segment(self, first: int, stop: int, rows: Sequence[AxisTile], cols: Sequence[AxisTile],
                stored: bool, batch: int = 1, aligned: bool = False) -> SegmentCost:
        """Cost of nodes ``[first, stop)``, stored, or tiled with the given axis tiles, ``batch``
        tiles of one shape class per call (``aligned``: ``Estimator.tiled``)."""
        if stored:
            return self.stored(first, stop)
        return self.tiled(first, stop, AxisArrays.of_tiles(self.graph, first, stop, rows),
                          AxisArrays.of_tiles(self.graph, first, stop, cols), batch, aligned)

    def period(self, rows: Sequence[AxisTile], cols: Sequence[AxisTile]) -> tuple[int, int] | None:
        """The period (rows, columns) with which a tiled segment's axis tiles ``rows`` and ``cols``
        repeat, in pixels of the model input whose background is known: per axis, where every
        tensor the tiles partition (their owned parts and partials) is that input at a stride
        (``tilec.regions.strides_of``) and is cut into tiles of one length but the last, that length
        times the stride (one tile: the input's size). ``None`` where no background is known, the
        known inputs differ in size, or the partitions do not give one period."""
        inputs = {(known.height, known.width) for known in self.backgrounds.values()}
        if len(inputs) != 1:
            return None
        (image,) = inputs
        found = tuple(_axis_period(tiles, full) for tiles, full in zip((rows, cols), image, strict=True))
        return None if None in found else found

    def _stored(self, first: int, stop: int) -> SegmentCost:
        facts = self.facts
        forward, kept = self.stored_forward(first)
        backward = self.program(first, stop, False).backward.peak(facts.scale_full[first:stop].reshape(1, -1))
        casts = self.cast_bytes(first, stop)
        flops = float(facts.flops[first:stop].sum() + facts.backward_flops[first:stop].sum())
        calls = 2 * (stop - first)
        flop_seconds = float(((facts.flops[first:stop] + facts.backward_flops[first:stop])
                              * facts.full_seconds_per_flop[first:stop]).sum())
        return SegmentCost(
            forward_local=forward[stop - first - 1] + casts,
            backward_local=self.gradients(first, stop) + facts.later_weights[first] + backward + casts,
            kept=kept[stop - first - 1] + casts,
            flops=round(flops),
            flop_overhead=0.0,
            calls=calls,
            copied=0,
            seconds=self.speed.seconds(flop_seconds, calls, 0),
            kernels=self.kernel_bytes((p, facts.stored_passes[p], (None,)) for p in facts.convolutions
                                      if first <= p < stop),
        )

    def _stored_forward(self, first: int) -> tuple[list[int], list[int]]:
        """Per stop, the forward peak and the kept bytes of the stored segment ``[first, stop)``."""
        ahead = self.forward(first, False, True)
        alive, at = (level[0] for level in ahead.run.trace().levels(self.facts.scale_full[first:].reshape(1, -1)))
        peaks = np.maximum.accumulate(np.concatenate([[0.0], at]))
        return ([round(float(peaks[events])) for _, events, _, _ in ahead.marks],
                [round(float(alive[changes])) for changes, _, _, _ in ahead.marks])

    def tiled(self, first: int, stop: int, rows: AxisArrays, cols: AxisArrays, batch: int = 1,
              aligned: bool = False) -> SegmentCost:
        """Cost of nodes ``[first, stop)`` tiled; ``rows`` and ``cols`` cover at least those nodes.
        With ``batch`` > 1, consecutive tiles of one shape class run that many per call
        (``tilec.runtime.batches``): the working set of the largest call, its slices and the one
        read ahead, fewer calls of larger kernels. ``aligned``: its tiles and every later tiled
        segment's repeat with one ``period`` (and the model returns no image, whose gradient the
        caller gives): the owned output gradients over the background repeat with it, and the
        reused tiles' input gradients come in a few classes (``tilec.runtime.sweeps.Sweep.alike``)."""
        facts, nodes = self.facts, self.facts.nodes
        simulated = self.program(first, stop, True)
        tiles = rows.parts * cols.parts
        constant = self.constant_tiles(first, stop, rows.parts, cols.parts)
        if batch == 1 and constant is None:
            made = (tiles, 1, (1,), 0)
        else:
            made = _calls(_class_ids(simulated, rows), _class_ids(simulated, cols), batch, constant)
        reused = made[3]
        # every backward sweep computes identical tiles once as the forward does; in the last one,
        # where a sliced input wants a gradient and the owned output gradients may differ (outputs
        # not all reductions' results), each reused tile still back-propagates its own into its
        # input gradient (``tilec.runtime.sweeps.Sweep.band``), but for a class of equal ones
        # (aligned segments, ``_classes_apart``)
        uniform = not any(self.graph.is_image(name) for name in self.graph.outputs_of(first, stop))
        inputs_grad = any(facts.needs_grad(self.graph.position[name]) for name, _ in simulated.slices)
        apart = reused if inputs_grad and not uniform else 0
        if apart and aligned and not any(self.graph.is_image(name) for name in self.graph.outputs):
            apart = min(apart, _classes_apart(constant))
        sizes = self._pair_bytes(simulated, rows, cols) * made[1]
        outputs, in_grad, fixed = self.boundary(first, stop)
        work = self.sweep_work(first, stop, rows, cols, made[0] + reused)
        flops, halo = work.flops, work.halo
        flop_seconds = ((work.forward_seconds + work.sweep_seconds + work.last_seconds) * (1 - reused / tiles)
                        + work.input_seconds * apart / tiles)
        calls = (work.forward_calls + work.sweep_calls + work.last_calls) * made[0] + (stop - first) * apart
        # every call copies its convolutions' weights: forward (once where packed), autograd re-run, backward
        packed = self.packed_bytes(first, stop)
        copied_weights = packed + sum(
            (1 if nodes[p].packed else 2) * nodes[p].weight_copies + nodes[p].backward_weight_copies
            for p in range(first, stop)) * made[0]
        copied = outputs + 2 * in_grad + copied_weights
        rollable = self.rollable(first)
        bands = [(name, _band(rows, name, readers)) for name, readers in simulated.slices if name in rollable]
        rolls = tuple((name, self.full[name] - self.full[name] * band // self.graph.size(name, 0))
                      for name, band in bands if band is not None)
        staging = self.staging(simulated, sizes) * (made[1] + 1) // (2 * made[1])
        partials = self.partials(first, stop)
        return SegmentCost(  # in backward, the merged partials' gradients too (``tilec.runtime.sweeps``)
            forward_local=outputs + partials + packed + staging + simulated.forward.peak(sizes),
            backward_local=fixed + 2 * partials + staging + simulated.backward.peak(sizes),
            kept=outputs + partials,
            flops=round(flops),
            flop_overhead=halo - 1,
            calls=calls,
            copied=copied,
            seconds=self.speed.seconds(flop_seconds, calls, copied),
            kernels=self.kernel_bytes(_tile_calls(facts, first, stop, rows, cols, made[2])),
            rolls=rolls,
            staging=staging,
            reused=reused,
            largest_call=made[1],
        )

    def _constant_tiles(self, first: int, stop: int, row_parts: int, col_parts: int) -> np.ndarray | None:
        """``[row tile, column tile]``: whether the tile of segment ``[first, stop)`` tiled
        ``row_parts`` x ``col_parts`` reads only known background of the model's image inputs through
        its whole cone from them (``backgrounds``), so that its slices are constant and the runtime
        computes it once with the others of its class (``tilec.runtime.reuse``); ``None`` where no
        tile can be known so: no background given, an image input read without one, a cone that
        does not reach the inputs through tileable nodes, or an op reading absolute positions."""
        graph = self.graph
        if not self.backgrounds or any(rule(n).positional(n, graph) for n in graph.members(first, stop)):
            return None
        if any(not graph.nodes[name].tileable for name in graph.order[:stop]):
            return None
        regions = [self.input_regions(stop, 0, row_parts), self.input_regions(stop, 1, col_parts)]
        images = [name for name in graph.input_names if graph.is_image(name) and name in regions[0]]
        if not images or any(name not in self.backgrounds for name in images):
            return None
        constant = np.ones((row_parts, col_parts), dtype=bool)
        for name in images:
            constant &= self.backgrounds[name].constant(regions[0][name], regions[1][name])
        return constant

    def _input_regions(self, stop: int, axis: int, parts: int) -> dict[str, np.ndarray]:
        """Per model input the run ``[0, stop)`` reads, each of ``parts`` tiles' ``(start, stop)``
        of it on ``axis``: the hull of its cone's reads (``tilec.cone``)."""
        regions = cone(self.graph, 0, stop, axis, [parts]).regions
        return {name: np.stack(regions[name], axis=1) for name in self.graph.input_names if name in regions}

    def _partials(self, first: int, stop: int) -> int:
        """Bytes of the merged partials of the reductions of segment ``[first, stop)``, which the
        step keeps from the forward sweep computing them until the segment's backward ends
        (``tilec.runtime.sweeps``; ``Op.partial_elements``, half-precision ones in float32): one per
        reduction, whatever the number of tiles. The backward holds their gradients as well."""
        element = max(self.facts.element, 4)
        return sum(count * element + PARTIAL_TENSOR_BYTES
                   for level in levels(self.graph, first, stop)
                   for node in (self.graph.nodes[name] for name in level.reductions)
                   for count in rule(node).partial_elements(node, self.graph))

    def staging(self, program: Program, sizes: np.ndarray) -> int:
        """Twice the most bytes any tile of ``program`` reads of the model inputs (``sizes``: per
        pair of tiles, the bytes of each quantity, the sliced inputs' first)."""
        columns = [k for k, (name, _) in enumerate(program.slices) if self.graph.is_input(name)]
        return 2 * round(float(sizes[:, columns].sum(axis=1).max())) if columns and len(sizes) else 0

    def sweep_work(self, first: int, stop: int, rows: AxisArrays, cols: AxisArrays,
                   calls_made: int | None = None) -> SweepWork:
        """The work of one step of a tiled segment (``SweepWork``) whose tiles run in ``calls_made``
        calls a pass (default: one each, which sizes the kernels): every forward sweep
        (``tilec.sweeps``: per level, what its partials need; then the image outputs, if any), and in
        backward every recompute sweep (per swept level that is not direct, and the last) and the
        back-propagation of what depends on what it differentiates: into the parameters as well in
        the last sweep only."""
        facts, sweeps = self.facts, self.sweeps(first, stop)
        calls_made = rows.parts * cols.parts if calls_made is None else calls_made
        row_sums = rows.sums[first - rows.offset:stop - rows.offset]
        col_sums = cols.sums[first - cols.offset:stop - cols.offset]
        per_second = facts.seconds_per_flop(first, stop, row_sums * col_sums / calls_made)
        tiled_per_node = facts.pixel_flops[first:stop] * row_sums * col_sums
        tiled = float(tiled_per_node[sweeps.images].sum())
        halo = tiled / sweeps.untiled if sweeps.untiled else 1.0
        backward = facts.backward_flops[first:stop] * sweeps.images * halo
        input_backward = facts.input_backward_flops[first:stop] * sweeps.images * halo
        forward = tiled_per_node * sweeps.forward  # FLOPs per node over the step's forward sweeps
        last = backward + tiled_per_node  # the last backward sweep's
        swept = tiled_per_node * sweeps.swept + input_backward * sweeps.after  # and the other backward sweeps'
        return SweepWork(float(forward.sum() + swept.sum() + last.sum()), float((forward * per_second).sum()),
                         float((swept * per_second).sum()), float((last * per_second).sum()),
                         float((input_backward * per_second).sum()), sweeps.forward_calls,
                         sweeps.sweep_calls, (stop - first) * 2, halo)

    def _sweeps(self, first: int, stop: int) -> Sweeps:
        """What ``sweep_work`` counts of segment ``[first, stop)`` whatever its tiles: per node, the
        forward sweeps that compute it (the image outputs' and, per level that is neither the first
        nor direct, its prefix's) and the other backward sweeps (per swept level) that
        back-propagate through it into its inputs."""
        graph, count = self.graph, stop - first
        images = np.array([graph.is_image(name) for name in graph.order[first:stop]])
        has_images = any(graph.is_image(name) for name in graph.outputs_of(first, stop))
        sweeping = [level for level in levels(graph, first, stop) if level.index and not level.direct]
        prefixed = sum(1 << level.index for level in sweeping)  # levels whose forward sweep runs a prefix
        swept_levels = sum(1 << level.index for level in sweeping if level.swept)
        computed = np.array([(mask & prefixed).bit_count() for mask in prefix_masks(graph, first, stop)], dtype=float)
        after = np.array([(mask & swept_levels).bit_count() for mask in dependent_masks(graph, first, stop)],
                         dtype=float)
        swept = swept_levels.bit_count()
        return Sweeps(images, float(self.facts.flops[first:stop][images].sum()), computed + has_images, swept, after,
                      count * has_images + int(computed.sum()), swept * count + int(after.sum()))

    def _rollable(self, cut: int) -> frozenset[str]:
        """The tensors whose gradient the tiled backward of a segment starting at ``cut`` may roll
        into the tensor's own storage, band by band (``tilec.runtime.tiles.Rolled``), if a tiled
        segment made it (``made_tiled``): those ``tilec.sweeps.may_roll`` names that need one; none
        where ranks share the tiles (``Target.shared_tiles``)."""
        if self.target.shared_tiles:
            return frozenset()
        return frozenset(name for name in may_roll(self.graph, cut) if self.facts.needs_grad(self.graph.position[name]))

    def made_tiled(self, cut: int, spans: Sequence) -> frozenset[str]:
        """Of ``rollable(cut)``, the tensors made by a tiled segment of ``spans`` (segments or
        segment choices in order, with ``first``, ``stop`` and ``mode``; at least those before
        ``cut``): the segment starting there rolls those of its ``SegmentCost.rolls``."""
        rollable = self.rollable(cut)
        if not rollable:
            return rollable
        position = self.graph.position
        return frozenset(name for name in rollable if _mode_at(spans, position[name]) == "tiled")

    def kernel_bytes(self, calls: Iterable[tuple[int, int, Iterable]]) -> int:
        """Kernel state of convolution calls, per convolution ``(position, passes, call shapes)``:
        alike convolutions' calls of one shape share their kernels."""
        if not self.target.kernel_state:
            return 0
        shapes: dict[tuple, set] = {}
        for p, passes, found in calls:
            shapes.setdefault((self.facts.kernel_key[p], passes), set()).update(found)
        return self.target.kernel_state * sum(passes * len(found) for (_, passes), found in shapes.items())

    def _boundary(self, first: int, stop: int) -> tuple[int, int, int]:
        """A tiled segment's output bytes, sliced inputs' gradient bytes, and backward bytes besides
        its working set (``gradients``, and the gradients of its and later segments' parameters)."""
        inputs = [i.name for i in self.graph.inputs_of(first, stop) if i.sliced]
        in_grad = sum(self.full[name] for name in inputs if self.facts.needs_grad(self.graph.position[name]))
        return self.output_bytes(first, stop), in_grad, self.gradients(first, stop) + self.facts.later_weights[first]

    def local(self, cost: SegmentCost, made: frozenset[str] = frozenset()) -> int:
        """Peak bytes while a segment runs, beyond the kept bytes of earlier segments, its tiles
        rolling the gradients of those of its ``rolls`` that tiled segments ``made``."""
        if not cost.rolls or not made:
            return max(cost.forward_local, cost.backward_local)
        return max(cost.forward_local, cost.backward_local - sum(saved for name, saved in cost.rolls if name in made))

    def stored_floor(self, first: int, stop: int) -> int:
        """A lower bound of ``local`` of the segment stored, without simulating its backward."""
        forward = self.stored_forward(first)[0][stop - first - 1] + self.cast_bytes(first, stop)
        return max(forward, self.gradients(first, stop) + self.facts.later_weights[first])

    def _floor(self, first: int, stop: int) -> int:
        """A lower bound of ``local`` of the segment tiled with any grid: all but its working set
        and the gradients it may roll."""
        outputs, _, fixed = self.boundary(first, stop)
        rollable = self.rollable(first)
        return max(outputs + self.packed_bytes(first, stop),
                   fixed - sum(self.full[i.name] for i in self.graph.inputs_of(first, stop) if i.name in rollable))

    def cast_bytes(self, first: int, stop: int) -> int:
        """Bytes of autocast's copies of the parameters of nodes ``[first, stop)`` stored."""
        return self.facts.casts_after[first] - self.facts.casts_after[stop]

    def packed_bytes(self, first: int, stop: int) -> int:
        """Bytes of the packed weights a tiled forward pass of nodes ``[first, stop)`` keeps."""
        return self.facts.packed_after[first] - self.facts.packed_after[stop]

    def step_peaks(self, costs: Sequence[SegmentCost], rolled: Sequence[frozenset[str]]) -> list[int]:
        """Predicted step peak while each segment runs (forward or backward, whichever is higher),
        with the kernel state of every segment; segment ``k`` rolls the gradients ``rolled[k]``."""
        peaks, kept, kernels = [], 0, sum(cost.kernels for cost in costs)
        for cost, names in zip(costs, rolled, strict=True):
            peaks.append(kept + self.local(cost, names) + kernels)
            kept += cost.kept
        return peaks

    def output_bytes(self, first: int, stop: int) -> int:
        return sum(self.full[name] for name in self.graph.outputs_of(first, stop))

    def _gradients(self, first: int, stop: int) -> int:
        """Gradients alive in the segment's backward, and the model outputs held from ``first`` on."""
        position = self.graph.position
        names = {*self.graph.crossing(stop), *(i.name for i in self.graph.inputs_of(first, stop))}
        grads = sum(self.full[n] for n in names if self.facts.needs_grad(position[n]) and n not in self.facts.outputs)
        return grads + sum(self.full[n] for n in self.facts.outputs if position[n] >= first)

    def _pair_bytes(self, program: Program, rows: AxisArrays, cols: AxisArrays) -> np.ndarray:
        """Bytes of each quantity in each distinct (row tile, column tile) pair: ``[pairs, quantities]``."""
        first, stop, count = program.first, program.stop, len(program.slices)
        row_lengths, row_flags = _classes(program, rows)
        col_lengths, col_flags = _classes(program, cols)
        scale = np.concatenate([[self.full[name] / self.facts.area(name) for name, _ in program.slices],
                                self.facts.scale_pixel[first:stop].ravel()])
        flags = np.ones((len(row_flags), len(col_flags), count + KINDS * (stop - first)))
        flags[:, :, count + COPY::KINDS] = np.maximum(row_flags[:, None], col_flags[None])
        return (row_lengths[:, None] * col_lengths[None] * flags * scale).reshape(-1, len(scale))

    def _forward(self, first: int, tiled: bool, autograd: bool) -> Forward:
        end = first
        while end < len(self.graph) and (not tiled or self.graph.nodes[self.graph.order[end]].tileable):
            end += 1
        return Forward(self.facts, first, end, tiled, autograd)

    def _program(self, first: int, stop: int, tiled: bool) -> Program:
        return program(self.facts, self.forward, first, stop, tiled)


def _tile_calls(facts: Facts, first: int, stop: int, rows: AxisArrays, cols: AxisArrays, sizes):
    """``Estimator.kernel_bytes``'s calls of a tiled segment ``[first, stop)``: per convolution,
    its passes and its call shapes, each a row and a column shape (``AxisArrays.call_shapes``)
    and a batch size."""
    for p in facts.convolutions:
        if first <= p < stop:
            yield p, facts.tile_passes[p], itertools.product(rows.call_shapes(p), cols.call_shapes(p), sizes)


def _class_ids(program: Program, arrays: AxisArrays) -> np.ndarray:
    """Per tile of one axis, in order, a number shared by the tiles whose lengths are all equal and
    whose reads of the segment's nodes touch the same ends of what they read (what their
    shape class is, as far as the cost model sees it: a first and a last tile may have equal
    lengths, padded at opposite ends)."""
    key = ("classes", program.first, program.stop)
    if key in arrays.derived:
        return arrays.derived[key]
    starts, stops = arrays.read_bounds(program.first, program.stop)
    ends = []
    if starts.shape[1]:
        ends = [starts[arrays.tiles] == 0, stops[arrays.tiles] == stops.max(axis=0)]
    table = np.ascontiguousarray(np.concatenate([_table(program, arrays), *ends], axis=1))
    seen: dict[bytes, int] = {}
    found = arrays.derived[key] = np.array([seen.setdefault(row.tobytes(), len(seen)) for row in table],
                                           dtype=np.int64)
    return found


def _calls(row_ids: np.ndarray, col_ids: np.ndarray, batch: int,
           constant: np.ndarray | None = None) -> tuple[int, int, tuple[int, ...], int]:
    """The calls of one pass over a grid whose tiles run row-major (``tilec.runtime.sweeps``): the
    ``constant`` ones (``[row tile, column tile]``) once per class (``row_ids`` x ``col_ids``),
    each by itself, and the others, consecutive tiles of one class ``batch`` at a time. Returns how
    many calls, the most tiles of one, the distinct numbers of tiles they take, and how many tiles
    are computed once for another (reused)."""
    pairs = (row_ids[:, None] * (int(col_ids.max()) + 1) + col_ids[None, :]).reshape(-1)
    flat = np.zeros(len(pairs), dtype=bool) if constant is None else constant.reshape(-1)
    alone = len(np.unique(pairs[flat]))
    rest = pairs[~flat]
    edges = np.flatnonzero(np.diff(rest)) + 1
    runs = np.diff(np.concatenate([[0], edges, [len(rest)]])) if len(rest) else np.zeros(0, dtype=np.int64)
    calls = alone + int((-(-runs // batch)).sum())
    found = np.unique(np.concatenate([np.minimum(runs, batch), runs[runs > batch] % batch, [1] if alone else []]))
    sizes = tuple(int(size) for size in found if size > 0)
    return calls, max(sizes, default=1), sizes or (1,), int(flat.sum()) - alone


#: Tiles from one that runs (it reads tissue), in rows or columns, within which the owned output
#: gradients of aligned tiles (``Estimator.tiled``) are counted as differing: the tissue's reach
#: through the later segments' halos, as measured on ResNet-18 at 8192² with 512-pixel tiles.
REACH = 2


def _classes_apart(constant: np.ndarray) -> int:
    """Input gradients a reused tile of an aligned segment back-propagates apart, of the tiles
    ``constant`` (``[row tile, column tile]``): one per row holding such tiles (a rolled input
    gradient's band; its repeating class), and one per tile within ``REACH`` of a tile that runs."""
    rows, cols = constant.shape
    grown = np.pad(~constant, REACH)
    near = np.zeros_like(constant)
    for dr in range(2 * REACH + 1):
        for dc in range(2 * REACH + 1):
            near |= grown[dr:dr + rows, dc:dc + cols]
    return int(constant.any(axis=1).sum() + (constant & near).sum())


def _table(program: Program, arrays: AxisArrays) -> np.ndarray:
    """Per tile of one axis, its lengths: of each slice's hull, and per node its output, padded
    read, padded copy and whether it makes one."""
    columns = slice(program.first - arrays.offset, program.stop - arrays.offset)
    hulls = [_hull(arrays, name, readers) for name, readers in program.slices]
    return np.concatenate([np.array(hulls, dtype=np.int64).reshape(-1, arrays.parts).T, arrays.out[:, columns],
                           arrays.padded[:, columns], arrays.copied[:, columns], arrays.copies[:, columns]], axis=1)


def _classes(program: Program, arrays: AxisArrays) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct tile of one axis: each quantity's length, and whether a padded copy exists
    (kept in ``arrays.derived``: a segment's grid is costed once for each batch, each the same)."""
    key = ("lengths", program.first, program.stop)
    if key not in arrays.derived:
        arrays.derived[key] = _distinct_lengths(program, arrays)
    return arrays.derived[key]


def _distinct_lengths(program: Program, arrays: AxisArrays) -> tuple[np.ndarray, np.ndarray]:
    table = _table(program, arrays)
    table = table[list({row.tobytes(): index for index, row in enumerate(table)}.values())]
    count, width = len(program.slices), program.stop - program.first
    out, padded, copied, copies = (table[:, count + k * width:count + (k + 1) * width] for k in range(4))
    lengths = np.concatenate([table[:, :count], np.stack([out, padded, copied, out], axis=2)
                              .reshape(len(table), -1)], axis=1)
    return lengths, copies


def _hull(arrays: AxisArrays, name: str, readers: Sequence[str]) -> np.ndarray:
    """Length of the interval of ``name`` the tiles read (the hull of their non-empty reads)."""
    start, stop, read = _hull_bounds(arrays, name, readers)
    return np.where(read, stop - start, 0)


def _hull_bounds(arrays: AxisArrays, name: str, readers: Sequence[str]) -> tuple[np.ndarray, ...]:
    """Per tile, the start and stop of the hull of its non-empty reads of ``name``, and whether it
    reads any."""
    reads = [(start, stop) for reader in readers for source, start, stop in arrays.reads[reader] if source == name]
    if not reads:
        empty = np.zeros(arrays.parts, dtype=np.int64)
        return empty, empty, empty.astype(bool)
    starts, stops = (np.array(bounds)[:, arrays.tiles] for bounds in zip(*reads, strict=True))
    full = stops > starts
    start, stop = np.where(full, starts, starts.max()).min(axis=0), np.where(full, stops, stops.min()).max(axis=0)
    return start, stop, full.any(axis=0)


def _band(rows: AxisArrays, name: str, readers: Sequence[str]) -> int | None:
    """Rows of the band that rolls the gradient of ``name`` (``Estimator.rollable``): the tallest
    read of a row of tiles; ``None`` where the reads' starts fall from one row to the next (the
    band could not move on)."""
    start, stop, read = _hull_bounds(rows, name, readers)
    starts = start[read]
    if not len(starts) or np.any(np.diff(starts) < 0):
        return None
    return int((stop - start)[read].max())


def _axis_period(tiles: Sequence[AxisTile], full: int) -> int | None:
    """``Estimator.period`` on one axis: ``tiles`` along it, ``full`` the input's size there."""
    if len(tiles) == 1:
        return full
    found = None
    for column in (*zip(*(t.owned for t in tiles), strict=True), *zip(*(t.partials for t in tiles), strict=True)):
        if not any(part.length for part in column):
            continue  # a reduction of nothing partitions nothing
        size, length = column[-1].stop, column[0].length
        if any(part != Interval(k * length, min((k + 1) * length, size)) for k, part in enumerate(column)):
            return None
        periods = {length * stride for stride in strides_of(size, full, full)}
        found = periods if found is None else found & periods
    return min(found) if found else None


def _mode_at(spans: Sequence, position: int) -> str | None:
    """The mode of the span of ``spans`` holding node ``position`` (``None``: none does), looked for
    from the last: the tensors crossing a cut are mostly made by the segments just before it."""
    for span in reversed(spans):
        if span.first <= position < span.stop:
            return span.mode
    return None
