"""The with-statement of the package's objects that hold something until ``close()``."""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T", bound="_Closing")


class _Closing:
    """``with`` support for an object with an idempotent ``close()``: the block's end closes it
    (:class:`~pyllamacpp.speculative.Draft`, :class:`~pyllamacpp.speculative.PassCounter`)."""

    def close(self) -> None:
        """Free what the object holds (idempotent)."""

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
