"""Speculative decoding against plain generate, on the real model and on synthetic ones.

Greedy output is compared with ``pl.generate`` token for token; stochastic output is tested for
its distribution (chi-square on a tiny model) and for drawing what plain ``generate`` draws with
the same seed. Forward passes are counted by the C ``cb_eval`` of ``PassCounter``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager

import gguf
import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp.experiments.speculative import WORKLOADS
from pyllamacpp.speculative import Draft, ModelDraft, NgramDraft, PassCounter, generate_speculative, layer_skip_gguf
from pyllamacpp.testing import make_model

T1 = {"n_threads": 1, "n_threads_batch": 1}  # one thread: these are small decodes, and the machine is shared


class FixedDraft(Draft):
    """Proposes the same tokens every round."""

    def __init__(self, tokens):
        self.tokens = list(tokens)

    def draft(self, history, n_max):
        return self.tokens[:n_max]


class OracleDraft(Draft):
    """Proposes the continuation plain generate produced: every draft token is accepted (greedy)."""

    def __init__(self, continuation, n_prompt):
        self.cont, self.n_prompt = list(continuation), n_prompt

    def draft(self, history, n_max):
        i = len(history) - self.n_prompt
        return self.cont[i : i + n_max]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Synthetic models of 64 tokens (llama.cpp's "test" vocabulary), one per memory kind."""
    d = tmp_path_factory.mktemp("spec")
    return {
        "llama": make_model(d / "llama.gguf", "llama", n_layer=4, n_embd=32, n_head=2, n_vocab=64, seed=3),
        "mamba": make_model(d / "mamba.gguf", "mamba", n_layer=2, n_embd=32, n_vocab=64, seed=3),
        "lfm2": make_model(d / "lfm2.gguf", "lfm2", n_layer=4, n_embd=32, n_head=2, n_vocab=64, seed=3),
        "gemma3": make_model(
            d / "gemma3.gguf", "gemma3", n_layer=2, n_embd=32, n_head=2, n_vocab=64, seed=3, n_swa=8, swa_pattern=[1, 0]
        ),
    }


def _repetitive(n_vocab=64, seed=0):
    unit = np.random.default_rng(seed).integers(0, n_vocab, 12)
    return np.concatenate([unit, unit, unit, unit[:5]]).astype(np.int32)


def _held(ctx, seq=0):
    return ctx.memory.seq_pos_max(seq) + 1


@contextmanager
def _plain(path, seed, n):
    """A context on the model at ``path``, the prompt ``_repetitive(seed)`` and the ``n`` tokens plain
    ``generate`` makes of it, the memory cleared after: what a speculative run must give again."""
    with pl.Model(path) as m, m.context(n_ctx=256, **T1) as ctx:
        prompt = _repetitive(seed=seed)
        plain = list(pl.generate(ctx, prompt, n))
        ctx.memory.seq_rm(0)
        yield ctx, prompt, plain


