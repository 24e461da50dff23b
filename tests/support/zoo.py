"""A zoo of small real-world CNN architectures, written inline, for the exactness tests.

Each entry of ``ZOO`` is a builder returning a fresh, deterministic (``torch.manual_seed``) model
in eval mode, with non-trivial BatchNorm statistics and affine parameters, small enough (4 to 24
channels) that a float64 forward + backward at its ``SHAPES`` entry takes milliseconds. The
blocks are written the way torchvision and the common reference implementations write them (in
place ``+=`` and ReLU, ``torch.cat``, ``chunk``, ``view``/``transpose`` channel shuffles,
``permute`` + ``LayerNorm`` + ``Linear``, ``F.pad`` and ``F.interpolate`` in U-Net decoders, dict
outputs...) so that the suite compiles the patterns it will meet in users' models. The default
shapes are odd and uneven on purpose. Builders return float32 models: callers convert them.

``TRAIN_ZOO`` (at the end) builds models in training mode, at ``TRAIN_SHAPES`` (tiny odd images):
BatchNorm with batch statistics, GroupNorm, instance norm (MONAI's BasicUNet), ConvNeXt's head,
stochastic depth and Dropout2d, global max pooling with ties, a per-pixel loss: the reductions
that run inside tiled segments by sweeps (``tests/test_sweeps.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import astuple, replace

import torch
import torch.nn.functional as F
from torch import nn

from tilec.calibrate import cached
from tilec.clock import cache_keys
from tilec.target import KERNEL_STATE_BYTES, REFERENCE_SPEED, Target

#: Bytes per kernel (``Target.kernel_state``) for tests of the budget search on tiny models, whose
#: tensors take a few KiB: enough to steer the search between grids without drowning out the
#: tensors, as ``tilec.target.KERNEL_STATE_BYTES`` (84 KiB per kernel) would.
TINY_KERNEL_STATE = 256
#: The reference target with ``TINY_KERNEL_STATE``.
TINY = Target(kernel_state=TINY_KERNEL_STATE)


def seed_reference_speed() -> None:
    """Write ``REFERENCE_SPEED`` (no kinds' rates) into the calibration cache (``XDG_CACHE_HOME``)
    as this machine's speed on the CPU (and CUDA, where it runs) in every float dtype, so that
    budget searches in subprocesses, which the in-process stand-in for ``tilec.clock`` does not
    reach, rank plans at the reference too rather than timing a machine the suite's other workers
    keep busy (where timings are not cached: every search would time it again). The weight-gradient
    race is left to run: it takes a second."""
    for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        for dtype in ("float32", "float64", "bfloat16", "float16"):
            _, speed_key, rates_key = cache_keys(device, dtype)
            cached(speed_key, lambda: list(astuple(REFERENCE_SPEED)[:3]), list)
            cached(rates_key, list, list)


def reference_kernels(target: Target, dtype: str) -> Target:
    """``tilec.calibrate.measure_kernels`` as the tests stand it in: ``KERNEL_STATE_BYTES`` per
    kernel, not this machine's measurement, so that smallest feasible budgets do not move with it."""
    return replace(target, kernel_state=KERNEL_STATE_BYTES)

# --------------------------------------------------------------------------------------------
# helpers


def _finish(model: nn.Module) -> nn.Module:
    """Random BatchNorm statistics and affine parameters (so eval BN is no identity), eval mode."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.copy_(torch.randn_like(module.running_mean))
                module.running_var.copy_(torch.rand_like(module.running_var) + 0.5)
                module.weight.copy_(torch.randn_like(module.weight))
                module.bias.copy_(torch.randn_like(module.bias))
    return model.eval()


def conv_bn(inputs: int, outputs: int, kernel: int = 3, stride: int = 1, padding: int | None = None,
            groups: int = 1, activation: type[nn.Module] | None = nn.ReLU) -> nn.Sequential:
    """Conv (no bias) + BatchNorm (+ activation): the ``Conv2dNormActivation`` of torchvision."""
    padding = kernel // 2 if padding is None else padding
    layers = [nn.Conv2d(inputs, outputs, kernel, stride, padding, groups=groups, bias=False), nn.BatchNorm2d(outputs)]
    if activation is not None:
        layers.append(activation(inplace=True) if activation in (nn.ReLU, nn.ReLU6, nn.SiLU, nn.Hardswish)
                      else activation())
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------------------------
# ResNets


class BasicBlock(nn.Module):
    expansion = 1

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


def _downsample(inputs: int, outputs: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False), nn.BatchNorm2d(outputs))


class ResNetBasic(nn.Module):
    """3x3 stem, a BasicBlock, a stride-2 BasicBlock with a 1x1 conv + BN shortcut."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = BasicBlock(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2, downsample=_downsample(8, 16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        return self.layer2(self.layer1(x))


class ResNetHead(ResNetBasic):
    """ResNetBasic with torchvision's classifier head: global average pool, flatten, linear."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


class ResNetBottleneck(nn.Module):
    """ResNet-50's 7x7/2 stem and 3x3/2 max-pool, then Bottleneck blocks (expansion 4)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = nn.Sequential(Bottleneck(8, 4, downsample=_downsample(8, 16, 1)), Bottleneck(16, 4))
        self.layer2 = nn.Sequential(Bottleneck(16, 4, stride=2, downsample=_downsample(16, 16, 2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.layer2(self.layer1(x))


class PreActBlock(nn.Module):
    """Pre-activation block (He et al. 2016): BN-ReLU-conv, BN-ReLU-conv, add."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inputs)
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.shortcut = None
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(x))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(F.relu(self.bn2(out)))
        return out + shortcut


class PreActResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.layer1 = PreActBlock(8, 8)
        self.layer2 = PreActBlock(8, 12, stride=2)
        self.layer3 = PreActBlock(12, 12)
        self.bn = nn.BatchNorm2d(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer3(self.layer2(self.layer1(self.conv1(x))))
        return F.relu(self.bn(x))


# --------------------------------------------------------------------------------------------
# MobileNet V2 / V3, EfficientNet, squeeze-and-excitation


class InvertedResidual(nn.Module):
    """MobileNetV2 block: expand 1x1, depthwise 3x3, linear project 1x1; residual if shapes allow."""

    def __init__(self, inputs: int, outputs: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = inputs * expand_ratio
        self.use_res_connect = stride == 1 and inputs == outputs
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(conv_bn(inputs, hidden, 1, activation=nn.ReLU6))
        layers += [
            conv_bn(hidden, hidden, 3, stride, groups=hidden, activation=nn.ReLU6),
            nn.Conv2d(hidden, outputs, 1, bias=False),
            nn.BatchNorm2d(outputs),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, stride=2, activation=nn.ReLU6)
        self.blocks = nn.Sequential(
            InvertedResidual(8, 8, 1, 1),
            InvertedResidual(8, 12, 2, 2),
            InvertedResidual(12, 12, 1, 2),
        )
        self.last = conv_bn(12, 16, 1, activation=nn.ReLU6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.blocks(self.stem(x)))


class SqueezeExcitation(nn.Module):
    """Global average pool, 1x1 reduce, activation, 1x1 expand, gate, rescale."""

    def __init__(self, channels: int, squeeze: int, activation: type[nn.Module] = nn.ReLU,
                 gate: type[nn.Module] = nn.Sigmoid):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.activation = activation()
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        scale = self.gate(self.fc2(self.activation(self.fc1(scale))))
        return x * scale


class SqueezeExciteNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = conv_bn(3, 8, 3)
        self.se1 = SqueezeExcitation(8, 4)
        self.block2 = conv_bn(8, 16, 3, stride=2)
        self.se2 = SqueezeExcitation(16, 4)
        self.block3 = conv_bn(16, 16, 3)
        self.se3 = SqueezeExcitation(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.se1(self.block1(x))
        x = self.se2(self.block2(x))
        return x + self.se3(self.block3(x))


class MBConv(nn.Module):
    """EfficientNet block: expand 1x1, depthwise kxk, SE (SiLU / Sigmoid), project 1x1; residual."""

    def __init__(self, inputs: int, outputs: int, kernel: int, stride: int, expand_ratio: int):
        super().__init__()
        hidden = inputs * expand_ratio
        self.use_res_connect = stride == 1 and inputs == outputs
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(conv_bn(inputs, hidden, 1, activation=nn.SiLU))
        layers += [
            conv_bn(hidden, hidden, kernel, stride, groups=hidden, activation=nn.SiLU),
            SqueezeExcitation(hidden, max(1, inputs // 4), activation=nn.SiLU, gate=nn.Sigmoid),
            conv_bn(hidden, outputs, 1, activation=None),
        ]
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if self.use_res_connect:
            out = out + x
        return out


class EfficientNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, stride=2, activation=nn.SiLU)
        self.blocks = nn.Sequential(
            MBConv(8, 8, 3, 1, 1),
            MBConv(8, 12, 5, 2, 2),
            MBConv(12, 12, 3, 1, 2),
        )
        self.head_conv = conv_bn(12, 16, 1, activation=nn.SiLU)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.head_dropout = nn.Dropout(0.2)
        self.classifier = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head_conv(self.blocks(self.stem(x)))
        x = torch.flatten(self.avgpool(x), 1)
        return self.classifier(self.head_dropout(x))


class MobileNetV3Block(nn.Module):
    """Hardswish stem, an inverted residual with a Hardsigmoid SE, then a 1x1 conv + Mish."""

    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, activation=nn.Hardswish)
        self.expand = conv_bn(8, 16, 1, activation=nn.Hardswish)
        self.depthwise = conv_bn(16, 16, 3, groups=16, activation=nn.Hardswish)
        self.se = SqueezeExcitation(16, 4, activation=nn.ReLU, gate=nn.Hardsigmoid)
        self.project = conv_bn(16, 8, 1, activation=None)
        self.last = nn.Conv2d(8, 8, 1)
        self.mish = nn.Mish()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return self.mish(self.last(out + x))


# --------------------------------------------------------------------------------------------
# DenseNet, Inception, ConvNeXt, ShuffleNet


class DenseLayer(nn.Module):
    def __init__(self, inputs: int, growth: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(inputs)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(inputs, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(self.relu1(self.norm1(x)))
        return self.conv2(self.relu2(self.norm2(x)))


class DenseNet(nn.Module):
    def __init__(self, growth: int = 4, layers: int = 3):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.dense = nn.ModuleList(DenseLayer(8 + i * growth, growth, 2) for i in range(layers))
        channels = 8 + layers * growth
        self.transition = nn.Sequential(
            nn.BatchNorm2d(channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, channels // 2, 1, bias=False),
            nn.AvgPool2d(2, 2),
        )
        self.norm = nn.BatchNorm2d(channels // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [self.conv0(x)]
        for layer in self.dense:
            features.append(layer(features))
        x = self.transition(torch.cat(features, 1))
        return F.relu(self.norm(x))


class InceptionBlock(nn.Module):
    def __init__(self, inputs: int):
        super().__init__()
        self.branch1 = conv_bn(inputs, 4, 1)
        self.branch2 = nn.Sequential(conv_bn(inputs, 4, 1), conv_bn(4, 6, 3))
        self.branch3 = nn.Sequential(conv_bn(inputs, 2, 1), conv_bn(2, 4, 5, padding=2))
        self.branch4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), conv_bn(inputs, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class Inception(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8, 3)
        self.inception = InceptionBlock(8)
        self.pool = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.last = conv_bn(18, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.pool(self.inception(self.stem(x))))


class ConvNeXtBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.pwconv1 = nn.Linear(channels, 4 * channels)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.rand(channels) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        x = self.dwconv(x)
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.pwconv2(self.act(self.pwconv1(x)))
        x = self.gamma * x
        x = x.permute(0, 3, 1, 2)
        return identity + x


class ConvNeXt(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.blocks = nn.Sequential(ConvNeXtBlock(8), ConvNeXtBlock(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x))


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    n, c, h, w = x.size()
    x = x.view(n, groups, c // groups, h, w)
    x = x.transpose(1, 2).contiguous()
    return x.view(n, c, h, w)


class ShuffleUnit(nn.Module):
    """ShuffleNetV2 unit; stride 1 splits the channels in two, stride 2 downsamples both branches."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.stride = stride
        branch = outputs // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                conv_bn(inputs, inputs, 3, stride, groups=inputs, activation=None),
                conv_bn(inputs, branch, 1),
            )
        else:
            self.branch1 = nn.Sequential()
        branch_in = inputs if stride > 1 else branch
        self.branch2 = nn.Sequential(
            conv_bn(branch_in, branch, 1),
            conv_bn(branch, branch, 3, stride, groups=branch, activation=None),
            conv_bn(branch, branch, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = conv_bn(3, 8, 3)
        self.stage = nn.Sequential(ShuffleUnit(8, 8, 1), ShuffleUnit(8, 16, 2), ShuffleUnit(16, 16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(self.stem(x))


# --------------------------------------------------------------------------------------------
# U-Nets


class DoubleConv(nn.Sequential):
    def __init__(self, inputs: int, outputs: int, padding: int = 1):
        super().__init__(
            nn.Conv2d(inputs, outputs, 3, padding=padding, bias=False),
            nn.BatchNorm2d(outputs),
            nn.ReLU(inplace=True),
            nn.Conv2d(outputs, outputs, 3, padding=padding, bias=False),
            nn.BatchNorm2d(outputs),
            nn.ReLU(inplace=True),
        )


def pad_to(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """Pad ``x`` to ``skip``'s spatial size, the odd pixel at the bottom / right (milesial's U-Net)."""
    dy = skip.size(2) - x.size(2)
    dx = skip.size(3) - x.size(3)
    return F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])


class UpTransposed(nn.Module):
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.up = nn.ConvTranspose2d(inputs, inputs // 2, 2, stride=2)
        self.conv = DoubleConv(inputs, outputs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = pad_to(self.up(x), skip)
        return self.conv(torch.cat([skip, x], 1))


class UpNearest(nn.Module):
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.reduce = nn.Conv2d(inputs, inputs // 2, 1)
        self.conv = DoubleConv(inputs, outputs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.reduce(F.interpolate(x, scale_factor=2, mode="nearest"))
        x = pad_to(x, skip)
        return self.conv(torch.cat([skip, x], 1))


class UpBilinear(nn.Module):
    def __init__(self, inputs: int, skip_channels: int, outputs: int, align_corners: bool):
        super().__init__()
        self.align_corners = align_corners
        self.conv = DoubleConv(inputs + skip_channels, outputs)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=self.align_corners)
        return self.conv(torch.cat([skip, x], 1))


class UNet(nn.Module):
    """Three resolution levels (4, 8, 16 channels); ``up``: how the decoder upsamples."""

    def __init__(self, up: str, classes: int = 2):
        super().__init__()
        self.inc = DoubleConv(3, 4)
        self.down1 = DoubleConv(4, 8)
        self.down2 = DoubleConv(8, 16)
        self.pool = nn.MaxPool2d(2)
        if up == "transposed":
            self.up1, self.up2 = UpTransposed(16, 8), UpTransposed(8, 4)
        elif up == "nearest":
            self.up1, self.up2 = UpNearest(16, 8), UpNearest(8, 4)
        else:
            self.up1 = UpBilinear(16, 8, 8, align_corners=False)
            self.up2 = UpBilinear(8, 4, 4, align_corners=True)
        self.outc = nn.Conv2d(4, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(self.pool(x1))
        x3 = self.down2(self.pool(x2))
        x = self.up1(x3, x2)
        x = self.up2(x, x1)
        return self.outc(x)


def center_crop(skip: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    h, w = like.shape[2], like.shape[3]
    dy = (skip.shape[2] - h) // 2
    dx = (skip.shape[3] - w) // 2
    return skip[:, :, dy:dy + h, dx:dx + w]


class UNetCrop(nn.Module):
    """Ronneberger's original U-Net: valid convolutions, skips center-cropped to the upsampled size."""

    def __init__(self, classes: int = 2):
        super().__init__()
        self.inc = DoubleConv(3, 4, padding=0)
        self.down1 = DoubleConv(4, 8, padding=0)
        self.down2 = DoubleConv(8, 16, padding=0)
        self.pool = nn.MaxPool2d(2)
        self.up1 = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.conv1 = DoubleConv(16, 8, padding=0)
        self.up2 = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.conv2 = DoubleConv(8, 4, padding=0)
        self.outc = nn.Conv2d(4, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(self.pool(x1))
        x = self.down2(self.pool(x2))
        x = self.up1(x)
        x = self.conv1(torch.cat([center_crop(x2, x), x], 1))
        x = self.up2(x)
        x = self.conv2(torch.cat([center_crop(x1, x), x], 1))
        return self.outc(x)


# --------------------------------------------------------------------------------------------
# dict outputs, Sequential


class Heads(nn.Module):
    """A conv trunk returning a dict: classifier logits and the full-resolution features."""

    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.trunk = nn.Sequential(conv_bn(3, 8, 3), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.trunk(x)
        logits = self.fc(features.mean((2, 3)))
        return {"logits": logits, "features": features}


def plain_chain() -> nn.Module:
    torch.manual_seed(0)
    return _finish(nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(8, 12, 3), nn.BatchNorm2d(12), nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(12, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
    ))


def wide_convs() -> nn.Module:
    """Convolutions with 32 or more input channels, which tiles give their weight gradient by
    matrix products (``tilec.runtime.kernels.weight_grad``): dilated, rectangular, without bias,
    after batch norm; and ones that keep oneDNN's (1x1, strided, grouped)."""
    torch.manual_seed(0)
    return _finish(nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 40, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(40), nn.ReLU(inplace=True),
        nn.Conv2d(40, 33, (3, 5), padding=(1, 2)), nn.MaxPool2d(2),
        nn.Conv2d(33, 32, 1), nn.Conv2d(32, 36, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(36, 32, 3, padding=1, groups=4), nn.Conv2d(32, 34, (5, 3), padding=(2, 1), dilation=(1, 2)),
    ))


# --------------------------------------------------------------------------------------------
# the zoo


def _builder(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return _finish(factory())

    return build


def efficientnet_train_head() -> nn.Module:
    """EfficientNet in eval mode except its head's Dropout, which stays in training mode."""
    model = ZOO["efficientnet"]()
    model.head_dropout.train()
    return model


ZOO: dict[str, Callable[[], nn.Module]] = {
    "resnet_basic": _builder(ResNetBasic),
    "resnet_bottleneck": _builder(ResNetBottleneck),
    "resnet_head": _builder(ResNetHead),
    "preact_resnet": _builder(PreActResNet),
    "mobilenetv2": _builder(MobileNetV2),
    "densenet": _builder(DenseNet),
    "inception": _builder(Inception),
    "convnext": _builder(ConvNeXt),
    "shufflenet": _builder(ShuffleNet),
    "squeeze_excite": _builder(SqueezeExciteNet),
    "efficientnet": _builder(EfficientNet),
    "efficientnet_train_head": efficientnet_train_head,
    "mobilenetv3_block": _builder(MobileNetV3Block),
    "unet_transposed": _builder(lambda: UNet("transposed")),
    "unet_nearest": _builder(lambda: UNet("nearest")),
    "unet_bilinear": _builder(lambda: UNet("bilinear")),
    "unet_crop": _builder(UNetCrop),
    "heads": _builder(Heads),
    "plain_chain": plain_chain,
    "wide_convs": wide_convs,
}

#: Default input shapes (N, C, H, W): odd and uneven, so that borders, strides and pads all show.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "resnet_basic": (2, 3, 23, 29),
    "resnet_bottleneck": (2, 3, 37, 43),
    "resnet_head": (2, 3, 23, 29),
    "preact_resnet": (2, 3, 21, 27),
    "mobilenetv2": (2, 3, 29, 35),
    "densenet": (2, 3, 23, 29),
    "inception": (2, 3, 23, 29),
    "convnext": (2, 3, 31, 41),
    "shufflenet": (2, 3, 23, 29),
    "squeeze_excite": (2, 3, 25, 19),
    "efficientnet": (2, 3, 29, 37),
    "efficientnet_train_head": (2, 3, 29, 37),
    "mobilenetv3_block": (2, 3, 21, 27),
    "unet_transposed": (1, 3, 39, 47),
    "unet_nearest": (1, 3, 39, 47),
    "unet_bilinear": (1, 3, 37, 45),
    "unet_crop": (1, 3, 53, 61),
    "heads": (2, 3, 19, 23),
    "plain_chain": (2, 3, 27, 31),
    "wide_convs": (2, 3, 29, 23),
}


# --------------------------------------------------------------------------------------------
# training mode: batch statistics, group and instance norm, heads, losses, random masks
#
# ``TRAIN_ZOO``'s builders return models in training mode (BatchNorm computes batch statistics and
# updates its running ones; Dropout2d and stochastic depth draw masks), sized for tiny images
# (``TRAIN_SHAPES``): inside a tiled segment their reductions run by sweeps (``tilec.sweeps``).


class StochasticDepth(nn.Module):
    """torchvision's ``StochasticDepth`` in ``"row"`` mode, written inline: one Bernoulli draw per
    sample, scaled by the survival rate (a small op drawn once per step inside a tiled segment)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        noise = torch.empty([x.shape[0], 1, 1, 1], dtype=x.dtype, device=x.device).bernoulli_(survival)
        noise.div_(survival)
        return x * noise


class MBConvDrop(MBConv):
    """EfficientNet's block with stochastic depth on the residual branch, as torchvision has it."""

    def __init__(self, inputs: int, outputs: int, kernel: int, stride: int, expand_ratio: int, p: float):
        super().__init__(inputs, outputs, kernel, stride, expand_ratio)
        self.stochastic_depth = StochasticDepth(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if self.use_res_connect:
            out = self.stochastic_depth(out)
            out += x
        return out


class EfficientNetDrop(nn.Module):
    """EfficientNet with stochastic depth (p = 0.2, 0.4) in its residual blocks, Dropout2d on the
    head's feature map and Dropout before the classifier."""

    def __init__(self, num_classes: int = 5):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, stride=2, activation=nn.SiLU)
        self.blocks = nn.Sequential(MBConvDrop(8, 8, 3, 1, 1, 0.2), MBConvDrop(8, 8, 3, 1, 2, 0.4))
        self.head_conv = conv_bn(8, 8, 1, activation=nn.SiLU)
        self.drop2d = nn.Dropout2d(0.3)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.head_dropout = nn.Dropout(0.2)
        self.classifier = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop2d(self.head_conv(self.blocks(self.stem(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.classifier(self.head_dropout(x))


class GroupNormBlock(nn.Module):
    """A BasicBlock with GroupNorm (2 groups) in place of BatchNorm."""

    def __init__(self, inputs: int, outputs: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(2, outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(2, outputs)
        self.shortcut = None
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False),
                                          nn.GroupNorm(2, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = F.relu(self.gn1(self.conv1(x)))
        return F.relu(self.gn2(self.conv2(out)) + identity)


class GroupNormResNet(nn.Module):
    """A GroupNorm ResNet with its classifier head."""

    def __init__(self, num_classes: int = 3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.GroupNorm(2, 4), nn.ReLU())
        self.layer1 = GroupNormBlock(4, 4)
        self.layer2 = GroupNormBlock(4, 8, stride=2)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class TwoConv(nn.Sequential):
    """MONAI's ``TwoConv``: (conv 3x3, InstanceNorm with affine, LeakyReLU) twice."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__(
            nn.Conv2d(inputs, outputs, 3, padding=1), nn.InstanceNorm2d(outputs, affine=True), nn.LeakyReLU(0.1),
            nn.Conv2d(outputs, outputs, 3, padding=1), nn.InstanceNorm2d(outputs, affine=True), nn.LeakyReLU(0.1),
        )


class Down(nn.Sequential):
    """MONAI's ``Down``: max pooling, then ``TwoConv``."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__(nn.MaxPool2d(2), TwoConv(inputs, outputs))


class UpCat(nn.Module):
    """MONAI's ``UpCat``: a transposed-convolution upsampling halving the channels, the result
    padded (replicate) by one pixel where the encoder feature is larger, concatenated, ``TwoConv``."""

    def __init__(self, inputs: int, cat: int, outputs: int):
        super().__init__()
        self.upsample = nn.ConvTranspose2d(inputs, inputs // 2, 2, stride=2)
        self.convs = TwoConv(cat + inputs // 2, outputs)

    def forward(self, x: torch.Tensor, x_e: torch.Tensor) -> torch.Tensor:
        x_0 = self.upsample(x)
        sp = [0] * 4
        for i in range(2):
            if x_e.shape[-i - 1] != x_0.shape[-i - 1]:
                sp[i * 2 + 1] = 1
        x_0 = F.pad(x_0, sp, "replicate")
        return self.convs(torch.cat([x_e, x_0], dim=1))


class BasicUNet(nn.Module):
    """MONAI's ``BasicUNet`` layout, two levels deep: instance norm in every block."""

    def __init__(self, classes: int = 2):
        super().__init__()
        self.conv_0 = TwoConv(3, 4)
        self.down_1 = Down(4, 4)
        self.down_2 = Down(4, 8)
        self.upcat_2 = UpCat(8, 4, 4)
        self.upcat_1 = UpCat(4, 4, 4)
        self.final_conv = nn.Conv2d(4, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = self.conv_0(x)
        x1 = self.down_1(x0)
        x2 = self.down_2(x1)
        u2 = self.upcat_2(x2, x1)
        u1 = self.upcat_1(u2, x0)
        return self.final_conv(u1)


class LayerNorm2d(nn.LayerNorm):
    """torchvision's ``LayerNorm2d``: LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtHead(ConvNeXt):
    """ConvNeXt with torchvision's classifier: global pooling, ``LayerNorm2d``, flatten, linear."""

    def __init__(self, num_classes: int = 4):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(8, eps=1e-6), nn.Flatten(1), nn.Linear(8, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(super().forward(x)))


class MaxHeads(nn.Module):
    """Global max pooling over ReLU outputs whose channels 0 and 2 are all zero (a bias of -100):
    ``amax`` into a linear layer, ``adaptive_max_pool2d`` with its indices, and both over an
    exactly tied map whose gradient reaches the input (``t + (x - x.detach())``: values 0 or 1)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        with torch.no_grad():
            self.conv.bias[0::2] = -100.0
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor):
        y = F.relu(self.conv(x))
        values, indices = F.adaptive_max_pool2d(y, 1, return_indices=True)
        ties = (x > 0.5).to(x.dtype) + (x - x.detach())
        tied_values, tied_indices = F.adaptive_max_pool2d(ties, 1, return_indices=True)
        return self.fc(y.amax((2, 3))), values, indices, ties.amax((2, 3)), tied_values, tied_indices


class SegmentationLoss(nn.Module):
    """A conv-BN-ReLU-conv segmenter returning its per-pixel cross-entropy loss, the target derived
    from the input (``x.argmax(1)``: classes 0-2), class 2 ignored, with class weights and label
    smoothing; plus an unweighted sum-reduced loss of the same logits."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(conv_bn(3, 6, 3), nn.Conv2d(6, classes, 3, padding=1))
        self.register_buffer("weight", torch.tensor([0.5, 2.0, 1.0, 1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = x.argmax(1)
        logits = self.body(x)
        loss = F.cross_entropy(logits, target, weight=self.weight, ignore_index=2, label_smoothing=0.1)
        return loss + 0.01 * F.cross_entropy(logits, target, reduction="sum")


class ASPP(nn.Module):
    """torchvision's DeepLabV3 ``ASPP``, small: a 1x1 branch, two dilated 3x3 branches and a global
    pooling branch (pooled, 1x1 conv, BatchNorm, ReLU, upsampled back), concatenated, then projected by
    1x1 conv, BatchNorm, ReLU and element-wise ``Dropout(0.5)``."""

    def __init__(self, inputs: int, width: int, pooling: bool = True):
        super().__init__()
        self.convs = nn.ModuleList([conv_bn(inputs, width, 1), *(
            nn.Sequential(nn.Conv2d(inputs, width, 3, padding=rate, dilation=rate, bias=False), nn.BatchNorm2d(width),
                          nn.ReLU()) for rate in (2, 3))])
        self.pooling = nn.Sequential(nn.AdaptiveAvgPool2d(1), conv_bn(inputs, width, 1)) if pooling else None
        self.project = nn.Sequential(conv_bn(width * (len(self.convs) + pooling), width, 1), nn.Dropout(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [conv(x) for conv in self.convs]
        if self.pooling is not None:
            branches.append(F.interpolate(self.pooling(x), size=x.shape[-2:], mode="bilinear", align_corners=False))
        return self.project(torch.cat(branches, dim=1))


class DropoutSegmenter(nn.Module):
    """A segmentation network with the training-mode element-wise Dropout of published heads: a
    stride-2 trunk, DeepLabV3's ASPP head (Dropout 0.5), FCN's head (3x3 conv, BatchNorm, ReLU,
    ``Dropout(0.1)``, 1x1 classifier) and an ``F.dropout`` in the model's own forward, upsampled
    bilinearly to the input's size. Not in ``TRAIN_ZOO``: its masks are tilec's counter-based ones,
    which plain PyTorch draws only under ``tilec.runtime.dropout.counter_dropout``."""

    def __init__(self, classes: int = 3, pooling: bool = True):
        super().__init__()
        self.backbone = nn.Sequential(conv_bn(3, 6, 3, stride=2), conv_bn(6, 8, 3))
        self.aspp = ASPP(8, 6, pooling)
        self.fcn = nn.Sequential(conv_bn(6, 6, 3), nn.Dropout(0.1), nn.Conv2d(6, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fcn(F.dropout(self.aspp(self.backbone(x)), 0.2, self.training))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


def dropout_segmenter(pooling: bool = True) -> nn.Module:
    """``DropoutSegmenter`` in training mode (BatchNorm with batch statistics, Dropout drawing)."""
    torch.manual_seed(0)
    return _finish(DropoutSegmenter(pooling=pooling)).train()


def _train_builder(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return _finish(factory()).train()

    return build


TRAIN_ZOO: dict[str, Callable[[], nn.Module]] = {
    "resnet_basic": _train_builder(ResNetBasic),
    "resnet_bottleneck": _train_builder(ResNetBottleneck),
    "resnet_head": _train_builder(ResNetHead),
    "mobilenetv2": _train_builder(MobileNetV2),
    "mobilenetv3_block": _train_builder(MobileNetV3Block),
    "efficientnet": _train_builder(EfficientNet),
    "efficientnet_drop": _train_builder(EfficientNetDrop),
    "squeeze_excite": _train_builder(SqueezeExciteNet),
    "groupnorm_resnet": _train_builder(GroupNormResNet),
    "basic_unet": _train_builder(BasicUNet),
    "convnext_head": _train_builder(ConvNeXtHead),
    "max_heads": _train_builder(MaxHeads),
    "segmentation_loss": _train_builder(SegmentationLoss),
}

#: Tiny odd inputs for ``TRAIN_ZOO``.
TRAIN_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "resnet_basic": (2, 3, 13, 11),
    "resnet_bottleneck": (2, 3, 17, 15),
    "resnet_head": (2, 3, 11, 13),
    "mobilenetv2": (2, 3, 15, 13),
    "mobilenetv3_block": (2, 3, 11, 9),
    "efficientnet": (2, 3, 15, 17),
    "efficientnet_drop": (2, 3, 15, 13),
    "squeeze_excite": (2, 3, 13, 11),
    "groupnorm_resnet": (2, 3, 13, 11),
    "basic_unet": (1, 3, 15, 13),
    "convnext_head": (2, 3, 17, 15),
    "max_heads": (2, 3, 9, 11),
    "segmentation_loss": (2, 3, 11, 9),
}


# --------------------------------------------------------------------------------------------
# Python branches on ``self.training``: each mode traces its own graph
#
# ``MODE_ZOO``'s builders return models in training mode whose forward takes another path in eval
# mode, as published code writes it (timm's ``drop_path``, the EfficientNet encoders' drop-connect
# of segmentation_models_pytorch, auxiliary heads): a plan per mode (``tilec.trace.trace_modes``).


def drop_connect(inputs: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """The EfficientNet encoders' drop-connect (segmentation_models_pytorch, efficientnet_pytorch):
    a per-sample mask ``floor(keep + U[0, 1))``, scaled by ``1 / keep``; nothing in eval mode."""
    if not training:
        return inputs
    keep = 1 - p
    mask = torch.floor(keep + torch.rand([inputs.shape[0], 1, 1, 1], dtype=inputs.dtype, device=inputs.device))
    return inputs / keep * mask


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    """timm's ``drop_path`` as timm 1.0 writes it: a per-sample mask drawn with
    ``x.new_empty(shape).bernoulli_(keep)``, divided in place by ``keep``; in training only."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    mask.div_(keep)
    return x * mask


def drop_path_0_4(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False) -> torch.Tensor:
    """timm's ``drop_path`` as timm 0.4 wrote it: a per-sample mask ``floor(keep + U[0, 1))``
    floored in place, the input scaled by ``1 / keep``; in training only."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1 - drop_prob
    mask = keep + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
    mask.floor_()
    return x.div(keep) * mask


class DropConnectBlock(MBConv):
    """smp's EfficientNet encoder block: drop-connect on the residual branch, written as a function
    called with ``self.training``."""

    def __init__(self, inputs: int, outputs: int, kernel: int, stride: int, expand_ratio: int, p: float):
        super().__init__(inputs, outputs, kernel, stride, expand_ratio)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        if self.use_res_connect:
            out = drop_connect(out, self.p, self.training) + x
        return out


class DropConnectNet(nn.Module):
    """A U-Net-like encoder-decoder of ``DropConnectBlock`` s (p = 0.2, 0.3), as smp's U-Net with an
    EfficientNet encoder."""

    def __init__(self, classes: int = 2):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, activation=nn.SiLU)
        self.encoder = nn.Sequential(DropConnectBlock(8, 8, 3, 1, 2, 0.2), DropConnectBlock(8, 8, 3, 1, 1, 0.3))
        self.down = conv_bn(8, 8, 3, stride=2, activation=nn.SiLU)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.head = nn.Conv2d(16, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.encoder(self.stem(x))
        return self.head(torch.cat([skip, pad_to(self.up(self.down(skip)), skip)], 1))


class DropPathBlock(nn.Module):
    """timm's residual block: ``shortcut + drop_path(branch)`` with ``self.drop_path_rate`` (timm
    0.4's ``drop_path`` where ``legacy``)."""

    def __init__(self, channels: int, drop_path_rate: float, legacy: bool = False):
        super().__init__()
        self.branch = nn.Sequential(conv_bn(channels, channels), conv_bn(channels, channels, activation=None))
        self.drop_path_rate = drop_path_rate
        self.drop = drop_path_0_4 if legacy else drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.drop(self.branch(x), self.drop_path_rate, self.training))


class DropPathNet(nn.Module):
    """A small ResNet of ``DropPathBlock`` s (drop-path 0.1 as timm 0.4, 0.25 as timm 1.0) and torchvision's
    ``StochasticDepth`` (p = 0.3) on a third block, with a pooled linear head."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, stride=2)
        self.blocks = nn.Sequential(DropPathBlock(8, 0.1, legacy=True), DropPathBlock(8, 0.25))
        self.last = nn.Sequential(conv_bn(8, 8), StochasticDepth(0.3))
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = torch.relu(x + self.last(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class AuxHeadNet(nn.Module):
    """torchvision's Inception / GoogLeNet pattern: an auxiliary classifier on an inner feature map,
    returned beside the output only in training (``if self.training and self.aux_logits``)."""

    def __init__(self, classes: int = 4, aux_logits: bool = True):
        super().__init__()
        self.aux_logits = aux_logits
        self.features = nn.Sequential(conv_bn(3, 8), conv_bn(8, 8, stride=2))
        self.aux = nn.Sequential(conv_bn(8, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))
        self.more = nn.Sequential(conv_bn(8, 8), conv_bn(8, 8))
        self.fc = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor):
        x = self.features(x)
        aux = self.aux(x) if self.training and self.aux_logits else None
        out = self.fc(torch.flatten(F.adaptive_avg_pool2d(self.more(x), 1), 1))
        if self.training and self.aux_logits:
            return out, aux
        return out


MODE_ZOO: dict[str, Callable[[], nn.Module]] = {
    "drop_connect": _train_builder(DropConnectNet),
    "drop_path": _train_builder(DropPathNet),
    "aux_head": _train_builder(AuxHeadNet),
    "efficientnet_drop": _train_builder(EfficientNetDrop),
}

#: Tiny odd inputs for ``MODE_ZOO``.
MODE_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "drop_connect": (2, 3, 14, 11),
    "drop_path": (3, 3, 15, 13),
    "aux_head": (2, 3, 13, 15),
    "efficientnet_drop": (2, 3, 15, 13),
}


# published networks' patterns, written inline (``tests/test_published.py``)
#
# torchvision's EfficientNet classifier (``Dropout(p, inplace=True)`` after ``flatten``), its
# segmentation models (an ``OrderedDict`` of outputs, DeepLabV3's ASPP with its global-pooling
# branch, FCN's auxiliary head, LR-ASPP's sigmoid-gated head) and segmentation_models_pytorch's FPN
# (its pyramid merged by ``torch.stack(features).sum(0)``). ``PUBLISHED_ZOO``'s builders take the
# mode (``train``). Heads with element-wise Dropout on images in training mode (``DeepLabLike``'s
# ASPP and FCN head) draw tilec's counter-based masks, which the plain reference draws under
# ``counter_dropout``.


class EfficientNetClassifier(EfficientNet):
    """torchvision's EfficientNet head: global pooling, ``flatten``, then
    ``Sequential(Dropout(p, inplace=True), Linear)`` (the dropout writes through the flatten)."""

    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes)
        del self.head_dropout
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head_conv(self.blocks(self.stem(x)))
        return self.classifier(torch.flatten(self.avgpool(x), 1))


class ASPPPooling(nn.Sequential):
    """torchvision's ``ASPPPooling``: global average pool, 1x1 conv, BN, ReLU, upsampled back."""

    def __init__(self, inputs: int, outputs: int):
        super().__init__(nn.AdaptiveAvgPool2d(1), nn.Conv2d(inputs, outputs, 1, bias=False), nn.BatchNorm2d(outputs),
                         nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[-2:]
        for module in self:
            x = module(x)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False)


class TorchvisionASPP(nn.Module):
    """torchvision's ``ASPP``: a 1x1 branch, dilated 3x3 branches, the pooling branch, concatenated
    and projected (conv, BN, ReLU, ``Dropout(0.5)``)."""

    def __init__(self, inputs: int, rates: tuple[int, ...], outputs: int = 8):
        super().__init__()
        branches = [conv_bn(inputs, outputs, 1)]
        branches += [nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=r, dilation=r, bias=False),
                                   nn.BatchNorm2d(outputs), nn.ReLU()) for r in rates]
        self.convs = nn.ModuleList([*branches, ASPPPooling(inputs, outputs)])
        self.project = nn.Sequential(conv_bn(len(self.convs) * outputs, outputs, 1), nn.Dropout(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(torch.cat([conv(x) for conv in self.convs], dim=1))


class DeepLabLike(nn.Module):
    """torchvision's ``DeepLabV3`` with an FCN auxiliary head: a strided, dilated backbone, the ASPP
    head, bilinear upsampling to the input, an ``OrderedDict`` with ``out`` and ``aux``."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.stem = conv_bn(3, 8, 3, stride=2)
        self.layer = nn.Sequential(conv_bn(8, 12, 3, stride=2), nn.Conv2d(12, 12, 3, padding=2, dilation=2),
                                   nn.BatchNorm2d(12), nn.ReLU())
        self.classifier = nn.Sequential(TorchvisionASPP(12, (2, 3)), conv_bn(8, 8, 3), nn.Conv2d(8, classes, 1))
        self.aux_classifier = nn.Sequential(conv_bn(8, 4, 3), nn.Dropout(0.1), nn.Conv2d(4, classes, 1))

    def forward(self, x: torch.Tensor) -> OrderedDict:
        size = x.shape[-2:]
        aux = self.stem(x)
        features = self.layer(aux)
        result = OrderedDict()
        result["out"] = F.interpolate(self.classifier(features), size=size, mode="bilinear", align_corners=False)
        result["aux"] = F.interpolate(self.aux_classifier(aux), size=size, mode="bilinear", align_corners=False)
        return result


class LRASPPLike(nn.Module):
    """torchvision's ``LRASPP``: a 1x1 conv-BN-ReLU branch gated by a sigmoid of the pooled high
    features, upsampled to the low features, two 1x1 classifiers added, upsampled to the input;
    ``OrderedDict(out=...)``. No dropout: it trains with batch statistics."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.low = conv_bn(3, 6, 3, stride=2, activation=nn.Hardswish)
        self.high = nn.Sequential(conv_bn(6, 10, 3, stride=2, activation=nn.Hardswish), conv_bn(10, 10, 3))
        self.cbr = conv_bn(10, 8, 1)
        self.scale = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(10, 8, 1, bias=False), nn.Sigmoid())
        self.low_classifier = nn.Conv2d(6, classes, 1)
        self.high_classifier = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> OrderedDict:
        low = self.low(x)
        high = self.high(low)
        y = self.cbr(high) * self.scale(high)
        y = F.interpolate(y, size=low.shape[-2:], mode="bilinear", align_corners=False)
        out = self.low_classifier(low) + self.high_classifier(y)
        return OrderedDict(out=F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False))


class FPNStack(nn.Module):
    """segmentation_models_pytorch's FPN: lateral 1x1 convs, a top-down path with nearest
    upsampling, segmentation blocks upsampling every level to a quarter of the input, merged by
    ``torch.stack(features).sum(dim=0)``; Dropout2d, a 3x3 head, bilinear upsampling."""

    def __init__(self, classes: int = 2):
        super().__init__()
        self.encoder = nn.ModuleList([conv_bn(3, 4, 3, stride=2), conv_bn(4, 6, 3, stride=2),
                                      conv_bn(6, 8, 3, stride=2), conv_bn(8, 10, 3, stride=2)])
        self.laterals = nn.ModuleList([nn.Conv2d(c, 6, 1) for c in (6, 8, 10)])
        self.blocks = nn.ModuleList([conv_bn(6, 4, 3) for _ in range(3)])
        self.dropout = nn.Dropout2d(0.2)
        self.head = nn.Conv2d(4, classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = []
        y = x
        for stage in self.encoder:
            y = stage(y)
            features.append(y)
        quarter = features[1].shape[-2:]
        p = self.laterals[2](features[3])
        pyramid = [p]
        for lateral, skip in zip(self.laterals[1::-1], features[2:0:-1], strict=True):
            p = F.interpolate(p, size=skip.shape[-2:], mode="nearest") + lateral(skip)
            pyramid.append(p)
        merged = torch.stack([F.interpolate(block(level), size=quarter, mode="bilinear", align_corners=True)
                              for block, level in zip(self.blocks, pyramid, strict=True)]).sum(dim=0)
        out = self.head(self.dropout(merged))
        return F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=True)


def _published_builder(factory: Callable[[], nn.Module]):
    def build(train: bool) -> nn.Module:
        torch.manual_seed(0)
        return _finish(factory()).train(train)

    return build


PUBLISHED_ZOO: dict[str, Callable[[bool], nn.Module]] = {
    "efficientnet_classifier": _published_builder(EfficientNetClassifier),
    "deeplab": _published_builder(DeepLabLike),
    "lraspp": _published_builder(LRASPPLike),
    "fpn_stack": _published_builder(FPNStack),
}

#: Odd, uneven inputs for ``PUBLISHED_ZOO``.
PUBLISHED_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "efficientnet_classifier": (2, 3, 17, 15),
    "deeplab": (2, 3, 27, 33),
    "lraspp": (2, 3, 25, 31),
    "fpn_stack": (2, 3, 37, 43),
}
