"""Tile weights for sharing tiles among ranks: integer FLOPs per axis tile, the same on every machine."""

from __future__ import annotations

from collections.abc import Sequence
from math import prod

from tilec.graph import Graph
from tilec.ir import AxisTile, NodeSpec
from tilec.ops import rule


def axis_weights(graph: Graph, members: Sequence[NodeSpec], tiles: Sequence[AxisTile], axis: int) -> list[int]:
    """Per tile along ``axis`` of a tiled segment, the FLOPs of one step (forward, the autograd
    re-run and backward) of a full band of tiles: per node, its FLOPs per output pixel (rounded)
    times the tile's output length on ``axis`` times the node's full size on the other axis.

    Tile ``(i, j)`` is weighted ``rows[i] * cols[j]`` (``tile_cost``): exact when every node's
    tile lengths are the same share of its size, a close estimate with halos. Integers: the
    same on every machine, and the module stays per axis (no rows x columns table). Nodes without
    an image output (small ops, reductions' results) weigh nothing."""
    weights = [0] * len(tiles)
    for position, node in enumerate(members):
        if not graph.is_image(node.name):  # a small op or result: no tile computes it
            continue
        area = graph.size(node.name, 0) * graph.size(node.name, 1)
        per_pixel = rule(node).flops(node, graph) * prod(node.shape) / area
        rate = max(1, round(per_pixel * (2 + rule(node).backward_factor))) * graph.size(node.name, 1 - axis)
        for index, tile in enumerate(tiles):
            weights[index] += rate * tile.steps[position].out.length
    return weights


def tile_cost(row_weights: Sequence[int], col_weights: Sequence[int]) -> list[int]:
    """Per tile, row-major, the product of its row and column weights (``axis_weights``)."""
    return [row * col for row in row_weights for col in col_weights]
