"""The LlamaError hierarchy and the few helpers every C return code and pointer passes through."""

from __future__ import annotations

from typing import Any


class LlamaError(RuntimeError):
    """Base class of every error pyllamacpp raises for llama.cpp.

    ``func`` names the C function, ``code`` its return code (when it has one) and ``reason`` the
    last error or warning line llama.cpp logged during the call (when it logged one).

    Args:
        message: What failed; ``reason``, when given, is appended after a colon.
        func: The C function that failed.
        code: Its return code.
        reason: The line llama.cpp logged.
    """

    def __init__(
        self, message: str, *, func: str | None = None, code: int | None = None, reason: str | None = None
    ) -> None:
        self.func, self.code, self.reason = func, code, reason
        if reason:
            message = f"{message}: {reason}"
            message += "".join(f" ({hint})" for phrase, hint in _REASON_HINTS if phrase in reason)
        super().__init__(message)


# What to change, for reasons llama.cpp logs without saying it.
_REASON_HINTS = (
    (
        "n_stream mismatch",
        "the state holds another number of KV streams than this context: a context made with "
        "kv_unified=True has 1, one with kv_unified=False has n_seq_max; load it into a context with "
        "the kv_unified and n_seq_max of the context that saved it",
    ),
)


def n_stream_hint(state_streams: int, n_stream: int, kv_unified: bool, n_seq_max: int) -> str:
    """What a state of ``state_streams`` KV streams needs, said against this context's settings.

    A ``kv_unified=True`` context (or one with ``n_seq_max=1``) has one stream; a
    ``kv_unified=False`` one has ``n_seq_max`` (``llama_kv_cache``'s ``n_stream``), and a state
    loads only into a context with as many.

    Args:
        state_streams: The ``n_stream`` the state holds.
        n_stream: This context's stream count.
        kv_unified: This context's ``kv_unified``.
        n_seq_max: This context's ``n_seq_max``.

    Returns:
        One sentence: what the state has, what this context has, which parameter to change.
    """
    head = (
        f"the state has {state_streams} KV stream(s), this context has {n_stream} "
        f"(kv_unified={bool(kv_unified)}, n_seq_max={n_seq_max}): the state was saved by"
    )
    if state_streams == 1:
        return f"{head} a kv_unified=True context (or one with n_seq_max=1); make this one with kv_unified=True"
    saved = f"{head} a kv_unified=False context with n_seq_max={state_streams}; make this one with"
    if kv_unified:
        return f"{saved} kv_unified=False, n_seq_max={state_streams}"
    return f"{saved} n_seq_max={state_streams}"


class ModelLoadError(LlamaError):
    """``llama_model_load_from_file`` returned NULL."""


class ContextError(LlamaError):
    """A context could not be created, or was used after ``close()``."""


class DecodeError(LlamaError):
    """``llama_decode`` returned a negative code other than -1."""


class InvalidBatchError(DecodeError):
    """``llama_decode`` returned -1: llama.cpp rejected the batch (reason from its log)."""


class KVCacheFullError(DecodeError):
    """``llama_decode`` returned 1: no KV cache slot for the batch."""


class DecodeAborted(DecodeError):
    """``llama_decode`` returned 2: the abort callback stopped it (``Context.abort()``, or a callback
    of the caller's own).

    ``seq_pos_max`` maps each sequence of the batch to its last position in memory (ubatches
    computed before the abort stay); from ``Context.prefill``, ``resume_from`` is the index of the
    first token to feed again."""

    seq_pos_max: dict[int, int]  # set by the Context that raises it
    resume_from: int  # set by Context.prefill only


class DecodeInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped ``llama_decode``/``llama_encode`` (it returned 2 through the abort
    callback). A ``KeyboardInterrupt``, so ``except KeyboardInterrupt`` sees it and ``except
    Exception`` does not swallow it; not a :class:`DecodeAborted`, which is a RuntimeError.

    Carries what a DecodeAborted carries: ``func``, ``code`` (2), ``seq_pos_max`` and, from
    ``Context.prefill``, ``resume_from``. The context stays usable.

    Args:
        message: What was interrupted.
        func: The C function (``llama_decode`` or ``llama_encode``).
        code: Its return code (2).
    """

    resume_from: int  # set by Context.prefill only

    def __init__(self, message: str, *, func: str | None = None, code: int | None = None) -> None:
        self.func, self.code, self.reason = func, code, None
        self.seq_pos_max: dict[int, int] = {}
        super().__init__(message)


class StateError(LlamaError):
    """A state get/set/save/load call failed."""


class ClosedError(LlamaError, ValueError):
    """An object was used after ``close()``."""


class RPCError(LlamaError):
    """An RPC server (ggml-rpc) could not be used: unreachable, or gone while objects lived on it."""


class TapError(LlamaError):
    """A graph tap (capture or patch, :mod:`pyllamacpp.taps`) cannot be made or failed in a decode."""


class CaptureLimitError(TapError, MemoryError):
    """A capture would need more memory (or more records) than its limit; the decode that hit it
    was stopped and rolled back before anything was overwritten."""


class BusyCoresWarning(RuntimeWarning):
    """A context computes with several threads while the load average says every core is taken:
    ggml's threads wait for each other at every step, so decoding can be slower than with one."""


class TaskFileWarning(UserWarning):
    """A task file of llama-perplexity's multiple-choice modes holds data its reader does not use
    (a Winogrande line no newline ends, bytes after the last multiple-choice task): read as
    ``llama-perplexity`` reads it, and said, since it says nothing there."""


def check_ptr(
    ptr: Any, func: str, *, error: type[LlamaError] = LlamaError, reason: str | None = None, what: str = ""
) -> Any:
    """Return ``ptr``, or raise ``error`` naming ``func`` when it is NULL.

    Args:
        ptr: A pointer (cdata) a C function returned.
        func: The C function's name, for the message.
        error: The LlamaError subclass to raise.
        reason: The line llama.cpp logged during the call, if any.
        what: Words appended to the message ("for model.gguf" ...).

    Returns:
        ``ptr`` itself.

    Raises:
        LlamaError: ``ptr`` is NULL (the ``error`` subclass given).
    """
    from ._lib import ffi

    if ptr == ffi.NULL:
        raise error(f"{func}() returned NULL{(' ' + what) if what else ''}", func=func, reason=reason)
    return ptr


_DECODE_ERRORS = {1: KVCacheFullError, 2: DecodeAborted, -1: InvalidBatchError}
_DECODE_TEXT = {
    1: "no KV cache slot for the batch (KV cache full)",
    2: "aborted by the abort callback",
    -1: "invalid batch",
}


def check_decode(rc: int, func: str = "llama_decode", *, reason: str | None = None) -> int:
    """Map ``llama_decode``/``llama_encode`` return codes to exceptions; return 0 otherwise.

    Args:
        rc: The return code.
        func: The C function's name, for the message.
        reason: The line llama.cpp logged during the call, if any.

    Returns:
        0 (when ``rc`` is 0).

    Raises:
        KVCacheFullError: ``rc`` is 1 (no KV cache slot for the batch).
        DecodeAborted: ``rc`` is 2 (the abort callback stopped it).
        InvalidBatchError: ``rc`` is -1.
        DecodeError: Any other nonzero ``rc`` (negative: an error; positive: a warning code).
    """
    if rc == 0:
        return 0
    if rc in _DECODE_ERRORS:
        raise _DECODE_ERRORS[rc](f"{func}() returned {rc}, {_DECODE_TEXT[rc]}", func=func, code=rc, reason=reason)
    if rc < 0:
        raise DecodeError(f"{func}() returned {rc}", func=func, code=rc, reason=reason)
    # Positive codes other than 1 and 2 are warnings in llama.h; keep them visible.
    raise DecodeError(f"{func}() returned {rc} (a warning code)", func=func, code=rc, reason=reason)
