"""``pyllamacpp mask``: the KQ mask llama.cpp built for each ubatch, shown, and checked entry by entry.

Decodes a batch you describe (``--tokens``, ``--seqs``, ``--past``, ``--layout`` as for split-plan;
``--shared N``: N tokens cached once and shared by every sequence, by ``llama_memory_seq_cp``;
``--couple``: each row also carries the other sequences' ids, after its own) with graph taps on the
inputs ``attn_inp_kq_mask`` (``[n_kv, n_tokens/n_stream, 1, n_stream]``; numpy: (n_stream, 1,
n_tokens/n_stream, n_kv)) and ``attn_inp_k_idxs`` (the cell each row of the ubatch is written to),
and shows which query row may see which cell: a text grid for small cases, a figure with ``-o``.

Every entry is then recomputed in Python, as ``set_input_kq_mask_impl`` (src/llama-kv-cache.cpp)
decides it, from the cells' metadata: the positions and sequence sets of the cells before the
decode, read from a whole-context state dump (``llama_state_get_data``, parsed by
``pyllamacpp.state``), plus the cells each ubatch writes (its rows, at the cells
``attn_inp_k_idxs`` names). A cell is visible to query row i (``0``) unless, in this order: it is
empty (the columns past the cells in use, up to n_kv, are such padding); it does not hold the
row's FIRST sequence id (``ubatch->seq_id[i][0]``: a row of several sequences masks against its
first only); its position is after the row's (causal); or it is outside the sliding window
(``llama_hparams::is_masked_swa``, in the SWA cache's mask of an iSWA model). Then ``-inf``. Any
entry that differs is a mismatch (exit 1).

The dump lists a stream's non-empty cells in order without their index (``state_write_meta``),
so cell indices are read as 0, 1, ... per stream: true for the caches this command fills (a fresh
context, filled front to back, no holes); a ubatch written over a cell that is not empty by that
reading is reported. ALiBi (a keep entry is ``-|p0 - p1|``), M-RoPE positions and non-causal
attention are not modelled.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .common import add_model_flags, context_kwargs, load_model, progress, prompt_tokens, subcommand
from .ubatch_plan import N_PAD, PlanError, add_plan_flags, layout_rows, pad, per_seq, shape_from_args

if TYPE_CHECKING:
    from ..model import Model

# what decides an entry, in the order set_input_kq_mask_impl tests it
KEEP, EMPTY, PADDING, OTHER_SEQ, FUTURE, WINDOW = range(6)
RULES = ("keep", "empty", "padding", "other sequence", "future", "window")
GRID_CHARS = "#.-sfw"  # one per rule; a mismatch is X (engine keeps, rule masks) or ! (the reverse)
SWA_TYPES = ("none", "standard", "chunked", "symmetric")  # llama_swa_type
# models/<arch>.cpp set hparams.swa_type; the other SWA archs are LLAMA_SWA_TYPE_STANDARD
_ARCH_SWA_TYPE = {"llama4": "chunked", "gemma-embedding": "symmetric", "modern-bert": "symmetric"}
_TEXT_ROWS, _TEXT_COLS = 48, 48  # the text grid is printed up to this size; -o draws any size


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


# -- the run -----------------------------------------------------------------------------------


def _swa_type(model: Model) -> str:
    arch = model.meta("general.architecture") or ""
    return _ARCH_SWA_TYPE.get(arch, "standard")


_LAYER_IN = re.compile(r"[^ ]+-(\d+)(?: |$)|cache_[kv]_l(\d+)")


def _layer_in(name: str) -> int | None:
    """The layer a tensor name says (``Kcur-3 (view)``, ``cache_k_l3 (view) (permuted)``), or None."""
    m = _LAYER_IN.match(name)
    return int(m.group(1) or m.group(2)) if m else None


def _parts_by_first_use(graph, model: Model, leaf: str) -> dict[int, str]:
    """Occurrence of an input leaf -> the cache part (kv, base, swa) it belongs to.

    Leaves of one name are numbered by first use (taps.py), so occurrence k is the k-th distinct
    cache among the nodes that read a leaf of that name, in graph order. A reader's layer is in its
    name (``kq_soft_max-3``) or, for an unnamed one (``FLASH_ATTN_EXT``, the ``SET_ROWS`` into
    ``cache_k_l3``), in its sources' names; the layer's cache from pyllamacpp.state's layer map.
    """
    from ..state import model_facts

    if sum(1 for i in graph.inputs if i.name == leaf) == 1:
        return {0: "kv"}
    layers = model_facts(model).get("layers") or {}
    part_of = {il: p for p, ils in layers.items() for il in ils}
    order: list[str] = []
    for n in graph.nodes:
        if leaf not in n.srcs:
            continue
        il = n.layer
        if il is None:
            il = next((x for x in map(_layer_in, n.srcs) if x is not None), None)
        p = part_of.get(il) if il is not None else None
        if p is None:
            raise ValueError(f"{leaf}: pyllamacpp.state does not say which cache layer {il} of this model uses")
        if p not in order:
            order.append(p)
    return dict(enumerate(order))


def _cache_size(part: str, ctx, model: Model, unified: bool) -> int:
    """Cells per stream of a cache part (``llama_kv_cache::get_size``)."""
    base = int(ctx.n_ctx_seq)
    if part != "swa" or ctx.params.swa_full:
        return base
    # llama_kv_cache_iswa's constructor
    return pad(min(base, model.n_swa * (ctx.n_seq_max if unified else 1) + int(ctx.n_ubatch)), N_PAD)


def _cells_before(state, part: str, n_stream: int, size: int) -> list[KVCells]:
    p = next((q for q in state.parts if q.name == part), None)
    if p is None:
        have = ", ".join(q.name for q in state.parts)
        raise ValueError(f"the state dump has no {part!r} part (it has {have})")
    out = []
    for s in range(n_stream):
        st = next((x for x in p.streams if x.index == s), None)
        if st is None or st.cell_count == 0:
            out.append(KVCells.empty(size))
            continue
        c = st.cells
        rows = [(int(c["pos"][i]), [int(x) for x in c["seq_id"][i] if x >= 0]) for i in range(st.cell_count)]
        out.append(KVCells.of(rows, size))
    return out


def _ranges(keep: np.ndarray) -> list[list[int]]:
    idx = np.flatnonzero(keep)
    if idx.size == 0:
        return []
    cut = np.flatnonzero(np.diff(idx) > 1)
    starts = np.concatenate([[idx[0]], idx[cut + 1]])
    ends = np.concatenate([idx[cut], [idx[-1]]])
    return [[int(a), int(b)] for a, b in zip(starts, ends)]


def _fill(ctx, model: Model, toks: np.ndarray, past: Sequence[int], n_shared: int, n_seqs: int) -> None:
    """The cells before the decode: the shared prefix (sequence 0, copied to the others), then
    each sequence's own past tokens after it."""
    if n_shared:
        ctx.prefill(toks[:n_shared], seq_id=0, start_pos=0)
        for s in range(1, n_seqs):
            ctx.memory.seq_cp(0, s)
    for s, p in enumerate(past):
        if p:
            ctx.prefill(toks[n_shared : n_shared + p], seq_id=s, start_pos=n_shared)


