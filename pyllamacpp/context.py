"""``Context``: a ``llama_context`` — decode, outputs, memory (sequences) and state."""
from __future__ import annotations

import dataclasses
import enum
import os
import signal
import threading
import weakref
from pathlib import Path

import numpy as np

from . import _log
from ._handle import Handle, view
from ._lib import ffi, lib
from .batch import Batch
from .errors import (ClosedError, ContextError, DecodeAborted, InvalidBatchError, LlamaError, StateError,
                     check_decode, check_ptr)
from .model import Model, parse_buffer_sizes
from .params import ContextParams, context_params


_MAIN_THREAD = threading.main_thread().ident


class StateFlags(enum.IntFlag):
    """``LLAMA_STATE_SEQ_FLAGS_*`` (values from the header of this build)."""
    NONE = lib.LLAMA_STATE_SEQ_FLAGS_NONE
    PARTIAL_ONLY = lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY  # == SWA_ONLY (its old name)
    SWA_ONLY = lib.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
    ON_DEVICE = lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


PerfContextData = dataclasses.make_dataclass(
    "PerfContextData", [(n, float if f.type.cname == "double" else int)
                        for n, f in ffi.typeof("struct llama_perf_context_data").fields])
PerfContextData.__doc__ = "Every field of ``llama_perf_context_data`` (times in ms)."
PerfContextData.__module__ = __name__


@dataclasses.dataclass
class SeqState:
    """One sequence's state as ``llama_state_seq_get_data_ext`` wrote it: bytes you own.

    Picklable; restore with ``ctx.set_seq_state(seq_id, state)``."""
    data: np.ndarray  # uint8
    seq_id: int
    flags: int = 0

    def __len__(self) -> int:
        return int(self.data.size)

    def __bytes__(self) -> bytes:
        return self.data.tobytes()

    def __buffer__(self, flags):  # Python >= 3.12 buffer protocol
        return memoryview(self.data)


def _as_uint8(data) -> np.ndarray:
    if isinstance(data, SeqState):
        data = data.data
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    return np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)


