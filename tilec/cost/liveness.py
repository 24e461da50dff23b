"""The tile liveness simulation: which tensors are alive at each allocation of a segment's run.

A segment's forward and backward are simulated op by op on the storages alive (``Timeline``):
a tiled segment's forward runs each tile without autograd, on a channels-last copy of its slice
of each sliced input: a fresh tensor per op (views, identity copies and the activations a tile
computes in place are free), a padded copy where a border tile pads asymmetrically,
intermediates freed after their last use, except what the tile keeps in its arena (input
copies, padded copies, max-pooling results and indices and float32 convolution results live
until the tile ends, the weights of those convolutions in oneDNN's blocked layout until the
pass ends). Its backward re-runs each tile under autograd on fresh tensors (no arena: each dies
when neither a later op nor a backward reads it any more), each op keeping what its backward
reads (``Op.saves``), then back-propagates the tile: gradients of the tile's tensors (an
activation that back-propagates in place hands on its output's), and of its slice of each
sliced input. A stored segment runs the same ops untiled. Convolutions take a kernel workspace
on top. The result is a ``Trace`` of a few *quantities* (``Program``): bytes linear in a
handful of lengths per axis, so every distinct (row tile, column tile) pair is evaluated at once.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from tilec.cost.facts import Facts
from tilec.ops import Op


@dataclass(frozen=True)
class Trace:
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


class Timeline:
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

    def trace(self, mark: tuple | None = None) -> Trace:
        changes, events, transients, _ = mark or self.mark(False)
        change = np.array(self.changes[:changes], dtype=np.int64).reshape(-1, 2)
        transient = np.array(self.transients[:transients], dtype=float).reshape(-1, 3)
        return Trace(change[:, 0], change[:, 1], np.array(self.events[:events], dtype=np.int64),
                      transient[:, 0].astype(np.int64), transient[:, 1].astype(np.int64), transient[:, 2],
                      np.array(self.constants[:events], dtype=float))

    def fork(self, mark: tuple, events: bool) -> Timeline:
        """A run continuing from ``mark`` (a snapshot mark), with or without the events so far."""
        run = Timeline()
        changes, count, transients, holders = mark
        run.holders, run.quantity, run.changes = dict(holders), list(self.quantity), self.changes[:changes]
        run.pinned = set(self.pinned)
        if events:
            run.events, run.constants = self.events[:count], self.constants[:count]
            run.transients = self.transients[:transients]
        return run


#: Kinds of node quantities; quantity ``slices + KINDS * (position - first) + kind`` (see ``Program``).
OUT, PADDED, COPY, INDEX = range(4)
KINDS = 4


@dataclass(frozen=True)
class Program:
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
    forward: Trace | None
    backward: Trace


class Forward:
    """The forward of nodes ``[first, end)``, simulated once for every segment starting at ``first``.

    A shorter segment's forward is a prefix of it: a node read after the segment is its output
    and stays alive to its end, as it does here past that point. ``marks[k]``: after node
    ``first + k`` (with the storages alive, when ``autograd``).
    """

    def __init__(self, facts: Facts, first: int, end: int, tiled: bool, autograd: bool):
        self.run = Timeline()
        self.value: dict[int, int | None] = {}
        self.saved: dict[int, list[int | None]] = {}
        self.marks = []
        graph, nodes, run = facts.graph, facts.nodes, self.run
        self.slices = tuple(graph.position[i.name] for i in graph.inputs_of(first, end) if i.sliced) if tiled else ()
        base = len(self.slices) - KINDS * first
        carved = not autograd  # from the arena: a backward pass's recompute takes fresh tensors
        last_reader = {}
        for quantity, source in enumerate(self.slices):  # each tile's channels-last copy of its slice
            self.value[source] = run.new(quantity, pinned=carved)
            last_reader[source] = max(p for p in range(first, end) if source in nodes[p].inputs)
        for position in range(first, end):
            node = nodes[position]
            op, inputs = node.rule, node.inputs
            in_place = tiled and node.overwrites and inputs[0] >= first
            if op.view or in_place:
                self.value[position] = self.value.get(inputs[0]) if inputs else None
                run.hold(self.value[position])
                if in_place and autograd and node.grad:
                    self.saved[position] = self._saves(op, position, inputs, None, None, base)
            else:
                copied = run.new(base + KINDS * position + COPY, pinned=carved) if tiled and op.padded_copy else None
                self.value[position] = run.new(base + KINDS * position + OUT, pinned=carved and tiled and node.in_arena)
                indices = run.new(base + KINDS * position + INDEX, pinned=carved) \
                    if tiled and op.keeps_indices else None
                if not op.convolution:
                    run.event()
                elif tiled:
                    workspace = node.tile_workspace[0]
                    run.event({base + KINDS * position + PADDED: workspace} if workspace else None,
                              0 if node.packed and not autograd else node.weight_copies)
                else:
                    run.event({base + KINDS * position + PADDED: node.stored_workspace[0]})
                if autograd and node.grad:
                    self.saved[position] = self._saves(op, position, inputs, copied, indices, base)
                run.drop(copied)
                run.drop(indices)
            for dying in node.dies_at:
                if dying >= first:
                    run.drop(self.value[dying])
            for source in self.slices:
                if last_reader[source] == position:
                    run.drop(self.value[source])
            self.marks.append(run.mark(autograd))

    def _saves(self, op: Op, position: int, inputs: tuple[int, ...], copied: int | None, indices: int | None,
               base: int) -> list:
        """Hold and return the storages autograd keeps for the node's backward (``None``: a tensor
        of another segment); ``copied`` and ``indices``: a tile's padded copy of the op's input
        and its max-pool indices. The op keeps its input too (border tiles keep only the copy, but
        the input is nearly always kept by another op)."""
        if op.saves == "nothing":
            return []
        if op.saves == "output":
            kept = [self.value[position]]
        elif op.saves == "inputs":
            kept = [self.value.get(i) for i in inputs]
        else:
            kept = [self.value.get(inputs[0]) if inputs else None]
        kept += [storage for storage in (copied, indices) if storage is not None]
        for storage in kept:
            self.run.hold(storage)
        if op.keeps_indices and indices is None:  # a stored segment's: made for the backward
            kept.append(self.run.new(base + KINDS * position + INDEX))
        return kept


def program(facts: Facts, forward, first: int, stop: int, tiled: bool) -> Program:
    """Simulate the segment ``[first, stop)``: forward (a prefix of ``forward(first, tiled,
    autograd)``'s, a cached ``Forward``), then backward from there."""
    graph, nodes = facts.graph, facts.nodes
    ahead = forward(first, tiled, True)
    mark = ahead.marks[stop - first - 1]
    run = ahead.run.fork(mark, events=tiled)
    base = len(ahead.slices) - KINDS * first
    outputs = [graph.position[name] for name in graph.outputs_of(first, stop)]
    if not tiled:
        for p in outputs:
            run.drop(ahead.value[p])
    grads = {p: run.new(base + KINDS * p + OUT) if tiled else None for p in outputs if nodes[p].grad}
    for p in reversed(range(first, stop)):
        node = nodes[p]
        op = node.rule
        if p in grads:
            transient: defaultdict[int, float] = defaultdict(float)
            reader = node.gradient_reader
            in_place = tiled and reader is not None and reader < stop and node.inputs[0] >= first
            for i in node.inputs:
                if not facts.needs_grad(i):
                    continue
                if i >= first and (op.pass_through or in_place):
                    if i not in grads:
                        grads[i] = grads[p]
                        run.hold(grads[i])
                    continue
                if i < first:
                    size = ahead.slices.index(i) if i in ahead.slices else None
                else:
                    size = base + KINDS * p + PADDED if op.window else base + KINDS * i + OUT
                if size is None:
                    grads.setdefault(i, None)
                elif i in grads:
                    transient[size] += 1.0
                else:
                    grads[i] = run.new(size)
            if op.convolution and not tiled:
                transient[base + KINDS * p + PADDED] += node.stored_workspace[1]
            if node.gemm and tiled:  # the output gradient, padded to the padded input's size
                transient[base + KINDS * p + PADDED] += node.channel_ratio
            elif tiled and node.tile_workspace[1]:
                transient[base + KINDS * p + PADDED] += node.tile_workspace[1]
            if op.channels_last_backward_copy and tiled and facts.needs_grad(node.inputs[0]) and graph.is_image(
                    graph.name_at(node.inputs[0])):  # a tile's normalisation (a standardised weight's is small)
                source = node.inputs[0]
                copy = ahead.slices.index(source) if source < first else base + KINDS * source + OUT
                transient[copy] += 1.0
            if not op.pass_through:
                extra = node.backward_weight_copies + node.backward_scratch if tiled else 0
                run.event(transient, node.weights + extra)
            run.drop(grads[p])
        for storage in ahead.saved.get(p, ()):
            run.drop(storage)
    slices = tuple((graph.name_at(p), tuple(graph.order[r] for r in range(first, stop) if p in nodes[r].inputs))
                   for p in ahead.slices)
    plain = forward(first, True, False) if tiled else None
    trace = plain.run.trace(plain.marks[stop - first - 1]) if plain else None
    return Program(first, stop, slices, trace, run.trace())