def batch_rows(
    tokens: Sequence[int], past: Sequence[int], *, n_shared: int = 0, layout: str = "seq", couple: bool = False
) -> list[tuple[tuple[int, ...], int, bool]]:
    """The decoded batch's rows: ``(seq_ids, pos, output)`` in batch order.

    Args:
        tokens: Tokens per sequence.
        past: Tokens each sequence has cached after the shared prefix.
        n_shared: The shared prefix's length.
        layout: ``"seq"`` or ``"interleave"`` (split-plan's layouts).
        couple: Each row also carries the other sequences' ids, after its own.

    Returns:
        The rows.

    Raises:
        PlanError: An unknown layout.
    """
    n_seqs = len(tokens)
    out = []
    for s, _t, p, o in layout_rows(list(tokens), [n_shared + x for x in past], layout):
        ids = (s, *[x for x in range(n_seqs) if x != s]) if couple else (s,)
        out.append((ids, p, o))
    return out


def run_mask(
    model: Model,
    tokens: Sequence[int],
    past: Sequence[int],
    *,
    n_shared: int = 0,
    layout: str = "seq",
    couple: bool = False,
    **ctx_kw: Any,
) -> dict:
    """Decode the batch described, capture each ubatch's KQ masks and cell indices, and check
    every entry against the rule (see the module docstring).

    Args:
        model: The :class:`~pyllamacpp.Model`.
        tokens: Tokens per sequence decoded.
        past: Tokens per sequence cached before it (after the shared prefix).
        n_shared: Tokens cached once for every sequence (``seq_cp`` from sequence 0).
        layout: ``"seq"`` or ``"interleave"``.
        couple: Each row also carries the other sequences' ids, after its own.
        **ctx_kw: :class:`~pyllamacpp.Context` keywords.

    Returns:
        ``masks`` (one entry per mask per ubatch: its shape, rows, cells, rule counts, grid,
        mismatches), ``facts``, ``n_mismatches``, ``n_entries``, ``ok`` and the context's settings.

    Raises:
        ValueError: A shape llama.cpp would refuse (``--couple`` with different pasts or separate
            streams), or a model without a KQ mask (recurrent memory).
        DecodeError: llama.cpp refused a decode.
    """
    from ..batch import Batch
    from ..context import Context
    from ..state import parse

    n_seqs = len(tokens)
    past = list(past)
    if len(past) != n_seqs:
        raise ValueError(f"--past: {len(past)} values for {n_seqs} sequences")
    ctx_kw["n_seq_max"] = max(int(ctx_kw.get("n_seq_max") or 1), n_seqs)
    with Context(model, **ctx_kw) as ctx:
        unified = bool(ctx.params.kv_unified) or ctx.n_seq_max == 1
        if couple and n_seqs > 1 and (not unified or len(set(past)) > 1):
            raise ValueError(
                "--couple: coupled sequences need one KV stream (--kv-unified) and the same --past for "
                "every sequence (llama_batch_allocr::init refuses them otherwise)"
            )
        graph = ctx.graph_nodes()
        masks = sorted((i for i in graph.inputs if i.name == "attn_inp_kq_mask"), key=lambda i: i.occurrence)
        if not masks:
            raise ValueError("this model's forward pass has no attn_inp_kq_mask input (no KV-cache attention)")
        parts = _parts_by_first_use(graph, model, "attn_inp_kq_mask")
        kparts = {p: k for k, p in _parts_by_first_use(graph, model, "attn_inp_k_idxs").items()}
        rows = batch_rows(tokens, past, n_shared=n_shared, layout=layout, couple=couple)
        toks = prompt_tokens(model, n_shared + max(p + t for p, t in zip(past, tokens)))
        _fill(ctx, model, toks, past, n_shared, n_seqs)
        state = parse(np.asarray(ctx.state()), model=model)
        n_stream_kv = 1 if unified else ctx.n_seq_max
        cells: dict[str, list[KVCells]] = {}
        sizes: dict[str, int] = {}
        for part in dict.fromkeys(parts.values()):
            sizes[part] = _cache_size(part, ctx, model, unified)
            cells[part] = _cells_before(state, part, n_stream_kv, sizes[part])
        problems = _check_against_memory(ctx, cells, n_seqs)
        n_before = {p: sum(c.used_max_p1 for c in cs) for p, cs in cells.items()}
        batch = Batch(ctx.n_batch, max(len(r[0]) for r in rows), model=model)
        calls = [rows[i : i + ctx.n_batch] for i in range(0, len(rows), ctx.n_batch)]
        with ctx.capture("attn_inp_kq_mask", "attn_inp_k_idxs") as cap:
            for call in progress(calls, "mask"):
                batch.clear()
                for ids, p, o in call:
                    batch.add(int(toks[p % toks.size]), p, list(ids), logits=o)
                ctx.decode(batch)
        flash = bool(ctx.flash_attn)
        settings = {
            "n_ctx": ctx.n_ctx,
            "n_ctx_seq": ctx.n_ctx_seq,
            "n_batch": ctx.n_batch,
            "n_ubatch": ctx.n_ubatch,
            "n_seq_max": ctx.n_seq_max,
            "kv_unified": unified,
            "n_stream_kv": n_stream_kv,
            "flash_attn": flash,
            "cache_size": sizes,
        }
    out = _check_records(cap.records, masks, parts, kparts, cells, unified, model, problems)
    if any(not e["layers"] for e in out["masks"]):  # flash attention: the readers are unnamed
        from ..state import model_facts

        by_part = model_facts(model).get("layers") or {}
        for e in out["masks"]:
            e["layers"] = e["layers"] or list(by_part.get(e["cache"], range(model.n_layer)))
    out.update(settings)
    out.update(
        tokens=list(tokens),
        past=past,
        shared=n_shared,
        layout=layout,
        couple=couple,
        cells_before=n_before,
        problems=problems,
    )
    out["facts"] = _facts(out)
    out["ok"] = out["n_mismatches"] == 0 and not problems
    return out


