"""Continuous batching with a prefix cache: the loop of llama.cpp's ``examples/parallel`` and server.

A :class:`Scheduler` takes requests (a prompt, ``n_predict``, a sampler) at any time and runs up to
``n_seq_max`` of them at once in one context, one sequence each. Each :meth:`Scheduler.step` is one
``llama_decode`` of one batch that holds the pending token of every generating sequence, then
prompt chunks of newly admitted requests up to ``n_batch`` tokens in all (as the server's
``update_slots`` fills its batch). After the decode each sequence that asked for logits samples
its next token with its own :class:`~pyllamacpp.Sampler`, and the step returns what happened as
:class:`Event` s. A sequence whose request ended takes the next waiting request at the next step.

The cache convention is :mod:`pyllamacpp.generation`'s: a sampled token is decoded at the next
step, and the last one is never decoded. Every request's sequence starts at position 0.

Prefix cache: the scheduler keeps, per sequence, the tokens its KV cells hold. A new request's
prompt is compared with them; the longest common prefix (at most ``n_prompt - 1`` tokens, since the
last prompt token must be decoded for its logits) is not decoded again: the request's sequence
keeps those cells (``llama_memory_seq_rm`` of the rest) or shares them with
``llama_memory_seq_cp(src, dst, 0, n)`` from the sequence that holds them, running or finished.
A finished request's cells stay as cache until its sequence is needed by another request or the
KV cache runs out of cells. Sharing between sequences needs ``kv_unified=True``: with one stream
per sequence, llama.cpp copies only whole sequences between streams, so there a request reuses only
what its own sequence held (as the server without ``--kv-unified``).

Drafts (speculative decoding per request, as the server's per-slot draft): a request submitted
with ``draft=`` (a :class:`~pyllamacpp.speculative.Draft`, for example an ``NgramDraft``) puts its
pending token and up to ``n_draft`` drafted tokens into the step's batch, every row with logits;
after the decode it samples its rows in order with its own chain while the sampled token is the
drafted one (sample-and-compare, as :func:`~pyllamacpp.generate_speculative`), one event per
token, and the cells of the rejected rows are removed (``llama_memory_seq_rm``). Drafts take
batch rows before prompt chunks do, and only what the batch has left over one row per generating
sequence. They need a plain KV cache (no sliding window, no recurrent state).

Prefix store (the second tier, :class:`~pyllamacpp.prefix_store.PrefixStore`): with
``prefix_store=``, a request whose prompt the store holds more of (in whole chunks, at most
``n_prompt - 1`` tokens) than the prefix cache can give has its sequence emptied and the stored
chunks loaded into it (``llama_state_seq_set_data_ext``) before its prefill; once its prompt is all
decoded, the prompt's whole chunks the store lacks are stored. A restored cell holds the bytes a
decode of those tokens wrote, so the exactness above holds (flash attention off; with it on, cells
that land elsewhere can move logits in the last bits). It needs a plain KV cache; with
``kv_unified=False`` chunks stored from any sequence load into any other.
"""

from __future__ import annotations

import codecs
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from . import packing
from ._lib import lib
from .batch import Batch
from .errors import DecodeAborted, KVCacheFullError
from .sampling import Sampler

if TYPE_CHECKING:
    from .context import Context
    from .model import _TokenTable
    from .prefix_store import PrefixStore

FinishReason = Literal["eog", "n_predict", "ctx_full", "cancelled"]


_sample = lib.llama_sampler_sample


