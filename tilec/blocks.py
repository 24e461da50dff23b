"""``blocks``: space to depth and depth to space written with views become pixel (un)shuffles.

A model may move ``r`` x ``r`` blocks of pixels into channels by hand, as TResNet's stem does
(``x.view(N, C, H / r, r, W / r, r).permute(0, 3, 5, 1, 2, 4).view(N, C * r * r, H / r, W / r)``),
and back (``DepthToSpace``). The views cut an image axis into (blocks, pixels of a block) or merge
them, which no rule follows; this pass rewrites them, value for value, into ``pixel_unshuffle`` /
``pixel_shuffle`` (``tilec.ops.shuffle``) and views and permutes of the channels alone:

* space to depth: a view of a 4-D ``x`` (N, C, H, W) as ``(N, C, H / r, r, W / r, r)`` (``r >= 2``)
  becomes ``u = pixel_unshuffle(x, r)`` viewed as ``(N, C, r, r, H / r, W / r)`` and permuted by
  ``(0, 1, 4, 2, 5, 3)``; a permute reading the view is composed with that one (TResNet's leaves
  the blocks' pixels before the channels and the image axes last);
* depth to space: a view of a 6-D ``y`` (N, C, h, r, w, r) as ``(N, C, h * r, w * r)`` becomes
  ``pixel_shuffle`` of ``y`` permuted by ``(0, 1, 3, 5, 2, 4)`` and viewed as ``(N, C * r * r, h,
  w)``; a permute making ``y`` (through ``contiguous``) is composed with that one.

New nodes are named after the view they replace (``view_unshuffle``, ``view_shuffle``...); a
composed permute after the permute it replaces (``permute_blocks``).
"""

from __future__ import annotations

import torch

from tilec.functionalize import Rewrite, fake_shape

aten = torch.ops.aten
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
PERMUTE = aten.permute.default
#: Ops ``contiguous`` leaves between a permute and a view.
COPIES = {aten.contiguous.default, aten.clone.default}
#: The permute taking ``pixel_unshuffle``'s blocks (N, C, r, r, h, w) to the view's (N, C, h, r, w, r).
TO_VIEW = (0, 1, 4, 2, 5, 3)
#: The permute taking the view's (N, C, h, r, w, r) to ``pixel_shuffle``'s blocks (N, C, r, r, h, w).
TO_BLOCKS = (0, 1, 3, 5, 2, 4)


def _split(source: tuple[int, ...], target: tuple[int, ...]) -> int | None:
    """``r`` where ``target`` cuts both image axes of the 4-D ``source`` into blocks of ``r``."""
    if len(source) != 4 or len(target) != 6 or target[3] != target[5] or target[3] < 2:
        return None
    n, c, rows, cols = source
    r = target[3]
    return r if target == (n, c, rows // r, r, cols // r, r) and rows % r == 0 and cols % r == 0 else None


def _composed(first, then) -> list[int]:
    """The one permute doing ``first`` then ``then``."""
    return [first[k] for k in then]


class _Rewrite(Rewrite):
    def run(self) -> bool:
        changed = False
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target not in VIEWS or not isinstance(node.args[0], torch.fx.Node):
                continue
            source, target = fake_shape(node.args[0]), fake_shape(node)
            if r := _split(source, target):
                self.space_to_depth(node, r)
                changed = True
            elif r := _split(target, source):
                self.depth_to_space(node, r)
                changed = True
        return changed

    def space_to_depth(self, view, r: int):
        n, c, rows, cols = fake_shape(view.args[0])
        with self.graph.inserting_before(view):
            unshuffled = self.new(aten.pixel_unshuffle.default, [view.args[0], r], view, f"{view.name}_unshuffle")
            blocks = self.new(aten.view.default, [unshuffled, [n, c, r, r, rows // r, cols // r]], view,
                              f"{view.name}_blocks")
        for user in list(view.users):
            if user.target == PERMUTE and user.args[0] is view:
                with self.graph.inserting_before(user):
                    order = _composed(TO_VIEW, [d % 6 for d in user.args[1]])
                    permuted = self.new(PERMUTE, [blocks, order], user, f"{user.name}_blocks")
                user.replace_all_uses_with(permuted)
                self.graph.erase_node(user)
        if view.users:
            with self.graph.inserting_before(view):
                view.replace_all_uses_with(self.new(PERMUTE, [blocks, list(TO_VIEW)], view, f"{view.name}_permute"))
        self.graph.erase_node(view)

    def depth_to_space(self, view, r: int):
        source, passed = view.args[0], [view]
        n, c, rows, _, cols, _ = fake_shape(source)
        order = list(TO_BLOCKS)
        while source.target in COPIES and len(source.users) == 1:
            passed.append(source)
            source = source.args[0]
        if source.target == PERMUTE and len(source.users) == 1:
            passed.append(source)
            order, source = _composed([d % 6 for d in source.args[1]], order), source.args[0]
        with self.graph.inserting_before(view):
            if order != sorted(order):
                source = self.new(PERMUTE, [source, order], view, f"{view.name}_blocks")
            merged = self.new(aten.reshape.default, [source, [n, c * r * r, rows, cols]], view, f"{view.name}_merged")
            view.replace_all_uses_with(self.new(aten.pixel_shuffle.default, [merged, r], view, f"{view.name}_shuffle"))
        for node in passed:  # the view, then what it alone read
            self.graph.erase_node(node)


def blocks(program: torch.export.ExportedProgram) -> bool:
    """Rewrite ``program``'s hand-written space to depth and depth to space in place (module
    docstring); whether any was rewritten."""
    return _Rewrite.apply(program)
