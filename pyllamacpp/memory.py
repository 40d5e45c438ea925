"""``Memory``: a context's sequences (``llama_memory_*``: KV cache or recurrent state)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ._lib import lib
from .errors import ClosedError, LlamaError

if TYPE_CHECKING:
    from .context import Context


# pyllamacpp.state's memory names -> the class llama_model::create_memory builds
_LLAMA_CLASS = {
    "kv": "llama_kv_cache",
    "iswa": "llama_kv_cache_iswa",
    "recurrent": "llama_memory_recurrent",
    "hybrid": "llama_memory_hybrid",
    "hybrid-iswa": "llama_memory_hybrid_iswa",
    "dsa": "llama_kv_cache_dsa",
    "msa": "llama_kv_cache_msa",
    "dsa-iswa": "llama_kv_cache_dsa_iswa",
    "hybrid-idx": "llama_memory_hybrid_idx",
    "dsv4": "llama_kv_cache_dsv4",
}


class Memory:
    """A context's sequences: its KV cache or recurrent state.

    Wraps ``llama_get_memory(ctx)`` and the ``llama_memory_*`` functions. Sequence ids are checked
    against ``[0, n_seq_max)`` in Python first: llama.cpp asserts (and aborts the process) on some
    out-of-range ids. The memory holds its context weakly: once the context is gone or closed,
    every method raises :class:`~pyllamacpp.errors.ClosedError`.

    Args:
        ctx: The context whose memory this is.
    """

    def __init__(self, ctx: Context) -> None:
        self._ctx = weakref.ref(ctx)

    def __repr__(self) -> str:
        """``<Memory llama_kv_cache n_seq_max=4 n_ctx=512 seqs={0: (0, 8), 2: (0, 3)}>``: the
        class llama.cpp built (when pyllamacpp.state knows the architecture's rule), and the
        [pos_min, pos_max] of each non-empty sequence (``llama_memory_seq_pos_min/max``)."""
        ctx = self._ctx()
        if ctx is None or ctx.closed:
            return "<Memory (context closed)>"
        mem = lib.llama_get_memory(ctx.ptr)
        seqs = {}
        for s in range(ctx.n_seq_max):
            hi = lib.llama_memory_seq_pos_max(mem, s)
            if hi >= 0:
                seqs[s] = (lib.llama_memory_seq_pos_min(mem, s), hi)
        try:
            name, _ = ctx._memory_layers()
        except (OSError, ValueError):  # a repr never raises: the GGUF may have moved since the model loaded
            name = None
        kind = _LLAMA_CLASS.get(name, name) if name else "memory"
        return f"<Memory {kind} n_seq_max={ctx.n_seq_max} n_ctx={ctx.n_ctx} seqs={seqs}>"

    def _mem(self):
        ctx = self._ctx()
        if ctx is None:
            raise ClosedError("the context is gone", func="llama_get_memory")
        return lib.llama_get_memory(ctx.ptr), ctx

    def _seq(self, ctx, seq_id, *, allow_all=False) -> int:
        seq_id = int(seq_id)
        if allow_all and seq_id < 0:
            return -1
        if not 0 <= seq_id < ctx.n_seq_max:
            raise ValueError(f"seq_id {seq_id} is outside [0, {ctx.n_seq_max}) (n_seq_max)")
        return seq_id

    def clear(self, data: bool = True) -> None:
        """Clear the memory of every sequence (``llama_memory_clear``).

        Args:
            data: Also clear the data buffers (``data`` of ``llama_memory_clear``), not only the
                metadata.

        Raises:
            ClosedError: The context is closed or gone.
        """
        mem, _ = self._mem()
        lib.llama_memory_clear(mem, data)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of ``seq_id`` (``llama_memory_seq_rm``).

        Args:
            seq_id: The sequence; negative: every sequence.
            p0: The first position removed (negative: from 0).
            p1: One past the last position removed (negative: to the end).

        Returns:
            False if llama.cpp could not remove the range (e.g. a partial range of a recurrent
            state), True otherwise.

        Raises:
            ValueError: ``seq_id`` is ``>= n_seq_max``.
            ClosedError: The context is closed or gone.
        """
        mem, ctx = self._mem()
        return bool(lib.llama_memory_seq_rm(mem, self._seq(ctx, seq_id, allow_all=True), p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy positions [p0, p1) of sequence ``src`` into ``dst`` (``llama_memory_seq_cp``).

        With ``kv_unified=False`` each sequence has its own stream, and llama.cpp only queues a
        copy between streams: the buffers are copied at the start of the next ``decode``. Until
        then, loading a state into ``dst`` would be overwritten by that copy, so pyllamacpp refuses
        such a load. A partial range across streams aborts llama.cpp (GGML_ASSERT): refused here.

        Args:
            src: The sequence copied from.
            dst: The sequence copied to.
            p0: The first position copied (negative: from 0).
            p1: One past the last position copied (negative: to the end).

        Raises:
            ValueError: ``src`` or ``dst`` is outside ``[0, n_seq_max)``, or a partial range between
                two streams (``kv_unified=False``).
            ClosedError: The context is closed or gone.
        """
        mem, ctx = self._mem()
        src, dst = self._seq(ctx, src), self._seq(ctx, dst)
        cross = not ctx.params.kv_unified and src != dst and lib.llama_model_is_recurrent(ctx.model.ptr) == 0
        if cross and not (p0 <= 0 and p1 < 0):
            raise ValueError(
                f"seq_cp({src}, {dst}, {p0}, {p1}): with kv_unified=False the sequences live in "
                "different streams and llama.cpp copies only whole sequences between them"
            )
        lib.llama_memory_seq_cp(mem, src, dst, p0, p1)
        if cross:
            ctx._pending_stream_copies.add(dst)

    def seq_keep(self, seq_id: int) -> None:
        """Remove every sequence but ``seq_id`` (``llama_memory_seq_keep``).

        Args:
            seq_id: The sequence kept.

        Raises:
            ValueError: ``seq_id`` is outside ``[0, n_seq_max)``.
            ClosedError: The context is closed or gone.
        """
        mem, ctx = self._mem()
        lib.llama_memory_seq_keep(mem, self._seq(ctx, seq_id))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions [p0, p1) of ``seq_id`` by ``delta`` (``llama_memory_seq_add``).

        Args:
            seq_id: The sequence.
            p0: The first position shifted (negative: from 0).
            p1: One past the last position shifted (negative: to the end).
            delta: What is added to each position.

        Raises:
            LlamaError: This memory cannot shift positions (``llama_memory_can_shift`` is false).
            ValueError: ``seq_id`` is outside ``[0, n_seq_max)``.
            ClosedError: The context is closed or gone.
        """
        mem, ctx = self._mem()
        if not lib.llama_memory_can_shift(mem):
            raise LlamaError("this memory cannot shift positions", func="llama_memory_seq_add")
        lib.llama_memory_seq_add(mem, self._seq(ctx, seq_id), p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide positions [p0, p1) of ``seq_id`` by ``d`` (``llama_memory_seq_div``).

        Args:
            seq_id: The sequence.
            p0: The first position divided (negative: from 0).
            p1: One past the last position divided (negative: to the end).
            d: The divisor.

        Raises:
            ValueError: ``d <= 0``, or ``seq_id`` is outside ``[0, n_seq_max)``.
            LlamaError: This memory cannot shift positions (``llama_memory_can_shift`` is false).
            ClosedError: The context is closed or gone.
        """
        mem, ctx = self._mem()
        if d <= 0:
            raise ValueError(f"seq_div: d must be positive, got {d}")
        if not lib.llama_memory_can_shift(mem):
            raise LlamaError("this memory cannot shift positions", func="llama_memory_seq_div")
        lib.llama_memory_seq_div(mem, self._seq(ctx, seq_id), p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        """The smallest position of ``seq_id`` in the memory (``llama_memory_seq_pos_min``).

        Args:
            seq_id: The sequence.

        Returns:
            The position, or -1 if the sequence is empty.

        Raises:
            ValueError: ``seq_id`` is outside ``[0, n_seq_max)``.
            ClosedError: The context is closed or gone.
        """
        mem, ctx = self._mem()
        return lib.llama_memory_seq_pos_min(mem, self._seq(ctx, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """The largest position of ``seq_id`` in the memory (``llama_memory_seq_pos_max``).

        Args:
            seq_id: The sequence.

        Returns:
            The position, or -1 if the sequence is empty.

        Raises:
            ValueError: ``seq_id`` is outside ``[0, n_seq_max)``.
            ClosedError: The context is closed or gone.
        """
        mem, ctx = self._mem()
        return lib.llama_memory_seq_pos_max(mem, self._seq(ctx, seq_id))

    @property
    def can_shift(self) -> bool:
        """Whether positions can be shifted (``llama_memory_can_shift``): ``seq_add``, ``seq_div``.

        Raises:
            ClosedError: The context is closed or gone.
        """
        mem, _ = self._mem()
        return bool(lib.llama_memory_can_shift(mem))
