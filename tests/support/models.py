"""Small DAG models and their plans, shared by the validation and picture tests (no tests here).

Every model but ``swap`` (an H/W transpose: a stored segment after a tiled one) has a branch
that joins again: a residual add, a U-Net skip concatenated after a
transposed convolution, a squeeze-and-excitation scale (global pooling: with ``--grid`` one
tiled segment whose pooling runs by a sweep, level 1; ``SE_SPLIT`` gives the older layout, the
branch stored between two tiled segments). BatchNorm runs in eval mode. Odd input sizes make
the border tiles differ from the inner ones.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn
from torch.nn import functional

from tilec.ir import Plan
from tilec.pipeline import plan_for
from tilec.target import REFERENCE
from tilec.trace import trace

SHAPE = (1, 3, 23, 19)


class Lambda(nn.Module):
    """A module calling ``fn``: an op at a module path of the test's choosing."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Residual(nn.Module):
    """conv-bn-relu, a residual block (conv + skip add), a ceil-mode pool, a 1x1 head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.conv = nn.Conv2d(4, 4, 3, padding=2, dilation=2)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        y = torch.relu(self.bn(self.stem(x)))
        y = torch.relu(y + self.conv(y))
        return self.head(self.pool(y))


class UNetPiece(nn.Module):
    """Down (pool), up (transposed conv and bilinear upsampling), concatenated with the skip."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Conv2d(3, 4, 3, padding=1)
        self.down = nn.MaxPool2d(2)
        self.mid = nn.Conv2d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.dec = nn.Conv2d(12, 2, 3, padding=1)

    def forward(self, x):
        skip = torch.relu(self.enc(x))
        low = torch.relu(self.mid(self.down(skip)))
        up = functional.pad(self.up(low), (0, 1, 0, 1))
        smooth = functional.interpolate(low, size=skip.shape[2:], mode="bilinear", align_corners=False)
        return self.dec(torch.cat([skip, up, smooth], 1))


class SqueezeExcite(nn.Module):
    """conv, an SE scale (global pool, two 1x1 convs, sigmoid), the scaled map, a conv."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc1 = nn.Conv2d(4, 2, 1)
        self.fc2 = nn.Conv2d(2, 4, 1)
        self.out = nn.Conv2d(4, 2, 3, stride=2)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        scale = torch.sigmoid(self.fc2(torch.relu(self.fc1(functional.adaptive_avg_pool2d(y, 1)))))
        return self.out(y * scale)


class Swap(nn.Module):
    """conv, a transpose of H and W (no tile rule: it and what reads it run stored), a conv."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).transpose(2, 3))


MODELS = {"residual": Residual, "unet": UNetPiece, "se": SqueezeExcite, "swap": Swap}

#: The squeeze-and-excitation model cut as ``--grid 3x2`` cut it before reductions ran inside
#: tiled segments: the convolution tiled (nodes 0-1), the SE branch stored (pool, two 1x1
#: convolutions and their activations: 2-6), the scaled map and the last convolution tiled (7-8).
SE_SPLIT = ((0, 2, (3, 2)), (2, 7, (1, 1)), (7, 9, (3, 2)))


@cache
def graph(name: str, shape: tuple[int, ...] = SHAPE):
    torch.manual_seed(0)
    return trace(MODELS[name]().eval(), shape)


@cache
def grid_plan(name: str, grid: tuple[int, int] = (3, 2)) -> Plan:
    return plan_for(graph(name), REFERENCE, name, grid=grid)


@cache
def segment_plan(name: str, segments: tuple) -> Plan:
    return plan_for(graph(name), REFERENCE, name, segments=list(segments))
