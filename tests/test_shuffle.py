"""Pixel shuffles tile exactly: ``pixel_shuffle`` (sub-pixel upsampling: ESPCN and EDSR's
upsamplers, fastai's ``PixelShuffle_ICNR`` with its blur) and ``pixel_unshuffle`` (a
space-to-depth stem), on uneven sizes, odd grids, in training mode and with tiles stacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilec.ops.shuffle import PixelShuffle
from tilec.regions import Interval
from tilec.trace import trace

from support.exactness import check_exact

GRIDS = [(1, 1), (2, 2), (3, 2), (4, 3), (7, 5), (999, 999)]


class SubPixel(nn.Module):
    """ESPCN's upsampler twice (x2, then x3) between convolutions, BatchNorm after the first."""

    def __init__(self):
        super().__init__()
        self.head = nn.Conv2d(3, 8, 3, padding=1)
        self.up2 = nn.Conv2d(8, 4 * 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.up3 = nn.Conv2d(4, 2 * 9, 1)
        self.tail = nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y = F.relu(self.norm(F.pixel_shuffle(self.up2(F.relu(self.head(x))), 2)))
        return self.tail(F.pixel_shuffle(self.up3(y), 3))


class ShuffleICNR(nn.Module):
    """fastai's ``PixelShuffle_ICNR`` with ``blur``: 1x1 convolution, ReLU, shuffle, then a
    replication pad and a 2x2 average pool of stride 1; and a skip from the input, concatenated."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.conv = nn.Conv2d(6, 4 * 4, 1)
        self.blur = nn.Sequential(nn.ReplicationPad2d((1, 0, 1, 0)), nn.AvgPool2d(2, stride=1))
        self.fuse = nn.Conv2d(7, 2, 3, padding=1)

    def forward(self, x):
        up = self.blur(F.pixel_shuffle(F.relu(self.conv(F.relu(self.down(x)))), 2))
        return self.fuse(torch.cat([x, up[:, :, :x.shape[2], :x.shape[3]]], 1))


class SpaceToDepthStem(nn.Module):
    """A 4x4 space-to-depth stem (``pixel_unshuffle``), then convolutions and global pooling."""

    def __init__(self, r: int = 4):
        super().__init__()
        self.r = r
        self.conv = nn.Conv2d(3 * r * r, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        y = F.relu(self.norm(self.conv(F.pixel_unshuffle(x, self.r))))
        return y, self.head(y.mean((2, 3)))


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("kernels", ["auto", "generic"])
def test_sub_pixel_upsampling_tiles_exactly(grid, kernels):
    check_exact(SubPixel().train(), (2, 3, 11, 9), grid=grid, kernels=kernels)


@pytest.mark.parametrize("grid", GRIDS)
def test_shuffle_with_blur_and_a_skip_tiles_exactly(grid):
    check_exact(ShuffleICNR(), (1, 3, 17, 13), grid=grid)


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("r", [2, 4])
def test_space_to_depth_stem_tiles_exactly(grid, r):
    check_exact(SpaceToDepthStem(r).train(), (2, 3, 8 * r, 5 * r), grid=grid)


@pytest.mark.parametrize("model", [SubPixel, SpaceToDepthStem], ids=["shuffle", "unshuffle"])
def test_stacked_tiles_shuffle_exactly(model):
    check_exact(model().train(), (1, 3, 24, 20), grid=(4, 3), batch=4)


def test_shuffles_run_in_tiles():
    for model, shape in ((SubPixel(), (1, 3, 11, 9)), (SpaceToDepthStem(), (1, 3, 16, 12))):
        graph = trace(model, shape)
        assert all(node.tileable for node in graph if "shuffle" in node.op)


@pytest.mark.parametrize(("out", "read"), [((0, 0), (0, 0)), ((0, 5), (0, 3)), ((3, 7), (1, 4)), ((4, 6), (2, 3))])
def test_a_shuffle_reads_the_blocks_its_outputs_come_from(out, read):
    graph = trace(SubPixel(), (1, 3, 11, 9))
    node = next(node for node in graph if node.op == "pixel_shuffle")
    (need,) = PixelShuffle("pixel_shuffle").need(node, 0, Interval(*out), graph)
    assert need.interval == Interval(*read)


class ShuffledChannelsLast(nn.Module):
    """``pixel_unshuffle`` of a channels-last map: its blocks are of columns and channels, not of
    the image's rows and columns; it runs untiled, not refused."""

    def __init__(self):
        super().__init__()
        self.conv, self.out = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x):
        return self.out(F.pixel_unshuffle(self.conv(x).permute(0, 2, 3, 1), 2).permute(0, 3, 1, 2))


def test_a_shuffle_of_other_dims_runs_untiled():
    graph = trace(ShuffledChannelsLast(), (1, 3, 8, 10))
    assert not next(node for node in graph if node.op == "pixel_unshuffle").tileable
    check_exact(ShuffledChannelsLast(), (1, 3, 8, 10), grid=(2, 2))
