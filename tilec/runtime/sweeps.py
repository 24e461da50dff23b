"""``Tiled``: a tiled segment as an autograd function, its reductions computed by sweeps.

A tile function ``fn(xs, bs, p, arena, r, o, want)`` computes a tile from its slices ``xs`` of the
segment's sliced inputs, the broadcast inputs ``bs``, the model tensors ``p`` and the *leaves*
``r`` (by name: the results of the segment's reductions and of its small ops), ``o`` giving the
origin of each partial; it returns the owned parts of the image outputs and the partials of the
reductions ``want`` names (``wanted``; ``None`` for the others and for a direct level's). A level's
*prefix* function returns its partials only. A pass computes only the partials it uses: the last
forward sweep none, a backward sweep those whose shares it back-propagates.

Forward. Level 0 (reductions of nothing, small ops of the inputs) is computed once; then per level
``l``, a sweep runs every tile up to level ``l``'s partials under ``no_grad`` (a direct level reads
them off the inputs' owned slices), and its combine merges them into its results; the last sweep
makes the image outputs. A level whose reductions are BatchNorms in eval mode runs no sweep: its
combine reads the running statistics.

Backward, with autograd doing the calculus (the leaves of level ``l`` are ``r_l``; ``g_t`` a tile's
owned output gradient; ``H_{l,t}`` the gradient of tile ``t``'s level-``l`` partials):

1. from the top level down, a level whose results tiles read (``swept``, not direct) gets a sweep:
   each tile is recomputed with ``r_l`` requiring grad, and the gradient of its outputs (with
   ``g_t``) and of its higher partials (their shares of ``H``) with respect to ``r_l`` is summed over
   the tiles: ``G_l``, complete, as nothing else depends on ``r_l``; then the level's combine runs
   again, from its merged partials as leaves, and back-propagates ``G_l``: that gives ``H_l``, the
   gradient of the merged partials, and the gradients of the lower leaves the combine read (added
   to theirs) and of its parameters. A tile's partials get their share of ``H_l``
   (``tilec.runtime.reduce.shares_of``, in closed form) in the sweeps that recompute the tile;
2. the last sweep recomputes each tile and back-propagates ``g_t`` and every ``H`` into the
   parameters and the segment's inputs; it also sums the gradients of the leaves of level 0, of a
   direct level 1 and of a level that computes no statistics in this step (BatchNorms in eval
   mode), which need no sweep of their own (nothing in the tiles depends on their partials);
3. their combines back-propagate their ``G`` (a normalisation's into its weight and bias,
   ``tilec.runtime.reduce.norm_affine``); a direct level's partials' shares are added to the
   input gradient over each tile's owned slices; last, level 0's combine back-propagates into the
   broadcast inputs and the parameters.

Each forward pass carves its tiles' tensors from one arena (``tilec.runtime.arena``). A backward pass
takes fresh ones: an arena would keep every tensor of a tile's recompute until the tile's backward
ends, where fresh ones go as autograd releases them (measured with one: later steps peaked 1.16-1.44x
the prediction), and the cost model counts the latter. The step keeps one merged partial per
reduction, whatever the number of tiles: each tile's is merged into it as the tile runs. Ranks of a
process group share the tiles: they exchange their merged partials (every rank merges them in rank
order) and sum the leaves' gradients.

What a tile call returns (its outputs, partials, gradients) is used before the next call, or kept as
a copy: replayed as a CUDA graph (``tilec.runtime.compiled``), the next call's replay writes over it.
"""

import torch
import torch.distributed as dist

from tilec.runtime.arena import Arena
from tilec.runtime.batches import Pending, batch_partials, stack_in, unstacked
from tilec.runtime.bits import differing, fingerprints
from tilec.runtime.kernels import copy_in, narrow
from tilec.runtime.reduce import Gradients, merged, needs_grad, shares_of
from tilec.runtime.reuse import Keys
from tilec.runtime.sources import Source, region
from tilec.runtime.tiles import (
    Progress,
    Rolled,
    autocast_state,
    grad_channels_last,
    input_gradient,
    outputs,
    slices,
    sum_over,
)


def flat(value):
    """The tensors of a leaf's value (a tensor, or a tuple of them)."""
    if value is None:
        return []
    return [value] if isinstance(value, torch.Tensor) else [t for t in value if isinstance(t, torch.Tensor)]


def grad_leaf(value):
    """``value`` (a tensor, or a tuple of them and numbers) with its floating tensors detached and
    requiring grad."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.is_floating_point())
    return tuple(grad_leaf(t) for t in value) if isinstance(value, tuple) else value


def grad_pairs(grads, others):
    """Two tiles' owned output gradients (``Sweep.owned_grads``) paired, where the outputs have one."""
    return [(g, h) for (g, _), (h, _) in zip(grads, others, strict=True) if g is not None]


