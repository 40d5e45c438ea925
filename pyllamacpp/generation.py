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

Sampling: :func:`generate` samples with one chain; :func:`generate_parallel` with one chain shared
by every sequence (``examples/batched``) or one chain per sequence (a list, a factory, ``seed=``),
each sampled at its own sequence's output (``llama_sampler_sample(chain, ctx, idx)``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from . import packing
from ._lib import lib
from .batch import Batch
from .errors import KVCacheFullError
from .sampling import Sampler

if TYPE_CHECKING:
    from .context import Context

FinishReason = Literal["eog", "n_predict", "ctx_full"]


class GenerationOutcome:
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
        self._out = GenerationOutcome()
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
    ctx: Context, tokens: np.ndarray, n_predict: int, sampler: Sampler, seq_id: int, res: GenerationOutcome
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


SamplerSpec = Sampler | Sequence[Sampler] | Callable[[int], Sampler] | None
"""What :func:`generate_parallel` takes as ``sampler``: one chain for all, one per sequence, or a factory."""


def _sequence_samplers(
    sampler: SamplerSpec, seed: int | None, n_parallel: int
) -> tuple[list[Sampler], bool, list[Sampler]]:
    """``(chains, shared, made)``: the chain of each sequence (one object ``n_parallel`` times when
    ``shared``), and the chains made here (for the caller to close)."""
    if seed is not None:
        if sampler is not None:
            raise ValueError(
                "seed= makes one chain per sequence (Sampler.common(seed + i)); it does not combine with "
                "sampler=: give a factory instead, e.g. lambda i: Sampler(model).top_k(40).temp(0.8).dist(seed + i)"
            )
        seed = operator.index(seed)
        made = [Sampler.common(seed + i) for i in range(n_parallel)]
        return made, False, made
    if sampler is None:
        greedy = Sampler.greedy()  # stateless: one chain serves every sequence alike
        return [greedy] * n_parallel, True, [greedy]
    if isinstance(sampler, Sampler):
        return [sampler] * n_parallel, True, []
    if callable(sampler):
        chains = [sampler(i) for i in range(n_parallel)]
        what = "the sampler factory returned"
    elif isinstance(sampler, Sequence) and not isinstance(sampler, (str, bytes)):
        chains = list(sampler)
        if len(chains) != n_parallel:
            raise ValueError(f"sampler: a list of {len(chains)} samplers for n_parallel={n_parallel} sequences")
        what = "the sampler list holds"
    else:
        raise TypeError(f"sampler must be a Sampler, a list of Samplers or a factory, not {type(sampler).__name__}")
    for c in chains:
        if not isinstance(c, Sampler):
            raise TypeError(f"{what} a {type(c).__name__}, not a Sampler")
    if len({id(c) for c in chains}) != len(chains):
        raise ValueError(
            f"{what} one Sampler object for several sequences: each sequence needs its own chain "
            "(pass one Sampler, not a list, to share a chain)"
        )
    return chains, False, []


@dataclass
class ParallelResult:
    """One sequence's outcome in :func:`generate_parallel`.

    Attributes:
        seq_id: The sequence.
        tokens: The tokens sampled for it.
        text: Those tokens, end-of-generation tokens left out, detokenized.
        finish_reason: ``"eog"``, ``"n_predict"`` or ``"ctx_full"``, as ``Generation.finish_reason``.
        sampler: The steps of the chain that sampled it (:meth:`Sampler.describe`), e.g.
            ``"top_k(40) -> top_p(0.95) -> min_p(0.05) -> temp(0.8) -> dist(42)"``.
        seed: The seed of that chain's RNG step (:meth:`Sampler.get_seed`), None without one.
        shared_sampler: True when one chain sampled every sequence (its state saw all of them).
    """

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""  # "eog", "n_predict" or "ctx_full", as Generation.finish_reason
    sampler: str = ""
    seed: int | None = None
    shared_sampler: bool = False

    @property
    def finished_by(self) -> str:
        """The former name of ``finish_reason``."""
        return self.finish_reason


