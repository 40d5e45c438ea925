"""The rule of ``set_input_kq_mask_impl`` (src/llama-kv-cache.cpp), in Python: which KV cell each
query row of a ubatch may see, decided from the cells' metadata alone, and the check of a captured
KQ mask against it, entry by entry. Pure functions of numpy arrays: no model, no context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# what decides an entry, in the order set_input_kq_mask_impl tests it
KEEP, EMPTY, PADDING, OTHER_SEQ, FUTURE, WINDOW = range(6)
RULES = ("keep", "empty", "padding", "other sequence", "future", "window")
GRID_CHARS = "#.-sfw"  # one per rule; a mismatch is X (engine keeps, rule masks) or ! (the reverse)
SWA_TYPES = ("none", "standard", "chunked", "symmetric")  # llama_swa_type


@dataclasses.dataclass
class KVCells:
    """One stream of one KV cache, as ``llama_kv_cells`` holds it: a position (-1: empty) and a
    set of sequence ids per cell.

    Attributes:
        pos: Position of each cell, -1 for an empty one.
        seqs: The sequence ids of each cell.
    """

    pos: np.ndarray
    seqs: list[frozenset[int]]

    @classmethod
    def empty(cls, size: int) -> KVCells:
        """A stream of ``size`` empty cells.

        Args:
            size: Cells in the stream (``llama_kv_cache::get_size``).

        Returns:
            The stream.
        """
        return cls(np.full(size, -1, np.int64), [frozenset()] * size)

    @classmethod
    def of(cls, cells: Sequence[tuple[int, Sequence[int]]], size: int | None = None) -> KVCells:
        """A stream whose cells 0, 1, ... hold these ``(pos, seq_ids)``, the rest empty.

        Args:
            cells: ``(pos, seq_ids)`` of each cell from index 0.
            size: Cells in the stream; None: as many as given.

        Returns:
            The stream.

        Raises:
            ValueError: More cells than ``size``.
        """
        n = len(cells) if size is None else size
        if len(cells) > n:
            raise ValueError(f"{len(cells)} cells do not fit a stream of {n}")
        out = cls.empty(n)
        for i, (p, s) in enumerate(cells):
            out.pos[i] = p
            out.seqs[i] = frozenset(int(x) for x in s)
        return out

    def copy(self) -> KVCells:
        """An independent copy.

        Returns:
            The copy.
        """
        return KVCells(self.pos.copy(), list(self.seqs))

    @property
    def used_max_p1(self) -> int:
        """One past the last non-empty cell (``llama_kv_cells::used_max_p1``)."""
        nz = np.flatnonzero(self.pos >= 0)
        return int(nz[-1]) + 1 if nz.size else 0

    def write(self, idx: int, pos: int, seq_ids: Sequence[int]) -> bool:
        """Put a row of a ubatch into cell ``idx`` (``llama_kv_cache::apply_ubatch``: a cell in use
        is emptied first).

        Args:
            idx: The cell.
            pos: The row's position.
            seq_ids: Every sequence id of the row.

        Returns:
            Whether the cell was in use before.
        """
        was = bool(self.pos[idx] >= 0)
        self.pos[idx] = pos
        self.seqs[idx] = frozenset(int(s) for s in seq_ids)
        return was


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One mask entry that differs from the rule.

    Attributes:
        stream: The mask's stream (its numpy axis 0).
        row: The query row in the ubatch (``s * n_tps + ii``).
        cell: The column (KV cell).
        got: The entry llama.cpp wrote.
        want: What the rule gives (0.0 or -inf).
        rule: Why (one of :data:`RULES`).
    """

    stream: int
    row: int
    cell: int
    got: float
    want: float
    rule: str

    def to_dict(self) -> dict:
        """As plain data (``got``/``want`` as strings: JSON has no -inf).

        Returns:
            The fields.
        """
        return {
            "stream": self.stream,
            "row": self.row,
            "cell": self.cell,
            "got": str(self.got),
            "want": str(self.want),
            "rule": self.rule,
        }


