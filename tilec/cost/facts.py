"""``Facts``: what the cost model knows of every node of a graph on a target, computed once.

Per node (``NodeFacts``, by position in the execution order; position -1 is the model input):
its op's rule, its input positions, the element bytes it computes in, its parameters' bytes,
whether it needs a gradient, and what its tile kernels hold (``tilec.runtime.device``): its
result in the arena, weight copies per call, a weight gradient from matrix products, a
convolution workspace, autocast's casts of its parameters, its weight packed for a forward pass.
Model-wide: FLOPs per node as arrays, the bytes of every tensor, and sums from each position on.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import log, prod

import numpy as np
import torch

from tilec.cost.constants import (
    ARENA_GEMM_WEIGHT_BACKWARD_COPIES,
    ARENA_WEIGHT_BACKWARD_COPIES,
    CONV_BACKWARD_WORKSPACE,
    CONV_FORWARD_WORKSPACE,
    DEPTHWISE_BACKWARD_SCRATCH,
    ELEMENT_BYTES,
    WEIGHT_BACKWARD_EXTRA_COPIES,
)
from tilec.graph import Graph
from tilec.ir import NodeSpec
from tilec.ops import Op, const, rule
from tilec.ops.base import INDEX_BYTES
from tilec.ops.in_place import activations_in_place
from tilec.ops.window import window_args
from tilec.runtime.device import kernels_for, uses_gemm_weight_grad, uses_onednn
from tilec.target import Target


@dataclass(frozen=True)
class NodeFacts:
    """One node: ``rule``; ``inputs`` (positions, -1 the model input); ``computes`` (element bytes
    it computes in: the plan's dtype, or autocast's); ``weights`` (bytes of its parameters, in the
    plan's dtype); ``grad`` (it needs a gradient); ``in_arena`` (tiles write its result into their
    arena: max pooling, oneDNN convolutions); ``weight_copies`` / ``backward_weight_copies`` (bytes
    of the weight copies one tile's call makes in forward / backward, ``tilec.cost.constants``);
    ``gemm`` (tiles compute its weight gradient as matrix products) and ``channel_ratio`` (then its
    output channels per input channel); ``tile_workspace`` / ``stored_workspace`` (a convolution's
    ``(forward, backward)`` workspace in multiples of its padded input); ``backward_scratch`` (bytes
    a tile's backward of it takes whatever the tile's size: a large depthwise kernel's,
    ``DEPTHWISE_BACKWARD_SCRATCH``); ``casts`` (bytes of
    autocast's copies of its parameters); ``packed`` (bytes of its weight a tiled forward keeps in
    oneDNN's blocked layout); ``overwrites`` (tiles compute it in place when its input's producer is
    in the segment) and ``gradient_reader`` (the position of its one reader if it then also
    back-propagates in place when that reader is in the segment); ``dies_at`` (positions of the
    tensors whose last reader this node is)."""

    rule: Op
    inputs: tuple[int, ...]
    computes: int
    weights: int
    grad: bool
    in_arena: bool
    weight_copies: float
    backward_weight_copies: float
    gemm: bool
    channel_ratio: float
    tile_workspace: tuple[float, float]
    stored_workspace: tuple[float, float]
    backward_scratch: int
    casts: int
    packed: int
    overwrites: bool
    gradient_reader: int | None
    dies_at: tuple[int, ...]


def suffix_sums(values) -> list[int]:
    """Per position 0..len(values), the sum of ``values`` from there on."""
    return np.concatenate([np.cumsum(values[::-1])[::-1], [0]]).astype(int).tolist()


def _backward_weight_copies(forward: float, weight: float, gemm: bool, arena: bool) -> float:
    """Bytes of the weight copies a tile convolution's backward makes, given its forward's and its
    weight's bytes, whether its weight gradient is matrix products and whether it is in the arena."""
    if gemm:
        return forward + ARENA_GEMM_WEIGHT_BACKWARD_COPIES * weight if arena else weight
    return forward + (ARENA_WEIGHT_BACKWARD_COPIES if arena else WEIGHT_BACKWARD_EXTRA_COPIES) * weight


def _kernel_key(node: NodeSpec, size: int, graph: Graph) -> tuple:
    """A convolution's op, element size, input channels, weight and bias shapes and constants."""
    def described(arg) -> object:
        if arg.kind == "node":
            return graph.shape(arg.value)[:2]
        if arg.kind == "tensor":
            return tuple(graph.tensor_shapes[arg.value])
        return repr(arg.value)
    return node.op, size, tuple(described(arg) for arg in node.args)


class Facts:
    """Every node's ``NodeFacts`` on ``target``, training in ``dtype`` (module docstring)."""

    def __init__(self, graph: Graph, target: Target, dtype: str):
        self.graph, self.target = graph, target
        self.element = ELEMENT_BYTES[dtype]
        self.kernels = kernels_for(target.device, target.gemm_min_channels)
        shapes = graph.tensor_shapes
        parameters = {t.name for t in graph.tensors if not t.buffer}
        order = list(graph)
        self.outputs = [name for name in graph.outputs if not graph.is_input(name)]
        in_place = activations_in_place(order, self.outputs)
        dies_at: list[list[int]] = [[] for _ in order]
        for p, name in enumerate(graph.order):
            if graph.last_use[name] < len(order):
                dies_at[max(graph.last_use[name], p)].append(p)
        self.nodes: list[NodeFacts] = []
        for p, node in enumerate(order):
            op = rule(node)
            compute_dtype = node.autocast_dtype or node.dtype or dtype
            computes = ELEMENT_BYTES[compute_dtype]
            inputs = tuple(graph.position[i] for i in node.inputs)
            weight = graph.arg_shape(node.args[1]) if op.convolution else None
            weights = self.element * (sum(prod(shapes[a.value]) for a in node.args
                                          if a.kind == "tensor" and a.value in parameters)
                                      + (prod(weight) if op.convolution and node.args[1].kind == "node" else 0))
            in_arena = self.kernels.arena and (node.op == "max_pool2d" or node.op == "conv2d" and uses_onednn(
                self.kernels, getattr(torch, compute_dtype), False))
            spread = op.convolution and prod(weight[2:]) > 1
            weight_copies = weights * computes // self.element * (spread if in_arena else 1 + spread) \
                if op.convolution else 0
            gemm = node.op == "conv2d" and uses_gemm_weight_grad(
                self.kernels, getattr(torch, compute_dtype), const(node, 6, 1), window_args(node, weight).stride,
                prod(weight[2:]), weight[1])
            taps = prod(weight[2:]) if node.op == "conv2d" else 0
            calibrated = target.conv_workspace
            tile_workspace, stored_workspace = (
                tuple((forward * taps, backward * taps) for forward, backward in calibrated)
                if calibrated and taps > 1 else ((0.0, 0.0), (CONV_FORWARD_WORKSPACE, CONV_BACKWARD_WORKSPACE)))
            depthwise = node.op == "conv2d" and op.time_class(node, graph)[0] == "depthwise" and taps > 9
            on_cpu = depthwise and computes == 4 and target.device == "cpu"
            scratch = DEPTHWISE_BACKWARD_SCRATCH * weight[0] * taps if on_cpu else 0
            self.nodes.append(NodeFacts(
                rule=op, inputs=inputs, computes=computes, weights=weights,
                grad=weights > 0 or any(self.nodes[i].grad for i in inputs if i >= 0),
                in_arena=in_arena, weight_copies=weight_copies,
                backward_weight_copies=_backward_weight_copies(weight_copies, weights, gemm, in_arena)
                if op.convolution else 0,
                gemm=gemm, channel_ratio=weight[0] / weight[1] if gemm else 0.0,
                tile_workspace=tile_workspace, stored_workspace=stored_workspace, backward_scratch=scratch,
                casts=weights * computes // self.element if op.casts_parameters and computes < self.element else 0,
                packed=weights if in_arena and op.convolution else 0,
                overwrites=node.name in in_place,
                gradient_reader=graph.position[in_place[node.name]] if in_place.get(node.name) else None,
                dies_at=tuple(dies_at[p])))
        self.casts_after = suffix_sums([n.casts for n in self.nodes])
        self.packed_after = suffix_sums([n.packed for n in self.nodes])
        #: Per cut, the bytes of the parameters read by the nodes from there on (their gradients).
        self.later_weights = suffix_sums([n.weights for n in self.nodes])
        self.full = {**{spec.name: prod(spec.shape) * ELEMENT_BYTES[spec.dtype] for spec in graph.inputs},
                     **{node.name: prod(node.shape) * facts.rule.element_bytes(node, graph, facts.computes)
                        for node, facts in zip(order, self.nodes, strict=True)}}
        self.flops = np.array([rule(n).flops(n, graph) * prod(n.shape) for n in order])
        areas = np.array([self.area(name) for name in graph.order])
        #: Per node, its kind's rates (``tilec.target.Speed.points``): the logarithms of the smallest
        #: and the largest size measured, and the FLOP/s at each.
        points = [target.rates.points(*rule(n).time_class(n, graph)) for n in order]
        self.rate_points = np.array([[log(p[0][0]), log(p[-1][0]), p[0][1], p[-1][1]] for p in points]).T
        #: Per node, the elements of its output per pixel (the whole output where it has no image axes).
        self.pixel_elements = np.array([prod(n.shape) for n in order]) / areas
        #: Per node, seconds per FLOP of it untiled (``seconds_per_flop``).
        self.full_seconds_per_flop = self.seconds_per_flop(0, len(order), areas)
        self.backward_flops = np.array([rule(n).backward_factor for n in order]) * self.flops
        #: Of those, the FLOPs of the gradients of the nodes' inputs alone.
        self.input_backward_flops = self.backward_flops - np.array([rule(n).weight_gradient_factor
                                                                     for n in order]) * self.flops
        #: Forward FLOPs per output pixel (row x column) of each node.
        self.pixel_flops = self.flops / areas
        # Bytes of each node quantity (OUT, PADDED, COPY, INDEX), in all and per tile pixel.
        source = [n.inputs[0] if rule(n).window else n.name for n in order]
        self.scale_full = np.array([[self.full[n.name], self.full[s], self.full[s],
                                     prod(graph.shape(n.name)) * INDEX_BYTES]
                                    for n, s in zip(order, source, strict=True)])
        self.scale_pixel = self.scale_full / np.array([[a, self.area(s), self.area(s), a]
                                                       for a, s in zip(areas, source, strict=True)])
        #: The convolutions' positions, what their kernels depend on besides the tile's lengths
        #: (convolutions alike, as in a ResNet's repeated blocks, share them), and how many passes
        #: in a tile and stored: forward, input gradient (if its input needs one), weight gradient.
        self.convolutions = [p for p, n in enumerate(self.nodes) if n.rule.convolution]
        self.kernel_key = {p: _kernel_key(order[p], self.nodes[p].computes, graph) for p in self.convolutions}
        input_grad = {p: int(self.needs_grad(self.nodes[p].inputs[0])) for p in self.convolutions}
        self.tile_passes = {p: 1 + input_grad[p] + (not self.nodes[p].gemm) for p in self.convolutions}
        self.stored_passes = {p: 2 + input_grad[p] for p in self.convolutions}

    def needs_grad(self, position: int) -> bool:
        """Whether the tensor at ``position`` needs a gradient (the model inputs, negative, do not)."""
        return position >= 0 and self.nodes[position].grad

    def seconds_per_flop(self, first: int, stop: int, areas: np.ndarray) -> np.ndarray:
        """Per node of ``[first, stop)``, seconds per FLOP at its kind's rate for outputs of
        ``areas`` pixels (per node): linear in the logarithm of the output's elements between the
        rates at the smallest and the largest size measured, and held beyond them."""
        small, large, slow, fast = self.rate_points[:, first:stop]
        elements = np.log(np.maximum(areas * self.pixel_elements[first:stop], 1.0))
        share = np.clip((elements - small) / np.maximum(large - small, 1e-12), 0.0, 1.0)
        return 1 / (slow + (fast - slow) * share)

    def area(self, name: str) -> int:
        shape, spatial = self.graph.shape(name), self.graph.spatial(name)
        return shape[spatial[0]] * shape[spatial[1]] if spatial else 1
