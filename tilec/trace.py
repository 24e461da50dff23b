"""Frontend: ``trace`` turns any ``nn.Module`` and its inputs' shapes and dtypes into the op ``Graph``.

The model is captured with ``torch.export`` (non-strict) on fake inputs, so shape-dependent
Python runs as usual and a 100,000-pixel input costs no memory. The inputs are the tensor
arguments of ``forward``, in order, named as there; each is given as ``(shape, dtype)``, a dtype
of ``None`` meaning the model's own (its first floating parameter's). Nodes are named as export names
them; each is a ``NodeSpec`` whose layout and tileability its op's rule decides
(``tilec.ops``). In-place ops are made functional (later readers of a mutated tensor read the
op's result instead), space to depth and depth to space written with views become pixel
(un)shuffles (``tilec.blocks``), a statistic ``expand``-ed to an image's shape stays small until it
meets the image (``tilec.broadcasts``), ``max`` and ``min`` of two tensors are called ``maximum``
and ``minimum``, a ``conv3d`` convolving two dims of three a grouped ``conv2d``
(``tilec.conv3d``), and ops on pixels the model flattened into one dim run on rows and columns
(``tilec.unflatten``). A ``with torch.autocast(..., enabled=False)`` block runs inline, its ops
marked (``tilec.autocast_blocks``).

Traced for ``autocast="DEVICE:DTYPE"``, the captured program runs once more on a fake input
under ``torch.autocast(DEVICE, dtype=DTYPE)``, and every op autocast computes in another dtype
than the model's records it (``NodeSpec.autocast_dtype``): autocast's own per-op choices,
not a copy of its op lists.

``trace_modes`` traces the model in training and in eval mode (``Traced``): Python that branches
on ``self.training`` takes another path in each, and where the two graphs differ beyond the ops
that follow a module's flag at run time (BatchNorm, Dropout modules), each mode needs its own
plan (``Plan.mode``).
"""

from __future__ import annotations

import inspect
import io
import logging
import math
import operator
import sys
from collections.abc import Mapping, Sequence
from contextlib import contextmanager, nullcontext, redirect_stderr
from dataclasses import dataclass

import torch
from torch import nn

from tilec.autocast_blocks import OFF, inline_autocast
from tilec.blocks import blocks
from tilec.broadcasts import narrow_broadcasts
from tilec.conv3d import fold_conv3d
from tilec.errors import ShapeError, TilecError, UnsupportedLayerError
from tilec.functionalize import fake_mode, functionalize, made_like, relinted, schema_arguments
from tilec.graph import Graph, Shapes
from tilec.ir import INPUT_DTYPES, Arg, InputSpec, NodeSpec, OutputTree, Shape, TensorSpec, is_int
from tilec.ops import const, lost, mode_flag, rule, tileable, updates_buffer
from tilec.runtime.checks import follows_mode, named_tensors
from tilec.unflatten import unflatten

#: The floating dtypes a node may compute in (``NodeSpec.autocast_dtype``).
FLOATS = frozenset({"float32", "float64", "bfloat16", "float16"})
#: Checks of a tensor's metadata that compute nothing (``x.float()`` exports one before its cast).
METADATA_CHECKS = frozenset({"_assert_tensor_metadata", "_assert_async", "_assert_scalar", "sym_constrain_range",
                             "sym_constrain_range_for_size", "_functional_sym_constrain_range"})


#: The most elements an input may have: its bytes fit torch's 64-bit sizes at 16 bytes an element.
MAX_ELEMENTS = 2**59


def _positive_sizes(shape: Sequence) -> bool:
    """Whether every size of ``shape`` is a positive integer (not a bool)."""
    return all(is_int(n) and n >= 1 for n in shape)


def _check_elements(shape: Sequence[int], label: str) -> None:
    if math.prod(shape) > MAX_ELEMENTS:
        raise ShapeError(f"{label} {tuple(shape)} has more elements than a tensor can hold (2**59)")


def check_input_shape(shape: Sequence[int], label: str = "input shape") -> Shape:
    """An image input's shape: four positive sizes N, C, H, W, at most ``MAX_ELEMENTS`` in all."""
    if len(shape) != 4:
        raise ShapeError(f"{label} {tuple(shape)} has {len(shape)} dimension(s); tilec needs 4: N,C,H,W")
    if not _positive_sizes(shape):
        raise ShapeError(f"{label} {tuple(shape)} must be four positive integers N,C,H,W")
    _check_elements(shape, label)
    return tuple(shape)


