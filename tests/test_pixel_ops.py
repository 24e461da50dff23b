"""Every per-pixel op of one input tiles exactly: activations, elementwise math (logarithms,
trigonometry, ``erf``, shrinkage, rounding, ``sign``) and the compositions PyTorch builds of them
(``lp_pool2d``, ``softsign``, ``tanhshrink``), channels sliced with a step, variances over the
channels (timm's ``SimpleNorm2d``), maxima of two tensors and over the channels (CBAM's, ties among
a ReLU's zeros included), between two
convolutions, on odd grids; and each traced op is the one its entry names, with a per-pixel rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilec.ops import rule
from tilec.ops.pixel import Pixel
from tilec.trace import trace

from support.exactness import check_exact

SHAPE = (2, 3, 13, 11)


def _positive(y):
    return y.abs() + 1


#: aten op: what the model applies to the first convolution's output (the op among others)
OPS = {
    "relu": F.relu, "hardtanh": F.hardtanh, "leaky_relu": F.leaky_relu, "relu6": F.relu6,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp, "sqrt": lambda y: torch.sqrt(_positive(y)),
    "rsqrt": lambda y: torch.rsqrt(_positive(y)), "elu": F.elu, "selu": F.selu, "celu": F.celu, "gelu": F.gelu,
    "silu": F.silu, "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "mish": F.mish, "softplus": F.softplus,
    "log_sigmoid": F.logsigmoid, "clamp": lambda y: y.clamp(-0.5, 0.7), "clamp_min": lambda y: y.clamp_min(0.1),
    "clamp_max": lambda y: y.clamp_max(0.1), "abs": torch.abs, "square": torch.square, "neg": torch.neg,
    "log": lambda y: torch.log(_positive(y)), "log2": lambda y: torch.log2(_positive(y)),
    "log10": lambda y: torch.log10(_positive(y)), "log1p": lambda y: torch.log1p(y.abs()), "expm1": torch.expm1,
    "exp2": torch.exp2, "sin": torch.sin, "cos": torch.cos, "tan": lambda y: torch.tan(y / 4), "atan": torch.atan,
    "asinh": torch.asinh, "sinh": torch.sinh, "cosh": torch.cosh, "erf": torch.erf, "erfc": torch.erfc,
    "logit": lambda y: torch.logit(torch.sigmoid(y), eps=1e-6), "hardshrink": F.hardshrink,
    "softshrink": F.softshrink, "threshold": lambda y: F.threshold(y, 0.1, -2.0),
    "reciprocal": lambda y: torch.reciprocal(_positive(y)), "sign": lambda y: y * torch.sign(y),
    "sgn": lambda y: y * torch.sgn(y), "floor": lambda y: y + torch.floor(y), "ceil": lambda y: y + torch.ceil(y),
    "round": lambda y: y + torch.round(y, decimals=1), "trunc": lambda y: y + torch.trunc(y), "frac": torch.frac,
}

#: Compositions: the aten ops they trace to, each per pixel.
COMPOSED = {
    "lp_pool2d": (lambda y: F.lp_pool2d(y, 2, 3, 1), {"pow", "avg_pool2d", "sign", "relu", "mul"}),
    "softsign": (F.softsign, {"abs", "add", "div"}),
    "tanhshrink": (F.tanhshrink, {"tanh", "sub"}),
    "every_other_channel": (lambda y: torch.cat([y[:, 1::2] * 2, y[:, ::2]], 1), {"slice", "cat", "mul"}),
    "channel_variance": (lambda y: y * torch.rsqrt(y.var(1, keepdim=True) + 1e-5), {"var", "rsqrt", "mul"}),
    "channels_last_variance": (lambda y: (lambda z: z / (z.std(-1, keepdim=True, correction=0) + 1e-5))(
        y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2), {"permute", "std", "div"}),
    "channel_moments": (lambda y: (lambda v, m: (y - m) * v)(*torch.var_mean(y, 1, keepdim=True)),
                        {"var_mean", "getitem", "sub"}),
    "max_of_two": (lambda y: torch.max(y, torch.sigmoid(y)) + torch.min(y, F.relu(y)), {"maximum", "minimum"}),
    "channel_max_and_min": (lambda y: torch.cat([y.max(1, keepdim=True)[0], F.relu(y).min(1).values[:, None],
                                                 F.relu(y).max(1).indices[:, None].to(y.dtype), y.min(1)[0][:, None]],
                                                1),
                            {"max", "min", "getitem", "cat"}),
}


class Sandwich(nn.Module):
    """``op`` between two convolutions."""

    def __init__(self, op):
        super().__init__()
        self.first, self.op, self.last = nn.Conv2d(3, 4, 3, padding=1), op, nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.last(self.op(self.first(x)))


@pytest.mark.parametrize("grid", [(3, 2), (5, 4)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("name", list(OPS))
def test_a_per_pixel_op_tiles_exactly(name, grid):
    model = Sandwich(OPS[name])
    graph = trace(model, SHAPE)
    assert name in {node.op for node in graph} and all(node.tileable for node in graph)
    assert all(isinstance(rule(node), Pixel) for node in graph if node.op == name)
    check_exact(model, SHAPE, grid=grid, traced_as=f"sandwich {name}")


@pytest.mark.parametrize("name", list(COMPOSED))
def test_compositions_of_per_pixel_ops_tile_exactly(name):
    op, traced = COMPOSED[name]
    graph = trace(Sandwich(op), SHAPE)
    assert traced <= {node.op for node in graph} and all(node.tileable for node in graph)
    check_exact(Sandwich(op), SHAPE, grid=(4, 3))


class ConstantMaps(nn.Module):
    """Maps of the image's size made from no tensor beside the first convolution's: zero channels
    (``torch.empty``, as segmentation_models_pytorch's timm encoders stand in for a stride-2
    feature), zeros, ones and a constant concatenated with it, at full and half resolution; and
    ``zeros_like`` and its kin of it."""

    def __init__(self):
        super().__init__()
        self.first, self.down = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.last = nn.Conv2d(12, 2, 3, padding=1)

    def forward(self, x):
        n, _, h, w = x.shape
        y, half = self.first(x), self.down(x)
        like = {"dtype": x.dtype, "device": x.device}
        made = [torch.empty(n, 0, h, w, **like), torch.zeros(n, 1, h, w, **like), torch.ones(n, 1, h, w, **like),
                torch.full((n, 1, h, w), 0.5, **like)]
        halves = torch.cat([half, torch.empty(n, 0, half.shape[2], half.shape[3], **like)], 1)
        alike = [torch.zeros_like(y[:, :1]), torch.ones_like(y[:, :1]), torch.full_like(y[:, :1], 2.0),
                 torch.empty_like(y[:, :0])]
        return self.last(torch.cat([y, *made, *alike, F.interpolate(halves, size=(h, w))[:, :2]], 1))


@pytest.mark.parametrize("grid", [(2, 2), (3, 2), (5, 4)], ids=lambda g: f"{g[0]}x{g[1]}")
def test_constant_maps_made_from_no_tensor_tile_exactly(grid):
    graph = trace(ConstantMaps(), SHAPE)
    assert {"empty", "zeros", "ones", "full", "zeros_like", "full_like"} <= {node.op for node in graph}
    assert all(node.tileable for node in graph)
    check_exact(ConstantMaps(), SHAPE, grid=grid)
