"""Codegen: ``render`` turns a plan into the source of a standalone tiled-training module.

The module is, in order: a header, the runtime (``tilec/runtime/``, copied verbatim), the plan's
constants and tables, one tile function per tiled segment and shape class (a pair of row and
column classes, never per tile), one function per stored segment, and ``TiledModel``. Python
prepares a small view model here (``SegmentView``, statements from ``tilec.emit``); the jinja2
template in ``templates/`` only loops and branches over it.

A tile function takes ``xs`` (the tile's slices of the segment's sliced inputs), ``bs`` (its
broadcast inputs, whole), ``p`` (the segment's model tensors) and ``arena`` (where its
convolutions, max-poolings and border padding put their results) and returns the owned parts
of the segment's outputs. The same function serves forward (under no_grad) and backward
(re-run under autograd; ``tilec.runtime.tiles``).
"""

from __future__ import annotations

import functools
import re
import types
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import jinja2

from tilec import __version__
from tilec.cost.balance import axis_weights
from tilec.emit import CombineView, Constants, DirectView, Statement, TileView, free, index, kept_off, local, var
from tilec.graph import Graph
from tilec.ir import AxisTile, NodeSpec, OutputTree, Plan, Segment
from tilec.ops import mode_flag, rule, updates_buffer
from tilec.ops.in_place import activations_in_place
from tilec.ops.pixel import is_batch_norm_module
from tilec.regions import Interval
from tilec.runtime import SOURCES
from tilec.sweeps import role


@dataclass
class TileFunction:
    """A tile function ``(xs, bs, p, arena, r, o, want)`` of one shape class: the full one (returns
    the owned outputs and the partials, ``None`` for those its caller does not ``want``) or a
    level's prefix (returns that level's partials)."""

    name: str
    row: int
    col: int
    sliced: list[str]
    broadcast: list[str]
    statements: list[Statement]
    result: str
    doc: str


@dataclass
class CombineFunction:
    """A level's combine ``(parts, r, like, bs, p, train, update)``: its results into ``r``."""

    name: str
    level: int
    statements: list[Statement]


@dataclass
class LevelView:
    """A level as the generated ``LevelSpec`` has it."""

    index: int
    direct: bool
    swept: bool
    first: int
    count: int
    switches: tuple
    results: tuple
    combine: str
    prefix: list[tuple[int, int, str]]
    merges: tuple


@dataclass
class SegmentView:
    """A segment as the template renders it; ``name``: its function's (``_S0``; another mode's
    plan prefixes its names with the mode, ``_eval_S0``)."""

    name: str
    segment: Segment
    tensors: list[int]
    sliced: list[tuple[str, tuple[int, int]]]
    broadcast: list[str]
    outputs: list[str]
    rows: str
    cols: str
    costs: str
    shares: str
    rolled: str
    functions: list[TileFunction]
    statements: list[Statement]
    prefixes: list[TileFunction] = field(default_factory=list)
    combines: list[CombineFunction] = field(default_factory=list)
    levels: list[LevelView] = field(default_factory=list)
    direct: str | None = None
    reduced: str = "()"
    reuse: bool = True

    @property
    def sliced_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sliced)

    @property
    def broadcast_names(self) -> tuple[str, ...]:
        return tuple(self.broadcast)

    @property
    def tensor_indices(self) -> tuple[int, ...]:
        return tuple(self.tensors)

    @property
    def sliced_vars(self) -> list[str]:
        return [var(name) for name, _ in self.sliced]

    @property
    def broadcast_vars(self) -> list[str]:
        return [var(name) for name in self.broadcast]

    @property
    def output_vars(self) -> list[str]:
        return [var(name) for name in self.segment.outputs]


def _first_of_class(tiles: tuple[AxisTile, ...]) -> list[AxisTile]:
    seen: dict[int, AxisTile] = {}
    for tile in tiles:
        seen.setdefault(tile.shape_class, tile)
    return list(seen.values())


def anchored(segment: Segment, graph: Graph) -> tuple[str, ...]:
    """The tile ops of ``segment`` that read their tile's position (``Op.anchor``), in node order."""
    return tuple(node.name for node in graph.members(segment.first, segment.stop)
                 if role(graph, node.name) == "tile" and rule(node).positional(node, graph))


