"""The values of a :class:`~pyllamacpp.context.Context`'s state methods: ``StateFlags``,
``SeqState``, ``StateBuffer``, and ``_StateBase``, what those methods (the mixins of
``context_state.py``) read of a Context. Imports nothing of the package above ``_lib``.

``pyllamacpp._state_types`` forwards ``SeqState`` and ``StateFlags`` here: pickles made before
they moved name that module."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any

import numpy as np

from .._lib import ffi, lib

if TYPE_CHECKING:
    import weakref

    from .._handle import Handle
    from ..memory import Memory
    from ..model import Model
    from ..params import ContextParams


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


class _StateBase:
    """What Context (context.py) sets or defines and the state mixins use: ``StateFacts``,
    ``StateChecks``, ``StateRoom``, ``StateFiles`` and ``StateMethods`` build on it."""

    if TYPE_CHECKING:
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

        # defined above the mixin that calls it (context_state.StateMethods)
        def seq_state(
            self, seq_id: int, flags: int = 0, *, out: np.ndarray | StateBuffer | None = None
        ) -> SeqState: ...
