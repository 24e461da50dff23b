"""Structural checks of a schema-valid plan: ``validate`` raises one ``PlanError`` line or returns.

The schema (pydantic) only knows types. A plan the generated code can execute exactly must
also be internally consistent:

* the layers chain (each input shape is the previous output shape, the first is the plan's
  input, the last output is the plan's output), their windows are sane, the spatial sizes
  follow each layer's window, and ``model.digest`` is the digest of ``model.layers``;
* segments cover the layers ``0..n-1`` contiguously, and each grid matches its axis tiles;
* per segment and axis, the owned intervals partition ``[0, size)`` of the segment output in
  order, without empty parts;
* per axis tile and layer: ``out`` lies in the layer output, ``read`` is ``out``'s window
  clipped to the layer input (so it lies in ``[0, in_size)``), ``pad`` is exactly what the
  clipping cut off, ``grad_out == out`` and ``grad_in == read``; layer ``k``'s ``read`` is layer
  ``k-1``'s ``out`` and the last layer's ``out`` is the owned interval;
* axis tiles sharing a ``shape_class`` share their region shapes (one generated kernel
  serves them all).

Only these invariants are checked, so fields a plan gains later (predictions, budgets) pass.
"""

from __future__ import annotations

from tilec.errors import PlanError
from tilec.ir import SCHEMA_VERSION, AxisTile, LayerSpec, Plan, Segment
from tilec.regions import Interval, Window

AXES = ("rows", "cols")


class _Inconsistent(Exception):
    pass


def _fail(message: str):
    raise _Inconsistent(message)


def _interval(interval: Interval) -> str:
    return f"[{interval.start}, {interval.stop})"


def _layer_name(layer: LayerSpec) -> str:
    return f"layer {layer.index} ({layer.path}, {layer.type})"


def _check_window(window: Window, where: str) -> None:
    if window.kernel < 1 or window.stride < 1 or window.dilation < 1:
        _fail(f"{where}: kernel, stride and dilation must be at least 1, got {window}")
    if window.pad_before < 0 or window.pad_after < 0:
        _fail(f"{where}: negative padding in {window}")


def _check_layers(plan: Plan) -> None:
    layers = plan.model.layers
    if not layers:
        _fail("model.layers is empty")
    if any(n < 1 for n in plan.input_shape):
        _fail(f"input_shape {tuple(plan.input_shape)} has a dimension below 1")
    shape = tuple(plan.input_shape)
    for position, layer in enumerate(layers):
        where = f"model.layers[{position}]"
        if layer.index != position:
            _fail(f"{where} has index {layer.index}, expected {position}")
        name = _layer_name(layer)
        if tuple(layer.in_shape) != shape:
            _fail(f"{name} takes input {tuple(layer.in_shape)} but receives {shape}")
        for axis, window in enumerate((layer.rows, layer.cols)):
            _check_window(window, f"{name} {AXES[axis]}")
        out = tuple(layer.out_shape)
        if any(n < 1 for n in out):
            _fail(f"{name} has output shape {out} with a dimension below 1")
        expected = (layer.rows.output_size(shape[2]), layer.cols.output_size(shape[3]))
        if out[0] != shape[0] or out[2:] != expected:
            _fail(f"{name} has output shape {out}, but its windows give "
                  f"(N={shape[0]}, H={expected[0]}, W={expected[1]})")
        shape = out
    if tuple(plan.output_shape) != shape:
        _fail(f"output_shape {tuple(plan.output_shape)} is not the last layer's output {shape}")
    from tilec.planner import fingerprint  # local: keeps plan I/O light to import

    if fingerprint(layers).digest != plan.model.digest:
        _fail("model.digest is not the digest of model.layers (the layers were edited)")


