"""Frontend: ``trace`` turns an ``nn.Sequential`` and an input shape into a layer graph.

The graph is a ``networkx.DiGraph`` whose nodes are ``"input"`` and the layer indices
``0..n-1`` (flattened order); each layer node carries its ``LayerSpec`` under ``"spec"``.
Edges run from producer to consumer. A Sequential gives a chain, but nothing downstream
assumes one: the planner walks consumers before producers and merges regions by union.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import networkx as nx
from torch import nn

from tilec.errors import ShapeError, UnsupportedLayerError
from tilec.ir import LayerSpec, Shape, TensorSpec
from tilec.layers import lookup

INPUT = "input"


def flatten(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(path, module)`` for every leaf of nested Sequentials, in execution order."""
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if type(child) is nn.Sequential:
            yield from flatten(child, f"{path}.")
        else:
            yield path, child


def check_input_shape(shape: Sequence[int]) -> Shape:
    if len(shape) != 4:
        raise ShapeError(f"input shape {tuple(shape)} has {len(shape)} dimension(s); tilec needs 4: N,C,H,W")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
        raise ShapeError(f"input shape {tuple(shape)} must be four positive integers N,C,H,W")
    return tuple(shape)


def _tensors(path: str, module: nn.Module) -> tuple[TensorSpec, ...]:
    specs = []
    for name in ("weight", "bias", "running_mean", "running_var"):
        tensor = getattr(module, name, None)
        if tensor is not None:
            buffer = name.startswith("running_")
            specs.append(TensorSpec(name=f"{path}.{name}", shape=tuple(tensor.shape), buffer=buffer))
    return tuple(specs)


def _channels_in(module: nn.Module) -> int | None:
    if isinstance(module, nn.Conv2d):
        return module.in_channels
    if isinstance(module, nn.BatchNorm2d):
        return module.num_features
    return None


def _attr(value):
    return tuple(value) if isinstance(value, list | tuple) else value


def _spec(index: int, path: str, module: nn.Module, in_shape: Shape, producer: str) -> LayerSpec:
    entry, meaning = lookup(path, module)
    n, channels, height, width = in_shape
    expected = _channels_in(module)
    if expected is not None and expected != channels:
        raise ShapeError(
            f"layer {path} ({type(module).__name__}) expects {expected} input channels, but {producer} "
            f"gives {channels}"
        )
    out_channels = module.out_channels if isinstance(module, nn.Conv2d) else channels
    out_shape = (n, out_channels, meaning.rows.output_size(height), meaning.cols.output_size(width))
    if out_shape[2] < 1 or out_shape[3] < 1:
        raise ShapeError(
            f"input is too small for the network: layer {path} ({type(module).__name__}) "
            f"gets {height}x{width} and would output {out_shape[2]}x{out_shape[3]}"
        )
    return LayerSpec(
        index=index,
        path=path,
        type=type(module).__name__,
        op=meaning.op,
        fn=meaning.fn,
        rows=meaning.rows,
        cols=meaning.cols,
        options=meaning.options,
        attrs={name: _attr(getattr(module, name)) for name in entry.attrs},
        tensors=_tensors(path, module),
        in_shape=in_shape,
        out_shape=out_shape,
    )


def trace(model: nn.Module, input_shape: Sequence[int]) -> nx.DiGraph:
    """Build the layer graph of ``model`` for inputs of ``input_shape`` (N, C, H, W)."""
    if not isinstance(model, nn.Sequential):
        raise UnsupportedLayerError(f"the model must be an nn.Sequential, got {type(model).__name__}")
    if type(model).forward is not nn.Sequential.forward:
        raise UnsupportedLayerError(
            f"the model is a {type(model).__name__} with its own forward(); tilec compiles the layer "
            f"chain of a plain nn.Sequential only"
        )
    shape = check_input_shape(input_shape)
    graph = nx.DiGraph(input_shape=shape)
    graph.add_node(INPUT)
    producer, source = INPUT, f"the input shape {shape}"
    for index, (path, module) in enumerate(flatten(model)):
        spec = _spec(index, path, module, shape, source)
        graph.add_node(index, spec=spec)
        graph.add_edge(producer, index)
        producer, shape = index, spec.out_shape
        source = f"layer {path} ({type(module).__name__})"
    if producer == INPUT:
        raise UnsupportedLayerError("the model has no layers")
    graph.graph["output"] = producer
    return graph


def layer_specs(graph: nx.DiGraph) -> tuple[LayerSpec, ...]:
    """The layers of a traced graph in execution (topological) order."""
    order = nx.lexicographical_topological_sort(graph, key=lambda node: -1 if node == INPUT else node)
    return tuple(graph.nodes[node]["spec"] for node in order if node != INPUT)
