"""The one bounds-checked view primitive every read of a state dump goes through."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class StateFormatError(ValueError):
    """A state dump that does not follow llama.cpp's format.

    ``offset`` is the byte where reading failed and ``what`` names the field or record being read;
    for short reads ``needed`` and ``left`` say how many bytes that needed and how many remained.
    The message reads ``at byte {offset}: {what}: {message}``.

    Args:
        message: What is wrong with the bytes.
        offset: The byte offset (in the dump) where reading failed.
        what: The field or record being read.
        needed: For a short read, the bytes the read needed.
        left: For a short read, the bytes that remained.
    """

    _records_read: int  # set by _memory's readers on the errors they keep: records read before it

    def __init__(
        self, message: str, *, offset: int, what: str, needed: int | None = None, left: int | None = None
    ) -> None:
        self.offset, self.what, self.needed, self.left = offset, what, needed, left
        super().__init__(f"at byte {offset}: {what}: {message}")


def short_read(offset: int, what: str, needed: int, left: int) -> StateFormatError:
    """The error for a read of ``needed`` bytes at ``offset`` with only ``left`` remaining.

    Args:
        offset: Where the read started.
        what: The field or record being read.
        needed: Bytes the read needed.
        left: Bytes that remained (a negative count is reported as 0).

    Returns:
        The StateFormatError to raise (not raised here).
    """
    return StateFormatError(
        f"needs {needed} bytes, {max(left, 0)} left", offset=offset, what=what, needed=needed, left=max(left, 0)
    )


class Buffer:
    """A read cursor-free window over the dump: ``view()`` is the only way to touch its bytes.

    ``data`` is a 1-D uint8 array (a view of bytes, a bytearray, an np.memmap ...); every view
    handed out is a slice of it, so edits made through views land in ``data``.

    Args:
        data: The dump's bytes, a 1-D uint8 array.

    Raises:
        TypeError: ``data`` is not a 1-D uint8 array.
    """

    __slots__ = ("data", "size")

    def __init__(self, data: np.ndarray) -> None:
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"a state dump is a 1-D uint8 array, got {data.dtype} {data.shape}")
        self.data = data
        self.size = int(data.shape[0])

    @property
    def writable(self) -> bool:
        """Whether views of ``data`` accept writes (False for bytes or a read-only memmap)."""
        return bool(self.data.flags.writeable)

    def view(self, offset: int, nbytes: int, what: str) -> np.ndarray:
        """``nbytes`` bytes at ``offset`` as a uint8 view: the one bounds-checked primitive.

        Args:
            offset: Byte offset in the dump.
            nbytes: How many bytes.
            what: The field or record being read (for the error message).

        Returns:
            A 1-D uint8 view of ``data``.

        Raises:
            StateFormatError: The range does not lie within the dump (a short read: ``needed`` and
                ``left`` set).
        """
        offset, nbytes = int(offset), int(nbytes)  # Python ints: numpy uint64 products wrap silently
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise short_read(offset, what, nbytes, self.size - offset)
        return self.data[offset : offset + nbytes]

    def uint(self, offset: int, nbytes: int, what: str, *, signed: bool = False) -> int:
        """A little-endian integer of ``nbytes`` bytes at ``offset``.

        Args:
            offset: Byte offset in the dump.
            nbytes: Width of the integer in bytes.
            what: The field being read (for the error message).
            signed: Read two's complement.

        Returns:
            The value as a Python int.

        Raises:
            StateFormatError: Fewer than ``nbytes`` bytes remain at ``offset``.
        """
        return int.from_bytes(self.view(offset, nbytes, what).tobytes(), "little", signed=signed)

    def u32(self, offset: int, what: str) -> int:
        """A little-endian uint32 at ``offset``.

        Args:
            offset: Byte offset in the dump.
            what: The field being read (for the error message).

        Returns:
            The value as a Python int.

        Raises:
            StateFormatError: The value does not fit in the bytes that remain.
        """
        return self.uint(offset, 4, what)

    def i32(self, offset: int, what: str) -> int:
        """A little-endian int32 at ``offset``.

        Args:
            offset: Byte offset in the dump.
            what: The field being read (for the error message).

        Returns:
            The value as a Python int.

        Raises:
            StateFormatError: The value does not fit in the bytes that remain.
        """
        return self.uint(offset, 4, what, signed=True)

    def u64(self, offset: int, what: str) -> int:
        """A little-endian uint64 at ``offset``.

        Args:
            offset: Byte offset in the dump.
            what: The field being read (for the error message).

        Returns:
            The value as a Python int.

        Raises:
            StateFormatError: The value does not fit in the bytes that remain.
        """
        return self.uint(offset, 8, what)

    def array(self, offset: int, count: int, dtype: npt.DTypeLike, what: str) -> np.ndarray:
        """``count`` items of ``dtype`` at ``offset``: a zero-copy typed view.

        Args:
            offset: Byte offset in the dump.
            count: Number of items.
            dtype: Item type (a numpy dtype or anything ``np.dtype`` takes).
            what: The field or record being read (for the error message).

        Returns:
            A 1-D view of ``count`` items.

        Raises:
            StateFormatError: The items do not fit in the bytes that remain.
        """
        dtype = np.dtype(dtype)
        return self.view(offset, int(count) * dtype.itemsize, what).view(dtype)
