"""Identical tiles of a tiled segment, computed once (``tilec.runtime.sweeps`` runs them).

A tile computes a function of its shape class (its row and column classes: its border padding and
sizes), of the values it reads of the segment's sliced inputs over its whole read region (halo
included), of the leaves it reads (the same for every tile of one sweep) and, backward, of the
gradients reaching its owned outputs and its partials. Two tiles of one class whose every slice is
one constant per sample and channel, the same constants, compute the same tensors at every op, unless
an op reads absolute positions: such a segment has ``reuse`` off (the op rules' ``positional``).

This is found at run time from the slices the tiles read, comparing bits
(``tilec.runtime.bits``). Once per step, at a segment's first pass, the slices of its sliced
inputs in memory are looked at for all of this process's tiles together, so that a GPU is waited
for once, not per tile (``Keys.prepare``): a first look takes, per sample and channel, the
lowest, highest and summed bits of every ``SAMPLE``-th row of each slice; where the lowest and
highest agree, a second look over all rows tells whether the slice is one constant, and a slice
that is not is fingerprinted by the first look's sums. A tile whose fingerprints match an earlier
tile's is that tile's equal only where its slices hold the same bits (a third look, compared
pairwise): a stored activation over background, whose tiles copied one representative's owned
values, repeats so without being one constant. A slice of a ``Source`` (a file, read once per
pass) counts only where it is constant, which its reader finds on the host as it reads
(``Source.region``). A tile's *key* is its classes, the sizes of its reads, owned parts and
partials, and its slices' constants or fingerprints; ``None`` where it has no equal (in a segment
reading only tensors, also where no other tile has its key). In the order this process runs the
tiles, the first tile of a key is its *representative*, the later ones its *members*:

* forward: a member merges the representative's partials in its own place in the order, which gives
  the merged partials bit for bit as its own would (an ``argmax`` partial keeps the representative's
  index: the first of the key's maxima in row-major order), and copies the representative's owned
  outputs into its own;
* backward: a member's recompute is the representative's function of the leaves and parameters, so
  by linearity (backprop is linear) their backwards' sum is one backward of the representative with
  the sum of their owned output gradients and ``k`` times its shares of the merged partials'
  gradients (``k``: it and its members; no ``argmax`` share may be wanted), exact up to rounding.
  This serves every sweep that wants no input gradient. Where an input needs one, each tile's is
  its own gradient's: where all members' owned output gradients have the representative's bits, the
  representative's input gradient divided by ``k`` goes into each one's own slice (exact up to
  rounding too); otherwise, for ``APART`` tiles or more, the representative back-propagates the sum
  into everything but the inputs, and one tile per class of equal owned output gradients its own
  into the slices of every tile of the class through one more recompute
  (``tilec.runtime.sweeps.Sweep.linear``, ``Sweep.band``, ``Sweep.alike``); fewer run on their own.
  An input whose gradient is rolled (its accumulators hold a band of rows) gets the input gradients
  of a key's tiles row by row, one recompute per row, as the row's first tile comes.
"""

import torch

from tilec.runtime.bits import as_bits, differing, sampled
from tilec.runtime.kernels import narrow
from tilec.runtime.sources import Source


def sizes_of(row, col):
    """The sizes of a tile's reads, owned parts and partials (``row``, ``col``: its table entries)."""
    return tuple(tuple(b - a for a, b in parts) for parts in (*row[:2], row[3], *col[:2], col[3]))


def first_looks(bits, spatial):
    """Per sample and channel of slice ``bits`` (as integers), the lowest, highest and summed bits
    of its ``sampled`` rows (on its device: nothing is read yet)."""
    rows, dims = sampled(bits, spatial), tuple(spatial)
    return rows.amin(dims), rows.amax(dims), rows.sum(dims, dtype=torch.int64)


