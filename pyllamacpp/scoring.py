"""Scoring: log-probabilities of a text, perplexity and KL divergence as ``llama-perplexity``
computes them (``tools/perplexity/perplexity.cpp``).

- :func:`log_softmax`: per row of float logits (a view of ``ctx.logits_all()`` is read in place),
  the log-sum-exp, the log-probability of a target token, the argmax and the top-k; the row loop
  is C (``build_support/score.h``): max, then the sum of ``exp(x - max)`` accumulated in double.
- :func:`score` (``Model.score``): the log-probability of every token of a text given the tokens
  before it, from one pass with logits at the rows that predict a token; a text longer than the
  context goes in windows that re-feed the end of the previous one as context.
- :func:`perplexity`: ``llama-perplexity -f FILE -c N -b B``: chunks of ``n_ctx`` tokens, the
  first token of each chunk replaced by BOS when the model adds one, only the second half of each
  chunk scored, several chunks per batch when ``n_batch`` is a multiple of ``n_ctx``; the running
  estimate after each chunk and the final ``PPL = x +/- y``. ``save_base=`` writes the
  ``--kl-divergence-base`` file, byte for byte in llama-perplexity's format.
- :func:`kl_divergence`: ``llama-perplexity --kl-divergence``: against such a file (yours or
  llama-perplexity's), mean KL divergence and its percentiles, top-1 agreement, Δp, PPL ratios.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import numpy.typing as npt

from ._cpu import default_n_threads
from ._lib import ffi, lib

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

__all__ = [
    "LogSoftmax",
    "log_softmax",
    "Scores",
    "score",
    "PerplexityResult",
    "perplexity",
    "BaseLogits",
    "KLDivergence",
    "kl_divergence",
    "CompletionLogprobs",
    "sample_text",
    "sample_text_path",
]

MAGIC = b"_logits_"
"""The first 8 bytes of llama-perplexity's base-logits file."""

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
"""The KL divergence percentiles llama-perplexity prints (besides max, median and min)."""
P_DIFF_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)
"""The Δp percentiles llama-perplexity prints (besides max, median and min)."""


def sample_text_path() -> Path:
    """The public-domain text shipped with the package (``pyllamacpp/data/shakespeare.txt``).

    The opening of Shakespeare's *Coriolanus* (24 KB, 7,310 tokens with the default model), from
    char-rnn's tinyshakespeare; its source is in ``pyllamacpp/data/README.md``.

    Returns:
        The file's path.
    """
    return Path(__file__).with_name("data") / "shakespeare.txt"


def sample_text() -> str:
    """The text of :func:`sample_text_path`.

    Returns:
        The text (UTF-8).
    """
    return sample_text_path().read_text(encoding="utf-8")


# -- the C row loops, over threads -------------------------------------------------------------
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
    stride = a.strides[0] // 4

    def rows(r0: int, r1: int) -> None:
        lib.pyl_score_rows(
            _ptr("float *", a[r0:r1]),
            r1 - r0,
            stride,
            n_vocab,
            _ptr("int32_t *", t[r0:r1] if t is not None else None),
            _ptr("double *", lse[r0:r1]),
            _ptr("double *", lp[r0:r1] if lp is not None else None),
            _ptr("int32_t *", am[r0:r1] if am is not None else None),
            k,
            _ptr("int32_t *", ids[r0:r1] if ids is not None else None),
            _ptr("float *", vals[r0:r1] if vals is not None else None),
        )

    if n:
        _run_rows(n, default_n_threads() if n_threads is None else int(n_threads), rows)
    top = vals.astype(np.float64) - lse[:, None] if vals is not None else None
    return LogSoftmax(lse, lp, am, ids, top)


