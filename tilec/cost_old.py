"""Cost model: FLOPs, time and peak bytes of a segmented tiling of one training step.

Memory convention (``predicted_peak_bytes``): bytes the step allocates above the input, the
parameters and the final output gradient; that is the boundary activations, the output, the
segments' input gradients, the parameter gradients, each stored segment's saved activations,
and one tile's working set. The input is assumed not to require a gradient (images).

Step timeline, segments ``S0..Sm-1`` with outputs ``B0..Bm-1`` (``Bm-1`` is the output):

* forward of ``Sk``: earlier segments' kept bytes + ``Bk`` + the forward working set;
* backward of ``Sk``: earlier kept bytes + grad of ``Bk`` (or the output itself, for the last)
  + grad of ``Bk-1`` + parameter gradients + the backward working set (+ the output if k<m-1).

A tiled segment keeps only its output until its backward; a stored (untiled, autograd)
segment also keeps the activations its backward reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from tilec.ir import AxisTile, LayerSpec
from tilec.schedule import Op, schedule

ELEMENT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
INDEX_BYTES = 8
#: Convolution kernel workspace, in multiples of the padded input tile (measured on CPU oneDNN:
#: about 1x in forward, 2-3x in backward, for reorders into blocked layouts).
CONV_FORWARD_WORKSPACE = 1.0
CONV_BACKWARD_WORKSPACE = 2.5
#: Reference machine for the time estimate: sustained FLOP/s, and seconds per kernel call.
FLOP_RATE = 1e11
CALL_SECONDS = 3e-5
#: Fixed cost of a segment (autograd node, Python), so that equal plans prefer fewer segments;
#: and the rate at which a tiled segment assembles its output and sums its input gradient.
SEGMENT_SECONDS = 1e-3
COPY_RATE = 5e9


def layer_flops_per_output(layer: LayerSpec) -> int:
    """Forward FLOPs per output element (one sample, one channel)."""
    if layer.op == "conv2d":
        return 2 * layer.in_shape[1] // layer.options["groups"] * layer.rows.kernel * layer.cols.kernel
    if layer.op in ("max_pool2d", "avg_pool2d"):
        return layer.rows.kernel * layer.cols.kernel
    return 2 if layer.fn == "batch_norm" else 1


def backward_factor(layer: LayerSpec) -> int:
    """Backward FLOPs as a multiple of forward: input and weight gradients for convolutions."""
    return 2 if layer.op == "conv2d" else 1


def tiled_forward_flops(layers: list[LayerSpec], rows: tuple[AxisTile, ...], cols: tuple[AxisTile, ...]) -> int:
    """Forward FLOPs over all tiles; per-output cost is uniform, so rows and columns separate."""
    total = 0
    for position, layer in enumerate(layers):
        height = sum(tile.steps[position].out.length for tile in rows)
        width = sum(tile.steps[position].out.length for tile in cols)
        total += layer_flops_per_output(layer) * layer.out_shape[0] * layer.out_shape[1] * height * width
    return total


def untiled_forward_flops(layers: list[LayerSpec]) -> int:
    return sum(layer_flops_per_output(layer) * prod(layer.out_shape) for layer in layers)


def _sizes(op: Op, element: int) -> tuple[int, int, int]:
    """Bytes of the op's input slice, padded input and output in one tile."""
    n, c_in = op.layer.in_shape[:2]
    c_out = op.layer.out_shape[1]
    rows, cols = op.rows, op.cols
    read = n * c_in * rows.read.length * cols.read.length * element
    padded = n * c_in * (rows.read.length + sum(rows.pad)) * (cols.read.length + sum(cols.pad)) * element
    out = n * c_out * rows.out.length * cols.out.length * element
    return read, padded, out


def forward_work(ops: list[Op], element: int) -> int:
    """Peak bytes of a forward-only tile call: padded input, output, and the tensor before."""
    peak, current = 0, 0
    for op in ops:
        _, padded, out = _sizes(op, element)
        if op.fn == "identity" or op.in_place_forward:
            continue
        pad = padded if op.padding else 0
        workspace = CONV_FORWARD_WORKSPACE * padded if op.op == "conv2d" else 0
        peak = max(peak, current + pad + out + round(workspace))
        current = out
    return peak