class Request:
    """One request of a :class:`Scheduler`: its prompt, sampler, and what came of it.

    Made by :meth:`Scheduler.submit`; read it at any time (the fields grow as it runs). Its text
    comes from the tokens' bytes (``llama_token_to_piece``) through an incremental UTF-8 decoder, as
    :class:`~pyllamacpp.Detokenizer` makes it: no piece ends inside a character.

    Attributes:
        id: Its number, in submission order (0, 1, ...).
        prompt: The prompt's token ids (int32).
        n_predict: Most tokens to sample; 0 prefills only; -1 has no limit.
        sampler: Its own sampler chain (greedy unless one was given).
        seq_id: The sequence it decodes in; None while it waits.
        tokens: The sampled tokens so far (an end-of-generation token is the last one).
        finish_reason: ``"eog"``, ``"n_predict"``, ``"ctx_full"`` or ``"cancelled"``; None while
            it waits or runs.
        error: The :class:`~pyllamacpp.KVCacheFullError` that ended it with ``"ctx_full"``.
        draft: Its :class:`~pyllamacpp.speculative.Draft`, or None.
        n_draft: The most tokens drafted per step.
        n_drafted: Drafted tokens verified so far.
        n_accepted: Drafted tokens its sampler agreed with.
        drafted_at: Per draft position (index 0: the first drafted token), steps that drafted it.
        accepted_at: Per draft position, steps that accepted it.
        n_prompt_reused: Prompt tokens whose KV cells came from the prefix cache or the prefix
            store (not decoded).
        n_prompt_restored: Of those, the tokens the prefix store loaded (0 without a store).
        n_prompt_decoded: Prompt tokens decoded for it.
        reused_from: The sequence whose cells it reused (its own, or the one ``seq_cp`` copied
            from); None when it reused nothing or its cells came from the prefix store.
        t_submit: ``time.perf_counter()`` at submission.
        t_start: When it got a sequence (None while waiting).
        t_first_token: When its first token was sampled.
        t_end: When it finished.

    Args:
        sched: The :class:`Scheduler` it was submitted to.
        rid: Its number.
        prompt: The prompt's token ids (int32, checked by ``submit``).
        n_predict: Most tokens to sample.
        sampler: Its sampler chain.
        info: The model's per-token table of bytes, end-of-generation flags and text (``Model._tokens``).
    """

    __slots__ = (
        "id",
        "prompt",
        "n_predict",
        "sampler",
        "seq_id",
        "tokens",
        "finish_reason",
        "error",
        "n_prompt_reused",
        "n_prompt_restored",
        "n_prompt_decoded",
        "reused_from",
        "t_submit",
        "t_start",
        "t_first_token",
        "t_end",
        "_pieces",
        "_info",
        "_utf8",
        "_dec",
        "_i",
        "_chunk",
        "_out",
        "_pending",
        "_cancel",
        "_sched",
        "_s",
        "_sptr",
        "draft",
        "n_draft",
        "n_drafted",
        "n_accepted",
        "drafted_at",
        "accepted_at",
        "_hist",
        "_drafted",
    )

    def __init__(
        self, sched: Scheduler, rid: int, prompt: np.ndarray, n_predict: int, sampler: Sampler, info: _TokenTable
    ) -> None:
        self._sched = sched
        self._s = -1  # seq_id as a plain int, for the per-step code
        self._sptr: Any = None  # the sampler's pointer, taken when the batch is filled
        self.id, self.prompt, self.n_predict, self.sampler = rid, prompt, n_predict, sampler
        self.seq_id: int | None = None
        self.tokens: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: KVCacheFullError | None = None
        self.n_prompt_reused = 0
        self.n_prompt_restored = 0
        self.n_prompt_decoded = 0
        self.reused_from: int | None = None
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first_token: float | None = None
        self.t_end: float | None = None
        self._pieces: list[str] = []
        self._info = info
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._utf8 = self._dec.decode
        self._i = 0  # next prompt index to decode
        self._chunk = 0  # prompt tokens in this step's batch
        self._out = -1  # output index of its logits in this step's batch
        self._pending = -1  # sampled, not yet decoded
        self._cancel = False
        self.draft: Any = None
        self.n_draft = 0
        self.n_drafted = 0
        self.n_accepted = 0
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []
        self._hist: list[int] = []  # prompt + sampled tokens, for the draft
        self._drafted: list[int] = []  # this step's drafted tokens

    @property
    def n_prompt(self) -> int:
        """How many prompt tokens."""
        return int(self.prompt.size)

    @property
    def text(self) -> str:
        """The sampled tokens' text so far (UTF-8-safe pieces joined; control tokens give none)."""
        return "".join(self._pieces)

    @property
    def done(self) -> bool:
        """Whether it finished (``finish_reason`` is set)."""
        return self.finish_reason is not None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from submission to its first sampled token (waiting included); None before it."""
        return None if self.t_first_token is None else self.t_first_token - self.t_submit

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens sampled per second after the first (as the server's ``predicted_per_second``).

        None until it finished with at least two tokens.
        """
        if self.t_end is None or self.t_first_token is None or len(self.tokens) < 2:
            return None
        dt = self.t_end - self.t_first_token
        return (len(self.tokens) - 1) / dt if dt > 0 else None

    def cancel(self) -> None:
        """Stop it at the next step (``finish_reason`` ``"cancelled"``); its cells stay as cache.

        A request that already finished keeps its ``finish_reason``.
        """
        if self.finish_reason is None:
            self._cancel = True
            self._sched._n_cancel += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Drafted tokens accepted per drafted token verified (None before any)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else None

    def report(self) -> dict:
        """The per-request figures as a dict (JSON-ready).

        Returns:
            ``id``, ``seq_id``, ``n_prompt``, ``n_prompt_reused``, ``n_prompt_decoded``,
            ``reused_from``, ``n_tokens``, ``finish_reason``, ``time_to_first_token_s``,
            ``tokens_per_s``, ``text``; with a prefix store also ``n_prompt_restored``; for a
            request with a draft also ``n_draft``,
            ``n_drafted``, ``n_accepted``, ``acceptance_rate`` and ``acceptance_at`` (per draft
            position: steps that accepted it / steps that drafted it).
        """
        out: dict[str, Any] = {
            "id": self.id,
            "seq_id": self.seq_id,
            "n_prompt": self.n_prompt,
            "n_prompt_reused": self.n_prompt_reused,
            "n_prompt_decoded": self.n_prompt_decoded,
            "reused_from": self.reused_from,
            "n_tokens": len(self.tokens),
            "finish_reason": self.finish_reason,
            "time_to_first_token_s": self.time_to_first_token,
            "tokens_per_s": self.tokens_per_s,
            "text": self.text,
        }
        if self._sched.prefix_store is not None:
            out["n_prompt_restored"] = self.n_prompt_restored
        if self.draft is not None:
            out.update(
                n_draft=self.n_draft,
                n_drafted=self.n_drafted,
                n_accepted=self.n_accepted,
                acceptance_rate=self.acceptance_rate,
                acceptance_at=[a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)],
            )
        return out

    def __repr__(self) -> str:
        state = self.finish_reason or ("waiting" if self.seq_id is None else "running")
        return (
            f"<Request {self.id} seq {self.seq_id} {state}: prompt {self.n_prompt} "
            f"(reused {self.n_prompt_reused}), {len(self.tokens)} tokens>"
        )