# -- score: every token of a text --------------------------------------------------------------
@dataclass
class Scores:
    """The log-probability of each token of a text given the tokens before it (:func:`score`).

    ``logprobs[i]`` is ``log p(tokens[i + 1] | tokens[w:i + 1])``, where ``w`` is where the window
    that scored it starts (0 for a text that fits the context). The first token has none.

    Attributes:
        tokens: int32 ``(n,)``: the text's tokens (BOS first when the model adds one).
        logprobs: float64 ``(n - 1,)``: the log-probability of ``tokens[1:]``.
        top_ids: int32 ``(n - 1, k)``: the ``top_k`` most likely tokens at each position (None
            without ``top_k``).
        top_logprobs: float64 ``(n - 1, k)``: their log-probabilities.
        n_ctx: The window: the most tokens one pass sees.
        windows: ``(start, first_target)`` per window: the index of the first token it feeds
            (after a BOS it puts first, when the text starts with one) and of the first it scores.
        seconds: Wall time of the decodes and the scoring.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray | None
    top_logprobs: np.ndarray | None
    n_ctx: int
    windows: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def targets(self) -> np.ndarray:
        """The scored tokens, ``tokens[1:]``."""
        return self.tokens[1:]

    @property
    def nll(self) -> float:
        """The negative log-likelihood of the scored tokens, summed (nats)."""
        return float(-self.logprobs.sum())

    @property
    def perplexity(self) -> float:
        """``exp(nll / number of scored tokens)`` (nan when nothing was scored)."""
        n = self.logprobs.size
        return math.exp(self.nll / n) if n else math.nan

    def __repr__(self) -> str:
        return (
            f"<Scores {self.tokens.size} tokens, {len(self.windows)} window(s) of n_ctx {self.n_ctx}, "
            f"nll {self.nll:.4f}, perplexity {self.perplexity:.4f}>"
        )


def _tokens_of(model: Model, text: str | bytes | npt.ArrayLike, add_special: bool, parse_special: bool) -> np.ndarray:
    if isinstance(text, (str, bytes)):
        return model.tokenize(text, add_special, parse_special)
    t = np.ascontiguousarray(text, dtype=np.int32).reshape(-1)
    if t.size and (int(t.min()) < 0 or int(t.max()) >= model.n_vocab):
        raise ValueError(f"tokens outside the vocabulary [0, {model.n_vocab})")
    return t


def _split(model_or_ctx: Model | Context) -> tuple[Model, Context | None]:
    from .context import Context
    from .model import Model

    if isinstance(model_or_ctx, Context):
        return model_or_ctx.model, model_or_ctx
    if isinstance(model_or_ctx, Model):
        return model_or_ctx, None
    raise TypeError(f"expected a Model or a Context, not {type(model_or_ctx).__name__}")


def score(
    model_or_ctx: Model | Context,
    text: str | bytes | npt.ArrayLike,
    *,
    n_ctx: int | None = None,
    n_batch: int | None = None,
    top_k: int = 0,
    keep: int | None = None,
    add_special: bool = True,
    parse_special: bool = False,
    seq_id: int = 0,
    **ctx_kwargs: Any,
) -> Scores:
    """The log-probability of every token of ``text`` given the ones before it.

    One ``llama_decode`` pass per ``n_batch`` tokens, logits only at the rows that predict a token
    (not at the last token), each batch's rows scored in place with :func:`log_softmax`. A text
    longer than the window goes in windows of ``n_ctx`` tokens: each one after the first starts
    with the last ``keep`` tokens already scored (context only) and, when the text starts with
    BOS, a BOS before them; so every token is predicted from at least ``keep`` tokens before it,
    or all of them.

    Args:
        model_or_ctx: A :class:`Model` (a context is made for the call and closed after) or a
            :class:`Context` (sequence ``seq_id`` is cleared before each window and holds the last
            one afterwards; the window is its ``n_ctx_seq``).
        text: A str or bytes (tokenized with ``llama_tokenize``), or token ids.
        n_ctx: The window (with a Model; default: the text's length, at most
            ``min(n_ctx_train, 4096)``).
        n_batch: Tokens per decode (with a Model; default ``min(n_ctx, 512)``): llama.cpp's output
            buffer holds ``n_batch x n_vocab`` floats.
        top_k: Also keep the ``top_k`` most likely tokens at each position.
        keep: Tokens of context re-fed at the start of each window after the first (default
            half the window).
        add_special: ``llama_tokenize``'s ``add_special`` (BOS where the model wants one).
        parse_special: ``llama_tokenize``'s ``parse_special``.
        seq_id: The sequence used in a given Context.
        **ctx_kwargs: Fields of :class:`ContextParams` for the context made (``type_k``,
            ``flash_attn``, ``n_threads``...).

    Returns:
        A :class:`Scores`.

    Raises:
        ValueError: Fewer than 2 tokens, tokens outside the vocabulary, a window under 2 tokens,
            ``keep`` too large for the window, context keywords with a Context.
        TypeError: ``model_or_ctx`` is neither a Model nor a Context.
        DecodeError: A decode failed (``KVCacheFullError``...).
        ClosedError: The model or context is closed.
    """
    from .params import default_n_ctx

    model, ctx = _split(model_or_ctx)
    tokens = _tokens_of(model, text, add_special, parse_special)
    n = int(tokens.size)
    if n < 2:
        raise ValueError(f"score: {n} token(s); at least 2 are needed (the first is context only)")
    own = ctx is None
    if ctx is not None:
        if n_ctx is not None or n_batch is not None or ctx_kwargs:
            raise ValueError("score: n_ctx, n_batch and context keywords are for a Model; this Context has its own")
        w = ctx.n_ctx_seq
    else:
        # the window asked for, not the context's n_ctx (llama.cpp pads that to a multiple of 256)
        w = min(n, default_n_ctx(model.n_ctx_train)) if n_ctx is None else int(n_ctx)
        kw: dict[str, Any] = {"n_ctx": w, "n_batch": min(w, 512) if n_batch is None else int(n_batch)}
        kw["n_ubatch"] = min(kw["n_batch"], 512)
        kw.update(ctx_kwargs)
        ctx = model.context(**kw)
    try:
        return _score(ctx, tokens, w, int(top_k), keep, seq_id)
    finally:
        if own:
            ctx.close()


def _score(ctx: Context, tokens: np.ndarray, W: int, top_k: int, keep: int | None, seq_id: int) -> Scores:
    from .batch import Batch

    model = ctx.model
    n, n_batch = int(tokens.size), ctx.n_batch
    if W < 2:
        raise ValueError(f"score: a window of {W} token(s) scores nothing")
    bos = model.bos
    lead = [bos] if bos >= 0 and tokens[0] == bos else []  # later windows start with BOS too
    keep = W // 2 if keep is None else int(keep)
    if not 0 <= keep <= W - len(lead) - 2:
        raise ValueError(f"keep={keep}: must be in [0, {W - len(lead) - 2}] for a window of {W}")
    k = int(top_k)
    if not 0 <= k <= model.n_vocab:
        raise ValueError(f"top_k must be in [0, n_vocab={model.n_vocab}], not {top_k}")
    logprobs = np.empty(n - 1, np.float64)
    top_ids = np.empty((n - 1, k), np.int32) if k else None
    top_lp = np.empty((n - 1, k), np.float64) if k else None
    n_threads = ctx.params.n_threads_batch or default_n_threads()
    batch = Batch(n_batch, 1, model=model)
    windows: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    target = 1  # the next token to score
    while target < n:
        start = 0 if target == 1 else target - keep  # first text token this window feeds
        pre = lead if start > 0 else []
        end = min(n, start + W - len(pre))  # one past the last token fed
        feed = np.concatenate([np.asarray(pre, np.int32), tokens[start:end]]) if pre else tokens[start:end]
        # fed index j predicts text token start - len(pre) + j + 1: rows for targets target..end-1
        first_row = target - 1 - start + len(pre)
        windows.append((start, target))
        ctx.memory.seq_rm(seq_id)
        for b0 in range(0, feed.size, n_batch):
            chunk = feed[b0 : b0 + n_batch]
            j = np.arange(b0, b0 + chunk.size)
            mask = (j >= first_row) & (j < feed.size - 1)
            batch.clear()
            batch.add_sequence(chunk, seq_id, b0, logits=mask)
            ctx.decode(batch)
            if not mask.any():
                continue
            js = j[mask]
            tgt_idx = start - len(pre) + js + 1  # text indices of the targets
            _score_outputs(ctx, tokens[tgt_idx], tgt_idx - 1, logprobs, top_ids, top_lp, k, n_threads)
        target = end
    return Scores(tokens, logprobs, top_ids, top_lp, W, windows, time.perf_counter() - t0)


def _score_outputs(ctx, targets, where, logprobs, top_ids, top_lp, k, n_threads) -> None:
    out = log_softmax(ctx.logits_all(), targets, top_k=k, n_threads=n_threads)  # the view dies here
    assert out.target is not None
    logprobs[where] = out.target
    if k:
        top_ids[where] = out.top_ids
        top_lp[where] = out.top_logprobs


# -- llama-perplexity ----------------------------------------------------------------------------
def _nv(n_vocab: int) -> int:
    """uint16 values per row of the base-logits file: 4 (two floats) + n_vocab rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


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
    """Decode chunks ``i .. i + n_seq_batch - 1`` as llama-perplexity does (one batch per ``n_batch``
    positions, sequences one after the other in it, logits at ``pos >= first``); yield, after each
    decode, ``(rows, seq, p0)``: the output rows of sequence ``seq`` and the position of its first."""
    ctx.memory.clear()
    num_batches = (n_ctx + n_batch - 1) // n_batch
    for j in range(num_batches):
        b_start = j * n_batch
        b_size = min(n_ctx - b_start, n_batch)
        pos = np.arange(b_start, b_start + b_size)
        need = pos >= first
        batch.clear()
        for seq in range(n_seq_batch):
            s0 = (i + seq) * n_ctx + b_start
            toks = tokens[s0 : s0 + b_size]
            if add_bos and j == 0:
                toks = toks.copy()
                toks[0] = bos
            batch.add_sequence(toks, seq, b_start, logits=need)
        ctx.decode(batch)
        n_out = int(need.sum())
        if n_out == 0:
            continue
        p0 = int(pos[need][0])
        for seq in range(n_seq_batch):
            yield seq * n_out, n_out, seq, p0


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
            ``n_ctx``; its whole memory is cleared before each group of chunks).
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
    from .batch import Batch

    model, ctx = _split(model_or_ctx)
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
        if own:
            ctx.close()


