"""What a tile computes its ops with, beyond aten's own calls.

Convolutions (oneDNN's convolution-into the arena on CPU, with the weight gradient raced against
matrix products), max pooling into the arena, border padding, upsampling with PyTorch's index
maps local to the tile, avg-pool divisors of border tiles, and activations in place. Each is an
autograd function or plain aten calls: autograd derives every tile's backward. Where the kernels
use no arena (CUDA's, the generic ones), input copies, max pooling and convolutions outside autocast
are aten's own calls: there a Python autograd function would call the same kernels both ways, at
some 30 us of the host's time per call forward and back. Border padding (whose gradient is a view,
not a copy) and activations in place (back-propagated in place) stay functions everywhere.
"""

import contextlib

import torch

from tilec.runtime.device import CONVOLVE_INTO, uses_gemm_weight_grad, uses_onednn

aten = torch.ops.aten

CONSTANTS = {}


def constant(values, like, dtype):
    """``values`` (a module-level tuple) as a tensor on ``like``'s device, cached."""
    key = (id(values), like.device, dtype)
    if key not in CONSTANTS:
        CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=like.device)
    return CONSTANTS[key]


def without_autocast(compute):
    """``compute()`` with autocast off on every device, for the ops the model computes in a block
    under ``torch.autocast(..., enabled=False)`` (``NodeSpec.autocast_off``); outside autocast, a call."""
    with contextlib.ExitStack() as off:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                off.enter_context(torch.autocast(device, enabled=False))
        return compute()


def divisor(rows, cols, like):
    """Avg-pool divisors of a border tile: the outer product of the per-axis counts."""
    return constant(rows, like, like.dtype)[:, None] * constant(cols, like, like.dtype)[None, :]


def gather(x, rows, cols):
    """Nearest upsampling of a tile: PyTorch's own index maps, local to the tile."""
    x = x.index_select(2, constant(rows, x, torch.int64))
    return x.index_select(3, constant(cols, x, torch.int64))


def lerp_axis(x, dim, low, high, frac):
    weight = constant(frac, x, x.dtype).reshape([-1] + [1] * (x.dim() - 1 - dim))
    lower = x.index_select(dim, constant(low, x, torch.int64))
    upper = x.index_select(dim, constant(high, x, torch.int64))
    return lower + (upper - lower) * weight


def lerp(x, low_rows, high_rows, frac_rows, low_cols, high_cols, frac_cols):
    """Bilinear upsampling of a tile, one axis after the other, with PyTorch's index maps."""
    return lerp_axis(lerp_axis(x, 3, low_cols, high_cols, frac_cols), 2, low_rows, high_rows, frac_rows)


def taps_axis(x, dim, taps, weights):
    """Per output along ``dim``, the sum of its taps' inputs times their weights, tap by tap."""
    index, weight = constant(taps, x, torch.int64), constant(weights, x, x.dtype)
    shape = [-1] + [1] * (x.dim() - 1 - dim)
    out = x.index_select(dim, index[0]) * weight[0].reshape(shape)
    for k in range(1, len(index)):
        out = out + x.index_select(dim, index[k]) * weight[k].reshape(shape)
    return out


def cubic(x, row_taps, row_weights, col_taps, col_weights):
    """Bicubic upsampling of a tile with PyTorch's taps and weights, columns first, as its kernel."""
    return taps_axis(taps_axis(x, 3, col_taps, col_weights), 2, row_taps, row_weights)


