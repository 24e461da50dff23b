"""Typed errors for bad input. The CLI prints each as one line and exits with code 2."""


class TilecError(Exception):
    """Base class: a refusal caused by the user's input, never by a bug in tilec."""


class ModelFileError(TilecError):
    """The model file is missing, does not import, or lacks the model attribute."""


class UnsupportedLayerError(TilecError):
    """A layer tilec cannot tile (its path, type and the reason are in the message)."""


class ShapeError(TilecError):
    """The input shape is malformed or does not fit the network."""


class GridError(TilecError):
    """The tile grid is malformed or finer than the output."""


class PlanError(TilecError):
    """A plan file is unreadable, invalid, from the future, or internally inconsistent."""


class BudgetError(TilecError):
    """No plan fits the memory budget."""


class OutputError(TilecError):
    """An output file or directory cannot be written."""


class SlideError(TilecError):
    """A slide cannot be opened or read: a missing reader package, a file no reader opens, a level
    out of range."""