def _base_rows(logits: np.ndarray, targets: np.ndarray, out: np.ndarray, nll: np.ndarray, n_threads: int) -> None:
    a = _rows(logits)
    n, n_vocab = a.shape
    t = _targets(targets, n, n_vocab)
    nv = out.shape[1]

    def rows(r0: int, r1: int) -> None:
        lib.pyl_base_rows(
            _ptr("float *", a[r0:r1]),
            r1 - r0,
            a.strides[0] // 4,
            n_vocab,
            _ptr("int32_t *", t[r0:r1]),
            _ptr("uint16_t *", out[r0:r1]),
            nv,
            _ptr("float *", nll[r0:r1]),
        )

    _run_rows(n, n_threads, rows)


# -- KL divergence against llama-perplexity's base logits ---------------------------------------
class BaseLogits:
    """llama-perplexity's base-logits file (``--kl-divergence-base``), read as views (a memmap).

    The format, as ``perplexity()`` in tools/perplexity/perplexity.cpp writes it (little-endian):
    8 bytes ``_logits_``; int32 ``n_ctx``, ``n_vocab``, ``n_chunk``; int32 ``tokens[n_chunk *
    n_ctx]`` (the text's first ``n_chunk * n_ctx`` tokens, BOS not substituted); then for each
    chunk, ``n_ctx - 1 - n_ctx // 2`` rows (the scored positions) of ``nv = 2 * ((n_vocab + 1) //
    2) + 4`` uint16: float ``scale``, float ``min_log_prob``, then ``n_vocab`` values ``q`` with
    ``log p = scale * q + min_log_prob`` (log-probabilities more than 16 below the row's max are
    stored as 0), padded with zeros. So a stored log-probability is within ``scale / 2`` (at most
    16 / 131070 = 1.2e-4) of the computed one.

    Args:
        path: The file (written by :func:`perplexity` with ``save_base=``, or by
            ``llama-perplexity --kl-divergence-base FILE``).

    Raises:
        ValueError: Not such a file (magic), a header out of range, or a size other than the
            header says (short or long), with what was expected.
        OSError: The file cannot be read.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(20)
        if len(head) < 8 or head[:8] != MAGIC:
            raise ValueError(f"{self.path}: not a base-logits file (the first 8 bytes are {head[:8]!r}, not {MAGIC!r})")
        if len(head) < 20:
            raise ValueError(f"{self.path}: header: expected 20 bytes, the file has {len(head)}")
        n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(head, "<i4", 3, 8))
        if n_ctx < 2 or n_vocab < 1 or n_chunk < 0:
            raise ValueError(f"{self.path}: header out of range: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}")
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.nv = _nv(n_vocab)
        self.n_scored = n_ctx - 1 - n_ctx // 2
        tok_bytes = 4 * n_ctx * n_chunk
        row_bytes = 2 * self.nv * self.n_scored * n_chunk
        want = 20 + tok_bytes + row_bytes
        if size != want:
            raise ValueError(
                f"{self.path}: expected {want} bytes (20 of header, {tok_bytes} of tokens, {row_bytes} of "
                f"{n_chunk} chunks x {self.n_scored} rows x {self.nv} uint16), the file has {size}"
            )
        self.tokens: np.ndarray = np.memmap(self.path, "<i4", "r", 20, (n_ctx * n_chunk,))
        """int32 ``(n_chunk * n_ctx,)``: the tokens (a read-only memmap)."""
        self.rows: np.ndarray = np.memmap(self.path, "<u2", "r", 20 + tok_bytes, (n_chunk, self.n_scored, self.nv))
        """uint16 ``(n_chunk, n_scored, nv)``: each scored position's row (a read-only memmap)."""

    def log_probs(self, chunk: int) -> np.ndarray:
        """The stored log-probabilities of one chunk, decoded: ``scale * q + min_log_prob``.

        Args:
            chunk: The chunk index.

        Returns:
            float32 ``(n_scored, n_vocab)`` (a new array).

        Raises:
            IndexError: No such chunk.
        """
        if not 0 <= chunk < self.n_chunk:
            raise IndexError(f"chunk {chunk} is outside [0, {self.n_chunk})")
        r = np.asarray(self.rows[chunk])
        head = np.ascontiguousarray(r[:, :4]).view(np.float32)  # (n_scored, 2): scale, min_log_prob
        return head[:, :1] * r[:, 4 : 4 + self.n_vocab].astype(np.float32) + head[:, 1:2]

    def __repr__(self) -> str:
        return f"<BaseLogits {self.path.name}: {self.n_chunk} chunks of {self.n_ctx}, n_vocab {self.n_vocab}>"


