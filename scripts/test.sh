#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: one single-threaded worker per core, at most 4
# (pytest-xdist; `-n 0` runs it in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -n auto --maxprocesses 4 --dist worksteal "$@"
