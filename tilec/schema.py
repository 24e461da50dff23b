"""The JSON schema of plan files, exported from the pydantic models.

``python -m tilec.schema [PATH]`` writes it to ``PATH`` (default ``plans/plan.schema.json``,
relative to the current directory: run it from the repository root). The committed copy is
checked against the models by the test suite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tilec.ir import Plan

DEFAULT_PATH = Path("plans") / "plan.schema.json"


def plan_schema() -> dict:
    """The JSON schema (draft 2020-12) that every plan file satisfies: the plan's own at the top
    level, and in ``$defs`` (``Plan.other`` refers to it)."""
    exported = Plan.model_json_schema()
    return {**exported["$defs"]["Plan"], "$defs": exported["$defs"]}


def schema_text() -> str:
    """The schema as deterministic JSON text (sorted keys, two-space indent, final newline)."""
    return json.dumps(plan_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DEFAULT_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(schema_text(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
