"""Writing dumps back: a smaller dump that keeps only some cells."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ._state import KVState


def _indices(mask, n: int, where: str) -> np.ndarray:
    m = np.asarray(mask)
    if m.dtype == bool:
        if m.shape != (n,):
            raise ValueError(f"{where}: a boolean mask needs shape ({n},), got {m.shape}")
        return np.flatnonzero(m)
    if not np.issubdtype(m.dtype, np.integer) or m.ndim != 1:
        raise TypeError(f"{where}: mask must be booleans or cell indices, not {m.dtype} {m.shape}")
    idx = m.astype(np.int64)
    if idx.size and (np.min(idx) < 0 or np.max(idx) >= n or np.any(np.diff(idx) <= 0)):  # np.min: see Model.detokenize
        raise ValueError(f"{where}: cell indices must be increasing and in [0, {n})")
    return idx


def _u32(v: int) -> bytes:
    return int(v).to_bytes(4, "little")


def select_cells(
    state: KVState,
    mask: np.ndarray | Sequence[int] | Sequence[bool] | Callable[[np.ndarray], np.ndarray],
    *,
    part: str | None = None,
    stream: int | None = None,
) -> KVState:
    """Keep the cells ``mask`` selects; everything else in the dump stays as it was.

    ``mask``: booleans or increasing indices over the cells of one stream (``part``/``stream``
    pick it, by default the only non-empty one), or a callable ``cells -> booleans`` applied to
    every stream of every part. cell_count, the cells and the rows of every K and V (or R and S)
    record are rewritten; a KV stream left with no cells is written as llama.cpp writes an empty
    one (cell_count 0 and nothing else). File headers (the prompt tokens) are copied unchanged.

    Args:
        state: The parsed dump.
        mask: Booleans or increasing cell indices, or a callable ``cells -> booleans``.
        part: The part whose stream ``mask`` selects in.
        stream: The stream ``mask`` selects in.

    Returns:
        The parsed new dump, backed by a writable bytearray.

    Raises:
        ValueError: A metadata-only or dsv4 dump; a boolean mask of the wrong length; indices
            not increasing or out of range.
        TypeError: ``mask`` is neither booleans nor integers.
    """
    from ._state import parse

    if state.metadata_only:
        # Its rows are in llama.cpp's memory, saved as one chunk per record and range; a blob with
        # other cells would not match them (llama_io_read_device aborts: "memory buffer mismatch").
        raise ValueError(
            "a metadata-only dump (StateFlags.ON_DEVICE) has no rows to select: "
            "select cells in a full dump (flags without ON_DEVICE) instead"
        )
    if state.options.get("memory") == "dsv4":
        raise ValueError(
            "select_cells on a llama_kv_cache_dsv4 dump (DeepSeek V4): its compressed K caches hold one "
            "row per 4 or 128 positions and its compressor states a ring of the last 8 or 128 positions, "
            "summaries that fewer raw cells would contradict and that cannot be recomputed here; llama.cpp "
            "itself removes no cells but a whole sequence or the positions past its end "
            "(llama_kv_cache_dsv4::seq_rm refuses any range with p1 >= 0, and a cut inside the sequence "
            "beyond its n_rs_seq rollback)"
        )
    if callable(mask):
        sel = {
            (p.name, s.index): _indices(mask(s.cells), s.cell_count, f"{p.name} stream {s.index}")
            for p in state.parts
            for s in p.streams
            if s.cell_count
        }
    else:
        s = state.stream(part, stream)
        sel = {(s.part, s.index): _indices(mask, s.cell_count, f"{s.part} stream {s.index}")}
    buf = state._buf

    def copy(start: int, end: int, what: str) -> bytes:
        return buf.view(start, end - start, what).tobytes()

    chunks = [copy(0, state.header.nbytes, "header")]
    for p in state.parts:
        if p.n_stream is not None:
            chunks.append(_u32(p.n_stream))
        for s in p.streams:
            idx = sel.get((p.name, s.index))
            if idx is None:
                chunks.append(copy(s.offset, s.end, f"{p.name} stream {s.index}"))
                continue
            chunks.append(_u32(len(idx)))
            if not len(idx) and p.kind == "kv":
                continue
            for o, nb in zip(s.cells["offset"][idx].tolist(), s.cells["nbytes"][idx].tolist()):
                chunks.append(copy(o, o + nb, "cell"))
            flags_at = s.cells_offset + s.cells_nbytes
            chunks.append(copy(flags_at, flags_at + 8, "v_trans, n_layer"))  # s_trans when recurrent
            for r in s.records:
                chunks.append(copy(r.header_offset, r.data_offset, f"{r.name} header"))
                if r.transposed:
                    el = r.type.type_size
                    assert r.data is not None  # metadata-only dumps were refused above
                    chunks.append(r.data.reshape(r.n_embd, r.n_cells, el)[:, idx, :].tobytes())
                else:
                    chunks.append(r.rows[idx].tobytes())
    opts = state.options
    return parse(
        bytearray(b"".join(chunks)),
        n_head_kv=state.n_head_kv,
        memory=opts["memory"],
        cell_ext=opts["cell_ext"],
        has_v=opts["has_v"],
        metadata_only=False,
        layers=opts.get("layers"),
        partial=opts.get("partial"),
    )
