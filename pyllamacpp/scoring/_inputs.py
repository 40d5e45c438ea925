"""What the scoring functions take: a text or its tokens (a Model or a Context is told apart by
``packing.model_and_context``); and the text shipped with the package to score."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ..model import Model


def sample_text_path() -> Path:
    """The public-domain text shipped with the package (``pyllamacpp/data/shakespeare.txt``).

    The opening of Shakespeare's *Coriolanus* (24 KB, 7,310 tokens with the default model), from
    char-rnn's tinyshakespeare; its source is in ``pyllamacpp/data/README.md``.

    Returns:
        The file's path.
    """
    return Path(__file__).parents[1] / "data" / "shakespeare.txt"


def sample_text() -> str:
    """The text of :func:`sample_text_path`.

    Returns:
        The text (UTF-8).
    """
    return sample_text_path().read_text(encoding="utf-8")


def _tokens_of(model: Model, text: str | bytes | npt.ArrayLike, add_special: bool, parse_special: bool) -> np.ndarray:
    if isinstance(text, (str, bytes)):
        return model.tokenize(text, add_special, parse_special)
    t = np.ascontiguousarray(text, dtype=np.int32).reshape(-1)
    if t.size and (int(t.min()) < 0 or int(t.max()) >= model.n_vocab):
        raise ValueError(f"tokens outside the vocabulary [0, {model.n_vocab})")
    return t
