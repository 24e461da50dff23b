"""Reductions inside tiled segments: partials per tile, merged across tiles.

A tile computes a *partial* over the part of a reduction's input it owns (the owned parts of the
tiles partition the input). Partials of one kind *merge* two at a time, associatively: the step
merges each tile's into a running one as the tiles run, and keeps only that. Its backward needs a
tile's *share* of the merged partial's gradient: the gradient of the tile's partial through the
merge of all the tiles' partials, the others' held constant. Each kind gives it in closed form
from the merged partial and the tile's (``shares_of``), a few element-wise ops per reduction, where
autograd through a merge with the others' partial solved for took some fifty. Partials and merges
are differentiable torch code, so autograd derives the backward of a level's combine through its
merged partials (the maxima's merges say how a tie's gradient is shared). Partials keep the
reduced dims (``keepdim``), so that they broadcast.

* ``sum``: sums (means divide by a count known when compiling; 2-norms sum squares); a part's
  share is the merged gradient.
* ``moments``: ``(count, mean, M2)`` per reduced group, merged with Chan's parallel formula, which
  stays accurate where ``E[x²] - E[x]²`` cancels; the count is a Python integer (every group of a
  partial has as many elements), exact however large the image.
* ``max``: maxima with the number of elements tied at them; the merged gradient goes to each part
  in proportion to its ties, as ``amax`` spreads it evenly over all maxima of the whole input.
* ``argmax``: the first maximum in row-major order and its flat index, as max pooling picks it; the
  gradient goes to the part holding it.
* ``logsumexp``: ``log Σ exp`` (a softmax's normaliser over the image), merged by ``logaddexp``; a
  part's share is the merged gradient times ``exp(lse_part - lse)``.
"""

import functools
from typing import NamedTuple

import torch


def widened(x):
    """``x`` in float32 where it is half or bfloat16: partials accumulate there, and the result is
    rounded to the op's dtype once, as PyTorch's own reductions do."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def partial_sum(x, dims):
    return (widened(x).sum(dims, keepdim=True),)


def partial_contraction(a, b):
    """``a`` (..., M, H, W) times ``b`` (..., H, W, N) summed over the tile's pixels: its part of a
    product contracting the image (``tilec.ops.reduce.Contraction``), merged as a sum."""
    return (torch.einsum("...mhw,...hwn->...mn", widened(a), widened(b)),)


def partial_squares(x, dims):
    """The sum of squares of ``x`` over ``dims``: a 2-norm's partial, merged as a sum."""
    return (widened(x).square().sum(dims, keepdim=True),)


def root_of_squares(squares):
    """The 2-norm from merged sums of squares; where they are 0, the norm is 0 and so is its
    gradient, as ``linalg_vector_norm``'s backward gives (a plain square root's would be NaN)."""
    zero = squares == 0
    return torch.where(zero, 0.0, torch.where(zero, 1.0, squares).sqrt())


def partial_logsumexp(x, dims):
    """``log Σ exp(x)`` over ``dims``: a softmax's normaliser, merged by ``logaddexp``."""
    return (torch.logsumexp(widened(x), dims, keepdim=True),)


def merge_sum(a, b):
    return tuple(x + y for x, y in zip(a, b, strict=True))


def share_sum(items):
    """Each part's share of a merged sum's gradients: those gradients."""
    return [grads for _, _, grads in items]


def partial_moments(x, dims):
    """``(count, mean, M2)`` of ``x`` over ``dims`` in one pass (``var_mean``, whose backward keeps
    only ``x``; ``ChannelMoments`` where it applies), the count an integer."""
    count = 1
    for d in dims:
        count *= x.shape[d]
    x = widened(x)
    found = ChannelMoments.layout(x, dims)
    if found is not None:
        channels_last, groups = found
        shape = (1, -1, 1, 1) if groups is None else (*x.shape[:2], 1, 1, 1)
        mean, m2 = (t.view(shape) for t in ChannelMoments.apply(channels_last, groups))
        return count, mean, m2
    m2, mean = torch.var_mean(x, dims, correction=count - 1, keepdim=True)  # over count - correction = 1: M2
    return count, mean, m2


