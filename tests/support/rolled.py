"""A model file for ``tests/test_memory.py``: VGG16's layout at a quarter of its widths with its
feature map rolled by three pixels along the rows after the second pooling. ``roll`` has no tile
rule: it runs untiled, in a stored segment between tiled ones."""

import runpy
from pathlib import Path

import torch
from torch import nn

INPUT_SHAPE = (1, 3, 224, 224)

VGG16 = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "vgg16.py"))["vgg16"]


class Rolled(nn.Module):
    def __init__(self):
        super().__init__()
        layers = list(VGG16(scale=0.25))
        self.early, self.late = nn.Sequential(*layers[:10]), nn.Sequential(*layers[10:])

    def forward(self, x):
        return self.late(torch.roll(self.early(x), 3, 2))


model = Rolled
