"""Speculative decoding: a draft proposes tokens, the target checks them all in one batch.

Each round the target context decodes ``[last token, d1 ... dn]`` (the draft's ``n`` tokens) in
one ``llama_decode``, logits for every row. The target's sampler samples row 0; while its token
equals the draft's next one it samples the next row, and the first token that differs is the
target's own (llama.cpp's ``common_sampler_sample_and_accept_n``, ``examples/speculative-simple``).
So one round yields between 1 and ``n + 1`` tokens for one target decode. The cells of the rows
that were not kept are removed with ``llama_memory_seq_rm``; the draft's own context (a draft
model) drops them at its next draft, when it compares what it holds with the text so far.

Acceptance rule, and what exactness means here:

- Every yielded token is sampled with the target's chain from the target's logits at its
  position, once, in order, as :func:`pyllamacpp.generate` samples it: the draft decides only
  how many rows one decode checks. The output distribution is the target's whatever the draft
  proposes (a stateful chain, penalties or grammar, sees the same tokens in the same order, and a
  ``dist`` step draws the same numbers). For a draft that proposes one token per position (all
  drafts here: greedy or looked up) this is also what the rejection rule of the
  speculative-sampling papers gives: it accepts ``d`` with probability ``min(1, p(d) / q(d)) =
  p(d)`` and otherwise samples ``p`` without ``d``, as sample-and-compare does.
- The logits of a row of a wider batch are not always bit-identical to those of a one-token
  decode (another kernel, another summation order): a near-tie may then go the other way, so the
  tokens equal plain ``generate``'s exactly only where no step is that close (see the guide for
  the rate measured on the default model).

Memory that cannot drop a suffix (a recurrent or hybrid memory, or a sliding-window cache whose
cells a longer batch may overwrite) is handled as ``examples/speculative-simple`` does it: a
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` checkpoint of the sequence before a verify with a draft;
on partial acceptance the checkpoint is restored, the rest cut (``seq_rm``), and the kept tokens
are decoded again, at the front of the next verify batch.

The cache convention is :mod:`pyllamacpp.generation`'s: when a generation ends, its sequence
holds the prompt and every yielded token but the last.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._lib import ffi, lib
from .batch import Batch
from .context_state import StateBuffer, StateFlags
from .errors import DecodeAborted, KVCacheFullError, LlamaError
from .generation import FinishReason, Generation
from .generation import _Outcome as _GenOutcome
from .sampling import Sampler

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

__all__ = [
    "Draft",
    "ModelDraft",
    "NgramDraft",
    "PassCounter",
    "Speculation",
    "SpeculativeComparison",
    "SpeculativeStats",
    "check_vocab",
    "compare_speculative",
    "generate_speculative",
    "layer_skip_gguf",
]

_PARTIAL = int(StateFlags.PARTIAL_ONLY)


# -- counting forward passes -------------------------------------------------------------------
class PassCounter:
    """Counts a context's forward passes (one per ubatch) in C, on the context's graph taps or
    with a ``cb_eval`` of its own.

    **On the taps** (``PassCounter(ctx)``, any context made with its taps, the default): the
    taps' C callback (build_support/taps.h) is armed with no node wanted and counts each pass
    where the graph's first node comes again, so the same context can also be captured and
    patched (``ctx.capture`` / ``ctx.patch``) while it counts. It counts from its creation until
    :meth:`close` (a ``with`` block closes it)::

        with PassCounter(ctx) as counter:
            ctx.decode(batch)
        counter.n_passes

    **With its own** ``cb_eval`` (``PassCounter()``, then ``model.context(**counter.context_params())``):
    ``pyl_pass_count_cb`` (build_support/speculative.h) wants no node and counts a pass where the
    first node it saw reappears (the rule of ``experiments/trace.py``). ``cb_eval`` is fixed when a
    context is made, and a context has one: a context made this way has no graph taps
    (``ctx.capture`` raises ``TapError``), and the counter must outlive it.

    Either way no Python runs per node: a Python callback would run about 1,100 times per pass on
    the default model and slow the decodes it counts. (A counter on the taps needs the graph's
    first node: the listing ``ctx.graph_nodes()`` makes with probe decodes in a throwaway
    context, once per model and parameters, as a capture does.)

    Attributes:
        n_passes: Passes seen so far.
        n_nodes: Graph nodes asked about so far.

    Args:
        ctx: Count on this context's taps; None: a counter for :meth:`context_params`.

    Raises:
        TapError: ``ctx`` has no taps (made with ``taps=False`` or its own ``cb_eval``).
    """

    def __init__(self, ctx: Context | None = None) -> None:
        self._c = ffi.new("pyl_pass_count *")
        self._taps: Any = None
        self._ctx: weakref.ref | None = None
        self._start = (0, 0)
        self._closed = (0, 0)  # the counts when close() stopped them
        if ctx is not None:
            from .taps import _listing, taps_of

            taps = taps_of(ctx)  # TapError when the context cannot be tapped
            taps.count(_listing(ctx, 3), True)  # the listing's first node starts a pass
            self._taps, self._ctx = taps, weakref.ref(ctx)
            self._start = taps.passes()

    def context_params(self) -> dict[str, Any]:
        """The :class:`~pyllamacpp.Context` keywords that install the counter as the context's
        ``cb_eval`` (a counter made without a context).

        Returns:
            ``{"cb_eval": ..., "cb_eval_user_data": ...}``.

        Raises:
            ValueError: The counter counts on a context's taps already.
        """
        if self._ctx is not None:
            raise ValueError("this PassCounter counts on a context's taps; make one with PassCounter() for cb_eval")
        return {"cb_eval": ffi.addressof(lib, "pyl_pass_count_cb"), "cb_eval_user_data": self._c}

    def counts(self, ctx: Context) -> bool:
        """Whether this counter counts ``ctx``'s passes (on its taps, or as its ``cb_eval``).

        Args:
            ctx: A context.

        Returns:
            True when the passes it decodes are counted here.
        """
        if self._ctx is not None:
            return self._ctx() is ctx and self._taps is not None
        return ctx.params.cb_eval_user_data is self._c

    def _counts(self) -> tuple[int, int]:
        if self._ctx is None:
            return int(self._c.n_passes), int(self._c.n_nodes)
        if self._taps is None:
            return self._closed
        p, n = self._taps.passes()
        return p - self._start[0], n - self._start[1]

    @property
    def n_passes(self) -> int:
        """Forward passes seen so far."""
        return self._counts()[0]

    @property
    def n_nodes(self) -> int:
        """Graph nodes asked about so far."""
        return self._counts()[1]

    def reset(self) -> None:
        """Set both counts to 0."""
        if self._ctx is None:
            self._c.n_passes = 0
            self._c.n_nodes = 0
        elif self._taps is not None:
            self._start = self._taps.passes()
        else:
            self._closed = (0, 0)

    def close(self) -> None:
        """Stop counting on the context's taps (idempotent; the counts stay readable). Nothing
        to do for a ``cb_eval`` counter."""
        if self._taps is None:
            return
        self._closed = self._counts()
        taps, self._taps = self._taps, None
        if self._ctx is not None and self._ctx() is not None:
            taps.count(None, False)

    def __enter__(self) -> PassCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<PassCounter {self.n_passes} passes, {self.n_nodes} nodes>"


# -- draft sources -----------------------------------------------------------------------------
class Draft:
    """Where draft tokens come from. Subclass it and override :meth:`draft`.

    :func:`generate_speculative` calls :meth:`bind` with the target model before any decode,
    :meth:`begin` once with the prompt, then :meth:`draft` before each verify. ``history`` is
    the whole text so far as token ids, the prompt then every token yielded, and ends with the
    token the next verify decodes first; it only grows within one generation.
    """

    def bind(self, model: Model) -> None:
        """Check that this draft can serve ``model`` (called before any decode).

        Args:
            model: The target model.

        Raises:
            ValueError: It cannot (e.g. another vocabulary).
        """

    def begin(self, history: list[int]) -> None:
        """A generation starts from ``history`` (the prompt).

        Args:
            history: The prompt's token ids.
        """

    def draft(self, history: list[int], n_max: int) -> list[int]:
        """Propose up to ``n_max`` tokens to follow ``history``.

        Args:
            history: The text so far; its last token is decoded first by the verify.
            n_max: The most tokens to propose (at least 1).

        Returns:
            The proposed token ids (may be empty).

        Raises:
            NotImplementedError: The base class proposes nothing of its own.
        """
        raise NotImplementedError

    def reset(self) -> None:
        """Forget what is kept between generations (a draft model's cached prompt)."""

    def close(self) -> None:
        """Free what the draft owns (idempotent)."""

    def __enter__(self) -> Draft:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NgramDraft(Draft):
    """Lookup decoding: the tokens that followed the same n-gram earlier in the text (no model).

    llama.cpp's n-gram cache (``common/ngram-cache.cpp``, ``examples/lookup``) over the prompt
    and the text so far: for each n-gram of ``n_min..n_max`` tokens, how often each token
    followed it. A draft extends the text one token at a time: the longest n-gram ending the
    text (drafts included) whose most frequent follower was seen at least ``min_samples[n-1]``
    times and makes at least ``min_percent[n-1]`` percent of them gives the next token; none: the
    draft stops. The defaults are llama.cpp's ``LLAMA_NGRAM_MIN/MAX`` and its "lax" thresholds
    for the context cache. Only that cache: no corpus-wide static or dynamic cache. The table
    sees every n-gram of the text, as ``examples/lookup`` updates it (not only those inside one
    round's new tokens, as ``common/speculative.cpp``'s ngram-cache path does).

    Args:
        n_min: The shortest n-gram looked up.
        n_max: The longest n-gram looked up.
        min_samples: Per n-gram length (index ``n - 1``), the times the n-gram must have been seen.
        min_percent: Per n-gram length, the share (percent) its most frequent follower must have.

    Raises:
        ValueError: ``n_min < 1``, ``n_max < n_min``, or a threshold list shorter than ``n_max``.
    """

    def __init__(
        self,
        n_min: int = 1,
        n_max: int = 4,
        *,
        min_samples: Sequence[int] = (2, 2, 1, 1),
        min_percent: Sequence[int] = (66, 50, 50, 50),
    ) -> None:
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min} n_max={n_max}")
        if len(min_samples) < n_max or len(min_percent) < n_max:
            raise ValueError(f"min_samples and min_percent need {n_max} entries (one per n-gram length)")
        self.n_min, self.n_max = int(n_min), int(n_max)
        self.min_samples = [int(x) for x in min_samples]
        self.min_percent = [int(x) for x in min_percent]
        # n-gram -> [times seen, most frequent follower, its count, {follower: count}]
        self._table: dict[tuple[int, ...], list] = {}
        self._seen = 0  # history[:_seen] is in the table

    def begin(self, history: list[int]) -> None:
        """Start a new table for this generation.

        Args:
            history: The prompt's token ids.
        """
        self._table.clear()
        self._seen = 0

    def reset(self) -> None:
        """Forget the table."""
        self.begin([])

    def _update(self, h: list[int]) -> None:
        table, n_min, n_max = self._table, self.n_min, self.n_max
        for i in range(max(self._seen, 1), len(h)):  # h[i] follows the n-grams ending at i - 1
            tok = h[i]
            for n in range(n_min, min(n_max, i) + 1):
                key = tuple(h[i - n : i])
                e = table.get(key)
                if e is None:
                    table[key] = [1, tok, 1, {tok: 1}]
                    continue
                e[0] += 1
                c = e[3][tok] = e[3].get(tok, 0) + 1
                if c > e[2]:
                    e[1], e[2] = tok, c
        self._seen = len(h)

    def draft(self, history: list[int], n_max: int) -> list[int]:
        """The longest-n-gram lookup, one token at a time (see the class).

        Args:
            history: The text so far.
            n_max: The most tokens to propose.

        Returns:
            The proposed token ids (empty when no n-gram qualifies).
        """
        if len(history) < self._seen:  # not the history this table was made from
            self.begin(history)
        self._update(history)
        table, samples, percent = self._table, self.min_samples, self.min_percent
        tail = history[-self.n_max :]
        out: list[int] = []
        while len(out) < n_max:
            tok = -1
            for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
                e = table.get(tuple(tail[-n:]))
                if e is not None and e[0] >= samples[n - 1] and 100 * e[2] >= percent[n - 1] * e[0]:
                    tok = e[1]
                    break
            if tok < 0:
                break
            out.append(tok)
            tail.append(tok)
        return out

    def __repr__(self) -> str:
        return f"<NgramDraft n={self.n_min}..{self.n_max}, {len(self._table)} n-grams>"


