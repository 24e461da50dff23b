"""Tiled == untiled (float64, max abs error <= 1e-10) for every layer kind and hyper-parameter.

The matrix is models x odd input sizes x grids; a grid finer than a model's output is left out.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from exactness import TOLERANCE, assert_exact, randomise_buffers
from torch import nn

from tilec.pipeline import build
from tilec.trace import trace

GRIDS = [(1, 1), (2, 2), (3, 2), (1, 5), (5, 1), (4, 4), (3, 7)]
SIZES = [(17, 15), (23, 21)]

S = nn.Sequential


def _models() -> dict[str, tuple[int, callable]]:
    """name -> (input channels, factory)."""
    return {
        # conv: kernel sizes, stride, padding forms, dilation, groups, bias
        "vgg_block_inplace_relu": (3, lambda: S(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(inplace=True), nn.MaxPool2d(2))),
        "conv_stride2_bn_relu6": (2, lambda: S(
            nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU6(), nn.Conv2d(4, 3, 3))),
        "rect_kernel_dilated_nobias_hardtanh": (2, lambda: S(
            nn.Conv2d(2, 3, (3, 5), padding=(1, 2), dilation=(2, 1), bias=False), nn.Hardtanh(-0.5, 0.7),
            nn.Conv2d(3, 2, (1, 3), stride=(1, 2)))),
        "same_even_kernel_leaky": (2, lambda: S(
            nn.Conv2d(2, 3, (4, 2), padding="same"), nn.LeakyReLU(0.2),
            nn.Conv2d(3, 3, 2, padding="same", dilation=(3, 2)), nn.LeakyReLU(0.2, inplace=True))),
        "valid_stride_elu": (3, lambda: S(
            nn.Conv2d(3, 4, (2, 3), stride=(2, 1), padding="valid"), nn.ELU(alpha=0.7),
            nn.Conv2d(4, 2, 3, stride=(1, 3), padding=(2, 0)))),
        "grouped_depthwise_gelu": (4, lambda: S(
            nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.GELU(),
            nn.Conv2d(6, 6, 3, padding=(0, 2), groups=6), nn.GELU(approximate="tanh"))),
        "dilated_conv_large_padding_silu": (2, lambda: S(
            nn.Conv2d(2, 3, 3, padding=4, dilation=3), nn.SiLU(), nn.Conv2d(3, 2, 3, padding=2, dilation=2))),
        "stride_exceeds_kernel": (2, lambda: S(
            nn.Conv2d(2, 3, 1, stride=3), nn.Tanh(), nn.Conv2d(3, 2, 2, stride=(1, 3), padding=1))),
        # a border tile of the 1x1 conv reads only its padding
        "padding_only_border": (2, lambda: S(
            nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 1, padding=2), nn.Conv2d(2, 2, (1, 2), padding=(1, 3)))),
        # max-pool: ceil_mode past the edge, padding, dilation, strides
        "max_pool_ceil_pad": (2, lambda: S(
            nn.Conv2d(2, 3, 3), nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), nn.SiLU())),
        "max_pool_ceil_past_edge": (2, lambda: S(
            nn.Conv2d(2, 2, 3, padding=1), nn.MaxPool2d(2, ceil_mode=True), nn.Conv2d(2, 3, 3, padding=1),
            nn.MaxPool2d((3, 2), stride=(3, 2), ceil_mode=True))),
        "max_pool_dilated": (2, lambda: S(
            nn.MaxPool2d((2, 3), stride=(1, 2), padding=1, dilation=(2, 1)), nn.Conv2d(2, 2, 3),
            nn.MaxPool2d(3, stride=1, dilation=2, ceil_mode=True))),
        "max_pool_overlapping_rect": (1, lambda: S(
            nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d((3, 1), stride=(2, 1), padding=(1, 0)))),
        # avg-pool: count_include_pad with padding, ceil_mode, divisor_override
        "avg_pool_include_pad": (2, lambda: S(
            nn.Conv2d(2, 3, 3, padding=1), nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=True))),
        "avg_pool_exclude_pad": (2, lambda: S(
            nn.Conv2d(2, 3, 3, padding=1), nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False))),
        "avg_pool_ceil_include_pad": (2, lambda: S(
            nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=True), nn.Conv2d(2, 2, 3),
            nn.AvgPool2d(2, ceil_mode=True))),
        "avg_pool_ceil_exclude_pad": (2, lambda: S(
            nn.Conv2d(2, 2, 2), nn.AvgPool2d((2, 3), stride=(2, 2), padding=(1, 1), ceil_mode=True,
                                             count_include_pad=False), nn.Hardswish())),
        "avg_pool_divisor_override": (2, lambda: S(
            nn.Conv2d(2, 2, 3, padding=1), nn.AvgPool2d(3, stride=2, padding=1, divisor_override=5),
            nn.AvgPool2d(2, ceil_mode=True, divisor_override=3))),
        # pointwise layers, chains of them, eval-only layers, nesting
        "pointwise_chain": (2, lambda: S(
            nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Sigmoid(), nn.Tanh(), nn.Hardswish(), nn.Identity(),
            nn.Conv2d(3, 2, 3))),
        "relu_first_then_sigmoid": (2, lambda: S(nn.ReLU(), nn.Sigmoid(), nn.Conv2d(2, 2, 3, padding=1))),
        "bn_first_affine_false": (3, lambda: S(
            nn.BatchNorm2d(3, affine=False), nn.Conv2d(3, 2, 3), nn.BatchNorm2d(2, eps=1e-3), nn.ELU())),
        "dropout_eval_nested": (2, lambda: S(
            nn.Conv2d(2, 3, 3, padding=1),
            S(nn.Dropout(0.5), nn.ReLU(inplace=True), S(nn.Dropout2d(0.3), nn.MaxPool2d(2))),
            nn.Conv2d(3, 2, 3, padding=1), nn.BatchNorm2d(2))),
        "everything_deep": (3, lambda: S(
            nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
            nn.Conv2d(4, 4, (3, 1), padding=(1, 0), groups=4), nn.GELU(),
            nn.AvgPool2d(2, stride=1, ceil_mode=True, count_include_pad=False), nn.Conv2d(4, 2, 1))),
    }


MODELS = _models()


def _output_hw(name: str, size: tuple[int, int]) -> tuple[int, int]:
    channels, factory = MODELS[name]
    graph = trace(factory().eval(), (1, channels, *size))
    shape = graph.nodes[graph.graph["output"]]["spec"].out_shape
    return shape[2], shape[3]


def _matrix():
    for name in MODELS:
        for size in SIZES:
            height, width = _output_hw(name, size)
            for grid in GRIDS:
                if grid[0] <= height and grid[1] <= width:
                    yield pytest.param(name, size, grid, id=f"{name}-{size[0]}x{size[1]}-grid{grid[0]}x{grid[1]}")


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(("name", "size", "grid"), list(_matrix()))
def test_exact(name, size, grid):
    torch.manual_seed(zlib.crc32(name.encode()))
    channels, factory = MODELS[name]
    assert_exact(factory().eval(), (1, channels, *size), grid)


def test_matrix_covers_every_layer_kind_and_option():
    """Every supported layer type appears, with the border-case options the matrix promises."""
    layers = [m for _, factory in MODELS.values() for m in factory().modules()]
    kinds = {type(m) for m in layers}
    for kind in (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d, nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.LeakyReLU, nn.ELU,
                 nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.Identity, nn.Dropout, nn.Dropout2d,
                 nn.BatchNorm2d, nn.Sequential):
        assert kind in kinds, kind
    convs = [m for m in layers if isinstance(m, nn.Conv2d)]
    assert {m.padding for m in convs} >= {"same", "valid"}
    assert any(m.groups > 1 for m in convs) and any(m.bias is None for m in convs)
    assert any(m.dilation != (1, 1) for m in convs) and any(m.stride != (1, 1) for m in convs)
    assert any(m.kernel_size[0] != m.kernel_size[1] for m in convs)
    assert any(m.padding == "same" and m.kernel_size[0] % 2 == 0 for m in convs)
    maxes = [m for m in layers if isinstance(m, nn.MaxPool2d)]
    assert any(m.ceil_mode for m in maxes) and any(m.dilation != 1 for m in maxes)
    avgs = [m for m in layers if isinstance(m, nn.AvgPool2d)]
    assert {(m.count_include_pad, m.padding != 0) for m in avgs} >= {(True, True), (False, True)}
    assert any(m.ceil_mode for m in avgs) and any(m.divisor_override for m in avgs)
    assert any(isinstance(m, nn.BatchNorm2d) and not m.affine for m in layers)
    assert any(isinstance(m, nn.ReLU) and m.inplace for m in layers)
    assert {m.approximate for m in layers if isinstance(m, nn.GELU)} == {"none", "tanh"}


# --- batch size ---------------------------------------------------------------------------------


@pytest.mark.parametrize("grid", [(1, 1), (2, 3), (4, 4)])
def test_batch_size_above_one(grid):
    torch.manual_seed(1)
    channels, factory = MODELS["everything_deep"]
    assert_exact(factory().eval(), (3, channels, 21, 19), grid)


def _reference(model, x, grad_out):
    x = x.clone().requires_grad_()
    y = model(x)
    return (y, *torch.autograd.grad(y, [x, *model.parameters()], grad_out))


def _errors(model, tiled, x, grad_out) -> list[float]:
    want = _reference(model, x, grad_out)
    x = x.clone().requires_grad_()
    y = tiled(x)
    got = (y, *torch.autograd.grad(y, [x, *model.parameters()], grad_out))
    return [(a - b).abs().max().item() for a, b in zip(want, got, strict=True)]


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_plan_for_one_batch_size_serves_another(batch):
    torch.manual_seed(2)
    channels, factory = MODELS["avg_pool_ceil_exclude_pad"]
    model = factory().double().eval()
    tiled = build(model, (2, channels, 17, 15), (3, 2))
    generator = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, channels, 17, 15, dtype=torch.float64, generator=generator)
    grad_out = torch.randn(model(x).shape, dtype=torch.float64, generator=generator)
    assert max(_errors(model, tiled, x, grad_out)) <= TOLERANCE


# --- gradients the exactness helper does not exercise -------------------------------------------


@pytest.mark.parametrize("name", ["bn_first_affine_false", "conv_stride2_bn_relu6", "pointwise_chain"])
@pytest.mark.parametrize("first", ["batch_norm", "relu", "max_pool", "as_is"])
def test_parameter_grads_when_input_needs_no_grad(name, first):
    """Training on images: the input needs no gradient, every parameter still gets its own."""
    torch.manual_seed(3)
    channels, factory = MODELS[name]
    lead = {"batch_norm": [nn.BatchNorm2d(channels)], "relu": [nn.ReLU()], "max_pool": [nn.MaxPool2d(2)],
            "as_is": []}[first]
    model = S(*lead, *factory()).double().eval()
    with torch.no_grad():
        randomise_buffers(model, torch.Generator().manual_seed(4))
    shape = (2, channels, 23, 21)
    x = torch.randn(shape, dtype=torch.float64)
    y = model(x)
    grad_out = torch.randn(y.shape, dtype=torch.float64)
    want = torch.autograd.grad(y, list(model.parameters()), grad_out)
    tiled = build(model, shape, (3, 2))
    got = torch.autograd.grad(tiled(x), list(model.parameters()), grad_out)
    for (param, _), a, b in zip(model.named_parameters(), want, got, strict=True):
        assert (a - b).abs().max().item() <= TOLERANCE, param


def test_frozen_parameters_get_no_grad_and_others_exact():
    torch.manual_seed(5)
    channels, factory = MODELS["everything_deep"]
    model = factory().double().eval()
    frozen = {"0.weight", "1.bias", "7.bias"}
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(1, channels, 23, 21, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(model(x).shape, dtype=torch.float64)
    want = torch.autograd.grad(model(x), [x, *trainable], grad_out)
    tiled = build(model, x.shape, (2, 3))
    got = torch.autograd.grad(tiled(x), [x, *trainable], grad_out)
    assert max((a - b).abs().max().item() for a, b in zip(want, got, strict=True)) <= TOLERANCE
    tiled(x).backward(grad_out)
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)


def test_grads_accumulate_like_pytorch():
    """``.backward()`` twice adds into ``.grad``, as untiled PyTorch does."""
    torch.manual_seed(6)
    channels, factory = MODELS["conv_stride2_bn_relu6"]
    model = factory().double().eval()
    x = torch.randn(1, channels, 17, 15, dtype=torch.float64)
    for _ in range(2):
        model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    tiled = build(model, x.shape, (4, 4))
    for _ in range(2):
        tiled(x).square().sum().backward()
    assert max((a - p.grad).abs().max().item() for a, p in zip(want, model.parameters(), strict=True)) <= TOLERANCE


@pytest.mark.parametrize(
    ("name", "segments"),
    [
        ("everything_deep", [(0, 4, (3, 3)), (4, 8, (2, 4))]),
        ("vgg_block_inplace_relu", [(0, 1, (5, 1)), (1, 3, (2, 2)), (3, 5, (1, 3))]),
        ("padding_only_border", [(0, 2, (4, 4)), (2, 4, (7, 3))]),
    ],
)
def test_segments(name, segments):
    torch.manual_seed(7)
    channels, factory = MODELS[name]
    assert_exact(factory().eval(), (2, channels, 23, 21), segments=segments)


# --- other dtypes -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("name", ["everything_deep", "avg_pool_ceil_exclude_pad", "same_even_kernel_leaky"])
def test_low_precision_runs_close_to_untiled(name, dtype, tolerance):
    """The generated module is dtype-generic: finite and close to untiled PyTorch in that dtype."""
    torch.manual_seed(8)
    channels, factory = MODELS[name]
    model = factory().eval()
    with torch.no_grad():
        randomise_buffers(model, torch.Generator().manual_seed(9))
    model = model.to(dtype)
    shape = (2, channels, 23, 21)
    x = torch.randn(shape).to(dtype)
    grad_out = torch.randn(model(x).shape).to(dtype)
    want = _reference(model, x, grad_out)
    tiled = build(model, shape, (3, 2))
    x_tiled = x.clone().requires_grad_()
    y = tiled(x_tiled)
    got = (y, *torch.autograd.grad(y, [x_tiled, *model.parameters()], grad_out))
    for index, (a, b) in enumerate(zip(want, got, strict=True)):
        assert b.dtype == dtype and b.shape == a.shape
        assert torch.isfinite(b).all(), index
        scale = max(a.abs().max().item(), 1.0)
        error = (a.float() - b.float()).abs().max().item()
        assert error <= tolerance * scale, (index, error, scale)
