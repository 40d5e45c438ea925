"""pyllamacpp: llama.cpp's C API through a compiled cffi extension, and a numpy layer over it.

``pyllamacpp.ffi`` / ``pyllamacpp.lib`` are the raw binding: every function, struct, enum and
integer ``#define`` of ``llama.h`` (and the ggml headers it includes), checked by the C compiler.
The compiled parts load on first use, so pure-Python parts (``pyllamacpp.state``, ``models``)
import without them.
"""

import importlib as _importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    ClosedError,
    ContextError,
    DecodeAborted,
    DecodeError,
    DecodeInterrupted,
    InvalidBatchError,
    KVCacheFullError,
    LlamaError,
    ModelLoadError,
    RPCError,
    StateError,
)
from .models import default_model_path, fetch_model

if TYPE_CHECKING:  # the lazy names below, as mypy should see them
    from ._lib import build_info as build_info
    from ._lib import ffi as ffi
    from ._lib import lib as lib
    from ._log import sync_log_level as sync_log_level
    from .batch import Batch as Batch
    from .context import Context as Context
    from .context_state import SeqState as SeqState
    from .context_state import StateBuffer as StateBuffer
    from .context_state import StateFlags as StateFlags
    from .evaluation import Loglikelihood as Loglikelihood
    from .evaluation import loglikelihood as loglikelihood
    from .generation import Generation as Generation
    from .generation import generate as generate
    from .generation import generate_parallel as generate_parallel
    from .lora import LoraAdapter as LoraAdapter
    from .memory import Memory as Memory
    from .model import Model as Model
    from .params import ContextParams as ContextParams
    from .params import ModelParams as ModelParams
    from .rpc import devices as devices
    from .sampling import Sampler as Sampler
    from .scheduler import Event as Event
    from .scheduler import Request as Request
    from .scheduler import Scheduler as Scheduler
    from .scoring import BaseLogits as BaseLogits
    from .scoring import KLDivergence as KLDivergence
    from .scoring import PerplexityResult as PerplexityResult
    from .scoring import Scores as Scores
    from .scoring import kl_divergence as kl_divergence
    from .scoring import perplexity as perplexity
    from .scoring import score as score
    from .speculative import Draft as Draft
    from .speculative import ModelDraft as ModelDraft
    from .speculative import NgramDraft as NgramDraft
    from .speculative import PassCounter as PassCounter
    from .speculative import Speculation as Speculation
    from .speculative import SpeculativeComparison as SpeculativeComparison
    from .speculative import SpeculativeStats as SpeculativeStats
    from .speculative import compare_speculative as compare_speculative
    from .speculative import generate_speculative as generate_speculative
    from .speculative import layer_skip_gguf as layer_skip_gguf
    from .text import Completion as Completion
    from .text import Detokenizer as Detokenizer
    from .text import TextStream as TextStream

# name -> module that defines it; imported on first access (PEP 562).
_LAZY = {
    "ffi": "._lib",
    "lib": "._lib",
    "build_info": "._lib",
    "ContextParams": ".params",
    "ModelParams": ".params",
    "Model": ".model",
    "Batch": ".batch",
    "Context": ".context",
    "Memory": ".memory",
    "SeqState": ".context_state",
    "StateBuffer": ".context_state",
    "StateFlags": ".context_state",
    "devices": ".rpc",
    "sync_log_level": "._log",
    "Sampler": ".sampling",
    "Scheduler": ".scheduler",
    "Request": ".scheduler",
    "Event": ".scheduler",
    "generate": ".generation",
    "generate_parallel": ".generation",
    "Generation": ".generation",
    "LoraAdapter": ".lora",
    "Completion": ".text",
    "TextStream": ".text",
    "Detokenizer": ".text",
    "score": ".scoring",
    "perplexity": ".scoring",
    "kl_divergence": ".scoring",
    "Scores": ".scoring",
    "PerplexityResult": ".scoring",
    "KLDivergence": ".scoring",
    "BaseLogits": ".scoring",
    "generate_speculative": ".speculative",
    "compare_speculative": ".speculative",
    "Speculation": ".speculative",
    "SpeculativeStats": ".speculative",
    "SpeculativeComparison": ".speculative",
    "Draft": ".speculative",
    "NgramDraft": ".speculative",
    "ModelDraft": ".speculative",
    "PassCounter": ".speculative",
    "layer_skip_gguf": ".speculative",
    "loglikelihood": ".evaluation",
    "Loglikelihood": ".evaluation",
}
# public subpackages and modules, also imported on first access (``pyllamacpp.state.parse``)
_SUBMODULES = (
    "state",
    "testing",
    "models",
    "experiments",
    "rpc",
    "cli",
    "scoring",
    "speculative",
    "taps",
    "cvec",
    "evaluation",
)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return _importlib.import_module("." + name, __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'pyllamacpp' has no attribute {name!r}")
    _importlib.import_module("._log", __name__)  # route llama.cpp's log before anything runs
    value = getattr(_importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # the public API and dunders: not the helpers, nor the implementation modules that importing
    # a lazy name sets as attributes (batch, context, _log ...)
    dunders = (n for n in globals() if n.startswith("__") and n.endswith("__"))
    return sorted({*__all__, *_SUBMODULES, *dunders})


__all__ = [
    "__version__",
    "default_model_path",
    "fetch_model",
    "LlamaError",
    "ModelLoadError",
    "ContextError",
    "DecodeError",
    "InvalidBatchError",
    "KVCacheFullError",
    "DecodeAborted",
    "DecodeInterrupted",
    "StateError",
    "ClosedError",
    "RPCError",
    *_LAZY,
]