def _mean_unc(s: float, s2: float, count: int) -> tuple[float, float]:
    """llama-perplexity's mean_and_uncertainty."""
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def _sqrt(x: float) -> float:
    """sqrt as C's: nan for a negative argument (a variance that came out negative)."""
    return math.sqrt(x) if x >= 0 else math.nan


def _cov(a: float, b: float, ab: float, count: int) -> float:
    """llama-perplexity's covariance."""
    if count < 10:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


def _percentile(values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile of sorted float values, in float as there."""
    f = np.float32(fraction)
    if f <= 0:
        return float(values[0])
    if f >= 1:
        return float(values[-1])
    p = np.float32(f * np.float32(values.size - 1))
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, values.size - 1)])


def _median(values: np.ndarray) -> float:
    n = values.size
    return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1])) if n % 2 == 0 else float(values[n // 2])


@dataclass
class KLDivergence:
    """What :func:`kl_divergence` computed: llama-perplexity's ``--kl-divergence`` statistics.

    Q is this run, base the stored one. Per token ``t`` scored: ``kld = sum over v of p_base(v) *
    (log p_base(v) - log p(v))``, the sum over tokens whose stored log-probability is above -16;
    ``p_diff = p(t) - p_base(t)``; top-1 agreement: the first argmax of the logits is the base's.
    Uncertainties as llama-perplexity's ``mean_and_uncertainty`` (0 with 10 tokens or fewer).

    Attributes:
        n_ctx: Tokens per chunk (from the base file).
        n_chunk: Chunks scored.
        count: Tokens scored.
        ppl: PPL(Q), with ``ppl_err``.
        ppl_err: Its uncertainty.
        ppl_base: PPL(base), with ``ppl_base_err``.
        ppl_base_err: Its uncertainty.
        cor: Cor(ln PPL(Q), ln PPL(base)), a fraction.
        ln_ratio: Mean ln(PPL(Q) / PPL(base)), with ``ln_ratio_err``.
        ln_ratio_err: Its uncertainty.
        ratio: PPL(Q) / PPL(base), with ``ratio_err``.
        ratio_err: Its uncertainty.
        diff: PPL(Q) - PPL(base), with ``diff_err``.
        diff_err: Its uncertainty.
        kld: Mean KL divergence (nats), with ``kld_err``.
        kld_err: Its uncertainty.
        kld_max: The largest.
        kld_median: The median.
        kld_min: The smallest.
        kld_percentiles: ``{99.9: value, 99.0: ..., 0.1: ...}`` (:data:`KLD_PERCENTILES`).
        p_diff: Mean Δp (a fraction), with ``p_diff_err``.
        p_diff_err: Its uncertainty.
        p_diff_max: The largest Δp.
        p_diff_median: The median Δp.
        p_diff_min: The smallest Δp.
        p_diff_percentiles: ``{99.9: value, ...}`` (:data:`P_DIFF_PERCENTILES`).
        rms_p_diff: RMS Δp (a fraction), with ``rms_p_diff_err``.
        rms_p_diff_err: Its uncertainty.
        same_top: Top-1 agreement (a fraction), with ``same_top_err``.
        same_top_err: Its uncertainty.
        kld_values: float32 ``(count,)``: each token's KL divergence, in text order.
        p_diff_values: float32 ``(count,)``: each token's Δp.
        same_top_values: bool ``(count,)``: each token's top-1 agreement.
        chunks: Per chunk, the running values of llama-perplexity's table (``ppl``, ``ppl_err``,
            ``ln_ratio``, ``ln_ratio_err``, ``kld``, ``kld_err``, ``rms_p_diff``,
            ``rms_p_diff_err``, ``same_top``, ``same_top_err``).
        seconds: Wall time.
    """

    n_ctx: int
    n_chunk: int
    count: int
    ppl: float
    ppl_err: float
    ppl_base: float
    ppl_base_err: float
    cor: float
    ln_ratio: float
    ln_ratio_err: float
    ratio: float
    ratio_err: float
    diff: float
    diff_err: float
    kld: float
    kld_err: float
    kld_max: float
    kld_median: float
    kld_min: float
    kld_percentiles: dict[float, float]
    p_diff: float
    p_diff_err: float
    p_diff_max: float
    p_diff_median: float
    p_diff_min: float
    p_diff_percentiles: dict[float, float]
    rms_p_diff: float
    rms_p_diff_err: float
    same_top: float
    same_top_err: float
    kld_values: np.ndarray
    p_diff_values: np.ndarray
    same_top_values: np.ndarray
    chunks: list[dict[str, float]]
    seconds: float = 0.0

    def report(self) -> str:
        """The per-chunk table and the three sections llama-perplexity prints, in its formats.

        Returns:
            The text (the sections only with 100 tokens or more, as there).
        """
        lines = [KL_HEADER]
        lines += [_kl_row(i, c) for i, c in enumerate(self.chunks)]
        if self.count >= 100:
            lines += ["", self.summary()]
        return "\n".join(lines)

    def summary(self) -> str:
        """The three sections llama-perplexity prints after its table (perplexity, KL divergence
        and token probability statistics), in its formats.

        Returns:
            The text.
        """
        pct = lambda v: f"{v:4.1f}%".rjust(5)  # noqa: E731
        lines = [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {self.ppl:10.6f} ± {self.ppl_err:10.6f}",
            f"Mean PPL(base)                : {self.ppl_base:10.6f} ± {self.ppl_base_err:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * self.cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {self.ln_ratio:10.6f} ± {self.ln_ratio_err:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {self.ratio:10.6f} ± {self.ratio_err:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {self.diff:10.6f} ± {self.diff_err:10.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {self.kld:10.6f} ± {self.kld_err:10.6f}",
            f"Maximum KLD: {self.kld_max:10.6f}",
        ]
        for q in KLD_PERCENTILES[:4]:
            lines.append(f"{pct(q)}   KLD: {self.kld_percentiles[q]:10.6f}")
        lines.append(f"Median  KLD: {self.kld_median:10.6f}")
        for q in KLD_PERCENTILES[4:]:
            lines.append(f"{pct(q)}   KLD: {self.kld_percentiles[q]:10.6f}")
        lines += [
            f"Minimum KLD: {self.kld_min:10.6f}",
            "",
            "====== Token probability statistics ======",
            f"Mean    Δp: {100 * self.p_diff:6.3f} ± {100 * self.p_diff_err:5.3f} %",
            f"Maximum Δp: {100 * self.p_diff_max:6.3f}%",
        ]
        for q in P_DIFF_PERCENTILES[:5]:
            lines.append(f"{pct(q)}   Δp: {100 * self.p_diff_percentiles[q]:6.3f}%")
        lines.append(f"Median  Δp: {100 * self.p_diff_median:6.3f}%")
        for q in P_DIFF_PERCENTILES[5:]:
            lines.append(f"{pct(q)}   Δp: {100 * self.p_diff_percentiles[q]:6.3f}%")
        lines += [
            f"Minimum Δp: {100 * self.p_diff_min:6.3f}%",
            f"RMS Δp    : {100 * self.rms_p_diff:6.3f} ± {100 * self.rms_p_diff_err:5.3f} %",
            f"Same top p: {100 * self.same_top:6.3f} ± {100 * self.same_top_err:5.3f} %",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<KLDivergence {self.count} tokens: mean KLD {self.kld:.6f}, same top {100 * self.same_top:.3f}%, "
            f"PPL(Q) {self.ppl:.4f} vs PPL(base) {self.ppl_base:.4f}>"
        )


KL_HEADER = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
    "Δp RMS            Same top p"
)
"""The header of llama-perplexity's per-chunk KL divergence table."""


