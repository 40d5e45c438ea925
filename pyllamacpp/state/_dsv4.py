"""llama_kv_cache_dsv4's state (DeepSeek V4; llama-kv-cache-dsv4.cpp at the pin).

llama_kv_cache_dsv4::state_write writes ``u32 DSV4_STATE_MAGIC, u32 version (1), u32 mode``
(0 full, 1 PARTIAL_ONLY), then its raw cache (a llama_kv_cache_iswa made K-only by
dsv4_make_k_only, so no V records; with PARTIAL_ONLY only its swa part), then, unless partial,
three compressed K caches (csa, hca, lid: dsv4_state_write_k_cache), then three compressor
states (csa-state, hca-state, lid-state: llama_dsv4_comp_state::state_write). Every check here
is one that the read side (state_read, dsv4_state_read_k_cache, dsv4_state_read_tensor_streams,
llama_dsv4_comp_state::state_read) makes, or a fact of the constructor that every dump of this
llama.cpp has; a dump that fails one cannot be loaded by any context.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import numpy as np

from ._buffer import Buffer, StateFormatError
from ._parse import _cells_dtype, parse_kv
from ._records import Dsv4Block, MemoryPart, Segment, Stream, TensorRecord
from ._types import ggml_type

DSV4_STATE_MAGIC = 0x34565344  # 'DSV4'
DSV4_STATE_VERSION = 1
MODE_FULL, MODE_PARTIAL = 0, 1  # DSV4_STATE_MODE_FULL / _PARTIAL
K_CACHE_VERSIONS = (1, 2)  # DSV4_K_CACHE_STATE_VER is 2; dsv4_state_read_k_cache also reads 1
COMP_STATE_VERSION = 1  # DSV4_COMP_STATE_VER
CSA_RATIO, HCA_RATIO = 4, 128  # DSV4_CSA_RATIO, DSV4_HCA_RATIO
LLAMA_MAX_LAYERS = 512  # llama-hparams.h: every il is below it
GGML_TYPE_F32 = 0
STREAMS_HEADER = 28  # i32 type, u64 ne0, u64 rows, u64 row_size
# the constructor: kv_csa and kv_lid hold the layers whose compress ratio is 4 (filter_csa),
# kv_hca those with 128 (filter_hca)
K_CACHES = (("csa", CSA_RATIO), ("hca", HCA_RATIO), ("lid", CSA_RATIO))
# (name, ratio, state_size): csa_state (4, 2*4), hca_state (128, 128), lid_state (4, 2*4)
COMP_STATES = (
    ("csa-state", CSA_RATIO, 2 * CSA_RATIO),
    ("hca-state", HCA_RATIO, HCA_RATIO),
    ("lid-state", CSA_RATIO, 2 * CSA_RATIO),
)
BLOCK_KINDS = ("compressed", "compressor")
RAW_PARTS = {False: ("base", "swa"), True: ("swa",)}  # by partial
PART_NAMES = ("base", "swa") + tuple(n for n, _ in K_CACHES) + tuple(n for n, _, _ in COMP_STATES)
PARTIAL_NAMES = ("swa",) + tuple(n for n, _, _ in COMP_STATES)


def _tensor_streams(
    buf: Buffer,
    p: int,
    part: str,
    kind: str,
    index: int,
    il: int,
    n_rows: int,
    ns: int,
    data: bool,
    tally: list[int],
    *,
    f32_ne0: int | None = None,
):
    """dsv4_state_write_tensor_streams: ``i32 type, u64 ne0, u64 rows, u64 row_size`` then ns
    chunks of rows x row_size bytes (write_tensor: absent from a metadata-only dump, and not
    written at all when rows x row_size is 0). One TensorRecord per stream; returns them and
    the end. dsv4_state_read_tensor_streams requires type, ne0, rows and row_size to be its
    tensor's: rows == the block's n_rows, row_size == ggml_row_size(type, ne0).
    ``f32_ne0``: a compressor state tensor, F32 with ne0 == n_embd_state."""
    what = f"{part} {kind}[il {il}]"
    t = ggml_type(buf.i32(p, f"{what} type"), offset=p, what=f"{what} type")
    ne0 = buf.u64(p + 4, f"{what} ne0")
    rows = buf.u64(p + 12, f"{what} rows")
    row_size = buf.u64(p + 20, f"{what} row_size")
    if f32_ne0 is not None and t.id != GGML_TYPE_F32:
        raise StateFormatError(
            f"type {t.name}: a compressor state tensor is F32 (llama_dsv4_comp_state's constructor)",
            offset=p,
            what=f"{what} type",
        )
    if f32_ne0 is not None and ne0 != f32_ne0:
        raise StateFormatError(f"ne0 {ne0}, expected n_embd_state {f32_ne0}", offset=p + 4, what=f"{what} ne0")
    # ne0 is n_embd_k_gqa or n_embd_state, a uint32_t in llama_hparams
    if not 1 <= ne0 <= 0xFFFFFFFF or ne0 % t.block_size:
        raise StateFormatError(
            f"ne0 {ne0} is not a row of {t.name} (1 to 2^32-1 values, whole blocks of {t.block_size})",
            offset=p + 4,
            what=f"{what} ne0",
        )
    if rows != n_rows:
        raise StateFormatError(f"rows {rows}, expected the block's {n_rows}", offset=p + 12, what=f"{what} rows")
    want = ne0 // t.block_size * t.type_size
    if row_size != want:
        raise StateFormatError(
            f"row_size {row_size}, but ggml_row_size({t.name}, {ne0}) is {want}", offset=p + 20, what=f"{what} row_size"
        )
    chunk, d, out = rows * row_size, p + STREAMS_HEADER, []
    for s in range(ns):
        view = (
            buf.view(d, chunk, f"{part} stream {s} {kind}[il {il}] data ({rows} rows x {row_size} bytes)")
            if data
            else None
        )
        out.append(
            TensorRecord(
                part,
                s,
                kind,
                index,
                t,
                p,
                d,
                rows,
                row_size,
                ne0,
                False,
                None,
                view,
                il=il,
                header_nbytes=STREAMS_HEADER,
            )
        )
        tally[0] += 1
        if data:
            d += chunk
    return out, d


def _check_ns(ns: int, off: int, part: str, allowed: set[int]) -> None:
    # dsv4_state_dst_stream_range: a sequence load needs ns == 1, a whole-memory load ns ==
    # n_stream (n_seq_max: every DSV4 cache and state is built non-unified)
    if ns not in allowed:
        raise StateFormatError(
            f"{ns} streams, expected {' or '.join(map(str, sorted(allowed)))} "
            f"(dsv4_state_src_stream_range: 1 for one sequence, the raw cache's n_stream "
            f"for the whole memory; one value for every block)",
            offset=off,
            what=f"{part}: ns",
        )


def _layered_block(buf: Buffer, p: int, q: int, part: str, kind: str, ns_ok: set[int], read_one, **fields) -> Dsv4Block:
    """The tail of both block formats, at ``q``: u32 ns, u32 n_layer, then n_layer times ``u32 il``
    and what ``read_one(il, index, at, ns)`` reads; il strictly increasing (get_layer_ids and the
    comp state's layers follow the constructor's il loop). The block runs from ``p`` to the end."""
    ns = buf.u32(q, f"{part}: ns")
    _check_ns(ns, q, part, ns_ok)
    n_layer = buf.u32(q + 4, f"{part}: n_layer")
    q += 8
    ils: list[int] = []
    records: list[TensorRecord] = []
    for i in range(n_layer):
        il = buf.u32(q, f"{part} layer {i}: il")
        if ils and il <= ils[-1]:
            raise StateFormatError(
                f"il {il} after il {ils[-1]}: layers come in increasing il", offset=q, what=f"{part} layer {i}: il"
            )
        if il >= LLAMA_MAX_LAYERS:
            raise StateFormatError(
                f"il {il}, expected below LLAMA_MAX_LAYERS ({LLAMA_MAX_LAYERS})", offset=q, what=f"{part} layer {i}: il"
            )
        ils.append(il)
        recs, q = read_one(il, i, q + 4, ns)
        records += recs
    return _block(part, kind, p, q, ns, records, n_layer=n_layer, layers=tuple(ils), **fields)


def _block(name: str, kind: str, off: int, end: int, ns: int, records: list[TensorRecord], **fields) -> Dsv4Block:
    streams = tuple(
        Stream(
            name,
            s,
            off,
            0,
            np.zeros(0, _cells_dtype(1, False)),
            off,
            0,
            None,
            fields["n_layer"],
            tuple(r for r in records if r.stream == s),
            end,
        )
        for s in range(ns)
    )
    return Dsv4Block(name, kind, off, ns, streams, end, records=tuple(records), **fields)


def _k_cache(buf, p, name, ratio, ns_ok, data, tally) -> Dsv4Block:
    """dsv4_state_write_k_cache: u32 version, n_rows, ns, n_layer, then per layer u32 il and
    the K tensor's rows 0..n_rows of each stream (n_rows: positions / ratio, not cells)."""
    version = buf.u32(p, f"{name}: version")
    if version not in K_CACHE_VERSIONS:
        raise StateFormatError(
            f"version {version}, expected 2 (or 1, which dsv4_state_read_k_cache also reads)",
            offset=p,
            what=f"{name}: version",
        )
    n_rows = buf.u32(p + 4, f"{name}: n_rows")

    def one(il, i, at, ns):
        return _tensor_streams(buf, at, name, "K", i, il, n_rows, ns, data, tally)

    return _layered_block(buf, p, p + 8, name, "compressed", ns_ok, one, version=version, ratio=ratio, n_rows=n_rows)