def check_inputs(inputs) -> list[tuple[Shape, str | None]]:
    """``inputs`` as ``(shape, dtype)`` pairs of positive sizes and known dtypes (``None``: the
    model's); one line naming the input otherwise. A bare shape (N, C, H, W) is the one-input
    shorthand: one input in the model's dtype, and one input given without a dtype must have that
    shape too."""
    if len(inputs) and all(isinstance(n, int) for n in inputs):
        return [(check_input_shape(inputs), None)]
    if len(inputs) == 1 and inputs[0][1] is None:  # one input in the model's dtype: an image
        return [(check_input_shape(inputs[0][0]), None)]
    checked = []
    for k, (shape, dtype) in enumerate(inputs):
        label = f"input {k + 1}"
        if not shape or not _positive_sizes(shape):
            raise ShapeError(f"{label} has shape {tuple(shape)}; give positive integer sizes, e.g. 1,3,512,512")
        _check_elements(shape, label)
        if dtype is not None and dtype not in INPUT_DTYPES:
            raise ShapeError(f"{label} has dtype {dtype!r}; tilec takes one of {', '.join(INPUT_DTYPES)}")
        checked.append((tuple(shape), dtype))
    if not checked:
        raise ShapeError("give the model's inputs: at least one shape")
    return checked


@contextmanager
def _quiet_torch_logs():
    """torch.export logs a traceback, and prints the partial graph, before raising on a model that
    fails; the error is enough. What it writes to standard error otherwise is passed on."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    written = io.StringIO()
    try:
        with redirect_stderr(written):
            yield
        sys.stderr.write(written.getvalue())
    finally:
        logger.setLevel(level)


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in: its first floating parameter's (float32 without one)."""
    return next((t.dtype for t in model.parameters() if t.is_floating_point()), torch.float32)


def _described(error: Exception) -> str:
    """``Type: first line of the message``, whitespace collapsed (for one-line refusals)."""
    message = " ".join(str(error).split("\n")[0].split()) or type(error).__name__
    return f"{type(error).__name__}: {message}"


@contextmanager
def _cumulative_momentum_as_float(model: nn.Module):
    """BatchNorm modules training with ``momentum=None`` (a cumulative average) divide by their
    batch count in Python, which a fake input cannot trace: they trace with a momentum of 0.0. The
    generated module reads every BatchNorm module's momentum at run time."""
    changed = [module for module in model.modules()
               if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum is None]
    for module in changed:
        module.momentum = 0.0
    try:
        yield
    finally:
        for module in changed:
            module.momentum = None


def _examples(model: nn.Module, inputs: list[tuple[Shape, str | None]], device: str = "cpu") -> tuple:
    """Fake tensors of the inputs' shapes and dtypes (made under a ``FakeTensorMode``)."""
    default = _model_dtype(model)
    return tuple(torch.zeros(shape, dtype=getattr(torch, dtype) if dtype else default, device=device)
                 for shape, dtype in inputs)


def _described_inputs(inputs: list[tuple[Shape, str | None]]) -> str:
    """``input shape (1, 3, 8, 8)`` for one input in the model's dtype, else ``inputs 1,3,8,8:uint8, ...``."""
    if len(inputs) == 1 and inputs[0][1] is None:
        return f"input shape {inputs[0][0]}"
    return "inputs " + ", ".join(",".join(map(str, shape)) + (f":{dtype}" if dtype else "") for shape, dtype in inputs)


