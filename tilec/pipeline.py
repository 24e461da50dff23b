"""The top-level pipeline, as a flat list of steps:
load -> trace -> recompute -> target -> plan -> distribute -> render -> write."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tilec.calibrate import conv_workspace_of, measure_kernels, search_device
from tilec.clock import clock
from tilec.codegen import load_source, render
from tilec.config import CompileConfig, budget_bytes, parse_segments
from tilec.cost.background import Background
from tilec.distribute import distribute
from tilec.errors import GridError, ShapeError, SlideError, TilecError
from tilec.graph import Graph
from tilec.ir import Plan
from tilec.modelfile import load_model
from tilec.planio import dumps, load, write_bytecode, write_files
from tilec.planner import plan
from tilec.recompute import recompute
from tilec.runtime.sources import dtype_name
from tilec.search import Choice, choose
from tilec.target import Target
from tilec.trace import Traced, trace_modes


@dataclass(frozen=True)
class CompileResult:
    plan: Plan
    plan_path: Path
    module_path: Path


def compile_model(config: CompileConfig, progress=None) -> CompileResult:
    """Compile the model file named by ``config``; write its plan, generated module and the
    module's bytecode (``tilec.planio.write_bytecode``).

    ``progress(done, total)``, if given, is called as the planner finishes each axis of a segment.
    """
    model, default_inputs = load_model(config.model_path, config.attr)
    inputs = config.inputs or default_inputs
    if inputs is None:
        raise ShapeError(f"give --input-shape N,C,H,W or --input SHAPE:DTYPE per input: {config.model_path} "
                         f"defines neither INPUTS nor INPUT_SHAPE")
    name = config.name or config.model_path.stem
    traced = trace_modes(model, inputs, config.autocast)
    target = target_for(traced.graphs[0], config.dtype, shared=bool(config.ranks))
    backgrounds = None if config.tissue_mask is None else tissue_background(config.tissue_mask, traced.graphs[0])
    like = None if config.like is None else planned_as(load(config.like))
    the_plan = plan_modes(traced, target, name, grid=config.grid, segments=config.segments,
                          recomputed=config.recompute, memory_budget=config.memory_budget, like=like,
                          batch=config.batch, backgrounds=backgrounds, dtype=config.dtype, progress=progress)
    the_plan = distribute(the_plan, config.ranks)
    source = render(the_plan)
    plan_path = config.plan_dir / f"{name}.plan.json"
    module_path = config.out_dir / f"{name}_tiled.py"
    write_files({plan_path: dumps(the_plan), module_path: source})
    write_bytecode(module_path)
    return CompileResult(the_plan, plan_path, module_path)


def planned_as(plan: Plan) -> dict:
    """Per mode its plans were traced in (``None``: both), the segments (as ``--segments`` takes
    them) and recomputed nodes of ``plan``: what ``--like`` plans another input size with."""
    plans = [plan] + ([plan.other] if plan.other is not None else [])
    return {one.mode: one.planned_as() for one in plans}


def tissue_background(path: Path, graph: Graph) -> dict[str, Background]:
    """The background of ``graph``'s first image input outside the tissue mask in the ``.npy`` file
    at ``path`` (2-D, boolean, True: tissue; its cells cover the input as ``tilec.slide(...).masked``
    applies one), by input name: what ``tilec.compile`` knows of a masked slide."""
    try:
        mask = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise SlideError(f"--tissue-mask {path}: not a readable .npy array ({' '.join(str(error).split())})") from None
    if mask.ndim != 2 or mask.dtype != np.bool_ or not mask.size:
        raise SlideError(f"--tissue-mask {path}: a tissue mask is a non-empty 2-D boolean array, got "
                         f"{mask.dtype} of shape {mask.shape}")
    images = [spec for spec in graph.inputs if graph.is_image(spec.name)]
    if not images:
        raise SlideError(f"--tissue-mask {path}: the model has no image input (N, C, H, W) for it to cover")
    name = images[0].name
    return {name: Background(~mask, graph.size(name, 0), graph.size(name, 1))}


def target_for(graph: Graph, dtype: str, shared: bool = False) -> Target:
    """What the plan of ``graph`` is for before anything is timed: autocast's device with its
    convolution workspace measured (cached, ``tilec.calibrate``), else the CPU; ``shared``: ranks
    of a process group will share its tiles."""
    if graph.autocast is None:
        return Target(shared_tiles=shared)
    return Target(device=graph.autocast.split(":")[0], conv_workspace=conv_workspace_of(graph.autocast),
                  shared_tiles=shared)


def plan_for(graph: Graph, target: Target, name: str, *, grid=None, segments=None, memory_budget=None,
             like=None, batch=None, backgrounds=None, dtype="float32", progress=None) -> Plan:
    """Plan from exactly one of: a grid, explicit segments, or a memory budget (bytes, or text such
    as ``"2GiB"``: ``tilec.config.budget_bytes``); ``batch``: with a grid or segments, the tiles of
    one shape class per call where a segment's tiles can run stacked (a budget search chooses it
    itself); ``backgrounds``: per model input, where it is known to be background
    (``tilec.cost.background``): the estimate, and so a budget search, counts the tiles computed
    once. A budget
    plans for the device it will run on (``search_device``), measured there once: its kernels'
    state (``tilec.calibrate.measure_kernels``), which weight gradient tiles compute and the time
    estimate's rates (``tilec.clock``); the search may then recompute long-lived tensors (the
    plan's nodes include the copies). ``like``: ``(segments, recomputed)`` of another plan of the
    model, at another input size (``PlanSpec.planned_as``), with those nodes recomputed: alone,
    the plan of those segments; with a budget, the search narrowed to their cuts
    (``_chosen_like``), or the whole search where no plan there fits."""
    memory_budget = budget_bytes(memory_budget)
    given = [option for option in (grid, segments, memory_budget if like is None else None, like) if option is not None]
    if len(given) != 1:
        raise GridError("give exactly one of --grid ROWSxCOLS, --segments or --memory-budget (like= alone, or with "
                        "a memory budget)")
    if batch is not None and memory_budget is not None:
        raise GridError("--batch goes with --grid or --segments: with --memory-budget the search chooses the batch")
    if like is not None and memory_budget is None:
        graph, segments = recompute(graph, like[1]), parse_segments(like[0])
    if memory_budget is not None:
        device, measured_dtype = search_device(graph.autocast, dtype)
        target = replace(target, device=device)
        target = clock(measure_kernels(target, measured_dtype), measured_dtype, graph.autocast)
        choice = None if like is None else _chosen_like(graph, target, memory_budget, like, dtype, backgrounds)
        choice = choice or choose(graph, target, memory_budget, dtype, backgrounds)
        graph, segments = choice.graph, choice.segments
    return plan(graph, target, name=name, grid=grid, segments=segments, dtype=dtype, memory_budget=memory_budget,
                batch=batch, backgrounds=backgrounds, progress=progress)


def _chosen_like(graph: Graph, target: Target, memory_budget: int, like, dtype, backgrounds) -> Choice | None:
    """``choose`` for ``graph`` with the nodes recomputed that ``like`` = ``(segments text, node
    names)`` of another plan of its model recomputes, over the cuts of its segments and a few
    others (``choose``'s ``near``): the plan of another size finds its boundaries near those of
    this one, which a smaller input may merge, move or store. ``None`` where no plan there fits
    the budget, or ``like`` names positions or nodes this graph does not have."""
    segments, recomputed = like
    try:
        near = sorted({cut for first, stop, *_ in parse_segments(segments) for cut in (first, stop)})
        return choose(recompute(graph, recomputed), target, memory_budget, dtype, backgrounds, near=near)
    except TilecError:
        return None


def plan_modes(traced: Traced, target: Target, name: str, *, grid=None, segments=None, recomputed=(),
               memory_budget=None, like=None, batch=None, backgrounds=None, dtype="float32", progress=None) -> Plan:
    """``plan_for`` each mode's graph of ``traced``, ``recomputed`` nodes recomputed for their late
    readers (``tilec.recompute``): the plan of the model's mode, carrying the other mode's where its
    graph differs (``Plan.other``), or why the other mode has none (``Plan.refused``: it does not
    trace, or cannot be planned). ``segments`` and ``recomputed`` name positions and nodes of the
    first graph: the other mode's plan takes the largest grid of the first's tiled segments instead,
    and recomputes those of the nodes it has. ``like``: per mode (``"train"``, ``"eval"`` or
    ``None``: both), ``plan_for``'s ``like`` for the graph traced in it."""
    like = like or {}
    first = traced.graphs[0]
    the_plan = plan_for(recompute(first, recomputed), target, name, grid=grid, segments=segments,
                        memory_budget=memory_budget, like=_like_for(like, first.mode), batch=batch,
                        backgrounds=backgrounds, dtype=dtype, progress=progress)
    if first.mode is None:
        return the_plan
    other, refused = None, traced.refused
    if len(traced.graphs) == 2:
        graph = traced.graphs[1]
        if segments is not None:
            grid = max((s.grid for s in the_plan.segments if s.mode == "tiled"), key=lambda g: (g[0] * g[1], g),
                       default=(1, 1))
        try:
            other = plan_for(recompute(graph, [n for n in recomputed if n in graph.nodes]), target, name,
                             grid=grid, memory_budget=memory_budget, like=_like_for(like, graph.mode), batch=batch,
                             backgrounds=backgrounds, dtype=dtype, progress=progress)
        except TilecError as error:
            refused = f"its {graph.mode}-mode graph cannot be planned: {error}"
    return the_plan.model_copy(update={"other": other, "refused": refused})


def _like_for(like: dict, mode):
    """``like``'s segments for a graph traced in ``mode``: its plan of that mode, or of both."""
    return like.get(mode, like.get(None))


def described(inputs) -> tuple[object, dict[int, Background]]:
    """``inputs`` as ``tilec.trace`` takes them, an array-like given for an input (anything with a
    ``shape`` and a ``dtype``: a tensor, a ``tilec.slide``) described by its shape and dtype; and
    per input position, the background known of it: its ``background()``, where it has one and
    that gives one (a masked slide)."""
    if not isinstance(inputs, list | tuple) or all(isinstance(n, int) for n in inputs):
        return inputs, {}
    specs, known = [], {}
    for k, item in enumerate(inputs):
        if isinstance(item, tuple | list) or not (hasattr(item, "shape") and hasattr(item, "dtype")):
            specs.append(item)
            continue
        specs.append((tuple(int(n) for n in item.shape), dtype_name(item)))
        found = item.background() if callable(getattr(item, "background", None)) else None
        if found is not None:
            known[k] = found
    return specs, known


def build(model: nn.Module, inputs, grid=None, *, segments=None, memory_budget=None, like=None, batch=None,
          recomputed=(), dtype="float32", autocast=None, name="model", progress=False, ranks=None,
          process_group=None, kernels="auto"):
    """Trace, plan, distribute, render and load in memory; return the ``TiledModel`` wrapping ``model``.

    ``inputs``: one shape (N, C, H, W) of the one input in the model's dtype, or per tensor
    argument of its forward ``(shape, dtype)`` (``tilec.trace``) or an array-like of that shape and
    dtype (a tensor, a ``tilec.slide``): one whose ``background()`` gives where it is background (a
    masked slide's, ``tilec.cost.background``) makes the estimate count the tiles computed once.
    Give one of ``grid``, ``segments`` or ``memory_budget`` (bytes or text, ``"2GiB"``); none means grid 1x1.
    ``batch``: with ``grid`` or ``segments``, tiles of one shape class per call (``tilec.runtime.batches``).
    ``recomputed``: node names recomputed for their late readers (``tilec.recompute``).
    ``like``: per mode, ``(segments, recomputed)`` of a plan of the model at another input size
    (``plan_modes``): alone, its segments; with ``memory_budget``, its segments where they fit.
    ``ranks`` / ``process_group``: share the tiles among a group's ranks (``tilec.distribute``).
    ``autocast``: "DEVICE:DTYPE" of the ``torch.autocast`` the step runs under (``tilec.trace``).
    ``kernels``: ``"generic"`` runs the generic tile kernels even on the CPU, ``"compiled"`` those with
    the tile functions compiled by ``torch.compile``, ``"cudagraphs"`` captured as CUDA graphs,
    ``"reduce-overhead"`` both (``tilec.runtime.device``).
    """
    if grid is None and segments is None and memory_budget is None and like is None:
        grid = (1, 1)
    inputs, known = described(inputs)
    with callers_modes_off():
        traced = trace_modes(model, inputs, autocast)
        target = target_for(traced.graphs[0], dtype, shared=bool(ranks) or process_group is not None)
        backgrounds = {traced.graphs[0].inputs[k].name: background for k, background in known.items()}
        the_plan = plan_modes(traced, target, name, grid=grid, segments=segments, recomputed=recomputed,
                              memory_budget=memory_budget, like=like, batch=batch, backgrounds=backgrounds,
                              dtype=dtype)
    the_plan = distribute(the_plan, ranks)
    tiled_class = load_source(render(the_plan), f"{name}_tiled").TiledModel
    return tiled_class(model, progress=progress, process_group=process_group, kernels=kernels)


@contextmanager
def callers_modes_off():
    """Gradients on, inference mode and the CPU's and CUDA's autocast off: a compile in the
    caller's process (inside a Lightning step, its validation loop or its autocast) traces, times
    and plans as ``tilec compile`` does, under the autocast ``--autocast`` names only."""
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield
