"""On CUDA: tiled == untiled for a few zoo models, the model and its input moved to the GPU after
compiling (float64 within 1e-10, float32 within rounding), and a ``TiledModel`` on CUDA runs the
generic tile kernels (``tilec.runtime.device``: aten on fresh tensors, no arena buffer, no oneDNN,
no matrix-product weight gradient, no allocator pin) with the caching allocator on expandable
segments, which keeps what it reserves near what a tiled step allocates; compiled tile functions
(``kernels="compiled"``), and tiles replayed as CUDA graphs (``"cudagraphs"``, ``"reduce-overhead"``),
are exact there too.
Skipped without a CUDA device."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from tilec.codegen import load_source, render
from tilec.planner import plan
from tilec.runtime.arena import Arena
from tilec.runtime.device import CUDA, GENERIC
from tilec.runtime.kernels import max_pool
from tilec.target import Target
from tilec.trace import trace

from support.exactness import check_close, check_exact
from support.generated import Recorded, counting
from support.zoo import SHAPES, TRAIN_SHAPES, TRAIN_ZOO, ZOO, dropout_segmenter

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

#: A residual network, a U-Net with bilinear upsampling, one with transposed convolutions and
#: cropped skips, depthwise convolutions with an SE branch (stored segments), and wide convolutions
#: (the CPU would give them matrix-product weight gradients).
MODELS = ["resnet_basic", "unet_bilinear", "unet_crop", "efficientnet", "wide_convs"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("grid", [(2, 3), (5, 4)])
def test_tiled_equals_untiled_on_cuda_in_float64(name, grid):
    check_exact(ZOO[name](), SHAPES[name], grid=grid, device="cuda")


#: Training-mode models whose reductions run by sweeps: BatchNorm with batch statistics and a
#: pooled head, squeeze-and-excitation, stochastic depth and Dropout2d (masks drawn on the GPU under
#: one seed), GroupNorm, MONAI's BasicUNet (instance norm), a per-pixel loss.
TRAINING = ["resnet_head", "efficientnet_drop", "groupnorm_resnet", "basic_unet", "segmentation_loss"]


@pytest.mark.parametrize("name", TRAINING)
def test_training_mode_sweeps_on_cuda_in_float64(name):
    check_exact(TRAIN_ZOO[name](), TRAIN_SHAPES[name], grid=(3, 2), device="cuda")


def test_compiled_tiles_equal_untiled_on_cuda_in_float64():
    """``kernels="compiled"``: the tile functions compiled by ``torch.compile`` (Triton on CUDA)."""
    check_exact(TRAIN_ZOO["basic_unet"](), TRAIN_SHAPES["basic_unet"], grid=(2, 2), device="cuda", kernels="compiled")


@pytest.mark.parametrize("kernels", ["cudagraphs", "reduce-overhead"])
@pytest.mark.parametrize("batch", [None, 2])
def test_cuda_graph_tiles_equal_untiled_on_cuda_in_float64(batch, kernels):
    """``kernels="cudagraphs"`` (aten's kernels) and ``"reduce-overhead"`` (inductor's): every tile
    function captured as CUDA graphs (none skipped) and replayed tile after tile; training-mode
    BatchNorm by sweeps, tiles one by one and stacked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tilec: CUDA graphs skipped")
        warnings.filterwarnings("error", message="tilec: torch.compile failed")
        check_exact(TRAIN_ZOO["resnet_head"](), TRAIN_SHAPES["resnet_head"], grid=(4, 3), batch=batch, device="cuda",
                    kernels=kernels)


@pytest.mark.parametrize("kernels", ["cudagraphs", "reduce-overhead"])
def test_tiles_reading_their_origins_are_captured_as_cuda_graphs(kernels):
    """Element-wise Dropout in training mode (DeepLabV3's and FCN's heads): the tiles read their
    origins and the dropout's stream, on the GPU, and every function is captured (none skipped)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="tilec: CUDA graphs skipped")
        warnings.filterwarnings("error", message="tilec: torch.compile failed")
        check_exact(dropout_segmenter(), (2, 3, 17, 15), grid=(2, 2), device="cuda", kernels=kernels, counter=True)


@pytest.mark.parametrize("name", MODELS)
def test_tiled_is_close_to_untiled_on_cuda_in_float32(name):
    # cuDNN picks its algorithms per shape (tiles have other shapes than the whole map): within
    # float32 rounding of each tensor's scale, without TF32
    with torch.backends.cudnn.flags(allow_tf32=False), _no_tf32_matmul():
        check_close(ZOO[name](), SHAPES[name], grid=(3, 2), device="cuda")


class _no_tf32_matmul:
    def __enter__(self):
        self.before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.before


def test_a_tiled_model_on_cuda_runs_the_generic_kernels():
    name = "wide_convs"
    model = ZOO[name]()
    module = load_source(render(plan(trace(model, SHAPES[name]), Target(), name="wide", grid=(3, 2)))).__dict__
    model = model.cuda()
    x = torch.randn(SHAPES[name], device="cuda")
    with Recorded(module) as recorded:
        tiled = module["TiledModel"](model)
        for _ in range(2):  # the second step finds the arenas' sizes
            model.zero_grad()
            tiled(x).square().sum().backward()
    assert recorded.arenas and all(arena.kernels == module["CUDA"] for arena in recorded.arenas)
    assert CUDA == replace(GENERIC, expand_segments=True)
    assert recorded.used() == {"weight_grad": False, "return_freed_memory": False, "CONVOLVE_INTO": False,
                               "buffer": False}
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters())


def _small_batch_stride():
    # a size-1 batch dim's stride (4 here, as elementwise ops leave it) makes the map suggest the
    # contiguous layout to aten
    x = torch.randn(1, 4, 10, 10, dtype=torch.float64, device="cuda").as_strided((1, 4, 10, 10), (4, 1, 40, 4))
    assert x.is_contiguous(memory_format=torch.channels_last)
    return x


def _narrowed():
    # a tile pooling part of what it computed: not contiguous, but aten reads it channels-last
    x = torch.randn(1, 4, 10, 12, dtype=torch.float64, device="cuda").contiguous(memory_format=torch.channels_last)
    return x[:, :, :, 1:11]


@pytest.mark.parametrize("make", [_small_batch_stride, _narrowed])
def test_a_tile_max_pool_on_cuda_matches_aten_whatever_layout_aten_reads_its_input_in(make):
    # aten's CUDA kernel writes in the layout it reads the input in, whatever the result's strides
    x = make()
    got = max_pool(Arena(x.device, GENERIC, 0, False), x, (2, 2), (2, 2), (0, 0), (1, 1))
    assert torch.equal(got, F.max_pool2d(x.contiguous(), 2))


def test_a_forward_on_cuda_puts_the_caching_allocator_on_expandable_segments():
    """Measured with ResNet-50 at 16384² (docs/benchmarks.md): fixed segments reserved 1.31x what
    the step allocated, expandable ones 1.02x. ``return_freed_memory=False`` leaves it alone."""
    name = "wide_convs"
    model = ZOO[name]()
    module = load_source(render(plan(trace(model, SHAPES[name]), Target(), name="wide", grid=(3, 2)))).__dict__
    model = model.cuda()
    calls = []
    counting(module, "expand_cuda_segments", calls)
    x = torch.randn(SHAPES[name], device="cuda")
    module["TiledModel"](model, return_freed_memory=False)(x).sum().backward()
    assert calls == []
    module["TiledModel"](model)(x).sum().backward()
    assert calls == [()]
