"""The classic U-Net (Ronneberger et al. 2015), written inline, with padded convolutions.

Five levels with 64, 128, 256, 512 and 1024 channels; each level is a pair of 3x3
convolutions with BatchNorm and ReLU; 2x2 max-pooling between encoder levels; 2x2
up-convolutions (transposed, stride 2) in the decoder, padded to the skip's size when the
input is not a multiple of 16, concatenated with the skip, and a pair of 3x3 convolutions;
a final 1x1 convolution to the classes (2). BatchNorm runs in eval mode, the mode tilec tiles:
``model`` (= ``unet``) returns ``UNet().eval()``. ``INPUT_SHAPE`` is 256x256; any size works, sizes
not divisible by 16 go through the decoder's padding.
"""

import torch
import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (1, 3, 256, 256)
WIDTHS = (64, 128, 256, 512, 1024)


class DoubleConv(nn.Sequential):
    def __init__(self, inputs: int, outputs: int):
        super().__init__(
            nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True),
        )


class Up(nn.Module):
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(inputs, inputs // 2, kernel_size=2, stride=2)
        self.conv = DoubleConv(inputs, outputs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        dy, dx = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    def __init__(self, channels: int = 3, classes: int = 2):
        super().__init__()
        self.inc = DoubleConv(channels, WIDTHS[0])
        self.down = nn.ModuleList(DoubleConv(a, b) for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(Up(a, b) for a, b in zip(WIDTHS[:0:-1], WIDTHS[-2::-1], strict=True))
        self.outc = nn.Conv2d(WIDTHS[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(self.pool(skips[-1])))
        x = skips.pop()
        for up in self.up:
            x = up(x, skips.pop())
        return self.outc(x)


def unet() -> nn.Module:
    return UNet().eval()


model = unet