def _check_arity(model: nn.Module, count: int) -> None:
    """Refuse ``count`` inputs where ``model.forward`` cannot take that many positional tensors."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_POSITIONAL for p in parameters):
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if not len(required) <= count <= len(positional):
        names = ", ".join(p.name for p in positional)
        raise ShapeError(f"the model's forward takes {len(required)} tensor input(s) ({names}); give one shape per "
                         f"input, {count} given")


def _export(model: nn.Module, inputs: list[tuple[Shape, str | None]]) -> torch.export.ExportedProgram:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        examples = _examples(model, inputs)
    try:
        with _quiet_torch_logs(), _cumulative_momentum_as_float(model):
            return torch.export.export(model, examples, strict=False)
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as error:
        raise ShapeError(f"the model does not run on {_described_inputs(inputs)}: {_described(error)}") from None
    except Exception as error:  # noqa: BLE001 - any other capture failure is the user's model too
        raise UnsupportedLayerError(f"torch.export could not capture the model: {_described(error)}") from None


def _autocast_dtypes(program: torch.export.ExportedProgram, inputs: list[tuple[Shape, str | None]],
                     autocast: str) -> dict[str, str]:
    """Per call node of ``program``, the dtype of its result under ``autocast`` ("DEVICE:DTYPE")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device, dtype = autocast.split(":")
    if device == "cuda" and not torch.cuda.is_available():
        raise UnsupportedLayerError(f"--autocast {autocast} reads autocast's choices from CUDA, which this torch "
                                    f"cannot use: compile on the machine that trains")
    module = program.module().to(device)
    found: dict[str, str] = {}
    off = {node.name for node in program.graph.nodes if node.meta.get(OFF)}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            if node.op == "call_function" and _op_name(node.target) in METADATA_CHECKS:
                return None  # a check of the dtypes export saw, which autocast changes
            with torch.autocast(device, enabled=False) if node.name in off else nullcontext():
                result = super().run_node(node)
            if node.op == "call_function" and isinstance(result, torch.Tensor):
                found[node.name] = str(result.dtype).removeprefix("torch.")
            return result

    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.autocast(device, dtype=getattr(torch, dtype)):
            _Recorder(module).run(*_examples(module, inputs, device))
    except Exception as error:  # noqa: BLE001 - the user's model under autocast
        raise UnsupportedLayerError(f"--autocast {autocast}: the model does not run under torch.autocast: "
                                    f"{_described(error)}") from None
    return found


def _op_name(target) -> str:
    if target is operator.getitem:
        return "getitem"
    if not isinstance(target, torch._ops.OpOverload):
        raise UnsupportedLayerError(f"the model calls {getattr(target, '__name__', target)!r}, which is not "
                                    f"an aten op tilec can compile")
    return target._opname


def _target(target) -> str:
    if target is operator.getitem:
        return "getitem"
    return f"aten.{target._opname}.{target._overloadname}"


def _functional(target):
    """The out-of-place twin of an in-place aten overload (``relu_`` -> ``relu``), or ``None``."""
    if target is operator.getitem or not target._opname.endswith("_") or target._opname.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, target._opname[:-1], None)
    return None if packet is None else getattr(packet, target._overloadname, None)


def _const(value):
    if isinstance(value, list | tuple):
        return tuple(_const(v) for v in value)
    if isinstance(value, torch.dtype | torch.device | torch.memory_format | torch.layout):
        return f"torch.{str(value).removeprefix('torch.')}" if not isinstance(value, torch.device) else str(value)
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    raise UnsupportedLayerError(f"argument {value!r} of type {type(value).__name__} cannot be compiled")


def _arg(value, names: dict, tensors: dict, keyword: str | None = None) -> Arg:
    if isinstance(value, torch.fx.Node):
        if value.name in tensors:
            return Arg(kind="tensor", value=tensors[value.name], keyword=keyword)
        return Arg(kind="node", value=names[value.name], keyword=keyword)
    if isinstance(value, list | tuple) and value and all(isinstance(v, torch.fx.Node) for v in value):
        return Arg(kind="nodes", value=tuple(names[v.name] for v in value), keyword=keyword)
    return Arg(kind="const", value=_const(value), keyword=keyword)


def _schema_args(node: torch.fx.Node) -> list[tuple[object, str | None]]:
    """Every argument of ``node`` in schema order, defaults filled in; kwarg-only ones keyed."""
    if node.target is operator.getitem:
        return [(node.args[0], None), (node.args[1], None)]
    return [(value, argument.name if argument.kwarg_only else None) for argument, value in schema_arguments(node)]


def _other_float(dtype: str | None, than: str) -> str | None:
    """``dtype`` where it is a floating dtype other than ``than``, else ``None``."""
    return dtype if dtype in FLOATS and dtype != than else None


def _shape(value) -> tuple[int, ...]:
    if isinstance(value, list | tuple):
        return _shape(value[0]) if value else ()
    return tuple(int(n) for n in value.shape) if isinstance(value, torch.Tensor) else ()


def _where(path: str, module_type: str) -> str:
    return f"module {path} ({module_type})" if path else f"the model's forward ({module_type})"


