"""Sequence and whole-context state of a :class:`~pyllamacpp.context.Context`: get, check, load,
files, and the sidecars that make dumps self-describing. ``StateMethods`` is a base of Context;
its methods use the context's pointer, memory and parameters."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from . import _log
from ._lib import ffi, lib
from ._log import pending as _log_pending
from .errors import LlamaError, StateError, n_stream_hint

if TYPE_CHECKING:
    import weakref

    from ._handle import Handle
    from .memory import Memory
    from .model import Model
    from .params import ContextParams


class StateFlags(enum.IntFlag):
    """``llama_state_seq_flags``: the ``LLAMA_STATE_SEQ_FLAGS_*`` values from the header of this
    build, for ``seq_state`` and ``set_seq_state``.

    ``PARTIAL_ONLY`` (``SWA_ONLY`` is its old name): only the memory's partial part (an iSWA
    cache's swa part, a hybrid memory's recurrent part). ``ON_DEVICE``: the rows stay in llama.cpp
    (``mem_storage``), the dump holds only the metadata."""

    NONE = lib.LLAMA_STATE_SEQ_FLAGS_NONE
    PARTIAL_ONLY = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # == SWA_ONLY (its old name)
    SWA_ONLY = lib.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
    ON_DEVICE = lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


@dataclasses.dataclass
class SeqState:
    """One sequence's state as ``llama_state_seq_get_data_ext`` wrote it.

    Picklable; restore with ``ctx.set_seq_state(seq_id, state)``. ``len()`` is its size in bytes,
    ``bytes()`` a copy, and it exports the buffer protocol (Python >= 3.12).

    Attributes:
        data: the dump, a 1-D uint8 array: read-only memory the state owns (``seq_state()``), or a
            view of the caller's buffer (``seq_state(out=buf)``: the next dump into ``buf``
            overwrites it).
        seq_id: the sequence it was taken from.
        flags: the ``StateFlags`` it was taken with.
    """

    data: np.ndarray  # uint8
    seq_id: int
    flags: int = 0
    # (the making context's token, data) when Context.seq_state made it: that context trusts it
    # without parsing it again while ``data`` is this very array, still read-only. Unpickled, the
    # token is another object, so the blob is checked; dataclasses.replace() does not carry it.
    _made: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # (data, its C pointer) when seq_state wrote it into a StateBuffer: set_seq_state's fast path
    # passes that pointer while ``data`` is this very view (no buffer export per call)
    _cptr: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        """The dump's size in bytes."""
        return int(self.data.size)

    def __bytes__(self) -> bytes:
        """A copy of the dump."""
        return self.data.tobytes()

    def __buffer__(self, flags):  # Python >= 3.12 buffer protocol
        return memoryview(self.data)

    def __getstate__(self) -> dict:
        # a C pointer does not pickle, nor would it mean anything in another process
        return {**self.__dict__, "_cptr": None}


