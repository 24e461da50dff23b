"""Loading the user's model file: ``model`` (or another attribute) and its optional inputs:
``INPUTS`` (per tensor argument of ``forward``, "SHAPE:DTYPE" as ``--input`` takes it) or
``INPUT_SHAPE`` (N, C, H, W of one input in the model's dtype)."""

from __future__ import annotations

import traceback
from pathlib import Path

from torch import nn

from tilec.config import parse_input
from tilec.errors import ModelFileError, ShapeError
from tilec.ir import is_int


def _where(path: Path, error: BaseException) -> str:
    """``file:line`` of the innermost frame inside the model file, or just the file."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename) == path]
    return f"{path}:{frames[-1].lineno}" if frames else str(path)


def load_model(path: Path, attr: str = "model") -> tuple[nn.Module, tuple | None]:
    """Execute ``path`` and return its model (calling it if it is a function) and its inputs as
    ``CompileConfig.inputs`` takes them (``None`` if it names none)."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"model file {path} is not a file")
    try:
        source = path.read_text(encoding="utf-8")
        code = compile(source, str(path), "exec")
    except SyntaxError as error:
        raise ModelFileError(f"{path}:{error.lineno}: syntax error: {error.msg}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ModelFileError(f"cannot read model file {path}: {error}") from None
    namespace = {"__name__": f"tilec_model_{path.stem}", "__file__": str(path)}
    try:
        exec(code, namespace)
    except (Exception, SystemExit) as error:
        raise ModelFileError(f"{_where(path, error)}: running the model file raised "
                             f"{type(error).__name__}: {error}") from None
    if attr not in namespace:
        raise ModelFileError(f"{path} defines no attribute {attr!r} (choose another with --attr)")
    model = namespace[attr]
    if callable(model) and not isinstance(model, nn.Module):
        try:
            model = model()
        except (Exception, SystemExit) as error:
            raise ModelFileError(f"{_where(path, error)}: calling {attr}() raised "
                                 f"{type(error).__name__}: {error}") from None
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{path}: {attr} is a {type(model).__name__}, not a torch.nn.Module")
    inputs = namespace.get("INPUTS")
    if inputs is not None:
        if not isinstance(inputs, list | tuple) or not all(isinstance(text, str) for text in inputs):
            raise ShapeError(f"{path}: INPUTS must be a list of 'SHAPE:DTYPE' strings, got {inputs!r}")
        return model, tuple(parse_input(text, f"{path}: INPUTS entry") for text in inputs)
    shape = namespace.get("INPUT_SHAPE")
    if shape is None:
        return model, None
    if not isinstance(shape, list | tuple) or not all(is_int(n) for n in shape):
        raise ShapeError(f"{path}: INPUT_SHAPE must be a tuple of integers N,C,H,W, got {shape!r}")
    return model, ((tuple(shape), None),)