def is_masked_swa(n_swa: int, swa_type: str, p0: np.ndarray, p1: int) -> np.ndarray:
    """``llama_hparams::is_masked_swa`` over an array of cell positions.

    Args:
        n_swa: The window (``hparams.n_swa``).
        swa_type: One of :data:`SWA_TYPES`.
        p0: The cells' positions.
        p1: The query's position.

    Returns:
        A bool array: the cell is outside the window.

    Raises:
        ValueError: An unknown ``swa_type``.
    """
    p0 = np.asarray(p0, np.int64)
    if swa_type == "none":
        return np.zeros(p0.shape, bool)
    if swa_type == "standard":
        return p1 - p0 >= n_swa
    if swa_type == "chunked":
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == "symmetric":
        d = p1 - p0
        half = n_swa // 2
        return (d < -half) | (d > half)
    raise ValueError(f"swa_type must be one of {', '.join(SWA_TYPES)}, got {swa_type!r}")


def engine_seq_order(seq_ids: Sequence[int]) -> tuple[int, ...]:
    """A row's seq ids in the order llama.cpp's ubatch holds them (``ubatch->seq_id[i]``), whose
    first is the one its KQ mask row is built for.

    At this pin ``llama_batch_compat`` copies each row's ids into a ``std::unordered_set`` of a
    ``llama_batch_ext`` token (src/llama-batch.h) in the caller's order, and the ubatch takes them in
    that set's iteration order. This is libstdc++'s (g++ builds the library): the hash of an id is
    the id, the first insert makes 13 buckets (29 at the 14th), and a node goes to the front of the
    list when its bucket is empty, else to the front of its bucket's run (``_M_insert_bucket_begin``;
    a rehash relinks the nodes in list order the same way). So ``(0, 1)`` iterates as ``(1, 0)``.

    Args:
        seq_ids: The row's seq ids as the caller gave them (``llama_batch.seq_id[i]``).

    Returns:
        The ids in iteration order.

    Raises:
        ValueError: More than 29 ids (a later rehash is not modelled here).
    """
    ids = [int(x) for x in dict.fromkeys(int(x) for x in seq_ids)]
    if len(ids) > 29:
        raise ValueError(f"{len(ids)} seq ids in one row: the unordered_set order is modelled up to 29")

    def place(order: list[int], x: int, n_bkt: int) -> None:
        same = [k for k, y in enumerate(order) if y % n_bkt == x % n_bkt]
        order.insert(same[0] if same else 0, x)

    order: list[int] = []
    n_bkt = 13
    for n, x in enumerate(ids):
        if n == 13:  # _M_need_rehash: 14 elements > 13 buckets -> _M_next_bkt(26) = 29
            n_bkt, old, order = 29, order, []
            for y in old:
                place(order, y, n_bkt)
        place(order, x, n_bkt)
    return tuple(order)


def mask_rule(
    cells: Sequence[KVCells],
    pos: Sequence[int],
    seq_ids: Sequence[Sequence[int]],
    n_kv: int,
    n_stream: int,
    *,
    unified: bool,
    n_swa: int = 0,
    swa_type: str = "none",
    causal: bool = True,
) -> np.ndarray:
    """What decides each entry of a KQ mask, as ``set_input_kq_mask_impl`` computes it.

    Args:
        cells: The KV cache's streams, after the ubatch's own rows were written.
        pos: Each row's position, in ubatch order.
        seq_ids: Each row's sequence ids (the first is the one the mask uses).
        n_kv: The mask's columns.
        n_stream: The mask's streams (``ne[3]``).
        unified: One KV stream for every sequence (else sequence s reads stream s).
        n_swa: The sliding window (with ``swa_type``).
        swa_type: One of :data:`SWA_TYPES` (``"none"``: no window).
        causal: Mask cells after the row's position.

    Returns:
        An int8 array (n_stream, n_tokens / n_stream, n_kv) of rule indices (:data:`RULES`;
        ``KEEP`` is 0).

    Raises:
        ValueError: The rows do not split into ``n_stream`` equal parts, or a row's first
            sequence has no stream.
    """
    n_tokens = len(pos)
    if n_stream <= 0 or n_tokens % n_stream or len(seq_ids) != n_tokens:
        raise ValueError(f"{n_tokens} rows ({len(seq_ids)} seq id lists) do not make {n_stream} equal streams")
    n_tps = n_tokens // n_stream
    out = np.empty((n_stream, n_tps, n_kv), np.int8)
    col = np.arange(n_kv)
    views: dict[int, tuple[np.ndarray, int]] = {}
    members: dict[tuple[int, int], np.ndarray] = {}
    for i in range(n_tokens):
        s, ii = divmod(i, n_tps)
        first = int(seq_ids[i][0])
        strm = 0 if unified else first
        if not 0 <= strm < len(cells):
            raise ValueError(f"row {i}: sequence {first} has no stream (the cache has {len(cells)})")
        if strm not in views:
            c = cells[strm]
            p = np.full(n_kv, -1, np.int64)
            k = min(n_kv, c.pos.size)
            p[:k] = c.pos[:k]
            views[strm] = (p, c.used_max_p1)
        p, used = views[strm]
        if (strm, first) not in members:
            c = cells[strm]
            members[(strm, first)] = np.array(
                [j < len(c.seqs) and first in c.seqs[j] for j in range(n_kv)], bool
            ).reshape(n_kv)
        member = members[(strm, first)]
        p1 = int(pos[i])
        r = np.full(n_kv, KEEP, np.int8)
        filled = p >= 0
        if swa_type != "none":
            r[filled & is_masked_swa(n_swa, swa_type, p, p1)] = WINDOW
        if causal:
            r[filled & (p > p1)] = FUTURE
        r[filled & ~member] = OTHER_SEQ
        r[~filled] = EMPTY
        r[~filled & (col >= used)] = PADDING
        out[s, ii] = r
    return out


