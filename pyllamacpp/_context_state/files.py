"""A :class:`~pyllamacpp.context.Context`'s state files: seq files (``llama_state_seq_save_file``
/ ``_load_file``) and session files (``llama_state_save_file`` / ``_load_file``), each checked
against what it claims and against the context before llama.cpp reads it, and raw seq dumps
(``save_seq_dump``) with their sidecars.

Each public function is a method of Context (``StateMethods``, in ``__init__.py``, lists them), the
context its ``self``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from .. import _log
from .._lib import ffi, lib
from ..errors import LlamaError, StateError
from .checks import _check_no_pending_copy, _check_parsed, _kv_has_v, _occupied, _own_stream_fits, _put_back, _room_for
from .data import _NOT_BACK

if TYPE_CHECKING:
    from ..context import Context


@contextlib.contextmanager
def _replacing(path: Path):
    """A temporary name beside ``path``, renamed onto it when the block succeeds and removed
    when it does not: a failed write leaves the earlier file as it was."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _file_format_error(e: Any, size: int) -> str:
    """What a ``StateFormatError`` from parsing a state file says, against the file's length:
    a short read as the bytes its field needs (``file is 138,000 bytes; its ... needs 277,376``)."""
    if e.needed is None:
        return f"file is {size:,} bytes; {e}"
    end = e.offset + e.needed
    at = f" (from byte {e.offset:,})" if e.offset else ""
    return f"file is {size:,} bytes; its {e.what}{at} needs {end:,}"


def save_seq_state(
    self: Context, path: str | os.PathLike, seq_id: int, tokens: npt.ArrayLike = (), *, sidecar: bool = False
) -> int:
    """Save one sequence's state and ``tokens`` to a file: ``llama_state_seq_save_file``.

    Written to a temporary name beside ``path``, then renamed: a failed save leaves an
    earlier file as it was.

    Args:
        path: the file to write.
        seq_id: the sequence to save.
        tokens: token ids stored in the file with it (``load_seq_state`` returns them).
        sidecar: also write ``path + ".json"`` (:meth:`sidecar_facts`), which
            ``pyllamacpp.state`` uses to read the dump without the model.

    Returns:
        The number of bytes written.

    Raises:
        OSError: llama.cpp could not write the file (with the reason it logged).
        ValueError: a bad ``seq_id``.
        ClosedError: the context is closed.
    """
    ptr = self.ptr
    seq_id = self.memory._seq(self, seq_id)
    toks = np.ascontiguousarray(tokens, dtype=np.int32)
    path = Path(path)
    with _replacing(path) as tmp:
        with _log.capture() as cap:
            n = lib.llama_state_seq_save_file(
                ptr, os.fsencode(tmp), seq_id, ffi.from_buffer("llama_token[]", toks), toks.size
            )
        if n == 0:
            raise OSError(f"llama_state_seq_save_file() could not write {path}: {cap.reason() or 'failed'}")
    if sidecar:
        from ..state import write_sidecar

        write_sidecar(path, **self.sidecar_facts(toks, flags=0))  # the file holds a flags-0 dump
    return int(n)


def load_seq_state(self: Context, path: str | os.PathLike, seq_id: int, max_tokens: int | None = None) -> np.ndarray:
    """Load one sequence's state from a file into ``seq_id``: ``llama_state_seq_load_file``.

    The file is checked first (:meth:`check_state_file`: its header against its length, its
    state against this context), so llama.cpp only reads files it can read to the end: its
    file reader does not stop at the end of the file (it asserts, aborting the process, once
    it has counted more bytes than the file holds). When the load could still fail (the
    sequence's stream is short of room for the file's cells), an occupied ``seq_id`` is
    copied aside first and put back if it does.

    Args:
        path: a file ``save_seq_state`` (``llama_state_seq_save_file``) wrote.
        seq_id: the sequence to load into.
        max_tokens: room for the stored tokens (default ``n_ctx``).

    Returns:
        The token ids stored in the file (a copy).

    Raises:
        FileNotFoundError: no such file.
        StateError: the file is not a seq file this context can load (what it claims against
            its length, or its state against this context; the sequence untouched),
            llama.cpp could not load it (with the reason it logged; the sequence as it was),
            or a cross-stream ``seq_cp`` into ``seq_id`` is still queued.
        ValueError: a bad ``seq_id``.
        ClosedError: the context is closed.
    """
    ptr = self.ptr
    seq_id = self.memory._seq(self, seq_id)
    _check_no_pending_copy(self, seq_id, "llama_state_seq_load_file")
    cap_tokens = max_tokens if max_tokens is not None else self.n_ctx
    cell_count = _check_file(self, path, "sequence", cap_tokens, "llama_state_seq_load_file")
    occupied = _occupied(self, seq_id)
    backup = None
    if occupied and not _own_stream_fits(self) and not _room_for(self, seq_id, cell_count):
        backup = self.seq_state(seq_id)
    toks = np.empty(cap_tokens, dtype=np.int32)
    count = ffi.new("size_t *")
    with _log.capture() as cap:
        n = lib.llama_state_seq_load_file(
            ptr, os.fsencode(path), seq_id, ffi.from_buffer("llama_token[]", toks), cap_tokens, count
        )
    if n == 0:
        self.memory.seq_rm(seq_id)  # llama.cpp clears what it had loaded (state_clear)
        back = backup is not None and _put_back(self, seq_id, backup)
        raise StateError(
            f"llama_state_seq_load_file() could not load {path}; the sequence is "
            + ("unchanged" if back or not occupied else _NOT_BACK if backup is not None else "now empty"),
            func="llama_state_seq_load_file",
            reason=cap.reason(),
        )
    return toks[: count[0]].copy()


