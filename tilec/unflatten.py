"""``unflatten``: ops on an image whose rows and columns the model merged into one dim run on the
image's own two axes, so that tilec's rules, which follow rows and columns, tile them.

A model pooling over its pixels often flattens them first: GCNet's global context
(``x.reshape(B, C, H * W)``, a softmax over the pixels, a ``matmul`` with it), attention-MIL
pooling (``x.flatten(2).transpose(1, 2)``, per-pixel ``linear`` layers, a softmax over the pixels,
a weighted sum), a mean over tokens; MobileViT-v2 attends over its map cut into patches
((N, C, pixels of a patch, patches), ``tilec.blocks`` makes the cut a pixel unshuffle), a lambda
layer over its pixels. A *region* starts at a view merging the two image axes of a tensor of 4
dims or more, H and W at dims ``(2, 3)``, channels-last ``(1, 2)``, or the last two, both longer
than 1, and holds every op that reads a tensor with the merged dim ``f``. Each op of it becomes one
on the unmerged tensor, whose dims ``f, f + 1`` are H and W, computing the same values:

* element-wise ops, their other tensor arguments given a unit dim for W where they broadcast over
  the merged dim (one spanning it, a positional embedding, is not rewritten);
* permutes, transposes, ``unsqueeze``/``squeeze``, ``chunk``/``split``/``unbind``, slices,
  ``select`` and constant padding of other dims, ``linear`` and ``layer_norm`` over dims after it
  (a check of dtypes before a cast is dropped); a 1x1 ``conv2d`` of one group: a ``linear`` layer
  over the channels moved last; ``group_norm``: of the tensor viewed as an image
  (N, C * K, H, W), each channel's weight repeated K times;
* a softmax over it: ``exp(x - logsumexp(x, (f, f + 1)))`` (log-softmax: without the ``exp``); over
  another dim, the softmax;
* ``sum``, ``mean``, ``amax``, ``amin``, ``logsumexp`` and vector norms over it: over both axes
  (``F.normalize`` over the tokens, EdgeNeXt's cross-covariance attention: its norm expanded to
  the tensor, ``expand_as``, on the unmerged one);
* a ``matmul`` / ``bmm`` contracting it: an ``einsum`` over both axes; one with it as the columns
  of the result, a ``matmul`` per pixel by the other matrix transposed (pixels permuted before the
  contracted dim and back); one with it as the rows, by a matrix: a ``linear`` layer, by a matrix
  per batch index: a ``matmul`` broadcasting it over H; one with it in a batch dim of both: the
  ``matmul`` of the unmerged tensors, per pixel;
* ``scaled_dot_product_attention`` of queries over keys and values that are its tokens (one query
  made from the tokens' mean, SimPool's), without mask, dropout or causality: the softmax of the
  scores over it, and their product with the values, as above;
* a view keeping it whole keeps both axes; one splitting it into (H, W) ends the region. The view
  starting a region may regroup the dims before H and W (EfficientViT splits its channels into
  heads as it flattens).

A region is rewritten only where every op of it has a rule here and no output of the model holds
the merged dim; else it stays as exported (attention between pixels, a matrix over the merged dim
twice, is then refused or run untiled by tilec, as before). The rewritten ops keep their module's
path (``nn_module_stack``); a new node is named after the node it rewrites and its op
(``softmax_logsumexp``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from tilec.functionalize import Rewrite, fake_shape, fake_value, made_like, schema_arguments
from tilec.ops.reduce import Contraction

aten = torch.ops.aten
#: Views that merge or split dims: a region's start, its views, its end.
VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.flatten.using_ints,
         aten.unflatten.int, aten.view_as.default}
#: Ops computed element by element, their tensor arguments broadcasting against each other.
ELEMENTWISE = {"add", "sub", "mul", "div", "rsub", "pow", "exp", "log", "tanh", "sigmoid", "relu", "gelu", "silu",
               "neg", "sqrt", "rsqrt", "abs", "square", "clamp", "clamp_min", "clamp_max", "softplus", "hardtanh",
               "leaky_relu", "elu", "mish", "hardswish", "hardsigmoid", "where", "maximum", "minimum", "to",
               "_to_copy", "clone", "contiguous", "alias", "dropout", "reciprocal"}
#: Reductions over dims: the argument holding them, and the keepdim argument (a norm's order before them).
REDUCTIONS = {"sum": (1, 2), "mean": (1, 2), "amax": (1, 2), "amin": (1, 2), "logsumexp": (1, 2),
              "linalg_vector_norm": (2, 3)}
SOFTMAXES = {aten.softmax.int: False, aten._softmax.default: False, aten.log_softmax.int: True,
             aten._log_softmax.default: True}


class Unsupported(Exception):
    """An op of a region with no rule here: the region stays as exported."""


@dataclass(frozen=True)
class Flat:
    """A region's tensor: ``node`` holds it with H and W at dims ``f, f + 1``, where the model's
    tensor holds them merged at ``f``."""

    node: torch.fx.Node
    f: int


@dataclass(frozen=True)
class Parts(Flat):
    """A region's list of tensors (``chunk``/``split`` along another dim), each a ``Flat`` at ``f``."""


