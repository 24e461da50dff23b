"""The model behind the golden files: a small DAG with the patterns tilec must tile.

stem conv 3x3 + BatchNorm (eval) + ReLU -> residual block (conv, ReLU, conv, add, ReLU) ->
max-pool 2 -> conv -> transposed conv 2x2/2 -> pad to the skip's size -> concat with the skip ->
conv + LeakyReLU (the "mask" output) and a head (global mean, linear: the "logits" output), on a
13x11 input. The golden plan cuts it into three segments: one through the residual block (its
skip crosses the cut), the decoder, and the stored head.
"""

import torch
import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (1, 3, 13, 11)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True))
        self.conv1 = nn.Conv2d(4, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.down = nn.Conv2d(4, 6, 3, padding=1)
        self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        self.fuse = nn.Conv2d(8, 5, 3, padding=1)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        skip = self.stem(x)
        x = F.relu(skip + self.conv2(F.relu(self.conv1(skip))))
        x = self.up(self.down(self.pool(x)))
        x = F.pad(x, [0, skip.shape[3] - x.shape[3], 0, skip.shape[2] - x.shape[2]])
        mask = F.leaky_relu(self.fuse(torch.cat([skip, x], 1)), 0.1)
        return {"mask": mask, "logits": self.fc(mask.mean((2, 3)))}


def model() -> nn.Module:
    torch.manual_seed(0)
    small = Small()
    with torch.no_grad():
        bn = small.stem[1]
        bn.running_mean.copy_(torch.randn(4))
        bn.running_var.copy_(torch.rand(4) + 0.5)
        bn.weight.copy_(torch.randn(4))
        bn.bias.copy_(torch.randn(4))
    return small.eval()
