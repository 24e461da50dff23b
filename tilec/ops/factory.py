"""Factories of an image's shape: ``empty`` / ``zeros`` / ``ones`` / ``full``.

A model may make a constant map of the image's size from no tensor (segmentation_models_pytorch's
timm encoders stand in for a missing stride-2 feature with ``torch.empty([N, 0, H / 2, W / 2])``).
Each tile makes its own part, of its own rows and columns, filled as the whole is; it reads nothing.
"""

from __future__ import annotations

from tilec.graph import Shapes
from tilec.ir import NodeSpec
from tilec.ops.base import Need, Op
from tilec.regions import Interval


class Factory(Op):
    """A constant map of an image's shape: it reads nothing, and a tile makes its rows and columns
    with the whole's fill, on the device of the tile's inputs (its size names the samples: a segment
    holding one stacks no tiles)."""

    saves = "nothing"

    def spreads(self, node: NodeSpec, shapes: Shapes) -> bool:
        return True

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        return []

    def batchable(self, node: NodeSpec, shapes: Shapes) -> bool:
        return False

    def emit(self, node: NodeSpec, tile) -> str:
        shape = list(node.shape)
        shape[node.spatial[0]], shape[node.spatial[1]] = tile.row.out.length, tile.col.out.length
        rest = ["xs[0].device" if arg.keyword == "device" and arg.value is not None else tile.arg(arg)
                for arg in node.args[1:]]  # on the device of the tile's inputs
        return tile.call(node, [repr(shape), *rest])
