"""One training step of one image on N cooperating ranks (gloo, CPU) against one process.

    python benchmarks/spatial.py --size 1024 --width 0.25 --grid 4x4 --ranks 2

The model is ``examples/vgg16.py``'s VGG16 layout with its channel widths scaled by
``--width``, or the model of ``--model FILE``. It is compiled once (``--grid`` or ``--budget``);
then each variant runs in its own processes
with one thread each: ``1 process`` (``TiledModel(model)``) and ``N ranks``
(``TiledModel(model, process_group=WORLD)``, spawned, a gloo group through a file store). A
variant runs ``--steps`` steps (forward + backward of ``sum``, float32); the first is a warm-up
and the best of the others is reported; for N ranks a step's time is the slowest rank's,
measured between barriers. Communication is counted by wrapping ``all_reduce`` and
``all_gather`` in the generated module: the bytes of the tensors reduced per step (each rank
sends about ``2 (N - 1) / N`` of that with a ring algorithm), against the activation volume
(every op's output of one forward, the bytes plain autograd computes). Stored segments run on
every rank; their forward time is measured, and so is broadcasting their outputs from one rank,
the alternative.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import sys
import tempfile
import time
from math import prod
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import environment, header, write_results  # noqa: E402
from step import parse_bytes, parse_grid  # noqa: E402

from tilec.codegen import render  # noqa: E402
from tilec.ir import segments_text  # noqa: E402
from tilec.modelfile import load_model  # noqa: E402
from tilec.pipeline import load_source, plan_for  # noqa: E402
from tilec.trace import trace  # noqa: E402

VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg(width: float) -> nn.Sequential:
    """VGG16's convolutional layout with every width scaled by ``width`` (seeded weights)."""
    torch.manual_seed(0)
    layers, channels = [], 3
    for entry in VGG16:
        if entry == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            layers += [nn.Conv2d(channels, max(1, round(entry * width)), 3, padding=1), nn.ReLU(inplace=True)]
            channels = max(1, round(entry * width))
    return nn.Sequential(*layers)


def make_model(spec: dict) -> nn.Module:
    """``{"file": PATH}``: the model of a model file (seeded); ``{"width": W}``: ``vgg(W)``."""
    if "file" in spec:
        torch.manual_seed(0)
        return load_model(Path(spec["file"]))[0]
    return vgg(spec["width"])


def _time_stored(module) -> dict:
    """Wrap the generated module's stored-segment functions: their forward seconds and the shapes
    of what they return (what broadcasting their results would move)."""
    stored = {"seconds": 0.0, "shapes": []}
    for name, function in list(vars(module).items()):
        if re.fullmatch(r"_s\d+", name):
            def timed(*args, function=function):
                start = time.perf_counter()
                outs = function(*args)
                stored["seconds"] += time.perf_counter() - start
                stored["shapes"] += [tuple(out.shape) for out in outs]
                return outs
            setattr(module, name, timed)
    return stored


def _broadcast_seconds(shapes, dtype) -> float:
    """Seconds to broadcast tensors of ``shapes`` from rank 0 (between barriers)."""
    tensors = [torch.zeros(shape, dtype=dtype) for shape in shapes]
    torch.distributed.barrier()
    start = time.perf_counter()
    for tensor in tensors:
        torch.distributed.broadcast(tensor, 0)
    torch.distributed.barrier()
    return time.perf_counter() - start


def run_variant(rank: int, world: int, store: str, source: str, spec: dict, shape, steps: int, out: str) -> None:
    """One process of a variant: ``world`` 1 means no process group."""
    torch.set_num_threads(1)
    group = None
    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        group = torch.distributed.group.WORLD
    try:
        module = load_source(Path(source).read_text(), "tiled")
        sent, stored = _count_collectives(module), _time_stored(module)
        model = make_model(spec)
        tiled = module.TiledModel(model, process_group=group)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        times = []
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            sent["bytes"], sent["seconds"] = 0, 0.0
            stored["seconds"], stored["shapes"] = 0.0, []
            if group is not None:
                torch.distributed.barrier()
            start = time.perf_counter()
            tiled(x).sum().backward()
            if group is not None:
                torch.distributed.barrier()
            times.append(time.perf_counter() - start)
        grad_sum = sum(float(p.grad.double().abs().sum()) for p in model.parameters())
        record = {"times": times, "reduced_bytes": sent["bytes"], "collective_s": sent["seconds"], "grad_sum": grad_sum,
                  "stored_forward_s": stored["seconds"],
                  "stored_out_bytes": sum(prod(shape) for shape in stored["shapes"]) * x.element_size(),
                  "broadcast_s": _broadcast_seconds(stored["shapes"], x.dtype) if group is not None else None}
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    finally:
        if group is not None:
            torch.distributed.destroy_process_group()


