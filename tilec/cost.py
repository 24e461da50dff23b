"""Cost model: FLOPs, time and peak bytes of one training step of a segmented plan.

Memory convention (``predicted_peak_bytes``): bytes the step allocates above the input, the
parameters and the final output gradient, plus the kernel state a process's first step creates
and keeps (``KERNEL_STATE_BYTES`` per distinct convolution call shape; all of it is counted in
every segment's peak, as the first segment's backward, which runs last, finds it all). The input
is assumed not to need a gradient (images).

Step timeline. Segments run in order in forward, then in reverse in backward. Every segment
output (a boundary tensor) stays alive from its creation until the backward of its last reader;
the gradient of a boundary tensor exists from the backward of its last reader until the backward
of its producer. While segment ``k`` runs:

* forward: the kept bytes of earlier segments + ``forward_local`` (its outputs at full size and
  its working set);
* backward: the kept bytes of earlier segments + ``backward_local``: the gradients of the
  tensors crossing its stop cut and of its inputs, the model outputs produced from its first node
  on (the caller holds them), the gradients of its own parameters and of those of later segments
  (created by their backward, which ran first; gradients that exist before the step, as with
  ``zero_grad(set_to_none=False)``, are not the step's), and its working set.

``kept``: a tiled segment keeps its outputs until its backward; a stored segment (untiled,
through autograd) also keeps what autograd saves for its backward, under autocast the
lower-precision copies of its parameters too (``Estimator.casts``). The step's forward is assumed
to run under autocast and its backward outside it, as PyTorch's mixed-precision recipe does.

Working sets are simulated op by op on the tensors alive (``_Forward``, ``Estimator._program``).
A tiled segment's forward runs each tile without autograd, on a channels-last copy of its slice
of each sliced input: a fresh tensor per op (views, identity copies and the activations a tile
computes in place, ``tilec.ops.overwrites_input``, are free), a padded copy where a border tile
pads asymmetrically, intermediates freed after their last use, except what the tile keeps in
its arena (the generated module's ``_Arena``): its input copies, padded copies, max-pooling
results and indices and float32 convolution results live until the tile ends, and the weights
of those convolutions in oneDNN's blocked layout until the forward pass ends. Its backward
re-runs each tile under autograd, each op keeping what its backward reads (``SAVES_*``), then
back-propagates the tile: gradients of the tile's tensors (an activation that back-propagates
in place, ``tilec.ops.overwrites_gradient``, hands on its output's), and of its slice of each
sliced input. A stored segment runs the same ops untiled. Convolutions take a kernel
workspace on top (``CONV_*_WORKSPACE``). A tile tensor's bytes are its shape with the image
axes replaced by the tile's lengths, times the element size. Bytes are linear in a handful of
lengths per axis, so every distinct (row tile, column tile) pair is evaluated at once.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from math import prod

import numpy as np

from tilec.ir import INPUT, AxisTile, NodeSpec
from tilec.ops import Context, activations_in_place, const, window_args
from tilec.planner import Boundaries, model_outputs
from tilec.trace import VIEWS as ALIASING

ELEMENT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
INDEX_BYTES = 8
#: Convolution kernel workspace of stored segments (NCHW), in multiples of the padded input
#: (measured on CPU oneDNN: about 1x in forward, 2-3x in backward, reorders into blocked layouts).
CONV_FORWARD_WORKSPACE = 1.0
CONV_BACKWARD_WORKSPACE = 2.5
#: Tiles compute channels-last, which oneDNN convolves without reordering the activations, but
#: every call copies the weight: into a blocked layout, and first into channels-last unless the
#: kernel is 1x1. Measured on CPU: 1x (1x1) or 2x the weight's bytes in forward, one more in
#: backward (besides the weight gradient).
WEIGHT_BACKWARD_EXTRA_COPIES = 1.0
#: A tile convolution in the arena (its channels-last weight copy there) whose weight gradient
#: oneDNN computes: the backward's blocked copies of the weight and of its gradient besides
#: (measured on CPU, 3x3 stride 2 and 1x1, 512-1024 channels: 1.96-1.99x the weight's bytes).
ARENA_WEIGHT_BACKWARD_COPIES = 2.0
#: One whose weight gradient is matrix products: the input gradient's blocked weight copy
#: besides (3x3, 512-1024 channels, 11-14² tiles: 2.03-2.10x with the channels-last copy).
ARENA_GEMM_WEIGHT_BACKWARD_COPIES = 1.0
#: From this many input channels, a tile convolution with stride 1, no groups and a kernel
#: larger than 1x1 gets its weight gradient from the generated module's matrix products
#: (``_weight_grad``), unless the graph says otherwise: a budget search races the two on its
#: device (``tilec.clock.gemm_min_channels``; ``None``, never). This is the reference, from a
#: 2-core AVX2 CPU, where oneDNN's channels-last weight gradient took 1.5-3x as long (as fast or
#: faster with fewer channels or a 1x1 kernel); on an AVX-512 one it took half as long. That
#: backward takes the output gradient padded to the input's size and one weight-sized buffer of
#: taps, instead of oneDNN's weight copies (``python benchmarks/workspace.py``, layout "tile").
GEMM_MIN_CHANNELS = 32
#: Ops whose channels-last backward takes a temporary the size of their input (measured on CPU:
#: eval-mode batch_norm's takes 2x its input channels-last, 1x in NCHW).
CHANNELS_LAST_BACKWARD_COPY = frozenset({"batch_norm", "_native_batch_norm_legit_no_training"})
#: Fixed cost of a segment (autograd node, Python), so that equal plans prefer fewer segments.
SEGMENT_SECONDS = 1e-3
#: Bytes a process keeps from then on for each convolution kernel it runs for the first time: on
#: CPU, oneDNN's primitive cache holds one compiled kernel per pass (forward, input gradient,
#: weight gradient unless ``_weight_grad``'s matrix products compute it) and call shape, and a
#: tile's convolution runs one shape per distinct tile class. Measured per machine for a budget
#: search (``tilec.calibrate.kernel_state``; 0 on CUDA, whose kernels keep host memory); this is
#: the measurement on a 2-core AVX-512 CPU, float32 (70-95 KiB from 3 to 1024 channels, 1x1 and
#: 3x3; DarkNet19's 5% plan at 2048² of before one interior tile length: 417 kernels, 30 MiB).
KERNEL_STATE_BYTES = 84 << 10

#: Ops whose result aliases an input (no bytes of their own): views and identity copies.
VIEWS = ALIASING | {"clone", "contiguous", "detach", "lift_fresh_copy", "dropout", "feature_dropout",
                    "alpha_dropout"}
#: Ops whose backward hands its output gradient (or views of it) to its inputs, allocating nothing.
PASS_THROUGH = VIEWS | {"add", "cat", "pad", "constant_pad_nd"}
#: What autograd keeps for an op's backward; any other op keeps its first input.
SAVES_NOTHING = PASS_THROUGH | {"sub", "rsub", "neg", "mean", "sum", "upsample_nearest2d",
                                "_upsample_nearest_exact2d", "upsample_bilinear2d"}
SAVES_OUTPUT = frozenset({"relu", "sigmoid", "tanh", "hardtanh", "relu6", "exp", "sqrt", "rsqrt", "softmax",
                          "_softmax", "log_softmax"})
SAVES_INPUTS = frozenset({"mul", "div", "maximum", "minimum"})
CONVS = frozenset({"conv2d", "conv_transpose2d"})
#: Ops whose parameters autocast casts to its lower precision when they compute in it.
CASTS_PARAMETERS = CONVS | {"linear"}
#: Ops reading a window of their input: their input gradient covers the padded read.
WINDOWS = CONVS | {"max_pool2d", "avg_pool2d"}
#: Ops a border tile feeds a padded copy of its input (``tilec.codegen``): asymmetric padding for
#: convolution and max-pooling (symmetric padding is passed natively), any padding for avg-pooling.
PADDED_COPY = frozenset({"conv2d", "max_pool2d", "avg_pool2d"})


@dataclass(frozen=True)
class Speed:
    """The time estimate's rates: FLOP/s of the step's kernels, seconds per op call per tile
    (Python, autograd, kernel launch), and bytes/s of copies (a tiled segment assembling its
    outputs and input gradients, a tile's weight copies). A segment takes ``SEGMENT_SECONDS`` +
    FLOPs / ``flop_rate`` + calls * ``call_seconds`` + bytes copied / ``copy_rate``."""

    flop_rate: float
    call_seconds: float
    copy_rate: float

    def seconds(self, flops: float, calls: int, copied: float) -> float:
        return SEGMENT_SECONDS + flops / self.flop_rate + calls * self.call_seconds + copied / self.copy_rate


#: The rates of a graph not timed on its device (``tilec.clock``): a 2-core x86 CPU in float32.
REFERENCE_SPEED = Speed(flop_rate=1e11, call_seconds=3e-5, copy_rate=5e9)


@dataclass(frozen=True)
class SegmentCost:
    """What one segment choice costs; bytes are per the module docstring's timeline; ``calls``
    and ``copied`` bytes as ``Speed`` counts them."""

    forward_local: int
    backward_local: int
    kept: int
    flops: int
    flop_overhead: float
    calls: int
    copied: int
    seconds: float
    #: Bytes of kernel state its convolutions create and the process keeps (KERNEL_STATE_BYTES).
    kernels: int = 0
    #: Per sliced input whose gradient the tiles may roll (``Estimator.rollable``), its name and
    #: the bytes ``backward_local`` holds less if they do: its full gradient less the band.
    rolls: tuple[tuple[str, int], ...] = ()

    def rolled(self, made: frozenset[str]) -> frozenset[str]:
        """The inputs the tiles roll, of those tiled segments made (``Estimator.made_tiled``)."""
        return frozenset(name for name, _ in self.rolls if name in made)


def flops_per_output(node: NodeSpec, shapes: dict[str, tuple[int, ...]], input_numel: int) -> float:
    """Forward FLOPs per output element of ``node``."""
    if node.op == "conv2d":
        weight = shapes[node.args[1].value]
        return 2 * weight[1] * weight[2] * weight[3]
    if node.op == "conv_transpose2d":  # every input element meets Cout/groups * kh * kw weights
        weight = shapes[node.args[1].value]
        return 2 * weight[1] * weight[2] * weight[3] * input_numel / prod(node.shape)
    if node.op == "linear":
        return 2 * shapes[node.args[1].value][1]
    if node.op in ("layer_norm", "batch_norm", "_native_batch_norm_legit_no_training", "group_norm"):
        return 5
    if node.op in ("max_pool2d", "avg_pool2d"):
        return prod(window_args(node).kernel)
    return 1


def backward_factor(node: NodeSpec) -> int:
    """Backward FLOPs as a multiple of forward: input and weight gradients for convolutions."""
    return 2 if node.op in CONVS or node.op == "linear" else 1


def gemm_weight_grad(node: NodeSpec, shapes: dict[str, tuple[int, ...]], min_channels: int | None) -> bool:
    """Whether tiles compute ``node``'s weight gradient as matrix products, from ``min_channels``
    input channels (``None``: never; GEMM_MIN_CHANNELS); the generated module decides again at
    run time, from the dtype, device and layout."""
    if node.op != "conv2d" or min_channels is None:
        return False
    weight = shapes[node.args[1].value]
    return (const(node, 6, 1) == 1 and window_args(node, weight).stride == (1, 1) and prod(weight[2:]) > 1
            and weight[1] >= min_channels)


def axis_weights(context: Context, members: Sequence[NodeSpec], tiles: Sequence[AxisTile], axis: int) -> list[int]:
    """Per tile along ``axis`` of a tiled segment, the FLOPs of one step (forward, the autograd
    re-run and backward) of a full band of tiles: per node, its FLOPs per output pixel (rounded)
    times the tile's output length on ``axis`` times the node's full size on the other axis.

    Tile ``(i, j)`` is weighted ``rows[i] * cols[j]`` (``tile_cost``): exact when every node's
    tile lengths are the same share of its size, a close estimate with halos. Integers: the
    same on every machine, and the module stays per axis (no rows x columns table)."""
    weights = [0] * len(tiles)
    for position, node in enumerate(members):
        area = context.size(node.name, 0) * context.size(node.name, 1)
        source = prod(context.shape(node.inputs[0])) if node.inputs else 0
        per_pixel = flops_per_output(node, context.tensor_shapes, source) * prod(node.shape) / area
        rate = max(1, round(per_pixel * (2 + backward_factor(node)))) * context.size(node.name, 1 - axis)
        for index, tile in enumerate(tiles):
            weights[index] += rate * tile.steps[position].out.length
    return weights


def tile_cost(row_weights: Sequence[int], col_weights: Sequence[int]) -> list[int]:
    """Per tile, row-major, the product of its row and column weights (``axis_weights``)."""
    return [row * col for row in row_weights for col in col_weights]


class AxisArrays:
    """One axis of the tiles of a run of nodes, as ``[tile, node]`` arrays of lengths.

    Columns are node positions minus ``offset``. ``out``: output length; ``padded``: length of a
    window op's input read plus its border padding; ``copied`` / ``copies``:
    length of its padded copy and whether the tile makes one (1 or 0, see ``PADDED_COPY``). ``reads[name]``: per
    input of the node, ``(input, start, stop)`` of the interval read, over ``tiles`` of the arrays
    (``window`` selects some tiles without copying). ``sums``: ``out`` summed over the tiles.
    """

    def __init__(self, nodes: dict[str, NodeSpec], position: dict[str, int], offset: int, count: int, parts: int,
                 steps: Iterable[tuple[str, np.ndarray, np.ndarray, list[tuple]]]):
        """``steps``: per node, ``(name, out start, out stop, reads)``, each read ``(input, start,
        stop, pad before, pad after)``; arrays over the tiles."""
        self.parts, self.offset, self.tiles = parts, offset, slice(0, parts)
        self.out = np.zeros((parts, count), dtype=np.int64)
        self.padded = np.zeros((parts, count), dtype=np.int64)
        self.copied = np.zeros((parts, count), dtype=np.int64)
        self.copies = np.zeros((parts, count), dtype=np.int64)
        self.reads: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
        for name, start, stop, reads in steps:
            column = position[name] - offset
            self.out[:, column] = stop - start
            self.reads[name] = [(source, read_start, read_stop) for source, read_start, read_stop, _, _ in reads]
            op = nodes[name].op
            if op not in WINDOWS:
                continue
            _, read_start, read_stop, before, after = reads[0]
            self.padded[:, column] = read_stop - read_start + before + after
            if op in PADDED_COPY:
                copies = before + after > 0 if op == "avg_pool2d" else before != after
                self.copies[:, column] = copies
                self.copied[:, column] = read_stop - read_start + np.where(copies, before + after, 0)
        self.sums = self.out.sum(axis=0)

    def window(self, start: int, stop: int) -> AxisArrays:
        """Tiles ``[start, stop)`` only (several grids computed together, then taken apart)."""
        part = copy.copy(self)
        part.parts, part.tiles = stop - start, slice(start, stop)
        part.out, part.padded, part.copied, part.copies = (
            a[start:stop] for a in (self.out, self.padded, self.copied, self.copies))
        part.sums = part.out.sum(axis=0)
        return part

    @classmethod
    def of_tiles(cls, bounds: Boundaries, first: int, stop: int, tiles: Sequence[AxisTile]) -> AxisArrays:
        """The arrays of a planned segment's axis tiles."""
        def column(values) -> np.ndarray:
            return np.array(list(values), dtype=np.int64)

        steps = []
        for index, name in enumerate(bounds.order[first:stop]):
            at = [tile.steps[index] for tile in tiles]
            reads = [(read.input, column(s.reads[k].read.start for s in at), column(s.reads[k].read.stop for s in at),
                      column(s.reads[k].pad[0] for s in at), column(s.reads[k].pad[1] for s in at))
                     for k, read in enumerate(at[0].reads)]
            steps.append((name, column(s.out.start for s in at), column(s.out.stop for s in at), reads))
        return cls(bounds.context.nodes, bounds.position, first, stop - first, len(tiles), steps)


@dataclass(frozen=True)
class _Trace:
    """Bytes alive at each allocation of one simulated run, linear in the quantities' bytes.

    The run is a sequence of changes (quantity ``change_quantity`` comes alive or dies, by
    ``change_sign``); event ``e`` happens after the first ``events[e]`` changes, with transient
    extras (``transient_*``: event, quantity, multiple) and a constant (weight gradients).
    """

    change_quantity: np.ndarray
    change_sign: np.ndarray
    events: np.ndarray
    transient_event: np.ndarray
    transient_quantity: np.ndarray
    transient_multiple: np.ndarray
    constants: np.ndarray

    def levels(self, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bytes alive after each change (0 before the first) and at each event, per row of
        ``sizes`` (``[rows, quantities]`` bytes): ``[rows, changes + 1]`` and ``[rows, events]``."""
        alive = np.zeros((len(sizes), len(self.change_quantity) + 1))
        np.cumsum(sizes[:, self.change_quantity] * self.change_sign, axis=1, out=alive[:, 1:])
        at = alive[:, self.events] + self.constants
        np.add.at(at, (slice(None), self.transient_event), sizes[:, self.transient_quantity] * self.transient_multiple)
        return alive, at

    def peak(self, sizes: np.ndarray) -> int:
        """The largest event over the rows of ``sizes``; 0 without events."""
        return round(float(self.levels(sizes)[1].max())) if len(self.events) else 0


class _Run:
    """Storages alive during one simulated run; a storage dies when its last holder lets go.

    ``mark()`` records where the run is (after a node); ``trace(mark)`` gives the events up to
    there, and ``fork(mark)`` a run that goes on from there another way.
    """

    def __init__(self):
        self.holders: dict[int, int] = {}
        self.pinned: set[int] = set()
        self.quantity: list[int] = []
        self.changes: list[tuple[int, int]] = []
        self.events: list[int] = []
        self.transients: list[tuple[int, int, float]] = []
        self.constants: list[float] = []

    def new(self, quantity: int, pinned: bool = False) -> int:
        """A storage of ``quantity``; a ``pinned`` one stays alive to the end of the run (a tile's
        arena tensors) whoever lets go of it."""
        self.quantity.append(quantity)
        self.holders[len(self.quantity) - 1] = 1
        self.changes.append((quantity, 1))
        if pinned:
            self.pinned.add(len(self.quantity) - 1)
        return len(self.quantity) - 1

    def hold(self, storage: int | None) -> None:
        if storage is not None:
            self.holders[storage] += 1

    def drop(self, storage: int | None) -> None:
        if storage is None:
            return
        self.holders[storage] -= 1
        if not self.holders[storage]:
            del self.holders[storage]
            if storage not in self.pinned:
                self.changes.append((self.quantity[storage], -1))

    def event(self, transient: dict[int, float] | None = None, constant: float = 0.0) -> None:
        if transient:
            self.transients.extend((len(self.events), quantity, multiple) for quantity, multiple in transient.items())
        self.events.append(len(self.changes))
        self.constants.append(constant)

    def mark(self, snapshot: bool) -> tuple:
        return len(self.changes), len(self.events), len(self.transients), dict(self.holders) if snapshot else None

    def trace(self, mark: tuple | None = None) -> _Trace:
        changes, events, transients, _ = mark or self.mark(False)
        change = np.array(self.changes[:changes], dtype=np.int64).reshape(-1, 2)
        transient = np.array(self.transients[:transients], dtype=float).reshape(-1, 3)
        return _Trace(change[:, 0], change[:, 1], np.array(self.events[:events], dtype=np.int64),
                      transient[:, 0].astype(np.int64), transient[:, 1].astype(np.int64), transient[:, 2],
                      np.array(self.constants[:events], dtype=float))

    def fork(self, mark: tuple, events: bool) -> _Run:
        """A run continuing from ``mark`` (a snapshot mark), with or without the events so far."""
        run = _Run()
        changes, count, transients, holders = mark
        run.holders, run.quantity, run.changes = dict(holders), list(self.quantity), self.changes[:changes]
        run.pinned = set(self.pinned)
        if events:
            run.events, run.constants = self.events[:count], self.constants[:count]
            run.transients = self.transients[:transients]
        return run


#: Kinds of node quantities; quantity ``slices + KINDS * (position - first) + kind`` (see ``_Program``).
OUT, PADDED, COPY, INDEX = range(4)
KINDS = 4


@dataclass(frozen=True)
class _Program:
    """The simulated working set of one segment ``[first, stop)``, in a few quantities.

    Quantities: first one per sliced input of the forward run (``slices``: the input's name and
    the segment's nodes reading it), the tile's slice of it (its channels-last copy, and the
    gradient of the slice); then ``KINDS`` per node: its result (``OUT``), a window op's padded
    input (``PADDED``), a border tile's padded copy of it (``COPY``) and max-pool indices
    (``INDEX``). ``forward``: a tiled segment's forward (a stored one's comes from
    ``Estimator.stored_forward``).
    """

    first: int
    stop: int
    slices: tuple[tuple[str, tuple[str, ...]], ...]
    forward: _Trace | None
    backward: _Trace


class _Forward:
    """The forward of nodes ``[first, end)``, simulated once for every segment starting at ``first``.

    A shorter segment's forward is a prefix of it: a node read after the segment is its output
    and stays alive to its end, as it does here past that point. ``marks[k]``: after node
    ``first + k`` (with the storages alive, when ``autograd``).
    """

    def __init__(self, estimator: Estimator, first: int, end: int, tiled: bool, autograd: bool):
        self.run = _Run()
        self.value: dict[int, int | None] = {}
        self.saved: dict[int, list[int | None]] = {}
        self.marks = []
        e, run = estimator, self.run
        self.slices = tuple(e.bounds.position[i.name] for i in e.bounds.inputs(first, end) if i.sliced) if tiled else ()
        base = len(self.slices) - KINDS * first
        last_reader = {}
        for quantity, source in enumerate(self.slices):  # each tile's channels-last copy of its slice
            self.value[source] = run.new(quantity, pinned=True)
            last_reader[source] = max(p for p in range(first, end) if source in e.inputs[p])
        for position in range(first, end):
            op, inputs = e.op[position], e.inputs[position]
            in_place = tiled and e.overwrites[position] and inputs[0] >= first
            if op in VIEWS or in_place:
                self.value[position] = self.value.get(inputs[0]) if inputs else None
                run.hold(self.value[position])
                if in_place and autograd and e.grad[position]:
                    self.saved[position] = self._saves(op, position, inputs, None, None, base)
            else:
                copied = run.new(base + KINDS * position + COPY, pinned=True) if tiled and op in PADDED_COPY else None
                self.value[position] = run.new(base + KINDS * position + OUT, pinned=tiled and e.in_arena[position])
                indices = run.new(base + KINDS * position + INDEX, pinned=True) \
                    if tiled and op == "max_pool2d" else None
                if op not in CONVS:
                    run.event()
                elif tiled:
                    workspace = e.tile_workspace[position][0]
                    run.event({base + KINDS * position + PADDED: workspace} if workspace else None,
                              0 if e.packed[position] and not autograd else e.weight_copies[position])
                else:
                    run.event({base + KINDS * position + PADDED: e.stored_workspace[position][0]})
                if autograd and e.grad[position]:
                    self.saved[position] = self._saves(op, position, inputs, copied, indices, base)
                run.drop(copied)
                run.drop(indices)
            for dying in e.dies_at[position]:
                if dying >= first:
                    run.drop(self.value[dying])
            for source in self.slices:
                if last_reader[source] == position:
                    run.drop(self.value[source])
            self.marks.append(run.mark(autograd))

    def _saves(self, op: str, position: int, inputs: tuple[int, ...], copied: int | None, indices: int | None,
               base: int) -> list:
        """Hold and return the storages autograd keeps for the node's backward (``None``: a tensor
        of another segment); ``copied`` and ``indices``: a tile's padded copy of the op's input
        and its max-pool indices (in the tile's arena, alive anyway). The op keeps its input too
        (border tiles keep only the copy, but the input is nearly always kept by another op or
        in the arena)."""
        if op in SAVES_NOTHING:
            return []
        if op in SAVES_OUTPUT:
            kept = [self.value[position]]
        elif op in SAVES_INPUTS:
            kept = [self.value.get(i) for i in inputs]
        else:
            kept = [self.value.get(inputs[0]) if inputs else None]
        kept += [storage for storage in (copied, indices) if storage is not None]
        for storage in kept:
            self.run.hold(storage)
        if op == "max_pool2d" and indices is None:  # a stored segment's: made for the backward
            kept.append(self.run.new(base + KINDS * position + INDEX))
        return kept


class Estimator:
    """Costs of segment choices for one traced graph (see the module docstring)."""

    def __init__(self, bounds: Boundaries, dtype: str):
        self.bounds = bounds
        self.element = ELEMENT_BYTES[dtype]
        self.speed: Speed = bounds.graph.graph.get("speed", REFERENCE_SPEED)
        context = bounds.context
        shapes = context.tensor_shapes
        parameters = {t.name for t in bounds.graph.graph["tensors"] if not t.buffer}
        order = [context.nodes[name] for name in bounds.order]
        #: Per node, the element bytes it computes in: ``dtype``, or autocast's (``NodeSpec.autocast_dtype``);
        #: parameters, their gradients and the model input stay in ``dtype``.
        self.computes = [ELEMENT_BYTES[n.autocast_dtype or dtype] for n in order]
        position = bounds.position
        # Per node position: op, input positions (-1: the model input), whether it needs a gradient
        # (the last entry, -1, is the model input's), bytes of its parameters, where it dies.
        self.op = [node.op for node in order]
        self.inputs = [tuple(position[i] for i in node.inputs) for node in order]
        self.weights = [self.element * sum(prod(shapes[a.value]) for a in node.args
                                           if a.kind == "tensor" and a.value in parameters) for node in order]
        #: Per node, whether tiles write its result into their arena (the generated module's
        #: ``_Arena``, on CPU): max-pooling, and a convolution computed in float32 (``_convolve``).
        self.in_arena = [n.op == "max_pool2d" or (n.op == "conv2d" and size == 4)
                         for n, size in zip(order, self.computes, strict=True)]
        #: Per node, the bytes of the weight copies one tile's call makes in forward and in backward
        #: (convolutions; see WEIGHT_BACKWARD_EXTRA_COPIES); in the arena, one channels-last copy
        #: (none of a 1x1 weight, channels-last already).
        spread = [prod(shapes[n.args[1].value][2:]) > 1 if n.op in CONVS else False for n in order]
        self.weight_copies = [w * size // self.element * (k if arena else 1 + k) if n.op in CONVS else 0
                              for w, n, size, arena, k in zip(self.weights, order, self.computes, self.in_arena,
                                                              spread, strict=True)]
        #: From how many input channels tiles compute a weight gradient as matrix products (measured
        #: on the device, else GEMM_MIN_CHANNELS); per node, whether they do, and then its output
        #: channels per input channel.
        self.gemm_min_channels: int | None = bounds.graph.graph.get("gemm_min_channels", GEMM_MIN_CHANNELS)
        self.gemm = [size in (4, 8) and gemm_weight_grad(n, shapes, self.gemm_min_channels)
                     for n, size in zip(order, self.computes, strict=True)]
        self.channel_ratio = [shapes[n.args[1].value][0] / shapes[n.args[1].value][1] if gemm else 0.0
                              for n, gemm in zip(order, self.gemm, strict=True)]
        #: Per node, a convolution's workspace in multiples of its padded input: in a tile (forward,
        #: backward), in a stored segment (forward, backward). Measured (``tilec.calibrate``), else
        #: none in tiles and CONV_*_WORKSPACE in stored segments.
        calibrated = bounds.graph.graph.get("conv_workspace")
        taps = [prod(shapes[n.args[1].value][2:]) if n.op == "conv2d" else 0 for n in order]
        fitted = ((0.0, 0.0), (CONV_FORWARD_WORKSPACE, CONV_BACKWARD_WORKSPACE))
        workspaces = [tuple((forward * t, backward * t) for forward, backward in calibrated)
                      if calibrated and t > 1 else fitted for t in taps]
        self.tile_workspace = [tile for tile, _ in workspaces]
        self.stored_workspace = [stored for _, stored in workspaces]
        self.backward_weight_copies = [_backward_weight_copies(c, w, gemm, arena) if n.op in CONVS else 0
                                       for c, w, n, gemm, arena in zip(self.weight_copies, self.weights, order,
                                                                       self.gemm, self.in_arena, strict=True)]
        #: Per node, the bytes of autocast's lower-precision copies of its parameters. A stored
        #: segment keeps them (autocast caches them through the forward, autograd saves them for the
        #: backward); a tile's call casts its own (the generated module turns the cache off there),
        #: one of ``weight_copies``.
        self.casts = [w * size // self.element if n.op in CASTS_PARAMETERS and size < self.element else 0
                      for w, n, size in zip(self.weights, order, self.computes, strict=True)]
        self.casts_after = _suffix_sums(self.casts)
        #: Per node, the bytes of its weight a tiled forward pass keeps in oneDNN's blocked layout
        #: from its first tile to its end (``_Arena.packed``: convolutions in the arena, which then
        #: copy no weight there), and their sums from each position on.
        self.packed = [w if arena and n.op in CONVS else 0 for w, n, arena in zip(self.weights, order, self.in_arena,
                                                                                   strict=True)]
        self.packed_after = _suffix_sums(self.packed)
        #: Per cut, the bytes of the parameters read by the nodes from there on (their gradients).
        self.later_weights = _suffix_sums(self.weights)
        self.grad = [False] * (len(order) + 1)
        for p in range(len(order)):
            self.grad[p] = self.weights[p] > 0 or any(self.grad[i] for i in self.inputs[p])
        self.dies_at: list[list[int]] = [[] for _ in order]
        for p, name in enumerate(bounds.order):
            if bounds.last_use[name] < len(order):
                self.dies_at[max(bounds.last_use[name], p)].append(p)
        self.full = {INPUT: prod(context.shape(INPUT)) * self.element,
                     **{n.name: prod(context.shape(n.name)) * size
                        for n, size in zip(order, self.computes, strict=True)}}
        self.outputs = [name for name in dict.fromkeys(model_outputs(bounds.graph)) if name != INPUT]
        #: Per node, whether a tile computes it in place on its first input when that input's
        #: producer is in the same segment, and the position of its one reader if it also
        #: back-propagates in place when that reader is in the segment (else ``None``):
        #: ``tilec.ops.activations_in_place``.
        in_place = activations_in_place(order, self.outputs)
        self.overwrites = [n.name in in_place for n in order]
        self.gradient_reader = [position[in_place[n.name]] if in_place.get(n.name) else None for n in order]
        rates = [flops_per_output(n, shapes, prod(context.shape(n.inputs[0])) if n.inputs else 0) for n in order]
        self.flops = np.array([rate * prod(n.shape) for rate, n in zip(rates, order, strict=True)])
        self.backward_flops = np.array([backward_factor(n) for n in order]) * self.flops
        areas = [self._area(name) for name in bounds.order]
        #: Forward FLOPs per output pixel (row x column) of each node.
        self.pixel_flops = self.flops / np.array(areas)
        # Bytes of each node quantity (OUT, PADDED, COPY, INDEX), in all and per tile pixel.
        source = [n.inputs[0] if n.op in WINDOWS else n.name for n in order]
        self.scale_full = np.array([[self.full[n.name], self.full[s], self.full[s],
                                     prod(context.shape(n.name)) * INDEX_BYTES]
                                    for n, s in zip(order, source, strict=True)])
        self.scale_pixel = self.scale_full / np.array([[a, self._area(s), self._area(s), a]
                                                       for a, s in zip(areas, source, strict=True)])
        #: Bytes kept per new convolution call shape (KERNEL_STATE_BYTES, or measured), and the
        #: convolutions' positions.
        self.kernel_state = bounds.graph.graph.get("kernel_state", KERNEL_STATE_BYTES)
        self.convolutions = [p for p, op in enumerate(self.op) if op in CONVS]
        #: Per convolution position, what its kernels depend on besides the tile's lengths
        #: (convolutions alike, as in a ResNet's repeated blocks, share them), and how many passes
        #: in a tile and stored: forward, input gradient (if its input needs one), weight gradient.
        self.kernel_key = {p: _kernel_key(order[p], self.computes[p], context) for p in self.convolutions}
        input_grad = {p: int(self.grad[self.inputs[p][0]]) for p in self.convolutions}
        self.tile_passes = {p: 1 + input_grad[p] + (not self.gemm[p]) for p in self.convolutions}
        self.stored_passes = {p: 2 + input_grad[p] for p in self.convolutions}
        self.forward = cache(self._forward)
        self.program = cache(self._program)
        self.stored = cache(self._stored)
        self.stored_forward = cache(self._stored_forward)
        self.gradients = cache(self._gradients)
        self.boundary = cache(self._boundary)
        self.rollable = cache(self._rollable)

    def segment(self, first: int, stop: int, rows: Sequence[AxisTile], cols: Sequence[AxisTile],
                stored: bool) -> SegmentCost:
        """Cost of nodes ``[first, stop)``, stored, or tiled with the given axis tiles."""
        if stored:
            return self.stored(first, stop)
        return self.tiled(first, stop, AxisArrays.of_tiles(self.bounds, first, stop, rows),
                          AxisArrays.of_tiles(self.bounds, first, stop, cols))

    def _stored(self, first: int, stop: int) -> SegmentCost:
        forward, kept = self.stored_forward(first)
        backward = self.program(first, stop, False).backward.peak(self.scale_full[first:stop].reshape(1, -1))
        casts = self.cast_bytes(first, stop)
        flops = float(self.flops[first:stop].sum() + self.backward_flops[first:stop].sum())
        calls = 2 * (stop - first)
        return SegmentCost(
            forward_local=forward[stop - first - 1] + casts,
            backward_local=self.gradients(first, stop) + self.later_weights[first] + backward + casts,
            kept=kept[stop - first - 1] + casts,
            flops=round(flops),
            flop_overhead=0.0,
            calls=calls,
            copied=0,
            seconds=self.speed.seconds(flops, calls, 0),
            kernels=self.kernel_bytes((p, self.stored_passes[p], None) for p in self.convolutions if first <= p < stop),
        )

    def _stored_forward(self, first: int) -> tuple[list[int], list[int]]:
        """Per stop, the forward peak and the kept bytes of the stored segment ``[first, stop)``."""
        ahead = self.forward(first, False, True)
        alive, at = (level[0] for level in ahead.run.trace().levels(self.scale_full[first:].reshape(1, -1)))
        peaks = np.maximum.accumulate(np.concatenate([[0.0], at]))
        return ([round(float(peaks[events])) for _, events, _, _ in ahead.marks],
                [round(float(alive[changes])) for changes, _, _, _ in ahead.marks])

    def tiled(self, first: int, stop: int, rows: AxisArrays, cols: AxisArrays) -> SegmentCost:
        """Cost of nodes ``[first, stop)`` tiled; ``rows`` and ``cols`` cover at least those nodes."""
        program = self.program(first, stop, True)
        sizes = self._pair_bytes(program, rows, cols)
        outputs, in_grad, fixed = self.boundary(first, stop)
        tiled = float((self.pixel_flops[first:stop] * rows.sums[first - rows.offset:stop - rows.offset]
                       * cols.sums[first - cols.offset:stop - cols.offset]).sum())
        untiled = float(self.flops[first:stop].sum())
        halo = tiled / untiled if untiled else 1.0
        flops = 2 * tiled + float(self.backward_flops[first:stop].sum()) * halo
        calls = rows.parts * cols.parts * (stop - first) * 3
        # every tile copies its convolutions' weights: forward (once where packed), autograd re-run, backward
        packed = self.packed_bytes(first, stop)
        copied_weights = packed + rows.parts * cols.parts * sum(
            (1 if self.packed[p] else 2) * self.weight_copies[p] + self.backward_weight_copies[p]
            for p in range(first, stop))
        copied = outputs + 2 * in_grad + copied_weights
        rollable = self.rollable(first)
        bands = [(name, _band(rows, name, readers)) for name, readers in program.slices if name in rollable]
        rolls = tuple((name, self.full[name] - self.full[name] * band // self.bounds.context.size(name, 0))
                      for name, band in bands if band is not None)
        return SegmentCost(
            forward_local=outputs + packed + program.forward.peak(sizes),
            backward_local=fixed + program.backward.peak(sizes),
            kept=outputs,
            flops=round(flops),
            flop_overhead=halo - 1,
            calls=calls,
            copied=copied,
            seconds=self.speed.seconds(flops, calls, copied),
            kernels=self.kernel_bytes((p, self.tile_passes[p], (row, col)) for p in self.convolutions
                                      if first <= p < stop for row in _shapes(rows, p) for col in _shapes(cols, p)),
            rolls=rolls,
        )

    def _rollable(self, cut: int) -> frozenset[str]:
        """The tensors whose gradient the tiled backward of a segment starting at ``cut`` may roll
        into the tensor's own storage, band by band (the generated module's ``_Rolled``), if a tiled
        segment made it (``made_tiled``): those ``Boundaries.may_roll`` names that need one; none
        where ranks share the tiles (``tilec.distribute.shared``)."""
        if self.bounds.graph.graph.get("shared_tiles"):
            return frozenset()
        return frozenset(name for name in self.bounds.may_roll(cut) if self.grad[self.bounds.position[name]])

    def made_tiled(self, cut: int, spans: Iterable[tuple[int, int, str]]) -> frozenset[str]:
        """Of ``rollable(cut)``, the tensors made by a tiled segment of ``spans``, ``(first, stop,
        mode)`` each (at least the segments before ``cut``): the segment starting there rolls
        those of its ``SegmentCost.rolls``."""
        position, tiled = self.bounds.position, [(first, stop) for first, stop, mode in spans if mode == "tiled"]
        return frozenset(name for name in self.rollable(cut) if any(a <= position[name] < b for a, b in tiled))

    def kernel_bytes(self, calls: Iterable[tuple[int, int, object]]) -> int:
        """Kernel state of convolution calls ``(position, passes, call shape)``: alike convolutions'
        calls of one shape share their kernels."""
        distinct = {(self.kernel_key[p], passes, shape) for p, passes, shape in calls}
        return self.kernel_state * sum(passes for _, passes, _ in distinct)

    def _boundary(self, first: int, stop: int) -> tuple[int, int, int]:
        """A tiled segment's output bytes, sliced inputs' gradient bytes, and backward bytes besides
        its working set (``gradients``, and the gradients of its and later segments' parameters)."""
        inputs = [i.name for i in self.bounds.inputs(first, stop) if i.sliced]
        in_grad = sum(self.full[name] for name in inputs if self.grad[self.bounds.position[name]])
        return self.output_bytes(first, stop), in_grad, self.gradients(first, stop) + self.later_weights[first]

    def local(self, cost: SegmentCost, made: frozenset[str] = frozenset()) -> int:
        """Peak bytes while a segment runs, beyond the kept bytes of earlier segments, its tiles
        rolling the gradients of those of its ``rolls`` that tiled segments ``made``."""
        return max(cost.forward_local, cost.backward_local - sum(saved for name, saved in cost.rolls if name in made))

    def stored_floor(self, first: int, stop: int) -> int:
        """A lower bound of ``local`` of the segment stored, without simulating its backward."""
        forward = self.stored_forward(first)[0][stop - first - 1] + self.cast_bytes(first, stop)
        return max(forward, self.gradients(first, stop) + self.later_weights[first])

    def floor(self, first: int, stop: int) -> int:
        """A lower bound of ``local`` of the segment tiled with any grid: all but its working set
        and the gradients it may roll."""
        outputs, _, fixed = self.boundary(first, stop)
        rollable = self.rollable(first)
        return max(outputs + self.packed_bytes(first, stop),
                   fixed - sum(self.full[i.name] for i in self.bounds.inputs(first, stop) if i.name in rollable))

    def cast_bytes(self, first: int, stop: int) -> int:
        """Bytes of autocast's copies of the parameters of nodes ``[first, stop)`` stored."""
        return self.casts_after[first] - self.casts_after[stop]

    def packed_bytes(self, first: int, stop: int) -> int:
        """Bytes of the packed weights a tiled forward pass of nodes ``[first, stop)`` keeps."""
        return self.packed_after[first] - self.packed_after[stop]

    def step_peaks(self, costs: Sequence[SegmentCost], rolled: Sequence[frozenset[str]]) -> list[int]:
        """Predicted step peak while each segment runs (forward or backward, whichever is higher),
        with the kernel state of every segment; segment ``k`` rolls the gradients ``rolled[k]``."""
        peaks, kept, kernels = [], 0, sum(cost.kernels for cost in costs)
        for cost, names in zip(costs, rolled, strict=True):
            peaks.append(kept + self.local(cost, names) + kernels)
            kept += cost.kept
        return peaks

    def output_bytes(self, first: int, stop: int) -> int:
        return sum(self.full[name] for name in self.bounds.outputs(first, stop))

    def _gradients(self, first: int, stop: int) -> int:
        """Gradients alive in the segment's backward, and the model outputs held from ``first`` on."""
        position = self.bounds.position
        names = {*self.bounds.crossing(stop), *(i.name for i in self.bounds.inputs(first, stop))}
        grads = sum(self.full[n] for n in names if self.grad[position[n]] and n not in self.outputs)
        return grads + sum(self.full[n] for n in self.outputs if position[n] >= first)

    def _area(self, name: str) -> int:
        shape, spatial = self.bounds.context.shape(name), self.bounds.context.spatial(name)
        return shape[spatial[0]] * shape[spatial[1]] if spatial else 1

    def _pair_bytes(self, program: _Program, rows: AxisArrays, cols: AxisArrays) -> np.ndarray:
        """Bytes of each quantity in each distinct (row tile, column tile) pair: ``[pairs, quantities]``."""
        first, stop, count = program.first, program.stop, len(program.slices)
        row_lengths, row_flags = _classes(program, rows)
        col_lengths, col_flags = _classes(program, cols)
        scale = np.concatenate([[self.full[name] / self._area(name) for name, _ in program.slices],
                                self.scale_pixel[first:stop].ravel()])
        flags = np.ones((len(row_flags), len(col_flags), count + KINDS * (stop - first)))
        flags[:, :, count + COPY::KINDS] = np.maximum(row_flags[:, None], col_flags[None])
        return (row_lengths[:, None] * col_lengths[None] * flags * scale).reshape(-1, len(scale))

    def _forward(self, first: int, tiled: bool, autograd: bool) -> _Forward:
        end = first
        while end < len(self.op) and (not tiled or self.bounds.context.nodes[self.bounds.order[end]].tileable):
            end += 1
        return _Forward(self, first, end, tiled, autograd)

    def _program(self, first: int, stop: int, tiled: bool) -> _Program:
        """Simulate the segment: forward (a prefix of ``_forward``'s), then backward from there."""
        ahead = self.forward(first, tiled, True)
        mark = ahead.marks[stop - first - 1]
        run = ahead.run.fork(mark, events=tiled)
        base = len(ahead.slices) - KINDS * first
        outputs = [self.bounds.position[name] for name in self.bounds.outputs(first, stop)]
        if not tiled:
            for p in outputs:
                run.drop(ahead.value[p])
        grads = {p: run.new(base + KINDS * p + OUT) if tiled else None for p in outputs if self.grad[p]}
        for p in reversed(range(first, stop)):
            op = self.op[p]
            if p in grads:
                transient: defaultdict[int, float] = defaultdict(float)
                reader = self.gradient_reader[p]
                in_place = tiled and reader is not None and reader < stop and self.inputs[p][0] >= first
                for i in self.inputs[p]:
                    if not self.grad[i]:
                        continue
                    if i >= first and (op in PASS_THROUGH or in_place):
                        if i not in grads:
                            grads[i] = grads[p]
                            run.hold(grads[i])
                        continue
                    if i < first:
                        size = ahead.slices.index(i) if i in ahead.slices else None
                    else:
                        size = base + KINDS * p + PADDED if op in WINDOWS else base + KINDS * i + OUT
                    if size is None:
                        grads.setdefault(i, None)
                    elif i in grads:
                        transient[size] += 1.0
                    else:
                        grads[i] = run.new(size)
                if op in CONVS and not tiled:
                    transient[base + KINDS * p + PADDED] += self.stored_workspace[p][1]
                if self.gemm[p] and tiled:  # the output gradient, padded to the padded input's size
                    transient[base + KINDS * p + PADDED] += self.channel_ratio[p]
                elif tiled and self.tile_workspace[p][1]:
                    transient[base + KINDS * p + PADDED] += self.tile_workspace[p][1]
                if op in CHANNELS_LAST_BACKWARD_COPY and tiled and self.grad[self.inputs[p][0]]:
                    source = self.inputs[p][0]
                    copy = ahead.slices.index(source) if source < first else base + KINDS * source + OUT
                    transient[copy] += 1.0
                if op not in PASS_THROUGH:
                    run.event(transient, self.weights[p] + (self.backward_weight_copies[p] if tiled else 0))
                run.drop(grads[p])
            for storage in ahead.saved.get(p, ()):
                run.drop(storage)
        names = [*self.bounds.order, INPUT]  # position -1: the model input
        slices = tuple((names[p], tuple(names[r] for r in range(first, stop) if p in self.inputs[r]))
                       for p in ahead.slices)
        plain = self.forward(first, True, False) if tiled else None
        forward = plain.run.trace(plain.marks[stop - first - 1]) if plain else None
        return _Program(first, stop, slices, forward, run.trace())


def _suffix_sums(values: Sequence[int]) -> list[int]:
    """Per position 0..len(values), the sum of ``values`` from there on."""
    return np.concatenate([np.cumsum(values[::-1])[::-1], [0]]).astype(int).tolist()


def _backward_weight_copies(forward: float, weight: float, gemm: bool, arena: bool) -> float:
    """Bytes of the weight copies a tile convolution's backward makes, given its forward's and its
    weight's bytes, whether its weight gradient is matrix products and whether it is in the arena."""
    if gemm:
        return forward + ARENA_GEMM_WEIGHT_BACKWARD_COPIES * weight if arena else weight
    return forward + (ARENA_WEIGHT_BACKWARD_COPIES if arena else WEIGHT_BACKWARD_EXTRA_COPIES) * weight


def _shapes(arrays: AxisArrays, position: int) -> set[tuple[int, int]]:
    """The distinct ``(length, padding)`` along one axis of the convolution calls at ``position``
    over the tiles: its read padded natively, or the copy of it padded (padding 0)."""
    column = position - arrays.offset
    length = np.where(arrays.copies[:, column] > 0, arrays.padded[:, column], arrays.copied[:, column])
    return set(zip(length.tolist(), (arrays.padded[:, column] - length).tolist(), strict=True))


def _kernel_key(node: NodeSpec, size: int, context: Context) -> tuple:
    """A convolution's op, element size, input channels, weight and bias shapes and constants."""
    def described(arg) -> object:
        if arg.kind == "node":
            return context.shape(arg.value)[:2]
        if arg.kind == "tensor":
            return tuple(context.tensor_shapes[arg.value])
        return repr(arg.value)
    return node.op, size, tuple(described(arg) for arg in node.args)


def _classes(program: _Program, arrays: AxisArrays) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct tile of one axis: each quantity's length, and whether a padded copy exists."""
    columns = slice(program.first - arrays.offset, program.stop - arrays.offset)
    hulls = [_hull(arrays, name, readers) for name, readers in program.slices]
    table = np.concatenate([np.array(hulls, dtype=np.int64).reshape(-1, arrays.parts).T, arrays.out[:, columns],
                            arrays.padded[:, columns], arrays.copied[:, columns], arrays.copies[:, columns]], axis=1)
    table = table[list({row.tobytes(): index for index, row in enumerate(table)}.values())]
    count, width = len(program.slices), program.stop - program.first
    out, padded, copied, copies = (table[:, count + k * width:count + (k + 1) * width] for k in range(4))
    lengths = np.concatenate([table[:, :count], np.stack([out, padded, copied, out], axis=2)
                              .reshape(len(table), -1)], axis=1)
    return lengths, copies


def _hull(arrays: AxisArrays, name: str, readers: Sequence[str]) -> np.ndarray:
    """Length of the interval of ``name`` the tiles read (the hull of their non-empty reads)."""
    start, stop, read = _hull_bounds(arrays, name, readers)
    return np.where(read, stop - start, 0)


def _hull_bounds(arrays: AxisArrays, name: str, readers: Sequence[str]) -> tuple[np.ndarray, ...]:
    """Per tile, the start and stop of the hull of its non-empty reads of ``name``, and whether it
    reads any."""
    reads = [(start, stop) for reader in readers for source, start, stop in arrays.reads[reader] if source == name]
    if not reads:
        empty = np.zeros(arrays.parts, dtype=np.int64)
        return empty, empty, empty.astype(bool)
    starts, stops = (np.array(bounds)[:, arrays.tiles] for bounds in zip(*reads, strict=True))
    full = stops > starts
    start, stop = np.where(full, starts, starts.max()).min(axis=0), np.where(full, stops, stops.min()).max(axis=0)
    return start, stop, full.any(axis=0)


def _band(rows: AxisArrays, name: str, readers: Sequence[str]) -> int | None:
    """Rows of the band that rolls the gradient of ``name`` (``Estimator.rollable``): the tallest
    read of a row of tiles; ``None`` where the reads' starts fall from one row to the next (the
    band could not move on)."""
    start, stop, read = _hull_bounds(rows, name, readers)
    starts = start[read]
    if not len(starts) or np.any(np.diff(starts) < 0):
        return None
    return int((stop - start)[read].max())