def _kl_row(i: int, c: dict[str, float]) -> str:
    """Row ``i`` (0-based) of llama-perplexity's per-chunk KL divergence table, in its formats."""
    return (
        f"{i + 1:4d}    {c['ppl']:9.4f} ± {c['ppl_err']:9.4f}    {c['ln_ratio']:10.5f} ± {c['ln_ratio_err']:10.5f}"
        f"    {c['kld']:10.5f} ± {c['kld_err']:10.5f}    {100 * c['rms_p_diff']:6.3f} ± "
        f"{100 * c['rms_p_diff_err']:6.3f} %    {100 * c['same_top']:6.3f} ± {100 * c['same_top_err']:6.3f} %"
    )


class _KLSums:
    """kl_divergence_result of perplexity.cpp: double sums of float terms, as there."""

    def __init__(self) -> None:
        self.nll = self.nll2 = self.nll_base = self.nll_base2 = self.nll_nll_base = 0.0
        self.kld = self.kld2 = self.p_diff = self.p_diff2 = self.p_diff4 = 0.0
        self.same_top = 0
        self.count = 0

    def add(self, nll: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, p_diff: np.ndarray, same: np.ndarray) -> None:
        f64 = np.float64
        self.nll += float(nll.astype(f64).sum())
        self.nll2 += float((nll * nll).astype(f64).sum())  # float products, as there
        self.nll_base += float(nll_base.astype(f64).sum())
        self.nll_base2 += float((nll_base * nll_base).astype(f64).sum())
        self.nll_nll_base += float((nll * nll_base).astype(f64).sum())
        self.kld += float(kld.sum())
        self.kld2 += float(np.dot(kld, kld))
        pd = p_diff.astype(f64)
        pd2 = (p_diff * p_diff).astype(f64)
        self.p_diff += float(pd.sum())
        self.p_diff2 += float(pd2.sum())
        self.p_diff4 += float(np.dot(pd2, pd2))
        self.same_top += int(np.count_nonzero(same))
        self.count += int(nll.size)

    def chunk_row(self) -> dict[str, float]:
        c = self.count
        lp, lpu = _mean_unc(self.nll, self.nll2, c)
        lb, lbu = _mean_unc(self.nll_base, self.nll_base2, c)
        cov = _cov(self.nll, self.nll_base, self.nll_nll_base, c)
        kl, klu = _mean_unc(self.kld, self.kld2, c)
        mse, mseu = _mean_unc(self.p_diff2, self.p_diff4, c)
        rms = math.sqrt(mse)
        top = self.same_top / c
        return {
            "ppl": math.exp(lp),
            "ppl_err": math.exp(lp) * lpu,
            "ln_ratio": lp - lb,
            "ln_ratio_err": _sqrt(lpu * lpu + lbu * lbu - 2.0 * cov),
            "kld": kl,
            "kld_err": klu,
            "rms_p_diff": rms,
            "rms_p_diff_err": 0.5 / rms * mseu if rms > 0 else 0.0,
            "same_top": top,
            "same_top_err": math.sqrt(top * (1 - top) / (c - 1)) if c > 1 else 0.0,
        }


