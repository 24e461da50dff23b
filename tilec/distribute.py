"""``distribute``: share every tiled segment's tiles among the ranks of a process group.

Tiles are balanced by their cost in one step (``tilec.cost.balance``), by the runtime's own rule
(``tilec.runtime.tiles.share``): the costliest tile first, each to the least loaded rank, on
ties the one with the fewest tiles, then the lowest rank. Tiles are numbered row-major (tile
``(i, j)`` of an ``R x C`` grid is ``i * C + j``). The generated module applies the same rule at
run time to a group the plan did not name. Stored segments run on every rank.
"""

from __future__ import annotations

from tilec.cost.balance import axis_weights, tile_cost
from tilec.errors import GridError
from tilec.graph import Graph
from tilec.ir import MAX_COUNT, Plan, Segment
from tilec.runtime.tiles import share


def distribute(plan: Plan, ranks: int | None) -> Plan:
    """``plan`` with each tiled segment's shares for ``ranks`` ranks (``None``: unchanged)."""
    if ranks is None:
        return plan
    if not 1 <= ranks <= MAX_COUNT:
        raise GridError(f"--ranks must be from 1 to {MAX_COUNT}, got {ranks}")
    graph = Graph.of_plan(plan)
    segments = [_shared(segment, graph, ranks) for segment in plan.segments]
    other = distribute(plan.other, ranks) if plan.other is not None else None
    return plan.model_copy(update={"segments": tuple(segments), "ranks": ranks, "other": other})


def _shared(segment: Segment, graph: Graph, ranks: int) -> Segment:
    if segment.mode != "tiled":
        return segment.model_copy(update={"rank_seconds": segment.estimated_seconds})
    members = graph.members(segment.first, segment.stop)
    costs = tile_cost(axis_weights(graph, members, segment.rows, 0), axis_weights(graph, members, segment.cols, 1))
    shares = share(costs, ranks)
    busiest = max(sum(costs[i] for i in indices) for indices in shares)
    return segment.model_copy(update={"shares": shares,
                                      "rank_seconds": segment.estimated_seconds * busiest / max(1, sum(costs))})
