"""Recurrent memory's state (llama-memory-recurrent.cpp): R, optional P (PLE) and S records."""
from __future__ import annotations

import dataclasses

from ._buffer import Buffer, StateFormatError
from ._parse import _count, _layer_header, _rows, parse_cells, row_record
from ._records import MemoryPart, Stream, TensorRecord


def ple_record(buf: Buffer, p: int, part: str, r: TensorRecord, n_cells: int, *, data: bool = True,
               row_size: int | None = None) -> TensorRecord:
    """A PLE conv row after R record ``r``: ``u64 p_size_row`` and the rows, no type field
    (llama_memory_recurrent::state_write_data: p_l[il] is made with type_r, like r_l[il]).
    ``row_size``: the size every P record must have (state_read_data checks each against
    ggml_row_size(p_l[il]->type, hparams.ple_conv_state()), one value for all layers)."""
    what = f"{part} stream 0 P[{r.layer}]"
    size = buf.u64(p, f"{what} row size")
    n_embd = r.type.n_values(size)
    if not size or n_embd is None or (row_size is not None and size != row_size):
        want = f"{row_size}, as the first PLE record" if row_size is not None else \
            f"a whole number of {r.type.name} blocks (the type of the R record before it)"
        raise StateFormatError(f"PLE row size {size}, expected {want}", offset=p, what=f"{what} row size")
    rows = _rows(buf, p + 8, n_cells * size, f"{what} data ({n_cells} rows x {size} bytes)", data)
    return TensorRecord(part, 0, "P", r.layer, r.type, p, p + 8, n_cells, size, n_embd, False, None, rows)


def parse_recurrent(buf: Buffer, off: int, name: str, tally: list[int] | None = None, *,
                    data: bool = True) -> MemoryPart:
    """llama_memory_recurrent::state_write: u32 cell_count, cells, u32 s_trans (always 0),
    u32 n_layer, then an R record per layer that has one, each followed by a P record (PLE conv
    rows) when that layer has a PLE conv tensor, then an S record per layer; all written even
    when cell_count is 0. n_layer counts every model layer, not those with records, and which
    layers have them is not written down: this part is always the last, so the records run to the
    end of the dump, as many R as S. Without P records that reading is unique; with them, see
    _ple_records."""
    what = f"{name} stream 0"
    cell_count = buf.u32(off, f"{what}: cell_count")
    cells, nb = parse_cells(buf, off + 4, cell_count, ext=False, what=what)
    q = off + 4 + nb
    s_trans, n_layer = _layer_header(buf, q, what, "s_trans")
    if s_trans:
        raise StateFormatError("s_trans 1: this llama.cpp only writes 0", offset=q, what=f"{what}: s_trans")
    q += 8
    try:
        records = _plain_rs_records(buf, q, name, cell_count, n_layer, tally, data)
    except StateFormatError as plain_error:
        records = _ple_records(buf, q, name, cell_count, n_layer, data)
        if records is None:  # the PLE reading is taken only when it accounts for every byte
            raise plain_error
    end = records[-1].data_offset + records[-1].nbytes if records else q
    stream = Stream(name, 0, off, cell_count, cells, off + 4, nb, s_trans, n_layer, tuple(records), end)
    return MemoryPart(name, "recurrent", off, None, (stream,), end)


def _plain_rs_records(buf, q, name, n_cells, n_layer, tally, data) -> list[TensorRecord]:
    what = f"{name} stream 0"
    records = []
    while q < buf.size:
        if len(records) == 2 * n_layer:
            raise StateFormatError(f"more than 2 x n_layer ({2 * n_layer}) R and S records",
                                   offset=q, what=f"{what}: records")
        records.append(row_record(buf, q, name, 0, "R/S", len(records), n_cells, None, data=data, empty_ok=True))
        q = _count(records, tally)
    if len(records) % 2:
        raise StateFormatError(f"{len(records)} records: expected as many R as S records",
                               offset=q, what=f"{what}: records")
    half = len(records) // 2
    return [dataclasses.replace(r, kind="R" if i < half else "S", layer=i % half if half else 0)
            for i, r in enumerate(records)]


def _same_header(a: TensorRecord, b: TensorRecord) -> bool:
    return (a.type.id, a.row_size) == (b.type.id, b.row_size)


def _ple_records(buf, q0, name, n_cells, n_layer, data) -> list[TensorRecord] | None:
    """The reading with PLE rows: R records, each optionally followed by a P record, then as
    many S records, ending at the last byte; None when there is no such reading with a P.

    What llama_memory_recurrent::state_read_data accepts narrows it: every R record has the
    memory's type_r and row size ggml_row_size(type_r, n_embd_r()), every P record the one
    ple_conv_state() row size, every S record type_s and its one row size; hence all R headers
    are equal, all P sizes and all S headers. A depth-first search over "P here or not" with
    those checks; each wrong guess fails within a record or two, and (offset, R count, P size)
    states already refuted are not tried again.
    """
    def rec(kind, p, idx, p_size=None, first=None):
        try:
            if kind == "P":
                return ple_record(buf, p, name, first, n_cells, data=data, row_size=p_size)
            r = row_record(buf, p, name, 0, kind, idx, n_cells, None, data=data, empty_ok=True)
        except StateFormatError:
            return None
        return r if first is None or _same_header(r, first) else None

    def end(r):
        return r.data_offset + r.nbytes

    def s_block(p, count):  # exactly ``count`` equal S records from p to the end of the dump
        out = []
        for i in range(count):
            r = rec("S", p, i, first=out[0] if out else None)
            if r is None:
                return None
            out.append(r)
            p = end(r)
        return out if p == buf.size else None

    r0 = rec("R", q0, 0)
    if r0 is None:
        return None
    refuted = set()
    # a stack of (records so far, P row size so far): depth first, "P next" tried first
    stack = [([r0], None)]
    while stack:
        records, p_size = stack.pop()
        last = records[-1]
        n_r = sum(r.kind == "R" for r in records)
        state = (end(last), n_r, last.kind, p_size)
        if state in refuted or n_r > n_layer:
            continue
        refuted.add(state)
        q = end(last)
        if p_size is not None:
            tail = s_block(q, n_r)
            if tail is not None:
                return records + tail
        nxt = rec("R", q, n_r, first=r0)
        if nxt is not None:
            stack.append((records + [nxt], p_size))
        if last.kind == "R":
            ple = rec("P", q, 0, p_size, first=last)
            if ple is not None:
                stack.append((records + [ple], ple.row_size))
    return None
