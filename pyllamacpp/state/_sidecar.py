"""``<dump>.json`` next to a dump: the facts the dump itself does not carry (head counts, model)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path

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
    p = Path(dump)
    return p if p.suffix == ".json" else p.with_name(p.name + ".json")


def _plain(v):
    if hasattr(v, "tolist"):  # numpy arrays and scalars
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def write_sidecar(path: str | os.PathLike, **facts) -> Path:
    """Write ``<path>.json`` atomically (temp file + os.replace); return its path.

    Fields: see SIDECAR_FIELDS; others raise TypeError (a typo would otherwise go unread).
    """
    unknown = sorted(set(facts) - set(SIDECAR_FIELDS))
    if unknown:
        raise TypeError(f"unknown sidecar fields {unknown}; known: {sorted(SIDECAR_FIELDS)}")
    target = sidecar_path(path)
    text = json.dumps({k: _plain(v) for k, v in facts.items()}, indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return target


def read_sidecar(path: str | os.PathLike) -> dict | None:
    """The sidecar of dump ``path`` (or the .json itself) as a dict, or None when there is none."""
    p = sidecar_path(path)
    if not p.is_file():
        return None
    facts = json.loads(p.read_text())
    if not isinstance(facts, dict):
        raise ValueError(f"{p}: a sidecar holds a JSON object, not {type(facts).__name__}")
    return facts


def _field(reader, key):
    f = reader.get_field(key)
    return None if f is None else f.contents()


@lru_cache(maxsize=4)
def _gguf_reader(path: str, size: int, mtime_ns: int):
    # GGUFReader reads the whole vocabulary too (~2 s for a 49k-token model): cache per file.
    from gguf import GGUFReader
    return GGUFReader(path)


def gguf_field(path: str | os.PathLike, key: str):
    """One metadata value of a GGUF file (arrays as lists), None when absent. For what
    llama.cpp's ``llama_model_meta_val_str`` leaves out: it skips array values."""
    st = os.stat(path)
    return _field(_gguf_reader(os.fspath(path), st.st_size, st.st_mtime_ns), key)


@lru_cache(maxsize=8)
def _gguf_facts(path: str, size: int, mtime_ns: int) -> dict:
    r = _gguf_reader(path, size, mtime_ns)
    arch = _field(r, "general.architecture")
    head_kv = _field(r, f"{arch}.attention.head_count_kv")
    n_head = _field(r, f"{arch}.attention.head_count")
    n_embd = _field(r, f"{arch}.embedding_length")
    default_head = n_embd // n_head if isinstance(n_head, int) and n_head else None
    if isinstance(head_kv, list):
        # per-layer counts, 0 for a layer without attention (hybrid models): one number only
        # when the attention layers agree
        head_kv = set(head_kv) - {0}
        head_kv = head_kv.pop() if len(head_kv) == 1 else None
    keys = ["general.architecture"] + [f"{arch}.{k}" for k in rule_keys(arch)]  # absent ones as None
    fields = {k: _field(r, k) for k in keys}
    layers = layer_map(fields)
    memory = None if layers else memory_for(fields)
    return {
        "model": Path(path).name, "arch": arch, "n_layer": _field(r, f"{arch}.block_count"),
        "n_head_kv": head_kv or None,
        "n_embd_head_k": _field(r, f"{arch}.attention.key_length") or default_head,
        "n_embd_head_v": _field(r, f"{arch}.attention.value_length") or default_head,
        "layers": layers,
        **({"memory": memory} if memory else {}),
    }


def model_facts(model, *, sha256: bool = False) -> dict:
    """Head counts, sizes and the layer map (``layers``, None for an architecture _layers does
    not know) of ``model``: a GGUF path (read with gguf.GGUFReader) or an object with an
    ``n_head_kv`` attribute (or method), whose ``path``, when it has one, is read as the GGUF
    (pyllamacpp.Model). ``sha256=True`` adds the file's sha256 prefix."""
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
