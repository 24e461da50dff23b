"""Regenerate the golden files after an intended change to the planner or the code generator.

Run from the repository root:

    python tests/golden/regenerate.py

It compiles ``small_model.py`` with grid 2x3 into ``small_tiled.py`` and ``small.plan.json``
beside this script. Review the diff before committing it.
"""

from __future__ import annotations

from pathlib import Path

from tilec.config import CompileConfig
from tilec.pipeline import compile_model

HERE = Path(__file__).resolve().parent
MODEL_FILE = HERE / "small_model.py"
NAME = "small"
GRID = (2, 3)
MODULE_FILE = HERE / f"{NAME}_tiled.py"
PLAN_FILE = HERE / f"{NAME}.plan.json"
COMMAND = "python tests/golden/regenerate.py"


def config(out_dir: Path) -> CompileConfig:
    """The golden compile, writing both files into ``out_dir``."""
    return CompileConfig(model_path=MODEL_FILE, grid=GRID, name=NAME, out_dir=out_dir, plan_dir=out_dir)


def main() -> None:
    result = compile_model(config(HERE))
    print(f"wrote {result.module_path} and {result.plan_path}")


if __name__ == "__main__":
    main()