def _kl_rows(logits, base_rows, targets, outs, n_threads: int) -> None:
    a = _rows(logits)
    n, n_vocab = a.shape
    t = _targets(targets, n, n_vocab)
    b = np.ascontiguousarray(base_rows)
    nll, nll_base, kld, p_diff, same = outs

    def rows(r0: int, r1: int) -> None:
        lib.pyl_kl_rows(
            _ptr("float *", a[r0:r1]),
            r1 - r0,
            a.strides[0] // 4,
            n_vocab,
            _ptr("uint16_t *", b[r0:r1]),
            b.shape[1],
            _ptr("int32_t *", t[r0:r1]),
            _ptr("float *", nll[r0:r1]),
            _ptr("float *", nll_base[r0:r1]),
            _ptr("double *", kld[r0:r1]),
            _ptr("float *", p_diff[r0:r1]),
            _ptr("int8_t *", same[r0:r1]),
        )

    _run_rows(n, n_threads, rows)


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
            ``n_batch`` is used; its memory is cleared before each group of chunks).
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
    from .batch import Batch

    model, ctx = _split(model_or_ctx)
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
        if own:
            ctx.close()
    return _kl_result(n_ctx, n_chunk, sums, chunks, kld, p_diff, same, seconds)


def _kl_result(n_ctx, n_chunk, s: _KLSums, chunks, kld, p_diff, same, seconds) -> KLDivergence:
    c = s.count
    lp, lpu = _mean_unc(s.nll, s.nll2, c)
    lb, lbu = _mean_unc(s.nll_base, s.nll_base2, c)
    cov = _cov(s.nll, s.nll_base, s.nll_nll_base, c)
    ppl, ppl_b = math.exp(lp), math.exp(lb)
    ln_ratio_err = _sqrt(lpu * lpu + lbu * lbu - 2.0 * cov)
    ppl_cov = ppl * ppl_b * cov
    kl, klu = _mean_unc(s.kld, s.kld2, c)
    pdm, pdu = _mean_unc(s.p_diff, s.p_diff2, c)
    mse, mseu = _mean_unc(s.p_diff2, s.p_diff4, c)
    rms = math.sqrt(mse)
    top = s.same_top / c
    kv = np.sort(kld.astype(np.float32))
    pv = np.sort(p_diff)
    return KLDivergence(
        n_ctx=n_ctx,
        n_chunk=n_chunk,
        count=c,
        ppl=ppl,
        ppl_err=ppl * lpu,
        ppl_base=ppl_b,
        ppl_base_err=ppl_b * lbu,
        cor=cov / (lpu * lbu) if lpu * lbu > 0 else math.nan,
        ln_ratio=lp - lb,
        ln_ratio_err=ln_ratio_err,
        ratio=math.exp(lp - lb),
        ratio_err=math.exp(lp - lb) * ln_ratio_err,
        diff=ppl - ppl_b,
        diff_err=_sqrt((ppl * lpu) ** 2 + (ppl_b * lbu) ** 2 - 2.0 * ppl_cov),
        kld=kl,
        kld_err=klu,
        kld_max=float(kv[-1]),
        kld_median=_median(kv),
        kld_min=float(kv[0]),
        kld_percentiles={q: _percentile(kv, q / 100) for q in KLD_PERCENTILES},
        p_diff=pdm,
        p_diff_err=pdu,
        p_diff_max=float(pv[-1]),
        p_diff_median=_median(pv),
        p_diff_min=float(pv[0]),
        p_diff_percentiles={q: _percentile(pv, q / 100) for q in P_DIFF_PERCENTILES},
        rms_p_diff=rms,
        rms_p_diff_err=0.5 / rms * mseu if rms > 0 else 0.0,
        same_top=top,
        same_top_err=math.sqrt(top * (1 - top) / (c - 1)) if c > 1 else 0.0,
        kld_values=kld.astype(np.float32),
        p_diff_values=p_diff.copy(),
        same_top_values=same.astype(bool),
        chunks=chunks,
        seconds=seconds,
    )