def _check_against_memory(ctx, cells: dict[str, list[KVCells]], n_seqs: int) -> list[str]:
    """The dump's cells against ``llama_memory_seq_pos_max``: what the memory API says of each sequence."""
    bad = []
    part = "kv" if "kv" in cells else "base" if "base" in cells else next(iter(cells))
    for s in range(n_seqs):
        got = [int(c.pos[i]) for c in cells[part] for i in range(c.pos.size) if s in c.seqs[i]]
        want = ctx.memory.seq_pos_max(s)
        have = max(got) if got else -1
        if have != want:
            bad.append(f"sequence {s}: the state dump's cells end at position {have}, seq_pos_max says {want}")
    return bad


def _check_records(records, masks, parts, kparts, cells, unified, model, problems) -> dict:
    by_pass: dict[int, dict[tuple[str, int], Any]] = {}
    for r in records:
        by_pass.setdefault(r.pass_index, {})[(r.name, r.occurrence)] = r
    n_swa = int(model.n_swa)
    swa_type = _swa_type(model)
    entries = []
    n_mis = n_entries = 0
    for pi in sorted(by_pass):
        recs = by_pass[pi]
        for part, k in kparts.items():
            kr = recs.get(("attn_inp_k_idxs", k))
            if kr is None or kr.rows is None:
                raise ValueError(f"pass {pi}: attn_inp_k_idxs of the {part} cache was not captured with its rows")
            size = cells[part][0].pos.size
            for row, (kk, p, ids) in enumerate(zip(kr.array().tolist(), kr.pos.tolist(), kr.seq_ids)):
                strm, idx = divmod(int(kk), size)
                want = 0 if unified else ids[0]
                if strm != want:
                    problems.append(f"pass {pi}: row {row} in stream {strm}; its sequence {ids[0]} reads {want}")
                    continue
                if cells[part][strm].write(idx, p, ids) and part != "swa":
                    problems.append(
                        f"pass {pi}: row {row} written over cell {idx} of stream {strm}, in use as the dump was read "
                        "(the cache has holes: cell indices from the dump are wrong)"
                    )
        for m in masks:
            mr = recs.get(("attn_inp_kq_mask", m.occurrence))
            if mr is None:
                continue
            part = parts[m.occurrence]
            kr = recs[("attn_inp_k_idxs", kparts[part])]
            window = part == "swa"
            mis, rule = check_mask(
                mr.array(),
                cells[part],
                kr.pos,
                [engine_seq_order(ids) for ids in kr.seq_ids],
                unified=unified,
                n_swa=n_swa if window else 0,
                swa_type=swa_type if window else "none",
            )
            entries.append(_entry(mr, m, part, kr, cells[part], rule, mis, n_swa if window else 0, unified))
            n_mis += len(mis)
            n_entries += rule.size
    return {
        "masks": entries,
        "n_mismatches": n_mis,
        "n_entries": n_entries,
        "n_swa": n_swa,
        "swa_type": swa_type,
    }


