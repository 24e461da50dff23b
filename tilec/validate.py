"""Structural checks of a schema-valid plan: ``validate`` raises one ``PlanError`` line or returns.

The schema (pydantic) only knows types. A plan the generated code can execute exactly must also
be internally consistent, and ``validate`` checks that it is, in this order (the first
difference is reported, naming the segment, axis, tile and node):

* ``schema_version`` is this tilec's (``check_version`` refuses older and newer plans on the raw
  JSON object, before the schema sees fields it does not know);
* the inputs have unique names and positive sizes; predictions (peaks, FLOP overhead,
  seconds) and the budget are in range;
* every node's target is ``getitem`` or an aten overload of this torch named for its op
  (``aten.OP.OVERLOAD``);
* the nodes are in a topological order: unique names (none an input's), every ``node`` or
  ``nodes`` argument names an earlier node or an input, every ``tensor`` argument names a
  model tensor, ``inputs`` lists exactly the node arguments in order without repeats, shapes are
  not negative and ``spatial`` names two distinct dims of the shape; the output tree names nodes;
* every node that reads a model input runs on meta tensors of the inputs' shapes and dtypes (the
  other tensors it reads in the plan's dtype) and gives its recorded shape (``_check_readers``),
  so an input shape the graph cannot read is named (``inputs[K].shape``);
* ``model.digest`` is the digest of the nodes, tensors and output (``Graph.fingerprint``);
* every node's ``tileable`` flag is what tracing gives it (``tilec.ops.tileable``), and the
  image sizes of tileable nodes follow their rule from their input's sizes (``Op.output_size``,
  so the inputs' shapes agree with the nodes);
* segments cover the node positions ``0..n-1`` contiguously, and none ends between a node
  returning several tensors and a getitem taking one of them, or between a node reading a buffer
  and one writing into it (``Graph.ties``); each segment's
  inputs and outputs are what ``Graph.inputs_of`` / ``outputs_of`` compute; a stored segment has
  grid 1x1 and no tiles; a tiled one holds only tileable nodes and one axis tile per grid row and
  column;
* per tiled segment and axis, each output's owned intervals partition ``[0, size)`` in order
  without empty parts, and every axis tile equals the one the planner builds
  (``tilec.cone.axis_tiles``): the even owned split (or the ``period``'s), one step per node in order, every read the
  op's rule clipped to the input with the clipped amount as padding (none for rules without
  padding), ``grad_out == out`` and ``Read.grad == read``, every ``out`` the hull of its
  consumers' reads and its owned parts, every sliced input interval the hull of its reads;
* shape classes are numbered in order of first appearance, one per distinct ``class_key``
  (tiles of one class share generated code);
* a plan compiled for one grid (``Plan.grid``) has the segments it makes;
* a tiled segment's levels are those its nodes make (``tilec.sweeps.levels``) and each
  reduction's partials partition its input, the grid's split;
* a segment rolls (``Segment.rolled``) only the gradients of inputs no other backward reads
  (``_check_rolled``): the generated module overwrites them.

The name and dtype are not checked. Each axis tile is rebuilt once, so validation costs about
what planning the tiles costs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from tilec.cone import axis_tiles
from tilec.errors import PlanError, TilecError
from tilec.graph import Graph
from tilec.ir import SCHEMA_VERSION, Arg, AxisStep, AxisTile, NodeSpec, OutputTree, Plan, Segment, SegmentInput, is_int
from tilec.ops import rule, tileable
from tilec.planner import class_key, default_segments, periods_on
from tilec.regions import Interval, Period
from tilec.sweeps import batchable, levels, may_roll

AXES = ("rows", "cols")

#: What evaluating a forged node's arguments (a wrong type, a missing constant) can raise, torch included.
_EVALUATION_ERRORS = (TilecError, LookupError, TypeError, ValueError, ArithmeticError, AttributeError, RuntimeError)


class _Inconsistent(Exception):
    pass


def _fail(message: str):
    raise _Inconsistent(message)


@contextmanager
def _evaluating(what: str) -> Iterator[None]:
    """Report a rule or check that cannot run on the plan's data as an inconsistency of ``what``."""
    try:
        yield
    except _EVALUATION_ERRORS as error:
        detail = " ".join(str(error).split()) or type(error).__name__
        _fail(f"{what} cannot be evaluated ({type(error).__name__}: {detail})")


