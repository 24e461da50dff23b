"""Count the aten calls a training step makes outside its tiles' CUDA graphs, by runtime function.

    python benchmarks/graphs.py --model examples/resnet18.py --attr resnet18 --size 2048 \
        --segments 0:27@344x344px,27:43@688x688px,...

With ``TiledModel(kernels="cudagraphs")`` every tile function is one graph forward and one
backward, replayed on CUDA with one launch each; what the runtime calls between them (merging
partials and their shares, slicing inputs, the copies a replay needs) stays one dispatch and
mostly one launch per call, and bounds how fast small tiles can run there. On the CPU no graph is
captured, but the tile functions run traced as they would be, so the split shows here too.

Renders the model's module with ``tilec compile --segments`` (or ``--grid``) in a process of its
own, wraps each tile call and every function and method of the runtime in a
``torch.profiler.record_function`` range, runs one step untimed (tracing the tile functions: a
minute or more), then profiles a second (forward, backward of ``sum``, float32, moments by
``var_mean`` as on CUDA). An aten call counts as inside a graph when a tile call's range or
autograd's backward of a compiled function holds it, and only the outermost aten call of a nest
counts. Prints the tile calls and markdown tables of the calls outside the graphs by op and by the
innermost runtime function around them (``narrow`` counts for its caller).
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import tempfile
import types
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from calls import plan_parser, print_tables, rendered, warmed  # noqa: E402

#: The range of a tile call, and the prefix of the runtime's ranges.
TILE, RANGE = "tilec: tile", "tilec: "
#: Ranges that count for their caller: a helper called everywhere.
HELPERS = {RANGE + "narrow"}


def ranged(name, fn):
    """``fn`` run inside a profiler range named ``name``."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return inner


def instrument(module) -> None:
    """Wrap ``module``'s tile calls in ``TILE`` ranges and its other functions and methods in
    ranges of their names (before any tile is traced, so that the traces see the wrappers)."""
    function = module.CompiledTiles.function
    module.CompiledTiles.function = lambda self, fn, kernels: ranged(TILE, function(self, fn, kernels))
    for name, value in list(vars(module).items()):
        if isinstance(value, types.FunctionType) and value.__module__ == module.__name__:
            if not name.startswith("_s"):  # tile functions are what the graphs hold
                setattr(module, name, ranged(RANGE + name, value))
        elif (isinstance(value, type) and value.__module__ == module.__name__
              and not issubclass(value, torch.autograd.Function) and value is not module.CompiledTiles):
            for attribute, method in list(vars(value).items()):
                if isinstance(method, types.FunctionType) and not attribute.startswith("__"):
                    setattr(value, attribute, ranged(f"{RANGE}{name}.{attribute}", method))


def split(events):
    """``(tile calls, their backwards, calls inside graphs, Counter of calls outside by op, by
    function)``."""
    tiles, backwards, inside = 0, 0, 0
    by_op, by_function = collections.Counter(), collections.Counter()
    for event in events:
        tiles += event.name == TILE
        backwards += event.name == "CompiledFunctionBackward"
        if not event.name.startswith("aten::"):
            continue
        nested, in_graph, owner, parent = False, False, None, event.cpu_parent
        while parent is not None:
            nested = nested or parent.name.startswith("aten::")
            in_graph = in_graph or parent.name == TILE or "CompiledFunctionBackward" in parent.name
            if owner is None and parent.name.startswith(RANGE) and parent.name not in HELPERS | {TILE}:
                owner = parent.name[len(RANGE):]
            parent = parent.cpu_parent
        if nested:
            continue
        if in_graph:
            inside += 1
            continue
        by_op[event.name] += 1
        by_function[owner or "(outside the runtime)"] += 1
    return tiles, backwards, inside, by_op, by_function


def main(argv=None) -> None:
    args = plan_parser(__doc__.splitlines()[0]).parse_args(argv)
    warnings.filterwarnings("ignore", message="tilec: CUDA graphs skipped")  # the CPU captures none
    logging.getLogger("torch._inductor.cudagraph_utils").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as out:
        module, _ = rendered(args, Path(out))
        module.ChannelMoments.layout = staticmethod(lambda x, dims: None)  # var_mean, as on CUDA
        instrument(module)
        tiled, x = warmed(args, module, "cudagraphs")
        with profile(activities=[ProfilerActivity.CPU]) as profiled:
            tiled(x).sum().backward()
    tiles, backwards, inside, by_op, by_function = split(profiled.events())
    outside = sum(by_op.values())
    print(f"{tiles:,} tile calls ({backwards:,} of them back-propagated): {inside:,} aten calls inside their "
          f"graphs, {outside:,} outside ({outside / max(tiles + backwards, 1):.1f} per graph run)\n")
    print_tables((("op", by_op), ("function", by_function)), args.top)


if __name__ == "__main__":
    main()
