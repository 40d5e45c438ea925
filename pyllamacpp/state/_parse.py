"""The format grammar, as llama.cpp writes it (llama-context.cpp, llama-kv-cache.cpp): the
header, cells, per-layer records and a KV cache's state. Every read goes through Buffer.view();
nothing here copies payloads. Recurrent memory is in _recurrent, the choice among layouts in
_memory.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ._buffer import Buffer, StateFormatError, short_read
from ._records import DumpKind, Header, MemoryPart, Stream, TensorRecord
from ._types import ggml_type

IO_MAGIC = 0xAF143CD8  # llama-context.cpp: `static constexpr uint32_t io_magic`
SEQ_FILE_MAGIC = 0x67677371  # 'ggsq', LLAMA_STATE_SEQ_MAGIC (llama.h)
SESSION_MAGIC = 0x6767736E  # 'ggsn', LLAMA_SESSION_MAGIC
SEQ_FILE_VERSION = 3  # LLAMA_STATE_SEQ_VERSION
SESSION_VERSION = 10  # LLAMA_SESSION_VERSION
FILE_HEADER_SIZE = 12  # u32 magic, u32 version, u32 n_token_count (llama_state_*_save_file), then the tokens
LLAMA_MAX_SEQ = 256  # src/llama-cparams.h; also bounds n_stream
CELL_EXT_SIZE = 12  # llama_kv_cell_ext: i32 x, i32 y, i32 tok (llama-kv-cells.h)
MAX_ARCH_NAME = 64

_ARCH_RE = re.compile(rb"[A-Za-z0-9_.\-]+")


# --- header -------------------------------------------------------------------------------------


def _arch(buf: Buffer, off: int) -> tuple[str, int]:
    n = buf.u32(off, "arch name length")
    if not 1 <= n <= MAX_ARCH_NAME:
        raise StateFormatError(
            f"length {n} is not that of an architecture name (1..{MAX_ARCH_NAME})", offset=off, what="arch name length"
        )
    raw = buf.view(off + 4, n, "arch name").tobytes()
    if not _ARCH_RE.fullmatch(raw):
        raise StateFormatError(f"{raw!r} is not an architecture name", offset=off + 4, what="arch name")
    return raw.decode(), off + 4 + n


def parse_header(buf: Buffer) -> Header:
    """Everything before the memory part: which kind of dump it is, and its header fields.

    Args:
        buf: The dump.

    Returns:
        The header; ``nbytes`` is where the memory part starts.

    Raises:
        StateFormatError: An unknown magic, a file version other than this llama.cpp's, a bad
            architecture name, or a header cut short.
    """
    magic = buf.u32(0, "magic")
    if magic == IO_MAGIC:  # llama_context::state_seq_get_data: io_magic, then the source seq_id
        return Header(DumpKind.SEQUENCE, magic, None, buf.i32(4, "seq_id"), None, None, None, 8)
    if magic in (SEQ_FILE_MAGIC, SESSION_MAGIC):  # state_seq_save_file / state_save_file
        kind, version, name = (
            (DumpKind.SEQ_FILE, SEQ_FILE_VERSION, "LLAMA_STATE_SEQ_VERSION")
            if magic == SEQ_FILE_MAGIC
            else (DumpKind.SESSION_FILE, SESSION_VERSION, "LLAMA_SESSION_VERSION")
        )
        got = buf.u32(4, "version") if buf.size >= 8 else None
        if got is not None and got != version:
            raise StateFormatError(
                f"version {got}, expected {version} ({name} of this llama.cpp)", offset=4, what=f"{kind} version"
            )
        if buf.size < FILE_HEADER_SIZE:  # llama_state_*_load_file read magic, version, n_token_count first
            raise short_read(0, f"{kind} header (u32 magic, version, n_token_count)", FILE_HEADER_SIZE, buf.size)
        n_tokens = buf.u32(8, "n_token_count")
        off, arch = FILE_HEADER_SIZE + 4 * n_tokens, None
        if off > buf.size:  # the whole header measured against the dump, as one short read
            raise short_read(
                0,
                f"{kind} header ({FILE_HEADER_SIZE} bytes, then n_token_count {n_tokens:,} tokens of 4)",
                off,
                buf.size,
            )
        tokens = buf.array(FILE_HEADER_SIZE, n_tokens, "<i4", f"{n_tokens} prompt tokens")
        if kind is DumpKind.SESSION_FILE:  # then what llama_state_get_data writes: arch, memory
            arch, off = _arch(buf, off)
        return Header(kind, magic, got, None, arch, tokens, FILE_HEADER_SIZE, off)
    if 1 <= magic <= MAX_ARCH_NAME:  # llama_context::state_write_data: write_string(arch), memory
        arch, off = _arch(buf, 0)
        return Header(DumpKind.CONTEXT, None, None, None, arch, None, None, off)
    raise StateFormatError(
        f"unknown magic 0x{magic:08x}: not a sequence dump (0x{IO_MAGIC:08x}), a seq file "
        f"('ggsq' 0x{SEQ_FILE_MAGIC:08x}), a session file ('ggsn' 0x{SESSION_MAGIC:08x}) nor a "
        f"whole-context state (u32 length + architecture name)",
        offset=0,
        what="magic",
    )


# --- cells --------------------------------------------------------------------------------------


def _cells_dtype(width: int, ext: bool) -> np.dtype:
    fields = [("pos", "<i4"), ("n_seq_id", "<u4"), ("seq_id", "<i4", (width,))]
    if ext:
        fields += [("x", "<i4"), ("y", "<i4"), ("tok", "<i4")]
    return np.dtype(fields + [("offset", "<i8"), ("nbytes", "<i4")])


def _check_n_seq(n: int, off: int, what: str) -> None:
    if n > LLAMA_MAX_SEQ:
        raise StateFormatError(f"n_seq_id {n} > LLAMA_MAX_SEQ ({LLAMA_MAX_SEQ})", offset=off, what=what)


def _check_seq_ids(ids: np.ndarray, offsets: np.ndarray, what: str) -> None:
    bad = np.flatnonzero((ids < 0) | (ids >= LLAMA_MAX_SEQ))
    if bad.size:
        i = int(bad[0])
        raise StateFormatError(
            f"seq_id {int(ids.flat[i])} out of range [0, {LLAMA_MAX_SEQ})", offset=int(offsets.flat[i]), what=what
        )


def parse_cells(buf: Buffer, off: int, count: int, *, ext: bool, what: str) -> tuple[np.ndarray, int]:
    """``count`` cells: i32 pos, u32 n_seq_id, [llama_kv_cell_ext], n_seq_id x i32 seq_id
    (llama_kv_cache::state_write_meta; recurrent cells have no ext).

    Args:
        buf: The dump.
        off: Byte offset of the first cell.
        count: The cell_count just read.
        ext: Whether cells carry llama_kv_cell_ext (12 bytes).
        what: The stream being read, for messages.

    Returns:
        The cells as a structured array (a copy), and the bytes they take.

    Raises:
        StateFormatError: Cells cut short, n_seq_id > LLAMA_MAX_SEQ, or a seq_id out of range.
    """
    base = 8 + (CELL_EXT_SIZE if ext else 0)
    left = buf.size - off
    if count * base > left:
        raise short_read(off, f"{what}: {count} cells of at least {base} bytes", count * base, left)
    if count == 0:
        return np.zeros(0, _cells_dtype(1, ext)), 0
    n0 = buf.u32(off + 4, f"{what}: cell 0 n_seq_id")
    _check_n_seq(n0, off + 4, f"{what}: cell 0 n_seq_id")
    stride = base + 4 * n0
    if count * stride <= left:  # fast path: every cell the same size (always so in sequence dumps)
        fields: dict[str, Any] = {
            "names": ["pos", "n_seq_id"],
            "formats": ["<i4", "<u4"],
            "offsets": [0, 4],
            "itemsize": stride,
        }
        if ext:
            fields["names"] += ["x", "y", "tok"]
            fields["formats"] += ["<i4"] * 3
            fields["offsets"] += [8, 12, 16]
        if n0:
            fields["names"].append("seq_id")
            fields["formats"].append(("<i4", (n0,)))
            fields["offsets"].append(base)
        # numpy types a dict dtype as its private _DTypeDict TypedDict
        raw = buf.view(off, count * stride, f"{what}: {count} cells").view(np.dtype(fields))  # type: ignore[call-overload]
        if (raw["n_seq_id"] == n0).all():
            out = np.zeros(count, _cells_dtype(max(n0, 1), ext))
            out["offset"] = off + stride * np.arange(count, dtype=np.int64)
            out["nbytes"] = stride
            for name in raw.dtype.names:
                if name == "seq_id":
                    out["seq_id"][:, :n0] = raw["seq_id"].reshape(count, n0)
                else:
                    out[name] = raw[name]
            if n0:
                _check_seq_ids(
                    out["seq_id"][:, :n0], out["offset"][:, None] + base + 4 * np.arange(n0), f"{what}: seq_id"
                )
            else:
                out["seq_id"] = -1
            return out, count * stride
    # slow path: cells of different sizes (a whole-context state with shared prefixes)
    rows, p = [], off
    for i in range(count):
        pos = buf.i32(p, f"{what}: cell {i} pos")
        n = buf.u32(p + 4, f"{what}: cell {i} n_seq_id")
        _check_n_seq(n, p + 4, f"{what}: cell {i} n_seq_id")
        ext_vals = tuple(int(v) for v in buf.array(p + 8, 3, "<i4", f"{what}: cell {i} ext")) if ext else ()
        ids = buf.array(p + base, n, "<i4", f"{what}: cell {i} seq ids")
        _check_seq_ids(ids, p + base + 4 * np.arange(n), f"{what}: cell {i} seq_id")
        rows.append((pos, n, ids.tolist(), ext_vals, p, base + 4 * n))
        p += base + 4 * n
    width = max(1, max(r[1] for r in rows))
    out = np.zeros(count, _cells_dtype(width, ext))
    out["seq_id"] = -1
    for i, (pos, n, ids, ext_vals, o, nb) in enumerate(rows):
        out["pos"][i], out["n_seq_id"][i], out["offset"][i], out["nbytes"][i] = pos, n, o, nb
        out["seq_id"][i, :n] = ids
        if ext:
            out["x"][i], out["y"][i], out["tok"][i] = ext_vals
    return out, p - off


# --- per-layer records --------------------------------------------------------------------------


def _heads(n_head: int | None, n_embd: int, off: int, what: str) -> int | None:
    if n_head and n_embd % n_head:
        raise StateFormatError(
            f"a row of {n_embd} values does not split into n_head_kv={n_head} heads", offset=off, what=what
        )
    return n_head


def _rows(buf: Buffer, off: int, nbytes: int, what: str, data: bool) -> np.ndarray | None:
    # data=False: a metadata-only dump (llama_io_write_dummy(skip_tensors) / llama_io_write_device
    # in llama-context.cpp skip every write_tensor), where the next header follows at once.
    return buf.view(off, nbytes, what) if data else None


def row_record(
    buf: Buffer,
    p: int,
    part: str,
    s: int,
    kind: str,
    il: int,
    n_cells: int,
    n_head: int | None,
    *,
    data: bool = True,
    empty_ok: bool = False,
) -> TensorRecord:
    """``i32 type, u64 row_size`` then n_cells rows (llama_kv_cache::state_write_data,
    llama_memory_recurrent::state_write_data).

    Args:
        buf: The dump.
        p: Byte offset of the record's header.
        part: The memory part's name.
        s: The stream index.
        kind: K, V, R, S ...
        il: The record's index among its kind.
        n_cells: Cells in the stream.
        n_head: n_head_kv to shape views with, or None.
        data: False for a metadata-only dump (no rows follow the header).
        empty_ok: A row size of 0 is valid (a recurrent S record of lfm2, whose
            hparams.n_embd_s() is 0).

    Returns:
        The record.

    Raises:
        StateFormatError: Bytes that do not follow the format (offset, what, needed, left).
    """
    what = f"{part} stream {s} {kind}[{il}]"
    t = ggml_type(buf.i32(p, f"{what} type"), offset=p, what=f"{what} type")
    row_size = buf.u64(p + 4, f"{what} row size")
    n_embd = t.n_values(row_size)
    if (not row_size and not empty_ok) or n_embd is None:
        raise StateFormatError(
            f"row size {row_size} is not a whole number of {t.name} blocks "
            f"({t.type_size} bytes per {t.block_size} values)",
            offset=p + 4,
            what=f"{what} row size",
        )
    n_head = _heads(n_head, n_embd, p + 4, f"{what} row size")
    rows = _rows(buf, p + 12, n_cells * row_size, f"{what} data ({n_cells} rows x {row_size} bytes)", data)
    return TensorRecord(part, s, kind, il, t, p, p + 12, n_cells, row_size, n_embd, False, n_head, rows)


def transposed_record(
    buf: Buffer, p: int, part: str, s: int, il: int, n_cells: int, n_head: int | None, *, data: bool = True
) -> TensorRecord:
    """V with v_trans=1: ``i32 type, u32 element_size, u32 n_embd_v_gqa`` then, for each of the
    n_embd values, that value of every cell.

    Args:
        buf: The dump.
        p: Byte offset of the record's header.
        part: The memory part's name.
        s: The stream index.
        il: The record's index among the V records.
        n_cells: Cells in the stream.
        n_head: n_head_kv to shape views with, or None.
        data: False for a metadata-only dump.

    Returns:
        The record (``transposed`` True).

    Raises:
        StateFormatError: A quantized type, an element size that is not the type's, or bytes
            cut short.
    """
    what = f"{part} stream {s} V[{il}]"
    t = ggml_type(buf.i32(p, f"{what} type"), offset=p, what=f"{what} type")
    if t.quantized:
        # llama_init_from_model and llama_context's constructor (llama-context.cpp) refuse a
        # quantized V cache without flash attention, and only flash attention off gives v_trans=1;
        # a block type written "value by value" (state_write_data copies ggml_type_size() bytes per
        # value) would be nonsense.
        raise StateFormatError(
            f"transposed V (v_trans=1) of block-quantized type {t.name}: this "
            f"llama.cpp never writes one (quantized V requires flash attention, "
            f"which stores V untransposed)",
            offset=p,
            what=f"{what} type",
        )
    el = buf.u32(p + 4, f"{what} element size")
    if el != t.type_size:
        raise StateFormatError(
            f"element size {el}, but ggml_type_size({t.name}) is {t.type_size}",
            offset=p + 4,
            what=f"{what} element size",
        )
    n_embd = buf.u32(p + 8, f"{what} n_embd_v_gqa")
    if not n_embd:
        raise StateFormatError("n_embd_v_gqa is 0", offset=p + 8, what=f"{what} n_embd_v_gqa")
    n_head = _heads(n_head, n_embd, p + 8, f"{what} n_embd_v_gqa")
    rows = _rows(buf, p + 12, n_embd * n_cells * el, f"{what} data ({n_embd} x {n_cells} values of {el} bytes)", data)
    return TensorRecord(part, s, "V", il, t, p, p + 12, n_cells, n_embd * el, n_embd, True, n_head, rows)


def _count(records: list[TensorRecord], tally: list[int] | None) -> int:
    """Count a record read (how far an attempt got, see parse_memory); return where it ends."""
    if tally is not None:
        tally[0] += 1
    return records[-1].data_offset + records[-1].nbytes


# --- memory parts -------------------------------------------------------------------------------


def _layer_header(buf: Buffer, p: int, what: str, flag_name: str = "v_trans") -> tuple[int, int]:
    # No bound on n_layer needed here: each record read consumes at least 12 bytes or fails.
    flag = buf.u32(p, f"{what}: {flag_name}")
    if flag not in (0, 1):
        raise StateFormatError(f"{flag}, expected 0 or 1", offset=p, what=f"{what}: {flag_name}")
    return flag, buf.u32(p + 4, f"{what}: n_layer")


def parse_kv(
    buf: Buffer,
    off: int,
    name: str,
    *,
    ext: bool,
    has_v: bool,
    n_head: int | None,
    tally: list[int] | None = None,
    data: bool = True,
) -> MemoryPart:
    """llama_kv_cache::state_write: u32 n_stream, then per stream u32 cell_count and, unless it is
    0, cells, u32 v_trans, u32 n_layer, n_layer K records, n_layer V records (none without V).

    Args:
        buf: The dump.
        off: Byte offset of n_stream.
        name: The part's name (kv, base, swa ...).
        ext: Whether cells carry llama_kv_cell_ext.
        has_v: Whether V records follow the K records.
        n_head: n_head_kv to shape views with, or None.
        tally: A one-item list counting the records read (for the caller's choice of error).
        data: False for a metadata-only dump.

    Returns:
        The part.

    Raises:
        StateFormatError: Bytes that do not follow the format (offset, what, needed, left).
    """
    n_stream = buf.u32(off, f"{name}: n_stream")
    if not 1 <= n_stream <= LLAMA_MAX_SEQ:
        raise StateFormatError(f"{n_stream} out of range [1, {LLAMA_MAX_SEQ}]", offset=off, what=f"{name}: n_stream")
    streams, p = [], off + 4
    for s in range(n_stream):
        what = f"{name} stream {s}"
        cell_count = buf.u32(p, f"{what}: cell_count")
        cells, nb = parse_cells(buf, p + 4, cell_count, ext=ext, what=what)
        q = p + 4 + nb
        if not cell_count:  # llama.cpp writes nothing more for an empty stream
            streams.append(Stream(name, s, p, 0, cells, p + 4, 0, None, None, (), q))
            p = q
            continue
        v_trans, n_layer = _layer_header(buf, q, what)
        q += 8
        records = []
        for il in range(n_layer):
            records.append(row_record(buf, q, name, s, "K", il, cell_count, n_head, data=data))
            q = _count(records, tally)
        for il in range(n_layer if has_v else 0):
            records.append(
                transposed_record(buf, q, name, s, il, cell_count, n_head, data=data)
                if v_trans
                else row_record(buf, q, name, s, "V", il, cell_count, n_head, data=data)
            )
            q = _count(records, tally)
        streams.append(Stream(name, s, p, cell_count, cells, p + 4, nb, v_trans, n_layer, tuple(records), q))
        p = q
    return MemoryPart(name, "kv", off, n_stream, tuple(streams), p)
