"""Tensors compared by their bits: each element read as an integer of its width, so that 0.0 and
-0.0 differ and two NaNs of one payload are equal (``tilec.runtime.reuse`` finds identical tiles
with them). ``spatial`` names a slice's image dims; ``SAMPLE`` is how sparsely a first look reads
them."""

import torch

BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Every how many rows (along a slice's first image dim) a first look reads (``sampled``).
SAMPLE = 8


def as_bits(x):
    """``x`` read as integers of its element width (``None`` for widths without one)."""
    width = BITS.get(x.element_size())
    if width is None or x.is_complex():
        return None
    return x if x.dtype == width else x.view(width)


def sampled(x, spatial):
    """Every ``SAMPLE``-th row of slice ``x`` along the first of its image dims ``spatial`` (a view)."""
    return x[tuple(slice(None, None, SAMPLE) if d == spatial[0] else slice(None) for d in range(x.dim()))]


def constants(x, spatial):
    """The bits of the constant per sample and channel of slice ``x`` over its image dims
    ``spatial``, as a tuple of integers; ``()`` for an empty slice; ``None`` where not constant.
    Meant for host tensors: it reads its answers off ``x``'s device."""
    if x.numel() == 0:
        return ()
    bits = as_bits(x)
    if bits is None:
        return None
    first = bits[tuple(slice(0, 1) if d in spatial else slice(None) for d in range(bits.dim()))]
    if not (sampled(bits, spatial) == first).all() or not (bits == first).all():
        return None
    return tuple(first.reshape(-1).tolist())


def fingerprints(slices):
    """Per ``(x, spatial)`` of ``slices``, the fingerprint of slice ``x``: the sums of the bits of
    its ``sampled`` rows per sample and channel over its image dims ``spatial``, as a tuple of
    integers (``None`` where ``x`` is, or for widths without integers); read off the device at once."""
    sums = []
    for x, spatial in slices:
        bits = None if x is None else as_bits(x)
        sums.append(None if bits is None else sampled(bits, spatial).sum(dim=tuple(spatial), dtype=torch.int64)
                    .reshape(-1))
    present = [s for s in sums if s is not None]
    flat = torch.cat(present).tolist() if present else []
    found, at = [], 0
    for s in sums:
        found.append(None if s is None else tuple(flat[at:at + s.numel()]))
        at += 0 if s is None else s.numel()
    return found


def differing(pairs):
    """Per pair of same-shaped tensors (of one dtype) in ``pairs``, whether any of their bits
    differ, read off the device at once (one wait for it, however many pairs)."""
    if not pairs:
        return []
    flags = []
    for a, b in pairs:
        bits_a, bits_b = as_bits(a), as_bits(b)
        flags.append((a != b).any() if bits_a is None else (bits_a != bits_b).any())
    return torch.stack(flags).tolist()
