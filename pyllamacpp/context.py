"""``Context``: a ``llama_context`` — decode and outputs; its sequences are ``Memory``
(memory.py), its state methods ``StateMethods`` (context_state.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import weakref
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np
import numpy.typing as npt

from . import _log
from ._handle import Handle, Owner, view
from ._lib import ffi, lib
from .batch import Batch
from .context_state import SeqState, StateFlags, StateMethods  # noqa: F401 (SeqState, StateFlags: re-exported)
from .errors import (
    ContextError,
    DecodeAborted,
    DecodeInterrupted,
    InvalidBatchError,
    LlamaError,
    check_decode,
    check_ptr,
)
from .memory import Memory
from .model import Model, parse_buffer_sizes
from .params import ContextParams, context_params, default_n_ctx

_MAIN_THREAD = threading.main_thread().ident

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from .lora import LoraAdapter
    from .taps import Capture, Graph, NamesFilter, Patch, TapInfo

    class PerfContextData:  # fields from the C struct at import: to mypy, attributes of any type
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

        def __init__(self, **kwargs: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
else:
    PerfContextData = dataclasses.make_dataclass(
        "PerfContextData",
        [
            (n, float if f.type.cname == "double" else int)
            for n, f in ffi.typeof("struct llama_perf_context_data").fields
        ],
    )
PerfContextData.__doc__ = "Every field of ``llama_perf_context_data`` (times in ms)."
PerfContextData.__module__ = __name__


def _outputs_max(model: Model, params: ContextParams) -> int:
    """``cparams.n_outputs_max`` as ``llama_context``'s constructor sets it: ``n_outputs_max``, or
    when 0 (or for an encoder model) ``n_batch``, itself capped at ``n_ctx`` (causal attention)."""
    n_ctx = params.n_ctx or model.n_ctx_train
    n_batch = min(n_ctx, params.n_batch)
    if params.n_outputs_max and not lib.llama_model_has_encoder(model.ptr):
        return int(params.n_outputs_max)
    return int(n_batch)


def _loadavg() -> tuple[float, int] | None:
    """The 1-minute load average and the CPUs it is spread over (the whole system's, as the load
    average is), or None where the OS has no load average (Windows)."""
    import os

    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None


_busy_cores_warned = False
"""Whether this process has said :class:`BusyCoresWarning` already (it is said once)."""


def _warn_if_cores_busy(params: ContextParams) -> None:
    """A :class:`BusyCoresWarning` when more than one thread would compute and the load average
    is at least the CPU count: ggml's threads meet at a barrier after every op, and one that waits
    for a core holds up the others (on the 2-core development machine at load 5.5, 2 threads
    decoded 16 tokens in 4.1-5.7 s, 1 thread in 0.8-1.0 s). A warning, not a log line: the
    package's logger has no handler unless the application adds one, and this must be seen. Once
    per process: a script that makes six contexts needs to read it once, not six times."""
    global _busy_cores_warned
    n = max(params.n_threads, params.n_threads_batch)
    load = _loadavg() if n > 1 and not _busy_cores_warned else None
    if load is not None and load[0] >= load[1]:
        _busy_cores_warned = True
        import os
        import sys
        import types
        import warnings

        from .errors import BusyCoresWarning

        # point at the caller's line (Context(...), model.context(...)), not at this package's
        level, here = 2, os.path.dirname(__file__)
        f: types.FrameType | None = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(here):
            level, f = level + 1, f.f_back
        warnings.warn(
            f"the load average is {load[0]:.1f} on {load[1]} CPU(s): every core is taken, and "
            f"{n} threads (n_threads={params.n_threads}, n_threads_batch={params.n_threads_batch}) "
            "wait for each other at every step, which can decode several times slower than one "
            "thread; pass n_threads=1, n_threads_batch=1 (-t 1) while the machine is busy",
            BusyCoresWarning,
            stacklevel=level,
        )


def _check_mean_pooling(model: Model, params: ContextParams) -> None:
    """Mean pooling with an ``n_ubatch`` that is not a multiple of ``n_seq_max`` aborts in
    ``llama_init_from_model`` (its reserve graph rounds the worst-case ubatch up to a multiple of
    n_seq_max, past n_ubatch; seen at n_seq_max 2..7): refused here instead."""
    if not params.embeddings or params.n_seq_max <= 1:
        return
    pooling = params.pooling_type
    if pooling == lib.LLAMA_POOLING_TYPE_UNSPECIFIED:
        pooling = int(model.meta(f"{model.arch}.pooling_type") or lib.LLAMA_POOLING_TYPE_NONE)
    if pooling != lib.LLAMA_POOLING_TYPE_MEAN:
        return
    n_ctx = params.n_ctx or model.n_ctx_train
    n_ubatch = min(params.n_ubatch, params.n_batch, n_ctx)
    if n_ubatch % params.n_seq_max:
        raise ValueError(
            f"mean pooling needs n_ubatch ({n_ubatch}) to be a multiple of n_seq_max ({params.n_seq_max}): "
            "llama.cpp would abort while making the context"
        )


def _names_filter(names: tuple) -> Any:
    """``ctx.capture("l_out", "kq")``'s names as one taps.NamesFilter (a lone predicate stays one)."""
    if len(names) == 1:
        return names[0]
    if any(callable(n) for n in names):
        raise TypeError("a predicate must be the only name filter")
    return list(names)


