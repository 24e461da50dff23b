"""Statements of generated functions: one per node, with the variables it reads and those that die.

A tile function computes its shape class's nodes in order, each ``v_<node> = <expression>``
(``Op.emit`` writes the expression through a ``TileView``: the node's reads as slices of what
the tile holds, its border padding, its parameters, its local constants); a stored segment's
function calls each node's aten op on whole tensors. Every statement records the variables it
reads, so that each dies (``del``) right after its last reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tilec.graph import Shapes
from tilec.ir import Arg, AxisStep, NodeSpec
from tilec.ops import rule
from tilec.regions import Interval


def var(name: str) -> str:
    """The variable holding tensor ``name`` (a node or a model input: their names are distinct)."""
    return f"v_{name}"


@dataclass
class Statement:
    """``dst = expr``; ``uses``: the variables ``expr`` reads; ``free``: those that die after it."""

    dst: str
    expr: str
    uses: set[str] = field(default_factory=set)
    free: list[str] = field(default_factory=list)


def kept_off(node: NodeSpec, expr: str | None) -> str | None:
    """``expr`` (or none), computing ``node``, with autocast off where the model turns it off for
    ``node`` (``NodeSpec.autocast_off``; ``tilec.runtime.kernels.without_autocast``)."""
    return f"without_autocast(lambda: {expr})" if node.autocast_off and expr is not None else expr


def index(ndim: int, spatial, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> str:
    """``[:, :, a:b, c:d]`` selecting ``rows``/``cols`` on the spatial dims (``None``: all)."""
    parts = [":"] * ndim
    for dim, bounds in zip(spatial, (rows, cols), strict=True):
        if bounds is not None:
            parts[dim] = f"{bounds[0]}:{bounds[1]}"
    while parts and parts[-1] == ":":
        parts.pop()
    return f"[{', '.join(parts)}]" if parts else ""


def local(read: Interval, base: Interval) -> tuple[int, int] | None:
    """``read`` in the coordinates of a tile tensor covering ``base``; ``None`` if all of it."""
    start = read.start - base.start
    if start == 0 and read.length == base.length:
        return None
    return start, start + read.length


def literal(value) -> str:
    if isinstance(value, str) and value.startswith("torch."):
        return value
    if isinstance(value, float) and value != value:
        return "float('nan')"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return f"float({str(value)!r})"
    if isinstance(value, tuple):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    return repr(value)


class Constants:
    """Module-level tuples (upsampling index maps and weights, divisors), deduplicated by value."""

    def __init__(self):
        self.names: dict[tuple, str] = {}

    def name(self, values: tuple) -> str:
        return self.names.setdefault(values, f"_K{len(self.names)}")

    def items(self) -> list[tuple[str, str]]:
        return [(name, repr(values)) for values, name in self.names.items()]


class TileView:
    """What ``Op.emit`` may look up while one node of one tile function is emitted: ``node``, its
    axis steps ``row`` and ``col``, the border padding of each input (``pads``), whether it runs
    in place (``in_place``: ``None`` no, ``False`` forward only, ``True`` backward too), and the
    graph's ``shapes``. Every variable the expression names is recorded in ``uses``."""

    def __init__(self, shapes: Shapes, slots: dict[str, int], constants: Constants,
                 region: dict[str, tuple[Interval, Interval]], leaves: frozenset[str] = frozenset(),
                 reductions: tuple[str, ...] = (), partials: tuple = ((), ()), anchors: tuple[str, ...] = ()):
        """``leaves``: names read from ``r`` (results of the segment's reductions and small ops);
        ``reductions``: the segment's (``AxisTile.partials`` order); ``partials``: the row and column
        tile's owned intervals of each; ``anchors``: the tile ops reading their tile's position
        (``tilec.codegen.anchored``), whose origins follow the reductions' in ``o``."""
        self.shapes, self.slots, self.constants, self.region = shapes, slots, constants, region
        self.leaves, self.reductions, self.partials, self.anchors = leaves, reductions, partials, anchors
        self.node: NodeSpec | None = None
        self.row = self.col = None
        self.pads: dict[str, tuple] = {}
        self.in_place: bool | None = None
        self.uses: set[str] = set()
        self.widened: dict[str, str] = {}

    def focus(self, node: NodeSpec, row: AxisStep | None, col: AxisStep | None, in_place: bool | None) -> None:
        self.node, self.row, self.col, self.in_place, self.uses = node, row, col, in_place, set()
        self.pads = {r.input: (r.pad, c.pad) for r, c in zip(row.reads, col.reads, strict=True)} if row else {}

    def var(self, name: str) -> str:
        if name in self.leaves:
            return self.leaf(name)
        name = self.widened.get(name, var(name))
        self.uses.add(name)
        return name

    def leaf(self, name: str) -> str:
        """A result of the segment's reductions or small ops, read from ``r``."""
        return f"r[{name!r}]"

    def owned(self, name: str) -> str:
        """The part of input ``name`` the current reduction's partial covers in this tile."""
        k = self.reductions.index(self.node.name)
        held_r, held_c = self.region[name]
        rows, cols = (local(owned[k], held) for owned, held in zip(self.partials, (held_r, held_c), strict=True))
        return self.var(name) + index(len(self.shapes.shape(name)), self.shapes.spatial(name), rows, cols)

    def origin(self, name: str) -> str:
        """The first row and column of reduction ``name``'s owned part, or of what tile op ``name``
        anchors to (``Op.anchor``): ``o``, per tile."""
        if name in self.anchors:
            return f"o[{len(self.reductions) + self.anchors.index(name)}]"
        return f"o[{self.reductions.index(name)}]"

    def local(self, name: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """The node's read of ``name`` in the coordinates of what the tile holds of it, per axis."""
        k = [r.input for r in self.row.reads].index(name)
        held_r, held_c = self.region[name]
        return local(self.row.reads[k].read, held_r), local(self.col.reads[k].read, held_c)

    def index(self, ndim: int, spatial, rows, cols) -> str:
        return index(ndim, spatial, rows, cols)

    def read(self, name: str) -> str:
        """The node's read of input ``name``: a slice of the tile's tensor where it reads less."""
        if self.row is None:
            return self.var(name)
        return self.var(name) + index(len(self.shapes.shape(name)), self.shapes.spatial(name), *self.local(name))

    def tensor(self, name: str) -> str:
        return f"p[{self.slots[name]}]"

    def arg(self, arg: Arg) -> str:
        reads = set(self.pads) if self.row is not None else set()
        if arg.kind == "node":
            return self.read(arg.value) if arg.value in reads else self.var(arg.value)
        if arg.kind == "nodes":
            return "[" + ", ".join(self.read(v) if v in reads else self.var(v) for v in arg.value) + "]"
        if arg.kind == "tensor":
            return self.tensor(arg.value)
        if arg.keyword == "device" and arg.value is not None:  # a factory op's (a mask's noise): the step's
            return "like.device"
        return literal(arg.value)

    def call(self, node: NodeSpec, args: list[str], target: str | None = None) -> str:
        keyed = [a if arg.keyword is None else f"{arg.keyword}={a}" for a, arg in zip(args, node.args, strict=False)]
        keyed += args[len(node.args):]
        return f"{target or node.target}({', '.join(keyed)})"

    def constant(self, values: tuple) -> str:
        return self.constants.name(values)

    def padded(self, name: str, value: str, native_limit=None) -> tuple[str, tuple[int, int]]:
        """The read of ``name`` with its asymmetric border padding applied in the arena; the padding
        left for the op itself to apply (symmetric, within ``native_limit`` per axis)."""
        source = self.read(name)
        (rb, ra), (cb, ca) = self.pads[name]
        native, explicit = [], [0, 0, 0, 0]
        for axis, (before, after) in enumerate(((rb, ra), (cb, ca))):
            if before == after and (native_limit is None or before <= native_limit[axis]):
                native.append(before)
            else:
                native.append(0)
                explicit[2 - 2 * axis: 4 - 2 * axis] = [before, after]
        if any(explicit):
            source = f"pad_border(arena, {source}, {tuple(explicit)!r}, {value})"
        return source, tuple(native)

    def widen(self, node: NodeSpec) -> Statement:
        """The statement widening a normalisation's input to float32 where it is half or bfloat16
        (``w_<node>``, ``Op.widens_input``), which its partial and apply then read, until ``applied``."""
        source = var(node.inputs[0])
        self.widened = {node.inputs[0]: f"w_{node.name}"}
        return Statement(f"w_{node.name}", f"widened({source})", {source})

    def partial(self, node: NodeSpec, row: AxisStep, col: AxisStep) -> Statement:
        """The statement computing a reduction's partial in one tile (``q_<node>``), where the
        caller wants it (``want``, per reduction), else ``None``."""
        self.focus(node, row, col, None)
        expr = kept_off(node, rule(node).partial(node, self))
        return Statement(f"q_{node.name}", f"{expr} if want[{self.reductions.index(node.name)}] else None", self.uses)

    def applied(self, node: NodeSpec, row: AxisStep, col: AxisStep) -> Statement:
        """The statement computing a normalisation's image output in one tile from its result, in
        its input's dtype where it read the input widened (``widen``)."""
        self.focus(node, row, col, None)
        expr = kept_off(node, rule(node).apply(node, self))
        if self.widened:
            source, self.widened = var(node.inputs[0]), {}
            expr = f"{expr}.to({source}.dtype)"
            self.uses.add(source)
        return Statement(var(node.name), expr, self.uses)

    def statement(self, node: NodeSpec, row: AxisStep, col: AxisStep, in_place: bool | None) -> Statement:
        """The statement computing ``node`` in one tile. Where the tile computes none of it, a
        per-pixel op runs on its empty inputs (giving its dtype) and any other op is an empty tensor
        of its first input's dtype (autocast's, where it casts)."""
        self.focus(node, row, col, in_place)
        if (row.out.length == 0 or col.out.length == 0) and not rule(node).pixel:
            shape = [repr(size) for size in node.shape]
            shape[node.spatial[0]], shape[node.spatial[1]] = repr(row.out.length), repr(col.out.length)
            source = self.var(node.inputs[0])
            if rule(node).batchable(node, self.shapes) and node.shape[0] == self.shapes.shape(node.inputs[0])[0]:
                shape[0] = f"{source}.shape[0]"  # as many samples as tiles stacked (``tilec.runtime.batches``)
            dtype = f", dtype=torch.{node.autocast_dtype}" if node.autocast_dtype else ""
            return Statement(var(node.name), f"{source}.new_empty(({', '.join(shape)},){dtype})", self.uses)
        return Statement(var(node.name), kept_off(node, rule(node).emit(node, self)), self.uses)

    def whole(self, node: NodeSpec, args: list[str] | None = None, expr: str | None = None) -> Statement:
        """A stored segment's statement: ``node``'s aten call on whole tensors (``args`` replacing
        its arguments' expressions, or ``expr`` the whole expression, both made through this view
        since ``focus(node, None, None, None)``)."""
        args = [self.arg(a) for a in node.args] if args is None else args
        expr = expr if expr is not None else self.call(node, args)
        return Statement(var(node.name), kept_off(node, expr), self.uses)


class CombineView(TileView):
    """What ``Op.finish`` and a small op's statement may look up in a combine function
    ``(parts, r, like, bs, p, train, update)``: leaves in ``r``, broadcast inputs in ``bs`` (by
    their position), model tensors in ``p``, the modules' modes in ``train``, and ``like``, an
    empty tensor of the model's floating dtype on its device."""

    def __init__(self, shapes: Shapes, slots: dict[str, int], constants: Constants, leaves: frozenset[str],
                 broadcast: list[str]):
        super().__init__(shapes, slots, constants, {}, leaves)
        self.broadcast = broadcast

    def var(self, name: str) -> str:
        if name in self.leaves:
            return self.leaf(name)
        return f"bs[{self.broadcast.index(name)}]"

    def dtype(self, node: NodeSpec) -> str:
        """The dtype ``node`` computes in: where autocast casts it (when compiling), autocast's in this
        step if it is on (``autocast_dtype``), else the one the model casts to (``dtype``), else the model's."""
        if node.autocast_dtype:
            return "autocast_dtype(like)"
        return f"torch.{node.dtype}" if node.dtype else "like.dtype"

    def mode(self, path: str) -> str:
        """A BatchNorm module's ``(batch statistics?, momentum)`` in this step."""
        return f"train[{path!r}]"

    def train(self, path: str) -> str:
        """A module's training flag in this step."""
        return f"train[{path!r}]"


class DirectView(CombineView):
    """What ``Op.partial`` may look up in a direct level's function ``(owned, bs, p, r, o)``: per
    reduction of the level, the owned slices of its reduced inputs (``owned``), and their origins
    (``o``); as in a combine function, leaves in ``r``, broadcast inputs in ``bs`` and model tensors
    in ``p`` (a loss's class weights)."""

    def __init__(self, shapes: Shapes, slots: dict[str, int], leaves: frozenset[str], broadcast: list[str],
                 reductions: tuple[str, ...], first: int):
        """``reductions``: the level's; ``first``: the segment's index of the first of them."""
        super().__init__(shapes, slots, Constants(), leaves, broadcast)
        self.reductions, self.first = reductions, first

    def owned(self, name: str) -> str:
        k = self.reductions.index(self.node.name)
        return f"owned[{k}][{rule(self.node).reduced(self.node, self.shapes).index(name)}]"

    def origin(self, name: str) -> str:
        return f"o[{self.first + self.reductions.index(name)}]"


def free(statements: list[Statement], keep: set[str]) -> None:
    """Attach ``del`` lists: each variable dies after the statement that reads it last."""
    last: dict[str, int] = {}
    for position, statement in enumerate(statements):
        for name in statement.uses:
            last[name] = position
    for name, position in last.items():
        if name not in keep:
            statements[position].free.append(name)
    for statement in statements:
        statement.free.sort()