def backward_work(ops: list[Op], element: int) -> tuple[int, int]:
    """Peak bytes of a recompute-and-backward tile call, and the bytes saved for backward."""
    live: dict[str, int] = {}
    peak = saved = 0
    for op in ops:
        _, padded, out = _sizes(op, element)
        if op.padding:
            live[op.padded] = padded
        if op.recompute and op.dst != op.src:
            if op.in_place:
                live[op.dst], live[op.src] = live.get(op.src, 0), 0
            else:
                live[op.dst] = out
            if op.op == "max_pool2d":
                live[f"i{op.position}"] = out // element * INDEX_BYTES
        workspace = CONV_FORWARD_WORKSPACE * padded if op.op == "conv2d" and op.recompute else 0
        peak = max(peak, sum(live.values()) + round(workspace))
        for name in op.free_forward:
            live.pop(name, None)
    saved = sum(live.values())
    gradient = 0
    for op in reversed(ops):
        _, padded, _ = _sizes(op, element)
        weight = prod(op.layer.tensors[0].shape) * element if op.op == "conv2d" else 0
        workspace = CONV_BACKWARD_WORKSPACE * padded if op.op == "conv2d" else 0
        peak = max(peak, sum(live.values()) + gradient + padded + weight + round(workspace))
        for name in op.free_backward:
            live.pop(name, None)
        gradient = padded
    return peak, saved


@dataclass(frozen=True)
class SegmentCost:
    """What one segment choice costs; bytes are per the module docstring's timeline."""

    forward_local: int
    backward_local: int
    kept: int
    flops: int
    flop_overhead: float
    seconds: float


def _dominant(tiles: tuple[AxisTile, ...]) -> list[AxisTile]:
    """One tile per shape class, less classes another class dominates.

    A class dominates when its tiles pad at the same layers and are at least as long at every
    layer (output, read and padded read); working bytes grow with those lengths, so the peak
    over shape classes is the peak over the dominant ones.
    """
    first = list({tile.shape_class: tile for tile in reversed(tiles)}.values())

    def key(tile: AxisTile):
        return tuple(s.pad != (0, 0) for s in tile.steps), [(s.out.length, s.read.length, sum(s.pad))
                                                            for s in tile.steps]

    keys = [key(tile) for tile in first]

    def covers(a, b) -> bool:
        pairs = zip(a[1], b[1], strict=True)
        return a[0] == b[0] and all(x >= y for pa, pb in pairs for x, y in zip(pa, pb, strict=True))

    return [tile for i, tile in enumerate(first)
            if not any(j != i and covers(keys[j], keys[i]) and (keys[j] != keys[i] or j < i)
                       for j in range(len(first)))]


def _shape_classes(rows: tuple[AxisTile, ...], cols: tuple[AxisTile, ...]):
    return [(r, c) for r in _dominant(rows) for c in _dominant(cols)]


def _unpadded(tile: AxisTile) -> AxisTile:
    """The tile as autograd runs it untiled: layers pad internally, no padded copies kept."""
    return tile.model_copy(update={"steps": tuple(s.model_copy(update={"pad": (0, 0)}) for s in tile.steps)})


def segment_cost(
    layers: list[LayerSpec],
    rows: tuple[AxisTile, ...],
    cols: tuple[AxisTile, ...],
    *,
    stored: bool,
    element: int,
    first: bool,
) -> SegmentCost:
    """Cost of running ``layers`` with the given axis tiles, tiled or stored (untiled)."""
    out_bytes = prod(layers[-1].out_shape) * element
    in_grad = 0 if first else prod(layers[0].in_shape) * element
    untiled = untiled_forward_flops(layers)
    backward = sum(backward_factor(layer) * layer_flops_per_output(layer) * prod(layer.out_shape) for layer in layers)
    if stored:
        work, saved = backward_work(schedule(layers, _unpadded(rows[0]), _unpadded(cols[0]), autograd=True), element)
        return SegmentCost(
            forward_local=saved + out_bytes,
            backward_local=out_bytes + in_grad + work,
            kept=saved + out_bytes,
            flops=untiled + backward,
            flop_overhead=0.0,
            seconds=(untiled + backward) / FLOP_RATE + 2 * len(layers) * CALL_SECONDS + SEGMENT_SECONDS,
        )
    works = [backward_work(schedule(layers, r, c), element) for r, c in _shape_classes(rows, cols)]
    tiled = tiled_forward_flops(layers, rows, cols)
    tiles = len(rows) * len(cols)
    halo = tiled / untiled
    flops = 2 * tiled + round(backward * halo)
    calls = tiles * len(layers) * 3
    forward = max(forward_work(schedule(layers, r, c), element) for r, c in _shape_classes(rows, cols))
    return SegmentCost(
        forward_local=out_bytes + forward,
        backward_local=out_bytes + in_grad + max(peak for peak, _ in works),
        kept=out_bytes,
        flops=flops,
        flop_overhead=halo - 1,
        seconds=flops / FLOP_RATE + calls * CALL_SECONDS + SEGMENT_SECONDS + (out_bytes + 2 * in_grad) / COPY_RATE,
    )


def parameter_bytes(layers: list[LayerSpec], element: int) -> int:
    return sum(prod(t.shape) * element for layer in layers for t in layer.tensors if not t.buffer)
