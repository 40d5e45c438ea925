"""Generation loops over a Context: one sequence, or many decoded together (examples/batched)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .batch import Batch
from .sampling import Sampler


def generate(ctx, tokens, n_predict: int, sampler: Sampler | None = None, seq_id: int = 0) -> Iterator[int]:
    """Prefill ``tokens`` into ``seq_id`` (after what it holds), then yield up to ``n_predict``
    sampled tokens, one ``llama_decode`` each; stops after an end-of-generation token.

    Each yielded token is decoded when the next one is asked for (so breaking out of the loop
    leaves the last yielded token out of memory); the decode and the next sample are one C call
    (``Context._generation_step``)."""
    sampler = sampler or Sampler.greedy()
    is_eog = ctx.model.is_eog
    pos = ctx.prefill(tokens, seq_id)
    if n_predict <= 0:
        return
    step, out = ctx._generation_step(sampler, seq_id)
    tok = sampler.sample(ctx, -1)
    eog = is_eog(tok)
    for i in range(1, n_predict + 1):
        yield tok
        if eog:
            return
        tok = step(tok, pos, i < n_predict)  # the last token is decoded too, as it always was
        eog = out.eog
        pos += 1


@dataclass
class ParallelResult:
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finished_by: str = ""  # "eog" or "n_predict"


def generate_parallel(ctx, prompt, n_parallel: int, n_predict: int, sampler: Sampler | None = None,
                      *, shared_prompt: bool | None = None) -> list[ParallelResult]:
    """llama.cpp's ``examples/batched`` in Python.

    The prompt goes in once, each token carrying all sequence ids 0..n_parallel-1 (one KV copy of
    the prompt). This needs a unified KV cache; with ``kv_unified=False`` llama.cpp rejects such
    "coupled" sequences, so the prompt is decoded into sequence 0 and copied with ``seq_cp``
    (``shared_prompt`` forces either path). Then each step puts one token per live sequence into
    one batch; a sequence ends on its own at an end-of-generation token or after ``n_predict``.
    One sampler serves all sequences, as in the example; greedy by default.
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
            batch.add_sequence(tokens[i0:i0 + n_batch], seqs, i0, logits="last" if last else "none")
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
                results[s].finished_by = "eog"
                continue
            if len(results[s].tokens) >= n_predict:
                results[s].finished_by = "n_predict"
                continue
            out_index[s] = batch.add(tok, pos, s, logits=True)
            still.append(s)
        live = still
        if not live:
            break
        ctx.decode(batch)
        pos += 1
    for r in results.values():
        r.text = model.detokenize([t for t in r.tokens if not model.is_eog(t)])
    return [results[s] for s in seqs]
