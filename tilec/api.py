"""The Python API that ``import tilec`` exposes: ``compile`` a model into a ``TiledModel`` in this
process, or ``load`` the generated module ``tilec compile`` wrote. Each returns the ``TiledModel``
wrapping the caller's model (a drop-in ``nn.Module`` sharing its parameters)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

from tilec.config import parse_grid, parse_segments
from tilec.errors import PlanError
from tilec.pipeline import build


def compile(model: nn.Module, inputs, *, memory_budget: int | str | None = None, grid=None, segments=None,
            batch: int | None = None, recomputed=(), dtype: str = "float32", autocast: str | None = None,
            name: str = "model", ranks: int | None = None, process_group=None, progress: bool = False,
            kernels: str = "auto") -> nn.Module:
    """Trace, plan and render ``model`` for ``inputs`` in memory; return its ``TiledModel``.

    ``inputs``: one shape (N, C, H, W) of the one input in the model's dtype, or per tensor
    argument of its forward ``(shape, dtype)``: ``[((1, 3, 65536, 65536), "uint8"), ((1,), "int64")]``,
    or an array-like of its shape and dtype (``[slide, label]``): a masked ``tilec.slide`` tells where
    it is background, and the plan's time then counts the tiles computed once.
    Give one of ``memory_budget`` (bytes, or text as ``tilec compile --memory-budget`` takes it:
    ``"2GiB"``), ``grid`` (``(4, 4)`` or ``"4x4"``) or ``segments`` (``[(0, 10, (8, 8)), ...]`` or
    ``"0:10@8x8,..."``; ``"0:10@640x640px"``: tiles 640 input pixels long, the last taking the
    rest); none means a 1x1 grid. ``batch``: with a grid or segments, up to that many consecutive
    tiles of one shape class run as one call (a budget chooses it itself). The other options are
    ``tilec.pipeline.build``'s."""
    grid = parse_grid(grid) if isinstance(grid, str) else grid
    segments = parse_segments(segments) if isinstance(segments, str) else segments
    return build(model, inputs, grid, segments=segments, memory_budget=memory_budget, batch=batch,
                 recomputed=recomputed,
                 dtype=dtype, autocast=autocast, name=name, progress=progress, ranks=ranks,
                 process_group=process_group, kernels=kernels)


def load(module_path: str | Path, model: nn.Module, **options) -> nn.Module:
    """The ``TiledModel`` of the generated module at ``module_path`` (``tilec compile``'s
    ``NAME_tiled.py``) wrapping ``model``; ``options`` go to ``TiledModel`` (``progress``,
    ``process_group``, ``read_ahead``, ``kernels``, ``return_freed_memory``)."""
    path = Path(module_path)
    if not path.is_file():
        raise PlanError(f"generated module {path} does not exist (tilec compile writes NAME_tiled.py)")
    spec = importlib.util.spec_from_file_location(f"tilec_generated_{path.stem.replace('.', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # whatever the file raises, it is not a module tilec generated
        raise PlanError(f"{path} does not load as a generated module: {type(error).__name__}: {error}") from None
    if not isinstance(getattr(module, "TiledModel", None), type):
        raise PlanError(f"{path} is not a module tilec generated: it defines no TiledModel")
    return module.TiledModel(model, **options)
