"""``narrow_broadcasts``: a statistic ``expand``-ed to an image's shape stays small until it meets
the image.

A model may broadcast a per-sample or per-group statistic over the pixels by hand before it
divides by it, as timm's EvoNorm does (``std.expand(B, G, C / G, H, W).reshape(B, C, H, W)``, a
group's standard deviation per channel and pixel). The expanded tensor has the image's size but
is computed from no pixel of it, which no rule can slice. This pass rewrites such chains, value
for value, so that the dims an ``expand`` only broadcasts stay of size 1 through the views after
it, and the element-wise op meeting the image broadcasts them itself:

* ``reshape(expand(s, shape), target)``, where ``shape`` and ``target`` share their last dims and
  ``s`` has size 1 along some of them (the broadcast dims), becomes ``expand(reshape(expand(s,
  shape'), target'), target)``: ``shape'`` and ``target'`` are ``shape`` and ``target`` with those
  dims 1 (the other expanded dims, merged into the channels, are repeated as before, in a small
  tensor);
* an ``expand`` read only by element-wise ops that broadcast (``add``, ``mul``, ``div``, ``where``...)
  next to a tensor of its full shape is replaced by its source in them.

Backpropagating an ``expand`` sums over its broadcast dims, as backpropagating a broadcasting op
does, so the gradients are the same sums. New nodes are named after the ``expand``
(``expand_narrow``, ``expand_narrow_view``).
"""

from __future__ import annotations

import torch

from tilec.functionalize import Rewrite, fake_shape

aten = torch.ops.aten
EXPAND = aten.expand.default
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
#: Element-wise ops whose tensor arguments broadcast against each other.
BROADCASTING = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.div.Tensor_mode,
                aten.rsub.Tensor, aten.where.self, aten.maximum.default, aten.minimum.default, aten.pow.Tensor_Tensor,
                aten.addcmul.default, aten.addcdiv.default}


def _common_tail(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many last dims ``a`` and ``b`` share."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _broadcast(source: tuple[int, ...], shape: tuple[int, ...]) -> set[int]:
    """The dims of ``shape`` an ``expand`` of ``source`` to it broadcasts (``source`` 1 there, ``shape`` more)."""
    offset = len(shape) - len(source)
    return {d for d, size in enumerate(shape) if size > 1 and (d < offset or source[d - offset] == 1)}


class _Rewrite(Rewrite):
    def run(self) -> bool:
        changed = False
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target == EXPAND and isinstance(node.args[0], torch.fx.Node):
                changed |= self.defer_through_views(node)
        for node in list(self.graph.nodes):
            if node.op == "call_function" and node.target == EXPAND and isinstance(node.args[0], torch.fx.Node):
                changed |= self.leave_to_users(node)
        return changed

    def defer_through_views(self, expand) -> bool:
        """The first bullet of the module docstring, for each view reading ``expand``."""
        shape = fake_shape(expand)
        broadcast = _broadcast(fake_shape(expand.args[0]), shape)
        changed = False
        for view in [user for user in expand.users if user.target in VIEWS]:
            target = fake_shape(view)
            tail = _common_tail(shape, target)
            deferred = {d - len(shape) for d in broadcast if d >= len(shape) - tail}  # negative: from the end
            if not deferred:
                continue
            narrow = [1 if d - len(shape) in deferred else size for d, size in enumerate(shape)]
            narrow_target = [1 if d - len(target) in deferred else size for d, size in enumerate(target)]
            with self.graph.inserting_before(view):
                small = expand.args[0]
                if list(fake_shape(small)) != narrow:
                    small = self.new(EXPAND, [small, narrow], expand, f"{expand.name}_narrow")
                small = self.new(aten.reshape.default, [small, narrow_target], view, f"{view.name}_narrow")
                view.replace_all_uses_with(self.new(EXPAND, [small, list(target)], view, f"{view.name}_expand"))
            self.graph.erase_node(view)
            changed = True
        if changed and not expand.users:
            self.graph.erase_node(expand)
        return changed

    def leave_to_users(self, expand) -> bool:
        """The second bullet of the module docstring."""
        shape = fake_shape(expand)
        users = list(expand.users)
        if not users or not all(user.target in BROADCASTING and self.meets_full(user, expand, shape) for user in users):
            return False
        for user in users:
            user.replace_input_with(expand, expand.args[0])
        self.graph.erase_node(expand)
        return True

    @staticmethod
    def meets_full(user, expand, shape: tuple[int, ...]) -> bool:
        """Whether ``user`` reads ``expand`` beside another tensor of ``expand``'s full shape."""
        return any(isinstance(arg, torch.fx.Node) and arg is not expand and fake_shape(arg) == shape
                   for arg in user.args)


def narrow_broadcasts(program: torch.export.ExportedProgram) -> bool:
    """Rewrite ``program``'s expanded statistics in place (module docstring); whether any was."""
    return _Rewrite.apply(program)