def generate_parallel(
    ctx: Context,
    prompt: str | bytes | npt.ArrayLike,
    n_parallel: int,
    n_predict: int,
    sampler: SamplerSpec = None,
    *,
    seed: int | None = None,
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

    Sequence ``i`` is sampled with ``llama_sampler_sample(chain_i, ctx, idx_i)`` at its own output
    index, which also accepts the token into ``chain_i`` only. Which chains:

    - one :class:`Sampler` (or None: greedy): one chain for all sequences, as ``examples/batched``
      does. Its state (penalty history, grammar, RNG) then sees every sequence's tokens in turn: fine
      for greedy, not for penalties, a grammar or independent draws.
    - a list of ``n_parallel`` distinct Samplers, or a factory ``f(i) -> Sampler``: chain ``i`` for
      sequence ``i``, its own RNG, penalty history and grammar state. Used as they are (not reset);
      the caller owns them.
    - ``seed=`` with no sampler: sequence ``i`` gets ``Sampler.common(seed + i)``, llama.cpp's
      ``common_params_sampling`` defaults ``top_k(40) -> top_p(0.95) -> min_p(0.05) -> temp(0.8)
      -> dist(seed + i)``, closed when this returns. Other settings per sequence: a factory.

    Args:
        ctx: The context; its ``n_seq_max`` must be at least ``n_parallel``.
        prompt: Text (tokenized with ``llama_tokenize``) or token ids.
        n_parallel: How many sequences (ids 0..n_parallel-1).
        n_predict: Most tokens to sample per sequence.
        sampler: A :class:`Sampler` shared by all, a list of one per sequence, a factory
            ``f(seq_id) -> Sampler``, or None (greedy, or ``Sampler.common(seed + i)`` with ``seed``).
        seed: Sequence ``i`` samples with ``Sampler.common(seed + i)``; only without ``sampler``.
        shared_prompt: True: decode the prompt once with every seq id; False: decode it into
            sequence 0 and ``seq_cp`` it; None: True when ``kv_unified`` (or one sequence).

    Returns:
        One :class:`ParallelResult` per sequence, in seq id order, each naming its chain
        (``sampler``, ``seed``, ``shared_sampler``).

    Raises:
        ValueError: ``n_parallel`` is outside ``[1, n_seq_max]``, a prompt token is outside the
            vocabulary, a sampler list's length is not ``n_parallel``, a list or factory gives one
            Sampler object to two sequences, or ``seed`` comes with ``sampler``.
        TypeError: ``sampler`` is not a Sampler, a sequence of Samplers or a callable, or the list
            or factory gives something that is not a Sampler.
        KVCacheFullError: The prompt itself does not fit.
        InvalidBatchError: llama.cpp rejected the batch (e.g. coupled sequences with
            ``shared_prompt=True`` and ``kv_unified=False``).
        DecodeAborted: ``ctx.abort()`` stopped a decode.
        DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
        DecodeError: Another ``llama_decode`` failure.
        ClosedError: The context or a sampler was closed.
    """
    model = ctx.model
    if not 1 <= n_parallel <= ctx.n_seq_max:
        raise ValueError(f"n_parallel {n_parallel} is outside [1, n_seq_max={ctx.n_seq_max}]")
    tokens = model.tokenize(prompt) if isinstance(prompt, (str, bytes)) else np.asarray(prompt, np.int32)
    chains, shared, made = _sequence_samplers(sampler, seed, n_parallel)
    try:
        return _parallel(ctx, tokens, n_parallel, n_predict, chains, shared, shared_prompt)
    finally:
        for c in made:
            c.close()


def _parallel(
    ctx: Context,
    tokens: np.ndarray,
    n_parallel: int,
    n_predict: int,
    chains: list[Sampler],
    shared: bool,
    shared_prompt: bool | None,
) -> list[ParallelResult]:
    model = ctx.model
    seqs = list(range(n_parallel))
    results = [
        ParallelResult(s, sampler=c.describe(), seed=c.get_seed(), shared_sampler=shared) for s, c in zip(seqs, chains)
    ]
    ptrs = [c.ptr for c in chains]  # raises for a closed chain; the chains stay referenced till the end
    if shared_prompt is None:
        shared_prompt = bool(ctx.params.kv_unified) or n_parallel == 1
    batch = Batch(max(ctx.n_batch, n_parallel), ctx.n_seq_max, model=model)
    if shared_prompt:
        # one segment carrying every seq id: each prompt token stored once, in all the sequences
        prompt = [packing.Segment(tokens, seqs, 0, "last")] if tokens.size else []
        for _ in packing.decode(ctx, prompt, batch=batch):
            pass
    else:
        ctx.prefill(tokens, 0, 0)
        packing.fork(ctx, 0, seqs[1:])
    toks_of = [r.tokens for r in results]
    live = seqs if n_predict > 0 else []
    if not live:
        for r in results:
            r.finish_reason = "n_predict"  # 0 prefills only, as in generate
    pos = int(tokens.size)
    # Each step's batch holds one token per live sequence, in seq id order: slot k is live[k], so
    # the sequence's output index in the next step is k. Written through the batch's numpy views,
    # a few vectorized writes per step (Batch.add per token cost more than the rest of a step).
    p, tok_view, pos_view, seq_col = batch._p, batch._token, batch._pos, batch._seq[:, 0]
    assert tok_view is not None  # a token batch
    batch._n_seq_id[:n_parallel] = 1
    batch._logits[:n_parallel] = 1
    info, sample, decode = model._tokens[0], lib.llama_sampler_sample, ctx.decode  # token -> (bytes, is_eog, text)
    stepped = False  # the first tokens all come from the prompt's last output (-1)
    while live:
        cptr = ctx.ptr
        still: list[int] = []
        step_toks: list[int] = []
        for k, s in enumerate(live):
            # the indices are the last batch's own output slots, so llama.cpp's index checks cannot fail
            tok = sample(ptrs[s], cptr, k if stepped else -1)
            toks = toks_of[s]
            toks.append(tok)
            if info[tok][1]:
                results[s].finish_reason = "eog"
            elif len(toks) >= n_predict:
                results[s].finish_reason = "n_predict"  # its last token is not decoded
            else:
                step_toks.append(tok)
                still.append(s)
        live = still
        if not live:
            break
        n = len(live)
        tok_view[:n] = step_toks
        pos_view[:n] = pos
        seq_col[:n] = live
        p.n_tokens = n
        try:
            decode(batch)
        except KVCacheFullError:
            for s in live:
                results[s].finish_reason = "ctx_full"
            break
        stepped = True
        pos += 1
    for r in results:
        r.text = model.detokenize([t for t in r.tokens if not info[t][1]])
    return results
