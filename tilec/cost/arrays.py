"""``AxisArrays``: one axis of the tiles of a run of nodes, as ``[tile, node]`` arrays of lengths,
what the cost model sizes a tile's tensors by."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from tilec.cone import Cone
from tilec.graph import Graph
from tilec.ir import AxisTile
from tilec.ops import rule
from tilec.sweeps import levels


class AxisArrays:
    """One axis of the tiles of a run of nodes, as ``[tile, node]`` arrays of lengths.

    Columns are node positions minus ``offset``. ``out``: output length; ``padded``: length of a
    window op's input read plus its border padding; ``copied`` / ``copies``: length of its padded
    copy and whether the tile makes one (1 or 0, ``Op.copies``). ``reads[name]``: per input of
    the node, ``(input, start, stop)`` of the interval read, over ``tiles`` of the arrays
    (``window`` selects some tiles without copying). ``sums``: ``out`` summed over the tiles;
    ``derived``: what has been computed from the arrays (``call_shapes``, the cost model's shape
    classes of a run of their nodes), kept for the next asker; ``shared``: the same, for what its
    windows share (``read_bounds``).
    """

    def __init__(self, graph: Graph, offset: int, count: int, parts: int, steps):
        """``steps``: per node, ``(name, out start, out stop, reads)``, each read ``(input, start,
        stop, pad before, pad after)``; arrays over the tiles."""
        self.parts, self.offset, self.tiles = parts, offset, slice(0, parts)
        self.out = np.zeros((parts, count), dtype=np.int64)
        self.padded = np.zeros((parts, count), dtype=np.int64)
        self.copied = np.zeros((parts, count), dtype=np.int64)
        self.copies = np.zeros((parts, count), dtype=np.int64)
        self.reads: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
        for name, start, stop, reads in steps:
            column = graph.position[name] - offset
            self.out[:, column] = stop - start
            self.reads[name] = [(source, read_start, read_stop) for source, read_start, read_stop, _, _ in reads]
            op = rule(graph.nodes[name])
            if not op.window or not reads:  # a small op in a tiled segment reads nothing in the tiles
                continue
            _, read_start, read_stop, before, after = reads[0]
            self.padded[:, column] = read_stop - read_start + before + after
            if op.padded_copy:
                copies = op.copies(before, after)
                self.copies[:, column] = copies
                self.copied[:, column] = read_stop - read_start + np.where(copies, before + after, 0)
        self.sums = self.out.sum(axis=0)
        self.derived: dict[tuple, object] = {}
        self.shared: dict[str, object] = {}
        self.names = {graph.position[name] - offset: name for name, *_ in steps}

    def call_shapes(self, position: int) -> set[tuple[int, int]]:
        """The distinct ``(length, padding)`` along this axis of the calls of the window op at
        ``position`` over the tiles: its read padded natively, or the copy of it padded (padding 0)."""
        found = self.derived.get(("shapes", position))
        if found is None:
            column = position - self.offset
            length = np.where(self.copies[:, column] > 0, self.padded[:, column], self.copied[:, column])
            found = self.derived["shapes", position] = set(zip(length.tolist(),
                                                               (self.padded[:, column] - length).tolist(), strict=True))
        return found

    def read_bounds(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)`` of the reads of the nodes at positions ``[first, stop)``, in order of
        node and then of read: ``[tile, read]`` over every tile the arrays were made with (a window
        selects its own by ``tiles``)."""
        if "reads" not in self.shared:
            counts = np.zeros(self.out.shape[1] + 1, dtype=np.int64)  # before column c's reads: counts[:c + 1]
            for column, name in self.names.items():
                counts[column + 1] = len(self.reads[name])
            reads = [read for column in sorted(self.names) for read in self.reads[self.names[column]]]
            empty = np.zeros((0, 0), dtype=np.int64)  # no reads: nothing to slice
            self.shared["reads"] = (np.stack([start for _, start, _ in reads], axis=1) if reads else empty,
                                    np.stack([stop for _, _, stop in reads], axis=1) if reads else empty,
                                    np.cumsum(counts))
        starts, stops, ends = self.shared["reads"]
        low, high = ends[first - self.offset], ends[stop - self.offset]
        return starts[:, low:high], stops[:, low:high]

    @classmethod
    def of_cone(cls, graph: Graph, found: Cone) -> AxisArrays:
        empty = np.zeros(found.tiles, dtype=np.int64)
        steps = [(step.node, step.start, step.stop, step.reads + _owned(graph, step.node, step.owned, empty))
                 for step in found.steps]
        return cls(graph, found.low, found.stop - found.low, found.tiles, steps)

    @classmethod
    def of_tiles(cls, graph: Graph, first: int, stop: int, tiles: Sequence[AxisTile]) -> AxisArrays:
        """The arrays of a planned segment's axis tiles."""
        def column(values) -> np.ndarray:
            return np.array(list(values), dtype=np.int64)

        steps, empty = [], np.zeros(len(tiles), dtype=np.int64)
        reductions = [name for level in levels(graph, first, stop) for name in level.reductions]
        for index, name in enumerate(graph.order[first:stop]):
            at = [tile.steps[index] for tile in tiles]
            reads = [(read.input, column(s.reads[k].read.start for s in at), column(s.reads[k].read.stop for s in at),
                      column(s.reads[k].pad[0] for s in at), column(s.reads[k].pad[1] for s in at))
                     for k, read in enumerate(at[0].reads)]
            owned = None
            if name in reductions:
                k = reductions.index(name)
                owned = column(t.partials[k].start for t in tiles), column(t.partials[k].stop for t in tiles)
            reads = tuple(reads) + _owned(graph, name, owned, empty)
            steps.append((name, column(s.out.start for s in at), column(s.out.stop for s in at), reads))
        return cls(graph, first, stop - first, len(tiles), steps)

    def window(self, start: int, stop: int) -> AxisArrays:
        """Tiles ``[start, stop)`` only (several grids computed together, then taken apart)."""
        part = copy.copy(self)
        part.parts, part.tiles = stop - start, slice(start, stop)
        part.out, part.padded, part.copied, part.copies = (
            a[start:stop] for a in (self.out, self.padded, self.copied, self.copies))
        part.sums, part.derived = part.out.sum(axis=0), {}
        return part


def _owned(graph: Graph, name: str, owned, empty: np.ndarray) -> tuple:
    """A reduction's partial read, as reads of its reduced inputs (their owned parts), after its
    other reads: what its tiles hold of them."""
    if owned is None:
        return ()
    node = graph.nodes[name]
    return tuple((source, owned[0], owned[1], empty, empty) for source in rule(node).reduced(node, graph))
