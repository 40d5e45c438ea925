"""A :class:`~pyllamacpp.context.Context`'s state in memory: ``seq_state`` / ``set_seq_state``
(``llama_state_seq_get_data_ext`` / ``llama_state_seq_set_data_ext``) and ``state`` /
``set_state`` (``llama_state_get_data`` / ``llama_state_set_data``), and the values they deal in:
``StateFlags``, ``SeqState``, ``StateBuffer``.

Each public function is a method of Context (``StateMethods``, in ``__init__.py``, lists them), the
context its ``self``. checks.py imports this module (the types), so what these functions need of
it (``check_state``, the room for a load) they reach through ``self``.

``pyllamacpp._state_types`` forwards ``SeqState`` and ``StateFlags`` here: pickles made before
they moved name that module."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from .. import _log
from .._lib import ffi, lib
from .._log import pending as _log_pending
from ..errors import LlamaError, StateError

if TYPE_CHECKING:
    from ..context import Context


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


def _as_uint8(data) -> np.ndarray:
    if isinstance(data, SeqState):
        data = data.data
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


# None: seq_state's own buffer comes from malloc inside one C call (pyl_state_seq_get). A function
# size -> writable uint8 array replaces that: tools/bench/bench_core.py places the dump at chosen page
# offsets with it, since llama.cpp's copy runs ~15% faster or slower with where the dump sits
# relative to the KV tensors it copies from.
_new_state_buffer: Callable[[int], np.ndarray] | None = None


_ON_DEVICE = lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
_U8 = np.dtype(np.uint8)
_PARTIAL_ONLY = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

# a failed load whose backup did not load back: the sequence shared its cells with another one
# (seq_cp in a unified cache), which a state load cannot do again, so they are not free for it
_NOT_BACK = "now empty: the copy kept aside did not fit back (cells it shared with another sequence stay taken)"


def seq_state(self: Context, seq_id: int, flags: int = 0, *, out: np.ndarray | StateBuffer | None = None) -> SeqState:
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
            seq_id = _seq_checked(self, seq_id)
        if type(flags) is not int:
            flags = int(flags)
        if type(out) is StateBuffer:
            # its pointer, made once; its last view and SeqState, reused when they still fit
            n = lib.llama_state_seq_get_data_ext(ptr, out._p, out.size, seq_id, flags)
            if not n:
                _seq_state_failed(ptr, seq_id, flags, out.array)
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
            _seq_state_failed(ptr, seq_id, flags, arr)
        if _log_pending:  # a log line without "\n", or a log handler raised inside the C callback
            _log.raise_pending()
        return SeqState(arr[:n], seq_id, flags)
    ptr = self.ptr
    seq_id = self.memory._seq(self, seq_id)
    flags = int(flags)
    if flags & _ON_DEVICE:
        _check_device_save(self)
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
    self: Context,
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
            seq_id = _seq_checked(self, seq_id)
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
            _seq_set_failed(self, seq_id)
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
    own = made is not None and made[0] is self._state_token and made[1] is state.data and not state.data.flags.writeable
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


def _seq_set_failed(self: Context, seq_id: int) -> NoReturn:
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


def _seq_checked(self: Context, seq_id: int) -> int:
    seq_id = self.memory._seq(self, seq_id)  # ValueError outside [0, n_seq_max)
    self._n_seq_max_seen = self.n_seq_max
    return seq_id


def _seq_state_failed(ptr: Any, seq_id: int, flags: int, out: np.ndarray) -> NoReturn:
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


def _check_device_save(self: Context) -> None:
    """Refuse an ON_DEVICE save that llama.cpp would restore wrong: its device writer
    (llama_io_write_device, llama-context.cpp) sizes each saved chunk as ``size /
    ggml_element_size(tensor)`` values, which for a block-quantized cache type is the number
    of blocks, so only 1/32 of a q8_0 chunk is kept and a load puts garbage in the cache
    (measured: next-token logits off by up to 29, argmax changed; tests/test_context.py)."""
    quantized = [
        n for n, t in (("type_k", self.params.type_k), ("type_v", self.params.type_v)) if lib.ggml_blck_size(t) > 1
    ]
    if quantized:
        from ..params import ggml_type_name

        raise StateError(
            "an ON_DEVICE save of a quantized cache ("
            + ", ".join(f"{n}={ggml_type_name(getattr(self.params, n))}" for n in quantized)
            + ") "
            "would load back wrong: llama.cpp's device writer keeps only size / ggml_element_size "
            "values of each chunk (1/32 of a q8_0 one); save without ON_DEVICE",
            func="llama_state_seq_get_data_ext",
        )


def state(self: Context) -> np.ndarray:
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


def set_state(self: Context, data: npt.ArrayLike) -> int:
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
