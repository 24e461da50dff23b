"""Published networks' patterns (issue 39): exact in float64 against plain PyTorch, a training
step (BatchNorm with batch statistics) then an eval-mode forward, grids 1x1 to 4x3.

The inline copies (``support.zoo.PUBLISHED_ZOO``) always run: torchvision's EfficientNet classifier
(``Dropout(inplace=True)`` writing through a ``flatten``), its segmentation models (an
``OrderedDict`` returned as such, ASPP's global-pooling branch) and smp's FPN (``torch.stack(...)
.sum(0)``). The published packages run as users download them (``support.published``):
torchvision's models and timm's, built by their own classes with random weights (the large ones
with fewer blocks or channels), at odd sizes on a 3x2 grid (``PUBLISHED_MODELS``), and
torchvision's EfficientNet and segmentation models at 64²; segmentation_models_pytorch's FPN,
U-Net on a timm ConvNeXt and DeepLabV3+ with small decoders
(``benchmarks/published.py`` checks a hundred and forty-six at their full sizes). Heads with
element-wise Dropout on images (DeepLabV3's ASPP) train with tilec's counter-based masks, which the
plain reference draws under ``counter_dropout`` (``check_exact(counter=True)``).
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tilec.errors import UnsupportedLayerError
from tilec.pipeline import build
from tilec.trace import trace

from support.exactness import check_exact
from support.published import published
from support.zoo import PUBLISHED_SHAPES, PUBLISHED_ZOO

GRIDS = [(1, 1), (2, 2), (4, 3)]


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("name", sorted(PUBLISHED_ZOO))
def test_a_training_step_then_an_eval_forward_equal_plain(name, grid):
    check_exact(PUBLISHED_ZOO[name](True), PUBLISHED_SHAPES[name], grid=grid, eval_after=True, counter=True,
                traced_as=f"published {name}")


@pytest.mark.parametrize("name", sorted(PUBLISHED_ZOO))
def test_compiled_in_eval_mode_equal_plain(name):
    check_exact(PUBLISHED_ZOO[name](False), PUBLISHED_SHAPES[name], grid=(3, 2))


def test_an_identity_in_place_dropout_through_a_flatten_disappears():
    graph = trace(PUBLISHED_ZOO["efficientnet_classifier"](False), PUBLISHED_SHAPES["efficientnet_classifier"])
    assert not [node for node in graph if "dropout" in node.op]
    trained = trace(PUBLISHED_ZOO["efficientnet_classifier"](True), PUBLISHED_SHAPES["efficientnet_classifier"])
    (dropout,) = [node for node in trained if "dropout" in node.op]
    assert dropout.op == "dropout" and dropout.spatial is None  # after the pooling: untiled, once per step


class FlattenedDropout(nn.Module):
    """An in-place Dropout on a flatten of a feature map that is read again afterwards."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.dropout = nn.Dropout(0.3, inplace=True)

    def forward(self, x):
        y = F.relu(self.conv(x))
        flat = self.dropout(y.flatten(2))
        return y + flat.view(y.shape)


def test_an_in_place_dropout_whose_base_is_read_again_compiles_in_eval_mode_and_is_refused_in_training():
    check_exact(FlattenedDropout().eval(), (1, 3, 11, 9), grid=(2, 3))
    with pytest.raises(UnsupportedLayerError, match=r"aten.dropout_ from module dropout \(Dropout\) is not "
                                                    r"supported: it writes in place through an aten.flatten"):
        trace(FlattenedDropout().train(), (1, 3, 11, 9))


def test_mapping_outputs_come_back_as_the_models_type():
    model = PUBLISHED_ZOO["deeplab"](False).double()
    x = torch.randn(PUBLISHED_SHAPES["deeplab"], dtype=torch.float64)
    out = build(model, tuple(x.shape), (2, 2), dtype="float64")(x)
    assert type(out) is OrderedDict and list(out) == ["out", "aux"]


class Unbound(nn.Module):
    """Stacks two maps along a dim between the channels and the image axes, unbinds them again."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        a, b = torch.stack([y, torch.sigmoid(y)], dim=2).unbind(2)
        return F.max_pool2d(a * b, 3, stride=1, padding=1) + torch.stack([a, b]).mean(0)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_stack_and_unbind_along_non_image_dims_tile(grid):
    graph = trace(Unbound(), (2, 3, 13, 11))
    shifted = {node.op: node.spatial for node in graph if node.op in ("stack", "unbind")}
    assert shifted == {"stack": (3, 4), "unbind": (2, 3)} and all(node.tileable for node in graph)
    check_exact(Unbound(), (2, 3, 13, 11), grid=grid)


class Rows(nn.Module):
    """Unbinds the rows of a map and stacks them again."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(torch.stack(self.conv(x)[:, :3].unbind(2), dim=2) * 2)


