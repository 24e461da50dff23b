"""The README's quick start runs exactly as written: its ``bash`` block, then its ``python``
block, from a copy of the repository's examples (the commands write ``out/`` where they run)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in ``language``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.slow
def test_quick_start_runs_as_written(tmp_path):
    (bash,), (python,) = blocks("bash"), blocks("python")
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    environment = {**os.environ, "PYTHONHASHSEED": "0"}
    shell = subprocess.run(["bash", "-e", "-c", bash], cwd=tmp_path, env=environment, capture_output=True,
                           text=True, timeout=600)
    assert shell.returncode == 0, shell.stdout[-3000:] + shell.stderr[-3000:]
    assert "-> OK" in shell.stdout, shell.stdout[-3000:]
    snippet = subprocess.run([sys.executable, "-c", python], cwd=tmp_path, env=environment, capture_output=True,
                             text=True, timeout=600)
    assert snippet.returncode == 0, snippet.stdout[-3000:] + snippet.stderr[-3000:]
    assert snippet.stdout.startswith("loss ")
