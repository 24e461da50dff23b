"""Human-readable views of a plan (rich tables) for ``tilec compile`` and ``tilec inspect``."""

from __future__ import annotations

from rich.table import Table

from tilec.errors import TilecError
from tilec.ir import AxisStep, Plan, Segment
from tilec.regions import Interval


def _interval(interval: Interval) -> str:
    return f"[{interval.start}, {interval.stop})"


def _shape(shape) -> str:
    return "x".join(str(n) for n in shape)


def _mib(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


def describe_plan(plan: Plan) -> Table:
    """One row per segment: nodes, mode, grid, shape classes, largest tile, predicted cost."""
    budget = f", budget {_mib(plan.memory_budget)}" if plan.memory_budget else ""
    table = Table(
        title=f"plan {plan.name}: input {_shape(plan.input_shape)}, {len(plan.model.nodes)} nodes, {plan.dtype}, "
        f"predicted peak {_mib(plan.predicted_peak_bytes)}{budget}"
    )
    for column in ("segment", "nodes", "mode", "grid", "shape classes", "largest input slice", "outputs",
                   "predicted peak", "FLOP overhead", "est. seconds"):
        table.add_column(column, justify="right" if column != "nodes" else "left")
    nodes = plan.model.nodes
    for segment in plan.segments:
        first, last = nodes[segment.first], nodes[segment.stop - 1]
        tiled = segment.mode == "tiled"
        classes = len({t.shape_class for t in segment.rows}) * len({t.shape_class for t in segment.cols})
        rows = max((sum(i.length for i in t.inputs) for t in segment.rows), default=0)
        cols = max((sum(i.length for i in t.inputs) for t in segment.cols), default=0)
        table.add_row(
            str(segment.index),
            f"{segment.first}..{segment.stop - 1} ({first.name} {first.path or '-'} .. {last.name} {last.path or '-'})",
            segment.mode,
            f"{segment.grid[0]}x{segment.grid[1]}",
            str(classes) if tiled else "-",
            f"{rows}x{cols}" if tiled else "-",
            ", ".join(_shape(plan.node(name).shape) for name in segment.outputs[:2])
            + (f" +{len(segment.outputs) - 2}" if len(segment.outputs) > 2 else ""),
            _mib(segment.predicted_peak_bytes),
            f"{segment.flop_overhead:+.1%}",
            f"{segment.estimated_seconds:.3f}",
        )
    return table


def _pad(row: AxisStep, col: AxisStep) -> str:
    top, bottom = row.pad
    left, right = col.pad
    return f"{top}/{bottom}/{left}/{right}"


def _padded_input(row: AxisStep, col: AxisStep) -> str:
    """Size of the tile's input after border padding: what the layer's kernel runs on."""
    return f"{row.read.length + sum(row.pad)}x{col.read.length + sum(col.pad)}"


def _segments(plan: Plan, segment: int | None) -> list[Segment]:
    if segment is None:
        return list(plan.segments)
    if not 0 <= segment < len(plan.segments):
        raise TilecError(f"--segment {segment} is out of range: the plan has {len(plan.segments)} segment(s)")
    return [plan.segments[segment]]


def tile_table(plan: Plan, tile: tuple[int, int] | None, layer: int | None, segment: int | None) -> list[Table]:
    """Per-layer regions of one tile, or of every tile at one layer."""
    if layer is not None and not 0 <= layer < len(plan.model.layers):
        raise TilecError(f"--layer {layer} is out of range: the plan has {len(plan.model.layers)} layers")
    tables = []
    for seg in _segments(plan, segment):
        if layer is not None and not seg.first <= layer < seg.stop:
            continue
        if tile is not None and not (tile[0] < seg.grid[0] and tile[1] < seg.grid[1]):
            raise TilecError(f"--tile {tile[0]},{tile[1]} is outside segment {seg.index}'s "
                             f"{seg.grid[0]}x{seg.grid[1]} grid")
        coordinates = [tile] if tile is not None else [(i, j) for i in range(seg.grid[0]) for j in range(seg.grid[1])]
        title = f"segment {seg.index}" + (f", tile {tile[0]},{tile[1]}" if tile else f", layer {layer}")
        table = Table(title=title + "  (rows x cols, half-open; pad = top/bottom/left/right)")
        for column in ("tile", "layer", "type", "output rows", "output cols", "reads rows", "reads cols",
                       "padded input", "pad", "grad out", "grad in"):
            table.add_column(column)
        for i, j in coordinates:
            rows, cols = seg.rows[i], seg.cols[j]
            for position, spec in enumerate(plan.model.layers[seg.first:seg.stop]):
                if layer is not None and spec.index != layer:
                    continue
                r, c = rows.steps[position], cols.steps[position]
                table.add_row(
                    f"{i},{j}", f"{spec.index} ({spec.path})", spec.type,
                    _interval(r.out), _interval(c.out), _interval(r.read), _interval(c.read),
                    _padded_input(r, c), _pad(r, c),
                    f"{_interval(r.grad_out)}x{_interval(c.grad_out)}",
                    f"{_interval(r.grad_in)}x{_interval(c.grad_in)}",
                )
        tables.append(table)
    return tables


def node_table(plan: Plan) -> Table:
    """Every node: position, name, op, module path, output shape, tileable, segment."""
    table = Table(title=f"nodes of plan {plan.name} (positions for --segments FIRST:STOP@RxC)")
    for column in ("position", "node", "op", "module", "output", "tileable", "segment"):
        table.add_column(column)
    for position, node in enumerate(plan.model.nodes):
        table.add_row(str(position), node.name, node.op, node.path or "-", _shape(node.shape),
                      "yes" if node.tileable else "no", str(plan.segment_of(position).index))
    return table
