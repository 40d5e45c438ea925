"""What ``pyllamacpp kv-live`` watches: the KV cache tensors as the graph saw them (their type,
``ne``, ``nb``, buffer and offset, and a live view of their bytes), and the graph taps that see
them and the K row indices each forward pass writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ...context import Context


@dataclasses.dataclass(frozen=True)
class KVTensor:
    """One KV cache tensor as the graph saw it.

    Attributes:
        name: ``cache_k_l<il>`` or ``cache_v_l<il>``.
        kind: ``"K"`` or ``"V"``.
        layer: The model's layer (il).
        type: ggml's type name (``f16``, ``q8_0``).
        ne: ggml's ``ne``: ``(n_embd_gqa, kv_size, n_stream, 1)``.
        nb: ggml's ``nb``, bytes.
        buffer: The backend buffer's name (``ggml_backend_buffer_name``: ``CPU``, ``CUDA0``).
        buffer_offset: The tensor's data, in bytes from the buffer's base.
        buffer_size: The buffer's size in bytes.
        nbytes: The tensor's size in bytes.
        on_host: The buffer is host memory (then :attr:`data` is a view of it).
        v_trans: V used transposed (flash attention off): value j of cell c at element
            ``j * kv_size + c`` of its stream; False for K.
        data: The tensor's bytes, a read-only uint8 view of the buffer (live: it shows what later
            decodes write), or None for a buffer that is not host memory.
    """

    name: str
    kind: str
    layer: int
    type: str
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    buffer: str
    buffer_offset: int
    buffer_size: int
    nbytes: int
    on_host: bool
    v_trans: bool
    data: np.ndarray | None = dataclasses.field(repr=False, compare=False)

    @property
    def kv_size(self) -> int:
        """Cells per stream (``ne[1]``)."""
        return int(self.ne[1])

    @property
    def n_stream(self) -> int:
        """Streams (``ne[2]``)."""
        return int(self.ne[2])

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order: ``(n_stream, kv_size, n_embd_gqa)``."""
        return (int(self.ne[2]), int(self.ne[1]), int(self.ne[0]))

    def cell_bytes(self, stream: int, cells: Sequence[int] | np.ndarray, n_embd: int | None = None) -> np.ndarray:
        """The bytes these cells hold, in the layout the state dump writes them in.

        Args:
            stream: The stream.
            cells: Cell indices within the stream, in the order wanted.
            n_embd: Values per cell to take (a layer whose V is narrower than the tensor's
                ``ne[0]``); None: all.

        Returns:
            K, and V without ``v_trans``: ``(n_cells, row_size)``, one row per cell. V with
            ``v_trans``: ``(n_embd, n_cells, element_size)``, value-major. A copy (the cells are
            picked by index).

        Raises:
            ValueError: The tensor has no host view (:attr:`data` is None), or a cell or stream
                outside the tensor.
        """
        if self.data is None:
            raise ValueError(f"{self.name} lives in {self.buffer}, not host memory: it has no view to read")
        idx = np.asarray(cells, np.int64)
        if not 0 <= stream < self.n_stream or (idx.size and not (0 <= idx.min() and idx.max() < self.kv_size)):
            raise ValueError(f"{self.name}: stream {stream} / cells outside {self.n_stream} x {self.kv_size}")
        per_stream = self.data[stream * self.nb[2] : (stream + 1) * self.nb[2]]
        if self.v_trans:
            el = int(self.nb[0])
            n = int(self.ne[0]) if n_embd is None else int(n_embd)
            cols = per_stream.reshape(int(self.ne[0]), self.kv_size, el)
            return cols[:n, idx, :]
        rows = per_stream.reshape(self.kv_size, int(self.nb[1]))
        if n_embd is not None:
            from ..._lib import lib

            return rows[idx, : int(lib.ggml_row_size(_type_id(self.type), int(n_embd)))]
        return rows[idx]


