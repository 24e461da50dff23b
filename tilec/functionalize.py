"""``functionalize``: in-place writes into views of a captured program become scatters.

``torch.export`` keeps Python's in-place writes into views as they are: ``out[:, :6] += x`` is an
in-place ``add_`` on a ``slice`` of ``out`` (and a ``copy_`` back), and later readers of ``out``
still name the node from before the write. tilec reads a program functionally (an in-place op's
result replaces its argument for later readers), which is right for writes into whole tensors
and wrong for writes into views. This pass rewrites the program so that every write into a view
is functional: the in-place node keeps its name and takes its out-of-place twin
(``add_`` -> ``add``), and a ``slice_scatter`` / ``select_scatter`` per view level writes the
result back into the base (none for an ``alias``, a view of the whole tensor); later readers of
the base read the scatter, and views of it taken before the write are taken again from it. A
``copy_`` into a view becomes a scatter of what it copies, or disappears when it writes back the
view's own content. Two writes need no scatter: an in-place op that is an identity in the traced
mode (eval-mode ``dropout_``, or ``p = 0``) disappears, its readers reading what it wrote into; and a
write through a view that cannot be scattered back (a ``flatten``, as torchvision's EfficientNet
classifier has before its ``Dropout(inplace=True)``) is read functionally, as a write into a whole
tensor, when nothing reads the base or another view of it afterwards (``_observed_elsewhere``).

``torch``'s functionalisation (``run_decompositions``) would do this too, but it also rewrites
every other node (``batch_norm``, ``relu_``, ``chunk``...) and renames them. Here a program without
a write into a view, or into a tensor one of whose earlier views is read afterwards, is left
untouched (``needed``), so its nodes and names stay as exported.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch._guards import detect_fake_mode

from tilec.errors import UnsupportedLayerError

aten = torch.ops.aten
SLICE, SELECT = aten.slice.Tensor, aten.select.int
SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default}
#: Views that can be taken again from a new base but not scattered back into it.
REPLAY = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
          aten.transpose.int, aten.expand.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
          aten.unsqueeze.default, aten.flatten.using_ints, aten.unflatten.int, aten.t.default}
#: In-place random ops that are identities when their ``train`` argument (the third) is false or
#: their ``p`` (the second) is 0.
DROPOUTS = {aten.dropout_.default, aten.feature_dropout_.default, aten.alpha_dropout_.default,
            aten.feature_alpha_dropout_.default}


class WriteThroughView(Exception):
    """An in-place write through a view that cannot be scattered back (``node``: the write)."""

    def __init__(self, node: torch.fx.Node, why: str):
        super().__init__(why)
        self.node = node


def fake_value(node):
    """The fake tensor (or tensors) export recorded as ``node``'s value; ``None`` for a non-node."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def fake_shape(node) -> tuple[int, ...]:
    """The shape export recorded for ``node``'s tensor value."""
    return tuple(int(n) for n in fake_value(node).shape)


def fake_mode(graph: torch.fx.Graph):
    """The fake mode export traced ``graph`` under (its placeholders' values'), for new nodes' values."""
    return detect_fake_mode([n.meta["val"] for n in graph.nodes if n.op == "placeholder"])


#: What a node made in another's stead keeps of its metadata: its module path and stack, and
#: whether autocast is off for it (``tilec.autocast_blocks``).
KEPT_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "autocast_off")


def made_like(graph: torch.fx.Graph, fake, target, args, like: torch.fx.Node, kwargs=None, name=None):
    """A new node calling ``target(*args, **kwargs)`` at ``graph``'s insertion point, named ``name``
    (fx's name for ``target`` where ``None``), keeping ``like``'s module path and stack, its value
    computed on fake tensors under ``fake``."""
    kwargs = kwargs or {}
    new = graph.create_node("call_function", target, tuple(args), kwargs, name=name)
    new.meta = {k: v for k, v in like.meta.items() if k in KEPT_META}
    with fake:
        new.meta["val"] = target(*torch.fx.node.map_arg(tuple(args), fake_value), **kwargs)
    return new


class Rewrite:
    """A pass rewriting an exported program's graph in place (``tilec.blocks``,
    ``tilec.broadcasts``, ``tilec.unflatten``): ``run`` rewrites ``graph`` and says whether it
    changed it; ``new`` makes a node at the graph's insertion point, its value computed on fake
    tensors; ``apply`` runs the pass on a program."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph, self.fake = graph, fake_mode(graph)

    def new(self, target, args, like: torch.fx.Node, name: str):
        return made_like(self.graph, self.fake, target, args, like, name=name)

    def run(self) -> bool:
        raise NotImplementedError

    @classmethod
    def apply(cls, program: torch.export.ExportedProgram) -> bool:
        """Run the pass on ``program`` in place; whether it changed it."""
        return relinted(program, cls(program.graph).run())


def relinted(program: torch.export.ExportedProgram, changed: bool) -> bool:
    """``changed``, ``program``'s graph linted and its module recompiled where a pass changed it."""
    if changed:
        program.graph.lint()
        program.graph_module.recompile()
    return changed