def check_vocab(target: Model, draft: Model) -> None:
    """Raise unless ``draft`` may draft for ``target``: llama.cpp's ``common_speculative_are_compatible``.

    The same vocabulary type, the same BOS and EOS (and whether each is added), at most 128
    tokens more or fewer, and the same text for every token id from 5 on
    (``SPEC_VOCAB_CHECK_START_TOKEN_ID``) that both have (``llama_vocab_get_text``).

    Args:
        target: The target model.
        draft: The draft model.

    Raises:
        ValueError: The vocabularies differ; the message says where.
        ClosedError: A model is closed.
    """
    vt, vd = target._vocab_ptr(), draft._vocab_ptr()
    where = f"draft {draft.path.name} for target {target.path.name}"
    if lib.llama_vocab_type(vt) != lib.llama_vocab_type(vd):
        raise ValueError(
            f"{where}: another vocabulary type ({lib.llama_vocab_type(vd)}, the target's {lib.llama_vocab_type(vt)})"
        )
    for what, add, tok in (
        ("BOS", lib.llama_vocab_get_add_bos, lib.llama_vocab_bos),
        ("EOS", lib.llama_vocab_get_add_eos, lib.llama_vocab_eos),
    ):
        if add(vt) != add(vd) or (add(vt) and tok(vt) != tok(vd)):
            raise ValueError(
                f"{where}: another {what} (added {bool(add(vd))}, id {tok(vd)}; "
                f"the target's: added {bool(add(vt))}, id {tok(vt)})"
            )
    nt, nd = lib.llama_vocab_n_tokens(vt), lib.llama_vocab_n_tokens(vd)
    if abs(nt - nd) > 128:
        raise ValueError(f"{where}: {nd} tokens, the target {nt} (llama.cpp allows a difference of at most 128)")
    text = lib.llama_vocab_get_text
    for i in range(5, min(nt, nd)):
        a, b = text(vt, i), text(vd, i)
        if a != b and ffi.string(a) != ffi.string(b):
            raise ValueError(f"{where}: token {i} is {ffi.string(b)!r} in the draft, {ffi.string(a)!r} in the target")


