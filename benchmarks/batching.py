"""Same-shape tiles: k calls, one call batched along N, or one tile k times the area?

    python benchmarks/batching.py

One training step (forward, backward of ``sum``) of two 3x3 convolutions with ReLU, 64 channels,
channels-last, float32, on: k separate tiles of side s (with the 2-pixel halo of the two
convolutions on each side), the same k tiles stacked along the batch dimension in one call, and
one tile of side s * sqrt(k) with its halo. The last holds the same owned pixels as the k tiles
with less halo, so it also needs less memory than the batch. Each time is the best of 5 after one
unmeasured call. Prints a markdown table.
"""

from __future__ import annotations

import math
import time

import torch

CHANNELS, HALO = 64, 2
CASES = ((16, 4), (32, 4), (64, 4), (16, 16), (32, 16))


def step(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    x = x.contiguous(memory_format=torch.channels_last).requires_grad_()
    for w in weights:
        x = torch.conv2d(x, w).relu_()
    x.sum().backward()


def best(run, repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(CHANNELS, CHANNELS, 3, 3, generator=generator, requires_grad=True) for _ in range(2)]
    print("| tiles | side | k calls (ms) | one batched call (ms) | one tile of k times the area (ms) |")
    print("|--:|--:|--:|--:|--:|")
    for side, count in CASES:
        padded = side + 2 * HALO
        tiles = [torch.randn(1, CHANNELS, padded, padded, generator=generator) for _ in range(count)]
        batch = torch.cat(tiles)
        large = round(side * math.sqrt(count)) + 2 * HALO
        whole = torch.randn(1, CHANNELS, large, large, generator=generator)
        separate = best(lambda: [step(t, weights) for t in tiles])  # noqa: B023 - called within the iteration
        batched = best(lambda: step(batch, weights))  # noqa: B023
        single = best(lambda: step(whole, weights))  # noqa: B023
        print(f"| {count} | {side} | {separate * 1e3:.1f} | {batched * 1e3:.1f} | {single * 1e3:.1f} |")


if __name__ == "__main__":
    main()
