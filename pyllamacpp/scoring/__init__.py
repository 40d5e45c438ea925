"""Scoring: log-probabilities of a text, perplexity and KL divergence as ``llama-perplexity``
computes them (``tools/perplexity/perplexity.cpp``).

- :func:`log_softmax`: per row of float logits (a view of ``ctx.logits_all()`` is read in place),
  the log-sum-exp, the log-probability of a target token, the argmax and the top-k; the row loop
  is C (``build_support/score.h``): max, then the sum of ``exp(x - max)`` accumulated in double.
- :func:`score` (``Model.score``): the log-probability of every token of a text given the tokens
  before it, from one pass with logits at the rows that predict a token; a text longer than the
  context goes in windows that re-feed the end of the previous one as context.
- :func:`perplexity`: ``llama-perplexity -f FILE -c N -b B``: chunks of ``n_ctx`` tokens, the
  first token of each chunk replaced by BOS when the model adds one, only the second half of each
  chunk scored, several chunks per batch when ``n_batch`` is a multiple of ``n_ctx``; the running
  estimate after each chunk and the final ``PPL = x +/- y``. ``save_base=`` writes the
  ``--kl-divergence-base`` file, byte for byte in llama-perplexity's format.
- :func:`kl_divergence`: ``llama-perplexity --kl-divergence``: against such a file (yours or
  llama-perplexity's), mean KL divergence and its percentiles, top-1 agreement, Δp, PPL ratios.

The modules, bottom to top: ``_rows`` (the C row loops over threads, :func:`log_softmax`),
``_inputs`` (a text or tokens, the shipped text), ``_base_logits`` (the base-logits file),
``_kl_stats`` (llama-perplexity's sums, uncertainties, percentiles and printed lines; numpy only),
then ``_score``, ``_perplexity`` (its chunks, decoded through the packing core) and ``_kl``, and
``_logprobs`` (``complete(..., logprobs=k)``).
"""

from __future__ import annotations

from ._base_logits import MAGIC, BaseLogits
from ._inputs import sample_text, sample_text_path
from ._kl import kl_divergence
from ._kl_stats import (
    KL_HEADER,
    KLD_PERCENTILES,
    P_DIFF_PERCENTILES,
    KLDivergence,
    _cov,
    _kl_result,
    _KLSums,
    _mean_unc,
    _median,
    _percentile,
    kl_row,
)
from ._logprobs import CompletionLogprobs, LogprobsRecorder
from ._perplexity import PerplexityResult, perplexity
from ._rows import LogSoftmax, log_softmax
from ._score import Scores, score

__all__ = [
    "LogSoftmax",
    "log_softmax",
    "Scores",
    "score",
    "PerplexityResult",
    "perplexity",
    "BaseLogits",
    "KLDivergence",
    "kl_divergence",
    "CompletionLogprobs",
    "sample_text",
    "sample_text_path",
]
# names of the module this package was, outside __all__: constants, and what others use:
# LogprobsRecorder (text), KL_HEADER and kl_row
# (cli._scoring), the statistics helpers (tests/test_statistics.py)
_INTERNAL = (MAGIC, KLD_PERCENTILES, P_DIFF_PERCENTILES, KL_HEADER, LogprobsRecorder, kl_row)
_STATISTICS = (_KLSums, _kl_result, _mean_unc, _cov, _percentile, _median)