def _comp_state(buf, p, name, ratio, state_size, ns_ok, data, tally) -> Dsv4Block:
    """llama_dsv4_comp_state::state_write: u32 version, ratio, state_size, n_embd_state, ns,
    n_layer, then per layer u32 il, the kv tensor's and the score tensor's state_size rows."""
    version = buf.u32(p, f"{name}: version")
    if version != COMP_STATE_VERSION:
        raise StateFormatError(f"version {version}, expected {COMP_STATE_VERSION}", offset=p, what=f"{name}: version")
    # state_read compares ratio, state_size and n_embd_state with its own: the first two are
    # the constructor's constants
    for at, field, want in ((p + 4, "ratio", ratio), (p + 8, "state_size", state_size)):
        got = buf.u32(at, f"{name}: {field}")
        if got != want:
            raise StateFormatError(f"{got}, expected {want}", offset=at, what=f"{name}: {field}")
    n_embd = buf.u32(p + 12, f"{name}: n_embd_state")
    # 2 * n_embd_head_k (csa), n_embd_head_k (hca), 2 * indexer_head_size (lid)
    if not n_embd or (name != "hca-state" and n_embd % 2):
        raise StateFormatError(
            f"{n_embd}, expected a positive{'' if name == 'hca-state' else ', even'} number",
            offset=p + 12,
            what=f"{name}: n_embd_state",
        )

    def one(il, i, at, ns):
        kv, at = _tensor_streams(buf, at, name, "KV", i, il, state_size, ns, data, tally, f32_ne0=n_embd)
        score, at = _tensor_streams(buf, at, name, "SCORE", i, il, state_size, ns, data, tally, f32_ne0=n_embd)
        return kv + score, at

    fields = dict(version=version, ratio=ratio, n_rows=state_size, state_size=state_size, n_embd_state=n_embd)
    return _layered_block(buf, p, p + 16, name, "compressor", ns_ok, one, **fields)


