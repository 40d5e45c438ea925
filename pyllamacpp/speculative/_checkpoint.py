"""Cutting a sequence back after a verify: ``seq_rm``, or a ``PARTIAL_ONLY`` checkpoint restored
for a memory that cannot drop a suffix (recurrent, hybrid, a sliding window)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._lib import lib
from ..context_state import StateBuffer, StateFlags
from ..errors import LlamaError

if TYPE_CHECKING:
    from ..context import Context

_PARTIAL = int(StateFlags.PARTIAL_ONLY)


class _Rollback:
    """Cut a sequence back to a position. A plain KV cache: ``seq_rm``. Another memory: restore
    the ``PARTIAL_ONLY`` checkpoint :meth:`mark` took (a StateBuffer, made once and grown when
    needed), then ``seq_rm`` what the checkpoint does not cover (a hybrid memory's KV part)."""

    def __init__(self, ctx: Context, seq_id: int) -> None:
        self.ctx, self.seq = ctx, seq_id
        self.plain = bool(ctx._plain_kv)
        self.base = -1  # the checkpoint's position: the sequence held positions < base; -1: none
        self._buf: StateBuffer | None = None
        self._state: Any = None

    def mark(self, base: int) -> None:
        ctx = self.ctx
        if self._buf is not None:
            try:
                self._state = ctx.seq_state(self.seq, _PARTIAL, out=self._buf)
                self.base = base
                return
            except ValueError:  # the state grew past the buffer (a sliding window filling up)
                pass
        size = lib.llama_state_seq_get_size_ext(ctx.ptr, self.seq, _PARTIAL)
        self._buf = StateBuffer(max(2 * int(size), 1 << 12))
        self._state = ctx.seq_state(self.seq, _PARTIAL, out=self._buf)
        self.base = base

    def restore(self) -> None:
        assert self.base >= 0, "no checkpoint to restore"
        self.ctx.set_seq_state(self.seq, self._state, _PARTIAL, validate=False, keep_on_error=False)
        if not self.ctx.memory.seq_rm(self.seq, self.base, -1):
            raise LlamaError(
                f"llama_memory_seq_rm(seq {self.seq}, {self.base}, -1) refused to cut after a checkpoint restore",
                func="llama_memory_seq_rm",
            )
