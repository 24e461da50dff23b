"""Tile functions compiled by ``torch.compile`` (``Kernels.compiler``), falling back to running
them as they are: ``TiledModel(model, kernels="compiled")`` by inductor; ``kernels="cudagraphs"``
by torch's backend of that name, which captures aten's kernels as CUDA graphs and replays them
(no code generated: it compiles in the time of dynamo's and autograd's tracing);
``kernels="reduce-overhead"`` by inductor in that mode, which captures its own kernels so.

Each shape class of a segment is a function of its own, compiled at its first call with static
shapes; dynamo compiles it again for each other set of guards it meets (a forward pass without
gradients, the backward's re-run with them, each level's backward sweep, whose results want
gradients, each size of a stack of tiles). The plan bounds those variants by (levels + 4) times
the segment's ``batch``, and a segment raises dynamo's ``recompile_limit`` (8 by default, past
which dynamo runs a function uncompiled) to that bound: BasicUNet's one segment of 18 instance
norms needs 22.

While dynamo traces a tile, its kernels take forms it can trace (``torch.compiler.is_compiling``):
activations in place and max pooling by aten's own ops, moments by ``var_mean``; a tile that reads
its origins (``positional``) gets them as 0-d tensors on the tiles' device, made once per value,
so that no function is compiled again for each tile position and a CUDA graph of it holds no CPU
tensor (torch's backend "cudagraphs" captures no graph that does; element-wise dropout's stream
is on that device too, ``tilec.runtime.dropout.step_stream``). Where compiling fails (an op
dynamo cannot trace, no C++ compiler for inductor), the segment's tiles run uncompiled from then
on, and a warning says so once per segment.

CUDA graphs: each tile call starts a new step of torch's CUDA graph trees
(``torch.compiler.cudagraph_mark_step_begin``), so that a replay may write over what the previous
call returned (the runtime copies what it keeps, ``tilec.runtime.sweeps``); a tile's slices are
copied into the graph's inputs. Inductor leaves the model tensors where they are
(``torch._dynamo.mark_static_address``); the "cudagraphs" backend copies them too. Where no graph
is captured (not CUDA, an op that cannot be captured), that function runs compiled without it,
and a warning says so once per segment (``TORCH_LOGS=cudagraphs`` says why).
"""

import warnings
from typing import NamedTuple

import torch


class Compiler(NamedTuple):
    """A compiled choice of ``TiledModel(kernels=...)``: ``torch.compile``'s ``options``, whether its
    tiles replay as CUDA ``graphs``, and whether the model tensors are marked ``static`` (inductor
    leaves them where they are; the "cudagraphs" backend ignores the mark)."""

    options: dict
    graphs: bool
    static: bool


#: The compiled ``Kernels.compiler`` choices: by inductor, as CUDA graphs of aten's kernels, or
#: inductor's kernels replayed as CUDA graphs.
COMPILERS = {"compiled": Compiler({}, graphs=False, static=False),
             "cudagraphs": Compiler({"backend": "cudagraphs"}, graphs=True, static=False),
             "reduce-overhead": Compiler({"mode": "reduce-overhead"}, graphs=True, static=True)}


class CompiledTiles:
    """One tiled segment's tile functions as ``torch.compile`` makes them (``function``), run as
    they are once compiling one of them failed (``failed``); ``skipped``: one was not captured as
    CUDA graphs; ``label`` names the segment; ``positional``: its tiles read their origins
    (element-wise dropout, first maxima), which they are then given as 0-d tensors
    (``Origins``), values dynamo does not compile a function again for; ``variants``: how many
    graphs one function may need (module docstring)."""

    def __init__(self, label, positional=False, variants=8):
        self.label, self.positional, self.variants = label, positional, variants
        self.failed, self.skipped, self.compiled, self.origins = False, False, {}, Origins()

    def function(self, fn, kernels):
        """``fn`` compiled by the device's ``kernels.compiler``: one wrapper per function and
        compiler, which runs ``fn`` itself once compiling failed."""
        found = self.compiled.get((fn, kernels.compiler))
        if found is None:
            found = self.compiled[fn, kernels.compiler] = self.wrap(fn, kernels)
        return found

    def wrap(self, fn, kernels):
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, self.variants)
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, self.variants)
        compiler = COMPILERS[kernels.compiler]
        compiled = torch.compile(fn, dynamic=False, **compiler.options)
        graphs, static = compiler.graphs, compiler.static

        def call(xs, bs, p, arena, r, o, *rest):
            if self.failed:
                return fn(xs, bs, p, arena, r, o, *rest)
            if self.positional:
                o = self.origins.of(o, xs[0].device)
            if static:
                for t in p:
                    torch._dynamo.mark_static_address(t)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
                skips = cudagraph_skips()
            try:
                found = compiled(xs, bs, p, arena, r, o, *rest)
            except RuntimeError as error:
                if not isinstance(error, torch._dynamo.exc.TorchDynamoException):
                    raise
                self.failed = True
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                warnings.warn(f"tilec: torch.compile failed on {self.label} ({reason}); its tiles run uncompiled",
                              RuntimeWarning, stacklevel=2)
                return fn(xs, bs, p, arena, r, o, *rest)
            if graphs and not self.skipped and cudagraph_skips() > skips:
                self.skipped = True
                warnings.warn(f"tilec: CUDA graphs skipped on {self.label} (TORCH_LOGS=cudagraphs says why); its "
                              "tiles run compiled without them", RuntimeWarning, stacklevel=2)
            return found

        return call


def cudagraph_skips():
    """How many graphs inductor has not captured as CUDA graphs in this process."""
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


class Origins(dict):
    """0-d int64 tensors of the partials' origins, made at first use, one per value, device and
    place among a tile's origins: two places never share a tensor, which dynamo would take for
    aliased inputs and compile a function again for."""

    def of(self, origins, device):
        """Per reduction, its partial's origin (first row, first column) as such tensors on ``device``."""
        return [tuple(self.tensor((k, axis, start), device) for axis, start in enumerate(origin))
                for k, origin in enumerate(origins)]

    def tensor(self, place, device):
        found = self.get((place, device))
        if found is None:
            found = self[place, device] = torch.tensor(place[-1], dtype=torch.int64, device=device)
        return found