def _entry(mr, m, part, kr, cells, rule, mis, n_swa, unified) -> dict:
    n_stream, n_tps, n_kv = rule.shape
    got_keep = as_streams(mr.array()).astype(np.float32) == 0
    kv_streams = [0 if unified else engine_seq_order(kr.seq_ids[s * n_tps])[0] for s in range(n_stream)]
    used = {s: cells[s].used_max_p1 for s in sorted(set(kv_streams))}
    shown = min(n_kv, max(used.values(), default=0))
    grid = []
    for s in range(n_stream):
        lines = []
        for ii in range(n_tps):
            chars = []
            for j in range(shown):
                want_keep = rule[s, ii, j] == KEEP
                if got_keep[s, ii, j] == want_keep:
                    chars.append(GRID_CHARS[rule[s, ii, j]])
                else:
                    chars.append("X" if got_keep[s, ii, j] else "!")
            lines.append("".join(chars))
        grid.append(lines)
    counts = {name: int((rule == i).sum()) for i, name in enumerate(RULES)}
    n_tok = n_stream * n_tps
    # batch row, position, seq ids as given, and in the ubatch's order (its first is the mask's)
    rows = [
        [int(kr.rows[i]), int(kr.pos[i]), list(kr.seq_ids[i]), list(engine_seq_order(kr.seq_ids[i]))]
        for i in range(n_tok)
    ]
    cell_list = {}
    for s, c in enumerate(cells):
        nz = np.flatnonzero(c.pos >= 0)
        if nz.size:
            cell_list[str(s)] = [[int(j), int(c.pos[j]), sorted(c.seqs[j])] for j in nz]
    keep = rule == KEEP
    return {
        "call": mr.call,
        "ubatch": mr.ubatch,
        "pass": mr.pass_index,
        "occurrence": m.occurrence,
        "cache": part,
        "layers": list(m.read_by),
        "n_swa": n_swa,
        "type": mr.type,
        "ne": list(mr.ne),
        "shape": list(mr.shape),
        "n_kv": n_kv,
        "n_stream": n_stream,
        "n_tps": n_tps,
        "kv_streams": kv_streams,
        "used": {str(s): u for s, u in used.items()},
        "columns_shown": shown,
        "padding_masked": bool((rule[..., shown:] == PADDING).all() and not got_keep[..., shown:].any()),
        "rows": rows,
        "cells": cell_list,
        "counts": counts,
        "visible": [[_ranges(keep[s, ii]) for ii in range(n_tps)] for s in range(n_stream)],
        "grid": grid,
        "n_mismatches": len(mis),
        "mismatches": [x.to_dict() for x in mis[:50]],
    }