def _check_blocks(blocks: dict[str, Dsv4Block]) -> None:
    """What the constructor makes true of every dump: kv_csa and kv_lid hold the same layers
    (filter_csa), as do csa_state and lid_state; no layer is in both a ratio-4 and the ratio-128
    set; a compressor state holds a prefix of its K cache's layers (the states loop over
    hparams.n_layer(), the caches over n_layer_all: MTP layers with a ratio would be in the cache
    only); csa_state's n_embd_state is twice hca_state's (2 * n_embd_head_k and n_embd_head_k);
    kv_lid's rows hold indexer_head_size values (hparams_lid: one KV head of that size), half
    lid_state's n_embd_state."""

    def fail(b: Dsv4Block, msg: str, what: str = "layers", at: int | None = None):
        raise StateFormatError(msg, offset=b.offset if at is None else at, what=f"{b.name}: {what}")

    for a, b in (("lid", "csa"), ("lid-state", "csa-state")):
        if a in blocks and blocks[a].layers != blocks[b].layers:
            fail(
                blocks[a],
                f"layers {list(blocks[a].layers)}, but {b} has {list(blocks[b].layers)} "
                f"(both hold the layers whose compress ratio is 4)",
            )
    for state, cache in (("csa-state", "csa"), ("hca-state", "hca")):
        if cache in blocks and blocks[cache].layers[: len(blocks[state].layers)] != blocks[state].layers:
            fail(
                blocks[state],
                f"layers {list(blocks[state].layers)}, not the first layers of {cache}'s {list(blocks[cache].layers)}",
            )
    for x, y in (("csa", "hca"), ("csa-state", "hca-state")):
        if x in blocks and set(blocks[x].layers) & set(blocks[y].layers):
            fail(
                blocks[y],
                f"layers {sorted(set(blocks[x].layers) & set(blocks[y].layers))} are also in {x} "
                f"(a layer's compress ratio is 4 or 128, not both)",
            )
    csa, hca = blocks["csa-state"], blocks["hca-state"]
    if csa.n_embd_state != 2 * cast(int, hca.n_embd_state):  # a compressor state has one
        fail(
            csa,
            f"{csa.n_embd_state}, expected 2 x hca-state's {hca.n_embd_state} (2 * n_embd_head_k)",
            "n_embd_state",
            csa.offset + 12,
        )
    lid = blocks.get("lid")
    if lid is not None and lid.records:
        r = lid.records[0]
        if 2 * r.n_embd != blocks["lid-state"].n_embd_state:
            fail(
                lid,
                f"ne0 {r.n_embd}, expected half of lid-state's n_embd_state "
                f"{blocks['lid-state'].n_embd_state} (indexer_head_size)",
                f"{r.name} ne0",
                r.header_offset + 4,
            )
        for q in lid.records:
            if q.n_embd != r.n_embd:
                fail(
                    lid,
                    f"ne0 {q.n_embd}, but {r.name} has {r.n_embd} (indexer_head_size for every layer)",
                    f"{q.name} ne0",
                    q.header_offset + 4,
                )