class StateBuffer:
    """A reusable destination for ``seq_state(out=...)`` whose C pointer is made once.

    ``ctx.seq_state(seq_id, out=sb)`` is the cheapest dump there is: one
    ``llama_state_seq_get_data_ext`` into ``sb.array`` through a pointer made when the buffer was,
    instead of a buffer export (``ffi.from_buffer``) per call as for a plain numpy ``out``. The
    ``SeqState`` returned is a view of ``sb.array``, overwritten by the next dump into it; a dump
    of the same size, sequence and flags as the last one returns that same ``SeqState`` object
    again (unless its ``data``, ``seq_id`` or ``flags`` were changed), so no view or object is
    made per call. The pointer holds a reference to the array, so numpy refuses to ``resize()``
    it (and must not be asked to with ``refcheck=False``).

    Args:
        size: The size in bytes: at least the state's (``len(ctx.seq_state(seq_id))``, or
            ``llama_state_seq_get_size_ext``); the dump of a longer sequence needs more. Or an
            array to adopt (a writable, C-contiguous 1-D uint8 numpy array: memory of your own,
            e.g. a ``np.memmap``).

    Attributes:
        array: The buffer, a writable 1-D uint8 numpy array of ``size`` bytes.
        size: Its size in bytes.

    Raises:
        ValueError: ``size`` is not positive, or the array is not a writable, C-contiguous 1-D
            uint8 array.
        MemoryError: The buffer could not be allocated.
    """

    __slots__ = ("_p", "_st", "_view", "array", "size")

    def __init__(self, size: int | np.ndarray) -> None:
        if isinstance(size, np.ndarray):
            arr = size
            if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous or not arr.flags.writeable:
                raise ValueError(
                    f"StateBuffer needs a writable, C-contiguous 1-D uint8 array, got a {arr.ndim}-D {arr.dtype} one"
                )
            if arr.size == 0:
                raise ValueError("StateBuffer size must be positive, got an empty array")
        else:
            n = int(size)
            if n <= 0:
                raise ValueError(f"StateBuffer size must be positive, got {n}")
            arr = np.empty(n, dtype=np.uint8)
        self.array: np.ndarray = arr
        self.size = int(arr.size)
        self._p = ffi.from_buffer(arr, require_writable=True)
        # the last dump's view (array[:n]) and SeqState, given again by the next dump of the same
        # size, sequence and flags: slicing and a new SeqState cost microseconds after a copy
        self._view: np.ndarray = arr[:0]
        self._st: SeqState | None = None

    def __len__(self) -> int:
        """The buffer's size in bytes."""
        return self.size

    def __repr__(self) -> str:
        return f"<StateBuffer {self.size:,} bytes>"


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


# None: seq_state's own buffer comes from malloc inside one C call (pyl_state_seq_get). A function
# size -> writable uint8 array replaces that: tools/bench/bench_core.py places the dump at chosen page
# offsets with it, since llama.cpp's copy runs ~15% faster or slower with where the dump sits
# relative to the KV tensors it copies from.
_new_state_buffer: Callable[[int], np.ndarray] | None = None


_ON_DEVICE = lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
# a failed load whose backup did not load back: the sequence shared its cells with another one
# (seq_cp in a unified cache), which a state load cannot do again, so they are not free for it
_NOT_BACK = "now empty: the copy kept aside did not fit back (cells it shared with another sequence stay taken)"
_U8 = np.dtype(np.uint8)
_PARTIAL_ONLY = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def _as_uint8(data) -> np.ndarray:
    if isinstance(data, SeqState):
        data = data.data
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


def _file_format_error(e: Any, size: int) -> str:
    """What a ``StateFormatError`` from parsing a state file says, against the file's length:
    a short read as the bytes its field needs (``file is 138,000 bytes; its ... needs 277,376``)."""
    if e.needed is None:
        return f"file is {size:,} bytes; {e}"
    end = e.offset + e.needed
    at = f" (from byte {e.offset:,})" if e.offset else ""
    return f"file is {size:,} bytes; its {e.what}{at} needs {end:,}"


def _kv_has_v(m) -> bool:
    """Whether model ``m``'s KV caches hold V: the llama_kv_cache constructor makes V tensors,
    and state_write_data writes V records, unless hparams.is_mla() (attention.key_length_mla and
    value_length_mla both set)."""
    return not all(int(m.meta(f"{m.arch}.attention.{x}_length_mla") or 0) for x in ("key", "value"))