def check_state_file(
    self: Context, path: str | os.PathLike, *, kind: str = "sequence", max_tokens: int | None = None
) -> None:
    """Check a state file against what it claims and against this context, before anything
    reaches C: what ``load_seq_state`` and ``load_state`` do first.

    The file is memory-mapped (``np.memmap``; only the pages of its headers are read) and
    parsed with :mod:`pyllamacpp.state`, as llama.cpp's loaders read it: the magic and
    version (``LLAMA_STATE_SEQ_MAGIC`` / ``_VERSION`` for a seq file, ``LLAMA_SESSION_MAGIC``
    / ``_VERSION`` for a session file), ``n_token_count`` against ``max_tokens`` and against
    the file's length, every size in the state against the bytes that follow it (no byte
    missing, none left over), then the state itself as :meth:`check_state` checks a blob.

    Args:
        path: the file.
        kind: ``"sequence"`` (a seq file, ``llama_state_seq_save_file``) or ``"context"``
            (a session file, ``llama_state_save_file``).
        max_tokens: the room for tokens the load will give (default ``n_ctx``).

    Raises:
        FileNotFoundError: no such file.
        StateError: the file is not one this context can load; the message says what is
            wrong, with the file's length and what its fields need.
        ValueError: ``kind`` is neither ``"sequence"`` nor ``"context"``.
        ClosedError: the context is closed.
    """
    if kind not in ("sequence", "context"):
        raise ValueError(f"kind must be 'sequence' or 'context', not {kind!r}")
    func = "llama_state_seq_load_file" if kind == "sequence" else "llama_state_load_file"
    _check_file(self, path, kind, max_tokens if max_tokens is not None else self.n_ctx, func)


def _check_file(self: Context, path: str | os.PathLike, kind: str, cap_tokens: int, func: str) -> int:
    """check_state_file's checks; returns the cells of the file's state (all streams)."""
    from .. import state as st

    self.ptr  # noqa: B018 - raises ClosedError before the file is read
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(path)
    size = path.stat().st_size
    want = st.DumpKind.SEQ_FILE if kind == "sequence" else st.DumpKind.SESSION_FILE

    def refuse(what: str, cause: BaseException | None = None) -> NoReturn:
        raise StateError(f"{path} is not a {want} this context can load: {what}", func=func) from cause

    # mapped, not read: parsing slices the rows and reads only the headers' pages
    arr = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    try:
        try:
            # V pinned: a file cut right after its K records would read as a cache without V
            parsed = st.parse(arr, has_v=_kv_has_v(self.model))
        except st.StateFormatError as e:
            refuse(_file_format_error(e, size), e)
        if parsed.kind is not want:
            other = "load_state" if parsed.kind is st.DumpKind.SESSION_FILE else "load_seq_state"
            hint = f" (load it with {other})" if parsed.kind in (st.DumpKind.SEQ_FILE, st.DumpKind.SESSION_FILE) else ""
            refuse(f"it is a {parsed.kind}{hint}")
        n_tokens = int(cast(np.ndarray, parsed.header.tokens).size)  # a file's header has them
        if n_tokens > cap_tokens:  # llama.cpp: "token count in ... file exceeded capacity"
            refuse(f"it holds {n_tokens:,} tokens, more than max_tokens={cap_tokens:,}")
        try:
            _check_parsed(self, parsed, kind, 0)  # llama.cpp reads a file's state with flags 0
        except StateError as e:
            refuse(str(e), e)
        return sum(s.cell_count for p in parsed.parts for s in p.streams)
    finally:
        del arr  # the mapping goes with its last view (parsed's, dropped on return)