def _interval(interval: Interval) -> str:
    return f"[{interval.start}, {interval.stop})"


def check_version(data: dict, source: str = "plan") -> None:
    """Refuse the raw JSON object of a plan from another tilec before the schema parses it.

    A schema-1 plan (layer chains: ``model.layers``, no ``model.nodes``) or any version below
    this one asks for recompiling; a newer version asks for upgrading tilec; one without a version
    is refused. A version that is not an integer is left to the schema (strict: no ``"12"``, no
    ``true``).
    """
    version = data.get("schema_version")
    model = data.get("model")
    numeric = is_int(version)
    if numeric and version > SCHEMA_VERSION:
        raise PlanError(f"{source} has schema_version {version}, newer than this tilec's {SCHEMA_VERSION}; "
                        f"upgrade tilec")
    chain = isinstance(model, dict) and "layers" in model and "nodes" not in model
    if (numeric and version < SCHEMA_VERSION) or chain:
        found = f"schema_version {version}" if numeric else "model.layers"
        layers = ": layer chains" if chain else ""
        raise PlanError(f"{source} is a plan from an older tilec ({found}{layers}); recompile the model "
                        f"with `tilec compile` to get a schema {SCHEMA_VERSION} plan")
    if "schema_version" not in data:
        raise PlanError(f"{source} has no schema_version: it is not a plan tilec wrote")


def _check_predictions(plan: Plan) -> None:
    """Predictions are estimates, so only their range is checked: bytes and seconds not negative,
    FLOP overhead at least -1 (a ratio minus one), all finite; a budget, if any, positive; the
    kernel state within the peak; tiles counted as computed once only where the compile knew of
    background, and fewer than the segment's tiles."""
    if plan.predicted_peak_bytes < 0 or (plan.memory_budget is not None and plan.memory_budget < 1):
        _fail(f"predicted_peak_bytes {plan.predicted_peak_bytes} or memory_budget {plan.memory_budget} is out of range")
    if plan.kernel_state < 0 or not 0 <= plan.kernel_state_bytes <= plan.predicted_peak_bytes:
        _fail(f"kernel_state {plan.kernel_state} or kernel_state_bytes {plan.kernel_state_bytes} is out of range "
              f"(at most predicted_peak_bytes {plan.predicted_peak_bytes})")
    if not 0 <= plan.staging_bytes <= plan.predicted_peak_bytes:
        _fail(f"staging_bytes {plan.staging_bytes} is out of range (at most predicted_peak_bytes "
              f"{plan.predicted_peak_bytes})")
    if any(not 0 < rate < math.inf for _, rate in plan.rates):
        _fail(f"rates {list(plan.rates)} are not all positive and finite")
    for segment in plan.segments:
        seconds, overhead = segment.estimated_seconds, segment.flop_overhead
        if segment.predicted_peak_bytes < 0 or not (0 <= seconds < math.inf and -1 <= overhead < math.inf):
            _fail(f"segment {segment.index} has predictions out of range: peak {segment.predicted_peak_bytes} bytes, "
                  f"{seconds} s, FLOP overhead {overhead}")
        if segment.reused and (not plan.backgrounds or segment.reused >= segment.grid[0] * segment.grid[1]):
            _fail(f"segment {segment.index} counts {segment.reused} tiles as computed once: that needs a known "
                  f"background (backgrounds) and fewer than its {segment.grid[0]}x{segment.grid[1]} tiles")


