"""Recurrent memory's state (llama-memory-recurrent.cpp): R, optional P (PLE) and S records."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ._buffer import Buffer, StateFormatError
from ._parse import _count, _layer_header, _rows, parse_cells, row_record
from ._records import MemoryPart, Stream, TensorRecord


def ple_record(
    buf: Buffer, p: int, part: str, r: TensorRecord, n_cells: int, *, data: bool = True, row_size: int | None = None
) -> TensorRecord:
    """A PLE conv row after R record ``r``: ``u64 p_size_row`` and the rows, no type field
    (llama_memory_recurrent::state_write_data: p_l[il] is made with type_r, like r_l[il]).
    ``row_size``: the size every P record must have (state_read_data checks each against
    ggml_row_size(p_l[il]->type, hparams.ple_conv_state()), one value for all layers).

    Args:
        buf: The dump.
        p: Byte offset of the P record's row size.
        part: The memory part's name.
        r: The R record it follows (its type and layer).
        n_cells: Cells in the stream.
        data: False for a metadata-only dump.
        row_size: The row size it must have, or None for any.

    Returns:
        The P record.

    Raises:
        StateFormatError: Bytes that do not follow the format (offset, what, needed, left).
    """
    what = f"{part} stream 0 P[{r.layer}]"
    size = buf.u64(p, f"{what} row size")
    n_embd = r.type.n_values(size)
    if not size or n_embd is None or (row_size is not None and size != row_size):
        want = (
            f"{row_size}, as the first PLE record"
            if row_size is not None
            else f"a whole number of {r.type.name} blocks (the type of the R record before it)"
        )
        raise StateFormatError(f"PLE row size {size}, expected {want}", offset=p, what=f"{what} row size")
    rows = _rows(buf, p + 8, n_cells * size, f"{what} data ({n_cells} rows x {size} bytes)", data)
    return TensorRecord(part, 0, "P", r.layer, r.type, p, p + 8, n_cells, size, n_embd, False, None, rows)


def _recurrent_header(buf: Buffer, off: int, name: str):
    what = f"{name} stream 0"
    cell_count = buf.u32(off, f"{what}: cell_count")
    cells, nb = parse_cells(buf, off + 4, cell_count, ext=False, what=what)
    q = off + 4 + nb
    s_trans, n_layer = _layer_header(buf, q, what, "s_trans")
    if s_trans:
        raise StateFormatError("s_trans 1: this llama.cpp only writes 0", offset=q, what=f"{what}: s_trans")
    return cell_count, cells, nb, s_trans, n_layer, q + 8


def _part(buf, off, name, header, records) -> MemoryPart:
    cell_count, cells, nb, s_trans, n_layer, q = header
    end = records[-1].data_offset + records[-1].nbytes if records else q
    stream = Stream(name, 0, off, cell_count, cells, off + 4, nb, s_trans, n_layer, tuple(records), end)
    return MemoryPart(name, "recurrent", off, None, (stream,), end)


def parse_recurrent(
    buf: Buffer, off: int, name: str, tally: list[int] | None = None, *, data: bool = True
) -> MemoryPart:
    """llama_memory_recurrent::state_write: u32 cell_count, cells, u32 s_trans (always 0),
    u32 n_layer, then an R record per layer that has one, each followed by a P record (PLE conv
    rows) when that layer has a PLE conv tensor, then an S record per layer; all written even
    when cell_count is 0. n_layer counts every model layer, not those with records, and which
    layers have them is not written down: as the last part, the records run to the end of the
    dump, as many R as S. Without P records that reading is unique; with them, see
    _ple_records. A part followed by another: parse_recurrent_splits.

    Args:
        buf: The dump.
        off: Byte offset of cell_count.
        name: The part's name.
        tally: A one-item list counting the records read.
        data: False for a metadata-only dump.

    Returns:
        The part.

    Raises:
        StateFormatError: Bytes that do not follow the format (offset, what, needed, left).
    """
    header = _recurrent_header(buf, off, name)
    q, n_layer, cell_count = header[5], header[4], header[0]
    try:
        records = _plain_rs_records(buf, q, name, cell_count, n_layer, tally, data)
    except StateFormatError as plain_error:
        ple = next(_ple_records(buf, q, name, cell_count, n_layer, data), None)
        if ple is None:  # the PLE reading is taken only when it accounts for every byte
            raise plain_error
        records = ple
    return _part(buf, off, name, header, records)


def parse_recurrent_splits(
    buf: Buffer, off: int, name: str, tally: list[int] | None = None, *, data: bool = True
) -> Iterator[MemoryPart]:
    """The readings of a recurrent part that another part follows (llama_memory_hybrid_idx::
    state_write: the indexer cache after the recurrent state), most records first. The dump
    does not say where the records stop, so this yields every reading of k R and k S records
    (k <= n_layer) whose R headers are all equal and whose S headers are all equal (r_l/s_l
    rows are n_embd_r()/n_embd_s() for every layer, llama_memory_recurrent's constructor and
    state_read_data); the caller keeps the one after which the next part reads every byte.
    Then the PLE readings. Raises the header's error now; the readings come lazily, no error.

    Args:
        buf: The dump.
        off: Byte offset of cell_count.
        name: The part's name.
        tally: A one-item list counting the records read.
        data: False for a metadata-only dump.

    Returns:
        An iterator of the part's readings, most records first.

    Raises:
        StateFormatError: The part's header (cells, s_trans, n_layer) does not read.
    """
    header = _recurrent_header(buf, off, name)
    return _splits(buf, off, name, header, tally, data)


def _splits(buf, off, name, header, tally, data):
    cell_count, n_layer, q = header[0], header[4], header[5]
    records, p = [], q
    while p < buf.size and len(records) < 2 * n_layer:  # greedy: past the end, the next part's bytes
        try:
            records.append(row_record(buf, p, name, 0, "R/S", len(records), cell_count, None, data=data, empty_ok=True))
        except StateFormatError:
            break
        p = _count(records, tally)
    for half in range(len(records) // 2, -1, -1):
        r, s = records[:half], records[half : 2 * half]
        if all(_same_header(x, r[0]) for x in r) and all(_same_header(x, s[0]) for x in s):
            yield _part(buf, off, name, header, _name_rs(r + s))
    for ple in _ple_records(buf, q, name, cell_count, n_layer, data, to_end=False):
        yield _part(buf, off, name, header, ple)


def _name_rs(records: list[TensorRecord]) -> list[TensorRecord]:
    half = len(records) // 2
    return [
        dataclasses.replace(r, kind="R" if i < half else "S", layer=i % half if half else 0)
        for i, r in enumerate(records)
    ]


def _plain_rs_records(buf, q, name, n_cells, n_layer, tally, data) -> list[TensorRecord]:
    what = f"{name} stream 0"
    records: list[TensorRecord] = []
    while q < buf.size:
        if len(records) == 2 * n_layer:
            raise StateFormatError(
                f"more than 2 x n_layer ({2 * n_layer}) R and S records", offset=q, what=f"{what}: records"
            )
        records.append(row_record(buf, q, name, 0, "R/S", len(records), n_cells, None, data=data, empty_ok=True))
        q = _count(records, tally)
    if len(records) % 2:
        raise StateFormatError(
            f"{len(records)} records: expected as many R as S records", offset=q, what=f"{what}: records"
        )
    records = _name_rs(records)
    # every R row is n_embd_r() of type_r, every S row n_embd_s() of type_s (state_read_data
    # checks each layer against them): a record unlike the first of its kind is not this part's
    for r in records:
        first = records[0] if r.kind == "R" else records[len(records) // 2]
        if not _same_header(r, first):
            raise StateFormatError(
                f"{r.type.name} rows of {r.row_size} bytes, but {first.kind}[0] has "
                f"{first.type.name} rows of {first.row_size} bytes (one type and row "
                f"size for every layer)",
                offset=r.header_offset,
                what=f"{what} {r.name}",
            )
    return records


def _same_header(a: TensorRecord, b: TensorRecord) -> bool:
    return (a.type.id, a.row_size) == (b.type.id, b.row_size)


def _ple_records(buf, q0, name, n_cells, n_layer, data, *, to_end: bool = True):
    """The readings with PLE rows: R records, each optionally followed by a P record, then as
    many S records, ending at the last byte (``to_end``; else anywhere, for a part that another
    follows); yields each, none when there is no such reading with a P.

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
        return out if p == buf.size or not to_end else None

    r0 = rec("R", q0, 0)
    if r0 is None:
        return
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
                yield records + tail
        nxt = rec("R", q, n_r, first=r0)
        if nxt is not None:
            stack.append((records + [nxt], p_size))
        if last.kind == "R":
            ple = rec("P", q, 0, p_size, first=last)
            if ple is not None:
                stack.append((records + [ple], ple.row_size))
