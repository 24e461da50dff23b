#!/usr/bin/env bash
# Create .venv and install tilec with its test extras; torch pinned to the CPU build via constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[test]"
