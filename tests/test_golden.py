"""Golden files: the generated module and plan for ``tests/golden/small_model.py`` are byte-stable.

If a change to the planner or the code generator is intended, regenerate them from the
repository root with

    python tests/golden/regenerate.py

and review the diff of ``tests/golden/small_tiled.py`` and ``tests/golden/small.plan.json``.
"""

from __future__ import annotations

import difflib
import importlib.util
import types
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from tilec.codegen import load_source
from tilec.ir import SCHEMA_VERSION
from tilec.modelfile import load_model
from tilec.pipeline import compile_model
from tilec.planio import dumps, load

from support.exactness import TOLERANCE

GOLDEN = Path(__file__).resolve().parent / "golden"


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("tilec_golden_regenerate", GOLDEN / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REGEN = _regenerate_module()


def _assert_same(committed: Path, fresh: Path) -> None:
    want, got = committed.read_bytes(), fresh.read_bytes()
    if want != got:
        diff = "".join(difflib.unified_diff(want.decode().splitlines(True), got.decode().splitlines(True),
                                            str(committed), "fresh", n=1))
        raise AssertionError(
            f"{committed.name} differs from a fresh compile. If the change is intended, run "
            f"`{REGEN.COMMAND}` from the repository root and commit the result.\n{diff[:4000]}"
        )


def test_golden_files_are_byte_identical(tmp_path):
    result = compile_model(REGEN.config(tmp_path))
    assert result.module_path == tmp_path / REGEN.MODULE_FILE.name
    assert result.plan_path == tmp_path / REGEN.PLAN_FILE.name
    _assert_same(REGEN.MODULE_FILE, result.module_path)
    _assert_same(REGEN.PLAN_FILE, result.plan_path)


def test_golden_plan_describes_the_model():
    plan = load(REGEN.PLAN_FILE)
    assert dumps(plan) == REGEN.PLAN_FILE.read_text(encoding="utf-8")  # loads and dumps back unchanged
    assert plan.schema_version == SCHEMA_VERSION and plan.name == "small" and plan.inputs[0].shape == (1, 3, 13, 11)
    assert [(s.first, s.stop, s.grid) for s in plan.segments] == [tuple(s) for s in REGEN.SEGMENTS]
    assert [s.mode for s in plan.segments] == ["tiled", "tiled", "stored"]
    ops = [node.op for node in plan.model.nodes]
    assert {"conv2d", "add", "cat", "conv_transpose2d", "pad", "max_pool2d", "mean", "linear"} <= set(ops)
    # the residual block's skip (the stem's ReLU) crosses the first cut, and so does the block's first half
    first, second, head = plan.segments
    crossing = {i.name for i in second.inputs}
    assert set(first.outputs) == crossing and len(crossing) == 2
    assert [i.name for i in head.inputs] == [second.outputs[-1]]
    assert plan.model.output.kind == "dict" and plan.model.output.keys == ("mask", "logits")


def test_golden_module_runs_exactly():
    """The committed module, executed as is, matches the untiled model in float64: both outputs,
    the input gradient and every parameter gradient."""
    model, ((shape, _),) = load_model(REGEN.MODEL_FILE)
    model = model.double()
    tiled = load_source(REGEN.MODULE_FILE.read_text(encoding="utf-8"), "small_tiled").TiledModel(model)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, dtype=torch.float64, generator=generator)
    params = list(model.parameters())
    results = []
    grads_out = None
    for forward in (model, tiled):
        x_leaf = x.clone().requires_grad_()
        leaves, _ = tree_flatten(forward(x_leaf))
        if grads_out is None:
            grads_out = [torch.randn(leaf.shape, dtype=torch.float64, generator=generator) for leaf in leaves]
        results.append((*leaves, *torch.autograd.grad(leaves, [x_leaf, *params], grads_out)))
    errors = [(a - b).abs().max().item() for a, b in zip(*results, strict=True)]
    assert len(errors) == 2 + 1 + len(params)
    assert max(errors) <= TOLERANCE, errors


def test_golden_module_is_an_importable_file():
    """The file on disk imports as a regular module, not only through ``load_source``."""
    spec = importlib.util.spec_from_file_location("small_tiled_file", REGEN.MODULE_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, _ = load_model(REGEN.MODEL_FILE)
    assert module.PLAN_NAME == "small" and module.INPUTS == (("x", (1, 3, 13, 11), "float32"),)
    assert module.PLAN.name == "small" and module.PLAN.segments == tuple(REGEN.SEGMENTS)
    module.check_plan(REGEN.PLAN_FILE)
    out = module.TiledModel(model)(torch.randn(1, 3, 13, 11))
    assert set(out) == {"mask", "logits"}
    assert out["mask"].shape == (1, 5, 13, 11) and out["logits"].shape == (1, 3)


def test_a_module_loaded_from_source_is_the_file_imported():
    """``load_source`` runs the module as its file does: the same docstring and names, every
    function at its line in the file; a second load shares the runtime's compiled code, not the
    functions made from it."""
    source = REGEN.MODULE_FILE.read_text(encoding="utf-8")
    spec = importlib.util.spec_from_file_location("small_tiled_file", REGEN.MODULE_FILE)
    imported = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(imported)
    first, second = load_source(source, "small_tiled"), load_source(source, "small_tiled")
    assert first.__doc__ == imported.__doc__ and first.__doc__.startswith('Tiled training for plan "small"')
    names = {name for name in vars(imported) if not name.startswith("__")}
    assert {name for name in vars(first) if not name.startswith("__")} == names
    lines = source.splitlines()
    functions = [value for value in vars(first).values()
                 if isinstance(value, types.FunctionType) and value.__code__.co_filename == "<small_tiled>"]
    assert len(functions) > 20
    for function in functions:
        assert function.__code__.co_firstlineno == getattr(imported, function.__name__).__code__.co_firstlineno
        assert lines[function.__code__.co_firstlineno - 1].lstrip().startswith(("def ", "@")), function.__name__
    assert first.TiledModule.__init__.__code__ is second.TiledModule.__init__.__code__
    assert first.TiledModule is not second.TiledModule and first.PLAN is not second.PLAN