def _check_segments(plan: Plan) -> None:
    count = len(plan.model.layers)
    if not plan.segments:
        _fail("the plan has no segments")
    expected = 0
    for position, segment in enumerate(plan.segments):
        where = f"segment {position}"
        if segment.index != position:
            _fail(f"{where} has index {segment.index}, expected {position}")
        if segment.first != expected or not segment.first < segment.stop <= count:
            _fail(f"{where} covers layers [{segment.first}, {segment.stop}), expected a non-empty "
                  f"range starting at {expected} and ending by {count}")
        expected = segment.stop
        grid = (len(segment.rows), len(segment.cols))
        if tuple(segment.grid) != grid:
            _fail(f"{where} has grid {segment.grid[0]}x{segment.grid[1]} but {grid[0]} row tiles "
                  f"and {grid[1]} column tiles")
        if grid[0] < 1 or grid[1] < 1:
            _fail(f"{where} has an empty grid {grid[0]}x{grid[1]}")
    if expected != count:
        _fail(f"the segments cover layers [0, {expected}), but the model has {count} layers")


def _check_axis(plan: Plan, segment: Segment, axis: int) -> None:
    layers = plan.model.layers[segment.first:segment.stop]
    tiles: tuple[AxisTile, ...] = getattr(segment, AXES[axis])
    size = layers[-1].out_shape[2 + axis]
    position = 0
    for number, tile in enumerate(tiles):
        where = f"segment {segment.index} {AXES[axis]} tile {number}"
        if tile.index != number:
            _fail(f"{where} has index {tile.index}, expected {number}")
        owned = tile.owned
        if owned.start != position or not owned.start < owned.stop <= size:
            _fail(f"{where} owns {_interval(owned)}: the owned {AXES[axis]} must partition the "
                  f"output [0, {size}) in order (next part starts at {position})")
        position = owned.stop
    if position != size:
        _fail(f"segment {segment.index}: the owned {AXES[axis]} cover [0, {position}), "
              f"not the whole output [0, {size})")
    classes: dict[int, tuple] = {}
    for number, tile in enumerate(tiles):
        where = f"segment {segment.index} {AXES[axis]} tile {number}"
        if len(tile.steps) != len(layers):
            _fail(f"{where} has {len(tile.steps)} steps for the segment's {len(layers)} layers")
        downstream = tile.owned
        for step, layer in reversed(list(zip(tile.steps, layers, strict=True))):
            here = f"{where}, {_layer_name(layer)}"
            in_size, out_size = layer.in_shape[2 + axis], layer.out_shape[2 + axis]
            if step.out != downstream:
                what = "the owned interval" if layer is layers[-1] else "what the next layer reads"
                _fail(f"{here}: out {_interval(step.out)} is not {what} {_interval(downstream)}")
            if not 0 <= step.out.start <= step.out.stop <= out_size:
                _fail(f"{here}: out {_interval(step.out)} is reversed or outside the output [0, {out_size})")
            if not 0 <= step.read.start <= step.read.stop <= in_size:
                _fail(f"{here}: read {_interval(step.read)} is reversed or outside the input [0, {in_size})")
            window = layer.rows if axis == 0 else layer.cols
            read, before, after = window.read(step.out, in_size)
            if step.read != read:
                _fail(f"{here}: read {_interval(step.read)} is not the window of out "
                      f"{_interval(step.out)}, which is {_interval(read)}")
            if tuple(step.pad) != (before, after):
                _fail(f"{here}: pad {tuple(step.pad)} does not match the clipped amount ({before}, {after})")
            if step.grad_out != step.out or step.grad_in != step.read:
                _fail(f"{here}: grad_out/grad_in {_interval(step.grad_out)}/{_interval(step.grad_in)} "
                      f"differ from out/read {_interval(step.out)}/{_interval(step.read)}")
            downstream = step.read
        signature = tuple((s.out.length, s.read.length, tuple(s.pad)) for s in tile.steps)
        if classes.setdefault(tile.shape_class, signature) != signature:
            _fail(f"{where} is in shape_class {tile.shape_class} but its regions have other shapes "
                  f"than that class's first tile")


def validate(plan: Plan, source: str = "plan") -> Plan:
    """Return ``plan`` if it is internally consistent, else raise one ``PlanError`` line."""
    if plan.schema_version != SCHEMA_VERSION:
        raise PlanError(f"{source} has schema_version {plan.schema_version}; this tilec reads "
                        f"version {SCHEMA_VERSION} (recompile the model)")
    try:
        _check_layers(plan)
        _check_segments(plan)
        for segment in plan.segments:
            for axis in range(2):
                _check_axis(plan, segment, axis)
    except _Inconsistent as error:
        raise PlanError(f"{source} is inconsistent: {error}") from None
    return plan
