"""Statistics with a numpy definition, held against it with ``hypothesis``: llama-perplexity's KL
divergence figures (percentiles, medians, uncertainties, the whole ``KLDivergence``), the C
log-softmax rows of ``pl.scoring.log_softmax`` against a float64 numpy log-softmax, and the
acceptance rates of speculative decoding and the scheduler's drafts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_scoring import kl_figures, sem

import pyllamacpp as pl
from pyllamacpp import scoring
from pyllamacpp.speculative import NgramDraft, SpeculativeStats, generate_speculative
from pyllamacpp.testing import make_model

PERPLEXITY_CPP = Path(__file__).resolve().parent.parent / "vendor/llama.cpp/tools/perplexity/perplexity.cpp"
FEW = settings(max_examples=50, deadline=None, database=None)  # no example database left in the tree

# float32 values, bounded: the statistics of llama-perplexity take float32 terms
f32 = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)


def _near(got: float, want: float, tol: float) -> bool:
    return abs(got - want) <= tol


def _percentile_ok(v: np.ndarray, fraction: float, got: float) -> tuple[bool, float]:
    """``got`` against numpy's linear percentile of the sorted ``v`` (and the value it returns).
    perplexity.cpp computes in float32, the rank ``fraction * (n - 1)`` too: allowed, a few float32
    steps of the two values it interpolates between and 3e-5 of their gap (the rank's rounding
    for n <= 300)."""
    want = float(np.percentile(v.astype(np.float64), 100 * fraction, method="linear"))
    lo = min(int(fraction * (v.size - 1)), v.size - 1)
    a, b = float(v[lo]), float(v[min(lo + 1, v.size - 1)])
    tol = 3e-5 * abs(b - a) + 4 * float(np.spacing(np.float32(max(abs(a), abs(b)))))
    return _near(got, want, tol) and min(a, b) - tol <= got <= max(a, b) + tol, want


# -- percentiles and the median -------------------------------------------------------------------
# every element drawn on its own (numpy arrays from hypothesis repeat one value by default)
values32 = hnp.arrays(np.float32, st.integers(1, 300), elements=f32, fill=st.nothing())


@FEW
@given(
    values32,
    st.one_of(st.floats(0, 1), st.sampled_from([q / 100 for q in scoring.P_DIFF_PERCENTILES] + [0.0, 1.0])),
)
def test_percentile_is_numpys_linear_method(values, fraction):
    """perplexity.cpp's ``percentile``: linear between the ranks around ``fraction * (n - 1)``,
    numpy's default ``method="linear"``."""
    v = np.sort(values)
    got = scoring._percentile(v, fraction)
    ok, want = _percentile_ok(v, fraction, got)
    assert ok, (got, want, fraction)


