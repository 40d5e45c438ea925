"""An lm-evaluation-harness backend: ``lm_eval.api.model.LM`` registered as ``pyllamacpp``.

Importing this module registers it (lm-eval 0.4 has no plugin entry point); then::

    import lm_eval, pyllamacpp.evaluation.lm_eval
    lm_eval.simple_evaluate(model="pyllamacpp", model_args="model=PATH,n_ctx=2048", tasks=[...])

or pass an instance (``model=PyllamacppLM(model=pl.Model(...))``); from the command line,
``pyllamacpp lm-eval --model_args model=PATH --tasks ...`` registers it and runs lm-eval's own
CLI. It needs lm-eval (from a clone, ``pip install ".[eval]"``; beside an installed wheel,
``pip install "lm-eval>=0.4"``); nothing else in the package imports it.

- ``loglikelihood``: every request of the run in one :func:`pyllamacpp.loglikelihood` call, so the
  trie spans all of them (the few-shot header of a task is decoded once, each question once).
  Tokenization is lm-eval's ``TemplateLM._encode_pair`` (:func:`encode_pair`) with
  ``parse_special`` on (special-token text in a prompt is that token, as HF tokenizers read it);
  a request longer than ``max_length`` (``n_ctx``) keeps its last ``n_ctx + 1`` tokens, as lm-eval's
  HF backend truncates. Each call logs what the trie saved (logger ``lm_eval.models.pyllamacpp``,
  so lm-eval's CLI prints it with its own lines): requests, tokens decoded against the tokens a
  request-by-request backend decodes, decodes, seconds. An empty context is the prefix token (BOS;
  EOS on a model without BOS, as lm-eval's ``TemplateLM`` does, where
  :func:`pyllamacpp.loglikelihood` refuses it).
- ``loglikelihood_rolling``: lm-eval's rolling windows (``get_rolling_token_windows`` with
  ``context_len=1``, ``make_disjoint_window``, ``max_seq_len = n_ctx``), the model's BOS (its EOS
  without one) before the first; all windows of all documents in one engine call; each document's
  sum. A document that fits in one window is ``pl.score`` of BOS + its tokens.
- ``generate_until``: a :class:`~pyllamacpp.Scheduler` over all the requests, ``n_seq_max`` at once
  in one unified KV cache (a shared prompt prefix is decoded once, its cells shared), greedy
  unless ``do_sample`` (then ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``seed``), at most
  ``max_gen_toks`` tokens, a request cancelled as soon as its text holds one of ``until``, and the
  text cut at the first one of them (lm-eval's ``postprocess_generated_text``). A prompt keeps its
  last ``n_ctx - max_gen_toks`` tokens.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
from lm_eval import utils as _lm_utils  # type: ignore[import-untyped, import-not-found]
from lm_eval.api.model import LM  # type: ignore[import-untyped, import-not-found]
from lm_eval.api.registry import register_model  # type: ignore[import-untyped, import-not-found]

from ._engine import encode_pair, loglikelihood

if TYPE_CHECKING:
    from ..model import Model

__all__ = ["PyllamacppLM"]

log = logging.getLogger(__name__)
# lm-eval's own logger tree: its handler (lm-eval's CLI, simple_evaluate(verbosity=...)) shows these lines
run_log = logging.getLogger("lm_eval.models.pyllamacpp")


def _stop_at(text: str, until: list[str]) -> str:
    """``text`` cut at the first occurrence of each stop string, in turn (as lm-eval does)."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


