"""pyllamacpp.scoring on the real library and the default model: log-probabilities against an
independent float64 numpy log-softmax of the same logits, windows, top-k, perplexity against a
direct recomputation, KL divergence (a run against itself, against another cache type), the base
file, ``complete(logprobs=k)``, the CLI commands; and, opt-in (``PYLLAMACPP_SLOW=1``), against
llama.cpp's own ``llama-perplexity`` built from the vendored sources."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp import scoring
from pyllamacpp.batch import Batch

ROOT = Path(__file__).resolve().parent.parent
T = {"n_threads": 1, "n_threads_batch": 1}  # the machine is shared: one thread each
# With flash attention on, ggml's CPU kernel gives other logits for the same tokens in ubatches of
# another size (up to 1.37 apart, 64 against 32 rows, default model): comparisons of two batch
# layouts run with it off, where they are bit-identical.
OFF = {**T, "flash_attn": "off"}


@pytest.fixture(scope="module")
def text_tokens(model):
    return model.tokenize(scoring.sample_text())


def ref_log_softmax(logits: np.ndarray) -> np.ndarray:
    """Every token's log-probability, float64 numpy, independent of the C loop."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def decode_all(ctx, tokens, pos0=0, seq=0):
    """Decode ``tokens`` in one batch with logits at every row; a copy of them."""
    b = Batch(len(tokens), 1, model=ctx.model)
    b.add_sequence(tokens, seq, pos0, logits="all")
    ctx.decode(b)
    return ctx.logits_all().copy()


# -- log_softmax ---------------------------------------------------------------------------------
def test_log_softmax_against_float64_numpy(model, text_tokens):
    toks = text_tokens[:64]
    with model.context(n_ctx=128, **T) as ctx:
        b = Batch(64, 1, model=model)
        b.add_sequence(toks, 0, 0, logits="all")
        ctx.decode(b)
        view = ctx.logits_all()
        r = scoring.log_softmax(view[:-1], toks[1:], top_k=5, argmax=True)
        ref = ref_log_softmax(view[:-1])
        x = np.asarray(view[:-1])
        del view
    assert r.target is not None and r.argmax is not None and r.top_ids is not None and r.top_logprobs is not None
    assert r.target.dtype == np.float64 and r.lse.dtype == np.float64
    want = ref[np.arange(63), toks[1:]]
    assert np.max(np.abs(r.target - want)) < 2e-6
    lse = x.max(1) + np.log(np.exp(x.astype(np.float64) - x.max(1, keepdims=True)).sum(1))
    assert np.max(np.abs(r.lse - lse)) < 1e-6
    assert np.array_equal(r.argmax, np.argmax(x, axis=1))  # the first index of the max, as numpy's
    order = np.argsort(-x, axis=1, kind="stable")[:, :5]  # equal logits in index order
    assert np.array_equal(r.top_ids, order)
    assert np.max(np.abs(r.top_logprobs - np.take_along_axis(ref, order, 1))) < 2e-6
    assert np.all(np.diff(r.top_logprobs, axis=1) <= 0)


def test_log_softmax_is_stable_and_reads_views():
    x = np.zeros((3, 1001), np.float32)
    x[0, 7] = 1e4  # exp overflows without the max subtracted
    x[1] = -1e4
    x[2, ::2] = 50.0
    r = scoring.log_softmax(x[:, :1000], [7, 0, 2], top_k=2)  # a strided view of rows
    assert r.target is not None and r.top_ids is not None
    assert r.target[0] == 0.0 and math.isclose(r.target[1], -math.log(1000), rel_tol=1e-12)
    assert math.isclose(r.target[2], -math.log(500), rel_tol=1e-9)
    assert r.top_ids[2].tolist() == [0, 2]
    one = scoring.log_softmax(np.arange(10, dtype=np.float32), [9])
    assert one.target is not None and math.isclose(
        one.target[0], float(ref_log_softmax(np.arange(10))[9]), abs_tol=1e-7
    )
    f64 = scoring.log_softmax(np.arange(10, dtype=np.float64), [9])  # another dtype: copied to float32
    assert f64.target is not None and f64.target[0] == one.target[0]


def test_log_softmax_bad_input():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="2 rows"):
        scoring.log_softmax(x, [1])
    with pytest.raises(ValueError, match=r"targets\[1\] is 8"):
        scoring.log_softmax(x, [1, 8])
    with pytest.raises(ValueError, match="top_k"):
        scoring.log_softmax(x, top_k=9)
    with pytest.raises(ValueError, match="shape"):
        scoring.log_softmax(np.zeros((2, 2, 2), np.float32))


# -- score ---------------------------------------------------------------------------------------
def test_score_one_window_equals_direct(model, text_tokens):
    toks = text_tokens[:96]
    s = model.score(toks, top_k=3, **T)
    assert s.windows == [(0, 1)] and s.logprobs.shape == (95,) and s.top_ids is not None
    with model.context(n_ctx=128, **T) as ctx:
        ref = ref_log_softmax(decode_all(ctx, toks)[:-1])
    want = ref[np.arange(95), toks[1:]]
    assert np.max(np.abs(s.logprobs - want)) < 1e-4  # the same tokens in other batches: near, not bitwise
    assert math.isclose(s.nll, -want.sum(), rel_tol=1e-5)
    assert math.isclose(s.perplexity, math.exp(-want.mean()), rel_tol=1e-5)
    assert np.array_equal(s.top_ids[:, 0], np.argmax(ref, axis=1))
    same_text = pl.scoring.score(model, model.detokenize(toks), **T)  # a str is tokenized the same way
    assert np.array_equal(same_text.tokens, toks)