#: Ops returning parts of a tensor along a dim, and the argument holding the dim.
SPLITS = {aten.chunk.default: 2, aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.unbind.int: 1}
PADS = {aten.pad.default, aten.constant_pad_nd.default}


def _merged_at(source: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, list[int]] | None:
    """Where a view from ``source`` (4-D or more) to ``target`` merges the image axes ``f, f + 1``
    (``(2, 3)``, ``(1, 2)`` channels-last, or the last two), both longer than 1, into one dim
    ``g``, the dims before them regrouped or not (EfficientViT splits its channels into heads as
    it merges): ``(g, target's shape with H and W at g, g + 1)``; else ``None``."""
    if len(source) < 4:
        return None
    for f in dict.fromkeys((2, 1, len(source) - 2)):
        height, width, rest = source[f], source[f + 1], source[f + 2:]
        g = len(target) - len(rest) - 1
        if (height > 1 and width > 1 and g >= 0 and target[g] == height * width
                and tuple(target[g + 1:]) == rest and math.prod(target[:g]) == math.prod(source[:f])):
            return g, [*target[:g], height, width, *rest]
    return None


def positional(node: torch.fx.Node, args: list) -> list:
    """``node``'s arguments ``args`` (twins) and the defaults of the positional ones they leave out."""
    return [*args, *(value for argument, value in schema_arguments(node)[len(args):] if not argument.kwarg_only)]


