"""Train on a whole slide kept on disk as uint8, within a memory budget.

    python examples/train_slide.py --size 8192 --budget 1GiB --steps 2
    python examples/train_slide.py --size 8192 --budget 1GiB --no-mask       # background as scanned
    python examples/train_slide.py --format npy --level 0 --size 4096
    python examples/train_slide.py --task segment --size 4096 --budget 1GiB

Writes a synthetic slide-like image (tissue blobs with stained texture on a white background)
as an H x W x 3 uint8 ``.npy``, band of rows by band of rows, so that it is never held whole;
for ``--task segment`` also its tissue mask, H x W uint8 (0 background, 1 tissue). From the
``.npy`` it writes a pyramidal tiled TIFF with tifffile (deflate-compressed 256-pixel tiles,
each level half the one before, as a scanner's generic TIFF), ``--format tiff`` (the default)
trains from that and ``--format npy`` from the ``.npy``. Both are opened with ``tilec.slide``,
seen as the (1, 3, H, W) array the model takes: each tile reads its own region of the file (of
the TIFF, only the file tiles under it are decoded), and nothing holds the slide, as uint8 or as
float. ``--level`` picks a pyramid level of the TIFF. Everything outside the tissue (Otsu on the
saturation of the coarsest level) is made white (``--no-mask`` keeps the slide as written).

``classify``: the ResNet-50 of ``examples/resnet50.py`` (frozen BatchNorm) under a slide-level
label; the model converts its uint8 input to normalised float itself, pools globally and returns
its cross-entropy loss against the label, a second, per-sample input. ``--arch resnet18``
trains the ResNet-18 of ``examples/resnet18.py`` with BatchNorm in training mode instead,
``--arch attention_mil`` the attention-MIL classifier of ``examples/attention_mil.py`` (gated
attention pooling over the feature map's pixels).
``segment``: the U-Net of ``examples/unet.py`` returning its per-pixel cross-entropy loss against
the mask, a second image input: the logits are never materialised.

Each step prints its loss, its time, the share of it spent waiting for the file, and the growth
of the process's resident memory (file pages included) over the step.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

import tilec

EXAMPLES = Path(__file__).parent
#: ImageNet's per-channel mean and standard deviation, on the 0..255 scale.
MEAN, STD = (123.675, 116.28, 103.53), (58.395, 57.12, 57.375)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blobs(size: int, seed: int, count: int = 24) -> np.ndarray:
    """Tissue pieces: ellipses ``(row, col, row radius, col radius)`` over a ``size`` square."""
    rng = np.random.default_rng(seed)
    centres = rng.uniform(0.1, 0.9, (count, 2)) * size
    radii = rng.uniform(0.03, 0.12, (count, 2)) * size
    return np.concatenate([centres, radii], axis=1)


def _tissue(rows: np.ndarray, cols: np.ndarray, blobs: np.ndarray) -> np.ndarray:
    """Boolean tissue mask of the pixels ``rows`` x ``cols``."""
    inside = np.zeros((len(rows), len(cols)), dtype=bool)
    for row, col, row_radius, col_radius in blobs:
        near = np.abs(rows - row) < row_radius
        if near.any():
            dy = ((rows[near] - row) / row_radius)[:, None] ** 2
            inside[near] |= dy + ((cols - col) / col_radius)[None] ** 2 < 1
    return inside


def _write(path: Path, shape: tuple[int, ...], bands) -> None:
    """A uint8 ``.npy`` of ``shape`` from ``bands`` of rows, in order (written to a ``.partial``
    file first, renamed once complete)."""
    partial = path.with_suffix(".partial")
    with open(partial, "wb") as stream:
        np.lib.format.write_array_header_2_0(stream, {"descr": "|u1", "fortran_order": False, "shape": shape})
        for band in bands:
            stream.write(np.ascontiguousarray(band, dtype=np.uint8).tobytes())
    partial.replace(path)


def _band_rows(size: int) -> int:
    """Rows per band written at a time: about 8 million pixels."""
    return max(8, (1 << 23) // size)


def write_slide(path: Path, size: int, seed: int = 0) -> None:
    """The synthetic slide, ``size`` x ``size`` x 3 (module docstring)."""
    blobs, cols, rows_per_band = _blobs(size, seed), np.arange(size), _band_rows(size)
    rng = np.random.default_rng(seed + 1)
    stain = np.array([200, 120, 190], dtype=np.int16)  # haematoxylin-and-eosin pink-purple
    noise = rng.integers(-24, 25, (rows_per_band, 1031, 3), dtype=np.int16)  # tiled over the columns
    texture = (40 * np.sin(np.arange(size) / 9.0)).astype(np.int16)[None, :, None]

    def bands():
        for start in range(0, size, rows_per_band):
            rows = np.arange(start, min(start + rows_per_band, size))
            inside = _tissue(rows, cols, blobs)[..., None]
            grain = np.tile(np.roll(noise, start % 1031, axis=1), (1, -(-size // 1031), 1))[:len(rows), :size]
            band = np.where(inside, stain + grain + texture[:, :size] * ((rows % 13) < 6)[:, None, None],
                            245 + grain // 6)
            yield np.clip(band, 0, 255)

    _write(path, (size, size, 3), bands())


def write_mask(path: Path, size: int, seed: int = 0) -> None:
    """The tissue mask of ``write_slide``'s slide, ``size`` x ``size``."""
    blobs, cols, rows_per_band = _blobs(size, seed), np.arange(size), _band_rows(size)
    _write(path, (size, size), (_tissue(np.arange(start, min(start + rows_per_band, size)), cols, blobs)
                                for start in range(0, size, rows_per_band)))