class Event(NamedTuple):
    """What one step did for one request: a sampled token, or the end of the request.

    Attributes:
        request: The :class:`Request`.
        token: The sampled token id; None for an end without a token (``"ctx_full"``,
            ``"cancelled"``, or ``n_predict=0``).
        text: The text this token completes ("" while a UTF-8 character is incomplete; at the end,
            what was held back).
        finish_reason: None, or how the request ended (this is its last event).
    """

    request: Request
    token: int | None
    text: str
    finish_reason: FinishReason | None


_new_event: Any = tuple.__new__  # Event from a tuple without NamedTuple's Python-level __new__


class Scheduler:
    """Continuous batching over one context: many requests, one ``llama_decode`` per step.

    The scheduler uses every sequence of ``ctx`` (ids ``0..n_seq_max-1``) and clears them when it
    is made (``llama_memory_seq_rm(mem, seq, -1, -1)`` for each); leave the context to it while it runs.
    See the module's docstring for the batch it builds and the prefix cache.

    Args:
        ctx: The context; its ``n_seq_max`` is how many requests run at once.
        prefix_cache: Reuse cached prompt prefixes (default True). Across sequences only with
            ``kv_unified=True``; otherwise a request reuses what its own sequence held. Off, whatever
            is asked, for a model with a sliding window (``n_swa > 0``) or a recurrent or hybrid
            memory (:attr:`prefix_cache` says which).
        prefix_store: A :class:`~pyllamacpp.prefix_store.PrefixStore`: before a request's prefill
            the longest stored prefix of its prompt is loaded when the prefix cache holds less of
            it, and after it the prompt's new whole chunks are stored (None: no store).

    Raises:
        ValueError: ``n_batch`` is smaller than ``n_seq_max`` (a step could not hold one token per
            sequence), or a prefix store with a memory it cannot serve here (a sliding window, a
            recurrent or hybrid memory: the message says which).
        TypeError: ``prefix_store`` is not a :class:`~pyllamacpp.prefix_store.PrefixStore`.
        ClosedError: The context is closed.
    """

    defer_min_tokens = 16
    """A waiting request whose prompt shares at least this many more tokens with a prompt being
    prefilled than with any cache waits for that prefill (a step or so) and shares its cells."""

    def __init__(self, ctx: Context, *, prefix_cache: bool = True, prefix_store: PrefixStore | None = None) -> None:
        n_seq = ctx.n_seq_max
        if ctx.n_batch < n_seq:
            raise ValueError(f"n_batch {ctx.n_batch} < n_seq_max {n_seq}: a step needs one token per sequence")
        self.ctx, self.model = ctx, ctx.model
        self.n_seq_max, self.n_batch = n_seq, ctx.n_batch
        model = ctx.model
        # cutting a sequence at a position needs a plain KV cache: a sliding window drops early
        # cells as a sequence moves on, and a recurrent state has no positions to cut at
        self.plain_kv = not (
            model.n_swa or lib.llama_model_is_recurrent(model.ptr) or lib.llama_model_is_hybrid(model.ptr)
        )
        """Whether the memory is one plain KV cache (no sliding window, no recurrent state)."""
        self.prefix_cache = bool(prefix_cache) and self.plain_kv
        """Whether prompt prefixes are reused: as asked, and only with a plain KV cache."""
        self.kv_unified = bool(ctx.params.kv_unified) or n_seq == 1
        """Whether cells can be shared between sequences (one KV stream)."""
        if prefix_store is not None:
            from .prefix_store import PrefixStore

            if not isinstance(prefix_store, PrefixStore):
                raise TypeError(
                    f"prefix_store must be a pyllamacpp.prefix_store.PrefixStore, got {type(prefix_store).__name__}"
                )
            prefix_store.keys(ctx, np.zeros(0, np.int32))  # refuses a memory it cannot serve, before any request
            if model.n_swa:
                raise ValueError(
                    f"a scheduler keeps a prefix store with a plain KV cache only: {model.path.name} has "
                    f"sliding-window layers (n_swa {model.n_swa}), whose cells a prefill keeps only at the chunk "
                    "it ends on; feed its prompts with PrefixStore.prefill, which stops at every chunk's end"
                )
        self.prefix_store = prefix_store
        """The :class:`~pyllamacpp.prefix_store.PrefixStore` (the second tier), or None."""
        self._n_vocab = self.model.n_vocab
        self._n_ctx_seq = ctx.n_ctx_seq
        self._batch = Batch(self.n_batch, 1, model=self.model)
        self._order = packing.WorkOrder(self._batch)  # each step's batch
        self._flags = self._batch._logits  # the logits flags, read before each sample
        # per sequence: how many tokens its cells hold (positions 0..n-1: the first n of its last
        # request's prompt + sampled tokens), that request, who runs in it, when it was last used
        self._n_held = [0] * n_seq
        self._owner: list[Request | None] = [None] * n_seq
        self._running: list[Request | None] = [None] * n_seq
        self._last_used = [0] * n_seq
        self._waiting: deque[Request] = deque()
        self._gen: list[Request] = []  # have a sampled token to decode
        self._prefill: list[Request] = []  # admitted, prompt not all decoded
        self._samplers: set[int] = set()  # id() of the samplers of live requests
        self._drafts: set[int] = set()  # id() of the drafts of live requests
        self._no_drafts = False  # this step's batch is filled without drafts (the cache was full)
        self._next_id = 0
        self._n_cancel = 0  # cancel() calls not yet handled
        self.n_steps = 0
        """Decodes run so far (one per step that had work)."""
        self.n_prompt_decoded = 0
        """Prompt tokens decoded so far, all requests."""
        self.n_prompt_reused = 0
        """Prompt tokens reused from the prefix cache or the prefix store so far, all requests."""
        self.n_prompt_restored = 0
        """Of those, the tokens the prefix store loaded."""
        self.n_tokens = 0
        """Tokens sampled so far, all requests."""
        for s in range(n_seq):  # one by one: a recurrent memory refuses seq_id -1
            ctx.memory.seq_rm(s)

    # -- requests ------------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | bytes | npt.ArrayLike,
        n_predict: int,
        sampler: Sampler | None = None,
        *,
        special: bool = False,
        draft: Any = None,
        n_draft: int = 4,
    ) -> Request:
        """Queue a request; it starts at the next step that has a free sequence.

        May be called at any time, also between steps or while iterating :meth:`run`.

        Args:
            prompt: Text (``llama_tokenize``, with the model's BOS) or token ids (at least one).
            n_predict: Most tokens to sample; 0 prefills only; -1 has no limit.
            sampler: Its :class:`~pyllamacpp.Sampler` (greedy when None); one sampler serves one
                live request (its penalties and grammar state are that request's).
            special: Render special (control) tokens in the text pieces.
            draft: A :class:`~pyllamacpp.speculative.Draft` (``NgramDraft()``, a ``ModelDraft``
                of its own...) whose tokens each step verifies in the same batch; one draft
                serves one live request. None: no drafts.
            n_draft: The most tokens drafted per step (with ``draft``).

        Returns:
            The :class:`Request`.

        Raises:
            ValueError: No tokens, a token outside the vocabulary, a prompt longer than the
                context's ``n_ctx_seq``, ``n_predict < -1``, or a sampler already used by a live
                request, a draft on a memory that cannot drop a suffix (:attr:`plain_kv` False),
                a draft already used by a live request, ``n_draft < 1``, or a draft whose
                model's vocabulary differs (``Draft.bind``).
            TypeError: ``sampler`` is not a :class:`~pyllamacpp.Sampler`, or ``draft`` not a
                :class:`~pyllamacpp.speculative.Draft`.
            ClosedError: The context, model or sampler is closed.
        """
        self.ctx.ptr  # noqa: B018 - raises ClosedError once the context is closed
        if isinstance(prompt, (str, bytes)):
            toks = self.model.tokenize(prompt)
        else:
            toks = np.asarray(prompt)
            if toks.size and toks.dtype.kind not in "iu":
                raise ValueError(f"prompt tokens must be integers, got dtype {toks.dtype}")
            toks = toks.astype(np.int32, copy=True).reshape(-1)  # a copy: the caller may reuse the array
        if toks.size == 0:
            raise ValueError("submit: the prompt has no tokens")
        if toks.min() < 0 or toks.max() >= self._n_vocab:
            bad = int(toks[(toks < 0) | (toks >= self._n_vocab)][0])
            raise ValueError(f"prompt token {bad} is outside the vocabulary [0, {self._n_vocab})")
        if toks.size > self._n_ctx_seq:
            raise ValueError(f"the prompt has {toks.size} tokens, more than the context's n_ctx_seq {self._n_ctx_seq}")
        n_predict = int(n_predict)
        if n_predict < -1:
            raise ValueError(f"n_predict must be >= -1 (-1: no limit), got {n_predict}")
        if sampler is None:
            sampler = Sampler.greedy()
        elif not isinstance(sampler, Sampler):
            raise TypeError(f"sampler must be a pyllamacpp.Sampler, got {type(sampler).__name__}")
        sampler.ptr  # noqa: B018 - raises ClosedError for a closed sampler
        if id(sampler) in self._samplers:
            raise ValueError("this sampler is used by another live request: give each request its own")
        if draft is not None:
            from .speculative import Draft

            if not isinstance(draft, Draft):
                raise TypeError(f"draft must be a pyllamacpp.speculative.Draft, got {type(draft).__name__}")
            if not self.plain_kv:
                raise ValueError(
                    "drafts need a memory that can drop a suffix; this model's cannot (a sliding window, "
                    "or a recurrent or hybrid memory): use generate_speculative, which checkpoints it"
                )
            n_draft = int(n_draft)
            if n_draft < 1:
                raise ValueError(f"n_draft must be >= 1, got {n_draft}")
            if id(draft) in self._drafts:
                raise ValueError("this draft is used by another live request: give each request its own")
            draft.bind(self.model)
            self._drafts.add(id(draft))
        self._samplers.add(id(sampler))
        req = Request(self, self._next_id, toks, n_predict, sampler, self.model._tokens[bool(special)])
        if draft is not None:
            req.draft, req.n_draft = draft, n_draft
        self._next_id += 1
        self._waiting.append(req)
        return req

    @property
    def n_waiting(self) -> int:
        """Requests submitted and not started."""
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        """Requests that hold a sequence."""
        return len(self._gen) + len(self._prefill)

    @property
    def idle(self) -> bool:
        """Whether no request waits or runs."""
        return not (self._waiting or self._gen or self._prefill)

    def cached(self) -> dict[int, int]:
        """What the prefix cache holds: tokens in KV cells per sequence (running sequences included).

        Returns:
            ``{seq_id: n_tokens}`` for every sequence that holds any.
        """
        return {s: n for s, n in enumerate(self._n_held) if n}

    def clear_cache(self) -> None:
        """Free the cells of every sequence no request runs in (``llama_memory_seq_rm``).

        Raises:
            ClosedError: The context is closed.
        """
        for s in range(self.n_seq_max):
            if self._running[s] is None and self._n_held[s]:
                self._drop(s)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> Iterator[Event]:
        """Step until no request waits or runs, yielding each step's events.

        Requests submitted while iterating are run too.

        Yields:
            :class:`Event` s, in the order of :meth:`step`.

        Raises:
            Whatever :meth:`step` raises.
        """
        while self._waiting or self._gen or self._prefill:
            yield from self.step()

    def step(self) -> list[Event]:
        """Admit waiting requests, decode one batch (``llama_decode``), sample, and say what happened.

        The batch holds one token per generating sequence, then prompt chunks of admitted
        requests, at most ``n_batch`` tokens. When ``llama_decode`` finds no KV cell (return 1),
        cached sequences no request runs in are freed one by one, then the request with the most
        tokens in memory ends with ``"ctx_full"`` (its cells freed), until the batch fits; the
        scheduler goes on with the others.

        Returns:
            The events of this step (empty when there was nothing to do).

        Raises:
            DecodeAborted: ``ctx.abort()`` stopped the decode; what it put in memory was removed,
                so the next step retries it (with a recurrent memory, which cannot be cut, the
                requests whose state moved on end ``"cancelled"``).
            DecodeInterrupted: Ctrl-C stopped the decode (a KeyboardInterrupt); as above (also for
                a Ctrl-C delivered right after a decode that completed).
            DecodeError: Another ``llama_decode`` failure (``InvalidBatchError``...).
            ClosedError: The context is closed, or a running request's sampler is (before the
                decode; ``cancel()`` that request to go on).
        """
        events: list[Event] = []
        if self._n_cancel:
            self._cancelled(events)
        if self._waiting:
            self._admit()
        if not (self._gen or self._prefill):
            return events
        order = self._order
        while True:
            self._fill(order)
            try:
                order.decode(self.ctx)
                break
            except KVCacheFullError as e:
                if e.__context__ is not None:
                    raise
                if not self._no_drafts and any(r._drafted for r in self._gen):
                    self._no_drafts = True  # drafts first: they are only a speed-up
                    continue
                if self._evict_cache():
                    continue
                self._end(
                    max(self._gen + self._prefill, key=lambda r: self._n_held[r._s]), "ctx_full", events.append, e
                )
                if not (self._gen or self._prefill):
                    return events
            except (DecodeAborted, KeyboardInterrupt):  # DecodeInterrupted, or Ctrl-C right after the decode
                self._no_drafts = False
                self._rollback()
                raise
            except BaseException:
                self._no_drafts = False
                for r in self._gen:
                    r._drafted = []
                raise
        self._no_drafts = False
        self.n_steps += 1
        self._decoded(events)
        return events

    # -- internals -----------------------------------------------------------------------------
    def _held(self, s: int, n: int) -> np.ndarray:
        """The first ``n`` tokens sequence ``s`` holds (made when asked: nothing per step)."""
        r = self._owner[s]
        assert r is not None
        if n <= r.prompt.size:
            return r.prompt[:n]
        return np.concatenate([r.prompt, np.asarray(r.tokens[: n - r.prompt.size], np.int32)])

    def _lcp(self, s: int, toks: np.ndarray) -> int:
        """How many of ``toks`` sequence ``s`` holds, from its first position."""
        n = min(self._n_held[s], toks.size)
        return packing.common_prefix(self._held(s, n), toks) if n else 0  # a sequence never used has no owner

    def _drop(self, s: int) -> None:
        self.ctx.memory.seq_rm(s)
        self._n_held[s] = 0

    def _cancelled(self, events: list[Event]) -> None:
        self._n_cancel = 0
        if any(r._cancel for r in self._waiting):
            for r in [r for r in self._waiting if r._cancel]:
                self._waiting.remove(r)
                self._end(r, "cancelled", events.append)
        for r in [r for r in self._gen + self._prefill if r._cancel]:
            self._end(r, "cancelled", events.append)

    def _admit(self) -> None:
        free = [s for s in range(self.n_seq_max) if self._running[s] is None]
        deferred: list[Request] = []
        while self._waiting and free:
            r = self._waiting.popleft()
            if self._defer(r):
                deferred.append(r)
                continue
            s = self._pick(r, free)
            free.remove(s)
            self._start(r, s)
        self._waiting.extendleft(reversed(deferred))

    def _defer(self, r: Request) -> bool:
        """Wait for a running prefill that will hold at least ``defer_min_tokens`` more of this prompt
        than any sequence holds now (requests with one system prompt submitted together)."""
        if not (self.prefix_cache and self.kv_unified and self._prefill):
            return False
        n_max = r.prompt.size - 1
        held = max((min(self._lcp(s, r.prompt), n_max) for s in range(self.n_seq_max)), default=0)
        for p in self._prefill:
            if min(packing.common_prefix(p.prompt, r.prompt), n_max) >= held + self.defer_min_tokens:
                return True
        return False

    def _pick(self, r: Request, free: list[int]) -> int:
        """The free sequence that holds the longest prefix of the prompt, else an empty one, else the
        least recently used (its cache is dropped)."""
        if not self.prefix_cache:
            return free[0]
        return max(free, key=lambda s: (self._lcp(s, r.prompt), self._n_held[s] == 0, -self._last_used[s]))

    def _start(self, r: Request, s: int) -> None:
        mem, toks = self.ctx.memory, r.prompt
        reuse, src = 0, s
        if self.prefix_cache:
            n_max = toks.size - 1  # the last prompt token is decoded: its logits give the first token
            reuse = min(self._lcp(s, toks), n_max)
            if self.kv_unified:
                for o in range(self.n_seq_max):
                    if o != s and self._n_held[o] > reuse:
                        n = min(self._lcp(o, toks), n_max)
                        if n > reuse:
                            reuse, src = n, o
        restored = 0
        if self.prefix_store is not None and self._stored(toks) > reuse:
            restored, reuse, src = self._restore(r, s, reuse, src)
        if src == s:
            if self._n_held[s] > reuse:
                mem.seq_rm(s, reuse, -1)
        else:
            if self._n_held[s]:
                mem.seq_rm(s)
            packing.fork(self.ctx, src, (s,), 0, reuse)
        self._n_held[s], self._owner[s] = reuse, r  # what s holds is a prefix of r's prompt
        r.seq_id, r._s, r.n_prompt_reused, r._i = s, s, reuse, reuse
        r.n_prompt_restored = restored
        r.reused_from = src if reuse and not restored else None
        r.t_start = time.perf_counter()
        if r.draft is not None:
            r._hist = toks.tolist()
            r.draft.begin(list(r._hist))
        self.n_prompt_reused += reuse
        self.n_prompt_restored += restored
        self._running[s] = r
        self._prefill.append(r)

    def _stored(self, toks: np.ndarray) -> int:
        """How many of the prompt's first tokens the store holds in whole chunks (all but the last
        token at most), found by key without reading a chunk."""
        store = self.prefix_store
        assert store is not None
        try:
            keys = store.keys(self.ctx, toks[: toks.size - 1])
            n = 0
            while n < len(keys) and store.backend.find(keys[n]) is not None:
                n += 1
        except OSError:  # a store that cannot be reached: restore() says so when it is asked
            return 0
        return n * store.chunk_size

    def _restore(self, r: Request, s: int, reuse: int, src: int) -> tuple[int, int, int]:
        """Empty sequence ``s`` and load the longest stored prefix of ``r``'s prompt into it.

        Returns ``(restored, reuse, src)`` for :meth:`_start`: when a chunk failed to load and the
        prefix cache held more in another sequence, that sequence is forked from instead."""
        store = self.prefix_store
        assert store is not None
        mem = self.ctx.memory
        if self._n_held[s]:
            mem.seq_rm(s)
            self._n_held[s] = 0
        got = store.restore(self.ctx, s, r.prompt)
        if got < reuse and src != s:  # a chunk failed its checksum: the other sequence's cells give more
            mem.seq_rm(s)
            return 0, reuse, src
        return got, got, s

    def _fill(self, order: packing.WorkOrder) -> None:
        """The step's work order: each generating request's pending token (and its drafted tokens),
        every one with an output, then prompt chunks of the admitted requests in what is left.
        A request's ``_out`` is the batch slot of its (first) row, as ``llama_sampler_sample`` takes it."""
        order.clear()
        # the pending tokens were sampled by llama.cpp from this vocabulary (drafts are checked by
        # _draft), the seq ids are this context's: the order's unchecked per-token path
        add, n_held = order.add_trusted, self._n_held
        slack = 0 if self._no_drafts else self.n_batch - len(self._gen)  # rows drafts may take
        for r in self._gen:
            s = r._s
            r._sptr = r.sampler.ptr  # a closed sampler raises here, before a draft or the decode runs
            if r.draft is None:
                r._out = add((r._pending,), n_held[s], s, True)
            else:
                d = self._draft(r, slack) if slack > 0 else []
                r._drafted = d
                r._out = add([r._pending, *d], n_held[s], s, True)
                slack -= len(d)
        budget = order.room
        for r in self._prefill:
            n = min(budget, r.prompt.size - r._i)
            r._chunk = n
            if n <= 0:
                continue
            last = r._i + n == r.prompt.size
            if last:
                r._sptr = r.sampler.ptr
            piece = order.add(r.prompt[r._i : r._i + n], r._s, r._i, "last" if last else "none")
            r._out = piece.slots.stop - 1
            budget -= n

    def _draft(self, r: Request, slack: int) -> list[int]:
        """Up to ``n_draft`` tokens from ``r``'s draft for this step: no more than the batch has left,
        than positions remain in the sequence, or than tokens remain to sample after the pending one."""
        n = min(r.n_draft, slack, self._n_ctx_seq - self._n_held[r._s] - 1)
        if r.n_predict >= 0:
            n = min(n, r.n_predict - len(r.tokens) - 1)  # the verify samples up to n + 1 tokens
        if n <= 0:
            return []
        d = [int(t) for t in r.draft.draft(r._hist, n)][:n]
        for t in d:
            if not 0 <= t < self._n_vocab:
                raise ValueError(
                    f"request {r.id}'s draft proposed token {t}, outside the vocabulary [0, {self._n_vocab})"
                )
        return d

    def _verify(self, r: Request, cptr: Any, ev: Callable[[Event], None]) -> None:
        """Sample ``r``'s rows in order while its sampler agrees with the draft; drop the rest's cells."""
        d, r._drafted = r._drafted, []
        s, n_held = r._s, self._n_held
        end = n_held[s] + 1 + len(d)  # the positions the verify rows took
        n_held[s] += 1  # the pending token
        r.n_drafted += len(d)
        while len(r.drafted_at) < len(d):
            r.drafted_at.append(0)
            r.accepted_at.append(0)
        for j in range(len(d)):
            r.drafted_at[j] += 1
        base = r._out
        for j in range(len(d) + 1):
            r._out = base + j
            self._sample(r, cptr, ev)
            if r.finish_reason is not None or j == len(d) or r._pending != d[j]:
                break
            self._gen.pop()  # _sample queued r for the next step; it goes on from the next row instead
            n_held[s] += 1  # the drafted token's cell holds what was sampled
            r.n_accepted += 1
            r.accepted_at[j] += 1
        if n_held[s] < end:
            self.ctx.memory.seq_rm(s, n_held[s], -1)  # the cells of the rows not kept

    def _decoded(self, events: list[Event]) -> None:
        n_held = self._n_held
        gen = self._gen
        self._gen = []
        sample, cptr, ev = self._sample, self.ctx.ptr, events.append
        for r in gen:
            if r._drafted:
                self._verify(r, cptr, ev)
                continue
            n_held[r._s] += 1
            sample(r, cptr, ev)
        prefill, still = self._prefill, []
        self._prefill = []  # _end may remove from it while this loop runs
        for r in prefill:
            n = r._chunk
            if n <= 0:
                still.append(r)
                continue
            i = r._i
            n_held[r._s] = i + n
            r._i = i + n
            r.n_prompt_decoded += n
            self.n_prompt_decoded += n
            r._chunk = 0
            if r._i < r.prompt.size:
                still.append(r)
                continue
            # the whole prompt is in its cells: store its new chunks, after its first token is sampled
            # (not in its time to first token) unless that ends it and frees the cells (no prefix cache)
            store = self.prefix_store
            if store is not None and (r.n_predict == 0 or not self.prefix_cache):
                store.save(self.ctx, r._s, r.prompt)
                store = None
            if r.n_predict == 0:
                self._end(r, "n_predict", ev)
            else:
                self._sample(r, cptr, ev)
                if store is not None:
                    store.save(self.ctx, r._s, r.prompt)
        self._prefill = still

    def _sample(self, r: Request, cptr: Any, ev: Callable[[Event], None]) -> None:
        # llama_sampler_sample straight: the output index is this batch's own slot, the pointer was
        # checked by _fill; Sampler.sample's checks and log capture cost more than the rest. One
        # check stays: a slot without its logits flag would abort the process in the sampler
        # (GGML_ASSERT), so a packing fault raises here instead
        if not self._flags[r._out]:
            raise RuntimeError(f"request {r.id}: slot {r._out} of this step's batch has no logits to sample from")
        tok = _sample(r._sptr, cptr, r._out)
        if tok < 0:
            raise IndexError(f"llama_sampler_sample() failed for output {r._out} of request {r.id}")
        toks = r.tokens
        toks.append(tok)
        if r.draft is not None:
            r._hist.append(tok)
        self.n_tokens += 1
        if r.t_first_token is None:
            r.t_first_token = time.perf_counter()
        data, eog, piece = r._info[tok]
        if piece is None or r._dec.buffer:  # not whole characters by itself, or bytes held back
            piece = r._utf8(data)
        reason: FinishReason
        if eog:
            reason = "eog"
        elif len(toks) == r.n_predict:
            reason = "n_predict"  # its last token is not decoded
        else:
            r._pending = tok
            self._gen.append(r)
            r._pieces.append(piece)
            ev(_new_event(Event, (r, tok, piece, None)))  # tuple.__new__: NamedTuple's own __new__ is Python
            return
        piece += r._utf8(b"", True)
        r._pieces.append(piece)
        self._end(r, reason, ev, token=tok, piece=piece)

    def _end(
        self,
        r: Request,
        reason: FinishReason,
        ev: Callable[[Event], None],
        error: KVCacheFullError | None = None,
        *,
        token: int | None = None,
        piece: str | None = None,
    ) -> None:
        r.finish_reason, r.error, r.t_end = reason, error, time.perf_counter()
        self._samplers.discard(id(r.sampler))
        if r.draft is not None:
            self._drafts.discard(id(r.draft))
            r._drafted = []
        s = r.seq_id
        if s is not None:
            if r in self._gen:
                self._gen.remove(r)
            if r in self._prefill:
                self._prefill.remove(r)
            self._running[s] = None
            self._last_used[s] = self.n_steps
            if not self.prefix_cache or reason == "ctx_full":
                self._drop(s)
        if piece is None:  # an end without a token: what the UTF-8 decoder held back
            piece = r._utf8(b"", True)
            r._pieces.append(piece)
        ev(Event(r, token, piece, reason))

    def _evict_cache(self) -> bool:
        """Free the least recently used sequence that holds cells and runs no request."""
        idle = [s for s in range(self.n_seq_max) if self._running[s] is None and self._n_held[s]]
        if not idle:
            return False
        self._drop(min(idle, key=lambda s: self._last_used[s]))
        return True

    def _rollback(self) -> None:
        """After an abort: remove what the batch put in memory (ubatches computed before it stay).

        A recurrent state cannot be cut at a position (``llama_memory_seq_rm`` returns false): a
        request whose state moved on ends ``"cancelled"``, its sequence cleared."""
        mem = self.ctx.memory
        lost: list[Event] = []
        for r in self._gen + self._prefill:
            r._chunk = 0
            r._drafted = []
            if not mem.seq_rm(r._s, self._n_held[r._s], -1):
                self._end(r, "cancelled", lost.append)
                self._drop(r._s)

    def __repr__(self) -> str:
        return (
            f"<Scheduler n_seq_max={self.n_seq_max} running={self.n_running} waiting={self.n_waiting} "
            f"prefix_cache={self.prefix_cache} kv_unified={self.kv_unified}>"
        )
