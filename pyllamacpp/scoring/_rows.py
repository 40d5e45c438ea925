"""The C row loops (``build_support/score.h``) over threads, and :func:`log_softmax`: per row of
float logits, read in place, the log-sum-exp, a target's log-probability, the argmax and the top-k."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .._cpu import default_n_threads
from .._lib import ffi, lib

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _run_rows(n_rows: int, n_threads: int, fn: Callable[[int, int], None]) -> None:
    """``fn(r0, r1)`` over ``[0, n_rows)`` in up to ``n_threads`` slices, one per thread (cffi
    releases the GIL during the C call, so the slices run at once)."""
    global _pool
    k = max(1, min(n_threads, n_rows // 16))  # a few rows are not worth a thread
    if k == 1:
        fn(0, n_rows)
        return
    with _pool_lock:
        if _pool is None or _pool._max_workers < k - 1:
            _pool = ThreadPoolExecutor(max_workers=k - 1, thread_name_prefix="pyllamacpp-score")
        pool = _pool
    bounds = [n_rows * i // k for i in range(k + 1)]
    futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, k)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()


def _rows(logits: npt.ArrayLike, what: str = "logits") -> np.ndarray:
    """A 2-D float32 array whose rows are contiguous (a view when ``logits`` already is one)."""
    a = np.asarray(logits)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"{what}: expected a (n_vocab,) or (n_rows, n_vocab) array, got shape {a.shape}")
    if a.shape[1] == 0:
        raise ValueError(f"{what}: rows of 0 values")
    if a.dtype != np.float32 or a.strides[1] != 4 or a.strides[0] < 4 * a.shape[1] or a.strides[0] % 4:
        a = np.ascontiguousarray(a, dtype=np.float32)  # other layouts: one copy
    return a


def _ptr(ctype: str, a: np.ndarray | None) -> Any:
    return ffi.NULL if a is None else ffi.cast(ctype, a.ctypes.data)


def _targets(targets: npt.ArrayLike, n_rows: int, n_vocab: int) -> np.ndarray:
    t = np.ascontiguousarray(targets, dtype=np.int32).reshape(-1)
    if t.size != n_rows:
        raise ValueError(f"targets: {t.size} tokens for {n_rows} rows of logits")
    if t.size and (int(t.min()) < 0 or int(t.max()) >= n_vocab):
        i = int(np.flatnonzero((t < 0) | (t >= n_vocab))[0])
        raise ValueError(f"targets[{i}] is {int(t[i])}, outside the vocabulary [0, {n_vocab})")
    return t


def _row_loop(c_rows: Any, a: np.ndarray, n_threads: int, *args: Any) -> None:
    """``c_rows(rows, n_rows, row stride, n_vocab, *args)`` (a ``pyl_*_rows`` of score.h) over the
    rows of ``a`` (from :func:`_rows`) in slices, one per thread: an ``args`` entry ``(ctype,
    array or None)`` passes that array's rows of the slice (a per-row input or output, or NULL),
    any other entry is passed as it is."""
    n_vocab, stride = a.shape[1], a.strides[0] // 4

    def rows(r0: int, r1: int) -> None:
        sliced = (_ptr(x[0], None if x[1] is None else x[1][r0:r1]) if isinstance(x, tuple) else x for x in args)
        c_rows(_ptr("float *", a[r0:r1]), r1 - r0, stride, n_vocab, *sliced)

    _run_rows(a.shape[0], n_threads, rows)


@dataclass(frozen=True)
class LogSoftmax:
    """What :func:`log_softmax` computed, one entry per row.

    Attributes:
        lse: float64 ``(n,)``: ``max + log(sum(exp(x - max)))``; token ``v``'s log-probability in
            row ``i`` is ``logits[i, v] - lse[i]``.
        target: float64 ``(n,)``: the target's log-probability (None without targets).
        argmax: int32 ``(n,)``: the first index of each row's largest logit (None unless asked).
        top_ids: int32 ``(n, k)``: the ``top_k`` most likely tokens, most likely first, equal logits
            in index order (None without ``top_k``).
        top_logprobs: float64 ``(n, k)``: their log-probabilities.
    """

    lse: np.ndarray
    target: np.ndarray | None = None
    argmax: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


def log_softmax(
    logits: npt.ArrayLike,
    targets: npt.ArrayLike | None = None,
    *,
    top_k: int = 0,
    argmax: bool = False,
    n_threads: int | None = None,
) -> LogSoftmax:
    """Log-softmax statistics of each row of ``logits``, in C, without a copy of the rows.

    Per row, as llama-perplexity's ``log_softmax``: the max, then ``sum(exp(x - max))`` with the
    exponentials in float (8 lanes at a time where the CPU has AVX2) accumulated in double, so
    ``log p(t) = (x[t] - max) - log(sum)``. The rows of a ``ctx.logits_all()`` view, or any float32
    array whose rows are contiguous, are read where they are; another dtype or layout is copied
    once to float32.

    For the outputs of the last decode: ``log_softmax(ctx.logits_all(), next_tokens)``.

    Args:
        logits: ``(n_vocab,)`` or ``(n_rows, n_vocab)`` logits.
        targets: One token per row whose log-probability to return (None: none).
        top_k: Also return the ``top_k`` most likely tokens of each row and their log-probabilities.
        argmax: Also return each row's first argmax.
        n_threads: Threads over the rows (None: the physical cores).

    Returns:
        A :class:`LogSoftmax` (float64 log-probabilities).

    Raises:
        ValueError: A shape that is not 1-D or 2-D, targets of the wrong length or outside the
            vocabulary, ``top_k`` outside ``[0, n_vocab]``.
    """
    a = _rows(logits)
    n, n_vocab = a.shape
    k = int(top_k)
    if not 0 <= k <= n_vocab:
        raise ValueError(f"top_k must be in [0, n_vocab={n_vocab}], not {top_k}")
    t = _targets(targets, n, n_vocab) if targets is not None else None
    lse = np.empty(n, np.float64)
    lp = np.empty(n, np.float64) if t is not None else None
    am = np.empty(n, np.int32) if argmax else None
    ids = np.empty((n, k), np.int32) if k else None
    vals = np.empty((n, k), np.float32) if k else None
    if n:
        threads = default_n_threads() if n_threads is None else int(n_threads)
        per_row = ("int32_t *", t), ("double *", lse), ("double *", lp), ("int32_t *", am)
        _row_loop(lib.pyl_score_rows, a, threads, *per_row, k, ("int32_t *", ids), ("float *", vals))
    top = vals.astype(np.float64) - lse[:, None] if vals is not None else None
    return LogSoftmax(lse, lp, am, ids, top)
