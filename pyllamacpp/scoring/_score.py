"""``score`` (``Model.score``): the log-probability of every token of a text given the tokens
before it, in windows of the context when the text is longer."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._cpu import default_n_threads
from ..packing import Segment, decode, model_and_context
from ._inputs import _tokens_of
from ._rows import log_softmax

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model


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
    from ..params import default_n_ctx

    model, ctx = model_and_context(model_or_ctx)
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
    from ..batch import Batch

    model = ctx.model
    n = int(tokens.size)
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
    batch = Batch(ctx.n_batch, 1, model=model)
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
        j = np.arange(feed.size)
        window = Segment(feed, seq_id, 0, (j >= first_row) & (j < feed.size - 1))
        for order in decode(ctx, [window], batch=batch):
            for piece in order.pieces:
                if not piece.n_outputs:
                    continue
                tgt_idx = start - len(pre) + piece.at + 1  # text indices of the targets
                _score_outputs(ctx, piece.rows, tokens[tgt_idx], tgt_idx - 1, logprobs, top_ids, top_lp, k, n_threads)
        target = end
    return Scores(tokens, logprobs, top_ids, top_lp, W, windows, time.perf_counter() - t0)


def _score_outputs(ctx, rows, targets, where, logprobs, top_ids, top_lp, k, n_threads) -> None:
    out = log_softmax(ctx.logits_all()[rows], targets, top_k=k, n_threads=n_threads)  # the view dies here
    assert out.target is not None
    logprobs[where] = out.target
    if k:
        top_ids[where] = out.top_ids
        top_lp[where] = out.top_logprobs