def test_score_windows_refeed_context(model, text_tokens):
    toks = text_tokens[:300]
    s = scoring.score(model, toks, n_ctx=128, n_batch=64, keep=32, **OFF)
    # window 0 feeds 0..127 (targets 1..127), then each feeds 32 tokens of context and 96 new ones
    assert s.windows == [(0, 1), (96, 128), (192, 224)]
    assert s.logprobs.shape == (299,) and np.all(np.isfinite(s.logprobs)) and np.all(s.logprobs <= 0)
    with model.context(n_ctx=128, **OFF) as ctx:
        second = ref_log_softmax(decode_all(ctx, toks[96:224]))  # window 1, alone
    want = second[np.arange(32 - 1, 127), toks[128:224]]  # rows of tokens 127..222 predict 128..223
    assert np.max(np.abs(s.logprobs[127:223] - want)) < 2e-6
    with pytest.raises(ValueError, match="keep="):
        scoring.score(model, toks, n_ctx=128, keep=127, **T)


def test_score_in_a_given_context(model, text_tokens):
    with model.context(n_ctx=256, n_batch=64, **T) as ctx:
        s = scoring.score(ctx, text_tokens[:300], seq_id=0)
        # window 0 feeds 0..255; window 1 re-feeds 128..255 as context, scores 256..299, stays in memory
        assert s.windows == [(0, 1), (128, 256)] and ctx.memory.seq_pos_max(0) == 171
        with pytest.raises(ValueError, match="for a Model"):
            scoring.score(ctx, text_tokens[:10], n_ctx=64)
    with pytest.raises(ValueError, match="at least 2"):
        scoring.score(model, text_tokens[:1])
    with pytest.raises(TypeError, match="Model or a Context"):
        scoring.score("model.gguf", [1, 2])  # type: ignore[arg-type]


# -- perplexity ----------------------------------------------------------------------------------
def direct_perplexity(model, tokens, n_ctx, n_chunk, bos=None):  # flash attention off
    """llama-perplexity's definition recomputed: each chunk decoded alone (BOS first when given),
    float64 numpy log-softmax at positions n_ctx//2 .. n_ctx-2, predicting the next token."""
    first, nll = n_ctx // 2, []
    with model.context(n_ctx=n_ctx, n_batch=n_ctx, **OFF) as ctx:
        for i in range(n_chunk):
            chunk = tokens[i * n_ctx : (i + 1) * n_ctx].copy()
            if bos is not None:
                chunk[0] = bos
            ctx.memory.clear()
            ref = ref_log_softmax(decode_all(ctx, chunk)[first:-1])
            nll.append(-ref[np.arange(n_ctx - 1 - first), tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx]])
    return np.array(nll)


@pytest.mark.parametrize("n_batch", [128, 32], ids=["2 chunks per batch", "2 batches per chunk"])
def test_perplexity_against_direct_recomputation(model, text_tokens, n_batch):
    r = scoring.perplexity(model, text_tokens, 64, n_batch, n_chunks=3, **OFF)
    assert (r.n_seq, r.n_chunk, r.add_bos) == ((2, 3, False) if n_batch == 128 else (1, 3, False))
    ref = direct_perplexity(model, text_tokens, 64, 3)
    assert r.nll.shape == (3, 31)
    assert np.max(np.abs(r.nll - ref)) < 2e-6
    flat = r.nll.ravel()
    assert np.allclose(r.chunks, [math.exp(r.nll[: i + 1].mean()) for i in range(3)], rtol=1e-12)
    mean, var = flat.mean(), (flat * flat).mean() - flat.mean() ** 2
    assert math.isclose(r.ppl, math.exp(mean), rel_tol=1e-12)
    assert math.isclose(r.ppl_err, math.sqrt(var / (flat.size - 1)) * r.ppl, rel_tol=1e-9)
    lines = r.report().splitlines()
    assert lines[0] == "".join(f"[{i + 1}]{v:.4f}," for i, v in enumerate(r.chunks))
    assert lines[1] == f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}"


@pytest.mark.parametrize("n_batch", [128, 32], ids=["2 chunks per batch", "2 batches per chunk"])
def test_perplexity_bos_replaces_each_chunks_first_token(model, text_tokens, monkeypatch, n_batch):
    # the default model adds no BOS: take the branch of one that does, and check it against the definition;
    # with 2 batches per chunk only the first starts with BOS; the second (from position 32) keeps its token
    monkeypatch.setattr(scoring._perplexity, "_check_vocab_flags", lambda m: True)
    r = scoring.perplexity(model, text_tokens, 64, n_batch, n_chunks=2, **OFF)
    assert r.add_bos and r.n_batch == min(n_batch, 128)
    ref = direct_perplexity(model, text_tokens, 64, 2, bos=model.bos)
    plain = direct_perplexity(model, text_tokens, 64, 2)
    assert np.max(np.abs(r.nll - ref)) < 2e-6
    assert np.max(np.abs(ref - plain)) > 1e-3  # the substitution changes the result: the check can fail


