"""Evaluation with shared prefixes: log-likelihoods of (context, continuation) requests over a
trie of their tokens (:func:`loglikelihood`), llama-perplexity's multiple-choice modes
(:func:`hellaswag`, :func:`winogrande`, :func:`multiple_choice`) and an lm-evaluation-harness
backend (``pyllamacpp.evaluation.lm_eval``, imported only when lm-eval is installed).

Above :mod:`pyllamacpp.scoring` in the import order; nothing in the core imports this package.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._engine import Loglikelihood as Loglikelihood
    from ._engine import loglikelihood as loglikelihood
    from .llama_perplexity import MultipleChoiceResult as MultipleChoiceResult
    from .llama_perplexity import hellaswag as hellaswag
    from .llama_perplexity import multiple_choice as multiple_choice
    from .llama_perplexity import winogrande as winogrande

# name -> module that defines it; imported on first access (PEP 562)
_LAZY = {
    "loglikelihood": "._engine",
    "Loglikelihood": "._engine",
    "hellaswag": ".llama_perplexity",
    "winogrande": ".llama_perplexity",
    "multiple_choice": ".llama_perplexity",
    "MultipleChoiceResult": ".llama_perplexity",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pyllamacpp.evaluation' has no attribute {name!r}")
    value = getattr(_importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
