"""timm's models as its package builds them (random weights, 10 classes, training mode), as model
files for ``benchmarks/run.py`` and ``benchmarks/step.py``:

    python benchmarks/run.py --model benchmarks/timm_models.py --attr efficientvit_b0 ...

timm is imported as ``tests/support/published.py`` does (from ``.venv/published`` where
``scripts/setup.sh`` installs it).
"""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from support.published import load  # noqa: E402


def efficientvit_b0():
    """EfficientViT-B0 (MIT): its multi-scale linear attention in the last two stages."""
    return load("timm").create_model("efficientvit_b0", pretrained=False, num_classes=10)


def convnext_atto():
    """ConvNeXt-Atto: a ``Dropout(0.0)`` in every block's channels-last MLP."""
    return load("timm").create_model("convnext_atto", pretrained=False, num_classes=10)


def tresnet_m():
    """TResNet-M: a space-to-depth stem written with views, and anti-aliased downsampling."""
    return load("timm").create_model("tresnet_m", pretrained=False, num_classes=10)


def skresnet18():
    """SK-ResNet-18: selective kernels, a training-mode BatchNorm in every block's pooled attention."""
    return load("timm").create_model("skresnet18", pretrained=False, num_classes=10)


def rexnet_100():
    """ReXNet-1.0: squeeze-and-excitation with a BatchNorm between its convolutions."""
    return load("timm").create_model("rexnet_100", pretrained=False, num_classes=10)


def mobilevitv2_050():
    """MobileViT-v2-0.5: patch unfolding and linear attention over the patches, run untiled."""
    return load("timm").create_model("mobilevitv2_050", pretrained=False, num_classes=10)


def edgenext_xx_small():
    """EdgeNeXt-XX-Small: cross-covariance attention over flattened pixels in its last three
    stages, a Fourier positional encoding in one block."""
    return load("timm").create_model("edgenext_xx_small", pretrained=False, num_classes=10)


def lambda_resnet26t():
    """LambdaResNet-26t: lambda layers (content lambdas over the pixels, position lambdas by a 3-D
    convolution) in its last two stages."""
    return load("timm").create_model("lambda_resnet26t", pretrained=False, num_classes=10)


def regnetz_c16_evos():
    """RegNetZ-C16 with EvoNorm-S0a: each group's standard deviation ``expand``-ed to the map."""
    return load("timm").create_model("regnetz_c16_evos", pretrained=False, num_classes=10)


def convnext_zepto_rms():
    """ConvNeXt-Zepto with ``SimpleNorm2d``: a variance over the channels, channels-last."""
    return load("timm").create_model("convnext_zepto_rms", pretrained=False, num_classes=10)


def efficientnet_b0():
    """EfficientNet-B0: depthwise convolutions and squeeze-and-excitation, 239 nodes traced."""
    return load("timm").create_model("efficientnet_b0", pretrained=False, num_classes=10)


def convnext_tiny():
    """ConvNeXt-Tiny: 7x7 depthwise convolutions, channels-last LayerNorms and MLPs."""
    return load("timm").create_model("convnext_tiny", pretrained=False, num_classes=10)
