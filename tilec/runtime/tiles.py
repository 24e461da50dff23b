"""Tiled segments: what a generated module knows of one (``TiledSegment``), and how its tiles, input
gradients and outputs are laid out; ``tilec.runtime.sweeps.Tiled`` runs it.

Input gradients are summed where the tiles' reads overlap (``Whole``), or written over the input
itself where nothing reads it afterwards (``Rolled``). The ranks of a process group may share the
tiles (``share``).
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
from tilec.runtime.compiled import CompiledTiles
from tilec.runtime.device import kernels_for
from tilec.runtime.kernels import layout_of, narrow
from tilec.runtime.reduce import widened
from tilec.runtime.sources import Source, region


def share(costs, ranks):
    """Per rank, the sorted indices of the tiles it runs, balanced by their ``costs``: the
    costliest tile first, each to the least loaded rank (on ties the one with the fewest tiles, then
    the lowest rank: tiles costing nothing, as a segment of reductions and small ops, go round)."""
    loads, shares = [0] * ranks, [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        least = min(range(ranks), key=lambda r: (loads[r], len(shares[r]), r))
        loads[least] += costs[index]
        shares[least].append(index)
    return tuple(tuple(sorted(indices)) for indices in shares)


@dataclass(frozen=True)
class Run:
    """How one step runs its tiled segments: ``plan`` (its name, for progress lines), ``progress``
    (report each tile on standard error), ``group`` (a process group sharing the tiles, or
    ``None``), ``kernel_choice`` (which tile kernels: one of ``tilec.runtime.device.KERNEL_CHOICES``)
    with the plan's ``gemm_min_channels``, ``train``: the modules' modes in this step (training
    flags; BatchNorm's ``(batch statistics?, momentum)``), the ``device`` and floating
    ``dtype`` the model computes in, and ``reuse``: where the passes count the tiles they ran and
    reused (``tilec.runtime.reuse.Reuse``), or ``None``."""

    plan: str
    progress: bool
    group: object
    kernel_choice: str
    gemm_min_channels: object
    train: dict = None
    device: object = None
    dtype: object = None
    reuse: object = None

    def like(self):
        """An empty tensor of the model's floating dtype on its device (what combines cast to)."""
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def kernels(self, device_type):
        return kernels_for(device_type, self.gemm_min_channels, self.kernel_choice)

    def report(self, label, done, total, reused=0):
        """Progress of pass ``label``: ``done`` tiles of ``total``, of which ``reused`` were
        reused (``tilec.runtime.reuse``); at the last one, the pass's counts are tallied."""
        if done == total and self.reuse is not None:
            self.reuse.add(label, total - reused, reused)
        if self.progress:
            end = "\n" if done == total else ""
            note = f" ({reused} reused)" if reused else ""
            print(f"\rtilec {self.plan} {label}: tile {done}/{total}{note}", end=end, file=sys.stderr, flush=True)


class Progress:
    """One pass's tiles counted as they finish, and reported (``Run.report``): ``ran`` ones and
    ``reused`` ones (``tilec.runtime.reuse``), of ``total``."""

    def __init__(self, run, label, total):
        self.run, self.label, self.total = run, label, total
        self.done = self.reuses = 0

    def ran(self, count):
        for _ in range(count):
            self.done += 1
            self.run.report(self.label, self.done, self.total, self.reuses)

    def reused(self):
        self.reuses += 1
        self.ran(1)


@dataclass(frozen=True)
class LevelSpec:
    """One level of a tiled segment's reductions (the plan's ``Level``): its ``index``, ``direct``
    and ``swept``; ``first`` and ``count``: where its reductions' partials are in a tile's and how
    many; ``switches``: the BatchNorm modules whose training mode makes it compute batch statistics
    (empty: always); ``results``: the names of the leaves it makes; ``combine``: its combine
    function ``(parts, r, like, bs, p, train, update)``; ``prefix``: per (row class, column class),
    the tile function computing its partials (a level neither direct nor 0); ``merges``: per
    reduction, the kind its partials merge by (``tilec.runtime.reduce.MERGES``)."""

    index: int
    direct: bool
    swept: bool
    first: int
    count: int
    switches: tuple
    results: tuple
    combine: object
    prefix: dict
    merges: tuple

    def active(self, train):
        """Whether the level computes batch statistics in this step (``train``: the modes)."""
        return not self.switches or any(train[path][0] for path in self.switches)


class TiledSegment:
    """A tiled segment: its tile functions by (row class, column class), per-axis tables (per axis
    tile: the reads of each sliced input, the owned part of each image output, the shape class, the
    part of each reduction's input its partial covers), the sliced inputs' image dims, the number
    of broadcast inputs, its outputs (``("image", shape, spatial dims, channels-last)`` or
    ``("leaf", name)``: a result of its reductions), per-axis cost weights, the plan's shares per
    rank (if compiled with --ranks), which sliced inputs' gradients its backward rolls
    (``Rolled``), its reductions' levels (``LevelSpec``), and a direct level's function
    ``direct(owned, bs, p, r, o)`` computing its partials from ``owned``, per reduction the owned
    slices of its reduced inputs (``reduced``: per reduction of the direct level, its index among the
    segment's and the indices of those inputs among the sliced ones), ``o`` their origins; whether
    identical tiles may be computed once (``reuse``: no op reads absolute positions,
    ``tilec.runtime.reuse``); how many consecutive tiles of one shape class run as one call
    (``batch``, ``tilec.runtime.batches``); and the arena capacity its passes needed so far, by
    device, dtype and autocast state."""

    def __init__(self, label, functions, rows, cols, sliced, broadcast, outputs, costs, shares, rolled, levels=(),
                 direct=None, reduced=(), reuse=True, batch=1):
        self.label, self.functions, self.rows, self.cols = label, functions, rows, cols
        self.reuse, self.batch = reuse, batch
        self.sliced, self.broadcast, self.outputs, self.costs = sliced, broadcast, outputs, costs
        self.rolled, self.levels, self.direct, self.reduced = rolled, levels, direct, reduced
        self._shares = {len(shares): [set(indices) for indices in shares]} if shares else {}
        self._capacity = {}
        self._compiled = CompiledTiles(label, positional=not reuse, variants=(len(levels) + 4) * batch)

    def function(self, kernels, key, level=None):
        """The tile function of shape class ``key`` (``(row class, column class)``): the segment's, or
        ``level``'s computing its partials; compiled where the device's ``kernels`` say so."""
        fn = (self.functions if level is None else level.prefix)[key]
        return self._compiled.function(fn, kernels) if kernels.compiled else fn

    def arena(self, run, autocast, kernels):
        """An arena for one forward pass of ``run`` (its device and dtype) with the device's
        ``kernels``: as large as such passes needed before; the first one learns it with fresh
        tensors."""
        return Arena(run.device, kernels, self._capacity.get(pass_kind(run, autocast), 0), pack=True)

    def learn(self, run, autocast, arena):
        key = pass_kind(run, autocast)
        self._capacity[key] = max(self._capacity.get(key, 0), arena.need)

    def tiles(self, group=None, xs=(), owned=False):
        """The tiles this process runs, as ``(index, row entry, column entry)``: all of them, or
        its rank's share of ``group``'s. Every ``Source`` among ``xs`` (the sliced inputs) reads
        each tile's slices ahead, while the tile before it computes (its owned slices of the
        reduced inputs, if ``owned``)."""
        mine = None if group is None else self.share(dist.get_world_size(group), dist.get_rank(group))
        chosen = [(index, row, col) for index, (row, col) in enumerate((row, col) for row in self.rows
                                                                        for col in self.cols)
                  if mine is None or index in mine]
        streamed = any(isinstance(x, Source) for x in xs)
        for position, tile in enumerate(chosen):
            if streamed and position == 0:
                self.read_ahead(xs, tile, owned)
            if streamed and position + 1 < len(chosen):
                self.read_ahead(xs, chosen[position + 1], owned)
            yield tile

    def read_ahead(self, xs, tile, owned):
        """Start reading one tile's slices of the ``Source`` s among ``xs``."""
        _, row, col = tile
        if owned:
            wanted = [(i, row[3][k], col[3][k]) for k, inputs in self.reduced for i in inputs]
        else:
            wanted = [(i, row[0][i], col[0][i]) for i in range(len(xs))]
        for i, rows, cols in wanted:
            if isinstance(xs[i], Source):
                xs[i].ahead(self.sliced[i], rows, cols)

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

    def owned(self, xs, row, col, needs=None):
        """Per reduction of the direct level, the owned slices of its reduced inputs in one tile.
        With ``needs`` (per input, whether it wants a gradient), leaves of detached ``xs`` widened to
        float32 where they are half or bfloat16: their gradients, the partials' shares, then round
        once, as they are added to the input gradient the tiles hold in the input's dtype."""
        found = []
        for k, inputs in self.reduced:
            rows, cols = row[3][k], col[3][k]
            found.append(tuple(region(xs[i], self.sliced[i], rows, cols) if needs is None
                               else widened(region(xs[i], self.sliced[i], rows, cols)).requires_grad_(needs[i])
                               for i in inputs))
        return found

    @property
    def merges(self):
        """Per reduction of the segment, in the order of a tile's partials, the kind it merges by."""
        return tuple(kind for level in self.levels for kind in level.merges)

    @property
    def images(self):
        """The image outputs' specs ``(shape, spatial dims, channels-last)``, in order."""
        return [spec[1:] for spec in self.outputs if spec[0] == "image"]


def pass_kind(run, autocast):
    """What an arena's capacity depends on: the device, dtype and autocast state."""
    return run.device, run.dtype, autocast


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


def slices(segment, xs, row, col):
    """One tile's slices of the segment's sliced inputs (``row``, ``col``: its table entries)."""
    return [region(x, spatial, r, c) for x, spatial, r, c in zip(xs, segment.sliced, row[0], col[0], strict=True)]


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
    """The segment's full image outputs, in the dtypes its tiles compute them in (autocast decides).
    Channels-last where only tiled segments read them: tiles then copy their parts in and their
    slices out without transposing (5-15x faster on CPU), and so do the gradients."""
    outs = []
    for part, (shape, _, channels_last) in zip(parts, segment.images, strict=True):
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
