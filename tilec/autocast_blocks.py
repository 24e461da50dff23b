"""``inline_autocast``: a block of ``forward`` that turns autocast off runs inline, its ops marked.

Model code that must compute part of its forward in full precision under mixed-precision
training wraps it in ``with torch.autocast(device_type, enabled=False)`` (EfficientViT's linear
attention does, after casting its queries, keys and values with ``.float()``). ``torch.export``
keeps such a block as one ``wrap_with_autocast`` call of a submodule. This pass copies the
submodule's ops in its place, each marked ``meta["autocast_off"]``, so that tilec's rules see
them as any other op; ``NodeSpec.autocast_off`` carries the mark into the plan, and the tiles run
those ops with autocast off (``tilec.runtime.reduce.autocast_off``), as the model does. Outside
autocast the block is its ops. A block turning autocast *on* inside ``forward`` is refused.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch

WRAP = torch.ops.higher_order.wrap_with_autocast
#: The metadata key marking an op the model computes with autocast off.
OFF = "autocast_off"


def inline_autocast(program: torch.export.ExportedProgram,
                    refuse: Callable[[torch.fx.Node, str], Exception]) -> None:
    """Inline ``program``'s ``wrap_with_autocast`` blocks that turn autocast off (module
    docstring), in place; ``refuse(node, why)`` is raised for one that turns it on or holds
    another block."""
    graph = program.graph
    blocks = [node for node in graph.nodes if node.op == "call_function" and node.target == WRAP]
    for node in blocks:
        _, _, enabled, _, submodule, *operands = node.args
        if enabled:
            raise refuse(node, "turns torch.autocast on inside forward, which tilec does not follow: let the "
                               "step's own torch.autocast choose the dtypes")
        body = getattr(program.graph_module, submodule.target)
        if (any(sub.op not in ("placeholder", "call_function", "output") for sub in body.graph.nodes)
                or any(user.target is not operator.getitem for user in node.users)):
            raise refuse(node, "nests another block inside a torch.autocast(enabled=False) block, which tilec "
                               "does not inline")
        results = _copied(graph, body, operands, node)
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not submodule.users:
            graph.erase_node(submodule)
            delattr(program.graph_module, submodule.target)
    if blocks:
        graph.lint()
        program.graph_module.recompile()


def _copied(graph: torch.fx.Graph, submodule: torch.fx.GraphModule, operands, before: torch.fx.Node) -> list:
    """``submodule``'s ops copied into ``graph`` before ``before``, reading ``operands``; its results."""
    env = dict(zip((n for n in submodule.graph.nodes if n.op == "placeholder"), operands, strict=True))
    results = []
    with graph.inserting_before(before):
        for sub in submodule.graph.nodes:
            if sub.op == "output":
                results = list(torch.fx.node.map_arg(sub.args[0], env.__getitem__))
            elif sub.op == "call_function":
                env[sub] = graph.node_copy(sub, env.__getitem__)
                env[sub].meta = {**before.meta, **sub.meta, OFF: True}
    return results