# -- complete(..., logprobs=k) -------------------------------------------------------------------
class CompletionLogprobs(TypedDict):
    """``Completion.logprobs``: what llama-cpp-python's ``create_completion(logprobs=k)`` returns
    in ``choices[0]["logprobs"]``, for the generated tokens (an end-of-generation token left out).

    ``tokens[i]`` is the token's own text (its bytes decoded, an incomplete character dropped, as
    there); ``text_offset[i]`` the length of the prompt plus the text generated before it;
    ``token_logprobs[i]`` its log-probability under the model's logits (the raw logits, not the
    sampler's distribution); ``top_logprobs[i]`` the ``k`` most likely tokens' texts with their
    log-probabilities, and the token's own. ``token_ids`` (not in llama-cpp-python) keeps the ids,
    which texts may not tell apart.
    """

    tokens: list[str]
    text_offset: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    token_ids: list[int]


class _LogprobsRecorder:
    """Fills a :class:`CompletionLogprobs` token by token from the logits the token was sampled
    from (``ctx.logits(-1)``, read in place, before the next decode overwrites it)."""

    def __init__(self, model: Model, top_k: int, offset: int) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= model.n_vocab:
            raise ValueError(f"logprobs must be an int in [0, n_vocab={model.n_vocab}] or None, not {top_k!r}")
        self.model, self.k, self.offset = model, top_k, offset
        self.data: CompletionLogprobs = {
            "tokens": [],
            "text_offset": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "token_ids": [],
        }

    def _text(self, token: int) -> str:
        return self.model.token_to_bytes(token).decode("utf-8", "ignore")

    def wrap(self, feed: Callable[[int], str], ctx: Context) -> Callable[[int], str]:
        """``feed`` (a Detokenizer's) that also records each token it is given."""

        def recording_feed(token: int) -> str:
            piece = feed(token)
            self.add(ctx, token, piece)
            return piece

        return recording_feed

    def add(self, ctx: Context, token: int, piece: str) -> None:
        r = log_softmax(ctx.logits(-1), [token], top_k=self.k, n_threads=1)
        assert r.target is not None
        lp, text = float(r.target[0]), self._text(token)
        top: dict[str, float] = {}
        if self.k:
            assert r.top_ids is not None and r.top_logprobs is not None
            top = {self._text(int(i)): float(v) for i, v in zip(r.top_ids[0], r.top_logprobs[0])}
        top[text] = lp
        d = self.data
        d["tokens"].append(text)
        d["text_offset"].append(self.offset)
        d["token_logprobs"].append(lp)
        d["top_logprobs"].append(top)
        d["token_ids"].append(int(token))
        self.offset += len(piece)
