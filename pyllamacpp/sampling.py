"""``Sampler``: a ``llama_sampler`` chain (``llama_sampler_chain_init`` + ``llama_sampler_chain_add``).

Build it step by step, in the order the steps run::

    Sampler(model).penalties(64, 1.1).top_k(40).top_p(0.95).min_p(0.05).temp(0.8).dist(seed=42)
    Sampler.greedy()
    Sampler.common(seed=42)   # llama.cpp's common_params_sampling defaults (top_k 40 ... temp 0.8)

A chain must end with a step that picks a token (``greedy`` or ``dist``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from ._handle import Handle, Owner
from ._lib import ffi, lib
from .errors import LlamaError

if TYPE_CHECKING:
    from .context import Context
    from .model import Model


class Sampler(Owner):
    """A ``llama_sampler`` chain: steps added in the order they run, ending with a step that picks a token.

    Wraps ``llama_sampler_chain_init`` (``llama_sampler_chain_default_params``); each step method
    adds one ``llama_sampler_init_*`` sampler with ``llama_sampler_chain_add`` and returns the
    chain, so steps chain. ``llama_sampler_free`` frees it on ``close()``.

    Args:
        model: The model, needed by steps that know the vocabulary (``penalties``).
        no_perf: ``llama_sampler_chain_params.no_perf``: skip llama.cpp's timing counters.

    Raises:
        LlamaError: ``llama_sampler_chain_init`` returned NULL.
    """

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
        """A new chain of one step, ``llama_sampler_init_greedy``: always the most likely token.

        Returns:
            The new sampler.
        """
        return cls()._add(lib.llama_sampler_init_greedy(), "greedy")

    @classmethod
    def common(cls, seed: int = lib.LLAMA_DEFAULT_SEED, model: Model | None = None) -> Sampler:
        """A new chain with the defaults of llama.cpp's ``common_params_sampling`` (llama-cli, server).

        ``top_k(40) -> top_p(0.95) -> min_p(0.05) -> temp(0.8) -> dist(seed)``: the steps of
        ``common_sampler_init`` that change anything at their defaults (penalties, DRY, typical-p,
        XTC and top-n-sigma are off there).

        Args:
            seed: The RNG seed of the ``dist`` step (``LLAMA_DEFAULT_SEED`` draws a random one).
            model: Kept as :attr:`model`, for steps added later that need the vocabulary.

        Returns:
            The new sampler.

        Raises:
            LlamaError: ``llama_sampler_chain_init`` returned NULL.
        """
        return cls(model).top_k(40).top_p(0.95).min_p(0.05).temp(0.8).dist(seed)

    _what, _free = "sampler", "llama_sampler_free"  # Owner: ptr, closed, close, with-statement

    def _add(self, smpl, name: str) -> Sampler:
        if smpl == ffi.NULL:
            raise ValueError(f"llama.cpp refused the {name} sampler")
        lib.llama_sampler_chain_add(self.ptr, smpl)  # the chain owns it from here
        self.steps.append(name)
        return self

    # -- steps ---------------------------------------------------------------------------------
    def top_k(self, k: int) -> Sampler:
        """Add ``llama_sampler_init_top_k(k)``: keep the ``k`` most likely tokens.

        Args:
            k: How many tokens to keep (``<= 0`` keeps all, as in llama.cpp).

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: llama.cpp refused the step (returned NULL).
            ClosedError: The sampler is closed.
        """
        return self._add(lib.llama_sampler_init_top_k(int(k)), f"top_k({k})")

    def top_p(self, p: float, min_keep: int = 1) -> Sampler:
        """Add ``llama_sampler_init_top_p(p, min_keep)``: nucleus sampling.

        Args:
            p: Keep the most likely tokens whose probabilities add up to ``p``.
            min_keep: Keep at least this many tokens.

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: llama.cpp refused the step (returned NULL).
            ClosedError: The sampler is closed.
        """
        return self._add(lib.llama_sampler_init_top_p(float(p), int(min_keep)), f"top_p({p})")

    def min_p(self, p: float, min_keep: int = 1) -> Sampler:
        """Add ``llama_sampler_init_min_p(p, min_keep)``: drop tokens below ``p`` times the best one's probability.

        Args:
            p: The fraction of the most likely token's probability a token needs to stay.
            min_keep: Keep at least this many tokens.

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: llama.cpp refused the step (returned NULL).
            ClosedError: The sampler is closed.
        """
        return self._add(lib.llama_sampler_init_min_p(float(p), int(min_keep)), f"min_p({p})")

    def temp(self, t: float) -> Sampler:
        """Add ``llama_sampler_init_temp(t)``: divide the logits by the temperature ``t``.

        Args:
            t: The temperature (``<= 0`` keeps only the most likely token, as in llama.cpp).

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: llama.cpp refused the step (returned NULL).
            ClosedError: The sampler is closed.
        """
        return self._add(lib.llama_sampler_init_temp(float(t)), f"temp({t})")

    def penalties(self, last_n: int = 64, repeat: float = 1.0, freq: float = 0.0, present: float = 0.0) -> Sampler:
        """Add ``llama_sampler_init_penalties``: repetition, frequency and presence penalties.

        Needs ``Sampler(model)``: the penalties are over the model's ``n_vocab``.

        Args:
            last_n: How many of the last tokens to penalize (``penalty_last_n``; 0 disables it).
            repeat: The repetition penalty (``penalty_repeat``; 1.0 disables it).
            freq: The frequency penalty (``penalty_freq``; 0.0 disables it).
            present: The presence penalty (``penalty_present``; 0.0 disables it).

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: The sampler was made without a model, ``repeat <= 0``, or llama.cpp refused
                the step.
            ClosedError: The sampler is closed.
        """
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
        """Add a GBNF grammar step (``llama_sampler_init_grammar``).

        Args:
            model: The model whose vocabulary the grammar is matched against.
            grammar: The grammar, in GBNF.
            root: The name of the grammar's start rule.

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: llama.cpp rejected the grammar (the message carries the reason it logged).
            ClosedError: The sampler or the model is closed.
        """
        from . import _log

        with _log.capture() as cap:
            smpl = lib.llama_sampler_init_grammar(model._vocab_ptr(), grammar.encode(), root.encode())
        if smpl == ffi.NULL:
            raise ValueError(f"grammar rejected by llama.cpp: {cap.reason() or 'parse error'}")
        self._add(smpl, "grammar")
        # the grammar keeps the model's vocab pointer: the model's C object outlives the chain
        cast(Handle, self._h).add_deps((model._h,))
        return self

    def dist(self, seed: int = lib.LLAMA_DEFAULT_SEED) -> Sampler:
        """Add ``llama_sampler_init_dist(seed)``: pick a token at random from the distribution.

        Deterministic for a fixed ``seed``.

        Args:
            seed: The RNG seed (taken modulo 2**32); ``LLAMA_DEFAULT_SEED`` draws a random one.

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: llama.cpp refused the step (returned NULL).
            ClosedError: The sampler is closed.
        """
        return self._add(lib.llama_sampler_init_dist(int(seed) & 0xFFFFFFFF), f"dist({seed})")

    def pick_greedy(self) -> Sampler:
        """Add ``llama_sampler_init_greedy``: pick the most likely token.

        Returns:
            This sampler, to chain calls.

        Raises:
            ValueError: llama.cpp refused the step (returned NULL).
            ClosedError: The sampler is closed.
        """
        return self._add(lib.llama_sampler_init_greedy(), "greedy")

    # -- use -----------------------------------------------------------------------------------
    def sample(self, ctx: Context, i: int = -1) -> int:
        """Sample a token from output ``i`` of the last batch (``llama_sampler_sample(chain, ctx, i)``).

        The chain accepts the token, as llama.cpp does.

        Args:
            ctx: The context that decoded the batch.
            i: The output index (negative: from the end; -1 is the last output).

        Returns:
            The token id.

        Raises:
            IndexError: The last decode asked for no outputs, or llama.cpp failed for output ``i``
                (for instance an index out of range).
            ClosedError: The sampler or the context is closed.
        """
        if ctx.n_outputs == 0:
            raise IndexError("no outputs to sample from: the last decode asked for no logits")
        from . import _log

        with _log.capture() as cap:
            tok = lib.llama_sampler_sample(self.ptr, ctx.ptr, int(i))
        if tok < 0:
            raise IndexError(f"llama_sampler_sample() failed for output {i}: {cap.reason()}")
        return int(tok)

    def accept(self, token: int) -> None:
        """Tell stateful steps (penalties, grammar) about a token (``llama_sampler_accept``).

        Args:
            token: The token id chosen.

        Raises:
            ClosedError: The sampler is closed.
        """
        lib.llama_sampler_accept(self.ptr, int(token))

    def reset(self) -> None:
        """Reset the state of every step (``llama_sampler_reset``), e.g. the penalties' history.

        Raises:
            ClosedError: The sampler is closed.
        """
        lib.llama_sampler_reset(self.ptr)

    def describe(self) -> str:
        """The chain's steps in the order they run, e.g. ``"top_k(40) -> temp(0.8) -> dist(42)"``.

        Returns:
            The steps joined by ``" -> "`` (``"(empty)"`` for a chain without steps).
        """
        return " -> ".join(self.steps) or "(empty)"

    def get_seed(self) -> int | None:
        """The seed of the chain's RNG step (``llama_sampler_get_seed``): for ``dist(LLAMA_DEFAULT_SEED)``
        the random seed it drew.

        Returns:
            The seed, or None when no step of the chain has one (e.g. a greedy chain).

        Raises:
            ClosedError: The sampler is closed.
        """
        seed = int(lib.llama_sampler_get_seed(self.ptr))
        return None if seed == lib.LLAMA_DEFAULT_SEED else seed

    def __repr__(self) -> str:
        return f"<Sampler {self.describe()}>"
