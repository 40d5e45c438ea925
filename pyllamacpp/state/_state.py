"""``parse()`` and the KVState it returns: records, views, layout, addresses, bytes out."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ._buffer import Buffer
from ._parse import parse_header, parse_memory
from ._records import DumpKind, Header, Layout, LayoutRow, MemoryPart, Segment, Stream, TensorRecord
from ._sidecar import model_facts, read_sidecar

_SOURCES = {
    DumpKind.SEQUENCE: "llama_state_seq_get_data", DumpKind.SEQ_FILE: "llama_state_seq_save_file",
    DumpKind.CONTEXT: "llama_state_get_data", DumpKind.SESSION_FILE: "llama_state_save_file",
}


def _as_array(data, writable: bool | None) -> tuple[np.ndarray, str, Path | None]:
    """The dump as a 1-D uint8 array, copied only when writable=True asks for it."""
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.stat().st_size == 0:  # mmap cannot map an empty file; the parser reports it
            return np.zeros(0, np.uint8), str(path), path
        # "c": copy-on-write; edits stay in this process and never reach the file
        arr = np.memmap(path, dtype=np.uint8, mode="c" if writable else "r")
        return arr, str(path), path
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise TypeError(f"a state dump array must be 1-D contiguous uint8, not {data.dtype} {data.shape}")
        arr, source = data, "numpy array"
    else:
        try:
            arr = np.frombuffer(data, dtype=np.uint8)
        except TypeError:
            raise TypeError(f"parse() takes bytes-like data, a uint8 array or a path, "
                            f"not {type(data).__name__}") from None
        source = type(data).__name__
    if writable and not arr.flags.writeable:
        arr, source = arr.copy(), f"{source} (copied: writable=True)"
    elif writable is False and arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr, source, None


def parse(data, *, n_head_kv: int | None = None, model=None, writable: bool | None = None,
          memory: str | None = None, cell_ext: bool | None = None, has_v: bool | None = None) -> "KVState":
    """Parse a state dump: bytes-like, a uint8 array, or a path (np.memmap'ed, never read whole).

    It may come from llama_state_seq_get_data(_ext), llama_state_get_data,
    llama_state_seq_save_file or llama_state_save_file; ``KVState.kind`` says which.

    ``n_head_kv`` (or ``model=``: a GGUF path or an object with ``n_head_kv``; else, for a path,
    its ``<path>.json`` sidecar) shapes views as (cells, n_head_kv, head_dim); without it rows
    stay (cells, n_embd_gqa). ``writable``: None keeps the input's writability (bytes are
    read-only, a bytearray or writable array gives writable views, zero-copy); True copies
    read-only input once (a path is mapped copy-on-write: the file is never changed); False
    forces read-only views. ``memory`` ("kv", "iswa", "hybrid", "hybrid-iswa", "recurrent"),
    ``cell_ext`` and ``has_v`` pin what is otherwise detected (see _parse.parse_memory).
    Raises StateFormatError (a ValueError) on anything that does not follow the format.
    """
    arr, source, path = _as_array(data, writable)
    sidecar = read_sidecar(path) if path is not None else None
    if n_head_kv is None and model is not None:
        n_head_kv = model_facts(model).get("n_head_kv")
    if n_head_kv is None and sidecar:
        n_head_kv = sidecar.get("n_head_kv")
    if n_head_kv is not None and (not isinstance(n_head_kv, (int, np.integer)) or n_head_kv < 1):
        raise ValueError(f"n_head_kv must be a positive int, not {n_head_kv!r}")
    n_head_kv = int(n_head_kv) if n_head_kv is not None else None
    buf = Buffer(arr)
    header = parse_header(buf)
    parts, options = parse_memory(buf, header.nbytes, memory=memory, cell_ext=cell_ext, has_v=has_v,
                                  n_head=n_head_kv)
    return KVState(buf, header, parts, n_head_kv=n_head_kv, options=options, source=source, sidecar=sidecar)


class KVState:
    """A parsed dump. Payloads are views of the input (see ``writable``); records and cells
    carry their byte offsets. ``k``/``v``/``cells`` read the only non-empty stream of the only
    part; ``stream(part=, stream=)`` picks one when there are several."""

    def __init__(self, buf: Buffer, header: Header, parts: tuple[MemoryPart, ...], *, n_head_kv,
                 options: dict, source: str, sidecar: dict | None):
        self._buf, self.header, self.parts = buf, header, parts
        self.n_head_kv, self.options, self.source, self.sidecar = n_head_kv, options, source, sidecar

    # --- what it is -------------------------------------------------------------------------------
    @property
    def kind(self) -> DumpKind:
        return self.header.kind

    @property
    def buffer(self) -> np.ndarray:
        """The whole dump as a uint8 array (the input itself, a copy of it, or a memmap)."""
        return self._buf.data

    @property
    def nbytes(self) -> int:
        return self._buf.size

    @property
    def writable(self) -> bool:
        return self._buf.writable

    @property
    def tokens(self) -> np.ndarray | None:
        return self.header.tokens

    # --- picking a part, a stream, a record ----------------------------------------------------------
    def part(self, name: str | None = None) -> MemoryPart:
        if name is None:
            if len(self.parts) != 1:
                raise ValueError(f"this dump has parts {[p.name for p in self.parts]}: pass part=")
            return self.parts[0]
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"no part {name!r}; this dump has {[p.name for p in self.parts]}")

    def stream(self, part: str | None = None, stream: int | None = None) -> Stream:
        p = self.part(part)
        if stream is not None:
            if not 0 <= stream < len(p.streams):
                raise IndexError(f"stream {stream} out of range: part {p.name} has {len(p.streams)}")
            return p.streams[stream]
        full = [s for s in p.streams if s.cell_count]
        if len(full) > 1:
            raise ValueError(f"part {p.name} has cells in streams {[s.index for s in full]}: pass stream=")
        return full[0] if full else p.streams[0]

    @property
    def cells(self) -> np.ndarray:
        return self.stream().cells

    @property
    def k(self) -> tuple[np.ndarray, ...]:
        """``k[il]``: zero-copy K of layer record il, (cells, n_head_kv, head_dim) for plain types."""
        return self.stream().k

    @property
    def v(self) -> tuple[np.ndarray, ...]:
        """``v[il]``: zero-copy V, un-transposed through strides when v_trans=1."""
        return self.stream().v

    def record(self, kind: str, layer: int, *, part: str | None = None, stream: int | None = None) -> TensorRecord:
        recs = [r for r in self.stream(part, stream).records if r.kind == kind.upper()]
        if not 0 <= layer < len(recs):
            raise IndexError(f"{kind}[{layer}] out of range: {len(recs)} {kind.upper()} records")
        return recs[layer]

    def records(self):
        for p in self.parts:
            for s in p.streams:
                yield from s.records

    # --- where things are ----------------------------------------------------------------------------
    def address(self, kind: str, layer: int, cell: int, head: int = 0, element: int = 0, *,
                part: str | None = None, stream: int | None = None) -> int:
        """Byte offset in the dump of one value (``cell`` counts the dump's cells)."""
        return self.record(kind, layer, part=part, stream=stream).address(cell, head, element)

    def tensor_offset(self, kind: str, layer: int, cell: int, head: int = 0, element: int = 0, *,
                      kv_size: int, part: str | None = None, stream: int | None = None,
                      dest_stream: int | None = None, n_embd_tensor: int | None = None) -> int:
        """Byte offset of one value in llama.cpp's per-layer cache tensor (see
        TensorRecord.tensor_offset: row-major for K and v_trans=0 V, value-major for v_trans=1).
        ``part``/``stream`` pick the record in the dump; ``cell``/``dest_stream`` the cache slot."""
        rec = self.record(kind, layer, part=part, stream=stream)
        return rec.tensor_offset(cell, head, element, kv_size=kv_size, dest_stream=dest_stream,
                                 n_embd_tensor=n_embd_tensor)

    def segments(self) -> list[Segment]:
        """Every byte of the dump, in order, as header / field / cells / record header / payload."""
        segs = [Segment(0, self.header.nbytes, f"header ({self.kind})", False)]
        for p in self.parts:
            if p.n_stream is not None:
                segs.append(Segment(p.offset, 4, f"{p.name}: n_stream", False))
            for s in p.streams:
                segs.append(Segment(s.offset, 4, f"{p.name} stream {s.index}: cell_count", False))
                if s.cells_nbytes:
                    segs.append(Segment(s.cells_offset, s.cells_nbytes, f"{p.name} stream {s.index}: "
                                        f"{s.cell_count} cells", False))
                if s.v_trans is not None:
                    segs.append(Segment(s.cells_offset + s.cells_nbytes, 8,
                                        f"{p.name} stream {s.index}: {'v' if p.kind == 'kv' else 's'}_trans, n_layer",
                                        False))
                for r in s.records:
                    segs.append(Segment(r.header_offset, r.header_size, f"{p.name} stream {s.index} "
                                        f"{r.kind}[{r.layer}] header", False))
                    if r.nbytes:
                        segs.append(Segment(r.data_offset, r.nbytes, f"{p.name} stream {s.index} "
                                            f"{r.kind}[{r.layer}] data", True))
        return segs

    def layout(self) -> Layout:
        """One row per record plus metadata/payload totals, which add up to the input length."""
        rows = tuple(LayoutRow(r.part, r.stream, r.kind, r.layer, r.type.name, r.row_size,
                               r.header_offset, r.data_offset, r.nbytes) for r in self.records())
        segs = tuple(self.segments())
        payload = sum(s.nbytes for s in segs if s.payload)
        meta = sum(s.nbytes for s in segs if not s.payload)
        return Layout(rows, segs, meta, payload, meta + payload)

    # --- bytes out -----------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The dump as bytes, with any edits made through the views."""
        return self._buf.data.tobytes()

    def select_cells(self, mask, *, part: str | None = None, stream: int | None = None) -> "KVState":
        """A new, smaller dump keeping the selected cells (in every layer, K and V); see _write."""
        from ._write import select_cells
        return select_cells(self, mask, part=part, stream=stream)

    # --- text ----------------------------------------------------------------------------------------
    def describe(self, *, max_rows: int = 8, n_cells: int = 3, n_values: int = 4) -> str:
        """A readable summary: kind, header, parts and streams, layout table, first cells' K/V."""
        from ._describe import describe
        return describe(self, max_rows=max_rows, n_cells=n_cells, n_values=n_values)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        cells = sum(s.cell_count for p in self.parts for s in p.streams)
        return (f"<KVState {self.kind}: {self.nbytes:,} bytes, parts {[p.name for p in self.parts]}, "
                f"{cells} cells, n_head_kv={self.n_head_kv}>")