class _Rollback:
    """Cut a sequence back to a position. A plain KV cache: ``seq_rm``. Another memory: restore
    the ``PARTIAL_ONLY`` checkpoint :meth:`mark` took (a StateBuffer, made once and grown when
    needed), then ``seq_rm`` what the checkpoint does not cover (a hybrid memory's KV part)."""

    def __init__(self, ctx: Context, seq_id: int) -> None:
        self.ctx, self.seq = ctx, seq_id
        self.plain = bool(ctx._plain_kv)
        self.base = -1  # the checkpoint's position: the sequence held positions < base; -1: none
        self._buf: StateBuffer | None = None
        self._state: Any = None

    def mark(self, base: int) -> None:
        ctx = self.ctx
        if self._buf is not None:
            try:
                self._state = ctx.seq_state(self.seq, _PARTIAL, out=self._buf)
                self.base = base
                return
            except ValueError:  # the state grew past the buffer (a sliding window filling up)
                pass
        size = lib.llama_state_seq_get_size_ext(ctx.ptr, self.seq, _PARTIAL)
        self._buf = StateBuffer(max(2 * int(size), 1 << 12))
        self._state = ctx.seq_state(self.seq, _PARTIAL, out=self._buf)
        self.base = base

    def restore(self) -> None:
        assert self.base >= 0, "no checkpoint to restore"
        self.ctx.set_seq_state(self.seq, self._state, _PARTIAL, validate=False, keep_on_error=False)
        if not self.ctx.memory.seq_rm(self.seq, self.base, -1):
            raise LlamaError(
                f"llama_memory_seq_rm(seq {self.seq}, {self.base}, -1) refused to cut after a checkpoint restore",
                func="llama_memory_seq_rm",
            )


