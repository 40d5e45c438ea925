"""ggml types as they appear in a dump: ids, block sizes, numpy dtypes, dequantization (via gguf)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ._buffer import StateFormatError

# Types a numpy view can show as they are. bf16 has no numpy dtype: its view holds the raw bits
# (uint16) and dequantize() widens them.
_DTYPES = {
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "F64": "<f8",
    "I8": "i1",
    "I16": "<i2",
    "I32": "<i4",
    "I64": "<i8",
}


@dataclass(frozen=True)
class GGMLType:
    """One ``enum ggml_type`` value, with ggml's block size and bytes per block.

    Attributes:
        id: The ``enum ggml_type`` value.
        name: Lower case, as llama.cpp's --cache-type-k spells it: f16, q8_0 ...
        block_size: Values per block (1 for plain types; ggml_blck_size).
        type_size: Bytes per block (ggml_type_size).
    """

    id: int
    name: str  # lower case, as llama.cpp's --cache-type-k spells it: f16, q8_0 ...
    block_size: int  # values per block (1 for plain types)
    type_size: int  # bytes per block (ggml_type_size)

    @property
    def quantized(self) -> bool:
        """True for a block-quantized type (more than one value per block)."""
        return self.block_size > 1

    @property
    def dtype(self) -> np.dtype | None:
        """numpy dtype of one value, for plain types; None for block-quantized ones."""
        s = _DTYPES.get(self.name.upper())
        return np.dtype(s) if s else None

    def n_values(self, row_size: int) -> int | None:
        """Values in a row of ``row_size`` bytes (the inverse of ggml_row_size).

        Args:
            row_size: Bytes of the row.

        Returns:
            The value count, or None when ``row_size`` is not a whole number of blocks.
        """
        if row_size % self.type_size:
            return None
        return row_size // self.type_size * self.block_size

    def byte_in_row(self, index: int) -> int:
        """Byte offset, inside a row, of value ``index`` (of its block, for quantized types).

        Args:
            index: The value's index in the row.

        Returns:
            The byte offset from the start of the row.
        """
        return index // self.block_size * self.type_size

    def dequantize(self, raw: np.ndarray) -> np.ndarray:
        """float32 values of ``raw``, through gguf.quants (bf16 and plain types directly).

        Args:
            raw: uint8 rows, shape (n, row_size).

        Returns:
            A new float32 array, shape (n, values per row).

        Raises:
            ValueError: ``raw``'s rows are not whole blocks of the type (from numpy or gguf).
        """
        if self.name == "bf16":
            bits = np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16
            return bits.view(np.float32)
        if self.dtype is not None:
            return np.ascontiguousarray(raw).view(self.dtype).astype(np.float32)
        from gguf.quants import dequantize

        return np.asarray(dequantize(np.ascontiguousarray(raw), GGMLQuantizationType(self.id)), dtype=np.float32)


@cache
def hadamard(n: int) -> np.ndarray:
    """The orthonormal n x n Walsh-Hadamard matrix of ggml_gen_hadamard (llama-kv-cache.cpp).

    Symmetric and its own inverse; llama.cpp rotates a block-quantized cache's K and V with it.

    Args:
        n: The size, a power of two.

    Returns:
        A read-only float32 array (n, n), cached per n.

    Raises:
        ValueError: ``n`` is not a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard size is a power of two, not {n}")
    h: np.ndarray = np.ones((1, 1), dtype=np.float64)  # typed loosely: np.block's shape type differs
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    out = (h / np.sqrt(n)).astype(np.float32)
    out.flags.writeable = False
    return out


@cache
def _table() -> dict[int, GGMLType]:
    return {
        int(t): GGMLType(int(t), t.name.lower(), *GGML_QUANT_SIZES[t])
        for t in GGMLQuantizationType
        if t in GGML_QUANT_SIZES
    }


def ggml_type(type_id: int, *, offset: int, what: str) -> GGMLType:
    """The ggml type with id ``type_id``.

    Args:
        type_id: The ``enum ggml_type`` value read from the dump.
        offset: Where it was read (for the error).
        what: The field being read (for the error).

    Returns:
        The type.

    Raises:
        StateFormatError: An id the gguf package does not know.
    """
    t = _table().get(type_id)
    if t is None:
        raise StateFormatError(f"unknown ggml type {type_id} (known: {sorted(_table())})", offset=offset, what=what)
    return t


def type_by_name(name: str) -> GGMLType:
    """The ggml type named ``name`` (f16, q8_0 ..., any case).

    Args:
        name: The type's name.

    Returns:
        The type.

    Raises:
        KeyError: No ggml type has that name.
    """
    for t in _table().values():
        if t.name == name.lower():
            return t
    raise KeyError(name)
