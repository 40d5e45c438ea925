"""``parse()`` and the KVState it returns: records, views, layout, addresses, bytes out."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from . import _dsv4
from ._buffer import Buffer, StateFormatError
from ._memory import ON_DEVICE, PARTIAL_ONLY, memory_of, parse_memory, written_parts
from ._parse import parse_header
from ._records import (
    Dsv4Block,
    DumpKind,
    Header,
    LayerViews,
    Layout,
    LayoutRow,
    MemoryPart,
    Segment,
    Stream,
    TensorRecord,
)
from ._sidecar import model_facts, read_sidecar

_SOURCES = {
    DumpKind.SEQUENCE: "llama_state_seq_get_data",
    DumpKind.SEQ_FILE: "llama_state_seq_save_file",
    DumpKind.CONTEXT: "llama_state_get_data",
    DumpKind.SESSION_FILE: "llama_state_save_file",
}


def _as_array(data, writable: bool | None) -> tuple[np.ndarray, str, Path | None]:
    """The dump as a 1-D uint8 array, copied only when writable=True asks for it."""
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.stat().st_size == 0:  # mmap cannot map an empty file; the parser reports it
            return np.zeros(0, np.uint8), str(path), path
        # "c": copy-on-write; edits stay in this process and never reach the file
        arr: np.ndarray = np.memmap(path, dtype=np.uint8, mode="c" if writable else "r")
        return arr, str(path), path
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
            raise TypeError(f"a state dump array must be 1-D contiguous uint8, not {data.dtype} {data.shape}")
        arr, source = data, "numpy array"
    else:
        try:
            arr = np.frombuffer(data, dtype=np.uint8)
        except TypeError:
            raise TypeError(
                f"parse() takes bytes-like data, a uint8 array or a path, not {type(data).__name__}"
            ) from None
        source = type(data).__name__
    if writable and not arr.flags.writeable:
        arr, source = arr.copy(), f"{source} (copied: writable=True)"
    elif writable is False and arr.flags.writeable:
        arr = arr.view()
        arr.flags.writeable = False
    return arr, source, None


def parse(
    data: str | os.PathLike | np.ndarray | bytes | bytearray | memoryview,
    *,
    n_head_kv: int | None = None,
    model: Any = None,
    writable: bool | None = None,
    memory: str | None = None,
    cell_ext: bool | None = None,
    has_v: bool | None = None,
    metadata_only: bool | None = None,
    layers: dict | None = None,
    partial: bool | None = None,
    flags: int | None = None,
) -> KVState:
    """Parse a state dump: bytes-like, a uint8 array, or a path (np.memmap'ed, never read whole).

    It may come from llama_state_seq_get_data(_ext), llama_state_get_data,
    llama_state_seq_save_file or llama_state_save_file; ``KVState.kind`` says which. For a path,
    its ``<path>.json`` sidecar, when present, gives what the arguments below do not.

    Args:
        data: the dump: bytes-like, a uint8 array, or a path.
        n_head_kv: shapes views as (cells, n_head_kv, head_dim); without it (or ``model``, or a
            sidecar) rows stay (cells, n_embd_gqa).
        model: a GGUF path or an object with ``n_head_kv`` (a ``Model``): gives ``n_head_kv``
            and the layer map.
        writable: None keeps the input's writability (bytes are read-only, a bytearray or
            writable array gives writable views, zero-copy); True copies read-only input once (a
            path is mapped copy-on-write: the file is never changed); False forces read-only views.
        memory: pins the memory layout ("kv", "iswa", "hybrid", "hybrid-iswa", "recurrent",
            "dsa", "msa", "dsa-iswa", "hybrid-idx", "dsv4"); detected otherwise.
        cell_ext: pins whether cells carry ``llama_kv_cell_ext``; detected otherwise.
        has_v: pins whether KV parts have V records; detected otherwise.
        metadata_only: pins a StateFlags.ON_DEVICE dump (headers without rows); detected otherwise
            (a sequence dump only: files and whole-context states always hold their rows).
        layers: the layer map: part name -> the model's il of each record (see _layers); without
            one, layer numbers are record indices.
        partial: True when written with StateFlags.PARTIAL_ONLY, so only the memory's partial
            part is there (an iSWA cache's swa part, a hybrid memory's recurrent part; plain KV
            caches and recurrent memories write all of themselves). With a layer map a partial
            dump is told apart from a full one by reading.
        flags: the ``llama_state_seq_flags`` the dump was made with (a sidecar's ``flags``): sets
            ``partial`` and, with ON_DEVICE, ``metadata_only``.

    Returns:
        A ``KVState``: header, cells, and per layer zero-copy views of K and V.

    Raises:
        StateFormatError: (a ValueError) anything that does not follow the format, or that
            contradicts the layer map; the message gives the byte offset, what was being read, the
            bytes needed and the bytes left.
        ValueError: Bad arguments: ``flags`` that are not llama_state_seq_flags, ``partial``
            contradicting ``flags``, ``n_head_kv`` not a positive int, an unknown ``memory``.
        TypeError: ``data`` is not bytes-like, a 1-D contiguous uint8 array or a path.
        OSError: A path that cannot be opened (FileNotFoundError ...).
    """
    arr, source, path = _as_array(data, writable)
    sidecar = read_sidecar(path) if path is not None else None
    if flags is None and partial is None and sidecar and sidecar.get("flags") is not None:
        flags = sidecar["flags"]
    if flags is not None:
        if isinstance(flags, bool) or not isinstance(flags, (int, np.integer)) or flags & ~(PARTIAL_ONLY | ON_DEVICE):
            raise ValueError(f"flags={flags!r}: expected llama_state_seq_flags (PARTIAL_ONLY=1 | ON_DEVICE=2)")
        if partial is not None and bool(partial) != bool(flags & PARTIAL_ONLY):
            raise ValueError(f"partial={partial!r} contradicts flags={int(flags)}")
        partial = bool(flags & PARTIAL_ONLY)
        if metadata_only is None and flags & ON_DEVICE:
            metadata_only = True  # llama_io_write_device writes headers only, on every backend
    facts = model_facts(model) if model is not None else {}
    if n_head_kv is None:
        # 0 (a sidecar of a hybrid model, whose layer 0 has no attention) says nothing: rows stay flat
        n_head_kv = facts.get("n_head_kv") or (sidecar or {}).get("n_head_kv") or None
    if n_head_kv is not None and (not isinstance(n_head_kv, (int, np.integer)) or n_head_kv < 1):
        raise ValueError(f"n_head_kv must be a positive int, not {n_head_kv!r}")
    n_head_kv = int(n_head_kv) if n_head_kv is not None else None
    if layers is None:
        layers = facts.get("layers") or (sidecar or {}).get("layers")
    buf = Buffer(arr)
    header = parse_header(buf)
    if header.kind is not DumpKind.SEQUENCE:
        # llama_state_seq_save_file and llama_context::state_write_data write with flags 0
        if partial:
            raise StateFormatError(
                f"a {header.kind} is written without PARTIAL_ONLY: it cannot be partial", offset=0, what="dump kind"
            )
        partial = False
        # ... and with every row (llama_io_write_file / _host): only a sequence dump can be ON_DEVICE
        if metadata_only:
            raise StateFormatError(
                f"a {header.kind} is written with its rows: it cannot be metadata-only", offset=0, what="dump kind"
            )
        metadata_only = False
    # the sequence it was written for: llama_state_seq_get_data writes it; whole states are of
    # every sequence (-1); a seq file does not say
    seq_id = header.seq_id if header.kind is DumpKind.SEQUENCE else None if header.kind is DumpKind.SEQ_FILE else -1
    kw: dict[str, Any] = dict(
        cell_ext=cell_ext, has_v=has_v, n_head=n_head_kv, metadata_only=metadata_only, partial=partial, seq_id=seq_id
    )
    # the memory: memory=, else the layer map's, else the model's or sidecar's "memory" (an arch
    # whose memory _layers knows but not its layer rule)
    by_map = memory is None and (memory_of(layers) or facts.get("memory") or (sidecar or {}).get("memory"))
    try:
        parts, options = parse_memory(buf, header.nbytes, memory=memory or by_map or None, **kw)
    except StateFormatError as e:
        if not by_map:
            raise
        # does it read as another memory? then say the map is not this dump's
        try:
            other, opts = parse_memory(buf, header.nbytes, **kw)
        except StateFormatError:
            raise e from None
        want = " or ".join(
            str([n for _, n in written_parts(by_map, p)]) for p in ((False, True) if partial is None else (partial,))
        )
        raise StateFormatError(
            f"the {'layer map' if layers else 'model'} is for memory {by_map!r} (parts {want}), "
            "but the dump reads as memory "
            f"{opts['memory']!r} (parts {[p.name for p in other]}): a dump of another model?",
            offset=header.nbytes,
            what="memory layout",
        ) from None
    if layers:
        parts = tuple(_number_layers(p, layers.get(p.name)) for p in parts)
    options["layers"] = {p.name: layers[p.name] for p in parts if p.name in layers} if layers else None
    return KVState(buf, header, parts, n_head_kv=n_head_kv, options=options, source=source, sidecar=sidecar)


def _number_layers(part: MemoryPart, ils) -> MemoryPart:
    """Give every record of ``part`` its model layer: the i-th record of each kind is layer
    ``ils[i]`` (a part writes its layers in increasing il: the llama_kv_cache constructor and
    llama_memory_recurrent's state_write_data both walk il upwards). A P record shares its R's."""
    if ils is None:
        return part
    if isinstance(part, Dsv4Block):  # it writes its layers' il: the map must say the same
        return _dsv4.check_layers(part, ils)
    ils = [int(x) for x in ils]
    streams = []
    for s in part.streams:
        for kind in sorted({r.kind for r in s.records} - {"P"}):  # P: only the layers with PLE rows
            recs = [r for r in s.records if r.kind == kind]
            if len(recs) != len(ils):
                raise StateFormatError(
                    f"{len(recs)} {kind} records, but the layer map gives part {part.name} "
                    f"{len(ils)} layers {ils}: a dump of another model?",
                    offset=recs[0].header_offset,
                    what=f"{part.name} stream {s.index} {kind} records",
                )
        records = tuple(dataclasses.replace(r, il=ils[r.layer]) for r in s.records)
        streams.append(dataclasses.replace(s, records=records))
    return dataclasses.replace(part, streams=tuple(streams))


class KVState:
    """A parsed dump (made by ``parse()``). Payloads are views of the input (see ``writable``);
    records and cells carry their byte offsets. ``k``/``v``/``cells`` read the only non-empty
    stream of the only part; ``stream(part=, stream=)`` picks one when there are several.

    Args:
        buf: The dump's bytes.
        header: Its parsed header.
        parts: Its parsed memory parts.
        n_head_kv: The head count views are shaped with, or None (flat rows).
        options: The reading that parsed it (memory, partial, cell_ext, has_v, metadata_only,
            layers).
        source: What the bytes came from (a path, "bytes" ...), for messages.
        sidecar: The ``<path>.json`` sidecar read with a path, or None.
    """

    def __init__(
        self,
        buf: Buffer,
        header: Header,
        parts: tuple[MemoryPart, ...],
        *,
        n_head_kv: int | None,
        options: dict,
        source: str,
        sidecar: dict | None,
    ) -> None:
        self._buf, self.header, self.parts = buf, header, parts
        self.n_head_kv, self.options, self.source, self.sidecar = n_head_kv, options, source, sidecar

    # --- what it is -------------------------------------------------------------------------------
    @property
    def kind(self) -> DumpKind:
        """What produced the dump (llama_state_seq_get_data, a seq file, ...)."""
        return self.header.kind

    @property
    def buffer(self) -> np.ndarray:
        """The whole dump as a uint8 array (the input itself, a copy of it, or a memmap)."""
        return self._buf.data

    @property
    def nbytes(self) -> int:
        """The dump's length in bytes."""
        return self._buf.size

    @property
    def writable(self) -> bool:
        """Whether the views accept edits (see ``parse(writable=)``)."""
        return self._buf.writable

    @property
    def tokens(self) -> np.ndarray | None:
        """The prompt tokens a seq or session file holds (an int32 view), else None."""
        return self.header.tokens

    @property
    def metadata_only(self) -> bool:
        """True for a StateFlags.ON_DEVICE dump: record headers, no rows (views raise
        MetadataOnlyError; layout() shows 0 payload bytes)."""
        return bool(self.options.get("metadata_only"))

    @property
    def partial(self) -> bool | None:
        """True for a StateFlags.PARTIAL_ONLY dump (only the memory's partial part), False for a
        full one, None when neither the flags nor the reading tell (plain KV caches and recurrent
        memories write the same bytes either way)."""
        return self.options.get("partial")

    @property
    def layers(self) -> dict | None:
        """The layer map in use, ``{part: [il of each record]}``, or None (numbers are indices)."""
        return self.options.get("layers")

    @property
    def n_layer(self) -> int:
        """Layers the dump holds memory for: each attention and recurrent part's layers (its
        records of one kind in a stream: K, or R), added over the parts. For a plain KV cache
        that is the model's ``llama_model_n_layer`` and ``len(state.k)``; iSWA's base and swa
        layers, and a hybrid model's attention and recurrent layers, add up (a recurrent part's
        own ``n_layer`` field is the model's, whatever it holds). 0 when no part wrote any record
        (a KV cache with no cells writes none)."""
        n = 0
        for p in self.parts:
            if p.kind in ("kv", "recurrent"):
                per_kind = [Counter(r.kind for r in s.records) for s in p.streams]
                n += max((max(c.values(), default=0) for c in per_kind), default=0)
        return n

    # --- picking a part, a stream, a record ----------------------------------------------------------
    def part(self, name: str | None = None) -> MemoryPart:
        """The memory part named ``name``, or the only one.

        Args:
            name: kv, base, swa, recurrent ... (``[p.name for p in state.parts]``); None for the
                only part.

        Returns:
            The part.

        Raises:
            ValueError: ``name`` is None and the dump has several parts.
            KeyError: No part has that name.
        """
        if name is None:
            if len(self.parts) != 1:
                raise ValueError(
                    f"this dump has parts {[p.name for p in self.parts]}: pass part="
                    + ("" if self.layers else " (or model= to index layers across parts)")
                )
            return self.parts[0]
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(f"no part {name!r}; this dump has {[p.name for p in self.parts]}")

    def stream(self, part: str | None = None, stream: int | None = None) -> Stream:
        """One stream of a part: ``stream``, or the only one holding cells.

        Args:
            part: The part's name, None for the only part.
            stream: The stream index; None for the only stream with cells (the first when none
                has).

        Returns:
            The stream.

        Raises:
            ValueError: Several parts and no ``part``; several streams with cells (or a
                whole-memory dsv4 block) and no ``stream``.
            KeyError: No part has that name.
            IndexError: ``stream`` out of range.
        """
        p = self.part(part)
        if stream is not None:
            if not 0 <= stream < len(p.streams):
                raise IndexError(f"stream {stream} out of range: part {p.name} has {len(p.streams)}")
            return p.streams[stream]
        if isinstance(p, Dsv4Block) and len(p.streams) > 1:  # no cells say which stream is the one
            raise ValueError(f"part {p.name} has {len(p.streams)} streams (a whole-memory dump): pass stream=")
        full = [s for s in p.streams if s.cell_count]
        if len(full) > 1:
            raise ValueError(f"part {p.name} has cells in streams {[s.index for s in full]}: pass stream=")
        return full[0] if full else p.streams[0]

    @property
    def cells(self) -> np.ndarray:
        """The cells of the only stream with cells (see ``Stream``): pos, n_seq_id, seq_id ...

        Raises:
            ValueError: Several parts or several streams with cells: use ``stream()``.
        """
        return self.stream().cells

    def _views(self, kind: str) -> LayerViews:
        want = "kv" if kind in ("K", "V") else "recurrent"
        parts = [p for p in self.parts if p.kind == want]
        if len(parts) <= 1:
            return getattr(self.stream(parts[0].name), kind.lower()) if parts else LayerViews(())
        # several KV parts (iSWA): one index over all of them, which needs the model's layer numbers
        recs = [r for p in parts for r in self.stream(p.name).records if r.kind == kind]
        if not self.layers or any(r.il is None for r in recs):
            raise ValueError(
                f"this dump has parts {[p.name for p in self.parts]} and no layer map: "
                f"pass part= (stream(part=...).{kind.lower()}) or model= for the model's layer numbers"
            )
        return LayerViews(sorted(recs, key=lambda r: cast(int, r.il)))  # none is None: checked above

    @property
    def k(self) -> LayerViews:
        """``k[il]``: zero-copy K of layer il, (cells, n_head_kv, head_dim) for plain types. il is
        the model's layer when the layer map is known (then iSWA and hybrid dumps are indexed
        across their parts), else the record index of the only part.

        Raises:
            ValueError: Several attention parts (iSWA) and no layer map.
        """
        return self._views("K")

    @property
    def v(self) -> LayerViews:
        """``v[il]``: zero-copy V, un-transposed through strides when v_trans=1.

        Raises:
            ValueError: Several attention parts (iSWA) and no layer map.
        """
        return self._views("V")

    def record(self, kind: str, layer: int, *, part: str | None = None, stream: int | None = None) -> TensorRecord:
        """The ``kind`` record of ``layer``.

        Args:
            kind: K, V, R, P, S (any case).
            layer: The model's il with a layer map, else the record index.
            part: The part's name; None: the only part, or across parts with a layer map.
            stream: The stream index; None: the only stream with cells.

        Returns:
            The record.

        Raises:
            IndexError: No such layer (or stream).
            ValueError: The part or stream is ambiguous (see ``stream()``), or several parts and
                no layer map.
            KeyError: No part has that name.
        """
        kind = kind.upper()
        if part is None and stream is None and len(self.parts) > 1:
            return self._views(kind).record(layer)
        return LayerViews(r for r in self.stream(part, stream).records if r.kind == kind).record(layer)

    def records(self) -> Iterator[TensorRecord]:
        """Every record, in byte order.

        Returns:
            An iterator over the records of every part and stream.
        """
        for p in self.parts:
            if isinstance(p, Dsv4Block):  # its streams interleave per layer
                yield from p.records
                continue
            for s in p.streams:
                yield from s.records

    # --- where things are ----------------------------------------------------------------------------
    def address(
        self,
        kind: str,
        layer: int,
        cell: int,
        head: int = 0,
        element: int = 0,
        *,
        part: str | None = None,
        stream: int | None = None,
    ) -> int:
        """Byte offset in the dump of one value (``TensorRecord.address`` of ``record()``).

        Args:
            kind: K, V, R, P, S.
            layer: The model's il with a layer map, else the record index.
            cell: The cell, counting the dump's cells.
            head: The KV head.
            element: The value within the head.
            part: The part's name (see ``record()``).
            stream: The stream index (see ``record()``).

        Returns:
            The byte offset from the start of the dump.

        Raises:
            MetadataOnlyError: The dump is metadata-only.
            IndexError: ``layer``, ``cell``, ``head`` or ``element`` out of range.
            ValueError: The part or stream is ambiguous.
        """
        return self.record(kind, layer, part=part, stream=stream).address(cell, head, element)

    def tensor_offset(
        self,
        kind: str,
        layer: int,
        cell: int,
        head: int = 0,
        element: int = 0,
        *,
        kv_size: int,
        part: str | None = None,
        stream: int | None = None,
        dest_stream: int | None = None,
        n_embd_tensor: int | None = None,
    ) -> int:
        """Byte offset of one value in llama.cpp's per-layer cache tensor (see
        TensorRecord.tensor_offset: row-major for K and v_trans=0 V, value-major for v_trans=1).
        ``part``/``stream`` pick the record in the dump; ``cell``/``dest_stream`` the cache slot.

        Args:
            kind: K, V, R, P, S.
            layer: The model's il with a layer map, else the record index.
            cell: The cache cell index.
            head: The KV head.
            element: The value within the head.
            kv_size: The cache's cells per stream.
            part: The part's name (see ``record()``).
            stream: The stream index in the dump (see ``record()``).
            dest_stream: The cache stream, by default the dumped one.
            n_embd_tensor: The V tensor's ne[0] when v_trans=1.

        Returns:
            The byte offset from the start of the tensor's data.

        Raises:
            IndexError: ``layer``, ``cell``, ``head`` or ``element`` out of range.
            ValueError: The part or stream is ambiguous.
        """
        rec = self.record(kind, layer, part=part, stream=stream)  # no rows needed: metadata-only works
        return rec.tensor_offset(
            cell, head, element, kv_size=kv_size, dest_stream=dest_stream, n_embd_tensor=n_embd_tensor
        )

    def segments(self) -> list[Segment]:
        """Every byte of the dump, in order, as header / field / cells / record header / payload.

        Returns:
            Segments that tile the dump with no gap or overlap.
        """
        segs = [Segment(0, self.header.nbytes, f"header ({self.kind})", False)]
        if self.options.get("memory") == "dsv4":
            segs.append(Segment(self.header.nbytes, 12, "dsv4: magic, version, mode", False))
        for p in self.parts:
            if isinstance(p, Dsv4Block):
                segs += _dsv4.block_segments(p)
                continue
            if p.n_stream is not None:
                segs.append(Segment(p.offset, 4, f"{p.name}: n_stream", False))
            for s in p.streams:
                segs.append(Segment(s.offset, 4, f"{p.name} stream {s.index}: cell_count", False))
                if s.cells_nbytes:
                    segs.append(
                        Segment(
                            s.cells_offset, s.cells_nbytes, f"{p.name} stream {s.index}: {s.cell_count} cells", False
                        )
                    )
                if s.v_trans is not None:
                    segs.append(
                        Segment(
                            s.cells_offset + s.cells_nbytes,
                            8,
                            f"{p.name} stream {s.index}: {'v' if p.kind == 'kv' else 's'}_trans, n_layer",
                            False,
                        )
                    )
                for r in s.records:
                    segs.append(
                        Segment(r.header_offset, r.header_size, f"{p.name} stream {s.index} {r.name} header", False)
                    )
                    if r.nbytes:
                        segs.append(Segment(r.data_offset, r.nbytes, f"{p.name} stream {s.index} {r.name} data", True))
        return segs

    def layout(self) -> Layout:
        """One row per record plus metadata/payload totals, which add up to the input length.

        Returns:
            The layout (``str()`` of it is the table).
        """
        rows = tuple(
            LayoutRow(
                r.part,
                r.stream,
                r.kind,
                r.layer,
                r.il,
                r.type.name,
                r.row_size,
                r.header_offset,
                r.data_offset,
                r.nbytes,
            )
            for r in self.records()
        )
        segs = tuple(self.segments())
        payload = sum(s.nbytes for s in segs if s.payload)
        meta = sum(s.nbytes for s in segs if not s.payload)
        return Layout(
            rows,
            segs,
            meta,
            payload,
            meta + payload,
            metadata_only=self.metadata_only,
            layers_known=all(r.il is not None for r in rows),
        )

    # --- bytes out -----------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """The dump as bytes, with any edits made through the views.

        Returns:
            A copy of the whole dump, ready for llama_state_seq_set_data / a file.
        """
        return self._buf.data.tobytes()

    def select_cells(
        self,
        mask: np.ndarray | Sequence[int] | Sequence[bool] | Callable[[np.ndarray], np.ndarray],
        *,
        part: str | None = None,
        stream: int | None = None,
    ) -> KVState:
        """A new, smaller dump keeping the selected cells (in every layer, K and V).

        Args:
            mask: Booleans or increasing indices over the cells of one stream, or a callable
                ``cells -> booleans`` applied to every stream of every part.
            part: The part whose stream ``mask`` selects in (not with a callable).
            stream: The stream ``mask`` selects in (not with a callable).

        Returns:
            The parsed new dump, backed by a writable bytearray.

        Raises:
            ValueError: A metadata-only or dsv4 dump; a boolean mask of the wrong length;
                indices not increasing or out of range.
            TypeError: ``mask`` is neither booleans nor integers.
        """
        from ._write import select_cells

        return select_cells(self, mask, part=part, stream=stream)

    # --- text ----------------------------------------------------------------------------------------
    def describe(self, *, max_rows: int = 8, n_cells: int = 3, n_values: int = 4) -> str:
        """A readable summary: kind, header, parts and streams, layout table, first cells' K/V.

        Args:
            max_rows: Layout table rows to show (first and last halves).
            n_cells: Cells whose values to show.
            n_values: Values per cell to show.

        Returns:
            The text (``str(state)`` is ``describe()``).
        """
        from ._describe import describe

        return describe(self, max_rows=max_rows, n_cells=n_cells, n_values=n_values)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        cells = sum(s.cell_count for p in self.parts for s in p.streams)
        meta = ", metadata only (ON_DEVICE)" if self.metadata_only else ""
        meta += ", partial (PARTIAL_ONLY)" if self.partial else ""
        return (
            f"<KVState {self.kind}{meta}: {self.nbytes:,} bytes, parts {[p.name for p in self.parts]}, "
            f"{cells} cells, n_head_kv={self.n_head_kv}>"
        )