def _model_memory(m) -> tuple[str | None, dict | None]:
    """(memory, layer map) of model ``m`` from llama.cpp's metadata (llama_model_meta_val_str).
    Not from the GGUF through gguf.GGUFReader, which reads the whole vocabulary (~2 s for 49k
    tokens): only an array key the rule needs is read there (llama.cpp's metadata leaves arrays
    out), as ``Model._meta_list`` does for per-layer head counts."""
    from .state import layer_map, memory_of
    from .state._layers import arch_keys, rule_keys
    from .state._sidecar import gguf_field

    arch = m.arch

    def num(key: str) -> int | None:
        v = m.meta(f"{arch}.{key}")
        return int(v) if v is not None and v.strip().lstrip("-").isdigit() else None

    # every key the rule reads, None when absent: scalars from the metadata; the arch's own keys
    # (arrays among them) from the GGUF when the metadata lacks them
    own = arch_keys(arch)
    fields = {"general.architecture": arch}
    for k in rule_keys(arch):
        v = m.kv_head_counts() if k == "attention.head_count_kv" else num(k)
        if v is None and k in own and m.path is not None:
            v = gguf_field(m.path, f"{arch}.{k}")
        fields[f"{arch}.{k}"] = v
    layers = layer_map(fields)
    return memory_of(layers), layers


