"""Regenerate the golden files after an intended change to the planner or the code generator.

Run from the repository root:

    python tests/golden/regenerate.py

It compiles ``small_model.py`` with the segments below into ``small_tiled.py`` and
``small.plan.json`` beside this script. Review the diff before committing it.
"""

from __future__ import annotations

from pathlib import Path

from tilec.config import CompileConfig
from tilec.pipeline import compile_model

HERE = Path(__file__).resolve().parent
MODEL_FILE = HERE / "small_model.py"
NAME = "small"
#: Nodes 0..4 (stem and the residual block's first conv: the skip crosses the cut) tiled 2x3,
#: nodes 5..14 (the rest of the block, pool, transposed conv, pad, concat, fuse) tiled 3x2,
#: nodes 15..16 (global mean and linear head) stored.
SEGMENTS = ((0, 5, (2, 3)), (5, 15, (3, 2)), (15, 17, (1, 1)))
MODULE_FILE = HERE / f"{NAME}_tiled.py"
PLAN_FILE = HERE / f"{NAME}.plan.json"
COMMAND = "python tests/golden/regenerate.py"


def config(out_dir: Path) -> CompileConfig:
    """The golden compile, writing both files into ``out_dir``."""
    return CompileConfig(model_path=MODEL_FILE, segments=SEGMENTS, name=NAME, out_dir=out_dir, plan_dir=out_dir)


def main() -> None:
    result = compile_model(config(HERE))
    print(f"wrote {result.module_path} and {result.plan_path}")


if __name__ == "__main__":
    main()
