"""Half-open intervals and the one-axis halo rules.

Conventions used throughout tilec:

* A region is a product of two 1-D intervals, rows and columns; every rule is 1-D.
* An ``Interval(start, stop)`` is half-open, ``[start, stop)``, in the coordinates of the
  full (untiled) tensor at that point of the network.
* A ``Window`` describes one axis of a sliding-window layer: output index ``o`` reads input
  indices ``o * stride - pad_before + j * dilation`` for ``j`` in ``[0, kernel)``.
  Pointwise layers are the window ``kernel=1, stride=1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Interval(NamedTuple):
    """Half-open integer interval ``[start, stop)``."""

    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def hull(self, other: Interval) -> Interval:
        """Smallest interval containing both (the merge rule for fan-out)."""
        return Interval(min(self.start, other.start), max(self.stop, other.stop))

    def clip(self, size: int) -> tuple[Interval, int, int]:
        """Clip to ``[0, size)``; return the clipped interval and the amounts cut before and after.

        An interval lying wholly outside ``[0, size)`` clips to an empty one at the nearer edge;
        the amounts cut then add up to its whole length.
        """
        start, stop = min(max(self.start, 0), size), max(min(self.stop, size), 0)
        if stop < start:
            stop = start
        before = max(0, min(self.stop, 0) - self.start)
        after = max(0, self.stop - max(self.start, size))
        return Interval(start, stop), before, after

    def shift(self, offset: int) -> Interval:
        return Interval(self.start + offset, self.stop + offset)


@dataclass(frozen=True)
class Window:
    """One axis of a window layer. ``pad_before``/``pad_after`` are the layer's own padding."""

    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    pad_before: int = 0
    pad_after: int = 0
    ceil_mode: bool = False

    @property
    def span(self) -> int:
        """Input extent one output reads: ``(kernel - 1) * dilation + 1``."""
        return (self.kernel - 1) * self.dilation + 1

    def output_size(self, size: int) -> int:
        """Output length for an input of ``size``; PyTorch's conv / pooling shape rule."""
        padded = size + self.pad_before + self.pad_after - self.span
        if not self.ceil_mode:
            return padded // self.stride + 1 if padded >= 0 else 0
        # ceil_mode keeps a last window that runs past the padded input, even when the window
        # is longer than the padded input itself (PyTorch: a 2x2 pool of a 1x1 image is 1x1).
        out = -(-padded // self.stride) + 1
        if out >= 1 and (out - 1) * self.stride >= size + self.pad_before:
            out -= 1
        return max(out, 0)

    def input_interval(self, out: Interval) -> Interval:
        """Input indices read by outputs ``out``, unclipped (may run into the padding)."""
        start = out.start * self.stride - self.pad_before
        stop = (out.stop - 1) * self.stride - self.pad_before + self.span
        return Interval(start, stop)

    def read(self, out: Interval, size: int) -> tuple[Interval, int, int]:
        """What a tile computing outputs ``out`` reads of an input of ``size``: the clipped input
        interval and the border padding ``(before, after)`` it applies in place of the clipped part.

        An empty ``out`` (a consumer reads only its own border padding here) reads nothing:
        an empty interval at the clipped start, no padding.
        """
        read, before, after = self.input_interval(out).clip(size)
        if out.length == 0:
            return Interval(read.start, read.start), 0, 0
        return read, before, after

    def avg_divisors(self, out: Interval, size: int, count_include_pad: bool) -> tuple[int, ...]:
        """Per-output element counts PyTorch's avg-pool divides by on this axis."""
        counts = []
        for o in range(out.start, out.stop):
            start = o * self.stride - self.pad_before
            stop = min(start + self.kernel, size + self.pad_after)
            if count_include_pad:
                counts.append(stop - start)
            else:
                counts.append(min(stop, size) - max(start, 0))
        return tuple(counts)


class Period(NamedTuple):
    """An axis tiled with one period over the whole network: tiles of ``pixels`` pixels of an input
    ``full`` pixels long, the last taking the rest. A tensor of ``size`` on that axis is the input
    at a stride ``s`` where ``ceil(full / s) == size`` (as stride-``s`` convolutions and poolings
    padded by half their window give), and its tiles are ``pixels / s`` long for the least such
    ``s`` dividing ``pixels``: tile ``i`` of every such tensor covers input pixels
    ``[i * pixels, (i + 1) * pixels)``, and each is cut into ``ceil(full / pixels)`` tiles
    (``ceil(ceil(x) / m) = ceil(x / m)``).
    """

    pixels: int
    full: int

    @classmethod
    def of(cls, full: int, quantum: int, parts: int) -> Period:
        """About ``parts`` tiles of an input ``full`` long, each a multiple of ``quantum`` pixels."""
        return cls(quantum * -(-full // (quantum * parts)), full)

    @property
    def parts(self) -> int:
        return -(-self.full // self.pixels)

    def length(self, size: int) -> int | None:
        """The tile length of a tensor of ``size`` on this axis; ``None`` where it is not the input
        at a stride dividing ``pixels``."""
        return next((self.pixels // s for s in strides_of(size, self.full, self.pixels) if self.pixels % s == 0), None)


def strides_of(size: int, full: int, most: int) -> range:
    """The strides ``s <= most`` at which a tensor of ``size`` is an input of ``full``:
    ``ceil(full / s) == size`` (one for large sizes, empty for sizes no stride gives)."""
    if size < 1:
        return range(0)
    low = -(-full // size)
    return range(low, (most if size == 1 else min(most, (full - 1) // (size - 1))) + 1)


def parts_of(grid: int | Period) -> int:
    """The number of tiles an axis split by ``grid`` (a number of parts, or a ``Period``) has."""
    return grid.parts if isinstance(grid, Period) else grid


def partition(size: int, grid: int | Period) -> tuple[Interval, ...]:
    """Partition ``[0, size)`` by ``grid``: ``split`` into that many parts, or in tiles of a
    ``Period``'s length at that size (which must have one, ``Period.length``)."""
    if not isinstance(grid, Period):
        return split(size, grid)
    length = grid.length(size)
    if length is None:
        raise ValueError(f"a tensor of {size} is not tiled by {grid}")
    return tuple(Interval(start, min(start + length, size)) for start in range(0, size, length))


def split(size: int, parts: int) -> tuple[Interval, ...]:
    """Partition ``[0, size)`` into ``parts`` intervals.

    All but the last are ``ceil(size / parts)`` long and the last takes the rest, so that every
    interior tile of a grid has one shape (one compiled kernel per convolution and pass, not two).
    Where that would leave the last interval empty (``size`` 10 in 6 parts), the lengths differ
    by at most one instead, the longer ones first.
    """
    length = -(-size // parts)
    if length * (parts - 1) < size:
        return tuple(Interval(i * length, min((i + 1) * length, size)) for i in range(parts))
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append(Interval(start, stop))
        start = stop
    return tuple(bounds)