def test_perplexity_refuses_what_llama_perplexity_refuses(model, text_tokens):
    with pytest.raises(ValueError, match="at least 128 tokens"):
        scoring.perplexity(model, text_tokens[:100], 64, **T)
    with pytest.raises(ValueError, match="multiple"):
        scoring.perplexity(model, text_tokens, 64, 100, **T)
    with model.context(n_ctx=128, n_batch=128, **T) as ctx:  # n_seq 2 but n_seq_max 1
        with pytest.raises(ValueError, match="cannot hold 2 chunk"):
            scoring.perplexity(ctx, text_tokens, 64)


# -- KL divergence and the base file --------------------------------------------------------------
@pytest.fixture(scope="module")
def base_file(model, text_tokens, tmp_path_factory):
    path = tmp_path_factory.mktemp("kld") / "base.kld"
    r = scoring.perplexity(model, text_tokens, 64, 128, n_chunks=4, save_base=path, **T)
    return path, r


def test_perplexity_and_kl_leave_a_callers_context_open_and_its_memory_cleared(model, text_tokens, base_file):
    """A Context passed in is cleared when the run ends, as it is before each group of chunks
    (its cells would make the caller's next prefill of sequence 0 start past position 0), and
    when a run is stopped (a KeyboardInterrupt from on_chunk after the first chunk)."""
    path, r = base_file

    def stopped(*_):
        raise KeyboardInterrupt

    with model.context(n_ctx=128, n_batch=128, n_seq_max=2, **T) as ctx:
        runs = {
            "perplexity": lambda **kw: scoring.perplexity(ctx, text_tokens, 64, n_chunks=4, **kw),
            "kl_divergence": lambda **kw: scoring.kl_divergence(ctx, path, **kw),
        }
        for name, run in runs.items():
            for on_chunk in (None, stopped):
                if on_chunk is None:
                    assert run().n_chunk == 4
                else:
                    with pytest.raises(KeyboardInterrupt):
                        run(on_chunk=on_chunk)
                assert not ctx.closed and [ctx.memory.seq_pos_max(s) for s in (0, 1)] == [-1, -1], (name, on_chunk)
                ctx.prefill(model.tokenize("The sky is"))
                assert ctx.memory.seq_pos_max(0) == 2


