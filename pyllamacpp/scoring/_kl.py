"""``kl_divergence``: ``llama-perplexity --kl-divergence --kl-divergence-base FILE``, this run's
rows against the stored ones, chunk by chunk."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .._cpu import default_n_threads
from .._lib import lib
from ..packing import model_and_context, release
from ._base_logits import BaseLogits
from ._kl_stats import KLDivergence, _kl_result, _KLSums
from ._perplexity import _check_vocab_flags, _chunk_batches, _chunk_plan
from ._rows import _row_loop, _rows, _targets

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model


def _kl_rows(logits, base_rows, targets, outs, n_threads: int) -> None:
    """Each row against its stored base row (``pyl_kl_rows``): nll, base nll, KL divergence, Δp, same top."""
    a = _rows(logits)
    t = _targets(targets, *a.shape)
    b = np.ascontiguousarray(base_rows)
    if b.ndim != 2 or b.shape[0] != a.shape[0]:  # C reads one base row per logits row
        raise ValueError(f"{a.shape[0]} logits rows but base rows of shape {b.shape}")
    nll, nll_base, kld, p_diff, same = outs
    per_row = ("float *", nll), ("float *", nll_base), ("double *", kld), ("float *", p_diff), ("int8_t *", same)
    _row_loop(lib.pyl_kl_rows, a, n_threads, ("uint16_t *", b), b.shape[1], ("int32_t *", t), *per_row)


def kl_divergence(
    model_or_ctx: Model | Context,
    base: BaseLogits | str | os.PathLike,
    n_batch: int = 2048,
    *,
    n_chunks: int = -1,
    on_chunk: Callable[[int, int, dict[str, float]], None] | None = None,
    **ctx_kwargs: Any,
) -> KLDivergence:
    """KL divergence of this run against stored base logits, as ``llama-perplexity
    --kl-divergence --kl-divergence-base FILE`` computes it.

    The chunks, tokens and ``n_ctx`` come from the base file; they are decoded as in
    :func:`perplexity` (BOS substituted, ``max(1, n_batch // n_ctx)`` chunks per batch) and each
    scored position is compared with the stored row (``kl_divergence()`` and its ``log_softmax``
    in perplexity.cpp): see :class:`KLDivergence` for the definitions. The base can come from
    another model with the same vocabulary, another cache type, or a context you edited (pass it).

    Args:
        model_or_ctx: A :class:`Model` (a context is made and closed) or a :class:`Context` (its
            ``n_batch`` is used; its memory is cleared before each group of chunks and when the
            run ends or is stopped, and it is left open).
        base: A :class:`BaseLogits`, or the path of a base-logits file (``perplexity(...,
            save_base=path)``, or ``llama-perplexity --kl-divergence-base path``).
        n_batch: Tokens per decode (``-b``).
        n_chunks: Most chunks (-1: all of the file's).
        on_chunk: Called after each chunk with ``(i, n_chunk, the running table row)``.
        **ctx_kwargs: Fields of :class:`ContextParams` for the context made.

    Returns:
        A :class:`KLDivergence`; ``report()`` gives llama-perplexity's table and statistics.

    Raises:
        ValueError: A vocabulary size other than the file's, a bad file, a Context too small, a
            model that adds EOS, keywords with a Context.
        TypeError: ``model_or_ctx`` is neither a Model nor a Context.
        OSError: The file cannot be read.
        DecodeError: A decode failed.
        ClosedError: The model or context is closed.
    """
    from ..batch import Batch

    model, ctx = model_and_context(model_or_ctx)
    b = base if isinstance(base, BaseLogits) else BaseLogits(base)
    if b.n_vocab != model.n_vocab:
        raise ValueError(f"inconsistent vocabulary: the base file has {b.n_vocab} tokens, the model {model.n_vocab}")
    add_bos = _check_vocab_flags(model)
    n_ctx = b.n_ctx
    kw, n_seq, n_batch = _chunk_plan(model, ctx, n_ctx, int(n_batch), ctx_kwargs)
    n_chunk = b.n_chunk if n_chunks < 0 else min(int(n_chunks), b.n_chunk)
    first, n_scored = n_ctx // 2, b.n_scored
    tokens = np.asarray(b.tokens)
    count = n_chunk * n_scored
    nll, nll_base, p_diff = (np.empty(count, np.float32) for _ in range(3))
    kld = np.empty(count, np.float64)
    same = np.empty(count, np.int8)
    own = ctx is None
    if ctx is None:
        ctx = model.context(**kw)
    try:
        n_threads = ctx.params.n_threads_batch or default_n_threads()
        batch = Batch(n_batch, 1, model=model)
        sums, chunks = _KLSums(), []
        t0 = time.perf_counter()
        for i in range(0, n_chunk, n_seq):
            n_seq_batch = min(n_seq, n_chunk - i)
            for r0, n_out, seq, p0 in _chunk_batches(
                ctx, batch, tokens, add_bos, model.bos, i, n_seq_batch, n_ctx, n_batch, first
            ):
                m = min(n_out, n_ctx - 1 - p0)
                if m <= 0:
                    continue
                c0 = (i + seq) * n_ctx
                k0 = p0 - first
                o = (i + seq) * n_scored + k0
                sl = slice(o, o + m)
                logits = ctx.logits_all()[r0 : r0 + m]
                _kl_rows(
                    logits,
                    b.rows[i + seq, k0 : k0 + m],
                    tokens[c0 + p0 + 1 : c0 + p0 + 1 + m],
                    (nll[sl], nll_base[sl], kld[sl], p_diff[sl], same[sl]),
                    n_threads,
                )
                del logits
            for seq in range(n_seq_batch):
                sl = slice((i + seq) * n_scored, (i + seq + 1) * n_scored)
                sums.add(nll[sl], nll_base[sl], kld[sl], p_diff[sl], same[sl])
                chunks.append(sums.chunk_row())
                if on_chunk is not None:
                    on_chunk(i + seq, n_chunk, chunks[-1])
        seconds = time.perf_counter() - t0
    finally:
        release(ctx, own)
    return _kl_result(n_ctx, n_chunk, sums, chunks, kld, p_diff, same, seconds)
