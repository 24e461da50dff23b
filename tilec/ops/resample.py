"""Upsampling, and its index maps read off PyTorch's own kernels.

``resample_map(node, axis, in_size, out_size)`` runs the node's upsampling op on a 1-D probe
(``arange(in_size)`` in float64 along one axis, size 1 along the other) with the node's own
size and scale arguments, so the float rounding of scale factors is PyTorch's. Nearest modes
read one input index per output; bilinear reads ``low`` and ``low + 1`` (clamped) with weight
``frac`` on the upper one: ``y[o] = x[low] * (1 - frac) + x[high] * frac``. Bicubic reads four
consecutive inputs (clamped at the border) with four weights, ``y[o] = sum_k w_k[o] x[i_k[o]]``:
their four indices fall in four residues modulo 4, so probes of the inputs of one residue (ones,
and their indices) give each tap's weight and index, PyTorch's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from tilec.graph import Shapes
from tilec.ir import AxisStep, NodeSpec
from tilec.ops.base import Need, Op
from tilec.regions import Interval


@dataclass(frozen=True)
class ResampleMap:
    """Per output index ``o``: the input indices read (``low[o]`` and ``high[o]``, equal for
    nearest modes) and, for bilinear, the weight of the upper one (``frac[o]``); for bicubic, the
    index and weight of each of its four taps (``taps[k][o]``, ``weights[k][o]``; a tap of weight 0
    reads ``low[o]``)."""

    low: tuple[int, ...]
    high: tuple[int, ...]
    frac: tuple[float, ...] | None
    taps: tuple[tuple[int, ...], ...] | None = None
    weights: tuple[tuple[float, ...], ...] | None = None

    def reads(self, start: int, stop: int) -> tuple[int, int]:
        """``[lo, hi)`` of the inputs outputs ``[start, stop)`` read."""
        return min(self.low[start:stop]), max(self.high[start:stop]) + 1


def _probe_args(node: NodeSpec, axis: int, in_size: int, out_size: int) -> tuple[list, list]:
    """The node's upsampling arguments restricted to one axis (the other axis is 1 -> 1)."""
    values = [arg.value for arg in node.args[1:]]
    output_size, scales = values[0], values[-1]
    one_axis_size = None if output_size is None else [out_size if a == axis else 1 for a in range(2)]
    one_axis_scales = None if scales is None else [float(scales[axis]) if a == axis else 1.0 for a in range(2)]
    return one_axis_size, [*values[1:-1], one_axis_scales] if len(values) > 1 else [one_axis_scales]


@lru_cache(maxsize=256)
def _map(target: str, args: tuple, axis: int, in_size: int, out_size: int) -> ResampleMap:
    probe_shape = (1, 1, in_size, 1) if axis == 0 else (1, 1, 1, in_size)
    probe = torch.arange(in_size, dtype=torch.float64).reshape(probe_shape)
    op = torch.ops.aten
    for part in target.split(".")[1:]:
        op = getattr(op, part)
    size, rest = args

    def run(probe):
        return op(probe, None if size is None else list(size), *[list(v) if isinstance(v, tuple) else v for v in rest])

    values = run(probe).reshape(-1).tolist()
    if len(values) != out_size:
        raise AssertionError(f"{target} probe gave {len(values)} values, expected {out_size}")
    if "bicubic" in target:
        return _cubic(run, probe, values)
    if "bilinear" not in target:
        low = tuple(int(round(v)) for v in values)
        return ResampleMap(low, low, None)
    low = tuple(min(int(v), in_size - 1) for v in values)
    high = tuple(min(lo + 1, in_size - 1) for lo in low)
    frac = tuple(0.0 if hi == lo else v - lo for v, lo, hi in zip(values, low, high, strict=True))
    return ResampleMap(low, high, frac)


