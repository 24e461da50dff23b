"""``distribute``: share every tiled segment's tiles among the ranks of a process group.

Tiles are balanced by their cost in one step (``tilec.cost.axis_weights``, ``tile_cost``): the
costliest tile first, each to the least loaded rank, the lowest rank on ties. Tiles are numbered row-major
(tile ``(i, j)`` of an ``R x C`` grid is ``i * C + j``). The generated module applies the same
rule at run time to a group the plan did not name. Stored segments run on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx

from tilec.cost import axis_weights, tile_cost
from tilec.errors import GridError
from tilec.ir import Plan, Segment
from tilec.ops import plan_context


def share(costs: Sequence[int], ranks: int) -> tuple[tuple[int, ...], ...]:
    """Per rank, the sorted indices of the tiles it runs."""
    loads, shares = [0] * ranks, [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        least = min(range(ranks), key=lambda r: (loads[r], r))
        loads[least] += costs[index]
        shares[least].append(index)
    return tuple(tuple(sorted(indices)) for indices in shares)


def shared(graph: nx.DiGraph, sharing: bool) -> nx.DiGraph:
    """``graph`` marked ``shared_tiles`` if ranks of a process group will share its tiles: then no
    segment rolls an input's gradient (``tilec.cost.Estimator.rollable``), which takes one process
    running every row of tiles in order."""
    if not sharing:
        return graph
    marked = graph.copy()
    marked.graph["shared_tiles"] = True
    return marked


def distribute(plan: Plan, ranks: int | None) -> Plan:
    """``plan`` with each tiled segment's shares for ``ranks`` ranks (``None``: unchanged)."""
    if ranks is None:
        return plan
    if ranks < 1:
        raise GridError(f"--ranks must be at least 1, got {ranks}")
    context = plan_context(plan)
    order = [n.name for n in plan.model.nodes]
    segments = [_shared(segment, context, order, ranks) for segment in plan.segments]
    return plan.model_copy(update={"segments": tuple(segments), "ranks": ranks})


def _shared(segment: Segment, context, order: list[str], ranks: int) -> Segment:
    if segment.mode != "tiled":
        return segment.model_copy(update={"rank_seconds": segment.estimated_seconds})
    members = [context.nodes[name] for name in order[segment.first:segment.stop]]
    costs = tile_cost(axis_weights(context, members, segment.rows, 0), axis_weights(context, members, segment.cols, 1))
    shares = share(costs, ranks)
    busiest = max(sum(costs[i] for i in indices) for indices in shares)
    return segment.model_copy(update={"shares": shares,
                                      "rank_seconds": segment.estimated_seconds * busiest / max(1, sum(costs))})