def save_state(self: Context, path: str | os.PathLike, tokens: npt.ArrayLike = ()) -> None:
    """Save the whole context's state and ``tokens`` to a session file:
    ``llama_state_save_file`` (to a temporary name beside ``path``, then renamed).

    Args:
        path: the file to write.
        tokens: token ids stored in the file (``load_state`` returns them).

    Raises:
        OSError: llama.cpp could not write the file (with the reason it logged).
        ClosedError: the context is closed.
    """
    ptr = self.ptr
    toks = np.ascontiguousarray(tokens, dtype=np.int32)
    path = Path(path)
    with _replacing(path) as tmp:
        with _log.capture() as cap:
            ok = lib.llama_state_save_file(ptr, os.fsencode(tmp), ffi.from_buffer("llama_token[]", toks), toks.size)
        if not ok:
            raise OSError(f"llama_state_save_file() could not write {path}: {cap.reason() or 'failed'}")


def load_state(self: Context, path: str | os.PathLike, max_tokens: int | None = None) -> np.ndarray:
    """Load the whole context's state from a session file: ``llama_state_load_file``.

    The file is checked first (:meth:`check_state_file` with ``kind="context"``): llama.cpp
    reads a session file into the memory as it goes, so a file it cannot read to the end
    would leave the memory half-loaded.

    Args:
        path: a file ``save_state`` (``llama_state_save_file``) wrote.
        max_tokens: room for the stored tokens (default ``n_ctx``).

    Returns:
        The token ids stored in the file (a copy).

    Raises:
        FileNotFoundError: no such file.
        StateError: the file is not a session file this context can load (what it claims
            against its length, or its state against this context; the context untouched),
            llama.cpp could not load it (with the reason it logged), or a cross-stream
            ``seq_cp`` is still queued.
        LlamaError: output views are alive (the load may reallocate their buffer).
        ClosedError: the context is closed.
    """
    ptr = self.ptr
    if not Path(path).is_file():
        raise FileNotFoundError(path)
    _check_no_pending_copy(self, None, "llama_state_load_file")
    if len(self._views):
        raise LlamaError(
            "output views are alive; copy or delete them before loading a whole state", func="llama_state_load_file"
        )
    cap_tokens = max_tokens if max_tokens is not None else self.n_ctx
    _check_file(self, path, "context", cap_tokens, "llama_state_load_file")
    toks = np.empty(cap_tokens, dtype=np.int32)
    count = ffi.new("size_t *")
    with _log.capture() as cap:
        ok = lib.llama_state_load_file(
            ptr, os.fsencode(path), ffi.from_buffer("llama_token[]", toks), cap_tokens, count
        )
    if not ok:
        raise StateError(
            f"llama_state_load_file() could not load {path}", func="llama_state_load_file", reason=cap.reason()
        )
    self._out_reserved = max(self._out_reserved, self.n_batch)
    return toks[: count[0]].copy()


def save_seq_dump(
    self: Context,
    path: str | os.PathLike,
    seq_id: int,
    *,
    flags: int = 0,
    tokens: npt.ArrayLike | None = None,
    sidecar: bool = True,
) -> int:
    """Write ``seq_state(seq_id, flags)`` (the raw ``llama_state_seq_get_data_ext`` bytes,
    no file header) to ``path``, atomically (a temporary name, then renamed).

    Args:
        path: the file to write.
        seq_id: the sequence to dump.
        flags: ``StateFlags`` for the dump (recorded in the sidecar, so ``parse`` reads a
            PARTIAL_ONLY dump as one).
        tokens: token ids recorded in the sidecar.
        sidecar: also write ``path + ".json"`` with :meth:`sidecar_facts`.

    Returns:
        The dump's size in bytes.

    Raises:
        StateError: as :meth:`seq_state`.
        OSError: the file could not be written.
        ValueError: a bad ``seq_id``.
        ClosedError: the context is closed.
    """
    state = self.seq_state(seq_id, flags)
    with _replacing(Path(path)) as tmp, open(tmp, "wb") as f:
        f.write(memoryview(state.data))  # type: ignore[arg-type]  # numpy types __buffer__ for 3.12+ only
    if sidecar:
        from ..state import write_sidecar

        write_sidecar(path, **self.sidecar_facts(tokens, flags=flags))
    return len(state)