def max_pool_indices(x, kernel, stride, padding, dilation, origin, shift, width):
    """``max_pool2d_with_indices`` of a tile: its values, and its indices flat over the whole input
    (``width`` columns), where ``x``'s first row and column are ``origin`` less ``shift`` (the
    border a padded copy put before the tile's read)."""
    values, local = aten.max_pool2d_with_indices.default(x, kernel, stride, padding, dilation)
    columns = x.shape[3]
    return values, (local // columns + (origin[0] - shift[0])) * width + local % columns + (origin[1] - shift[1])


def unpool(x, indices, origin, size, width):
    """``max_unpool2d`` of a tile: each value of ``x`` to its flat ``indices`` over the whole output
    (``width`` columns), in the block of ``size`` whose first row and column are ``origin``; values
    whose place lies outside the block are left out, places no value reaches are 0."""
    rows, cols = indices // width - origin[0], indices % width - origin[1]
    inside = (rows >= 0) & (rows < size[0]) & (cols >= 0) & (cols < size[1])
    area = size[0] * size[1]
    place = torch.where(inside, rows * size[1] + cols, area).flatten(2)
    del rows, cols, inside
    out = x.new_zeros(*x.shape[:2], area + 1)
    out.scatter_(2, place, x.flatten(2))
    return out[..., :area].view(*x.shape[:2], *size)


def narrow(t, spatial, rows, cols):
    """The block ``rows`` x ``cols`` (half-open) of ``t`` over its image dims ``spatial``, as one view
    (one call, where narrowing each dim is two). For the runtime's tensors outside autograd only: a
    gradient through ``as_strided`` would be as large as ``t``."""
    size, stride = list(t.shape), t.stride()
    size[spatial[0]], size[spatial[1]] = rows[1] - rows[0], cols[1] - cols[0]
    offset = t.storage_offset() + rows[0] * stride[spatial[0]] + cols[0] * stride[spatial[1]]
    return t.as_strided(size, stride, offset)


def layout_of(x):
    """The memory format aten's kernels read ``x`` in (its ``suggest_memory_format``), and so the one
    tile tensors made from it take: channels-last where the channels are innermost, views of a
    channels-last map (a tile's narrowed part) included. A one-sample batch's stride does not
    count: elementwise ops leave a small one, from which aten would guess the contiguous layout."""
    if x.dim() != 4:
        return torch.contiguous_format
    sizes, strides = x.shape, list(x.stride())
    if sizes[0] == 1:
        strides[0] = sum(stride * size for stride, size in zip(strides[1:], sizes[1:], strict=True))
    # aten's rule: each of channels, width, height, batch strides at least as far as the one inside
    # it spans; ties in the ambiguous cases (size-1 dims) go to the contiguous layout
    if strides[1] == 0:
        return torch.contiguous_format
    span = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < span or (d == 0 and span == strides[1]):
            return torch.contiguous_format
        span = strides[d] * sizes[d] if sizes[d] > 1 else strides[d]
    return torch.channels_last


def dense(x):
    """``x`` contiguous in its layout (``layout_of``), with that layout's strides on its size-1 dims
    too: what aten's kernels that fill given tensors assume of their input. CUDA's max pooling
    writes in the layout it reads ``x`` in, whatever the strides of the tensors it fills."""
    layout = layout_of(x)
    x = x.contiguous(memory_format=layout)
    if layout is not torch.channels_last:
        return x
    n, c, h, w = x.shape
    return x.as_strided(x.shape, (h * w * c, 1, w * c, c))


class CopyIn(torch.autograd.Function):
    """A tile's slice of a sliced input, copied channels-last into the arena (every op of the tile
    then computes channels-last: convolution kernels read and write it without reordering); its
    gradient passes through."""

    @staticmethod
    def forward(ctx, x, arena):
        return arena.copy(x, torch.channels_last)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_in(arena, tile):
    """A tile's slices copied channels-last: into the arena by ``CopyIn``, or, where the kernels
    use none, by aten's ``clone``, whose gradient passes through too."""
    if not arena.kernels.arena:
        return [t.clone(memory_format=torch.channels_last) if t.dim() == 4 else t for t in tile]
    return [CopyIn.apply(t, arena) if t.dim() == 4 else t for t in tile]


def padded_copy(arena, x, pads, value):
    """``x`` padded with ``value`` (``pads``: left, right, top, bottom), in the arena: its border
    strips filled, ``x`` copied inside; where the arena gives a fresh tensor, aten's
    ``constant_pad_nd`` (one call)."""
    left, right, top, bottom = pads
    n, c, h, w = x.shape
    shape = (n, c, h + top + bottom, w + left + right)
    start = arena.claim(shape, x.dtype, x.device)
    if start is None:
        return torch.constant_pad_nd(x, pads, value)
    y = arena.carve(start, shape, x.dtype, layout_of(x))
    inner = slice(top, top + h)
    for rows, cols, size in ((slice(0, top), slice(None), top), (slice(top + h, None), slice(None), bottom),
                             (inner, slice(0, left), left), (inner, slice(left + w, None), right)):
        if size:
            y[:, :, rows, cols].fill_(value)
    y[:, :, top:top + h, left:left + w].copy_(x)
    return y


class PadBorder(torch.autograd.Function):
    """A border tile's own share of a window op's padding, into the arena; its gradient is the
    inner part of the output gradient."""

    @staticmethod
    def forward(ctx, x, pads, value, arena):
        ctx.inner = pads[2], x.shape[2], pads[0], x.shape[3]
        return padded_copy(arena, x, pads, value)

    @staticmethod
    def backward(ctx, g):
        top, height, left, width = ctx.inner
        return g.narrow(2, top, height).narrow(3, left, width), None, None, None


def pad_border(arena, x, pads, value):
    return PadBorder.apply(x, pads, value, arena)


def pooled(size, kernel, stride, padding, dilation):
    """Output length of a window op (no ceil mode) along one axis."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


class MaxPool2d(torch.autograd.Function):
    """A tile's max_pool2d, its result and indices in the arena; aten's kernels both ways."""

    @staticmethod
    def forward(ctx, x, kernel, stride, padding, dilation, arena):
        shape = (*x.shape[:2], *(pooled(x.shape[2 + i], kernel[i], stride[i], padding[i], dilation[i])
                                 for i in range(2)))
        layout = layout_of(x)
        y = arena.take(shape, x.dtype, x.device, layout)
        indices = arena.take(shape, torch.int64, x.device, layout)
        aten.max_pool2d_with_indices.out(dense(x), kernel, stride, padding, dilation, False, out=y, indices=indices)
        ctx.save_for_backward(x, indices)
        ctx.args = kernel, stride, padding, dilation
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, indices = ctx.saved_tensors
        return (aten.max_pool2d_with_indices_backward.default(g, x, *ctx.args, False, indices),
                None, None, None, None, None)


def max_pool(arena, x, kernel, stride, padding, dilation):
    """``MaxPool2d`` into the arena; where the kernels use none, and while dynamo traces the tile
    (it does not trace ``out=`` tensors that are channels-last), aten's own, which autograd
    back-propagates with the same kernel."""
    if not arena.kernels.arena or torch.compiler.is_compiling():
        return aten.max_pool2d_with_indices.default(x, kernel, stride, padding, dilation)[0]
    return MaxPool2d.apply(x, kernel, stride, padding, dilation, arena)


def onednn(x, w, arena):
    """Whether a tile convolution of ``x`` by ``w`` runs on oneDNN into ``arena``: where the
    device's kernels say so (``uses_onednn``) for a channels-last ``x`` and a ``w`` alike."""
    return (uses_onednn(arena.kernels, x.dtype, torch.is_autocast_enabled(x.device.type)) and w.dtype == x.dtype
            and x.is_contiguous(memory_format=torch.channels_last))


def undilated(w, dilation):
    """``dilation`` with the axes where ``w`` has one tap undilated: dilating them changes nothing,
    but some kernels crash on it (oneDNN's and aten's channels-last ones: a 1x1 kernel dilated 2,
    an input 1 wide, padding, stride 2 or more)."""
    return [1 if w.shape[2 + i] == 1 else dilation[i] for i in range(2)]


def convolve(arena, x, w, b, stride, padding, dilation, groups):
    """``conv2d(x, w, b)``: where ``onednn`` says so, written into the arena by oneDNN (which
    adds the convolution to the tensor it is given: the bias, broadcast) with ``w`` as the arena
    gives it (``Arena.packed``); elsewhere aten's ``conv2d``."""
    dilation = undilated(w, dilation)
    if not onednn(x, w, arena):
        return aten.conv2d.default(x, w, b, stride, padding, dilation, groups)
    shape = (x.shape[0], w.shape[0], *(pooled(x.shape[2 + i], w.shape[2 + i], stride[i], padding[i], dilation[i])
                                       for i in range(2)))
    y = arena.take(shape, x.dtype, x.device, torch.channels_last)
    if b is None:
        y.zero_()
    else:
        y.copy_(b.view(1, -1, 1, 1).expand(shape))
    if y.numel() == 0:
        return y
    mark = arena.top
    CONVOLVE_INTO.binary(y, x, arena.packed(w, x, stride, padding, dilation, groups), None, list(padding),
                         list(stride), list(dilation), groups, "add", 1.0, None, [], None)
    arena.top = mark
    return y


def gemm_weight_grad(x, w, stride, groups, arena):
    """Whether ``weight_grad`` computes this convolution's weight gradient: where the device's
    kernels say so (``uses_gemm_weight_grad``) for a channels-last ``x``. On some CPUs oneDNN's own
    channels-last weight gradient takes 1.5-3x as long there, on others half as long: the plan's
    race says which."""
    return (uses_gemm_weight_grad(arena.kernels, x.dtype, groups, stride, w.shape[2] * w.shape[3], w.shape[1])
            and x.is_contiguous(memory_format=torch.channels_last))


def weight_grad(g, x, kernel, dilation, arena):
    """Weight gradient of a stride-1 convolution of the channels-last, already padded ``x`` whose
    output gradient is ``g``: one matrix product per kernel tap. Flattened to (pixel, channel)
    rows, tap (a, b) pairs output pixel q with input pixel q + a * dilation * padded width +
    b * dilation when ``g`` is padded with zeros to the input's height and width: each tap is one
    contiguous slice of ``x``'s rows, and the padding rows contribute nothing. The padded
    gradient and the taps are scratch on top of ``arena`` (the caller releases them); the result
    is a view of the taps in the weight's shape."""
    n, channels, height, width = x.shape
    out, g_height, g_width = g.shape[1:]
    rows = arena.take((n, height, width, out), g.dtype, g.device)  # zeroing only the padding, not all of it
    rows[:, g_height:].zero_()
    rows[:, :g_height, g_width:].zero_()
    rows[:, :g_height, :g_width].copy_(g.permute(0, 2, 3, 1))
    rows = rows.view(-1, out)
    pixels = x.permute(0, 2, 3, 1).reshape(-1, channels)
    (kh, kw), (dh, dw) = kernel, dilation
    length = rows.shape[0] - (kh - 1) * dh * width - (kw - 1) * dw
    taps = arena.take((kh, kw, out, channels), g.dtype, g.device)
    for a in range(kh):
        for b in range(kw):
            start = a * dh * width + b * dw
            torch.mm(rows[:length].T, pixels[start:start + length], out=taps[a, b])
    return taps.permute(2, 3, 0, 1)


class Conv2d(torch.autograd.Function):
    """A tile's conv2d (``convolve``); its input and bias gradients from aten, its weight gradient
    from ``weight_grad`` where ``gemm_weight_grad`` says so, else from aten too. The backward
    runs in the dtype the forward computed in (autocast's, if it cast), which autograd casts back
    to the inputs'. ``weight_grad``'s result is added into the weight's ``grad`` here when the
    weight is a leaf (the tiles' parameters are), instead of being copied out of the arena for
    autograd to add: one weight-sized allocation fewer per tile."""

    @staticmethod
    def forward(ctx, x, w, b, stride, padding, dilation, groups, arena):
        y = convolve(arena, x, w, b, stride, padding, dilation, groups)
        ctx.save_for_backward(x, w)
        ctx.args = stride, padding, dilation, groups, b is not None
        ctx.arena = arena
        ctx.leaf = w if w.is_leaf else None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, w = (t.to(g.dtype) for t in ctx.saved_tensors)
        stride, padding, dilation, groups, bias = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        arena, mark = ctx.arena, ctx.arena.top
        gemm = need_w and gemm_weight_grad(x, w, stride, groups, arena)
        weight = arena.channels_last(w) if onednn(x, w, arena) else w
        # oneDNN computes a bias gradient together with the weight gradient: not on the GEMM path
        gx, gw, gb = aten.convolution_backward.default(
            g, x, weight, [w.shape[0]] if bias else None, stride, padding, dilation, False, [0, 0], groups,
            [need_x, need_w and not gemm, need_b and not gemm])
        arena.top = mark
        if gemm:
            if any(padding):
                x = padded_copy(arena, x, (padding[1], padding[1], padding[0], padding[0]), 0.0)
            gw = weight_grad(g, x, w.shape[2:], dilation, arena)
            gb = g.sum((0, 2, 3)) if need_b else None
            leaf = ctx.leaf
            if leaf is None or leaf.dtype != gw.dtype:
                gw = gw.contiguous()
            elif leaf.grad is None:
                leaf.grad, gw = gw.contiguous(), None
            else:
                leaf.grad.add_(gw)
                gw = None
        arena.top = mark
        return gx, gw, gb, None, None, None, None, None


def conv2d(x, w, b, stride, padding, dilation, groups, arena):
    """A tile's conv2d: ``Conv2d`` where the kernels may convolve through oneDNN or compute weight
    gradients as matrix products (the CPU's), and under autocast (``Conv2d`` keeps its inputs as
    they are for its backward, autograd would keep autocast's copies of them too); else aten's
    ``conv2d``, which autograd back-propagates with the same ``convolution_backward`` without a
    Python function's cost."""
    kernels = arena.kernels
    if kernels.onednn or kernels.gemm_min_channels is not None or torch.is_autocast_enabled(x.device.type):
        return Conv2d.apply(x, w, b, stride, padding, dilation, groups, arena)
    return aten.conv2d.default(x, w, b, stride, padding, undilated(w, dilation), groups)


class InPlace(torch.autograd.Function):
    """``op(x, *args)`` computed in place on ``x``, and back-propagated in place: ``grad(g, y,
    *args)`` overwrites the output gradient ``g`` with the input gradient, from the result
    ``y``. For a tile's activation whose one reader hands it a fresh gradient that nothing else
    reads (a convolution's or a pooling's): one gradient-sized allocation fewer per activation."""

    @staticmethod
    def forward(ctx, x, op, grad, *args):
        y = op(x, *args)
        ctx.mark_dirty(x)
        ctx.save_for_backward(y)
        ctx.grad, ctx.args = grad, args
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        y, = ctx.saved_tensors
        return ctx.grad(g, y, *ctx.args), None, None, *(None for _ in ctx.args)


def in_place(x, op, grad, *args):
    """``InPlace``; while dynamo traces the tile (it does not trace ``mark_dirty``), ``op`` itself,
    back-propagated by autograd's own derivative."""
    if torch.compiler.is_compiling():
        return op(x, *args)
    return InPlace.apply(x, op, grad, *args)


def relu_grad_(g, y):
    return aten.threshold_backward.grad_input(g, y, 0, grad_input=g)


def leaky_relu_grad_(g, y, slope=0.01):
    return aten.leaky_relu_backward.grad_input(g, y, slope, True, grad_input=g)



def hardtanh_grad_(g, y, low=-1.0, high=1.0):
    return aten.hardtanh_backward.grad_input(g, y, low, high, grad_input=g)


def adaptive_average(x, rows, cols):
    """Adaptive average pooling of a tile with the bins ``rows`` and ``cols`` (``(starts, stops)``,
    local to the tile, PyTorch's): a mean over each bin's rows, then over its columns."""
    x = torch.stack([x[:, :, a:b].mean(2) for a, b in zip(*rows, strict=True)], 2)
    return torch.stack([x[..., a:b].mean(3) for a, b in zip(*cols, strict=True)], 3)