class ModelDraft(Draft):
    """A draft model: a smaller GGUF with the target's vocabulary, in a context of its own.

    It drafts greedily (the most likely token, as llama.cpp's ``draft-simple``), one
    ``llama_decode`` per drafted token but the last, stopping early when the token's probability
    is below ``p_min`` (llama.cpp's ``--draft-p-min``; 0, its default, never stops early). Before
    each draft it compares what its sequence holds with the text so far, drops the rest
    (``seq_rm``, or a ``PARTIAL_ONLY`` checkpoint restored for a memory that cannot drop a
    suffix) and decodes what is new: the tokens the target kept and its own last one. What it
    holds stays between generations: a prompt that starts the same is not decoded again.

    The vocabularies are compared (:func:`check_vocab`) when :func:`generate_speculative` starts,
    before any decode; drafted ids the target does not have end the draft.

    Args:
        model: The draft :class:`~pyllamacpp.Model`, or a GGUF path (then loaded, and closed with
            the draft).
        ctx: A context of the draft model to use (not closed with the draft); None: one is made
            with ``ctx_params``.
        p_min: Stop drafting at a token whose probability (softmax of the draft's logits) is below it.
        seq_id: The sequence it uses in its context.
        **ctx_params: :class:`~pyllamacpp.Context` keywords for the context it makes.

    Raises:
        ModelLoadError: The path cannot be loaded.
        ContextError: The context cannot be made.
        ValueError: ``p_min`` outside [0, 1], or ``ctx`` is a context of another model.
    """

    def __init__(
        self,
        model: Model | str | os.PathLike,
        *,
        ctx: Context | None = None,
        p_min: float = 0.0,
        seq_id: int = 0,
        **ctx_params: Any,
    ) -> None:
        from .model import Model

        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {p_min}")
        self._own_model = not isinstance(model, Model)
        self.model: Model = model if isinstance(model, Model) else Model(model)
        if ctx is not None and ctx.model is not self.model:
            raise ValueError("ctx= is a context of another model than the draft's")
        try:
            self.ctx: Context = ctx if ctx is not None else self.model.context(**ctx_params)
        except BaseException:
            if self._own_model:
                self.model.close()
            raise
        self._own_ctx = ctx is None
        self.p_min, self.seq_id = float(p_min), int(seq_id)
        self._greedy = Sampler.greedy()
        self._step: Any = None
        self._rb = _Rollback(self.ctx, self.seq_id)
        self._held: list[int] = []  # the tokens of its sequence, positions 0, 1, ...
        self._ok = 0  # _held[:_ok] is known to equal the history's start
        self._n_vocab_target = 0
        self._bound: weakref.ref | None = None  # the target check_vocab passed for
        self._full = False  # its context ran out of cells in this generation: no more drafts

    @classmethod
    def layer_skip(cls, target: Model | str | os.PathLike, n_layer: int, **kwargs: Any) -> ModelDraft:
        """A draft made of the target's first ``n_layer`` layers (:func:`layer_skip_gguf`).

        The draft runs those layers, then the target's own output norm and head: an early exit,
        with no training behind it. The GGUF is written once and cached.

        Args:
            target: The target :class:`~pyllamacpp.Model` or its GGUF path.
            n_layer: How many of its first layers to keep.
            **kwargs: :class:`ModelDraft` keywords (``p_min``, context keywords).

        Returns:
            The draft (it owns the model it loads).

        Raises:
            ValueError: ``n_layer`` is not between 1 and the target's layers - 1.
            OSError: The GGUF cannot be read or written.
        """
        from .model import Model

        path = target.path if isinstance(target, Model) else Path(target)
        return cls(layer_skip_gguf(path, n_layer), **kwargs)

    def bind(self, model: Model) -> None:
        """Check the vocabularies (:func:`check_vocab`).

        Args:
            model: The target model.

        Raises:
            ValueError: The vocabularies differ.
        """
        if self._bound is None or self._bound() is not model:  # checked once per target
            check_vocab(model, self.model)
            self._bound = weakref.ref(model)
        self._n_vocab_target = model.n_vocab

    def begin(self, history: list[int]) -> None:
        """A generation starts: compare what the sequence holds with the prompt from the start.

        Args:
            history: The prompt's token ids.
        """
        self._ok = 0
        self._full = False

    def reset(self) -> None:
        """Clear its sequence (``llama_memory_seq_rm``): the next prompt is decoded in full."""
        self.ctx.memory.seq_rm(self.seq_id)
        self._held, self._ok, self._rb.base = [], 0, -1

    def _sync(self, history: list[int]) -> int:
        """Make the sequence hold ``history`` and return the token the draft model samples next."""
        held, rb = self._held, self._rb
        n, lim = self._ok, min(len(held), len(history) - 1)
        while n < lim and held[n] == history[n]:
            n += 1
        if len(held) > n:
            if rb.plain:
                self.ctx.memory.seq_rm(self.seq_id, n, -1)
            elif 0 <= rb.base <= n:
                rb.restore()
                n = rb.base
            else:  # a memory that cannot be cut there: start over
                self.ctx.memory.seq_rm(self.seq_id)
                n = 0
            del held[n:]
        new = history[n:]
        if self._step is None:
            self._step, _ = self.ctx._generation_step(self._greedy, self.seq_id)
        if len(new) == 1:
            tok = self._step(new[0], n, True)
        else:
            self.ctx.prefill(np.asarray(new, dtype=np.int32), self.seq_id, n)
            tok = self._greedy.sample(self.ctx, -1)
        held.extend(new)
        self._ok = len(held)
        if not rb.plain:
            rb.mark(len(held))  # the sequence holds the history: drafts are cut back to here
        return tok

    def draft(self, history: list[int], n_max: int) -> list[int]:
        """Greedy tokens of the draft model after ``history``.

        Args:
            history: The text so far.
            n_max: The most tokens to propose.

        Returns:
            The proposed token ids; empty once the draft's context is full.

        Raises:
            DecodeError: A decode of the draft context failed (other than for want of cells).
        """
        if self._full:
            return []
        out: list[int] = []
        try:
            tok = self._sync(history)
            p_min, n_vocab = self.p_min, self._n_vocab_target or self.model.n_vocab
            while True:
                if tok >= n_vocab:
                    break
                if p_min > 0.0:
                    lg = self.ctx.logits()
                    if 1.0 / float(np.exp(lg - lg[tok]).sum()) < p_min:  # softmax of the top token
                        break
                out.append(tok)
                if len(out) >= n_max:
                    break
                tok = self._step(tok, len(self._held), True)
                self._held.append(out[-1])
        except KVCacheFullError:
            self._full = True  # no cells left for this generation: draft nothing more
            self.reset()
        return out

    def close(self) -> None:
        """Close the context and model the draft made (not those it was given); idempotent."""
        self._step = None
        if self._own_ctx:
            self.ctx.close()
        if self._own_model:
            self.model.close()
        self._greedy.close()

    def __repr__(self) -> str:
        return f"<ModelDraft {self.model.path.name} p_min={self.p_min} holds {len(self._held)} tokens>"


