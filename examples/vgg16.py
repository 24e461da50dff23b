"""VGG16's convolutional part (configuration D), the fused-tiling benchmark network.

The classifier (Linear layers) is left out: it is the untiled tail after the tiled part.
"""

from torch import nn

INPUT_SHAPE = (1, 3, 224, 224)

CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(in_channels: int = 3) -> nn.Sequential:
    layers = []
    for width in CONFIG:
        if width == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(in_channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            in_channels = width
    return nn.Sequential(*layers)


model = vgg16