def _table(tiles: tuple[AxisTile, ...], graph: Graph, anchors: tuple[str, ...]) -> str:
    """Per axis tile: ((start, stop) per sliced input), ((start, stop) per image output), class,
    ((start, stop) per reduction's partial, then (anchor, anchor) per node of ``anchors``: the
    origins ``o`` a tile reads)."""
    rows = []
    for tile in tiles:
        inputs = tuple((i.start, i.stop) for i in tile.inputs)
        owned = tuple((o.start, o.stop) for o in tile.owned)
        steps = {step.node: step for step in tile.steps}
        positions = tuple((a, a) for a in (rule(graph.nodes[name]).anchor(steps[name]) for name in anchors))
        partials = tuple((p.start, p.stop) for p in tile.partials) + positions
        rows.append(repr((inputs, owned, tile.shape_class, partials)))
    return "(\n" + "".join(f"    {row},\n" for row in rows) + ")"


def _overwriting(segment: Segment, graph: Graph, in_place: dict[str, str | None]) -> dict[str, bool]:
    """The nodes of a tiled segment its tiles compute in place, each mapped to whether it
    back-propagates in place too (``tilec.ops.in_place``)."""
    inside = set(graph.order[segment.first:segment.stop])
    return {name: reader in inside for name, reader in in_place.items()
            if name in inside and graph.nodes[name].inputs[0] in inside}


def _tile_functions(segment: Segment, graph: Graph, slots: dict[str, int], constants: Constants,
                    in_place: dict[str, bool], rows: AxisTile, cols: AxisTile, prefix: str,
                    anchors: tuple[str, ...]) -> list[TileFunction]:
    """The full tile function of one shape class and its levels' prefixes (``TileFunction``);
    ``anchors``: the segment's ``anchored`` tile ops."""
    sliced = [i.name for i in segment.inputs if i.sliced]
    broadcast = [i.name for i in segment.inputs if not i.sliced]
    region = {name: (r, c) for name, r, c in zip(sliced, rows.inputs, cols.inputs, strict=True)}
    for name in broadcast:
        shape = graph.shape(name)
        spatial = graph.spatial(name) or (0, 0)
        region[name] = (Interval(0, shape[spatial[0]]), Interval(0, shape[spatial[1]]))
    reductions = segment.reductions
    direct = {name for level in segment.levels if level.direct for name in level.reductions}
    view = TileView(graph, slots, constants, region, _leaves(segment, graph), reductions,
                    (rows.partials, cols.partials), anchors)
    statements, computed = [], set()
    for row, col in zip(rows.steps, cols.steps, strict=True):
        node = graph.nodes[row.node]
        kind = role(graph, node.name)
        if kind == "reduction":
            partial = rule(node).reduced(node, graph) and node.name not in direct
            if partial and graph.is_image(node.name) and rule(node).widens_input:
                statements.append(view.widen(node))
            if partial:
                statements.append(view.partial(node, row, col))
                computed.add(node.name)
            if graph.is_image(node.name):
                statements.append(view.applied(node, row, col))
        elif kind == "tile":
            statements.append(view.statement(node, row, col, in_place.get(node.name)))
        region[node.name] = (row.out, col.out)
    returns, kept = [], {var(n) for n in sliced + broadcast}
    images = [name for name in segment.outputs if graph.is_image(name)]
    for name, own_r, own_c in zip(images, rows.owned, cols.owned, strict=True):
        held_r, held_c = region[name]
        kept.add(var(name))
        returns.append(var(name) + index(len(graph.shape(name)), graph.spatial(name), local(own_r, held_r),
                                         local(own_c, held_c)))
    partials = [f"q_{name}" if name in computed else "None" for name in reductions]
    classes = f"{rows.shape_class}_{cols.shape_class}"
    functions = [_function(f"{prefix}_s{segment.index}_{classes}", rows, cols, sliced, broadcast, statements,
                           kept | {f"q_{name}" for name in computed}, f"({_tuple(returns)}, {_tuple(partials)})",
                           f"Segment {segment.index}, shape class ({rows.shape_class}, {cols.shape_class}).")]
    for level in segment.levels:
        if level.index == 0 or level.direct:
            continue
        wanted = [f"q_{name}" for name in level.reductions if name in computed]
        functions.append(_function(
            f"{prefix}_s{segment.index}_l{level.index}_{classes}", rows, cols, sliced, broadcast,
            _needed(statements, set(wanted)), kept | set(wanted), _tuple(wanted),
            f"Segment {segment.index}, shape class ({rows.shape_class}, {cols.shape_class}): the partials of "
            f"level {level.index}."))
    return functions