def slice_keys(slices, spatial):
    """What each slice of ``slices`` (as integers, one input's, the same dims) contributes to its
    tile's key: ``("c", constants)`` where it is one constant per sample and channel, else ``("f",
    fingerprint)``; two reads off the device at most (``Keys.prepare``)."""
    found = [None if x.numel() else ("c", ()) for x in slices]
    full, candidates = [k for k, x in enumerate(slices) if x.numel()], []
    looks = []
    if full:
        columns = zip(*(first_looks(slices[k], spatial) for k in full), strict=True)
        looks = torch.cat([torch.stack(column).reshape(len(full), -1).long() for column in columns], dim=1).tolist()
    for k, look in zip(full, looks, strict=True):
        n = len(look) // 3
        low, high, sums = look[:n], look[n:2 * n], look[2 * n:]
        found[k] = ("f", tuple(sums))
        if low == high:
            candidates.append((k, tuple(low)))
    dims = tuple(spatial)
    if candidates:
        whole = torch.stack([torch.stack([slices[k].amin(dims), slices[k].amax(dims)]).reshape(2, -1).long()
                             for k, _ in candidates]).tolist()
        for (k, low), (lowest, highest) in zip(candidates, whole, strict=True):
            if lowest == highest:
                found[k] = ("c", low)
    return found


class Keys(dict):
    """Per tile index, its key in this step (``None``: it has no equal); ``ahead``: per tile index,
    the part of its key its slices of tensors in memory make (``None``: it has no equal)."""

    def __init__(self):
        super().__init__()
        self.ahead = None

    def prepare(self, segment, xs, group):
        """Find the keys of the tiles this process runs (its rank's of ``group``, or all) from their
        slices of the tensors among ``xs`` (module docstring), once per step; where no input is a
        ``Source``, the keys themselves, without those no other tile has."""
        if self.ahead is not None:
            return
        tiles = list(segment.tiles(group))
        tensors = [i for i, x in enumerate(xs) if not isinstance(x, Source)]
        bits = {i: as_bits(xs[i]) for i in tensors}
        if not segment.reuse or None in bits.values():
            self.ahead = dict.fromkeys((index for index, _, _ in tiles), None)
            self.update(self.ahead)
            return
        cut = {(index, i): narrow(bits[i], segment.sliced[i], row[0][i], col[0][i])
               for index, row, col in tiles for i in tensors}
        found = {i: slice_keys([cut[index, i] for index, _, _ in tiles], segment.sliced[i]) for i in tensors}
        self.ahead = {index: (row[2], col[2], sizes_of(row, col), tuple(found[i][n] for i in tensors))
                      for n, (index, row, col) in enumerate(tiles)}
        firsts, pairs = {}, []
        for index, part in self.ahead.items():
            first = firsts.setdefault(part, index)
            if first != index:
                pairs += [(index, cut[index, i], cut[first, i]) for i, (kind, _) in zip(tensors, part[3], strict=True)
                          if kind == "f"]
        for (index, _, _), differs in zip(pairs, differing([(a, b) for _, a, b in pairs]), strict=True):
            if differs:
                self.ahead[index] = None
        if len(tensors) == len(xs):
            counts = {}
            for key in self.ahead.values():
                counts[key] = counts.get(key, 0) + 1
            self.update((index, key if counts[key] > 1 else None) for index, key in self.ahead.items())

    def find(self, segment, xs, index, row, col):
        """The key of tile ``index``, its slices read (``Keys.prepare`` first): its part of tensors
        with the constants its reader found in its slices of each ``Source`` among ``xs``."""
        if index not in self:
            part = self.ahead.get(index)
            found = None if part is None else list(part[3])
            for i, x in enumerate(xs):
                if found is not None and isinstance(x, Source):
                    constant = x.constants(segment.sliced[i], row[0][i], col[0][i])
                    found.insert(i, None if constant is None else ("c", constant))
            self[index] = None if found is None or None in found else (*part[:3], tuple(found))
        return self[index]


class Reuse:
    """How many tiles the last step ran and how many it reused, per pass (``passes``: label ->
    ``[ran, reused]``) and in all (``ran``, ``reused``)."""

    def __init__(self):
        self.passes = {}

    def add(self, label, ran, reused):
        counts = self.passes.setdefault(label, [0, 0])
        counts[0] += ran
        counts[1] += reused

    @property
    def ran(self):
        return sum(ran for ran, _ in self.passes.values())

    @property
    def reused(self):
        return sum(reused for _, reused in self.passes.values())

    def __repr__(self):
        return f"Reuse(ran={self.ran}, reused={self.reused})"
