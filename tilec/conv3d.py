"""``fold_conv3d``: a ``conv3d`` whose kernel spans one element of a dim, with stride 1 and no padding
there, becomes a grouped ``conv2d`` over its other two dims, which tilec's window rule tiles.

LambdaNetworks' position lambdas (timm's ``LambdaLayer``) convolve the values viewed as
(N, 1, H, W, V) by a (K, 1, r, r, 1) kernel: each of the V value channels is convolved over H and W by
the same K filters. Folding that dim ``t`` (size T) into the channels, ``t``-major, makes ``T *
groups`` groups: the input (N, C, ...) is permuted to (N, T, C, A, B) and viewed as (N, T * C, A, B);
the weight (K, C / groups, ...) loses its unit dim and is repeated T times along its output channels
(once per step, from the parameter), the bias likewise; the result (N, T * K, A', B') is viewed as
(N, T, K, A', B') and permuted back to the ``conv3d``'s (N, K, ...). Each output element is the same
sum of products (the kernels may add them in another order). Where several dims qualify, the last
is folded. New nodes are named after the ``conv3d`` (``conv3d_weight``, ``conv3d_conv2d``...).
"""

from __future__ import annotations

import torch

from tilec.functionalize import fake_mode, fake_shape, made_like, relinted, schema_arguments

aten = torch.ops.aten
CONV3D = aten.conv3d.default


def _arguments(node: torch.fx.Node) -> dict:
    """``node``'s arguments by name, defaults filled in."""
    return {argument.name: value for argument, value in schema_arguments(node)}


def _triple(value) -> list[int]:
    return list(value) * 3 if len(value) == 1 else list(value)


def _folded(values: dict, kernel: list[int]) -> int | None:
    """The last of the three dims the kernel spans one element of, with stride 1 and no padding."""
    stride, padding = _triple(values["stride"]), values["padding"]
    if isinstance(padding, str):
        return None
    padding = _triple(padding)
    found = [t for t in range(3) if kernel[t] == 1 and stride[t] == 1 and padding[t] == 0]
    return found[-1] if found else None


def _fold(graph: torch.fx.Graph, fake, node: torch.fx.Node, values: dict, t: int) -> None:
    x, weight, bias, groups = values["input"], values["weight"], values["bias"], values["groups"]
    n, c, *dims = fake_shape(x)
    k = fake_shape(weight)[0]
    others = [d for d in range(3) if d != t]
    size = dims[t]

    def new(target, *args, name):
        return made_like(graph, fake, target, list(args), node, name=f"{node.name}_{name}")

    with graph.inserting_before(node):
        x = new(aten.permute.default, x, [0, 2 + t, 1, *(2 + d for d in others)], name="fold")
        x = new(aten.reshape.default, x, [n, size * c, *(dims[d] for d in others)], name="folded")
        weight = new(aten.squeeze.dim, weight, 2 + t, name="weight")
        weight = new(aten.repeat.default, weight, [size, 1, 1, 1], name="weights")
        if bias is not None:
            bias = new(aten.repeat.default, bias, [size], name="biases")
        stride, padding, dilation = ([_triple(values[key])[d] for d in others]
                                     for key in ("stride", "padding", "dilation"))
        y = new(aten.conv2d.default, x, weight, bias, stride, padding, dilation, size * groups, name="conv2d")
        rows, cols = fake_shape(y)[2:]
        y = new(aten.reshape.default, y, [n, size, k, rows, cols], name="unfold")
        order = [0, 2, *(1 if d == t else 3 + others.index(d) for d in range(3))]
        node.replace_all_uses_with(new(aten.permute.default, y, order, name="unfolded"))
    graph.erase_node(node)


def fold_conv3d(program: torch.export.ExportedProgram) -> bool:
    """Rewrite ``program``'s foldable ``conv3d`` s in place (module docstring); whether any was."""
    graph, fake, changed = program.graph, None, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != CONV3D:
            continue
        values = _arguments(node)
        t = _folded(values, fake_shape(node.args[1])[2:])
        if t is not None:
            fake = fake or fake_mode(graph)
            _fold(graph, fake, node, values, t)
            changed = True
    return relinted(program, changed)
