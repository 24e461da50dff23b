"""Shared helpers of the hardening tests: small model files and a CLI runner that snapshots files."""

from __future__ import annotations

import os
from pathlib import Path

from click.testing import CliRunner
from torch import nn

from tilec.cli import main

#: A small network with border padding, a pool and an unpadded convolution.
SMALL = """\
from torch import nn
INPUT_SHAPE = (1, 3, 16, 16)
model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3))
"""


def small_model() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3))


def rich_model() -> nn.Sequential:
    """Every kind of region rule: padding, ceil-mode overhang, strides, eval-mode BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.LeakyReLU(0.1),
        nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
        nn.Conv2d(4, 4, 3, stride=2, padding=2, dilation=2),
        nn.AvgPool2d(2, ceil_mode=True, count_include_pad=False),
        nn.Conv2d(4, 2, 1),
    ).eval()


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file and folder under ``folder`` (hidden ones too), with file contents."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            found[os.path.relpath(os.path.join(root, name), folder)] = None
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = Path(path).read_bytes()
    return found


def run(args: list[str]):
    """Invoke the CLI in-process; return the click ``Result``."""
    return CliRunner().invoke(main, args)
