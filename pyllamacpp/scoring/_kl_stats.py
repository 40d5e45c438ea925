"""llama-perplexity's KL divergence statistics (``kl_divergence()`` of perplexity.cpp): its sums,
means and uncertainties, percentiles, and the table and sections it prints. Pure numpy."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
"""The KL divergence percentiles llama-perplexity prints (besides max, median and min)."""
P_DIFF_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)
"""The Δp percentiles llama-perplexity prints (besides max, median and min)."""


def _mean_unc(s: float, s2: float, count: int) -> tuple[float, float]:
    """llama-perplexity's mean_and_uncertainty."""
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0


def _sqrt(x: float) -> float:
    """sqrt as C's: nan for a negative argument (a variance that came out negative)."""
    return math.sqrt(x) if x >= 0 else math.nan


def _cov(a: float, b: float, ab: float, count: int) -> float:
    """llama-perplexity's covariance."""
    if count < 10:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


def _percentile(values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's percentile of sorted float values, in float as there."""
    f = np.float32(fraction)
    if f <= 0:
        return float(values[0])
    if f >= 1:
        return float(values[-1])
    p = np.float32(f * np.float32(values.size - 1))
    ip = int(p)
    p = np.float32(p - np.float32(ip))
    return float((np.float32(1) - p) * values[ip] + p * values[min(ip + 1, values.size - 1)])


def _median(values: np.ndarray) -> float:
    n = values.size
    return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1])) if n % 2 == 0 else float(values[n // 2])


@dataclass
class KLDivergence:
    """What :func:`kl_divergence` computed: llama-perplexity's ``--kl-divergence`` statistics.

    Q is this run, base the stored one. Per token ``t`` scored: ``kld = sum over v of p_base(v) *
    (log p_base(v) - log p(v))``, the sum over tokens whose stored log-probability is above -16;
    ``p_diff = p(t) - p_base(t)``; top-1 agreement: the first argmax of the logits is the base's.
    Uncertainties as llama-perplexity's ``mean_and_uncertainty`` (0 with 10 tokens or fewer).

    Attributes:
        n_ctx: Tokens per chunk (from the base file).
        n_chunk: Chunks scored.
        count: Tokens scored.
        ppl: PPL(Q), with ``ppl_err``.
        ppl_err: Its uncertainty.
        ppl_base: PPL(base), with ``ppl_base_err``.
        ppl_base_err: Its uncertainty.
        cor: Cor(ln PPL(Q), ln PPL(base)), a fraction.
        ln_ratio: Mean ln(PPL(Q) / PPL(base)), with ``ln_ratio_err``.
        ln_ratio_err: Its uncertainty.
        ratio: PPL(Q) / PPL(base), with ``ratio_err``.
        ratio_err: Its uncertainty.
        diff: PPL(Q) - PPL(base), with ``diff_err``.
        diff_err: Its uncertainty.
        kld: Mean KL divergence (nats), with ``kld_err``.
        kld_err: Its uncertainty.
        kld_max: The largest.
        kld_median: The median.
        kld_min: The smallest.
        kld_percentiles: ``{99.9: value, 99.0: ..., 0.1: ...}`` (:data:`KLD_PERCENTILES`).
        p_diff: Mean Δp (a fraction), with ``p_diff_err``.
        p_diff_err: Its uncertainty.
        p_diff_max: The largest Δp.
        p_diff_median: The median Δp.
        p_diff_min: The smallest Δp.
        p_diff_percentiles: ``{99.9: value, ...}`` (:data:`P_DIFF_PERCENTILES`).
        rms_p_diff: RMS Δp (a fraction), with ``rms_p_diff_err``.
        rms_p_diff_err: Its uncertainty.
        same_top: Top-1 agreement (a fraction), with ``same_top_err``.
        same_top_err: Its uncertainty.
        kld_values: float32 ``(count,)``: each token's KL divergence, in text order.
        p_diff_values: float32 ``(count,)``: each token's Δp.
        same_top_values: bool ``(count,)``: each token's top-1 agreement.
        chunks: Per chunk, the running values of llama-perplexity's table (``ppl``, ``ppl_err``,
            ``ln_ratio``, ``ln_ratio_err``, ``kld``, ``kld_err``, ``rms_p_diff``,
            ``rms_p_diff_err``, ``same_top``, ``same_top_err``).
        seconds: Wall time.
    """

    n_ctx: int
    n_chunk: int
    count: int
    ppl: float
    ppl_err: float
    ppl_base: float
    ppl_base_err: float
    cor: float
    ln_ratio: float
    ln_ratio_err: float
    ratio: float
    ratio_err: float
    diff: float
    diff_err: float
    kld: float
    kld_err: float
    kld_max: float
    kld_median: float
    kld_min: float
    kld_percentiles: dict[float, float]
    p_diff: float
    p_diff_err: float
    p_diff_max: float
    p_diff_median: float
    p_diff_min: float
    p_diff_percentiles: dict[float, float]
    rms_p_diff: float
    rms_p_diff_err: float
    same_top: float
    same_top_err: float
    kld_values: np.ndarray
    p_diff_values: np.ndarray
    same_top_values: np.ndarray
    chunks: list[dict[str, float]]
    seconds: float = 0.0

    def report(self) -> str:
        """The per-chunk table and the three sections llama-perplexity prints, in its formats.

        Returns:
            The text (the sections only with 100 tokens or more, as there).
        """
        lines = [KL_HEADER]
        lines += [kl_row(i, c) for i, c in enumerate(self.chunks)]
        if self.count >= 100:
            lines += ["", self.summary()]
        return "\n".join(lines)

    def summary(self) -> str:
        """The three sections llama-perplexity prints after its table (perplexity, KL divergence
        and token probability statistics), in its formats.

        Returns:
            The text.
        """
        lines = [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {self.ppl:10.6f} ± {self.ppl_err:10.6f}",
            f"Mean PPL(base)                : {self.ppl_base:10.6f} ± {self.ppl_base_err:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * self.cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {self.ln_ratio:10.6f} ± {self.ln_ratio_err:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {self.ratio:10.6f} ± {self.ratio_err:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {self.diff:10.6f} ± {self.diff_err:10.6f}",
        ]
        sections = [  # title, name, the mean's text, a value's format, the distribution
            (
                "KL divergence",
                "KLD",
                f"{self.kld:10.6f} ± {self.kld_err:10.6f}",
                lambda v: f"{v:10.6f}",
                (self.kld_max, self.kld_percentiles, KLD_PERCENTILES, self.kld_median, self.kld_min),
            ),
            (
                "Token probability",
                "Δp",
                f"{100 * self.p_diff:6.3f} ± {100 * self.p_diff_err:5.3f} %",
                lambda v: f"{100 * v:6.3f}%",
                (self.p_diff_max, self.p_diff_percentiles, P_DIFF_PERCENTILES, self.p_diff_median, self.p_diff_min),
            ),
        ]
        for title, name, mean, fmt, spread in sections:
            lines += ["", f"====== {title} statistics ======", f"Mean    {name}: {mean}"]
            lines += _spread_lines(name, fmt, *spread)
        lines += [
            f"RMS Δp    : {100 * self.rms_p_diff:6.3f} ± {100 * self.rms_p_diff_err:5.3f} %",
            f"Same top p: {100 * self.same_top:6.3f} ± {100 * self.same_top_err:5.3f} %",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<KLDivergence {self.count} tokens: mean KLD {self.kld:.6f}, same top {100 * self.same_top:.3f}%, "
            f"PPL(Q) {self.ppl:.4f} vs PPL(base) {self.ppl_base:.4f}>"
        )


def _spread_lines(
    name: str,
    fmt: Callable[[float], str],
    largest: float,
    percentiles: dict[float, float],
    qs: tuple[float, ...],
    median: float,
    smallest: float,
) -> list[str]:
    """llama-perplexity's lines of a distribution: ``Maximum``, the percentiles ``qs`` above the
    median, ``Median``, those below it, ``Minimum``, each ``label name: fmt(value)``."""
    pct = lambda q: f"{q:4.1f}%".rjust(5)  # noqa: E731
    rows = [("Maximum", largest)] + [(pct(q), percentiles[q]) for q in qs if q > 50]
    rows += [("Median", median)] + [(pct(q), percentiles[q]) for q in qs if q < 50] + [("Minimum", smallest)]
    return [f"{label:<7} {name}: {fmt(v)}" for label, v in rows]


KL_HEADER = (
    "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              "
    "Δp RMS            Same top p"
)
"""The header of llama-perplexity's per-chunk KL divergence table."""


def kl_row(i: int, c: dict[str, float]) -> str:
    """Row ``i`` (0-based) of llama-perplexity's per-chunk KL divergence table, in its formats."""
    return (
        f"{i + 1:4d}    {c['ppl']:9.4f} ± {c['ppl_err']:9.4f}    {c['ln_ratio']:10.5f} ± {c['ln_ratio_err']:10.5f}"
        f"    {c['kld']:10.5f} ± {c['kld_err']:10.5f}    {100 * c['rms_p_diff']:6.3f} ± "
        f"{100 * c['rms_p_diff_err']:6.3f} %    {100 * c['same_top']:6.3f} ± {100 * c['same_top_err']:6.3f} %"
    )


class _KLSums:
    """kl_divergence_result of perplexity.cpp: double sums of float terms, as there."""

    def __init__(self) -> None:
        self.nll = self.nll2 = self.nll_base = self.nll_base2 = self.nll_nll_base = 0.0
        self.kld = self.kld2 = self.p_diff = self.p_diff2 = self.p_diff4 = 0.0
        self.same_top = 0
        self.count = 0

    def add(self, nll: np.ndarray, nll_base: np.ndarray, kld: np.ndarray, p_diff: np.ndarray, same: np.ndarray) -> None:
        f64 = np.float64
        self.nll += float(nll.astype(f64).sum())
        self.nll2 += float((nll * nll).astype(f64).sum())  # float products, as there
        self.nll_base += float(nll_base.astype(f64).sum())
        self.nll_base2 += float((nll_base * nll_base).astype(f64).sum())
        self.nll_nll_base += float((nll * nll_base).astype(f64).sum())
        self.kld += float(kld.sum())
        self.kld2 += float(np.dot(kld, kld))
        pd = p_diff.astype(f64)
        pd2 = (p_diff * p_diff).astype(f64)
        self.p_diff += float(pd.sum())
        self.p_diff2 += float(pd2.sum())
        self.p_diff4 += float(np.dot(pd2, pd2))
        self.same_top += int(np.count_nonzero(same))
        self.count += int(nll.size)

    def nll_moments(self) -> tuple[float, float, float, float, float]:
        """Mean nll and its uncertainty for Q, the same for the base, and their covariance."""
        c = self.count
        lp, lpu = _mean_unc(self.nll, self.nll2, c)
        lb, lbu = _mean_unc(self.nll_base, self.nll_base2, c)
        return lp, lpu, lb, lbu, _cov(self.nll, self.nll_base, self.nll_nll_base, c)

    def chunk_row(self) -> dict[str, float]:
        """The running values of llama-perplexity's per-chunk table: ten fields of :class:`KLDivergence`."""
        c = self.count
        lp, lpu, lb, lbu, cov = self.nll_moments()
        kl, klu = _mean_unc(self.kld, self.kld2, c)
        mse, mseu = _mean_unc(self.p_diff2, self.p_diff4, c)
        rms = math.sqrt(mse)
        top = self.same_top / c
        return {
            "ppl": math.exp(lp),
            "ppl_err": math.exp(lp) * lpu,
            "ln_ratio": lp - lb,
            "ln_ratio_err": _sqrt(lpu * lpu + lbu * lbu - 2.0 * cov),
            "kld": kl,
            "kld_err": klu,
            "rms_p_diff": rms,
            "rms_p_diff_err": 0.5 / rms * mseu if rms > 0 else 0.0,
            "same_top": top,
            "same_top_err": math.sqrt(top * (1 - top) / (c - 1)) if c > 1 else 0.0,
        }


def _kl_result(n_ctx, n_chunk, s: _KLSums, chunks, kld, p_diff, same, seconds) -> KLDivergence:
    row = s.chunk_row()  # the table's running values, now over every token
    _, lpu, lb, lbu, cov = s.nll_moments()
    ppl, ppl_b = row["ppl"], math.exp(lb)
    ppl_cov = ppl * ppl_b * cov
    pdm, pdu = _mean_unc(s.p_diff, s.p_diff2, s.count)
    kv = np.sort(kld.astype(np.float32))
    pv = np.sort(p_diff)
    return KLDivergence(
        n_ctx=n_ctx,
        n_chunk=n_chunk,
        count=s.count,
        ppl_base=ppl_b,
        ppl_base_err=ppl_b * lbu,
        cor=cov / (lpu * lbu) if lpu * lbu > 0 else math.nan,
        ratio=math.exp(row["ln_ratio"]),
        ratio_err=math.exp(row["ln_ratio"]) * row["ln_ratio_err"],
        diff=ppl - ppl_b,
        diff_err=_sqrt((ppl * lpu) ** 2 + (ppl_b * lbu) ** 2 - 2.0 * ppl_cov),
        kld_max=float(kv[-1]),
        kld_median=_median(kv),
        kld_min=float(kv[0]),
        kld_percentiles={q: _percentile(kv, q / 100) for q in KLD_PERCENTILES},
        p_diff=pdm,
        p_diff_err=pdu,
        p_diff_max=float(pv[-1]),
        p_diff_median=_median(pv),
        p_diff_min=float(pv[0]),
        p_diff_percentiles={q: _percentile(pv, q / 100) for q in P_DIFF_PERCENTILES},
        kld_values=kld.astype(np.float32),
        p_diff_values=p_diff.copy(),
        same_top_values=same.astype(bool),
        chunks=chunks,
        seconds=seconds,
        **row,  # ppl, ppl_err, ln_ratio, ln_ratio_err, kld, kld_err, rms_p_diff, same_top and their errors
    )
