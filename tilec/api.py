"""The Python API that ``import tilec`` exposes: ``compile`` a model into a ``TiledModel`` in this
process, or ``load`` the generated module ``tilec compile`` wrote. Each returns the ``TiledModel``
wrapping the caller's model (a drop-in ``nn.Module`` sharing its parameters)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import nn

from tilec.config import parse_autocast, parse_grid, parse_name, parse_segments
from tilec.errors import GridError, PlanError, ShapeError, TilecError
from tilec.ir import FLOAT_DTYPES, SEGMENT_MODES, is_int
from tilec.pipeline import build
from tilec.runtime.device import KERNEL_CHOICES


def compile(model: nn.Module, inputs, *, memory_budget: int | str | None = None, grid=None, segments=None,
            like: nn.Module | None = None, batch: int | None = None, recomputed=(), dtype: str = "float32",
            autocast: str | None = None, name: str = "model", ranks: int | None = None, process_group=None,
            progress: bool = False, kernels: str = "auto") -> nn.Module:
    """Trace, plan and render ``model`` for ``inputs`` in memory; return its ``TiledModel``.

    ``inputs``: one shape (N, C, H, W) of the one input in the model's dtype, or per tensor
    argument of its forward ``(shape, dtype)``: ``[((1, 3, 65536, 65536), "uint8"), ((1,), "int64")]``,
    or an array-like of its shape and dtype (``[slide, label]``): a masked ``tilec.slide`` tells where
    it is background, and the plan's time then counts the tiles computed once.
    Give one of ``memory_budget`` (bytes, or text as ``tilec compile --memory-budget`` takes it:
    ``"2GiB"``), ``grid`` (``(4, 4)`` or ``"4x4"``) or ``segments`` (``[(0, 10, (8, 8)), ...]`` or
    ``"0:10@8x8,..."``; ``"0:10@640x640px"``: tiles 640 input pixels long, the last taking the
    rest); none means a 1x1 grid. ``batch``: with a grid or segments, up to that many consecutive
    tiles of one shape class run as one call (a budget chooses it itself). ``like``: a ``TiledModel``
    of the same model for another input size (one that ``compile`` or ``load`` returned): its
    segments, in input pixels, planned at this size; with ``memory_budget``, a search narrowed to
    their cuts and a few others, which may merge, move or store them (seconds where the whole
    search takes tens; the whole search where no plan there fits). The other options
    are ``tilec.pipeline.build``'s."""
    grid = parse_grid(grid) if isinstance(grid, str) else grid
    segments = parse_segments(segments) if isinstance(segments, str) else segments
    check_options(inputs, segments, recomputed, dtype, autocast, name, ranks, kernels)
    return build(model, inputs, grid, segments=segments, memory_budget=memory_budget,
                 like=None if like is None else _planned_as(like), batch=batch, recomputed=recomputed,
                 dtype=dtype, autocast=autocast, name=name, progress=progress, ranks=ranks,
                 process_group=process_group, kernels=kernels)


def _planned_as(tiled) -> dict:
    """Per mode its plans were traced in (``None``: both), the segments and recomputed nodes of the
    ``TiledModel`` ``tiled`` (``PlanSpec.planned_as``); a ``PlanError`` line for anything else."""
    plan = getattr(type(tiled), "plan", None)
    if not isinstance(getattr(plan, "planned_as", None), tuple):
        raise PlanError(f"like must be a TiledModel that tilec.compile or tilec.load returned (from a module of this "
                        f"tilec version), got {type(tiled).__name__}")
    plans = [plan] + ([type(tiled).other.plan] if type(tiled).other is not None else [])
    return {spec.mode: spec.planned_as for spec in plans}


def check_options(inputs, segments, recomputed, dtype, autocast, name, ranks, kernels) -> None:
    """Refuse ``compile``'s arguments of the wrong kind, each in one ``TilecError`` line naming it
    (what they hold is checked where it is used: shapes by the tracer, grids by the planner)."""
    if not isinstance(inputs, list | tuple):
        raise ShapeError(f"inputs must be a shape (N, C, H, W) or a list with one (shape, dtype) or array-like per "
                         f"tensor argument of forward, got {inputs!r}")
    if segments is not None and not (isinstance(segments, list | tuple) and all(
            isinstance(s, list | tuple) and 3 <= len(s) <= 5 and all(is_int(n) for n in s[:2])
            and (len(s) < 4 or s[3] in (None, *SEGMENT_MODES)) for s in segments)):
        raise GridError(f"segments must be (first, stop, grid[, mode[, batch]]) per segment, mode None, 'tiled' or "
                        f"'stored', or their text '0:10@8x8,...', got {segments!r}")
    if not (isinstance(recomputed, list | tuple) and all(isinstance(n, str) for n in recomputed)):
        raise GridError(f"recomputed must be a list of node names, got {recomputed!r}")
    if dtype not in FLOAT_DTYPES:
        raise ShapeError(f"dtype must be one of {', '.join(FLOAT_DTYPES)} (a name), got {dtype!r}")
    if autocast is not None:
        if not isinstance(autocast, str):
            raise TilecError(f"autocast must be a text DEVICE:DTYPE such as 'cuda:float16', got {autocast!r}")
        parse_autocast(autocast)
    if not isinstance(name, str):
        raise TilecError(f"name must be a text, got {name!r}")
    parse_name(name)
    if ranks is not None and not is_int(ranks):
        raise GridError(f"ranks must be a number of ranks, got {ranks!r}")
    if kernels not in KERNEL_CHOICES:
        raise TilecError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")


def load(module_path: str | Path, model: nn.Module, **options) -> nn.Module:
    """The ``TiledModel`` of the generated module at ``module_path`` (``tilec compile``'s
    ``NAME_tiled.py``) wrapping ``model``; ``options`` go to ``TiledModel`` (``progress``,
    ``process_group``, ``read_ahead``, ``kernels``, ``return_freed_memory``)."""
    if not isinstance(module_path, str | Path):
        raise PlanError(f"module_path must be the path of a generated module NAME_tiled.py, got {module_path!r}")
    path = Path(module_path)
    if not path.is_file():
        raise PlanError(f"generated module {path} does not exist (tilec compile writes NAME_tiled.py)")
    spec = importlib.util.spec_from_file_location(f"tilec_generated_{path.stem.replace('.', '_')}", path)
    if spec is None or spec.loader is None:
        raise PlanError(f"{path} is not a Python module: tilec compile writes NAME_tiled.py")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # whatever the file raises, it is not a module tilec generated
        raise PlanError(f"{path} does not load as a generated module: {type(error).__name__}: {error}") from None
    if not isinstance(getattr(module, "TiledModel", None), type):
        raise PlanError(f"{path} is not a module tilec generated: it defines no TiledModel")
    return module.TiledModel(model, **options)
