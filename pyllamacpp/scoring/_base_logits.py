"""llama-perplexity's base-logits file (``--kl-divergence-base``): its layout, read as views."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MAGIC = b"_logits_"
"""The first 8 bytes of llama-perplexity's base-logits file."""


def _nv(n_vocab: int) -> int:
    """uint16 values per row of the base-logits file: 4 (two floats) + n_vocab rounded up to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


class BaseLogits:
    """llama-perplexity's base-logits file (``--kl-divergence-base``), read as views (a memmap).

    The format, as ``perplexity()`` in tools/perplexity/perplexity.cpp writes it (little-endian):
    8 bytes ``_logits_``; int32 ``n_ctx``, ``n_vocab``, ``n_chunk``; int32 ``tokens[n_chunk *
    n_ctx]`` (the text's first ``n_chunk * n_ctx`` tokens, BOS not substituted); then for each
    chunk, ``n_ctx - 1 - n_ctx // 2`` rows (the scored positions) of ``nv = 2 * ((n_vocab + 1) //
    2) + 4`` uint16: float ``scale``, float ``min_log_prob``, then ``n_vocab`` values ``q`` with
    ``log p = scale * q + min_log_prob`` (log-probabilities more than 16 below the row's max are
    stored as 0), padded with zeros. So a stored log-probability is within ``scale / 2`` (at most
    16 / 131070 = 1.2e-4) of the computed one.

    Args:
        path: The file (written by :func:`perplexity` with ``save_base=``, or by
            ``llama-perplexity --kl-divergence-base FILE``).

    Raises:
        ValueError: Not such a file (magic), a header out of range, or a size other than the
            header says (short or long), with what was expected.
        OSError: The file cannot be read.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(20)
        if len(head) < 8 or head[:8] != MAGIC:
            raise ValueError(f"{self.path}: not a base-logits file (the first 8 bytes are {head[:8]!r}, not {MAGIC!r})")
        if len(head) < 20:
            raise ValueError(f"{self.path}: header: expected 20 bytes, the file has {len(head)}")
        n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(head, "<i4", 3, 8))
        if n_ctx < 2 or n_vocab < 1 or n_chunk < 0:
            raise ValueError(f"{self.path}: header out of range: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}")
        self.n_ctx, self.n_vocab, self.n_chunk = n_ctx, n_vocab, n_chunk
        self.nv = _nv(n_vocab)
        self.n_scored = n_ctx - 1 - n_ctx // 2
        tok_bytes = 4 * n_ctx * n_chunk
        row_bytes = 2 * self.nv * self.n_scored * n_chunk
        want = 20 + tok_bytes + row_bytes
        if size != want:
            raise ValueError(
                f"{self.path}: expected {want} bytes (20 of header, {tok_bytes} of tokens, {row_bytes} of "
                f"{n_chunk} chunks x {self.n_scored} rows x {self.nv} uint16), the file has {size}"
            )
        self.tokens: np.ndarray = np.memmap(self.path, "<i4", "r", 20, (n_ctx * n_chunk,))
        """int32 ``(n_chunk * n_ctx,)``: the tokens (a read-only memmap)."""
        self.rows: np.ndarray = np.memmap(self.path, "<u2", "r", 20 + tok_bytes, (n_chunk, self.n_scored, self.nv))
        """uint16 ``(n_chunk, n_scored, nv)``: each scored position's row (a read-only memmap)."""

    def log_probs(self, chunk: int) -> np.ndarray:
        """The stored log-probabilities of one chunk, decoded: ``scale * q + min_log_prob``.

        Args:
            chunk: The chunk index.

        Returns:
            float32 ``(n_scored, n_vocab)`` (a new array).

        Raises:
            IndexError: No such chunk.
        """
        if not 0 <= chunk < self.n_chunk:
            raise IndexError(f"chunk {chunk} is outside [0, {self.n_chunk})")
        r = np.asarray(self.rows[chunk])
        head = np.ascontiguousarray(r[:, :4]).view(np.float32)  # (n_scored, 2): scale, min_log_prob
        return head[:, :1] * r[:, 4 : 4 + self.n_vocab].astype(np.float32) + head[:, 1:2]

    def __repr__(self) -> str:
        return f"<BaseLogits {self.path.name}: {self.n_chunk} chunks of {self.n_ctx}, n_vocab {self.n_vocab}>"
