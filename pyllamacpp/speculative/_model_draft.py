"""A draft model in a context of its own: :class:`ModelDraft`, and the vocabulary check it needs."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .._lib import ffi, lib
from ..errors import KVCacheFullError
from ..sampling import Sampler
from ._checkpoint import _Rollback
from ._drafts import Draft
from ._layer_skip import layer_skip_gguf

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model


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
        from ..model import Model

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
        from ..model import Model

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
