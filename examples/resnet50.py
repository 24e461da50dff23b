"""ResNet-50 (torchvision's layout and parameter names), written inline: the README's quick-start model.

Bottleneck blocks [3, 4, 6, 3] with widths 64..512 and expansion 4, the stride on the 3x3
convolution, 1x1 convolution + BatchNorm shortcuts where the shape changes, a 7x7 stride-2
stem with a 3x3/2 max-pool, and the classifier head (global average pool, flatten, linear).
BatchNorm runs in eval mode (frozen statistics), as fine-tuning a pretrained backbone on large
images often does: ``model`` (= ``resnet50``, which tilec calls) returns ``ResNet50().eval()``
(``examples/resnet18.py`` trains its BatchNorm with batch statistics). The parameter names
(conv1, bn1, layer1.0.conv1, layer1.0.downsample.0, fc...) are torchvision's, so its state_dicts
load as they are.
"""

import torch
from torch import nn

INPUT_SHAPE = (1, 3, 224, 224)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, width: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.inplanes = 64
        self.layer1 = self._layer(64, 3, 1)
        self.layer2 = self._layer(128, 4, 2)
        self.layer3 = self._layer(256, 6, 2)
        self.layer4 = self._layer(512, 3, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def _layer(self, width: int, blocks: int, stride: int) -> nn.Sequential:
        out = width * Bottleneck.expansion
        downsample = nn.Sequential(nn.Conv2d(self.inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
        layers = [Bottleneck(self.inplanes, width, stride, downsample)]
        self.inplanes = out
        layers += [Bottleneck(out, width) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50() -> nn.Module:
    return ResNet50().eval()


model = resnet50
