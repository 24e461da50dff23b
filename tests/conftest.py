"""Suite-wide settings.

The tests run thousands of tiny tensor ops. On a 2-core CI machine (or one shared with other
jobs) intra-op threads only add synchronisation: a single thread is several times faster and
keeps timings stable, so each process of the suite uses one, and ``scripts/test.sh`` runs a
pytest-xdist worker per core instead.

Helpers shared by the test modules live in the package ``tests/support`` (``from support.zoo
import ZOO``; pyproject's ``pythonpath``). Markers (pyproject): ``slow``, the multi-process and
measuring subprocess tests (``pytest -m "not slow"`` is the quick loop; CI runs everything), and
``cuda``, the tests that need a CUDA device (skipped without one).
"""

import dataclasses

import pytest
import torch

import tilec.pipeline
from tilec.target import REFERENCE_SPEED

from support.zoo import reference_kernels, seed_reference_speed

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def reference_speed(tmp_path_factory):
    """In this process, budget searches rank plans at ``REFERENCE_SPEED`` and count
    ``KERNEL_STATE_BYTES`` per kernel (``support.zoo.reference_kernels``) instead of this
    machine's measured rates and kernel state (``tilec.clock``, ``tilec.calibrate.measure_kernels``),
    so that what they pick does not depend on the machine; subprocesses find the reference speed in
    the session's own cache directory (``seed_reference_speed``), where their measurements go."""

    def at_reference(target, dtype, autocast):
        return dataclasses.replace(target, speed=REFERENCE_SPEED)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        seed_reference_speed()
        patch.setattr(tilec.pipeline, "clock", at_reference)
        patch.setattr(tilec.pipeline, "measure_kernels", reference_kernels)
        yield


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Fill tensors from ``torch.empty``, ``torch.empty_like``, ``Tensor.new_empty`` and
    ``Tensor.set_`` on an untyped storage with NaN (floating dtypes).

    The generated code allocates each tiled segment's outputs with ``torch.empty`` and relies on
    its tiles' owned parts covering every element; fresh pages are zero, which would hide a region
    no tile writes. Its tiles carve their tensors from an arena (``set_`` on the arena's untyped
    storage; ``deepcopy`` sets typed ones) that holds the last tile's values, which would hide one
    as well. NaN makes the exactness checks fail there instead.
    """
    empty, empty_like, new_empty, set_ = torch.empty, torch.empty_like, torch.Tensor.new_empty, torch.Tensor.set_

    def poison(tensor):
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda *a, **k: poison(new_empty(*a, **k)))

    def carve(tensor, *args, **kwargs):
        set_(tensor, *args, **kwargs)
        return poison(tensor) if args and isinstance(args[0], torch.UntypedStorage) else tensor

    monkeypatch.setattr(torch.Tensor, "set_", carve)
