"""Frozen records of a parsed dump. Each keeps its byte offsets; payloads are views, not copies."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
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
    """Everything before the memory part. Fields a kind does not have are None.

    Attributes:
        kind: What produced the bytes.
        magic: The io magic 0xaf143cd8, 'ggsq' or 'ggsn'; None for a context state.
        version: The file format version (seq and session files only).
        seq_id: The seq_id a sequence dump was taken from.
        arch: llm_arch_name() (context states and session files).
        tokens: The prompt tokens of a file, an int32 view.
        tokens_offset: Byte offset of ``tokens``.
        nbytes: Bytes of the header: the memory part starts here.
    """

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
    the rows of the dumped cells, or by nothing in a metadata-only dump (``data`` is None).

    Attributes:
        part: The memory part's name.
        stream: The stream index.
        kind: K, V (attention) or R, P, S (recurrent; P: PLE conv rows).
        layer: The index of the record among its stream's records of this kind.
        type: The ggml type of the values.
        header_offset: Byte offset of the record's header.
        data_offset: Byte offset of its rows.
        n_cells: Cells (rows) in the record.
        row_size: Bytes of one cell's values (element size x n_embd when transposed).
        n_embd: Values per cell (n_embd_k_gqa / n_embd_v_gqa).
        transposed: V with v_trans=1: stored value-major, ``[n_embd][n_cells]``.
        n_head: Heads to shape views with (n_head_kv); None keeps rows flat.
        data: The payload, a uint8 view of the dump; None in a metadata-only dump.
        il: The model's layer index, when the layer map is known.
        header_nbytes: Bytes of the header when they do not end at data_offset (dsv4 blocks).
    """

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
        """Whether the dump holds the rows (False in a metadata-only dump)."""
        return self.data is not None

    @property
    def header_size(self) -> int:
        """Bytes of the record's header (type, row size ...) in the dump."""
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
        """Values per head: ``n_embd // n_head``, or ``n_embd`` without a head count."""
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
        """Raw bytes, one row per cell, shape (n_cells, row_size), a view of the dump.

        Raises:
            MetadataOnlyError: The dump is metadata-only (no rows).
            ValueError: The record is a transposed V (v_trans=1), which has no per-cell rows.
        """
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
        Transposed V comes back un-transposed through strides, still a view of the dump.

        Raises:
            MetadataOnlyError: The dump is metadata-only (no rows).
        """
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
        divides the head size. Needs the head count for K.

        Returns:
            The rotation size n.

        Raises:
            ValueError: A K record without a head count (parsed without ``n_head_kv``).
        """
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

        Args:
            unrotate: False keeps the values as stored; True undoes the Hadamard rotation of
                ``rotation_size()``; an int undoes one of that size.

        Returns:
            A new float32 array (not a view).

        Raises:
            MetadataOnlyError: The dump is metadata-only (no rows).
            ValueError: A block-quantized transposed V, rows that do not split into runs of the
                rotation size, or (K) no head count to derive it.
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
        """Byte offset in the dump of one value (of its block, for quantized types).

        Args:
            cell: The cell, counting the dump's cells of this stream.
            head: The KV head.
            element: The value within the head.

        Returns:
            The byte offset from the start of the dump.

        Raises:
            MetadataOnlyError: The dump is metadata-only (no value to point at).
            IndexError: ``cell``, ``head`` or ``element`` out of range.
        """
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

        Args:
            cell: The cache cell index (not the dump's cell).
            head: The KV head.
            element: The value within the head.
            kv_size: The cache's cell count per stream (``n_ctx`` per stream).
            dest_stream: The cache stream, by default the dumped one.
            n_embd_tensor: The V tensor's ne[0] when v_trans=1, by default ``n_embd``.

        Returns:
            The byte offset from the start of the tensor's data.

        Raises:
            IndexError: ``cell`` outside ``[0, kv_size)``, or ``head``/``element`` out of range.
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

    Attributes:
        part: The name of the memory part it belongs to.
        index: The stream index.
        offset: Byte offset of the cell_count field.
        cell_count: Cells in the stream.
        cells: The cells, a structured array (a copy).
        cells_offset: Byte offset of the first cell.
        cells_nbytes: Bytes of the cells.
        v_trans: v_trans (s_trans for recurrent memory); None for an empty KV stream.
        n_layer: Records per kind written; None for an empty KV stream.
        records: Every record of the stream, in byte order.
        end: The first byte after the stream.
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
    def k_records(self) -> tuple[TensorRecord, ...]:
        """The K records, in byte order."""
        return self._kind("K")

    @property
    def v_records(self) -> tuple[TensorRecord, ...]:
        """The V records, in byte order."""
        return self._kind("V")

    @property
    def k(self) -> LayerViews:
        """``k[il]``: the K values of layer il (the model's layer with a layer map, else the
        record index; see TensorRecord.values)."""
        return LayerViews(self._kind("K"))

    @property
    def v(self) -> LayerViews:
        """``v[il]``: the V values of layer il (un-transposed through strides when v_trans=1)."""
        return LayerViews(self._kind("V"))

    @property
    def r(self) -> LayerViews:
        """``r[il]``: the recurrent R rows (conv state) of layer il."""
        return LayerViews(self._kind("R"))

    @property
    def p(self) -> LayerViews:
        """PLE conv rows (recurrent layers with a PLE conv tensor, qwen4exp at this pin)."""
        return LayerViews(self._kind("P"))

    @property
    def s(self) -> LayerViews:
        """``s[il]``: the recurrent S rows (SSM / wkv state) of layer il."""
        return LayerViews(self._kind("S"))

    def views(self, kind: str) -> LayerViews:
        """The values of the records of ``kind`` by layer.

        Args:
            kind: K, V, R, P, S, or a llama_kv_cache_dsv4 compressor state's KV and SCORE (any
                case).

        Returns:
            The records' views, indexed by layer.
        """
        return LayerViews(self._kind(kind.upper()))


class LayerViews(Sequence):
    """The values of a run of records, indexed by layer: ``views[il]`` is the record whose
    ``key`` is il (the model's layer index when the layer map is known, else the record index),
    built when asked for. ``len()``, iteration and slices go by record order; ``.layers`` lists
    the keys, ``.record(il)`` gives the record itself.

    Args:
        records: The records, in order.

    Raises:
        TypeError: (indexing) A layer that is not an int.
        IndexError: (indexing) No record of that layer.
        MetadataOnlyError: (indexing) The dump is metadata-only.
    """

    __slots__ = ("records", "_by_key")

    def __init__(self, records: Iterable[TensorRecord]) -> None:
        self.records = tuple(records)
        self._by_key = {r.key: r for r in self.records}

    @property
    def layers(self) -> tuple[int, ...]:
        """The layer key of each record, in record order."""
        return tuple(r.key for r in self.records)

    def record(self, il: int) -> TensorRecord:
        """The record of layer ``il``.

        Args:
            il: The model's layer with a layer map, else the record index.

        Returns:
            The record.

        Raises:
            TypeError: ``il`` is not an int.
            IndexError: No record holds that layer.
        """
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
    llama_kv_cache_dsv4's blocks after its raw cache are Dsv4Block parts.

    Attributes:
        name: The part's name: kv, base, swa, recurrent, mla, lid, idx; a dsv4 block's csa ...
        kind: "kv", "recurrent", or a Dsv4Block's "compressed" / "compressor".
        offset: Byte offset of the part's first field.
        n_stream: n_stream as written; None where the part has no such field.
        streams: The streams, in order.
        end: The first byte after the part.
    """

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
    """One record of a dump's layout: where it is and how big (a row of ``Layout.table()``).

    Attributes:
        part: The memory part's name.
        stream: The stream index.
        kind: K, V, R, P, S (KV, SCORE for a dsv4 compressor state).
        layer: The record index among its stream's records of this kind.
        il: The model's layer, when the layer map is known.
        type: The ggml type's name.
        row_size: Bytes of one cell's values.
        header_offset: Byte offset of the record's header.
        data_offset: Byte offset of its rows.
        nbytes: Bytes of its rows in the dump (0 in a metadata-only dump).
    """

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
    """A run of bytes and what it is; a layout's segments tile the dump with no gap or overlap.

    Attributes:
        offset: Byte offset of the run.
        nbytes: Its length.
        what: What it is ("header (sequence dump)", "kv stream 0 K[il 3] data" ...).
        payload: True for rows (K/V/R/S values), False for metadata.
    """

    offset: int
    nbytes: int
    what: str
    payload: bool


@dataclass(frozen=True)
class Layout:
    """Where every byte of a dump is (``KVState.layout()``): one row per record, and totals.

    ``len()``, iteration and indexing go over the rows; ``str()`` is ``table()``.

    Attributes:
        rows: One LayoutRow per record, in dump order.
        segments: Every byte of the dump as header / field / cells / record header / payload.
        metadata_bytes: Bytes that are not rows.
        payload_bytes: Bytes of rows.
        total_bytes: Their sum: the dump's length.
        metadata_only: An ON_DEVICE dump: headers without rows.
        layers_known: False when "layer" numbers are record indices, not the model's il.
    """

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
        """Lines that qualify the table: a metadata-only dump, layer numbers that are indices.

        Returns:
            The notes, possibly none.
        """
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
        """The layout as text: one line per record, then the byte totals and the notes.

        Args:
            max_rows: Show at most this many records (the first and last halves); None: all.

        Returns:
            The table, lines joined by newlines.
        """
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
