"""Reductions inside tiled segments: partials per tile, combines across tiles.

A tile computes a *partial* over the part of a reduction's input it owns (the owned parts of the
tiles partition the input); a *combine* merges the tiles' partials into the reduction's result.
Both are differentiable torch code, so autograd derives the backward of every reduction from
them. Partials and results keep the reduced dims (``keepdim``), so that they broadcast.

* ``partial_sum`` / ``combine_sum``: sums (means divide by a count known when compiling).
* ``partial_moments`` / ``combine_moments``: ``(count, mean, M2)`` per reduced group, merged with
  Chan's parallel formula, which stays accurate where ``E[x²] - E[x]²`` cancels.
* ``partial_max`` / ``combine_max``: maxima with the number of elements tied at them; the
  combined gradient goes to each tile in proportion to its ties, as ``amax`` spreads it evenly.
* ``partial_argmax`` / ``combine_argmax``: the first maximum in row-major order and its flat
  index, as max pooling picks it; the gradient goes to the tile holding it.
"""

import torch


def widened(x):
    """``x`` in float32 where it is half or bfloat16: partials accumulate there, and the result is
    rounded to the op's dtype once, as PyTorch's own reductions do."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def partial_sum(x, dims):
    return (widened(x).sum(dims, keepdim=True),)


def combine_sum(parts):
    """The sums of the tiles' partials, element by element."""
    return tuple(torch.stack(values).sum(0) for values in zip(*parts, strict=True))


def partial_moments(x, dims):
    """``(count, mean, M2)`` of ``x`` over ``dims`` in one pass (``var_mean``, whose backward keeps
    only ``x``): the count as a tensor of the mean's shape."""
    count = 1
    for d in dims:
        count *= x.shape[d]
    var, mean = torch.var_mean(widened(x), dims, correction=0, keepdim=True)
    return torch.full_like(mean, count, requires_grad=False), mean, var * count


def combine_moments(parts):
    """Chan's merge of ``(count, mean, M2)`` over the tiles: for two parts a and b,
    ``n = na + nb``, ``d = mean_b - mean_a``, ``mean = mean_a + d * nb / n``,
    ``M2 = M2_a + M2_b + d² * na * nb / n``."""
    count, mean, m2 = parts[0]
    for other_count, other_mean, other_m2 in parts[1:]:
        total = count + other_count
        delta = other_mean - mean
        mean = mean + delta * (other_count / total)
        m2 = m2 + other_m2 + delta.square() * (count * other_count / total)
        count = total
    return count, mean, m2


def partial_max(x, dims):
    """The maxima of ``x`` over ``dims`` and how many elements equal them."""
    top = x.amax(dims, keepdim=True)
    return top, (x == top).sum(dims, keepdim=True).to(x.dtype)


class MaxCombine(torch.autograd.Function):
    """The maximum over the tiles' maxima; its gradient goes to each tile whose maximum it is,
    in proportion to the elements the tile holds at it (``amax`` spreads its gradient evenly over
    all maxima of the whole input)."""

    @staticmethod
    def forward(ctx, counts, *tops):
        stacked = torch.stack(tops)
        top = stacked.amax(0)
        hits = torch.where(stacked == top, counts, torch.zeros_like(counts))
        ctx.save_for_backward(hits / hits.sum(0))
        return top

    @staticmethod
    def backward(ctx, grad):
        shares, = ctx.saved_tensors
        return (None, *(grad * share for share in shares))


def combine_max(parts):
    tops = [top for top, _ in parts]
    counts = torch.stack([count.detach() for _, count in parts])
    return (MaxCombine.apply(counts, *tops),)


def partial_argmax(x, origin, width):
    """Max pooling of the tile's owned part ``x`` (from row ``origin[0]`` and column ``origin[1]``
    of an input ``width`` wide) to 1x1: the first maximum in row-major order, and its flat index
    in the whole input."""
    top, local = torch.nn.functional.adaptive_max_pool2d(x, 1, return_indices=True)
    row, col = local // x.shape[-1] + origin[0], local % x.shape[-1] + origin[1]
    return top, row * width + col


class ArgMaxCombine(torch.autograd.Function):
    """The tiles' maxima merged as max pooling picks: the largest, the one at the smallest flat
    index among ties; its gradient goes to that tile alone."""

    @staticmethod
    def forward(ctx, indices, *tops):
        stacked = torch.stack(tops)
        top = stacked.amax(0)
        candidates = torch.where(stacked == top, indices, torch.full_like(indices, torch.iinfo(indices.dtype).max))
        first = candidates.argmin(0, keepdim=True)
        ctx.save_for_backward(first)
        ctx.tiles = len(tops)
        return top, indices.gather(0, first).squeeze(0)

    @staticmethod
    def backward(ctx, grad, _):
        first, = ctx.saved_tensors
        chosen = torch.arange(ctx.tiles, device=grad.device).view(-1, *[1] * grad.dim()) == first
        return (None, *(torch.where(mask, grad, torch.zeros_like(grad)) for mask in chosen))