def _module(node: torch.fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", "model"
    path, kind = list(stack.values())[-1]
    return path, (kind.__name__ if isinstance(kind, type) else str(kind)).rsplit(".", 1)[-1]


def _output_tree(spec, leaves: list[str]) -> OutputTree:
    """The export output spec (a pytree) as an ``OutputTree`` over the output node names."""
    if spec.is_leaf():
        return OutputTree(kind="tensor", node=leaves.pop(0))
    kind = {tuple: "tuple", list: "list", dict: "dict"}.get(spec.type)
    mapping = None
    if kind is None and _keyed_mapping(spec):
        kind, mapping = "dict", f"{spec.type.__module__}.{spec.type.__qualname__}"
    if kind is None:
        raise UnsupportedLayerError(f"the model returns a {spec.type.__name__}; tilec handles tensors, "
                                    f"tuples, lists and mappings of tensors (dict, OrderedDict)")
    items = tuple(_output_tree(child, leaves) for child in spec.children())
    keys = tuple(str(key) for key in spec.context) if kind == "dict" else ()
    return OutputTree(kind=kind, keys=keys, items=items, mapping=mapping)


def _keyed_mapping(spec) -> bool:
    """Whether the pytree node ``spec`` is a mapping type (not dict itself) whose context is its
    string keys and which its module names at top level, so that ``Type(pairs)`` rebuilds it."""
    kind = spec.type
    return (isinstance(kind, type) and issubclass(kind, Mapping) and "<" not in kind.__qualname__
            and isinstance(spec.context, list | tuple) and len(spec.context) == spec.num_children
            and all(isinstance(key, str) for key in spec.context))


#: Factories named after a tensor (``x.new_empty(shape)``), which read only its dtype and device,
#: and their twins that read no tensor.
FACTORIES = {"new_empty": torch.ops.aten.empty.memory_format, "new_zeros": torch.ops.aten.zeros.default,
             "new_ones": torch.ops.aten.ones.default, "new_full": torch.ops.aten.full.default}


#: Overloads that are another name of an op with a rule: the same values and gradients.
SAME_OPS = {torch.ops.aten.max.other: torch.ops.aten.maximum.default,
            torch.ops.aten.min.other: torch.ops.aten.minimum.default}


def _renamed(program: torch.export.ExportedProgram) -> None:
    """Call ``torch.max(a, b)`` and ``torch.min(a, b)`` by their other names, ``maximum`` and
    ``minimum`` (element-wise; ``max`` and ``min`` of one tensor are reductions)."""
    renamed = [node for node in program.graph.nodes if node.op == "call_function" and node.target in SAME_OPS]
    for node in renamed:
        node.target = SAME_OPS[node.target]
    relinted(program, bool(renamed))


def _factories(program: torch.export.ExportedProgram) -> None:
    """Rewrite ``x.new_empty(shape)`` and its kin into factories of ``x``'s dtype and device that
    read no tensor (timm's ``drop_path`` draws its per-sample mask from ``x.new_empty``): the mask is
    then a small op of no image, drawn once per step, as ``torch.empty(shape, dtype=x.dtype)`` is."""
    for node in program.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "_opname", None) not in FACTORIES:
            continue
        value = node.meta["val"]
        node.target = FACTORIES[node.target._opname]
        node.args = tuple(node.args[1:])
        node.kwargs = {"dtype": value.dtype, "device": value.device, "pin_memory": False}
    program.graph_module.recompile()


def _listed_tensors(program: torch.export.ExportedProgram) -> None:
    """A model tensor in a list argument (``torch.stack([self.a, self.b])``, an ``einsum`` of
    parameters) is read through an ``alias`` node, so that a list argument holds nodes only."""
    signature = program.graph_signature
    tensors = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    fake = fake_mode(program.graph)
    for node in list(program.graph.nodes):
        for k, arg in enumerate(node.args if node.op == "call_function" else ()):
            if isinstance(arg, list | tuple) and any(isinstance(v, torch.fx.Node) and v.name in tensors for v in arg):
                with program.graph.inserting_before(node):
                    listed = [made_like(program.graph, fake, torch.ops.aten.alias.default, [v], node)
                              if isinstance(v, torch.fx.Node) and v.name in tensors else v for v in arg]
                node.update_arg(k, type(arg)(listed))
    program.graph_module.recompile()