class Memory:
    """``llama_get_memory(ctx)``: the context's sequences (KV cache or recurrent state).

    Sequence ids are checked against ``[0, n_seq_max)`` in Python first: llama.cpp asserts
    (and aborts the process) on some out-of-range ids."""

    def __init__(self, ctx: "Context"):
        self._ctx = weakref.ref(ctx)

    def _mem(self):
        ctx = self._ctx()
        if ctx is None:
            raise ClosedError("the context is gone", func="llama_get_memory")
        return lib.llama_get_memory(ctx.ptr), ctx

    def _seq(self, ctx, seq_id, *, allow_all=False) -> int:
        seq_id = int(seq_id)
        if allow_all and seq_id < 0:
            return -1
        if not 0 <= seq_id < ctx.n_seq_max:
            raise ValueError(f"seq_id {seq_id} is outside [0, {ctx.n_seq_max}) (n_seq_max)")
        return seq_id

    def clear(self, data: bool = True) -> None:
        """``llama_memory_clear``."""
        mem, _ = self._mem()
        lib.llama_memory_clear(mem, data)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """``llama_memory_seq_rm``: remove positions [p0, p1) of ``seq_id`` (-1: all sequences)."""
        mem, ctx = self._mem()
        return bool(lib.llama_memory_seq_rm(mem, self._seq(ctx, seq_id, allow_all=True), p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """``llama_memory_seq_cp``.

        With ``kv_unified=False`` each sequence has its own stream, and llama.cpp only queues a
        copy between streams: the buffers are copied at the start of the next ``decode``. Until
        then, loading a state into ``dst`` would be overwritten by that copy, so pyllamacpp refuses
        such a load. A partial range across streams aborts llama.cpp (GGML_ASSERT): refused here."""
        mem, ctx = self._mem()
        src, dst = self._seq(ctx, src), self._seq(ctx, dst)
        cross = not ctx.params.kv_unified and src != dst and lib.llama_model_is_recurrent(ctx.model.ptr) == 0
        if cross and not (p0 <= 0 and p1 < 0):
            raise ValueError(f"seq_cp({src}, {dst}, {p0}, {p1}): with kv_unified=False the sequences live in "
                             "different streams and llama.cpp copies only whole sequences between them")
        lib.llama_memory_seq_cp(mem, src, dst, p0, p1)
        if cross:
            ctx._pending_stream_copies.add(dst)

    def seq_keep(self, seq_id: int) -> None:
        """``llama_memory_seq_keep``."""
        mem, ctx = self._mem()
        lib.llama_memory_seq_keep(mem, self._seq(ctx, seq_id))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """``llama_memory_seq_add``: shift positions [p0, p1) by ``delta``."""
        mem, ctx = self._mem()
        if not lib.llama_memory_can_shift(mem):
            raise LlamaError("this memory cannot shift positions", func="llama_memory_seq_add")
        lib.llama_memory_seq_add(mem, self._seq(ctx, seq_id), p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """``llama_memory_seq_div``: integer-divide positions [p0, p1) by ``d``."""
        mem, ctx = self._mem()
        if d <= 0:
            raise ValueError(f"seq_div: d must be positive, got {d}")
        if not lib.llama_memory_can_shift(mem):
            raise LlamaError("this memory cannot shift positions", func="llama_memory_seq_div")
        lib.llama_memory_seq_div(mem, self._seq(ctx, seq_id), p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        mem, ctx = self._mem()
        return lib.llama_memory_seq_pos_min(mem, self._seq(ctx, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        mem, ctx = self._mem()
        return lib.llama_memory_seq_pos_max(mem, self._seq(ctx, seq_id))

    @property
    def can_shift(self) -> bool:
        mem, _ = self._mem()
        return bool(lib.llama_memory_can_shift(mem))


class Context:
    """``llama_init_from_model(model, params)``; a context manager; ``close()`` frees it.

    Keeps its model alive. Any use after ``close()`` raises :class:`ClosedError`.
    Keywords are fields of :class:`ContextParams` (``n_ctx``, ``n_batch``, ``n_ubatch``,
    ``n_seq_max``, ``type_k``, ``flash_attn``, ``kv_unified``...).
    """

    def __init__(self, model: Model, params: ContextParams | None = None, *, handle_sigint: bool = True,
                 **kwargs):
        self.model = model
        self.params = context_params(params, **kwargs)
        self.handle_sigint = handle_sigint
        cparams = self.params.to_c()
        # Abort through a C flag (no GIL in ggml's threads) unless the caller brings a callback.
        self._abort_state = ffi.new("pyl_abort_state *")
        if self.params.abort_callback is None:
            cparams.abort_callback = ffi.addressof(lib, "pyl_abort_flag_cb")
            cparams.abort_callback_data = self._abort_state
        with _log.capture() as cap:
            ptr = lib.llama_init_from_model(model.ptr, cparams[0])
        check_ptr(ptr, "llama_init_from_model", error=ContextError, reason=cap.reason())
        self._h = Handle(ptr, lib.llama_free, deps=(model._h, self._abort_state))
        self.buffers: dict[str, dict[str, float]] = {**model.load_buffers}
        for backend, kinds in parse_buffer_sizes(cap.lines).items():
            self.buffers.setdefault(backend, {}).update(kinds)
        """MiB per backend buffer and kind, as llama.cpp logged them (model, KV, compute, output)."""
        self.creation_log = cap.lines
        self.memory = Memory(self)
        self._lock = threading.Lock()
        self._n_outputs = 0
        self._out_reserved = self.n_seq_max  # llama.cpp reserves outputs for n_seq_max at start
        self._views: weakref.WeakSet = weakref.WeakSet()
        self._batch: Batch | None = None
        self._pending_stream_copies: set[int] = set()  # dst seqs of queued cross-stream copies
        # seq -> the blob of its latest seq_state(seq, ON_DEVICE): llama.cpp keeps the rows of that
        # save only, and aborts on a load whose cells do not add up to them
        self._device_saved: dict[int, bytes] = {}
        self._own_states = weakref.WeakValueDictionary()  # id -> read-only array seq_state made here
        self._kv_row_bytes: tuple[int, int] | None = None  # see _cells_held
        # one plain KV cache (not iSWA, recurrent or hybrid): see _load_fits
        self._plain_kv = not (model.n_swa or lib.llama_model_is_recurrent(model.ptr)
                              or lib.llama_model_is_hybrid(model.ptr))
        model._contexts.add(self)

    # -- lifetime ------------------------------------------------------------------------------
    @property
    def ptr(self):
        """The ``struct llama_context *`` (raises :class:`ClosedError` after ``close()``)."""
        h = self._h
        if h is None:
            raise ClosedError("the context is closed", func="llama_free")
        return h.ptr

    @property
    def closed(self) -> bool:
        return self._h is None

    def close(self) -> None:
        """``llama_free`` (idempotent). Output views still alive keep the memory valid until they go."""
        self._h = None
        self._batch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self.closed:
            return "<Context closed>"
        return f"<Context n_ctx={self.n_ctx} n_batch={self.n_batch} n_ubatch={self.n_ubatch} n_seq_max={self.n_seq_max}>"

    # -- effective sizes (after llama.cpp's clamps) --------------------------------------------
    @property
    def n_ctx(self) -> int:
        return lib.llama_n_ctx(self.ptr)

    @property
    def n_ctx_seq(self) -> int:
        return lib.llama_n_ctx_seq(self.ptr)

    @property
    def n_batch(self) -> int:
        return lib.llama_n_batch(self.ptr)

    @property
    def n_ubatch(self) -> int:
        return lib.llama_n_ubatch(self.ptr)

    @property
    def n_seq_max(self) -> int:
        return lib.llama_n_seq_max(self.ptr)

    @property
    def n_threads(self) -> int:
        return lib.llama_n_threads(self.ptr)

    # -- decode --------------------------------------------------------------------------------
    def abort(self) -> None:
        """Stop the running (or next) ``decode`` through the abort callback; it raises DecodeAborted.

        The exception's ``seq_pos_max`` maps each sequence of the batch to the last position now
        in memory (ubatches computed before the abort stay); from ``prefill`` it also carries
        ``resume_from``, the index of the first token to feed again."""
        self._abort_state.abort_requested = 1

    def decode(self, batch: Batch) -> None:
        """``llama_decode``. Return codes become exceptions: 1 KVCacheFullError, 2 DecodeAborted,
        -1 InvalidBatchError (with llama.cpp's logged reason), other negatives DecodeError.

        Output views (``logits()``...) of the previous decode are overwritten by this one."""
        self._run(lib.llama_decode, batch)

    def encode(self, batch: Batch) -> None:
        """``llama_encode`` (encoder models), same error mapping as ``decode``."""
        self._run(lib.llama_encode, batch)

    def _run(self, fn, batch: Batch) -> None:
        ptr = self.ptr
        cbatch = batch.struct
        self._check_batch(batch)
        n_outputs = batch.n_outputs
        n_out = max(n_outputs, 1)
        if n_out > self._out_reserved and len(self._views):
            # llama.cpp would reallocate its output buffer under the live views.
            raise LlamaError(
                f"{len(self._views)} output view(s) of an earlier decode are still alive and this batch "
                f"asks for {n_out} outputs (more than the {self._out_reserved} reserved so far), which "
                "makes llama.cpp reallocate the buffer they point into; copy or delete them first",
                func=fn.__name__ if hasattr(fn, "__name__") else "llama_decode")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this context is being used by another thread; use one context per thread")
        watch = self.handle_sigint and threading.get_ident() == _MAIN_THREAD
        sigint = 0
        try:
            if watch:
                self._abort_state.watch_sigint = lib.pyl_sigint_watch()
            with _log.capture() as cap:
                rc = fn(ptr, cbatch)
        finally:
            if watch:
                sigint = lib.pyl_sigint_unwatch()
                self._abort_state.watch_sigint = 0
            self._lock.release()
        if rc == 2:  # consumed; an abort() that came after the last check stays for the next decode
            self._abort_state.abort_requested = 0
        if rc == 0:
            self._decoded(n_outputs, sigint)
            return
        self._decode_failed(rc, sigint, cap, batch, "llama_decode" if fn is lib.llama_decode else "llama_encode")

    def _decoded(self, n_outputs: int, sigint: int) -> None:
        if self._pending_stream_copies:
            self._pending_stream_copies.clear()  # llama.cpp ran them at the start of this decode
        self._n_outputs = n_outputs
        if n_outputs > self._out_reserved:
            self._out_reserved = n_outputs
        if sigint:  # Ctrl-C came too late to stop this decode: deliver it now
            signal.raise_signal(signal.SIGINT)

    def _decode_failed(self, rc: int, sigint: int, cap, batch: Batch, func: str) -> None:
        self._n_outputs = 0
        try:
            if rc == 2 and sigint:
                raise DecodeAborted(f"{func}() aborted by Ctrl-C (SIGINT)", func=func, code=2)
            check_decode(rc, func, reason=cap.reason())
        except DecodeAborted as e:
            # Which positions made it into memory: ubatches that finished before the abort stay.
            e.seq_pos_max = {int(sq): self.memory.seq_pos_max(int(sq)) for sq in np.unique(
                batch.seq_id[np.arange(batch.n_seq_max) < batch.n_seq_id[:, None]])}
            raise

    def _generation_step(self, sampler, seq_id: int):
        """For :func:`pyllamacpp.generate`: ``step(token, pos, sample_next)`` decodes ``token`` at
        ``pos`` of ``seq_id`` and returns the next token sampled from its logits (or -1), in one
        C call (``pyl_decode_sample`` in build_support/helpers.h), with what :meth:`decode` does
        around it: the thread lock, the abort flag and SIGINT watch, error mapping. The token is
        one the sampler produced, and seq_id is checked here once, so the batch checks of
        :meth:`decode` have nothing left to find."""
        seq_id = self.memory._seq(self, seq_id)
        batch = Batch(1, 1)
        pbatch, out, state, lock = batch._p, ffi.new("pyl_step_out *"), self._abort_state, self._lock
        fn, capture, null, get_ident = lib.pyl_decode_sample, _log.capture, ffi.NULL, threading.get_ident

        def step(token: int, pos: int, sample_next: bool) -> int:
            ptr = self.ptr  # raises once the context is closed
            smpl = sampler.ptr if sample_next else null
            watch = self.handle_sigint and get_ident() == _MAIN_THREAD
            if not lock.acquire(False):
                raise RuntimeError("this context is being used by another thread; use one context per thread")
            try:
                with capture() as cap:
                    fn(ptr, pbatch, smpl, state, watch, token, pos, seq_id, out)
            finally:
                lock.release()
            if out.rc:
                self._decode_failed(out.rc, out.sigint, cap, batch, "llama_decode")
            self._decoded(1, out.sigint)
            return out.next

        return step

    def _check_batch(self, batch: Batch) -> None:
        """What llama.cpp would not survive, refused before C: the batch's views can be written
        freely, so a decode checks what they hold (vectorized; microseconds for 2048 tokens)."""
        n = len(batch)
        if 0 < n <= 16 and self._small_batch_ok(batch, n):
            return  # the per-step batches of generation loops: checked with plain ints

        def bad(why: str):
            raise InvalidBatchError(f"invalid batch: {why}", func="llama_decode", code=-1)

        if n > self.n_batch:  # GGML_ASSERT(n_tokens_all <= n_batch) in llama.cpp
            bad(f"{n} tokens, more than n_batch={self.n_batch}")
        if n == 0:
            return  # llama.cpp rejects it itself, with its own message
        n_ids = batch.n_seq_id
        if n_ids.min() < 1 or n_ids.max() > batch.n_seq_max:  # n_seq_id 0: a division by zero (SIGFPE)
            i = int(np.flatnonzero((n_ids < 1) | (n_ids > batch.n_seq_max))[0])
            bad(f"token {i} has n_seq_id {int(n_ids[i])}, outside [1, {batch.n_seq_max}]")
        ids = batch.seq_id
        used = np.arange(batch.n_seq_max) < n_ids[:, None]
        wrong = used & ((ids < 0) | (ids >= self.n_seq_max))
        if wrong.any():
            i, j = (int(x) for x in np.argwhere(wrong)[0])
            bad(f"token {i} has seq_id {int(ids[i, j])}, outside [0, n_seq_max={self.n_seq_max})")
        if batch._token is not None:
            toks = batch.token
            if toks.min() < 0 or toks.max() >= self.model.n_vocab:
                i = int(np.flatnonzero((toks < 0) | (toks >= self.model.n_vocab))[0])
                bad(f"token {i} is {int(toks[i])}, outside the vocabulary [0, {self.model.n_vocab})")

    def _small_batch_ok(self, batch: Batch, n: int) -> bool:
        """True when a small batch passes every check of _check_batch (else it reports the error)."""
        if n > self.n_batch:
            return False
        p, cap, n_seq_max = batch._p, batch.n_seq_max, self.n_seq_max
        n_vocab = self.model.n_vocab if batch._token is not None else None
        for i in range(n):
            k = p.n_seq_id[i]
            if not 1 <= k <= cap:
                return False
            row = p.seq_id[i]
            for j in range(k):
                if not 0 <= row[j] < n_seq_max:
                    return False
            if n_vocab is not None and not 0 <= p.token[i] < n_vocab:
                return False
        return True

    def _prefill_batch(self) -> Batch:
        if self._batch is None or self._batch.capacity < self.n_batch:
            self._batch = Batch(self.n_batch, self.n_seq_max, model=self.model)
        return self._batch

    def prefill(self, tokens, seq_id: int = 0, start_pos: int | None = None) -> int:
        """Feed ``tokens`` to ``seq_id`` as consecutive ``llama_decode`` calls of at most
        ``n_batch`` tokens (5000 at n_batch 2048: 2048, 2048, 904), logits for the last token only.

        ``start_pos`` defaults to the sequence's ``seq_pos_max + 1``. Returns the next position."""
        toks = np.asarray(tokens)
        if toks.size == 0:
            raise ValueError("prefill: no tokens")
        if start_pos is None:
            start_pos = self.memory.seq_pos_max(seq_id) + 1
        batch = self._prefill_batch()
        n_batch = self.n_batch
        for i0 in range(0, toks.size, n_batch):
            chunk = toks[i0:i0 + n_batch]
            batch.clear()
            last = i0 + n_batch >= toks.size
            batch.add_sequence(chunk, seq_id, start_pos + i0, logits="last" if last else "none")
            try:
                self.decode(batch)
            except DecodeAborted as e:
                # resume with prefill(tokens[e.resume_from:], seq_id) (positions follow)
                e.resume_from = self.memory.seq_pos_max(seq_id) + 1 - start_pos
                raise
        return start_pos + toks.size

    # -- outputs (views) -----------------------------------------------------------------------
    def _view(self, ptr, shape, func: str) -> np.ndarray:
        if ptr == ffi.NULL:
            raise IndexError(f"{func}() returned NULL (no such output in the last batch)")
        arr = view(ptr, shape, np.float32, self._h)
        self._views.add(arr.base)  # the base, which every slice of the view shares
        return arr

    @property
    def n_outputs(self) -> int:
        """Outputs of the last successful decode (tokens with their logits flag set)."""
        return self._n_outputs

    def logits(self, i: int = -1) -> np.ndarray:
        """``llama_get_logits_ith``: (n_vocab,) float32 view of output ``i`` of the last batch
        (``i`` is the batch slot; -1 the last output). Overwritten by the next decode."""
        ptr = self.ptr
        if self._n_outputs == 0:
            raise IndexError("no outputs: the last decode asked for no logits (or failed)")
        with _log.capture():
            p = lib.llama_get_logits_ith(ptr, int(i))
        return self._view(p, (self.model.n_vocab,), "llama_get_logits_ith")

    def logits_all(self) -> np.ndarray:
        """``llama_get_logits``: (n_outputs, n_vocab) view, rows in output order."""
        ptr = self.ptr
        if self._n_outputs == 0:
            raise IndexError("no outputs: the last decode asked for no logits (or failed)")
        return self._view(lib.llama_get_logits(ptr), (self._n_outputs, self.model.n_vocab), "llama_get_logits")

    def embeddings(self, i: int = -1) -> np.ndarray:
        """``llama_get_embeddings_ith``: (n_embd_out,) view (context made with ``embeddings=True``)."""
        ptr = self.ptr
        with _log.capture():
            p = lib.llama_get_embeddings_ith(ptr, int(i))
        return self._view(p, (lib.llama_model_n_embd_out(self.model.ptr),), "llama_get_embeddings_ith")

    def seq_embeddings(self, seq_id: int) -> np.ndarray:
        """``llama_get_embeddings_seq``: pooled embedding of ``seq_id`` (pooling_type != none)."""
        ptr = self.ptr
        p = lib.llama_get_embeddings_seq(ptr, int(seq_id))
        n = lib.llama_model_n_embd_out(self.model.ptr)
        if lib.llama_pooling_type(ptr) == lib.LLAMA_POOLING_TYPE_RANK:
            n = max(1, lib.llama_model_n_cls_out(self.model.ptr))
        return self._view(p, (n,), "llama_get_embeddings_seq")

    # -- state ---------------------------------------------------------------------------------
    def seq_state(self, seq_id: int, flags: int = 0, *, out: np.ndarray | None = None) -> SeqState:
        """``llama_state_seq_get_size_ext`` + ``llama_state_seq_get_data_ext``: one copy into
        a numpy buffer you own.

        ``out``: a writable uint8 array to reuse (at least the state's size): no fresh allocation,
        hence no page faults, for loops that dump again and again. The state is then ``out[:size]``."""
        ptr = self.ptr
        seq_id = self.memory._seq(self, seq_id)
        size = lib.llama_state_seq_get_size_ext(ptr, seq_id, int(flags))
        own = out is None
        if own:
            buf = np.empty(size, dtype=np.uint8)
        else:
            if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
                raise ValueError("out must be a writable, contiguous 1-D uint8 array")
            if out.size < size:
                raise ValueError(f"out holds {out.size} bytes, the state needs {size}")
            buf = out[:size]
        with _log.capture() as cap:
            n = lib.llama_state_seq_get_data_ext(ptr, ffi.from_buffer(buf), size, seq_id, int(flags))
        if n != size:
            raise StateError(f"llama_state_seq_get_data_ext() wrote {n} of {size} bytes",
                             func="llama_state_seq_get_data_ext", reason=cap.reason())
        if flags & lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE:
            self._device_saved[seq_id] = buf.tobytes()  # headers only: a few KB
        if own:
            buf.flags.writeable = False  # so set_seq_state can trust it without parsing it again
            self._own_states[id(buf)] = buf
        return SeqState(buf, seq_id, int(flags))

    def set_seq_state(self, seq_id: int, data, flags: int = 0, *, validate: bool = True,
                      keep_on_error: bool = True) -> int:
        """``llama_state_seq_set_data_ext``: load a sequence state into ``seq_id``.

        The blob is first parsed and checked against this context (:meth:`check_state`; skip with
        ``validate=False`` to see what llama.cpp itself does). Raises :class:`StateError` when the
        check fails or llama.cpp reads 0 bytes; the sequence then holds what it held before
        (llama.cpp clears it on failure, so a non-empty one is saved and put back: one more
        ``seq_state`` of it; ``keep_on_error=False`` skips that and leaves it cleared on failure).
        A :class:`SeqState` this context made (its data is read-only) is not parsed again."""
        ptr = self.ptr
        seq_id = self.memory._seq(self, seq_id)
        self._check_no_pending_copy(seq_id, "llama_state_seq_set_data_ext")
        buf = _as_uint8(data)
        if buf.size == 0:
            raise StateError("empty state", func="llama_state_seq_set_data_ext")
        own = (isinstance(data, SeqState) and self._own_states.get(id(data.data)) is data.data
               and not data.data.flags.writeable)
        if own and (data.flags ^ int(flags)) & lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE:
            raise StateError("state does not fit this context: a metadata-only dump (seq_state(seq, ON_DEVICE))"
                             " loads with flags=StateFlags.ON_DEVICE only" if data.flags & lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE
                             else "a full dump loads without StateFlags.ON_DEVICE", func="llama_state_seq_set_data_ext")
        if flags & lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE:
            # The blob names the sequence whose on-device copy to use. llama.cpp asserts (aborts the
            # process) when this context never saved that sequence with ON_DEVICE, and aborts
            # ("memory buffer mismatch", llama_io_read_device) when the blob's cells do not add up
            # to the rows of that sequence's latest save: only that blob, unchanged, is safe.
            src = int(np.frombuffer(buf[4:8].tobytes(), "<i4")[0]) if buf.size >= 8 else None
            if self._device_saved.get(src) != buf.tobytes():
                why = ("it is not the blob of that sequence's latest seq_state(seq, ON_DEVICE)"
                       if src in self._device_saved else f"it names seq {src}, saved on device here: "
                       f"{sorted(self._device_saved)}")
                raise StateError("an ON_DEVICE state loads only as the latest seq_state(seq, ON_DEVICE) "
                                 f"of this context returned it; {why}", func="llama_state_seq_set_data_ext")
        elif validate and not own:
            self.check_state(buf, kind="sequence")
        trusted = own or validate or bool(flags & lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE)
        backup = None
        if keep_on_error and self.memory.seq_pos_max(seq_id) >= 0 and not (trusted and self._load_fits(seq_id, buf)):
            backup = self.seq_state(seq_id)
        with _log.capture() as cap:
            n = lib.llama_state_seq_set_data_ext(ptr, ffi.from_buffer(buf), buf.size, seq_id, int(flags))
        if n == 0:
            self.memory.seq_rm(seq_id)
            if backup is not None:
                with _log.capture():
                    lib.llama_state_seq_set_data_ext(ptr, ffi.from_buffer(backup.data), len(backup), seq_id, 0)
            raise StateError("llama_state_seq_set_data_ext() read 0 bytes; the sequence is "
                             + ("unchanged" if keep_on_error else "now empty"),
                             func="llama_state_seq_set_data_ext", reason=cap.reason())
        return int(n)

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
        if not (self.params.kv_unified and self.n_seq_max > 1):
            # the sequence's stream is its own: a checked blob (or one this context made) has
            # cell_count <= n_ctx_seq
            return True
        if buf.size < 12 or not buf.flags.c_contiguous:
            return False
        n_stream = int(buf[8:12].view("<u4")[0])
        if not 1 <= n_stream <= 256 or buf.size < 12 + 4 * n_stream:
            return False
        # u32 cell_count of stream 0, then its cells...: only a leading run of empty streams
        # reads as counts, and a checked sequence blob has cells in one stream
        counts = buf[12:12 + 4 * n_stream].view("<u4")
        nz = np.flatnonzero(counts)
        cell_count = int(counts[nz[0]]) if nz.size else 0
        room = self.n_ctx_seq  # of the one stream the other sequences share
        for s in range(self.n_seq_max):
            if s != seq_id and self.memory.seq_pos_max(s) >= 0:
                c = self._cells_held(s)
                if c is None:
                    return False
                room -= c
        return cell_count <= room

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
            n_kv_layers = sum(1 for n in m._meta_list("attention.head_count_kv", m.n_head_kv) if n > 0)
            self._kv_row_bytes = (m.kv_bytes_per_token(self.params.type_k, self.params.type_v), n_kv_layers)
        row_bytes, n_layers = self._kv_row_bytes
        cells, rest = divmod(full - meta, row_bytes)
        if rest or meta - 16 - 8 - 24 * n_layers not in (12 * cells, 24 * cells):
            return None
        return cells

    def check_state(self, data, *, kind: str = "sequence") -> None:
        """Parse a state blob with :mod:`pyllamacpp.state` and check it against this context before
        anything reaches C: dump kind, streams (``kv_unified``), layer count, K/V types, row sizes,
        V layout (flash attention), cell count, sequence ids. Raises :class:`StateError` naming
        what does not match. (Used by ``set_seq_state`` and ``set_state``.)"""
        from . import state as st
        from .params import ggml_type_name
        try:
            parsed = st.parse(_as_uint8(data))  # rows stay flat: a dump of another model still parses
        except st.StateFormatError as e:
            raise StateError(f"not a valid state: {e}", func="pyllamacpp.state.parse") from e
        want = {"sequence": (st.DumpKind.SEQUENCE,), "context": (st.DumpKind.CONTEXT,)}[kind]
        if parsed.kind not in want:
            raise StateError(f"this is a {parsed.kind}, not a {want[0]}", func="pyllamacpp.state.parse")

        def bad(what: str):
            raise StateError(f"state does not fit this context: {what}", func="pyllamacpp.state.parse")

        if parsed.metadata_only:
            bad("a metadata-only dump (seq_state(seq, ON_DEVICE): the rows stayed in llama.cpp); load it "
                "with flags=StateFlags.ON_DEVICE into the context that made it")
        n_stream = 1 if self.params.kv_unified else self.n_seq_max
        kv_parts = [p for p in parsed.parts if p.kind == "kv"]
        if lib.llama_model_is_recurrent(self.model.ptr) and kv_parts:
            bad("a KV cache state for a recurrent model")
        m = self.model
        k_len, v_len = m.kv_head_sizes()
        # per-layer KV heads, 0 for a layer without attention (hybrid models): the KV part holds
        # the others, in order
        kv_heads = [n for n in m._meta_list("attention.head_count_kv", m.n_head_kv) if n > 0]
        n_kv_layers = len(kv_heads)
        plain = len(kv_parts) == 1 and kv_parts[0].name == "kv"
        for part in kv_parts:
            if part.n_stream != n_stream:
                bad(f"{part.n_stream} KV stream(s), this context has {n_stream} "
                    f"(kv_unified={bool(self.params.kv_unified)}, n_seq_max={self.n_seq_max})")
            for s in part.streams:
                if not s.cell_count:
                    continue
                if s.cell_count > self.n_ctx_seq:
                    bad(f"{s.cell_count} cells in stream {s.index}, more than n_ctx_seq={self.n_ctx_seq}")
                if s.v_trans != (0 if self.flash_attn else 1):
                    bad(f"v_trans={s.v_trans}, this context has flash attention {'on' if self.flash_attn else 'off'}")
                if plain and s.n_layer != n_kv_layers:
                    bad(f"{s.n_layer} layers, the model has {n_kv_layers}")
                for r in s.records:
                    want_t = self.params.type_k if r.kind == "K" else self.params.type_v
                    if r.type.id != want_t:
                        bad(f"{r.kind}[{r.layer}] is {r.type.name}, this context's cache is {ggml_type_name(want_t)}")
                    if plain and r.layer < n_kv_layers:
                        n_embd = (k_len if r.kind == "K" else v_len) * kv_heads[r.layer]
                        if r.n_embd != n_embd:
                            bad(f"{r.kind}[{r.layer}] rows hold {r.n_embd} values, the model's hold {n_embd}")
                ids = s.cells["seq_id"]
                if ids.size and ((ids >= self.n_seq_max) | (ids < -1)).any():
                    bad(f"a cell of stream {s.index} names a sequence outside [0, {self.n_seq_max})")
                pos = s.cells["pos"]
                if pos.size and pos.min() < 0:
                    bad(f"a cell of stream {s.index} has a negative position")
                if kind == "sequence" and (s.cells["n_seq_id"] != 1).any():
                    # llama_kv_cache::state_read_meta: "invalid seq_id-agnostic kv cell"
                    bad(f"a cell of stream {s.index} lists {int(s.cells['n_seq_id'].max())} sequences; "
                        "a sequence dump's cells list exactly one")
            if kind == "sequence" and sum(1 for s in part.streams if s.cell_count) > 1:
                # llama.cpp writes one sequence's cells from its one stream; loading several would
                # put each into the same stream, the later ones removing the earlier
                bad(f"cells in {sum(1 for s in part.streams if s.cell_count)} streams of {part.name}; "
                    "a sequence dump has them in one")

    def _check_no_pending_copy(self, seq_id, func: str) -> None:
        if self._pending_stream_copies and (seq_id is None or seq_id in self._pending_stream_copies):
            which = sorted(self._pending_stream_copies) if seq_id is None else [seq_id]
            raise StateError(f"a cross-stream seq_cp into seq {which} is still queued in llama.cpp (kv_unified=False): "
                             "it runs at the next decode and would overwrite what is loaded now; decode first",
                             func=func)

    def save_seq_state(self, path, seq_id: int, tokens=(), *, sidecar: bool = False) -> int:
        """``llama_state_seq_save_file`` (written to a temporary file, then renamed); with
        ``sidecar=True`` also ``path + ".json"`` (:meth:`sidecar_facts`)."""
        ptr = self.ptr
        seq_id = self.memory._seq(self, seq_id)
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with _log.capture() as cap:
            n = lib.llama_state_seq_save_file(ptr, os.fsencode(tmp), seq_id,
                                              ffi.from_buffer("llama_token[]", toks), toks.size)
        if n == 0:
            tmp.unlink(missing_ok=True)
            raise OSError(f"llama_state_seq_save_file() could not write {path}: {cap.reason() or 'failed'}")
        os.replace(tmp, path)
        if sidecar:
            from .state import write_sidecar
            write_sidecar(path, **self.sidecar_facts(toks))
        return int(n)

    def load_seq_state(self, path, seq_id: int, max_tokens: int | None = None) -> np.ndarray:
        """``llama_state_seq_load_file`` into ``seq_id``; returns the tokens stored in the file."""
        ptr = self.ptr
        seq_id = self.memory._seq(self, seq_id)
        self._check_no_pending_copy(seq_id, "llama_state_seq_load_file")
        cap_tokens = max_tokens if max_tokens is not None else self.n_ctx
        toks = np.empty(cap_tokens, dtype=np.int32)
        count = ffi.new("size_t *")
        if not Path(path).is_file():
            raise FileNotFoundError(path)
        with _log.capture() as cap:
            n = lib.llama_state_seq_load_file(ptr, os.fsencode(path), seq_id,
                                              ffi.from_buffer("llama_token[]", toks), cap_tokens, count)
        if n == 0:
            raise StateError(f"llama_state_seq_load_file() could not load {path}",
                             func="llama_state_seq_load_file", reason=cap.reason())
        return toks[: count[0]].copy()

    def state(self) -> np.ndarray:
        """``llama_state_get_size`` + ``llama_state_get_data``: the whole context's state."""
        ptr = self.ptr
        size = lib.llama_state_get_size(ptr)
        out = np.empty(size, dtype=np.uint8)
        n = lib.llama_state_get_data(ptr, ffi.from_buffer(out), size)
        if n != size:
            raise StateError(f"llama_state_get_data() wrote {n} of {size} bytes", func="llama_state_get_data")
        return out

    def set_state(self, data) -> int:
        """``llama_state_set_data``: load a whole-context state."""
        ptr = self.ptr
        self._check_no_pending_copy(None, "llama_state_set_data")
        buf = _as_uint8(data)
        self.check_state(buf, kind="context")
        if len(self._views):
            raise LlamaError("output views are alive: loading a whole state may reallocate the output "
                             "buffer they point into; copy or delete them first", func="llama_state_set_data")
        with _log.capture() as cap:
            n = lib.llama_state_set_data(ptr, ffi.from_buffer(buf), buf.size)
        if n == 0:
            raise StateError("llama_state_set_data() read 0 bytes", func="llama_state_set_data",
                             reason=cap.reason())
        self._out_reserved = max(self._out_reserved, self.n_batch)
        return int(n)

    def save_state(self, path, tokens=()) -> None:
        """``llama_state_save_file`` (session file; temporary file, then renamed)."""
        ptr = self.ptr
        toks = np.ascontiguousarray(tokens, dtype=np.int32)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with _log.capture() as cap:
            ok = lib.llama_state_save_file(ptr, os.fsencode(tmp), ffi.from_buffer("llama_token[]", toks), toks.size)
        if not ok:
            tmp.unlink(missing_ok=True)
            raise OSError(f"llama_state_save_file() could not write {path}: {cap.reason() or 'failed'}")
        os.replace(tmp, path)

    def load_state(self, path, max_tokens: int | None = None) -> np.ndarray:
        """``llama_state_load_file``; returns the tokens stored in the session file."""
        ptr = self.ptr
        if not Path(path).is_file():
            raise FileNotFoundError(path)
        self._check_no_pending_copy(None, "llama_state_load_file")
        if len(self._views):
            raise LlamaError("output views are alive; copy or delete them before loading a whole state",
                             func="llama_state_load_file")
        cap_tokens = max_tokens if max_tokens is not None else self.n_ctx
        toks = np.empty(cap_tokens, dtype=np.int32)
        count = ffi.new("size_t *")
        with _log.capture() as cap:
            ok = lib.llama_state_load_file(ptr, os.fsencode(path), ffi.from_buffer("llama_token[]", toks),
                                           cap_tokens, count)
        if not ok:
            raise StateError(f"llama_state_load_file() could not load {path}", func="llama_state_load_file",
                             reason=cap.reason())
        self._out_reserved = max(self._out_reserved, self.n_batch)
        return toks[: count[0]].copy()

    # -- self-describing dumps ------------------------------------------------------------------
    @property
    def flash_attn(self) -> bool:
        """Whether flash attention is on (``"auto"`` resolved as llama.cpp logged it)."""
        for _, text in self.creation_log:
            if "Flash Attention enabled" in text:
                return True
            if "Flash Attention disabled" in text:
                return False
        return self.params.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_ENABLED

    def sidecar_facts(self, tokens=None) -> dict:
        """What a dump of this context does not say about itself (see ``pyllamacpp.state`` sidecars)."""
        from ._lib import EXTENSION_INFO
        from .params import ggml_type_name
        from .state import model_facts
        m = self.model
        if getattr(m, "_sha256_prefix", None) is None:
            m._sha256_prefix = model_facts(str(m.path), sha256=True)["model_sha256"]
        k_len, v_len = m.kv_head_sizes()
        # llama_model_n_head_kv is layer 0's count (0 when layer 0 has no attention): give the
        # attention layers' count when they agree, and the layer map the parser uses for il
        heads = {n for n in m._meta_list("attention.head_count_kv", m.n_head_kv) if n > 0}
        facts = {
            "model": m.path.name, "model_sha256": m._sha256_prefix, "arch": m.arch, "n_layer": m.n_layer,
            "n_head_kv": heads.pop() if len(heads) == 1 else None,
            "layers": model_facts(str(m.path))["layers"],
            "n_embd_head_k": k_len, "n_embd_head_v": v_len,
            "type_k": ggml_type_name(self.params.type_k), "type_v": ggml_type_name(self.params.type_v),
            "flash_attn": self.flash_attn, "kv_unified": bool(self.params.kv_unified), "n_ctx": self.n_ctx,
            "llama_cpp_commit": EXTENSION_INFO.get("llama_cpp_commit"),
        }
        if tokens is not None:
            facts["tokens"] = [int(t) for t in np.asarray(tokens).reshape(-1)]
        return facts

    def save_seq_dump(self, path, seq_id: int, *, flags: int = 0, tokens=None, sidecar: bool = True) -> int:
        """Write ``seq_state(seq_id, flags)`` (raw ``llama_state_seq_get_data_ext`` bytes) to ``path``
        atomically, and ``path + ".json"`` with :meth:`sidecar_facts` unless ``sidecar=False``."""
        state = self.seq_state(seq_id, flags)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(memoryview(state.data))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        if sidecar:
            from .state import write_sidecar
            write_sidecar(path, **self.sidecar_facts(tokens))
        return len(state)

    # -- performance ---------------------------------------------------------------------------
    def perf(self) -> PerfContextData:
        """``llama_perf_context`` (times need a context made with ``no_perf=False``).

        Synchronizes first: llama.cpp adds a decode to the counters only at the next
        synchronization (next decode or output read), so without it the last decode is missing."""
        ptr = self.ptr
        lib.llama_synchronize(ptr)
        d = lib.llama_perf_context(ptr)
        return PerfContextData(**{f.name: getattr(d, f.name) for f in dataclasses.fields(PerfContextData)})

    def perf_reset(self) -> None:
        lib.llama_perf_context_reset(self.ptr)
