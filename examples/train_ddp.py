"""Data-parallel tiled training under torchrun: DDP across images, optionally tiles across ranks.

    torchrun --nproc-per-node 2 examples/train_ddp.py examples/resnet50.py --input-shape 1,3,512,512 --grid 2x2
    torchrun --nproc-per-node 4 examples/train_ddp.py examples/unet.py --input-shape 1,3,512,512 \\
        --memory-budget 300MiB --tile-ranks 2 --accumulate 2

Rank 0 compiles the model file with tilec (into ``--out-dir``); every rank imports the generated
module. Ranks are split into groups of ``--tile-ranks`` consecutive ranks that share the tiles
of one image (``TiledModel(model, process_group=tile_group)``); ``DistributedDataParallel``
averages gradients across the groups (its process group holds one rank per tile group with the
same position). With ``--accumulate K`` each step runs K micro-batches, the first K - 1 under
``no_sync``. The backend is NCCL when CUDA is available (each rank on ``cuda:LOCAL_RANK``),
gloo otherwise; nothing else changes. Images and targets are synthetic; BatchNorm layers are
put in eval mode (tilec tiles BatchNorm with running statistics).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from tilec.config import CompileConfig, parse_bytes, parse_grid, parse_shape
from tilec.errors import TilecError
from tilec.modelfile import load_model
from tilec.pipeline import compile_model


def import_file(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def groups(world: int, tile_ranks: int) -> tuple[list, list]:
    """Every tile group (consecutive ranks) and every DDP group (same position in each tile
    group); each rank must create all of them, in the same order."""
    if world % tile_ranks:
        raise SystemExit(f"--tile-ranks {tile_ranks} does not divide the {world} ranks")
    tiles = [dist.new_group(list(range(start, start + tile_ranks))) for start in range(0, world, tile_ranks)]
    images = [dist.new_group(list(range(position, world, tile_ranks))) for position in range(tile_ranks)]
    return tiles, images


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_file", type=Path)
    parser.add_argument("--input-shape", type=parse_shape, required=True)
    plan = parser.add_mutually_exclusive_group(required=True)
    plan.add_argument("--grid", type=parse_grid)
    plan.add_argument("--memory-budget", type=parse_bytes)
    parser.add_argument("--tile-ranks", type=int, default=1, help="ranks sharing one image's tiles")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per step (no_sync)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path("out"))
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        name = f"{args.model_file.stem}_ddp"
        failed = torch.zeros(1, device=device)
        if rank == 0:
            try:
                compile_model(CompileConfig(model_path=args.model_file, inputs=((args.input_shape, None),),
                                            grid=args.grid, memory_budget=args.memory_budget, name=name,
                                            out_dir=args.out_dir, plan_dir=args.out_dir))
            except TilecError as error:
                print(f"Error: {error}", file=sys.stderr)
                failed += 1
        dist.broadcast(failed, 0)  # every rank stops if rank 0 could not compile
        if failed.item():
            raise SystemExit(2)
        generated = import_file(args.out_dir / f"{name}_tiled.py")
        torch.manual_seed(0)  # the same initial weights on every rank
        model, _ = load_model(args.model_file)
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()
        model.to(device)
        tile_groups, image_groups = groups(world, args.tile_ranks)
        image, position = divmod(rank, args.tile_ranks)
        tile_group = tile_groups[image] if args.tile_ranks > 1 else None
        tiled = generated.TiledModel(model, process_group=tile_group)
        wrapped = DistributedDataParallel(tiled, process_group=image_groups[position])
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
        for step in range(args.steps):
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            for micro in range(args.accumulate):
                # the image index: one per tile group, micro-batch and step (the same on a tile group's ranks)
                seed = (step * args.accumulate + micro) * len(tile_groups) + image
                x = torch.randn(args.input_shape, generator=torch.Generator().manual_seed(seed)).to(device)
                if micro < args.accumulate - 1:
                    with wrapped.no_sync():
                        loss = sum(y.float().square().mean() for y in tree_leaves(wrapped(x)))
                        loss.backward()
                else:
                    loss = sum(y.float().square().mean() for y in tree_leaves(wrapped(x)))
                    loss.backward()
            optimizer.step()
            seconds = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            if rank == 0:
                print(f"step {step}: loss {loss.item():.6f} on rank 0, {seconds.item():.2f} s, "
                      f"{world // args.tile_ranks} image groups x {args.tile_ranks} tile ranks")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
