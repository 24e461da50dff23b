#!/usr/bin/env bash
# Create .venv and install tilec with its test extras; torch pinned to the CPU build via constraints.txt.
# The published model code the tests also run (torchvision's models, timm, segmentation_models_pytorch)
# goes to .venv/published, outside the environment's packages: on that build torchvision's compiled
# ops do not load, and packages that import torchvision wherever it is installed (torchmetrics,
# through Lightning) would fail. tests/support/published.py imports them from there (remove the
# folder to reinstall them); where they cannot be installed, the tests of their models skip.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test]"
if [ ! -d .venv/published/timm ]; then
    .venv/bin/python -m pip install --quiet -c constraints.txt --no-deps --target .venv/published torchvision timm \
        || echo "torchvision and timm not installed: the tests of their models skip" >&2
fi
if [ ! -d .venv/published/segmentation_models_pytorch ]; then
    .venv/bin/python -m pip install --quiet -c constraints.txt --no-deps --target .venv/published \
        segmentation-models-pytorch \
        || echo "segmentation_models_pytorch not installed: the tests of its models skip" >&2
fi
