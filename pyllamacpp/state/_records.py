"""Frozen records of a parsed dump. Each keeps its byte offsets; payloads are views, not copies."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ._types import GGMLType, hadamard


class DumpKind(str, enum.Enum):
    """What produced the bytes (the value is how ``describe()`` prints it)."""

    SEQUENCE = "sequence dump"  # llama_state_seq_get_data(_ext)
    SEQ_FILE = "seq file"  # llama_state_seq_save_file ('ggsq')
    CONTEXT = "whole-context state"  # llama_state_get_data
    SESSION_FILE = "session file"  # llama_state_save_file ('ggsn')

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Header:
    """Everything before the memory part. Fields a kind does not have are None."""

    kind: DumpKind
    magic: int | None  # io magic 0xaf143cd8, 'ggsq' or 'ggsn'; None for a context state
    version: int | None  # file formats only
    seq_id: int | None  # sequence dumps: the seq_id they were taken from
    arch: str | None  # context states and session files: llm_arch_name()
    tokens: np.ndarray | None = field(repr=False, compare=False)  # int32 view (files)
    tokens_offset: int | None
    nbytes: int  # the memory part starts here


class MetadataOnlyError(ValueError):
    """A record of a metadata-only dump (StateFlags.ON_DEVICE) has no rows to read."""


@dataclass(frozen=True)
class TensorRecord:
    """One per-layer record: ``i32 type, u64 row_size`` (or, for transposed V, ``i32 type,
    u32 element_size, u32 n_embd``; for a recurrent PLE row, ``u64 row_size`` alone) followed by
    the rows of the dumped cells, or by nothing in a metadata-only dump (``data`` is None)."""

    part: str
    stream: int
    kind: str  # K, V (attention) or R, P, S (recurrent; P: PLE conv rows)
    layer: int  # index of the record among its stream's records of this kind
    type: GGMLType
    header_offset: int
    data_offset: int
    n_cells: int
    row_size: int  # bytes of one cell's values (element size x n_embd when transposed)
    n_embd: int  # values per cell (n_embd_k_gqa / n_embd_v_gqa)
    transposed: bool  # V with v_trans=1: stored value-major, [n_embd][n_cells]
    n_head: int | None  # heads to shape views with (n_head_kv); None keeps rows flat
    data: np.ndarray | None = field(repr=False, compare=False)  # the payload, uint8 view; None: not in the dump
    il: int | None = None  # the model's layer index, when the layer map is known (see _layers)
    # bytes of the header when they do not end at data_offset: a llama_kv_cache_dsv4 block's
    # record of stream s > 0 shares its layer's one header, and its rows follow stream s - 1's
    header_nbytes: int | None = None

    @property
    def name(self) -> str:
        """How messages name the record: ``K[il 5]`` with a layer map, ``K[#2]`` (index) without."""
        return f"{self.kind}[il {self.il}]" if self.il is not None else f"{self.kind}[#{self.layer}]"

    @property
    def key(self) -> int:
        """What ``k[...]`` indexes by: the model's il when known, else the record index."""
        return self.il if self.il is not None else self.layer

    @property
    def has_data(self) -> bool:
        return self.data is not None

    @property
    def header_size(self) -> int:
        return self.header_nbytes if self.header_nbytes is not None else self.data_offset - self.header_offset

    @property
    def nbytes(self) -> int:
        """Payload bytes in the dump: 0 in a metadata-only dump."""
        return self.rows_nbytes if self.data is not None else 0

    @property
    def rows_nbytes(self) -> int:
        """Bytes the rows take (in the dump, or in device memory for a metadata-only dump)."""
        return self.n_cells * self.row_size

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head if self.n_head else self.n_embd

    def _payload(self) -> np.ndarray:
        if self.data is None:
            raise MetadataOnlyError(
                f"{self.part} stream {self.stream} {self.name}: this is a metadata-only dump "
                f"(StateFlags.ON_DEVICE): llama.cpp wrote the record headers and kept the "
                f"{self.rows_nbytes:,} bytes of rows in its own memory (llama_io_write_device)"
            )
        return self.data

    @property
    def rows(self) -> np.ndarray:
        """Raw bytes, one row per cell, shape (n_cells, row_size); transposed V has no such rows."""
        data = self._payload()
        if self.transposed:
            raise ValueError(
                f"{self.kind}[{self.layer}] is stored transposed (v_trans=1): it has no per-cell byte rows; use .values"
            )
        return data.reshape(self.n_cells, self.row_size)

    @property
    def values(self) -> np.ndarray:
        """Zero-copy view: (cells, n_head, head_dim) for plain types ((cells, n_embd) without a head
        count), the raw rows (cells, row_size) for quantized types (see dequantize()).
        Transposed V comes back un-transposed through strides, still a view of the dump."""
        t = self.type
        if t.dtype is None:
            return self.rows
        shape = (self.n_cells, self.n_head, self.head_dim) if self.n_head else (self.n_cells, self.n_embd)
        flat = self._payload().view(t.dtype)
        el = t.dtype.itemsize
        if self.transposed:  # [n_embd][n_cells]: value j of cell c at (j * n_cells + c)
            col = self.n_cells * el
            strides = (el, self.head_dim * col, col) if self.n_head else (el, col)
        else:
            strides = (self.row_size, self.head_dim * el, el) if self.n_head else (self.row_size, el)
        return np.lib.stride_tricks.as_strided(flat, shape, strides, writeable=flat.flags.writeable)

    def rotation_size(self) -> int:
        """n of the Hadamard rotation llama.cpp applies to a quantized cache (attn_rot_k/_v in
        llama_kv_cache's constructor): 64 for V; for K the largest power of two >= 64 that
        divides the head size. Needs the head count for K."""
        if self.kind == "V":
            return 64
        if not self.n_head:
            raise ValueError(
                "the K rotation size depends on the head size: parse with n_head_kv=, or pass dequantize(unrotate=n)"
            )
        n = 64
        while self.head_dim % (2 * n) == 0:
            n *= 2
        return n

    def dequantize(self, *, unrotate: bool | int = False) -> np.ndarray:
        """float32 copy of the values, shaped like ``values`` would be for a plain type.

        With a block-quantized cache type (and a head size that is a multiple of 64, unless
        LLAMA_ATTN_ROT_DISABLE is set), llama.cpp stores K and V rotated: each run of n values
        multiplied by the n x n Walsh-Hadamard matrix, and Q and the attention output rotated to
        match. ``unrotate=True`` undoes it (the matrix is its own inverse), giving values
        comparable with an F16 cache; an int says n. The dump does not record whether the
        rotation was on: that is for the caller to know.
        """
        if self.transposed:
            if self.type.quantized:
                raise ValueError("a block-quantized transposed V cannot be dequantized per cell")
            out = self.type.dequantize(np.ascontiguousarray(self.values).view(np.uint8).reshape(self.n_cells, -1))
        else:
            out = self.type.dequantize(self.rows)
        if unrotate:
            n = self.rotation_size() if unrotate is True else int(unrotate)
            if self.n_embd % n:
                raise ValueError(f"rows of {self.n_embd} values do not split into runs of {n}")
            out = (out.reshape(self.n_cells, -1, n) @ hadamard(n)).reshape(self.n_cells, self.n_embd)
        return out.reshape((self.n_cells, self.n_head, self.head_dim) if self.n_head else (self.n_cells, self.n_embd))

    def _index(self, cell: int, head: int, element: int) -> int:
        hd = self.head_dim
        if not 0 <= cell < self.n_cells:
            raise IndexError(f"cell {cell} out of range: {self.kind}[{self.layer}] holds {self.n_cells} cells")
        n_head = self.n_head or 1
        if not 0 <= head < n_head or not 0 <= element < hd:
            raise IndexError(f"head {head}, element {element} out of range ({n_head} heads x {hd})")
        return head * hd + element

    def address(self, cell: int, head: int = 0, element: int = 0) -> int:
        """Byte offset in the dump of one value (of its block, for quantized types)."""
        self._payload()  # a metadata-only dump holds no value to point at
        j = self._index(cell, head, element)
        if self.transposed:
            return self.data_offset + (j * self.n_cells + cell) * self.type.type_size
        return self.data_offset + cell * self.row_size + self.type.byte_in_row(j)

    def tensor_offset(
        self,
        cell: int,
        head: int = 0,
        element: int = 0,
        *,
        kv_size: int,
        dest_stream: int | None = None,
        n_embd_tensor: int | None = None,
    ) -> int:
        """Byte offset of the same value inside llama.cpp's per-layer cache tensor.

        The tensor is ``ggml_new_tensor_3d(type, n_embd, kv_size, n_stream)``. K, and V when
        v_trans=0: row-major, ``stream*kv_size*row_size + cell*row_size + byte_in_row(j)``.
        V when v_trans=1 is used transposed, value-major per stream: value j of cell c is element
        ``j*kv_size + c``; ``n_embd_tensor`` is the tensor's ne[0] (n_embd_v_gqa_max when the
        layers' V sizes differ). ``cell`` is the cache cell index: a whole-context restore puts
        dump cell i in cell i, a sequence restore wherever find_slot() finds room.
        ``dest_stream`` is the cache stream (default: the stream the record was dumped from; a
        sequence restore uses the destination seq_id's stream).
        """
        j = self._index(0, head, element)
        if not 0 <= cell < kv_size:
            raise IndexError(f"cell {cell} out of range for kv_size {kv_size}")
        stream = self.stream if dest_stream is None else dest_stream
        if self.transposed:
            ne0 = n_embd_tensor or self.n_embd
            return (stream * ne0 * kv_size + j * kv_size + cell) * self.type.type_size
        return (stream * kv_size + cell) * self.row_size + self.type.byte_in_row(j)


@dataclass(frozen=True)
class Stream:
    """One stream of a memory part: its cells and per-layer records.

    KV caches: ``u32 cell_count``, cells, then (if any cells) ``u32 v_trans, u32 n_layer``, K
    records, V records. Recurrent memory: the same, with R and S records, and written even when
    empty. ``cells`` is a structured array (a copy: cells have variable length): pos, n_seq_id,
    seq_id (padded with -1), x/y/tok when the cells carry llama_kv_cell_ext, and offset/nbytes of
    each cell in the dump. A llama_kv_cache_dsv4 block (Dsv4Block) has no cells: its stream s
    holds stream s's rows of every layer (they interleave per layer in the dump, so ``offset``
    and ``end`` are the block's).
    """

    part: str
    index: int
    offset: int  # of the cell_count field
    cell_count: int
    cells: np.ndarray = field(repr=False, compare=False)
    cells_offset: int
    cells_nbytes: int
    v_trans: int | None  # None for an empty KV stream (nothing written after cell_count)
    n_layer: int | None
    records: tuple[TensorRecord, ...] = field(repr=False)
    end: int  # first byte after this stream

    def _kind(self, kind: str) -> tuple[TensorRecord, ...]:
        return tuple(r for r in self.records if r.kind == kind)

    @property
    def k_records(self):
        return self._kind("K")

    @property
    def v_records(self):
        return self._kind("V")

    @property
    def k(self) -> LayerViews:
        """``k[il]``: the K values of layer il (the model's layer with a layer map, else the
        record index; see TensorRecord.values)."""
        return LayerViews(self._kind("K"))

    @property
    def v(self) -> LayerViews:
        return LayerViews(self._kind("V"))

    @property
    def r(self) -> LayerViews:
        return LayerViews(self._kind("R"))

    @property
    def p(self) -> LayerViews:
        """PLE conv rows (recurrent layers with a PLE conv tensor, qwen4exp at this pin)."""
        return LayerViews(self._kind("P"))

    @property
    def s(self) -> LayerViews:
        return LayerViews(self._kind("S"))

    def views(self, kind: str) -> LayerViews:
        """The values of the records of ``kind`` by layer: K, V, R, P, S, or a llama_kv_cache_dsv4
        compressor state's KV and SCORE."""
        return LayerViews(self._kind(kind.upper()))


class LayerViews(Sequence):
    """The values of a run of records, indexed by layer: ``views[il]`` is the record whose
    ``key`` is il (the model's layer index when the layer map is known, else the record index),
    built when asked for. ``len()``, iteration and slices go by record order; ``.layers`` lists
    the keys, ``.record(il)`` gives the record itself."""

    __slots__ = ("records", "_by_key")

    def __init__(self, records):
        self.records = tuple(records)
        self._by_key = {r.key: r for r in self.records}

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(r.key for r in self.records)

    def record(self, il: int) -> TensorRecord:
        if isinstance(il, (bool, np.bool_)) or not isinstance(il, (int, np.integer)):
            raise TypeError(f"layers are ints, not {type(il).__name__}")
        r = self._by_key.get(int(il))
        if r is None:
            what = "model layers (il)" if self.records and self.records[0].il is not None else "record indices"
            raise IndexError(f"no layer {il}: these records hold {what} {list(self.layers)}")
        return r

    def __getitem__(self, il):
        if isinstance(il, slice):
            return tuple(r.values for r in self.records[il])
        return self.record(il).values

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return (r.values for r in self.records)

    def __contains__(self, il) -> bool:
        return il in self._by_key

    def __repr__(self) -> str:
        return f"<LayerViews {len(self.records)} records, layers {list(self.layers)}>"


@dataclass(frozen=True)
class MemoryPart:
    """One memory module's state: a KV cache (``u32 n_stream`` then streams) or recurrent memory
    (one stream, no n_stream field). ``name``: kv, or base/swa (iSWA), plus recurrent (hybrid).
    llama_kv_cache_dsv4's blocks after its raw cache are Dsv4Block parts."""

    name: str
    kind: str  # "kv", "recurrent", or a Dsv4Block's "compressed" / "compressor"
    offset: int
    n_stream: int | None
    streams: tuple[Stream, ...]
    end: int


@dataclass(frozen=True)
class Dsv4Block(MemoryPart):
    """One block llama_kv_cache_dsv4::state_write writes after its raw iSWA cache
    (llama-kv-cache-dsv4.cpp). kind "compressed": a compressed K cache (csa, hca, lid;
    dsv4_state_write_k_cache): ``u32 version, u32 n_rows, u32 ns, u32 n_layer``; kind
    "compressor": a compressor state (csa-state, hca-state, lid-state;
    llama_dsv4_comp_state::state_write): ``u32 version, u32 ratio, u32 state_size,
    u32 n_embd_state, u32 ns, u32 n_layer``. Then per layer ``u32 il`` and one tensor record
    (K; a compressor state two: KV, SCORE), each ``i32 type, u64 ne0, u64 rows, u64 row_size``
    followed by ns chunks of rows x row_size bytes (none in a metadata-only dump).

    Rows are not cells: row r of a compressed cache holds positions [r*ratio, (r+1)*ratio) of the
    sequence; a compressor state's row i is the ring slot of the positions p with p % state_size
    == i. ``n_stream`` is ns; streams[s].records are stream s's records, which carry the il
    written in the dump; ``records`` lists them all in byte order."""

    version: int = 0
    ratio: int = 0  # 4 (csa, lid) or 128 (hca): positions per compressed row
    n_rows: int = 0  # rows per layer and stream: (pos_max + 1) / ratio clipped, or state_size
    n_layer: int = 0
    layers: tuple[int, ...] = ()  # il of each layer, as written
    state_size: int | None = None  # compressor states only
    n_embd_state: int | None = None  # compressor states only
    records: tuple[TensorRecord, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class LayoutRow:
    part: str
    stream: int
    kind: str
    layer: int  # record index
    il: int | None  # the model's layer, when the layer map is known
    type: str
    row_size: int
    header_offset: int
    data_offset: int
    nbytes: int


@dataclass(frozen=True)
class Segment:
    """A run of bytes and what it is; a layout's segments tile the dump with no gap or overlap."""

    offset: int
    nbytes: int
    what: str
    payload: bool


@dataclass(frozen=True)
class Layout:
    rows: tuple[LayoutRow, ...]
    segments: tuple[Segment, ...]
    metadata_bytes: int
    payload_bytes: int
    total_bytes: int
    metadata_only: bool = False  # an ON_DEVICE dump: headers without rows
    layers_known: bool = True  # False: "layer" numbers are record indices, not the model's il

    def __len__(self) -> int:
        """The number of records (rows)."""
        return len(self.rows)

    def __iter__(self) -> Iterator[LayoutRow]:
        """The records (LayoutRow), in dump order."""
        return iter(self.rows)

    def __getitem__(self, i: int) -> LayoutRow:
        return self.rows[i]

    def notes(self) -> list[str]:
        out = []
        if self.metadata_only:
            out.append(
                "metadata only (ON_DEVICE): every record is a header; its rows stayed in "
                "llama.cpp's device memory, so the payload is 0 bytes"
            )
        if not self.layers_known:
            out.append(
                "il: layer numbers are record indices within each part that does not write "
                "them (no layer map: pass model= or keep a sidecar with 'layers')"
            )
        return out

    def table(self, max_rows: int | None = None) -> str:
        kw = max([2] + [len(r.kind) for r in self.rows])  # KV, SCORE: a llama_kv_cache_dsv4 compressor state
        head = (
            f"{'part':<9} {'strm':>4} {'kv':<{kw}} {'#':>3} {'il':>4} {'type':<6} {'row':>6} "
            f"{'hdr@':>10} {'data@':>10} {'bytes':>10}"
        )
        rows: list[LayoutRow | None] = list(self.rows)
        skipped = 0
        if max_rows is not None and len(rows) > max_rows:
            skipped = len(rows) - max_rows
            rows = rows[: max_rows // 2] + [None] + rows[len(rows) - (max_rows - max_rows // 2) :]
        lines = [head]
        for r in rows:
            if r is None:
                lines.append(f"  ... {skipped} more records ...")
                continue
            il = "-" if r.il is None else r.il
            lines.append(
                f"{r.part:<9} {r.stream:>4} {r.kind:<{kw}} {r.layer:>3} {il:>4} {r.type:<6} {r.row_size:>6} "
                f"{r.header_offset:>10} {r.data_offset:>10} {r.nbytes:>10}"
            )
        lines.append(f"metadata {self.metadata_bytes:,} B + payload {self.payload_bytes:,} B = {self.total_bytes:,} B")
        lines.extend(self.notes())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