def write_tiff(path: Path, npy: Path, smallest: int = 256) -> None:
    """The ``.npy`` slide as a pyramidal tiled TIFF: level 0 and each level half the one before,
    down to ``smallest`` pixels a side, reduced levels marked so (tifffile and OpenSlide read them
    as a pyramid); written tile by tile from the memory-mapped file, to a ``.partial`` first."""
    import tifffile

    level = np.load(npy, mmap_mode="r")
    count = 1 + max(0, int(math.log2(min(level.shape[:2]) / smallest)))
    partial = path.with_suffix(".partial")
    with tifffile.TiffWriter(partial, bigtiff=level.nbytes > 2 ** 31) as writer:
        for k in range(count):
            writer.write(level[:: 2 ** k, :: 2 ** k], tile=(256, 256), compression="zlib", photometric="rgb",
                         subfiletype=int(k > 0), resolution=(1e4 / (0.25 * 2 ** k),) * 2,
                         resolutionunit="CENTIMETER")
    partial.replace(path)


class SlideClassifier(nn.Module):
    """uint8 slide (1, 3, H, W) and its label (1,) -> cross-entropy loss of ``backbone``'s logits."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))

    def forward(self, slide: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        x = (slide.float() - self.mean) / self.std
        return F.cross_entropy(self.backbone(x), label)


class SlideSegmenter(nn.Module):
    """uint8 slide (1, 3, H, W) and its uint8 mask (1, H, W) -> per-pixel cross-entropy loss."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))

    def forward(self, slide: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = (slide.float() - self.mean) / self.std
        return F.cross_entropy(self.net(x), mask.long())


def model_for(task: str, arch: str) -> nn.Module:
    if task == "segment":
        return SlideSegmenter(load_example("unet").UNet(classes=2).eval())
    if arch == "resnet18":
        return SlideClassifier(load_example("resnet18").ResNet18(num_classes=2).train())
    if arch == "attention_mil":
        return SlideClassifier(load_example("attention_mil").attention_mil())
    return SlideClassifier(load_example("resnet50").ResNet50(num_classes=2).eval())


def resident() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, file-backed pages included."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found["VmRSS"], found["VmHWM"]


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("classify", "segment"), default="classify")
    parser.add_argument("--arch", choices=("resnet50", "resnet18", "attention_mil"), default="resnet50")
    parser.add_argument("--size", type=int, default=8192, help="slide side in pixels")
    parser.add_argument("--budget", default="1GiB", help="memory budget of the plan")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--format", choices=("tiff", "npy"), default="tiff", help="train from the TIFF or the .npy")
    parser.add_argument("--level", type=int, default=0, help="pyramid level of the TIFF to train on")
    parser.add_argument("--mask", action=argparse.BooleanOptionalAction, default=True,
                        help="make everything outside the tissue white (--no-mask: train on the slide as written)")
    parser.add_argument("--dir", type=Path, default=Path("out/slides"), help="where the slide files go")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    slide_path = args.dir / f"slide_{args.size}.npy"
    mask_path = args.dir / f"mask_{args.size}.npy"
    if not slide_path.exists():
        print(f"writing {slide_path} ({3 * args.size ** 2 / 2 ** 30:.2f} GiB)")
        write_slide(slide_path, args.size)
    if args.task == "segment" and not mask_path.exists():
        write_mask(mask_path, args.size)
    tiff_path = args.dir / f"slide_{args.size}.tif"
    if args.format == "tiff" and not tiff_path.exists():
        print(f"writing {tiff_path}")
        write_tiff(tiff_path, slide_path)

    torch.manual_seed(0)
    model = model_for(args.task, args.arch)
    start = time.perf_counter()
    try:
        slide = tilec.slide(tiff_path if args.format == "tiff" else slide_path, level=args.level)
        if args.task == "segment" and slide.level > 0:
            raise tilec.SlideError("--task segment trains on level 0 (its mask file is level 0's)")
        slide = slide.masked() if args.mask else slide
        second = ((1, *slide.shape[2:]), "uint8") if args.task == "segment" else ((1,), "int64")
        tiled = tilec.compile(model, [(slide.shape, "uint8"), second], memory_budget=args.budget,
                              name=f"slide_{args.task}")
    except tilec.TilecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{slide}; compiled in {time.perf_counter() - start:.1f} s: {len(tiled.plan.segments)} segments, "
          f"budget {args.budget}")
    target = np.load(mask_path, mmap_mode="r")[None] if args.task == "segment" else torch.tensor([1])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("steps", total=args.steps)
        for step in range(args.steps):
            before, _ = resident()
            reset_peak()
            start = time.perf_counter()
            loss = tiled(slide, target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - start
            _, peak = resident()
            waited = tiled.reading.waited
            bar.console.print(f"step {step + 1}: loss {loss.item():.4f}, {seconds:.1f} s ({waited / seconds:.1%} "
                              f"waiting for the file), resident growth {(peak - before) / 2 ** 20:,.0f} MiB")
            bar.advance(task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
