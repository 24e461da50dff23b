"""Tile functions compiled by ``torch.compile`` (``Kernels.compiled``: ``TiledModel(model,
kernels="compiled")``), falling back to running them as they are.

Each shape class of a segment is a function of its own, compiled at its first call with static
shapes; dynamo compiles it again for each other set of guards it meets (a forward pass without
gradients, the backward's re-run with them, a batch of tiles). While dynamo traces it, a tile's
kernels take forms it can trace (``torch.compiler.is_compiling``): activations in place and max
pooling by aten's own ops, moments by ``var_mean``. Where compiling fails (an op dynamo cannot
trace, no C++ compiler for inductor), the segment's tiles run uncompiled from then on, and a
warning says so once per segment.
"""

import warnings

import torch


class CompiledTiles:
    """One tiled segment's tile functions as ``torch.compile`` makes them (``function``), run as
    they are once compiling one of them failed (``failed``); ``label`` names the segment."""

    def __init__(self, label):
        self.label, self.failed, self.compiled = label, False, {}

    def function(self, fn):
        """``fn`` compiled: one wrapper per function, which runs ``fn`` itself once compiling failed."""
        found = self.compiled.get(fn)
        if found is None:
            found = self.compiled[fn] = self.wrap(fn)
        return found

    def wrap(self, fn):
        compiled = torch.compile(fn, dynamic=False)

        def call(*args):
            if self.failed:
                return fn(*args)
            try:
                return compiled(*args)
            except RuntimeError as error:
                if not isinstance(error, torch._dynamo.exc.TorchDynamoException):
                    raise
                self.failed = True
                reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                warnings.warn(f"tilec: torch.compile failed on {self.label} ({reason}); its tiles run uncompiled",
                              RuntimeWarning, stacklevel=2)
                return fn(*args)

        return call
