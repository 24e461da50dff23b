"""The model behind the golden files: a small conv net with every common kind of layer.

conv 3x3 (padding 1) -> ReLU -> MaxPool 2 -> conv 3x3 (no padding) -> BatchNorm (eval) -> LeakyReLU,
on a 13x11 input: the output is 4x3, tiled 2x3 by the golden plan.
"""

import torch
from torch import nn

INPUT_SHAPE = (1, 3, 13, 11)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 5, 3),
        nn.BatchNorm2d(5),
        nn.LeakyReLU(0.1),
    ).eval()
