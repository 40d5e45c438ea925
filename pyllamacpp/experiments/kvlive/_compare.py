"""What ``pyllamacpp kv-live`` checks: the tensors' placement by their offsets, and each
sequence's rows in the live tensors against the same rows of its state dump, byte for byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._watch import KVTensor, KVWatch

if TYPE_CHECKING:
    from ...context import Context
    from ...state import KVState


def memory_order(tensors: Sequence[KVTensor]) -> dict:
    """What the offsets say about the tensors' placement.

    Args:
        tensors: From :meth:`KVWatch.tensors` (sorted by buffer and offset).

    Returns:
        ``order`` (``["K0", "V0", "K1", ...]`` by offset), ``buffers`` (name -> size in bytes),
        ``gaps`` (bytes between consecutive tensors of a buffer, and after the last, that no
        tensor covers) and ``interleaved`` (K and V of each layer side by side, layer by layer).
    """
    order = [f"{t.kind}{t.layer}" for t in tensors]
    gaps = 0
    buffers: dict[str, int] = {}
    by_buf: dict[str, list[KVTensor]] = {}
    for t in tensors:
        buffers[t.buffer] = t.buffer_size
        by_buf.setdefault(t.buffer, []).append(t)
    for ts in by_buf.values():
        end = 0
        for t in ts:
            gaps += max(0, t.buffer_offset - end)
            end = max(end, t.buffer_offset + t.nbytes)
        gaps += max(0, ts[0].buffer_size - end)
    layers = sorted({t.layer for t in tensors})
    interleaved = order == [f"{k}{il}" for il in layers for k in ("K", "V")]
    return {"order": order, "buffers": buffers, "gaps": gaps, "interleaved": interleaved}


# -- live against the dump -----------------------------------------------------------------------


def compare(
    tensors: Sequence[KVTensor],
    dump: KVState,
    stream: int,
    cells: Sequence[int] | np.ndarray,
) -> dict:
    """Compare the dump's K and V rows with the same cells of the live tensors, byte for byte.

    Args:
        tensors: The cache tensors (:meth:`KVWatch.tensors`; a copy of one with a byte changed
            shows as a mismatch).
        dump: The sequence's dump, parsed (``pyllamacpp.state.parse(ctx.seq_state(s).data,
            model=model)``).
        stream: The stream the sequence lives in (the dump's stream with cells).
        cells: The cache cells that hold it, in cell order (the dump writes them in that order).

    Returns:
        ``layers`` (one dict per layer and kind: ``kind``, ``layer``, ``bytes``, ``mismatches``
        and the ``first`` mismatch: cell, byte in the tensor, byte in the dump), ``bytes`` compared,
        ``mismatches`` (bytes that differ) and ``ok``.

    Raises:
        ValueError: The dump's stream holds another number of cells, or a layer's record or
            tensor is missing.
    """
    s = dump.stream(stream=stream)
    idx = np.asarray(cells, np.int64)
    if s.cell_count != len(idx):
        raise ValueError(f"the dump's stream {stream} holds {s.cell_count} cells, the live cache {len(idx)}")
    by_name = {(t.kind, t.layer): t for t in tensors}
    rows = []
    for rec in s.records:
        if rec.kind not in ("K", "V"):
            continue
        il = rec.il if rec.il is not None else rec.layer
        t = by_name.get((rec.kind, il))
        if t is None:
            raise ValueError(f"no live tensor for {rec.name}")
        if rec.transposed != t.v_trans:
            raise ValueError(f"{rec.name}: the dump says v_trans={int(rec.transposed)}, the context {int(t.v_trans)}")
        assert rec.data is not None, "a metadata-only dump has no rows"
        live = t.cell_bytes(stream, idx, rec.n_embd)
        filed: np.ndarray
        if rec.transposed:
            filed = rec.data.reshape(rec.n_embd, len(idx), rec.type.type_size)
        else:
            filed = rec.data.reshape(len(idx), rec.row_size)
        diff = np.flatnonzero(live.reshape(-1) != filed.reshape(-1))
        row: dict[str, Any] = {"kind": rec.kind, "layer": il, "bytes": int(filed.size), "mismatches": int(diff.size)}
        if diff.size:
            row["first"] = _where(t, rec, stream, idx, int(diff[0]))
        rows.append(row)
    n_bad = sum(r["mismatches"] for r in rows)
    return {"layers": rows, "bytes": sum(r["bytes"] for r in rows), "mismatches": n_bad, "ok": n_bad == 0}


def _where(t: KVTensor, rec: Any, stream: int, cells: np.ndarray, flat: int) -> dict:
    """Byte ``flat`` of a compared block: its cell, and its offset in the tensor and in the dump."""
    if rec.transposed:
        el = rec.type.type_size
        j, rest = divmod(flat, len(cells) * el)
        i, b = divmod(rest, el)
        in_tensor = stream * t.nb[2] + (j * t.kv_size + int(cells[i])) * el + b
        what = f"value {j}"
    else:
        i, b = divmod(flat, rec.row_size)
        in_tensor = stream * t.nb[2] + int(cells[i]) * t.nb[1] + b
        what = f"byte {b} of the row"
    return {
        "cell": int(cells[i]),
        "what": what,
        "tensor_offset": int(in_tensor),
        "buffer_offset": int(t.buffer_offset + in_tensor),
        "dump_offset": int(rec.data_offset + flat),
    }


def compare_seq(ctx: Context, w: KVWatch, seq_id: int, *, dump: np.ndarray | None = None) -> dict:
    """A sequence's rows in the live cache against its ``llama_state_seq_get_data_ext`` dump.

    Args:
        ctx: The context ``w`` watched.
        w: The watch (its block ended).
        seq_id: The sequence.
        dump: The dump's bytes; None: ``ctx.seq_state(seq_id).data`` now.

    Returns:
        What :func:`compare` returns, plus ``seq_id``, ``stream``, ``cells``, ``pos`` and
        ``dump_bytes``.

    Raises:
        ValueError: The cells the watch saw written disagree with the cells the dump lists
            (positions, or count): a memory op moved them since (then the watch cannot say where
            the sequence is), or no row of it was written while watching.
    """
    from ... import state as st

    blob = ctx.seq_state(seq_id).data if dump is None else dump
    parsed = st.parse(blob, model=ctx.model)
    stream, cells, pos = w.cells(seq_id)
    s = parsed.stream()
    if s.index != stream or s.cell_count != len(cells) or not np.array_equal(s.cells["pos"], pos):
        raise ValueError(
            f"kv-live: sequence {seq_id}: the watched writes put {len(cells)} cells in stream {stream} "
            f"(positions {_ranges(pos)}), the dump lists {s.cell_count} in stream {s.index} "
            f"(positions {_ranges(s.cells['pos'])}): a memory op moved the cells since"
        )
    out = compare(w.tensors(), parsed, stream, cells)
    return {
        "seq_id": seq_id,
        "stream": stream,
        "cells": cells.tolist(),
        "pos": pos.tolist(),
        "dump_bytes": int(parsed.nbytes),
        **out,
    }


def _ranges(xs) -> str:
    """``[0, 1, 2, 3, 7, 8]`` -> ``"0..3, 7..8"``."""
    xs = [int(x) for x in xs]
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:]:
        if x != prev + 1:
            out.append(f"{start}..{prev}" if prev != start else f"{start}")
            start = x
        prev = x
    out.append(f"{start}..{prev}" if prev != start else f"{start}")
    return ", ".join(out)
