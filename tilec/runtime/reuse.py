"""Identical tiles of a tiled segment, computed once (``tilec.runtime.sweeps`` runs them).

A tile computes a function of its shape class (its row and column classes: its border padding and
sizes), of the values it reads of the segment's sliced inputs over its whole read region (halo
included), of the leaves it reads (the same for every tile of one sweep) and, backward, of the
gradients reaching its owned outputs and its partials. Two tiles of one class whose every slice is
one constant per sample and channel, the same constants, compute the same tensors at every op, unless
an op reads absolute positions: such a segment has ``reuse`` off (the op rules' ``positional``).

This is found at run time from the slices the tiles read anyway, comparing bits: a slice is constant
where, per sample and channel, every element read as an integer of its width equals the first (so
0.0 and -0.0 are never one constant, and two NaNs of one payload are); every ``SAMPLE``-th row is
compared first, which rejects a textured slice for a fraction of the cost. A slice of a tensor in
memory that is not constant (a stored activation over background, whose tiles copied one
representative's owned values, rounded by position within it) is fingerprinted by the sums of the
bits of those rows per sample and channel, and a tile whose fingerprints match an earlier tile's is
that tile's member only where its slices hold the same bits as that tile's, read again
(``Keys.find``); a file is never read twice, so a slice of a ``Source`` counts only where it is
constant. A tile's *key* is its classes, the sizes of its reads, owned parts and partials, and its
slices' constants or fingerprints; ``None`` where it has no equal. In the order this process runs
the tiles, the first tile of a key is its *representative*, the later ones its *members*:

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

from tilec.runtime.sources import Source, region

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(x):
    """``x`` read as integers of its element width (``None`` for widths without one)."""
    width = BITS.get(x.element_size())
    if width is None or x.is_complex():
        return None
    return x if x.dtype == width else x.view(width)


#: Every how many rows (along a slice's first image dim) a first look reads (``sampled``).
SAMPLE = 8


def sampled(x, spatial):
    """Every ``SAMPLE``-th row of slice ``x`` along the first of its image dims ``spatial`` (a view)."""
    return x[tuple(slice(None, None, SAMPLE) if d == spatial[0] else slice(None) for d in range(x.dim()))]


def constants(x, spatial):
    """The bits of the constant per sample and channel of slice ``x`` over its image dims
    ``spatial``, as a tuple of integers; ``()`` for an empty slice; ``None`` where not constant."""
    if x.numel() == 0:
        return ()
    bits = as_bits(x)
    if bits is None:
        return None
    first = bits[tuple(slice(0, 1) if d in spatial else slice(None) for d in range(bits.dim()))]
    if not (sampled(bits, spatial) == first).all() or not (bits == first).all():
        return None
    return tuple(first.reshape(-1).tolist())


def fingerprint(x, spatial):
    """The sums of the bits of ``sampled`` rows of slice ``x`` per sample and channel over its image
    dims ``spatial``, as a tuple of integers (``None`` for widths without integers)."""
    bits = as_bits(x)
    if bits is None:
        return None
    return tuple(sampled(bits, spatial).sum(dim=tuple(spatial), dtype=torch.int64).reshape(-1).tolist())


def slice_key(x, spatial, source):
    """What one slice contributes to its tile's key: ``("c", constants)`` where it is constant, else
    ``("f", fingerprint)`` of a slice of a tensor (not of a ``source``), else ``None``."""
    found = constants(x, spatial)
    if found is not None:
        return "c", found
    if source:
        return None
    found = fingerprint(x, spatial)
    return None if found is None else ("f", found)


def tile_key(segment, xs, tile, row, col):
    """The key of one tile (module docstring) from its slices ``tile`` of the segment's sliced inputs
    ``xs``; ``None`` where it has no equal (or the segment's tiles are never reused)."""
    if not segment.reuse:
        return None
    found = [slice_key(t, spatial, isinstance(x, Source)) for x, t, spatial in zip(xs, tile, segment.sliced,
                                                                                   strict=True)]
    if any(c is None for c in found):
        return None
    sizes = tuple(tuple(b - a for a, b in parts) for parts in (*row[:2], row[3], *col[:2], col[3]))
    return row[2], col[2], sizes, tuple(found)


class Keys(dict):
    """Per tile index, its key in this step (``None``: it has no equal); ``first``: per key, its
    representative's row and column entries."""

    def __init__(self):
        super().__init__()
        self.first = {}

    def find(self, segment, xs, tile, index, row, col):
        """The key of tile ``index`` from its slices ``tile``, recorded: a tile whose fingerprinted
        slices do not hold the bits of its key's representative's has none."""
        key = tile_key(segment, xs, tile, row, col)
        if key is not None:
            first = self.first.setdefault(key, (row, col))
            if first != (row, col) and not all(
                    kind == "c" or same_bits(t, region(x, spatial, first[0][0][i], first[1][0][i]))
                    for i, (x, t, spatial, (kind, _)) in enumerate(zip(xs, tile, segment.sliced, key[3],
                                                                       strict=True))):
                key = None
        self[index] = key
        return key


def same_bits(a, b):
    """Whether tensors ``a`` and ``b`` (of one shape and dtype) hold the same bits."""
    bits_a, bits_b = as_bits(a), as_bits(b)
    return torch.equal(a, b) if bits_a is None else torch.equal(bits_a, bits_b)


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
