"""Count the aten calls of one training step of a tiled model, by op and by runtime function.

    python benchmarks/calls.py --model examples/resnet18.py --attr resnet18 --size 2048 \
        --segments 0:27@6x6,27:43@3x3,... [--as-cuda]

Renders the model's module with ``tilec compile --segments`` (or ``--grid``) in a process of its
own, runs one step (forward, backward of ``sum``, float32) untimed, then a second under a
``TorchDispatchMode`` that counts every aten call the step makes, and prints a markdown table of
the calls by op and by the runtime function that made them (the nearest frame of the generated
module; calls from autograd's backward of a tile count under the sweep that ran it). On a GPU
each call is at least a kernel launch and its host-side dispatch, so the count bounds how fast
small tiles can run there. ``--as-cuda`` counts the calls CUDA's path makes, on the CPU: the
generic kernels (``TiledModel(kernels="generic")``) and normalisations' partials by
``torch.var_mean`` (``ChannelMoments`` is the CPU's). Also counts the Python autograd functions the
step applies, by class: each costs the host a Python call forward and, back-propagated, another
backward, on top of the aten calls it makes.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tilec.modelfile import load_model  # noqa: E402

#: Aten ops that read a value off the device (on CUDA the host waits for the queue to drain):
#: a tensor's truth or ``item()``, and ``torch.equal``; ``Tensor.tolist`` does too, outside aten.
SYNCS = {"aten._local_scalar_dense", "aten.equal"}


class Count(TorchDispatchMode):
    """Counts aten calls by op and by the generated module's function that made them."""

    def __init__(self, module_file: str):
        super().__init__()
        self.module_file = module_file
        self.ops, self.where, self.syncs = collections.Counter(), collections.Counter(), collections.Counter()

    def __enter__(self):
        tolist = self.tolist = torch.Tensor.tolist

        def counted(tensor):
            self.syncs[self.caller() + " (tolist)"] += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self.tolist
        return super().__exit__(*exc)

    def caller(self):
        """The qualified name of the generated module's innermost function on the stack."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename != self.module_file:
            frame = frame.f_back
        return frame.f_code.co_qualname if frame is not None else "(outside the module)"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, where = str(func.overloadpacket), self.caller()
        self.ops[name] += 1
        self.where[where] += 1
        if name in SYNCS:
            self.syncs[f"{where} ({name.split('.')[-1]})"] += 1
        return func(*args, **(kwargs or {}))


class Functions:
    """Counts ``torch.autograd.Function`` applications by class while entered; installed before the
    generated module loads, which binds some ``apply`` methods to names."""

    def __init__(self):
        self.counts, self.active = collections.Counter(), False
        apply = torch.autograd.Function.apply.__func__

        def counted(cls, *args, **kwargs):
            if self.active:
                self.counts[cls.__name__] += 1
            return apply(cls, *args, **kwargs)

        torch.autograd.Function.apply = classmethod(counted)

    def __enter__(self):
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False


def render(args, out: Path) -> Path:
    """The generated module of ``args``' model and segments, written under ``out``."""
    how = ["--segments", args.segments] if args.segments else ["--grid", args.grid]
    command = [sys.executable, "-m", "tilec", "compile", str(args.model), "--attr", args.attr, "--input-shape",
               f"1,{args.channels},{args.size},{args.size}", "--name", "counted", "--out-dir", str(out),
               "--plan-dir", str(out), *how]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"calls.py: tilec compile: {done.stderr.strip().splitlines()[-1]}")
    return out / "counted_tiled.py"


def plan_parser(description):
    """A parser of the model, its input and its plan (``--segments`` or ``--grid``), and ``--top``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--attr", default="model")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--channels", type=int, default=3)
    plan = parser.add_mutually_exclusive_group(required=True)
    plan.add_argument("--segments", help="as tilec compile --segments")
    plan.add_argument("--grid", help="as tilec compile --grid, e.g. 4x4")
    parser.add_argument("--top", type=int, default=12, help="rows of each table")
    return parser


def rendered(args, out: Path):
    """``(module, path)``: the generated module of ``args``' model and plan, rendered under ``out``
    (``render``) and loaded."""
    path = render(args, out)
    spec = importlib.util.spec_from_file_location("counted_tiled", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def warmed(args, module, kernels):
    """``(tiled model, input)`` of ``module`` with ``kernels``, after one untimed step (forward,
    backward of ``sum``), its gradients reset."""
    model = load_model(args.model.resolve(), args.attr)[0]
    tiled = module.TiledModel(model, kernels=kernels)
    x = torch.randn(1, args.channels, args.size, args.size, generator=torch.Generator().manual_seed(0))
    tiled(x).sum().backward()
    for p in model.parameters():
        p.grad = None
    return tiled, x


def print_tables(tables, top):
    """Markdown tables of the ``top`` most common rows of each ``(title, Counter)``."""
    for title, counts in tables:
        print(f"| {title} | calls |\n|---|--:|")
        for name, calls in counts.most_common(top):
            print(f"| `{name}` | {calls:,} |")
        print()


def main(argv=None) -> None:
    parser = plan_parser(__doc__.splitlines()[0])
    parser.add_argument("--as-cuda", action="store_true", help="count the calls of CUDA's path (docstring)")
    args = parser.parse_args(argv)
    functions = Functions()
    with tempfile.TemporaryDirectory() as out:
        module, path = rendered(args, Path(out))
        if args.as_cuda:
            module.ChannelMoments.layout = staticmethod(lambda x, dims: None)
        tiled, x = warmed(args, module, "generic" if args.as_cuda else "auto")
        counter = Count(str(path))
        with counter, functions:
            tiled(x).sum().backward()
    print(f"{sum(counter.ops.values()):,} aten calls in a step ({'CUDA' if args.as_cuda else 'CPU'}'s path)\n")
    print(f"{sum(counter.syncs.values()):,} reads off the device\n")
    print(f"{sum(functions.counts.values()):,} Python autograd functions applied\n")
    print_tables((("op", counter.ops), ("function", counter.where), ("read off the device", counter.syncs),
                  ("autograd function", functions.counts)), args.top)


if __name__ == "__main__":
    main()
