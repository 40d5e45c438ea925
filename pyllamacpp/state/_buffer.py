"""The one bounds-checked view primitive every read of a state dump goes through."""

from __future__ import annotations

import numpy as np


class StateFormatError(ValueError):
    """A state dump that does not follow llama.cpp's format.

    ``offset`` is the byte where reading failed and ``what`` names the field or record being read;
    for short reads ``needed`` and ``left`` say how many bytes that needed and how many remained.
    """

    _records_read: int  # set by _memory's readers on the errors they keep: records read before it

    def __init__(self, message: str, *, offset: int, what: str, needed: int | None = None, left: int | None = None):
        self.offset, self.what, self.needed, self.left = offset, what, needed, left
        super().__init__(f"at byte {offset}: {what}: {message}")


def short_read(offset: int, what: str, needed: int, left: int) -> StateFormatError:
    return StateFormatError(
        f"needs {needed} bytes, {max(left, 0)} left", offset=offset, what=what, needed=needed, left=max(left, 0)
    )


class Buffer:
    """A read cursor-free window over the dump: ``view()`` is the only way to touch its bytes.

    ``data`` is a 1-D uint8 array (a view of bytes, a bytearray, an np.memmap ...); every view
    handed out is a slice of it, so edits made through views land in ``data``.
    """

    __slots__ = ("data", "size")

    def __init__(self, data: np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"a state dump is a 1-D uint8 array, got {data.dtype} {data.shape}")
        self.data = data
        self.size = int(data.shape[0])

    @property
    def writable(self) -> bool:
        return bool(self.data.flags.writeable)

    def view(self, offset: int, nbytes: int, what: str) -> np.ndarray:
        """``nbytes`` bytes at ``offset`` as a uint8 view, or StateFormatError naming ``what``."""
        offset, nbytes = int(offset), int(nbytes)  # Python ints: numpy uint64 products wrap silently
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise short_read(offset, what, nbytes, self.size - offset)
        return self.data[offset : offset + nbytes]

    def uint(self, offset: int, nbytes: int, what: str, *, signed: bool = False) -> int:
        return int.from_bytes(self.view(offset, nbytes, what).tobytes(), "little", signed=signed)

    def u32(self, offset: int, what: str) -> int:
        return self.uint(offset, 4, what)

    def i32(self, offset: int, what: str) -> int:
        return self.uint(offset, 4, what, signed=True)

    def u64(self, offset: int, what: str) -> int:
        return self.uint(offset, 8, what)

    def array(self, offset: int, count: int, dtype, what: str) -> np.ndarray:
        """``count`` items of ``dtype`` at ``offset``: a zero-copy typed view."""
        dtype = np.dtype(dtype)
        return self.view(offset, int(count) * dtype.itemsize, what).view(dtype)
