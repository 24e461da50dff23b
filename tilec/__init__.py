"""tilec: an ahead-of-time tiling compiler for exact training of CNNs on huge images.

``tilec.compile(model, inputs, memory_budget="2GiB")`` returns a ``TiledModel``;
``tilec.load("NAME_tiled.py", model)`` loads one ``tilec compile`` wrote; ``tilec.slide(path)``
opens a whole-slide file as an input read by region. Bad input raises a ``TilecError`` subclass.
The compiler is imported on first use of ``compile`` or ``load``, so ``import tilec`` stays light.
"""

from tilec.errors import (
    BudgetError,
    GridError,
    ModelFileError,
    OutputError,
    PlanError,
    ShapeError,
    SlideError,
    TilecError,
    UnsupportedLayerError,
)

__version__ = "0.1.0"
__all__ = ["compile", "load", "slide", "TilecError", "ModelFileError", "UnsupportedLayerError", "ShapeError",
           "GridError", "PlanError", "BudgetError", "OutputError", "SlideError"]

#: Where each lazily imported name lives.
_LAZY = {"compile": "tilec.api", "load": "tilec.api", "slide": "tilec.slides"}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'tilec' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(__all__) | {"__version__"})
