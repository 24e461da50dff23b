"""Train one tiled step of a compiled model and check it against untiled PyTorch.

    python examples/train_step.py out/resnet50_tiled.py examples/resnet50.py

Imports the generated module, wraps the model with ``TiledModel``, runs one SGD step on
random data, then repeats forward and backward in float64 with and without tiling and prints
the max abs error of every output, the input gradient and every parameter gradient.
"""

import importlib.util
import sys
import time

import torch
from torch.utils._pytree import tree_leaves

from tilec.modelfile import load_model

TOLERANCE = 1e-10


def import_file(path: str):
    spec = importlib.util.spec_from_file_location("tiled", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outputs(value) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def main(generated: str, model_file: str) -> int:
    tiled_module = import_file(generated)
    model, _ = load_model(model_file)
    torch.manual_seed(0)
    tiled = tiled_module.TiledModel(model)
    (_, shape, _), = tiled_module.INPUTS  # one float input
    optimizer = torch.optim.SGD(tiled.parameters(), lr=1e-3)

    start = time.perf_counter()
    image = torch.randn(shape)
    loss = sum(y.square().mean() for y in outputs(tiled(image)))
    loss.backward()
    optimizer.step()
    print(f"tiled training step on {tuple(shape)}: loss {loss.item():.6f}, {time.perf_counter() - start:.1f} s")

    model.double()
    x = torch.randn(shape, dtype=torch.float64)
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    results = []
    for run in (model, tiled):
        x_run = x.clone().requires_grad_()
        ys = outputs(run(x_run))
        grad_out = [torch.randn_like(y) for y in ys] if not results else results[0][1]
        grads = torch.autograd.grad(ys, [x_run, *params], grad_out)
        results.append((ys, grad_out, grads))
    (y_ref, _, ref), (y_tiled, _, got) = results
    errors = {f"output {i}": (a - b).abs().max().item() for i, (a, b) in enumerate(zip(y_ref, y_tiled, strict=True))}
    for name, a, b in zip(["input"] + names, ref, got, strict=True):
        errors[f"grad {name}"] = (a - b).abs().max().item()
    for name, error in list(errors.items())[:6]:
        print(f"  max abs error {name:<28} {error:.2e}")
    print(f"  ... and {len(errors) - 6} more tensors" if len(errors) > 6 else "", end="\n" if len(errors) > 6 else "")
    worst_name = max(errors, key=errors.get)
    worst = errors[worst_name]
    verdict = "OK" if worst <= TOLERANCE else "MISMATCH"
    print(f"gradient check (float64, {len(errors)} tensors): worst {worst:.2e} ({worst_name}) -> {verdict}")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