def test_base_file_format(model, text_tokens, base_file):
    path, r = base_file
    b = scoring.BaseLogits(path)
    nv = 2 * ((model.n_vocab + 1) // 2) + 4
    assert (b.n_ctx, b.n_vocab, b.n_chunk, b.nv, b.n_scored) == (64, model.n_vocab, 4, nv, 31)
    assert path.stat().st_size == 20 + 4 * 64 * 4 + 2 * nv * 31 * 4
    assert path.read_bytes()[:8] == b"_logits_" and np.array_equal(b.tokens, text_tokens[: 4 * 64])
    # the stored log-probabilities are within half a quantization step of the computed ones
    with model.context(n_ctx=64, **T) as ctx:
        ref = ref_log_softmax(decode_all(ctx, text_tokens[64:128])[32:-1])  # chunk 1
    stored = b.log_probs(1)
    scale = np.ascontiguousarray(np.asarray(b.rows[1])[:, :4]).view(np.float32)[:, 0]
    near = ref >= ref.max(axis=1, keepdims=True) - 15.9  # within 16 of the max: stored, not clamped
    err = np.abs(stored - ref)
    assert np.all(err[near] <= (scale[:, None] * 0.5 + 2e-4).repeat(ref.shape[1], 1)[near])
    assert np.allclose(-stored[np.arange(31), text_tokens[97:128]], r.nll[1], atol=2e-4)


def test_base_file_errors(base_file, tmp_path):
    path, _ = base_file
    data = path.read_bytes()
    short = tmp_path / "short.kld"
    short.write_bytes(data[:-10])
    with pytest.raises(ValueError, match=rf"expected {len(data)} bytes .* the file has {len(data) - 10}"):
        scoring.BaseLogits(short)
    bad = tmp_path / "bad.kld"
    bad.write_bytes(b"_logitz_" + data[8:])
    with pytest.raises(ValueError, match="not a base-logits file"):
        scoring.BaseLogits(bad)
    with pytest.raises(IndexError):
        scoring.BaseLogits(path).log_probs(4)


def test_kl_divergence_of_a_run_against_itself_is_zero(model, base_file):
    path, r = base_file
    k = scoring.kl_divergence(model, path, 128, **T)
    assert k.count == 4 * 31 and k.n_chunk == 4
    assert abs(k.kld) < 1e-5 and k.kld_max < 1e-4  # 0 but for the base's 16-bit storage
    assert k.same_top == 1.0 and abs(k.p_diff) < 1e-5
    assert math.isclose(k.ppl, r.ppl, rel_tol=1e-6) and abs(k.ln_ratio) < 1e-5
    assert "Same top p: 100.000" in k.report()


def test_kl_divergence_of_another_cache_type_is_not(model, base_file):
    path, r = base_file
    k = scoring.kl_divergence(model, path, 128, type_k="q4_0", type_v="q4_0", flash_attn="on", **T)
    assert k.kld > 1e-3 and k.same_top < 1.0  # a quantized cache changes the predictions
    assert math.isclose(k.ppl_base, r.ppl, rel_tol=1e-3)
    assert k.kld_min <= k.kld_median <= k.kld_percentiles[99.0] <= k.kld_max
    assert k.kld_values.shape == (4 * 31,) and math.isclose(
        float(k.kld_values.astype(np.float64).mean()), k.kld, rel_tol=1e-5
    )
    assert math.isclose(k.same_top, float(k.same_top_values.mean()))
    assert k.chunks[-1]["kld"] == pytest.approx(k.kld) and len(k.chunks) == 4
    with pytest.raises(ValueError, match="inconsistent vocabulary"):
        small = pl.testing.make_model(path.parent / "tiny.gguf", n_layer=1, n_embd=32, n_head=2, n_vocab=64)
        with pl.Model(small) as m:
            scoring.kl_divergence(m, path, **T)


def sem(v) -> float:
    """The standard error of the mean, numpy's way: llama-perplexity's ``mean_and_uncertainty``
    (``sqrt((mean(v^2) - mean(v)^2) / (count - 1))``) in other words."""
    v = np.asarray(v, np.float64)
    return float(np.std(v, ddof=1) / math.sqrt(v.size))


def kl_figures(nll, nll_base, kld, p_diff, same) -> dict[str, float]:
    """Every figure of llama-perplexity's KL divergence statistics, from per-token values with numpy
    (more than 10 of them: below that llama-perplexity gives no uncertainties). Where a figure
    divides by 0 (values all alike), what the package gives: a correlation of nan, an RMS error of 0."""
    nll, nll_base = np.asarray(nll, np.float64), np.asarray(nll_base, np.float64)
    kld, p_diff, same = np.asarray(kld, np.float64), np.asarray(p_diff, np.float64), np.asarray(same, np.float64)
    ppl, ppl_b = math.exp(nll.mean()), math.exp(nll_base.mean())
    rms = math.sqrt(float(np.mean(p_diff**2)))
    s_q, s_b = sem(nll), sem(nll_base)
    return {
        "ppl": ppl,
        "ppl_err": ppl * s_q,
        "ppl_base": ppl_b,
        "ppl_base_err": ppl_b * s_b,
        "cor": float(np.corrcoef(nll, nll_base)[0, 1]) if s_q * s_b > 0 else math.nan,
        "ln_ratio": float(nll.mean() - nll_base.mean()),
        "ln_ratio_err": sem(nll - nll_base),
        "ratio": ppl / ppl_b,
        "ratio_err": ppl / ppl_b * sem(nll - nll_base),
        "diff": ppl - ppl_b,
        # sqrt((ppl s_q)^2 + (ppl_b s_b)^2 - 2 ppl ppl_b cov): the standard error of the per-token differences
        "diff_err": sem(ppl * nll - ppl_b * nll_base),
        "kld": float(kld.mean()),
        "kld_err": sem(kld),
        "kld_max": float(kld.max()),
        "kld_median": float(np.median(kld)),
        "kld_min": float(kld.min()),
        "p_diff": float(p_diff.mean()),
        "p_diff_err": sem(p_diff),
        "p_diff_max": float(p_diff.max()),
        "p_diff_median": float(np.median(p_diff)),
        "p_diff_min": float(p_diff.min()),
        "rms_p_diff": rms,
        "rms_p_diff_err": 0.5 / rms * sem(p_diff**2) if rms > 0 else 0.0,
        "same_top": float(same.mean()),
        "same_top_err": sem(same),
    }


def test_kl_divergence_figures_against_numpy_over_the_per_token_values(model, text_tokens, base_file):
    """A quantized cache against the f16 base: every figure and percentile, and each chunk's row of
    the table, recomputed with numpy from the per-token values: KL divergence, Δp and top-1 from
    the result, nll from the same run's perplexity (the same chunks and batches), nll_base from
    the stored rows. Percentiles as perplexity.cpp's ``percentile`` (linear between the two
    nearest ranks of ``fraction * (count - 1)``): numpy's ``method="linear"``."""
    path, _ = base_file
    q4 = {"type_k": "q4_0", "type_v": "q4_0", "flash_attn": "on", **T}
    k = scoring.kl_divergence(model, path, 128, **q4)
    nll = scoring.perplexity(model, text_tokens, 64, 128, n_chunks=4, **q4).nll.ravel()
    b = scoring.BaseLogits(path)
    targets = np.asarray(b.tokens).reshape(4, 64)[:, 33:]  # rows 32..62 predict tokens 33..63
    nll_base = -np.concatenate([b.log_probs(c)[np.arange(31), targets[c]] for c in range(4)]).astype(np.float64)
    kv, pv, same = k.kld_values, k.p_diff_values, k.same_top_values
    assert k.count == kv.size == nll.size == 124 and k.kld > 1e-3 and 0 < k.same_top < 1
    assert np.allclose(pv, np.exp(-nll) - np.exp(-nll_base), atol=1e-5)  # the per-token values agree
    # float32 terms summed in double there and here, float32 nll against float64: measured within 2e-6
    # of each other; an uncertainty over count instead of count - 1 is 4e-3 off
    for name, v in kl_figures(nll, nll_base, kv, pv, same).items():
        assert math.isclose(getattr(k, name), v, rel_tol=1e-5, abs_tol=1e-9), (name, getattr(k, name), v)
    for got, values, qs in (
        (k.kld_percentiles, kv, scoring.KLD_PERCENTILES),
        (k.p_diff_percentiles, pv, scoring.P_DIFF_PERCENTILES),
    ):
        assert list(got) == list(qs)
        for q in qs:
            ref = float(np.percentile(values.astype(np.float64), q, method="linear"))
            assert math.isclose(got[q], ref, rel_tol=1e-5, abs_tol=1e-7), (q, got[q], ref)
    # each chunk's row of the table: the figures over the chunks so far
    assert len(k.chunks) == 4
    for i, row in enumerate(k.chunks):
        n = 31 * (i + 1)
        f = kl_figures(nll[:n], nll_base[:n], kv[:n], pv[:n], same[:n])
        for name, got in row.items():
            assert math.isclose(got, f[name], rel_tol=1e-5, abs_tol=1e-9), (i, name, got, f[name])


# -- complete(logprobs=k) --------------------------------------------------------------------------
def test_complete_logprobs_like_llama_cpp_python(model):
    prompt = "The capital of France is"
    with model.context(n_ctx=128, **T) as ctx:
        c = model.complete(prompt, 8, ctx=ctx, logprobs=3)
    lp = c.logprobs
    assert lp is not None and set(lp) == {"tokens", "text_offset", "token_logprobs", "top_logprobs", "token_ids"}
    n = len(lp["token_ids"])
    assert n == len([t for t in c.tokens if not model.is_eog(t)]) and n > 0
    assert lp["text_offset"][0] == len(prompt) and lp["text_offset"] == sorted(lp["text_offset"])
    assert "".join(lp["tokens"]) == str(c)
    for text, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert text in top and top[text] == v and 3 <= len(top) <= 4
        assert v == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
    # the logits each token was sampled from, replayed as generation decodes them (the prompt, then one
    # token per decode: another batch layout gives other logits), with a float64 numpy log-softmax
    want = []
    with model.context(n_ctx=128, **T) as ctx:
        pos = ctx.prefill(model.tokenize(prompt))
        one = Batch(1, 1, model=model)
        for i, tok in enumerate(lp["token_ids"]):
            want.append(ref_log_softmax(ctx.logits(-1))[tok])
            if i + 1 < n:
                one.clear()
                one.add(tok, pos + i, 0, True)
                ctx.decode(one)
    assert np.max(np.abs(np.array(want) - np.array(lp["token_logprobs"]))) < 2e-6
    with model.context(n_ctx=128, **T) as ctx:
        stream = model.complete(prompt, 4, ctx=ctx, stream=True, logprobs=0)
        pieces = list(stream)
        assert stream.logprobs is not None and len(stream.logprobs["top_logprobs"][0]) == 1
        assert "".join(pieces) == "".join(stream.logprobs["tokens"])
        assert model.complete(prompt, 2, ctx=ctx).logprobs is None
        with pytest.raises(ValueError, match="logprobs"):
            model.complete(prompt, 2, ctx=ctx, logprobs=-1)


def test_complete_logprobs_are_exactly_the_logits_top_k(model):
    """``logprobs=k`` gives each token's ``k`` most likely alternatives, no more: the top-k of the
    logits it was sampled from (replayed as generation decodes them), most likely first."""
    prompt, k = "The capital of France is", 5
    with model.context(n_ctx=128, **T) as ctx:
        lp = model.complete(prompt, 6, ctx=ctx, logprobs=k).logprobs
    assert lp is not None and len(lp["token_ids"]) == 6
    with model.context(n_ctx=128, **T) as ctx:
        pos = ctx.prefill(model.tokenize(prompt))
        one = Batch(1, 1, model=model)
        for i, (tok, top) in enumerate(zip(lp["token_ids"], lp["top_logprobs"])):
            ref = ref_log_softmax(ctx.logits(-1))
            ids = np.argsort(-ref, kind="stable")[:k]
            want = {model.token_to_bytes(int(t)).decode("utf-8", "ignore"): float(ref[t]) for t in ids}
            assert len(want) == k and tok == ids[0]  # k distinct texts; greedy: the token is the first
            assert list(top) == list(want), i
            assert max(abs(top[t] - want[t]) for t in want) < 2e-6
            one.clear()
            one.add(tok, pos + i, 0, True)
            ctx.decode(one)


# -- the CLI ---------------------------------------------------------------------------------------
def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pyllamacpp.cli", *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tempfile.gettempdir(),
    )