def _check_modes(plan: Plan) -> None:
    """A plan of both modes has no mode, flipped modules, other plan or refusal; a plan of one mode
    has either the other mode's plan (of the same name, inputs, dtype, autocast and ranks, with no
    other of its own) or a refusal."""
    other = plan.other
    if plan.mode is None and (plan.flipped or other is not None or plan.refused is not None):
        _fail("a plan without a mode has flipped modules, another mode's plan or a refusal")
    if plan.mode is not None and (other is None) == (plan.refused is None):
        _fail(f"the {plan.mode}-mode plan needs exactly one of the other mode's plan (other) and refused")
    if other is None:
        return
    if other.mode in (None, plan.mode) or other.other is not None or other.refused is not None:
        _fail(f"the other mode's plan has mode {other.mode!r}, not the other mode than {plan.mode!r}, or "
              f"an other plan or a refusal of its own")
    for field in ("name", "inputs", "dtype", "autocast", "ranks"):
        if getattr(other, field) != getattr(plan, field):
            _fail(f"the {other.mode}-mode plan has another {field} than the {plan.mode}-mode plan")


def _check_input(plan: Plan) -> None:
    names = [spec.name for spec in plan.inputs]
    if not names or len(set(names)) != len(names):
        _fail(f"inputs {names} are not one or more distinct names")
    for spec in plan.inputs:
        if not spec.shape or any(n < 1 for n in spec.shape):
            _fail(f"input {spec.name} has shape {tuple(spec.shape)}, not positive sizes")


def _check_target(node: NodeSpec) -> None:
    """A node's target is ``getitem`` or the aten overload ``aten.OP.OVERLOAD`` of its op."""
    if node.target == "getitem" or node.op == "getitem":
        if node.target != node.op:
            _fail(f"node {node.name} has op {node.op!r} and target {node.target!r}; getitem has both 'getitem'")
        return
    parts = node.target.split(".")
    if len(parts) != 3 or parts[0] != "aten" or parts[1] != node.op:
        _fail(f"node {node.name} has target {node.target!r}, not an overload of its op: 'aten.{node.op}.OVERLOAD'")
    packet = getattr(torch.ops.aten, node.op, None) if node.op.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or parts[2] not in packet.overloads():
        _fail(f"node {node.name} has target {node.target!r}, which is not an aten op of this torch")


def _check_args(node: NodeSpec, known: set[str], tensors: set[str]) -> None:
    expected: dict[str, None] = {}
    for arg in node.args:
        names = [arg.value] if arg.kind == "node" else arg.value if arg.kind == "nodes" else []
        if arg.kind == "nodes" and not isinstance(arg.value, tuple):
            _fail(f"node {node.name} has a 'nodes' argument that is not a list of names: {arg.value!r}")
        for name in names:
            if not isinstance(name, str) or name not in known:
                _fail(f"node {node.name} reads {name!r}, which is neither an input nor an earlier node "
                      f"(the nodes must be in execution order)")
            expected.setdefault(name)
        if arg.kind == "tensor" and arg.value not in tensors:
            _fail(f"node {node.name} computes with tensor {arg.value!r}, which is not in model.tensors")
    if tuple(node.inputs) != tuple(expected):
        _fail(f"node {node.name} lists inputs {list(node.inputs)}, but its arguments read {list(expected)}")


def _check_shape(node: NodeSpec) -> None:
    if any(n < 0 for n in node.shape):
        _fail(f"node {node.name} has a negative size in its shape {tuple(node.shape)}")
    if node.spatial is not None:
        rows, cols = node.spatial
        if rows == cols or not (0 <= rows < len(node.shape) and 0 <= cols < len(node.shape)):
            _fail(f"node {node.name} has spatial dims {tuple(node.spatial)}, not two distinct dims of its "
                  f"shape {tuple(node.shape)}")