# -- greedy: the same tokens as plain generate -------------------------------------------------
QUOTE = WORKLOADS["quote"]  # the speculative command's own quoting prompt
FREE = [
    "Count from one to twenty in words: one, two, three, four,",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


def _margins(ctx, prompt, tokens):
    """Top-1 minus top-2 logit of the target at each greedy step (one batched decode)."""
    ctx.memory.seq_rm(0)
    allt = np.concatenate([prompt, tokens[:-1]]).astype(np.int32)
    mask = np.zeros(allt.size, bool)
    mask[prompt.size - 1 :] = True
    b = pl.Batch(allt.size, 1, model=ctx.model)
    b.add_sequence(allt, 0, 0, logits=mask)
    ctx.decode(b)
    s = np.sort(ctx.logits_all(), axis=1)
    ctx.memory.seq_rm(0)
    return s[:, -1] - s[:, -2]


@pytest.mark.parametrize("which", ["quote", *range(len(FREE))])
def test_greedy_equals_generate_where_winners_are_clear(model, which):
    """Token for token up to the first step whose winner is within 0.1 of the runner-up (the
    logits of a row of a wider batch may differ in the last bits: a near-tie may turn)."""
    text, n = (QUOTE, 96) if which == "quote" else (FREE[which], 40)
    prompt = model.tokenize(text, parse_special=True)
    with model.context(n_ctx=1024, **T1) as ctx:
        plain = list(pl.generate(ctx, prompt, n))
        clear = _margins(ctx, prompt, plain) >= 0.1
        n_clear = int(np.argmin(clear)) if not clear.all() else n
        ctx.memory.seq_rm(0)
        s = generate_speculative(ctx, prompt, n, NgramDraft())
        got = list(s)
        assert got[: n_clear + 1] == plain[: n_clear + 1], f"differs before the first near-tie (step {n_clear})"
        assert _held(ctx) == prompt.size + len(got) - 1  # the last token is not decoded
    if which == "quote":
        assert n_clear >= 48, "the quoting prompt should have clear winners for a while"
        assert got == plain
        assert s.stats.n_accepted > 20 and s.stats.tokens_per_round > 1.5, s.stats.report()


def test_ngram_draft_lookup():
    d = NgramDraft()
    h = [5, 6, 7, 8, 9, 5, 6, 7]
    # the 3-gram (5, 6, 7) was followed by 8 once: enough for n >= 3; then (6, 7, 8) by 9, ...
    assert d.draft(h, 4) == [8, 9, 5, 6]
    assert d.draft(h, 1) == [8]
    # one sighting of a 1-gram is not enough (min_samples[0] = 2), nor of a 2-gram (2)
    assert NgramDraft(1, 2).draft([1, 2, 3, 1, 2], 3) == []
    assert NgramDraft(1, 2).draft([1, 2, 3, 1, 2, 3, 1, 2], 2) == [3, 1]
    assert NgramDraft().draft([1], 4) == []
    # the majority follower, with at least 66% for a 1-gram
    assert NgramDraft(1, 1).draft([4, 1, 4, 1, 4, 2, 4, 3, 4], 1) == []  # 1 follows 4 in 2 of 4: 50%
    assert NgramDraft(1, 1).draft([4, 1, 4, 1, 4, 1, 4, 2, 4], 1) == [1]  # 3 of 4: 75%
    with pytest.raises(ValueError):
        NgramDraft(0, 4)
    with pytest.raises(ValueError):
        NgramDraft(1, 5)


def test_ngram_draft_thresholds_are_inclusive():
    """As common/ngram-cache.cpp's try_draft: an n-gram qualifies when it was seen exactly
    ``min_samples`` times, and its follower when it makes exactly ``min_percent`` percent."""
    h = [4, 1, 4, 1, 4, 2, 4, 3, 4]  # 4 was followed 4 times: by 1 twice (50%), 2 once, 3 once
    assert NgramDraft(1, 1, min_samples=(2,), min_percent=(50,)).draft(h, 1) == [1]
    assert NgramDraft(1, 1, min_samples=(2,), min_percent=(51,)).draft(h, 1) == []
    assert NgramDraft(1, 1, min_samples=(4,), min_percent=(50,)).draft(h, 1) == [1]  # seen 4 times: enough
    assert NgramDraft(1, 1, min_samples=(5,), min_percent=(50,)).draft(h, 1) == []
    # the defaults: a 2-gram's follower needs 50% (llama.cpp's lax threshold): (4, 5) -> 1 in 2 of 4
    assert NgramDraft(2, 2).draft([4, 5, 1, 4, 5, 1, 4, 5, 2, 4, 5, 3, 4, 5], 1) == [1]


# -- forward passes per verify: the seed's claim --------------------------------------------------
def test_five_token_draft_under_ub4_is_two_passes(model):
    """The seed: verifying a five-token draft (six rows with the last token) under -ub 4 costs two passes."""
    prompt = model.tokenize("The cat sat on the mat.")
    for ub, want in ((4, 2), (512, 1), (2, 3)):
        pc = PassCounter()
        with model.context(n_ctx=256, n_ubatch=ub, **T1, **pc.context_params()) as ctx:
            s = generate_speculative(ctx, prompt, 6, FixedDraft([11, 12, 13, 14, 15]), n_draft=5, passes=pc)
            next(s)
            assert s.stats.verify_rows[0] == 6
            assert s.stats.verify_passes[0] == want, (ub, s.stats.verify_passes)
            s.close()
        assert pc.n_passes > 0 and pc.n_nodes > pc.n_passes


def test_passes_counted_follow_ceil_rows_over_ubatch(tiny):
    with pl.Model(tiny["llama"]) as m:
        prompt = _repetitive()
        for ub in (1, 3, 4, 512):
            pc = PassCounter()
            with m.context(n_ctx=256, n_ubatch=ub, **T1, **pc.context_params()) as ctx:
                s = generate_speculative(ctx, prompt, 40, NgramDraft(), n_draft=6, passes=pc)
                list(s)
                for rows, passes in s.stats.passes_by_rows().items():
                    assert passes == [math.ceil(rows / ub)], (ub, rows, passes)
                assert s.stats.passes_per_verify >= 1
                assert s.stats.tokens_per_pass == s.stats.n_tokens / s.stats.n_target_passes


# -- memory that cannot drop a suffix ----------------------------------------------------------
@pytest.mark.parametrize("arch", ["mamba", "lfm2", "gemma3", "llama"])
def test_checkpoint_memories_equal_generate_and_continue(tiny, arch):
    """Recurrent (mamba), hybrid (lfm2) and sliding-window (gemma3) memories go through a
    PARTIAL_ONLY checkpoint, restored on partial acceptance; the sequence is right afterwards."""
    with pl.Model(tiny[arch]) as m, m.context(n_ctx=256, n_ubatch=4, **T1) as ctx:
        prompt = _repetitive()
        plain = list(pl.generate(ctx, prompt, 50))
        after = list(pl.generate(ctx, [plain[-1]], 10))
        ctx.memory.seq_rm(0)
        s = generate_speculative(ctx, prompt, 50, NgramDraft())
        got = list(s)
        assert got == plain
        assert _held(ctx) == prompt.size + len(got) - 1
        assert list(pl.generate(ctx, [got[-1]], 10)) == after  # the state after it is the same
        st = s.stats
        assert st.n_accepted > 0
        if arch == "llama":
            assert st.n_checkpoints == st.n_restores == 0  # a plain KV cache: seq_rm only
        else:
            assert st.n_checkpoints > 0 and st.n_restores > 0, st.report()


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_close_inside_a_round_keeps_the_convention(tiny, arch):
    with _plain(tiny[arch], 1, 30) as (ctx, prompt, plain):
        s = generate_speculative(ctx, prompt, 30, OracleDraft(plain, prompt.size), n_draft=4)
        assert [next(s), next(s)] == plain[:2]  # the first round yields 5 tokens
        s.close()
        assert s.stats.n_rounds == 1 and s.stats.n_accepted == 4
        assert _held(ctx) == prompt.size + 1
        assert list(pl.generate(ctx, [plain[1]], 10)) == plain[2:12]


def test_abort_leaves_the_round_undone(tiny):
    with _plain(tiny["llama"], 2, 20) as (ctx, prompt, plain):
        s = generate_speculative(ctx, prompt, 20, OracleDraft(plain, prompt.size), n_draft=2)
        got = [next(s) for _ in range(3)]  # one round: the last token and two drafts
        ctx.abort()
        with pytest.raises(pl.DecodeAborted):
            next(s)
        assert got == plain[:3] and _held(ctx) == prompt.size + 2
        assert list(pl.generate(ctx, [got[-1]], 8)) == plain[3:11]


class RoundsDraft(Draft):
    """Proposes the given tokens, one list per round, then nothing."""

    def __init__(self, rounds):
        self.rounds, self.i = [list(r) for r in rounds], 0

    def draft(self, history, n_max):
        d = self.rounds[self.i] if self.i < len(self.rounds) else []
        self.i += 1
        return d[:n_max]


@pytest.mark.parametrize("arch", ["mamba", "lfm2"])
def test_abort_after_a_restore_replays_the_kept_tokens(tiny, arch):
    """Recurrent and hybrid memory: a half-wrong draft restores the checkpoint and leaves the kept
    tokens to be decoded again at the front of the next verify batch; that decode aborted, the
    sequence is restored again and the kept tokens replayed: it holds the prompt and the first
    token (42 positions), not only what the checkpoint held (40), in the state plain decodes give."""
    with _plain(tiny[arch], 2, 20) as (ctx, prompt, plain):
        wrong = (plain[1] + 1) % 64
        s = generate_speculative(ctx, prompt, 20, RoundsDraft([[plain[0], wrong], plain[2:4]]), n_draft=2)
        got = [next(s), next(s)]  # the first round: plain[0] accepted, then plain[1] sampled for `wrong`
        assert s.stats.n_restores == 1 and s.stats.n_accepted == 1 and s.stats.n_replayed == 0
        ctx.abort()
        with pytest.raises(pl.DecodeAborted):
            next(s)  # the second round's verify: the two kept tokens replayed, then plain[1] and the draft
        assert got == plain[:2] and _held(ctx) == prompt.size + 1 == 42
        # these tiny models repeat a token whatever the state: compare the next logits instead
        ctx.prefill([got[-1]])
        after = ctx.logits().copy()
        ctx.memory.seq_rm(0)
        ctx.prefill([*prompt.tolist(), *plain[:2]])
        assert np.abs(after - ctx.logits()).max() < 1e-5


def test_ctx_full_ends_as_generate(tiny):
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        prompt = np.resize(_repetitive(seed=4), ctx.n_ctx_seq - 20).astype(np.int32)
        g = pl.generate(ctx, prompt, -1)
        plain = list(g)
        assert g.finish_reason == "ctx_full"
        ctx.memory.seq_rm(0)
        s = generate_speculative(ctx, prompt, -1, NgramDraft(), n_draft=8)
        got = list(s)
        assert s.finish_reason == "ctx_full" and isinstance(s.error, pl.KVCacheFullError)
        assert got == plain
        assert s.stats.n_accepted > 0


def test_history_is_text_for_the_draft_only(tiny):
    """A sequence that holds the prompt already: ``history=`` gives the draft the text, nothing is decoded twice."""
    with _plain(tiny["llama"], 9, 30) as (ctx, prompt, plain):
        ctx.prefill(prompt[:-1])
        s = generate_speculative(ctx, prompt[-1:], 30, NgramDraft(), history=prompt[:-1])
        assert list(s) == plain and s.stats.n_accepted > 0
        assert _held(ctx) == prompt.size + 30 - 1
        ctx.memory.seq_rm(0)
        ctx.prefill(prompt[:-1])
        s = generate_speculative(ctx, prompt[-1:], 30, NgramDraft())  # no history: little to look up
        assert list(s) == plain


def test_stats_time_the_generation_to_its_end(tiny):
    """``t_total`` runs from the first ``next`` to the end, exhausted or closed early, and holds the parts it times."""
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        prompt = _repetitive(seed=11)
        s = generate_speculative(ctx, prompt, 24, NgramDraft(), n_draft=4)
        assert s.stats.t_total == 0.0  # nothing runs before the first next
        list(s)
        st = s.stats
        assert st.t_target > 0 and st.t_total >= st.t_prefill + st.t_draft + st.t_target + st.t_sample + st.t_rollback
        assert st.tokens_per_s == st.n_tokens / st.t_total
        ctx.memory.seq_rm(0)
        s = generate_speculative(ctx, prompt, 24, NgramDraft(), n_draft=4)
        next(s)
        s.close()
        assert s.stats.n_rounds == 1 and s.stats.t_total >= s.stats.t_prefill + s.stats.t_target > 0


def test_compare_speculative(tiny):
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        c = pl.compare_speculative(ctx, _repetitive(seed=10), 24, NgramDraft(), n_draft=4, repeat=2)
        assert c["same_tokens"] and c["first_difference"] is None and c["n_tokens"] == 24
        assert len(c["speedups"]) == len(c["speedups_cpu"]) == 2 and c["speedup"] > 0 and c["speedup_cpu"] > 0
        assert c["speculative"]["stats"]["n_accepted"] > 0
        json.dumps(c)  # JSON-ready
        assert _held(ctx) == 0  # the sequence is left cleared


# -- stochastic sampling -----------------------------------------------------------------------
def _chi2_critical(df: int, alpha_z: float = 3.0902) -> float:
    """Upper chi-square quantile by Wilson-Hilferty (within 1% of the exact one for df >= 10):
    z = 3.0902 is the normal quantile of 1 - 0.001."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + alpha_z * math.sqrt(a)) ** 3


def _chi2(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with cells expected below 5 pooled into one; returns (statistic, df)."""
    small = expected < 5
    c = np.append(counts[~small], counts[small].sum())
    e = np.append(expected[~small], expected[small].sum())
    if e[-1] == 0:
        c, e = c[:-1], e[:-1]
    return float(((c - e) ** 2 / e).sum()), int(c.size - 1)


def test_stochastic_output_distribution_is_the_targets(tmp_path):
    """Two tokens sampled at temperature 0.1 on an 8-token model, 3000 times: the joint counts of
    (t1, t2) against the target's own distribution, from single-token decodes. The draft proposes
    the two most likely tokens, so t2 comes from a verify row when t1 was accepted and from a new
    decode otherwise."""
    path = make_model(tmp_path / "v8.gguf", "llama", n_layer=2, n_embd=16, n_head=2, n_vocab=8, seed=1)
    temp, n = 0.1, 3000
    prompt = np.array([1, 2, 3], np.int32)
    with pl.Model(path) as m, m.context(n_ctx=64, **T1) as ctx:

        def probs(tokens):
            ctx.memory.seq_rm(0)
            ctx.prefill(np.asarray(tokens, np.int32))
            z = ctx.logits().astype(np.float64) / temp
            p = np.exp(z - z.max())
            return p / p.sum()

        p1 = probs(prompt)
        p2 = np.array([probs([*prompt, a]) for a in range(8)])
        joint = p1[:, None] * p2
        assert joint.max() > 4 / 64, "the distribution should be far from uniform"
        a = int(p1.argmax())
        d = FixedDraft([a, int(p2[a].argmax())])
        counts = np.zeros((8, 8))
        accepted = 0
        for seed in range(n):
            ctx.memory.seq_rm(0)
            with pl.Sampler().temp(temp).dist(seed) as smpl:
                s = generate_speculative(ctx, prompt, 2, d, smpl, n_draft=2)
                t1, t2 = list(s)
            counts[t1, t2] += 1
            accepted += s.stats.n_accepted > 0
    stat, df = _chi2(counts.ravel(), n * joint.ravel())
    assert stat < _chi2_critical(df), f"chi2 {stat:.1f} >= {_chi2_critical(df):.1f} (df {df})"
    # the test has teeth: the same counts against a uniform distribution fail it by far
    flat, df_flat = _chi2(counts.ravel(), np.full(64, n / 64))
    assert flat > 10 * _chi2_critical(df_flat)
    assert 300 < accepted < n - 300  # both paths, a verify row and a fresh decode, were taken often


def test_same_seed_draws_what_generate_draws(tiny):
    """Every yielded token is one draw of the target's chain, in generate's order: with the same
    seed the output is plain generate's (this tiny f32 model has no near-tie at these draws)."""
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        prompt = _repetitive(seed=5)
        n_acc = 0
        for seed in range(8):
            ctx.memory.seq_rm(0)
            with pl.Sampler(m).penalties(16, 1.05).top_k(20).temp(0.02).dist(seed) as smpl:
                plain = list(pl.generate(ctx, prompt, 30, smpl))
            ctx.memory.seq_rm(0)
            with pl.Sampler(m).penalties(16, 1.05).top_k(20).temp(0.02).dist(seed) as smpl:
                s = generate_speculative(ctx, prompt, 30, NgramDraft(), smpl)
                got = list(s)
            assert got == plain, seed
            n_acc += s.stats.n_accepted
        assert n_acc > 0


# -- draft models ------------------------------------------------------------------------------
def test_model_draft_same_model_accepts_everything(tiny):
    with _plain(tiny["llama"], 6, 40) as (ctx, prompt, plain):
        with ModelDraft(tiny["llama"], n_ctx=256, **T1) as d:
            s = generate_speculative(ctx, prompt, 40, d, n_draft=4)
            assert list(s) == plain
            assert s.stats.acceptance_rate > 0.9, s.stats.report()
            # what it holds stays: a second generation does not decode the prompt again in the draft
            assert _held(d.ctx) >= prompt.size
            ctx.memory.seq_rm(0)
            assert list(generate_speculative(ctx, prompt, 40, d, n_draft=4)) == plain


def test_layer_skip_draft_is_exact_whatever_it_drafts(tiny, tmp_path):
    path = layer_skip_gguf(tiny["llama"], 2, cache=tmp_path)
    with _plain(tiny["llama"], 7, 40) as (ctx, prompt, plain):
        with ModelDraft(path, n_ctx=256, **T1) as d:
            assert d.model.n_layer == 2
            s = generate_speculative(ctx, prompt, 40, d, n_draft=3)
            assert list(s) == plain
            assert s.stats.n_drafted > 0 and s.stats.t_draft > 0


def test_model_draft_recurrent(tiny):
    with _plain(tiny["mamba"], 8, 30) as (ctx, prompt, plain):
        with ModelDraft(tiny["mamba"], n_ctx=256, **T1) as d:
            s = generate_speculative(ctx, prompt, 30, d, n_draft=3)
            assert list(s) == plain
            assert s.stats.acceptance_rate > 0.9


def test_other_vocabulary_is_an_error_before_any_decode(model, tiny):
    with model.context(n_ctx=256, **T1) as ctx, ModelDraft(tiny["llama"], n_ctx=256, **T1) as d:
        with pytest.raises(ValueError, match="for target"):
            generate_speculative(ctx, model.tokenize("Hello"), 8, d)
        assert _held(ctx) == 0 and _held(d.ctx) == 0


def test_bad_input(tiny):
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        prompt = _repetitive()
        with pytest.raises(ValueError, match="n_draft"):
            generate_speculative(ctx, prompt, 8, NgramDraft(), n_draft=0)
        with pytest.raises(TypeError):
            generate_speculative(ctx, prompt, 8, "ngram")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="no tokens"):
            generate_speculative(ctx, [], 8)
        with pytest.raises(ValueError, match="PassCounter"):
            generate_speculative(ctx, prompt, 8, passes=PassCounter())  # not installed in ctx
        s = generate_speculative(ctx, prompt, 8, FixedDraft([3, 64]))
        with pytest.raises(ValueError, match="not a token"):
            next(s)
        assert _held(ctx) == prompt.size - 1  # nothing of the bad round reached memory
        ctx.memory.seq_rm(0)
        assert len(list(generate_speculative(ctx, prompt, 8))) == 8  # the context goes on
        s = generate_speculative(ctx, prompt, 0)
        assert list(s) == [] and s.finish_reason == "n_predict" and _held(ctx) == prompt.size + 8 - 1 + prompt.size


