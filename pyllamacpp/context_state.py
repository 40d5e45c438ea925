"""Sequence and whole-context state of a :class:`~pyllamacpp.context.Context`: get and set in
memory, and seq dumps to files. ``StateMethods`` is a base of Context; its methods use the
context's pointer, memory and parameters. It builds on mixins in ``pyllamacpp._context_state``:

- ``data.py``: ``StateFlags``, ``SeqState``, ``StateBuffer``, and what the mixins read of a
  Context (``_StateBase``);
- ``checks.py``: the model's memory and layer map, flash attention, sidecar facts;
  ``check_state``, a blob against this context before C sees it; whether a load can fail on
  room, and the backup kept when it can;
- ``files.py``: seq and session files, ``check_state_file``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from . import _log
from ._context_state.checks import _NOT_BACK
from ._context_state.checks import _model_memory as _model_memory  # re-exported: tests check it on stand-ins
from ._context_state.data import SeqState as SeqState
from ._context_state.data import StateBuffer as StateBuffer
from ._context_state.data import StateFlags as StateFlags
from ._context_state.data import _as_uint8
from ._context_state.files import StateFiles, _replacing
from ._lib import ffi, lib
from ._log import pending as _log_pending
from .errors import LlamaError, StateError

# None: seq_state's own buffer comes from malloc inside one C call (pyl_state_seq_get). A function
# size -> writable uint8 array replaces that: tools/bench/bench_core.py places the dump at chosen page
# offsets with it, since llama.cpp's copy runs ~15% faster or slower with where the dump sits
# relative to the KV tensors it copies from.
_new_state_buffer: Callable[[int], np.ndarray] | None = None


_ON_DEVICE = lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
_U8 = np.dtype(np.uint8)
_PARTIAL_ONLY = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


class StateMethods(StateFiles):
    """State get/set/check/files for Context (see the module docstring)."""

    def seq_state(self, seq_id: int, flags: int = 0, *, out: np.ndarray | StateBuffer | None = None) -> SeqState:
        """Dump one sequence's state: ``llama_state_seq_get_size_ext`` +
        ``llama_state_seq_get_data_ext``.

        Without ``out``: one copy into a buffer the state owns (a read-only numpy array over
        memory from ``malloc``, freed with its last view; the size query, the allocation and the
        copy are one C call, ``pyl_state_seq_get``).

        With ``out`` (the fast path, for loops that dump again and again): one
        ``llama_state_seq_get_data_ext`` call into ``out`` with ``out.size`` as the size, and no
        size query, allocation or log capture. llama.cpp bounds every write by that size and
        returns the bytes written, so nothing past ``out`` is touched; when ``out`` is too small
        it stops ("unexpectedly reached end of buffer", logged at ERROR), returns 0, and this
        raises ``ValueError`` with both sizes; the part of ``out`` it had reached by then holds
        a partial dump. The state is ``out[:n]``, a view (writable, so ``set_seq_state`` checks
        it like any blob unless told ``validate=False``); bytes of ``out`` past it are unchanged.

        Args:
            seq_id: the sequence to dump (checked against the context's ``n_seq_max``).
            flags: ``StateFlags`` (``PARTIAL_ONLY``, ``ON_DEVICE``; ``ON_DEVICE`` with ``out``
                takes the checked path).
            out: a :class:`StateBuffer` (its pointer made once, and its last ``SeqState``
                returned again when it still fits: the cheapest) or a writable, C-contiguous
                1-D uint8 array to reuse, at least the state's size.

        Returns:
            A ``SeqState``: the bytes (``.data``), ``seq_id`` and ``flags``.

        Raises:
            StateError: llama.cpp returned a size of 0 or wrote 0 bytes or fewer than it
                announced (with the reason it logged), or ``ON_DEVICE`` was asked of a quantized
                cache.
            ValueError: a bad ``seq_id``, or an ``out`` that is not a writable, contiguous 1-D
                uint8 array or is too small for the state.
            MemoryError: the buffer could not be allocated.
            ClosedError: the context is closed.
        """
        if out is not None and not flags & _ON_DEVICE:
            # The fast path: no size query (llama.cpp bounds every write by the size passed and
            # returns the bytes written, 0 when out is too small), no log capture, no allocation.
            # Each line here runs with the caches the copy left cold (microseconds each): few lines.
            h = self._h
            ptr = h.ptr if h is not None and h.rpc is None else self.ptr  # self.ptr raises or asks RPC
            if type(seq_id) is not int or not 0 <= seq_id < self._n_seq_max_seen:
                seq_id = self._seq_checked(seq_id)
            if type(flags) is not int:
                flags = int(flags)
            if type(out) is StateBuffer:
                # its pointer, made once; its last view and SeqState, reused when they still fit
                n = lib.llama_state_seq_get_data_ext(ptr, out._p, out.size, seq_id, flags)
                if not n:
                    self._seq_state_failed(ptr, seq_id, flags, out.array)
                if _log_pending:  # a log line without "\n", or a log handler raised inside the C callback
                    _log.raise_pending()
                st = out._st
                view = out._view
                if st is not None and st.data is view and view.size == n and st.seq_id == seq_id and st.flags == flags:
                    return st
                if view.size != n:
                    view = out._view = out.array[:n]
                st = out._st = SeqState(view, seq_id, flags)
                st._cptr = (view, out._p)  # set_seq_state's fast path passes it while st.data is view
                return st
            arr = cast(np.ndarray, out)
            try:
                if arr.ndim != 1 or (arr.dtype is not _U8 and arr.dtype != _U8):
                    raise ValueError(f"a {arr.ndim}-D {arr.dtype} array")
                p = ffi.from_buffer(arr, require_writable=True)  # raises for read-only, non-contiguous
            except (AttributeError, ValueError, TypeError) as e:
                raise ValueError(f"out must be a StateBuffer or a writable, contiguous 1-D uint8 array ({e})") from None
            n = lib.llama_state_seq_get_data_ext(ptr, p, arr.size, seq_id, flags)
            if not n:
                self._seq_state_failed(ptr, seq_id, flags, arr)
            if _log_pending:  # a log line without "\n", or a log handler raised inside the C callback
                _log.raise_pending()
            return SeqState(arr[:n], seq_id, flags)
        ptr = self.ptr
        seq_id = self.memory._seq(self, seq_id)
        flags = int(flags)
        if flags & _ON_DEVICE:
            self._check_device_save()
        own = out is None
        # Python code right after a copy of megabytes runs with cold caches (each line costs
        # microseconds then): the default path does as little around the C call as it can.
        if own and _new_state_buffer is None:
            res = ffi.new("pyl_state_out *")
            p = lib.pyl_state_seq_get(ptr, seq_id, flags, res)
            size, n = res.size, res.written
            if p == ffi.NULL:
                raise MemoryError(f"cannot allocate {size} bytes for the state of seq {seq_id}")
            # read-only down to the buffer: no view of it can be made writable, so what
            # set_seq_state trusts is what llama.cpp wrote
            buf = np.frombuffer(memoryview(ffi.buffer(ffi.gc(p, lib.pyl_free), size)).toreadonly(), dtype=np.uint8)
            reason = _log.c_reason
        else:
            size = lib.llama_state_seq_get_size_ext(ptr, seq_id, flags)
            if out is None:  # own: the hook is set (the other branch took the default path)
                buf = cast(Callable[[int], np.ndarray], _new_state_buffer)(size)
            else:
                out = out.array if isinstance(out, StateBuffer) else out
                if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
                    raise ValueError("out must be a writable, contiguous 1-D uint8 array")
                if out.size < size:
                    raise ValueError(f"out holds {out.size} bytes, the state needs {size}")
                buf = out[:size]
            with _log.capture() as cap:
                n = lib.llama_state_seq_get_data_ext(ptr, ffi.from_buffer(buf), size, seq_id, flags)
            reason = cap.reason
        _log.raise_pending()
        if not size:  # a dump holds at least its magic and seq_id: 0 is llama.cpp's failure
            raise StateError(
                "llama_state_seq_get_size_ext() returned 0", func="llama_state_seq_get_size_ext", reason=reason()
            )
        if n != size:
            raise StateError(
                f"llama_state_seq_get_data_ext() wrote {n} of {size} bytes",
                func="llama_state_seq_get_data_ext",
                reason=reason(),
            )
        if flags & _ON_DEVICE:
            self._device_saved[seq_id] = buf.tobytes()  # headers only: a few KB
            self._device_flags_by_seq[seq_id] = flags
        if not own:
            return SeqState(buf, seq_id, flags)
        buf.flags.writeable = False  # so set_seq_state can trust it without parsing it again
        st = SeqState(buf, seq_id, flags)
        st._made = (self._state_token, buf)
        return st

    def set_seq_state(
        self,
        seq_id: int,
        data: SeqState | npt.ArrayLike,
        flags: int = 0,
        *,
        validate: bool = True,
        keep_on_error: bool = True,
    ) -> int:
        """Load a sequence state into ``seq_id``: ``llama_state_seq_set_data_ext``.

        The blob is first parsed and checked against this context (:meth:`check_state`; skip with
        ``validate=False`` to see what llama.cpp itself does). Raises :class:`StateError` when the
        check fails or llama.cpp reads 0 bytes; the sequence then holds what it held before
        (llama.cpp clears it on failure, so an occupied one is copied aside first when the load
        could fail, see :meth:`_load_fits`, and put back; ``keep_on_error=False`` skips that and
        leaves it cleared on failure).
        A :class:`SeqState` this context's ``seq_state`` made (its data still read-only) is not
        parsed again, unless ``flags`` differ from its own in ``PARTIAL_ONLY``.
        ``flags=StateFlags.PARTIAL_ONLY`` loads a partial dump: llama.cpp then reads only the
        memory's partial part (an iSWA cache's swa part, a hybrid memory's recurrent part) and
        leaves the rest of the sequence as it was.

        ``validate=False, keep_on_error=False`` (without ``ON_DEVICE``) is the fast path: the
        blob goes to llama.cpp in one call, with no parse, no occupancy query and no backup.
        llama.cpp's own reader still checks what it reads (magic, stream count, cell count,
        layer count, K/V types and row sizes, the end of the buffer) and returns 0 on a mismatch; the
        sequence is then empty. Give it only blobs you trust to come from a context like this
        one: llama.cpp's checks are not :meth:`check_state`'s.

        Args:
            seq_id: the sequence to load into.
            data: a ``SeqState``, bytes-like or uint8 array holding a sequence dump.
            flags: the ``StateFlags`` the dump was made with.
            validate: check the blob against this context before the C call.
            keep_on_error: copy an occupied sequence aside when the load could fail, and put it
                back if it does.

        Returns:
            The number of bytes llama.cpp read.

        Raises:
            StateError: the blob is empty or does not fit this context, llama.cpp read 0 bytes
                (with the reason it logged, and whether the sequence is unchanged or empty), or a
                cross-stream ``seq_cp`` into ``seq_id`` is still queued.
            ValueError: a bad ``seq_id``.
            ClosedError: the context is closed.
        """
        # an ON_DEVICE state takes the full path, which checks it against what this context saved
        if not (
            validate or keep_on_error or flags & _ON_DEVICE or (isinstance(data, SeqState) and data.flags & _ON_DEVICE)
        ):
            # The fast path (see seq_state's): the blob goes to llama.cpp as it is.
            h = self._h
            ptr = h.ptr if h is not None and h.rpc is None else self.ptr  # self.ptr raises or asks RPC
            if type(seq_id) is not int or not 0 <= seq_id < self._n_seq_max_seen:
                seq_id = self._seq_checked(seq_id)
            if self._pending_stream_copies:
                self._check_no_pending_copy(seq_id, "llama_state_seq_set_data_ext")
            buf = data.data if type(data) is SeqState else data
            fast = data._cptr if type(data) is SeqState else None
            if type(flags) is not int:
                flags = int(flags)
            if fast is not None and fast[0] is buf:  # written into a StateBuffer: its pointer
                p, size = fast[1], buf.size
            else:
                if type(buf) is not np.ndarray or buf.ndim != 1 or buf.dtype is not _U8:
                    buf = _as_uint8(buf)  # any bytes-like or array, as uint8
                size = buf.size
                if not size:
                    raise StateError("empty state", func="llama_state_seq_set_data_ext")
                try:
                    p = ffi.from_buffer(buf)
                except ValueError:  # not contiguous: a contiguous copy
                    buf = _as_uint8(buf)
                    p = ffi.from_buffer(buf)
            n = lib.pyl_state_seq_set(ptr, p, size, seq_id, flags)
            if not n:
                self._seq_set_failed(seq_id)
            if _log_pending:  # a log line without "\n", or a log handler raised inside the C callback
                _log.raise_pending()
            return n
        ptr = self.ptr
        seq_id = self.memory._seq(self, seq_id)
        if self._pending_stream_copies:
            self._check_no_pending_copy(seq_id, "llama_state_seq_set_data_ext")
        flags = int(flags)
        made = data._made if isinstance(data, SeqState) else None
        state = cast(SeqState, data)  # read only once made is set, which only a SeqState has
        own = (
            made is not None
            and made[0] is self._state_token
            and made[1] is state.data
            and not state.data.flags.writeable
        )
        if own:
            buf = state.data
            if (state.flags ^ flags) & _PARTIAL_ONLY:
                own = False  # made with the other PARTIAL_ONLY setting: checked like any blob
            if (state.flags ^ flags) & _ON_DEVICE:
                raise StateError(
                    "state does not fit this context: a metadata-only dump (seq_state(seq, ON_DEVICE))"
                    " loads with flags=StateFlags.ON_DEVICE only"
                    if state.flags & _ON_DEVICE
                    else "a full dump loads without StateFlags.ON_DEVICE",
                    func="llama_state_seq_set_data_ext",
                )
        else:
            buf = _as_uint8(data)
        if buf.size == 0:
            raise StateError("empty state", func="llama_state_seq_set_data_ext")
        if flags & _ON_DEVICE:
            # The blob names the sequence whose on-device copy to use. llama.cpp asserts (aborts the
            # process) when this context never saved that sequence with ON_DEVICE, and aborts
            # ("memory buffer mismatch", llama_io_read_device) when the blob's cells do not add up
            # to the rows of that sequence's latest save: only that blob, unchanged, is safe.
            src = int(np.frombuffer(buf[4:8].tobytes(), "<i4")[0]) if buf.size >= 8 else None
            if src is None or self._device_saved.get(src) != buf.tobytes():
                why = (
                    "it is not the blob of that sequence's latest seq_state(seq, ON_DEVICE)"
                    if src in self._device_saved
                    else f"it names seq {src}, saved on device here: {sorted(self._device_saved)}"
                )
                raise StateError(
                    "an ON_DEVICE state loads only as the latest seq_state(seq, ON_DEVICE) "
                    f"of this context returned it; {why}",
                    func="llama_state_seq_set_data_ext",
                )
            saved = self._device_flags_by_seq.get(src, flags)
            if (saved ^ flags) & _PARTIAL_ONLY and self._partial_differs():
                # the device reader would take the saved chunks for other parts: an abort
                # ("memory buffer mismatch", llama_io_read_device)
                raise StateError(
                    f"this ON_DEVICE state was saved with flags={saved}: load it with the same PARTIAL_ONLY setting",
                    func="llama_state_seq_set_data_ext",
                )
        elif validate and not own:
            self.check_state(buf, kind="sequence", flags=flags)
        trusted = own or validate or bool(flags & _ON_DEVICE)
        backup = None
        occupied = None  # not asked: a trusted blob for a stream of its own cannot fail to load
        if keep_on_error and not (trusted and self._own_stream_fits()):
            occupied = self._occupied(seq_id)
            if occupied and not (trusted and self._load_fits(seq_id, buf)):
                backup = self.seq_state(seq_id)
        n = lib.pyl_state_seq_set(ptr, ffi.from_buffer(buf), buf.size, seq_id, flags)
        if n == 0:
            reason = _log.c_reason()
            self.memory.seq_rm(seq_id)
            back = backup is not None and self._put_back(seq_id, backup)
            _log.raise_pending()  # a logging handler's exception, once the sequence is back
            raise StateError(
                "llama_state_seq_set_data_ext() read 0 bytes; the sequence is "
                + (
                    "unchanged"
                    if back or occupied is False
                    else _NOT_BACK
                    if backup is not None
                    else "now empty"
                    if not keep_on_error
                    else "now empty (no copy was kept: by llama.cpp's rules this load could not fail)"
                ),
                func="llama_state_seq_set_data_ext",
                reason=reason,
            )
        _log.raise_pending()
        return int(n)

    def _seq_set_failed(self, seq_id: int) -> NoReturn:
        """After ``llama_state_seq_set_data_ext`` read 0 bytes on the fast path (no backup): the
        sequence is cleared, as the full path leaves it, and the reason raised."""
        reason = _log.c_reason()
        self.memory.seq_rm(seq_id)
        _log.raise_pending()
        raise StateError(
            "llama_state_seq_set_data_ext() read 0 bytes; the sequence is now empty",
            func="llama_state_seq_set_data_ext",
            reason=reason,
        )

    # n_seq_max, once a seq_id was checked against it (_seq_checked): the fast paths compare with it
    _n_seq_max_seen = 0

    def _seq_checked(self, seq_id: int) -> int:
        seq_id = self.memory._seq(self, seq_id)  # ValueError outside [0, n_seq_max)
        self._n_seq_max_seen = self.n_seq_max
        return seq_id

    def _seq_state_failed(self, ptr: Any, seq_id: int, flags: int, out: np.ndarray) -> NoReturn:
        """Why ``llama_state_seq_get_data_ext`` into ``out`` wrote 0 bytes, raised: ``out`` too
        small (llama.cpp stops at its end: "unexpectedly reached end of buffer"), else llama.cpp's
        logged reason from a second try under a capture."""
        with _log.capture() as cap:
            size = lib.llama_state_seq_get_size_ext(ptr, seq_id, flags)
        if not size:
            raise StateError(
                "llama_state_seq_get_size_ext() returned 0", func="llama_state_seq_get_size_ext", reason=cap.reason()
            )
        if out.size < size:
            raise ValueError(
                f"out holds {out.size} bytes, the state needs {size} "
                "(llama.cpp wrote part of it into out before it stopped)"
            )
        with _log.capture() as cap:  # the same call again, for the reason llama.cpp logs
            lib.llama_state_seq_get_data_ext(ptr, ffi.from_buffer(out), out.size, seq_id, flags)
        raise StateError(
            f"llama_state_seq_get_data_ext() wrote 0 of {size} bytes",
            func="llama_state_seq_get_data_ext",
            reason=cap.reason(),
        )

    def _check_device_save(self) -> None:
        """Refuse an ON_DEVICE save that llama.cpp would restore wrong: its device writer
        (llama_io_write_device, llama-context.cpp) sizes each saved chunk as ``size /
        ggml_element_size(tensor)`` values, which for a block-quantized cache type is the number
        of blocks, so only 1/32 of a q8_0 chunk is kept and a load puts garbage in the cache
        (measured: next-token logits off by up to 29, argmax changed; tests/test_context.py)."""
        quantized = [
            n for n, t in (("type_k", self.params.type_k), ("type_v", self.params.type_v)) if lib.ggml_blck_size(t) > 1
        ]
        if quantized:
            from .params import ggml_type_name

            raise StateError(
                "an ON_DEVICE save of a quantized cache ("
                + ", ".join(f"{n}={ggml_type_name(getattr(self.params, n))}" for n in quantized)
                + ") "
                "would load back wrong: llama.cpp's device writer keeps only size / ggml_element_size "
                "values of each chunk (1/32 of a q8_0 one); save without ON_DEVICE",
                func="llama_state_seq_get_data_ext",
            )

    def state(self) -> np.ndarray:
        """The whole context's state: ``llama_state_get_size`` + ``llama_state_get_data``.

        Returns:
            A new uint8 array holding the dump (outputs, memory of every sequence).

        Raises:
            StateError: llama.cpp wrote fewer bytes than it announced.
            ClosedError: the context is closed.
        """
        ptr = self.ptr
        size = lib.llama_state_get_size(ptr)
        out = np.empty(size, dtype=np.uint8)
        n = lib.llama_state_get_data(ptr, ffi.from_buffer(out), size)
        if n != size:
            raise StateError(f"llama_state_get_data() wrote {n} of {size} bytes", func="llama_state_get_data")
        return out

    def set_state(self, data: npt.ArrayLike) -> int:
        """Load a whole-context state: ``llama_state_set_data``.

        The blob is checked first (:meth:`check_state` with ``kind="context"``).

        Args:
            data: a dump :meth:`state` (``llama_state_get_data``) made, bytes-like or uint8 array.

        Returns:
            The number of bytes llama.cpp read.

        Raises:
            StateError: the blob does not fit this context, llama.cpp read 0 bytes (with the
                reason it logged), or a cross-stream ``seq_cp`` is still queued.
            LlamaError: output views (``logits()``...) are alive: the load may reallocate the
                buffer they point into.
            ClosedError: the context is closed.
        """
        ptr = self.ptr
        self._check_no_pending_copy(None, "llama_state_set_data")
        buf = _as_uint8(data)
        self.check_state(buf, kind="context")
        if len(self._views):
            raise LlamaError(
                "output views are alive: loading a whole state may reallocate the output "
                "buffer they point into; copy or delete them first",
                func="llama_state_set_data",
            )
        with _log.capture() as cap:
            n = lib.llama_state_set_data(ptr, ffi.from_buffer(buf), buf.size)
        if n == 0:
            raise StateError("llama_state_set_data() read 0 bytes", func="llama_state_set_data", reason=cap.reason())
        self._out_reserved = max(self._out_reserved, self.n_batch)
        return int(n)

    def save_seq_dump(
        self,
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
            from .state import write_sidecar

            write_sidecar(path, **self.sidecar_facts(tokens, flags=flags))
        return len(state)