def _check_output(tree: OutputTree, known: set[str]) -> None:
    if tree.kind == "tensor":
        if tree.node not in known or tree.items or tree.keys:
            _fail(f"the output tree's tensor {tree.node!r} is not a node (or has items or keys)")
        return
    if tree.node is not None or (tree.kind == "dict") != bool(tree.keys) or (
            tree.kind == "dict" and len(tree.keys) != len(tree.items)):
        _fail(f"the output tree's {tree.kind} has a node {tree.node!r} or {len(tree.keys)} keys for "
              f"{len(tree.items)} items")
    if tree.mapping is not None and tree.kind != "dict":
        _fail(f"the output tree's {tree.kind} names a mapping type {tree.mapping!r}")
    for item in tree.items:
        _check_output(item, known)


def _check_nodes(plan: Plan) -> None:
    nodes = plan.model.nodes
    if not nodes:
        _fail("model.nodes is empty")
    tensors = [t.name for t in plan.model.tensors]
    if len(set(tensors)) != len(tensors):
        _fail("model.tensors names a tensor twice")
    if any(n < 0 for t in plan.model.tensors for n in t.shape):
        _fail("a model tensor has a negative size")
    known, names = {spec.name for spec in plan.inputs}, set(tensors)
    for node in nodes:
        if node.name in known:
            _fail(f"node name {node.name!r} is used twice (or names an input)")
        _check_target(node)
        _check_args(node, known, names)
        _check_shape(node)
        known.add(node.name)
    _check_output(plan.model.output, known)


def _value(arg: Arg, inputs: dict, shapes: dict, dtype: torch.dtype, device: str):
    """A node's argument as its op takes it: the inputs' tensors, empty tensors on ``device`` of the
    recorded shapes of nodes and model tensors (``shapes``) in ``dtype``, constants as Python values."""
    if arg.kind in ("node", "tensor"):
        return inputs[arg.value] if arg.value in inputs else torch.empty(shapes[arg.value], dtype=dtype, device=device)
    if arg.kind == "nodes":
        return [_value(Arg(kind="node", value=name), inputs, shapes, dtype, device) for name in arg.value]
    if isinstance(arg.value, str) and arg.value.startswith("torch."):
        return getattr(torch, arg.value.removeprefix("torch."))
    return list(arg.value) if isinstance(arg.value, tuple) else arg.value


def _check_readers(plan: Plan) -> None:
    """Every node reading a model input gives its recorded shape from the inputs' shapes, on meta
    tensors (no data: aten's meta kernels give the shapes)."""
    where = {spec.name: k for k, spec in enumerate(plan.inputs)}
    shapes = {t.name: t.shape for t in (*plan.model.tensors, *plan.model.nodes)}
    for node in plan.model.nodes:
        read = [name for name in node.inputs if name in where]
        if not read or node.target == "getitem":
            continue
        field = f"inputs[{where[read[0]]}].shape {tuple(plan.inputs[where[read[0]]].shape)}"
        try:
            result = _read(plan, node, shapes, "meta")
        except _REFUSALS:
            _fail(f"{field} cannot be read by node {node.name} (aten.{node.op}): {_why(plan, node, shapes)}")
        result = result[0] if isinstance(result, list | tuple) else result
        if tuple(result.shape) != tuple(node.shape):
            _fail(f"{field} gives node {node.name} (aten.{node.op}) shape {tuple(result.shape)}, but the plan's "
                  f"graph has {tuple(node.shape)}")


#: What an aten op raises for arguments it cannot take.
_REFUSALS = (RuntimeError, ValueError, TypeError, IndexError)


def _read(plan: Plan, node, shapes: dict, device: str):
    """``node``'s op on empty tensors on ``device`` of the plan's input shapes and dtypes, and of the
    recorded ``shapes`` of what else it reads, in the dtype of its floating input (else the plan's)."""
    inputs = {spec.name: torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
              for spec in plan.inputs if spec.name in node.inputs}
    floating = [tensor.dtype for tensor in inputs.values() if tensor.is_floating_point()]
    like = floating[0] if floating else getattr(torch, plan.dtype)  # the model's tensors are in that dtype
    positional = [_value(a, inputs, shapes, like, device) for a in node.args if a.keyword is None]
    keywords = {a.keyword: _value(a, inputs, shapes, like, device) for a in node.args if a.keyword is not None}
    _, op, overload = node.target.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)(*positional, **keywords)


