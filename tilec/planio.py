"""Plan files: deterministic JSON text, atomic writes, validated loading, and the generated
module's bytecode."""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import tempfile
from pathlib import Path

from pydantic import ValidationError

from tilec.errors import OutputError, PlanError
from tilec.ir import Plan
from tilec.validate import check_version, validate


def _flat(value) -> bool:
    """A scalar, or a list of scalars."""
    if isinstance(value, list):
        return not any(isinstance(v, dict | list) for v in value)
    return not isinstance(value, dict)


def _format(value, indent: int) -> str:
    """JSON with nested objects and lists of objects indented; lists of scalars, and objects of
    scalars and such lists (one tile's step: ``{"out": [0, 8], "read": ...}``), on one line."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict):
        if all(_flat(v) for v in value.values()):
            return json.dumps(value, separators=(", ", ": "))
        items = (f"{inner}{json.dumps(k)}: {_format(v, indent + 1)}" for k, v in value.items())
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        if all(isinstance(v, list) and not any(isinstance(x, dict | list) for x in v) for v in value):
            return json.dumps(value, separators=(", ", ": "))
        return "[\n" + ",\n".join(f"{inner}{_format(v, indent + 1)}" for v in value) + f"\n{pad}]"
    return json.dumps(value, separators=(", ", ": "))


def dumps(plan: Plan) -> str:
    """The plan as JSON text; the same plan always gives the same bytes."""
    return _format(json.loads(plan.model_dump_json()), 0) + "\n"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _missing_parents(folder: Path) -> list[Path]:
    """The folders ``mkdir(parents=True)`` would create for ``folder``, outermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]


def _why(path: Path, error: OSError) -> str:
    """The reason ``path`` cannot be written, naming the culprit folder where there is one."""
    try:
        for parent in reversed(path.parents):
            if parent.exists() and not parent.is_dir():
                return f"{parent} is a file, not a directory"
        if path.is_dir():
            return "it is a directory"
    except OSError:  # the path itself cannot be looked up (a name too long)
        pass
    return error.strerror or str(error)


def write_files(files: dict[Path, str | bytes]) -> None:
    """Write every file or none: stage each beside its target, then rename them all.

    A failure while staging removes what was staged and the folders it created, and leaves
    the targets untouched.
    """
    staged: list[tuple[str, Path]] = []
    created: list[Path] = []
    path = Path("output")
    try:
        for path, text in files.items():
            path = Path(path)
            if path.is_dir():
                raise IsADirectoryError(21, "it is a directory", str(path))
            missing = _missing_parents(path.parent)
            path.parent.mkdir(parents=True, exist_ok=True)
            created += missing
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append((temporary, path))
            os.chmod(temporary, 0o666 & ~_umask())
            if isinstance(text, bytes):
                with os.fdopen(handle, "wb") as stream:
                    stream.write(text)
            else:
                with os.fdopen(handle, "w", encoding="utf-8") as stream:
                    stream.write(text)
        for temporary, path in staged:
            os.replace(temporary, path)
    except OSError as error:
        for temporary, _ in staged:
            Path(temporary).unlink(missing_ok=True)
        for folder in reversed(created):
            try:
                folder.rmdir()
            except OSError:
                pass
        raise OutputError(f"cannot write {path}: {_why(path, error)}") from None


def write_bytecode(module_path: Path) -> None:
    """Compile the generated module at ``module_path`` into the checked-hash .pyc (PEP 552) that
    ``import`` finds beside it and loads without compiling; Python verifies it against the
    source's hash (never its timestamp), and another Python version compiles the source instead.
    The bytecode names the module by its file name, not its folder (``import`` puts in the path it
    was loaded from): the same module gives the same bytes wherever it is written.

    Compiling costs about 80 bytes of transient heap per byte of source (240 MiB for the 3 MB
    module of a U-Net in 6x6 tiles with 18 levels of sweeps): here it is the compiler's, not the
    training process's, whose steps would find it free and grow by less than they hold.
    """
    try:
        py_compile.compile(str(module_path), dfile=module_path.name, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    except (OSError, py_compile.PyCompileError) as error:
        cache = Path(importlib.util.cache_from_source(str(module_path)))
        why = _why(cache, error) if isinstance(error, OSError) else error.msg
        raise OutputError(f"cannot write {cache}: {why}") from None


def loads(text: str, source: str = "plan") -> Plan:
    """Parse and validate plan JSON text; every failure is one ``PlanError`` line."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(f"{source} is not JSON: {error.msg} at line {error.lineno}") from None
    except (ValueError, RecursionError) as error:
        raise PlanError(f"{source} is not JSON tilec can read: {error}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{source} is not a plan: the top level is not an object")
    check_version(data, source)
    try:
        plan = Plan.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        parts = [str(part) if str(part).isidentifier() or isinstance(part, int) else repr(part)
                 for part in first["loc"]]
        where = ".".join(parts) or "(top level)"
        raise PlanError(f"{source} violates the plan schema at {where}: {first['msg']}") from None
    return validate(plan, source)


def load(path: Path) -> Plan:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PlanError(f"cannot read plan {path}: {getattr(error, 'strerror', None) or error}") from None
    return loads(text, source=str(path))
