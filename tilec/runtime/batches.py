"""Same-shape tiles in one call: consecutive tiles of one shape class stacked along the batch axis.

A tiled segment whose plan says ``batch`` k > 1 runs up to k tiles that follow each other in the
order this process runs them, and share a shape class, as one call of their class's tile function
on their slices stacked along dim 0 (``Pending`` gathers them, ``stack_in`` stacks them). The plan
batches only segments whose model batch is one sample and whose ops compute each sample on its own
(``tilec.ops.base.Op.batchable``), so the stacked call computes every tile's values as its own
call would, and its owned outputs are the tiles' along dim 0.

Its partials are those of the k tiles merged (``batch_partials``): a reduction over the batch axis
(BatchNorm's statistics) reduces the stacked tiles together, which is their merged partial; one per
sample (instance or group norm, global pooling) comes with one row per tile along dim 0, and the
rows are merged as separate tiles' partials, in order. Partials keep their reduced dims, so a
partial with dim 0 of size k is one per sample. Backward, the batch's merged partial takes the
batch's share of the merged partials' gradients as one tile's would (``tilec.runtime.reduce``).
"""

import torch

from tilec.runtime.kernels import copy_in
from tilec.runtime.reduce import merged


class Pending:
    """Tiles waiting to run as one call: consecutive tiles of one shape class and read sizes, at
    most ``size``; each an ``(index, row, col, ...)`` tuple of its row and column table entries."""

    def __init__(self, size):
        self.size, self.items = size, []

    def fits(self, row, col):
        """Whether tile ``row`` x ``col`` may join the tiles waiting."""
        if not self.items:
            return True
        _, first_row, first_col, *_ = self.items[0]
        return len(self.items) < self.size and shape_of(row, col) == shape_of(first_row, first_col)

    def add(self, item):
        self.items.append(item)

    def take(self):
        items, self.items = self.items, []
        return items

    def __len__(self):
        return len(self.items)


def shape_of(row, col):
    """A tile's shape class and the lengths of its reads (what its slices' shapes are)."""
    return row[2], col[2], tuple(b - a for a, b in row[0]), tuple(b - a for a, b in col[0])


def stack_in(arena, tiles):
    """Per sliced input, the slices of ``tiles`` (each a list of one tile's slices) as one tensor:
    one tile's copied in as it is (``copy_in``), several stacked along dim 0."""
    if len(tiles) == 1:
        return copy_in(arena, tiles[0])
    return [Stack.apply(arena, *parts) if parts[0].dim() == 4 else torch.cat(parts)
            for parts in zip(*tiles, strict=True)]


class Stack(torch.autograd.Function):
    """The slices of one sliced input of several tiles, stacked along dim 0 into the arena,
    channels-last; the gradient goes back to each tile's slice."""

    @staticmethod
    def forward(ctx, arena, *slices):
        first = slices[0]
        ctx.count = len(slices)
        stacked = arena.take((first.shape[0] * len(slices), *first.shape[1:]), first.dtype, first.device,
                             torch.channels_last)
        for part, x in zip(stacked.split(first.shape[0]), slices, strict=True):
            part.copy_(x)
        return stacked

    @staticmethod
    def backward(ctx, g):
        return None, *g.split(g.shape[0] // ctx.count)


def unstacked(tensor, count):
    """``count`` stacked tiles' parts of one output, along dim 0."""
    return tensor.split(tensor.shape[0] // count) if count > 1 else (tensor,)


def batch_partials(partials, count, kinds):
    """The partials of ``count`` stacked tiles as one tile's (module docstring), per reduction
    merged by ``kinds`` (``None`` for a direct level's stays ``None``)."""
    if count == 1:
        return partials
    return tuple(part if part is None or not per_sample(part, count) else
                 merged(kind, [tuple(t[k:k + 1] if isinstance(t, torch.Tensor) else t for t in part)
                               for k in range(count)])
                 for kind, part in zip(kinds, partials, strict=True))


def per_sample(part, count):
    """Whether a stacked call's partial has one row per tile (its dim 0 was not reduced): its
    tensors' (a count is a number, the same for every row)."""
    first = next(t for t in part if isinstance(t, torch.Tensor))
    return first.dim() > 0 and first.shape[0] == count
