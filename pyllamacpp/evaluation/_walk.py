"""The walk that decodes the trie of :func:`~pyllamacpp.evaluation.loglikelihood`'s requests.

Slots (sequences) walk the trie's leaves depth first, sharing nodes in one batch (coupled sequences)
or by ``llama_memory_seq_cp``; epochs; the rows' log-probabilities; the prefix store's restore and
save. The module docstring of ``pyllamacpp.evaluation._engine`` tells the whole story.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..packing import WorkOrder
from ..scoring import log_softmax
from ._trie import _Node, _path

if TYPE_CHECKING:
    from ..context import Context
    from ..packing import Piece
    from ..prefix_store import PrefixStore
    from ._engine import Loglikelihoods


# -- the walk ----------------------------------------------------------------------------------------
class _Seg:
    """The walk's tag on a piece of the work order (the piece's ``lo``/``hi`` are the node's tokens
    ``[j0, j1)``): the node, the slot that feeds it and the slots that joined it."""

    __slots__ = ("node", "slot", "joiners")

    def __init__(self, node: _Node, slot: int) -> None:
        self.node, self.slot = node, slot
        self.joiners: list[int] = []


class _Walk:
    """Decodes the trie in one context: slots, epochs, batches, rows (see the module docstring)."""

    def __init__(
        self,
        ctx: Context,
        leaves: list[_Node],
        n_seq: int,
        grave: int,
        n_ctx: int,
        stats: Loglikelihoods,
        store: PrefixStore | None = None,
    ) -> None:
        from ..batch import Batch

        self.ctx, self.leaves, self.stats = ctx, leaves, stats
        self.n_ctx, self.n_batch = n_ctx, ctx.n_batch
        self.grave = grave  # the sequence that keeps the cells of finished branches (-1: none)
        self.n_threads = ctx.params.n_threads_batch or 1
        self.paths: list[list[_Node] | None] = [None] * n_seq  # the path each slot works on
        self.held = [0] * n_seq  # nodes of its path (from the first) fully in the slot's sequence
        self.next_leaf = 0
        self.used = 0  # cells taken in this epoch (all of them stay taken until it ends)
        self.live: set[_Node] = set()  # nodes with cells in this epoch
        self.reserved: set[_Node] = set()  # nodes the paths in flight still have to feed
        self.order = WorkOrder(Batch(self.n_batch, max(1, n_seq), model=ctx.model))
        self.on_scored: Any = None  # called with each node whose last token's log-prob is known
        self.n_scored = self.n_scored_at_epoch = 0  # nodes scored (a guard: every epoch scores some)
        self.store = store
        self.spare = 0  # cells of this epoch no path in flight will take (set by each _assign)
        self.n_restored_new = 0  # restored tokens of nodes not scored before (work the bar counts)

    # a slot's path is done when every node on it has been scored
    def _done(self, s: int) -> bool:
        path = self.paths[s]
        return path is None or all(n.scored for n in path)

    def _drop(self, s: int, keep: int) -> None:
        """Slot ``s`` lets go of its path past the first ``keep`` nodes: those cells move to the
        graveyard sequence (``llama_memory_seq_cp`` then ``llama_memory_seq_rm``), so that no cell
        is free again before the epoch ends and llama.cpp keeps placing new tokens above all the
        others. A node no slot holds any more has no cells to share."""
        path = self.paths[s]
        assert path is not None
        if any(s in n.holders for n in path[keep:]):
            p0 = path[keep - 1].end if keep else 0
            mem = self.ctx.memory
            if self.grave >= 0:
                mem.seq_cp(s, self.grave, p0, -1)
            mem.seq_rm(s, p0, -1)
            for node in path[keep:]:
                node.holders.discard(s)
                if not node.holders:
                    node.n_dec, node.owner = 0, -1
                    self.live.discard(node)
        self.held[s] = min(self.held[s], keep)

    def _new_epoch(self) -> None:
        """Every cell taken: clear the memory (llama.cpp's head back to cell 0) and start the
        paths in flight again from their first node not scored."""
        self.ctx.memory.clear()
        for node in self.live:
            node.n_dec, node.owner, node.holders = 0, -1, set()
        self.live.clear()
        self.reserved.clear()
        self.held = [0] * len(self.held)
        self.used = 0
        self.stats.n_epochs += 1

    def _assign(self) -> None:
        """Give the free slots the next leaves in depth-first order, each to the free slot that
        holds the most of its path, while the epoch's cells hold what the paths in flight still
        need (so no path is cut by the end of an epoch and decoded again)."""
        free = [s for s in range(len(self.paths)) if self._done(s)]
        new: dict[int, list[_Node]] = {}
        self.reserved = {n for n in self.reserved if n.n_dec < n.n_feed}
        owed = sum(n.n_feed - n.n_dec for n in self.reserved)  # cells the paths in flight will take
        while free and self.next_leaf < len(self.leaves):
            path = _path(self.leaves[self.next_leaf])
            more = [n for n in path if n.n_dec < n.n_feed and n not in self.reserved]
            need = sum(n.n_feed - n.n_dec for n in more)
            if self.used + owed + need > self.n_ctx:
                break  # the next epoch's
            owed += need
            self.reserved.update(more)
            best, best_k = free[0], -1
            for s in free:
                k = _shared(self.paths[s], self.held[s], path)
                if k > best_k:
                    best, best_k = s, k
            free.remove(best)
            new[best] = path
            self.next_leaf += 1
        self.spare = self.n_ctx - self.used - owed  # cells no path in flight will take (restored copies may)
        # copies before cuts: the slots in flight take what they need from the cache first, then
        # each new path cuts its slot's old one and takes its own; last, the idle slots let go
        for s, p in enumerate(self.paths):
            if p is not None and s not in new and s not in free:
                if self.held[s] == 0 and self.store is not None:  # in flight into a new epoch
                    self._restore(s)
                self._catch_up(s)
        for s, path in new.items():
            k = _shared(self.paths[s], self.held[s], path)
            if self.paths[s] is not None:
                self._drop(s, k)
            self.paths[s], self.held[s] = path, k
            if k == 0 and self.store is not None:
                self._restore(s)
            self._catch_up(s)
        for s in free:
            if self.paths[s] is not None:
                self._drop(s, 0)
                self.paths[s] = None

    def _restore(self, s: int) -> None:
        """Load the longest stored prefix of slot ``s``'s path into its empty sequence, up to the
        first row the path needs: the restored nodes are in the cache as if decoded (a node that
        needed no rows counts as scored).

        Where the path's first nodes are already whole in the cache (another slot holds them), the
        slot would copy them with ``seq_cp``; it loads its own copy of them instead only when the
        store holds at least a chunk beyond them, none of it in the cache or fed by another slot,
        and the copy's cells fit in what the epoch has spare."""
        path = self.paths[s]
        store = self.store
        assert path is not None and store is not None
        i_mem = 0  # the first nodes whole in the cache
        while i_mem < len(path) and path[i_mem].holders and path[i_mem].n_dec == path[i_mem].n_feed:
            i_mem += 1
        mem_end = path[i_mem - 1].start + path[i_mem - 1].n_feed if i_mem else 0
        limit = 0
        for i, node in enumerate(path):
            if i >= i_mem and (node.n_dec or node.holders or node.owner != -1):
                limit = node.start  # in the cache, or fed by another slot: not this load's
                break
            n = node.n_feed
            if not node.scored:  # a row it needs: the token before it is decoded, for its logits
                rows = node.want[1 : n + 1].copy()
                if n == node.tokens.size and node.out_children:
                    rows = np.append(rows, True)
                hit = np.flatnonzero(rows)
                if hit.size:
                    n = int(hit[0])
            limit = node.start + n
            if n < node.n_feed:
                break
        if limit - mem_end < store.chunk_size:
            return
        toks = np.concatenate([node.tokens for node in path])[:limit]
        if i_mem and (mem_end > self.spare or store.stored(self.ctx, toks) <= mem_end):
            return
        got = store.restore(self.ctx, s, toks, keep=0)
        if not got:
            return
        self.used += got
        self.stats.n_restored = (self.stats.n_restored or 0) + got
        self.spare -= min(got, mem_end)  # the copy's cells; a load let go keeps them till the epoch ends
        if got <= mem_end:  # no more than the cache holds (a chunk gone since): let go of the copy
            mem = self.ctx.memory
            if self.grave >= 0:
                mem.seq_cp(s, self.grave, 0, -1)
            mem.seq_rm(s, 0, -1)
            return
        for i, node in enumerate(path):
            n = min(got - node.start, node.n_feed)
            if n <= 0:
                break
            node.holders.add(s)
            if i < i_mem:  # whole in the cache already: the slot holds a copy of it now
                self.held[s] = i + 1
                continue
            node.n_dec = n
            self.live.add(node)
            if not node.scored:
                self.n_restored_new += n
            if n < node.n_feed:
                node.owner = s  # the rest is this slot's to feed
                break
            node.owner = -1
            if not node.scored:
                node.scored = True
                self.n_scored += 1
            self.held[s] = i + 1

    def _save(self, s: int, node: _Node) -> None:
        """Store the new whole chunks of slot ``s``'s path up to ``node``'s end (fed whole now)."""
        assert self.store is not None
        path = self.paths[s]
        assert path is not None
        end = node.start + node.n_feed
        if end // self.store.chunk_size == 0:
            return
        toks = np.concatenate([n.tokens for n in path[: _depth_index(path, node) + 1]])[:end]
        self.store.save(self.ctx, s, toks)

    def _catch_up(self, s: int) -> int:
        """Give slot ``s`` the nodes of its path that are in the cache (one ``seq_cp`` from a
        slot that holds the deepest of them: a holder of a node holds its ancestors), up to the
        last node it needs. Returns the index of that node (-1: its path is all scored)."""
        path = self.paths[s]
        if path is None:
            return -1
        last = max((i for i, n in enumerate(path) if not n.scored), default=-1)
        i = j = self.held[s]
        while j <= last and path[j].n_dec == path[j].n_feed and path[j].owner == -1:
            j += 1
        deep = max((k for k in range(i, j) if path[k].n_feed), default=-1)
        if deep >= 0:
            if not path[deep].holders:  # a node in the cache always has a holder
                raise AssertionError("a node in the cache without a holder")
            src = min(path[deep].holders)
            self.ctx.memory.seq_cp(src, s, path[i].start, path[deep].start + path[deep].n_feed)
            for n in path[i : deep + 1]:
                n.holders.add(s)
        self.held[s] = j
        return last

    def _fill(self) -> list[Piece]:
        """The next batch: per slot with work, its path's next tokens, up to ``n_batch`` and the
        cells the epoch has left.

        A node is fed by one slot (its owner); a slot that reaches a node another slot puts
        whole into this batch joins it (its seq id is added to those tokens: one cell each,
        kv_unified) and goes on with its own nodes after it in the same batch, so a question and
        its endings go in one decode. A node the owner feeds over several batches is waited for,
        then taken with ``seq_cp``. Slots fill in index order, so the first slot with work always
        finishes its path within an epoch."""
        wo = self.order
        wo.clear()
        room = min(wo.room, self.n_ctx - self.used)
        whole: dict[int, Piece] = {}  # id(node) -> its piece, for the nodes put whole in this order
        for s, path in enumerate(self.paths):
            if path is None or room == 0:
                continue
            last = self._catch_up(s)
            i = self.held[s]
            while i <= last and room > 0:
                node = path[i]
                if node.owner not in (-1, s):
                    piece = whole.get(id(node))
                    if piece is None:
                        break  # another slot feeds it over several batches: wait for its cells
                    wo.join(piece, s)
                    piece.tag.joiners.append(s)
                    i += 1
                    continue
                node.owner = s
                j0 = node.n_dec
                take = min(room, node.n_feed - j0)
                j1 = j0 + take
                flags: str | np.ndarray = "none"  # a node decoded again needs no rows
                if not node.scored:
                    flags = np.zeros(take, bool)
                    nxt = np.arange(j0 + 1, j1 + 1)
                    inside = nxt < node.tokens.size
                    flags[inside] = node.want[nxt[inside]]
                    if j1 == node.tokens.size and node.out_children:
                        flags[-1] = True
                else:
                    self.stats.n_redecoded += take
                piece = wo.add(node.tokens[j0:j1], s, node.start + j0, flags, tag=_Seg(node, s), lo=j0)
                room -= take
                if j1 < node.n_feed:
                    break  # the rest of it in the next batch
                if j0 == 0:
                    whole[id(node)] = piece
                i += 1  # this slot goes on in the same batch: same sequence, next positions
        return wo.pieces

    def _decoded(self, pieces: list[Piece]) -> None:
        """After the decode: the rows' log-probabilities (each piece's ``rows``), the nodes' state."""
        n_out, n_tok = self.order.n_outputs, len(self.order)
        self.used += n_tok
        self.stats.n_decodes += 1
        self.stats.n_decoded += n_tok
        self.stats.n_outputs += n_out
        scored_now: list[_Node] = []
        if n_out:
            # per output row the token it predicts: the node's next one, or (at the node's last
            # token) the first token of its first child that wants it
            targets = [0] * n_out
            fed: list[tuple[_Node, int, list[int]]] = []  # per piece with rows: node, first row, tokens predicted
            extra: list[tuple[int, _Node]] = []  # (row, child) for the other children of a last row
            for p in pieces:
                if p.rows.start == p.rows.stop:
                    continue
                node = p.tag.node
                size = node.tokens.size
                js = (p.at + 1).tolist()
                fed.append((node, p.rows.start, js))
                for row, j in enumerate(js, p.rows.start):
                    if j < size:
                        targets[row] = int(node.tokens[j])
                    else:
                        first, *others = node.out_children
                        targets[row] = int(first.tokens[0])
                        extra.extend((row, ch) for ch in others)
            logits = self.ctx.logits_all()
            r = log_softmax(logits, targets, argmax=True, n_threads=self.n_threads)
            assert r.target is not None and r.argmax is not None
            lps, argmax = r.target.tolist(), r.argmax.tolist()
            for node, r0, js in fed:
                size = node.tokens.size
                for row, j in enumerate(js, r0):
                    dst, jd = (node, j) if j < size else (node.out_children[0], 0)
                    dst.lp[jd] = lps[row]
                    dst.greedy[jd] = argmax[row] == targets[row]
                    if jd == dst.tokens.size - 1:
                        scored_now.append(dst)
            if extra:
                # the same rows again (a copy of those few), the other children as targets
                ex = log_softmax(logits[[k for k, _ in extra]], [int(ch.tokens[0]) for _, ch in extra])
                assert ex.target is not None
                for (k, ch), lp in zip(extra, ex.target.tolist()):
                    ch.lp[0] = lp
                    ch.greedy[0] = argmax[k] == int(ch.tokens[0])
                    if ch.tokens.size == 1:
                        scored_now.append(ch)
            del logits, r  # no view of the outputs outlives this decode
        for p in pieces:
            seg = p.tag
            node = seg.node
            node.n_dec = p.hi
            node.holders.add(seg.slot)
            node.holders.update(seg.joiners)
            self.live.add(node)
            if p.hi == node.n_feed:
                node.owner = -1
                if self.store is not None and not node.scored:
                    self._save(seg.slot, node)
                node.scored = True
                self.n_scored += 1
                for t in (seg.slot, *seg.joiners):
                    self.held[t] = max(self.held[t], _depth_index(self.paths[t], node) + 1)
                for ch in node.out_children:  # a leaf of one token: its parent's last row scored it
                    if ch.n_feed == 0:
                        ch.scored = True
        if self.on_scored is not None:
            for node in scored_now:
                self.on_scored(node)

    def run(self) -> None:
        """Decode the whole trie."""
        while True:
            self._assign()
            if all(p is None for p in self.paths):
                if self.next_leaf >= len(self.leaves):
                    return
                if self.used == 0:  # cannot be: every path fits in n_ctx (checked before the walk)
                    raise AssertionError("a path does not fit in an empty epoch")
                self._new_epoch()  # the next leaf does not fit in the cells left
                continue
            pieces = self._fill()
            if not pieces:
                if all(self._done(s) for s in range(len(self.paths))):
                    continue  # scored by other slots' rows: free them and go on
                if self.used >= self.n_ctx:
                    if self.n_scored == self.n_scored_at_epoch:  # a path longer than n_ctx: never
                        raise AssertionError("an epoch scored nothing: a path does not fit in n_ctx")
                    self.n_scored_at_epoch = self.n_scored
                    self._new_epoch()
                    continue
                raise AssertionError("the walk made no progress")  # a slot waits only on one that feeds
            self.order.decode(self.ctx)
            self._decoded(pieces)


def _shared(old: list[_Node] | None, held: int, path: list[_Node]) -> int:
    """How many first nodes of ``path`` a slot that holds ``held`` nodes of ``old`` has."""
    k = 0
    if old is not None:
        n = min(held, len(path))
        while k < n and old[k] is path[k]:
            k += 1
    return k


def _depth_index(path: list[_Node] | None, node: _Node) -> int:
    assert path is not None
    for i, n in enumerate(path):
        if n is node:
            return i
    raise AssertionError("node not on the slot's path")