class Context(StateMethods, Owner):
    """A ``llama_context``: decode batches, read outputs, its sequences' memory and state.

    Wraps ``llama_init_from_model(model, params)``; a context manager; ``close()`` frees it
    (``llama_free``). Keeps its model alive. Any use after ``close()`` raises :class:`ClosedError`.
    Keywords are fields of :class:`ContextParams` (``n_ctx``, ``n_batch``, ``n_ubatch``,
    ``n_seq_max``, ``type_k``, ``flash_attn``, ``kv_unified``...).

    Defaults that differ from ``llama_context_default_params()``: ``n_ctx`` not given (None) is
    ``min(model.n_ctx_train, 4096)`` (``n_ctx=0`` is llama.cpp's "all of ``n_ctx_train``"), and
    ``n_threads`` / ``n_threads_batch`` are the physical core count
    (:func:`pyllamacpp.params.default_n_threads`). A keyword ``n_threads`` without a keyword
    ``n_threads_batch`` sets both (``n_threads=1`` means one thread, for prompts too).
    ``self.params`` holds the values asked for, with ``n_ctx`` resolved.

    With ``handle_sigint`` (the default), Ctrl-C during a decode on the main thread stops it
    through the abort callback and raises :class:`DecodeInterrupted` (a KeyboardInterrupt); the
    context stays usable.

    Args:
        model: The model (kept alive by the context).
        params: A :class:`ContextParams`; ``kwargs`` override its fields.
        handle_sigint: Turn Ctrl-C during a decode on the main thread into an abort.
        **kwargs: Fields of :class:`ContextParams`.

    Raises:
        ContextError: ``llama_init_from_model`` returned NULL (llama.cpp's logged reason attached).
        ValueError: A bad parameter value, before anything reaches C.
        TypeError: An unknown parameter, before anything reaches C.
        ClosedError: The model is closed.
    """

    def __init__(
        self,
        model: Model,
        params: ContextParams | None = None,
        *,
        handle_sigint: bool = True,
        taps: bool = True,
        **kwargs: Any,
    ) -> None:
        self.model = model
        if "n_threads" in kwargs and "n_threads_batch" not in kwargs:  # one thread count asked: both
            kwargs["n_threads_batch"] = kwargs["n_threads"]
        self.params = context_params(params, **kwargs)
        if self.params.n_ctx is None:  # the default: what the model was trained for, capped
            self.params = dataclasses.replace(self.params, n_ctx=default_n_ctx(model.n_ctx_train))
        self.handle_sigint = handle_sigint
        self._n_outputs_max = _outputs_max(model, self.params)
        self._all_rows_out = bool(self.params.embeddings)  # llama.cpp then outputs every token
        if self._n_outputs_max < self.params.n_seq_max:
            # llama.cpp reserves n_seq_max output rows at creation and asserts (an abort) when that is
            # more than n_outputs_max (llama_context::output_reserve)
            raise ValueError(
                f"n_seq_max {self.params.n_seq_max} is more than the {self._n_outputs_max} outputs this "
                "context may hold (n_outputs_max, or n_batch when it is 0): llama.cpp would abort; "
                "raise n_batch (or n_outputs_max) to at least n_seq_max"
            )
        _check_mean_pooling(model, self.params)
        cparams = self.params.to_c()
        # Abort through a C flag (no GIL in ggml's threads) unless the caller brings a callback.
        self._abort_state = ffi.new("pyl_abort_state *")
        if self.params.abort_callback is None:
            cparams.abort_callback = ffi.addressof(lib, "pyl_abort_flag_cb")
            cparams.abort_callback_data = self._abort_state
        # Graph taps (taps.py): a C cb_eval that answers "not wanted" until a capture or patch is armed.
        self._taps_state: Any = None
        self._taps: Any = None  # the taps.Taps, made on first capture or patch
        if taps and self.params.cb_eval is None:
            self._taps_state = ffi.new("pyl_taps *")
            cparams.cb_eval = ffi.addressof(lib, "pyl_tap_eval")
            cparams.cb_eval_user_data = self._taps_state
        with _log.capture() as cap:
            ptr = lib.llama_init_from_model(model.ptr, cparams[0])
        check_ptr(ptr, "llama_init_from_model", error=ContextError, reason=cap.reason())
        rpc = cast(Handle, model._h).rpc  # model.ptr above raised if the model is closed
        self._h = Handle(
            ptr,
            lib.llama_free,
            deps=(model._h, self._abort_state, self._taps_state),
            rpc=rpc.child("context") if rpc is not None else None,
        )
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
        self._device_flags_by_seq: dict[int, int] = {}  # seq -> flags of that save (PARTIAL_ONLY must match)
        self._memory_layers_cache = None  # see StateMethods._memory_layers
        self._state_token = object()  # marks the SeqStates this context made (SeqState._made)
        self._kv_row_bytes = None  # see _cells_held
        # one plain KV cache (not iSWA, recurrent or hybrid): see _load_fits
        self._plain_kv = not (
            model.n_swa or lib.llama_model_is_recurrent(model.ptr) or lib.llama_model_is_hybrid(model.ptr)
        )
        model._contexts.add(self)
        _warn_if_cores_busy(self.params)

    # -- lifetime ------------------------------------------------------------------------------
    _what, _free = "context", "llama_free"  # Owner: ptr, closed, with-statement

    def close(self) -> None:
        """Free the context (``llama_free``); idempotent.

        Output views still alive keep the memory valid until they go.
        """
        self._h = None
        self._batch = None

    def __repr__(self) -> str:
        if self.closed:
            return "<Context closed>"
        return (
            f"<Context n_ctx={self.n_ctx} n_batch={self.n_batch} n_ubatch={self.n_ubatch} n_seq_max={self.n_seq_max}>"
        )

    # -- effective sizes (after llama.cpp's clamps) --------------------------------------------
    @property
    def n_ctx(self) -> int:
        """``llama_n_ctx``: the context size, after llama.cpp's clamps and padding.

        Raises:
            ClosedError: The context is closed.
        """
        return lib.llama_n_ctx(self.ptr)

    @property
    def n_ctx_seq(self) -> int:
        """``llama_n_ctx_seq``: the context size of one sequence (``n_ctx / n_seq_max`` unless ``kv_unified``).

        Raises:
            ClosedError: The context is closed.
        """
        return lib.llama_n_ctx_seq(self.ptr)

    @property
    def n_batch(self) -> int:
        """``llama_n_batch``: the most tokens one ``decode`` takes.

        Raises:
            ClosedError: The context is closed.
        """
        return lib.llama_n_batch(self.ptr)

    @property
    def n_ubatch(self) -> int:
        """``llama_n_ubatch``: the most tokens of one micro-batch (one graph computation).

        Raises:
            ClosedError: The context is closed.
        """
        return lib.llama_n_ubatch(self.ptr)

    @property
    def n_seq_max(self) -> int:
        """``llama_n_seq_max``: how many sequences the context holds (seq ids ``0..n_seq_max-1``).

        Raises:
            ClosedError: The context is closed.
        """
        return lib.llama_n_seq_max(self.ptr)

    @property
    def n_threads(self) -> int:
        """``llama_n_threads``: threads used for generation (single-token batches).

        Raises:
            ClosedError: The context is closed.
        """
        return lib.llama_n_threads(self.ptr)

    # -- decode --------------------------------------------------------------------------------
    def abort(self) -> None:
        """Stop the running (or next) ``decode`` through the abort callback.

        Sets the flag the context's ``abort_callback`` (``ggml_abort_callback``) reads; that decode
        then raises :class:`DecodeAborted` (Ctrl-C raises :class:`DecodeInterrupted` instead, a
        KeyboardInterrupt).

        The exception's ``seq_pos_max`` maps each sequence of the batch to the last position now
        in memory (ubatches computed before the abort stay); from ``prefill`` it also carries
        ``resume_from``, the index of the first token to feed again.
        """
        self._abort_state.abort_requested = 1

    def decode(self, batch: Batch) -> None:
        """Decode a batch (``llama_decode``).

        Return codes become exceptions: 1 KVCacheFullError, 2 DecodeAborted (DecodeInterrupted, a
        KeyboardInterrupt, when Ctrl-C stopped it), -1 InvalidBatchError (with llama.cpp's logged
        reason), other negatives DecodeError. Output views (``logits()``...) of the previous decode
        are overwritten by this one.

        Args:
            batch: The batch; what llama.cpp would not survive (more than ``n_batch`` tokens, a
                seq id outside ``[0, n_seq_max)``, a token outside the vocabulary) is refused first.

        Raises:
            KVCacheFullError: No KV cells for the batch (return code 1).
            DecodeAborted: :meth:`abort` stopped it (2); ``seq_pos_max`` says what reached memory.
            DecodeInterrupted: Ctrl-C stopped it (2), a KeyboardInterrupt.
            InvalidBatchError: The batch was refused, here or by llama.cpp (-1).
            DecodeError: Another failure (other negative codes).
            LlamaError: Output views of an earlier decode are alive and this batch asks for more
                outputs than are reserved (llama.cpp would reallocate under them).
            RuntimeError: Another thread is using the context.
            ClosedError: The context or the batch is closed.
        """
        self._run(lib.llama_decode, batch)

    def encode(self, batch: Batch) -> None:
        """Encode a batch with an encoder model (``llama_encode``); errors as in :meth:`decode`.

        Args:
            batch: The batch.

        Raises:
            InvalidBatchError: The batch was refused, here or by llama.cpp (-1).
            DecodeAborted: :meth:`abort` stopped it.
            DecodeInterrupted: Ctrl-C stopped it, a KeyboardInterrupt.
            DecodeError: Another failure.
            LlamaError: Output views of an earlier decode would be reallocated (see :meth:`decode`).
            RuntimeError: Another thread is using the context.
            ClosedError: The context or the batch is closed.
        """
        self._run(lib.llama_encode, batch)

    def _run(self, fn, batch: Batch) -> None:
        ptr = self.ptr
        cbatch = batch.struct
        self._check_batch(batch)
        n_outputs = batch.n_outputs
        n_rows = len(batch) if self._all_rows_out else n_outputs
        if n_rows > self._n_outputs_max:  # llama.cpp asserts (aborts) in output_reserve
            raise InvalidBatchError(
                f"the batch asks for {n_rows} outputs, more than this context's n_outputs_max "
                f"{self._n_outputs_max} (llama.cpp would abort)",
                func="llama_decode" if fn is lib.llama_decode else "llama_encode",
            )
        n_out = max(n_outputs, 1)
        if n_out > self._out_reserved and len(self._views):
            # llama.cpp would reallocate its output buffer under the live views.
            raise LlamaError(
                f"{len(self._views)} output view(s) of an earlier decode are still alive and this batch "
                f"asks for {n_out} outputs (more than the {self._out_reserved} reserved so far), which "
                "makes llama.cpp reallocate the buffer they point into; copy or delete them first",
                func=fn.__name__ if hasattr(fn, "__name__") else "llama_decode",
            )
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("this context is being used by another thread; use one context per thread")
        watch = self.handle_sigint and threading.get_ident() == _MAIN_THREAD
        sigint = 0
        taps = self._taps if self._taps is not None and self._taps.armed else None
        try:
            if taps is not None:
                taps.before_call(batch)
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
        if taps is not None:
            tap_error = taps.failed()
            if tap_error is not None:
                self._taps_failed(rc, tap_error, taps)
        if rc == 0:
            self._decoded(n_outputs, sigint)
            return
        self._decode_failed(
            rc, sigint, cap.reason(), batch, "llama_decode" if fn is lib.llama_decode else "llama_encode"
        )

    def _decoded(self, n_outputs: int, sigint: int) -> None:
        if self._pending_stream_copies:
            self._pending_stream_copies.clear()  # llama.cpp ran them at the start of this decode
        self._n_outputs = n_outputs
        if n_outputs > self._out_reserved:
            self._out_reserved = n_outputs
        if sigint:  # Ctrl-C came too late to stop this decode: deliver it now
            signal.raise_signal(signal.SIGINT)

    def _decode_failed(self, rc: int, sigint: int, reason: str | None, batch: Batch, func: str) -> None:
        self._n_outputs = 0
        try:
            if rc == 2 and sigint:
                if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                    signal.raise_signal(signal.SIGINT)  # the program's own handler runs (and may raise)
                    raise DecodeAborted(f"{func}() aborted by SIGINT", func=func, code=2)
                raise DecodeInterrupted(f"{func}() interrupted by Ctrl-C (SIGINT)", func=func, code=2)
            check_decode(rc, func, reason=reason)
        except (DecodeAborted, DecodeInterrupted) as e:
            # Which positions made it into memory: ubatches that finished before the abort stay.
            e.seq_pos_max = {
                int(sq): self.memory.seq_pos_max(int(sq))
                for sq in np.unique(batch.seq_id[np.arange(batch.n_seq_max) < batch.n_seq_id[:, None]])
            }
            raise

    def _taps_failed(self, rc: int, error: BaseException, taps) -> None:
        """A capture or patch failed during a decode (taps.py): leave the context as a failed decode
        leaves it, and raise the failure. llama.cpp rolled back the ubatch it was computing when the
        abort flag stopped it; a failure at a graph's last node stops nothing, so that pass's
        cells are removed here as llama.cpp would (positions from the first of each sequence on)."""
        self._abort_state.abort_requested = 0  # set by the tap; unused when nothing came after it
        self._n_outputs = 0
        s = taps.state
        if rc == 0 or int(s.cur_pass) > int(s.error_pass):
            _, call = taps.current_call()
            ub = int(s.error_pass) - (call.first_pass if call is not None else 0)
            if call is not None:
                if call.ubatches is None:
                    from .taps import plan_ubatches

                    call.ubatches = plan_ubatches(self, call)
                if 0 <= ub < len(call.ubatches):
                    first: dict[int, int] = {}
                    for i in call.ubatches[ub]:
                        sq, p = call.seq_ids[i][0], int(call.pos[i])
                        first[sq] = min(p, first.get(sq, p))
                    for sq, p in first.items():
                        lib.llama_memory_seq_rm(lib.llama_get_memory(self.ptr), sq, p, -1)
        raise error

    def _generation_step(self, sampler, seq_id: int):
        """For :func:`pyllamacpp.generate`: ``(step, out)``. ``step(token, pos, sample_next)``
        decodes ``token`` at ``pos`` of ``seq_id`` and returns the next token sampled from its
        logits (or -1; ``out.eog`` says whether it ends generation), in one C call
        (``pyl_decode_sample`` in build_support/helpers.h), with what :meth:`decode` does around it:
        the thread lock, the abort flag and SIGINT watch, error mapping (llama.cpp's reason kept in
        C, not by a log capture). The token is one the sampler produced, and seq_id is checked here
        once, so the batch checks of :meth:`decode` have nothing left to find.

        Python right after a decode runs with caches the decode flushed, so each line here costs
        microseconds per token: the step does as little as it can. DEBUG log lines follow the
        logger's level as it is when the step is made (``_log.sync_log_level``)."""
        seq_id = self.memory._seq(self, seq_id)
        batch = Batch(1, 1)
        pbatch, out, state, lock = batch._p, ffi.new("pyl_step_out *"), self._abort_state, self._lock
        fn, null, get_ident, vocab = lib.pyl_decode_sample, ffi.NULL, threading.get_ident, self.model._vocab_ptr()
        raise_pending, pending = _log.raise_pending, _log.pending
        _log.sync_log_level()

        def step(token: int, pos: int, sample_next: bool) -> int:
            ptr = self.ptr  # raises once the context is closed
            if not lock.acquire(False):
                raise RuntimeError("this context is being used by another thread; use one context per thread")
            try:
                fn(
                    ptr,
                    pbatch,
                    sampler.ptr if sample_next else null,
                    state,
                    self.handle_sigint and get_ident() == _MAIN_THREAD,
                    token,
                    pos,
                    seq_id,
                    vocab,
                    out,
                )
            finally:
                lock.release()
            if out.rc:
                if self._taps is not None and self._taps.armed:
                    tap_error = self._taps.failed()
                    if tap_error is not None:
                        self._taps_failed(0 if out.rc == lib.PYL_STEP_TAPS_FAILED else out.rc, tap_error, self._taps)
                reason = _log.c_reason()
                try:
                    raise_pending()  # a logging handler's exception: the decode's error carries it as context
                finally:
                    self._decode_failed(out.rc, out.sigint, reason, batch, "llama_decode")
            if out.sigint or self._pending_stream_copies or not self._out_reserved:
                self._decoded(1, out.sigint)
            else:
                self._n_outputs = 1
            if pending:  # a log line without "\n", or a log handler raised inside the C callback
                raise_pending()
            return out.next

        return step, out

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
            self._batch = Batch(self.n_batch, 1, model=self.model)  # prefill: one seq id per token
        return self._batch

    def prefill(self, tokens: npt.ArrayLike, seq_id: int = 0, start_pos: int | None = None) -> int:
        """Feed ``tokens`` to ``seq_id`` in chunks of at most ``n_batch`` tokens, logits for the last only.

        Consecutive ``llama_decode`` calls (5000 tokens at n_batch 2048: 2048, 2048, 904).

        Args:
            tokens: The token ids (at least one).
            seq_id: The sequence.
            start_pos: The position of the first token; None: the sequence's ``seq_pos_max + 1``.

        Returns:
            The next position (``start_pos + len(tokens)``).

        Raises:
            ValueError: No tokens, a token outside the vocabulary, or a bad ``seq_id``.
            KVCacheFullError: No KV cells for a chunk (chunks before it stay in memory).
            DecodeAborted: :meth:`abort` stopped it; ``resume_from`` is the index of the first
                token to feed again.
            DecodeInterrupted: Ctrl-C stopped it (a KeyboardInterrupt), with ``resume_from`` too.
            InvalidBatchError: llama.cpp refused a chunk.
            DecodeError: Another ``llama_decode`` failure.
            ClosedError: The context is closed.
        """
        toks = np.asarray(tokens)
        if toks.size == 0:
            raise ValueError("prefill: no tokens")
        if start_pos is None:
            start_pos = self.memory.seq_pos_max(seq_id) + 1
        from .packing import Segment, decode  # packing sits above context: a lazy import

        try:
            for _ in decode(self, [Segment(toks, seq_id, start_pos, "last")], batch=self._prefill_batch()):
                pass
        except (DecodeAborted, DecodeInterrupted) as e:
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
        """The logits of output ``i`` of the last batch: a (n_vocab,) float32 view.

        Wraps ``llama_get_logits_ith``. Overwritten by the next decode.

        Args:
            i: The batch slot (-1: the last output).

        Returns:
            A view over llama.cpp's output buffer.

        Raises:
            IndexError: The last decode asked for no logits (or failed), or slot ``i`` has none.
            ClosedError: The context is closed.
        """
        ptr = self.ptr
        if self._n_outputs == 0:
            raise IndexError("no outputs: the last decode asked for no logits (or failed)")
        with _log.capture():
            p = lib.llama_get_logits_ith(ptr, int(i))
        return self._view(p, (self.model.n_vocab,), "llama_get_logits_ith")

    def logits_all(self) -> np.ndarray:
        """The logits of every output of the last batch (``llama_get_logits``).

        Returns:
            A (n_outputs, n_vocab) float32 view, rows in output order.

        Raises:
            IndexError: The last decode asked for no logits (or failed).
            ClosedError: The context is closed.
        """
        ptr = self.ptr
        if self._n_outputs == 0:
            raise IndexError("no outputs: the last decode asked for no logits (or failed)")
        return self._view(lib.llama_get_logits(ptr), (self._n_outputs, self.model.n_vocab), "llama_get_logits")

    def embeddings(self, i: int = -1) -> np.ndarray:
        """The embedding of output ``i`` of the last batch (``llama_get_embeddings_ith``).

        Needs a context made with ``embeddings=True``.

        Args:
            i: The batch slot (-1: the last output).

        Returns:
            A (n_embd_out,) float32 view.

        Raises:
            IndexError: llama.cpp has no embedding for slot ``i`` (returned NULL).
            ClosedError: The context is closed.
        """
        ptr = self.ptr
        with _log.capture():
            p = lib.llama_get_embeddings_ith(ptr, int(i))
        return self._view(p, (lib.llama_model_n_embd_out(self.model.ptr),), "llama_get_embeddings_ith")

    def seq_embeddings(self, seq_id: int) -> np.ndarray:
        """The pooled embedding of ``seq_id`` (``llama_get_embeddings_seq``; pooling_type != none).

        Args:
            seq_id: The sequence.

        Returns:
            A (n_embd_out,) float32 view; (n_cls_out,) for rank pooling.

        Raises:
            IndexError: llama.cpp has no pooled embedding for ``seq_id`` (returned NULL).
            ClosedError: The context is closed.
        """
        ptr = self.ptr
        p = lib.llama_get_embeddings_seq(ptr, int(seq_id))
        n = lib.llama_model_n_embd_out(self.model.ptr)
        if lib.llama_pooling_type(ptr) == lib.LLAMA_POOLING_TYPE_RANK:
            n = max(1, lib.llama_model_n_cls_out(self.model.ptr))
        return self._view(p, (n,), "llama_get_embeddings_seq")

    # -- performance ---------------------------------------------------------------------------
    def perf(self) -> PerfContextData:
        """The context's performance counters (``llama_perf_context``).

        Times need a context made with ``no_perf=False``. Synchronizes first
        (``llama_synchronize``): llama.cpp adds a decode to the counters only at the next
        synchronization (next decode or output read), so without it the last decode is missing.

        Returns:
            Every field of ``llama_perf_context_data``.

        Raises:
            ClosedError: The context is closed.
        """
        ptr = self.ptr
        lib.llama_synchronize(ptr)
        d = lib.llama_perf_context(ptr)
        return PerfContextData(**{f.name: getattr(d, f.name) for f in dataclasses.fields(PerfContextData)})

    def perf_reset(self) -> None:
        """Reset the performance counters (``llama_perf_context_reset``).

        Raises:
            ClosedError: The context is closed.
        """
        lib.llama_perf_context_reset(self.ptr)

    # -- LoRA adapters (pyllamacpp.lora) -------------------------------------------------------
    # -- graph taps (taps.py) ------------------------------------------------------------------
    def graph_nodes(self, n_tokens: int = 3) -> Graph:
        """What one forward pass of this model under this context's parameters computes: every
        node (name, op, type, shape, layer, token axis) in graph order, and the inputs they read.

        Made by probe decodes of ``n_tokens`` tokens (and 2 and 3, to find each node's token axis)
        in a throwaway context with the same parameters, so this context is untouched; cached per
        model and parameters.

        Args:
            n_tokens: Tokens of the probe whose shapes are shown (one output, the last).

        Returns:
            A :class:`~pyllamacpp.taps.Graph` (``.table()`` prints it).

        Raises:
            ContextError: The probe context could not be made.
            ClosedError: The context is closed.
        """
        from .taps import graph_listing

        self.ptr  # noqa: B018 - raises when closed
        return graph_listing(self, int(n_tokens))

    def capture(
        self,
        *names: NamesFilter,
        layers: Sequence[int] | None = None,
        which: int | str | None = None,
        max_bytes: int = 1 << 30,
        max_records: int = 1 << 16,
        copy: bool = True,
    ) -> Capture:
        """Capture tensors of the forward passes run inside a ``with`` block (graph taps).

        ``with ctx.capture("l_out", "kq_soft_max", layers=[0, 5]) as cap: ctx.decode(batch)``, then
        ``cap["l_out", 5]`` is a ``(n_tokens, n_embd)`` array and ``cap.records`` has one record
        per tensor per ubatch. The copies are made in C (``ggml_backend_tensor_get``) while the
        graph runs; see :class:`~pyllamacpp.taps.Capture`.

        Args:
            *names: Names, sites or globs (``"l_out"``, ``"l_out-5"``, ``"ffn_*"``), or one
                predicate on the full node name; inputs (``"attn_inp_kq_mask"``, ``"inp_pos"``)
                too.
            layers: Only these layers.
            which: For names several nodes carry: None (the last), an index, an op name, "all".
            max_bytes: The arena's size: a decode whose copies need more raises
                :class:`~pyllamacpp.errors.CaptureLimitError` (and is rolled back).
            max_records: The most tensor copies (and decode calls) it holds.
            copy: False records each wanted node's shape and pass without copying it (what
                the graph splits cost alone; counting passes).

        Returns:
            The :class:`~pyllamacpp.taps.Capture` (a context manager).

        Raises:
            TapError: A name this pass does not produce (the message lists what it does), a
                context made with ``taps=False`` or its own ``cb_eval``, or another capture active.
            TypeError: A filter that is not a name, glob, list or predicate.
            ClosedError: The context is closed.
        """
        from .taps import Capture

        return Capture(
            self,
            _names_filter(names),
            layers=layers,
            which=which,
            max_bytes=max_bytes,
            max_records=max_records,
            copy=copy,
        )

    def patch(
        self,
        names: NamesFilter,
        fn: Callable[[np.ndarray, TapInfo], np.ndarray | None],
        *,
        layers: Sequence[int] | None = None,
        which: int | str | None = None,
    ) -> Patch:
        """Call ``fn(array, info)`` at named nodes of every forward pass inside a ``with`` block:
        the array is the node's output (writable, numpy order); change it in place or return new
        values, and later nodes read them. An exception in ``fn`` stops the decode, which raises
        it, its ubatch rolled back.

        Args:
            names: As for :meth:`capture` (inputs too: a patched input is what every node reads).
            fn: The function; ``info`` is a :class:`~pyllamacpp.taps.TapInfo` (name, layer, the
                batch rows of the pass, their sequence ids and positions).
            layers: Only these layers.
            which: As for :meth:`capture`.

        Returns:
            The :class:`~pyllamacpp.taps.Patch` (a context manager).

        Raises:
            TapError: A name this pass does not produce, or a context that cannot be tapped.
            TypeError: ``fn`` is not callable.
            ClosedError: The context is closed.
        """
        from .taps import Patch

        return Patch(self, names, fn, layers=layers, which=which)

    def control_vector(
        self,
        vector: npt.ArrayLike | str | os.PathLike | None,
        *,
        layers: tuple[int, int] | None = None,
        strength: float = 1.0,
    ) -> None:
        """Add a control vector to each layer's output: ``llama_set_adapter_cvec``.

        llama.cpp adds layer ``il``'s vector to the layer's output just before the graph names it
        ``l_out-<il>`` (for layers 1 to ``n_layer - 1``; layer 0 has none).

        Args:
            vector: A ``(n_layer - 1, n_embd)`` array (row 0 is layer 1), a ``{layer: (n_embd,)}``
                dict, the path of a control-vector GGUF (``direction.<il>`` tensors, as
                llama.cpp's ``cvector-generator`` writes), or None to clear it.
            layers: ``(il_start, il_end)``, both inclusive (default: every layer it has).
            strength: Multiplies the vector (as llama.cpp's ``--control-vector-scaled``).

        Raises:
            ValueError: A vector of another width than the model's ``n_embd``, a bad layer, or a
                file that is not a control vector.
            LlamaError: llama.cpp refused it.
            ClosedError: The context is closed.
        """
        from .cvec import control_vector_data

        ptr = self.ptr
        n_embd = self.model.n_embd
        if vector is None:
            with _log.capture() as cap:
                rc = lib.llama_set_adapter_cvec(ptr, ffi.NULL, 0, n_embd, -1, -1)
            if rc == 0:
                self._cvec_applied = None
        else:
            data = control_vector_data(vector, n_layer=self.model.n_layer, n_embd=n_embd, strength=strength)
            lo, hi = layers if layers is not None else (1, self.model.n_layer - 1)
            if not 1 <= lo <= hi < self.model.n_layer:
                raise ValueError(f"layers: {lo}..{hi} is not within 1..{self.model.n_layer - 1}")
            self._cvec = data  # llama.cpp copies it, but keep what was applied readable
            with _log.capture() as cap:
                rc = lib.llama_set_adapter_cvec(ptr, ffi.from_buffer("float[]", data), data.size, n_embd, lo, hi)
            if rc == 0:
                self._cvec_applied = (data, (lo, hi))
        if rc != 0:
            raise LlamaError(
                "llama_set_adapter_cvec() failed", func="llama_set_adapter_cvec", code=rc, reason=cap.reason()
            )

    @property
    def control_vector_applied(self) -> tuple[np.ndarray, tuple[int, int]] | None:
        """The control vector :meth:`control_vector` applied last and its layers ``(il_start,
        il_end)``, or None (none applied, or cleared). The array is the buffer given to
        ``llama_set_adapter_cvec`` (row 0 is layer 1)."""
        return getattr(self, "_cvec_applied", None)

    def set_lora(self, adapter: LoraAdapter, scale: float = 1.0) -> None:
        """Apply ``adapter`` at ``scale``, keeping the other adapters; 0 takes it off.

        ``llama_set_adapters_lora`` with the whole set (see :mod:`pyllamacpp.lora`). The context
        keeps the adapter alive from here on. The KV cache is not recomputed.

        Args:
            adapter: A :class:`LoraAdapter` of this context's model.
            scale: Its scale (llama.cpp multiplies it by ``alpha / rank``).

        Raises:
            TypeError: ``adapter`` is not a LoraAdapter.
            ValueError: An adapter of another model, or a scale that is not finite.
            RuntimeError: Another thread is decoding in the context.
            ClosedError: The adapter or the context is closed.
        """
        from .lora import set_lora

        set_lora(self, adapter, scale)

    def set_loras(self, adapters: Mapping[LoraAdapter, float]) -> None:
        """Apply exactly ``adapters`` (``{adapter: scale}``; ``{}`` removes all): ``llama_set_adapters_lora``.

        Args:
            adapters: Adapters of this context's model and their scales (0: left out).

        Raises:
            TypeError: A key that is not a LoraAdapter, or a scale that is not a number.
            ValueError: An adapter of another model, or a scale that is not finite.
            RuntimeError: Another thread is decoding in the context.
            ClosedError: An adapter or the context is closed.
        """
        from .lora import set_loras

        set_loras(self, adapters)

    @property
    def loras(self) -> dict[LoraAdapter, float]:
        """The adapters applied and their scales, as float32 stored them (a copy).

        Raises:
            ClosedError: The context is closed.
        """
        from .lora import applied

        return applied(self)