def combine_argmax(parts):
    return ArgMaxCombine.apply(torch.stack([index for _, index in parts]), *[top for top, _ in parts])


def autocast_dtype(like):
    """The dtype of a result that autocast computes in lower precision: autocast's where it is on
    for ``like``'s device in this step, else ``like``'s (the model's), as the tiles compute it."""
    device = like.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else like.dtype


def variance(moments, correction, shape):
    """The variance from merged ``(count, mean, M2)``, with ``correction`` (1: unbiased), shaped."""
    count, _, m2 = moments
    return (m2 / (count - correction)).reshape(shape)


def grouped(x, groups):
    """``(N, C, H, W)`` as ``(N, groups, C / groups, H, W)``."""
    return x.reshape(x.shape[0], groups, -1, *x.shape[2:])


def norm_stats(moments, eps):
    """``(mean, 1 / sqrt(var + eps))`` from merged ``(count, mean, M2)`` (the biased variance)."""
    count, mean, m2 = moments
    return mean, torch.rsqrt(m2 / count + eps)


def batch_norm_stats(moments, running_mean, running_var, mode, eps, update):
    """``nn.BatchNorm``'s statistics for ``mode = (batch statistics?, momentum)``: of the batch from
    merged ``(count, mean, M2)`` over (N, H, W), updating the running statistics with ``momentum``
    where ``update`` (a forward pass; the unbiased variance, as PyTorch does), or the running ones."""
    batch_stats, momentum = mode
    if not batch_stats:
        return running_mean.view(1, -1, 1, 1), torch.rsqrt(running_var.view(1, -1, 1, 1) + eps)
    count, mean, m2 = moments
    var = m2 / count
    if update and running_mean is not None:
        with torch.no_grad():
            total = count.reshape(-1)[0]
            running_mean.mul_(1 - momentum).add_(mean.reshape(-1).to(running_mean.dtype), alpha=momentum)
            unbiased = (var * (total / (total - 1))).reshape(-1).to(running_var.dtype)
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return mean, torch.rsqrt(var + eps)


def norm_apply(x, stats, groups, weight, bias):
    """``x`` normalised with ``stats = (mean, 1 / std)`` (per channel where ``groups`` is ``None``,
    else per sample and channel group), then scaled and shifted per channel, in ``x``'s layout: as
    PyTorch's CPU kernels compute it, ``x * a + b`` with ``a = weight / std`` and ``b = bias - mean
    * a`` per (sample,) channel, one pass over ``x`` whose backward keeps ``x`` only."""
    mean, scale = stats
    trailing = (1,) * (x.dim() - 2)
    if groups is not None:  # per (sample, group) -> per (sample, channel)
        n, channels = x.shape[:2]
        mean, scale = (t.reshape(n, groups, 1).expand(n, groups, channels // groups).reshape(n, channels, *trailing)
                       for t in (mean, scale))
    if weight is not None:
        scale = scale * weight.view(1, -1, *trailing)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.view(1, -1, *trailing)
    return torch.addcmul(shift, x, scale).to(x.dtype)


def partial_class_loss(op, prediction, target, weight, ignore_index, *smoothing):
    """A class-weighted loss (``cross_entropy_loss``, ``nll_loss_nd``) of the tile's owned part,
    summed, and what its mean divides by: the class weights of the pixels not ignored."""
    total = op(widened(prediction), target, weight, 2, ignore_index, *smoothing)
    kept = target != ignore_index
    if weight is None:
        return total, kept.sum().to(total.dtype)
    return total, (weight[torch.where(kept, target, 0)] * kept).sum().to(total.dtype)


def partial_loss(op, prediction, target, reduction_arg, *rest):
    """An element-wise loss of the tile's owned part, summed (its reduction argument, at
    ``reduction_arg``, set to sum)."""
    args = [widened(prediction), widened(target), *rest]
    args.insert(reduction_arg, 2)
    return (op(*args),)


def channel_dropout(like, shape, p, training):
    """``Dropout2d``'s mask: one value per sample and channel, drawn as PyTorch draws it (a
    Bernoulli sample of ``1 - p`` divided by ``1 - p``, in ``like``'s dtype and device); ones
    where the module is not training."""
    if not training or p == 0:
        return torch.ones(shape, dtype=like.dtype, device=like.device)
    if p == 1:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(1 - p).div_(1 - p)