def trace(model: nn.Module, inputs, autocast: str | None = None) -> Graph:
    """Build the op graph of ``model`` for ``inputs`` (per tensor argument of its ``forward``, in
    order: ``(shape, dtype)``, ``None`` for the model's dtype; or one shape (N, C, H, W) for a
    model of one input in its dtype), trained under ``autocast``
    ("DEVICE:DTYPE", e.g. "cuda:float16") or without."""
    if not isinstance(model, nn.Module):
        raise UnsupportedLayerError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = check_inputs(inputs)
    _check_arity(model, len(inputs))
    program = _export(model, inputs)
    inline_autocast(program, refuse=lambda node, why: UnsupportedLayerError(f"{_where(*_module(node))} {why}"))
    functionalize(program, refuse=lambda node, why: UnsupportedLayerError(
        f"op aten.{node.target._opname} from {_where(*_module(node))} is not supported: {why}"))
    _renamed(program)
    _factories(program)
    _listed_tensors(program)
    blocks(program)
    narrow_broadcasts(program)
    fold_conv3d(program)
    unflatten(program)
    autocast_dtypes = _autocast_dtypes(program, inputs, autocast) if autocast else {}
    signature = program.graph_signature
    state = named_tensors(model)  # non-persistent buffers too, which a state_dict leaves out
    tensors = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    if signature.inputs_to_lifted_tensor_constants:
        raise UnsupportedLayerError("the model makes a tensor constant in its forward (torch.tensor(...)); register "
                                    "it as a buffer (self.register_buffer) so that tilec can pass it to the tiles")
    tensor_specs = tuple(
        TensorSpec(name=name, shape=tuple(state[name].shape), buffer=name in signature.buffers)
        for name in sorted(set(tensors.values())) if name in state
    )
    user_inputs = list(signature.user_inputs)
    if len(user_inputs) != len(inputs):
        raise ShapeError(f"the model's forward takes {len(user_inputs)} tensor input(s) ({', '.join(user_inputs)}); "
                         f"give one shape per input, {len(inputs)} given")
    default = str(_model_dtype(model)).removeprefix("torch.")
    input_specs = tuple(InputSpec(name=name, shape=shape, dtype=dtype or default)
                        for name, (shape, dtype) in zip(user_inputs, inputs, strict=True))
    names = {name: name for name in user_inputs}
    shapes = Shapes({}, tensor_specs, input_specs)
    counted = set()  # BatchNorm batch-counter updates
    derived: set[str] = set()  # nodes computed from model tensors (and constants) alone
    for fx_node in program.graph.nodes:
        if fx_node.op != "call_function":
            continue
        op = _op_name(fx_node.target)
        if op in METADATA_CHECKS:
            continue
        functional = _functional(fx_node.target) if op != "getitem" else None
        mutated = fx_node.args[0] if functional is not None else None
        if functional is not None and mutated.name in counted:
            raise UnsupportedLayerError(f"{_where(*_module(fx_node))} is called more than once in one forward in "
                                        f"training mode; tilec counts a BatchNorm's batches once per step: give each "
                                        f"call its own module, or call .eval() on it")
        if functional is not None and tensors.get(mutated.name, "").endswith("num_batches_tracked"):
            counted.add(fx_node.name)
            continue  # BatchNorm's batch counter: the generated module counts as nn.BatchNorm does
        if functional is not None and mutated.name in tensors:
            functional = None  # another buffer update: kept in place, untiled
        elif functional is not None:
            op = functional._opname
        args = [_arg(value, names, tensors, keyword) for value, keyword in _schema_args(fx_node)]
        inputs = [a.value for a in args if a.kind == "node"] + [v for a in args if a.kind == "nodes" for v in a.value]
        path, module_type = _module(fx_node)
        value = fx_node.meta.get("val")
        out_shape = _shape(value)
        value_dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
        node = NodeSpec(
            name=fx_node.name, op=op, target=_target(functional or fx_node.target), path=path,
            module_type=module_type, args=tuple(args), inputs=tuple(dict.fromkeys(inputs)), shape=out_shape,
            spatial=None, tileable=False, autocast_dtype=_other_float(autocast_dtypes.get(fx_node.name), value_dtype),
            dtype=_other_float(value_dtype, default),
            autocast_off=bool(fx_node.meta.get(OFF)),
        )
        if all(name in derived for name in node.inputs) and (node.inputs or any(a.kind == "tensor" for a in args)):
            derived.add(node.name)  # no image axes, whatever its shape: a standardised weight, a bias's view
        else:
            spatial = rule(node).layout(node, shapes)
            if spatial is None and len(out_shape) == 4 and any(lost(name, shapes) for name in node.inputs):
                spatial = (2, 3)  # an image again, of values that had left the image axes
            node = node.model_copy(update={"spatial": spatial})
        if mutated is not None and functional is not None:
            names[mutated.name] = fx_node.name  # later readers of the mutated tensor read this result
        names[fx_node.name] = fx_node.name
        shapes.nodes[node.name] = node.model_copy(update={"tileable": tileable(node, shapes)})
    outputs = [names[n.name] if isinstance(n, torch.fx.Node) else n
               for n in program.graph.output_node().args[0]]
    if any(not isinstance(name, str) or name not in shapes.nodes and not shapes.is_input(name) for name in outputs):
        raise UnsupportedLayerError("the model returns something other than tensors computed from its inputs")
    live = _live(list(shapes.nodes.values()), outputs)
    if not live:
        raise UnsupportedLayerError("the model has no ops (none that its outputs read)")
    return Graph(live, tensors=tensor_specs,
                 output=_output_tree(program.call_spec.out_spec, list(outputs)), inputs=input_specs, autocast=autocast)


