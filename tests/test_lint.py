"""The code passes ruff with the project's rules, among them the banned-API rule (flake8-tidy-imports
``TID251``, ``[tool.ruff.lint.flake8-tidy-imports.banned-api]`` in pyproject.toml): nothing reads
or writes pickles (``pickle``, ``torch.load``, ``torch.save``, ``marshal``, ``shelve``), in tilec,
its tests, benchmarks and examples, and in the modules it generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from tilec.codegen import render
from tilec.planner import plan
from tilec.trace import trace

ROOT = Path(__file__).resolve().parents[1]


def _ruff(*args: str, source: str | None = None) -> subprocess.CompletedProcess:
    try:
        import ruff  # noqa: F401
    except ImportError:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT, input=source,
                          capture_output=True, text=True, timeout=120)


def test_ruff_passes():
    done = _ruff("tilec", "tests", "benchmarks", "examples")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.parametrize("source", ["import pickle\n", "from pickle import loads\n", "import marshal\n",
                                    "import shelve\n", "import torch\n\ntorch.load('x.pt')\n",
                                    "import torch\n\ntorch.save({}, 'x.pt')\n", "from torch import load\n"])
def test_the_banned_api_rule_catches_pickles(source):
    done = _ruff("--select", "TID251", "--stdin-filename", "tilec/example.py", "-", source=source)
    assert done.returncode == 1 and "TID251" in done.stdout, done.stdout + done.stderr


def test_generated_modules_use_no_banned_api():
    """The generated module (tilec/runtime's code and the template's) is checked as tilec's own."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 3))
    source = render(plan(trace(model, (1, 3, 16, 16)), name="x", grid=(2, 2)))
    done = _ruff("--select", "TID251", "--stdin-filename", "tilec/generated.py", "-", source=source)
    assert done.returncode == 0, done.stdout + done.stderr