#: Elements of the scratch block ``ChannelMoments`` takes deviations in (1 MiB of float32: cached).
BLOCK = 1 << 18


class ChannelMoments(torch.autograd.Function):
    """``(mean, M2)`` of a non-empty CPU float tensor ``x`` (N, C, H, W) whose channels are its
    innermost dim (channels-last, as tiles make it, or a region of such a tensor): per channel over
    N, H and W (``groups`` ``None``: BatchNorm's partial, shaped ``(1, C)``), or per sample and
    each of ``groups`` runs of consecutive channels over the run's channels, H and W (group,
    instance and layer norm's partial, shaped ``(N, groups)``). On such a tensor ``var_mean`` takes 2-8x as
    long (``benchmarks/moments.py``).

    Block by block (``BLOCK`` elements, a region's copied into a scratch), the mean is a sum,
    vectorised over the channels, and M2 sums the squared deviations from it in the scratch; each
    block's sums are added up in float64, and M2 corrects the mean's rounding (``M2 = S2 - S1² / n``,
    ``S1``, ``S2``: the sums of the deviations and of their squares; the mean moves by ``S1 / n``);
    a group's channels then merge in float64 (``M2 = Σ M2_c + n Σ (mean_c - mean)²``): within a
    float32 ulp of ``var_mean``'s, as accurate in float64."""

    @staticmethod
    def layout(x, dims):
        """``(x as (N, C, H, W), groups)`` where ``ChannelMoments`` computes ``x``'s moments over
        ``dims``: BatchNorm's (``x`` 4-D, ``dims`` (0, 2, 3), ``groups`` ``None``) or a grouped
        view's (``x`` (N, groups, C / groups, H, W), ``dims`` (2, 3, 4)); else (and while dynamo
        traces a compiled tile) ``None``."""
        if (x.device.type != "cpu" or x.numel() == 0 or x.dtype not in (torch.float32, torch.float64)
                or torch.compiler.is_compiling()):
            return None
        if x.dim() == 4 and tuple(dims) == (0, 2, 3) and x.stride(1) == 1:
            return x, None
        if (x.dim() == 5 and tuple(dims) == (2, 3, 4) and x.stride(4) == x.shape[1] * x.shape[2]
                and (x.stride(2) == 1 or x.shape[2] == 1) and (x.stride(1) == x.shape[2] or x.shape[1] == 1)):
            return x.flatten(1, 2), x.shape[1]
        return None

    @staticmethod
    def forward(ctx, x, groups):
        rows = x.permute(0, 2, 3, 1)  # (N, H, W, C), channels innermost
        channels = x.shape[1]
        sets = 1 if groups is None else x.shape[0]  # sums over all samples, or per sample
        count = x.numel() // channels // sets
        height = max(1, BLOCK // (rows.shape[2] * rows.shape[3]))
        blocks = [(0 if groups is None else n, sample[start:start + height]) for n, sample in enumerate(rows)
                  for start in range(0, rows.shape[1], height)]
        scratch = torch.empty((min(height, rows.shape[1]), *rows.shape[2:]), dtype=x.dtype)
        total = torch.zeros(sets, channels, dtype=torch.float64)
        for n, block in blocks:  # a region's rows are strided: copied, its blocks sum as fast
            total[n] += (block if block.is_contiguous() else scratch[:block.shape[0]].copy_(block)).sum((0, 1))
        rough = (total / count).to(x.dtype)
        first = torch.zeros(sets, channels, dtype=torch.float64)
        second = torch.zeros(sets, channels, dtype=torch.float64)
        for n, block in blocks:
            deviations = scratch[:block.shape[0]]
            torch.sub(block, rough[n], out=deviations)
            first[n] += deviations.sum((0, 1))
            second[n] += deviations.square_().sum((0, 1))
        mean, m2 = rough + first / count, second - first.square() / count
        if groups is not None:
            by_group = mean.view(sets, groups, -1)
            mean = by_group.mean(2)
            m2 = m2.view(sets, groups, -1).sum(2) + count * (by_group - mean.unsqueeze(2)).square().sum(2)
            count *= channels // groups
        mean = mean.to(x.dtype)
        ctx.save_for_backward(x, mean)
        ctx.count, ctx.groups = count, groups
        return mean, m2.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_mean, grad_m2):
        """``dmean/dx = 1/n``, ``dM2/dx = 2 (x - mean)``, per channel or group."""
        x, mean = ctx.saved_tensors
        channels = x.shape[1]

        def per_channel(t):
            if ctx.groups is not None:
                t = t.repeat_interleave(channels // ctx.groups, dim=1)
            return t.view(t.shape[0], channels, 1, 1)

        if grad_m2 is None:
            grad = torch.zeros_like(x)
        else:
            grad = torch.sub(x, per_channel(mean)).mul_(2 * per_channel(grad_m2))
        if grad_mean is not None:
            grad.add_(per_channel(grad_mean) / ctx.count)
        return grad, None


def merge_moments(a, b):
    """Chan's merge of two ``(count, mean, M2)``: ``n = na + nb``, ``d = mean_b - mean_a``,
    ``mean = mean_a + d * nb / n``, ``M2 = M2_a + M2_b + d² * na * nb / n``."""
    count, mean, m2 = a
    other_count, other_mean, other_m2 = b
    total = count + other_count
    delta = other_mean - mean
    weight = other_count / total
    return total, torch.add(mean, delta, alpha=weight), torch.addcmul(m2 + other_m2, delta, delta, value=count * weight)


def share_moments(items):
    """Each part's share of the gradients ``grads`` of merged ``(n, mean, M2)`` (``items``: per part,
    ``(merged, part, grads)``): with the others' ``(nb, mean_b, M2_b)`` held constant,
    ``d mean / d mean_a = na / n``, ``d M2 / d M2_a = 1`` and ``d M2 / d mean_a = -2 (mean_b - mean_a)
    na nb / n = 2 (mean_a - mean) na`` (as ``mean_b - mean_a = (mean - mean_a) n / nb``); counts are
    constants. What depends on ``na`` alone, the mean's gradient times ``na / n`` and M2's times
    ``2 na``, is made once per count of the parts sharing ``grads`` (``Gradients``); what depends on
    the part's mean, ``(mean_a - mean) * slope + scaled``, is three calls for all the parts (a
    ``torch._foreach_`` op each)."""
    found, spread = [], []
    for (count, mean, _), (own_count, own_mean, _), grads in items:
        _, grad_mean, grad_m2 = grads
        scaled, slope = grads.once(own_count, functools.partial(count_terms, own_count / count, 2 * own_count,
                                                                 grad_mean, grad_m2))
        found.append([None, scaled, grad_m2])
        if slope is not None:
            spread.append((len(found) - 1, own_mean, mean, scaled, slope))
    if spread:
        at, own, mean, scaled, slope = zip(*spread, strict=True)
        shares = torch._foreach_mul(torch._foreach_sub(own, mean), slope)
        with_scaled = [k for k, s in enumerate(scaled) if s is not None]
        if with_scaled:
            torch._foreach_add_([shares[k] for k in with_scaled], [scaled[k] for k in with_scaled])
        for n, share in zip(at, shares, strict=True):
            found[n][1] = share
    return [tuple(grads) for grads in found]


def count_terms(weight, twice, grad_mean, grad_m2):
    """What a part's share of merged moments' gradients takes from its count alone: the mean's
    gradient times ``weight`` (``na / n``) and M2's times ``twice`` (``2 na``), ``None`` for none."""
    return (None if grad_mean is None else grad_mean * weight, None if grad_m2 is None else grad_m2 * twice)


def each(share):
    """A share of one part's, ``share(merged, part, grads)``, made a share of each of ``items``."""
    @functools.wraps(share)
    def shares(items):
        return [share(*item) for item in items]
    return shares


def partial_max(x, dims):
    """The maxima of ``x`` over ``dims`` and how many elements equal them."""
    top = x.amax(dims, keepdim=True)
    return top, (x == top).sum(dims, keepdim=True).to(widened(x).dtype)


def merge_logsumexp(a, b):
    return (torch.logaddexp(a[0], b[0]),)


@each
def share_logsumexp(merged, part, grads):
    """A part's share of a merged ``logsumexp``'s gradient: ``d LSE / d lse_a = exp(lse_a - LSE)``."""
    grad = grads[0]
    if grad is None:
        return (None,)
    return ((grad * torch.exp(part[0] - merged[0])).to(grad.dtype),)


class MaxMerge(torch.autograd.Function):
    """The larger of two maxima with the elements tied at it; its gradient goes to each part whose
    maximum it is, in proportion to the elements the part holds at it."""

    @staticmethod
    def forward(ctx, count_a, count_b, top_a, top_b):
        top = torch.maximum(top_a, top_b)
        hits_a = torch.where(top_a == top, count_a, torch.zeros_like(count_a))
        hits_b = torch.where(top_b == top, count_b, torch.zeros_like(count_b))
        hits = hits_a + hits_b
        ctx.save_for_backward(hits_a / hits, hits_b / hits)
        ctx.mark_non_differentiable(hits)
        return top, hits

    @staticmethod
    def backward(ctx, grad, _):
        share_a, share_b = ctx.saved_tensors
        return None, None, (grad * share_a).to(grad.dtype), (grad * share_b).to(grad.dtype)


def merge_max(a, b):
    return MaxMerge.apply(a[1].detach(), b[1].detach(), a[0], b[0])


@each
def share_max(merged, part, grads):
    """A part's share of the merged maximum's gradient: in proportion to the elements it holds at
    the merged maximum (none where its maximum is lower), as ``MaxMerge`` shares it."""
    top, hits = merged
    own_top, own_hits = part
    grad = grads[0]
    if grad is None:
        return None, None
    mine = torch.where(own_top == top, own_hits / hits, torch.zeros_like(hits))
    return (grad * mine).to(grad.dtype), None


class ArgMaxMerge(torch.autograd.Function):
    """The larger of two maxima, at the smaller flat index among ties, as max pooling picks; its
    gradient goes to the part holding it."""

    @staticmethod
    def forward(ctx, index_a, index_b, top_a, top_b):
        top = torch.maximum(top_a, top_b)
        first = (top_a == top) & ((top_b != top) | (index_a < index_b))
        ctx.save_for_backward(first)
        index = torch.where(first, index_a, index_b)
        ctx.mark_non_differentiable(index)
        return top, index

    @staticmethod
    def backward(ctx, grad, _):
        first, = ctx.saved_tensors
        zero = torch.zeros_like(grad)
        return None, None, torch.where(first, grad, zero), torch.where(first, zero, grad)


def merge_argmax(a, b):
    return ArgMaxMerge.apply(a[1], b[1], a[0], b[0])


@each
def share_argmax(merged, part, grads):
    """A part's share of the merged first maximum's gradient: all of it where the part holds that
    maximum (its flat index), none elsewhere."""
    grad = grads[0]
    if grad is None:
        return None, None
    return torch.where(part[1] == merged[1], grad, torch.zeros_like(grad)), None


def partial_argmax(x, origin, width):
    """Max pooling of the tile's owned part ``x`` (from row ``origin[0]`` and column ``origin[1]``
    of an input ``width`` wide) to 1x1: the first maximum in row-major order, and its flat index
    in the whole input."""
    top, local = torch.nn.functional.adaptive_max_pool2d(x, 1, return_indices=True)
    row, col = local // x.shape[-1] + origin[0], local % x.shape[-1] + origin[1]
    return top, row * width + col


class Gradients(tuple):
    """A merged partial's gradients, per tensor (``None`` where none), with what a share computes
    from them and a part's count alone, made once for every part of that count (``once``)."""

    def once(self, count, make):
        """``make()``, kept for ``count``."""
        made = self.__dict__.setdefault("made", {})
        if count not in made:
            made[count] = make()
        return made[count]


class Merge(NamedTuple):
    """How partials of one kind merge, and parts' shares of merged ones' gradients:
    ``share(items)`` gives, per ``(merged, part, grads)`` of ``items``, the gradient of each of
    ``part``'s tensors (``None`` where none), ``merged`` and ``grads`` the merged partial and its
    gradients (``Gradients``, ``None`` where none), which every part's share is given."""

    merge: object
    share: object


MERGES = {"sum": Merge(merge_sum, share_sum), "moments": Merge(merge_moments, share_moments),
          "max": Merge(merge_max, share_max), "argmax": Merge(merge_argmax, share_argmax),
          "logsumexp": Merge(merge_logsumexp, share_logsumexp)}


def merged(kind, parts):
    """Partials ``parts`` of one ``kind`` merged, in order."""
    return functools.reduce(MERGES[kind].merge, parts)


def shares_of(items):
    """(tensor, gradient) pairs that back-propagate each part's share of the gradients of a merged
    partial (its gradient through the merge of every part, the others held constant) into the
    part's tensors that require grad, in the order of ``items``: per part, ``(kind, merged_part,
    part, grads)``; none where nothing is wanted. The parts of one kind are shared in one go."""
    live = [item for item in items if any(g is not None for g in item[3]) and any(needs_grad(t) for t in item[2])]
    found = {}
    with torch.no_grad():
        for kind in dict.fromkeys(item[0] for item in live):
            mine = [n for n, item in enumerate(live) if item[0] == kind]
            found.update(zip(mine, MERGES[kind].share([live[n][1:] for n in mine]), strict=True))
    return [(t, g) for n, (_, _, part, _) in enumerate(live)
            for t, g in zip(part, found[n], strict=True) if g is not None and needs_grad(t)]


def needs_grad(t):
    """Whether ``t``, a partial's tensor or count, requires grad."""
    return isinstance(t, torch.Tensor) and t.requires_grad


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
            running_mean.mul_(1 - momentum).add_(mean.reshape(-1).to(running_mean.dtype), alpha=momentum)
            unbiased = (var * (count / (count - 1))).reshape(-1).to(running_var.dtype)
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return mean, torch.rsqrt(var + eps)


def norm_affine(stats, groups, channels, weight, bias):
    """``(a, b)`` per (sample,) channel, shaped ``(N or 1, channels, 1, 1)``, from ``stats = (mean,
    1 / std)`` (per channel where ``groups`` is ``None``, else per sample and channel group) and the
    per-channel ``weight`` and ``bias``: ``a = weight / std``, ``b = bias - mean * a``, as PyTorch's
    CPU kernels compute a normalisation. A level's combine makes them once, so that each tile
    normalises in one op (``norm_apply``) and their gradients reach the weight and bias through
    the combine."""
    mean, scale = stats
    if groups is not None:  # per (sample, group) -> per (sample, channel); one sample broadcasts over stacked tiles
        n = mean.shape[0]
        mean, scale = (t.reshape(n, groups, 1).expand(n, groups, channels // groups).reshape(n, channels, 1, 1)
                       for t in (mean, scale))
    if weight is not None:
        scale = scale * weight.view(1, -1, 1, 1)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.view(1, -1, 1, 1)
    return scale, shift


def norm_apply(x, affine):
    """``x * a + b`` with ``affine = (a, b)`` (``norm_affine``), in ``x``'s dtype and layout: one pass
    over ``x`` whose backward keeps ``x`` only."""
    scale, shift = affine
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
