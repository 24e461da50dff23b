"""Run ONE training step on a uint8 slide, read from disk or held in memory, and print one JSON line.

    python benchmarks/stream.py --model resnet50 --size 8192 --budget 1GiB --source disk
    python benchmarks/stream.py --model small --size 100000 --budget 2GiB --source disk --dir /data
    python benchmarks/stream.py --model resnet18 --size 32768 --budget 512MiB --source tiff --mask

The slide is ``examples/train_slide.py``'s synthetic one, an H x W x 3 uint8 ``.npy`` (written
first if missing, band by band), read through ``np.load(mmap_mode="r")`` as the (1, 3, H, W)
array the model takes (``--source disk``), or loaded whole into a uint8 tensor (``--source
memory``), or written once more as a pyramidal tiled TIFF (deflate-compressed 256-pixel tiles,
``train_slide.write_tiff``) and read through ``tilec.slide`` (``--source tiff``, tifffile through
zarr; ``--mask``: the background outside the tissue made white, and the plan made knowing where,
as ``tilec.compile`` plans for a masked slide). The model converts it to
normalised float itself and returns its cross-entropy loss against a slide label, a second input:

  resnet50  ``examples/resnet50.py`` (frozen BatchNorm, two classes);
  resnet18  ``examples/resnet18.py`` (BatchNorm in training mode, two classes);
  resnet18-frozen  the same with frozen BatchNorm (eval mode: running statistics);
  small     a strided 4x4 stem to 16 channels, three 3x3 stride-2 convolutions with ReLU to 32,
            64 and 64 channels, global average pooling and a linear layer to two classes.

The plan is chosen for ``--budget`` (or given by ``--segments``, e.g. to keep the tile size of
another run), and planned and compiled as ``tilec compile`` does, in a process of its own that
writes the module and its bytecode; the measuring process imports them (``--write-module``).
Measured over the step (forward, backward), as ``benchmarks/step.py`` measures a
CPU step: ``peak_bytes``, the growth of resident memory (VmHWM after resetting it, minus VmRSS
before), file-backed pages of the memory-mapped slide included (``file_growth_bytes``: the growth
of RssFile at the end); ``step_s``; ``waited_s`` and ``read_s``: time the tiles waited for input
and spent reading it (``TiledModel.reading``), and ``read_bytes``. With ``--device cuda`` the
model and its plan are on the GPU (the slide stays on the host and is copied tile by tile):
``peak_bytes`` is then ``torch.cuda.max_memory_allocated()`` over the step above what was
allocated before it, ``reserved_bytes`` the same of ``max_memory_reserved()``, and
``host_peak_bytes`` the growth of the process's resident memory. ``--forward-only`` measures the
forward alone (where a whole step runs too long for the machine at hand).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))

from step import Meter, import_file, parse_bytes, parse_segments  # noqa: E402
from train_slide import SlideClassifier, load_example, write_slide, write_tiff  # noqa: E402

import tilec  # noqa: E402
from tilec.calibrate import reset_high_water_mark, status_bytes  # noqa: E402
from tilec.codegen import render  # noqa: E402
from tilec.ir import segments_text  # noqa: E402
from tilec.pipeline import plan_for, target_for  # noqa: E402
from tilec.planio import dumps, write_bytecode, write_files  # noqa: E402
from tilec.planio import load as load_plan  # noqa: E402
from tilec.trace import trace  # noqa: E402


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 4, stride=4)
        self.convs = nn.Sequential(
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        )
        self.fc = nn.Linear(64, 2)

    def forward(self, x):
        return self.fc(self.convs(torch.relu(self.stem(x))).mean((2, 3)))


def backbone(name: str) -> nn.Module:
    if name.startswith("resnet18"):
        return load_example("resnet18").ResNet18(num_classes=2).train(name == "resnet18")
    return SmallCNN() if name == "small" else load_example("resnet50").ResNet50(num_classes=2).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("resnet50", "resnet18", "resnet18-frozen", "small"), default="resnet50")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--budget", type=parse_bytes)
    parser.add_argument("--segments", type=parse_segments, help="FIRST:STOP@ROWSxCOLS[/BATCH],... instead of --budget")
    parser.add_argument("--source", choices=("disk", "memory", "tiff"), default="disk")
    parser.add_argument("--mask", action="store_true", help="with --source tiff: the background made white")
    parser.add_argument("--forward-only", action="store_true", help="measure the forward alone")
    parser.add_argument("--read-ahead", choices=("on", "off"), default="on")
    parser.add_argument("--dir", type=Path, default=Path("out/slides"))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--write-module", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = SlideClassifier(backbone(args.model))
    if args.write_module:
        write_module(args, model)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / f"slide_{args.size}.npy"
    tiff = args.dir / f"slide_{args.size}.tif"
    if not path.exists() and not (args.source == "tiff" and tiff.exists()):
        write_slide(path, args.size)
    if args.source == "tiff" and not tiff.exists():
        write_tiff(tiff, path)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--write-module", out],
                       check=True)
        plan = load_plan(Path(out) / "slide.plan.json")
        module = import_file(Path(out) / "slide_tiled.py")
    model = model.to(args.device)
    tiled = module.TiledModel(model, read_ahead=args.read_ahead == "on")
    compile_s = time.perf_counter() - start
    if args.source == "tiff":
        slide = tilec.slide(tiff).masked() if args.mask else tilec.slide(tiff)
    else:
        slide = np.load(path, mmap_mode="r").transpose(2, 0, 1)[None]
    if args.source == "memory":
        slide = torch.from_numpy(np.ascontiguousarray(slide))
    label = torch.tensor([1])
    gc.collect()
    host_before = status_bytes("VmRSS")
    reset_high_water_mark()
    if args.device == "cuda":
        torch.cuda.synchronize()
        reserved_before = torch.cuda.memory_reserved()
    with Meter(torch.device(args.device)) as meter:
        loss = tiled(slide, label)
        if not args.forward_only:
            loss.backward()
    host_peak = status_bytes("VmHWM") - host_before
    record = {
        "model": args.model, "size": args.size, "source": args.source, "read_ahead": args.read_ahead,
        "mask": args.mask, "forward_only": args.forward_only,
        "budget_bytes": args.budget, "compile_s": round(compile_s, 2),
        "segments": segments_text(plan.segments),
        "predicted_peak_bytes": plan.predicted_peak_bytes, "staging_bytes": plan.staging_bytes,
        "estimated_s": round(sum(s.estimated_seconds for s in plan.segments), 2),
        "device": args.device, "peak_bytes": meter.growth, "method": meter.method,
        "file_growth_bytes": getattr(meter, "file_growth", None), "host_peak_bytes": host_peak,
        "reserved_bytes": torch.cuda.max_memory_reserved() - reserved_before if args.device == "cuda" else None,
        "step_s": round(meter.seconds, 2), "cpu_stall_fraction": meter.stalled,
        "waited_s": round(tiled.reading.waited, 3), "read_s": round(tiled.reading.seconds, 3),
        "read_bytes": tiled.reading.bytes, "loss": loss.item(),
    }
    print(json.dumps(record))
    return 0


def write_module(args, model: nn.Module) -> None:
    """Plan ``model`` for the slide and write its plan, module and bytecode into ``args.write_module``."""
    inputs = [((1, 3, args.size, args.size), "uint8"), ((1,), "int64")]
    how = {"segments": args.segments} if args.segments else {"memory_budget": args.budget}
    graph = trace(model, inputs)
    target = target_for(graph, "float32")
    if args.device == "cuda":
        target = replace(target, device="cuda")
    if args.mask:
        masked = tilec.slide(args.dir / f"slide_{args.size}.tif").masked()
        how["backgrounds"] = {graph.inputs[0].name: masked.background()}
    plan = plan_for(graph, target, "slide", **how)
    module_path = args.write_module / "slide_tiled.py"
    write_files({args.write_module / "slide.plan.json": dumps(plan), module_path: render(plan)})
    write_bytecode(module_path)


if __name__ == "__main__":
    sys.exit(main())
