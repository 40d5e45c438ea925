"""A GGUF file's key/value metadata, read without its tensor infos or data (``read_metadata``).

gguf-py's ``GGUFReader`` builds a record and numpy views for every value and tensor: ~1.5-2.6 s
for a 49k-token vocabulary. The layer rules read a dozen numbers, so this reader walks the KV
section once, decodes only the keys asked for, skips the others by their lengths, and stops
where the tensor infos begin. Values come out as ``GGUFReader``'s ``ReaderField.contents()`` gives
them: ints, floats, bools, str, and lists for arrays.

Layout (gguf.h, ggml/src/gguf.cpp at the pin): b"GGUF", u32 version (2 or 3), u64 n_tensors,
u64 n_kv, then n_kv times (string key, u32 type, value); a string is u64 length + UTF-8 bytes, an
array u32 element type + u64 count + elements. A big-endian file's version reads byte-swapped.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Collection
from typing import Any

from ._buffer import StateFormatError, short_read

GGUF_MAGIC = b"GGUF"
# gguf_type: (struct code, size) of the fixed-size types; 8 string, 9 array
_SCALARS = {
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("?", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_STRING, _ARRAY = 8, 9


class _Reader:
    """A cursor over the file's bytes; ``take`` is the one bounds-checked read."""

    __slots__ = ("bo", "mv", "off", "size", "u64")

    def __init__(self, mv: memoryview, byteorder: str):
        self.mv, self.size, self.off, self.bo = mv, len(mv), 0, byteorder
        self.u64 = struct.Struct(byteorder + "Q").unpack_from

    def take(self, nbytes: int, what: str) -> int:
        """Advance past ``nbytes`` and return where they start, or StateFormatError naming ``what``."""
        off = self.off
        if nbytes < 0 or off + nbytes > self.size:
            raise short_read(off, what, nbytes, self.size - off)
        self.off = off + nbytes
        return off

    def scalar(self, code: str, size: int, what: str):
        return struct.unpack_from(self.bo + code, self.mv, self.take(size, what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", 8, what + " length")
        off = self.take(n, what)
        return str(self.mv[off : off + n], "utf-8", "replace")

    def skip_strings(self, count: int, what: str) -> None:
        # the hot loop (98k strings in a 49k-token vocabulary): bounds checked once, at the end
        mv, u64, off, size = self.mv, self.u64, self.off, self.size
        for _ in range(count):
            if off + 8 > size:
                break
            off += 8 + u64(mv, off)[0]
        else:
            if off <= size:
                self.off = off
                return
        raise short_read(self.off, f"{what} ({count} strings)", off + 8 - self.off, size - self.off)

    def value(self, vtype: int, what: str, *, keep: bool):
        """The value of type ``vtype`` at the cursor, decoded when ``keep``, else skipped (None)."""
        if vtype in _SCALARS:
            code, size = _SCALARS[vtype]
            if keep:
                return self.scalar(code, size, what)
            self.take(size, what)
            return None
        if vtype == _STRING:
            if keep:
                return self.string(what)
            self.take(self.scalar("Q", 8, what + " length"), what)
            return None
        if vtype == _ARRAY:
            etype = self.scalar("I", 4, what + " element type")
            count = self.scalar("Q", 8, what + " count")
            if etype in _SCALARS:
                code, size = _SCALARS[etype]
                off = self.take(count * size, what)
                if not keep:
                    return None
                return list(struct.unpack_from(f"{self.bo}{count}{code}", self.mv, off))
            if etype == _STRING and not keep:
                self.skip_strings(count, what)
                return None
            if etype not in (_STRING, _ARRAY):
                raise StateFormatError(f"unknown array element type {etype}", offset=self.off - 12, what=what)
            items = [self.value(etype, f"{what}[{i}]", keep=keep) for i in range(count)]
            return items if keep else None
        raise StateFormatError(f"unknown value type {vtype}", offset=self.off - 4, what=what)


def _every_key(key: str) -> bool:
    return True


def read_metadata(
    path: str | os.PathLike, keys: Collection[str] | Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """The key/value metadata of the GGUF file at ``path``: ``{key: value}`` for the keys in
    ``keys`` (a collection, or a predicate on the key; None: every key) that the file holds.

    Reads the header and the KV section only (through an mmap: skipped values are never touched).

    Args:
        path: The GGUF file.
        keys: The keys to return: a collection, a predicate on the key, or None for every key.

    Returns:
        ``{key: value}`` (arrays as lists, strings decoded).

    Raises:
        StateFormatError: not a GGUF file (magic, version), or a KV section cut short or holding
            an unknown type; ``offset`` and ``what`` say where.
        OSError: the file cannot be opened.
    """
    want: Callable[[str], bool]
    if keys is None:
        want = _every_key
    elif callable(keys):
        want = keys
    else:
        want = frozenset(keys).__contains__
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise short_read(0, "GGUF header", 24, size)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mv = memoryview(mm)
            try:
                return _read(mv, want)
            finally:
                mv.release()


def _read(mv: memoryview, want: Callable[[str], bool]) -> dict[str, Any]:
    if bytes(mv[:4]) != GGUF_MAGIC:
        raise StateFormatError(f"magic {bytes(mv[:4])!r}, not {GGUF_MAGIC!r}", offset=0, what="GGUF magic")
    version = struct.unpack_from("<I", mv, 4)[0]
    byteorder = "<"
    if version & 0xFFFF == 0:  # gguf-py's test: a big-endian file's small version reads swapped
        version, byteorder = struct.unpack_from(">I", mv, 4)[0], ">"
    if version not in (2, 3):  # version 1 wrote u32 lengths; gguf.cpp refuses it too
        raise StateFormatError(f"version {version}, this reader reads 2 and 3", offset=4, what="GGUF version")
    r = _Reader(mv, byteorder)
    r.off = 8
    r.scalar("Q", 8, "n_tensors")
    n_kv = r.scalar("Q", 8, "n_kv")
    out: dict[str, Any] = {}
    for i in range(n_kv):
        key = r.string(f"key {i}")
        vtype = r.scalar("I", 4, f"type of {key}")
        keep = want(key)
        value = r.value(vtype, key, keep=keep)
        if keep:
            out[key] = value
    return out