def layer_skip_gguf(source: str | os.PathLike, n_layer: int, *, cache: str | os.PathLike | None = None) -> Path:
    """Write (once) a GGUF of ``source``'s first ``n_layer`` layers and return its path.

    The tensors of layers ``n_layer`` and above (``blk.<il>.*``) are left out, ``block_count``
    becomes ``n_layer``, per-layer metadata arrays are cut to ``n_layer`` entries, and every other
    tensor (embeddings, output norm, output head) and key is copied as it is, quantized data
    included, with the ``gguf`` package (as ``gguf_new_metadata.py`` copies a file). The file goes
    under ``$PYLLAMACPP_CACHE/models/layer-skip`` (default ``~/.cache/pyllamacpp/...``), written
    to a temporary name and renamed; a sidecar ``.source`` names the source's path, size and
    mtime, and the file is written again when they change.

    Args:
        source: The target's GGUF.
        n_layer: How many of its first layers to keep.
        cache: The folder to write into instead of the cache's.

    Returns:
        The path of the layer-skip GGUF.

    Raises:
        ValueError: ``n_layer`` is not between 1 and the source's layers - 1, or the source has
            no ``<arch>.block_count``.
        OSError: A file cannot be read or written.
    """
    import gguf

    from ._fetch import cache_dir

    src = Path(source).resolve()
    st = src.stat()
    ident = {"source": str(src), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "n_layer": int(n_layer), "v": 1}
    folder = Path(cache) if cache is not None else cache_dir() / "models" / "layer-skip"
    out = folder / f"{src.stem}.first{int(n_layer)}.gguf"
    side = out.with_name(out.name + ".source")
    if out.is_file() and side.is_file():
        try:
            if json.loads(side.read_text()) == ident:
                return out
        except ValueError:
            pass
    reader = gguf.GGUFReader(src)
    arch_f = reader.fields.get("general.architecture")
    if arch_f is None:
        raise ValueError(f"{src.name}: no general.architecture")
    arch = str(arch_f.contents())
    bc = reader.fields.get(f"{arch}.block_count")
    if bc is None:
        raise ValueError(f"{src.name}: no {arch}.block_count")
    n_src = int(bc.contents())
    if not 1 <= n_layer < n_src:
        raise ValueError(f"n_layer must be in [1, {n_src - 1}] for {src.name} ({n_src} layers), got {n_layer}")
    folder.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        for f in reader.fields.values():
            name = f.name
            if name == "general.architecture" or name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = f.contents()
            if name == "general.alignment":
                writer.add_custom_alignment(int(value))
                continue
            if name == f"{arch}.block_count":
                value = int(n_layer)
            elif name == "general.name":
                value = f"{value} (first {n_layer} of {n_src} layers)"
            elif sub is not None and name.startswith(f"{arch}.") and isinstance(value, list) and len(value) == n_src:
                value = value[:n_layer]  # one entry per layer (head counts, window pattern ...)
            writer.add_key_value(name, value, vtype, sub_type=sub)
        keep = [t for t in reader.tensors if not _dropped_layer(t.name, n_layer)]
        for t in keep:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in keep:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    side.write_text(json.dumps(ident) + "\n")
    return out


def _dropped_layer(name: str, n_layer: int) -> bool:
    if not name.startswith("blk."):
        return False
    il = name.split(".", 2)[1]
    return il.isdigit() and int(il) >= n_layer


