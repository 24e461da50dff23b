"""MONAI's default 2-D ``BasicUNet`` (``monai.networks.nets.BasicUNet(spatial_dims=2)``), written inline.

Features (32, 32, 64, 128, 256, 32): a ``TwoConv`` block (3x3 convolution, instance norm with
affine parameters, LeakyReLU 0.1, twice) at each of five levels, 2x2 max-pooling down, 2x2
transposed convolutions up (halving the channels, except at the top), replicate padding by one
pixel where the encoder feature is larger, concatenation with the skip, a ``TwoConv``, and a
final 1x1 convolution to the classes (2). Instance norm normalises each image's channels over
the whole image: tilec computes its statistics by sweeps over the tiles. ``model`` returns it in
training mode (instance norm without running statistics computes the same in eval mode).
"""

import torch
import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (1, 3, 256, 256)
FEATURES = (32, 32, 64, 128, 256, 32)


class TwoConv(nn.Sequential):
    def __init__(self, inputs: int, outputs: int):
        super().__init__(
            nn.Conv2d(inputs, outputs, 3, padding=1), nn.InstanceNorm2d(outputs, affine=True),
            nn.LeakyReLU(0.1, inplace=True),
            nn.Conv2d(outputs, outputs, 3, padding=1), nn.InstanceNorm2d(outputs, affine=True),
            nn.LeakyReLU(0.1, inplace=True),
        )


class Down(nn.Sequential):
    def __init__(self, inputs: int, outputs: int):
        super().__init__(nn.MaxPool2d(2), TwoConv(inputs, outputs))


class UpCat(nn.Module):
    def __init__(self, inputs: int, cat: int, outputs: int, halves: bool = True):
        super().__init__()
        up = inputs // 2 if halves else inputs
        self.upsample = nn.ConvTranspose2d(inputs, up, 2, stride=2)
        self.convs = TwoConv(cat + up, outputs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.upsample(x)
        pad = [0, int(skip.shape[3] != x.shape[3]), 0, int(skip.shape[2] != x.shape[2])]
        x = F.pad(x, pad, "replicate")
        return self.convs(torch.cat([skip, x], dim=1))


class BasicUNet(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 2, features=FEATURES):
        super().__init__()
        f = features
        self.conv_0 = TwoConv(channels, f[0])
        self.down_1, self.down_2 = Down(f[0], f[1]), Down(f[1], f[2])
        self.down_3, self.down_4 = Down(f[2], f[3]), Down(f[3], f[4])
        self.upcat_4, self.upcat_3 = UpCat(f[4], f[3], f[3]), UpCat(f[3], f[2], f[2])
        self.upcat_2, self.upcat_1 = UpCat(f[2], f[1], f[1]), UpCat(f[1], f[0], f[5], halves=False)
        self.final_conv = nn.Conv2d(f[5], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.conv_0(x)
        x1 = self.down_1(x0)
        x2 = self.down_2(x1)
        x3 = self.down_3(x2)
        x4 = self.down_4(x3)
        u4 = self.upcat_4(x4, x3)
        u3 = self.upcat_3(u4, x2)
        u2 = self.upcat_2(u3, x1)
        u1 = self.upcat_1(u2, x0)
        return self.final_conv(u1)


def basic_unet() -> nn.Module:
    return BasicUNet().train()


model = basic_unet
