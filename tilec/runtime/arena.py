"""``Arena``: one buffer that every tile of a segment's pass reuses for its own tensors."""

import math

import torch

from tilec.runtime.device import PACK
from tilec.runtime.memory import HUGE_PAGE, advise_huge_pages


class Arena:
    """One buffer that every tile of a segment's forward pass reuses for its own tensors, where
    the device's kernels use one (``Kernels.arena``: the CPU).

    ``take`` hands out tensors one after the other from ``top``: a tile's input copies, the padded
    copies of its border tiles, its convolution and max-pooling results and max-pooling indices,
    all of which live until the tile ends, and on top of them a convolution's scratch, given back
    by restoring ``top``. ``reset`` starts the next tile at 0. Fresh, every such tensor is a block
    of 128 KiB or more that the pinned allocator maps and unmaps, and the kernel faults in again
    page by page, tile after tile. The buffer holds ``capacity`` bytes (the most a tile of the
    segment's earlier forward passes took, ``need``); past it, and without a capacity (a backward
    pass's arena: ``tilec.runtime.sweeps``), tensors are fresh. Tensors carved from the buffer are
    not views, so autograd treats them as any fresh tensor; none of them is ever a gradient.
    ``kernels``: the device's (``tilec.runtime.device.Kernels``)."""

    def __init__(self, device, kernels, capacity=0, pack=False):
        self.top = self.need = 0
        self.kernels = kernels
        self.packed_weights = {} if pack and kernels.onednn else None
        self.buffer, self.base, self.capacity = None, 0, capacity
        if kernels.arena and capacity:
            self.buffer = torch.empty(capacity + HUGE_PAGE, dtype=torch.uint8, device=device)
            self.base = -self.buffer.data_ptr() % HUGE_PAGE
            advise_huge_pages(self.buffer.data_ptr() + self.base, capacity + HUGE_PAGE - self.base)

    def reset(self):
        self.top = 0

    def take(self, shape, dtype, device, memory_format=torch.contiguous_format):
        """An uninitialised tensor of ``shape`` (4-D for channels-last) at ``top``, 64-byte aligned."""
        start = self.claim(shape, dtype, device)
        if start is None:
            return torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format)
        return self.carve(start, shape, dtype, memory_format)

    def copy(self, x, memory_format=torch.contiguous_format):
        """``x`` copied into what ``take`` would give for it: one call (``clone``) where fresh."""
        start = self.claim(tuple(x.shape), x.dtype, x.device)
        if start is None:
            return x.clone(memory_format=memory_format)
        return self.carve(start, tuple(x.shape), x.dtype, memory_format).copy_(x)

    def claim(self, shape, dtype, device):
        """Room for a tensor of ``shape`` and ``dtype`` at ``top``, 64-byte aligned, counted in
        ``need``: its start in the buffer, or ``None`` where the tensor is to be fresh (kernels that
        use no arena, which count nothing: compiled tiles read no arena state to be compiled again
        for; no buffer on ``device``, or past its capacity)."""
        if not self.kernels.arena:
            return None
        start = -(-self.top // 64) * 64
        self.top = start + math.prod(shape) * dtype.itemsize
        self.need = max(self.need, self.top)
        if self.buffer is None or device != self.buffer.device or self.top > self.capacity:
            return None
        return start

    def carve(self, start, shape, dtype, memory_format=torch.contiguous_format):
        """The tensor of ``shape`` at ``start`` in the buffer (``claim``)."""
        if memory_format == torch.channels_last:
            n, c, h, w = shape
            strides = (h * w * c, 1, w * c, c)
        else:
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        offset = (self.base + start) // dtype.itemsize
        return torch.empty(0, dtype=dtype, device=self.buffer.device).set_(self.buffer.untyped_storage(), offset,
                                                                            shape, strides)

    def packed(self, w, x, stride, padding, dilation, groups):
        """Convolution weight ``w`` for oneDNN: in an arena that packs (a forward pass's), in
        oneDNN's blocked layout for inputs like ``x``, reordered at its first tile and kept until
        the pass ends (outside the buffer), since given as it is oneDNN reorders it on every call,
        which takes most of a small tile's call; else channels-last scratch (``channels_last``).
        A backward pass does not pack: the blocked weights would add to its higher peak."""
        if self.packed_weights is None:
            return self.channels_last(w)
        found = self.packed_weights.get(id(w))
        if found is None:
            blocked = PACK(w.detach(), list(padding), list(stride), list(dilation), groups, list(x.shape))
            found = self.packed_weights[id(w)] = (w, blocked)  # holding w: no other tensor takes its id
        return found[1]

    def channels_last(self, w):
        """A convolution weight as channels-last scratch (the caller gives it back): with a
        channels-last input, oneDNN copies a contiguous weight twice per call, outside the arena."""
        if w.is_contiguous(memory_format=torch.channels_last):
            return w
        return self.copy(w, torch.channels_last)
