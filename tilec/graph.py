"""The op graph, torch.fx style: ``Graph`` holds the nodes in execution order and who reads whom.

One class serves compiling (``tilec.trace`` builds it) and a loaded plan (``Graph.of_plan``).

Conventions:

* Nodes are ``NodeSpec`` s in one topological (execution) order; a node names its tensor inputs:
  other nodes, or the model's inputs (``InputSpec``: the ``forward``'s tensor arguments), which
  sit before every node: input ``k`` at position ``-1 - k``.
* A tensor's spatial axes are ``spatial = (row_dim, col_dim)``; ``None`` for a tensor without image
  axes, as one computed from the model's tensors alone is (a standardised convolution weight, a
  bias's view). An *image* is a tensor with image axes of more than one pixel.
* A *run* ``[first, stop)`` is a contiguous stretch of the execution order (a segment). The
  tensors a run reads from before it are its inputs; those it makes and something reads at or
  after ``stop`` (or the model returns) are its outputs; a *cut* is the boundary before a
  position.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from functools import cached_property

import networkx as nx

from tilec.ir import Arg, InputSpec, ModelFingerprint, NodeSpec, OutputTree, Plan, SegmentInput, Shape, TensorSpec


def updates_buffer(node: NodeSpec) -> bool:
    """An op that writes in place into a model tensor (a buffer), kept as the model runs it."""
    return (node.target.count(".") == 2 and node.target.split(".")[1].endswith("_") and bool(node.args)
            and node.args[0].kind == "tensor")


def output_leaves(tree: OutputTree) -> list[str]:
    """The node names of an output tree's tensors, in order (with repeats)."""
    leaves, stack = [], [tree]
    while stack:
        tree = stack.pop()
        if tree.kind == "tensor":
            leaves.append(tree.node)
        stack.extend(reversed(tree.items))
    return leaves


class Shapes:
    """Look-ups of tensor shapes and layouts by name: nodes, the model inputs and model tensors."""

    def __init__(self, nodes: dict[str, NodeSpec], tensors: Iterable[TensorSpec], inputs: Iterable[InputSpec]):
        self.nodes = nodes
        self.tensors = tuple(tensors)
        self.tensor_shapes = {t.name: tuple(t.shape) for t in self.tensors}
        self.inputs = tuple(inputs)
        self.input_specs = {spec.name: spec for spec in self.inputs}

    def shape(self, name: str) -> Shape:
        spec = self.input_specs.get(name)
        return spec.shape if spec is not None else self.nodes[name].shape

    def spatial(self, name: str) -> tuple[int, int] | None:
        spec = self.input_specs.get(name)
        return spec.spatial if spec is not None else self.nodes[name].spatial

    def arg_shape(self, arg: Arg) -> Shape:
        """The shape of a tensor argument: a model tensor's, or a node's or model input's (a
        convolution's weight computed from parameters, as weight standardisation does)."""
        return self.tensor_shapes[arg.value] if arg.kind == "tensor" else self.shape(arg.value)

    def is_input(self, name: str) -> bool:
        return name in self.input_specs

    def size(self, name: str, axis: int) -> int:
        return self.shape(name)[self.spatial(name)[axis]]

    def image_size(self) -> tuple[int, int] | None:
        """Rows and columns of the first model input with image axes (what a ``tilec.regions.Period``
        counts input pixels of); ``None`` where none has."""
        spec = next((spec for spec in self.inputs if spec.spatial is not None), None)
        return None if spec is None else tuple(spec.shape[d] for d in spec.spatial)

    def is_image(self, name: str) -> bool:
        spatial = self.spatial(name)
        if spatial is None:
            return False
        shape = self.shape(name)
        return shape[spatial[0]] * shape[spatial[1]] > 1

    def sliced_inputs(self, node: NodeSpec) -> tuple[str, ...]:
        """The inputs a tile of ``node`` slices: image tensors (others are broadcast whole)."""
        return tuple(dict.fromkeys(name for name in node.inputs if self.is_image(name)))


