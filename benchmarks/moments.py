"""Time the per-tile partials of the normalisations on the CPU: ``ChannelMoments`` against
``torch.var_mean``.

    python benchmarks/moments.py

For each (N, C, H, W) shape, a channels-last float32 tensor and a region of it (3 pixels off each
border, as a direct level's owned slice), the best of 5 calls each after one warm-up, in this one
process, of ``tilec.runtime.reduce.partial_moments`` (which takes ``ChannelMoments`` there) and of
``torch.var_mean``: over (0, 2, 3) (BatchNorm's), and per sample and group over a grouped view
(instance norm's: a group per channel; group norm's: 8 groups). Prints a markdown table of
milliseconds and their ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.batching import best  # noqa: E402
from tilec.runtime.reduce import grouped, partial_moments  # noqa: E402

SHAPES = ((1, 64, 640, 640), (16, 64, 160, 160), (1, 256, 160, 160), (4, 512, 40, 40), (1, 64, 100, 100))


def views(x):
    """``(label, view, dims)`` of the reductions timed on ``x``."""
    yield "batch", x, (0, 2, 3)
    yield "instance", grouped(x, x.shape[1]), (2, 3, 4)
    yield "8 groups", grouped(x, 8), (2, 3, 4)


def main() -> None:
    print("| shape | tensor | reduction | `ChannelMoments` | `var_mean` | speed-up |")
    print("|---|---|---|--:|--:|--:|")
    for shape in SHAPES:
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(0)).contiguous(
            memory_format=torch.channels_last)
        for label, x in (("whole", whole), ("region", whole[:, :, 3:-3, 3:-3])):
            for kind, view, dims in views(x):
                ours = best(lambda v=view, d=dims: partial_moments(v, d)) * 1e3
                theirs = best(lambda v=view, d=dims: torch.var_mean(v, d, correction=0, keepdim=True)) * 1e3
                print(f"| {'×'.join(map(str, shape))} | {label} | {kind} | {ours:.1f} ms | {theirs:.1f} ms "
                      f"| {theirs / ours:.1f}× |")


if __name__ == "__main__":
    main()