def test_cli_perplexity_and_kl_divergence(model, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(scoring.sample_text()[:3000] + "\n")
    base = tmp_path / "base.kld"
    r = cli(
        "perplexity",
        "-f",
        str(text),
        "-c",
        "64",
        "-b",
        "128",
        "--chunks",
        "3",
        "-t",
        "1",
        "--kl-divergence-base",
        str(base),
    )
    assert r.returncode == 0, r.stderr
    api = scoring.perplexity(model, scoring.sample_text()[:3000], 64, 128, n_chunks=3, **T)  # -f drops one "\n"
    assert re.findall(r"\[\d\]\d+\.\d{4},", r.stdout) == [f"[{i + 1}]{v:.4f}," for i, v in enumerate(api.chunks)]
    assert f"Final estimate: PPL = {api.ppl:.4f} +/- {api.ppl_err:.5f}" in r.stdout
    assert "chunk 3/3" in r.stderr and scoring.BaseLogits(base).n_chunk == 3
    k = cli("perplexity", "--kl-divergence", "--kl-divergence-base", str(base), "-b", "128", "-t", "1", "--json")
    assert k.returncode == 0, k.stderr
    d = json.loads(k.stdout)
    assert d["count"] == 3 * 31 and d["same_top"] == 1.0 and abs(d["kld"]) < 1e-5
    bad = cli("perplexity", "--kl-divergence", "-t", "1")
    assert bad.returncode == 2 and "needs --kl-divergence-base" in bad.stderr
    h = cli("perplexity", "--help")
    assert "(default: 512)" in h.stdout and "--kl-divergence-base" in h.stdout


def test_cli_kv_types(tmp_path, model):
    out = tmp_path / "kv.png"
    r = cli(
        "kv-types", "--types", "f16,q8_0", "-c", "64", "-b", "128", "--chunks", "2", "-p", "16", "-n", "4",
        "--kv-ctx", "256", "-r", "1", "-t", "1", "--hellaswag-tasks", "3", "--json", "-o", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    rows = {x["type"]: x for x in d["rows"]}
    assert set(rows) == {"f16", "q8_0"}
    f16, q8 = rows["f16"], rows["q8_0"]
    assert (
        f16["bytes_per_token"] == 2 * q8["bytes_per_token"] * 32 // 34 // 1
        or q8["bytes_per_token"] < f16["bytes_per_token"]
    )
    assert q8["kv_mib"] < f16["kv_mib"] and f16["kv_mib"] > 0
    assert abs(f16["kld"]) < 1e-5 and f16["same_top"] == 1.0 and q8["kld"] > f16["kld"]
    assert f16["prefill_tps"] > 0 and f16["decode_tps"] > 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kv-types: " in r.stderr  # progress
    # the HellaSwag column: llama-perplexity's acc_norm of each cache type, and the picks f16 made
    from pyllamacpp.evaluation import hellaswag

    api = {
        t: hellaswag(model, None, 3, n_ctx=64, n_batch=128, type_k=t, type_v=t, flash_attn="on", **T)
        for t in ("f16", "q8_0")
    }
    for t, row in rows.items():
        assert row["hellaswag"] == api[t].accuracy and row["hellaswag_tasks"] == 3
        assert row["hellaswag_interval"] == list(api[t].interval)
    same = np.mean([a.pred == b.pred for a, b in zip(api["f16"].tasks, api["q8_0"].tasks)])
    assert f16["hellaswag_same_pick"] == 1.0 and q8["hellaswag_same_pick"] == same


# -- opt-in: against llama.cpp's own llama-perplexity ----------------------------------------------
SLOW = os.environ.get("PYLLAMACPP_SLOW") == "1"
slow = pytest.mark.skipif(
    not SLOW, reason="opt-in: PYLLAMACPP_SLOW=1 builds llama-perplexity from the vendored sources"
)
BUILD = ROOT / "build" / "llama-perplexity"
# ggml-cpu without AMX, as the package's CMakeLists.txt builds it (llama.cpp#20824 at this pin): the
# flags go after ggml's own through a call deferred to the end of the configure step
AMX_OFF = """
function(_pyl_amx_off)
  if(TARGET ggml-cpu)
    target_compile_options(ggml-cpu PRIVATE -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
  endif()
endfunction()
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL _pyl_amx_off)
"""


def llama_perplexity() -> Path:
    """``build/llama-perplexity/bin/llama-perplexity``, built once: only that target, ``-j2``,
    configured as the package's libraries (Release, shared, GGML_NATIVE, AMX compiled out);
    ``build_seconds.txt`` beside it keeps how long the build took."""
    exe = BUILD / "bin" / "llama-perplexity"
    if exe.exists():
        return exe
    src = ROOT / "vendor" / "llama.cpp"
    assert (src / "tools" / "perplexity" / "perplexity.cpp").exists(), "no vendored llama.cpp sources"
    BUILD.mkdir(parents=True, exist_ok=True)
    hook = BUILD / "amx_off.cmake"
    hook.write_text(AMX_OFF)
    cfg = [
        "cmake", "-S", str(src), "-B", str(BUILD), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", f"-DCMAKE_PROJECT_INCLUDE={hook}",
        f"-DGGML_CCACHE={'ON' if shutil.which('ccache') else 'OFF'}",
    ]  # fmt: skip
    t0 = time.perf_counter()
    with open(BUILD / "build.log", "w") as log:
        subprocess.run(cfg, check=True, stdout=log, stderr=subprocess.STDOUT)
        build = ["cmake", "--build", str(BUILD), "--target", "llama-perplexity", "-j2"]
        subprocess.run(build, check=True, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    (BUILD / "build_seconds.txt").write_text(f"{seconds:.0f}\n")
    print(f"built llama-perplexity in {seconds:.0f} s (log: {BUILD / 'build.log'})", file=sys.stderr)
    return exe


def run_native(args: list[str]) -> str:
    r = subprocess.run([str(llama_perplexity()), *args], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def run_ours(args: list[str]) -> str:
    r = cli("perplexity", *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def chunks_and_final(out: str) -> tuple[list[str], str]:
    chunks = re.findall(r"\[\d+\](\d+\.\d{4}),", out)
    final = re.search(r"Final estimate: PPL = \d+\.\d{4} \+/- \d+\.\d{5}", out)
    assert chunks and final, out[-3000:]
    return chunks, final.group(0)


@slow
@pytest.mark.parametrize(
    "c,b,chunks", [(256, 512, 8), (512, 256, 4)], ids=["2 chunks per batch", "2 batches per chunk"]
)
def test_same_as_llama_perplexity(model_path, c, b, chunks):
    common = ["-m", str(model_path), "-f", str(scoring.sample_text_path()), "-c", str(c), "-b", str(b), "-t", "2"]
    native = run_native([*common, "--chunks", str(chunks)])
    ours = run_ours([*common, "--chunks", str(chunks)])
    (BUILD / f"compare-c{c}-b{b}.txt").write_text(f"llama-perplexity:\n{native}\n\npyllamacpp perplexity:\n{ours}\n")
    n_chunks, n_final = chunks_and_final(native)
    o_chunks, o_final = chunks_and_final(ours)
    assert len(n_chunks) == chunks
    assert (o_chunks, o_final) == (n_chunks, n_final)


@slow
def test_base_file_and_kl_divergence_both_ways_with_llama_perplexity(model_path, tmp_path):
    common = ["-m", str(model_path), "-c", "256", "-b", "512", "-t", "2"]
    text = ["-f", str(scoring.sample_text_path()), "--chunks", "4"]
    nat_base, our_base = tmp_path / "native.kld", tmp_path / "ours.kld"
    run_native([*common, *text, "--kl-divergence-base", str(nat_base)])
    run_ours([*common, *text, "--kl-divergence-base", str(our_base)])
    a, b = scoring.BaseLogits(nat_base), scoring.BaseLogits(our_base)
    assert (a.n_ctx, a.n_vocab, a.n_chunk) == (b.n_ctx, b.n_vocab, b.n_chunk) == (256, a.n_vocab, 4)
    assert np.array_equal(a.tokens, b.tokens)
    ra, rb = np.asarray(a.rows), np.asarray(b.rows)
    assert np.mean(ra[..., 4:] == rb[..., 4:]) > 0.9999  # the same logits, quantized alike
    ha, hb = (np.ascontiguousarray(r[..., :4]).view(np.float32) for r in (ra, rb))
    assert np.allclose(ha, hb, rtol=1e-5, atol=1e-6)  # scale, min_log_prob (expf there, ggml's exp here)
    kl = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "--kl-divergence"]
    native_on_ours = run_native([*common, *kl, "--kl-divergence-base", str(our_base)])
    ours_on_native = run_ours([*common, *kl, "--kl-divergence-base", str(nat_base)])
    (BUILD / "compare-kld.txt").write_text(f"llama-perplexity:\n{native_on_ours}\n\npyllamacpp:\n{ours_on_native}\n")
    for key in ("Mean PPL(Q)", "Mean PPL(base)", "Mean    KLD", "Median  KLD", "99.0%   KLD", "RMS Δp", "Same top p"):
        n = re.search(re.escape(key) + r"\s*:\s*([-\d.]+)", native_on_ours)
        o = re.search(re.escape(key) + r"\s*:\s*([-\d.]+)", ours_on_native)
        assert n and o, key
        # printed alike, or one unit apart in the last digit: each side's exp (expf there, ggml's
        # vectorized one here) rounds a token's float nll differently now and then (1 ulp, ~1e-6)
        unit = 10.0 ** -len(n.group(1).split(".")[1])
        assert abs(float(n.group(1)) - float(o.group(1))) <= 1.01 * unit, (key, n.group(1), o.group(1))


# -- opt-in: llama-perplexity's multiple-choice modes, on the task files shipped -------------------
def mc_native_and_ours(args: list[str], name: str) -> tuple[str, str]:
    """``(llama-perplexity's text, ours)`` for one multiple-choice run: its stdout without the
    progress dots, with the final lines it writes to stderr put where ours prints them (before
    ``main``'s blank line); ours is the stdout of ``pyllamacpp perplexity``."""
    r = subprocess.run([str(llama_perplexity()), *args], capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ours = run_ours(args)
    out = "".join(line for line in r.stdout.splitlines(keepends=True) if not re.fullmatch(r"\.*done\n", line))
    finals = re.findall(r"(?:Final Winogrande score|Final result|Random chance)[^\n]*\n", r.stderr)
    native = out[:-1] + "".join(finals) + out[-1:]
    (BUILD / f"compare-{name}.txt").write_text(f"llama-perplexity:\n{native}\n\npyllamacpp perplexity:\n{ours}\n")
    return native, ours


@slow
@pytest.mark.parametrize(
    "extra",
    [["--hellaswag-tasks", "40"], ["--hellaswag-tasks", "12", "-np", "8", "-b", "64", "-fa", "off"]],
    ids=["40 tasks, one per batch", "2 tasks per batch, 64 tokens per decode, -fa off"],
)
def test_hellaswag_same_as_llama_perplexity(model_path, extra):
    from pyllamacpp.evaluation.llama_perplexity import sample_path

    args = ["-m", str(model_path), "-f", str(sample_path("hellaswag")), "--hellaswag", *extra, "-t", "2"]
    native, ours = mc_native_and_ours(args, "hellaswag-" + "-".join(a.strip("-") for a in extra))
    assert native.startswith("\ntask\tacc_norm\t95% confidence interval\n1\t")
    assert ours == native


@slow
def test_winogrande_same_as_llama_perplexity(model_path, tmp_path):
    from pyllamacpp.evaluation.llama_perplexity import sample_path

    common = ["-m", str(model_path), "--winogrande", "-t", "2"]
    native, ours = mc_native_and_ours([*common, "-f", str(sample_path("winogrande"))], "winogrande")
    assert native.count("\n") == 40 + 2 and ours == native  # every score, to its 6 decimals
    # 120 tasks (the 40 three times), 100 picked at random: the selection and the final score
    lines = sample_path("winogrande").read_text().splitlines()[:40]
    many = tmp_path / "many.csv"
    many.write_text("\n".join(lines * 3) + "\n\n")
    native, ours = mc_native_and_ours([*common, "-f", str(many), "--winogrande-tasks", "100"], "winogrande-100")
    assert "Final Winogrande score(100 tasks): " in native and ours == native


@slow
@pytest.mark.parametrize("extra", [[], ["--multiple-choice-tasks", "10"]], ids=["all tasks", "10 picked"])
def test_multiple_choice_same_as_llama_perplexity(model_path, extra):
    from pyllamacpp.evaluation.llama_perplexity import sample_path

    args = ["-m", str(model_path), "-f", str(sample_path("multiple-choice")), "--multiple-choice", *extra, "-t", "2"]
    native, ours = mc_native_and_ours(args, "multiple-choice" + ("-10" if extra else ""))
    assert "Final result: " in native and "Random chance: " in native
    assert ours == native


# -- behaviours held against the mutants of a sample (issue 28: tools/mutation/run.py scoring)


def test_kl_divergence_of_the_first_chunks_only(model, base_file):
    path, _ = base_file
    k = scoring.kl_divergence(model, path, 128, n_chunks=1, **T)
    assert k.n_chunk == 1 and k.count == 31


@pytest.mark.parametrize("bos", [1, 0])
def test_score_of_a_text_that_starts_with_bos(tmp_path, bos):
    """A vocabulary that adds BOS (id 1, or 0): the first window is the text as given (no second
    BOS), and each later window starts with BOS before its context."""
    from pyllamacpp.testing import make_model

    md = {"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": bos}
    path = make_model(tmp_path / "bos.gguf", "llama", n_layer=2, n_embd=32, n_head=2, n_vocab=64, metadata=md)
    toks = np.concatenate([[bos], np.random.default_rng(0).integers(2, 64, 99)]).astype(np.int32)
    with pl.Model(path) as m:
        s = scoring.score(m, toks, n_ctx=64, n_batch=64, keep=16, **T)
        with m.context(n_ctx=64, **T) as ctx:
            first = ref_log_softmax(decode_all(ctx, toks[:64]))
            ctx.memory.clear()
            (start, target) = s.windows[1]
            second = ref_log_softmax(decode_all(ctx, np.concatenate([[bos], toks[start:]])))
    assert s.windows[0] == (0, 1) and target == 64
    assert np.max(np.abs(s.logprobs[:63] - first[np.arange(63), toks[1:64]])) < 1e-5
    rows = np.arange(target - start, toks.size - start)  # fed row j (BOS first) predicts text token start + j
    assert s.windows == [(0, 1), (48, 64)]
    assert np.max(np.abs(s.logprobs[start + rows - 1] - second[rows, toks[start + rows]])) < 1e-5


def test_log_softmax_refuses_more_targets_than_rows():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="2 rows"):
        scoring.log_softmax(x, [1, 2, 3])


def test_base_log_probs_of_a_vocabulary_of_100(tmp_path):
    """BaseLogits.log_probs decodes a chunk's rows to (n_scored, n_vocab) log-probabilities, for
    any vocabulary size (100: bit 2 set), within the 16-bit storage of the direct log-softmax."""
    from pyllamacpp.testing import make_model

    path = make_model(tmp_path / "v100.gguf", "llama", n_layer=1, n_embd=32, n_head=2, n_vocab=100)
    toks = np.random.default_rng(1).integers(0, 100, 128).astype(np.int32)
    with pl.Model(path) as m:
        scoring.perplexity(m, toks, 64, 64, save_base=tmp_path / "v100.kld", **T)
        with m.context(n_ctx=64, **T) as ctx:
            ref = ref_log_softmax(decode_all(ctx, toks[:64]))[32:63]  # the rows scored: 32..62
    lp = scoring.BaseLogits(tmp_path / "v100.kld").log_probs(0)
    assert lp.shape == (31, 100) and np.max(np.abs(lp - ref)) < 2e-3