def by_name(names, leaves, grads):
    """``grads`` (one per tensor of the ``leaves`` of ``names`` that requires grad, in order)
    per name: for each of its tensors, its gradient or ``None``."""
    found, position = {}, 0
    for name in names:
        found[name] = []
        for t in flat(leaves[name]):
            found[name].append(grads[position] if t.requires_grad else None)
            position += t.requires_grad
    return found


def add_grad(store, name, grads):
    """Add ``grads`` (per tensor of leaf ``name``, ``None`` for none) into ``store[name]``."""
    if all(g is None for g in grads):
        return
    known = store.get(name)
    if known is None:
        store[name] = list(grads)
    else:
        store[name] = [a if b is None else b if a is None else a + b for a, b in zip(known, grads, strict=True)]


def origins(row, col):
    """Per reduction, the first row and column of the tile's owned part (its partial's origin)."""
    return [(r[0], c[0]) for r, c in zip(row[3], col[3], strict=True)]


def wanted(segment, levels):
    """Per reduction of ``segment``, whether its partial is wanted: whether its level's index is
    among ``levels``."""
    return tuple(level.index in levels for level in segment.levels for _ in range(level.count))


def read_tile(segment, xs, keys, index, row, col):
    """One tile's slices, and its key (``tilec.runtime.reuse``), found once per step in ``keys``."""
    tile = slices(segment, xs, row, col)
    return tile, keys.find(segment, xs, index, row, col)


def kept(part):
    """A tile's partials ``part`` (per reduction, ``None`` or its tensors and numbers) copied, to
    outlive the next tile call (module docstring)."""
    return tuple(None if partial is None else tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in partial)
                 for partial in part)


def stable_grads(tensors):
    """Give each of ``tensors`` that requires grad and has none a zero ``grad``, which the tiles'
    backward passes add into: autograd would otherwise keep the first as it is, which a CUDA graph's
    next replay writes over (module docstring)."""
    for t in tensors:
        if t.requires_grad and t.grad is None:
            t.grad = torch.zeros_like(t)


def merge_tile(found, part, kinds):
    """A tile's partials ``part`` (per reduction, merged by ``kinds``) merged into ``found``, those
    of the tiles before it (``None``: none; the first tile's are kept as a copy)."""
    if found is None:
        return kept(part)
    return tuple(merged(kind, (a, b)) for kind, a, b in zip(kinds, found, part, strict=True))