def _why(plan: Plan, node, shapes: dict) -> str:
    """Why ``node`` cannot read the plan's inputs, in the words of aten's CPU checks (its meta
    kernels say less): the same call on fake CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            _read(plan, node, shapes, "cpu")
    except _REFUSALS as error:
        return " ".join(str(error).split("\n")[0].split())
    return "aten's meta kernel refuses it"


def _check_digest(plan: Plan, graph: Graph) -> None:
    if graph.fingerprint().digest != plan.model.digest:
        _fail("model.digest is not the digest of model.nodes, model.tensors and model.output (the model was "
              "edited; recompile it with `tilec compile`)")


def _check_tileable(plan: Plan, graph: Graph) -> None:
    for node in plan.model.nodes:
        with _evaluating(f"node {node.name} (aten.{node.op})"):
            flag = tileable(node, graph)
            on_images = node.spatial is not None and node.inputs and graph.spatial(node.inputs[0]) is not None
            sizes = [rule(node).output_size(node, axis, graph) for axis in range(2)] if flag and on_images else []
        if node.tileable != flag:
            _fail(f"node {node.name} (aten.{node.op}) is marked tileable={node.tileable}, but its op and "
                  f"shapes make it {flag}")
        for axis, size in enumerate(sizes):
            if size is not None and size != graph.size(node.name, axis):
                _fail(f"node {node.name} (aten.{node.op}) has {AXES[axis]} size {graph.size(node.name, axis)}, "
                      f"but its input {node.inputs[0]!r} of size {graph.size(node.inputs[0], axis)} gives {size}")


def _check_cover(plan: Plan) -> None:
    count, expected = len(plan.model.nodes), 0
    if not plan.segments:
        _fail("the plan has no segments")
    for position, segment in enumerate(plan.segments):
        if segment.index != position:
            _fail(f"segment {position} has index {segment.index}, expected {position}")
        if segment.first != expected or not segment.first < segment.stop <= count:
            _fail(f"segment {position} covers nodes [{segment.first}, {segment.stop}), expected a non-empty "
                  f"range starting at {expected} and ending by {count}")
        expected = segment.stop
    if expected != count:
        _fail(f"the segments cover nodes [0, {expected}), but the model has {count} nodes")


def _check_ties(plan: Plan, graph: Graph) -> None:
    for segment in plan.segments[:-1]:
        if (parting := graph.parting(segment.stop)) is not None:
            _fail(f"segment {segment.index} ends at {segment.stop}, {parting}")


def _names(inputs: Sequence[SegmentInput]) -> str:
    return "[" + ", ".join(f"{i.name}{'' if i.sliced else ' (whole)'}" for i in inputs) + "]"


def _check_segment(segment: Segment, graph: Graph) -> None:
    where = f"segment {segment.index}"
    first, stop = segment.first, segment.stop
    inputs, outputs = graph.inputs_of(first, stop), graph.outputs_of(first, stop)
    if tuple(segment.inputs) != inputs:
        _fail(f"{where} has inputs {_names(segment.inputs)}, but its nodes read {_names(inputs)} from before it")
    if tuple(segment.outputs) != outputs:
        _fail(f"{where} has outputs {list(segment.outputs)}, but {list(outputs)} are read after it or returned")
    grid = tuple(segment.grid)
    if segment.mode == "stored":
        if grid != (1, 1) or segment.rows or segment.cols:
            _fail(f"{where} is stored but has grid {grid[0]}x{grid[1]} and {len(segment.rows)}x{len(segment.cols)} "
                  f"axis tiles; a stored segment runs untiled (grid 1x1, no tiles)")
        if segment.batch != 1:
            _fail(f"{where} is stored but has batch {segment.batch}; it has no tiles to batch")
        if segment.period is not None:
            _fail(f"{where} is stored but has a period; only tiles have one")
        return
    if segment.batch > 1 and not batchable(graph, first, stop):
        _fail(f"{where} has batch {segment.batch}, but its tiles cannot run stacked (tilec.sweeps.batchable)")
    blocker = next((n for n in graph.members(first, stop) if not n.tileable), None)
    if blocker is not None:
        _fail(f"{where} is tiled but node {blocker.name} (aten.{blocker.op}) cannot run tile by tile")
    if grid[0] < 1 or grid[1] < 1 or (len(segment.rows), len(segment.cols)) != grid:
        _fail(f"{where} has grid {grid[0]}x{grid[1]} but {len(segment.rows)} row tiles and "
              f"{len(segment.cols)} column tiles")
    if segment.period is not None:
        image = graph.image_size()
        if image is None or min(segment.period) < 1 or tuple(
                period.parts for period in periods_on(graph, segment.period, where)) != grid:
            _fail(f"{where} has period {tuple(segment.period)}, which does not cut the model's image input "
                  f"{image} into its grid {grid[0]}x{grid[1]}")


def _check_rolled(plan: Plan, segment: Segment, graph: Graph) -> None:
    """A segment rolls only gradients that no other backward needs the input for: a tiled segment,
    inputs a tiled segment produced, that ``tilec.sweeps.may_roll`` allows."""
    may = may_roll(graph, segment.first)
    allowed = {i.name for i in segment.inputs if i.name in may} if segment.mode == "tiled" else set()
    for name in segment.rolled:
        producer = next((s for s in plan.segments if s.first <= graph.position.get(name, -1) < s.stop), None)
        if name not in allowed or producer is None or producer.mode != "tiled":
            _fail(f"segment {segment.index} rolls the gradient of {name}, which another backward may still read "
                  f"(it may roll only inputs of a tiled segment that a tiled segment produced and no earlier "
                  f"node reads, not the model input or an output)")


def _partition(tiles, where: str, what: str, size: int, parts) -> None:
    """``parts`` (per tile, one interval) partition ``[0, size)`` in order without empty parts."""
    position = 0
    for number, part in enumerate(parts):
        if part.start != position or not part.start < part.stop <= size:
            _fail(f"{where} tile {number} owns {_interval(part)} of {what}: the owned parts must partition "
                  f"[0, {size}) in order without empty parts (next part starts at {position})")
        position = part.stop
    if position != size:
        _fail(f"{where}: the owned parts of {what} cover [0, {position}), not [0, {size})")


def _check_owned(segment: Segment, axis: int, graph: Graph) -> None:
    """Each image output's owned intervals, and each reduction's partials' intervals, partition it."""
    tiles: tuple[AxisTile, ...] = getattr(segment, AXES[axis])
    where = f"segment {segment.index} {AXES[axis]}"
    images = [name for name in segment.outputs if graph.is_image(name)]
    for number, tile in enumerate(tiles):
        if tile.index != number:
            _fail(f"{where} tile {number} has index {tile.index}, expected {number}")
        if len(tile.owned) != len(images):
            _fail(f"{where} tile {number} owns {len(tile.owned)} intervals for {len(images)} image outputs")
        if len(tile.partials) != len(segment.reductions):
            _fail(f"{where} tile {number} has {len(tile.partials)} partials for {len(segment.reductions)} reductions")
    for k, name in enumerate(images):
        _partition(tiles, where, f"output {name}", graph.size(name, axis), [tile.owned[k] for tile in tiles])
    for k, name in enumerate(segment.reductions):
        node = graph.nodes[name]
        reduced = rule(node).reduced(node, graph)
        if reduced:
            _partition(tiles, where, f"the input of reduction {name}", graph.size(reduced[0], axis),
                       [tile.partials[k] for tile in tiles])


