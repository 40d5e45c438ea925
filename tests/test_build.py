"""What the build prints (issue 29): the configure step of a pinned tree names the pin's commit,
git says nothing (the sdist's tree has no git history), and llama.cpp's own warnings are off.

The configure step alone, into a temporary build folder: about 10-20 s, no compile."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "vendor" / "llama.cpp"


def _pin_commit() -> str:
    m = re.search(r"^commit=([0-9a-f]{40})$", (VENDOR / "PYLLAMACPP_PIN.txt").read_text(), re.M)
    assert m, "PYLLAMACPP_PIN.txt has no commit= line"
    return m.group(1)


@pytest.fixture(scope="module")
def configure(tmp_path_factory):
    cmake = shutil.which("cmake")
    if cmake is None or not (VENDOR / "CMakeLists.txt").exists():
        pytest.skip("needs cmake and a filled vendor/llama.cpp")
    build = tmp_path_factory.mktemp("configure")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    r = subprocess.run(
        [cmake, "-S", str(ROOT), "-B", str(build), *gen, f"-DPython_EXECUTABLE={sys.executable}",
         "-DCMAKE_BUILD_TYPE=Release", "-DPYLLAMACPP_CCACHE=OFF"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r, build


def test_the_pinned_tree_gives_its_commit_and_git_says_nothing(configure):
    r, _ = configure
    out = r.stdout + r.stderr
    assert "not a git repository" not in out and "fatal:" not in out
    short = _pin_commit()[:7]
    assert f"ggml commit:  {short}" in out, [ln for ln in out.splitlines() if "commit" in ln]


def test_llama_cpp_warnings_are_off(configure):
    _, build = configure
    cache = (build / "CMakeCache.txt").read_text()
    assert re.search(r"^LLAMA_ALL_WARNINGS:BOOL=OFF$", cache, re.M)
    assert re.search(r"^GGML_ALL_WARNINGS:BOOL=OFF$", cache, re.M)
    flags = "\n".join(p.read_text() for p in build.rglob("flags.make")) + "\n".join(
        p.read_text() for p in build.glob("*.ninja")
    )
    assert "-Wextra" not in flags  # llama.cpp's -Wall -Wextra set nowhere
