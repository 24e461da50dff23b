"""Human-readable views of a plan (rich tables) for ``tilec compile`` and ``tilec inspect``.

Intervals print half-open, ``[start, stop)``, in the coordinates of the full tensor; a 2-D
region prints as ``rows x cols``; padding prints as ``top/bottom/left/right``.
"""

from __future__ import annotations

import math

from rich.table import Table

from tilec.errors import TilecError
from tilec.graph import Graph
from tilec.ir import AxisStep, InputSpec, NodeSpec, Plan, Read, Segment
from tilec.ops import rule, why_untiled
from tilec.regions import Interval


def _interval(interval: Interval) -> str:
    return f"[{interval.start}, {interval.stop})"


def _region(rows: Interval, cols: Interval) -> str:
    return f"{_interval(rows)} x {_interval(cols)}"


def _shape(shape) -> str:
    return "x".join(str(n) for n in shape) or "scalar"


def _mib(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


def _where(node: NodeSpec) -> str:
    return f"{node.name} ({node.path or '-'})"


def describe_input(spec: InputSpec) -> str:
    """``x 1x3x8192x8192 uint8``."""
    return f"{spec.name} {_shape(spec.shape)} {spec.dtype}"


def input_reads(plan: Plan) -> list[str]:
    """Per model input, how the plan reads it: by tiles of tiled segments (streamed, when given as
    an array or a host tensor: ``TiledModel`` reads only those regions) or whole by stored ones."""
    lines = []
    for spec in plan.inputs:
        tiled, whole = [], []
        for segment in plan.segments:
            names = [i.name for i in segment.inputs if i.sliced]
            if spec.name in names and segment.mode == "tiled":
                k = names.index(spec.name)
                rows = max(t.inputs[k].length for t in segment.rows)
                cols = max(t.inputs[k].length for t in segment.cols)
                tiled.append(f"{segment.index} ({rows}x{cols} at most)")
            elif any(i.name == spec.name for i in segment.inputs):
                whole.append(str(segment.index))
        how = ([f"read by region by the tiles of segment(s) {', '.join(tiled)}"] if tiled else []) + (
            [f"read whole by segment(s) {', '.join(whole)}"] if whole else [])
        lines.append(f"input {describe_input(spec)}: {'; '.join(how) or 'not read'}")
    if plan.staging_bytes:
        lines.append(f"staging of inputs read by region: {_mib(plan.staging_bytes)} (in the predicted peak)")
    return lines


def _largest_slice(segment: Segment) -> str:
    """The largest input slice of any tile: per sliced input, the longest row interval times the
    longest column interval (tile ``(i, j)`` reads ``rows[i]`` x ``cols[j]``)."""
    sliced = [i.name for i in segment.inputs if i.sliced]
    best = None
    for k, name in enumerate(sliced):
        rows = max(t.inputs[k].length for t in segment.rows)
        cols = max(t.inputs[k].length for t in segment.cols)
        if best is None or rows * cols > best[0] * best[1]:
            best = (rows, cols, name)
    return "-" if best is None else f"{best[0]}x{best[1]} ({best[2]})"


def _outputs(plan: Plan, segment: Segment) -> str:
    """How many tensors the segment materialises, and the largest."""
    largest = max((plan.node(name) for name in segment.outputs), key=lambda n: math.prod(n.shape), default=None)
    return "-" if largest is None else f"{len(segment.outputs)}, largest {_shape(largest.shape)}"


def describe_plan(plan: Plan) -> Table:
    """One row per segment: nodes, mode, grid (and tiles per call, ``Segment.batch``), shape classes,
    largest slice, outputs, predicted cost."""
    budget = f", budget {_mib(plan.memory_budget)}" if plan.memory_budget else ""
    autocast = f" (autocast {plan.autocast})" if plan.autocast else ""
    mode = f" ({plan.mode} mode)" if plan.mode else ""
    ranks = ""
    if plan.ranks is not None:
        seconds = sum(s.rank_seconds or 0.0 for s in plan.segments)
        ranks = (f"; {plan.ranks} ranks share the tiles: predicted peak per rank {_mib(plan.predicted_peak_bytes)}, "
                 f"est. {seconds:.3f} s per rank (without communication)")
    table = Table(
        title=f"plan {plan.name}{mode}: inputs {', '.join(describe_input(spec) for spec in plan.inputs)}, "
        f"{len(plan.model.nodes)} nodes, "
        f"{plan.dtype}{autocast}, predicted peak {_mib(plan.predicted_peak_bytes)}{budget}{ranks}"
    )
    columns = ["segment", "nodes", "mode", "grid", "shape classes", "largest input slice", "outputs",
               "sweeps", "predicted peak", "FLOP overhead", "est. seconds"]
    if plan.ranks is not None:
        columns += ["tiles per rank", "busiest rank s"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("nodes", "outputs", "tiles per rank") else "right")
    nodes = plan.model.nodes
    groups = plan.recomputed_cones()
    captions = input_reads(plan)
    if groups:
        captions.append("recomputed from the input by later readers instead of kept: " + ", ".join(
            f"{cone[-1]} ({len(cone)} nodes)" for cone in groups.values()))
    captions += clipped_grids(plan)
    captions += untiled(plan)
    if plan.backgrounds:
        captions.append(f"background of {', '.join(plan.backgrounds)} known when compiling: the estimate leaves "
                        "out the tiles that reuse an identical one, " + "; ".join(
                            f"{s.reused} of segment {s.index}'s {s.grid[0] * s.grid[1]}"
                            for s in plan.segments if s.reused)
                        if any(s.reused for s in plan.segments) else
                        f"background of {', '.join(plan.backgrounds)} known when compiling: no tile lies wholly in it")
    captions += modes(plan)
    captions += [f"segment {s.index} reduces by sweeps: " + "; ".join(_level(level) for level in s.levels)
                 for s in plan.segments if s.levels]
    table.caption = "\n".join(captions) or None
    for segment in plan.segments:
        tiled = segment.mode == "tiled"
        classes = len({t.shape_class for t in segment.rows}) * len({t.shape_class for t in segment.cols})
        table.add_row(
            str(segment.index),
            f"{segment.first}..{segment.stop - 1}: {_where(nodes[segment.first])} .. {_where(nodes[segment.stop - 1])}",
            segment.mode,
            f"{segment.grid[0]}x{segment.grid[1]}" + (f" ({segment.batch} per call)" if segment.batch > 1 else ""),
            str(classes) if tiled else "-",
            _largest_slice(segment) if tiled else "-",
            _outputs(plan, segment),
            sweeps(segment),
            _mib(segment.predicted_peak_bytes),
            f"{segment.flop_overhead:+.1%}",
            f"{segment.estimated_seconds:.3f}",
            *_rank_cells(plan, segment),
        )
    return table


def same_segments(plan: Plan) -> str:
    """The ``tilec compile`` flags that plan ``plan``'s segments again (in a plan of two modes, the
    compile-time mode's): ``--segments`` and, where it recomputes, ``--recompute``."""
    segments, recomputed = plan.planned_as()
    return f"the same segments: --segments {segments}" + (f" --recompute {','.join(recomputed)}" if recomputed else "")


def modes(plan: Plan) -> list[str]:
    """A line on the modes a plan runs in, where it does not serve both."""
    if plan.mode is None:
        return []
    mode, other = ("training", "eval") if plan.mode == "train" else ("eval", "training")
    flipped = f" (modules in {other} mode: {', '.join(plan.flipped)})" if plan.flipped else ""
    if plan.other is not None:
        return [f"runs in {mode} mode only{flipped}: the model's forward takes another path in {other} mode, which "
                f"has its own plan"]
    if plan.refused is not None:
        return [f"runs in {mode} mode only{flipped}; {other} mode is refused: {plan.refused}"]
    return [f"runs in {mode} mode only{flipped}"]


def sweeps(segment: Segment) -> str:
    """A tiled segment's sweeps over its tiles in one step, forward + backward (``tilec.sweeps``)."""
    if segment.mode != "tiled":
        return "-"
    images = any(step.out.length for tile in segment.rows[:1] for step in tile.steps
                 if step.node in segment.outputs)
    forward = sum(1 for level in segment.levels if level.index > 0 and not level.direct) + images
    backward = 1 + sum(1 for level in segment.levels if level.swept and not level.direct)
    return f"{forward}+{backward}"


def _level(level) -> str:
    names = ", ".join([*level.reductions, *(f"{name} (small)" for name in level.small)])
    how = "direct" if level.direct else "swept" if level.swept else "combined"
    return f"level {level.index} ({how}): {names}"


def untiled_nodes(graph: Graph) -> list[tuple[NodeSpec, str]]:
    """The nodes before ``graph``'s last image op that run untiled, whatever the plan (in stored
    segments, where the maps around them are kept whole), each with why (``tilec.ops.why_untiled``)."""
    nodes = list(graph)
    last = max((k for k, node in enumerate(nodes) if graph.sliced_inputs(node)), default=0)
    return [(node, why_untiled(node, graph)) for node in nodes[:last] if not node.tileable]


def untiled(plan: Plan) -> list[str]:
    """A line naming the nodes that run untiled before the last image op (``untiled_nodes``), at
    most five, where there are any."""
    found = untiled_nodes(Graph.of_plan(plan))
    if not found:
        return []
    named = "; ".join(f"{node.name} (aten.{node.op}, {node.path or 'forward'}): {why}" for node, why in found[:5])
    more = f"; and {len(found) - 5} more (tilec inspect --nodes)" if len(found) > 5 else ""
    return [f"{len(found)} node(s) run untiled, the maps around them kept whole: {named}{more}"]


def clipped_grids(plan: Plan) -> list[str]:
    """One line per tiled segment whose grid is ``--grid`` clipped to its outputs' sizes."""
    if plan.grid is None:
        return []
    return [f"--grid {plan.grid[0]}x{plan.grid[1]} is finer than the outputs of segment {s.index}: clipped to "
            f"{s.grid[0]}x{s.grid[1]}" for s in plan.segments
            if s.mode == "tiled" and tuple(s.grid) != tuple(plan.grid)]


def _rank_cells(plan: Plan, segment: Segment) -> list[str]:
    """With ``plan.ranks``: how many tiles each rank runs ("all" for stored), the busiest rank's time."""
    if plan.ranks is None:
        return []
    counts = "/".join(str(len(indices)) for indices in segment.shares) if segment.shares else "all, untiled"
    return [counts, f"{segment.rank_seconds:.3f}"]


def node_position(plan: Plan, name: str) -> int:
    """Position of node ``name`` in the node order; a one-line ``TilecError`` if there is none."""
    for position, node in enumerate(plan.model.nodes):
        if node.name == name:
            return position
    raise TilecError(f"no node {name!r} in the plan; `tilec inspect PLAN --nodes` lists every node")


def _chosen_segments(plan: Plan, node: int | None, segment: int | None) -> list[Segment]:
    """The tiled segments to show: ``segment``, the one holding ``node``, or every tiled one."""
    if segment is not None and not 0 <= segment < len(plan.segments):
        raise TilecError(f"--segment {segment} is out of range: the plan has {len(plan.segments)} segment(s)")
    if node is not None:
        holder, name = plan.segment_of(node), plan.model.nodes[node].name
        if segment is not None and segment != holder.index:
            raise TilecError(f"node {name} is in segment {holder.index}, not segment {segment}")
        if holder.mode != "tiled":
            raise TilecError(f"node {name} is in segment {holder.index}, which is stored: it runs untiled, "
                             f"so it has no tiles to show")
        segment = holder.index
    if segment is not None:
        chosen = plan.segments[segment]
        if chosen.mode != "tiled":
            raise TilecError(f"segment {segment} is stored: it runs untiled, so it has no tiles to show")
        return [chosen]
    return [s for s in plan.segments if s.mode == "tiled"]


def _tiles(segments: list[Segment], tile: tuple[int, int] | None, explicit: bool) -> list[tuple[Segment, list]]:
    """Per segment, the tile coordinates to show: ``tile`` where it is in the grid, else all."""
    if tile is None:
        return [(s, [(i, j) for i in range(s.grid[0]) for j in range(s.grid[1])]) for s in segments]
    inside = [s for s in segments if 0 <= tile[0] < s.grid[0] and 0 <= tile[1] < s.grid[1]]
    if not inside or (explicit and len(inside) != len(segments)):
        grids = ", ".join(f"segment {s.index} {s.grid[0]}x{s.grid[1]}" for s in segments) or "no tiled segment"
        raise TilecError(f"--tile {tile[0]},{tile[1]} is outside the grid ({grids})")
    return [(s, [tile]) for s in inside]


def _read_cells(row: Read, col: Read) -> list[str]:
    return [row.input, _interval(row.read), _interval(col.read),
            f"{row.pad[0]}/{row.pad[1]}/{col.pad[0]}/{col.pad[1]}", _region(row.grad, col.grad)]


def _reduced(segment: Segment, graph: Graph, node: NodeSpec) -> tuple[str, ...]:
    """The inputs whose owned parts ``node``'s partials cover, if it is a reduction of ``segment``."""
    return rule(node).reduced(node, graph) if node.name in segment.reductions else ()


def _step_rows(node: NodeSpec, row: AxisStep, col: AxisStep,
               partials: list[tuple[str, Interval, Interval]]) -> list[list[str]]:
    """One table row per read of ``node`` (rows and cols steps of one tile), then one per input its
    partials cover (``(input, rows, cols)``); the node's own cells on the first."""
    head = [node.name, node.op, node.path or "-", _interval(row.out), _interval(col.out),
            _region(row.grad_out, col.grad_out)]
    cells = [_read_cells(r, c) for r, c in zip(row.reads, col.reads, strict=True)]
    cells += [[f"{name} (partial)", _interval(r), _interval(c), "0/0/0/0", _region(r, c)] for name, r, c in partials]
    return [(head if k == 0 else [""] * len(head)) + read for k, read in enumerate(cells)]


def tile_table(plan: Plan, tile: tuple[int, int] | None, node: str | None, segment: int | None) -> list[Table]:
    """Per node of a tile: output interval, and per read the input, read interval, padding and gradients;
    a reduction's partial reads the part of its input the tile owns ("(partial)").

    ``tile``: one tile ``(i, j)`` (else every tile); ``node``: only that node (else every node of the
    segment); ``segment``: only that segment (else the node's, or every tiled segment holding the
    tile). One table per segment shown; bad choices raise one-line ``TilecError`` s, as does a small
    op (``tilec.sweeps``), which no tile computes.
    """
    graph = Graph.of_plan(plan)
    position = node_position(plan, node) if node is not None else None
    segments = _chosen_segments(plan, position, segment)
    if position is not None and not segments[0].rows[0].steps[position - segments[0].first].reads \
            and not _reduced(segments[0], graph, plan.model.nodes[position]):
        raise TilecError(f"node {node} is a small op of segment {segments[0].index}, computed once per sweep from its "
                         f"reductions' results: no tile computes a region of it")
    tables = []
    for seg, coordinates in _tiles(segments, tile, explicit=segment is not None or position is not None):
        title = f"segment {seg.index} (grid {seg.grid[0]}x{seg.grid[1]})"
        title += f", tile {tile[0]},{tile[1]}" if tile is not None else ", every tile"
        title += f", node {node}" if node is not None else ""
        table = Table(title=title + "  (rows x cols, half-open; pad = top/bottom/left/right)")
        for column in ("tile", "node", "op", "module", "out rows", "out cols", "grad out", "reads", "read rows",
                       "read cols", "pad", "grad in"):
            table.add_column(column)
        members = range(seg.first, seg.stop) if position is None else [position]
        for i, j in coordinates:
            rows, cols = seg.rows[i], seg.cols[j]
            for index in members:
                k, spec = index - seg.first, plan.model.nodes[index]
                partials = [(name, rows.partials[seg.reductions.index(spec.name)],
                             cols.partials[seg.reductions.index(spec.name)]) for name in _reduced(seg, graph, spec)]
                for n, cells in enumerate(_step_rows(spec, rows.steps[k], cols.steps[k], partials)):
                    table.add_row(f"{i},{j}" if n == 0 else "", *cells)
        tables.append(table)
    return tables


def node_table(plan: Plan) -> Table:
    """Every node: position (for ``--segments FIRST:STOP@RxC``), name, op, module, shape, tileable (or
    why not, ``tilec.ops.why_untiled``), segment, and the node it is a recomputed copy of."""
    table = Table(title=f"nodes of plan {plan.name} (positions for --segments FIRST:STOP@RxC, STOP exclusive)")
    for column in ("position", "node", "op", "module", "output", "tileable", "segment", "recomputes"):
        table.add_column(column, justify="right" if column == "position" else "left")
    graph = Graph.of_plan(plan)
    for position, node in enumerate(plan.model.nodes):
        segment = plan.segment_of(position)
        tileable = "yes" if node.tileable else f"no: {why_untiled(node, graph)}"
        table.add_row(str(position), node.name, node.op, node.path or "-", _shape(node.shape), tileable,
                      f"{segment.index} ({segment.mode})", node.recomputes or "-")
    return table
