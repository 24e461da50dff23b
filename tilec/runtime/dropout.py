"""Element-wise dropout on 4-D tensors whose masks do not depend on tiles: a counter-based generator.

PyTorch draws a dropout mask from one sequential stream over the whole tensor, which no tile can
reproduce. Here each element's keep decision is a hash of three things:

* the step's *seed*: 62 bits drawn from torch's default (CPU) generator by the first element-wise
  dropout a forward runs in training mode, kept for the rest of that forward (``step_stream``), so
  ``torch.manual_seed`` governs it and it is the same on every device;
* the op's *key*: the CRC-32 of ``"PATH#K"``, where PATH is the module the op runs in (its
  ``named_modules`` name, ``""`` for the model's own forward) and K counts the dropouts on 4-D tensors
  that module ran before it in the forward (``op_key``), which is stable across compiles and modes;
* the element's absolute index in the full tensor (row-major over its full shape).

The hash is MurmurHash3 (32-bit) of the index's two 32-bit words, seeded by the MurmurHash3 of the
seed's words and the key; an element is kept when the hash is at least ``p * 2**32``, and kept
elements are scaled by ``1 / (1 - p)`` (``p = 1`` drops everything), as PyTorch does. It is computed
with int64 tensor ops on values below 2**49, so it gives the same bits on every device. A tile gives
``element_dropout`` its block's origin in the full tensor, and draws exactly its own elements'
values: the mask does not depend on the grid, the tile order, the ranks or the device.

``counter_dropout(model)`` runs a plain (untiled) model with the same masks: inside it, every
``F.dropout`` (and so ``nn.Dropout``) on a 4-D tensor draws them, so that a plain step and a tiled step
with the same seed are equal. Dropout on tensors of other ranks stays PyTorch's.
"""

import contextlib
import zlib

import torch

#: The entry of a step's ``train`` dict (keyed by module paths) holding its dropout seed.
STEP_SEED = ("dropout", "seed")
_MASK32 = 0xFFFFFFFF


def _mul32(x, c):
    """``x * c`` modulo 2**32 for 32-bit ``x`` (an int or an int64 tensor) and a 32-bit constant ``c``,
    in 16-bit halves of ``c`` so that no product reaches 2**63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x, r):
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _mix_word(h, k):
    """One 32-bit word ``k`` into MurmurHash3's state ``h``."""
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _MASK32


def _finish(h, length):
    """MurmurHash3's finaliser after ``length`` bytes."""
    h = h ^ length
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def op_key(path, count):
    """The key of the ``count``-th dropout on a 4-D tensor run by module ``path`` in a forward."""
    return zlib.crc32(f"{path}#{count}".encode())


def step_stream(train, key, training, device):
    """The stream of op ``key`` in this step, a 0-d int64 tensor on ``device`` (a tiled segment keeps
    it among its leaves; on the tiles' device, a CUDA graph of a tile holds no CPU tensor), or
    ``None`` where the op is not training (``train``: the step's dict, where the seed is drawn on
    first use)."""
    if not training:
        return None
    if STEP_SEED not in train:
        train[STEP_SEED] = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64, device="cpu"))
    seed = train[STEP_SEED]
    h = _mix_word(_mix_word(_mix_word(0, seed & _MASK32), seed >> 32), key)
    return torch.tensor(_finish(h, 12), dtype=torch.int64, device=device)


def positions(shape, starts, full, device):
    """The row-major indices in a tensor of shape ``full`` of the block of ``shape`` at ``starts``
    (ints, or 0-d int64 tensors)."""
    index, stride = torch.zeros((), dtype=torch.int64, device=device), 1
    for d in reversed(range(len(full))):
        axis = (torch.arange(shape[d], dtype=torch.int64, device=device) + starts[d]) * stride
        index = index + axis.view([-1] + [1] * (len(full) - 1 - d))
        stride *= full[d]
    return index


def keep_mask(stream, shape, starts, full, p, device):
    """Which elements of the block of ``shape`` at ``starts`` of a ``full`` tensor dropout keeps
    (``stream``: an int or a 0-d int64 tensor, read by tensor ops only, so that ``torch.compile``
    traces it whole and does not compile it again for each step's seed)."""
    index = positions(shape, starts, full, device)
    h = _finish(_mix_word(_mix_word(stream, index & _MASK32), index >> 32), 8)
    return h >= min(int(p * 4294967296.0), 4294967296)


def element_dropout(x, stream, p, starts, full, inplace=False):
    """Dropout of ``x``, the block at ``starts`` of a tensor of shape ``full``, with ``stream``'s masks
    (``None``: the identity). Kept elements are scaled by ``1 / (1 - p)``; ``p = 1`` gives zeros."""
    if stream is None:
        return x
    keep = keep_mask(stream, x.shape, starts, full, p, x.device)
    scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
    return x.mul_(keep).mul_(scale) if inplace else x.mul(keep).mul_(scale)


@contextlib.contextmanager
def counter_dropout(model):
    """Run ``model`` (untiled) with these masks (module docstring): inside, each forward of ``model``
    draws a fresh seed at its first training-mode dropout of ``p > 0`` on a 4-D tensor. Patches
    ``torch.nn.functional.dropout`` for the whole process while it lasts."""
    state = {"stack": [], "counts": {}, "train": {}}

    def start(module, args):
        state["stack"], state["counts"], state["train"] = [""], {}, {}

    def enter(path):
        return lambda module, args: state["stack"].append(path)

    def leave(module, args, output):
        state["stack"].pop()

    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if input.dim() != 4 or not state["stack"]:
            return original(input, p, training, inplace)
        path = state["stack"][-1]
        count = state["counts"].get(path, 0)
        state["counts"][path] = count + 1
        if p == 0:  # the identity, drawing no seed, as the tiles run it (``tilec.ops.pixel.is_element_dropout``)
            return original(input, p, training, inplace)
        stream = step_stream(state["train"], op_key(path, count), training, input.device)
        return element_dropout(input, stream, p, (0,) * 4, tuple(input.shape), inplace)

    handles = [model.register_forward_pre_hook(start)]
    for path, module in model.named_modules():
        if path:
            handles.append(module.register_forward_pre_hook(enter(path)))
            handles.append(module.register_forward_hook(leave))
    torch.nn.functional.dropout = dropout
    try:
        yield model
    finally:
        torch.nn.functional.dropout = original
        for handle in handles:
            handle.remove()
