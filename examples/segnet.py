"""SegNet (Badrinarayanan et al. 2017): VGG16's thirteen convolutions with BatchNorm as the encoder,
each of its five poolings keeping its indices, and a mirrored decoder that unpools to them.

    tilec compile examples/segnet.py --input-shape 1,3,4096,4096 --memory-budget 2GiB
"""

import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (1, 3, 512, 512)

ENCODER = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


def _stage(channels: int, widths: tuple[int, ...]) -> nn.Sequential:
    layers = []
    for width in widths:
        layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        channels = width
    return nn.Sequential(*layers)


class SegNet(nn.Module):
    """``classes`` per-pixel logits; every width multiplied by ``scale``."""

    def __init__(self, classes: int = 2, scale: float = 1.0):
        super().__init__()
        widths = [tuple(round(w * scale) for w in stage) for stage in ENCODER]
        ins = [3] + [stage[-1] for stage in widths[:-1]]
        self.encoder = nn.ModuleList(_stage(i, w) for i, w in zip(ins, widths, strict=True))
        outs = [widths[k - 1][-1] if k else classes for k in range(len(widths))]
        self.decoder = nn.ModuleList(_stage(w[-1], (*w[:0:-1], o)) for w, o in zip(widths, outs, strict=True))
        self.decoder[0][-1] = nn.Identity()  # the logits: no ReLU after the last BatchNorm

    def forward(self, x):
        kept = []
        for stage in self.encoder:
            x = stage(x)
            size = x.shape[2:]
            x, indices = F.max_pool2d(x, 2, return_indices=True)
            kept.append((indices, size))
        for stage, (indices, size) in zip(reversed(self.decoder), reversed(kept), strict=True):
            x = stage(F.max_unpool2d(x, indices, 2, output_size=size))
        return x


def segnet_quarter() -> SegNet:
    """A quarter of the widths (``--attr segnet_quarter``)."""
    return SegNet(scale=0.25)


model = SegNet
