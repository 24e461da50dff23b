"""VGG16's convolutional part (configuration D), the fused-tiling benchmark network.

The classifier (Linear layers) is left out: it is the untiled tail after the tiled part.
"""

from torch import nn

INPUT_SHAPE = (1, 3, 224, 224)

CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(in_channels: int = 3, scale: float = 1.0) -> nn.Sequential:
    """The layout with every width multiplied by ``scale``."""
    layers = []
    for width in CONFIG:
        if width == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(in_channels, round(width * scale), kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            in_channels = round(width * scale)
    return nn.Sequential(*layers)


def vgg16_quarter() -> nn.Sequential:
    """A quarter of the widths: small enough for bfloat16 autocast on a CPU without native
    bfloat16 kernels (``--attr vgg16_quarter``)."""
    return vgg16(scale=0.25)


model = vgg16
