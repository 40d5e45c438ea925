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

from .._context_state import model_memory
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


def _memory(ctx: Context) -> str:
    """The memory the store serves: "kv" (one KV cache) or "iswa" (a full cache beside a
    sliding-window one); anything else raises ValueError with the reason."""
    m = ctx.model
    if lib.llama_model_is_recurrent(m.ptr) or lib.llama_model_is_hybrid(m.ptr):
        raise ValueError(
            f"a prefix store cannot serve {m.path.name}: its memory is recurrent (or hybrid), one state per "
            "sequence that cannot be cut at a position, so no chunk of it stands for a prefix"
        )
    if not m.n_swa:
        return "kv"
    name = model_memory(m)[0]
    if name != "iswa":
        raise ValueError(
            f"a prefix store cannot serve {m.path.name}: its sliding-window layers (n_swa {m.n_swa}) sit in "
            f"{'a ' + name if name else 'a memory pyllamacpp.state does not know'}, not an iSWA cache (a full "
            "cache beside a sliding-window one), the only sliding-window memory whose window the store keeps"
        )
    return "iswa"


def window_key(key: str) -> str:
    """The key of the sliding-window cells kept at the end of the chunk whose key is ``key``.

    Args:
        key: A chunk's key (hex).

    Returns:
        The window's key (hex): the sha256 of the chunk's key and ``b"window"``.
    """
    return hashlib.sha256(bytes.fromhex(key) + b"window").hexdigest()


def _only(st: KVState, part: str) -> Any:
    """The stream of ``part`` that holds cells (a sequence's dump has at most one), or None."""
    full = [s for p in st.parts if p.name == part for s in p.streams if s.cell_count]
    if len(full) > 1:
        raise ValueError(f"a sequence's dump holds cells in {len(full)} streams of its {part} part")
    return full[0] if full else None


def _emptied(st: KVState, part: str) -> KVState:
    """``st`` with no cells left in ``part``."""
    s = _only(st, part)
    return st if s is None else st.select_cells(np.zeros(s.cell_count, bool), part=part, stream=s.index)


