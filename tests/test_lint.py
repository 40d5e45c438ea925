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


def _python_children_without_cwd(source: str) -> list[int]:
    """Lines of ``subprocess`` calls that start ``sys.executable -c``/``-m`` with no ``cwd=``."""
    import ast

    found = []
    for n in ast.walk(ast.parse(source)):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args):
            continue
        if not (isinstance(n.func.value, ast.Name) and n.func.value.id == "subprocess"):
            continue
        first = n.args[0]
        if not (isinstance(first, ast.List) and first.elts and ast.unparse(first.elts[0]) == "sys.executable"):
            continue
        flags = [e.value for e in first.elts[1:3] if isinstance(e, ast.Constant)]
        if ("-c" in flags or "-m" in flags) and "venv" not in flags and not any(k.arg == "cwd" for k in n.keywords):
            found.append(n.lineno)
    return found


def test_python_children_in_the_tests_run_away_from_the_repo_root():
    """A child ``python -c`` puts its working folder first on sys.path. Run from the repo root (as CI
    runs the tests), it imports the source tree, which has no compiled extension once the package is
    installed as a wheel: every such child says where it runs."""
    bad = [
        f"{f.name}:{line}"
        for f in sorted((ROOT / "tests").glob("*.py"))
        for line in _python_children_without_cwd(f.read_text())
    ]
    assert bad == [], "give these a cwd= (tmp_path, or tempfile.gettempdir()): " + ", ".join(bad)
    planted = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    assert _python_children_without_cwd(planted) == [2]
    assert _python_children_without_cwd(planted.replace("check=True", "cwd='/'")) == []
