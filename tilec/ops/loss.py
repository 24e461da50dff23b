"""Losses reduced by mean or sum over every pixel: a reduction whose partial is the loss of the
tile's owned part summed, with what the mean divides by.

``cross_entropy_loss`` and ``nll_loss_nd`` (a mean divides by the summed class weights of the
pixels not ignored: ``label_smoothing`` shares that divisor), ``binary_cross_entropy_with_logits``,
``mse_loss``, ``l1_loss``, ``smooth_l1_loss``, ``huber_loss`` (a mean divides by the element count).
Both the prediction and the target are images of one extent; a per-element weight of the image's
size is not supported.
"""

from __future__ import annotations

from math import prod

from tilec.graph import Shapes
from tilec.ir import NodeSpec
from tilec.ops.base import WHOLE_MAP, Op, const
from tilec.ops.reduce import image_dims

#: reduction argument values of aten's losses
NONE, MEAN, SUM = 0, 1, 2


class Loss(Op):
    """``reduction_arg``: the index of the reduction argument; ``weighted``: a class-weighted loss
    over class scores (``cross_entropy_loss``, ``nll_loss_nd``: target ``(N, H, W)``), else an
    element-wise one (target of the prediction's shape)."""

    saves = "inputs"

    def __init__(self, *names: str, reduction_arg: int, weighted: bool = False, **attributes):
        super().__init__(*names, **attributes)
        self.reduction_arg, self.weighted = reduction_arg, weighted

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return WHOLE_MAP

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        if const(node, self.reduction_arg) not in (MEAN, SUM) or image_dims(node, shapes) is None:
            return False
        prediction, target = node.inputs[:2]
        if not shapes.is_image(target) or any(shapes.is_image(name) for name in node.inputs[2:]):
            return False
        size = [shapes.size(prediction, axis) for axis in range(2)]
        return [shapes.size(target, axis) for axis in range(2)] == size

    def reduced(self, node: NodeSpec, shapes: Shapes) -> tuple[str, ...]:
        return tuple(node.inputs[:2])

    def partial(self, node: NodeSpec, tile) -> str:
        prediction, target = (tile.owned(name) for name in node.inputs[:2])
        if self.weighted:
            args = [tile.arg(node.args[2]), tile.arg(node.args[4])]
            smoothing = [tile.arg(node.args[5])] if node.op == "cross_entropy_loss" else []
            return f"partial_class_loss({node.target}, {prediction}, {target}, {', '.join(args + smoothing)})"
        rest = [tile.arg(a) for i, a in enumerate(node.args[2:], 2) if i != self.reduction_arg]
        return f"partial_loss({node.target}, {prediction}, {target}, {self.reduction_arg}, {', '.join(rest) or ''})"

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return (1, 1) if self.weighted else (1,)  # the summed loss (and what its mean divides by)

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        if const(node, self.reduction_arg) == SUM:
            value = f"{combined}[0]"
        elif self.weighted:
            value = f"({combined}[0] / {combined}[1])"
        else:
            value = f"({combined}[0] / {prod(view.shapes.shape(node.inputs[0]))})"
        return f"{value}.to({view.dtype(node)})"

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        return 4 * prod(shapes.shape(node.inputs[0]))