def _facts(data: dict) -> list[str]:
    """The details the seeds name, as this run shows them."""
    out: list[str] = []
    es = data["masks"]
    if not es:
        return out
    e0 = es[0]
    out.append(
        f"columns: every mask has n_kv columns (here {sorted({e['n_kv'] for e in es})}), the cells in use padded "
        f"to a multiple of {N_PAD} (llama_kv_cache::get_n_kv); the padding columns are masked in every row: "
        + ("yes" if all(e["padding_masked"] for e in es) else "NO")
    )
    out.append(
        f"shape: ne {e0['ne']} = [n_kv, n_tokens/n_stream, 1, n_stream], numpy {e0['shape']}"
        + (
            f", {e0['n_stream']} streams of {e0['n_tps']} rows (kv_unified off: one per sequence of the ubatch)"
            if e0["n_stream"] > 1
            else ", one stream"
        )
        + f"; type {e0['type']} ("
        + ("flash attention on: FLASH_ATTN_EXT takes an f16 mask" if data["flash_attn"] else "flash attention off")
        + ")"
    )
    shared_seen: dict[int, int] = {}
    n_shared_cells = 0
    first_only = 0
    multi_rows = 0
    reordered: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for e in es:
        cells = {(int(s), c[0]): set(c[2]) for s, cl in e["cells"].items() for c in cl}
        n_shared_cells = max(n_shared_cells, sum(1 for v in cells.values() if len(v) > 1))
        for ii, (_b, _p, given, ids) in enumerate(e["rows"]):
            s, r = divmod(ii, e["n_tps"])
            strm = 0 if data["kv_unified"] else ids[0]
            for a, z in e["visible"][s][r]:
                for j in range(a, z + 1):
                    if len(cells.get((strm, j), ())) > 1:
                        shared_seen[ids[0]] = shared_seen.get(ids[0], 0) + 1
            if len(ids) > 1:
                multi_rows += 1
                if given[0] != ids[0]:
                    reordered.add((tuple(given), tuple(ids)))
                line = e["grid"][s][r]
                for j, ch in enumerate(line):
                    if ch == GRID_CHARS[OTHER_SEQ] and cells.get((strm, j), set()) & set(ids[1:]):
                        first_only += 1
    if n_shared_cells:
        out.append(
            f"shared cells: {n_shared_cells} cells hold several sequences; seen (entries visible) by the rows of "
            + ", ".join(f"sequence {s}: {n}" for s, n in sorted(shared_seen.items()))
        )
    if multi_rows:
        out.append(
            f"first sequence id only: {multi_rows} row-masks of rows with several seq ids; {first_only} entries masked "
            "as 'other sequence' whose cell is in one of the row's OTHER sequences (set_input_kq_mask_impl reads "
            "ubatch->seq_id[i][0])"
        )
    if reordered:
        out.append(
            "the ubatch's first seq id is not the caller's: llama_batch_ext keeps a row's ids in a std::unordered_set "
            "(src/llama-batch.h), iterated "
            + ", ".join(f"{_seqs(g)} -> {_seqs(i)}" for g, i in sorted(reordered))
            + "; each such row masks against the set's first"
        )
    win = [e for e in es if e["cache"] == "swa"]
    if win:
        out.append(
            f"sliding window: the SWA cache's mask (layers {win[0]['layers']}, n_swa {win[0]['n_swa']}, "
            f"{data['swa_type']}) masks {sum(e['counts']['window'] for e in win)} entries as outside the window; "
            f"the other mask (layers {next((e['layers'] for e in es if e['cache'] != 'swa'), [])}) has none"
        )
    return out


