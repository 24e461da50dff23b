"""segmentation_models_pytorch's models as its package builds them (random weights, 3 classes,
training mode), as model files for ``benchmarks/run.py`` and ``benchmarks/step.py``:

    python benchmarks/run.py --model benchmarks/smp_models.py --attr unet_convnext_atto ...

The package is imported as ``tests/support/published.py`` does (from ``.venv/published`` where
``scripts/setup.sh`` installs it).
"""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from support.published import load  # noqa: E402


def unet_convnext_atto():
    """A U-Net on timm's ConvNeXt-Atto: the encoder's missing stride-2 feature is a zero-channel
    ``torch.empty`` of half the image's size."""
    return load("segmentation_models_pytorch").Unet("tu-convnext_atto", encoder_weights=None, classes=3)