# -- the layer-skip GGUF -----------------------------------------------------------------------
def test_layer_skip_gguf_writes_and_caches(tiny, tmp_path):
    src = tiny["lfm2"]  # per-layer metadata arrays (head_count_kv) are cut too
    out = layer_skip_gguf(src, 2, cache=tmp_path)
    r = gguf.GGUFReader(out)
    assert r.fields["lfm2.block_count"].contents() == 2
    assert len(r.fields["lfm2.attention.head_count_kv"].contents()) == 2
    names = {t.name for t in r.tensors}
    assert not any(n.startswith(("blk.2.", "blk.3.")) for n in names) and "blk.1.ffn_up.weight" in names
    s = gguf.GGUFReader(src)
    a = next(t for t in s.tensors if t.name == "token_embd.weight")
    b = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert np.array_equal(a.data, b.data)
    with pl.Model(out) as m:
        assert m.n_layer == 2
    mtime = out.stat().st_mtime_ns
    assert layer_skip_gguf(src, 2, cache=tmp_path) == out and out.stat().st_mtime_ns == mtime  # cached
    assert out.read_bytes().count(b"general.architecture") == 1  # the source's key not copied over the writer's
    for bad in (0, 4):
        with pytest.raises(ValueError, match=rf"n_layer must be in \[1, 3\] for \S+ \(4 layers\), got {bad}$"):
            layer_skip_gguf(src, bad, cache=tmp_path)


