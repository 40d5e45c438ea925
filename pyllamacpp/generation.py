"""Generation loops over a Context: one sequence, or many decoded together (examples/batched).

How generation ends, and what the KV cache holds afterwards (the same for :func:`generate` and
:func:`generate_parallel`):

- ``finish_reason`` is ``"eog"`` (an end-of-generation token was sampled; it is the last token
  returned), ``"n_predict"`` (``n_predict`` tokens were sampled) or ``"ctx_full"`` (the next
  decode found no KV cell: ``llama_decode`` returned 1; the tokens sampled so far are kept and
  no exception is raised). Other decode errors (abort, Ctrl-C, a closed context) raise.
- The last sampled token is not decoded, as in llama.cpp's examples (simple, batched): decoding
  it would cost one more ``llama_decode`` for logits nobody reads. So a sequence ends with its
  prompt and every sampled token but the last in memory: ``seq_pos_max == start + n_prompt +
  len(tokens) - 2``. To continue a sequence, feed that last token back first
  (``generate(ctx, [last, *more], n)``); an end-of-generation token is fed back like any other.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from .batch import Batch
from .errors import KVCacheFullError
from .sampling import Sampler

if TYPE_CHECKING:
    from .context import Context

FinishReason = Literal["eog", "n_predict", "ctx_full"]


class _Outcome:
    """What a generation did, written by its generator (kept apart so that the generator holds no
    reference to the object the caller holds: dropping that one closes the generator at once)."""

    __slots__ = ("error", "finish_reason", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: KVCacheFullError | None = None


class Generation:
    """What :func:`generate` returns: an iterator of sampled token ids that keeps what it did.

    Attributes:
        tokens: the tokens yielded so far.
        finish_reason: ``"eog"``, ``"n_predict"`` or ``"ctx_full"`` once the iterator is
            exhausted; None while it runs, or when it was closed early or raised.
        error: the :class:`KVCacheFullError` that ended it with ``"ctx_full"`` (llama.cpp's
            reason in ``error.reason``), else None.
        n_prompt: tokens prefilled before the first sample.
        ctx: The context it decodes in.
        seq_id: The sequence it extends.

    Args:
        ctx: The context.
        tokens: The prompt's token ids.
        n_predict: Most tokens to sample; 0 prefills only; -1 has no limit.
        sampler: The sampler (greedy when None).
        seq_id: The sequence to extend.
    """

    def __init__(
        self, ctx: Context, tokens: npt.ArrayLike, n_predict: int, sampler: Sampler | None, seq_id: int
    ) -> None:
        self.ctx, self.seq_id = ctx, seq_id
        toks = np.asarray(tokens, dtype=np.int32)
        self.n_prompt = int(toks.size)
        self._out = _Outcome()
        self._it = _run(ctx, toks, int(n_predict), sampler or Sampler.greedy(), seq_id, self._out)

    @property
    def tokens(self) -> list[int]:
        """The tokens yielded so far."""
        return self._out.tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        """``"eog"``, ``"n_predict"`` or ``"ctx_full"`` once exhausted; None while it runs, closed early or raised."""
        return self._out.finish_reason

    @property
    def error(self) -> KVCacheFullError | None:
        """The :class:`KVCacheFullError` that ended it with ``"ctx_full"``, else None."""
        return self._out.error

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> int:
        return next(self._it)

    def close(self) -> None:
        """Stop here (as breaking out of a loop does); the last yielded token stays undecoded."""
        self._it.close()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Generation {len(self.tokens)} tokens, finish_reason={self.finish_reason!r}>"


def _run(
    ctx: Context, tokens: np.ndarray, n_predict: int, sampler: Sampler, seq_id: int, res: _Outcome
) -> Generator[int, None, None]:
    is_eog = ctx.model.is_eog
    pos = ctx.prefill(tokens, seq_id)
    if n_predict == 0:
        res.finish_reason = "n_predict"
        return
    limit = n_predict if n_predict > 0 else -1  # -1: no limit (llama.cpp's -n -1)
    step, out = ctx._generation_step(sampler, seq_id)
    tok = sampler.sample(ctx, -1)
    eog = is_eog(tok)
    append = res.tokens.append
    i = 1
    while True:
        append(tok)
        yield tok
        if eog:
            res.finish_reason = "eog"
            return
        if i == limit:  # the last token is not decoded (see the module's docstring)
            res.finish_reason = "n_predict"
            return
        try:
            tok = step(tok, pos, True)
        except KVCacheFullError as e:  # nothing of this step reached memory; the context goes on
            if e.__context__ is not None:
                raise  # something else failed in the step too (a logging handler): surface both
            res.finish_reason, res.error = "ctx_full", e
            return
        eog = out.eog
        pos += 1
        i += 1


def generate(
    ctx: Context, tokens: npt.ArrayLike, n_predict: int, sampler: Sampler | None = None, seq_id: int = 0
) -> Generation:
    """Prefill ``tokens`` into ``seq_id``, then yield up to ``n_predict`` sampled tokens.

    The prompt goes after what the sequence holds, in ``llama_decode`` calls of at most ``n_batch``
    tokens (:meth:`Context.prefill`); then each sampled token costs one ``llama_decode``
    (``n_predict=-1``: no limit), sampled with ``llama_sampler_sample``.

    Generation ends at an end-of-generation token (yielded), after ``n_predict`` tokens, or when
    the context is full; the returned :class:`Generation` says which (``finish_reason``). The
    last yielded token is never decoded: the sequence holds the prompt and every token but the
    last (see the module's docstring). Each token is decoded when the next one is asked for; the
    decode and the next sample are one C call (``Context._generation_step``).

    Args:
        ctx: The :class:`Context`.
        tokens: The prompt's token ids (at least one).
        n_predict: Most tokens to sample; 0 prefills only; -1 has no limit.
        sampler: The :class:`Sampler` (greedy when None), used as is (not reset).
        seq_id: The sequence to extend.

    Returns:
        A :class:`Generation`, an iterator of token ids.

    Raises:
        ValueError: No tokens, a token outside the vocabulary, or a bad ``seq_id`` (at the first
            ``next``).
        KVCacheFullError: The prompt itself does not fit.
        DecodeAborted: ``ctx.abort()`` stopped a decode.
        DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
        DecodeError: Another ``llama_decode`` failure.
        ClosedError: The context or sampler was closed.
    """
    return Generation(ctx, tokens, n_predict, sampler, seq_id)


@dataclass
class ParallelResult:
    """One sequence's outcome in :func:`generate_parallel`.

    Attributes:
        seq_id: The sequence.
        tokens: The tokens sampled for it.
        text: Those tokens, end-of-generation tokens left out, detokenized.
        finish_reason: ``"eog"``, ``"n_predict"`` or ``"ctx_full"``, as ``Generation.finish_reason``.
    """

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # "eog", "n_predict" or "ctx_full", as Generation.finish_reason

    @property
    def finished_by(self) -> str:
        """The former name of ``finish_reason``."""
        return self.finish_reason


def generate_parallel(
    ctx: Context,
    prompt: str | bytes | npt.ArrayLike,
    n_parallel: int,
    n_predict: int,
    sampler: Sampler | None = None,
    *,
    shared_prompt: bool | None = None,
) -> list[ParallelResult]:
    """Generate ``n_parallel`` sequences from one prompt: llama.cpp's ``examples/batched`` in Python.

    The prompt goes in once, each token carrying all sequence ids 0..n_parallel-1 (one KV copy of
    the prompt). This needs a unified KV cache; with ``kv_unified=False`` llama.cpp rejects such
    "coupled" sequences, so the prompt is decoded into sequence 0 and copied with ``seq_cp``
    (``shared_prompt`` forces either path). Then each step puts one token per live sequence into
    one batch; a sequence ends on its own at an end-of-generation token or after ``n_predict``,
    and all live sequences end with ``"ctx_full"`` when a step's decode finds no KV cell. As with
    :func:`generate`, a sequence's last sampled token is not decoded.
    One sampler serves all sequences, as in the example; greedy by default.

    Args:
        ctx: The context; its ``n_seq_max`` must be at least ``n_parallel``.
        prompt: Text (tokenized with ``llama_tokenize``) or token ids.
        n_parallel: How many sequences (ids 0..n_parallel-1).
        n_predict: Most tokens to sample per sequence.
        sampler: The :class:`Sampler` (greedy when None).
        shared_prompt: True: decode the prompt once with every seq id; False: decode it into
            sequence 0 and ``seq_cp`` it; None: True when ``kv_unified`` (or one sequence).

    Returns:
        One :class:`ParallelResult` per sequence, in seq id order.

    Raises:
        ValueError: ``n_parallel`` is outside ``[1, n_seq_max]``, or a prompt token is outside the
            vocabulary.
        KVCacheFullError: The prompt itself does not fit.
        InvalidBatchError: llama.cpp rejected the batch (e.g. coupled sequences with
            ``shared_prompt=True`` and ``kv_unified=False``).
        DecodeAborted: ``ctx.abort()`` stopped a decode.
        DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
        DecodeError: Another ``llama_decode`` failure.
        ClosedError: The context or sampler was closed.
    """
    model = ctx.model
    if not 1 <= n_parallel <= ctx.n_seq_max:
        raise ValueError(f"n_parallel {n_parallel} is outside [1, n_seq_max={ctx.n_seq_max}]")
    tokens = model.tokenize(prompt) if isinstance(prompt, (str, bytes)) else np.asarray(prompt, np.int32)
    sampler = sampler or Sampler.greedy()
    seqs = list(range(n_parallel))
    if shared_prompt is None:
        shared_prompt = bool(ctx.params.kv_unified) or n_parallel == 1
    n_batch = ctx.n_batch
    batch = Batch(max(n_batch, n_parallel), ctx.n_seq_max, model=model)
    if shared_prompt:
        for i0 in range(0, tokens.size, n_batch):
            batch.clear()
            last = i0 + n_batch >= tokens.size
            batch.add_sequence(tokens[i0 : i0 + n_batch], seqs, i0, logits="last" if last else "none")
            ctx.decode(batch)
    else:
        ctx.prefill(tokens, 0, 0)
        for s in seqs[1:]:
            ctx.memory.seq_cp(0, s)
    # every sequence samples its first token from the prompt's last output
    out_index = {s: len(batch) - 1 for s in seqs}
    results = {s: ParallelResult(s) for s in seqs}
    live = list(seqs)
    pos = int(tokens.size)
    for _ in range(n_predict):
        batch.clear()
        still = []
        for s in live:
            tok = sampler.sample(ctx, out_index[s])
            results[s].tokens.append(tok)
            if model.is_eog(tok):
                results[s].finish_reason = "eog"
                continue
            if len(results[s].tokens) >= n_predict:
                results[s].finish_reason = "n_predict"  # its last token is not decoded
                continue
            out_index[s] = batch.add(tok, pos, s, logits=True)
            still.append(s)
        live = still
        if not live:
            break
        try:
            ctx.decode(batch)
        except KVCacheFullError:
            for s in live:
                results[s].finish_reason = "ctx_full"
            break
        pos += 1
    for r in results.values():
        r.text = model.detokenize([t for t in r.tokens if not model.is_eog(t)])
    return [results[s] for s in seqs]
