"""``Sampler``: a ``llama_sampler`` chain (``llama_sampler_chain_init`` + ``llama_sampler_chain_add``).

Build it step by step, in the order the steps run::

    Sampler(model).penalties(64, 1.1).top_k(40).top_p(0.95).min_p(0.05).temp(0.8).dist(seed=42)
    Sampler.greedy()

A chain must end with a step that picks a token (``greedy`` or ``dist``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._handle import Handle, Owner
from ._lib import ffi, lib
from .errors import LlamaError

if TYPE_CHECKING:
    from .context import Context
    from .model import Model


class Sampler(Owner):
    def __init__(self, model: Model | None = None, *, no_perf: bool = True) -> None:
        self.model = model  # needed by steps that know the vocabulary (penalties, grammar)
        params = lib.llama_sampler_chain_default_params()
        params.no_perf = no_perf
        ptr = lib.llama_sampler_chain_init(params)
        if ptr == ffi.NULL:
            raise LlamaError("llama_sampler_chain_init() returned NULL", func="llama_sampler_chain_init")
        self._h = Handle(ptr, lib.llama_sampler_free)
        self.steps: list[str] = []

    @classmethod
    def greedy(cls) -> Sampler:
        return cls()._add(lib.llama_sampler_init_greedy(), "greedy")

    _what, _free = "sampler", "llama_sampler_free"  # Owner: ptr, closed, close, with-statement

    def _add(self, smpl, name: str) -> Sampler:
        if smpl == ffi.NULL:
            raise ValueError(f"llama.cpp refused the {name} sampler")
        lib.llama_sampler_chain_add(self.ptr, smpl)  # the chain owns it from here
        self.steps.append(name)
        return self

    # -- steps ---------------------------------------------------------------------------------
    def top_k(self, k: int) -> Sampler:
        return self._add(lib.llama_sampler_init_top_k(int(k)), f"top_k({k})")

    def top_p(self, p: float, min_keep: int = 1) -> Sampler:
        return self._add(lib.llama_sampler_init_top_p(float(p), int(min_keep)), f"top_p({p})")

    def min_p(self, p: float, min_keep: int = 1) -> Sampler:
        return self._add(lib.llama_sampler_init_min_p(float(p), int(min_keep)), f"min_p({p})")

    def temp(self, t: float) -> Sampler:
        return self._add(lib.llama_sampler_init_temp(float(t)), f"temp({t})")

    def penalties(self, last_n: int = 64, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0) -> Sampler:
        """``llama_sampler_init_penalties(n_vocab, ...)``: needs ``Sampler(model)``."""
        if self.model is None:
            raise ValueError("penalties: make the sampler with Sampler(model), it needs n_vocab")
        if repeat <= 0:
            raise ValueError("penalties: repeat must be > 0 (1.0 disables it)")
        return self._add(
            lib.llama_sampler_init_penalties(
                self.model.n_vocab, int(last_n), float(repeat), float(freq), float(present)
            ),
            f"penalties({last_n}, {repeat}, {freq}, {present})",
        )

    def grammar(self, model: Model, grammar: str, root: str = "root") -> Sampler:
        """A GBNF grammar (``llama_sampler_init_grammar``)."""
        from . import _log

        with _log.capture() as cap:
            smpl = lib.llama_sampler_init_grammar(model._vocab_ptr(), grammar.encode(), root.encode())
        if smpl == ffi.NULL:
            raise ValueError(f"grammar rejected by llama.cpp: {cap.reason() or 'parse error'}")
        return self._add(smpl, "grammar")

    def dist(self, seed: int = lib.LLAMA_DEFAULT_SEED) -> Sampler:
        """Pick a token at random from the distribution; deterministic for a fixed ``seed``."""
        return self._add(lib.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF), f"dist({seed})")

    def pick_greedy(self) -> Sampler:
        return self._add(lib.llama_sampler_init_greedy(), "greedy")

    # -- use -----------------------------------------------------------------------------------
    def sample(self, ctx: Context, i: int = -1) -> int:
        """``llama_sampler_sample(chain, ctx, i)``: a token from output ``i`` of the last batch
        (the chain accepts it, as llama.cpp does)."""
        if ctx.n_outputs == 0:
            raise IndexError("no outputs to sample from: the last decode asked for no logits")
        from . import _log

        with _log.capture() as cap:
            tok = lib.llama_sampler_sample(self.ptr, ctx.ptr, int(i))
        if tok < 0:
            raise IndexError(f"llama_sampler_sample() failed for output {i}: {cap.reason()}")
        return int(tok)

    def accept(self, token: int) -> None:
        """``llama_sampler_accept``: tell stateful steps (penalties, grammar) about a token."""
        lib.llama_sampler_accept(self.ptr, int(token))

    def reset(self) -> None:
        lib.llama_sampler_reset(self.ptr)

    def __repr__(self) -> str:
        return f"<Sampler {' -> '.join(self.steps) or '(empty)'}>"