@register_model("pyllamacpp")
class PyllamacppLM(LM):
    """lm-evaluation-harness's model interface over a GGUF, shared prefixes decoded once.

    ``model_args`` are this constructor's keywords (``model=PATH,n_ctx=2048,n_threads=2``); lm-eval's
    ``batch_size``, ``max_batch_size`` and ``device`` are accepted and not used (the engine packs
    requests by ``n_batch`` and ``n_seq_max``; the backend is the one the package was built for).

    Args:
        model: A GGUF path or a :class:`~pyllamacpp.Model` (None: ``pl.Model()``, the default
            model).
        n_ctx: The most tokens a request may span (lm-eval's ``max_length``); longer ones are
            truncated from the left, as lm-eval's HF backend does.
        n_batch: Tokens per ``llama_decode`` (and ``n_ubatch``; 63 keeps flash attention's CPU
            kernel per row, where shared and unshared decoding agree bit for bit).
        n_seq_max: Branches (loglikelihood) or requests (generation) decoded at once.
        n_threads: ``n_threads`` and ``n_threads_batch`` (None: the physical cores).
        max_gen_toks: ``max_gen_toks`` when a request's ``generation_kwargs`` give none.
        n_gpu_layers: Layers offloaded, when the package was built with a GPU backend.
        parse_special: Read special-token text in prompts as the token (``llama_tokenize``).
        prefix_store: A :class:`~pyllamacpp.prefix_store.PrefixStore`, or where one is (a
            directory or a ``redis://`` URL, as ``model_args`` give it): the log-likelihood
            requests' shared context prefixes are loaded from it and stored in it, so a rerun
            with other settings of the task skips them (None: no store).
        batch_size: lm-eval's, not used.
        max_batch_size: lm-eval's, not used.
        device: lm-eval's, not used.
        **ctx_kwargs: Other fields of :class:`~pyllamacpp.params.ContextParams` (``flash_attn``,
            ``type_k``...).

    Raises:
        TypeError: A keyword that is not a context parameter.
        ValueError: ``n_ctx`` or ``n_batch`` below 1, or a bad context parameter value.
        StoreError: ``prefix_store`` names a path that is not a store, or a Redis server that
            cannot be reached.
    """

    def __init__(
        self,
        model: str | Model | None = None,
        n_ctx: int = 2048,
        n_batch: int = 63,
        n_seq_max: int = 16,
        n_threads: int | None = None,
        max_gen_toks: int = 256,
        n_gpu_layers: int | None = None,
        parse_special: bool = True,
        prefix_store: Any = None,
        batch_size: Any = None,
        max_batch_size: Any = None,
        device: Any = None,
        **ctx_kwargs: Any,
    ) -> None:
        super().__init__()
        import pyllamacpp as pl
        from pyllamacpp.params import context_params

        if int(n_ctx) < 1 or int(n_batch) < 1 or int(n_seq_max) < 1:
            raise ValueError(f"n_ctx ({n_ctx}), n_batch ({n_batch}) and n_seq_max ({n_seq_max}) must be >= 1")
        context_params(**ctx_kwargs)  # an unknown or bad context parameter fails here, not mid-run
        if isinstance(model, pl.Model):
            self.model = model
        else:
            kw: dict[str, Any] = {} if n_gpu_layers is None else {"n_gpu_layers": int(n_gpu_layers)}
            self.model = pl.Model(model, **kw)
        self.n_ctx, self.n_batch, self.n_seq_max = int(n_ctx), int(n_batch), int(n_seq_max)
        self.n_threads = None if n_threads is None else int(n_threads)
        self.max_gen_toks, self.parse_special = int(max_gen_toks), bool(parse_special)
        self.ctx_kwargs = ctx_kwargs
        if prefix_store is not None:
            from pyllamacpp.prefix_store import PrefixStore

            if not isinstance(prefix_store, PrefixStore):
                prefix_store = PrefixStore(prefix_store)
        self.prefix_store = prefix_store
        self.last_stats: dict[str, Any] = {}
        """The engine's counts of the last ``loglikelihood`` call (``Loglikelihoods.summary()``)."""

    # -- what lm-eval reads ------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        """The most tokens one request spans (``n_ctx``)."""
        return self.n_ctx

    @property
    def tokenizer_name(self) -> str:
        """A name for lm-eval's caches: the GGUF's file name."""
        import os

        return os.path.basename(self.model.path)

    @property
    def prefix_token_id(self) -> int:
        """The token before an empty context or a rolling document: BOS, else EOS (lm-eval's rule)."""
        return self.model.bos if self.model.bos >= 0 else self.model.eos

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's chat template over lm-eval's messages (``llama_chat_apply_template``).

        Args:
            chat_history: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: Open the assistant's turn at the end.

        Returns:
            The prompt text.
        """
        return self.model.apply_chat_template(chat_history, add_assistant=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The model's chat template text (lm-eval records it with the results).

        Args:
            chat_template: lm-eval's choice (False/None: none).

        Returns:
            The template, or None when none is asked for or the model has none.
        """
        if chat_template is False or chat_template is None:
            return None
        return self.model.meta("tokenizer.chat_template")

    def _engine(self, pairs: list, disable_tqdm: bool, what: str = "loglikelihood") -> list:
        kw: dict[str, Any] = {"n_batch": self.n_batch, "n_seq_max": self.n_seq_max, "n_threads": self.n_threads}
        if self.prefix_store is not None:
            kw["prefix_store"] = self.prefix_store
        res = loglikelihood(self.model, pairs, progress=False if disable_tqdm else None, **kw, **self.ctx_kwargs)
        self.last_stats = res.summary()
        run_log.info(_saved(what, res))
        return res

    def _fit(self, ctx: np.ndarray, cont: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The last ``n_ctx + 1`` tokens of context + continuation (the last one is never fed). An
        empty continuation is left as it is, for the engine to refuse whatever the context's length."""
        n = self.n_ctx
        if not cont.size or ctx.size + cont.size - 1 <= n:
            return ctx, cont
        seq = np.concatenate([ctx, cont])[-(n + 1) :]
        k = min(cont.size, n)
        return seq[:-k], seq[-k:]

    # -- the three request types -------------------------------------------------------------
    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """``(logprob, is_greedy)`` per ``(context, continuation)`` request, all through one engine call.

        Args:
            requests: lm-eval's ``Instance`` s (``args`` = ``(context, continuation)``).
            disable_tqdm: No progress bar.

        Returns:
            One ``(logprob, is_greedy)`` per request, in order.
        """
        if not requests:
            return []
        pairs = []
        for req in requests:
            c, x = req.args
            if c == "" and self.model.bos < 0:  # lm-eval's TemplateLM: the prefix token, EOS without BOS
                pair = (np.array([self.prefix_token_id], np.int32), self.model.tokenize(x, False, self.parse_special))
            else:
                pair = encode_pair(self.model, c, x, parse_special=self.parse_special)
            pairs.append(self._fit(*pair))
        out = []
        for req, r in zip(requests, self._engine(pairs, disable_tqdm)):
            out.append((r.logprob, r.is_greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, out[-1])
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood over lm-eval's rolling windows of ``n_ctx`` tokens.

        Args:
            requests: lm-eval's ``Instance`` s (``args`` = ``(text,)``).
            disable_tqdm: No progress bar.

        Returns:
            One summed log-probability per document, in order.
        """
        if not requests:
            return []
        pairs, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            toks = self.model.tokenize(text, False, self.parse_special).tolist()
            windows = _lm_utils.get_rolling_token_windows(
                token_list=toks, prefix_token=self.prefix_token_id, max_seq_len=self.n_ctx, context_len=1
            )
            for ctx, pred in map(_lm_utils.make_disjoint_window, windows):
                pairs.append((np.asarray(ctx, np.int32), np.asarray(pred, np.int32)))
                owner.append(i)
        sums = [0.0] * len(requests)
        for i, r in zip(owner, self._engine(pairs, disable_tqdm, "loglikelihood_rolling") if pairs else []):
            sums[i] += r.logprob
        for req, v in zip(requests, sums):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, v)
        return sums

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Generated text per ``(context, generation_kwargs)`` request, batched by a Scheduler.

        Args:
            requests: lm-eval's ``Instance`` s (``args`` = ``(context, gen_kwargs)``).
            disable_tqdm: No progress bar.

        Returns:
            The generated text per request, cut at its first stop string.

        Raises:
            ValueError: ``max_gen_toks`` leaves no room for a prompt in ``n_ctx``.
        """
        import sys

        from pyllamacpp.sampling import Sampler
        from pyllamacpp.scheduler import Scheduler

        if not requests:
            return []
        jobs = []
        for req in requests:
            context, gen = req.args
            gen = dict(gen or {})
            until = gen.pop("until", None)
            until = [until] if isinstance(until, str) else list(until or [])
            n_gen = self.max_gen_toks
            for key in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"):
                if gen.get(key) is not None:
                    n_gen = int(gen[key])
                    break
            if n_gen >= self.n_ctx:
                raise ValueError(f"max_gen_toks {n_gen} leaves no room for a prompt in n_ctx {self.n_ctx}")
            prompt = self.model.tokenize(context, True, self.parse_special)[-(self.n_ctx - n_gen) :]
            jobs.append((prompt, n_gen, until, gen))
        n_seq = max(1, min(self.n_seq_max, len(jobs), self.n_batch))
        need = max(p.size + n for p, n, _, _ in jobs)
        kw: dict[str, Any] = {"n_ctx": n_seq * need, "n_batch": self.n_batch, "n_ubatch": self.n_batch}
        kw.update(n_seq_max=n_seq, kv_unified=True)
        if self.n_threads is not None:
            kw["n_threads"] = kw["n_threads_batch"] = self.n_threads
        kw.update(self.ctx_kwargs)
        out: list[str] = [""] * len(jobs)
        bar = None
        if not disable_tqdm and len(jobs) > 1 and sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(total=len(jobs), desc="generate_until", unit="req", file=sys.stderr, leave=False)
        samplers: list[Sampler] = []
        try:
            with self.model.context(**kw) as ctx:
                sched = Scheduler(ctx)
                reqs = {}
                for k, (prompt, n_gen, _, gen) in enumerate(jobs):
                    s = _sampler(gen)
                    samplers.append(s)
                    reqs[sched.submit(prompt, n_gen, s).id] = k
                for ev in sched.run():
                    r = ev.request
                    k = reqs[r.id]
                    until = jobs[k][2]
                    if ev.finish_reason is None:
                        if until and any(t and t in r.text for t in until):
                            r.cancel()  # a stop string: no more tokens for it
                        continue
                    if ev.finish_reason == "ctx_full":
                        log.warning("generate_until: request %d ran out of KV cells after %d tokens", k, len(r.tokens))
                    out[k] = _stop_at(r.text, until)
                    self.cache_hook.add_partial("generate_until", requests[k].args, out[k])
                    if bar is not None:
                        bar.update(1)
        finally:
            for s in samplers:
                s.close()
            if bar is not None:
                bar.close()
        return out


def _saved(what: str, res: Any) -> str:
    """What the trie saved in one engine call, in a line: the tokens decoded against the tokens a
    request-by-request backend decodes (lm-eval's others feed each request's context + continuation)."""
    ratio = f"{res.n_unshared / res.n_decoded:.1f}x fewer" if res.n_decoded else "none decoded"
    return (
        f"pyllamacpp {what}: {res.n_requests:,} requests ({res.n_unique:,} distinct), {res.n_decoded:,} tokens "
        f"decoded where request by request would decode {res.n_unshared:,} ({ratio}), in {res.n_decodes:,} "
        f"decodes, {res.seconds:.1f} s"
    )


def _sampler(gen: dict[str, Any]) -> Any:
    """Greedy, unless ``do_sample`` (or a temperature above 0 without it): then top-k, top-p,
    min-p, temperature and a seeded draw, as lm-eval's generation kwargs give them."""
    from pyllamacpp.sampling import Sampler

    temp = float(gen.get("temperature", 0.0) or 0.0)
    do_sample = gen.get("do_sample")
    if do_sample is None:
        do_sample = temp > 0.0
    if not do_sample or temp <= 0.0:
        return Sampler.greedy()
    s = Sampler()
    if gen.get("top_k"):
        s.top_k(int(gen["top_k"]))
    if gen.get("top_p") is not None:
        s.top_p(float(gen["top_p"]))
    if gen.get("min_p") is not None:
        s.min_p(float(gen["min_p"]))
    return s.temp(temp).dist(int(gen.get("seed", 0) or 0))