def _count_collectives(module) -> dict:
    """Wrap the generated module's all_reduce / all_gather to add up the bytes they move and the
    seconds they take (waiting for slower ranks included)."""
    sent = {"bytes": 0, "seconds": 0.0}
    dist = module.dist

    def timed(call, size, *args, **kwargs):
        start = time.perf_counter()
        result = call(*args, **kwargs)
        sent["bytes"] += size
        sent["seconds"] += time.perf_counter() - start
        return result

    class Counting:
        def __getattr__(self, name):
            return getattr(dist, name)

        @staticmethod
        def all_reduce(tensor, *args, **kwargs):
            return timed(dist.all_reduce, tensor.numel() * tensor.element_size(), tensor, *args, **kwargs)

        @staticmethod
        def all_gather(tensors, tensor, *args, **kwargs):
            size = tensor.numel() * tensor.element_size() * len(tensors)
            return timed(dist.all_gather, size, tensors, tensor, *args, **kwargs)

    module.dist = Counting()
    return sent


def measure(world: int, source: str, spec: dict, shape, steps: int, timeout: float) -> dict:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        processes = [context.Process(target=run_variant, args=(rank, world, f"{folder}/store", source, spec, shape,
                                                               steps, folder)) for rank in range(world)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        ranks = []
        for rank in range(world):
            path = Path(folder, f"rank{rank}.json")
            if not path.exists():
                raise RuntimeError(f"rank {rank} of {world} wrote no result (exit {processes[rank].exitcode})")
            ranks.append(json.loads(path.read_text()))
    per_step = [max(r["times"][i] for r in ranks) for i in range(steps)]
    return {"ranks": world, "first_s": per_step[0], "step_s": min(per_step[1:] or per_step),
            "reduced_bytes": ranks[0]["reduced_bytes"], "collective_s": max(r["collective_s"] for r in ranks),
            "grad_sum": ranks[0]["grad_sum"], "stored_forward_s": max(r["stored_forward_s"] for r in ranks),
            "stored_out_bytes": ranks[0]["stored_out_bytes"], "broadcast_s": ranks[0]["broadcast_s"]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--width", type=float, default=0.25, help="VGG16 layout's width factor")
    parser.add_argument("--model", type=Path, help="a model file instead of the VGG16 layout")
    parser.add_argument("--grid", type=parse_grid, default=(4, 4))
    parser.add_argument("--budget", type=parse_bytes, help="plan for this memory budget instead of --grid")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    shape = (1, 3, args.size, args.size)
    spec = {"file": str(args.model)} if args.model else {"width": args.width}
    graph = trace(make_model(spec), shape)
    plan = plan_for(graph, "m", memory_budget=args.budget) if args.budget else plan_for(graph, "m", grid=args.grid)
    activations = sum(prod(graph.nodes[n]["spec"].shape) for n in graph.graph["order"]) * 4
    with tempfile.TemporaryDirectory() as folder:
        source = str(Path(folder, "vgg_tiled.py"))
        Path(source).write_text(render(plan))
        records = [measure(world, source, spec, shape, args.steps, args.timeout) for world in (1, args.ranks)]
    single, shared = records
    env = environment([sys.argv[0], *argv])
    segments = segments_text(plan.segments)
    rows = [
        "| variant | step wall (s) | first step (s) | wall / 1 process | reduced per step (MiB) | "
        "reduced / activations | in collectives (s) | Σ|grad| |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for record in records:
        label = "1 process × 1 thread" if record["ranks"] == 1 else f"{record['ranks']} ranks × 1 thread"
        rows.append(f"| {label} | {record['step_s']:.2f} | {record['first_s']:.2f} | "
                    f"{record['step_s'] / single['step_s']:.2f} | {record['reduced_bytes'] / 2**20:.1f} | "
                    f"{record['reduced_bytes'] / activations:.3f} | {record['collective_s']:.3f} | "
                    f"{record['grad_sum']:.6g} |")
    title = args.model.stem if args.model else f"VGG16 × {args.width} widths"
    stored = ""
    if shared["stored_out_bytes"]:
        stored = (f"- stored segments (run on every rank): {shared['stored_forward_s']:.3f} s forward per rank; "
                  f"broadcasting their {shared['stored_out_bytes'] / 2**20:.2f} MiB of outputs from one rank "
                  f"instead: {shared['broadcast_s']:.3f} s, on top of computing them there (and their "
                  f"gradients would need the same in backward)\n")
    markdown = (f"# Spatial parallelism: one {args.size}² step of {title}\n\n{header(env)}\n"
                + "\n".join(rows) + f"\n\n- segments: {segments}; activations of one forward: "
                f"{activations / 2**20:.1f} MiB (float32)\n"
                f"- step: best of {args.steps - 1} after a warm-up; N ranks: the slowest rank, between barriers\n"
                f"- in collectives: the last step's seconds inside all_reduce / all_gather on the rank that "
                f"spent most there (waiting for the other rank included)\n" + stored)
    name = args.name or f"spatial_{args.model.stem if args.model else 'vgg16'}_{args.size}"
    paths = write_results(name, markdown, {"environment": env, "records": records, "activation_bytes": activations})
    print(markdown)
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