def _check_levels(segment: Segment, graph: Graph) -> None:
    """A tiled segment's levels are those of its nodes (``tilec.sweeps.levels``); a stored one has none."""
    expected = levels(graph, segment.first, segment.stop) if segment.mode == "tiled" else ()
    if tuple(segment.levels) != tuple(expected):
        _fail(f"segment {segment.index} has levels {[level.model_dump() for level in segment.levels]}, but its nodes "
              f"make {[level.model_dump() for level in expected]}")


def _compare_step(step: AxisStep, expected: AxisStep, where: str) -> None:
    here = f"{where}, node {expected.node}"
    if step.node != expected.node:
        _fail(f"{where} has a step for node {step.node} where the segment's node order has {expected.node}")
    if step.out != expected.out:
        _fail(f"{here}: out {_interval(step.out)} is not the hull of its consumers' reads and its owned parts, "
              f"{_interval(expected.out)}")
    if step.grad_out != step.out:
        _fail(f"{here}: grad_out {_interval(step.grad_out)} differs from out {_interval(step.out)}")
    if [r.input for r in step.reads] != [r.input for r in expected.reads]:
        _fail(f"{here} reads {[r.input for r in step.reads]}, but its rule reads {[r.input for r in expected.reads]}")
    for read, want in zip(step.reads, expected.reads, strict=True):
        if read.read != want.read:
            _fail(f"{here}: read {_interval(read.read)} of {read.input} is not what its rule needs for out "
                  f"{_interval(step.out)}, clipped to the input: {_interval(want.read)}")
        if tuple(read.pad) != tuple(want.pad):
            _fail(f"{here}: pad {tuple(read.pad)} of {read.input} is not the clipped amount {tuple(want.pad)}")
        if read.grad != read.read:
            _fail(f"{here}: grad {_interval(read.grad)} of {read.input} differs from read {_interval(read.read)}")


