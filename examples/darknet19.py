"""Darknet-19 (YOLOv2's backbone), the second fused-tiling benchmark network.

Each convolution is followed by BatchNorm and LeakyReLU(0.1). BatchNorm runs in eval mode
(frozen statistics), the mode tilec can tile. The global average pool of the classifier is
left out: it is the untiled tail after the tiled part.
"""

from torch import nn

INPUT_SHAPE = (1, 3, 256, 256)

# (output channels, kernel size) per convolution; "M" is a 2x2 max-pool.
CONFIG = (
    (32, 3), "M", (64, 3), "M", (128, 3), (64, 1), (128, 3), "M", (256, 3), (128, 1), (256, 3), "M",
    (512, 3), (256, 1), (512, 3), (256, 1), (512, 3), "M",
    (1024, 3), (512, 1), (1024, 3), (512, 1), (1024, 3),
)


def darknet19(in_channels: int = 3, classes: int = 1000) -> nn.Sequential:
    layers = []
    for item in CONFIG:
        if item == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        width, kernel = item
        layers += [
            nn.Conv2d(in_channels, width, kernel, padding=kernel // 2, bias=False),
            nn.BatchNorm2d(width),
            nn.LeakyReLU(0.1, inplace=True),
        ]
        in_channels = width
    layers.append(nn.Conv2d(in_channels, classes, kernel_size=1))
    return nn.Sequential(*layers).eval()


model = darknet19