def _live(nodes: list[NodeSpec], outputs: list) -> list[NodeSpec]:
    """Drop ops whose result nothing reads (but keep in-place buffer updates, and BatchNorms with
    batch statistics that update their running statistics and batch counter)."""
    needed = {name for name in outputs if isinstance(name, str)}
    kept = []
    for node in reversed(nodes):
        running = node.op == "batch_norm" and const(node, 5, False) and node.args[3].kind == "tensor"
        if node.name in needed or updates_buffer(node) or running:
            kept.append(node)
            needed.update(node.inputs)
    return kept[::-1]


@dataclass(frozen=True)
class Traced:
    """A model's graphs in its modes: ``graphs[0]`` in the mode the model is in, and where the other
    mode's graph differs, ``graphs[1]`` in that mode (each ``Graph.mode`` set); ``refused``: why the
    other mode could not be traced, if it could not (its graph then unknown)."""

    graphs: tuple[Graph, ...]
    refused: str | None = None


@contextmanager
def _in_mode(model: nn.Module, training: bool):
    """``model`` with every module in one mode; each module's own flag restored afterwards."""
    flags = [(module, module.training) for module in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def _mode_free(graph: Graph) -> tuple:
    """``graph`` without what the modules' flags decide at run time: the training-flag argument of
    the ops that follow a module's flag (``tilec.ops.mode_flag``) and tileability; nodes are
    named by position (export numbers in-place ops after BatchNorm's batch counters, which only
    training mode has)."""
    position = {name: k for k, name in enumerate(graph.order)}

    def renamed(value):
        return position.get(value, value) if isinstance(value, str) else tuple(map(renamed, value))

    def node(spec: NodeSpec) -> tuple:
        flag = mode_flag(spec)
        args = tuple(None if k == flag else (a.kind, renamed(a.value) if a.kind in ("node", "nodes") else a.value,
                                             a.keyword) for k, a in enumerate(spec.args))
        return (spec.op, spec.target, spec.path, spec.module_type, args, renamed(spec.inputs), spec.shape,
                spec.spatial, spec.autocast_dtype)

    def tree(output: OutputTree) -> tuple:
        return output.kind, renamed(output.node or ""), output.keys, tuple(map(tree, output.items))

    return tuple(map(node, graph)), tree(graph.output), graph.tensors, graph.inputs


def trace_modes(model: nn.Module, inputs, autocast: str | None = None) -> Traced:
    """``trace`` the model in the mode it is in (its root module's flag), and with every module in
    the other; one graph where both are the same (``_mode_free``), else both, each with its mode
    and (the first) the modules whose flag differed from the root's (``follows_mode`` ones
    aside). The modules' flags are restored."""
    graph = trace(model, inputs, autocast)
    training = model.training
    flipped = tuple(path for path, module in model.named_modules()
                    if module.training != training and not follows_mode(module))
    modes = ("train", "eval") if training else ("eval", "train")
    try:
        with _in_mode(model, not training):
            other = trace(model, inputs, autocast)
    except TilecError as error:
        return Traced((graph.in_mode(modes[0], flipped),), f"the model does not trace in {modes[1]} mode: {error}")
    if _mode_free(graph) == _mode_free(other):
        return Traced((graph,))
    return Traced((graph.in_mode(modes[0], flipped), other.in_mode(modes[1])))