def parse_dsv4(
    buf: Buffer, off: int, *, seq_id: int | None, mode: int, ext: bool, n_head: int | None, data: bool, tally: list[int]
) -> tuple[MemoryPart, ...]:
    """The parts after the 12-byte dsv4 header at ``off`` to the last byte, for one reading
    (llama_kv_cache_dsv4::state_write).

    Args:
        buf: The dump.
        off: Byte offset of the dsv4 header (magic, version, mode).
        seq_id: The sequence the dump was written for (>= 0), -1 for the whole memory, None
            unknown (a seq file).
        mode: The header's mode (full or PARTIAL_ONLY).
        ext: Whether cells carry llama_kv_cell_ext.
        n_head: n_head_kv to shape the raw cache's views with, or None.
        data: False for a metadata-only dump.
        tally: A one-item list counting the records read.

    Returns:
        The raw cache's parts (base, swa) and the blocks (Dsv4Block).

    Raises:
        StateFormatError: Bytes that do not follow the format (offset, what, needed, left).
    """
    parts: list[MemoryPart] = []
    q = off + 12
    for name in RAW_PARTS[mode == MODE_PARTIAL]:
        part = parse_kv(buf, q, name, ext=ext, has_v=False, n_head=n_head, tally=tally, data=data)
        parts.append(part)
        q = part.end
    n_stream = cast(int, parts[-1].n_stream)  # a KV part has one
    if parts[0].n_stream != n_stream:  # one llama_kv_cache_iswa: base and swa built alike
        raise StateFormatError(
            f"{n_stream} streams, but the base part has {parts[0].n_stream}",
            offset=parts[-1].offset,
            what="swa: n_stream",
        )
    if seq_id is not None and seq_id >= 0 and n_stream > 1 and seq_id >= n_stream:
        raise StateFormatError(
            f"a dump of seq_id {seq_id} with {n_stream} streams (dsv4_state_src_stream_range: "
            f"the sequence is its stream)",
            offset=parts[-1].offset,
            what="swa: n_stream",
        )
    ns_ok: set[int | None] = (
        {1} if seq_id is not None and seq_id >= 0 else {n_stream} if seq_id is not None else {1, n_stream}
    )
    blocks: dict[str, Dsv4Block] = {}

    def add(block: Dsv4Block) -> int:
        nonlocal ns_ok
        blocks[block.name] = block
        parts.append(block)
        ns_ok = {block.n_stream}  # the same src_stream_range for every block
        return block.end

    if mode == MODE_FULL:
        for name, ratio in K_CACHES:
            q = add(_k_cache(buf, q, name, ratio, ns_ok, data, tally))
    for name, ratio, size in COMP_STATES:
        q = add(_comp_state(buf, q, name, ratio, size, ns_ok, data, tally))
    _check_blocks(blocks)
    if q != buf.size:
        raise StateFormatError(f"{buf.size - q} trailing bytes after the lid-state block", offset=q, what="end of dump")
    return tuple(parts)