# -- the loop ----------------------------------------------------------------------------------
@dataclass
class SpeculativeStats:
    """What a speculative generation did, filled as it runs (:attr:`Speculation.stats`).

    Attributes:
        n_draft: The most tokens drafted per round, as asked.
        n_ubatch: The target context's ``n_ubatch``.
        n_tokens: Tokens yielded.
        n_rounds: Verify decodes of the target (rounds).
        n_drafted: Draft tokens verified.
        n_accepted: Draft tokens the target's sampler agreed with.
        drafted_at: Per draft position (index 0: the first draft token), rounds that drafted it.
        accepted_at: Per draft position, rounds that accepted it.
        verify_rows: Rows of each verify batch (replayed tokens, the last token, the draft).
        verify_passes: Forward passes counted for each verify batch (with a :class:`PassCounter`;
            else empty).
        n_replay_passes: Passes counted for decodes that only replay kept tokens (end of a
            generation after a checkpoint restore).
        n_checkpoints: ``PARTIAL_ONLY`` checkpoints taken (memory that cannot drop a suffix).
        n_restores: Checkpoints restored (partial acceptance with such a memory).
        n_replayed: Tokens decoded again after a restore.
        t_prefill: Seconds in the prompt's prefill.
        t_draft: Seconds in the draft (its decodes included).
        t_target: Seconds in the target's verify and replay decodes.
        t_sample: Seconds sampling and comparing the rows.
        t_rollback: Seconds cutting sequences (``seq_rm``, checkpoints saved and restored).
        t_total: Seconds from the call's first step to its end.
    """

    n_draft: int = 0
    n_ubatch: int = 0
    n_tokens: int = 0
    n_rounds: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    verify_rows: list[int] = field(default_factory=list)
    verify_passes: list[int] = field(default_factory=list)
    n_replay_passes: int = 0
    n_checkpoints: int = 0
    n_restores: int = 0
    n_replayed: int = 0
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_target: float = 0.0
    t_sample: float = 0.0
    t_rollback: float = 0.0
    t_total: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Draft tokens accepted per draft token verified (None before any)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else None

    @property
    def acceptance_at(self) -> list[float]:
        """Per draft position: rounds that accepted it / rounds that drafted it."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def n_target_passes(self) -> int | None:
        """Forward passes counted in verify decodes (None without a :class:`PassCounter`)."""
        return sum(self.verify_passes) if self.verify_passes else None

    @property
    def passes_per_verify(self) -> float | None:
        """Mean forward passes per verify decode (None without a :class:`PassCounter`)."""
        return sum(self.verify_passes) / len(self.verify_passes) if self.verify_passes else None

    @property
    def tokens_per_pass(self) -> float | None:
        """Tokens yielded per target forward pass, replays included (None without a counter)."""
        n = self.n_target_passes
        return self.n_tokens / (n + self.n_replay_passes) if n else None

    @property
    def tokens_per_round(self) -> float | None:
        """Tokens yielded per verify decode."""
        return self.n_tokens / self.n_rounds if self.n_rounds else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens yielded per second of :attr:`t_total` (the prompt's prefill included)."""
        return self.n_tokens / self.t_total if self.t_total > 0 else None

    def passes_by_rows(self) -> dict[int, list[int]]:
        """The passes counted per verify batch width.

        Returns:
            ``{rows: sorted distinct pass counts seen for batches of that many rows}``.
        """
        out: dict[int, set[int]] = {}
        for r, p in zip(self.verify_rows, self.verify_passes):
            out.setdefault(r, set()).add(p)
        return {r: sorted(v) for r, v in sorted(out.items())}

    def report(self) -> dict[str, Any]:
        """Every figure as a JSON-ready dict.

        Returns:
            The fields, the properties, and ``passes_by_rows`` (keys as strings).
        """
        d: dict[str, Any] = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in (
            "acceptance_rate",
            "acceptance_at",
            "n_target_passes",
            "passes_per_verify",
            "tokens_per_pass",
            "tokens_per_round",
            "tokens_per_s",
        ):
            d[k] = getattr(self, k)
        d["passes_by_rows"] = {str(k): v for k, v in self.passes_by_rows().items()}
        return d


class _Outcome(_GenOutcome):
    """What a speculative generation did (a generation's outcome and its figures)."""

    __slots__ = ("stats",)

    def __init__(self, stats: SpeculativeStats) -> None:
        super().__init__()
        self.stats = stats


