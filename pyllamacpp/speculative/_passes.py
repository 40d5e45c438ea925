"""Counting a context's forward passes in C: :class:`PassCounter`."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from .._lib import ffi, lib
from ._closing import _Closing

if TYPE_CHECKING:
    from ..context import Context


class PassCounter(_Closing):
    """Counts a context's forward passes (one per ubatch) in C, on the context's graph taps or
    with a ``cb_eval`` of its own.

    **On the taps** (``PassCounter(ctx)``, any context made with its taps, the default): the
    taps' C callback (build_support/taps.h) is armed with no node wanted and counts each pass
    where the graph's first node comes again, so the same context can also be captured and
    patched (``ctx.capture`` / ``ctx.patch``) while it counts. It counts from its creation until
    :meth:`close` (a ``with`` block closes it)::

        with PassCounter(ctx) as counter:
            ctx.decode(batch)
        counter.n_passes

    **With its own** ``cb_eval`` (``PassCounter()``, then ``model.context(**counter.context_params())``):
    ``pyl_pass_count_cb`` (build_support/speculative.h) wants no node and counts a pass where the
    first node it saw reappears (the rule of ``experiments/trace.py``). ``cb_eval`` is fixed when a
    context is made, and a context has one: a context made this way has no graph taps
    (``ctx.capture`` raises ``TapError``), and the counter must outlive it.

    Either way no Python runs per node: a Python callback would run about 1,100 times per pass on
    the default model and slow the decodes it counts. (A counter on the taps needs the graph's
    first node: the listing ``ctx.graph_nodes()`` makes with probe decodes in a throwaway
    context, once per model and parameters, as a capture does.)

    Attributes:
        n_passes: Passes seen so far.
        n_nodes: Graph nodes asked about so far.

    Args:
        ctx: Count on this context's taps; None: a counter for :meth:`context_params`.

    Raises:
        TapError: ``ctx`` has no taps (made with ``taps=False`` or its own ``cb_eval``).
    """

    def __init__(self, ctx: Context | None = None) -> None:
        self._c = ffi.new("pyl_pass_count *")
        self._taps: Any = None
        self._ctx: weakref.ref | None = None
        self._start = (0, 0)
        self._closed = (0, 0)  # the counts when close() stopped them
        if ctx is not None:
            from ..taps import graph_listing, taps_of

            taps = taps_of(ctx)  # TapError when the context cannot be tapped
            taps.count(graph_listing(ctx, 3), True)  # the listing's first node starts a pass
            self._taps, self._ctx = taps, weakref.ref(ctx)
            self._start = taps.passes()

    def context_params(self) -> dict[str, Any]:
        """The :class:`~pyllamacpp.Context` keywords that install the counter as the context's
        ``cb_eval`` (a counter made without a context).

        Returns:
            ``{"cb_eval": ..., "cb_eval_user_data": ...}``.

        Raises:
            ValueError: The counter counts on a context's taps already.
        """
        if self._ctx is not None:
            raise ValueError("this PassCounter counts on a context's taps; make one with PassCounter() for cb_eval")
        return {"cb_eval": ffi.addressof(lib, "pyl_pass_count_cb"), "cb_eval_user_data": self._c}

    def counts(self, ctx: Context) -> bool:
        """Whether this counter counts ``ctx``'s passes (on its taps, or as its ``cb_eval``).

        Args:
            ctx: A context.

        Returns:
            True when the passes it decodes are counted here.
        """
        if self._ctx is not None:
            return self._ctx() is ctx and self._taps is not None
        return ctx.params.cb_eval_user_data is self._c

    def _counts(self) -> tuple[int, int]:
        if self._ctx is None:
            return int(self._c.n_passes), int(self._c.n_nodes)
        if self._taps is None:
            return self._closed
        p, n = self._taps.passes()
        return p - self._start[0], n - self._start[1]

    @property
    def n_passes(self) -> int:
        """Forward passes seen so far."""
        return self._counts()[0]

    @property
    def n_nodes(self) -> int:
        """Graph nodes asked about so far."""
        return self._counts()[1]

    def reset(self) -> None:
        """Set both counts to 0."""
        if self._ctx is None:
            self._c.n_passes = 0
            self._c.n_nodes = 0
        elif self._taps is not None:
            self._start = self._taps.passes()
        else:
            self._closed = (0, 0)

    def close(self) -> None:
        """Stop counting on the context's taps (idempotent; the counts stay readable). Nothing
        to do for a ``cb_eval`` counter."""
        if self._taps is None:
            return
        self._closed = self._counts()
        taps, self._taps = self._taps, None
        if self._ctx is not None and self._ctx() is not None:
            taps.count(None, False)

    def __repr__(self) -> str:
        return f"<PassCounter {self.n_passes} passes, {self.n_nodes} nodes>"