# -- command -----------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``mask`` subcommand and its flags.

    Args:
        sub: The ``add_subparsers()`` object of the ``pyllamacpp`` parser.

    Returns:
        The subcommand's parser (the caller sets its ``func``).
    """
    p = subcommand(sub, "mask", "the KQ mask of each ubatch, shown and checked against llama.cpp's rule", __doc__)
    add_model_flags(p, ctx=512, batch=512, ubatch=512)
    add_plan_flags(p)
    p.add_argument("--shared", type=int, default=0, help="tokens cached once for every sequence (seq_cp from 0)")
    p.add_argument(
        "--couple",
        action="store_true",
        help="each row also carries the other sequences' ids after its own (needs --kv-unified, equal --past)",
    )
    p.add_argument("-o", "--output", help="write the masks as a figure (PNG)")
    return p


def run(args: argparse.Namespace) -> dict:
    """:func:`run_mask` for the shape and context the flags ask for.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        What :func:`run_mask` returns, plus ``model`` and ``threads``.

    Raises:
        ValueError: Bad flags (``--mode`` other than auto, sizes), or a shape llama.cpp refuses.
        ModelLoadError: The model cannot be loaded.
        DecodeError: A decode failed.
    """
    shape = shape_from_args(args)
    if shape["mode"] != "auto":
        raise ValueError("--mode: the engine picks its split (llama_kv_cache::init_batch); --mode is split-plan's")
    n_seqs = shape["n_seqs"]
    try:
        tokens = per_seq(shape["tokens"], n_seqs, "--tokens")
        past = per_seq(shape["n_past"], n_seqs, "--past")
    except PlanError as e:
        raise ValueError(str(e)) from None
    if any(t <= 0 for t in tokens) or any(p < 0 for p in past) or args.shared < 0:
        raise ValueError(f"--tokens must be > 0, --past and --shared >= 0: {tokens}, {past}, {args.shared}")
    model = load_model(args)
    try:
        data = run_mask(
            model,
            tokens,
            past,
            n_shared=args.shared,
            layout=shape["layout"],
            couple=args.couple,
            **context_kwargs(args),
        )
    finally:
        model.close()
    data["model"] = str(model.path)
    data["threads"] = args.threads
    return data


def _seqs(ids: Sequence[int], short: bool = False) -> str:
    if short and all(0 <= s < 10 for s in ids):
        return "".join(str(s) for s in ids)  # a cell's set: digits, in one column
    return "+".join(str(s) for s in ids)


def grid_text(entry: dict) -> list[str]:
    """One mask as text: a line per query row, a character per cell (``#`` visible; masked: ``.``
    empty, ``s`` other sequence, ``f`` future, ``w`` window; ``X``/``!`` a mismatch).

    Args:
        entry: One of ``data["masks"]``.

    Returns:
        The lines (a note instead when it is too large to print).
    """
    n = entry["columns_shown"]
    if entry["n_tps"] > _TEXT_ROWS or n > _TEXT_COLS:
        return [f"  ({entry['n_tps']} rows x {n} cells: too large to print; -o draws it)"]
    out = []
    for s in range(entry["n_stream"]):
        rows = entry["rows"][s * entry["n_tps"] : (s + 1) * entry["n_tps"]]
        strm = entry["kv_streams"][s]
        cells = {c[0]: c for c in entry["cells"].get(str(strm), [])}
        out.append(
            f"  stream {s} (cells of KV stream {strm}); columns 0..{n - 1} of {entry['n_kv']} "
            f"({n}..{entry['n_kv'] - 1}: padding)"
        )
        labels = {j: _seqs(c[2], short=True) for j, c in cells.items()}
        w = max(3, 1 + max((len(x) for x in labels.values()), default=0), 1 + len(str(n - 1)))
        pre = "  " + " " * 22
        out.append(pre + "cell " + "".join(f"{j:>{w}}" for j in range(n)))
        out.append(pre + " pos " + "".join(f"{cells[j][1]:>{w}}" if j in cells else f"{'.':>{w}}" for j in range(n)))
        out.append(pre + "seqs " + "".join(f"{labels[j]:>{w}}" if j in cells else f"{'.':>{w}}" for j in range(n)))
        for (b, p, _given, ids), line in zip(rows, entry["grid"][s]):
            head = f"row {b:>3} seq {_seqs(ids):<5} pos {p:>3}"
            out.append(f"  {head:<27}" + "".join(f"{c:>{w}}" for c in line))
    return out


def print_report(data: dict) -> None:
    """Print what :func:`run` returned: one line per mask, the grids of small ones, the facts, the verdict.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    n_st = data["n_stream_kv"]
    print(
        f"model {data.get('model', '?')}; flash_attn {'on' if data['flash_attn'] else 'off'}; "
        f"kv_unified {'on' if data['kv_unified'] else 'off'} ({n_st} KV stream{'s' if n_st > 1 else ''}), n_seq_max "
        f"{data['n_seq_max']}, n_ubatch {data['n_ubatch']}, n_ctx_seq {data['n_ctx_seq']}; tokens {data['tokens']} "
        f"after {data['shared']} shared + {data['past']} cached ({data['layout']}"
        f"{', coupled' if data['couple'] else ''})"
    )
    print(
        f"cells before the decode (whole-context state dump): {data['cells_before']}; each ubatch's own cells from "
        "attn_inp_k_idxs; rule: llama_kv_cache::set_input_kq_mask"
    )
    rows = []
    for e in data["masks"]:
        c = e["counts"]
        rows.append(
            {
                "call": e["call"],
                "ub": e["ubatch"],
                "cache": f"{e['cache']} #{e['occurrence']}",
                "ne": str(e["ne"]),
                "type": e["type"],
                "used": max(int(u) for u in e["used"].values()) if e["used"] else 0,
                "keep": c["keep"],
                "empty": c["empty"],
                "pad": c["padding"],
                "other": c["other sequence"],
                "future": c["future"],
                "window": c["window"],
                "bad": e["n_mismatches"],
            }
        )
    print_table(
        rows,
        [
            ("call", "call", "d"),
            ("ub", "ubatch", "d"),
            ("cache", "mask of cache", "s"),
            ("ne", "ne", "s"),
            ("type", "type", "s"),
            ("used", "cells used", "d"),
            ("keep", "visible", "d"),
            ("empty", "empty", "d"),
            ("pad", "padding", "d"),
            ("other", "other seq", "d"),
            ("future", "future", "d"),
            ("window", "window", "d"),
            ("bad", "mismatches", "d"),
        ],
    )
    small = [e for e in data["masks"] if e["n_tps"] <= _TEXT_ROWS and e["columns_shown"] <= _TEXT_COLS]
    if small:
        print(
            "\n# visible; masked: . empty  s other sequence  f future  w window; X/! the engine differs; "
            "a row's seq ids in the ubatch's order (its first is the one masked against)"
        )
        n_occ = len({x["occurrence"] for x in data["masks"]})
        for e in small[:8]:
            where = f"call {e['call']} ubatch {e['ubatch']}, mask of the {e['cache']} cache"
            print(f"\n{where} (layers {_span(e['layers'], n_occ)}):")
            for line in grid_text(e):
                print(line)
    print()
    for f in data["facts"]:
        print(f"- {f}")
    for p in data["problems"]:
        print(f"PROBLEM: {p}")
    n = data["n_mismatches"]
    if n == 0 and not data["problems"]:
        n_masks = len(data["masks"])
        print(f"\nevery entry agrees with the rule: {data['n_entries']:,} entries of {n_masks} masks, 0 mismatches")
    else:
        print(f"\n{n} MISMATCH(ES) in {data['n_entries']:,} entries:")
        for e in data["masks"]:
            for m in e["mismatches"][:10]:
                print(
                    f"  call {e['call']} ubatch {e['ubatch']} {e['cache']}: stream {m['stream']} row {m['row']} cell "
                    f"{m['cell']}: engine {m['got']}, rule {m['want']} ({m['rule']})"
                )


