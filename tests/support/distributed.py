"""Multi-process checks on real gloo process groups (CPU).

``launch(world, worker, *args)`` starts ``world`` spawned processes, each joining one gloo group
through a file store, running ``worker(rank, world, *args)`` with one thread, and writing what
it returns (or the one-line error it raised) as JSON. The parent waits at most ``timeout``
seconds, kills what is left, and returns the per-rank results. Every process destroys its
group in ``finally``, so a failing check cannot leave a group behind.

Workers compare against single-process untiled PyTorch in float64 (``support.exactness.max_errors``).
"""

from __future__ import annotations

import json
import multiprocessing
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten

from tilec.codegen import load_source

from support.exactness import max_errors, randomise_buffers
from support.zoo import TRAIN_ZOO, ZOO

TIMEOUT = 180


def launch(world: int, worker, *args, folder: Path, timeout: float = TIMEOUT) -> list[dict]:
    """Run ``worker`` on ``world`` ranks; return each rank's ``{"result": ...}`` or ``{"error": ...}``."""
    context = multiprocessing.get_context("spawn")
    store = folder / "store"
    processes = [context.Process(target=_entry, args=(rank, world, str(store), str(folder), worker, args))
                 for rank in range(world)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        late = [process for process in processes if process.is_alive()]
        for process in late:
            process.kill()
            process.join()
    if late:
        raise TimeoutError(f"{len(late)} of {world} ranks still ran after {timeout} s (killed)")
    results = []
    for rank in range(world):
        path = folder / f"rank{rank}.json"
        if not path.exists():
            raise RuntimeError(f"rank {rank} wrote no result (exit code {processes[rank].exitcode})")
        results.append(json.loads(path.read_text()))
    return results


def _entry(rank: int, world: int, store: str, folder: str, worker, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        outcome = {"result": worker(rank, world, *args)}
    except Exception as error:  # noqa: BLE001 - reported to the parent as the rank's result
        outcome = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.json").write_text(json.dumps(outcome))


def _tiled_class(source_path: str):
    return load_source(Path(source_path).read_text(encoding="utf-8"), "tiled_rank").TiledModel


# --- workers ------------------------------------------------------------------------------------


def spatial(rank: int, world: int, source_path: str, name: str, shape) -> dict[str, float]:
    """Max errors of a TiledModel sharing its tiles over the whole group, against untiled."""
    model = ZOO[name]()
    tiled = _tiled_class(source_path)(model, process_group=dist.group.WORLD)
    return max_errors(model, tuple(shape), tiled=tiled)


def spatial_train(rank: int, world: int, source_path: str, name: str, shape) -> dict[str, float]:
    """``spatial`` on a model of ``support.zoo.TRAIN_ZOO`` (training mode: BatchNorm's batch
    statistics combine every rank's partials), its buffers after the step compared too."""
    model = TRAIN_ZOO[name]()
    tiled = _tiled_class(source_path)(model, process_group=dist.group.WORLD)
    return max_errors(model, tuple(shape), tiled=tiled)


def shares(rank: int, world: int, source_path: str, name: str) -> list[int]:
    """How many tiles of each tiled segment this rank runs."""
    module = load_source(Path(source_path).read_text(encoding="utf-8"), "tiled_rank")
    segments = [step.run for step in module.TiledModel.steps if isinstance(step.run, module.TiledSegment)]
    return [len(segment.share(world, rank)) for segment in segments]


def _loss(forward, x: torch.Tensor) -> torch.Tensor:
    """A fixed random linear function of every output."""
    leaves, _ = tree_flatten(forward(x))
    generator = torch.Generator().manual_seed(7)
    return sum((leaf * torch.randn(leaf.shape, dtype=leaf.dtype, generator=generator)).sum() for leaf in leaves)


def _image(index: int, shape) -> torch.Tensor:
    return torch.randn(tuple(shape), dtype=torch.float64, generator=torch.Generator().manual_seed(100 + index))


def _reference_grads(model: nn.Module, images: list[list[int]], shape) -> list[torch.Tensor]:
    """Untiled parameter gradients averaged over the groups of images (summed within a group)."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for group in images:
        model.zero_grad()
        for index in group:
            _loss(model, _image(index, shape)).backward()
        for t, p in zip(total, model.parameters(), strict=True):
            t.add_(p.grad / len(images))
    model.zero_grad()
    return total


def _double_model(name: str) -> nn.Module:
    model = ZOO[name]().double()
    randomise_buffers(model, torch.Generator().manual_seed(0))
    return model


def ddp(rank: int, world: int, source_path: str, name: str, shape) -> dict[str, float]:
    """DDP over TiledModel: a synced step, then two micro-batches under ``no_sync``."""
    model = _double_model(name)
    steps = {"step": [[r] for r in range(world)], "no_sync": [[world + r, r] for r in range(world)]}
    references = {label: _reference_grads(model, images, shape) for label, images in steps.items()}
    wrapped = DistributedDataParallel(_tiled_class(source_path)(model))
    errors = {}
    wrapped.zero_grad()
    _loss(wrapped, _image(rank, shape)).backward()
    errors["step"] = max((p.grad - w).abs().max().item()
                         for p, w in zip(model.parameters(), references["step"], strict=True))
    wrapped.zero_grad()
    with wrapped.no_sync():
        _loss(wrapped, _image(world + rank, shape)).backward()
    _loss(wrapped, _image(rank, shape)).backward()
    errors["no_sync"] = max((p.grad - w).abs().max().item()
                            for p, w in zip(model.parameters(), references["no_sync"], strict=True))
    return errors


def two_d(rank: int, world: int, source_path: str, name: str, shape) -> dict[str, float]:
    """2 images x 2 tile ranks: DDP across images, each image's tiles shared by a tile group."""
    tile_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    image_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    image, tile_rank = divmod(rank, 2)
    model = _double_model(name)
    reference = _reference_grads(model, [[0], [1]], shape)
    tiled = _tiled_class(source_path)(model, process_group=tile_groups[image])
    wrapped = DistributedDataParallel(tiled, process_group=image_groups[tile_rank])
    x = _image(image, shape).requires_grad_()
    _loss(wrapped, x).backward()
    errors = {"params": max((p.grad - w).abs().max().item()
                            for p, w in zip(model.parameters(), reference, strict=True))}
    want_input = _image(image, shape).requires_grad_()
    _loss(model, want_input).backward()
    errors["input"] = (x.grad - want_input.grad).abs().max().item()
    return errors


def mismatch(rank: int, world: int, source_paths: list[str], name: str, shape, what: str) -> str:
    """Run with one rank deliberately different (``what``: plan, weights or input), or on a plan
    for another number of ranks (``ranks``: ``source_paths[2]``); return the error."""
    model = _double_model(name)
    source = source_paths[1] if what == "plan" and rank == 1 else source_paths[2 if what == "ranks" else 0]
    if what == "weights" and rank == 1:
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
    tiled = _tiled_class(source)(model, process_group=dist.group.WORLD)
    tiled(_image(rank if what == "input" else 0, shape))
    return "no error"