def exchange(group, found, like, kinds):
    """The merged partials of every rank of ``group``, merged in rank order on every rank
    (``found``: this rank's, ``None`` where it ran no tile; ``like``: one tile's, for their shapes):
    each rank fills its row of a stack of their tensors, and of a table of whether it ran tiles
    and of their counts (numbers), zeros elsewhere, and the stacks and the table are summed."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = next(t for part in like for t in part if isinstance(t, torch.Tensor)).device
    numbers = sum(not isinstance(t, torch.Tensor) for part in like for t in part)
    table = torch.zeros(world, 1 + numbers, dtype=torch.float64)
    stacks = [[torch.zeros((world, *t.shape), dtype=t.dtype, device=t.device) if isinstance(t, torch.Tensor)
               else None for t in part] for part in like]
    if found is not None:
        table[rank] = torch.tensor([1, *(t for part in found for t in part if not isinstance(t, torch.Tensor))],
                                   dtype=torch.float64)
        for stack, part in zip(stacks, found, strict=True):
            for rows, t in zip(stack, part, strict=True):
                if rows is not None:
                    rows[rank] = t
    table = table.to(device)
    sum_over(group, [table, *(rows for stack in stacks for rows in stack if rows is not None)])
    ranks = [(k, iter(round(n) for n in row[1:])) for k, row in enumerate(table.tolist()) if row[0] > 0]  # one read
    return tuple(merged(kind, [tuple(next(counts) if rows is None else rows[k] for rows in stack)
                               for k, counts in ranks])
                 for kind, stack in zip(kinds, stacks, strict=True))


def forward_pass(segment, run, xs, keys, label, direct, run_call, reuse):
    """The tiles of one forward pass of ``segment`` in the order this process runs them: a tile
    whose key (``keys``, ``tilec.runtime.reuse``) an earlier one had is reused
    (``reuse(key, row, col)``); a key's first tile that runs by itself (``alone``) is one call
    ``run_call([(index, row, col, slices)], key)``; the others, consecutive tiles of one shape class,
    ``segment.batch`` per call (``run_call(batch, None)``; one by one for a ``direct`` level, which
    reads owned slices and no tile's). Progress is reported under ``label``."""
    progress, known, pending = Progress(run, label, segment.count(run.group)), set(), Pending(
        1 if direct else segment.batch)
    if not direct:
        keys.prepare(segment, xs, run.group)
    repeated = set() if any(isinstance(x, Source) for x in xs) else set(keys.values())

    def flush():
        if pending:
            batch = pending.take()
            run_call(batch, None)
            progress.ran(len(batch))

    for index, row, col in segment.tiles(run.group, xs, owned=direct):
        tile, key = (None, None) if direct else read_tile(segment, xs, keys, index, row, col)
        if key is not None and key in known:
            reuse(key, row, col)
            progress.reused()
        elif alone(segment, key, repeated):
            run_call([(index, row, col, tile)], key)
            known.add(key)
            progress.ran(1)
        else:
            if not pending.fits(row, col):
                flush()
            pending.add((index, row, col, tile))
    flush()


def alone(segment, key, repeated):
    """Whether a forward pass runs a tile whose ``key`` no tile before it had by itself, so that the
    later tiles of its key reuse it (``tilec.runtime.reuse``): every such tile of a segment running
    its tiles one by one; in one that batches them, those whose slices are all constant (the
    background, where tiles repeat) and those whose key a later tile of the pass has (``repeated``:
    in a segment reading only tensors, every key, ``tilec.runtime.reuse.Keys.prepare``), while the
    others run stacked with their neighbours."""
    if key is None:
        return False
    return segment.batch == 1 or key in repeated or all(kind == "c" for kind, _ in key[3])


def summed(pieces):
    """The sum of same-shaped tensors ``pieces`` in their order, accumulated in float32 or wider,
    in their dtype."""
    if len(pieces) == 1:
        return pieces[0]
    total = pieces[0].to(torch.promote_types(pieces[0].dtype, torch.float32), copy=True)
    for piece in pieces[1:]:
        total.add_(piece)
    return total.to(pieces[0].dtype)


#: The fewest tiles of one key whose owned output gradients differ that run apart (``Sweep.linear``
#: and ``Sweep.band``): two recomputes, a backward and an input gradient's each, against a whole
#: backward each.
APART = 3


def add_input_grads(sums, row, col, grads):
    """Add one tile's input gradients ``grads`` (per sliced input, ``None`` for none) into their
    accumulators ``sums`` at its reads (``row``, ``col``: its table entries), moving a rolled one
    on to its reads first; a tile that reads no row of an input (its read is only border padding)
    adds nothing to it."""
    for k, (accumulated, grad, (start, stop)) in enumerate(zip(sums, grads, row[0], strict=True)):
        if accumulated is None or stop <= start:
            continue
        accumulated.move(start)
        if grad is not None:
            accumulated.add(row[0][k], col[0][k], grad)


class Tiled(torch.autograd.Function):
    """The tiled segment ``segment`` run as ``run`` says (module docstring): its inputs ``tensors``
    are its sliced inputs, its broadcast inputs and its model tensors; it returns its outputs."""

    @staticmethod
    def forward(ctx, segment, run, *tensors):
        count = len(segment.sliced)
        xs, rest = tensors[:count], tensors[count:]
        bs, p = rest[:segment.broadcast], rest[segment.broadcast:]
        device = run.device.type
        autocast = (device, *autocast_state(device))
        arena = segment.arena(run, autocast, run.kernels(device))
        r, parts, active, keys = {}, {}, {}, Keys()
        # Without autocast's cache: it would keep a cast copy of every parameter the tiles read
        # until the step's forward ends; each tile's call casts its own (the plan counts one per call).
        with torch.autocast(autocast[0], dtype=autocast[2], enabled=autocast[1], cache_enabled=False):
            for level in segment.levels:
                active[level.index] = level.index > 0 and level.active(run.train)
                if active[level.index]:
                    parts[level.index] = Tiled.partials(segment, level, run, xs, bs, p, arena, r, keys)
                level.combine(parts.get(level.index), r, run.like(), bs, p, run.train, True)
            outs = Tiled.images(segment, run, xs, bs, p, arena, r, keys) if segment.images else []
        segment.learn(run, autocast, arena)
        del arena
        ctx.segment, ctx.run, ctx.autocast = segment, run, autocast
        ctx.r, ctx.parts, ctx.active, ctx.keys = r, parts, active, keys
        ctx.sources = [x if isinstance(x, Source) else None for x in tensors]  # read again by region
        ctx.save_for_backward(*(t for t in tensors if not isinstance(t, Source)))
        images = iter(outs)
        return tuple(next(images) if spec[0] == "image" else _detached(r[spec[1]]) for spec in segment.outputs)

    @staticmethod
    def partials(segment, level, run, xs, bs, p, arena, r, keys):
        """One forward sweep (``forward_pass``): per reduction of ``level``, the tiles' partials merged
        as the tiles run (and over the ranks of a group), which the step keeps for its backward; a
        reused tile merges its key's first tile's partials."""
        def partial(batch):
            arena.reset()
            _, row, col, tile = batch[0]
            if level.direct:
                return segment.direct(segment.owned(xs, row, col), bs, p, r, origins(row, col))
            fn = segment.function(arena.kernels, (row[2], col[2]), level)
            found = fn(stack_in(arena, [item[3] for item in batch]), bs, p, arena, r, origins(row, col), want)
            return batch_partials(found, len(batch), level.merges)

        found, known, want = None, {}, wanted(segment, {level.index})

        def run_call(batch, key):
            nonlocal found
            part = partial(batch)
            if key is not None:  # kept past the arena's reset
                known[key] = kept(part)
            found = merge_tile(found, part, level.merges)

        def reuse(key, row, col):
            nonlocal found
            found = merge_tile(found, known[key], level.merges)

        forward_pass(segment, run, xs, keys, f"{segment.label} level {level.index}", level.direct, run_call, reuse)
        if run.group is not None:
            like = found
            if like is None:  # a rank without tiles here: one tile tells the partials' shapes
                _, row, col = next(segment.tiles())
                like = partial([(0, row, col, slices(segment, xs, row, col))])
            found = exchange(run.group, found, like, level.merges)
        return found

    @staticmethod
    def images(segment, run, xs, bs, p, arena, r, keys):
        """The last forward sweep (``forward_pass``): the image outputs, every tile writing its owned
        parts; a reused tile copies its key's first tile's."""
        group, outs, first, want = run.group, None, {}, wanted(segment, ())

        def run_call(batch, key):
            nonlocal outs
            arena.reset()
            _, row, col, _ = batch[0]
            fn = segment.function(arena.kernels, (row[2], col[2]))
            parts, _ = fn(stack_in(arena, [item[3] for item in batch]), bs, p, arena, r, origins(row, col), want)
            if outs is None:
                outs = outputs(segment, parts, zeros=group is not None)
            for k, (out, (_, spatial, _), part) in enumerate(zip(outs, segment.images, parts, strict=True)):
                for (_, tile_row, tile_col, _), piece in zip(batch, unstacked(part, len(batch)), strict=True):
                    narrow(out, spatial, tile_row[1][k], tile_col[1][k]).copy_(piece)
            if key is not None:
                first[key] = row[1], col[1]

        def reuse(key, row, col):
            for out, (_, spatial, _), rows, cols, source_rows, source_cols in zip(
                    outs, segment.images, row[1], col[1], *first[key], strict=True):
                narrow(out, spatial, rows, cols).copy_(narrow(out, spatial, source_rows, source_cols))

        forward_pass(segment, run, xs, keys, f"{segment.label} forward", False, run_call, reuse)
        if outs is None:  # this rank has no tile here: one tile tells the output dtypes
            _, row, col = next(segment.tiles())
            arena.reset()
            fn = segment.function(arena.kernels, (row[2], col[2]))
            parts, _ = fn(copy_in(arena, slices(segment, xs, row, col)), bs, p, arena, r, origins(row, col), want)
            outs = outputs(segment, parts, zeros=True)
        if group is not None:
            sum_over(group, outs)  # owned parts are disjoint: the sum puts every rank's tiles in place
        return outs

    @staticmethod
    def backward(ctx, *grads):
        segment, run, saved = ctx.segment, ctx.run, iter(ctx.saved_tensors)
        tensors = [source if source is not None else next(saved) for source in ctx.sources]
        group, r, parts = run.group, ctx.r, ctx.parts
        needs = ctx.needs_input_grad[2:]
        count = len(segment.sliced)
        xs = [x if isinstance(x, Source) else x.detach() for x in tensors[:count]]  # sliced: Sweep's docstring
        leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors[count:], needs[count:], strict=True)]
        bs, p = leaves[:segment.broadcast], leaves[segment.broadcast:]
        image_grads = [g for spec, g in zip(segment.outputs, grads, strict=True) if spec[0] == "image"]
        totals = {}  # per leaf, its gradient so far (a list over its tensors)
        for spec, grad in zip(segment.outputs, grads, strict=True):
            if spec[0] == "leaf" and grad is not None:
                add_grad(totals, spec[1], [grad] if len(flat(r[spec[1]])) == 1 else list(grad))
        sums = [input_gradient(segment, k, x, group) if need else None
                for k, (x, need) in enumerate(zip(xs, needs[:count], strict=True))]
        arena = Arena(run.device, run.kernels(run.device.type))  # fresh tensors: module docstring
        if arena.kernels.graphs:
            stable_grads(leaves)
        sweep = Sweep(segment, run, ctx.autocast, xs, bs, p, leaves, image_grads, arena, ctx.keys)
        shares = {}  # per level, per reduction its merged partial and their gradients
        for level in reversed(segment.levels):
            if level.index == 0 or not ctx.active[level.index] or level.direct:
                continue
            if level.swept:
                for name, grads_of in sweep.leaf_grads(r, level.results, shares).items():
                    add_grad(totals, name, grads_of)
            shares[level.index] = Tiled.combine_backward(segment, level, run, ctx.autocast, xs, bs, p, r, parts, totals)
        later = [level for level in segment.levels
                 if level.index == 0 or level.direct or not ctx.active[level.index]]
        collected = sweep.last(r, [name for level in later for name in level.results], shares, sums)
        for name, grads_of in collected.items():
            add_grad(totals, name, grads_of)
        for level in reversed(later):
            share = Tiled.combine_backward(segment, level, run, ctx.autocast, xs, bs, p, r, parts, totals)
            if level.direct and ctx.active[level.index]:
                sweep.direct_inputs(r, level, share, sums)
        del arena, sweep
        gx = [None if accumulated is None else accumulated.result() for accumulated in sums]
        del sums
        gp = [leaf.grad if leaf.requires_grad else None for leaf in leaves]
        if group is not None:  # a rank without tiles here contributes zeros
            gp = [torch.zeros_like(leaf) if leaf.requires_grad and g is None else g
                  for leaf, g in zip(leaves, gp, strict=True)]
            sum_over(group, [g for g in (*gx, *gp) if g is not None])
        return (None, None, *gx, *gp)

    @staticmethod
    def combine_backward(segment, level, run, autocast, xs, bs, p, r, parts, totals):
        """Back-propagate the gradients ``totals`` of ``level``'s results through its combine, run
        again from its merged partials (``Tiled.partials``) as leaves (under the forward's
        ``autocast`` state): per reduction, its merged partial and their gradients (none where
        nothing is wanted); the lower leaves' gradients are added to ``totals``, and the parameters'
        and broadcast inputs' to their ``grad`` (on one rank of a group: every rank combines alike)."""
        wanted = [(name, k, t) for name in level.results for k, t in enumerate(flat(r[name]))
                  if name in totals and totals[name][k] is not None and t.is_floating_point()]
        level_parts = parts.get(level.index) or ()
        if not wanted:
            return []
        with torch.enable_grad(), torch.autocast(autocast[0], dtype=autocast[2], enabled=autocast[1]):
            sources = [grad_leaf(part) for part in level_parts]
            lower = {name: grad_leaf(value) for name, value in r.items() if name not in level.results}
            again = {**r, **lower}  # the level's random results are read back, the others made again
            level.combine(sources, again, run.like(), bs, p, run.train, False)
            wanted = [(name, k, t) for name, k, t in wanted if flat(again[name])[k].requires_grad]  # not random ones
            results = [flat(again[name])[k] for name, k, _ in wanted]
            ins = [t for part in sources for t in part if needs_grad(t)]
            ins += [t for value in lower.values() for t in flat(value) if t.requires_grad]
            params = [t for t in (*bs, *p) if t.requires_grad]
            found = torch.autograd.grad(results, ins + params, [totals[name][k] for name, k, _ in wanted],
                                        allow_unused=True) if results else [None] * len(ins + params)
        got = dict(zip(map(id, ins + params), found, strict=True))
        for name, value in lower.items():
            add_grad(totals, name, [got.get(id(t)) for t in flat(value)])
        if run.group is None or torch.distributed.get_rank(run.group) == 0:
            for t in params:
                grad = got[id(t)]
                if grad is not None:
                    t.grad = grad if t.grad is None else t.grad + grad
        return [(part, Gradients(got.get(id(t)) for t in source))
                for part, source in zip(level_parts, sources, strict=True)]