@FEW
@given(values32)
def test_median_is_numpys(values):
    """perplexity.cpp's median: the middle value, or the mean of the two middle ones (in float32)."""
    v = np.sort(values)
    want = float(np.median(v.astype(np.float64)))
    mid = np.abs(v[(v.size - 1) // 2 : v.size // 2 + 1]).max()
    assert _near(scoring._median(v), want, 2 * float(np.spacing(mid)))


# -- uncertainties ---------------------------------------------------------------------------------
# Values on a grid of 1/64 (0..20): their float32 squares are exact, so llama-perplexity's formula
# (mean(x^2) - mean(x)^2 over count - 1, from float32 terms) and numpy differ only by rounding in
# double, not by the float32 products the formula takes as input.
grid = hnp.arrays(np.int64, st.integers(1, 200), elements=st.integers(0, 1280)).map(
    lambda k: (k / 64).astype(np.float32)
)


@FEW
@given(grid)
def test_mean_and_uncertainty_is_the_standard_error_of_the_mean(x):
    d = x.astype(np.float64)
    mean, unc = scoring._mean_unc(float(d.sum()), float((x * x).astype(np.float64).sum()), x.size)
    assert math.isclose(mean, float(d.mean()), rel_tol=1e-12, abs_tol=1e-12)
    # llama-perplexity gives no uncertainty for 10 values or fewer
    want = sem(d) if x.size > 10 else 0.0
    assert math.isclose(unc, want, rel_tol=1e-7, abs_tol=1e-7), (unc, want, x.size)


@FEW
@given(st.integers(1, 200).flatmap(lambda n: st.tuples(*[hnp.arrays(np.int64, n, elements=st.integers(0, 1280))] * 2)))
def test_covariance_is_the_covariance_of_the_two_means(ks):
    a, b = (k / 64 for k in ks)
    got = scoring._cov(float(a.sum()), float(b.sum()), float((a * b).sum()), a.size)
    want = float(np.cov(a, b, ddof=1)[0, 1]) / a.size if a.size >= 10 else 0.0  # none under 10, as there
    assert math.isclose(got, want, rel_tol=1e-7, abs_tol=1e-12), (got, want)


@st.composite
def per_token(draw):
    """Chunks of per-token values as kl_divergence has them, more than 10 in all: nll and nll_base
    (float32), KL divergence (float64), Δp (float32), top-1 agreement (int8), on grids whose float32
    squares are exact."""
    n_chunk = draw(st.integers(1, 4))
    n_scored = draw(st.integers(max(3, 11 // n_chunk + 1), 40))
    n = n_chunk * n_scored
    ints = lambda lo, hi: hnp.arrays(np.int64, n, elements=st.integers(lo, hi))  # noqa: E731
    nll = (draw(ints(0, 1280)) / 64).astype(np.float32)
    nll_base = (draw(ints(0, 1280)) / 64).astype(np.float32)
    kld = draw(ints(0, 640)) / 64
    p_diff = (draw(ints(-2048, 2048)) / 2048).astype(np.float32)
    same = draw(hnp.arrays(np.int8, n, elements=st.integers(0, 1)))
    return n_chunk, n_scored, nll, nll_base, kld, p_diff, same


def _figures_match(got: dict[str, float], want: dict[str, float], where: str, ref: dict[str, float]) -> None:
    # llama-perplexity takes these three as sqrt(a^2 + b^2 - 2 cov): where they are near 0 the
    # difference of large terms leaves rounding of about 1e-8 of the terms (or below 0: nan)
    terms = {
        "ln_ratio_err": math.hypot(ref["ppl_err"] / ref["ppl"], ref["ppl_base_err"] / ref["ppl_base"]),
        "diff_err": math.hypot(ref["ppl_err"], ref["ppl_base_err"]),
    }
    terms["ratio_err"] = ref["ratio"] * terms["ln_ratio_err"]
    for name, w in want.items():
        g = got[name]
        if math.isnan(w):
            assert math.isnan(g), (where, name, g, w)
        elif name in terms:
            tol = 1e-6 * terms[name] + 1e-7
            assert (math.isnan(g) and w < tol) or abs(g - w) <= tol + 1e-6 * w, (where, name, g, w)
        else:
            assert math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-7), (where, name, g, w)


def _kl(n_chunk, n_scored, nll, nll_base, kld, p_diff, same):
    sums, chunks = scoring._KLSums(), []
    for c in range(n_chunk):
        sl = slice(c * n_scored, (c + 1) * n_scored)
        sums.add(nll[sl], nll_base[sl], kld[sl], p_diff[sl], same[sl])
        chunks.append(sums.chunk_row())
    return scoring._kl_result(64, n_chunk, sums, chunks, kld, p_diff, same, 0.0)


@FEW
@given(per_token())
def test_kl_statistics_are_their_numpy_definitions(data):
    """The whole ``KLDivergence`` and each chunk's row of its table (of more than 10 tokens) from
    the per-token values, against numpy: means, standard errors, the correlation, the ratio's
    error as the standard error of the per-token differences, percentiles by numpy's linear
    method, medians, extremes."""
    n_chunk, n_scored, nll, nll_base, kld, p_diff, same = data
    with np.errstate(all="ignore"):
        k = _kl(*data)
        want = kl_figures(nll, nll_base, kld, p_diff, same)
    assert k.count == nll.size and k.n_chunk == n_chunk
    _figures_match({name: getattr(k, name) for name in want}, want, "total", want)
    for got, values in ((k.kld_percentiles, kld), (k.p_diff_percentiles, p_diff)):
        v = np.sort(values.astype(np.float32))
        for q, x in got.items():
            ok, ref = _percentile_ok(v, q / 100, x)
            assert ok, (q, x, ref)
    for c, row in enumerate(k.chunks):
        n = (c + 1) * n_scored
        if n > 10:
            with np.errstate(all="ignore"):
                f = kl_figures(nll[:n], nll_base[:n], kld[:n], p_diff[:n], same[:n])
            _figures_match(row, {name: f[name] for name in row}, f"chunk {c}", f)


def test_kl_statistics_of_10_tokens_or_fewer_have_no_uncertainties():
    """llama-perplexity's mean_and_uncertainty gives 0 for count <= 10 (its covariance: for count
    < 10); the top-1 agreement's error is the Bernoulli one from 2 tokens on."""
    rng = np.random.default_rng(0)
    for n in (5, 10, 11):
        nll, nll_base = rng.uniform(0, 20, (2, n)).astype(np.float32)
        kld, p_diff = rng.uniform(0, 5, n), rng.uniform(-1, 1, n).astype(np.float32)
        same = (rng.uniform(size=n) < 0.5).astype(np.int8)
        k = _kl(1, n, nll, nll_base, kld, p_diff, same)
        zero = n <= 10
        assert (k.ppl_err == 0, k.kld_err == 0, k.p_diff_err == 0, k.rms_p_diff_err == 0) == (zero,) * 4
        assert math.isclose(k.same_top_err, sem(same), rel_tol=1e-12)
        assert math.isnan(k.cor) == zero


def test_kl_summary_is_what_perplexity_cpp_prints():
    """``KLDivergence.summary()`` is the text of perplexity.cpp's ``LOG`` calls after its table:
    their format strings, read from the vendored source in order (C's printf and Python's ``%``
    read these formats alike), applied to the figures each of them prints."""
    if not PERPLEXITY_CPP.exists():
        pytest.skip("no vendored llama.cpp sources")
    src = PERPLEXITY_CPP.read_text(encoding="utf-8")
    start = src.index('LOG("====== Perplexity statistics')
    block = src[start : src.index("\n", src.index('LOG("Same top p', start))]
    fmts = [f + "\n" for f in re.findall(r'^\s*LOG\("(.*?)\\n"', block, re.M)]  # not the // LOG( lines
    rng = np.random.default_rng(1)
    nll, nll_base = rng.uniform(0, 8, (2, 200)).astype(np.float32)
    kld, p_diff = rng.uniform(0, 0.5, 200), rng.uniform(-0.3, 0.3, 200).astype(np.float32)
    k = _kl(4, 50, nll, nll_base, kld, p_diff, (rng.uniform(size=200) < 0.8).astype(np.int8))
    kq = [(k.kld_percentiles[q],) for q in (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)]
    pq = [(100 * k.p_diff_percentiles[q],) for q in (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)]
    args = [
        *[(), (k.ppl, k.ppl_err), (k.ppl_base, k.ppl_base_err), (100 * k.cor,), (k.ln_ratio, k.ln_ratio_err)],
        *[(k.ratio, k.ratio_err), (k.diff, k.diff_err), ()],
        *[(), (k.kld, k.kld_err), (k.kld_max,), *kq[:4], (k.kld_median,), *kq[4:], (k.kld_min,), ()],
        *[(), (100 * k.p_diff, 100 * k.p_diff_err), (100 * k.p_diff_max,), *pq[:5], (100 * k.p_diff_median,)],
        *[*pq[5:], (100 * k.p_diff_min,), (100 * k.rms_p_diff, 100 * k.rms_p_diff_err)],
        (100 * k.same_top, 100 * k.same_top_err),
    ]
    assert len(fmts) == len(args) == 39
    assert k.summary() + "\n" == "".join(f % a for f, a in zip(fmts, args))


# -- log-softmax -----------------------------------------------------------------------------------
@st.composite
def logit_rows(draw):
    n_rows, n_vocab = draw(st.integers(1, 40)), draw(st.integers(1, 300))
    x = draw(hnp.arrays(np.float32, (n_rows, n_vocab), elements=f32 | st.just(np.float32(-np.inf))))
    x[:, draw(st.integers(0, n_vocab - 1))] = draw(f32)  # a finite logit in every row (all -inf: nan)
    targets = draw(hnp.arrays(np.int32, n_rows, elements=st.integers(0, n_vocab - 1)))
    return x, targets, draw(st.integers(0, n_vocab)), draw(st.sampled_from([1, 2]))


@FEW
@given(logit_rows())
def test_log_softmax_is_a_float64_numpy_log_softmax(data):
    """The C rows (exp in float, sums in double) against numpy in float64: log-sum-exp and the
    targets' log-probabilities within 2e-6 (masked -inf logits give -inf), the first argmax, the
    top-k most likely first with equal logits in index order; rows split over threads give each
    row's values bit for bit as one thread does."""
    x, targets, k, n_threads = data
    r = scoring.log_softmax(x, targets, top_k=k, argmax=True, n_threads=n_threads)
    d = x.astype(np.float64)
    m = d.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(d - m).sum(axis=1, keepdims=True))
    ref = d - lse
    assert r.target is not None and r.argmax is not None
    assert np.allclose(r.lse, lse[:, 0], rtol=0, atol=2e-6)
    assert np.allclose(r.target, ref[np.arange(x.shape[0]), targets], rtol=0, atol=2e-6)
    assert np.array_equal(r.argmax, np.argmax(x, axis=1))
    one = scoring.log_softmax(x, targets, top_k=k, argmax=True, n_threads=1)  # rows split over threads:
    assert np.array_equal(r.lse, one.lse) and np.array_equal(r.target, one.target)  # each row bit for bit
    if k:
        assert r.top_ids is not None and r.top_logprobs is not None
        order = np.argsort(-x, axis=1, kind="stable")[:, :k]
        assert np.array_equal(r.top_ids, order)
        assert np.allclose(r.top_logprobs, np.take_along_axis(ref, order, 1), rtol=0, atol=2e-6)
    else:
        assert r.top_ids is None


# -- acceptance rates ------------------------------------------------------------------------------
rounds = st.lists(st.integers(0, 6).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d))), max_size=40)