class _Target:
    """The target's sequence during a speculative generation: verify batches and what to keep.

    ``end`` is the position after what the sequence holds (the next token's position), counting
    ``replay``: tokens a checkpoint restore took out again, decoded at the front of the next batch
    (positions ``end - len(replay)`` on)."""

    def __init__(self, ctx: Context, seq_id: int, end: int, passes: PassCounter | None, st: SpeculativeStats) -> None:
        self.ctx, self.seq, self.end, self.passes, self.st = ctx, seq_id, end, passes, st
        self.rb = _Rollback(ctx, seq_id)
        self.replay: list[int] = []
        self.since: list[int] = []  # tokens decoded after the checkpoint (positions rb.base ...)
        self.batch = b = Batch(ctx.n_batch, 1, model=ctx.model)
        b._n_seq_id[:] = 1  # one sequence, in every slot, for good
        b._seq[:, 0] = seq_id
        self.out0 = 0  # the batch index of the row of the last token

    def _fill(self, quiet: list[int], rows: list[int], pos: int) -> None:
        """The batch: ``quiet`` (no logits) then ``rows`` (logits), from position ``pos``. Written
        through cffi: after a decode numpy's calls cost tens of µs each with the caches it left
        cold, more than a round's Python otherwise (the tokens are checked by then)."""
        p = self.batch._p
        token, bpos, logits = p.token, p.pos, p.logits
        i = 0
        for t in quiet:
            token[i], bpos[i], logits[i] = t, pos + i, 0
            i += 1
        for t in rows:
            token[i], bpos[i], logits[i] = t, pos + i, 1
            i += 1
        p.n_tokens = i

    def verify(self, id_last: int, draft: list[int]) -> None:
        rb, st, r = self.rb, self.st, self.replay
        if not rb.plain:
            t = time.perf_counter()
            if draft and not r:
                rb.mark(self.end)
                self.since = []
                st.n_checkpoints += 1
            elif not r:
                rb.base = -1  # a round without a draft keeps its one row: nothing to restore to
            st.t_rollback += time.perf_counter() - t
        rows = [id_last, *draft]
        self._fill(r, rows, self.end - len(r))
        p0 = self.passes.n_passes if self.passes is not None else 0
        t = time.perf_counter()
        self.ctx.decode(self.batch)  # KVCacheFullError: nothing of the batch reached memory
        st.t_target += time.perf_counter() - t
        if self.passes is not None:
            st.verify_passes.append(self.passes.n_passes - p0)
        st.verify_rows.append(len(r) + len(rows))
        st.n_replayed += len(r)
        self.out0 = len(r)
        if rb.base >= 0:
            self.since += r
            self.since += rows
        self.replay = []
        self.end += len(rows)

    def keep(self, end: int, lazy: bool) -> None:
        """Make the sequence hold positions before ``end`` only; ``lazy``: tokens to decode again
        wait for the next verify batch."""
        if end < self.end:
            t = time.perf_counter()
            rb = self.rb
            if rb.plain:
                self.ctx.memory.seq_rm(self.seq, end, -1)
            elif self.replay:  # the sequence is at the checkpoint already
                del self.replay[end - rb.base :]
            else:
                rb.restore()
                self.replay, self.since = self.since[: end - rb.base], []
                self.st.n_restores += 1
            self.end = end
            self.st.t_rollback += time.perf_counter() - t
        if not lazy:
            self.flush()

    def flush(self) -> None:
        """Decode the tokens a restore took out, without outputs."""
        r = self.replay
        if not r:
            return
        self._fill(r, [], self.end - len(r))
        p0 = self.passes.n_passes if self.passes is not None else 0
        t = time.perf_counter()
        self.ctx.decode(self.batch)
        self.st.t_target += time.perf_counter() - t
        if self.passes is not None:
            self.st.n_replay_passes += self.passes.n_passes - p0
        self.st.n_replayed += len(r)
        if self.rb.base >= 0:
            self.since += r
        self.replay = []

    def abandon(self, start: int) -> None:
        """After a failed verify (an abort): back to holding positions before ``start``."""
        if self.rb.plain:
            self.ctx.memory.seq_rm(self.seq, start, -1)
            self.end = start
        elif self.rb.base >= 0:
            self.rb.restore()
            self.replay = (self.since + self.replay)[: start - self.rb.base]
            self.since, self.end = [], start
            self.flush()


def _run(
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
    t_start = time.perf_counter()
    try:
        yield from _rounds(ctx, toks, n_predict, sampler, seq_id, draft, n_draft, passes, res, st, prefix)
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
    st: SpeculativeStats,
    prefix: list[int],
) -> Generator[int, None, None]:
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
        self._it = _run(
            ctx, toks, int(n_predict), self._sampler, seq_id, draft, int(n_draft), passes, self._out, prefix
        )

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


class SpeculativeComparison(dict):
    """What :func:`compare_speculative` measured: a JSON-ready dict (its keys are described
    there) that prints as a short report.

    ``print(c)`` (or ``c.report()``) gives both sides' speeds, the speed-up, whether the tokens
    are the same, and the draft's figures; ``c["speedup"]``, ``c["speculative"]["stats"]`` and
    the other keys read the numbers; ``json.dumps(c)`` writes them all.
    """

    def report(self) -> str:
        """The comparison in a few lines of text.

        Returns:
            The report, without a trailing newline.
        """
        pl, sp, st = self["plain"], self["speculative"], self["speculative"]["stats"]

        def runs(side: dict) -> str:
            return " ".join(f"{t:.3f}" for t in side["runs_s"])

        n = self["n_tokens"]
        same = (
            "the same tokens on both sides"
            if self["same_tokens"]
            else f"the sides differ from token {self['first_difference']} on"
        )
        lines = [
            f"plain generate:       {pl['tokens_per_s']:8.1f} tokens/s  (runs: {runs(pl)} s)",
            f"generate_speculative: {sp['tokens_per_s']:8.1f} tokens/s  (runs: {runs(sp)} s)",
            f"speed-up: {self['speedup']:.2f}x wall time (pairs {' '.join(f'{x:.2f}' for x in self['speedups'])}), "
            f"{self['speedup_cpu']:.2f}x this thread's CPU time",
            f"{n} tokens per run, {self['repeat']} run(s) per side, n_draft {self['n_draft']}: {same}",
        ]
        acc = st["acceptance_rate"]
        draft = (
            f"draft (last run): {st['n_rounds']} verifies, {st['n_drafted']} tokens drafted, {st['n_accepted']} "
            f"accepted ({'-' if acc is None else f'{acc:.0%}'}), "
            f"{st['tokens_per_round'] or 0:.2f} tokens per verify"
        )
        if st["passes_per_verify"] is not None:
            draft += f", {st['passes_per_verify']:.2f} forward passes per verify"
        return "\n".join([*lines, draft])

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return (
            f"<SpeculativeComparison {self['speedup']:.2f}x, {self['n_tokens']} tokens, "
            f"same_tokens={self['same_tokens']}>"
        )


