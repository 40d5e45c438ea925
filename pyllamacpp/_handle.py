"""Lifetimes of C objects and of the numpy views over their memory.

A :class:`Handle` owns one C pointer (freed by ``ffi.gc`` when the last reference goes) and keeps
the handles it depends on alive (a context's handle holds its model's). Python objects drop their
handle on ``close()``; a numpy view made by :func:`view` holds the handle too, so memory under a
live view is never freed: ``close()`` followed by reading an old view reads valid memory.

A handle of an object that lives on RPC servers carries an ``rpc.Link``: every ``ptr`` asks it
whether a server is gone (RPCError instead of an abort in ggml), and ``__del__`` leaves the C
object unfreed when one is, or at interpreter exit (freeing would go through the network).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._lib import ffi
from .errors import ClosedError


class Handle:
    __slots__ = ("ptr", "deps", "rpc", "__weakref__")

    def __init__(self, ptr, free, deps: tuple = (), rpc=None):
        self.ptr = ffi.gc(ptr, free)
        self.deps = deps  # freed after this one: they outlive every reference to it
        self.rpc = rpc  # an rpc.Link when the object lives on RPC servers

    def __del__(self, _release=ffi.release, _gc=ffi.gc):  # bound here: at exit the module's ffi may be None
        # Free our pointer before the dependencies go. Without this, CPython clears __slots__ in
        # sorted name order ("deps" before "ptr"): a model was freed before its context's
        # llama_free, a heap-use-after-free that AddressSanitizer found.
        ptr, self.ptr = self.ptr, None
        if ptr is None:
            return
        rpc = self.rpc
        if rpc is not None:
            try:
                leak = rpc.must_leak()
            except BaseException:  # noqa: BLE001 (in doubt, never enter ggml-rpc from a destructor)
                leak = True
            if leak:
                _gc(ptr, None)  # drop the destructor: the C object stays, unfreed
                return
        _release(ptr)


class Owner:
    """``ptr``, ``closed``, ``close()`` and the with-statement of an object that owns one
    :class:`Handle` in ``_h`` (Model, Context, Sampler). ``_what`` names it in the error, ``_free``
    is the C function that frees it."""

    _what = "object"
    _free = ""
    _h: Handle | None

    @property
    def ptr(self) -> Any:
        """The C pointer (raises :class:`~pyllamacpp.errors.ClosedError` after ``close()``, and
        :class:`~pyllamacpp.errors.RPCError` when an RPC server the object lives on is gone)."""
        h = self._h
        if h is None:
            raise ClosedError(f"the {self._what} is closed", func=self._free)
        if h.rpc is not None:
            h.rpc.check()  # a server known gone: RPCError here rather than an abort in ggml
        return h.ptr

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called: every use after it raises ClosedError."""
        return self._h is None

    def close(self) -> None:
        """Drop the handle (idempotent); the C object is freed once no view of its memory is left
        (or left unfreed, with a warning, when an RPC server it lives on is gone)."""
        self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Mem:
    """What numpy sees as a view's base: the address, and the handle that keeps it valid."""

    __slots__ = ("__array_interface__", "owner", "__weakref__")

    def __init__(self, addr: int, shape: tuple, typestr: str, owner, readonly: bool):
        self.__array_interface__ = {"data": (addr, readonly), "shape": shape, "typestr": typestr, "version": 3}
        self.owner = owner


def view(ptr, shape: tuple, dtype, owner, *, readonly: bool = False) -> np.ndarray:
    """A numpy array over ``ptr`` (a cdata pointer) that keeps ``owner`` alive."""
    dtype = np.dtype(dtype)
    addr = int(ffi.cast("uintptr_t", ptr))
    if addr == 0:
        raise ValueError("view of a NULL pointer")
    return np.asarray(_Mem(addr, tuple(int(s) for s in shape), dtype.str, owner, readonly))