def backward_into(pairs, held, others=()):
    """Back-propagate the (tensor, gradient) ``pairs``: the gradients of the tensors ``others`` are
    returned (``None`` where none), those of the tensors ``held`` that require grad (leaves keeping
    theirs in ``grad``) are added to their ``grad`` in one op, as autograd's ``backward`` would add
    them one by one; where one has none, it gets a copy (autograd may hand one tensor to several
    inputs, or hand on a gradient it was given, which later adds would write into)."""
    held = [t for t in held if t.requires_grad]
    if not pairs or not (held or others):
        return [None] * len(others)
    found = torch.autograd.grad([a for a, _ in pairs], [*others, *held], [b for _, b in pairs], allow_unused=True)
    added = []
    for t, g in zip(held, found[len(others):], strict=True):
        if g is None:
            continue
        if t.grad is None:
            t.grad = g.clone()
        else:
            added.append((t.grad, g))
    if added:
        torch._foreach_add_([t for t, _ in added], [g for _, g in added])
    return found[:len(others)]


def _detached(value):
    return value.detach() if isinstance(value, torch.Tensor) else tuple(t.detach() for t in value)


class Sweep:
    """The backward's sweeps over the tiles of one segment (``Tiled.backward``); ``keys``: the
    tiles' keys the forward found (``tilec.runtime.reuse``). The sliced inputs ``xs`` come detached
    (or as ``Source``s): a tile's slices are views of them or fresh reads, which may require grad of
    their own."""

    def __init__(self, segment, run, autocast, xs, bs, p, leaves, image_grads, arena, keys):
        self.segment, self.run, self.autocast = segment, run, autocast
        self.xs, self.bs, self.p, self.leaves, self.image_grads, self.arena = xs, bs, p, leaves, image_grads, arena
        self.keys = keys
        self.frozen = [t.detach() for t in bs], [t.detach() for t in p]

    def groups(self, shares, rolled, inputs):
        """Per representative's index, the tiles it back-propagates for in this sweep (itself first,
        ``(index, row, col)``), the set of their other indices, the representatives whose tiles are
        *apart* and their *bands*: tiles of one key (``tilec.runtime.reuse``), where the shares of
        the levels in ``shares`` are the same for identical partials. In a sweep that wants
        ``inputs``' gradients, a key's tiles are apart where their owned output gradients do not all
        have the representative's bits and they are ``APART`` or more (fewer run on their own), or
        where an input gradient is ``rolled``: the representative back-propagates the sum of their
        gradients into everything but the inputs (``Sweep.linear``), and each tile its own into its
        input gradients, band by band (``Sweep.band``). A band is the key's tiles, or with a
        ``rolled`` input gradient (whose accumulators hold a band of rows) those of one row; per
        index of a band's first tile, its tiles and whether their owned output gradients all have
        the first's bits."""
        for level in self.segment.levels:
            for kind, (_, grads) in zip(level.merges, shares.get(level.index, ()), strict=False):
                if kind == "argmax" and any(g is not None for g in grads):
                    return {}, set(), set(), {}
        first, groups = {}, {}
        for index, row, col in self.segment.tiles(self.run.group):
            key = self.keys.get(index)
            if key is None:
                continue
            if key not in first:
                first[key] = index
                groups[index] = [(index, row, col)]
            else:
                groups[first[key]].append((index, row, col))
        several = [(index, group) for index, group in groups.items() if inputs and len(group) > 1]
        same = dict(zip((index for index, _ in several), self.agreeing([group for _, group in several]), strict=True))
        apart, bands, checked = set(), {}, []
        for index, group in several:
            if not same[index] and len(group) < APART:
                del group[1:]
            elif rolled or not same[index]:
                apart.add(index)
                by_band = {}
                for tile in group:
                    by_band.setdefault(tile[1][0] if rolled else None, []).append(tile)
                for band in by_band.values():
                    bands[band[0][0]] = band, rolled and same[index]
                    if rolled and not same[index]:
                        checked.append(band)
        for band, agree in zip(checked, self.agreeing(checked), strict=True):
            bands[band[0][0]] = band, agree
        return groups, {index for group in groups.values() for index, _, _ in group[1:]}, apart, bands

    def owned_grads(self, row, col):
        """Per image output, the owned output gradient of tile ``row`` x ``col`` (``None`` where the
        output has none) and the output's image dims."""
        return [(None if g is None else narrow(g, spatial, rows, cols), spatial)
                for g, (_, spatial, _), rows, cols in zip(self.image_grads, self.segment.images, row[1], col[1],
                                                          strict=True)]

    def agreeing(self, runs):
        """Per run of tiles (``(index, row, col)`` each), whether the owned output gradients of
        all its tiles have the bits of its first's, read off the device at once."""
        pairs, owners = [], []
        for n, (first, *others) in enumerate(runs):
            for _, row, col in others:
                found = grad_pairs(self.owned_grads(row, col), self.owned_grads(*first[1:]))
                pairs += found
                owners += [n] * len(found)
        agree = [True] * len(runs)
        for n, differs in zip(owners, differing(pairs), strict=True):
            agree[n] = agree[n] and not differs
        return agree

    def recompute(self, batch, r, needs, shares, frozen=False):
        """The function of the tiles ``batch`` (``(index, row, col)`` each, of one shape class: one
        call, ``tilec.runtime.batches``) again under autograd (the forward's autocast state): per
        tile its slices (requiring grad per ``needs``), the owned outputs (stacked) and the batch's
        partials of the levels in ``shares`` (``None`` for the others). ``frozen``: with the
        broadcast inputs and parameters detached, for a sweep that wants only the leaves' gradients
        (a tile convolution adds its weight gradient into the weight's ``grad`` as it goes)."""
        bs, p = self.frozen if frozen else (self.bs, self.p)
        device_type, enabled, dtype = self.autocast
        tiles = [[region(x, spatial, rows, cols).requires_grad_(need)
                  for x, spatial, rows, cols, need in zip(self.xs, self.segment.sliced, row[0], col[0], needs,
                                                          strict=True)]
                 for _, row, col in batch]
        _, row, col = batch[0]
        self.arena.reset()
        with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            fn = self.segment.function(self.arena.kernels, (row[2], col[2]))
            outs, partials = fn(stack_in(self.arena, tiles), bs, p, self.arena, r, origins(row, col),
                                wanted(self.segment, shares))
            if not self.arena.kernels.compiled:  # compiled, autograd gives it the traced strides itself
                outs = [grad_channels_last(part) if part.requires_grad else part for part in outs]
            partials = batch_partials(partials, len(batch), self.segment.merges)
        return tiles, outs, partials

    def pairs(self, batch, outs, partials, shares, group=None):
        """(tensor, gradient) to back-propagate from the tiles ``batch`` run as one call: their owned
        outputs and the batch's shares of the merged partials' gradients of the levels in ``shares``;
        for a representative (``batch`` is it alone) of the tiles ``group``, the sum of their owned
        output gradients and ``len(group)`` times its shares (``tilec.runtime.reuse``)."""
        pairs, tiles = [], group or batch
        for k, (part, g, (_, spatial, _)) in enumerate(zip(outs, self.image_grads, self.segment.images, strict=True)):
            if part.requires_grad and g is not None:
                pieces = [narrow(g, spatial, row[1][k], col[1][k]) for _, row, col in tiles]
                pairs.append((part, summed(pieces) if group else pieces[0] if len(pieces) == 1 else torch.cat(pieces)))
        found = shares_of([(level.merges[k], merged_part, partials[level.first + k], grads)
                           for level in self.segment.levels
                           for k, (merged_part, grads) in enumerate(shares.get(level.index, ()))])
        return pairs + ([(a, b * len(group)) for a, b in found] if group else found)

    def calls(self, label, groups, members, bands=()):
        """The tiles this process runs in one backward sweep, in order, as ``(batch, group)``:
        ``batch`` the tiles ``(index, row, col)`` that run as one call, ``group`` the tiles a
        representative runs for (``groups``, by itself), else ``None``; its ``members`` are read (as
        read ahead) and counted, not run, except that a member starting a band (``bands``) comes as
        ``([tile], [])``. Consecutive tiles of one shape class run ``segment.batch`` at a time, those
        waiting before any tile that comes alone (a rolled input gradient's band moves on with them)."""
        segment, run = self.segment, self.run
        progress, pending = Progress(run, label, segment.count(run.group)), Pending(segment.batch)
        for index, row, col in segment.tiles(run.group, self.xs):
            group = groups.get(index)
            if index in members:
                alone = [] if index in bands else None
            else:
                alone = group if group and len(group) > 1 else None
            if pending and (alone is not None or not pending.fits(row, col)):
                batch = pending.take()
                yield batch, None
                progress.ran(len(batch))
            if index in members:
                slices(segment, self.xs, row, col)
                progress.reused()
                if alone is not None:
                    yield [(index, row, col)], alone
            elif alone is not None:
                yield [(index, row, col)], alone
                progress.ran(1)
            else:
                pending.add((index, row, col))
        if pending:
            batch = pending.take()
            yield batch, None
            progress.ran(len(batch))

    def leaf_grads(self, r, names, shares):
        """A backward sweep: the gradient of the leaves ``names``, summed over the tiles, of the
        tiles' outputs and of the partials of the levels in ``shares``."""
        chosen = {name: grad_leaf(r[name]) for name in names}
        with_leaves = {**r, **chosen}
        wanted = [t for name in names for t in flat(chosen[name]) if t.requires_grad]
        totals = [torch.zeros_like(t) for t in wanted]  # each call's gradients added in one op
        groups, members, _, _ = self.groups(shares, False, False)
        for batch, group in self.calls(f"{self.segment.label} backward sweep", groups, members):
            _, outs, partials = self.recompute(batch, with_leaves, [False] * len(self.xs), shares, frozen=True)
            pairs = self.pairs(batch, outs, partials, shares, group)
            if pairs and wanted:
                found = torch.autograd.grad([a for a, _ in pairs], wanted, [b for _, b in pairs], allow_unused=True)
                present = [k for k, f in enumerate(found) if f is not None]
                if present:
                    torch._foreach_add_([totals[k] for k in present], [found[k] for k in present])
        if self.run.group is not None:
            sum_over(self.run.group, totals)
        return by_name(names, chosen, totals)

    def last(self, r, collect, shares, sums):
        """The last backward sweep (module docstring, step 2): the gradients of the leaves
        ``collect``, summed over the tiles. The input gradients' accumulators move on tile by tile,
        in order, once a call has read its tiles (``tilec.runtime.tiles.Rolled``)."""
        needs = [s is not None for s in sums]
        chosen = {name: grad_leaf(r[name]) for name in collect}
        with_leaves = {**r, **chosen}
        collected = [t for name in collect for t in flat(chosen[name]) if t.requires_grad]
        if self.arena.kernels.graphs:
            stable_grads(collected)
        groups, members, apart, bands = self.groups(shares, any(isinstance(s, Rolled) for s in sums), any(needs))
        for batch, group in self.calls(f"{self.segment.label} backward", groups, members, bands):
            index = batch[0][0]
            if index in bands:  # a representative of tiles apart starts their first band
                if index in apart:
                    self.linear(group, with_leaves, collected, shares)
                self.band(*bands[index], r, needs, shares, sums)
                continue
            tiles, outs, partials = self.recompute(batch, with_leaves, needs, shares)
            pairs = self.pairs(batch, outs, partials, shares, group)
            slices_of = [t for tile in tiles for t in tile if t.requires_grad]
            found = dict(zip(map(id, slices_of), backward_into(pairs, [*self.leaves, *collected], slices_of),
                             strict=True))
            for (_, row, col), tile in zip(batch, tiles, strict=True):
                grad = [found.get(id(t)) for t in tile]
                if group:
                    grad = [None if g is None else g / len(group) for g in grad]
                for _, member_row, member_col in group or ((None, row, col),):
                    add_input_grads(sums, member_row, member_col, grad)
        grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in collected]
        if self.run.group is not None and grads:
            sum_over(self.run.group, grads)
        return by_name(collect, chosen, grads)

    def linear(self, group, with_leaves, collected, shares):
        """The representative of the tiles ``group`` of one key back-propagates the sum of their
        owned output gradients (and ``len(group)`` times its shares) into the parameters and the
        leaves (``collected``, and the segment's own): their gradients, by linearity
        (``tilec.runtime.reuse``); their input gradients come band by band (``Sweep.band``)."""
        first = group[:1]
        _, outs, partials = self.recompute(first, with_leaves, [False] * len(self.xs), shares)
        backward_into(self.pairs(first, outs, partials, shares, group), [*self.leaves, *collected])

    def band(self, band, same, r, needs, shares, sums):
        """The input gradients of the tiles ``band`` of one key: recomputed once (the first's slices,
        the parameters and leaves detached, ``Sweep.linear`` having back-propagated into them), each
        class of tiles whose owned output gradients have the same bits (``Sweep.alike``; one class
        where they all have the first's, ``same``) back-propagates its first's owned output
        gradients and shares into its first's slices, one backward each through the one graph, and
        that input gradient is each tile's of the class."""
        (tile,), outs, partials = self.recompute(band[:1], r, needs, shares, frozen=True)
        inputs = [t for t in tile if t.requires_grad]
        classes = [band] if same else self.alike(band)
        for n, ((index, row, col), *_) in enumerate(classes):
            pairs = self.pairs([(index, row, col)], outs, partials, shares)
            found = iter(torch.autograd.grad([a for a, _ in pairs], inputs, [b for _, b in pairs],
                                             retain_graph=n + 1 < len(classes), allow_unused=True)
                         if pairs else [None] * len(inputs))
            grads = [next(found) if t.requires_grad else None for t in tile]
            for _, tile_row, tile_col in classes[n]:
                add_input_grads(sums, tile_row, tile_col, grads)

    def alike(self, tiles):
        """``tiles`` (``(index, row, col)`` each) in classes whose owned output gradients have the
        same bits, each class in the order of ``tiles``, the classes in the order of their firsts:
        where the grids of consecutive segments line up, the gradients over the background repeat
        with their period, and a key's tiles fall into a few classes. Tiles are bucketed by the
        fingerprints of their gradients (``tilec.runtime.bits.fingerprints``, one read off the
        device), then each is compared with its bucket's first, all at once (one read); a tile
        that differs from it is bucketed again with the others that do (one more read a round)."""
        grads = [self.owned_grads(row, col) for _, row, col in tiles]
        width = len(grads[0]) if grads else 0
        found = fingerprints([pair for tile in grads for pair in tile])
        keys = [tuple(found[k * width:(k + 1) * width]) for k in range(len(tiles))]
        classes, pending = {}, list(range(len(tiles)))
        while pending:
            firsts = {}
            for k in pending:
                firsts.setdefault(keys[k], k)
            classes.update((first, [tiles[first]]) for first in firsts.values())
            others = [k for k in pending if firsts[keys[k]] != k]
            pairs = [grad_pairs(grads[k], grads[firsts[keys[k]]]) for k in others]
            flags = iter(differing([pair for tile in pairs for pair in tile]))
            pending = []
            for k, tile in zip(others, pairs, strict=True):
                if any([next(flags) for _ in tile]):
                    pending.append(k)
                else:
                    classes[firsts[keys[k]]].append(tiles[k])
        return [classes[first] for first in sorted(classes)]

    def direct_inputs(self, r, level, share, sums):
        """A direct ``level``'s partials' shares of their merged ones' gradients ``share``
        back-propagated into the input gradients, tile by tile over the owned slices (module
        docstring, step 3)."""
        needs = [s is not None for s in sums]
        if not any(needs) or not share:
            return
        segment = self.segment
        for _, row, col in segment.tiles(self.run.group, self.xs, owned=True):
            owned = segment.owned(self.xs, row, col, needs)
            with torch.enable_grad():
                partials = segment.direct(owned, self.bs, self.p, r, origins(row, col))
                pairs = shares_of([(kind, merged_part, partial, grads) for kind, partial, (merged_part, grads)
                                   in zip(level.merges, partials, share, strict=True)])
            leaves = [t for slices_k in owned for t in slices_k if t.requires_grad]
            found = dict(zip(map(id, leaves), backward_into(pairs, (), leaves), strict=True))
            for (k, inputs), slices_k in zip(segment.reduced, owned, strict=True):
                for i, t in zip(inputs, slices_k, strict=True):
                    grad = found.get(id(t))
                    if sums[i] is not None and grad is not None:
                        sums[i].add(row[3][k], col[3][k], grad)