def compare_speculative(
    ctx: Context,
    tokens: npt.ArrayLike,
    n_predict: int,
    draft: Draft | None = None,
    *,
    sampler: Callable[[], Sampler] | None = None,
    n_draft: int = 8,
    repeat: int = 3,
    seq_id: int = 0,
    passes: PassCounter | None = None,
) -> SpeculativeComparison:
    """Plain :func:`pyllamacpp.generate` against :func:`generate_speculative`, in one context, alternating.

    Each run clears ``seq_id`` first and the draft too (:meth:`Draft.reset`: a draft model
    decodes the prompt again), so every run starts cold; the sides alternate (plain, speculative,
    speculative, plain, ...) so that a machine getting slower or faster weighs on both. The
    prompt but its last token is prefilled first, untimed, the same for both; a run is timed from
    there to its last token: the prompt's last token is the first decode of both sides (``generate``
    of it; the first verify of the other, the prompt passed as ``history``), and a draft model's
    decode of the prompt is in the speculative side's time.

    Args:
        ctx: The target context.
        tokens: The prompt's token ids.
        n_predict: Tokens to sample per run.
        draft: The draft (None: a new :class:`NgramDraft`).
        sampler: Makes a fresh sampler per run (e.g. ``lambda: Sampler.common(seed=1)``, so both
            sides draw the same numbers); None: greedy.
        n_draft: Most tokens drafted per round.
        repeat: Runs per side.
        seq_id: The sequence to use.
        passes: A :class:`PassCounter` installed in ``ctx``.

    Returns:
        A ``SpeculativeComparison``: a dict that prints as a report (``print(c)``), of
        ``plain`` and ``speculative`` (``tokens_per_s``: the median over runs, ``runs_s`` and
        ``runs_cpu_s`` per run, and for the speculative side ``stats``, the last run's
        :meth:`SpeculativeStats.report`), ``speedup`` (the median over pairs of the speculative
        side's tokens/s over the plain side's; ``speedups`` per pair), ``speedup_cpu`` (the same
        in this thread's CPU time, ``time.thread_time``: with ``n_threads=1`` the decodes run in
        this thread, and time given to other processes does not count), ``same_tokens``,
        ``first_difference`` (the index of the first token where the sides differ, None when they
        agree), ``n_tokens`` and the ``tokens`` of each side.

    Raises:
        ValueError: As :func:`generate_speculative`, or ``repeat < 1``.
    """
    from .generation import generate

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if draft is None:
        draft = NgramDraft()
    toks = np.asarray(tokens, dtype=np.int32)
    make = sampler or Sampler.greedy
    wall: dict[str, list[float]] = {"plain": [], "speculative": []}
    cpu: dict[str, list[float]] = {"plain": [], "speculative": []}
    out: dict[str, list[int]] = {}
    stats: SpeculativeStats | None = None
    order = ["plain", "speculative"]
    clock, cpu_clock = time.perf_counter, time.thread_time
    for r in range(repeat):
        for side in order if r % 2 == 0 else order[::-1]:
            ctx.memory.seq_rm(seq_id)
            if toks.size > 1:
                ctx.prefill(toks[:-1], seq_id, 0)  # untimed, the same for both sides
            with make() as smpl:
                if side == "speculative":
                    draft.reset()
                t, c = clock(), cpu_clock()
                if side == "plain":
                    got = list(generate(ctx, toks[-1:], n_predict, smpl, seq_id))
                else:
                    s = generate_speculative(
                        ctx,
                        toks[-1:],
                        n_predict,
                        draft,
                        smpl,
                        seq_id=seq_id,
                        n_draft=n_draft,
                        passes=passes,
                        history=toks[:-1],
                    )
                    got = list(s)
                    stats = s.stats
                wall[side].append(clock() - t)
                cpu[side].append(cpu_clock() - c)
            out.setdefault(side, got)
    ctx.memory.seq_rm(seq_id)
    a, b = out["plain"], out["speculative"]
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    assert stats is not None

    def ratios(d: dict[str, list[float]]) -> list[float]:
        return [(len(b) / s) / (len(a) / p) for p, s in zip(d["plain"], d["speculative"])]

    return SpeculativeComparison(
        {
            "plain": {
                "tokens_per_s": len(a) / statistics.median(wall["plain"]),
                "runs_s": wall["plain"],
                "runs_cpu_s": cpu["plain"],
            },
            "speculative": {
                "tokens_per_s": len(b) / statistics.median(wall["speculative"]),
                "runs_s": wall["speculative"],
                "runs_cpu_s": cpu["speculative"],
                "stats": stats.report(),
            },
            "speedup": statistics.median(ratios(wall)),
            "speedups": ratios(wall),
            "speedup_cpu": statistics.median(ratios(cpu)),
            "speedups_cpu": ratios(cpu),
            "same_tokens": diff is None,
            "first_difference": diff,
            "n_tokens": len(b),
            "tokens": {"plain": a, "speculative": b},
            "n_draft": int(n_draft),
            "repeat": int(repeat),
        }
    )
