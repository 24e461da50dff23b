"""Codegen: ``render`` turns a plan into the source of a standalone tiled-training module.

Python prepares a small view model here: per segment and shape class, the list of
statements of one tile function (``v_<node> = <aten call>``, with the slices, border padding
and crops the tile needs) and the tensors that die after each. The jinja2 templates in
``templates/`` only loop and branch over it. One function per segment and shape class (a pair
of row and column classes), never per tile; per-tile data is a table of slice bounds.

A tile function takes ``xs`` (the tile's slices of the segment's sliced inputs), ``bs`` (its
broadcast inputs, whole), ``p`` (the segment's model tensors) and ``arena`` (where its
convolutions, max-poolings and border padding put their results) and returns the owned parts
of the segment's outputs. The same function serves forward (under no_grad) and backward (re-run
under autograd; see ``templates/module.py.j2``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import jinja2

from tilec import __version__
from tilec.cost import axis_weights
from tilec.ir import INPUT, Arg, AxisStep, AxisTile, NodeSpec, OutputTree, Plan, Segment
from tilec.local import avg_divisors, resample_local, transpose_local
from tilec.ops import IN_PLACE, Context, activations_in_place, const, plan_context, window_args
from tilec.planner import output_leaves
from tilec.regions import Interval

#: The module's function that back-propagates each ``IN_PLACE`` op in place (``_in_place``).
GRADIENT_IN_PLACE = {"relu": "_relu_grad_", "leaky_relu": "_leaky_relu_grad_", "hardtanh": "_hardtanh_grad_"}
#: Arguments that switch a module between training and eval behaviour: (op, argument index).
TRAINING_FLAGS = {"batch_norm": 5, "dropout": 2, "feature_dropout": 2, "alpha_dropout": 2}


@dataclass
class Statement:
    dst: str
    expr: str
    free: list[str] = field(default_factory=list)


@dataclass
class TileFunction:
    name: str
    row: int
    col: int
    sliced: list[str]
    broadcast: list[str]
    statements: list[Statement]
    returns: list[str]


@dataclass
class SegmentView:
    segment: Segment
    tensors: list[int]
    sliced: list[tuple[str, tuple[int, int]]]
    broadcast: list[str]
    outputs: list[tuple[str, str, tuple[int, int], bool]]
    rows: str
    cols: str
    costs: str
    shares: str
    rolled: str
    functions: list[TileFunction]
    statements: list[Statement]

    @property
    def sliced_vars(self) -> list[str]:
        return [var(name) for name, _ in self.sliced]

    @property
    def broadcast_vars(self) -> list[str]:
        return [var(name) for name in self.broadcast]

    @property
    def output_vars(self) -> list[str]:
        return [var(name) for name, *_ in self.outputs]


def var(name: str) -> str:
    return "x_in" if name == INPUT else f"v_{name}"


class _Constants:
    """Module-level tuples (upsampling index maps and weights), deduplicated by value."""

    def __init__(self):
        self.names: dict[tuple, str] = {}

    def name(self, values: tuple) -> str:
        return self.names.setdefault(values, f"_K{len(self.names)}")

    def items(self) -> list[tuple[str, str]]:
        return [(name, repr(values)) for values, name in self.names.items()]


def _index(ndim: int, spatial: tuple[int, int], rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> str:
    """``[:, :, a:b, c:d]`` selecting ``rows``/``cols`` on the spatial dims (``None``: all)."""
    parts = [":"] * ndim
    for dim, bounds in zip(spatial, (rows, cols), strict=True):
        if bounds is not None:
            parts[dim] = f"{bounds[0]}:{bounds[1]}"
    while parts and parts[-1] == ":":
        parts.pop()
    return f"[{', '.join(parts)}]" if parts else ""


def _local(read: Interval, base: Interval) -> tuple[int, int] | None:
    """``read`` in the coordinates of a tile tensor covering ``base``; ``None`` if all of it."""
    start = read.start - base.start
    if start == 0 and read.length == base.length:
        return None
    return start, start + read.length


class _TileEmitter:
    """Statements of one shape class of a tiled segment."""

    def __init__(self, context: Context, slots: dict[str, int], constants: _Constants,
                 in_place: dict[str, bool] | None = None):
        self.context, self.slots, self.constants, self.in_place = context, slots, constants, in_place or {}

    def tensor(self, name: str) -> str:
        return f"p[{self.slots[name]}]"

    def arg(self, arg: Arg, reads: dict) -> str:
        if arg.kind == "node":
            return reads.get(arg.value, var(arg.value))
        if arg.kind == "nodes":
            return "[" + ", ".join(reads.get(v, var(v)) for v in arg.value) + "]"
        if arg.kind == "tensor":
            return self.tensor(arg.value)
        return _literal(arg.value)

    def call(self, node: NodeSpec, args: list[str], target: str | None = None) -> str:
        keyed = [a if arg.keyword is None else f"{arg.keyword}={a}" for a, arg in zip(args, node.args, strict=False)]
        keyed += args[len(node.args):]
        return f"{target or node.target}({', '.join(keyed)})"

    def statement(self, node: NodeSpec, row: AxisStep, col: AxisStep, region: dict) -> str:
        """The expression computing ``node``'s tile; ``region`` maps names to (rows, cols) held."""
        if row.out.length == 0 or col.out.length == 0:
            shape = list(node.shape)
            shape[node.spatial[0]], shape[node.spatial[1]] = row.out.length, col.out.length
            return f"xs[0].new_empty({tuple(shape)!r})"
        reads = {}
        pads = {}
        for r, c in zip(row.reads, col.reads, strict=True):
            held_r, held_c = region[r.input]
            source = self.context
            spatial = source.spatial(r.input)
            ndim = len(source.shape(r.input))
            reads[r.input] = var(r.input) + _index(ndim, spatial, _local(r.read, held_r), _local(c.read, held_c))
            pads[r.input] = (r.pad, c.pad)
        kind = node.op
        if kind == "conv2d":
            return self._conv(node, reads, pads)
        if kind == "max_pool2d":
            return self._max_pool(node, reads, pads)
        if kind == "avg_pool2d":
            return self._avg_pool(node, reads, pads, row, col)
        if kind == "conv_transpose2d":
            return self._transpose(node, reads, row, col)
        if kind in ("upsample_nearest2d", "_upsample_nearest_exact2d", "upsample_bilinear2d"):
            return self._resample(node, reads, row, col)
        if kind in ("pad", "constant_pad_nd"):
            return self._pad(node, reads, pads)
        if kind == "slice" and const(node, 1, 0) % len(node.shape) in node.spatial:
            return reads[node.inputs[0]]
        if kind == "getitem":
            source = node.args[0].value
            held_r, held_c = region[source]
            r, c = row.reads[0], col.reads[0]
            crop = _index(len(node.shape), node.spatial, _local(r.read, held_r), _local(c.read, held_c))
            return f"{var(source)}[{node.args[1].value}]{crop}"
        if kind in ("view", "reshape", "_unsafe_view"):
            shape = list(node.shape)
            shape[node.spatial[0]], shape[node.spatial[1]] = row.out.length, col.out.length
            return self.call(node, [reads[node.inputs[0]], repr(shape)])
        args = [self.arg(a, reads) for a in node.args]
        if self.in_place.get(node.name):
            return f"_in_place({', '.join([args[0], IN_PLACE[node.op], GRADIENT_IN_PLACE[node.op], *args[1:]])})"
        return self.call(node, args, IN_PLACE[node.op] if node.name in self.in_place else None)

    def _padded(self, source: str, pads, value: str, native_limit=None) -> tuple[str, tuple[int, int]]:
        """Apply asymmetric padding explicitly; return the padding left for the op itself."""
        (rb, ra), (cb, ca) = pads
        native = []
        explicit = [0, 0, 0, 0]
        for axis, (before, after) in enumerate(((rb, ra), (cb, ca))):
            if before == after and (native_limit is None or before <= native_limit[axis]):
                native.append(before)
            else:
                native.append(0)
                explicit[2 - 2 * axis: 4 - 2 * axis] = [before, after]
        if any(explicit):
            source = f"_pad(arena, {source}, {tuple(explicit)!r}, {value})"
        return source, tuple(native)

    def _conv(self, node, reads, pads) -> str:
        source, native = self._padded(reads[node.inputs[0]], pads[node.inputs[0]], "0.0")
        weight = node.args[1].value
        bias = self.arg(node.args[2], reads)
        args = window_args(node, self.context.tensor_shapes[weight])
        return (f"_conv2d({source}, {self.tensor(weight)}, {bias}, {args.stride!r}, {native!r}, "
                f"{args.dilation!r}, {const(node, 6, 1)}, arena)")

    def _max_pool(self, node, reads, pads) -> str:
        args = window_args(node)
        limit = (args.kernel[0] // 2, args.kernel[1] // 2)
        source, native = self._padded(reads[node.inputs[0]], pads[node.inputs[0]], "float('-inf')", limit)
        return f"_max_pool(arena, {source}, {args.kernel!r}, {args.stride!r}, {native!r}, {args.dilation!r})"

    def _avg_pool(self, node, reads, pads, row, col) -> str:
        args = window_args(node)
        (rb, ra), (cb, ca) = pads[node.inputs[0]]
        source = reads[node.inputs[0]]
        override = const(node, 6, None)
        if (rb, ra, cb, ca) == (0, 0, 0, 0):
            return (f"aten.avg_pool2d.default({source}, {args.kernel!r}, {args.stride!r}, (0, 0), False, True, "
                    f"{override!r})")
        source = f"_pad(arena, {source}, {(cb, ca, rb, ra)!r}, 0.0)"
        rows = avg_divisors(node, row, 0, self.context)
        cols = avg_divisors(node, col, 1, self.context)
        kernel_rows, kernel_cols = args.kernel
        uniform = set(rows or (kernel_rows,)) == {kernel_rows} and set(cols or (kernel_cols,)) == {kernel_cols}
        if override is not None or uniform:
            return (f"aten.avg_pool2d.default({source}, {args.kernel!r}, {args.stride!r}, (0, 0), False, True, "
                    f"{override!r})")
        rows = rows or (kernel_rows,) * row.out.length
        cols = cols or (kernel_cols,) * col.out.length
        return (f"aten.avg_pool2d.default({source}, {args.kernel!r}, {args.stride!r}, (0, 0), False, True, 1) / "
                f"_divisor({self.constants.name(rows)}, {self.constants.name(cols)}, {reads[node.inputs[0]]})")

    def _transpose(self, node, reads, row, col) -> str:
        (crop_r, extra_r), (crop_c, extra_c) = (transpose_local(node, step, axis, self.context)
                                                for axis, step in enumerate((row, col)))
        weight = node.args[1].value
        stride, dilation = const(node, 3, (1, 1)), const(node, 7, (1, 1))
        stride = tuple(stride) if isinstance(stride, tuple) else (stride, stride)
        dilation = tuple(dilation) if isinstance(dilation, tuple) else (dilation, dilation)
        call = (f"aten.conv_transpose2d.input({reads[node.inputs[0]]}, {self.tensor(weight)}, "
                f"{self.arg(node.args[2], reads)}, {stride!r}, (0, 0), ({extra_r}, {extra_c}), {const(node, 6, 1)}, "
                f"{dilation!r})")
        return call + _index(4, (2, 3), (crop_r, crop_r + row.out.length), (crop_c, crop_c + col.out.length))

    def _resample(self, node, reads, row, col) -> str:
        low_r, high_r, frac_r = resample_local(node, row, 0, self.context)
        low_c, high_c, frac_c = resample_local(node, col, 1, self.context)
        source = reads[node.inputs[0]]
        if frac_r is None:
            return f"_gather({source}, {self.constants.name(low_r)}, {self.constants.name(low_c)})"
        names = [self.constants.name(v) for v in (low_r, high_r, frac_r, low_c, high_c, frac_c)]
        return f"_lerp({source}, {', '.join(names)})"

    def _pad(self, node, reads, pads) -> str:
        (rb, ra), (cb, ca) = pads[node.inputs[0]]
        source = reads[node.inputs[0]]
        if (rb, ra, cb, ca) == (0, 0, 0, 0):
            return source
        value = const(node, 3 if node.op == "pad" else 2, None)
        value = 0.0 if value is None else value
        rest = tuple(const(node, 1))[4:]
        return f"aten.constant_pad_nd.default({source}, {(cb, ca, rb, ra, *rest)!r}, {value!r})"


def is_batch_norm_module(node: NodeSpec) -> bool:
    """``batch_norm`` run by an ``nn.BatchNorm*`` module: at run time its training flag and
    momentum come from the module (``batch_norm_mode`` in the generated code)."""
    return node.op == "batch_norm" and "BatchNorm" in node.module_type


def in_place(node: NodeSpec) -> bool:
    """An in-place update of a buffer other than BatchNorm's batch counter (the generated module
    counts that itself, ``batch_norm_mode``), kept as the model runs it."""
    return node.target.count(".") == 2 and node.target.split(".")[1].endswith("_")


def _literal(value) -> str:
    if isinstance(value, str) and value.startswith("torch."):
        return value
    if isinstance(value, float) and value != value:
        return "float('nan')"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return f"float({str(value)!r})"
    if isinstance(value, tuple):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return repr(value)


def _free(statements: list[Statement], keep: set[str]) -> None:
    """Attach ``del`` lists: each variable dies after the statement that reads it last."""
    last: dict[str, int] = {}
    for index, statement in enumerate(statements):
        for name in _names(statement.expr):
            last[name] = index
    for name, index in last.items():
        if name not in keep:
            statements[index].free.append(name)
    for statement in statements:
        statement.free.sort()


def _names(expr: str) -> set[str]:
    import re

    return set(re.findall(r"\b(?:v_\w+|x_in)\b", expr))


def _first_of_class(tiles: tuple[AxisTile, ...]) -> list[AxisTile]:
    seen: dict[int, AxisTile] = {}
    for tile in tiles:
        seen.setdefault(tile.shape_class, tile)
    return list(seen.values())


def _table(tiles: tuple[AxisTile, ...]) -> str:
    """Per axis tile: ((start, stop) per sliced input), ((start, stop) per output), class."""
    rows = []
    for tile in tiles:
        inputs = tuple((i.start, i.stop) for i in tile.inputs)
        owned = tuple((o.start, o.stop) for o in tile.owned)
        rows.append(repr((inputs, owned, tile.shape_class)))
    return "(\n" + "".join(f"    {row},\n" for row in rows) + ")"


def _overwriting(segment: Segment, context: Context, order: list[str], in_place: dict[str, str | None]
                 ) -> dict[str, bool]:
    """The nodes of a tiled segment its tiles compute in place, each mapped to whether it
    back-propagates in place too (``tilec.ops.activations_in_place``)."""
    inside = set(order[segment.first:segment.stop])
    return {name: reader in inside for name, reader in in_place.items()
            if name in inside and context.nodes[name].inputs[0] in inside}


def _tile_function(plan: Plan, segment: Segment, context: Context, slots: dict[str, int], constants: _Constants,
                   in_place: dict[str, bool], rows: AxisTile, cols: AxisTile) -> TileFunction:
    emitter = _TileEmitter(context, slots, constants, in_place)
    sliced = [i.name for i in segment.inputs if i.sliced]
    broadcast = [i.name for i in segment.inputs if not i.sliced]
    region = {name: (r, c) for name, r, c in zip(sliced, rows.inputs, cols.inputs, strict=True)}
    for name in broadcast:
        shape = context.shape(name)
        spatial = context.spatial(name) or (0, 0)
        region[name] = (Interval(0, shape[spatial[0]]), Interval(0, shape[spatial[1]]))
    statements = []
    for row, col in zip(rows.steps, cols.steps, strict=True):
        node = context.nodes[row.node]
        statements.append(Statement(var(node.name), emitter.statement(node, row, col, region)))
        region[node.name] = (row.out, col.out)
    returns = []
    for name, own_r, own_c in zip(segment.outputs, rows.owned, cols.owned, strict=True):
        held_r, held_c = region[name]
        index = _index(len(context.shape(name)), context.spatial(name), _local(own_r, held_r), _local(own_c, held_c))
        returns.append(var(name) + index)
    _free(statements, {n for r in returns for n in _names(r)} | {var(n) for n in sliced + broadcast})
    return TileFunction(f"_s{segment.index}_{rows.shape_class}_{cols.shape_class}", rows.shape_class,
                        cols.shape_class, [var(n) for n in sliced], [var(n) for n in broadcast], statements, returns)


def _stored_statements(segment: Segment, context: Context, slots: dict[str, int], order: list[str]) -> list[Statement]:
    emitter = _TileEmitter(context, slots, _Constants())
    statements = []
    for name in order[segment.first:segment.stop]:
        node = context.nodes[name]
        args = [emitter.arg(a, {}) for a in node.args]
        if is_batch_norm_module(node):
            args[5], args[6] = f"train[{node.path!r}][0]", f"train[{node.path!r}][1]"
        elif node.op in TRAINING_FLAGS:
            args[TRAINING_FLAGS[node.op]] = f"train[{node.path!r}]"
        if node.op == "getitem":
            expr = f"{var(node.args[0].value)}[{node.args[1].value}]"
        elif in_place(node):
            expr = f"{emitter.call(node, args)} if train[{node.path!r}] else None"
        else:
            expr = emitter.call(node, args)
        statements.append(Statement(var(name), expr))
    keep = {var(n) for n in segment.outputs} | {var(i.name) for i in segment.inputs}
    _free(statements, keep)
    return statements


def _slots(segment: Segment, context: Context, order: list[str], all_tensors: list[str]) -> list[int]:
    used: dict[str, None] = {}
    for name in order[segment.first:segment.stop]:
        for arg in context.nodes[name].args:
            if arg.kind == "tensor":
                used.setdefault(arg.value)
    return [all_tensors.index(name) for name in used]


@dataclass(frozen=True)
class _Uses:
    """The activations tiles may compute in place (``tilec.ops.activations_in_place``) and the
    4-D tensors that only tiled segments read and the model does not return (allocated
    channels-last)."""

    in_place: dict[str, str | None]
    channels_last: frozenset[str]

    @classmethod
    def of(cls, plan: Plan, context: Context, order: list[str]) -> _Uses:
        outputs = frozenset(output_leaves(plan.model.output))
        mode = {name: s.mode for s in plan.segments for name in order[s.first:s.stop]}
        stored_reads = {i for name, m in mode.items() if m == "stored" for i in context.nodes[name].inputs}
        channels_last = frozenset(name for name in order if len(context.shape(name)) == 4
                                  and name not in outputs and name not in stored_reads)
        return cls(activations_in_place(plan.model.nodes, outputs), channels_last)


def _segment_view(plan: Plan, segment: Segment, context: Context, order: list[str], all_tensors: list[str],
                  constants: _Constants, uses: _Uses) -> SegmentView:
    tensors = _slots(segment, context, order, all_tensors)
    slots = {all_tensors[index]: local for local, index in enumerate(tensors)}
    sliced = [(i.name, context.spatial(i.name)) for i in segment.inputs if i.sliced]
    broadcast = [i.name for i in segment.inputs if not i.sliced]
    outputs = [(name, _shape_literal(context.shape(name)), context.spatial(name) or (0, 0),
                name in uses.channels_last) for name in segment.outputs]
    functions, costs = [], ""
    if segment.mode == "tiled":
        in_place = _overwriting(segment, context, order, uses.in_place)
        for rows in _first_of_class(segment.rows):
            for cols in _first_of_class(segment.cols):
                functions.append(_tile_function(plan, segment, context, slots, constants, in_place, rows, cols))
        members = [context.nodes[name] for name in order[segment.first:segment.stop]]
        costs = repr((tuple(axis_weights(context, members, segment.rows, 0)),
                      tuple(axis_weights(context, members, segment.cols, 1))))
    stored = _stored_statements(segment, context, slots, order) if segment.mode == "stored" else []
    rolled = tuple(name in segment.rolled for name, _ in sliced)
    return SegmentView(segment, tensors, sliced, broadcast, outputs, _table(segment.rows), _table(segment.cols),
                       costs, repr(segment.shares), repr(rolled), functions, stored)


def _shape_literal(shape) -> str:
    return repr(tuple(shape))


def _tree(tree: OutputTree) -> str:
    """Python expression building the model's return value from ``values``."""
    if tree.kind == "tensor":
        return f"values[{tree.node!r}]"
    items = [_tree(item) for item in tree.items]
    if tree.kind == "dict":
        return "{" + ", ".join(f"{key!r}: {item}" for key, item in zip(tree.keys, items, strict=True)) + "}"
    if tree.kind == "list":
        return "[" + ", ".join(items) + "]"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _environment() -> jinja2.Environment:
    packaged = resources.files("tilec") / "templates"
    folder = Path(str(packaged)) if packaged.is_dir() else Path(__file__).parent.parent / "templates"
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(plan: Plan) -> str:
    """Source of the generated module for ``plan``; the same plan gives the same bytes."""
    context = plan_context(plan)
    order = [n.name for n in plan.model.nodes]
    all_tensors = [t.name for t in plan.model.tensors]
    constants = _Constants()
    uses = _Uses.of(plan, context, order)
    views = [_segment_view(plan, segment, context, order, all_tensors, constants, uses) for segment in plan.segments]
    tiled_nodes = [context.nodes[name] for s in plan.segments if s.mode == "tiled"
                   for name in order[s.first:s.stop]]
    eval_only = tuple(sorted({n.path for n in tiled_nodes if n.op in TRAINING_FLAGS}))
    modules = sorted({(n.path, n.module_type) for n in plan.model.nodes})
    batch_norm_paths = tuple(sorted({n.path for n in plan.model.nodes if is_batch_norm_module(n)}))
    train_paths = tuple(sorted({n.path for n in plan.model.nodes if n.op in TRAINING_FLAGS or in_place(n)}
                               - set(batch_norm_paths)))
    return _environment().get_template("module.py.j2").render(
        plan=plan,
        version=__version__,
        tensors=[(t.name, tuple(t.shape), t.buffer) for t in plan.model.tensors],
        modules=modules,
        eval_only=eval_only,
        train_paths=train_paths,
        batch_norm_paths=batch_norm_paths,
        constants=constants.items(),
        segments=views,
        output=_tree(plan.model.output),
        pyrepr=repr,
    )