def as_streams(mask: np.ndarray, n_stream: int | None = None) -> np.ndarray:
    """A captured mask as (n_stream, n_tps, n_kv): numpy order of ``[n_kv, n_tps, 1, n_stream]``.

    Args:
        mask: (n_tps, n_kv), (n_stream, n_tps, n_kv) or (n_stream, 1, n_tps, n_kv).
        n_stream: Streams, to split a 2-D mask of several (None: 1 for a 2-D mask).

    Returns:
        A view with three axes.

    Raises:
        ValueError: Another shape.
    """
    m = np.asarray(mask)
    if m.ndim == 4 and m.shape[1] == 1:
        return m[:, 0]
    if m.ndim == 3:
        return m
    if m.ndim == 2:
        k = n_stream or 1
        return m.reshape(k, m.shape[0] // k, m.shape[1])
    raise ValueError(f"a KQ mask is (n_tps, n_kv) or (n_stream, 1, n_tps, n_kv), got shape {m.shape}")


def check_mask(
    mask: np.ndarray,
    cells: Sequence[KVCells],
    pos: Sequence[int],
    seq_ids: Sequence[Sequence[int]],
    *,
    unified: bool,
    n_swa: int = 0,
    swa_type: str = "none",
    causal: bool = True,
) -> tuple[list[Mismatch], np.ndarray]:
    """Every entry of a KQ mask against the rule of ``set_input_kq_mask_impl``: 0 where the cell is
    visible, -inf elsewhere. A pure function of the mask and the cells' metadata.

    Args:
        mask: The mask as captured (any shape :func:`as_streams` takes; f32 or f16).
        cells: The KV cache's streams after the ubatch's rows were written (:class:`KVCells`).
        pos: Each row's position, in ubatch order.
        seq_ids: Each row's sequence ids.
        unified: One KV stream for every sequence.
        n_swa: The sliding window.
        swa_type: One of :data:`SWA_TYPES`.
        causal: Causal attention.

    Returns:
        The mismatches, and the rule array (:func:`mask_rule`).

    Raises:
        ValueError: Rows that do not fit the mask's shape.
    """
    m = as_streams(mask)
    n_stream, n_tps, n_kv = m.shape
    if n_stream * n_tps != len(pos):
        raise ValueError(f"the mask has {n_stream} x {n_tps} rows, the ubatch {len(pos)}")
    rule = mask_rule(
        cells, pos, seq_ids, n_kv, n_stream, unified=unified, n_swa=n_swa, swa_type=swa_type, causal=causal
    )
    got = m.astype(np.float32)
    keep = rule == KEEP
    bad = np.argwhere((keep & (got != 0)) | (~keep & ~np.isneginf(got)))
    out = []
    for s, ii, j in bad.tolist():
        want = 0.0 if keep[s, ii, j] else float("-inf")
        out.append(Mismatch(s, s * n_tps + ii, j, float(got[s, ii, j]), want, RULES[int(rule[s, ii, j])]))
    return out, rule


def _seqs(ids: Sequence[int], short: bool = False) -> str:
    """Sequence ids as the report writes them: ``0+1``; ``short``: ``01`` (one column of a grid)."""
    if short and all(0 <= s < 10 for s in ids):
        return "".join(str(s) for s in ids)  # a cell's set: digits, in one column
    return "+".join(str(s) for s in ids)
