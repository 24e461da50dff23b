"""Reductions over the image axes: global pooling, means, sums, maxima, variances, and the
normalisations with batch statistics (``tilec.ops.base`` describes the parts of a reduction).

A tile's partial covers the part of the input it owns; the combines are ``tilec.runtime.reduce``'s:
sums, Chan's merge of ``(count, mean, M2)``, maxima with their ties, the first maximum.
"""

from __future__ import annotations

from math import prod

from tilec.graph import Shapes
from tilec.ir import AxisStep, NodeSpec
from tilec.ops.base import WHOLE_MAP, Need, Op, const, dim
from tilec.regions import Interval


def image_dims(node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
    """The image dims of ``node``'s first input, if it is a 4-D image (NCHW)."""
    images = shapes.sliced_inputs(node)
    if not images or len(shapes.shape(images[0])) != 4 or shapes.spatial(images[0]) != (2, 3):
        return None
    return 2, 3


def dims_of(node: NodeSpec, index: int, ndim: int) -> tuple[int, ...]:
    """The dims argument ``index`` of ``node``, all dims where it is missing, ``None`` or empty."""
    value = const(node, index, None)
    if value in (None, ()):
        return tuple(range(ndim))
    value = (value,) if isinstance(value, int) else value
    return tuple(sorted({dim(d, ndim) for d in value}))


def covers_image(node: NodeSpec, shapes: Shapes, dims: tuple[int, ...]) -> bool:
    """Whether ``dims`` reduce both image axes of the node's first input, in whichever dims it holds
    them (channels-last blocks hold them in 1 and 2)."""
    images = shapes.sliced_inputs(node)
    return bool(images) and images[0] == node.inputs[0] and set(shapes.spatial(images[0])) <= set(dims)


def count(node: NodeSpec, shapes: Shapes, dims: tuple[int, ...]) -> int:
    """Elements of the whole input each result element reduces."""
    shape = shapes.shape(node.inputs[0])
    return prod(shape[d] for d in dims)


class Reduce(Op):
    """A reduction with a small result: its value is the node's output (``apply`` is ``None``)."""

    saves = "nothing"

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        return prod(shapes.shape(node.inputs[0])) / max(1, prod(node.shape))


def bins(output: Interval, size: int, out_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """PyTorch's adaptive pooling bins of outputs ``output`` on an axis of ``size`` pooled to
    ``out_size``: output ``o`` averages inputs ``[floor(o * size / out), ceil((o + 1) * size / out))``."""
    starts = tuple(o * size // out_size for o in range(output.start, output.stop))
    stops = tuple(-(-(o + 1) * size // out_size) for o in range(output.start, output.stop))
    return starts, stops


class Pool(Reduce):
    """``adaptive_avg_pool2d`` / ``_adaptive_avg_pool2d``: to 1x1 the mean over the image, a
    reduction; to another size a window op whose bins are PyTorch's (``bins``), tile by tile."""

    vectorised = False

    def sizes(self, node: NodeSpec) -> tuple[int, int]:
        value = tuple(const(node, 1))
        return (value[0], value[0]) if len(value) == 1 else value

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return WHOLE_MAP if image_dims(node, shapes) is None or self.sizes(node) == (1, 1) else None

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return image_dims(node, shapes) is not None and self.sizes(node) == (1, 1)

    def layout(self, node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
        return (2, 3) if len(node.shape) == 4 else None

    def need(self, node: NodeSpec, axis: int, out: Interval, shapes: Shapes) -> list[Need]:
        source = node.inputs[0]
        starts, stops = bins(out, shapes.size(source, axis), self.sizes(node)[axis])
        interval = Interval(min(starts), max(stops)) if starts else Interval(0, 0)
        return [Need(source, interval, False)]

    def output_size(self, node: NodeSpec, axis: int, shapes: Shapes) -> int | None:
        return self.sizes(node)[axis]

    def extras(self, node: NodeSpec, step: AxisStep, axis: int, shapes: Shapes):
        """The tile's bins, local to its read."""
        if step.out.length == 0:
            return None
        starts, stops = bins(step.out, shapes.size(node.inputs[0], axis), self.sizes(node)[axis])
        base = step.reads[0].read.start
        return tuple(a - base for a in starts), tuple(b - base for b in stops)

    def emit(self, node: NodeSpec, tile) -> str:
        rows, cols = (self.extras(node, step, axis, tile.shapes) for axis, step in enumerate((tile.row, tile.col)))
        return f"adaptive_average({tile.read(node.inputs[0])}, {tile.constant(rows)}, {tile.constant(cols)})"

    def partial(self, node: NodeSpec, tile) -> str:
        return f"partial_sum({tile.owned(node.inputs[0])}, (2, 3))"

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return (prod(shapes.shape(node.inputs[0])[:2]),)

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        return f"({combined}[0] / {count(node, view.shapes, (2, 3))}).to({view.dtype(node)})"


class Contraction(Reduce):
    """``einsum("...mhw,...hwn->...mn", a, b)``: a product contracting the image axes, which
    ``tilec.unflatten`` makes of a ``matmul`` over flattened pixels (GCNet's context, attention's
    weighted values, linear attention's keys by values). Each tile's partial is the einsum of its
    own pixels, summed over the tiles."""

    #: The one equation it covers: ``a``'s image axes are its last two, ``b``'s the two before its last.
    EQUATION = "...mhw,...hwn->...mn"
    saves = "inputs"

    def layout(self, node: NodeSpec, shapes: Shapes) -> tuple[int, int] | None:
        return None

    def operands(self, node: NodeSpec) -> tuple[str, ...]:
        return tuple(node.args[1].value) if node.args[1].kind == "nodes" else ()

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        if const(node, 0) != self.EQUATION or len(self.operands(node)) != 2:
            return f"an einsum other than {self.EQUATION!r} over an image"
        return WHOLE_MAP

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        operands = self.operands(node)
        if const(node, 0) != self.EQUATION or len(operands) != 2 or not all(map(shapes.is_image, operands)):
            return False
        a, b = operands
        ranks = len(shapes.shape(a)), len(shapes.shape(b))
        return (shapes.spatial(a) == (ranks[0] - 2, ranks[0] - 1) and shapes.spatial(b) == (ranks[1] - 3, ranks[1] - 2)
                and all(shapes.size(a, axis) == shapes.size(b, axis) for axis in (0, 1)))

    def reduced(self, node: NodeSpec, shapes: Shapes) -> tuple[str, ...]:
        return self.operands(node)

    def partial(self, node: NodeSpec, tile) -> str:
        a, b = (tile.owned(name) for name in self.operands(node))
        return f"partial_contraction({a}, {b})"

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return (prod(node.shape),)

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        return f"{combined}[0].reshape({tuple(node.shape)!r}).to({view.dtype(node)})"

    def flops(self, node: NodeSpec, shapes: Shapes) -> float:
        if not self.reduces(node, shapes):  # an einsum of small tensors
            return super().flops(node, shapes)
        a = self.operands(node)[0]
        return 2 * shapes.size(a, 0) * shapes.size(a, 1)

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        if not self.reduces(node, shapes):
            return super().time_class(node, shapes)
        return "conv1x1", shapes.shape(self.operands(node)[0])[-3]


class MaxPool(Reduce):
    """``adaptive_max_pool2d`` to 1x1: values and indices, the first maximum in row-major order."""

    saves = "input"

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return WHOLE_MAP

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return image_dims(node, shapes) is not None and tuple(const(node, 1)) in ((1, 1), (1,))

    def partial(self, node: NodeSpec, tile) -> str:
        source = node.inputs[0]
        return f"partial_argmax({tile.owned(source)}, {tile.origin(node.name)}, {tile.shapes.size(source, 1)})"

    def merge(self, node: NodeSpec) -> str:
        return "argmax"

    def batchable(self, node: NodeSpec, shapes: Shapes) -> bool:
        return False  # its partial's index counts from the tile's origin

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return (prod(shapes.shape(node.inputs[0])[:2]),) * 2  # maxima and their indices

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        return combined


class Statistic(Reduce):
    """``mean`` / ``sum`` / ``amax`` / ``amin`` (the maximum of the negated input, negated) / ``max`` /
    ``min`` / ``var`` / ``std`` / ``var_mean`` / ``logsumexp`` / the 2-norm ``linalg_vector_norm``
    over dims that include both image axes (and any others); over others only, they are per-pixel
    ops (``tilec.ops.pixel.ChannelReduction``)."""

    #: Per op: the argument holding the dims (``None``: all), and the keepdim argument (``argmax``:
    #: for ``tilec.ops.pixel.ChannelArgMax``); ``max`` and ``min`` by overload (``arguments``).
    ARGUMENTS = {"mean": (1, 2), "sum": (1, 2), "amax": (1, 2), "var": (1, 3), "std": (1, 3),
                 "var_mean": (1, 3), "linalg_vector_norm": (2, 3), "argmax": (1, 2), "logsumexp": (1, 2),
                 "amin": (1, 2)}

    @classmethod
    def arguments(cls, node: NodeSpec) -> tuple[int | None, int | None]:
        """``ARGUMENTS`` of ``node``: ``max.dim`` / ``min.dim`` (values and indices along one dim) as
        ``amax``; ``max()`` / ``min()`` over all dims, without either argument."""
        if node.op in ("max", "min"):
            return (1, 2) if node.target.endswith(".dim") else (None, None)
        return cls.ARGUMENTS[node.op]

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return WHOLE_MAP

    def dims(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        """The dims it reduces: all of them without a dims argument (``mean.default``, ``max()``)."""
        ndim = len(shapes.shape(node.inputs[0]))
        where, _ = self.arguments(node)
        whole = where is None or node.op in ("mean", "sum") and node.target.endswith(".default")
        return tuple(range(ndim)) if whole else dims_of(node, where, ndim)

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        if node.op in ("mean", "sum") and node.target.endswith((".dim", ".dim_IntList")) and const(node, 3) is not None:
            return False  # a dtype argument
        if node.op in ("mean", "sum") and node.target.endswith(".default") and const(node, 1) is not None:
            return False
        if node.op == "linalg_vector_norm" and (const(node, 1, 2) != 2 or const(node, 4) is not None):
            return False  # another order, or a dtype argument
        return covers_image(node, shapes, self.dims(node, shapes))

    def partial(self, node: NodeSpec, tile) -> str:
        dims = self.dims(node, tile.shapes)
        source = tile.owned(node.inputs[0])
        if node.op in ("amax", "max"):
            return f"partial_max({source}, {dims!r})"
        if node.op in ("amin", "min"):
            return f"partial_max(-{source}, {dims!r})"  # the minimum, negated
        if node.op in ("var", "std", "var_mean"):
            return f"partial_moments({source}, {dims!r})"
        if node.op == "linalg_vector_norm":
            return f"partial_squares({source}, {dims!r})"
        if node.op == "logsumexp":
            return f"partial_logsumexp({source}, {dims!r})"
        return f"partial_sum({source}, {dims!r})"

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        dims, shape = self.dims(node, shapes), shapes.shape(node.inputs[0])
        kept = prod(size for d, size in enumerate(shape) if d not in dims)
        tensors = {"amax": 2, "amin": 2, "max": 2, "min": 2, "var": 2, "std": 2, "var_mean": 2}  # moments: a count
        return (kept,) * tensors.get(node.op, 1)

    def merge(self, node: NodeSpec) -> str:
        return {"amax": "max", "amin": "max", "max": "max", "min": "max", "var": "moments", "std": "moments",
                "var_mean": "moments", "logsumexp": "logsumexp"}.get(node.op, "sum")

    def correction(self, node: NodeSpec) -> float:
        """The variance's correction: ``unbiased`` (``.dim``) or ``correction`` (``None``: 1)."""
        value = const(node, 2, None)
        if node.target.endswith(".dim"):
            return 1 if value in (None, True) else 0
        return 1 if value is None else value

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        shape, dtype = tuple(node.shape), view.dtype(node)
        if node.op in ("var", "std", "var_mean"):
            value = f"variance({combined}, {self.correction(node)!r}, {shape!r})"
            if node.op == "std":
                return f"{value}.sqrt().to({dtype})"
            if node.op == "var_mean":
                return f"({value}.to({dtype}), {combined}[1].reshape({shape!r}).to({dtype}))"
            return f"{value}.to({dtype})"
        if node.op == "mean":
            size = count(node, view.shapes, self.dims(node, view.shapes))
            return f"({combined}[0] / {size}).reshape({shape!r}).to({dtype})"
        if node.op == "linalg_vector_norm":
            return f"root_of_squares({combined}[0]).reshape({shape!r}).to({dtype})"
        if node.op in ("amin", "min"):
            return f"(-{combined}[0]).reshape({shape!r}).to({dtype})"
        return f"{combined}[0].reshape({shape!r}).to({dtype})"


class Normalise(Op):
    """``group_norm``, ``instance_norm`` with input statistics, and ``layer_norm`` over (C, H, W)
    without a per-pixel weight: each tile normalises its part with statistics of the whole input
    per (sample, group); ``batch_norm`` with batch statistics is ``tilec.ops.pixel.BatchNorm``."""

    fresh_result = True
    channels_last_backward_copy = True  # in a tile, its scale's gradient: the output gradient times the input
    widens_input = True
    flop_count = 5

    def check(self, node: NodeSpec, shapes: Shapes) -> str | None:
        return WHOLE_MAP

    def time_class(self, node: NodeSpec, shapes: Shapes) -> tuple[str, int]:
        return "norm", node.shape[1] if len(node.shape) > 1 else 1

    def groups(self, node: NodeSpec, shapes: Shapes) -> int | None:
        """Channel groups per sample whose statistics are shared: ``None`` where it does not reduce."""
        if image_dims(node, shapes) is None:
            return None
        channels = shapes.shape(node.inputs[0])[1]
        if node.op == "group_norm":
            return const(node, 1)
        if node.op == "instance_norm":
            return channels if const(node, 5, False) and const(node, 3) is None else None
        if node.op == "layer_norm":
            covered = tuple(const(node, 1, ())) == tuple(shapes.shape(node.inputs[0])[1:])
            return 1 if covered and const(node, 2) is None and const(node, 3) is None else None
        return None

    def reduces(self, node: NodeSpec, shapes: Shapes) -> bool:
        return self.groups(node, shapes) is not None

    def partial(self, node: NodeSpec, tile) -> str:
        return f"partial_moments(grouped({tile.owned(node.inputs[0])}, {self.groups(node, tile.shapes)}), (2, 3, 4))"

    def merge(self, node: NodeSpec) -> str:
        return "moments"

    def partial_elements(self, node: NodeSpec, shapes: Shapes) -> tuple[int, ...]:
        return (shapes.shape(node.inputs[0])[0] * self.groups(node, shapes),) * 2  # (mean, M2); the count a number

    def eps(self, node: NodeSpec) -> float:
        return const(node, {"group_norm": 4, "instance_norm": 7, "layer_norm": 4}[node.op])

    def finish(self, node: NodeSpec, combined: str, view) -> str:
        weight, bias = {"group_norm": (2, 3), "instance_norm": (1, 2), "layer_norm": (2, 3)}[node.op]
        return (f"norm_affine(norm_stats({combined}, {self.eps(node)!r}), {self.groups(node, view.shapes)}, "
                f"{node.shape[1]}, {view.arg(node.args[weight])}, {view.arg(node.args[bias])})")

    def apply(self, node: NodeSpec, tile) -> str:
        return f"norm_apply({tile.read(node.inputs[0])}, {tile.leaf(node.name)})"
