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
    return _reparse(state, bytearray(b"".join(chunks)))


def _reparse(like: KVState, data: bytearray | np.ndarray) -> KVState:
    """Parse the dump written into ``data`` (writable, kept as the dump's buffer) with the options
    ``like`` was parsed with."""
    from ._state import parse

    opts = like.options
    return parse(
        data,
        n_head_kv=like.n_head_kv,
        memory=opts["memory"],
        cell_ext=opts["cell_ext"],
        has_v=opts["has_v"],
        metadata_only=False,
        layers=opts.get("layers"),
        partial=opts.get("partial"),
    )


def join_cells(states: Sequence[KVState]) -> KVState:
    """One dump holding the cells of ``states`` one after the other: the inverse of cutting a dump
    into runs of cells with :func:`select_cells`.

    Every dump must come from the same memory layout (the same parts, streams, layers and record
    types, as dumps of one context's sequences are); the header (seq id, file tokens) is the first
    dump's. Per stream: the cells of each dump in order, then each K and V record's rows joined in
    that order (a transposed V record, ``v_trans`` 1, value-major: its values per embedding row).

    Args:
        states: The parsed dumps, at least one.

    Returns:
        The parsed new dump, backed by a writable uint8 array (:func:`join_cells_data`'s).

    Raises:
        ValueError: No dumps, a metadata-only, dsv4 or recurrent dump, or dumps whose layouts
            differ (which part, stream, record or type, said).
    """

    data = join_cells_data(states)
    return _reparse(states[0], data)


def join_cells_data(states: Sequence[KVState]) -> np.ndarray:
    """The bytes :func:`join_cells` writes, not parsed again: for a caller that only hands them on
    (to ``llama_state_seq_set_data_ext``, which reads them, or to a file).

    Each byte is copied once, into one array allocated at its final size: no per-record copies
    joined afterwards, and no parse of the result.

    Args:
        states: The parsed dumps, at least one (see :func:`join_cells`).

    Returns:
        The joined dump, a new writable 1-D uint8 array.

    Raises:
        ValueError: No dumps, a metadata-only, dsv4 or recurrent dump, or dumps whose layouts
            differ (which part, stream, record or type, said).
    """

    if not states:
        raise ValueError("join_cells: no dumps")
    first = states[0]
    for i, st in enumerate(states):
        if st.metadata_only:
            raise ValueError(f"join_cells: dump {i} is metadata-only (StateFlags.ON_DEVICE): it has no rows")
        if st.options.get("memory") == "dsv4" or any(p.kind != "kv" for p in st.parts):
            raise ValueError(
                f"join_cells: dump {i} holds a {st.options.get('memory')} memory; only KV caches can be joined "
                "by cells (a recurrent state is one row per sequence, not one per position)"
            )
        if [(p.name, p.n_stream, len(p.streams)) for p in st.parts] != [
            (p.name, p.n_stream, len(p.streams)) for p in first.parts
        ]:
            raise ValueError(f"join_cells: dump {i} has other memory parts or streams than dump 0")
    # The pieces in order, nothing copied yet: byte strings or uint8 views, each written as it is,
    # and a list of the dumps' (n_embd, bytes per embedding row) views for a transposed V record.
    pieces: list[bytes | np.ndarray | list[np.ndarray]] = [first._buf.view(0, first.header.nbytes, "header")]
    for pi, p in enumerate(first.parts):
        if p.n_stream is not None:
            pieces.append(_u32(p.n_stream))
        for si in range(len(p.streams)):
            streams = [st.parts[pi].streams[si] for st in states]
            full = [s for s in streams if s.cell_count]
            n = sum(s.cell_count for s in full)
            pieces.append(_u32(n))
            if not full:
                continue
            ref = full[0]
            want = (ref.v_trans, ref.n_layer, len(ref.records))
            for s in full:
                if (s.v_trans, s.n_layer, len(s.records)) != want:
                    raise ValueError(
                        f"join_cells: {p.name} stream {si}: v_trans, n_layer or record count differ "
                        f"({(s.v_trans, s.n_layer, len(s.records))} against {want})"
                    )
            owners = [st for st, s in zip(states, streams) if s.cell_count]
            for st, s in zip(owners, full):
                pieces.append(st._buf.view(s.cells_offset, s.cells_nbytes, "cells"))
            flags_at = ref.cells_offset + ref.cells_nbytes
            pieces.append(owners[0]._buf.view(flags_at, 8, "v_trans, n_layer"))
            for ri, r in enumerate(ref.records):
                recs = [s.records[ri] for s in full]
                for j, q in enumerate(recs):
                    if (q.name, q.type, q.row_size if not q.transposed else q.n_embd) != (
                        r.name,
                        r.type,
                        r.row_size if not r.transposed else r.n_embd,
                    ):
                        raise ValueError(
                            f"join_cells: {p.name} stream {si} record {r.name}: dump {j} differs in type or size"
                        )
                pieces.append(owners[0]._buf.view(r.header_offset, r.data_offset - r.header_offset, "header"))
                data = [q._payload() for q in recs]
                if r.transposed:
                    pieces.append([d.reshape(r.n_embd, -1) for d in data])
                else:
                    pieces.extend(data)
    sizes = [
        len(x) if isinstance(x, bytes) else x.size if isinstance(x, np.ndarray) else sum(v.size for v in x)
        for x in pieces
    ]
    out = np.empty(sum(sizes), np.uint8)  # not zeroed: every byte is written below
    at = 0
    for x, nb in zip(pieces, sizes):
        if isinstance(x, list):
            # value-major: embedding row e of the joined record is row e of each dump's in turn
            dst = out[at : at + nb].reshape(x[0].shape[0], -1)
            c = 0
            for v in x:
                dst[:, c : c + v.shape[1]] = v
                c += v.shape[1]
        else:
            out[at : at + nb] = np.frombuffer(x, np.uint8) if isinstance(x, bytes) else x
        at += nb
    return out
