"""``Op``: everything tilec knows about one op family, in one object.

A rule object answers, for a node of its op (a ``NodeSpec``) and the graph's shapes:

* ``layout``: the dims of the output's image axes (``tilec.trace``);
* ``check``: why the node cannot run tile by tile, in a few words (``WHOLE_MAP``, or "tilec has
  no tiling rule for it"): it then runs untiled, in a stored segment; ``None``: it can;
* ``need``: the halo rule. For an output interval ``out`` on one axis, the *unclipped* interval
  it needs of each sliced input, and whether clipping that interval means border padding the
  tile applies (conv, pooling, constant pad) or simply nothing to read. Rules are 1-D; the 2-D
  problem is the product of the row and the column problem. ``vectorised`` rules take arrays
  of interval bounds, every tile at once;
* ``output_size``: the size on one axis its rule implies from its input (validation);
* ``extras``: the hashable local constants a tile's code depends on beyond lengths and pads
  (tiles with equal extras share code);
* ``emit``: the expression a tile function computes it with (``tilec.codegen``'s view);
* ``flops``, ``backward_factor`` and the memory attributes below: the cost model.

A *reduction* (``reduces``: global pooling, means and maxima over the image, normalisation with
batch statistics, losses) runs inside a tiled segment in three parts: a ``partial`` each tile
computes over the part of the ``reduced`` inputs it owns (the owned parts partition them), a
``merge`` of the tiles' partials, then the node's small result from the merged one, once per sweep
(``finish``), and
for normalisations an ``apply`` that each tile computes from its input and that result, read as
a leaf (``tilec.runtime.tiles``). A reduction of nothing (a dropout mask over channels) has no
reduced inputs: its result is drawn once per step. A *positional* one (element-wise dropout) has
its tiles draw by their position: its ``AxisTile.partials`` interval is the tile's own output
interval at it, whose start the tile reads as its origin ``o``.

Intervals are half-open ``[start, stop)`` in the coordinates of the full (untiled) tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from tilec.graph import Shapes
from tilec.ir import AxisStep, NodeSpec
from tilec.regions import Interval

#: Bytes of an int64 index.
INDEX_BYTES = 8

#: Why a node that reads the whole map (global pooling, flatten, a softmax over an image axis) runs
#: untiled, where it is no reduction a tiled segment computes by sweeps.
WHOLE_MAP = "it reads the whole map"


@dataclass(frozen=True)
class Need:
    """What ``out`` needs of one sliced input on one axis. ``pads``: the clipped part of
    ``interval`` is border padding the tile applies (else it just does not exist)."""

    input: str
    interval: Interval
    pads: bool


def const(node: NodeSpec, index: int, default=None):
    """Positional constant ``index`` of ``node`` (``default`` when the call left it out)."""
    return node.args[index].value if index < len(node.args) else default


def pair(value) -> tuple[int, int]:
    """An int or a one- or two-element sequence as ``(rows, cols)``."""
    if isinstance(value, int | float):
        return int(value), int(value)
    values = tuple(int(v) for v in value)
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def dim(value: int, ndim: int) -> int:
    """A possibly negative dim as a non-negative one."""
    return value + ndim if value < 0 else value


class Op:
    """An op family's rules; subclasses override what differs. Instances are registered by the
    aten op names they cover (``tilec.ops.RULES``)."""

    #: Maps each position to itself (activations, arithmetic, channel ops).
    pixel = False
    #: ``need`` takes arrays of interval bounds (every tile at once); else tile by tile.
    vectorised = True
    #: The result aliases its input: no bytes of its own.
    view = False
    #: The backward hands its output gradient (or views of it) to its inputs, allocating nothing.
    pass_through = False
    #: What autograd keeps for the backward: ``"nothing"``, ``"input"`` (the first), ``"inputs"``
    #: or ``"output"``.
    saves = "input"
    #: A convolution: weight copies, kernel state and workspace in the cost model.
    convolution = False
    #: Reads a window of its input: its input gradient covers the padded read.
    window = False
    #: A border tile feeds it a padded copy of its input (``tilec.codegen``).
    padded_copy = False
    #: It makes indices for its backward (max pooling).
    keeps_indices = False
    #: Its result is a pair of its values and int64 indices of as many elements, which later ops
    #: read (``max_pool2d_with_indices``): its result's bytes are both's (``element_bytes``).
    index_output = False
    #: Autocast casts its parameters to its lower precision.
    casts_parameters = False
    #: Its channels-last backward takes a temporary the size of its input.
    channels_last_backward_copy = False
    #: Forward FLOPs per output element (``flops`` may compute them from the node instead).
    flop_count = 1
    #: Backward FLOPs as a multiple of forward.
    backward_factor = 1
    #: Of ``backward_factor``, the part that computes its parameters' gradient, which a backward
    #: sweep differentiating only reduction results skips (``tilec.runtime.sweeps``).
    weight_gradient_factor = 0
    #: The aten overload a tile runs it in place with, and the runtime function that
    #: back-propagates it in place (``tilec.ops.in_place``).
    in_place: str | None = None
    in_place_grad: str | None = None
    #: Its result is a fresh tensor its backward does not read: overwriting it is invisible to autograd.
    fresh_result = False
    #: Its backward hands its input a fresh gradient that nothing else reads.
    fresh_gradient = False
    #: Its result changes from one run to the next (never recomputed).
    random = False
    #: Index of the argument that switches it between training and eval behaviour.
    training_flag: int | None = None
    #: A normalisation whose partial and apply read its first input from one copy widened to
    #: float32 (where it is half or bfloat16), so that their input gradients add in float32 and
    #: round once, as PyTorch's fused kernel does (``tilec.codegen``).
    widens_input = False
    def __init__(self, *names: str, **attributes):
        self.names = names
        for key, value in attributes.items():
            if not hasattr(type(self), key):
                raise TypeError(f"{type(self).__name__} has no attribute {key!r}")
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.names!r}"

    def layout(self, node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
        """Dims of the output's image axes (``node.spatial`` is not set yet): by default those of its
        first image input where the output has that input's rank and image sizes (an op with no
        rule, as ``flip``, keeps its image an image), else dims 2 and 3 of a 4-D output."""
        for name in shapes.sliced_inputs(node):
            source, axes = shapes.shape(name), shapes.spatial(name)
            if len(source) == len(node.shape) and all(source[d] == node.shape[d] for d in axes):
                return axes
        return (2, 3) if len(node.shape) == 4 else None

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        """Why ``node`` (which reads an image) cannot run tile by tile (module docstring)."""
        return "tilec has no tiling rule for it"

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        raise NotImplementedError(f"{self!r} has no halo rule")

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        """The size on ``axis`` the rule implies from the input, or ``None`` where it is free."""
        return None

    def extras(self, node: NodeSpec, step: AxisStep, axis: int, shapes: Shapes):
        """The hashable local constants of ``node`` in one axis step (``None`` for most ops)."""
        return None

    def emit(self, node: NodeSpec, tile) -> str:
        """The expression one tile computes ``node`` with (``tile``: ``tilec.codegen.TileView``)."""
        args = [tile.arg(a) for a in node.args]
        if tile.in_place is not None:
            if tile.in_place:
                return f"in_place({', '.join([args[0], self.in_place, self.in_place_grad, *args[1:]])})"
            return tile.call(node, args, self.in_place)
        return tile.call(node, args)

    def element_bytes(self, node: NodeSpec, shapes: Shapes, floating: int) -> int:
        """Bytes per element of ``node``'s result, where a floating one takes ``floating`` (the plan
        records floating dtypes only): int64 indices take 8, beside the values they come with
        (``index_output``)."""
        return floating + INDEX_BYTES * self.index_output

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        """Forward FLOPs per output element."""
        return self.flop_count

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        """The kind of kernel ``node`` runs and its channel count, by which the time estimate looks
        up its FLOP rates (``tilec.target.Speed.points``): per-pixel ops by default."""
        return "pixel", node.shape[1] if len(node.shape) > 1 else 1

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        """Whether ``node`` is a reduction a tiled segment computes by sweeps (module docstring)."""
        return False

    def spreads(self, node: NodeSpec, shapes: Shapes) -> bool:
        """Whether ``node`` makes an image of inputs that are not images (a pooled map upsampled back
        to the image's size): each tile computes its own part from them, read whole."""
        return False

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        """Elements of each tensor of a partial (``partial``): a step keeps the tiles' merged one
        from the forward sweep that computes it until the segment's backward ends."""
        return ()

    def reduced(self, node: NodeSpec, shapes: Shapes) -> tuple[str, ...]:
        """The image inputs whose owned parts a reduction's partials cover (several: a loss's
        prediction and target, of one extent)."""
        return shapes.sliced_inputs(node)

    def batchable(self, node: NodeSpec, shapes: Shapes) -> bool:
        """Whether tiles stacked along dim 0 compute ``node`` in one call as each would alone: it
        computes each sample on its own and keeps the samples along dim 0
        (``tilec.runtime.batches``)."""
        return True

    def draws(self, node: NodeSpec) -> bool:
        """Whether ``node`` draws random numbers (``random``, unless its arguments make it an identity)."""
        return self.random

    def positional(self, node: NodeSpec, shapes: Shapes) -> bool:
        """Whether ``node`` reads absolute positions (a reduction of nothing drawing by position,
        module docstring; a tile op computing indices over the whole image, ``anchor``): identical
        tiles of its segment are then never computed once (``tilec.runtime.reuse``), nor stacked."""
        return False

    def anchor(self, step: AxisStep) -> int:
        """A positional tile op's origin on one axis, absolute, from its step in a tile: what its
        tile reads at run time as ``o`` (``tilec.emit.TileView.origin``)."""
        raise NotImplementedError(f"{self!r} reads no position")

    def untiled(self, node: NodeSpec, args: list[str], shapes: Shapes) -> str | None:
        """The expression computing ``node`` on whole tensors from its arguments' expressions
        ``args`` (in a stored segment or a combine), where that is not its aten call; ``None``: it is."""
        return None

    def partial(self, node: NodeSpec, tile) -> str:
        """The expression of a tile's partial, a tuple of tensors, over ``tile.owned(input)``."""
        raise NotImplementedError(f"{self!r} has no partial")

    def merge(self, node: NodeSpec) -> str:
        """The kind the tiles' partials merge by (``tilec.runtime.reduce.MERGES``)."""
        return "sum"

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        """The expression of the node's result (its value, or what ``apply`` reads) from
        ``combined``, the merged partial, in a combine function (``view``: ``tilec.emit.TileView``)."""
        raise NotImplementedError(f"{self!r} has no result")

    def apply(self, node: NodeSpec, tile) -> str | None:
        """A normalisation's image output from its input and its result (``tile.leaf(node.name)``);
        ``None``: the reduction's result is its (small) output."""
        return None

    def switch(self, node: NodeSpec) -> str | None:
        """The module whose training mode makes the reduction compute batch statistics, or ``None``:
        always (``tilec.runtime.checks.batch_norm_mode``)."""
        return None


class Whole(Op):
    """Ops that read the whole map (global and adaptive pooling, flatten, group norm...): they and
    what is computed only from their results run untiled."""

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return WHOLE_MAP