def _compare(tile: AxisTile, expected: AxisTile, segment: Segment, graph: Graph, where: str) -> None:
    """The first field where ``tile`` differs from the planner's, consumers before producers."""
    images = [name for name in segment.outputs if graph.is_image(name)]
    for name, owned, want in zip(images, tile.owned, expected.owned, strict=True):
        if owned != want:
            _fail(f"{where} owns {_interval(owned)} of output {name}, not the grid's split {_interval(want)}")
    for name, part, want in zip(segment.reductions, tile.partials, expected.partials, strict=True):
        if part != want:
            _fail(f"{where}'s partial of {name} covers {_interval(part)}, not the grid's split {_interval(want)}")
    if len(tile.steps) != len(expected.steps):
        _fail(f"{where} has {len(tile.steps)} steps for the segment's {len(expected.steps)} nodes")
    for step, want in reversed(list(zip(tile.steps, expected.steps, strict=True))):
        _compare_step(step, want, where)
    sliced = [i.name for i in segment.inputs if i.sliced]
    if len(tile.inputs) != len(sliced):
        _fail(f"{where} has {len(tile.inputs)} input intervals for the {len(sliced)} sliced inputs {sliced}")
    for name, interval, want in zip(sliced, tile.inputs, expected.inputs, strict=True):
        if interval != want:
            _fail(f"{where} reads {_interval(interval)} of input {name}, not the hull of its readers' reads "
                  f"{_interval(want)}")


def _axis_grid(segment: Segment, axis: int, graph: Graph) -> int | Period:
    """What the planner split ``axis`` of tiled ``segment`` by: its tiles' count, or its ``period``."""
    if segment.period is None:
        return len(getattr(segment, AXES[axis]))
    return periods_on(graph, segment.period, f"segment {segment.index}")[axis]