def test_layer_skip_of_the_quantized_default_model(model, tmp_path):
    out = layer_skip_gguf(model.path, 3, cache=tmp_path)
    with pl.Model(out) as m, m.context(n_ctx=128, **T1) as ctx:
        assert m.n_layer == 3 and m.n_vocab == model.n_vocab
        ctx.prefill(m.tokenize("The cat sat on the mat."))
        assert np.isfinite(ctx.logits()).all()
    assert os.path.getsize(out) < os.path.getsize(model.path)


# -- the experiment command --------------------------------------------------------------------
def test_cli_speculative(tiny, tmp_path):
    cmd = [sys.executable, "-m", "pyllamacpp.cli", "speculative"]
    r = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "--draft-list" in r.stdout and "default" in r.stdout
    out = tmp_path / "spec.png"
    r = subprocess.run(
        [
            *cmd,
            "-m",
            str(tiny["llama"]),
            "-t",
            "1",
            "--draft-list",
            "2,5",
            "--ubatch-list",
            "4,512",
            "-n",
            "24",
            "--repeat",
            "1",
            "--json",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["ok"] and len(data["rows"]) == 4
    row = next(x for x in data["rows"] if x["n_ubatch"] == 4 and x["n_draft"] == 5)
    assert row["passes_check"] == "ok" and row["speedup"] > 0
    assert "step" in r.stderr  # progress on stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_closed_sampler_raises_before_the_verify(tiny):
    with _plain(tiny["llama"], 11, 12) as (ctx, prompt, plain):
        smpl = pl.Sampler.greedy()
        s = generate_speculative(ctx, prompt, 12, OracleDraft(plain, prompt.size), smpl, n_draft=2)
        got = [next(s) for _ in range(3)]
        smpl.close()
        with pytest.raises(pl.ClosedError):
            next(s)
        assert got == plain[:3] and _held(ctx) == prompt.size + 2


# -- behaviours held against the mutants of a sample (issue 28: tools/mutation/run.py speculative)


class _Recording(FixedDraft):
    """A FixedDraft that logs its resets and its drafts."""

    def __init__(self, tokens, log):
        super().__init__(tokens)
        self.log = log

    def reset(self):
        self.log.append("reset")
        super().reset()

    def draft(self, history, n_max):
        self.log.append("draft")
        return super().draft(history, n_max)


def test_compare_resets_the_draft_before_each_speculative_run_only(tiny):
    """The plain side never drafts; each speculative run starts from a reset draft."""
    log: list[str] = []
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        r = pl.compare_speculative(ctx, _repetitive()[:10], 6, _Recording([1, 2], log), repeat=2)
    runs = [g for g in "".join("R" if e == "reset" else "d" for e in log).split("R") if g]
    assert log[0] == "reset" and len(runs) == 2 and all(set(g) == {"d"} for g in runs), log
    assert r["same_tokens"] and r["n_tokens"] == 6


def test_compare_on_a_long_generation_finds_no_difference(tiny):
    """300 tokens: lengths past CPython's small-int cache compared by value."""
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=512, **T1) as ctx:
        r = pl.compare_speculative(ctx, _repetitive()[:10], 300, NgramDraft(), repeat=1)
    assert r["same_tokens"] and r["first_difference"] is None and r["n_tokens"] == 300


def test_a_model_draft_with_p_min_drafts_while_the_top_token_is_that_likely(tiny):
    """p_min 1e-6: every greedy token of a 64-token vocabulary is likelier than that, so the draft
    runs to n_max; p_min 1.0: no token is certain, so it drafts nothing."""
    with pl.Model(tiny["llama"]) as m:
        hist = _repetitive()[:10].tolist()
        with ModelDraft(m, p_min=1e-6, n_ctx=128, **T1) as low, ModelDraft(m, p_min=1.0, n_ctx=128, **T1) as high:
            low.bind(m)
            high.bind(m)
            assert len(low.draft(hist, 5)) == 5 and high.draft(hist, 5) == []


def test_an_own_cb_eval_counter_resets_to_zero(tiny):
    pc = PassCounter()
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, n_ubatch=4, **pc.context_params(), **T1) as ctx:
        b = pl.Batch(16, 1)
        b.add_sequence(_repetitive()[:7], 0, 0, logits="last")
        ctx.decode(b)
        assert pc.n_passes == 2
        pc.reset()
        assert (pc.n_passes, pc.n_nodes) == (0, 0)
        ctx.memory.clear()
        ctx.decode(b)
        assert pc.n_passes == 2