def _cubic(run, probe: torch.Tensor, values: list[float]) -> ResampleMap:
    """Bicubic's taps from probes of each residue modulo 4 of the inputs (module docstring), checked
    against ``values``, the op on the inputs' indices."""
    index = probe.reshape(-1)
    residues = torch.stack([(index % 4 == k).double() for k in range(4)])
    shape = (1, 8, *probe.shape[2:])
    out = run(torch.cat([residues, residues * index]).reshape(shape)).reshape(8, -1)
    weights, moments = out[:4].T.tolist(), out[4:].T.tolist()
    taps, kept = [], []
    for weight, moment, value in zip(weights, moments, values, strict=True):
        read = {round(m / w): w for w, m in zip(weight, moment, strict=True) if w != 0}
        if abs(sum(i * w for i, w in read.items()) - value) > 1e-9 * max(1, len(index)):
            raise AssertionError(f"bicubic taps {read} do not give the probe's value {value}")
        order = sorted(read)
        taps.append(tuple(order + [order[0]] * (4 - len(order))))
        kept.append(tuple(read[i] for i in order) + (0.0,) * (4 - len(order)))
    low = tuple(min(t) for t in taps)
    high = tuple(max(t) for t in taps)
    return ResampleMap(low, high, None, tuple(zip(*taps, strict=True)), tuple(zip(*kept, strict=True)))


def resample_map(node: NodeSpec, axis: int, in_size: int, out_size: int) -> ResampleMap:
    size, rest = _probe_args(node, axis, in_size, out_size)
    frozen = tuple(tuple(v) if isinstance(v, list) else v for v in rest)
    return _map(node.target, (None if size is None else tuple(size), frozen), axis, in_size, out_size)


class Upsample(Op):
    """Nearest, nearest-exact, bilinear and bicubic upsampling: each output reads the inputs
    PyTorch's own index map gives it (``resample_map``), local to the tile."""

    vectorised = False
    saves = "nothing"

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if shapes.spatial(shapes.sliced_inputs(node)[0]) != (2, 3) or len(node.shape) != 4:
            return "upsampling needs an NCHW input"
        return None

    def spreads(self, node: NodeSpec, shapes: Shapes) -> bool:
        """One pixel upsampled: every output is it (DeepLab's image pooling branch)."""
        source = shapes.shape(node.inputs[0])
        return len(source) == 4 and source[2] == source[3] == 1 and shapes.spatial(node.inputs[0]) == (2, 3)

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        source = node.inputs[0]
        if self.spreads(node, shapes):
            return []
        if not out.length:
            return [Need(source, Interval(0, 0), False)]
        mapping = resample_map(node, axis, shapes.size(source, axis), node.shape[2 + axis])
        return [Need(source, Interval(*mapping.reads(out.start, out.stop)), False)]

    def extras(self, node: NodeSpec, step: AxisStep, axis: int, shapes: Shapes):
        """Local ``(low, high, frac)`` index maps of upsampling over the tile's output."""
        if step.out.length == 0 or self.spreads(node, shapes):
            return None
        source = node.inputs[0]
        mapping = resample_map(node, axis, shapes.size(source, axis), node.shape[2 + axis])
        start, stop, base = step.out.start, step.out.stop, step.reads[0].read.start
        if mapping.taps is not None:
            return (tuple(tuple(i - base for i in tap[start:stop]) for tap in mapping.taps),
                    tuple(weight[start:stop] for weight in mapping.weights))
        low = tuple(i - base for i in mapping.low[start:stop])
        high = tuple(i - base for i in mapping.high[start:stop])
        return low, high, None if mapping.frac is None else mapping.frac[start:stop]

    def emit(self, node: NodeSpec, tile) -> str:
        if self.spreads(node, tile.shapes):
            rows, cols = ((0,) * step.out.length for step in (tile.row, tile.col))
            return f"gather({tile.var(node.inputs[0])}, {tile.constant(rows)}, {tile.constant(cols)})"
        source = tile.read(node.inputs[0])
        if "bicubic" in node.op:
            names = [tile.constant(v) for axis, step in enumerate((tile.row, tile.col))
                     for v in self.extras(node, step, axis, tile.shapes)]
            return f"cubic({source}, {', '.join(names)})"
        low_r, high_r, frac_r = self.extras(node, tile.row, 0, tile.shapes)
        low_c, high_c, frac_c = self.extras(node, tile.col, 1, tile.shapes)
        if frac_r is None:
            return f"gather({source}, {tile.constant(low_r)}, {tile.constant(low_c)})"
        names = [tile.constant(v) for v in (low_r, high_r, frac_r, low_c, high_c, frac_c)]
        return f"lerp({source}, {', '.join(names)})"