def _check_axis(segment: Segment, axis: int, graph: Graph) -> None:
    tiles: tuple[AxisTile, ...] = getattr(segment, AXES[axis])
    _check_owned(segment, axis, graph)
    with _evaluating(f"the rules of segment {segment.index} {AXES[axis]}"):
        rebuilt = axis_tiles(graph, segment.first, segment.stop, axis, _axis_grid(segment, axis, graph))
    first_of_class: dict[int, tuple[int, tuple]] = {}
    numbering: dict[tuple, int] = {}
    for number, (tile, expected) in enumerate(zip(tiles, rebuilt, strict=True)):
        where = f"segment {segment.index} {AXES[axis]} tile {number}"
        _compare(tile, expected, segment, graph, where)
        with _evaluating(f"the class key of {where}"):
            key = class_key(tile, graph, segment.inputs, segment.outputs, axis, segment.reductions)
        first, first_key = first_of_class.setdefault(tile.shape_class, (number, key))
        if first_key != key:
            _fail(f"{where} shares shape_class {tile.shape_class} with tile {first}, but their generated code "
                  f"differs (lengths, pads, offsets or op constants)")
        canonical = numbering.setdefault(key, len(numbering))
        if tile.shape_class != canonical:
            _fail(f"{where} has shape_class {tile.shape_class}, expected {canonical} (one class per distinct "
                  f"code shape, numbered in order of first appearance)")


def _check_grid(plan: Plan, graph: Graph) -> None:
    """A plan compiled for one grid (``Plan.grid``) has the segments that grid makes
    (``tilec.planner.default_segments``)."""
    if plan.grid is None:
        return
    if any(n < 1 for n in plan.grid):
        _fail(f"grid {tuple(plan.grid)} is not two positive sizes")
    found = [(s.first, s.stop, tuple(s.grid), s.mode) for s in plan.segments]
    expected = [tuple(choice)[:4] for choice in default_segments(graph, tuple(plan.grid))]
    if found != expected:
        _fail(f"the segments (first, stop, grid, mode) {found} are not those grid {plan.grid[0]}x{plan.grid[1]} "
              f"makes: {expected}")


def _check_shares(plan: Plan) -> None:
    """Without ``ranks`` no segment has shares; with it, each tiled segment's shares give every
    tile to exactly one of the ``ranks`` ranks, and stored segments have none."""
    for segment in plan.segments:
        tiles = segment.grid[0] * segment.grid[1] if segment.mode == "tiled" else 0
        if plan.ranks is None and (segment.shares or segment.rank_seconds is not None):
            _fail(f"segment {segment.index} has shares or rank_seconds, but the plan names no ranks")
        if plan.ranks is not None and segment.mode == "tiled" and (
                len(segment.shares) != plan.ranks
                or sorted(i for indices in segment.shares for i in indices) != list(range(tiles))):
            _fail(f"segment {segment.index}'s shares do not give each of its {tiles} tiles to exactly one of "
                  f"{plan.ranks} ranks")
        if segment.mode == "stored" and segment.shares:
            _fail(f"segment {segment.index} is stored but has shares")


def validate(plan: Plan, source: str = "plan") -> Plan:
    """Return ``plan`` if it is internally consistent, else raise one ``PlanError`` line."""
    if plan.schema_version != SCHEMA_VERSION:
        check_version({"schema_version": plan.schema_version}, source)
    try:
        _check_modes(plan)
    except _Inconsistent as error:
        raise PlanError(f"{source} is inconsistent: {error}") from None
    _check_one(plan, source)
    if plan.other is not None:
        _check_one(plan.other, f"{source} (its {plan.other.mode}-mode plan)")
    return plan


def _check_one(plan: Plan, source: str) -> None:
    """Raise one ``PlanError`` line unless one mode's plan is internally consistent."""
    try:
        _check_input(plan)
        _check_predictions(plan)
        _check_nodes(plan)
        graph = Graph.of_plan(plan)
        _check_digest(plan, graph)
        _check_tileable(plan, graph)
        _check_readers(plan)
        _check_cover(plan)
        _check_ties(plan, graph)
        _check_shares(plan)
        for segment in plan.segments:
            _check_segment(segment, graph)
            _check_levels(segment, graph)
            _check_rolled(plan, segment, graph)
            if segment.mode == "tiled":
                for axis in range(2):
                    _check_axis(segment, axis, graph)
        _check_grid(plan, graph)
    except _Inconsistent as error:
        raise PlanError(f"{source} is inconsistent: {error}") from None