class Graph(Shapes):
    """The traced model: nodes in execution order, their readers, the output tree, and the
    model's tensors; the runs, cuts and boundaries of its execution order."""

    def __init__(self, nodes: Iterable[NodeSpec], *, tensors: Iterable[TensorSpec], output: OutputTree,
                 inputs: Iterable[InputSpec], autocast: str | None = None, mode: str | None = None,
                 flipped: tuple[str, ...] = ()):
        super().__init__({node.name: node for node in nodes}, tensors, inputs)
        self.order = tuple(self.nodes)
        self.output = output
        self.autocast = autocast
        self.mode = mode
        self.flipped = flipped
        self.position = {name: index for index, name in enumerate(self.order)}
        self.position.update({spec.name: -1 - k for k, spec in enumerate(self.inputs)})
        self.input_names = tuple(spec.name for spec in self.inputs)

    @classmethod
    def of_plan(cls, plan: Plan) -> Graph:
        """The graph a plan's model fingerprint describes."""
        return cls(plan.model.nodes, tensors=plan.model.tensors, output=plan.model.output, inputs=plan.inputs,
                   autocast=plan.autocast, mode=plan.mode, flipped=plan.flipped)

    def with_nodes(self, nodes: Iterable[NodeSpec]) -> Graph:
        """The same model with other nodes (a rewritten graph, ``tilec.recompute``)."""
        return Graph(nodes, tensors=self.tensors, output=self.output, inputs=self.inputs, autocast=self.autocast,
                     mode=self.mode, flipped=self.flipped)

    def in_mode(self, mode: str, flipped: tuple[str, ...] = ()) -> Graph:
        """The same graph, as traced in ``mode`` ("train" or "eval") with the modules ``flipped`` in
        the other, which it runs only in (``Plan.mode``)."""
        return Graph(self.nodes.values(), tensors=self.tensors, output=self.output, inputs=self.inputs,
                     autocast=self.autocast, mode=mode, flipped=flipped)

    def name_at(self, position: int) -> str:
        """The tensor at ``position``: a node, or (negative) a model input."""
        return self.order[position] if position >= 0 else self.inputs[-1 - position].name

    def __iter__(self):
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.order)

    @cached_property
    def users(self) -> dict[str, tuple[str, ...]]:
        """Per tensor (the model inputs and every node), the nodes reading it, in execution order."""
        found: dict[str, list[str]] = {**{name: [] for name in self.input_names}, **{name: [] for name in self.order}}
        for node in self.nodes.values():
            for name in node.inputs:
                found[name].append(node.name)
        return {name: tuple(readers) for name, readers in found.items()}

    @cached_property
    def outputs(self) -> tuple[str, ...]:
        """The nodes the model returns, without repeats."""
        return tuple(dict.fromkeys(output_leaves(self.output)))

    @cached_property
    def dag(self) -> nx.DiGraph:
        """The graph as a ``networkx`` DAG, edges from producer to reader."""
        dag = nx.DiGraph()
        dag.add_nodes_from([*self.input_names, *self.order])
        dag.add_edges_from((name, reader) for name, readers in self.users.items() for reader in readers)
        return dag

    def ancestors(self, name: str) -> set[str]:
        """Every node ``name`` depends on (the model inputs excluded)."""
        return nx.ancestors(self.dag, name) - set(self.input_names)

    @cached_property
    def last_use(self) -> dict[str, int]:
        """Per tensor, the position of its last reader (the node count for a model output; -1: none)."""
        ends = {name: max((self.position[r] for r in readers), default=-1) for name, readers in self.users.items()}
        for name in self.outputs:
            if not self.is_input(name):  # the caller holds a returned input: it adds no reader
                ends[name] = len(self.order)
        return ends

    @cached_property
    def ties(self) -> dict[int, tuple[str, str]]:
        """Cuts no segment boundary may fall at, each with the two nodes it would part: a node
        returning several tensors and a ``getitem`` taking one of them (a segment hands on tensors,
        a tiled segment's through its autograd function, not the tuples such nodes return); a node
        reading a buffer and a later one writing into it (a segment keeps the model tensors it reads
        for its backward, which a write in a later segment would change under it)."""
        found = {}
        for node in self.nodes.values():
            if node.op == "getitem" and node.inputs:
                source = node.inputs[0]
                found.update(dict.fromkeys(range(self.position[source] + 1, self.position[node.name] + 1),
                                           (source, node.name)))
            if updates_buffer(node):
                at = self.position[node.name]
                readers = [self.position[r.name] for r in self.nodes.values() if self.position[r.name] < at
                           and any(a.kind == "tensor" and a.value == node.args[0].value for a in r.args)]
                if readers:
                    first = self.order[min(readers)]
                    found.update(dict.fromkeys(range(min(readers) + 1, at + 1), (first, node.name)))
        return found

    def parting(self, stop: int) -> str | None:
        """What a segment ending at ``stop`` would part (``ties``), in words; ``None`` for nothing."""
        if stop not in self.ties:
            return None
        source, reader = self.ties[stop]
        if self.nodes[reader].op == "getitem":
            return (f"between node {source}, which returns several tensors, and node {reader} (getitem), "
                    "which takes one of them")
        return (f"between node {source}, which reads buffer {self.nodes[reader].args[0].value}, and node {reader} "
                f"(aten.{self.nodes[reader].op}), which writes into it")

    @cached_property
    def first_use(self) -> dict[str, int]:
        """Per tensor, the position of its first reader (the node count if none)."""
        return {name: min((self.position[r] for r in readers), default=len(self.order))
                for name, readers in self.users.items()}

    def members(self, first: int, stop: int) -> list[NodeSpec]:
        return [self.nodes[name] for name in self.order[first:stop]]

    def tileable(self, first: int, stop: int) -> bool:
        return all(node.tileable for node in self.members(first, stop))

    def inputs_of(self, first: int, stop: int) -> tuple[SegmentInput, ...]:
        """The tensors run ``[first, stop)`` reads from before it, in order of first read."""
        seen: dict[str, None] = {}
        for name in self.order[first:stop]:
            for producer in self.nodes[name].inputs:
                if self.position[producer] < first:
                    seen.setdefault(producer)
        return tuple(SegmentInput(name=name, sliced=self.is_image(name)) for name in seen)

    def outputs_of(self, first: int, stop: int) -> tuple[str, ...]:
        """The tensors run ``[first, stop)`` makes that are read at or after ``stop``, or returned."""
        return tuple(name for name in self.order[first:stop] if self.last_use[name] >= stop)

    def crossing(self, cut: int) -> list[str]:
        """Tensors alive across cut ``cut``: produced before it, read at or after it."""
        return [name for name in [*self.input_names, *self.order[:cut]] if self.last_use[name] >= cut]

    def may_roll(self, cut: int) -> frozenset[str]:
        """The tensors whose gradient the tiled backward of a segment starting at ``cut`` may write
        over the tensor itself, if a tiled segment (which keeps no activations) produced it: image
        tensors crossing ``cut`` that no node before it reads (whose backward runs after this one
        and may read them), neither a model input nor a model output (which the caller holds)."""
        outputs = set(self.outputs)
        return frozenset(name for name in self.crossing(cut) if not self.is_input(name) and name not in outputs
                         and self.first_use[name] >= cut and self.is_image(name))

    def fingerprint(self) -> ModelFingerprint:
        """Digest of everything a plan depends on about the model."""
        nodes = tuple(self.nodes.values())
        payload = json.dumps([[n.model_dump(mode="json") for n in nodes],
                              [t.model_dump(mode="json") for t in self.tensors],
                              self.output.model_dump(mode="json")], sort_keys=True)
        return ModelFingerprint(digest=hashlib.sha256(payload.encode()).hexdigest(), tensors=self.tensors,
                                nodes=nodes, output=self.output)
