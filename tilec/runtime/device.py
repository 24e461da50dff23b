"""What a tile's kernels are on each device: one table, ``kernels_for``.

On the CPU, tiles carve their tensors from a reused arena, convolve float32 through oneDNN's
convolution-into with weights packed once per forward pass, may compute a convolution's weight
gradient as matrix products (raced against the library's on the device: ``gemm_min_channels``),
and the process pins glibc's mmap threshold. Every other device (CUDA among them) runs the
*generic* path: aten's kernels on fresh tensors, which its caching allocator reuses (CUDA's on
expandable segments). The generic path can be forced on the CPU (``TiledModel(model,
kernels="generic")``), and so can the *compiled* one: the generic kernels with every tile function
compiled by ``torch.compile``, once per shape class (``tilec.runtime.compiled``), and on CUDA also
replayed as CUDA graphs: aten's kernels captured (``"cudagraphs"``), or inductor's
(``"reduce-overhead"``).
The cost model asks the same table what a plan's tiles will run.
"""

import sys
from dataclasses import dataclass, replace

import torch

from tilec.runtime.compiled import COMPILERS

#: oneDNN's convolution adding into a given tensor, and its reorder of a convolution weight into
#: its blocked layout, where this build of torch has them.
CONVOLVE_INTO = getattr(getattr(torch.ops, "mkldnn", None), "_convolution_pointwise_", None)
PACK = getattr(getattr(torch.ops, "mkldnn", None), "_reorder_convolution_weight", None)


@dataclass(frozen=True)
class Kernels:
    """The kernels of a device's tiles.

    ``arena``: tiles carve their own tensors (input copies, padding, convolution and pooling
    results) from one reused buffer. ``onednn``: float32 convolutions outside autocast run
    oneDNN's convolution-into the arena, weights packed in forward. ``gemm_min_channels``: from
    how many input channels a stride-1 convolution's weight gradient is matrix products
    (``None``: never). ``pin_allocator``: pin glibc's mmap threshold; ``expand_segments``: put
    CUDA's caching allocator on expandable segments (``tilec.runtime.memory``); ``compiler``: tile
    functions run compiled by ``torch.compile`` (``tilec.runtime.compiled.COMPILERS``):
    ``"compiled"`` by inductor, ``"reduce-overhead"`` by inductor in that mode (its kernels replayed
    as CUDA graphs), ``"cudagraphs"`` by its backend of that name (aten's kernels, no code
    generated, replayed as CUDA graphs); ``None``: run as they are.
    """

    arena: bool
    onednn: bool
    gemm_min_channels: int | None
    pin_allocator: bool
    expand_segments: bool = False
    compiler: str | None = None

    @property
    def compiled(self):
        """Whether tile functions run compiled by ``torch.compile``."""
        return self.compiler is not None

    @property
    def graphs(self):
        """Whether compiled tile functions replay as CUDA graphs, which write over what the previous
        replay returned (``tilec.runtime.sweeps`` copies what it keeps)."""
        return self.compiler is not None and COMPILERS[self.compiler].graphs


#: Aten's kernels on fresh tensors: every device but the CPU and CUDA.
GENERIC = Kernels(arena=False, onednn=False, gemm_min_channels=None, pin_allocator=False)
#: CUDA's: the generic kernels, its caching allocator on expandable segments.
CUDA = Kernels(arena=False, onednn=False, gemm_min_channels=None, pin_allocator=False, expand_segments=True)


#: ``TiledModel(..., kernels=...)``: each device's own kernels, the generic ones everywhere, or
#: those compiled (``COMPILERS``, each its own ``Kernels.compiler``).
KERNEL_CHOICES = ("auto", "generic", *COMPILERS)


def kernels_for(device_type, gemm_min_channels, choice="auto"):
    """The kernels of tiles on ``device_type`` ("cpu", "cuda"...) for a plan whose weight gradient
    race chose ``gemm_min_channels``; ``choice`` (``KERNEL_CHOICES``) "generic" forces
    ``GENERIC`` on the CPU (CUDA's kernels are generic already), the ``COMPILERS`` the device's
    generic kernels compiled ("cudagraphs" and "reduce-overhead" replayed as CUDA graphs; a device
    without them runs them compiled, ``tilec.runtime.compiled`` says so)."""
    if choice in COMPILERS:
        return replace(CUDA if device_type == "cuda" else GENERIC, compiler=choice)
    if device_type == "cuda":
        return CUDA
    if choice == "generic" or device_type != "cpu":
        return GENERIC
    return Kernels(arena=True, onednn=CONVOLVE_INTO is not None and PACK is not None,
                   gemm_min_channels=gemm_min_channels, pin_allocator=sys.platform.startswith("linux"))


def uses_onednn(kernels, dtype, autocast):
    """Whether a tile convolution computing in ``dtype`` (a ``torch.dtype``) runs on oneDNN into
    the arena: float32, outside ``autocast`` (which would cast it). The tensors must also be
    channels-last, as tiles make them."""
    return kernels.onednn and dtype == torch.float32 and not autocast


def uses_gemm_weight_grad(kernels, dtype, groups, stride, taps, in_channels):
    """Whether a tile convolution's weight gradient is the matrix products: float32 or float64,
    no groups, stride 1, a kernel of more than one tap and at least ``kernels.gemm_min_channels``
    input channels (channels-last tensors, as tiles make them)."""
    return (kernels.gemm_min_channels is not None and dtype in (torch.float32, torch.float64) and groups == 1
            and tuple(stride) == (1, 1) and taps > 1 and in_channels >= kernels.gemm_min_channels)
