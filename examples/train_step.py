"""Train one tiled step of a compiled model and check it against untiled PyTorch.

    python examples/train_step.py out/vgg16_tiled.py examples/vgg16.py

Imports the generated module, wraps the model with ``TiledModel``, runs one SGD step on
random data, then repeats forward and backward in float64 with and without tiling and prints
the max abs error of the output, the input gradient and every parameter gradient.
"""

import importlib.util
import sys
import time

import torch

from tilec.modelfile import load_model

TOLERANCE = 1e-10


def import_file(path: str):
    spec = importlib.util.spec_from_file_location("tiled", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(generated: str, model_file: str) -> int:
    tiled_module = import_file(generated)
    model, _ = load_model(model_file)
    torch.manual_seed(0)
    tiled = tiled_module.TiledModel(model)
    shape = tiled_module.INPUT_SHAPE
    optimizer = torch.optim.SGD(tiled.parameters(), lr=1e-3)

    start = time.perf_counter()
    image = torch.randn(shape)
    loss = tiled(image).square().mean()
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
        y = run(x_run)
        grad_out = torch.ones_like(y) if not results else results[0][0][1]
        grads = torch.autograd.grad(y, [x_run, *params], grad_out)
        results.append(((y, grad_out), grads))
    (y_ref, _), ref = results[0]
    (y_tiled, _), got = results[1]
    errors = {"output": (y_tiled - y_ref).abs().max().item()}
    for name, a, b in zip(["input"] + names, ref, got, strict=True):
        errors[f"grad {name}"] = (a - b).abs().max().item()
    for name, error in errors.items():
        print(f"  max abs error {name:<22} {error:.2e}")
    worst = max(errors.values())
    verdict = "OK" if worst <= TOLERANCE else "MISMATCH"
    print(f"gradient check (float64, {len(errors)} tensors): worst {worst:.2e} -> {verdict}")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
