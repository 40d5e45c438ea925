"""``perplexity``: ``llama-perplexity -f FILE -c N -b B`` (tools/perplexity/perplexity.cpp): its
chunks, its batches, its running estimate, and the ``--kl-divergence-base`` file it writes."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._cpu import default_n_threads
from .._lib import lib
from ..packing import Segment, decode, model_and_context, release
from ._base_logits import MAGIC, _nv
from ._inputs import _tokens_of
from ._rows import _row_loop, _rows, _targets, log_softmax

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model


@dataclass
class PerplexityResult:
    """What :func:`perplexity` computed, as llama-perplexity prints it.

    Attributes:
        n_ctx: Tokens per chunk (``-c``).
        n_batch: Tokens per decode (``-b``, at most ``n_seq * n_ctx``).
        n_seq: Chunks decoded together (``max(1, n_batch // n_ctx)``).
        n_chunk: Chunks scored.
        n_tokens: Tokens of the whole text.
        add_bos: Whether each chunk's first token was replaced by BOS.
        chunks: The running estimate after each chunk: ``[i]value`` in llama-perplexity's output.
        ppl: The final estimate.
        ppl_err: Its uncertainty (nan when the variance came out negative).
        nll: float64 ``(n_chunk, n_ctx - 1 - n_ctx // 2)``: each scored token's negative
            log-likelihood.
        seconds: Wall time.
    """

    n_ctx: int
    n_batch: int
    n_seq: int
    n_chunk: int
    n_tokens: int
    add_bos: bool
    chunks: list[float]
    ppl: float
    ppl_err: float
    nll: np.ndarray
    seconds: float = 0.0

    def report(self) -> str:
        """llama-perplexity's lines: ``[1]x,[2]y,...`` then ``Final estimate: PPL = x +/- y``.

        Returns:
            The two lines, ``%.4f`` per chunk, ``%.4f +/- %.5f`` for the estimate.
        """
        line = "".join(f"[{i + 1}]{v:.4f}," for i, v in enumerate(self.chunks))
        return f"{line}\nFinal estimate: PPL = {self.ppl:.4f} +/- {self.ppl_err:.5f}"

    def __repr__(self) -> str:
        return f"<PerplexityResult {self.n_chunk} chunks of {self.n_ctx}: PPL = {self.ppl:.4f} +/- {self.ppl_err:.5f}>"


def _chunk_plan(model: Model, ctx: Context | None, n_ctx: int, n_batch: int, ctx_kwargs: dict) -> tuple[dict, int, int]:
    """``(context keywords, n_seq, n_batch)`` as llama-perplexity's main() sets them: ``n_parallel
    = max(1, n_batch / n_ctx)`` sequences, a context of ``n_parallel * n_ctx`` cells, ``n_batch``
    at most that."""
    if n_ctx < 2:
        raise ValueError(f"n_ctx must be at least 2, not {n_ctx}")
    if ctx is not None:
        if ctx_kwargs:
            raise ValueError("context keywords are for a Model; this Context has its own")
        n_batch = ctx.n_batch
        n_seq = max(1, n_batch // n_ctx)
        if n_seq > ctx.n_seq_max or ctx.n_ctx_seq < n_ctx:
            raise ValueError(
                f"this Context (n_ctx_seq {ctx.n_ctx_seq}, n_seq_max {ctx.n_seq_max}, n_batch {n_batch}) cannot hold "
                f"{n_seq} chunk(s) of {n_ctx} tokens at once: llama-perplexity would make n_seq_max {n_seq}, "
                f"n_ctx {n_seq * n_ctx}"
            )
        return {}, n_seq, n_batch
    n_seq = max(1, n_batch // n_ctx)
    n_batch = min(n_batch, n_seq * n_ctx)
    kw: dict[str, Any] = {"n_ctx": n_seq * n_ctx, "n_batch": n_batch, "n_seq_max": n_seq}
    kw.update(ctx_kwargs)
    return kw, n_seq, n_batch


def _check_vocab_flags(model: Model) -> bool:
    vocab = model._vocab_ptr()
    if lib.llama_vocab_get_add_eos(vocab):  # GGML_ASSERT(!llama_vocab_get_add_eos(vocab)) there
        raise ValueError("the model adds EOS when tokenizing: llama-perplexity refuses such a model too")
    return bool(lib.llama_vocab_get_add_bos(vocab))


def _chunk_batches(ctx, batch, tokens, add_bos, bos, i, n_seq_batch, n_ctx, n_batch, first):
    """Decode chunks ``i .. i + n_seq_batch - 1`` as llama-perplexity does: one segment per chunk,
    sequence ``seq`` for chunk ``i + seq``, logits at ``pos >= first``, packed in order into batches
    of ``n_batch`` slots (a chunk longer than that is cut every ``n_batch`` positions; else whole
    chunks, one after the other, share a batch); yield, after each decode, ``(r0, n_out, seq, p0)``:
    the first output row and the rows of sequence ``seq`` and the position of its first."""
    ctx.memory.clear()
    need = np.arange(n_ctx) >= first
    chunks = []
    for seq in range(n_seq_batch):
        s0 = (i + seq) * n_ctx
        toks = tokens[s0 : s0 + n_ctx]
        if add_bos:
            toks = toks.copy()
            toks[0] = bos
        chunks.append(Segment(toks, seq, 0, need))
    for order in decode(ctx, chunks, batch=batch, n_batch=n_batch):
        for piece in order.pieces:
            if piece.n_outputs:  # a chunk starts at position 0: its offsets are positions
                yield piece.rows.start, piece.n_outputs, piece.segment, int(piece.at[0])


def perplexity(
    model_or_ctx: Model | Context,
    text: str | bytes | npt.ArrayLike,
    n_ctx: int = 512,
    n_batch: int = 2048,
    *,
    n_chunks: int = -1,
    save_base: str | os.PathLike | None = None,
    on_chunk: Callable[[int, int, float], None] | None = None,
    **ctx_kwargs: Any,
) -> PerplexityResult:
    """Perplexity as ``llama-perplexity -f FILE -c n_ctx -b n_batch`` computes it.

    As ``perplexity()`` in tools/perplexity/perplexity.cpp: the text is tokenized with BOS where
    the model adds one (``add_special``, not ``parse_special``) and cut into ``len // n_ctx``
    chunks (at most ``n_chunks``); ``n_seq = max(1, n_batch // n_ctx)`` chunks are decoded
    together, one sequence each, in batches of ``n_batch`` positions, with the memory cleared
    before each group; a chunk's first token is replaced by BOS when the model adds one; logits
    are asked at positions ``>= n_ctx // 2`` and the tokens after position ``n_ctx // 2`` are
    scored (``n_ctx - 1 - n_ctx // 2`` per chunk). After chunk ``i`` the running estimate is
    ``exp(sum(nll) / count)``; the final uncertainty is ``ppl * sqrt((mean(nll^2) - mean(nll)^2) /
    (count - 1))``. With a Model, the context is what llama-perplexity makes: ``n_ctx = n_seq *
    n_ctx``, ``n_seq_max = n_seq``, one KV stream per sequence.

    Note that ``-f FILE`` drops one trailing newline of the file: the CLI does it too, this
    function takes the text as it is.

    Args:
        model_or_ctx: A :class:`Model` (a context is made and closed) or a :class:`Context` whose
            ``n_batch`` plays the part of ``-b`` (it must hold ``n_batch // n_ctx`` sequences of
            ``n_ctx``; its whole memory is cleared before each group of chunks and when the run
            ends or is stopped, and it is left open).
        text: A str or bytes, or token ids (then used as they are).
        n_ctx: Tokens per chunk (``-c``).
        n_batch: Tokens per decode (``-b``); a multiple of ``n_ctx`` or less than it.
        n_chunks: Most chunks (``--chunks``; -1: all).
        save_base: Write llama-perplexity's ``--kl-divergence-base`` file here (then each token's
            nll is taken from the quantizing loop, in float, as there).
        on_chunk: Called after each chunk with ``(i, n_chunk, running estimate)``.
        **ctx_kwargs: Fields of :class:`ContextParams` for the context made (``n_ubatch``,
            ``type_k``, ``type_v``, ``flash_attn``, ``n_threads``...).

    Returns:
        A :class:`PerplexityResult`; ``report()`` gives llama-perplexity's lines.

    Raises:
        ValueError: Fewer than ``2 * n_ctx`` tokens, ``n_batch`` neither under ``n_ctx`` nor a
            multiple of it, a model that adds EOS, a Context too small, keywords with a Context.
        TypeError: ``model_or_ctx`` is neither a Model nor a Context.
        OSError: ``save_base`` cannot be written.
        DecodeError: A decode failed.
        ClosedError: The model or context is closed.
    """
    from ..batch import Batch

    model, ctx = model_and_context(model_or_ctx)
    n_ctx, n_batch = int(n_ctx), int(n_batch)
    if ctx is None and not (n_batch < n_ctx or n_batch % n_ctx == 0):
        raise ValueError(f"n_batch {n_batch} must be less than n_ctx {n_ctx} or a multiple of it (as llama-perplexity)")
    add_bos = _check_vocab_flags(model)
    tokens = _tokens_of(model, text, True, False)
    if tokens.size < 2 * n_ctx:
        raise ValueError(
            f"you need at least {2 * n_ctx} tokens to evaluate perplexity with a context of {n_ctx}; "
            f"the text tokenizes to only {tokens.size} tokens"
        )
    kw, n_seq, n_batch = _chunk_plan(model, ctx, n_ctx, n_batch, ctx_kwargs)
    n_chunk_max = tokens.size // n_ctx
    n_chunk = n_chunk_max if n_chunks < 0 else min(int(n_chunks), n_chunk_max)
    first = n_ctx // 2
    n_scored = n_ctx - 1 - first
    n_vocab, bos = model.n_vocab, model.bos
    own = ctx is None
    if ctx is None:
        ctx = model.context(**kw)
    out = None
    try:
        if save_base is not None:
            out = open(save_base, "wb")  # noqa: SIM115 (closed in finally)
            out.write(MAGIC + np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes())
            out.write(tokens[: n_chunk * n_ctx].astype(np.int32).tobytes())
        nv = _nv(n_vocab)
        nll = np.empty((n_chunk, n_scored), np.float64)
        # the base rows of the chunks decoded together, written in chunk order once they are done
        rows_buf = np.empty((n_seq, n_scored, nv), np.uint16) if out is not None else None
        nll32 = np.empty((n_seq, n_scored), np.float32)
        n_threads = ctx.params.n_threads_batch or default_n_threads()
        batch = Batch(n_batch, 1, model=model)
        chunks: list[float] = []
        s1 = s2 = 0.0
        count = 0
        t0 = time.perf_counter()
        for i in range(0, n_chunk, n_seq):
            n_seq_batch = min(n_seq, n_chunk - i)
            for r0, n_out, seq, p0 in _chunk_batches(
                ctx, batch, tokens, add_bos, bos, i, n_seq_batch, n_ctx, n_batch, first
            ):
                # rows for positions p0.. of chunk i + seq; position p predicts token p + 1
                m = min(n_out, n_ctx - 1 - p0)  # the row at n_ctx - 1 predicts nothing
                if m <= 0:
                    continue
                c0 = (i + seq) * n_ctx
                tgt = tokens[c0 + p0 + 1 : c0 + p0 + 1 + m]
                k0 = p0 - first
                logits = ctx.logits_all()[r0 : r0 + m]
                if rows_buf is not None:
                    _base_rows(logits, tgt, rows_buf[seq, k0 : k0 + m], nll32[seq, k0 : k0 + m], n_threads)
                    nll[i + seq, k0 : k0 + m] = nll32[seq, k0 : k0 + m]
                else:
                    lp = log_softmax(logits, tgt, n_threads=n_threads).target
                    assert lp is not None
                    nll[i + seq, k0 : k0 + m] = -lp
                del logits
            for seq in range(n_seq_batch):
                if out is not None and rows_buf is not None:
                    out.write(rows_buf[seq].tobytes())
                v = nll[i + seq]
                s1 += float(v.sum())
                s2 += float(np.dot(v, v))
                count += n_scored
                chunks.append(math.exp(s1 / count))
                if on_chunk is not None:
                    on_chunk(i + seq, n_chunk, chunks[-1])
        mean, mean2 = s1 / count, s2 / count
        ppl = math.exp(mean)
        var = mean2 - mean * mean
        err = math.sqrt(var / (count - 1)) * ppl if var > 0 else math.nan
        return PerplexityResult(
            n_ctx, n_batch, n_seq, n_chunk, int(tokens.size), add_bos, chunks, ppl, err, nll, time.perf_counter() - t0
        )
    finally:
        if out is not None:
            out.close()
        release(ctx, own)


def _base_rows(logits: np.ndarray, targets: np.ndarray, out: np.ndarray, nll: np.ndarray, n_threads: int) -> None:
    """Each row's base-logits record into ``out`` (``pyl_base_rows``) and the target's nll, in float."""
    a = _rows(logits)
    t = _targets(targets, *a.shape)
    _row_loop(lib.pyl_base_rows, a, n_threads, ("int32_t *", t), ("uint16_t *", out), out.shape[1], ("float *", nll))
