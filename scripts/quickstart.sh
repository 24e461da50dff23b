#!/usr/bin/env bash
# Set up, compile the ResNet-50 example (with its classifier head) on a 2x2 grid, train one tiled
# step, and check every gradient against untiled PyTorch in float64.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/tilec compile examples/resnet50.py --grid 2x2 --out-dir out --plan-dir out
.venv/bin/python examples/train_step.py out/resnet50_tiled.py examples/resnet50.py