def _per_position(rs):
    """Per draft position: the accepted flags of the rounds that drafted it (a draft is accepted
    as a prefix: position j is accepted when the round accepted more than j)."""
    most = max((d for d, _ in rs), default=0)
    return [np.array([k > j for d, k in rs if d > j], float) for j in range(most)]


def _expected(rs):
    flags = np.concatenate([np.r_[np.ones(k), np.zeros(d - k)] for d, k in rs] or [np.zeros(0)])
    rate = float(flags.mean()) if flags.size else None
    return rate, [float(f.mean()) for f in _per_position(rs)]


@FEW
@given(rounds)
def test_speculative_acceptance_rates_are_means_of_the_accepted_flags(rs):
    """SpeculativeStats filled as a generation fills it, one round per (drafted, accepted): the
    acceptance rate is the mean over every drafted token of whether it was accepted, and
    ``acceptance_at[j]`` that mean over the rounds that drafted position j; ``report()`` says
    the same, JSON-ready."""
    s = SpeculativeStats(n_draft=6)
    for d, k in rs:
        s.n_rounds += 1
        s.n_drafted += d
        s.n_accepted += k
        s.n_tokens += k + 1  # the accepted tokens and the one sampled after them
        while len(s.drafted_at) < d:
            s.drafted_at.append(0)
            s.accepted_at.append(0)
        for j in range(d):
            s.drafted_at[j] += 1
        for j in range(k):
            s.accepted_at[j] += 1
    rate, at = _expected(rs)
    assert (s.acceptance_rate is None) == (rate is None)
    if rate is not None:
        assert s.acceptance_rate is not None and math.isclose(s.acceptance_rate, rate, rel_tol=1e-12)
    assert len(s.acceptance_at) == len(at) and all(
        math.isclose(a, b, rel_tol=1e-12) for a, b in zip(s.acceptance_at, at)
    )
    assert s.tokens_per_round == (np.mean([k + 1 for _, k in rs]) if rs else None)
    rep = json.loads(json.dumps(s.report()))
    assert rep["acceptance_rate"] == s.acceptance_rate and rep["acceptance_at"] == s.acceptance_at


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_model(
        tmp_path_factory.mktemp("stats") / "llama.gguf", "llama", n_layer=2, n_embd=32, n_head=2, n_vocab=64, seed=3
    )
    with pl.Model(path) as m:
        yield m


