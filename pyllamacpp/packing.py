"""The packing core: one way to turn work into ``llama_batch`` work orders.

A *segment* is a run of consecutive positions of one or more sequences: token ids (or embedding
rows), the seq ids every slot carries (several: a shared prefix, each token stored once in every
listed sequence), the position of the first, and which slots ask for an output row. Segments go
in, in order; :func:`plan` cuts them into work orders of at most ``n_batch`` slots and at most
``n_outputs_max`` output rows, keeping their order (a segment that does not fit in what is left of
an order goes on in the next one); :func:`decode` fills a :class:`~pyllamacpp.Batch` per order,
calls ``llama_decode`` and yields the order, whose :class:`Piece` s map every output row back to
its segment and offset. An online loop that decides what goes into each batch as it goes (the
scheduler, the evaluation walk, speculative verification) fills a :class:`WorkOrder` itself with
:meth:`WorkOrder.add` and reads the same pieces back.

Beside it, the primitives the prefix-sharing loops share: :func:`common_prefix` (the longest
common prefix of token arrays), :func:`model_and_context` (a Model or a Context, resolved once)
and :func:`fork` (a prefix's cells given to other sequences).

The output rows of a decode are in slot order (``llama_get_logits`` after llama.cpp put them back
in batch order), so a piece's rows are one slice: ``ctx.logits_all()[piece.rows]``, the outputs of
the segment's tokens at offsets ``piece.at``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .batch import Batch

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

__all__ = [
    "Segment",
    "Piece",
    "WorkOrder",
    "plan",
    "decode",
    "common_prefix",
    "model_and_context",
    "release",
    "fork",
]

_WORDS = ("none", "last", "all")


class Segment:
    """Consecutive positions of one or more sequences, and which of them ask for an output row.

    Args:
        tokens: The token ids (1-D), or None with ``embd``.
        seq_ids: One seq id, or several (every slot of the segment carries all of them).
        pos: The position of the first token.
        outputs: ``"none"``, ``"last"``, ``"all"`` or a boolean mask of ``len(tokens)``: which slots
            ask for an output (``llama_batch.logits``).
        embd: Embedding rows ``(n, n_embd)`` instead of tokens (an embedding batch).
        tag: Anything of the caller's, carried to each :class:`Piece` cut from the segment.

    Raises:
        ValueError: No tokens, both or neither of ``tokens`` and ``embd``, or ``outputs`` neither a
            word nor a mask of the segment's length.
    """

    __slots__ = ("tokens", "embd", "seq_ids", "pos", "outputs", "tag", "n", "_cum")

    def __init__(
        self,
        tokens: npt.ArrayLike | None = None,
        seq_ids: int | Sequence[int] | np.ndarray = 0,
        pos: int = 0,
        outputs: str | npt.ArrayLike = "last",
        *,
        embd: npt.ArrayLike | None = None,
        tag: Any = None,
    ) -> None:
        if (tokens is None) == (embd is None):
            raise ValueError("a segment holds tokens or embeddings: give exactly one of tokens and embd")
        if tokens is not None:
            t = np.asarray(tokens)
            self.tokens: np.ndarray | None = t.reshape(-1) if t.ndim != 1 else t
            self.embd: np.ndarray | None = None
            n = int(self.tokens.size)
        else:
            e = np.asarray(embd, dtype=np.float32)
            if e.ndim != 2:
                raise ValueError(f"embd must be 2-D (n_tokens, n_embd), got shape {e.shape}")
            self.tokens, self.embd = None, e
            n = int(e.shape[0])
        if n == 0:
            raise ValueError("a segment needs at least one token")
        self.n = n
        self.seq_ids = seq_ids
        self.pos = operator.index(pos)
        self.tag = tag
        self._cum: np.ndarray | None = None
        if isinstance(outputs, str):
            if outputs not in _WORDS:
                raise ValueError(f"outputs must be 'none', 'last', 'all' or a mask, got {outputs!r}")
            self.outputs: str | np.ndarray = outputs
        else:
            mask = np.asarray(outputs, dtype=bool)
            if mask.shape != (n,):
                raise ValueError(f"the outputs mask has shape {mask.shape}, expected ({n},)")
            self.outputs = mask

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        what = "embd" if self.embd is not None else "tokens"
        out = self.outputs if isinstance(self.outputs, str) else f"mask of {int(self.outputs.sum())}"
        return f"Segment({self.n} {what}, seq_ids={self.seq_ids}, pos={self.pos}, outputs={out})"

    def n_outputs(self, lo: int = 0, hi: int | None = None) -> int:
        """How many of the slots ``[lo, hi)`` ask for an output.

        Args:
            lo: The first slot (an offset from the segment's first token).
            hi: One past the last (None: the segment's end).

        Returns:
            The number of output rows those slots ask for.
        """
        hi = self.n if hi is None else hi
        o = self.outputs
        if isinstance(o, str):
            if o == "none":
                return 0
            return hi - lo if o == "all" else int(hi == self.n and hi > lo)
        cum = self._cumsum()
        return int(cum[hi] - cum[lo])

    def _cumsum(self) -> np.ndarray:
        if self._cum is None:
            assert isinstance(self.outputs, np.ndarray)
            self._cum = np.concatenate([[0], np.cumsum(self.outputs, dtype=np.int64)])
        return self._cum

    def _fit_outputs(self, lo: int, take: int, room: int) -> int:
        """The most slots from ``lo`` (at most ``take``) whose outputs fit in ``room`` rows."""
        if self.n_outputs(lo, lo + take) <= room:
            return take
        o = self.outputs
        if isinstance(o, str):  # "all" (one row a slot) or "last" (its one row needs room 1)
            return room if o == "all" else take - 1
        cum = self._cumsum()
        # the last slot index whose running count stays within room: searchsorted on the counts
        return int(np.searchsorted(cum, cum[lo] + room, side="right")) - 1 - lo

    def _flags(self, lo: int, hi: int) -> str | np.ndarray:
        o = self.outputs
        if isinstance(o, str):
            if o == "last" and hi != self.n:
                return "none"
            return o
        return o[lo:hi]


class Piece:
    """The slots ``[lo, hi)`` of one segment, as placed in a work order.

    Attributes:
        segment: The segment's index in the list given to :func:`plan` / :func:`decode` (for
            :meth:`WorkOrder.add`: the order in which pieces were added).
        tag: The segment's ``tag``.
        lo, hi: The segment's slots this piece holds (offsets from the segment's first token).
        pos: The position of slot ``lo``.
        slots: The batch slots it fills (a slice).
        rows: Its output rows in the decode's outputs (a slice of ``ctx.logits_all()``).

    Args:
        segment: Its ``segment``.
        tag: Its ``tag``.
        lo: Its ``lo``.
        hi: Its ``hi``.
        pos: Its ``pos``.
        slots: Its ``slots``.
        rows: Its ``rows``.
        flags: What the slots ask for: ``"none"``, ``"last"``, ``"all"`` or a boolean mask of them.
    """

    __slots__ = ("segment", "tag", "lo", "hi", "pos", "slots", "rows", "_flags")

    def __init__(
        self, segment: int, tag: Any, lo: int, hi: int, pos: int, slots: slice, rows: slice, flags: str | np.ndarray
    ) -> None:
        self.segment, self.tag, self.lo, self.hi, self.pos = segment, tag, lo, hi, pos
        self.slots, self.rows, self._flags = slots, rows, flags

    def __len__(self) -> int:
        return self.hi - self.lo

    @property
    def n_outputs(self) -> int:
        """How many output rows the piece has."""
        return self.rows.stop - self.rows.start

    @property
    def at(self) -> np.ndarray:
        """The offsets (from the segment's first token) of the slots with an output, one per row."""
        f = self._flags
        if isinstance(f, str):
            if f == "all":
                return np.arange(self.lo, self.hi)
            return np.array([self.hi - 1] if f == "last" else [], dtype=np.intp)
        return self.lo + np.flatnonzero(f)

    def __repr__(self) -> str:
        return (
            f"Piece(segment={self.segment}, [{self.lo}, {self.hi}), pos={self.pos}, "
            f"slots={self.slots.start}:{self.slots.stop}, rows={self.rows.start}:{self.rows.stop})"
        )


class WorkOrder:
    """One ``llama_batch`` being filled: its pieces, the room left, and after the decode the rows.

    The builder under :func:`decode`, and what an online loop (one that decides each batch as it
    goes) fills itself: :meth:`add` a segment's slots, :meth:`join` a sequence to slots already
    added (a shared prefix), :meth:`decode`, then read each piece's ``rows``.

    Args:
        batch: The batch it fills (cleared first). A token batch, or an embedding one for
            ``embd`` segments; its ``n_seq_max`` bounds the seq ids one slot may carry.
        n_outputs_max: The most output rows the order may ask for (None: no bound but the
            batch's capacity).
    """

    __slots__ = ("batch", "pieces", "n_outputs_max", "_rows", "_raw")

    def __init__(self, batch: Batch, n_outputs_max: int | None = None) -> None:
        self.batch = batch
        self.pieces: list[Piece] = []
        self.n_outputs_max = n_outputs_max
        self._rows = 0
        p = batch._p
        # the C arrays for add_trusted, looked up once (the batch's views keep them alive)
        self._raw = None if batch.n_embd else (p, p.token, p.pos, p.n_seq_id, p.seq_id, p.logits, batch.capacity)
        batch.clear()

    def clear(self) -> None:
        """Empty the order (and its batch) for the next one."""
        self.batch.clear()
        self.pieces.clear()
        self._rows = 0

    def __len__(self) -> int:
        return len(self.batch)

    @property
    def room(self) -> int:
        """Slots left."""
        return self.batch.capacity - len(self.batch)

    @property
    def n_outputs(self) -> int:
        """Output rows asked so far."""
        return self._rows

    def add(
        self,
        tokens: npt.ArrayLike,
        seq_ids: int | Sequence[int] | np.ndarray = 0,
        pos: int = 0,
        outputs: str | npt.ArrayLike = "last",
        *,
        tag: Any = None,
        segment: int | None = None,
        lo: int = 0,
    ) -> Piece:
        """Add token slots at ``pos, pos + 1, ...`` for ``seq_ids`` (``Batch.add_sequence``).

        Args:
            tokens: The token ids.
            seq_ids: One seq id or several.
            pos: The position of the first.
            outputs: ``"none"``, ``"last"``, ``"all"`` or a mask: which slots ask for an output.
            tag: Carried to the piece.
            segment: The piece's ``segment`` (default: how many pieces came before it).
            lo: The piece's ``lo`` (its first slot's offset in a longer segment).

        Returns:
            The piece.

        Raises:
            ValueError: No room, more output rows than ``n_outputs_max``, or what
                ``Batch.add_sequence`` refuses.
        """
        sl = self.batch.add_sequence(tokens, seq_ids, pos, outputs)
        return self._placed(sl, outputs, tag, segment, lo, pos)

    def add_embd(
        self,
        embd: npt.ArrayLike,
        seq_ids: int | Sequence[int] | np.ndarray = 0,
        pos: int = 0,
        outputs: str | npt.ArrayLike = "last",
        *,
        tag: Any = None,
        segment: int | None = None,
        lo: int = 0,
    ) -> Piece:
        """Add embedding rows ``(n, n_embd)`` as slots at ``pos, pos + 1, ...`` (``Batch.add_embd``).

        Args:
            embd: The rows, ``(n, n_embd)``.
            seq_ids: One seq id or several.
            pos: The position of the first.
            outputs: ``"none"``, ``"last"``, ``"all"`` or a mask: which slots ask for an output.
            tag: Carried to the piece.
            segment: The piece's ``segment`` (default: how many pieces came before it).
            lo: The piece's ``lo``.

        Returns:
            The piece.

        Raises:
            ValueError: No room, more output rows than ``n_outputs_max``, or what
                ``Batch.add_embd`` refuses.
        """
        e = np.asarray(embd, dtype=np.float32)
        n = int(e.shape[0])
        flags = _mask_of(outputs, n)
        i0 = len(self.batch)
        if n > self.room:
            raise ValueError(f"batch capacity exceeded: {i0} + {n} slots > capacity {self.batch.capacity}")
        for j in range(n):
            self.batch.add_embd(e[j], pos + j, seq_ids, bool(flags[j]))
        return self._placed(slice(i0, i0 + n), outputs, tag, segment, lo, pos)

    def add_token(self, token: int, pos: int, seq_id: int, output: bool) -> int:
        """One slot of one sequence, for the per-token path of a generation loop (``Batch.add``'s
        fast path: plain ints, no piece).

        Args:
            token: The token id.
            pos: Its position.
            seq_id: Its sequence.
            output: Whether it asks for an output.

        Returns:
            The slot, which is also its output row when every slot before it asked for an output."""
        i = self.batch._add_one(token, pos, seq_id, output)
        if output:
            self._rows += 1
        return i

    def add_trusted(self, tokens: Sequence[int], pos: int, seq_id: int, output: bool) -> int:
        """Slots ``pos, pos + 1, ...`` of one sequence, every one with an output or none, written
        straight into the C arrays: the per-token path of a loop whose tokens are known good (sampled
        by llama.cpp, or checked once when they came in) and whose seq id is the context's.

        Only the room is checked (a write past the capacity would overrun the C arrays); a token
        outside the vocabulary or a seq id past the context's ``n_seq_max`` is left to
        ``llama_decode``'s own batch check. No piece: the first slot is returned, and the slots of
        the run follow it (also its output rows when every slot before it asked for one).

        Args:
            tokens: The token ids, plain ints (``len(tokens)`` slots; none is allowed).
            pos: The position of the first.
            seq_id: The one sequence of every slot.
            output: Whether every slot asks for an output (``llama_batch.logits``).

        Returns:
            The first slot's index.

        Raises:
            ValueError: Not enough room left in the batch.
            TypeError: An embedding batch.
        """
        raw = self._raw
        if raw is None:
            raise TypeError("an embedding batch takes add_embd(), not add_trusted()")
        p, token, bpos, n_seq_id, seq, logits, cap = raw
        i0 = i = p.n_tokens
        n = len(tokens)
        if i + n > cap:
            raise ValueError(f"batch capacity exceeded: {i} + {n} slots > capacity {cap}")
        o = 1 if output else 0
        for t in tokens:
            token[i] = t
            bpos[i] = pos
            n_seq_id[i] = 1
            seq[i][0] = seq_id
            logits[i] = o
            i += 1
            pos += 1
        p.n_tokens = i
        if o:
            self._rows += n
        return i0

    def _placed(self, sl: slice, outputs, tag, segment, lo: int, pos: int) -> Piece:
        n = sl.stop - sl.start
        if isinstance(outputs, str):
            k = n if outputs == "all" else int(outputs == "last")
            flags: str | np.ndarray = outputs
        else:
            flags = np.asarray(outputs, dtype=bool)
            k = int(np.count_nonzero(flags))
        if self.n_outputs_max is not None and self._rows + k > self.n_outputs_max:
            self.batch._p.n_tokens = sl.start  # take the slots back: nothing half-added stays
            raise ValueError(
                f"the work order would ask for {self._rows + k} output rows, more than its n_outputs_max "
                f"{self.n_outputs_max}"
            )
        rows = slice(self._rows, self._rows + k)
        self._rows += k
        p = Piece(len(self.pieces) if segment is None else segment, tag, lo, lo + n, pos, sl, rows, flags)
        self.pieces.append(p)
        return p

    def join(self, piece: Piece, seq_id: int) -> None:
        """Put ``piece``'s slots in one more sequence (the tokens are stored once, in each).

        Args:
            piece: A piece of this order.
            seq_id: The sequence its slots join.

        Raises:
            ValueError: The slots already carry as many seq ids as the batch's ``n_seq_max``, or
                already carry ``seq_id``.
        """
        b = self.batch
        sl = piece.slots
        k = int(b.n_seq_id[sl.start])
        if k >= b.n_seq_max:
            raise ValueError(f"the slots carry {k} seq ids already, the batch's n_seq_max")
        if seq_id in b.seq_id[sl.start, :k]:
            raise ValueError(f"the slots carry seq id {seq_id} already")
        b.seq_id[sl, k] = seq_id
        b.n_seq_id[sl] = k + 1

    def decode(self, ctx: Context) -> None:
        """``ctx.decode(batch)``: afterwards each piece's ``rows`` index ``ctx.logits_all()``.

        Args:
            ctx: The context (errors as :meth:`Context.decode <pyllamacpp.Context.decode>` raises them).
        """
        ctx.decode(self.batch)


def _mask_of(outputs, n: int) -> np.ndarray:
    if isinstance(outputs, str):
        m = np.zeros(n, bool)
        if outputs == "all":
            m[:] = True
        elif outputs == "last":
            m[-1] = True
        return m
    return np.asarray(outputs, dtype=bool)


def plan(
    segments: Sequence[Segment], n_batch: int, n_outputs_max: int | None = None
) -> list[list[tuple[int, int, int]]]:
    """Cut ``segments``, in order, into work orders of at most ``n_batch`` slots and
    ``n_outputs_max`` output rows.

    An order is filled before the next starts; a segment longer than the room left goes on in the
    next order (the way llama.cpp's own tools cut a long prompt: 5,000 tokens at n_batch 2,048 are
    2,048, 2,048 and 904).

    Args:
        segments: The segments, in order.
        n_batch: The most slots an order holds.
        n_outputs_max: The most output rows an order asks for (None: no bound).

    Returns:
        One list per order of ``(segment index, lo, hi)``: the segment's slots ``[lo, hi)``.

    Raises:
        ValueError: ``n_batch`` < 1 or ``n_outputs_max`` < 1.
    """
    if n_batch < 1:
        raise ValueError(f"n_batch must be at least 1, not {n_batch}")
    if n_outputs_max is not None and n_outputs_max < 1:
        raise ValueError(f"n_outputs_max must be at least 1, not {n_outputs_max}")
    orders: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room, out_room = n_batch, n_outputs_max
    for i, seg in enumerate(segments):
        lo, n = 0, seg.n
        while lo < n:
            take = min(room, n - lo)
            if out_room is not None:
                take = seg._fit_outputs(lo, take, out_room)
            if take <= 0:
                orders.append(cur)
                cur, room, out_room = [], n_batch, n_outputs_max
                continue
            cur.append((i, lo, lo + take))
            room -= take
            if out_room is not None:
                out_room -= seg.n_outputs(lo, lo + take)
            lo += take
            if room == 0:
                orders.append(cur)
                cur, room, out_room = [], n_batch, n_outputs_max
    if cur:
        orders.append(cur)
    return orders


def decode(
    ctx: Context,
    segments: Iterable[Segment],
    *,
    batch: Batch | None = None,
    n_batch: int | None = None,
) -> Iterator[WorkOrder]:
    """Decode ``segments`` in work orders (:func:`plan`), yielding each order after its decode.

    Read each order's outputs before taking the next: the views of one decode are overwritten by
    the following one. ``for order in decode(ctx, segs): ...`` with
    ``ctx.logits_all()[piece.rows]`` for ``piece in order.pieces``.

    Args:
        ctx: The context.
        segments: The segments, in order.
        batch: The batch to fill (its capacity at least ``n_batch``; wide enough for the most seq
            ids a segment carries); default: a new one.
        n_batch: Slots per order (default and at most ``ctx.n_batch``).

    Yields:
        Each :class:`WorkOrder`, decoded.

    Raises:
        ValueError: A segment that does not fit the batch or the context (see
            :meth:`WorkOrder.add`).
        KVCacheFullError, DecodeAborted, DecodeInterrupted, DecodeError: from ``llama_decode``;
            the orders before the failing one stay in memory.
    """
    segs = list(segments)
    cap = ctx.n_batch if n_batch is None else min(int(n_batch), ctx.n_batch)
    orders = plan(segs, cap, ctx._n_outputs_max if not ctx._all_rows_out else None)
    if batch is None:
        width = max((1 if np.isscalar(s.seq_ids) else len(s.seq_ids)) for s in segs) if segs else 1  # type: ignore[arg-type]
        embd = segs[0].embd.shape[1] if segs and segs[0].embd is not None else 0
        batch = Batch(cap, width, embd, model=ctx.model if not embd else None)
    elif batch.capacity < cap:
        raise ValueError(f"the batch holds {batch.capacity} slots, fewer than the n_batch {cap} asked")
    wo = WorkOrder(batch)
    for order in orders:
        wo.clear()
        for i, lo, hi in order:
            s = segs[i]
            flags = s._flags(lo, hi)
            if s.tokens is not None:
                wo.add(s.tokens[lo:hi], s.seq_ids, s.pos + lo, flags, tag=s.tag, segment=i, lo=lo)
            else:
                assert s.embd is not None
                wo.add_embd(s.embd[lo:hi], s.seq_ids, s.pos + lo, flags, tag=s.tag, segment=i, lo=lo)
        wo.decode(ctx)
        yield wo


def common_prefix(a: npt.ArrayLike, *others: npt.ArrayLike) -> int:
    """The length of the longest common prefix of token arrays (0 when one is empty).

    ``common_prefix(a, b)`` for two, ``common_prefix(*seqs)`` for any number: vectorized, one
    comparison per array.

    Args:
        a: Token ids.
        *others: More token arrays.

    Returns:
        How many first tokens all of them share.
    """
    x = np.asarray(a).reshape(-1)
    n = x.size
    for b in others:
        y = np.asarray(b).reshape(-1)
        n = min(n, y.size)
        if n == 0:
            return 0
        d = np.flatnonzero(x[:n] != y[:n])
        if d.size:
            n = int(d[0])
    return int(n)


def model_and_context(model_or_ctx: Model | Context) -> tuple[Model, Context | None]:
    """``(model, ctx)`` for a Context, ``(model, None)`` for a Model: the one place that tells
    which of the two a function that takes either was given.

    Args:
        model_or_ctx: A Model or a Context.

    Returns:
        The model, and the context or None.

    Raises:
        TypeError: Neither a Model nor a Context.
    """
    from .context import Context
    from .model import Model

    if isinstance(model_or_ctx, Context):
        return model_or_ctx.model, model_or_ctx
    if isinstance(model_or_ctx, Model):
        return model_or_ctx, None
    raise TypeError(f"expected a Model or a Context, not {type(model_or_ctx).__name__}")


def release(ctx: Context, own: bool) -> None:
    """The end of a run over a context's whole memory (scoring, evaluation), done or not: a context
    the run made for itself (``own``) is closed; a caller's stays open, its memory cleared, as it
    was cleared before the run began (cells of the run's last batch left there would make the
    caller's next decode of those sequences start past their position 0).

    Args:
        ctx: The context the run used.
        own: Whether the run made it (from a Model) rather than being given it.
    """
    if own:
        ctx.close()
    elif not ctx.closed:
        ctx.memory.clear()


def fork(ctx: Context, src: int, dsts: Iterable[int], p0: int = -1, p1: int = -1) -> None:
    """Give positions ``[p0, p1)`` of sequence ``src`` to each of ``dsts`` (``llama_memory_seq_cp``).

    With a unified cache the cells are shared, not copied (each cell lists every sequence that
    holds it). With one stream per sequence (``kv_unified=False``) llama.cpp copies whole streams at
    the start of the next decode, so only the whole sequence can be given (a partial range there is
    refused, as :meth:`Memory.seq_cp <pyllamacpp.Memory.seq_cp>` refuses it).

    Args:
        ctx: The context.
        src: The sequence that holds the cells.
        dsts: The sequences given them.
        p0: The first position (negative: from 0).
        p1: One past the last (negative: to the end).

    Raises:
        ValueError: A seq id outside ``[0, n_seq_max)``, ``src`` among ``dsts``, or a partial range
            between streams.
    """
    targets = [operator.index(d) for d in dsts]
    if src in targets:
        raise ValueError(f"fork: sequence {src} is both the source and a destination")
    mem = ctx.memory
    for d in targets:
        mem.seq_cp(src, d, p0, p1)