def _type_id(name: str) -> int:
    from ..._lib import ffi, lib

    for t in range(lib.GGML_TYPE_COUNT):
        p = lib.ggml_type_name(t)
        if p != ffi.NULL and ffi.string(p).decode() == name:
            return t
    raise ValueError(f"unknown ggml type {name!r}")


class KVWatch:
    """Graph taps that watch a context's KV cache while decodes run (:func:`watch`).

    Inside the ``with`` block every forward pass reports, with no copy of the cache: each
    ``cache_k_l<il>`` / ``cache_v_l<il>`` tensor's type, ``ne``, ``nb``, buffer and offset (a
    capture with ``copy=False``), the tensor's address (a patch on the input that changes
    nothing), and the K row indices the pass writes (``attn_inp_k_idxs``) with the position and
    sequences of each row.

    Args:
        ctx: A context with graph taps and a plain KV cache of f32, f16 or bf16.

    Attributes:
        ctx: The context.
        writes: One ``(pos, seq_ids, index)`` per K row written, in order; ``index`` is
            ``stream * kv_size + cell``.
        n_passes: Forward passes seen.
    """

    def __init__(self, ctx: Context) -> None:
        _check_plain_kv(ctx)
        self.ctx = ctx
        self.writes: list[tuple[int, tuple[int, ...], int]] = []
        self.n_passes = 0
        self._addr: dict[str, int] = {}
        self._idxs: dict[tuple[int, int], np.ndarray] = {}
        self._cap: Any = None
        self._patch: Any = None
        self._records: list[Any] = []

    def _on_input(self, arr: np.ndarray, info: Any) -> None:
        if info.name == "attn_inp_k_idxs":
            self._idxs[(info.call, info.ubatch)] = np.array(arr, np.int64)
        elif info.on_host:  # the tensor's own memory: its address stays valid while the context lives
            self._addr[info.name] = int(arr.__array_interface__["data"][0])

    def __enter__(self) -> KVWatch:
        names = ["cache_k", "cache_v", "attn_inp_k_idxs"]
        self._patch = self.ctx.patch(names, self._on_input)
        self._cap = self.ctx.capture(*names, copy=False)
        self._patch.__enter__()
        try:
            self._cap.__enter__()
        except BaseException:
            self._patch.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching (idempotent); what was seen stays readable."""
        if self._cap is None:
            return
        cap, self._cap = self._cap, None
        cap.close()
        self._patch.close()
        recs = cap.records
        self._records = [r for r in recs if r.site in ("cache_k", "cache_v")]
        self.n_passes = cap.n_passes
        for r in recs:
            if r.name != "attn_inp_k_idxs":
                continue
            idx = self._idxs.get((r.call, r.ubatch))
            if idx is None or r.pos is None or r.seq_ids is None or len(idx) != len(r.pos):
                raise ValueError(
                    f"kv-live: the K row indices of pass {r.pass_index} could not be matched to its rows "
                    f"({0 if idx is None else len(idx)} indices, "
                    f"{'unknown' if r.pos is None else len(r.pos)} rows)"
                )
            self.writes += [(int(p), tuple(s), int(i)) for p, s, i in zip(r.pos, r.seq_ids, idx)]

    def tensors(self) -> list[KVTensor]:
        """The KV cache tensors, as the last pass saw them, sorted by buffer and byte offset.

        Returns:
            One :class:`KVTensor` per tensor (K and V of every layer), in memory order, each with
            a live view of its bytes when its buffer is host memory.

        Raises:
            ValueError: No pass was seen.
        """
        if self._cap is not None:
            raise ValueError("kv-live: read the tensors after the with block")
        last: dict[str, Any] = {}
        for r in self._records:
            last[r.name] = r
        if not last:
            raise ValueError("kv-live: no forward pass ran inside the with block")
        from ..._handle import view
        from ..._lib import ffi, lib

        v_trans = not self.ctx.flash_attn
        out = []
        for name, r in last.items():
            nbytes = int(lib.ggml_row_size(_type_id(r.type), r.ne[0])) * r.ne[1] * r.ne[2] * r.ne[3]
            addr = self._addr.get(name)
            data = None
            if r.on_host and addr is not None:
                # a view that keeps the context's C object (and so the buffer) alive
                data = view(ffi.cast("void *", addr), (nbytes,), np.uint8, self.ctx._h, readonly=True)
            kind = "K" if r.site == "cache_k" else "V"
            out.append(
                KVTensor(
                    name=name,
                    kind=kind,
                    layer=int(r.layer),
                    type=r.type,
                    ne=tuple(int(x) for x in r.ne),
                    nb=tuple(int(x) for x in r.nb),
                    buffer=r.buffer,
                    buffer_offset=int(r.buffer_offset),
                    buffer_size=int(r.buffer_size),
                    nbytes=nbytes,
                    on_host=bool(r.on_host),
                    v_trans=kind == "V" and v_trans,
                    data=data,
                )
            )
        return sorted(out, key=lambda t: (t.buffer, t.buffer_offset))

    def cells(self, seq_id: int) -> tuple[int, np.ndarray, np.ndarray]:
        """Where the watched passes wrote ``seq_id``'s K rows.

        Each cell keeps the last row written to it; the cells of ``seq_id`` are those whose last
        row carried it (a row of several sequences is in each).

        Args:
            seq_id: The sequence.

        Returns:
            ``(stream, cells, pos)``: the stream, the cells in cell order, the position each holds.

        Raises:
            ValueError: No row of ``seq_id`` was written while watching, or its rows are in
                several streams.
        """
        t = self.tensors()[0]
        last: dict[int, tuple[int, tuple[int, ...]]] = {}
        for pos, seqs, idx in self.writes:
            last[idx] = (pos, seqs)
        mine = sorted((idx, pos) for idx, (pos, seqs) in last.items() if seq_id in seqs)
        if not mine:
            raise ValueError(f"kv-live: no K row of sequence {seq_id} was written while watching")
        streams = {idx // t.kv_size for idx, _ in mine}
        if len(streams) != 1:
            raise ValueError(f"kv-live: sequence {seq_id}'s rows are in streams {sorted(streams)}")
        cells = np.array([idx % t.kv_size for idx, _ in mine], np.int64)
        return streams.pop(), cells, np.array([p for _, p in mine], np.int64)


def watch(ctx: Context) -> KVWatch:
    """Watch ``ctx``'s KV cache during the decodes of a ``with`` block.

    ``with kvlive.watch(ctx) as w: ctx.prefill(tokens)``, then ``w.tensors()`` lists the cache
    tensors in memory order and ``w.cells(seq_id)`` says where a sequence's rows were written.

    Args:
        ctx: A context with graph taps (the default) and a plain KV cache.

    Returns:
        A :class:`KVWatch` (a context manager).

    Raises:
        ValueError: The model's memory is not a plain KV cache (iSWA, recurrent, hybrid).
        TapError: The context cannot be tapped (``taps=False`` or its own ``cb_eval``).
    """
    return KVWatch(ctx)


def _check_plain_kv(ctx: Context) -> None:
    from ..._lib import lib

    if not ctx._plain_kv:
        raise ValueError(
            "kv-live reads a plain KV cache (one cache_k_l<il> / cache_v_l<il> per layer); this model's memory "
            "is iSWA, recurrent or hybrid"
        )
    quantized = [n for n in ("type_k", "type_v") if lib.ggml_blck_size(getattr(ctx.params, n)) > 1]
    if quantized:
        # the address comes from a patch of the input, and taps patch only types numpy can view
        raise ValueError(
            f"kv-live reads f32, f16 and bf16 caches; {', '.join(quantized)} is block-quantized here, and "
            "graph taps hand out no view of a quantized tensor to take its address from"
        )
