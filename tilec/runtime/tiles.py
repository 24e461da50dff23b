"""Tiled segments: ``Tiled`` runs one as an autograd function, tile by tile.

Forward runs every tile under ``no_grad`` and keeps nothing but the segment's inputs; backward
re-runs each tile under autograd and back-propagates its owned part of the output gradient,
accumulating parameter gradients and summing input gradients where the tiles' reads overlap
(``Whole``), or writing them over the input itself where nothing reads it afterwards
(``Rolled``). The ranks of a process group may share the tiles (``share``).
Conventions: slice bounds are half-open ``[start, stop)`` in full-tensor coordinates; tile
``(i, j)`` of an ``R x C`` grid is number ``i * C + j`` (row-major).
"""

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch.autograd.backward imports this (and sympy) the first time it is given gradients, as every
# tile's backward gives them: imported with the module, its ~30 MiB of Python objects are not a
# first step's.
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from tilec.runtime.arena import Arena
from tilec.runtime.device import kernels_for
from tilec.runtime.kernels import copy_in, layout_of, narrow


def share(costs, ranks):
    """Per rank, the sorted indices of the tiles it runs, balanced by their ``costs``: the
    costliest tile first, each to the least loaded rank (the lowest rank on ties)."""
    loads, shares = [0] * ranks, [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        least = min(range(ranks), key=lambda r: (loads[r], r))
        loads[least] += costs[index]
        shares[least].append(index)
    return tuple(tuple(sorted(indices)) for indices in shares)


@dataclass(frozen=True)
class Run:
    """How one step runs its tiled segments: ``plan`` (its name, for progress lines), ``progress``
    (report each tile on standard error), ``group`` (a process group sharing the tiles, or
    ``None``), and ``generic`` (the generic kernels even on the CPU, ``tilec.runtime.device``) with
    the plan's ``gemm_min_channels``."""

    plan: str
    progress: bool
    group: object
    generic: bool
    gemm_min_channels: object

    def kernels(self, device_type):
        return kernels_for(device_type, self.gemm_min_channels, self.generic)

    def report(self, label, done, total):
        if self.progress:
            end = "\n" if done == total else ""
            print(f"\rtilec {self.plan} {label}: tile {done}/{total}", end=end, file=sys.stderr, flush=True)


class TiledSegment:
    """A tiled segment: its tile functions by (row class, column class), per-axis tables, per-axis
    cost weights, the plan's shares per rank (if compiled with --ranks), which sliced inputs' gradients
    its backward rolls (``Rolled``), and the arena capacity its forward and backward passes needed
    so far, by device, dtype and autocast state."""

    def __init__(self, label, functions, rows, cols, sliced, broadcast, outputs, costs, shares, rolled):
        self.label, self.functions, self.rows, self.cols = label, functions, rows, cols
        self.sliced, self.broadcast, self.outputs, self.costs = sliced, broadcast, outputs, costs
        self.rolled = rolled
        self._shares = {len(shares): [set(indices) for indices in shares]} if shares else {}
        self._capacity = {}

    def arena(self, x, autocast, backward, kernels):
        """An arena for one pass (forward or ``backward``) over the tiles of input ``x`` with the
        device's ``kernels``: as large as such passes needed before; the first one learns it with
        fresh tensors."""
        return Arena(x.device, kernels, self._capacity.get(pass_kind(x, autocast, backward), 0), pack=not backward)

    def learn(self, x, autocast, backward, arena):
        key = pass_kind(x, autocast, backward)
        self._capacity[key] = max(self._capacity.get(key, 0), arena.need)

    def tiles(self, group=None):
        """The tiles this process runs: all of them, or its rank's share of ``group``'s."""
        mine = None if group is None else self.share(dist.get_world_size(group), dist.get_rank(group))
        index = 0
        for row_inputs, row_owned, row_class in self.rows:
            for col_inputs, col_owned, col_class in self.cols:
                if mine is None or index in mine:
                    yield self.functions[row_class, col_class], row_inputs, col_inputs, row_owned, col_owned
                index += 1

    def share(self, ranks, rank):
        """Row-major indices of the tiles rank ``rank`` of ``ranks`` runs: the plan's shares, or
        ``share`` gives them by the tiles' costs; the same on every rank."""
        if ranks not in self._shares:
            rows, cols = self.costs
            self._shares[ranks] = [set(indices) for indices in share([r * c for r in rows for c in cols], ranks)]
        return self._shares[ranks][rank]

    def count(self, group=None):
        return len(self.rows) * len(self.cols) if group is None else len(self.share(
            dist.get_world_size(group), dist.get_rank(group)))


def pass_kind(x, autocast, backward):
    """What an arena's capacity depends on: the device, dtype, autocast state and direction."""
    return x.device, x.dtype, autocast, backward


def sum_over(group, tensors):
    """Sum ``tensors`` over ``group`` in place; small ones travel as one buffer per dtype."""
    small = {}
    for tensor in tensors:
        if tensor.numel() >= 1 << 20:
            dist.all_reduce(tensor, group=group)
        else:
            small.setdefault(tensor.dtype, []).append(tensor)
    for same in small.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        for tensor, part in zip(same, flat.split([t.numel() for t in same]), strict=False):
            tensor.copy_(part.view_as(tensor))


def autocast_state(device_type):
    """``(enabled, dtype)`` of autocast for ``device_type`` where this is called."""
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def slices(segment, xs, row_in, col_in):
    """One tile's slices of the segment's sliced inputs."""
    return [narrow(x, spatial, r, c) for x, spatial, r, c in zip(xs, segment.sliced, row_in, col_in, strict=False)]


class GradChannelsLast(torch.autograd.Function):
    """Identity; its backward hands the output gradient on as a channels-last copy (4-D ones).

    A tile's output gradient is a slice of the full (contiguous) one; the tile's ops would
    otherwise backward in that layout, converting their saved channels-last tensors to it (CPU
    max-pooling copies its input and indices). Made here, inside the autograd graph, the copy is
    freed once the last op has used it.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous(memory_format=torch.channels_last) if g.dim() == 4 else g


grad_channels_last = GradChannelsLast.apply


def outputs(segment, parts, zeros):
    """The segment's full outputs, in the dtypes its tiles compute them in (autocast decides).
    Channels-last where only tiled segments read them: tiles then copy their parts in and their
    slices out without transposing (5-15x faster on CPU), and so do the gradients."""
    outs = []
    for part, (shape, _, channels_last) in zip(parts, segment.outputs, strict=False):
        layout = torch.channels_last if channels_last else torch.contiguous_format
        out = torch.empty(shape, dtype=part.dtype, device=part.device, memory_format=layout)
        outs.append(out.zero_() if zeros else out)
    return outs


class Whole:
    """The gradient of a segment input, as large as the input; the tiles add their parts into it."""

    def __init__(self, x, spatial):
        self.grad, self.spatial = torch.zeros_like(x), spatial

    def move(self, start):
        pass

    def add(self, rows, cols, grad):
        narrow(self.grad, self.spatial, rows, cols).add_(grad)

    def result(self):
        return self.grad


class Rolled:
    """The gradient of a segment input ``x`` that nothing reads after this segment's backward (the
    plan's ``rolled``), written over ``x`` itself row of tiles by row of tiles.

    The tiles run row by row, and the rows of ``x`` a row of tiles reads start no earlier than the
    previous row's. ``band`` holds the gradient of the rows from the current row's start on, as many
    as the most any row of tiles reads. When a row of tiles starts at ``start`` (``move``), the rows
    before it are final and no later tile reads ``x`` there: they are written over ``x`` (zeros
    where no tile read), and the band moves down. ``result`` writes the rest and returns ``x``'s
    storage as the gradient. The pass holds one band instead of a gradient the size of ``x``.
    ``x`` is changed in place: autograd refuses a second backward through this segment."""

    def __init__(self, x, spatial, reads):
        self.x, self.spatial, self.axis = x.detach(), spatial, spatial[0]
        self.height = max(stop - start for start, stop in reads)
        shape = list(x.shape)
        shape[self.axis] = self.height
        self.band = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=layout_of(x)).zero_()
        self.start, self.stop = None, 0  # the band's first row; the end of the rows added so far

    def move(self, start):
        """The next tiles read rows from ``start`` on (no earlier than before)."""
        if self.start is None:
            self.x.narrow(self.axis, 0, start).zero_()
            self.start = self.stop = start
            return
        if start <= self.start:
            return
        final = start - self.start
        written = min(final, self.height)
        self.x.narrow(self.axis, self.start, written).copy_(self.band.narrow(self.axis, 0, written))
        self.x.narrow(self.axis, self.start + written, final - written).zero_()
        carry = max(0, self.stop - start)
        if carry:
            pending = self.band.narrow(self.axis, final, carry)
            self.band.narrow(self.axis, 0, carry).copy_(pending.clone() if final < carry else pending)
        self.band.narrow(self.axis, carry, self.height - carry).zero_()
        self.start, self.stop = start, max(self.stop, start)

    def add(self, rows, cols, grad):
        band_rows = (rows[0] - self.start, rows[1] - self.start)
        narrow(self.band, self.spatial, band_rows, cols).add_(grad)
        self.stop = max(self.stop, rows[1])

    def result(self):
        self.move(self.x.shape[self.axis])
        del self.band
        return self.x


def input_gradient(segment, index, x, group):
    """The accumulator of the gradient of sliced input ``index``: rolled where the plan says so and
    this process runs every tile (in order), else whole."""
    spatial = segment.sliced[index]
    if segment.rolled[index] and group is None:
        reads = [row[0][index] for row in segment.rows if row[0][index][1] > row[0][index][0]]
        if reads and all(a[0] <= b[0] for a, b in zip(reads, reads[1:], strict=False)):
            return Rolled(x, spatial, reads)
    return Whole(x, spatial)


class Tiled(torch.autograd.Function):
    """Forward: every tile under no_grad. Backward: every tile again under autograd, with the
    autocast state the forward ran under. Each pass carves its tiles' own tensors from one arena.
    ``run``: how this step runs (``Run``)."""

    @staticmethod
    def forward(ctx, segment, run, *tensors):
        group = run.group
        count = len(segment.sliced)
        xs, rest = tensors[:count], tensors[count:]
        bs, p = rest[:segment.broadcast], rest[segment.broadcast:]
        autocast = (xs[0].device.type, *autocast_state(xs[0].device.type))
        arena = segment.arena(xs[0], autocast, False, run.kernels(xs[0].device.type))
        # Without autocast's cache: it would keep a cast copy of every parameter the tiles read
        # until the step's forward ends; each tile's call casts its own (the plan counts one per call).
        with torch.autocast(autocast[0], dtype=autocast[2], enabled=autocast[1], cache_enabled=False):
            outs = None
            total = segment.count(group)
            for done, (kernel, row_in, col_in, row_own, col_own) in enumerate(segment.tiles(group)):
                arena.reset()
                parts = kernel(copy_in(arena, slices(segment, xs, row_in, col_in)), bs, p, arena)
                if outs is None:
                    outs = outputs(segment, parts, zeros=group is not None)
                for out, (_, spatial, _), part, r, c in zip(outs, segment.outputs, parts, row_own, col_own,
                                                            strict=True):
                    narrow(out, spatial, r, c).copy_(part)
                del parts  # before the next tile allocates
                run.report(f"{segment.label} forward", done + 1, total)
            if outs is None:  # this rank has no tile here: one tile tells the output dtypes
                kernel, row_in, col_in, _, _ = next(segment.tiles())
                arena.reset()
                parts = kernel(copy_in(arena, slices(segment, xs, row_in, col_in)), bs, p, arena)
                outs = outputs(segment, parts, zeros=True)
        segment.learn(xs[0], autocast, False, arena)
        del arena
        if group is not None:
            sum_over(group, outs)  # owned parts are disjoint: the sum puts every rank's tiles in place
        ctx.segment, ctx.run, ctx.autocast = segment, run, autocast
        ctx.save_for_backward(*tensors)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        segment, tensors, run = ctx.segment, ctx.saved_tensors, ctx.run
        group = run.group
        needs = ctx.needs_input_grad[2:]
        count = len(segment.sliced)
        xs = tensors[:count]
        leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors[count:], needs[count:], strict=False)]
        bs, p = leaves[:segment.broadcast], leaves[segment.broadcast:]
        sums = [input_gradient(segment, k, x, group) if need else None
                for k, (x, need) in enumerate(zip(xs, needs[:count], strict=False))]
        arena = segment.arena(xs[0], ctx.autocast, True, run.kernels(xs[0].device.type))
        total = segment.count(group)
        for done, (kernel, row_in, col_in, row_own, col_own) in enumerate(segment.tiles(group)):
            arena.reset()
            for accumulated, (start, stop) in zip(sums, row_in, strict=False):
                if accumulated is not None and stop > start:
                    accumulated.move(start)
            tile_backward(segment, kernel, xs, bs, p, leaves, grads, sums, needs[:count], ctx.autocast,
                           (row_in, col_in, row_own, col_own), arena)
            run.report(f"{segment.label} backward", done + 1, total)
        segment.learn(xs[0], ctx.autocast, True, arena)
        del arena
        gx = [None if accumulated is None else accumulated.result() for accumulated in sums]
        del sums
        gp = [leaf.grad if leaf.requires_grad else None for leaf in leaves]
        if group is not None:  # a rank without tiles here contributes zeros
            gp = [torch.zeros_like(leaf) if leaf.requires_grad and g is None else g
                  for leaf, g in zip(leaves, gp, strict=True)]
            sum_over(group, [g for g in (*gx, *gp) if g is not None])
        return (None, None, *gx, *gp)


def tile_backward(segment, kernel, xs, bs, p, leaves, grads, sums, needs, autocast, bounds, arena):
    """One tile's backward: its forward again under autograd (with the forward's ``autocast``
    state), back-propagated from its owned part of each output gradient; its input gradients are
    added into ``sums`` (``Whole`` or ``Rolled``), its parameter gradients accumulate into
    ``leaves``. Everything else it made is freed on return (its arena tensors are dead), before
    the next tile allocates."""
    row_in, col_in, row_own, col_own = bounds
    device_type, enabled, dtype = autocast
    tile = [narrow(x, spatial, r, c).detach().requires_grad_(need)
            for x, spatial, r, c, need in zip(xs, segment.sliced, row_in, col_in, needs, strict=False)]
    with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
        parts = [grad_channels_last(part) if part.requires_grad else part
                 for part in kernel(copy_in(arena, tile), bs, p, arena)]
    pairs = [(part, narrow(g, spatial, r, c))
             for part, g, (_, spatial, _), r, c in zip(parts, grads, segment.outputs, row_own, col_own, strict=False)
             if part.requires_grad]
    wanted = [t for t in (*tile, *leaves) if t.requires_grad]
    if pairs and wanted:
        torch.autograd.backward([a for a, _ in pairs], [b for _, b in pairs], inputs=wanted)
    for accumulated, t, r, c in zip(sums, tile, row_in, col_in, strict=False):
        if accumulated is not None and t.grad is not None:
            accumulated.add(r, c, t.grad)
