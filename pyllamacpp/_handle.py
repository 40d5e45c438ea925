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

import weakref
from typing import Any

import numpy as np

from ._lib import ffi
from .errors import ClosedError


class _Node:
    """The freeing of one C object, apart from its :class:`Handle`: the pointer, and the nodes of
    the objects that must be freed before it (its dependents). A dependent's node is held strongly
    by the nodes it depends on, and holds them only weakly, so no reference cycle is made and a
    handle still goes as soon as its last reference does."""

    __slots__ = ("ptr", "rpc", "dependents", "parents", "__weakref__")

    def __init__(self, ptr, rpc) -> None:
        self.ptr = ptr  # the ffi.gc pointer; None once freed
        self.rpc = rpc
        self.dependents: dict[int, _Node] = {}  # id -> node, in the order they came
        self.parents: list = []  # weakrefs to the nodes this one depends on

    def release(self, _release=ffi.release, _gc=ffi.gc, _id=id) -> None:  # bound: at exit ffi may be None
        ptr, self.ptr = self.ptr, None
        if ptr is None:
            return  # freed already (by a parent that went first, or by its own handle)
        for ref in self.parents:
            parent = ref()  # None inside a collection of a cycle: the collector cleared it
            if parent is not None:
                parent.dependents.pop(_id(self), None)
        # What depends on this object goes first, newest first (a context before the adapters it
        # applies, both before their model), whatever order Python finalizes their handles in.
        while self.dependents:
            _, child = self.dependents.popitem()
            child.release()
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


class Handle:
    """One C pointer and the handles it depends on (``deps``: freed after it).

    The ownership rule, for every pair of C objects where one frees or invalidates the other
    (a model and its adapters and contexts, an adapter and the contexts that apply it): the
    dependent is freed before what it depends on, and once, in any order Python finalizes them.
    Holding ``deps`` keeps them alive while this handle is referenced, which orders the frees when
    references go one by one; inside the collection of a reference cycle CPython runs the
    finalizers in no fixed order, so each dependency also frees its live dependents itself, first
    (``llama_model_free`` would otherwise delete an adapter that ``llama_adapter_lora_free`` frees
    again: a double free)."""

    __slots__ = ("ptr", "deps", "rpc", "_node", "__weakref__")

    def __init__(self, ptr, free, deps: tuple = (), rpc=None):
        self.ptr = ffi.gc(ptr, free)
        self.rpc = rpc  # an rpc.Link when the object lives on RPC servers
        self._node = _Node(self.ptr, rpc)
        self.deps: tuple = ()
        self.add_deps(deps)

    def add_deps(self, deps) -> None:
        """Make this handle depend on ``deps`` too (kept alive by it, freed after it); a handle
        among them frees this one first if it goes first. Other objects (cffi buffers) are only
        kept alive."""
        held = {id(d) for d in self.deps}
        new = tuple(d for d in deps if d is not None and id(d) not in held)
        node = self._node
        for d in new:
            if isinstance(d, Handle) and node.ptr is not None:
                d._node.dependents[id(node)] = node
                node.parents.append(weakref.ref(d._node))
        self.deps = self.deps + new

    def __del__(self):
        # Free our pointer before the dependencies go. Without this, CPython clears __slots__ in
        # sorted name order ("deps" before "ptr"): a model was freed before its context's
        # llama_free, a heap-use-after-free that AddressSanitizer found.
        self.ptr = None
        node = getattr(self, "_node", None)  # absent when __init__ failed early
        if node is not None:
            node.release()


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
