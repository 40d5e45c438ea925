"""``<dump>.json`` next to a dump: the facts the dump itself does not carry (head counts, model)."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any

from ._gguf import read_metadata
from ._layers import layer_map, memory_for, rule_keys

SIDECAR_FIELDS = {
    "model": "model file name",
    "model_sha256": "prefix of the model file's sha256",
    "arch": "general.architecture",
    "n_layer": "<arch>.block_count",
    "n_head_kv": "<arch>.attention.head_count_kv",
    "n_embd_head_k": "K head size",
    "n_embd_head_v": "V head size",
    "type_k": "KV cache K type (f16, q8_0 ...)",
    "type_v": "KV cache V type",
    "flash_attn": "flash attention on (V not transposed)",
    "kv_unified": "llama_context_params.kv_unified",
    "n_ctx": "context size",
    "llama_cpp_commit": "llama.cpp commit that wrote the dump",
    "tokens": "token ids the dump holds",
    "layers": "the model layer (il) of each record, per memory part: {part: [il, ...]} (see _layers)",
    "flags": "llama_state_seq_flags the dump was written with (PARTIAL_ONLY 1, ON_DEVICE 2)",
    "memory": "the memory's layout name (dsa, msa ...) where there is no layer map to say it (see _layers)",
}


def sidecar_path(dump: str | os.PathLike) -> Path:
    """Where the sidecar of a dump lives: ``<dump>.json`` (a ``.json`` path is its own).

    Args:
        dump: The dump's path (or the sidecar's).

    Returns:
        The sidecar's path (it may not exist).
    """
    p = Path(dump)
    return p if p.suffix == ".json" else p.with_name(p.name + ".json")


def _plain(v):
    if hasattr(v, "tolist"):  # numpy arrays and scalars
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _dumps(v, indent: str = "") -> str:
    """JSON with one key per line, and a list of numbers or strings on one line (a layer map
    stays readable: ``"kv": [0, 1, ...]``, not one number per line)."""
    if isinstance(v, dict) and v:
        inner = indent + " "
        items = ",\n".join(f"{inner}{json.dumps(str(k))}: {_dumps(x, inner)}" for k, x in sorted(v.items()))
        return "{\n" + items + "\n" + indent + "}"
    if isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v):
        inner = indent + " "
        return "[\n" + ",\n".join(inner + _dumps(x, inner) for x in v) + "\n" + indent + "]"
    return json.dumps(v)


def write_sidecar(path: str | os.PathLike, **facts: Any) -> Path:
    """Write ``<path>.json`` atomically (temp file + os.replace).

    The file gets the umask's permissions, as the dump does. ``parse(path)`` reads it back.

    Args:
        path: The dump's path.
        **facts: Fields of SIDECAR_FIELDS (numpy values are written as plain JSON).

    Returns:
        The sidecar's path.

    Raises:
        TypeError: A field not in SIDECAR_FIELDS (a typo would otherwise go unread).
        OSError: The file cannot be written.
    """
    unknown = sorted(set(facts) - set(SIDECAR_FIELDS))
    if unknown:
        raise TypeError(f"unknown sidecar fields {unknown}; known: {sorted(SIDECAR_FIELDS)}")
    target = sidecar_path(path)
    text = _dumps({k: _plain(v) for k, v in facts.items()})
    # a unique name beside the target, opened with mode 0o666 so the umask decides, as for the
    # dump (tempfile.mkstemp would make it 0600)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """The sidecar of dump ``path`` (or the .json itself) as a dict.

    Args:
        path: The dump's path, or the sidecar's.

    Returns:
        The facts, or None when there is no sidecar.

    Raises:
        ValueError: The file holds no JSON object (json.JSONDecodeError, a ValueError, for bad
            JSON).
    """
    p = sidecar_path(path)
    if not p.is_file():
        return None
    facts = json.loads(p.read_text())
    if not isinstance(facts, dict):
        raise ValueError(f"{p}: a sidecar holds a JSON object, not {type(facts).__name__}")
    return facts


def _model_keys(key: str) -> bool:
    # everything but the tokenizer's (vocabulary, merges, chat template): no layer rule reads them
    return not key.startswith("tokenizer.")


@lru_cache(maxsize=8)
def _gguf_meta(path: str, size: int, mtime_ns: int) -> dict:
    # the KV section only (_gguf.read_metadata, ~7 ms), not gguf.GGUFReader (~2 s): cached per file
    return read_metadata(path, _model_keys)


def _meta(path: str | os.PathLike) -> dict:
    st = os.stat(path)
    return _gguf_meta(os.fspath(path), st.st_size, st.st_mtime_ns)


def gguf_field(path: str | os.PathLike, key: str) -> Any:
    """One metadata value of a GGUF file (arrays as lists), None when absent.

    For what llama.cpp's ``llama_model_meta_val_str`` leaves out: it skips array values.

    Args:
        path: The GGUF file.
        key: The metadata key (``general.architecture`` ...).

    Returns:
        The value (arrays as lists), or None when the file lacks the key.

    Raises:
        StateFormatError: ``path`` is no GGUF file or its metadata is cut short.
        OSError: the file cannot be read.
    """
    if _model_keys(key):
        return _meta(path).get(key)
    return read_metadata(path, (key,)).get(key)


@lru_cache(maxsize=8)
def _gguf_facts(path: str, size: int, mtime_ns: int) -> dict:
    r = _gguf_meta(path, size, mtime_ns).get
    arch = r("general.architecture")
    head_kv = r(f"{arch}.attention.head_count_kv")
    n_head = r(f"{arch}.attention.head_count")
    n_embd = r(f"{arch}.embedding_length")
    default_head = n_embd // n_head if isinstance(n_embd, int) and isinstance(n_head, int) and n_head else None
    if isinstance(head_kv, list):
        # per-layer counts, 0 for a layer without attention (hybrid models): one number only
        # when the attention layers agree
        head_kv = set(head_kv) - {0}
        head_kv = head_kv.pop() if len(head_kv) == 1 else None
    keys = ["general.architecture"] + [f"{arch}.{k}" for k in rule_keys(arch)]  # absent ones as None
    fields = {k: r(k) for k in keys}
    layers = layer_map(fields)
    memory = None if layers else memory_for(fields)
    return {
        "model": Path(path).name,
        "arch": arch,
        "n_layer": r(f"{arch}.block_count"),
        "n_head_kv": head_kv or None,
        "n_embd_head_k": r(f"{arch}.attention.key_length") or default_head,
        "n_embd_head_v": r(f"{arch}.attention.value_length") or default_head,
        "layers": layers,
        **({"memory": memory} if memory else {}),
    }


def model_facts(model: str | os.PathLike | Any, *, sha256: bool = False) -> dict:
    """Head counts, sizes and the layer map of a model: what a sidecar records about it.

    Args:
        model: A GGUF path (its KV metadata only is read) or an object with an ``n_head_kv``
            attribute (or method), whose ``path``, when it has one, is read as the GGUF
            (``pyllamacpp.Model``).
        sha256: Add ``model_sha256``, the file's sha256 prefix (reads the whole file).

    Returns:
        Sidecar fields: model, arch, n_layer, n_head_kv, n_embd_head_k/v, ``layers`` (None for
        an architecture _layers does not know) and, where there is no map, ``memory``.

    Raises:
        TypeError: ``model`` is neither a path nor has ``n_head_kv``.
        OSError: The file cannot be read.
        StateFormatError: The file is no GGUF or its metadata is cut short.
    """
    if isinstance(model, (str, os.PathLike)):
        st = os.stat(model)
        facts = dict(_gguf_facts(os.fspath(model), st.st_size, st.st_mtime_ns))
        if sha256:
            h = hashlib.sha256()
            with open(model, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            facts["model_sha256"] = h.hexdigest()[:16]
        return facts
    n = getattr(model, "n_head_kv", None)
    if n is None:
        raise TypeError(f"model= takes a GGUF path or an object with n_head_kv, not {type(model).__name__}")
    path = getattr(model, "path", None)
    facts = model_facts(path) if isinstance(path, (str, os.PathLike)) and os.path.isfile(path) else {}
    n = int(n() if callable(n) else n)
    # llama_model_n_head_kv is layer 0's count: 0 when layer 0 has no attention (hybrid models)
    return {**facts, "n_head_kv": n or facts.get("n_head_kv")}
