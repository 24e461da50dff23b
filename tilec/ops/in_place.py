"""Which activations a tile computes in place, from the op table's ``in_place`` entries.

A tile runs an activation with an in-place overload (``Op.in_place``) on its input when that input
is the fresh result of an op whose backward does not read it (``Op.fresh_result``) and nothing else
reads it: autograd then keeps one tensor where it kept two, and the activation saves an allocation.
It also back-propagates in place, overwriting the output gradient it is handed, when its one reader
hands it a fresh gradient that nothing else reads (``Op.fresh_gradient``). The values are the same.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from tilec.ir import NodeSpec
from tilec.ops import const, rule


def _reader_counts(nodes: Iterable[NodeSpec]) -> Counter:
    """Per tensor name, how many nodes read it."""
    return Counter(name for node in nodes for name in dict.fromkeys(node.inputs))


def overwrites_input(node: NodeSpec, producer: NodeSpec | None, readers: int, model_output: bool) -> bool:
    """Whether a tile computes ``node`` in place on its first input, the result of ``producer``
    (``None``: a tensor from outside the tile), which ``readers`` nodes read."""
    if rule(node).in_place is None or producer is None or not rule(producer).fresh_result:
        return False
    if node.op == "leaky_relu" and const(node, 1, 0.01) < 0:
        return False
    return readers == 1 and not model_output


def overwrites_gradient(node: NodeSpec, reader: NodeSpec | None, readers: int, model_output: bool) -> bool:
    """Whether a tile's in-place ``node`` also back-propagates in place: its one reader ``reader``
    (``None``: outside the tile, whose gradient is the caller's) hands it a fresh gradient."""
    return (rule(node).in_place is not None and reader is not None and rule(reader).fresh_gradient
            and readers == 1 and not model_output)


def activations_in_place(nodes: Sequence[NodeSpec], model_outputs: Iterable[str]) -> dict[str, str | None]:
    """The activations among ``nodes`` (the model's, in order) that a tile computes in place
    when their input's producer is in its segment (``overwrites_input``), each mapped to its one
    reader's name if it also back-propagates in place when that reader is in its segment
    (``overwrites_gradient``), else ``None``."""
    by_name = {node.name: node for node in nodes}
    readers = _reader_counts(nodes)
    outputs = set(model_outputs)
    first_reader: dict[str, NodeSpec] = {}
    for node in nodes:
        for name in node.inputs:
            first_reader.setdefault(name, node)
    chosen = {}
    for node in nodes:
        source = node.inputs[0] if node.inputs else None
        if source in by_name and overwrites_input(node, by_name[source], readers[source], source in outputs):
            reader = first_reader.get(node.name)
            gradient = overwrites_gradient(node, reader, readers[node.name], node.name in outputs)
            chosen[node.name] = reader.name if gradient else None
    return chosen