def schema_arguments(node: torch.fx.Node) -> list[tuple[torch.Argument, object]]:
    """Every argument of an aten ``node`` in schema order with its value, defaults filled in."""
    result = []
    for position, argument in enumerate(node.target._schema.arguments):
        if position < len(node.args):
            value = node.args[position]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            target = node.target
            raise UnsupportedLayerError(f"op aten.{target._opname}.{target._overloadname} misses argument "
                                        f"{argument.name}")
        result.append((argument, value))
    return result


def _shares_storage(a, b) -> bool:
    try:
        return fake_value(a).untyped_storage()._cdata == fake_value(b).untyped_storage()._cdata
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def _in_place(node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and bool(target._schema.arguments) and target._schema.arguments[0].alias_info is not None
            and target._schema.arguments[0].alias_info.is_write)


def _functional(target):
    if target is aten.copy_.default:
        return aten.copy.default
    if not target._opname.endswith("_") or target._opname.startswith("_"):
        return None
    packet = getattr(aten, target._opname[:-1], None)
    return None if packet is None else getattr(packet, target._overloadname, None)


def _identity(node) -> bool:
    """Whether the in-place ``node`` leaves its input as it is (an eval-mode or ``p = 0`` dropout)."""
    return node.target in DROPOUTS and (not node.args[2] or node.args[1] == 0)


def _step(node):
    """``(base, step)`` when ``node`` is a view this pass can invert or replay, else ``None``;
    ``step`` is hashable: ``("slice", dim, start, end, step)``, ``("select", dim, index)``,
    ``("alias",)`` or ``("replay", target, args, kwargs)``."""
    if node.op != "call_function":
        return None
    if node.target is SLICE:
        base = node.args[0]
        size = fake_value(base).shape
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(size)
        start, end, step = (list(node.args[2:5]) + [None, None, None])[:3]
        start, end, _ = slice(start, end, step).indices(int(size[dim]))
        return base, ("slice", dim, start, end, step or 1)
    if node.target is SELECT:
        base, dim, index = node.args[:3]
        size = fake_value(base).shape
        dim %= len(size)
        return base, ("select", dim, index % int(size[dim]))
    if node.target is aten.alias.default:
        return node.args[0], ("alias",)
    if node.target in REPLAY and _shares_storage(node, node.args[0]):  # reshape may copy
        return node.args[0], ("replay", node.target, tuple(node.args[1:]), tuple(sorted(node.kwargs.items())))
    if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and node.args[0].target in SPLITS:
        split, index = node.args
        base = split.args[0]
        dim = (split.args[2] if len(split.args) > 2 else 0) % fake_value(base).ndim
        sizes = [int(v.shape[dim]) for v in fake_value(split)]
        start = sum(sizes[:index])
        return base, ("slice", dim, start, start + sizes[index], 1)
    return None


def needed(nodes: list[torch.fx.Node]) -> bool:
    """Whether some in-place op writes into a view, or into a tensor one of whose views (taken
    before the write) is read after it."""
    position = {node: index for index, node in enumerate(nodes)}
    for node in nodes:
        if not (_in_place(node) and isinstance(node.args[0], torch.fx.Node)):
            continue
        written = node.args[0]
        if _step(written):
            return True
        stack = [written]
        while stack:
            base = stack.pop()
            for user in base.users:
                found = _step(user)
                if position.get(user, -1) < position[node] and found and found[0] is base:
                    if any(position.get(reader, -1) > position[node] for reader in user.users):
                        return True
                    stack.append(user)
    return False


