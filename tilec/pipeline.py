"""The top-level pipeline: load -> trace -> recompute -> calibrate -> shared -> plan -> distribute -> render
-> write, as a flat list of steps."""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from tilec.calibrate import calibrate, measure_kernels
from tilec.clock import clock
from tilec.codegen import render
from tilec.config import CompileConfig
from tilec.distribute import distribute, shared
from tilec.errors import GridError, ShapeError
from tilec.ir import Plan
from tilec.modelfile import load_model
from tilec.planio import dumps, write_files
from tilec.planner import plan
from tilec.recompute import recompute
from tilec.trace import trace


@dataclass(frozen=True)
class CompileResult:
    plan: Plan
    plan_path: Path
    module_path: Path


def compile_model(config: CompileConfig, progress=None) -> CompileResult:
    """Compile the model file named by ``config``; write its plan and generated module.

    ``progress(done, total)``, if given, is called as the planner finishes each axis tile.
    """
    model, default_shape = load_model(config.model_path, config.attr)
    shape = config.input_shape or default_shape
    if shape is None:
        raise ShapeError(f"give --input-shape N,C,H,W: {config.model_path} defines no INPUT_SHAPE")
    name = config.name or config.model_path.stem
    graph = shared(calibrate(recompute(trace(model, shape, config.autocast), config.recompute)), bool(config.ranks))
    the_plan = plan_for(graph, name, grid=config.grid, segments=config.segments,
                        memory_budget=config.memory_budget, dtype=config.dtype, progress=progress)
    the_plan = distribute(the_plan, config.ranks)
    source = render(the_plan)
    plan_path = config.plan_dir / f"{name}.plan.json"
    module_path = config.out_dir / f"{name}_tiled.py"
    write_files({plan_path: dumps(the_plan), module_path: source})
    return CompileResult(the_plan, plan_path, module_path)


def plan_for(graph, name: str, *, grid=None, segments=None, memory_budget=None, dtype="float32",
             progress=None) -> Plan:
    """Plan from exactly one of: a grid, explicit segments, or a memory budget in bytes (the
    search, timed on this machine's device, ``tilec.clock``, with its kernels' state measured,
    ``tilec.calibrate.measure_kernels``, may then recompute long-lived tensors: the plan's nodes
    include the copies)."""
    given = [option for option in (grid, segments, memory_budget) if option is not None]
    if len(given) != 1:
        raise GridError("give exactly one of --grid ROWSxCOLS, --segments or --memory-budget")
    if memory_budget is not None:
        from tilec.search import choose

        choice = choose(clock(measure_kernels(graph, dtype), dtype), memory_budget, dtype)
        graph, segments = choice.graph, choice.segments
    return plan(graph, name=name, grid=grid, segments=segments, dtype=dtype, memory_budget=memory_budget,
                progress=progress)


def load_source(source: str, name: str = "tilec_generated") -> types.ModuleType:
    """Execute generated source as a fresh module (no file needed)."""
    module = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def build(model: nn.Module, input_shape, grid=None, *, segments=None, memory_budget=None, recomputed=(),
          dtype="float32", autocast=None, name="model", progress=False, ranks=None, process_group=None):
    """Trace, plan, distribute, render and load in memory; return the ``TiledModel`` wrapping ``model``.

    Give one of ``grid``, ``segments`` or ``memory_budget`` (bytes); none means grid 1x1.
    ``recomputed``: node names recomputed for their late readers (``tilec.recompute``).
    ``ranks`` / ``process_group``: share the tiles among a group's ranks (``tilec.distribute``).
    ``autocast``: "DEVICE:DTYPE" of the ``torch.autocast`` the step runs under (``tilec.trace``).
    """
    if grid is None and segments is None and memory_budget is None:
        grid = (1, 1)
    graph = shared(calibrate(recompute(trace(model, input_shape, autocast), recomputed)),
                   bool(ranks) or process_group is not None)
    the_plan = plan_for(graph, name, grid=grid, segments=segments, memory_budget=memory_budget, dtype=dtype)
    the_plan = distribute(the_plan, ranks)
    tiled_class = load_source(render(the_plan), f"{name}_tiled").TiledModel
    return tiled_class(model, progress=progress, process_group=process_group)
