"""Published model code (torchvision's models, timm) as test dependencies.

``published(name)`` imports a module of a published package, or skips the test where it is not
installed (``load(name)`` raises ``ImportError`` there: ``benchmarks/published.py``).
``scripts/setup.sh`` installs torchvision and timm to ``.venv/published``, outside the
environment's packages, which this module puts on ``sys.path``.

On a build of torch that torchvision's compiled ops do not load into (the CPU build the suite
pins), ``import torchvision`` raises in ``torchvision._meta_registrations``: it registers fake
kernels for its detection ops (``torchvision::nms``, ``roi_align``...), which do not exist there.
The model code never calls those ops, so the import is retried once with that one module left
out; everything else (the models, timm's imports of torchvision) is the packages' own code as
users download it.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

#: Where ``scripts/setup.sh`` installs the published packages.
PACKAGES = Path(__file__).resolve().parents[2] / ".venv" / "published"
_META = "torchvision._meta_registrations"


def load(name: str) -> types.ModuleType:
    """``importlib.import_module(name)``, retried without torchvision's fake kernels where its
    compiled ops do not load; ``ImportError`` where it does not import."""
    if PACKAGES.is_dir() and str(PACKAGES) not in sys.path:
        sys.path.append(str(PACKAGES))
    try:
        return importlib.import_module(name)
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
    _forget(name.split(".")[0], "torchvision")
    sys.modules[_META] = types.ModuleType(_META)
    try:
        return importlib.import_module(name)
    except RuntimeError as error:
        raise ImportError(f"{name}: {str(error).splitlines()[0]}") from None


def published(name: str) -> types.ModuleType:
    """``load(name)``, or skip the test where it does not import."""
    try:
        return load(name)
    except ImportError as error:
        pytest.skip(f"{name} does not import here: {type(error).__name__}: {str(error).splitlines()[0]}")


def _forget(*packages: str) -> None:
    """Drop a failed import's half-initialised modules, so that the retry runs them afresh."""
    for module in [key for key in sys.modules if key.split(".")[0] in packages]:
        del sys.modules[module]
