"""``pyllamacpp kv-live``: the KV cache as it sits in its backend buffer, against the state file.

llama.cpp's KV cache (``llama_kv_cache``'s constructor) is two ggml tensors per layer,
``cache_k_l<il>`` and ``cache_v_l<il>``, each ``[n_embd_gqa, kv_size, n_stream]``, allocated in one
backend buffer per buffer type. This command decodes a few prompts while graph taps watch the
passes, and prints, from the tensors themselves (read through the ``src[]`` of the nodes that read
them): per layer the name, type, ``ne``, ``nb``, the buffer and the byte offset in it, sorted by
offset, so the order in memory is printed, not assumed. Which cells hold each sequence comes from
the engine too: ``attn_inp_k_idxs``, the row indices the graph's ``SET_ROWS`` writes K to
(``stream * kv_size + cell``), checked against the cells the sequence's state dump lists. Then each
sequence's rows, read from the live tensors (a numpy view of the buffer, not a copy), are compared
byte for byte with the same rows in its ``llama_state_seq_get_data_ext`` dump, parsed with
``pyllamacpp.state``: K row by row; V row by row with flash attention on, and with it off
(``v_trans = 1``) value by value, the tensor being used transposed (value j of cell c at
``j * kv_size + c``). Modes (``--modes``) are ``layout:fa``: ``unified`` (one stream) or
``split`` (``kv_unified=False``, one stream per sequence), flash attention ``on`` or ``off``.
Any byte that differs fails the command (exit 1), naming the layer, the cell and the offsets.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .common import Command, Interrupted, add_context_flags, add_model_path_flag, load_model, progress

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model
    from ..state import KVState

__all__ = [
    "KVTensor",
    "KVWatch",
    "watch",
    "memory_order",
    "compare",
    "compare_seq",
    "schedule",
    "run_mode",
    "run",
    "print_report",
    "plot",
    "add_parser",
    "main",
]

PROMPTS = ("The cat sat on the mat.", "A dog ran in the park, barking at the birds!")
MODES = "unified:on,unified:off,split:off"


# -- the tensors ---------------------------------------------------------------------------------


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
            from .._lib import lib

            return rows[idx, : int(lib.ggml_row_size(_type_id(self.type), int(n_embd)))]
        return rows[idx]


def _type_id(name: str) -> int:
    from .._lib import ffi, lib

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
        from .._handle import view
        from .._lib import ffi, lib

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
    from .._lib import lib

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


def memory_order(tensors: Sequence[KVTensor]) -> dict:
    """What the offsets say about the tensors' placement.

    Args:
        tensors: From :meth:`KVWatch.tensors` (sorted by buffer and offset).

    Returns:
        ``order`` (``["K0", "V0", "K1", ...]`` by offset), ``buffers`` (name -> size in bytes),
        ``gaps`` (bytes between consecutive tensors of a buffer, and after the last, that no
        tensor covers) and ``interleaved`` (K and V of each layer side by side, layer by layer).
    """
    order = [f"{t.kind}{t.layer}" for t in tensors]
    gaps = 0
    buffers: dict[str, int] = {}
    by_buf: dict[str, list[KVTensor]] = {}
    for t in tensors:
        buffers[t.buffer] = t.buffer_size
        by_buf.setdefault(t.buffer, []).append(t)
    for ts in by_buf.values():
        end = 0
        for t in ts:
            gaps += max(0, t.buffer_offset - end)
            end = max(end, t.buffer_offset + t.nbytes)
        gaps += max(0, ts[0].buffer_size - end)
    layers = sorted({t.layer for t in tensors})
    interleaved = order == [f"{k}{il}" for il in layers for k in ("K", "V")]
    return {"order": order, "buffers": buffers, "gaps": gaps, "interleaved": interleaved}


# -- live against the dump -----------------------------------------------------------------------


def compare(
    tensors: Sequence[KVTensor],
    dump: KVState,
    stream: int,
    cells: Sequence[int] | np.ndarray,
) -> dict:
    """Compare the dump's K and V rows with the same cells of the live tensors, byte for byte.

    Args:
        tensors: The cache tensors (:meth:`KVWatch.tensors`; a copy of one with a byte changed
            shows as a mismatch).
        dump: The sequence's dump, parsed (``pyllamacpp.state.parse(ctx.seq_state(s).data,
            model=model)``).
        stream: The stream the sequence lives in (the dump's stream with cells).
        cells: The cache cells that hold it, in cell order (the dump writes them in that order).

    Returns:
        ``layers`` (one dict per layer and kind: ``kind``, ``layer``, ``bytes``, ``mismatches``
        and the ``first`` mismatch: cell, byte in the tensor, byte in the dump), ``bytes`` compared,
        ``mismatches`` (bytes that differ) and ``ok``.

    Raises:
        ValueError: The dump's stream holds another number of cells, or a layer's record or
            tensor is missing.
    """
    s = dump.stream(stream=stream)
    idx = np.asarray(cells, np.int64)
    if s.cell_count != len(idx):
        raise ValueError(f"the dump's stream {stream} holds {s.cell_count} cells, the live cache {len(idx)}")
    by_name = {(t.kind, t.layer): t for t in tensors}
    rows = []
    for rec in s.records:
        if rec.kind not in ("K", "V"):
            continue
        il = rec.il if rec.il is not None else rec.layer
        t = by_name.get((rec.kind, il))
        if t is None:
            raise ValueError(f"no live tensor for {rec.name}")
        if rec.transposed != t.v_trans:
            raise ValueError(f"{rec.name}: the dump says v_trans={int(rec.transposed)}, the context {int(t.v_trans)}")
        assert rec.data is not None, "a metadata-only dump has no rows"
        live = t.cell_bytes(stream, idx, rec.n_embd)
        filed: np.ndarray
        if rec.transposed:
            filed = rec.data.reshape(rec.n_embd, len(idx), rec.type.type_size)
        else:
            filed = rec.data.reshape(len(idx), rec.row_size)
        diff = np.flatnonzero(live.reshape(-1) != filed.reshape(-1))
        row: dict[str, Any] = {"kind": rec.kind, "layer": il, "bytes": int(filed.size), "mismatches": int(diff.size)}
        if diff.size:
            row["first"] = _where(t, rec, stream, idx, int(diff[0]))
        rows.append(row)
    n_bad = sum(r["mismatches"] for r in rows)
    return {"layers": rows, "bytes": sum(r["bytes"] for r in rows), "mismatches": n_bad, "ok": n_bad == 0}


def _where(t: KVTensor, rec: Any, stream: int, cells: np.ndarray, flat: int) -> dict:
    """Byte ``flat`` of a compared block: its cell, and its offset in the tensor and in the dump."""
    if rec.transposed:
        el = rec.type.type_size
        j, rest = divmod(flat, len(cells) * el)
        i, b = divmod(rest, el)
        in_tensor = stream * t.nb[2] + (j * t.kv_size + int(cells[i])) * el + b
        what = f"value {j}"
    else:
        i, b = divmod(flat, rec.row_size)
        in_tensor = stream * t.nb[2] + int(cells[i]) * t.nb[1] + b
        what = f"byte {b} of the row"
    return {
        "cell": int(cells[i]),
        "what": what,
        "tensor_offset": int(in_tensor),
        "buffer_offset": int(t.buffer_offset + in_tensor),
        "dump_offset": int(rec.data_offset + flat),
    }


def compare_seq(ctx: Context, w: KVWatch, seq_id: int, *, dump: np.ndarray | None = None) -> dict:
    """A sequence's rows in the live cache against its ``llama_state_seq_get_data_ext`` dump.

    Args:
        ctx: The context ``w`` watched.
        w: The watch (its block ended).
        seq_id: The sequence.
        dump: The dump's bytes; None: ``ctx.seq_state(seq_id).data`` now.

    Returns:
        What :func:`compare` returns, plus ``seq_id``, ``stream``, ``cells``, ``pos`` and
        ``dump_bytes``.

    Raises:
        ValueError: The cells the watch saw written disagree with the cells the dump lists
            (positions, or count): a memory op moved them since (then the watch cannot say where
            the sequence is), or no row of it was written while watching.
    """
    from .. import state as st

    blob = ctx.seq_state(seq_id).data if dump is None else dump
    parsed = st.parse(blob, model=ctx.model)
    stream, cells, pos = w.cells(seq_id)
    s = parsed.stream()
    if s.index != stream or s.cell_count != len(cells) or not np.array_equal(s.cells["pos"], pos):
        raise ValueError(
            f"kv-live: sequence {seq_id}: the watched writes put {len(cells)} cells in stream {stream} "
            f"(positions {_ranges(pos)}), the dump lists {s.cell_count} in stream {s.index} "
            f"(positions {_ranges(s.cells['pos'])}): a memory op moved the cells since"
        )
    out = compare(w.tensors(), parsed, stream, cells)
    return {
        "seq_id": seq_id,
        "stream": stream,
        "cells": cells.tolist(),
        "pos": pos.tolist(),
        "dump_bytes": int(parsed.nbytes),
        **out,
    }


def _ranges(xs) -> str:
    """``[0, 1, 2, 3, 7, 8]`` -> ``"0..3, 7..8"``."""
    xs = [int(x) for x in xs]
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:]:
        if x != prev + 1:
            out.append(f"{start}..{prev}" if prev != start else f"{start}")
            start = x
        prev = x
    out.append(f"{start}..{prev}" if prev != start else f"{start}")
    return ", ".join(out)


# -- the command -----------------------------------------------------------------------------------


def schedule(model: Model, prompts: Sequence[str]) -> list[tuple[int, np.ndarray, int]]:
    """The decode calls of a run: ``(seq_id, tokens, start_pos)``, the first prompt split in two
    around the others, so in one stream its cells are not contiguous.

    Args:
        model: The model (to tokenize with).
        prompts: One prompt per sequence.

    Returns:
        The calls, in order.
    """
    toks = [model.tokenize(p) for p in prompts]
    half = max(1, len(toks[0]) // 2)
    calls = [(0, toks[0][:half], 0)]
    calls += [(s, t, 0) for s, t in enumerate(toks[1:], 1)]
    if len(toks[0]) > half:
        calls.append((0, toks[0][half:], half))
    return calls


def run_mode(
    model: Model,
    *,
    layout: str,
    flash_attn: str,
    prompts: Sequence[str],
    n_ctx: int,
    ctx_kwargs: dict,
) -> dict:
    """One mode: a context, the prompts decoded under a :class:`KVWatch`, each sequence compared.

    Args:
        model: The model.
        layout: ``"unified"`` (one stream) or ``"split"`` (one stream per sequence).
        flash_attn: ``"on"`` or ``"off"`` (V transposed).
        prompts: One prompt per sequence.
        n_ctx: ``n_ctx``.
        ctx_kwargs: Further context keywords (``type_k``, threads ...).

    Returns:
        ``layout``, ``flash_attn``, ``n_ctx``, ``n_seq_max``, ``calls`` (seq, tokens, start),
        ``tensors`` (dicts, memory order), ``memory`` (:func:`memory_order`), ``seqs`` (one
        :func:`compare_seq` result each) and ``ok``.

    Raises:
        ValueError: A bad layout or flash_attn value, or the cells disagree (see
            :func:`compare_seq`).
        ContextError: llama.cpp cannot make the context.
        DecodeError: A decode failed.
    """
    if layout not in ("unified", "split") or flash_attn not in ("on", "off"):
        raise ValueError(f"kv-live: a mode is unified|split:on|off, got {layout}:{flash_attn}")
    from ..batch import Batch

    calls = schedule(model, prompts)
    n_seq = len(prompts)
    with model.context(
        n_ctx=n_ctx,
        n_seq_max=n_seq,
        kv_unified=layout == "unified",
        flash_attn=flash_attn,
        **ctx_kwargs,
    ) as ctx:
        batch = Batch(max(len(t) for _, t, _ in calls), 1, model=model)
        with watch(ctx) as w:
            for seq, toks, start in calls:
                batch.clear()
                batch.add_sequence(toks, seq, start, logits="last")
                ctx.decode(batch)
        tensors = w.tensors()
        seqs = [compare_seq(ctx, w, s) for s in range(n_seq)]
        return {
            "layout": layout,
            "flash_attn": flash_attn,
            "v_trans": flash_attn == "off",
            "n_ctx": n_ctx,
            "n_seq_max": n_seq,
            "n_passes": w.n_passes,
            "calls": [{"seq_id": s, "n_tokens": len(t), "start": p} for s, t, p in calls],
            "tensors": [{k: v for k, v in dataclasses.asdict(t).items() if k != "data"} for t in tensors],
            "memory": memory_order(tensors),
            "seqs": seqs,
            "ok": all(s["ok"] for s in seqs),
        }


def run(args: argparse.Namespace) -> dict:
    """:func:`run_mode` for each mode of ``--modes``.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        ``model``, ``prompts``, ``modes`` (one :func:`run_mode` result each) and ``ok``.

    Raises:
        ModelLoadError: The model cannot be loaded.
        ValueError: A bad mode, fewer than two prompts for a split mode, or cells that disagree.
        ContextError: llama.cpp cannot make a context.
        DecodeError: A decode failed.
        Interrupted: Ctrl-C; it carries the modes finished before it.
    """
    modes = [m.strip().split(":") for m in str(args.modes).split(",") if m.strip()]
    for m in modes:
        if len(m) != 2:
            raise ValueError(f"kv-live: a mode is layout:fa (unified:on, split:off), got {':'.join(m)!r}")
    prompts = list(args.prompt or PROMPTS)
    kw = dict(
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        n_threads=args.threads,
        n_threads_batch=args.threads,
    )
    with load_model(args) as model:
        data: dict[str, Any] = {"model": str(model.path), "prompts": prompts, "modes": []}
        try:
            for layout, fa in progress(modes, "kv-live"):
                data["modes"].append(
                    run_mode(model, layout=layout, flash_attn=fa, prompts=prompts, n_ctx=args.ctx_size, ctx_kwargs=kw)
                )
        except KeyboardInterrupt:
            data["ok"] = all(m["ok"] for m in data["modes"])
            raise Interrupted(data if data["modes"] else None, len(data["modes"]), len(modes), "modes") from None
    data["ok"] = all(m["ok"] for m in data["modes"])
    return data


def print_report(data: dict, *, all_tensors: bool = False) -> None:
    """Print what :func:`run` returned: per mode the tensors in memory order and each sequence's
    comparison.

    Args:
        data: What :func:`run` returned.
        all_tensors: List every tensor (otherwise the first six and the last two).
    """
    from .common import print_table

    print(f"model {data['model']}; prompts: " + "; ".join(f"seq {i}: {p!r}" for i, p in enumerate(data["prompts"])))
    for m in data["modes"]:
        mem = m["memory"]
        t0 = m["tensors"][0]
        streams = t0["ne"][2]
        print(
            f"\n{m['layout']}, flash_attn {m['flash_attn']} (v_trans {int(m['v_trans'])}): n_ctx {m['n_ctx']}, "
            f"n_seq_max {m['n_seq_max']}, {streams} stream(s) of {t0['ne'][1]} cells; "
            f"{m['n_passes']} passes watched"
        )
        bufs = ", ".join(f"{b} {n:,} bytes" for b, n in mem["buffers"].items())
        order = mem["order"]
        shown = order if len(order) <= 8 else [*order[:6], "...", *order[-2:]]
        print(
            f"  memory order (by offset): {' '.join(shown)}; buffer(s): {bufs}; "
            f"{mem['gaps']:,} bytes not covered by a tensor"
        )
        ts = m["tensors"]
        cut = not all_tensors and len(ts) > 8
        rows = [
            {
                **t,
                "ne_s": " x ".join(str(x) for x in t["ne"][:3]),
                "nb_s": ", ".join(str(x) for x in t["nb"][:3]),
                "end": t["buffer_offset"] + t["nbytes"],
            }
            for t in (ts[:6] + ts[-2:] if cut else ts)
        ]
        if cut:  # --all lists every one
            rows.insert(6, {"name": f"({len(ts) - 8} more)"})
        print_table(
            rows,
            [
                ("name", "tensor", "s"),
                ("type", "type", "s"),
                ("ne_s", "ne", "s"),
                ("nb_s", "nb (bytes)", "s"),
                ("buffer", "buffer", "s"),
                ("buffer_offset", "offset", ","),
                ("end", "end", ","),
                ("nbytes", "bytes", ","),
            ],
        )
        for s in m["seqs"]:
            k = [r for r in s["layers"] if r["kind"] == "K"]
            v = [r for r in s["layers"] if r["kind"] == "V"]
            verdict = "live = file, byte for byte" if s["ok"] else f"{s['mismatches']:,} BYTES DIFFER"
            print(
                f"  seq {s['seq_id']}: stream {s['stream']}, cells {_ranges(s['cells'])} (from attn_inp_k_idxs; "
                f"the dump's {len(s['cells'])} cells have the same positions); {len(k)} K + {len(v)} V layers, "
                f"{s['bytes']:,} bytes of the {s['dump_bytes']:,}-byte dump: {verdict}"
            )
            for r in s["layers"]:
                if r["mismatches"]:
                    f = r["first"]
                    print(
                        f"    {r['kind']} layer {r['layer']}: {r['mismatches']} bytes differ; "
                        f"first at cell {f['cell']} "
                        f"({f['what']}): tensor byte {f['tensor_offset']:,} (buffer {f['buffer_offset']:,}), "
                        f"dump byte {f['dump_offset']:,}"
                    )
    n_seq = sum(len(m["seqs"]) for m in data["modes"])
    n_bytes = sum(s["bytes"] for m in data["modes"] for s in m["seqs"])
    if data["ok"]:
        print(f"\nlive = file: {n_bytes:,} bytes of {n_seq} sequences in {len(data['modes'])} modes, every one equal")
    else:
        print(f"\nLIVE AND FILE DIFFER: {sum(s['mismatches'] for m in data['modes'] for s in m['seqs']):,} bytes")


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw the first mode's live buffer against sequence 0's dump (matplotlib) into ``path``: the
    tensors in memory order, the dump's records (lines join a tensor to its record), and which
    cells hold which sequence.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (its suffix picks the format).
    """
    from matplotlib.patches import ConnectionPatch

    from .common import figure

    m = data["modes"][0]
    seq = m["seqs"][0]
    ts = m["tensors"]
    size = next(iter(m["memory"]["buffers"].values()))
    colors = {"K": ("#4c72b0", "#8fa9d6"), "V": ("#dd8452", "#efb48f")}
    with figure(
        path,
        3,
        1,
        figsize=(11, 6.8),
        gridspec_kw={"height_ratios": [1, 1, 1.1], "hspace": 1.3},
        tight=False,
        bbox_inches="tight",
    ) as (fig, (live, dump, cellmap)):
        mib = 2**20
        for t in ts:
            live.barh(0, t["nbytes"] / mib, left=t["buffer_offset"] / mib, color=colors[t["kind"]][t["layer"] % 2])
        live.set_xlim(0, size / mib)
        live.set_yticks([])
        live.set_xlabel("MiB from the buffer's base", fontsize=8)
        live.set_title(
            f"the live {ts[0]['buffer']} buffer ({size:,} bytes), tensors sorted by the offset each one reports: "
            f"{' '.join(m['memory']['order'][:4])} ... {' '.join(m['memory']['order'][-2:])}",
            fontsize=9,
        )
        n_layer = len({t["layer"] for t in ts})
        row = seq["bytes"] // (2 * n_layer)
        total = seq["dump_bytes"]
        meta = total - 2 * n_layer * row
        kib = 1024
        for i in range(2 * n_layer):
            kind = "K" if i < n_layer else "V"
            dump.barh(0, row / kib, left=(meta + i * row) / kib, color=colors[kind][(i % n_layer) % 2])
        dump.set_xlim(0, total / kib)
        dump.set_yticks([])
        dump.set_xlabel("KiB from the dump's start", fontsize=8)
        dump.set_title(
            f"sequence 0's llama_state_seq_get_data_ext dump ({total:,} bytes): {meta} bytes of metadata, every "
            f"layer's K, then every layer's V\n{seq['bytes']:,} bytes compared with the same rows of the live tensors: "
            + ("all equal" if seq["ok"] else f"{seq['mismatches']:,} DIFFER"),
            fontsize=9,
        )
        for t in ts[:4]:
            rec = t["layer"] + (n_layer if t["kind"] == "V" else 0)
            fig.add_artist(
                ConnectionPatch(
                    xyA=((t["buffer_offset"] + t["nbytes"] / 2) / mib, -0.4),
                    coordsA=live.transData,
                    xyB=((meta + rec * row + row / 2) / kib, 0.4),
                    coordsB=dump.transData,
                    color=colors[t["kind"]][0],
                    lw=1.2,
                )
            )
        # which cells hold which sequence (the stream of sequence 0)
        kv_size = ts[0]["ne"][1]
        owner = np.full(kv_size, -1)
        for s in m["seqs"]:
            if s["stream"] == seq["stream"]:
                owner[s["cells"]] = s["seq_id"]
        used = np.flatnonzero(owner >= 0)
        n_show = min(kv_size, int(used.max()) + 6 if used.size else 16)
        palette = ["#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#ccb974"]
        for c in range(n_show):
            o = owner[c]
            cellmap.barh(0, 1, left=c, color=palette[o % len(palette)] if o >= 0 else "#dddddd", edgecolor="white")
        for s in m["seqs"]:
            if s["stream"] == seq["stream"]:
                for c, p in zip(s["cells"], s["pos"]):
                    if c < n_show:
                        cellmap.text(c + 0.5, 0, str(p), ha="center", va="center", fontsize=7, color="white")
        cellmap.set_xlim(0, n_show)
        cellmap.set_yticks([])
        cellmap.set_xlabel(f"cell of stream {seq['stream']} (of {kv_size})", fontsize=8)
        row_b = ts[0]["nb"][1]
        layout = (
            "V transposed (v_trans 1): value j of cell c at byte "
            f"(j x {kv_size} + c) x {ts[1]['nb'][0]} of cache_v_l<il>"
            if m["v_trans"]
            else "V the same way (v_trans 0)"
        )
        from matplotlib.patches import Patch

        here = [s for s in m["seqs"] if s["stream"] == seq["stream"]]
        cellmap.legend(
            handles=[Patch(color=palette[s["seq_id"] % len(palette)], label=f"seq {s['seq_id']}") for s in here]
            + [Patch(color="#dddddd", label="empty")],
            loc="upper right",
            fontsize=7,
            ncol=len(here) + 1,
            bbox_to_anchor=(1.0, -0.45),
        )
        cellmap.set_title(
            "which cells hold which sequence, from attn_inp_k_idxs (numbers: positions)\ncell c of K is bytes "
            f"c x {row_b} of cache_k_l<il>; {layout}",
            fontsize=8,
        )


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_path_flag(p)
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="n_ctx (default %(default)s)")
    add_context_flags(p, flash_attn=False)
    p.add_argument("--modes", default=MODES, help="layout:fa, comma-separated (default %(default)s)")
    p.add_argument("--prompt", action="append", help="one per sequence (repeat; default: two built-in prompts)")
    p.add_argument("--all", action="store_true", help="list every tensor, not the first six and the last two")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-o", "--output", help="write a figure of the first mode (PNG)")


def _printer(args: argparse.Namespace) -> Callable[[dict], None]:
    return functools.partial(print_report, all_tensors=args.all)


COMMAND = Command(
    "kv-live",
    "the KV cache tensors in their buffer, against the state dump",
    __name__,
    _flags,
    printer=_printer,
    failure=lambda data: "the live cache and the dump DIFFER",
)
add_parser, main = COMMAND.add_parser, COMMAND
