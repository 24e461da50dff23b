"""Every per-pixel op of one input tiles exactly: activations, elementwise math (logarithms,
trigonometry, ``erf``, shrinkage, rounding, ``sign``) and the compositions PyTorch builds of them
(``lp_pool2d``, ``softsign``, ``tanhshrink``) and channels sliced with a step, between two
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
    check_exact(model, SHAPE, grid=grid)


@pytest.mark.parametrize("name", list(COMPOSED))
def test_compositions_of_per_pixel_ops_tile_exactly(name):
    op, traced = COMPOSED[name]
    graph = trace(Sandwich(op), SHAPE)
    assert traced <= {node.op for node in graph} and all(node.tileable for node in graph)
    check_exact(Sandwich(op), SHAPE, grid=(4, 3))
