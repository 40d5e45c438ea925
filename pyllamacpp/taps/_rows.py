"""What a captured or patched tensor is: :class:`TapRecord`, :class:`TapInfo`, and which batch
rows a pass holds (llama.cpp's batch split, replayed by :mod:`pyllamacpp.ubatch`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._lib import lib
from ..errors import TapError
from ..ubatch import BatchAllocr, PlanError, split_all
from ._graph import _NUMPY, GraphNode, _n_dims, _type_name

if TYPE_CHECKING:
    from ..context import Context

# -- records -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TapRecord:
    """One captured tensor of one forward pass (ubatch).

    Attributes:
        name: The tensor's name (``l_out-5``).
        site: The name without its layer.
        layer: The layer, or None.
        occurrence: Which node of that name (graph order).
        op: ggml's op name; ``NONE`` for an input.
        type: ggml's type name.
        ne: ggml's ``ne``; ``nb``: its strides in bytes.
        nb: ggml's ``nb``.
        shape: numpy order (``ne`` reversed).
        call: The decode call, counted from the capture's start.
        ubatch: The pass within that call (0 for its first ubatch).
        pass_index: The pass, counted from the capture's start.
        kind: ``"node"``, or ``"input"`` (read before its first reader computed).
        token_axis: The numpy axis of :attr:`data` that holds the pass's rows (None: none).
        rows: The batch index (in its decode call's batch) of each row along ``token_axis``, or
            None when not known.
        tokens: The token id of each row (None where not known).
        pos: The position of each row.
        seq_ids: The sequence ids of each row, in the order the batch gave them (llama.cpp keeps a
            token's ids in an ``unordered_set``: the "first" the KQ mask tests is that set's first,
            not necessarily this tuple's; see ``pyllamacpp mask``).
        outputs_only: The rows are the pass's output rows only (after ``inp_out_ids``).
        n_stream: KV streams the tensor is split into (``ne[3]``, without ``kv_unified`` and with
            several sequences in the ubatch): its rows then run stream by stream, each stream's
            along ``token_axis`` (see :meth:`by_rows`).
        data: The copy, a numpy view in numpy order over the capture's arena (raw uint8 rows for
            a quantized type).
        offset: Where the copy starts in the arena; ``nbytes``: its size.
        nbytes: Bytes copied.
        buffer: The backend buffer the tensor lives in (``ggml_backend_buffer_name``: ``CPU``,
            ``CUDA0``...), ``buffer_offset`` its data's byte offset from the buffer's base,
            ``buffer_size`` the buffer's size: where a KV cache tensor sits in its allocation.
        buffer_offset: See ``buffer``.
        buffer_size: See ``buffer``.
        buffer_usage: ``GGML_BACKEND_BUFFER_USAGE_*`` (weights, compute, any), -1 without a buffer.
        on_host: The buffer is host memory.
    """

    name: str
    site: str
    layer: int | None
    occurrence: int
    op: str
    type: str
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    shape: tuple[int, ...]
    call: int
    ubatch: int
    pass_index: int
    kind: str
    token_axis: int | None
    rows: np.ndarray | None
    tokens: np.ndarray | None
    pos: np.ndarray | None
    seq_ids: tuple[tuple[int, ...], ...] | None
    outputs_only: bool
    data: np.ndarray = dataclasses.field(repr=False)
    n_stream: int = 1
    offset: int = 0
    nbytes: int = 0
    buffer: str = ""
    buffer_offset: int = 0
    buffer_size: int = 0
    buffer_usage: int = -1
    on_host: bool = False

    def array(self) -> np.ndarray:
        """The data as numbers: :attr:`data` for f32/f16/integer types, float32 for bf16 and the
        quantized types (dequantized with ``gguf.quants``).

        Returns:
            An array of :attr:`shape` (a view when no conversion is needed).
        """
        t = lib.GGML_TYPE_COUNT
        for k, v in _TYPE_IDS.items():
            if v == self.type:
                t = k
        if t in _NUMPY and t != lib.GGML_TYPE_BF16:
            return self.data
        if t == lib.GGML_TYPE_BF16:
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        from gguf.quants import dequantize

        return dequantize(np.ascontiguousarray(self.data), t).reshape(self.shape)

    def by_rows(self) -> tuple[np.ndarray, int]:
        """The data with every row of the pass on one axis, in :attr:`rows`' order: the array
        itself, or for a tensor split into KV streams the stream axis merged into the token axis
        (a copy only when numpy cannot reshape in place).

        Returns:
            ``(array, axis)``.

        Raises:
            TapError: The record has no token axis.
        """
        if self.token_axis is None:
            raise TapError(f"{self.name}: this tensor has no axis of batch rows")
        a = self.array()
        if self.n_stream <= 1 or a.ndim < 4 or self.token_axis == 0:
            return a, self.token_axis
        ax = self.token_axis - 1  # the stream axis (numpy 0, ggml ne[3]) goes right before the token axis
        a = np.moveaxis(a, 0, ax)
        return a.reshape(*a.shape[:ax], -1, *a.shape[ax + 2 :]), ax

    def select(self, rows: np.ndarray) -> np.ndarray:
        """The entries of these rows (positions along :attr:`token_axis`, in :attr:`rows`' order).

        Args:
            rows: Indices into this record's rows.

        Returns:
            An array with the token axis cut to ``rows`` (a copy: numpy fancy indexing).

        Raises:
            TapError: The record has no token axis.
        """
        a, ax = self.by_rows()
        return np.take(a, rows, axis=ax)


_TYPE_IDS: dict[int, str] = {}


def _type_id_name(t: int) -> str:
    name = _TYPE_IDS.get(t)
    if name is None:
        name = _TYPE_IDS[t] = _type_name(t)
    return name


@dataclasses.dataclass(frozen=True)
class TapInfo:
    """What a patch function is told about the tensor it gets (see :meth:`Context.patch`).

    Attributes:
        name: The tensor's name.
        site: The name without its layer.
        layer: The layer, or None.
        op: ggml's op name.
        call: The decode call, counted from the patch's start; -1 in a decode that did not go
            through :meth:`Context.decode` (``lib.llama_decode`` on a batch's struct: the taps
            saw no batch, so ``rows``, ``seq_ids`` and ``pos`` are None too).
        ubatch: The pass within that call.
        token_axis: The numpy axis of the array that holds the pass's rows (None: none).
        rows: The batch index of each row along ``token_axis`` (None when not known).
        seq_ids: The sequence ids of each row (None when not known).
        pos: The position of each row (None when not known).
        on_host: The array is the tensor's own memory (host buffer); else a copy written back after
            the function returns (``ggml_backend_tensor_set``).
    """

    name: str
    site: str
    layer: int | None
    op: str
    call: int
    ubatch: int
    token_axis: int | None
    rows: np.ndarray | None
    seq_ids: tuple[tuple[int, ...], ...] | None
    pos: np.ndarray | None
    on_host: bool


class _Call:
    """A decode call seen while armed: its batch (Context.decode), or the one row of a C step."""

    __slots__ = ("tokens", "pos", "seq_ids", "outputs", "ubatches", "first_pass")

    def __init__(self, tokens, pos, seq_ids, outputs) -> None:
        self.tokens, self.pos, self.seq_ids, self.outputs = tokens, pos, seq_ids, outputs
        self.ubatches: list[np.ndarray] | None = None  # batch indices of each ubatch
        self.first_pass = 0


def _token_axis(node: GraphNode, ne: Sequence[int]) -> int | None:
    if node.token_axis is None:
        return None
    ndim = max(node.ndim, _n_dims(ne))
    return ndim - (node.ndim - node.token_axis)


def _rows_along(node: GraphNode, ne, rows, meta: _Call | None):
    """(rows, seq_ids, pos, outputs_only) for the entries along the node's token axis; with
    separate KV streams (ne[3] = n_stream) the rows run stream by stream over ne[3] and that axis."""
    if node.token_axis is None or rows is None or meta is None:
        return None, None, None, False
    dim = node.ndim - 1 - node.token_axis
    n = int(ne[dim])
    if dim < 3 and ne[3] > 1:
        n *= int(ne[3])
    outputs_only = False
    if n != len(rows) and meta.outputs is not None:
        out_rows = rows[meta.outputs[rows]]
        if n == len(out_rows):
            rows, outputs_only = out_rows, True
    if n != len(rows):
        return None, None, None, False
    return rows, tuple(meta.seq_ids[i] for i in rows), meta.pos[rows], outputs_only


@dataclasses.dataclass(frozen=True)
class _Splitting:
    """What llama.cpp's batch allocator splits with, read from the context once (records are
    built after the context may be gone)."""

    n_ubatch: int
    unified: bool
    recurrent: bool
    hybrid: bool

    @classmethod
    def of(cls, ctx: Context) -> _Splitting:
        m = ctx.model.ptr
        return cls(
            int(ctx.n_ubatch),
            bool(ctx.params.kv_unified) or ctx.n_seq_max == 1,
            bool(lib.llama_model_is_recurrent(m)),
            bool(lib.llama_model_is_hybrid(m)),
        )


def plan_ubatches(ctx: Context | _Splitting, call: _Call) -> list[np.ndarray]:
    """Batch indices per ubatch, as llama.cpp's batch allocator splits this call's batch
    (``llama_kv_cache::init_batch`` and the recurrent / hybrid memories' equivalents).

    Args:
        ctx: The context the call was decoded on, or what its allocator splits with.
        call: The decode call (its rows' sequence ids and output flags).

    Returns:
        One array of batch indices per ubatch, in the order they run; empty when llama.cpp
        would not split the batch (:class:`~pyllamacpp.ubatch.PlanError`).
    """
    f = ctx if isinstance(ctx, _Splitting) else _Splitting.of(ctx)
    all_out = call.outputs is not None and bool(call.outputs.all())
    if f.recurrent or f.hybrid:
        split, seq = ("seq", False) if all_out else ("equal", not f.unified or f.recurrent)
    else:
        split, seq = ("simple", False) if f.unified else ("equal", True)
    try:
        ubs = split_all(BatchAllocr(call.seq_ids), f.n_ubatch, split, seq)
    except PlanError:
        return []
    return [np.asarray(idxs, np.int64) for idxs, _, _ in ubs]
