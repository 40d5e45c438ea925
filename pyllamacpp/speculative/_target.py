"""The target's side of a round: the verify batch, and cutting the sequence back to what was kept."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..batch import Batch
from ..packing import WorkOrder
from ._checkpoint import _Rollback

if TYPE_CHECKING:
    from ..context import Context
    from ._passes import PassCounter
    from ._stats import SpeculativeStats


class _Target:
    """The target's sequence during a speculative generation: verify batches and what to keep.

    ``end`` is the position after what the sequence holds (the next token's position), counting
    ``replay``: tokens a checkpoint restore took out again, decoded at the front of the next batch
    (positions ``end - len(replay)`` on)."""

    def __init__(self, ctx: Context, seq_id: int, end: int, passes: PassCounter | None, st: SpeculativeStats) -> None:
        self.ctx, self.seq, self.end, self.passes, self.st = ctx, seq_id, end, passes, st
        self.rb = _Rollback(ctx, seq_id)
        self.replay: list[int] = []
        self.since: list[int] = []  # tokens decoded after the checkpoint (positions rb.base ...)
        self.order = WorkOrder(Batch(ctx.n_batch, 1, model=ctx.model))
        self.out0 = 0  # the batch index of the row of the last token

    def _fill(self, quiet: list[int], rows: list[int], pos: int) -> int:
        """The work order: ``quiet`` (no logits) then ``rows`` (logits), from position ``pos``;
        returns the batch index of the first row. Through the order's unchecked path (the tokens
        are checked by then): after a decode numpy's calls cost tens of µs each with the caches it
        left cold, more than a round's Python otherwise."""
        o = self.order
        o.clear()
        o.add_trusted(quiet, pos, self.seq, False)
        return o.add_trusted(rows, pos + len(quiet), self.seq, True)

    def verify(self, id_last: int, draft: list[int]) -> None:
        rb, st, r = self.rb, self.st, self.replay
        if not rb.plain:
            t = time.perf_counter()
            if draft and not r:
                rb.mark(self.end)
                self.since = []
                st.n_checkpoints += 1
            elif not r:
                rb.base = -1  # a round without a draft keeps its one row: nothing to restore to
            st.t_rollback += time.perf_counter() - t
        rows = [id_last, *draft]
        out0 = self._fill(r, rows, self.end - len(r))
        p0 = self.passes.n_passes if self.passes is not None else 0
        t = time.perf_counter()
        self.order.decode(self.ctx)  # KVCacheFullError: nothing of the batch reached memory
        st.t_target += time.perf_counter() - t
        if self.passes is not None:
            st.verify_passes.append(self.passes.n_passes - p0)
        st.verify_rows.append(len(r) + len(rows))
        st.n_replayed += len(r)
        self.out0 = out0
        if rb.base >= 0:
            self.since += r
            self.since += rows
        self.replay = []
        self.end += len(rows)

    def keep(self, end: int, lazy: bool) -> None:
        """Make the sequence hold positions before ``end`` only; ``lazy``: tokens to decode again
        wait for the next verify batch."""
        if end < self.end:
            t = time.perf_counter()
            rb = self.rb
            if rb.plain:
                self.ctx.memory.seq_rm(self.seq, end, -1)
            elif self.replay:  # the sequence is at the checkpoint already
                del self.replay[end - rb.base :]
            else:
                rb.restore()
                self.replay, self.since = self.since[: end - rb.base], []
                self.st.n_restores += 1
            self.end = end
            self.st.t_rollback += time.perf_counter() - t
        if not lazy:
            self.flush()

    def flush(self) -> None:
        """Decode the tokens a restore took out, without outputs."""
        r = self.replay
        if not r:
            return
        self._fill(r, [], self.end - len(r))
        p0 = self.passes.n_passes if self.passes is not None else 0
        t = time.perf_counter()
        self.order.decode(self.ctx)
        self.st.t_target += time.perf_counter() - t
        if self.passes is not None:
            self.st.n_replay_passes += self.passes.n_passes - p0
        self.st.n_replayed += len(r)
        if self.rb.base >= 0:
            self.since += r
        self.replay = []

    def abandon(self, start: int) -> None:
        """After a failed verify (an abort): back to holding positions before ``start``."""
        if self.rb.plain:
            self.ctx.memory.seq_rm(self.seq, start, -1)
            self.end = start
        elif self.rb.base >= 0:
            self.rb.restore()
            self.replay = (self.since + self.replay)[: start - self.rb.base]
            self.since, self.end = [], start
            self.flush()