def test_a_model_draft_decodes_only_what_the_history_added(tiny):
    """After a round whose drafts were accepted, the next draft finds them already in its
    sequence: one pass for the new token and one per further draft, however long the history."""
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, n_ubatch=2, n_batch=64, **T1) as dctx:
        with ModelDraft(m, ctx=dctx) as d, PassCounter(dctx) as pc:
            d.bind(m)
            hist = _repetitive()[:11].tolist()
            first = d.draft(hist, 3)
            assert len(first) == 3
            p0 = pc.n_passes
            again = d.draft(hist + first[:2] + [5], 3)  # two drafts accepted, then a token of the target's
            assert len(again) == 3 and pc.n_passes - p0 == 3


def test_stats_per_round(tiny):
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        s = generate_speculative(ctx, _repetitive()[:10], 20, NgramDraft(), n_draft=4)
        list(s)
    st = s.stats
    assert st.n_rounds > 1 and st.tokens_per_round == st.n_tokens / st.n_rounds
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=256, **T1) as ctx:
        c = list(pl.generate(ctx, _repetitive()[:10], 2, pl.Sampler.greedy()))
        ctx.memory.clear()
        s = generate_speculative(ctx, _repetitive()[:10], 12, FixedDraft([c[0], (c[1] + 1) % 64]), n_draft=2)
        list(s)
    st = s.stats
    assert 0 < st.n_accepted < st.n_drafted and st.acceptance_rate == st.n_accepted / st.n_drafted


