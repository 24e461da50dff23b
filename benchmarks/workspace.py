"""Measure the memory a CPU convolution takes besides its input, output and gradients.

    python benchmarks/workspace.py              # tile convolutions, channels-last and NCHW

Three ways to convolve: "tile" is the generated module's ``_conv2d`` (channels-last, with its
own weight gradient from ``_GEMM_MIN_CHANNELS`` input channels on), "channels-last" and "NCHW"
are ``torch.conv2d``. For each layer shape, a forward under ``no_grad`` and a backward (input and weight gradients)
are measured as the growth of resident memory (VmHWM reset through /proc/self/clear_refs), with
glibc's mmap threshold pinned as tilec's generated module pins it, after two warm-up calls (and
one unprinted measurement first: the first in a process includes what oneDNN sets up once).
Printed: the growth beyond the output (forward) or the input and weight gradients (backward), as
multiples of the padded input and of the weight. These are the constants of ``tilec/cost.py``
(``CONV_*_WORKSPACE`` for NCHW stored segments, ``weight_copies`` and
``GEMM_GRADIENT_COPIES`` for tiles).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import sys
from pathlib import Path

import torch
from torch import nn

# Run from a checkout without installing: make ``tilec`` importable from the repository root.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tilec.calibrate import reset_high_water_mark, status_bytes  # noqa: E402
from tilec.pipeline import build  # noqa: E402

LAYOUTS = ("tile", "channels-last", "NCHW")
#: (input channels, output channels, output height = width, kernel size)
LAYERS = ((16, 16, 256, 3), (64, 64, 128, 3), (64, 256, 128, 1), (256, 64, 128, 1), (128, 128, 96, 3),
          (3, 64, 256, 7), (512, 512, 32, 3), (1024, 2048, 16, 1))


def _growth(fn) -> int:
    gc.collect()
    if not reset_high_water_mark():
        raise SystemExit("workspace.py: cannot reset VmHWM (/proc/self/clear_refs): no peak to measure")
    base = status_bytes("VmRSS")
    fn()
    return status_bytes("VmHWM") - base


@functools.cache
def _tile_conv():
    """The generated module's tile convolution ``_conv2d``, as ``conv(x, weight)`` (built once)."""
    tiled = build(nn.Sequential(nn.Conv2d(1, 1, 3)), (1, 1, 8, 8), grid=(2, 2))
    conv2d = type(tiled).__init__.__globals__["_conv2d"]
    return lambda x, weight: conv2d(x, weight, None, (1, 1), (0, 0), (1, 1), 1)


def measure(cin: int, cout: int, size: int, kernel: int, layout: str) -> tuple[float, float, float, float]:
    """(forward, backward) growth beyond the tensors named above, per input byte and per weight byte."""
    conv = _tile_conv() if layout == "tile" else torch.conv2d
    weight = torch.randn(cout, cin, kernel, kernel, requires_grad=True)
    x = torch.randn(1, cin, size + kernel - 1, size + kernel - 1)
    if layout != "NCHW":
        x = x.contiguous(memory_format=torch.channels_last)
    x_bytes, w_bytes, out_bytes = x.numel() * 4, weight.numel() * 4, cout * size * size * 4
    for _ in range(2):
        with torch.no_grad():
            conv(x, weight)
        leaf = x.detach().requires_grad_()
        conv(leaf, weight).sum().backward()
        weight.grad = None

    def forward():
        with torch.no_grad():
            conv(x, weight)

    forward_extra = _growth(forward) - out_bytes
    leaf = x.detach().requires_grad_()
    out = conv(leaf, weight)
    grad = torch.ones_like(out)
    backward_extra = _growth(lambda: torch.autograd.backward([out], [grad], inputs=[leaf, weight])) - x_bytes - w_bytes
    return forward_extra / x_bytes, backward_extra / x_bytes, forward_extra / w_bytes, backward_extra / w_bytes


def main() -> None:
    ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, as the generated module pins it
    measure(*LAYERS[0], layout="tile")  # once, unprinted: what the process sets up on first use
    print("| layout | Cin | Cout | size | kernel | fwd / input | bwd / input | fwd / weight | bwd / weight |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for layout in LAYOUTS:
        for cin, cout, size, kernel in LAYERS:
            values = measure(cin, cout, size, kernel, layout)
            print(f"| {layout} | {cin} | {cout} | {size} | {kernel} | "
                  + " | ".join(f"{v:.2f}" for v in values) + " |")


if __name__ == "__main__":
    main()