class _Rewrite:
    """The pass's state over one program: per tensor, the root it aliases, the chain of view steps
    from the root, and the root's version when it was taken; per root, its latest value."""

    def __init__(self, program: torch.export.ExportedProgram):
        self.graph = program.graph
        self.nodes = list(self.graph.nodes)
        self.fake = fake_mode(self.graph)
        self.alias: dict = {}
        self.version: dict = {}
        self.current: dict = {}
        self.taken_again: dict = {}

    def record(self, node) -> None:
        found = _step(node)
        if found is None:
            self.alias[node] = (node, (), self.version.get(node, 0))
            return
        parent, step = found
        root, chain, _ = self.alias[parent]
        self.alias[node] = (root, (*chain, step), self.version.get(root, 0))

    def make(self, after, target, args, like):
        with self.graph.inserting_after(after):
            return made_like(self.graph, self.fake, target, args, like)

    def view_of(self, base, step, after, like):
        if step[0] == "alias":
            return base
        if step[0] == "slice":
            return self.make(after, SLICE, (base, *step[1:]), like)
        if step[0] == "replay":
            return self.make(after, step[1], (base, *step[2]), like)
        return self.make(after, SELECT, (base, *step[1:]), like)

    def fresh(self, node, reader):
        """The node holding ``node``'s current value, for ``reader``."""
        if not isinstance(node, torch.fx.Node) or node not in self.alias:
            return node
        root, chain, version = self.alias[node]
        now = self.version.get(root, 0)
        if version == now:
            return node
        key = (node, now)
        if key not in self.taken_again:
            value, after = self.current[root], reader.prev
            for step in chain:
                value = after = self.view_of(value, step, after, reader)
            self.taken_again[key] = value
            self.alias[value] = (root, chain, now)
        return self.taken_again[key]

    def observed_elsewhere(self, root, written, node) -> bool:
        """Whether ``root``, or a view of it other than ``written`` and views of ``written``, is
        read after the in-place ``node`` (which would see what ``node`` writes through ``written``)."""
        position = {n: k for k, n in enumerate(self.graph.nodes)}
        stack, seen = [root], set()
        while stack:
            base = stack.pop()
            if base is written or base in seen:
                continue
            seen.add(base)
            for user in base.users:
                found = _step(user)
                if found is not None and found[0] is base:
                    stack.append(user)
                elif user is not node and position[user] > position[node]:
                    return True
        return False

    def write(self, node) -> None:
        """Make the in-place ``node`` functional where it writes into a view."""
        written = node.args[0]
        root, chain, _ = self.alias.get(written, (written, (), 0))
        if not chain:  # into a whole tensor: tilec reads it functionally already
            self.version[root] = self.version.get(root, 0) + 1
            self.current[root] = node
            self.alias[node] = (root, (), self.version[root])
            return
        if _identity(node):
            node.replace_all_uses_with(written)
            self.graph.erase_node(node)
            return
        replayed = next((step[1] for step in chain if step[0] == "replay"), None)
        if replayed is not None and not self.observed_elsewhere(root, written, node):
            self.alias[node] = (node, (), 0)  # read functionally: later readers of ``written`` read ``node``
            return
        if replayed is not None:
            raise WriteThroughView(node, f"it writes in place through an aten.{replayed._opname} of another tensor, "
                                         f"which cannot be written back")
        owned = True
        if node.target is aten.copy_.default:
            source = node.args[1]
            if self.alias.get(source) == (root, chain, self.version.get(root, 0)):
                node.replace_all_uses_with(source)  # writes a view's own current content back: nothing
                self.graph.erase_node(node)
                return
            copied, into = fake_value(source), fake_value(written)
            if copied.shape == into.shape and copied.dtype == into.dtype:
                value, last, owned = source, node.prev, False  # the value copied is the new content
                node.replace_all_uses_with(source)
                self.graph.erase_node(node)
            else:
                node.target = aten.copy.default  # a broadcast or cast: a functional copy
                value = last = node
        else:
            functional = _functional(node.target)
            if functional is None:
                raise WriteThroughView(node, f"aten.{node.target._opname} writes in place into a view of "
                                             f"another tensor and has no out-of-place form")
            node.target = functional
            value = last = node
        result = value
        bases, step_node = [], written
        for _ in chain:
            step_node = _step(step_node)[0]
            bases.append(step_node)
        for step, base in zip(reversed(chain), bases, strict=True):
            if step[0] == "alias":
                continue
            scatter = aten.slice_scatter.default if step[0] == "slice" else aten.select_scatter.default
            value = last = self.make(last, scatter, (base, value, *step[1:]), node)
        self.version[root] = self.version.get(root, 0) + 1
        self.current[root] = value
        self.alias[value] = (root, (), self.version[root])
        if owned and result is not value:
            self.alias[result] = (root, chain, self.version[root])

    def run(self) -> None:
        for node in self.nodes:
            if node.op in ("placeholder", "get_attr"):
                self.alias[node] = (node, (), 0)
                continue
            if node.op == "output":
                node.args = torch.fx.node.map_arg(node.args, lambda a, n=node: self.fresh(a, n))
                continue
            if node.op != "call_function":
                continue
            node.args = torch.fx.node.map_arg(node.args, lambda a, n=node: self.fresh(a, n))
            node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda a, n=node: self.fresh(a, n))
            if _in_place(node):
                self.write(node)
            else:
                self.record(node)


def functionalize(program: torch.export.ExportedProgram,
                  refuse: Callable[[torch.fx.Node, str], Exception] | None = None) -> bool:
    """Rewrite ``program`` in place (module docstring); whether anything changed. A write that
    cannot be made functional raises ``refuse(node, why)`` (default: ``WriteThroughView``)."""
    nodes = list(program.graph.nodes)
    if not needed(nodes):
        return False
    try:
        _Rewrite(program).run()
    except WriteThroughView as error:
        raise (refuse(error.node, str(error)) if refuse else error) from None
    outputs = program.graph.output_node().args[0]
    for spec, output in zip(program.graph_signature.output_specs, outputs, strict=False):
        if hasattr(spec.arg, "name") and isinstance(output, torch.fx.Node):
            spec.arg.name = output.name
    program.graph.lint()
    program.graph_module.recompile()
    return True