def test_unbinding_an_image_axis_runs_untiled_and_exact():
    """The rows, without image axes, run untiled up to the stack that makes an image of them again."""
    untiled = [node.op for node in trace(Rows(), (1, 3, 5, 7)) if not node.tileable]
    assert untiled == ["unbind", *["getitem"] * 5, "stack"]
    check_exact(Rows(), (1, 3, 5, 7), grid=(2, 3))


# ------------------------------------------------------------------------------------------------
# the published packages, where they import


def _torchvision_efficientnet():
    efficientnet = published("torchvision.models.efficientnet")
    setting = [efficientnet.MBConvConfig(1, 3, 1, 8, 8, 1), efficientnet.MBConvConfig(4, 3, 2, 8, 12, 2)]
    return efficientnet.EfficientNet(setting, dropout=0.2, stochastic_depth_prob=0.0, num_classes=5)


def _torchvision_segmentation(name: str):
    segmentation = published("torchvision.models.segmentation")
    mobilenet = published("torchvision.models.mobilenetv3")
    layers = published("torchvision.models._utils")
    # MobileNetV3-Large at a quarter of its widths, to its first stride-16 block: 8 channels at stride
    # 4 (block 3), 24 at 16 (block 7); deeper, its training-mode BatchNorms over 4x4 maps amplify
    # rounding past 1e-10 in absolute terms
    backbone = mobilenet.mobilenet_v3_large(weights=None, dilated=True, width_mult=0.25).features[:8]
    low, high, channels = 3, 7, (8, 24)
    if name == "lraspp":
        getter = layers.IntermediateLayerGetter(backbone, {str(low): "low", str(high): "high"})
        return segmentation.LRASPP(getter, channels[0], channels[1], 3, inter_channels=16)
    getter = layers.IntermediateLayerGetter(backbone, {str(low): "aux", str(high): "out"})
    return segmentation.DeepLabV3(getter, segmentation.deeplabv3.DeepLabHead(channels[1], 3),
                                  segmentation.fcn.FCNHead(channels[0], 3))


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_torchvision_efficientnet(train):
    torch.manual_seed(0)
    check_exact(_torchvision_efficientnet().train(train), (2, 3, 64, 64), grid=(2, 2), eval_after=train)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", ["lraspp", "deeplabv3"])
def test_torchvision_segmentation(name, train):
    torch.manual_seed(0)
    model = _torchvision_segmentation(name).train(train)
    # in training, a batch of 4: the ASPP pooling branch's BatchNorm normalises N values of a 1x1 map,
    # and over 2 its gradient amplifies rounding past 1e-10
    check_exact(model, (4 if train else 2, 3, 64, 64), grid=(2, 2) if train else (4, 3), eval_after=train, counter=True)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_smp_fpn(train):
    smp = published("segmentation_models_pytorch")
    torch.manual_seed(0)
    model = smp.FPN("resnet18", encoder_weights=None, encoder_depth=4, classes=2, decoder_pyramid_channels=32,
                    decoder_segmentation_channels=32).train(train)
    check_exact(model, (2, 3, 64, 64), grid=(2, 2), eval_after=train)


#: smp's architectures with small decoders, and the modes each trains in: a timm ConvNeXt encoder
#: (its stride-2 feature a zero-channel ``torch.empty``), ASPP with its Dropout (counter-based masks).
SMP_MODELS = {
    "unet_convnext": ("Unet", "tu-convnext_atto", {"decoder_channels": (32, 16, 8, 8, 8)}, (False, True)),
    "deeplabv3plus": ("DeepLabV3Plus", "resnet18", {"decoder_channels": 32}, (True,)),
}


@pytest.mark.parametrize("name, train", [pytest.param(name, train, id=f"{name}-{'train' if train else 'eval'}")
                                         for name, spec in SMP_MODELS.items() for train in spec[3]])