class _Rewrite(Rewrite):
    """The pass over one program: per region (a union-find over region ids), the nodes it made and
    the model's nodes it replaces; a region with an op it has no rule for is dropped."""

    def __init__(self, graph: torch.fx.Graph):
        super().__init__(graph)
        self.parent: dict[int, int] = {}
        self.failed: set[int] = set()
        self.made: list[tuple[torch.fx.Node, int]] = []  # (new node, region)
        self.result: dict[torch.fx.Node, tuple[Flat | torch.fx.Node, int]] = {}  # model node -> (its twin, region)
        self.node = None  # the model's node being rewritten
        self.region = None

    # -- regions ---------------------------------------------------------------------------------

    def find(self, region: int) -> int:
        while self.parent[region] != region:
            region = self.parent[region]
        return region

    def join(self, region: int) -> None:
        region = self.find(region)
        if self.region is None:
            self.region = region
        elif region != self.find(self.region):
            self.parent[region] = self.find(self.region)
            if region in self.failed:
                self.failed.add(self.find(self.region))

    def twin(self, arg):
        """``arg``'s twin in a region, or ``arg`` itself."""
        if isinstance(arg, torch.fx.Node) and arg in self.result:
            return self.result[arg][0]
        return arg

    # -- making nodes ----------------------------------------------------------------------------

    def make(self, target, *args, **kwargs) -> torch.fx.Node:
        """A new node computing ``target(*args, **kwargs)`` before the model's node being rewritten,
        with its module path and its value's fake tensor."""
        with self.graph.inserting_before(self.node):
            new = made_like(self.graph, self.fake, target, args, self.node, kwargs,
                            name=f"{self.node.name}_{getattr(target, '_opname', target.__name__)}")
        self.made.append((new, None))
        return new

    # -- rules -----------------------------------------------------------------------------------

    def rewrite(self, node: torch.fx.Node, args: list):
        """``node``'s twin given its arguments' twins ``args``: a ``Flat``, or a node of
        ``node``'s shape (the region ends there)."""
        flats = [a for a in args if isinstance(a, Flat)]
        target, name = node.target, getattr(node.target, "_opname", "")
        rank = len(fake_shape(node)) if isinstance(fake_value(node), torch.Tensor) else None
        if target == aten._assert_tensor_metadata.default:
            return args[0]  # a check of dtype and device (before ``x.float()``), as true of the twin: dropped
        if target is operator.getitem and isinstance(args[0], Parts):
            return Flat(self.make(target, args[0].node, args[1]), args[0].f)
        if any(isinstance(a, Parts) or isinstance(a, list | tuple) and any(isinstance(v, Flat) for v in a)
               for a in args):
            raise Unsupported("a list of tensors holding the merged dim")
        if target in VIEWS:
            return self.view(flats[0], fake_shape(node.args[0]), fake_shape(node))
        if name in ELEMENTWISE:
            at = next(rank - len(fake_shape(n)) + a.f for a, n in zip(args, node.args, strict=False)
                      if isinstance(a, Flat))
            for a, n in zip(args, node.args, strict=False):
                if isinstance(a, Flat) and rank - len(fake_shape(n)) + a.f != at:
                    raise Unsupported("its inputs hold the merged dim in different places")
            return Flat(self.make(target, *[self.broadcast(a, at, rank) for a in args], **node.kwargs), at)
        if target in (aten.matmul.default, aten.bmm.default):
            return self.matmul(node, args)
        if target == aten.scaled_dot_product_attention.default:
            return self.attention(node, args)
        if target == aten.expand_as.default and isinstance(args[1], Flat):  # F.normalize's norm, to the tensor
            return Flat(self.make(target, self.broadcast(args[0], args[1].f, rank), args[1].node), args[1].f)
        x = args[0]
        if not isinstance(x, Flat) or any(isinstance(a, Flat) for a in args[1:]):
            raise Unsupported(f"aten.{name} reading the merged dim in another argument than its first")
        f = x.f
        if target in SOFTMAXES:
            dim = args[1] % rank
            if dim != f:
                return Flat(self.make(target, x.node, dim + (dim > f), *args[2:]), f)
            if args[2:] not in ([], [None], [False]):
                raise Unsupported("a softmax to another dtype")
            return self.softmax(x, SOFTMAXES[target])
        if name in ("sum", "mean") and target._overloadname == "default":
            return self.make(target, x.node, *args[1:], **node.kwargs)  # over every dim
        if name in REDUCTIONS:
            return self.reduce(node, x, positional(node, args))
        if target in (aten.transpose.int, aten.permute.default):
            order = list(range(rank))
            if target == aten.transpose.int:
                a, b = args[1] % rank, args[2] % rank
                order[a], order[b] = order[b], order[a]
            else:
                order = [d % rank for d in args[1]]
            new = [e for d in order for e in ((f, f + 1) if d == f else (d + (d > f),))]
            return Flat(self.make(aten.permute.default, x.node, new), order.index(f))
        if target == aten.unsqueeze.default:
            dim = args[1] % rank
            return Flat(self.make(target, x.node, dim + (dim > f)), f + (dim <= f))
        if target == aten.squeeze.dim:
            dim = args[1] % (rank + 1)
            if dim == f:
                raise Unsupported("squeezing the merged dim")
            return Flat(self.make(target, x.node, dim + (dim > f)), f - (dim < f))
        if target in SPLITS or target in (aten.slice.Tensor, aten.select.int):
            at = SPLITS.get(target, 1)
            dim = (args[at] if len(args) > at else 0) % (len(fake_shape(node.args[0])))
            if dim == f:
                raise Unsupported("splitting or slicing the merged dim")
            new = self.make(target, x.node, *args[1:at], dim + (dim > f), *args[at + 1:])
            if target == aten.select.int:
                return Flat(new, f - (dim < f))
            if target == aten.unbind.int:
                return Parts(new, f - (dim < f))
            return (Parts if target in SPLITS else Flat)(new, f)
        if target in PADS:
            if target == aten.pad.default and len(args) > 2 and args[2] not in ("constant", None):
                raise Unsupported("padding other than constant")
            if f >= rank - len(args[1]) // 2:
                raise Unsupported("padding the merged dim")
            return Flat(self.make(target, x.node, *args[1:]), f)
        if target == aten.conv2d.default:
            return self.pointwise(x, positional(node, args))
        if target == aten.group_norm.default:
            return self.group_norm(x, positional(node, args))
        if target == aten.linear.default:
            if f == rank - 1:
                raise Unsupported("a linear layer over the merged dim")
            return Flat(self.make(target, x.node, *args[1:]), f)
        if target == aten.layer_norm.default:
            if f >= rank - len(args[1]):
                raise Unsupported("a layer norm over the merged dim")
            return Flat(self.make(target, x.node, *args[1:]), f)
        raise Unsupported(f"aten.{name} has no rule on the merged dim")

    def pointwise(self, x: Flat, args: list) -> Flat:
        """A 1x1 ``conv2d`` of one group of a region's 4-D tensor: a ``linear`` layer over its
        channels, moved last and back."""
        weight, bias, stride, padding, _, groups = args[1:]
        kernel = fake_shape(weight)
        if kernel[2:] != (1, 1) or {*stride} != {1} or {*padding} != {0} or groups != 1 or x.f < 2:
            raise Unsupported("a convolution over the merged dim")
        dims = len(fake_shape(x.node))
        last = self.make(aten.permute.default, x.node, [0, *range(2, dims), 1])
        matrix = self.make(aten.reshape.default, weight, list(kernel[:2]))
        out = self.make(aten.linear.default, last, matrix, bias)
        return Flat(self.make(aten.permute.default, out, [0, dims - 1, *range(1, dims - 1)]), x.f)

    def group_norm(self, x: Flat, args: list) -> Flat:
        """``group_norm`` of a region's tensor (N, C, ..., H, W): of it viewed as (N, C * K, H, W), the
        K elements of the dims between each channel's, each channel's weight and bias repeated K
        times; the same groups of the same elements."""
        shape = fake_shape(x.node)
        if x.f < 2 or len(shape) != x.f + 2:
            raise Unsupported("a group norm with the merged dim not last")
        (n, c), inner, (height, width) = shape[:2], math.prod(shape[2:x.f]), shape[x.f:]
        groups, weight, bias, *rest = args[1:]
        if inner > 1:
            weight, bias = (None if t is None else self.make(aten.repeat_interleave.self_int, t, inner)
                            for t in (weight, bias))
        flat = self.make(aten.reshape.default, x.node, [n, c * inner, height, width])
        normed = self.make(aten.group_norm.default, flat, groups, weight, bias, *rest)
        return Flat(self.make(aten.reshape.default, normed, list(shape)), x.f)

    def broadcast(self, arg, at: int, rank: int):
        """A tensor argument of an element-wise op whose result holds the merged dim at ``at`` of
        ``rank`` dims, as the rewritten op reads it: a region's tensor unmerged; another given a
        unit dim for W where it reaches the merged dim (``Unsupported`` where it spans it)."""
        if isinstance(arg, Flat):
            return arg.node
        if not isinstance(arg, torch.fx.Node) or not isinstance(fake_value(arg), torch.Tensor):
            return arg
        shape = fake_shape(arg)
        local = at - (rank - len(shape))
        if local < 0:
            return arg
        if shape[local] != 1:
            raise Unsupported("a tensor spanning the merged dim (a positional embedding)")
        return self.make(aten.unsqueeze.default, arg, local + 1)

    def view(self, x: Flat, source: tuple[int, ...], target: tuple[int, ...]):
        """A view of a region's tensor (``source``, merged dim at ``x.f``) to ``target``: keeping
        the merged dim whole, or splitting it into (H, W), which ends the region."""
        height, width = fake_shape(x.node)[x.f:x.f + 2]
        before = math.prod(source[:x.f])
        for g in range(len(target) + 1):
            if math.prod(target[:g]) != before:
                continue
            if g < len(target) and target[g] == height * width:
                return Flat(self.make(aten.reshape.default, x.node, [*target[:g], height, width, *target[g + 1:]]), g)
            if tuple(target[g:g + 2]) == (height, width):
                return self.make(aten.reshape.default, x.node, list(target))
        raise Unsupported("a view splitting the merged dim otherwise than into rows and columns")

    def reduce(self, node, x: Flat, args: list):
        """``sum``, ``mean``, ``amax``, ``amin``, ``logsumexp`` and a vector norm over dims of a
        region's tensor (``args``: every positional argument, ``positional``)."""
        rank = len(fake_shape(node.args[0]))
        where, keep_at = REDUCTIONS[node.target._opname]
        dims = args[where]
        dims = list(range(rank)) if dims in (None, [], ()) else [d % rank for d in dims]
        keepdim = bool(args[keep_at])
        new_dims = [e for d in dims for e in ((x.f, x.f + 1) if d == x.f else (d + (d > x.f),))]
        new = self.make(node.target, x.node, *args[1:where], new_dims, keepdim, *args[keep_at + 1:], **node.kwargs)
        if x.f not in dims:
            return Flat(new, x.f if keepdim else x.f - sum(d < x.f for d in dims))
        return self.make(aten.squeeze.dim, new, x.f + 1) if keepdim else new

    def matmul(self, node, args: list):
        """``a @ b`` with the merged dim in one or both of ``a`` and ``b`` (ranks 2 and more)."""
        a, b = args[:2]
        ranks = [len(fake_shape(n)) for n in node.args[:2]]
        if min(ranks) < 2:
            raise Unsupported("a matmul of a vector")
        if isinstance(a, Flat) and isinstance(b, Flat):
            if ranks[0] - a.f == ranks[1] - b.f >= 3:  # a batch dim of both: a matrix product per pixel
                return Flat(self.per_pixel(a.node, b.node), max(ranks) - (ranks[0] - a.f))
            if (a.f, b.f) != (ranks[0] - 1, ranks[1] - 2):
                raise Unsupported("a matrix over the merged dim twice (attention between pixels)")
            return self.contracted(a, b)
        if isinstance(a, Flat) and a.f == ranks[0] - 2 and ranks[1] == 2:
            # a (..., H, W, K) @ b (K, N): a linear layer of weight b^T
            return Flat(self.make(aten.linear.default, a.node, self.make(aten.t.default, b)), a.f)
        if isinstance(a, Flat) and a.f == ranks[0] - 2 and not isinstance(b, Flat):
            # a (..., H, W, K) @ b (..., K, N), a matrix per batch index: b (..., 1, K, N) broadcast over H
            return Flat(self.make(aten.matmul.default, a.node, self.make(aten.unsqueeze.default, b, -3)), a.f)
        if isinstance(b, Flat) and b.f == ranks[1] - 1:
            return self.columns(a, b, max(ranks))
        raise Unsupported("a matmul holding the merged dim in a batch dim")

    def per_pixel(self, a: torch.fx.Node, b: torch.fx.Node) -> torch.fx.Node:
        """``a @ b`` of two unmerged tensors whose pixels are batch dims. Where ``a`` has one row
        and a batch dim along which ``b`` broadcasts (a lambda layer's heads), that dim becomes
        ``a``'s rows and back: ``matmul`` would copy ``b`` once per index of it."""
        sa, sb = fake_shape(a), fake_shape(b)
        spread = [d for d in range(len(sa) - 2) if len(sa) == len(sb) and sa[d] > 1 and sb[d] == 1]
        if sa[-2] != 1 or len(spread) != 1:
            return self.make(aten.matmul.default, a, b)
        rows = self.make(aten.transpose.int, a, spread[0], -2)
        return self.make(aten.transpose.int, self.make(aten.matmul.default, rows, b), spread[0], -2)

    def contracted(self, a: Flat, b: Flat) -> torch.fx.Node:
        """``a @ b`` contracting the merged dim, ``a`` (..., M, H, W) and ``b`` (..., H, W, N): their
        ``einsum`` over H and W (``tilec.ops.reduce.Contraction``)."""
        return self.make(aten.einsum.default, Contraction.EQUATION, [a.node, b.node])

    def columns(self, a, b: Flat, rank: int) -> Flat:
        """``a @ b`` with the merged dim as the result's columns (of ``rank`` dims), ``a`` (..., M, K)
        and ``b`` (..., K, H, W): each pixel's K values times ``a`` transposed, a matrix per batch
        index, ``b``'s pixels moved before K and the result's back (no (M, K, H, W) product)."""
        dims = len(fake_shape(b.node))
        pixels = self.make(aten.permute.default, b.node, [*range(dims - 3), dims - 2, dims - 1, dims - 3])
        matrix = self.make(aten.unsqueeze.default, self.make(aten.transpose.int, a, -1, -2), -3)
        product = self.make(aten.matmul.default, pixels, matrix)  # (..., H, W, M)
        last = rank + 1
        back = [*range(last - 3), last - 1, last - 3, last - 2]
        return Flat(self.make(aten.permute.default, product, back), rank - 1)

    def softmax(self, x: Flat, log: bool) -> Flat:
        """A softmax (``log``: log-softmax) over the merged dim: ``exp(x - logsumexp(x, (H, W)))``."""
        lse = self.make(aten.logsumexp.default, x.node, [x.f, x.f + 1], True)
        shifted = self.make(aten.sub.Tensor, x.node, lse)
        return Flat(shifted if log else self.make(aten.exp.default, shifted), x.f)

    def attention(self, node, args: list):
        """``scaled_dot_product_attention`` of queries ``q`` (..., L, E) over keys and values whose
        tokens are the merged dim, without a mask, dropout or causality: ``softmax(q @ k^T * scale) @ v``."""
        q, k, v = args[:3]
        options = dict(zip(("attn_mask", "dropout_p", "is_causal"), args[3:6], strict=False)) | dict(node.kwargs)
        rank = len(fake_shape(node.args[1]))
        if (isinstance(q, Flat) or not isinstance(k, Flat) or not isinstance(v, Flat) or k.f != rank - 2
                or v.f != rank - 2 or options.get("attn_mask") is not None or options.get("dropout_p", 0.0)
                or options.get("is_causal") or options.get("enable_gqa")):
            raise Unsupported("attention with the merged dim as queries, a mask, dropout or grouped heads")
        scale = options.get("scale") or fake_shape(node.args[0])[-1] ** -0.5
        order = [*range(rank - 2), rank, rank - 2, rank - 1]  # (..., H, W, E) -> (..., E, H, W)
        keys = Flat(self.make(aten.permute.default, k.node, order), rank - 1)
        scores = self.columns(q, keys, rank)
        scaled = Flat(self.make(aten.mul.Tensor, scores.node, scale), scores.f)
        return self.contracted(self.softmax(scaled, log=False), v)

    # -- the pass --------------------------------------------------------------------------------

    def run(self) -> bool:
        for node in list(self.graph.nodes):
            if node.op == "output":
                self.fail_outputs(node)
            if node.op != "call_function":
                continue
            self.node, self.region = node, None
            args = [type(a)(self.twin(v) for v in a) if isinstance(a, list | tuple) else self.twin(a)
                    for a in node.args]
            inputs = [*node.all_input_nodes]
            if not any(isinstance(self.result.get(n, (None,))[0], Flat) for n in inputs):
                self.start(node)
                continue
            for n in inputs:
                if n in self.result:
                    self.join(self.result[n][1])
            start = len(self.made)
            try:
                if any(isinstance(self.twin(v), Flat) for v in node.kwargs.values()):
                    raise Unsupported("a keyword argument holding the merged dim")
                self.result[node] = (self.rewrite(node, args), self.region)
            except Exception:  # noqa: BLE001 - Unsupported, or a shape no rule foresaw: left as exported
                self.failed.add(self.find(self.region))
            for k in range(start, len(self.made)):
                self.made[k] = (self.made[k][0], self.region)
        return self.commit()

    def start(self, node: torch.fx.Node) -> None:
        """A view merging a 4-D tensor's image axes starts a region (reading a twin: joining its)."""
        if node.target not in VIEWS or not isinstance(fake_value(node), torch.Tensor):
            return
        merged = _merged_at(fake_shape(node.args[0]), fake_shape(node))
        if merged is None:
            return
        self.region = len(self.parent)
        self.parent[self.region] = self.region
        source = self.twin(node.args[0])
        if node.args[0] in self.result:
            self.join(self.result[node.args[0]][1])
        g, unmerged = merged
        if list(fake_shape(node.args[0])) != unmerged:  # dims before H and W regrouped
            source = self.make(aten.reshape.default, source, unmerged)
            self.made[-1] = (source, self.region)
        self.result[node] = (Flat(source, g), self.find(self.region))

    def fail_outputs(self, output: torch.fx.Node) -> None:
        """A region one of whose tensors the model returns fails (its twin has another shape)."""
        for arg in output.all_input_nodes:
            if arg in self.result and isinstance(self.result[arg][0], Flat):
                self.failed.add(self.find(self.result[arg][1]))

    def commit(self) -> bool:
        """Replace the nodes of the regions that succeeded by their twins, drop the failed ones'."""
        failed = {self.find(r) for r in self.failed}
        for new, region in reversed(self.made):
            if self.find(region) in failed:
                self.graph.erase_node(new)
        replaced = [n for n, (_, region) in self.result.items() if self.find(region) not in failed]
        for node in replaced:
            found = self.result[node][0]
            if not isinstance(found, Flat):
                node.replace_all_uses_with(found)
        for node in reversed(replaced):
            if not node.users:
                self.graph.erase_node(node)
        return bool(replaced)


def unflatten(program: torch.export.ExportedProgram) -> bool:
    """Rewrite ``program``'s regions over merged image axes in place (module docstring); whether
    any was rewritten."""
    return _Rewrite.apply(program)
