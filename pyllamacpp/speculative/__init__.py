"""Speculative decoding: a draft proposes tokens, the target checks them all in one batch.

Each round the target context decodes ``[last token, d1 ... dn]`` (the draft's ``n`` tokens) in
one ``llama_decode``, logits for every row. The target's sampler samples row 0; while its token
equals the draft's next one it samples the next row, and the first token that differs is the
target's own (llama.cpp's ``common_sampler_sample_and_accept_n``, ``examples/speculative-simple``).
So one round yields between 1 and ``n + 1`` tokens for one target decode. The cells of the rows
that were not kept are removed with ``llama_memory_seq_rm``; the draft's own context (a draft
model) drops them at its next draft, when it compares what it holds with the text so far.

Acceptance rule, and what exactness means here:

- Every yielded token is sampled with the target's chain from the target's logits at its
  position, once, in order, as :func:`pyllamacpp.generate` samples it: the draft decides only
  how many rows one decode checks. The output distribution is the target's whatever the draft
  proposes (a stateful chain, penalties or grammar, sees the same tokens in the same order, and a
  ``dist`` step draws the same numbers). For a draft that proposes one token per position (all
  drafts here: greedy or looked up) this is also what the rejection rule of the
  speculative-sampling papers gives: it accepts ``d`` with probability ``min(1, p(d) / q(d)) =
  p(d)`` and otherwise samples ``p`` without ``d``, as sample-and-compare does.
- The logits of a row of a wider batch are not always bit-identical to those of a one-token
  decode (another kernel, another summation order): a near-tie may then go the other way, so the
  tokens equal plain ``generate``'s exactly only where no step is that close (see the guide for
  the rate measured on the default model).

Memory that cannot drop a suffix (a recurrent or hybrid memory, or a sliding-window cache whose
cells a longer batch may overwrite) is handled as ``examples/speculative-simple`` does it: a
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` checkpoint of the sequence before a verify with a draft;
on partial acceptance the checkpoint is restored, the rest cut (``seq_rm``), and the kept tokens
are decoded again, at the front of the next verify batch.

The cache convention is :mod:`pyllamacpp.generation`'s: when a generation ends, its sequence
holds the prompt and every yielded token but the last.

The modules, bottom to top: ``_closing`` (the with-statement), ``_passes``
(:class:`PassCounter`), ``_drafts`` (:class:`Draft`, :class:`NgramDraft`), ``_checkpoint``
(cutting a sequence back: ``seq_rm`` or a checkpoint), ``_layer_skip`` and ``_model_draft``
(:class:`ModelDraft`, :func:`check_vocab`), ``_stats`` (:class:`SpeculativeStats`), ``_target``
(the verify batch and what to keep), ``_generate`` (the loop: :func:`generate_speculative`,
:class:`Speculation`), ``_compare`` (:func:`compare_speculative`).
"""

from __future__ import annotations

from ._compare import SpeculativeComparison, compare_speculative
from ._drafts import Draft, NgramDraft
from ._generate import Speculation, generate_speculative
from ._layer_skip import layer_skip_gguf
from ._model_draft import ModelDraft, check_vocab
from ._passes import PassCounter
from ._stats import SpeculativeStats

__all__ = [
    "Draft",
    "ModelDraft",
    "NgramDraft",
    "PassCounter",
    "Speculation",
    "SpeculativeComparison",
    "SpeculativeStats",
    "check_vocab",
    "compare_speculative",
    "generate_speculative",
    "layer_skip_gguf",
]