def test_smp_models(name, train):
    smp = published("segmentation_models_pytorch")
    arch, encoder, options, _ = SMP_MODELS[name]
    torch.manual_seed(0)
    model = getattr(smp, arch)(encoder, encoder_weights=None, classes=2, **options).train(train)
    assert all(node.tileable for node in trace(model, (2, 3, 64, 64)))
    check_exact(model, (2, 3, 64, 64), grid=(3, 2), eval_after=train, counter=True)


def _torchvision(module: str, build: str, *args, **kwargs) -> nn.Module:
    return getattr(published(f"torchvision.models.{module}"), build)(*args, num_classes=10, **kwargs)


def _timm(name: str, **kwargs) -> nn.Module:
    return published("timm").create_model(name, pretrained=False, **kwargs)


def _timm_bit() -> nn.Module:
    """BiT's ResNetV2 as timm's ``resnetv2_50x1_bit`` builds it, one block a stage."""
    resnetv2, layers = published("timm.models.resnetv2"), published("timm.layers")
    return resnetv2.ResNetV2((1, 1, 1, 1), num_classes=10, stem_type="fixed",
                             conv_layer=functools.partial(layers.StdConv2d, eps=1e-8))


def _torchvision_convnext() -> nn.Module:
    convnext = published("torchvision.models.convnext")
    stages = [convnext.CNBlockConfig(16, 32, 2), convnext.CNBlockConfig(32, 64, 1), convnext.CNBlockConfig(64, None, 1)]
    return convnext.ConvNeXt(stages, stochastic_depth_prob=0.1, num_classes=10)


#: Published models, each for what it brings; the large ones at fewer blocks or channels, as their
#: own classes take them.
PUBLISHED_MODELS = {
    "torchvision_resnet": lambda: _torchvision("resnet", "ResNet", published("torchvision.models.resnet").Bottleneck,
                                               [1, 1, 1, 1]),  # bottlenecks
    # LayerNorm2d by permutes, layer scale, stochastic depth (per sample, drawn once per step)
    "torchvision_convnext": _torchvision_convnext,
    "torchvision_densenet": lambda: _torchvision("densenet", "DenseNet", growth_rate=8, block_config=(2, 2, 2, 2),
                                                 num_init_features=16, bn_size=2),  # concatenations
    # hardswish, squeeze-and-excitation
    "torchvision_mobilenet_v3_large": lambda: _torchvision("mobilenetv3", "mobilenet_v3_large", width_mult=0.5),
    "torchvision_squeezenet1_1": lambda: _torchvision("squeezenet", "squeezenet1_1"),  # ceil-mode max pooling
    "torchvision_alexnet": lambda: _torchvision("alexnet", "alexnet"),  # adaptive average pooling to 6x6
    "timm_convnextv2_atto": lambda: _timm("convnextv2_atto", num_classes=10),  # GRN: a 2-norm over the image
    "timm_resnetv2_bit": _timm_bit,  # weight-standardised convolutions, GroupNorm
    # ECA: a 1-D convolution over the pooled channels, expand_as
    "timm_eca_resnet10t": lambda: _timm("resnet10t", num_classes=10, block_args={"attn_layer": "eca"}),
    # GCNet's global context (GCResNet's): a softmax over the flattened pixels and a matmul with them
    "timm_gc_resnet10t": lambda: _timm("resnet10t", num_classes=10, block_args={"attn_layer": "gc"}),
    # TensorFlow's "same" padding, computed from the input's size
    "timm_tf_mobilenetv3_small": lambda: _timm("tf_mobilenetv3_small_100", num_classes=10),
    "timm_hrnet_w18_small": lambda: _timm("hrnet_w18_small", num_classes=10),  # resolutions fused by upsampling
    # anti-aliased downsampling: a blur filter in a non-persistent buffer, after reflect padding (TResNet's)
    "timm_resnet10t_blur": lambda: _timm("resnet10t", num_classes=10, aa_layer=published("timm.layers").BlurPool2d),
    "timm_resnet10t_features": lambda: _timm("resnet10t", features_only=True),  # a list of maps, for FPNs
}


#: Odd sizes, but where a model needs a multiple of 32 (HRNet's fusions) or 63 pixels (AlexNet).
SIZES = {"timm_hrnet_w18_small": (64, 96), "torchvision_alexnet": (64, 96)}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MODELS))
def test_published_models_train_a_step_then_run_in_eval_mode_as_plain(name):
    torch.manual_seed(0)
    shape = (2, 3, *SIZES.get(name, (67, 61)))
    check_exact(PUBLISHED_MODELS[name]().train(), shape, grid=(3, 2), eval_after=True, counter=True)