def test_check_vocab_of_two_vocabularies_that_add_bos(tmp_path):
    """Both add a BOS: the same id passes, another id is refused with both named."""
    from pyllamacpp.speculative import check_vocab

    md = {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 1}
    kw = {"n_embd": 32, "n_head": 2, "n_vocab": 64}
    a = make_model(tmp_path / "a.gguf", "llama", n_layer=1, metadata=md, **kw)
    b = make_model(tmp_path / "b.gguf", "llama", n_layer=2, seed=1, metadata=md, **kw)
    c = make_model(tmp_path / "c.gguf", "llama", n_layer=1, metadata={**md, "tokenizer.ggml.bos_token_id": 2}, **kw)
    with pl.Model(a) as ma, pl.Model(b) as mb, pl.Model(c) as mc:
        check_vocab(ma, mb)
        with pytest.raises(ValueError, match=r"another BOS \(added True, id 2; the target's: added True, id 1\)"):
            check_vocab(ma, mc)


def test_a_counter_says_which_contexts_passes_it_counts(tiny):
    own = PassCounter()
    with pl.Model(tiny["llama"]) as m, m.context(n_ctx=64, **T1) as a, m.context(n_ctx=64, **T1) as b:
        with m.context(n_ctx=64, **own.context_params(), **T1) as c, PassCounter(a) as on_a:
            assert on_a.counts(a) and not on_a.counts(b) and not on_a.counts(c)
            assert own.counts(c) and not own.counts(a)
