"""VGG16's convolutional layout at a quarter of its channel widths: small enough for bfloat16
autocast on a CPU without native bfloat16 kernels, and a model the cost model was not fitted on."""

from torch import nn

INPUT_SHAPE = (1, 3, 256, 256)

CONFIG = (16, 16, "M", 32, 32, "M", 64, 64, 64, "M", 128, 128, 128, "M", 128, 128, 128, "M")


def model() -> nn.Sequential:
    layers, channels = [], 3
    for width in CONFIG:
        if width == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            channels = width
    return nn.Sequential(*layers)
