"""Time BatchNorm's per-tile partial on the CPU: ``ChannelMoments`` against ``torch.var_mean``.

    python benchmarks/moments.py

For each (N, C, H, W) shape, a channels-last float32 tensor and a region of it (3 pixels off each
border, as a direct level's owned slice), the best of 5 calls each after one warm-up, in this one
process, of ``tilec.runtime.reduce.partial_moments`` (which takes ``ChannelMoments`` there) and of
``torch.var_mean`` over (0, 2, 3). Prints a markdown table of milliseconds and their ratio.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.batching import best  # noqa: E402
from tilec.runtime.reduce import partial_moments  # noqa: E402

SHAPES = ((1, 64, 640, 640), (16, 64, 160, 160), (1, 256, 160, 160), (4, 512, 40, 40), (1, 64, 100, 100))


def main() -> None:
    print("| shape | tensor | `ChannelMoments` | `var_mean` | speed-up |")
    print("|---|---|--:|--:|--:|")
    for shape in SHAPES:
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(0)).contiguous(
            memory_format=torch.channels_last)
        for label, x in (("whole", whole), ("region", whole[:, :, 3:-3, 3:-3])):
            ours = best(lambda x=x: partial_moments(x, (0, 2, 3))) * 1e3
            theirs = best(lambda x=x: torch.var_mean(x, (0, 2, 3), correction=0, keepdim=True)) * 1e3
            print(f"| {'×'.join(map(str, shape))} | {label} | {ours:.1f} ms | {theirs:.1f} ms | {theirs / ours:.1f}× |")


if __name__ == "__main__":
    main()