def read_header(buf: Buffer, off: int, partial: bool | None) -> int:
    """The mode of the dsv4 header at ``off`` (magic, version, mode), checked as state_read does.

    Args:
        buf: The dump.
        off: Byte offset of the magic.
        partial: Whether the dump is said to be PARTIAL_ONLY, or None when unknown.

    Returns:
        The mode (0 full, 1 PARTIAL_ONLY).

    Raises:
        StateFormatError: A magic other than 'DSV4', another version, an unknown mode, or a mode
            that is not ``partial`` (state_read refuses it: "DSV4 state flags mismatch").
    """
    magic = buf.u32(off, "dsv4: magic")
    if magic != DSV4_STATE_MAGIC:
        raise StateFormatError(
            f"0x{magic:08x}, expected DSV4_STATE_MAGIC 0x{DSV4_STATE_MAGIC:08x} ('DSV4')",
            offset=off,
            what="dsv4: magic",
        )
    version = buf.u32(off + 4, "dsv4: version")
    if version != DSV4_STATE_VERSION:
        raise StateFormatError(
            f"version {version}, expected {DSV4_STATE_VERSION}", offset=off + 4, what="dsv4: version"
        )
    mode = buf.u32(off + 8, "dsv4: mode")
    if mode not in (MODE_FULL, MODE_PARTIAL):
        raise StateFormatError(f"mode {mode}, expected 0 (full) or 1 (PARTIAL_ONLY)", offset=off + 8, what="dsv4: mode")
    if partial is not None and bool(partial) != (mode == MODE_PARTIAL):
        raise StateFormatError(
            f"mode {mode} ({'PARTIAL_ONLY' if mode else 'full'}), but the dump is said to be "
            f"{'partial' if partial else 'full'} (state_read refuses it: 'DSV4 state flags "
            f"mismatch')",
            offset=off + 8,
            what="dsv4: mode",
        )
    return mode


def block_segments(b: Dsv4Block) -> list[Segment]:
    """Every byte of block ``b``: its header, each layer's il, each tensor header, each stream's rows.

    Args:
        b: The block.

    Returns:
        Its segments, in byte order.
    """
    fields = (
        "version, n_rows, ns, n_layer"
        if b.kind == "compressed"
        else "version, ratio, state_size, n_embd_state, ns, n_layer"
    )
    segs = [Segment(b.offset, 4 * len(fields.split(", ")), f"{b.name}: {fields}", False)]
    seen = set()
    for r in b.records:
        if r.header_offset not in seen:
            seen.add(r.header_offset)
            if r.kind in ("K", "KV"):  # the first tensor of its layer
                segs.append(Segment(r.header_offset - 4, 4, f"{b.name} layer {r.layer}: il", False))
            segs.append(Segment(r.header_offset, STREAMS_HEADER, f"{b.name} {r.name} header", False))
        if r.nbytes:
            segs.append(Segment(r.data_offset, r.nbytes, f"{b.name} stream {r.stream} {r.name} data", True))
    return segs


def check_layers(b: Dsv4Block, ils: Iterable[int]) -> Dsv4Block:
    """A layer map's layers for block ``b``: they must be the ones it writes.

    Args:
        b: The block.
        ils: The layer map's layers for the block's part.

    Returns:
        ``b`` unchanged.

    Raises:
        StateFormatError: The block writes other layers (a dump of another model?).
    """
    ils = [int(x) for x in ils]
    if list(b.layers) != ils:
        raise StateFormatError(
            f"layers {list(b.layers)} written, but the layer map gives {ils}: a dump of another model?",
            offset=b.offset,
            what=f"{b.name}: layers",
        )
    return b
