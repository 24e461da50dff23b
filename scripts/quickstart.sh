#!/usr/bin/env bash
# Set up, compile the VGG16 example with a 2x2 grid, train one tiled step, check gradients.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/tilec compile examples/vgg16.py --grid 2x2 --out-dir out --plan-dir out
.venv/bin/python examples/train_step.py out/vgg16_tiled.py examples/vgg16.py
