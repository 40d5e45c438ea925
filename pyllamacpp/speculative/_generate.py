"""The loop: draft, verify, sample and compare, keep (:func:`generate_speculative`, :class:`Speculation`)."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from .._lib import lib
from ..errors import DecodeAborted, KVCacheFullError
from ..generation import FinishReason, Generation
from ..sampling import Sampler
from ._drafts import Draft, NgramDraft
from ._passes import PassCounter
from ._stats import SpeculativeStats, _Outcome
from ._target import _Target

if TYPE_CHECKING:
    from ..context import Context


def _timed(rounds: Generator[int, None, None], st: SpeculativeStats) -> Generator[int, None, None]:
    """``rounds``, with the seconds from its first step to its end (closed or raised) in ``st.t_total``."""
    t_start = time.perf_counter()
    try:
        yield from rounds
    finally:
        st.t_total = time.perf_counter() - t_start


def _rounds(
    ctx: Context,
    toks: np.ndarray,
    n_predict: int,
    sampler: Sampler,
    seq_id: int,
    draft: Draft,
    n_draft: int,
    passes: PassCounter | None,
    res: _Outcome,
    prefix: list[int],
) -> Generator[int, None, None]:
    st = res.stats
    info = ctx.model._tokens[0]  # token -> (bytes, is_eog, text)
    n_vocab = ctx.model.n_vocab
    pos0 = ctx.memory.seq_pos_max(seq_id) + 1
    t = time.perf_counter()
    if n_predict == 0:
        ctx.prefill(toks, seq_id, pos0)
        st.t_prefill = time.perf_counter() - t
        res.finish_reason = "n_predict"
        return
    if toks.size > 1:
        ctx.prefill(toks[:-1], seq_id, pos0)
    st.t_prefill = time.perf_counter() - t
    history: list[int] = prefix + toks.tolist()
    draft.begin(history)
    target = _Target(ctx, seq_id, pos0 + int(toks.size) - 1, passes, st)
    limit = n_predict if n_predict > 0 else -1  # -1: no limit
    rows_max = min(ctx.n_batch, ctx._n_outputs_max)
    n_ctx_seq = ctx.n_ctx_seq
    sample, perf = lib.llama_sampler_sample, time.perf_counter
    tokens = res.tokens
    drafted_at, accepted_at = st.drafted_at, st.accepted_at
    while True:
        id_last, start = history[-1], target.end
        n_max = min(n_draft, n_ctx_seq - start - 1, rows_max - 1 - len(target.replay))
        if limit > 0:
            n_max = min(n_max, limit - len(tokens) - 1)
        if len(target.replay) >= n_draft:
            n_max = 0  # tokens to replay piled up over partial acceptances: a round that keeps all its rows
        d: list[int] = []
        if n_max > 0:
            t = perf()
            d = draft.draft(history, n_max)
            st.t_draft += perf() - t
            if len(d) > n_max:
                d = d[:n_max]
            for i, x in enumerate(d):
                if not isinstance(x, (int, np.integer)) or not 0 <= x < n_vocab:
                    raise ValueError(f"the draft proposed {x!r} at position {i}, not a token of [0, {n_vocab})")
            d = [int(x) for x in d]
        sptr = sampler.ptr  # a closed sampler raises ClosedError here, before the verify changes anything
        try:
            try:
                target.verify(id_last, d)
            except KVCacheFullError as e:
                if e.__context__ is not None or not d:
                    raise
                d = []  # the draft's rows did not fit: the last token alone may
                target.verify(id_last, d)
        except KVCacheFullError as e:
            if e.__context__ is not None:
                raise
            res.finish_reason, res.error = "ctx_full", e
            target.flush()
            return
        except (DecodeAborted, KeyboardInterrupt):  # DecodeInterrupted too
            target.abandon(start)
            raise
        st.n_rounds += 1
        t = perf()
        cptr, o, n_d = ctx.ptr, target.out0, len(d)
        emitted: list[int] = []
        k = 0
        stop: FinishReason | None = None
        for i in range(n_d + 1):
            tok = sample(sptr, cptr, o + i)
            if tok < 0:
                raise IndexError(f"llama_sampler_sample() failed for row {o + i} of the verify batch")
            emitted.append(tok)
            hit = i < n_d and tok == d[i]
            if hit:
                k += 1
            if info[tok][1]:
                stop = "eog"
                break
            if len(tokens) + len(emitted) == limit:
                stop = "n_predict"
                break
            if not hit:
                break
        st.t_sample += perf() - t
        while len(drafted_at) < n_d:
            drafted_at.append(0)
            accepted_at.append(0)
        for i in range(n_d):
            drafted_at[i] += 1
        for i in range(k):
            accepted_at[i] += 1
        st.n_drafted += n_d
        st.n_accepted += k
        m = len(emitted)
        target.keep(start + m, lazy=stop is None)  # the last yielded token stays undecoded
        history += emitted
        j = 0  # tokens of this round yielded
        try:
            for tok in emitted:
                tokens.append(tok)
                j += 1
                st.n_tokens += 1
                yield tok
        except GeneratorExit:
            if j < m:  # closed inside the round: keep what was yielded only
                target.keep(start + j, lazy=False)
            else:
                target.flush()
            raise
        if stop is not None:
            res.finish_reason = stop
            return


class Speculation(Generation):
    """What :func:`generate_speculative` returns: an iterator of token ids, and the figures.

    A :class:`~pyllamacpp.Generation` (iterate it; ``tokens``, ``finish_reason``, ``error``): one
    verify decode runs when the tokens of the last one are used up.

    Attributes:
        ctx: The target context.
        seq_id: The sequence it extends.
        n_prompt: Tokens of the prompt.
        draft: The :class:`Draft` it uses.
        stats: The :class:`SpeculativeStats`, filled as it runs.

    Args:
        ctx: The target context.
        tokens: The prompt's token ids.
        n_predict: Most tokens to sample; 0 prefills only; -1 has no limit.
        draft: The draft source.
        sampler: The target's sampler (greedy when None).
        seq_id: The sequence to extend.
        n_draft: Most tokens drafted per round.
        passes: A :class:`PassCounter` installed in ``ctx``, or None.
        history: Tokens the sequence holds before ``tokens``, for the draft.
    """

    def __init__(
        self,
        ctx: Context,
        tokens: npt.ArrayLike,
        n_predict: int,
        draft: Draft,
        sampler: Sampler | None,
        seq_id: int,
        n_draft: int,
        passes: PassCounter | None,
        history: Sequence[int] = (),
    ) -> None:
        self.ctx, self.seq_id, self.draft = ctx, seq_id, draft
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        self.n_prompt = int(toks.size)
        self.stats = SpeculativeStats(n_draft=int(n_draft), n_ubatch=ctx.n_ubatch)
        self._out = _Outcome(self.stats)
        self._sampler = sampler or Sampler.greedy()
        prefix = [int(t) for t in history]
        rounds = _rounds(
            ctx, toks, int(n_predict), self._sampler, seq_id, draft, int(n_draft), passes, self._out, prefix
        )
        self._it = _timed(rounds, self.stats)

    def close(self) -> None:
        """Stop here: the sequence keeps the prompt and the yielded tokens but the last."""
        self._it.close()

    def __repr__(self) -> str:
        return (
            f"<Speculation {len(self.tokens)} tokens in {self.stats.n_rounds} rounds, "
            f"finish_reason={self.finish_reason!r}>"
        )


def generate_speculative(
    ctx: Context,
    tokens: npt.ArrayLike,
    n_predict: int,
    draft: Draft | None = None,
    sampler: Sampler | None = None,
    *,
    seq_id: int = 0,
    n_draft: int = 8,
    passes: PassCounter | None = None,
    history: npt.ArrayLike | None = None,
) -> Speculation:
    """:func:`pyllamacpp.generate` with a draft: several tokens per target decode where the draft is right.

    The prompt but its last token is prefilled (:meth:`Context.prefill`); then each round asks
    the draft for up to ``n_draft`` tokens, decodes ``[last token, draft...]`` in one batch with
    logits for every row, samples rows with ``sampler`` while they agree with the draft, and cuts
    the sequence back to what was kept (see the module's docstring). A batch wider than
    ``n_ubatch`` runs as several forward passes (``passes`` counts them). The draft is cut to fit
    ``n_batch``, the context's free positions and ``n_predict``; a verify that finds no KV cells
    is tried again with the last token alone before the generation ends with ``"ctx_full"``.

    The tokens are those :func:`pyllamacpp.generate` would sample with the same sampler, but for
    near-ties the wider batch may turn (see the module's docstring); ``finish_reason``, the
    cache convention and continuing a sequence are as there.

    Args:
        ctx: The target :class:`~pyllamacpp.Context`.
        tokens: The prompt's token ids (at least one).
        n_predict: Most tokens to sample; 0 prefills only; -1 has no limit.
        draft: A :class:`Draft`: :class:`NgramDraft` (None: a new one), :class:`ModelDraft`, or
            your own.
        sampler: The target's :class:`~pyllamacpp.Sampler` (greedy when None), used as is.
        seq_id: The sequence to extend.
        n_draft: Most tokens drafted per round (at least 1).
        passes: The :class:`PassCounter` installed in ``ctx`` (``ctx`` made with its
            :meth:`~PassCounter.context_params`): forward passes are then counted per verify.
        history: Tokens the sequence already holds before ``tokens`` (a conversation so far):
            the draft sees them as the text before the prompt; they are not decoded again.

    Returns:
        A :class:`Speculation`, an iterator of token ids with :attr:`~Speculation.stats`.

    Raises:
        ValueError: No tokens, a token outside the vocabulary, a bad ``seq_id`` (at the first
            ``next``), ``n_draft < 1``, a draft model with another vocabulary (here, before any
            decode), a draft that proposes something that is not a token, or a ``passes``
            counter ``ctx`` was not made with.
        TypeError: ``draft`` is not a :class:`Draft`.
        KVCacheFullError: The prompt itself does not fit.
        DecodeAborted: ``ctx.abort()`` stopped a decode (the sequence holds what it held before
            that round).
        DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
        DecodeError: Another ``llama_decode`` failure.
        ClosedError: The context, sampler or draft was closed.
    """
    if draft is None:
        draft = NgramDraft()
    if not isinstance(draft, Draft):
        raise TypeError(f"draft must be a pyllamacpp Draft (NgramDraft, ModelDraft ...), not {type(draft).__name__}")
    if int(n_draft) < 1:
        raise ValueError(f"n_draft must be >= 1, got {n_draft}")
    toks = np.asarray(tokens)
    if toks.size == 0:
        raise ValueError("generate_speculative: no tokens")
    if passes is not None and not passes.counts(ctx):
        raise ValueError(
            "passes: this PassCounter does not count ctx's passes (PassCounter(ctx) counts on its "
            "taps; a PassCounter() counts a context made with model.context(**counter.context_params()))"
        )
    draft.bind(ctx.model)  # a draft model of another vocabulary fails here, before any decode
    hist = () if history is None else np.asarray(history, dtype=np.int64).reshape(-1).tolist()
    return Speculation(ctx, toks, n_predict, draft, sampler, seq_id, n_draft, passes, hist)