def _one_stream(chunks: list[KVState], memory: str) -> list[KVState]:
    """The chunks with their cells moved to the first chunk's stream, in every part.

    With a stream per sequence (``kv_unified=False``) a chunk holds its cells in the stream of the
    sequence it was saved from; llama.cpp loads a sequence dump's cells into the destination's own
    stream, but empties the sequence at each stream that has cells (``state_read_meta``), so a
    joined dump must hold them all in one."""
    want = next((s.index for p in chunks[0].parts for s in p.streams if s.cell_count), 0)
    empty = (0).to_bytes(4, "little")  # an empty stream is its cell_count, 0
    out = []
    for st in chunks:
        moves = [(p, _only(st, p.name)) for p in st.parts]
        if all(src is None or src.index == want for _, src in moves):
            out.append(st)
            continue
        raw, pieces, at = st.to_bytes(), [], 0
        for part, src in moves:
            if src is None or src.index == want:
                continue
            pieces.append(raw[at : part.streams[0].offset])
            pieces += [raw[src.offset : src.end] if i == want else empty for i in range(len(part.streams))]
            at = part.end
        out.append(parse(b"".join(pieces) + raw[at:], memory=memory))
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
        _memory(ctx)
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
    def stored(self, ctx: Context, tokens: npt.ArrayLike) -> int:
        """How many first tokens of ``tokens`` a restore would load, looked up without reading a
        chunk (a chunk whose checksum fails would still end the run when read).

        Args:
            ctx: The context whose identity roots the keys.
            tokens: The token ids (all of them count: no ``keep``).

        Returns:
            A multiple of ``chunk_size``: the run of stored chunks from the first (with a
            sliding-window model, up to a chunk whose window is stored); 0 when the backend fails.

        Raises:
            ValueError: A memory the store cannot serve.
        """
        memory = _memory(ctx)
        keys = self.keys(ctx, tokens)
        n = 0
        try:
            while n < len(keys) and self.backend.find(keys[n]) is not None:
                n += 1
            while memory == "iswa" and n and self.backend.find(window_key(keys[n - 1])) is None:
                n -= 1
        except OSError:
            return 0
        return n * self.chunk_size

    def restore(self, ctx: Context, seq_id: int, tokens: npt.ArrayLike, *, keep: int = 1) -> int:
        """Load the longest stored prefix of ``tokens`` into the empty sequence ``seq_id``.

        The stored chunks are joined into one dump and loaded with ``llama_state_seq_set_data_ext``
        at their own positions (0 onwards); decode ``tokens[n:]`` after it. With a sliding-window
        model (an iSWA cache) the prefix ends where a chunk ends whose window is stored too (see
        :meth:`save`): the chunks give the full cache's cells, the window the sliding-window cache's.
        A chunk whose checksum fails is removed and ends the run there (a miss); a dump that will not
        load is a miss with a :class:`PrefixStoreWarning`, and the sequence stays empty.

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
        memory = _memory(ctx)
        t = np.asarray(tokens).reshape(-1)
        usable = max(0, t.size - max(0, int(keep)))
        keys = self.keys(ctx, t[:usable])
        chunks: list[bytes] = []
        for key in keys:
            self.stats.lookups += 1
            data = self._get(key)
            if data is None:
                break
            chunks.append(data)
            self.stats.hits += 1
        if memory == "iswa":  # the longest run of chunks whose last has its window
            while chunks:
                window = self._get(window_key(keys[len(chunks) - 1]))
                if window is not None:
                    chunks.append(window)
                    break
                chunks.pop()
        if not chunks:
            return 0
        try:
            if len(chunks) == 1:
                blob: Any = chunks[0]
            else:
                blob = join_cells_data(_one_stream([parse(c, memory=memory) for c in chunks], memory))
            ctx.set_seq_state(seq_id, blob, keep_on_error=False)
        except (StateError, ValueError) as e:
            ctx.memory.seq_rm(seq_id)
            self._warn(f"stored chunks did not load ({e}); computing them instead")
            return 0
        n = (len(chunks) - (memory == "iswa")) * self.chunk_size
        self.stats.tokens_restored += n
        return n

    def _get(self, key: str) -> bytes | None:
        """A stored entry, None for a miss (absent, its checksum failed, or the backend failed)."""
        try:
            return self.backend.get(key)
        except ChunkCorrupt:
            self.stats.corrupt += 1
        except OSError as e:
            self._warn(f"reading chunk {key[:16]}... failed ({e}); computing it instead")
        return None

    # -- save --------------------------------------------------------------------------------------
    def save(self, ctx: Context, seq_id: int, tokens: npt.ArrayLike) -> int:
        """Store the whole chunks of sequence ``seq_id``, which holds ``tokens`` at positions 0 on.

        Chunks already stored are not written again. With a sliding-window model (an iSWA cache) a
        chunk holds the full cache's cells of its positions, and the sliding-window cache's cells
        are stored as a window beside the chunk that ends where the sequence ends: only then does
        the sequence hold them (llama.cpp writes no cell the window has left). So a restore can go
        up to the end of a chunk only where the sequence was saved at that end; :meth:`prefill`
        stops at every chunk's end to keep each window. Once the disk is full the store warns once
        and writes nothing more in this process.

        Args:
            ctx: The context.
            seq_id: The sequence.
            tokens: The token ids it holds, from position 0 (at least its whole chunks).

        Returns:
            Entries written (chunks, and a window).

        Raises:
            ValueError: The sequence does not hold positions ``0 .. len(tokens) - 1`` in one cell
                each, or a memory the store cannot serve.
        """
        if self._no_writes:
            return 0
        memory = _memory(ctx)
        t = np.asarray(tokens).reshape(-1)
        keys = self.keys(ctx, t)
        end = ctx.memory.seq_pos_max(seq_id) + 1
        c = self.chunk_size
        want = [(k, key) for k, key in enumerate(keys)]
        if memory == "iswa" and end % c == 0 and 0 < end // c <= len(keys):
            want.append((-1, window_key(keys[end // c - 1])))
        try:
            missing = [(k, key) for k, key in want if self.backend.find(key) is None]
        except OSError as e:  # a Redis server gone: the run goes on without storing
            self._warn(f"looking up chunks failed ({e}); going on without storing")
            return 0
        if not missing:
            return 0
        st = parse(ctx.seq_state(seq_id).data, memory=memory)
        full = st if memory == "kv" else _emptied(st, "swa")  # chunks: the full cache's cells
        src = _only(full, "kv" if memory == "kv" else "base")
        pos = src.cells["pos"] if src is not None else np.zeros(0, np.int32)
        written = 0
        for k, key in missing:
            if k < 0:  # the window: the sliding-window cache's cells, none of the full cache's
                data = _emptied(st, "base").to_bytes()
            else:
                sel = (pos >= k * c) & (pos < (k + 1) * c)
                if int(sel.sum()) != c:
                    raise ValueError(
                        f"save: sequence {seq_id} holds {int(sel.sum())} cells at positions "
                        f"{k * c}..{(k + 1) * c - 1}, not one per position: it does not hold these tokens from "
                        "position 0"
                    )
                assert src is not None
                data = full.select_cells(sel, part=src.part, stream=src.index).to_bytes()
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

    # -- both --------------------------------------------------------------------------------------
    def prefill(self, ctx: Context, seq_id: int, tokens: npt.ArrayLike) -> int:
        """Feed ``tokens`` to the empty sequence ``seq_id`` through the store: restore the longest
        stored prefix, decode the rest (logits for the last token, as :meth:`Context.prefill`
        gives them) and store the new whole chunks.

        With a sliding-window model the decode stops at the end of each new chunk to store its
        window (see :meth:`save`), so any later prompt that shares a whole number of chunks with
        this one can be restored up to them; otherwise it decodes as :meth:`Context.prefill` does.

        Args:
            ctx: The context.
            seq_id: The sequence, which must be empty.
            tokens: The prompt's token ids (at least one).

        Returns:
            How many of the first tokens came from the store.

        Raises:
            ValueError: No tokens, ``seq_id`` holds cells, or a memory the store cannot serve.
            DecodeError: A decode failed (:meth:`Context.prefill`'s errors).
        """
        t = np.asarray(tokens).reshape(-1)
        if t.size == 0:
            raise ValueError("prefill: no tokens")
        n = self.restore(ctx, seq_id, t)
        at, c = n, self.chunk_size
        if _memory(ctx) == "iswa":
            for end in range((n // c + 1) * c, t.size, c):  # each chunk's end before the last token
                ctx.prefill(t[at:end], seq_id, at)
                self.save(ctx, seq_id, t[:end])
                at = end
        ctx.prefill(t[at:], seq_id, at)
        self.save(ctx, seq_id, t)
        return n

    def _warn(self, msg: str) -> None:
        self.stats.errors.append(msg)
        warnings.warn(f"prefix store {self.backend.root}: {msg}", PrefixStoreWarning, stacklevel=3)
