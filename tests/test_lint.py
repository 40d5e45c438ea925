"""Lint and types are habits: ruff (lint and format) over the tree and mypy over the package pass.

The configuration is pyproject.toml's ``[tool.ruff]`` and ``[tool.mypy]``; both tools come with the
``test`` extra. Fix findings with ``ruff check --fix .``, ``ruff format .`` and by reading ``mypy``'s.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(tool) is None:
        pytest.skip(f"{tool} is not installed (it comes with the test extra)")
    return subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_ruff_check():
    r = _run("ruff", "check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format():
    r = _run("ruff", "format", "--check", ".")
    assert r.returncode == 0, "files `ruff format` would change:\n" + r.stdout + r.stderr


def test_mypy_on_the_package():
    r = _run("mypy")  # packages = ["pyllamacpp"] in pyproject.toml
    assert r.returncode == 0, r.stdout + r.stderr