def _repetitive(seed):
    unit = np.random.default_rng(seed).integers(0, 64, 12)
    return np.concatenate([unit, unit, unit, unit[:5]]).astype(np.int32)


def _check_counts(drafted_at, accepted_at, n_drafted, n_accepted, rate, at):
    """What any run's per-position counts must satisfy, and the figures made from them."""
    dr, ac = np.array(drafted_at), np.array(accepted_at)
    assert dr.sum() == n_drafted and ac.sum() == n_accepted and n_drafted > 0
    assert (
        np.all(ac <= dr) and np.all(np.diff(dr) <= 0) and np.all(np.diff(ac) <= 0)
    )  # drafts and acceptance are prefixes
    assert math.isclose(rate, n_accepted / n_drafted) and math.isclose(rate, float(np.average(ac / dr, weights=dr)))
    assert np.allclose(at, ac / dr, rtol=1e-12)


def test_acceptance_figures_of_real_runs(tiny):
    """A speculative generation and a scheduler request with an n-gram draft on a synthetic model:
    the per-position counts they report hold what acceptance as a prefix implies, and the rates
    are the means those counts define."""
    with tiny.context(n_ctx=256, n_threads=1, n_threads_batch=1) as ctx:
        s = generate_speculative(ctx, _repetitive(0), 40, NgramDraft(), n_draft=4)
        list(s)
        st_ = s.stats
        assert st_.n_accepted > 0
        _check_counts(
            st_.drafted_at, st_.accepted_at, st_.n_drafted, st_.n_accepted, st_.acceptance_rate, st_.acceptance_at
        )
    with tiny.context(n_ctx=512, n_seq_max=2, n_threads=1, n_threads_batch=1) as ctx:
        sched = pl.Scheduler(ctx)
        req = sched.submit(_repetitive(1), 40, draft=NgramDraft(), n_draft=4)
        list(sched.run())
        rep = req.report()
        assert req.done and rep["n_accepted"] > 0
        _check_counts(
            req.drafted_at,
            req.accepted_at,
            rep["n_drafted"],
            rep["n_accepted"],
            rep["acceptance_rate"],
            rep["acceptance_at"],
        )