def _span(layers: Sequence[int], n_masks: int = 2) -> str:
    if not layers:
        return "all" if n_masks == 1 else "-"  # flash attention's FLASH_ATTN_EXT nodes are unnamed
    ls = sorted(layers)
    return f"{ls[0]}..{ls[-1]}" if ls == list(range(ls[0], ls[-1] + 1)) and len(ls) > 2 else ",".join(map(str, ls))


_COLORS = ["#1b7837", "#f0f0f0", "#d9d9d9", "#f1a340", "#9e9ac8", "#6baed6"]  # per rule


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw each mask (one panel per mask, ubatch and stream): which query row sees which cell,
    coloured by the rule that decides it; mismatches in red.

    Args:
        data: What :func:`run` returned.
        path: The PNG to write.

    Raises:
        OSError: The file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    panels = [(e, s) for e in data["masks"] for s in range(e["n_stream"])][:16]
    n = len(panels)
    cols = min(n, 4)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(max(8.0, 4.2 * cols), 3.6 * nrows + 0.8), squeeze=False)
    cmap = ListedColormap(_COLORS + ["#d7191c"])
    code = {ch: i for i, ch in enumerate(GRID_CHARS)} | {"X": 6, "!": 6}
    for ax, (e, s) in zip(axes.flat, panels):
        grid = e["grid"][s]
        shown = e["columns_shown"]
        extra = min(8, e["n_kv"] - shown)  # a few padding columns, to show they are masked
        a = np.array([[code[c] for c in line] + [PADDING] * extra for line in grid], np.int8).reshape(len(grid), -1)
        ax.imshow(a, cmap=cmap, vmin=0, vmax=6, aspect="auto", interpolation="nearest")
        rows = e["rows"][s * e["n_tps"] : (s + 1) * e["n_tps"]]
        if len(rows) <= 24:
            ax.set_yticks(range(len(rows)), [f"s{_seqs(r[3])} p{r[1]}" for r in rows], fontsize=6)
        ax.set_xlabel(f"KV cell (0..{shown - 1} in use, then padding to n_kv {e['n_kv']})", fontsize=7)
        ax.set_title(
            f"call {e['call']} ub {e['ubatch']} {e['cache']} mask, stream {s}\nne {e['ne']}, {e['type']}, "
            f"{e['n_mismatches']} mismatches",
            fontsize=8,
        )
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    legend = [Patch(color=_COLORS[i], label=RULES[i]) for i in range(6)] + [Patch(color="#d7191c", label="mismatch")]
    fig.legend(handles=legend, loc="lower center", ncol=7, fontsize=7, frameon=False)
    fig.suptitle(
        f"attn_inp_kq_mask as llama.cpp built it; colour: the rule of set_input_kq_mask_impl "
        f"({data['n_mismatches']} mismatches in {data['n_entries']:,} entries)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
