"""PrefixStore: chunk keys chained along the tokens, save a sequence's chunks, restore a prefix."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._lib import build_info, lib
from ..errors import StateError
from ..state import KVState, join_cells_data, parse
from ._directory import _MANIFEST, ChunkCorrupt, DirectoryBackend, StoreError, is_disk_full
from ._redis import RedisBackend, is_redis_url

if TYPE_CHECKING:
    from ..context import Context


Backend = DirectoryBackend | RedisBackend


def open_backend(where: str | os.PathLike | Backend, *, create: bool = True) -> Backend:
    """The backend ``where`` names: a ``redis://`` or ``rediss://`` URL is a :class:`RedisBackend`,
    anything else a store directory (:class:`DirectoryBackend`); a backend is returned as it is.

    Args:
        where: A directory, a Redis URL, or a backend.
        create: Make the store when it does not exist (False: refuse, as a command that inspects a
            store does, so a mistyped path is not made into a new store).

    Returns:
        The backend.

    Raises:
        StoreError: A path that is a file or not a store; a Redis server that cannot be reached
            (the message names the URL); a store of another format; with ``create=False``, no store.
    """
    if isinstance(where, (DirectoryBackend, RedisBackend)):
        return where
    if is_redis_url(where):
        return RedisBackend(str(where), create=create)
    if not create and not (Path(where) / _MANIFEST).is_file():
        what = "no such directory" if not Path(where).exists() else "not a prefix store (no manifest)"
        raise StoreError(f"{where}: {what}")
    return DirectoryBackend(where)


class PrefixStoreWarning(UserWarning):
    """The store could not be used for a while (the disk full, a chunk that would not load); the
    run goes on, computing what it could not restore and not storing what it could not write."""


_FILE_HASHES: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    """The sha256 of a file, computed once per (path, size, mtime) in this process."""
    st = path.stat()
    k = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    got = _FILE_HASHES.get(k)
    if got is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        got = _FILE_HASHES[k] = h.hexdigest()
    return got


def context_identity(ctx: Context) -> dict[str, Any]:
    """Everything about a context that changes the bytes of its KV cells or their meaning.

    The model file's sha256 (not its path: the same file on two machines is one model), the
    llama.cpp commit the package was built from, the K and V cache types, flash attention (it
    decides the V layout, ``v_trans``), the RoPE and YaRN settings, the number of KV streams (a
    dump carries it), the applied LoRA adapters (each file's sha256 and its scale) and control
    vector (its values' sha256 and the layers).

    Args:
        ctx: The context.

    Returns:
        A JSON-serializable dict; the store hashes it into every chunk key.
    """
    p = ctx.params
    loras = sorted((_file_sha256(a.path), float(s)) for a, s in ctx.loras.items())
    cvec = ctx.control_vector_applied
    return {
        "model": _file_sha256(ctx.model.path),
        "llama_cpp": build_info().get("llama_cpp_commit"),
        "type_k": int(p.type_k),
        "type_v": int(p.type_v),
        "flash_attn_type": int(p.flash_attn_type),
        "rope": [int(p.rope_scaling_type), float(p.rope_freq_base), float(p.rope_freq_scale)],
        "yarn": [
            float(p.yarn_ext_factor),
            float(p.yarn_attn_factor),
            float(p.yarn_beta_fast),
            float(p.yarn_beta_slow),
            int(p.yarn_orig_ctx),
        ],
        "n_stream": 1 if p.kv_unified else int(ctx.n_seq_max),
        "loras": loras,
        "cvec": None if cvec is None else [hashlib.sha256(cvec[0].tobytes()).hexdigest(), *cvec[1]],
    }


def _refuse_memory(ctx: Context) -> None:
    m = ctx.model
    if lib.llama_model_is_recurrent(m.ptr) or lib.llama_model_is_hybrid(m.ptr):
        raise ValueError(
            f"a prefix store cannot serve {m.path.name}: its memory is recurrent (or hybrid), one state per "
            "sequence that cannot be cut at a position, so no chunk of it stands for a prefix"
        )
    if m.n_swa:
        raise ValueError(
            f"a prefix store cannot serve {m.path.name}: its sliding-window layers (n_swa {m.n_swa}) keep only "
            "the last window's cells, so a chunk of early positions is gone from their cache"
        )


def _one_stream(chunks: list[KVState]) -> list[KVState]:
    """The chunks with their cells moved to the first chunk's stream.

    With a stream per sequence (``kv_unified=False``) a chunk holds its cells in the stream of the
    sequence it was saved from; llama.cpp loads a sequence dump's cells into the destination's own
    stream, but empties the sequence at each stream that has cells (``state_read_meta``), so a
    joined dump must hold them all in one."""
    want = next((s.index for s in chunks[0].parts[0].streams if s.cell_count), 0)
    out = []
    for st in chunks:
        part = st.parts[0]
        full = [s for s in part.streams if s.cell_count]
        if len(st.parts) != 1 or len(full) != 1 or full[0].index == want:
            out.append(st)
            continue
        raw, src = st.to_bytes(), full[0]
        empty = (0).to_bytes(4, "little")  # an empty stream is its cell_count, 0
        streams = [raw[src.offset : src.end] if i == want else empty for i in range(len(part.streams))]
        out.append(parse(raw[: part.streams[0].offset] + b"".join(streams) + raw[part.end :]))
    return out


@dataclass
class StoreStats:
    """What a store did in this process.

    Attributes:
        lookups: Chunk lookups by :meth:`PrefixStore.restore`.
        hits: Of those, chunks found and loaded.
        tokens_restored: Tokens that came from the store.
        chunks_written: Chunks written by :meth:`PrefixStore.save`.
        bytes_written: Their bytes.
        corrupt: Chunks whose checksum failed (removed, treated as misses).
        errors: Warnings given (the store then goes on without the failing part).
    """

    lookups: int = 0
    hits: int = 0
    tokens_restored: int = 0
    chunks_written: int = 0
    bytes_written: int = 0
    corrupt: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Hits per lookup (0 before any lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0


class PrefixStore:
    """Decoded prefixes kept as chunks of KV cells, shared by every run, process and context of the
    same identity (:func:`context_identity`).

    Args:
        where: A directory (made when missing), a Redis URL (``redis://host:port/db``, shared by
            every machine that reaches the server), or a backend (:func:`open_backend`).
        chunk_size: Positions per chunk (LMCache's default, 256).
        max_bytes: Keep the store at most this large: after each save the least recently used
            chunks are evicted (None: no cap).

    Raises:
        ValueError: ``chunk_size`` < 1 or ``max_bytes`` < 0.
        StoreError: ``where`` is a file, or a directory that is not a store of this format, or a
            Redis server that cannot be reached (the message names the URL).
    """

    def __init__(
        self, where: str | os.PathLike | Backend, *, chunk_size: int = 256, max_bytes: int | None = None
    ) -> None:
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be at least 1, not {chunk_size}")
        if max_bytes is not None and int(max_bytes) < 0:
            raise ValueError(f"max_bytes must be at least 0, not {max_bytes}")
        self.backend: Backend = open_backend(where)
        self.chunk_size = int(chunk_size)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.stats = StoreStats()
        self._no_writes = False  # set after the disk filled up: one warning, then no more writes

    def __repr__(self) -> str:
        return f"<PrefixStore {self.backend.root} chunk_size={self.chunk_size}>"

    # -- keys --------------------------------------------------------------------------------------
    def _root(self, ctx: Context) -> str:
        # made anew at each call: an adapter or control vector applied since changes the identity
        _refuse_memory(ctx)
        ident = dict(context_identity(ctx), chunk_size=self.chunk_size)
        root = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
        return root

    def keys(self, ctx: Context, tokens: npt.ArrayLike) -> list[str]:
        """The keys of the whole chunks of ``tokens`` under ``ctx``'s identity: key *k* hashes key
        *k - 1* and chunk *k*'s token ids (int32, little-endian), so it covers every token up to the
        chunk's end.

        Args:
            ctx: The context whose identity roots the keys.
            tokens: The token ids.

        Returns:
            One key (hex) per whole chunk.

        Raises:
            ValueError: A memory the store cannot serve (recurrent, hybrid, sliding window).
        """
        t = np.ascontiguousarray(tokens, dtype="<i4").reshape(-1)
        key = self._root(ctx)
        out = []
        c = self.chunk_size
        for k in range(t.size // c):
            key = hashlib.sha256(bytes.fromhex(key) + t[k * c : (k + 1) * c].tobytes()).hexdigest()
            out.append(key)
        return out

    # -- restore -----------------------------------------------------------------------------------
    def restore(self, ctx: Context, seq_id: int, tokens: npt.ArrayLike, *, keep: int = 1) -> int:
        """Load the longest stored prefix of ``tokens`` into the empty sequence ``seq_id``.

        The stored chunks are joined into one dump and loaded with ``llama_state_seq_set_data_ext``
        at their own positions (0 onwards); decode ``tokens[n:]`` after it. A chunk whose checksum
        fails is removed and ends the run there (a miss); a dump that will not load is a miss with
        a :class:`PrefixStoreWarning`, and the sequence stays empty.

        Args:
            ctx: The context.
            seq_id: The sequence, which must be empty.
            tokens: The prompt's token ids.
            keep: Tokens at the end not to restore (default 1: the last prompt token must be
                decoded for its logits).

        Returns:
            How many of the first tokens came from the store (a multiple of ``chunk_size``).

        Raises:
            ValueError: ``seq_id`` holds cells, or a memory the store cannot serve.
        """
        if ctx.memory.seq_pos_max(seq_id) >= 0:
            raise ValueError(f"restore: sequence {seq_id} holds cells; restore into an empty sequence")
        t = np.asarray(tokens).reshape(-1)
        usable = max(0, t.size - max(0, int(keep)))
        keys = self.keys(ctx, t[:usable])
        chunks: list[bytes] = []
        for key in keys:
            self.stats.lookups += 1
            try:
                data = self.backend.get(key)
            except ChunkCorrupt:
                self.stats.corrupt += 1
                break
            except OSError as e:
                self._warn(f"reading chunk {key[:16]}... failed ({e}); computing it instead")
                break
            if data is None:
                break
            chunks.append(data)
            self.stats.hits += 1
        if not chunks:
            return 0
        try:
            blob = chunks[0] if len(chunks) == 1 else join_cells_data(_one_stream([parse(c) for c in chunks]))
            ctx.set_seq_state(seq_id, blob, keep_on_error=False)
        except (StateError, ValueError) as e:
            ctx.memory.seq_rm(seq_id)
            self._warn(f"stored chunks did not load ({e}); computing them instead")
            return 0
        n = len(chunks) * self.chunk_size
        self.stats.tokens_restored += n
        return n

    # -- save --------------------------------------------------------------------------------------
    def save(self, ctx: Context, seq_id: int, tokens: npt.ArrayLike) -> int:
        """Store the whole chunks of sequence ``seq_id``, which holds ``tokens`` at positions 0 on.

        Chunks already stored are not written again. Once the disk is full the store warns once
        and writes nothing more in this process.

        Args:
            ctx: The context.
            seq_id: The sequence.
            tokens: The token ids it holds, from position 0 (at least its whole chunks).

        Returns:
            Chunks written.

        Raises:
            ValueError: The sequence does not hold positions ``0 .. len(tokens) - 1`` in one cell
                each, or a memory the store cannot serve.
        """
        if self._no_writes:
            return 0
        t = np.asarray(tokens).reshape(-1)
        keys = self.keys(ctx, t)
        try:
            missing = [(k, key) for k, key in enumerate(keys) if self.backend.find(key) is None]
        except OSError as e:  # a Redis server gone: the run goes on without storing
            self._warn(f"looking up chunks failed ({e}); going on without storing")
            return 0
        if not missing:
            return 0
        st = parse(ctx.seq_state(seq_id).data)
        pos = st.cells["pos"]
        c = self.chunk_size
        written = 0
        for k, key in missing:
            sel = (pos >= k * c) & (pos < (k + 1) * c)
            if int(sel.sum()) != c:
                raise ValueError(
                    f"save: sequence {seq_id} holds {int(sel.sum())} cells at positions {k * c}..{(k + 1) * c - 1}, "
                    f"not one per position: it does not hold these tokens from position 0"
                )
            data = st.select_cells(sel).to_bytes()
            try:
                nb = self.backend.put(key, data)
            except OSError as e:
                if is_disk_full(e):
                    self._no_writes = True
                    self._warn(f"the store's disk is full ({e}); going on without storing")
                    break
                if isinstance(e, (ConnectionError, TimeoutError)):  # the server gone: not one wait per chunk
                    self._warn(f"writing chunk {key[:16]}... failed ({e}); going on without storing")
                    break
                self._warn(f"writing chunk {key[:16]}... failed ({e}); going on without it")
                continue
            if nb:
                written += 1
                self.stats.chunks_written += 1
                self.stats.bytes_written += nb
        if written and self.max_bytes is not None:
            try:
                self.backend.evict(self.max_bytes)
            except OSError as e:
                self._warn(f"evicting down to {self.max_bytes} bytes failed ({e})")
        return written

    def _warn(self, msg: str) -> None:
        self.stats.errors.append(msg)
        warnings.warn(f"prefix store {self.backend.root}: {msg}", PrefixStoreWarning, stacklevel=3)
