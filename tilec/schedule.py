"""Schedule: the statements one tile executes, shared by codegen and the cost model.

For one shape class (a row tile and a column tile of a segment), ``schedule`` lists one ``Op``
per layer with the names the generated code uses: ``t{k}`` is the activation entering layer
``k`` (``t0`` is the tile's input slice, a view), ``t{k}p`` the same after border padding,
``i{k}`` max-pool indices, plus which ops may run in place and which names die when.
The backward function first recomputes the ops forward, keeping what the backward kernels
read, then runs the backward kernels in reverse layer order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tilec.ir import AxisStep, AxisTile, LayerSpec
from tilec.layers import SAVES, may_run_in_place, saves


@dataclass
class Op:
    """One layer of one shape class."""

    layer: LayerSpec
    position: int
    rows: AxisStep
    cols: AxisStep
    src: str
    padded: str
    dst: str
    in_place: bool
    in_place_forward: bool
    recompute: bool
    first: bool
    empty: bool = False
    autograd: bool = False
    free_forward: list[str] = field(default_factory=list)
    free_backward: list[str] = field(default_factory=list)

    @property
    def op(self) -> str:
        return self.layer.op

    @property
    def fn(self) -> str | None:
        return self.layer.fn

    @property
    def reads_output(self) -> bool:
        """Does the backward kernel of this pointwise op read its output (not its input)?"""
        return self.op == "pointwise" and saves(self.layer) == "output"

    @property
    def padding(self) -> bool:
        return not self.empty and (self.rows.pad != (0, 0) or self.cols.pad != (0, 0))


def backward_reads(op: Op) -> list[str]:
    """Names the backward kernel of ``op`` reads."""
    if op.autograd and op.layer.options.get("inplace", False):
        return [op.dst]
    if op.op == "max_pool2d":
        return [op.padded, f"i{op.position}"]
    if op.op in ("conv2d", "avg_pool2d"):
        return [op.padded]
    kind = SAVES[op.fn] if op.autograd else saves(op.layer)
    return {"input": [op.src], "output": [op.dst], "none": []}[kind]


def schedule(layers: list[LayerSpec], rows: AxisTile, cols: AxisTile, autograd: bool = False) -> list[Op]:
    """The ops of the shape class ``(rows.shape_class, cols.shape_class)``.

    ``autograd``: the ops as the model's own modules run them under autograd (a stored
    segment), where in-place modules overwrite their input and autograd saves the result.
    """
    ops: list[Op] = []
    name, fresh = "t0", False
    reads_backward: dict[str, int] = {}
    for position, layer in enumerate(layers):
        row, col = rows.steps[position], cols.steps[position]
        # An empty output: a consumer reads only border padding here; the tile makes an empty
        # tensor of the right shape instead of running the layer, and its gradient is empty.
        empty = row.out.length == 0 or col.out.length == 0
        src = name
        padded = f"{src}p" if not empty and (row.pad != (0, 0) or col.pad != (0, 0)) else src
        dst = src if layer.fn == "identity" and not empty else f"t{position + 1}"
        last = position == len(layers) - 1
        needs_output = layer.op == "max_pool2d" or (layer.op == "pointwise" and saves(layer) == "output")
        if autograd:
            runs_in_place = in_place_forward = layer.options.get("inplace", False)
        else:
            in_place_forward = may_run_in_place(layer) and fresh
            runs_in_place = in_place_forward and src not in reads_backward
        op = Op(
            layer=layer,
            position=position,
            rows=row,
            cols=col,
            src=src,
            padded=padded,
            dst=dst,
            in_place=runs_in_place,
            in_place_forward=in_place_forward,
            recompute=not last or needs_output,
            first=position == 0,
            empty=empty,
            autograd=autograd,
        )
        ops.append(op)
        for read in [] if empty else backward_reads(op):
            reads_backward.setdefault(read, position)
        fresh = fresh if layer.fn == "identity" else True
        name = dst
    _free(ops, reads_backward)
    return ops


def _free(ops: list[Op], reads_backward: dict[str, int]) -> None:
    """Attach ``del`` lists. A tensor no backward kernel reads dies after its forward consumer;
    a saved tensor dies after the last backward kernel reading it, which is the earliest layer
    reading it since backward runs in reverse (``reads_backward`` maps name -> that layer)."""
    for op in ops:
        if op.recompute:
            for name in dict.fromkeys((op.src, op.padded)):
                if name not in ("t0", op.dst) and name not in reads_backward:
                    op.free_forward.append(name)
    last = ops[-1]
    if last.recompute and last.dst not in reads_backward:
        last.free_forward.append(last.dst)
    for name, position in reads_backward.items():
        if name != "t0":
            ops[position].free_backward.append(name)
