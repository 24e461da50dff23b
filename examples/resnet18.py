"""ResNet-18 (torchvision's layout and parameter names), written inline, in training mode.

Basic blocks [2, 2, 2, 2] with widths 64..512, a 7x7 stride-2 stem with a 3x3/2 max-pool,
1x1 convolution + BatchNorm shortcuts where the shape changes, and the classifier head (global
average pool, flatten, linear). BatchNorm trains with batch statistics and updates its running
statistics, as it does in ordinary training: tilec computes its statistics by sweeps over the tiles.
"""

import torch
from torch import nn

INPUT_SHAPE = (1, 3, 224, 224)


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """ResNet-18, or with ``blocks`` per stage another basic-block ResNet ((3, 4, 6, 3): ResNet-34)."""

    def __init__(self, num_classes: int = 1000, blocks: tuple[int, int, int, int] = (2, 2, 2, 2)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.inplanes = 64
        self.layer1 = self._layer(64, 1, blocks[0])
        self.layer2 = self._layer(128, 2, blocks[1])
        self.layer3 = self._layer(256, 2, blocks[2])
        self.layer4 = self._layer(512, 2, blocks[3])
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def _layer(self, planes: int, stride: int, blocks: int) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        layers += [BasicBlock(planes, planes) for _ in range(blocks - 1)]
        self.inplanes = planes
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18() -> nn.Module:
    return ResNet18().train()


def resnet34() -> nn.Module:
    """torchvision's ResNet-34 layout (``--attr resnet34``), in training mode."""
    return ResNet18(blocks=(3, 4, 6, 3)).train()


def resnet34_frozen() -> nn.Module:
    """ResNet-34 with frozen BatchNorm (``--attr resnet34_frozen``): in eval mode, its affine
    parameters not trained, as Lightstream's streaming ResNets train (``benchmarks/step.py
    --variant lightstream``)."""
    model = ResNet18(blocks=(3, 4, 6, 3)).eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.requires_grad_(False)
    return model


model = resnet18
