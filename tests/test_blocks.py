"""Space to depth and depth to space written with views (``tilec.blocks``) become pixel
(un)shuffles and tile exactly: inline copies of TResNet's ``SpaceToDepth`` and timm's
``DepthToSpace``, timm's own modules, and TResNet itself, one block a stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tilec.trace import trace

from support.exactness import check_exact
from support.published import published

GRIDS = [(1, 1), (2, 2), (3, 2), (7, 5), (999, 999)]


class SpaceToDepth(nn.Module):
    """TResNet's stem, as timm writes it: (N, C, H, W) -> (N, r * r * C, H / r, W / r)."""

    def __init__(self, r: int = 4):
        super().__init__()
        self.r = r

    def forward(self, x):
        n, c, h, w = x.size()
        x = x.view(n, c, h // self.r, self.r, w // self.r, self.r).permute(0, 3, 5, 1, 2, 4).contiguous()
        return x.view(n, c * self.r * self.r, h // self.r, w // self.r)


class DepthToSpace(SpaceToDepth):
    """timm's inverse: (N, r * r * C, H, W) -> (N, C, r * H, r * W)."""

    def forward(self, x):
        n, c, h, w = x.size()
        x = x.view(n, self.r, self.r, c // self.r ** 2, h, w).permute(0, 3, 4, 1, 5, 2).contiguous()
        return x.view(n, c // self.r ** 2, h * self.r, w * self.r)


class Blocks(nn.Module):
    """A space-to-depth stem, convolutions with BatchNorm, depth to space back to full resolution,
    a skip from the input: every pixel block crosses tiles somewhere."""

    def __init__(self, to_depth: nn.Module, to_space: nn.Module, r: int):
        super().__init__()
        self.to_depth, self.to_space = to_depth, to_space
        self.body = nn.Sequential(nn.Conv2d(3 * r * r, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 2 * r * r, 3, padding=1))
        self.fuse = nn.Conv2d(5, 2, 3, padding=1)

    def forward(self, x):
        return self.fuse(torch.cat([x, self.to_space(self.body(self.to_depth(x)))], 1))


def _inline(r):
    return Blocks(SpaceToDepth(r), DepthToSpace(r), r)


def _timm(r):
    layers = published("timm.layers.space_to_depth")
    return Blocks(layers.SpaceToDepth(r), layers.DepthToSpace(r), r)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize(("make", "r"), [(_inline, 2), (_inline, 4), (_timm, 4)], ids=["inline2", "inline4", "timm4"])
def test_views_moving_pixel_blocks_tile_exactly(make, r, grid):
    check_exact(make(r).train(), (2, 3, 6 * r, 5 * r), grid=grid, eval_after=True)


def test_the_views_become_pixel_shuffles_and_every_node_tiles():
    graph = trace(_inline(4), (1, 3, 32, 24))
    ops = [node.op for node in graph]
    assert ops.count("pixel_unshuffle") == 1 and ops.count("pixel_shuffle") == 1
    assert all(node.tileable for node in graph)


def test_a_view_of_other_blocks_is_left_as_it_is():
    """A view cutting the rows into blocks of 2 and the columns into blocks of 3 is no shuffle."""

    class Uneven(nn.Module):
        def forward(self, x):
            n, c, h, w = x.shape
            return x.view(n, c, h // 2, 2, w // 3, 3).permute(0, 3, 5, 1, 2, 4).reshape(n, c * 6, h // 2, w // 3)

    graph = trace(Uneven(), (1, 3, 8, 9))
    assert not any("shuffle" in node.op for node in graph)


def test_tresnet_tiles_exactly():
    tresnet = published("timm.models.tresnet")
    torch.manual_seed(0)
    model = tresnet.TResNet(layers=[1, 1, 1, 1], num_classes=5, width_factor=0.25).train()
    assert all(node.tileable for node in trace(model, (1, 3, 96, 64)))  # its stem ran untiled before
    check_exact(model, (1, 3, 96, 64), grid=(3, 2), eval_after=True)
