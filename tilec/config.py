"""The compile configuration the CLI builds from its flags, and the flag parsers."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from tilec.errors import BudgetError, GridError, ShapeError, TilecError
from tilec.ir import INPUT_DTYPES, is_int
from tilec.regions import Period


@dataclass(frozen=True)
class CompileConfig:
    """Everything ``compile_model`` needs. ``inputs``: per tensor argument of the model's forward,
    ``(shape, dtype)`` (``None`` dtype: the model's); ``None``: the model file's INPUTS or
    INPUT_SHAPE. ``tissue_mask``: a ``.npy`` file of a 2-D boolean mask over the first image
    input (True: tissue), outside which the input is known to be one colour
    (``tilec.pipeline.tissue_background``). ``like``: a plan file of the model at another input
    size, whose segments plan this one (``tilec.pipeline.plan_for``)."""

    model_path: Path
    attr: str = "model"
    inputs: tuple[tuple[tuple[int, ...], str | None], ...] | None = None
    grid: tuple[int, int] | None = None
    segments: tuple[tuple, ...] | None = None
    memory_budget: int | None = None
    like: Path | None = None
    batch: int | None = None
    recompute: tuple[str, ...] = ()
    ranks: int | None = None
    dtype: str = "float32"
    autocast: str | None = None
    name: str | None = None
    out_dir: Path = Path(".")
    plan_dir: Path = Path("plans")
    tissue_mask: Path | None = None


def _sizes(text: str) -> tuple[int, ...] | None:
    """``"1, 3,224,224"`` -> ``(1, 3, 224, 224)``; ``None`` unless comma-separated integers."""
    parts = [part.strip() for part in text.split(",")]
    if not all(re.fullmatch(r"\d+", part) for part in parts):
        return None
    return tuple(int(part) for part in parts)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` -> ``(1, 3, 224, 224)``."""
    sizes = _sizes(text)
    if sizes is None:
        raise ShapeError(f"--input-shape must be comma-separated integers N,C,H,W, got {text!r}")
    return sizes


def parse_input(text: str, flag: str = "--input") -> tuple[tuple[int, ...], str | None]:
    """``"1,3,512,512:uint8"`` -> ``((1, 3, 512, 512), "uint8")``; without ``:DTYPE`` the dtype
    is ``None`` (the model's)."""
    match = re.fullmatch(r"\s*([\d,\s]+?)\s*(?::\s*([a-z0-9]+)\s*)?", text)
    if not match:
        raise ShapeError(f"{flag} must be SHAPE[:DTYPE], comma-separated sizes and a dtype (e.g. "
                         f"1,3,512,512:uint8), got {text!r}")
    dtype = match[2]
    if dtype is not None and dtype not in INPUT_DTYPES:
        raise ShapeError(f"{flag} {text!r}: dtype {dtype!r} is not one of {', '.join(INPUT_DTYPES)}")
    sizes = _sizes(match[1])
    if sizes is None:
        raise ShapeError(f"{flag} must be SHAPE[:DTYPE] with comma-separated integer sizes, got {text!r}")
    return sizes, dtype


def parse_inputs(inputs: tuple[str, ...], input_shape: str | None) -> tuple | None:
    """The ``inputs`` of a ``CompileConfig`` from ``--input`` (repeated) or ``--input-shape``
    (one input in the model's dtype); ``None`` when neither is given."""
    if inputs and input_shape is not None:
        raise ShapeError("give either --input (once per input) or --input-shape, not both")
    if input_shape is not None:
        return ((parse_shape(input_shape), None),)
    return tuple(parse_input(text) for text in inputs) or None


def parse_grid(text: str) -> tuple[int, int]:
    """``"4x3"`` -> ``(4, 3)`` (rows x columns)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise GridError(f"--grid must look like ROWSxCOLS (e.g. 4x4), got {text!r}")
    rows, cols = int(match[1]), int(match[2])
    if rows < 1 or cols < 1:
        raise GridError(f"--grid needs at least one tile per axis, got {text!r}")
    return rows, cols


UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
         "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"160MiB"`` -> 167772160; decimals allowed (``"1.5GB"``); no unit means bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in UNITS:
        raise BudgetError(f"--memory-budget must be a number with a unit (B, KB, MB, GB, KiB, MiB, GiB), got {text!r}")
    number = float(match[1]) * UNITS[match[2].upper()]
    if not math.isfinite(number):
        raise BudgetError(f"--memory-budget is too large to be a number of bytes, got {text!r}")
    value = round(number)
    if value < 1:
        raise BudgetError(f"--memory-budget must be positive, got {text!r}")
    return value


def budget_bytes(budget: int | str | None) -> int | None:
    """A memory budget as the API takes it, bytes or text (``"2GiB"``, ``parse_bytes``), in bytes."""
    if budget is None:
        return None
    if isinstance(budget, str):
        return parse_bytes(budget)
    if not is_int(budget) or budget < 1:
        raise BudgetError(f"memory_budget must be a positive number of bytes or a text such as '2GiB', got {budget!r}")
    return budget


def parse_segments(text: str) -> tuple[tuple, ...]:
    """``"0:10@8x8/4,10:20@1x1:tiled,20:31@1x1"`` -> ``((0, 10, (8, 8), None, 4), (10, 20, (1, 1),
    "tiled", 1), (20, 31, (1, 1), None, 1))``: half-open layer ranges, each with its grid, after
    ``/`` how many tiles of one shape class run as one call (default 1), and after ``:`` its mode
    where the grid does not say it (a 1x1 grid is stored unless ``:tiled``); ``tilec.ir.segments_text``
    writes them so. A grid ``ROWSxCOLSpx`` is tiles of one period, that many pixels of the model's
    first image input (``tilec.regions.Period``, its input's size filled in by the planner)."""
    segments = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+):(\d+)@([^/:]+?)(?:/(\d+))?(?::(tiled|stored))?\s*", part)
        if not match:
            raise GridError(f"--segments must look like FIRST:STOP@ROWSxCOLS[px][/BATCH][:tiled|:stored],... "
                            f"(e.g. 0:10@8x8/4,10:31@1x1), got {text!r}")
        grid = match[3].strip()
        if grid.endswith("px"):
            grid = tuple(Period(pixels, 0) for pixels in parse_grid(grid[:-2]))
        else:
            grid = parse_grid(grid)
        segments.append((int(match[1]), int(match[2]), grid, match[5], int(match[4] or 1)))
    return tuple(segments)


def parse_autocast(text: str) -> str:
    """``"cuda:float16"``: the device and dtype of the ``torch.autocast`` the step runs under."""
    match = re.fullmatch(r"\s*(cpu|cuda)\s*:\s*(bfloat16|float16)\s*", text)
    if not match:
        raise TilecError(f"--autocast must be DEVICE:DTYPE with DEVICE cpu or cuda and DTYPE bfloat16 or float16 "
                         f"(e.g. cuda:float16), got {text!r}")
    return f"{match[1]}:{match[2]}"


def parse_names(text: str) -> tuple[str, ...]:
    """``"relu_1, relu_3"`` -> ``("relu_1", "relu_3")`` (node names, as ``tilec inspect --nodes`` lists them)."""
    names = tuple(part.strip() for part in text.split(","))
    if not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) for name in names):
        raise GridError(f"--recompute must be node names NAME,NAME,... (see tilec inspect PLAN --nodes), got {text!r}")
    return names


def parse_name(text: str) -> str:
    """A plan and module name: it becomes ``NAME.plan.json`` and ``NAME_tiled.py``."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", text):
        raise TilecError(
            f"--name must be letters, digits, '_', '-' or '.' (no path separators), got {text!r}"
        )
    return text