class StateMethods:
    """State get/set/check/files for Context (see the module docstring)."""

    if TYPE_CHECKING:  # what Context (context.py) sets or defines, and these methods use
        model: Model
        params: ContextParams
        memory: Memory
        creation_log: list[tuple[int, str]]
        _views: weakref.WeakSet
        _out_reserved: int
        _pending_stream_copies: set[int]
        _device_saved: dict[int, bytes]
        _device_flags_by_seq: dict[int, int]
        _memory_layers_cache: tuple[str | None, dict | None] | None
        _state_token: object
        _kv_row_bytes: tuple[int, int] | None
        _plain_kv: bool
        _h: Handle | None

        @property
        def ptr(self) -> Any: ...
        @property
        def n_ctx(self) -> int: ...
        @property
        def n_ctx_seq(self) -> int: ...
        @property
        def n_batch(self) -> int: ...
        @property
        def n_seq_max(self) -> int: ...

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

    def _put_back(self, seq_id: int, backup: SeqState) -> bool:
        """Load the copy of ``seq_id`` kept aside before a load that failed; False (the sequence
        left empty) when it does not fit back either."""
        if lib.pyl_state_seq_set(self.ptr, ffi.from_buffer(backup.data), len(backup), seq_id, 0):
            return True
        self.memory.seq_rm(seq_id)
        return False

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

    def _occupied(self, seq_id: int) -> bool:
        # a hybrid memory whose attention part is empty has seq_pos_max -1 (the min of its
        # parts' maxima, llama_memory_hybrid::seq_pos_max) but seq_pos_min >= 0
        return self.memory.seq_pos_max(seq_id) >= 0 or self.memory.seq_pos_min(seq_id) >= 0

    def _load_fits(self, seq_id: int, buf: np.ndarray) -> bool:
        """True when loading this checked sequence blob into ``seq_id`` cannot fail, so the
        sequence needs no backup. Checked, the blob can still fail on room alone:
        llama_kv_cache::state_read_meta removes ``seq_id``'s cells, then ``find_slot`` needs
        ``cell_count`` usable cells of its stream, any of them (not contiguous). So it fits when
        ``cell_count <= n_ctx_seq - (cells the other sequences of that stream hold)``.
        Plain KV caches only (iSWA, recurrent and hybrid memories restore more than one part:
        they get the backup)."""
        if not self._plain_kv:
            return False
        if self._own_stream_fits():
            return True
        if buf.size < 12 or not buf.flags.c_contiguous:
            return False
        n_stream = int(buf[8:12].view("<u4")[0])
        if not 1 <= n_stream <= 256 or buf.size < 12 + 4 * n_stream:
            return False
        # u32 cell_count of stream 0, then its cells...: only a leading run of empty streams
        # reads as counts, and a checked sequence blob has cells in one stream
        counts = buf[12 : 12 + 4 * n_stream].view("<u4")
        nz = np.flatnonzero(counts)
        return self._room_for(seq_id, int(counts[nz[0]]) if nz.size else 0)

    def _room_for(self, seq_id: int, cell_count: int) -> bool:
        """True when ``cell_count`` cells loaded into ``seq_id`` cannot fail on room (see
        _load_fits): always with a stream of its own, else when the cells the other sequences
        of the one stream hold leave that many (plain KV caches only)."""
        if not self._plain_kv:
            return False
        if self._own_stream_fits():
            return True
        room = self.n_ctx_seq  # of the one stream the other sequences share
        for s in range(self.n_seq_max):
            if s != seq_id and self.memory.seq_pos_max(s) >= 0:
                c = self._cells_held(s)
                if c is None:
                    return False
                room -= c
        return cell_count <= room

    def _own_stream_fits(self) -> bool:
        """A plain KV cache whose every sequence has a stream of its own: a checked blob (or one
        this context made) has cell_count <= n_ctx_seq, so it always fits (see _load_fits)."""
        return self._plain_kv and not (self.params.kv_unified and self.n_seq_max > 1)

    def _cells_held(self, s: int) -> int | None:
        """Cells sequence ``s`` holds in a one-stream plain KV cache, from two sizes llama.cpp
        counts without copying anything (llama_io_write_dummy): with and without
        ``ON_DEVICE`` (headers only). Their difference is cells x the K+V row bytes of a token;
        the headers-only size is 16 + cells x (12 or 24 with llama_kv_cell_ext) + 8 + 12 per
        K/V record. Both must agree, else None (the caller then keeps a backup)."""
        ptr = self.ptr
        meta = int(lib.llama_state_seq_get_size_ext(ptr, s, lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE))
        full = int(lib.llama_state_seq_get_size_ext(ptr, s, 0))
        if self._kv_row_bytes is None:
            m = self.model
            n_kv_layers = sum(1 for n in m.kv_head_counts() if n > 0)
            self._kv_row_bytes = (m.kv_bytes_per_token(self.params.type_k, self.params.type_v), n_kv_layers)
        row_bytes, n_layers = self._kv_row_bytes
        cells, rest = divmod(full - meta, row_bytes)
        if rest or meta - 16 - 8 - 24 * n_layers not in (12 * cells, 24 * cells):
            return None
        return cells

    def _memory_layers(self) -> tuple[str | None, dict | None]:
        """This context's memory as pyllamacpp.state names it (kv, iswa, hybrid, hybrid-iswa,
        recurrent) and its layer map (state._layers); (None, None) for an architecture whose rule
        that module does not know. Read once per context."""
        if self._memory_layers_cache is None:
            self._memory_layers_cache = _model_memory(self.model)
        return self._memory_layers_cache

    def _partial_differs(self) -> bool:
        """Whether PARTIAL_ONLY changes what this context's memory writes and reads (iSWA, hybrid,
        dsa-iswa, hybrid-idx, dsv4 memories; plain KV caches, recurrent memories, dsa and msa
        ignore the flag)."""
        memory, _ = self._memory_layers()
        if memory is None:
            return not self._plain_kv
        from .state import written_parts  # what each memory writes with and without the flag

        return written_parts(memory, True) != written_parts(memory, False)

    def check_state(self, data: SeqState | npt.ArrayLike, *, kind: str = "sequence", flags: int = 0) -> None:
        """Check a state blob against this context before anything reaches C.

        Parses it with :mod:`pyllamacpp.state` (no llama.cpp call) and compares: dump kind, the
        memory parts llama.cpp will read with ``flags`` (``StateFlags.PARTIAL_ONLY``: an iSWA
        cache reads only its swa part, a hybrid memory only its recurrent part), streams
        (``kv_unified``), layer counts, K/V types, row sizes, V layout (flash attention), cell
        count, sequence ids: what ``llama_state_seq_set_data_ext`` / ``llama_state_set_data``
        would read. Used by ``set_seq_state`` and ``set_state``.

        Args:
            data: a ``SeqState``, bytes-like or uint8 array.
            kind: ``"sequence"`` (a ``llama_state_seq_get_data_ext`` dump) or ``"context"`` (a
                ``llama_state_get_data`` one).
            flags: the ``StateFlags`` it will be loaded with.

        Raises:
            StateError: the blob does not parse (the offset and what was being read), is of the
                other kind, is a metadata-only (``ON_DEVICE``) dump, or does not fit this
                context (the message names what does not match).
        """
        from . import state as st

        try:
            parsed = st.parse(_as_uint8(data))  # rows stay flat: a dump of another model still parses
        except st.StateFormatError as e:
            raise StateError(f"not a valid state: {e}", func="pyllamacpp.state.parse") from e
        want = {"sequence": (st.DumpKind.SEQUENCE,), "context": (st.DumpKind.CONTEXT,)}[kind]
        if parsed.kind not in want:
            raise StateError(f"this is a {parsed.kind}, not a {want[0]}", func="pyllamacpp.state.parse")
        StateMethods._check_parsed(self, parsed, kind, flags)  # unbound: tests check it on stand-ins of a Context

    def _check_parsed(self, parsed: Any, kind: str, flags: int) -> None:
        """check_state's comparison of a parsed dump (a ``KVState``: a blob's, or a state file's
        body) with this context; ``kind`` "sequence" or "context" says how llama.cpp reads it."""
        from . import state as st
        from .params import ggml_type_name

        def bad(what: str) -> NoReturn:
            raise StateError(f"state does not fit this context: {what}", func="pyllamacpp.state.parse")

        if parsed.metadata_only:
            bad(
                "a metadata-only dump (seq_state(seq, ON_DEVICE): the rows stayed in llama.cpp); load it "
                "with flags=StateFlags.ON_DEVICE into the context that made it"
            )
        # llama_context::state_read_data (whole states) reads with flags 0
        partial = kind == "sequence" and bool(int(flags) & lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        memory, layers = self._memory_layers()
        m = self.model
        arch = parsed.header.arch
        if arch is not None and arch != m.arch:  # state_read_data: "wrong model arch"
            bad(f"a state of a {arch!r} model, this context's model is {m.arch!r}")
        # the parts llama.cpp will read, each with its model layers (None: unknown architecture)
        expect: list[tuple[str, Any] | None] = [None] * len(parsed.parts)
        if memory is not None:
            reads = st.written_parts(memory, partial)
            got = tuple(p.kind for p in parsed.parts)
            if got != tuple(k for k, _ in reads):
                other = st.written_parts(memory, not partial)
                names, others = [n for _, n in reads], [n for _, n in other]
                if kind == "sequence" and got == tuple(k for k, _ in other) and other != reads:
                    bad(
                        f"a full dump (parts {others}) loaded with PARTIAL_ONLY, with which this context's "
                        f"{memory} memory reads only {names}"
                        if partial
                        else f"a PARTIAL_ONLY dump (parts {others} of this context's {memory} memory); load it "
                        "with flags=StateFlags.PARTIAL_ONLY"
                    )
                bad(
                    f"memory parts {[p.kind for p in parsed.parts]}, this context's {memory} memory reads "
                    f"{[f'{k} ({n})' for k, n in reads]}" + (" with PARTIAL_ONLY" if partial else "")
                )
            expect = [(n, cast(dict, layers)[n]) for _, n in reads]  # a known memory has its layer map
        # llama_kv_cache_dsv4 (every deepseek4 context) builds its caches non-unified whatever
        # kv_unified says (unified_raw in its constructor)
        dsv4 = memory == "dsv4" or m.arch == "deepseek4"
        n_stream = 1 if self.params.kv_unified and not dsv4 else self.n_seq_max
        kv_parts = [(p, e) for p, e in zip(parsed.parts, expect) if p.kind == "kv"]
        if lib.llama_model_is_recurrent(m.ptr) and kv_parts:
            bad("a KV cache state for a recurrent model")
        k_len, v_len = m.kv_head_sizes()
        # llama_model_loader reads attention.key_length_swa / value_length_swa for SWA layers
        # (default: the full layers' sizes; llama_hparams::n_embd_head_k(il))
        k_swa = int(m.meta(f"{m.arch}.attention.key_length_swa") or k_len)
        v_swa = int(m.meta(f"{m.arch}.attention.value_length_swa") or v_len)
        swa_layers = set((layers or {}).get("swa") or ())
        mla = not _kv_has_v(m)
        # per-layer KV heads, 0 for a layer without attention (hybrid models)
        heads = m.kv_head_counts()
        # without a layer map: a lone "kv" part holds every attention layer, in order, unless a
        # PARTIAL_ONLY load into a non-plain memory reads it (then which layers is unknown)
        plain = (
            len(kv_parts) == 1
            and kv_parts[0][0].name == "kv"
            and kv_parts[0][1] is None
            and (self._plain_kv or not partial)
        )
        for part, exp in kv_parts:
            # no map: a plain part's records are the attention layers in order
            ils = exp[1] if exp is not None else ([il for il, n in enumerate(heads) if n > 0] if plain else None)
            label = exp[0] if exp is not None else part.name
            # row widths are key/value_length x head_count_kv[il] only in caches built from the
            # model's own hparams with GQA heads: not in an indexer cache (lid, idx: one head of
            # indexer_head_size values) nor in an MLA one (dsa's mla, dsa-iswa's, dsv4's caches)
            widths = label in ("kv", "base", "swa") and memory not in ("dsa", "dsa-iswa") and not dsv4
            if part.n_stream != n_stream:
                bad(n_stream_hint(part.n_stream, n_stream, bool(self.params.kv_unified), self.n_seq_max))
            for s in part.streams:
                if not s.cell_count:
                    continue
                if s.cell_count > self.n_ctx_seq:
                    bad(f"{s.cell_count} cells in stream {s.index}, more than n_ctx_seq={self.n_ctx_seq}")
                if s.v_trans != (0 if self.flash_attn else 1):
                    bad(f"v_trans={s.v_trans}, this context has flash attention {'on' if self.flash_attn else 'off'}")
                if ils is not None and s.n_layer != len(ils):
                    bad(
                        f"{s.n_layer} layers in the {label} part, the model's has {len(ils)}"
                        if exp is not None
                        else f"{s.n_layer} layers, the model has {len(ils)}"
                    )
                n_v = sum(1 for r in s.records if r.kind == "V")
                if widths and n_v != (0 if mla else s.n_layer):
                    # a dump cut right after its K records reads as a cache without V
                    bad(
                        f"{n_v} V records in stream {s.index} of the {label} part, this context's cache "
                        f"has {0 if mla else s.n_layer}"
                    )
                for r in s.records:
                    want_t = self.params.type_k if r.kind == "K" else self.params.type_v
                    if r.type.id != want_t:
                        bad(f"{r.kind}[{r.layer}] is {r.type.name}, this context's cache is {ggml_type_name(want_t)}")
                    if widths and ils is not None and r.layer < len(ils):
                        il = ils[r.layer]
                        size = (
                            (k_swa if r.kind == "K" else v_swa)
                            if il in swa_layers
                            else (k_len if r.kind == "K" else v_len)
                        )
                        n_embd = size * heads[il]
                        if r.n_embd != n_embd:
                            bad(
                                f"{r.kind}[{r.layer}] rows hold {r.n_embd} values, "
                                f"the model's (layer {il}) hold {n_embd}"
                            )
                ids = s.cells["seq_id"]
                if ids.size and ((ids >= self.n_seq_max) | (ids < -1)).any():
                    bad(f"a cell of stream {s.index} names a sequence outside [0, {self.n_seq_max})")
                pos = s.cells["pos"]
                if pos.size and pos.min() < 0:
                    bad(f"a cell of stream {s.index} has a negative position")
                if kind == "sequence" and (s.cells["n_seq_id"] != 1).any():
                    # llama_kv_cache::state_read_meta: "invalid seq_id-agnostic kv cell"
                    bad(
                        f"a cell of stream {s.index} lists {int(s.cells['n_seq_id'].max())} sequences; "
                        "a sequence dump's cells list exactly one"
                    )
            if kind == "sequence" and sum(1 for s in part.streams if s.cell_count) > 1:
                # llama.cpp writes one sequence's cells from its one stream; loading several would
                # put each into the same stream, the later ones removing the earlier
                bad(
                    f"cells in {sum(1 for s in part.streams if s.cell_count)} streams of {part.name}; "
                    "a sequence dump has them in one"
                )
        for part in parsed.parts:
            # llama_memory_recurrent::state_write_data writes n_layer = hparams.n_layer()
            if part.kind == "recurrent" and part.streams[0].n_layer != m.n_layer:
                bad(f"{part.streams[0].n_layer} layers in the recurrent part, the model has {m.n_layer}")

    def _check_no_pending_copy(self, seq_id, func: str) -> None:
        if self._pending_stream_copies and (seq_id is None or seq_id in self._pending_stream_copies):
            which = sorted(self._pending_stream_copies) if seq_id is None else [seq_id]
            raise StateError(
                f"a cross-stream seq_cp into seq {which} is still queued in llama.cpp (kv_unified=False): "
                "it runs at the next decode and would overwrite what is loaded now; decode first",
                func=func,
            )

    def save_seq_state(
        self, path: str | os.PathLike, seq_id: int, tokens: npt.ArrayLike = (), *, sidecar: bool = False
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
            from .state import write_sidecar

            write_sidecar(path, **self.sidecar_facts(toks, flags=0))  # the file holds a flags-0 dump
        return int(n)

    def load_seq_state(self, path: str | os.PathLike, seq_id: int, max_tokens: int | None = None) -> np.ndarray:
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
        self._check_no_pending_copy(seq_id, "llama_state_seq_load_file")
        cap_tokens = max_tokens if max_tokens is not None else self.n_ctx
        cell_count = self._check_file(path, "sequence", cap_tokens, "llama_state_seq_load_file")
        occupied = self._occupied(seq_id)
        backup = None
        if occupied and not self._own_stream_fits() and not self._room_for(seq_id, cell_count):
            backup = self.seq_state(seq_id)
        toks = np.empty(cap_tokens, dtype=np.int32)
        count = ffi.new("size_t *")
        with _log.capture() as cap:
            n = lib.llama_state_seq_load_file(
                ptr, os.fsencode(path), seq_id, ffi.from_buffer("llama_token[]", toks), cap_tokens, count
            )
        if n == 0:
            self.memory.seq_rm(seq_id)  # llama.cpp clears what it had loaded (state_clear)
            back = backup is not None and self._put_back(seq_id, backup)
            raise StateError(
                f"llama_state_seq_load_file() could not load {path}; the sequence is "
                + ("unchanged" if back or not occupied else _NOT_BACK if backup is not None else "now empty"),
                func="llama_state_seq_load_file",
                reason=cap.reason(),
            )
        return toks[: count[0]].copy()

    def check_state_file(
        self, path: str | os.PathLike, *, kind: str = "sequence", max_tokens: int | None = None
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
        self._check_file(path, kind, max_tokens if max_tokens is not None else self.n_ctx, func)

    def _check_file(self, path: str | os.PathLike, kind: str, cap_tokens: int, func: str) -> int:
        """check_state_file's checks; returns the cells of the file's state (all streams)."""
        from . import state as st

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
                hint = (
                    f" (load it with {other})"
                    if parsed.kind in (st.DumpKind.SEQ_FILE, st.DumpKind.SESSION_FILE)
                    else ""
                )
                refuse(f"it is a {parsed.kind}{hint}")
            n_tokens = int(cast(np.ndarray, parsed.header.tokens).size)  # a file's header has them
            if n_tokens > cap_tokens:  # llama.cpp: "token count in ... file exceeded capacity"
                refuse(f"it holds {n_tokens:,} tokens, more than max_tokens={cap_tokens:,}")
            try:
                self._check_parsed(parsed, kind, 0)  # llama.cpp reads a file's state with flags 0
            except StateError as e:
                refuse(str(e), e)
            return sum(s.cell_count for p in parsed.parts for s in p.streams)
        finally:
            del arr  # the mapping goes with its last view (parsed's, dropped on return)

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

    def save_state(self, path: str | os.PathLike, tokens: npt.ArrayLike = ()) -> None:
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

    def load_state(self, path: str | os.PathLike, max_tokens: int | None = None) -> np.ndarray:
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
        self._check_no_pending_copy(None, "llama_state_load_file")
        if len(self._views):
            raise LlamaError(
                "output views are alive; copy or delete them before loading a whole state", func="llama_state_load_file"
            )
        cap_tokens = max_tokens if max_tokens is not None else self.n_ctx
        self._check_file(path, "context", cap_tokens, "llama_state_load_file")
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

    # -- self-describing dumps ------------------------------------------------------------------
    @property
    def flash_attn(self) -> bool:
        """Whether flash attention is on: ``"auto"`` resolved as llama.cpp logged it when the
        context was created (``llama_init_from_model``), else the ``flash_attn_type`` asked for.
        It decides the V layout of a dump (``v_trans``)."""
        for _, text in self.creation_log:
            if "Flash Attention enabled" in text:
                return True
            if "Flash Attention disabled" in text:
                return False
        return self.params.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_ENABLED

    def sidecar_facts(self, tokens: npt.ArrayLike | None = None, *, flags: int = 0) -> dict:
        """What a dump of this context does not say about itself, for a ``pyllamacpp.state``
        sidecar: model name and sha256 prefix, architecture, layer map, head sizes, K/V types,
        flash attention, ``kv_unified``, ``n_ctx``, the llama.cpp commit. No llama.cpp call
        beyond the model's metadata (``llama_model_meta_val_str``).

        Args:
            tokens: the token ids the dump holds, recorded when given.
            flags: the ``llama_state_seq_flags`` the dump is made with (PARTIAL_ONLY, ON_DEVICE).

        Returns:
            A JSON-ready dict (``pyllamacpp.state.write_sidecar`` takes it as keywords).

        Raises:
            ClosedError: the context or its model is closed.
        """
        from ._lib import EXTENSION_INFO
        from .params import ggml_type_name
        from .state import model_facts

        m = self.model
        if getattr(m, "_sha256_prefix", None) is None:
            m._sha256_prefix = model_facts(str(m.path), sha256=True)["model_sha256"]
        k_len, v_len = m.kv_head_sizes()
        # llama_model_n_head_kv is layer 0's count (0 when layer 0 has no attention): give the
        # attention layers' count when they agree, and the layer map the parser uses for il
        heads = {n for n in m.kv_head_counts() if n > 0}
        facts = {
            "model": m.path.name,
            "model_sha256": m._sha256_prefix,
            "arch": m.arch,
            "n_layer": m.n_layer,
            "n_head_kv": heads.pop() if len(heads) == 1 else None,
            "layers": self._memory_layers()[1],  # the map check_state uses
            "n_embd_head_k": k_len,
            "n_embd_head_v": v_len,
            "type_k": ggml_type_name(self.params.type_k),
            "type_v": ggml_type_name(self.params.type_v),
            "flash_attn": self.flash_attn,
            "kv_unified": bool(self.params.kv_unified),
            "n_ctx": self.n_ctx,
            "llama_cpp_commit": EXTENSION_INFO.get("llama_cpp_commit"),
            "flags": int(flags),
        }
        if tokens is not None:
            facts["tokens"] = [int(t) for t in np.asarray(tokens).reshape(-1)]
        return facts

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