def _tuple(items: list[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _function(name: str, rows: AxisTile, cols: AxisTile, sliced: list[str], broadcast: list[str],
              statements: list[Statement], kept: set[str], result: str, doc: str) -> TileFunction:
    """A tile function of ``statements`` (copied, with their own ``del`` lists)."""
    statements = [replace(statement, free=[]) for statement in statements]
    free(statements, kept)
    return TileFunction(name, rows.shape_class, cols.shape_class, [var(n) for n in sliced], [var(n) for n in broadcast],
                        statements, result, doc)


def _needed(statements: list[Statement], wanted: set[str]) -> list[Statement]:
    """The statements ``wanted`` variables depend on, in order."""
    needed, kept = set(wanted), []
    for statement in reversed(statements):
        if statement.dst in needed:
            kept.append(statement)
            needed |= statement.uses
    return kept[::-1]


def _leaves(segment: Segment, graph: Graph) -> frozenset[str]:
    """The results of a tiled segment's reductions with a small output and of its small ops: the
    tiles read them from ``r``."""
    names = {name for level in segment.levels for name in (*level.reductions, *level.small)}
    return frozenset(name for name in names if not graph.is_image(name))


def _combine_function(segment: Segment, graph: Graph, slots: dict[str, int], constants: Constants,
                      level, prefix: str) -> CombineFunction:
    """The combine of one level: each reduction's merged partials and result, each small op."""
    broadcast = [i.name for i in segment.inputs if not i.sliced]
    view = CombineView(graph, slots, constants, _leaves(segment, graph) | set(level.reductions), broadcast)
    names = sorted((*level.reductions, *level.small), key=graph.position.__getitem__)
    statements = []
    for name in names:
        node = graph.nodes[name]
        view.focus(node, None, None, None)
        if name in level.reductions:
            combined = "None"
            if rule(node).reduced(node, graph):
                k = level.reductions.index(name)
                statements.append(Statement(f"c_{name}", f"parts[{k}] if parts else None"))
                combined = f"c_{name}"
            view.focus(node, None, None, None)
            expr = kept_off(node, rule(node).finish(node, combined, view))
        elif node.op == "getitem":
            expr = f"{view.var(node.args[0].value)}[{node.args[1].value}]"
        else:
            args = _mode_args(node, view)
            if node.op == "batch_norm" and node.args[3].kind != "const":  # running statistics: updated once
                args[3], args[4] = (f"({a} if update or not {args[5]} else None)" for a in args[3:5])
            expr = kept_off(node, rule(node).untiled(node, args, graph)) or view.whole(node, args).expr
        if rule(node).draws(node):
            expr = f"{expr} if update else r[{name!r}]"
        if updates_buffer(node):  # in the forward pass alone, as the model does; else the buffer as it is
            expr = f"{expr} if update and train[{node.path!r}] else {view.arg(node.args[0])}"
        statements.append(Statement(f"r[{name!r}]", expr))
    return CombineFunction(f"{prefix}_S{segment.index}_c{level.index}", level.index, statements)


def _direct_function(segment: Segment, graph: Graph, slots: dict[str, int], level) -> str:
    """The expression of a direct level's partials from ``owned`` slices and origins ``o`` (and
    what else they read: ``bs``, ``p``, ``r``)."""
    first = segment.reductions.index(level.reductions[0])
    broadcast = [i.name for i in segment.inputs if not i.sliced]
    view = DirectView(graph, slots, _leaves(segment, graph), broadcast, level.reductions, first)
    partials = []
    for name in level.reductions:
        view.focus(graph.nodes[name], None, None, None)
        partials.append(kept_off(graph.nodes[name], rule(graph.nodes[name]).partial(graph.nodes[name], view)))
    return _tuple(partials)


def _mode_args(node: NodeSpec, view: TileView) -> list[str]:
    """The argument expressions of ``node`` on whole tensors, a training flag that follows its
    module (``tilec.ops.mode_flag``; BatchNorm's mode and momentum) read from the step's ``train``."""
    args = [view.arg(a) for a in node.args]
    flag = mode_flag(node)
    if is_batch_norm_module(node):
        args[5], args[6] = f"train[{node.path!r}][0]", f"train[{node.path!r}][1]"
    elif flag is not None:
        args[flag] = f"train[{node.path!r}]"
    return args


def _stored_statements(segment: Segment, graph: Graph, slots: dict[str, int],
                       in_place: dict[str, str | None]) -> list[Statement]:
    """A stored segment's statements: each node's aten call on whole tensors, the modules' modes read
    from ``train``; an activation of ``in_place`` whose input is made in the segment runs in place on
    it, as the model's own in-place activations do (``tilec.ops.in_place``)."""
    view = TileView(graph, slots, Constants(), {})
    statements = []
    inside = set(graph.order[segment.first:segment.stop])
    for node in graph.members(segment.first, segment.stop):
        view.focus(node, None, None, None)
        args = None
        if node.op == "getitem":
            statements.append(view.whole(node, expr=f"{view.var(node.args[0].value)}[{node.args[1].value}]"))
            continue
        if mode_flag(node) is not None:
            args = _mode_args(node, view)
        if node.name in in_place and node.inputs[0] in inside:
            args = [view.arg(a) for a in node.args]
            statement = view.whole(node, args, expr=view.call(node, args, rule(node).in_place))
        else:
            untiled = rule(node).untiled(node, args, graph) if args else None
            statement = view.whole(node, args, untiled)
        if updates_buffer(node):
            statement.expr = f"{statement.expr} if train[{node.path!r}] else None"
        statements.append(statement)
    free(statements, {var(n) for n in segment.outputs} | {var(i.name) for i in segment.inputs})
    return statements


def _slots(segment: Segment, graph: Graph, all_tensors: list[str]) -> list[int]:
    used: dict[str, None] = {}
    for node in graph.members(segment.first, segment.stop):
        for arg in node.args:
            if arg.kind == "tensor":
                used.setdefault(arg.value)
    return [all_tensors.index(name) for name in used]


def _channels_last(plan: Plan, graph: Graph) -> frozenset[str]:
    """The 4-D tensors that only tiled segments read and the model does not return: allocated
    channels-last."""
    mode = {name: s.mode for s in plan.segments for name in graph.order[s.first:s.stop]}
    stored_reads = {i for name, m in mode.items() if m == "stored" for i in graph.nodes[name].inputs}
    return frozenset(name for name in graph.order if len(graph.shape(name)) == 4
                     and name not in graph.outputs and name not in stored_reads)


def _segment_view(segment: Segment, graph: Graph, all_tensors: list[str], constants: Constants,
                  in_place: dict[str, str | None], channels_last: frozenset[str], prefix: str) -> SegmentView:
    tensors = _slots(segment, graph, all_tensors)
    slots = {all_tensors[index]: position for position, index in enumerate(tensors)}
    sliced = [(i.name, graph.spatial(i.name)) for i in segment.inputs if i.sliced]
    broadcast = [i.name for i in segment.inputs if not i.sliced]
    outputs = [repr(("image", tuple(graph.shape(name)), graph.spatial(name) or (0, 0), name in channels_last))
               if graph.is_image(name) else repr(("leaf", name)) for name in segment.outputs]
    functions, prefixes, costs, reuse = [], [], "", False
    combines, levels, direct, reduced = [], [], None, "()"
    anchors = anchored(segment, graph) if segment.mode == "tiled" else ()
    if segment.mode == "tiled":
        overwriting = _overwriting(segment, graph, in_place)
        for rows in _first_of_class(segment.rows):
            for cols in _first_of_class(segment.cols):
                full, *level_functions = _tile_functions(segment, graph, slots, constants, overwriting, rows, cols,
                                                             prefix, anchors)
                functions.append(full)
                prefixes += level_functions
        members = graph.members(segment.first, segment.stop)
        reuse = not any(rule(node).positional(node, graph) for node in members)
        costs = repr((tuple(axis_weights(graph, members, segment.rows, 0)),
                      tuple(axis_weights(graph, members, segment.cols, 1))))
        sliced_names = [name for name, _ in sliced]
        for level in segment.levels:
            level_prefix = f"{prefix}_s{segment.index}_l{level.index}_"
            combines.append(_combine_function(segment, graph, slots, constants, level, prefix))
            first = sum(len(other.reductions) for other in segment.levels if other.index < level.index)
            switches = [rule(graph.nodes[name]).switch(graph.nodes[name]) for name in level.reductions]
            levels.append(LevelView(
                level.index, level.direct, level.swept, first, len(level.reductions),
                tuple(dict.fromkeys(switches)) if switches and None not in switches else (),
                (*level.reductions, *level.small), combines[-1].name,
                [(f.row, f.col, f.name) for f in prefixes if f.name.startswith(level_prefix)],
                tuple(rule(graph.nodes[name]).merge(graph.nodes[name]) for name in level.reductions)))
            if level.direct:
                direct = _direct_function(segment, graph, slots, level)
                reduced = repr(tuple((first + k, tuple(sliced_names.index(i) for i in rule(graph.nodes[name]).reduced(
                    graph.nodes[name], graph))) for k, name in enumerate(level.reductions)))
    stored = _stored_statements(segment, graph, slots, in_place) if segment.mode == "stored" else []
    rolled = tuple(name in segment.rolled for name, _ in sliced)
    tables = (_table(segment.rows, graph, anchors), _table(segment.cols, graph, anchors))
    return SegmentView(f"{prefix}_S{segment.index}", segment, tensors, sliced, broadcast, outputs, *tables, costs,
                       repr(segment.shares), repr(rolled), functions, stored, prefixes, combines, levels, direct,
                       reduced, reuse)


def _tree(tree: OutputTree) -> str:
    """Python expression building the model's return value from ``values``."""
    if tree.kind == "tensor":
        return f"values[{tree.node!r}]"
    items = [_tree(item) for item in tree.items]
    if tree.kind == "dict":
        pairs = "{" + ", ".join(f"{key!r}: {item}" for key, item in zip(tree.keys, items, strict=True)) + "}"
        return pairs if tree.mapping is None else f"mapping({tree.mapping!r}, {pairs})"
    if tree.kind == "list":
        return "[" + ", ".join(items) + "]"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


#: A runtime file's import of another runtime file, which the copy drops.
_RUNTIME_IMPORT = re.compile(r"^from tilec\.runtime\.\w+ import (?:\([^)]*\)|[^(\n]+)\n", re.MULTILINE)
#: A runtime file's other top-level imports, gathered at the top of the module.
_IMPORT = re.compile(r"^(?:import [\w.]+(?: as \w+)?|from [\w.]+ import [\w, ]+)\n", re.MULTILINE)


def runtime_source() -> tuple[list[str], str]:
    """The runtime's imports (deduplicated, in order) and its code, from ``tilec/runtime/`` in
    ``SOURCES`` order: each file without its docstring's surroundings, its imports, and the
    imports between runtime files."""
    imports: dict[str, None] = {}
    bodies = []
    for name in SOURCES:
        text = (resources.files("tilec.runtime") / name).read_text(encoding="utf-8")
        text = _RUNTIME_IMPORT.sub("", text)
        imports.update(dict.fromkeys(match.rstrip("\n") for match in _IMPORT.findall(text)))
        text = _IMPORT.sub("", text)
        bodies.append(f"# --- tilec/runtime/{name} " + "-" * (88 - len(name)) + "\n\n" + text.strip() + "\n")
    return list(imports), "\n\n".join(bodies)


@functools.cache
def _environment() -> jinja2.Environment:
    """The templates' environment, made once per process: it keeps each template compiled (and
    compiles it again where its file changed)."""
    packaged = resources.files("tilec") / "templates"
    folder = Path(str(packaged)) if packaged.is_dir() else Path(__file__).parent.parent / "templates"
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


@dataclass
class ProgramView:
    """One mode's plan as the template renders it: its ``PlanSpec`` variable (``PLAN``; another
    mode's plan ``EVAL_PLAN`` or ``TRAIN_PLAN``), the prefix of its names, its segments, the
    expression of its return value, and the modules whose flags it follows or checks."""

    plan: Plan
    var: str
    prefix: str
    segments: list[SegmentView]
    output: str
    tensors: list[tuple[str, tuple[int, ...], bool]]
    modules: list[tuple[str, str]]
    eval_only: tuple[str, ...]
    train_paths: tuple[str, ...]
    batch_norm_paths: tuple[str, ...]
    planned_as: tuple[str, tuple[str, ...]]


def _program(plan: Plan, prefix: str, constants: Constants) -> ProgramView:
    graph = Graph.of_plan(plan)
    all_tensors = [t.name for t in plan.model.tensors]
    in_place = activations_in_place(plan.model.nodes, graph.outputs)
    channels_last = _channels_last(plan, graph)
    views = [_segment_view(segment, graph, all_tensors, constants, in_place, channels_last, prefix)
             for segment in plan.segments]
    tiled_nodes = [node for s in plan.segments if s.mode == "tiled" for node in graph.members(s.first, s.stop)]
    eval_only = tuple(sorted({n.path for n in tiled_nodes if mode_flag(n) is not None and not (
        role(graph, n.name) == "reduction" or role(graph, n.name) == "small" and n.op == "batch_norm")}))
    batch_norm_paths = tuple(sorted({n.path for n in plan.model.nodes if is_batch_norm_module(n)}))
    train_paths = tuple(sorted({n.path for n in plan.model.nodes
                                if mode_flag(n) is not None or updates_buffer(n)} - set(batch_norm_paths)))
    return ProgramView(plan, f"{prefix.strip('_').upper()}_PLAN" if prefix else "PLAN", prefix, views,
                       _tree(plan.model.output), [(t.name, tuple(t.shape), t.buffer) for t in plan.model.tensors],
                       sorted({(n.path, n.module_type) for n in plan.model.nodes}),
                       eval_only, train_paths, batch_norm_paths,
                       plan.planned_as())


def render(plan: Plan) -> str:
    """Source of the generated module for ``plan`` (and its other mode's, ``Plan.other``); the
    same plan gives the same bytes."""
    constants = Constants()
    programs = [_program(plan, "", constants)]
    if plan.other is not None:
        programs.append(_program(plan.other, f"_{plan.other.mode}", constants))
    imports, runtime = runtime_source()
    return _environment().get_template("module.py.j2").render(
        plan=plan,
        inputs=tuple((spec.name, tuple(spec.shape), spec.dtype) for spec in plan.inputs),
        inputs_line=", ".join(f"{spec.name} {tuple(spec.shape)} {spec.dtype}" for spec in plan.inputs),
        version=__version__,
        imports=imports,
        runtime=runtime,
        programs=programs,
        constants=constants.items(),
        pyrepr=repr,
    )


#: The section rules of a rendered module where its runtime and its plan begin (``templates/``).
_RUNTIME_RULE, _PLAN_RULE = "\n# --- tilec/runtime/", "\n# --- the plan "


def load_source(source: str, name: str = "tilec_generated") -> types.ModuleType:
    """Execute generated source as a fresh module (no file needed), as from its file: its docstring
    and imports, then its runtime, then its plan, each at its own lines, one after the other in the
    module's namespace. The runtime, the same in every module this tilec renders, is compiled once
    per process (``_compiled_runtime``)."""
    module = types.ModuleType(name)
    filename = f"<{name}>"
    start = source.find(_RUNTIME_RULE) + 1
    stop = source.find(_PLAN_RULE, start) + 1
    if not 0 < start < stop:
        exec(compile(source, filename, "exec", dont_inherit=True), module.__dict__)
        return module
    exec(compile(source[:start], filename, "exec", dont_inherit=True), module.__dict__)
    exec(_compiled_runtime(source[start:stop], source.count("\n", 0, start), filename), module.__dict__)
    exec(_compiled_part(source[stop:], source.count("\n", 0, stop), filename), module.__dict__)
    return module


def _compiled_part(text: str, lines_before: int, filename: str) -> types.CodeType:
    """``text``, which follows ``lines_before`` lines of a module, compiled at its lines there; a
    ``pass`` on the line before keeps a string it starts with from becoming the module's docstring."""
    return compile("\n" * (lines_before - 1) + "pass\n" + text, filename, "exec", dont_inherit=True)


#: ``_compiled_part`` for the runtime, kept for the next module of the process.
_compiled_runtime = functools.lru_cache(maxsize=4)(_compiled_part)
