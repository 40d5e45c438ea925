"""join_cells_data, the restore's join: the bytes the record-by-record join wrote, on real dumps.

The reference below is join_cells as it was before it wrote into one preallocated array (each
piece copied with ``tobytes``, a transposed V record joined with ``np.concatenate``, all of it
``b"".join``-ed): the fast path must give its bytes exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPT, STORE_TEXT, store_context

from pyllamacpp import state


def _u32(v: int) -> bytes:
    return int(v).to_bytes(4, "little")


def reference_join(states) -> bytes:
    """The former join_cells' bytes (layout checks left out: the dumps here fit)."""
    first = states[0]
    chunks = [first._buf.view(0, first.header.nbytes, "header").tobytes()]
    for pi, p in enumerate(first.parts):
        if p.n_stream is not None:
            chunks.append(_u32(p.n_stream))
        for si in range(len(p.streams)):
            streams = [st.parts[pi].streams[si] for st in states]
            full = [s for s in streams if s.cell_count]
            chunks.append(_u32(sum(s.cell_count for s in full)))
            if not full:
                continue
            ref = full[0]
            owners = [st for st, s in zip(states, streams) if s.cell_count]
            for st, s in zip(owners, full):
                chunks.append(st._buf.view(s.cells_offset, s.cells_nbytes, "cells").tobytes())
            flags_at = ref.cells_offset + ref.cells_nbytes
            chunks.append(owners[0]._buf.view(flags_at, 8, "v_trans, n_layer").tobytes())
            for ri, r in enumerate(ref.records):
                recs = [s.records[ri] for s in full]
                chunks.append(owners[0]._buf.view(r.header_offset, r.data_offset - r.header_offset, "header").tobytes())
                if r.transposed:
                    el = r.type.type_size
                    parts = [q.data.reshape(q.n_embd, q.n_cells, el) for q in recs]
                    chunks.append(np.concatenate(parts, axis=1).tobytes())
                else:
                    chunks.append(b"".join(q.rows.tobytes() for q in recs))
    return b"".join(chunks)


def _cut(st, bounds):
    pos = st.cells["pos"]
    return [st.select_cells((pos >= a) & (pos < b)) for a, b in bounds]


def _same(parts) -> bytes:
    """The fast path's bytes, checked against the reference and against join_cells' own."""
    got = state.join_cells_data(parts)
    assert got.dtype == np.uint8 and got.ndim == 1 and got.flags.writeable and got.flags.c_contiguous
    want = reference_join(parts)
    assert got.tobytes() == want
    joined = state.join_cells(parts)
    assert joined.to_bytes() == want and joined.writable
    return want


# chunks of unequal sizes, an empty one among them, and several of one size (the store's case)
BOUNDS = [(0, 5), (5, 5), (5, 16), (16, 24), (24, 32), (32, 10**6)]


@pytest.mark.parametrize("flash_attn", [True, False], ids=["v_trans0", "v_trans1"])
def test_the_fast_join_writes_the_bytes_of_the_record_by_record_join(model, flash_attn):
    toks = model.tokenize(STORE_TEXT)
    assert toks.size > 32
    with store_context(model, flash_attn=flash_attn) as ctx:
        ctx.prefill(toks)
        blob = ctx.seq_state(0).data.tobytes()
    st = state.parse(blob)
    assert st.stream().v_trans == (0 if flash_attn else 1)
    parts = _cut(st, BOUNDS)
    assert [p.stream().cell_count for p in parts][:2] == [5, 0]
    assert _same(parts) == blob  # cut and joined again: the dump itself
    assert _same(parts[2:4]) == _cut(st, [(5, 24)])[0].to_bytes()  # a run from the middle
    assert _same(parts[3:4]) == parts[3].to_bytes()  # one dump: itself
    # out of order: not a dump llama.cpp would write, but the join must still be the reference's
    _same([parts[4], parts[0], parts[2]])


@pytest.mark.parametrize("flash_attn", [True, False], ids=["v_trans0", "v_trans1"])
def test_the_fast_join_over_several_streams(model, flash_attn):
    """kv_unified False: a stream per sequence; dumps whose cells sit in other streams join into a
    dump with several non-empty streams, each stream's cells and rows in the dumps' order."""
    toks, other = model.tokenize(STORE_TEXT), model.tokenize(PROMPT)
    with store_context(model, flash_attn=flash_attn, n_seq_max=3, kv_unified=False, n_ctx=768) as ctx:
        ctx.prefill(toks, 1)
        ctx.prefill(other, 2)
        one = ctx.seq_state(1).data.tobytes()
        two = ctx.seq_state(2).data.tobytes()
    a, b = state.parse(one), state.parse(two)
    assert a.parts[0].n_stream == 3
    assert [s.cell_count for s in a.parts[0].streams] == [0, toks.size, 0]
    assert [s.cell_count for s in b.parts[0].streams] == [0, 0, other.size]
    assert a.stream().v_trans == (0 if flash_attn else 1)
    in_1 = _cut(a, BOUNDS)
    assert _same(in_1) == one
    both = _same([in_1[0], *_cut(b, [(0, 3), (3, 10**6)]), in_1[2]])
    assert [s.cell_count for s in state.parse(both).parts[0].streams] == [0, 5 + 11, other.size]


def test_the_fast_join_refuses_what_join_cells_refuses(model):
    toks = model.tokenize(PROMPT)
    dumps = {}
    for fa in (True, False):
        with store_context(model, flash_attn=fa) as ctx:
            ctx.prefill(toks)
            dumps[fa] = state.parse(ctx.seq_state(0).data)
            meta = state.parse(ctx.seq_state(0, state.ON_DEVICE).data, flags=state.ON_DEVICE)
    for join in (state.join_cells_data, state.join_cells):
        with pytest.raises(ValueError, match="no dumps"):
            join([])
        with pytest.raises(ValueError, match="metadata-only"):
            join([dumps[True], meta])
        with pytest.raises(ValueError, match=r"v_trans, n_layer or record count differ \(\(1, 30, 60\) against \(0"):
            join([dumps[True], dumps[False]])
