"""Captures and patches over a context's taps: :class:`Capture`, :class:`Patch`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._lib import ffi, lib
from ..errors import TapError
from ._graph import _AUTO_INPUTS, _NUMPY, GraphNode, NamesFilter, _listing, _n_dims, _op_name, resolve, split_name
from ._rows import TapInfo, TapRecord, _Call, _rows_along, _Splitting, _token_axis, _type_id_name, plan_ubatches
from ._taps import taps_of

if TYPE_CHECKING:
    from ..context import Context

# -- capture ---------------------------------------------------------------------------------------


class Capture:
    """Tensors of the forward passes run while it is active (:meth:`Context.capture`).

    A context manager: the decodes inside the ``with`` block (``ctx.decode``, ``prefill``,
    ``generate``, ``generate_parallel``, a ``Scheduler``'s steps) are captured; leaving the block
    disarms it and leaves the records readable. Index it by ``"l_out-5"``, ``("l_out", 5)`` or a
    site (``"embd"``): the rows of every pass in batch order, concatenated (a view when there is
    one pass); :attr:`records` has each pass's copy.

    Attributes:
        graph: The listing the names were resolved against.
        nodes: The nodes and inputs captured.
        names: The filter asked for.
        copy: Whether the tensors are copied; False keeps only each record's shape, op and pass
            (the cost of the graph splits without the copies).
        auto_inputs: ``inp_tokens`` / ``inp_pos``, captured with every capture to check which
            batch rows each pass holds (left out of :attr:`records` unless asked for).
        max_bytes: The arena's size: a capture that needs more raises :class:`CaptureLimitError`
            from the decode (rolled back), before anything is overwritten.

    Args:
        ctx: The context (:meth:`Context.capture` makes captures).
        names: A :data:`NamesFilter`.
        layers: Only these layers of layered names.
        which: For names several nodes carry (see :func:`resolve`).
        max_bytes: The arena's size in bytes.
        max_records: The most tensor copies and decode calls it holds.
        copy: False: records without data.
        n_tokens: The listing's probe size.

    Raises:
        TapError: A name the pass does not produce, or a context that cannot be tapped.
        ValueError: A limit that is not positive.
    """

    def __init__(
        self,
        ctx: Context,
        names: NamesFilter,
        *,
        layers: Sequence[int] | None = None,
        which: int | str | None = None,
        max_bytes: int = 1 << 30,
        max_records: int = 1 << 16,
        copy: bool = True,
        n_tokens: int = 3,
    ) -> None:
        if max_bytes <= 0 or max_records <= 0:
            raise ValueError("max_bytes and max_records must be positive")
        self._taps = taps_of(ctx)
        self.graph = _listing(ctx, n_tokens)
        self.names = names
        nodes = resolve(self.graph, names, layers, which)
        auto = [i for i in self.graph.inputs if i.name in _AUTO_INPUTS and i not in nodes]
        self.nodes = nodes
        self.auto_inputs = auto
        self.copy = bool(copy)
        self._auto = {i.name for i in auto}
        self._all = [*nodes, *auto]
        self.max_bytes = int(max_bytes)
        self._arena = np.empty(self.max_bytes, np.uint8)  # untouched pages cost no memory
        self._records_c = ffi.new("pyl_tap_record[]", max_records)
        self._calls_c = ffi.new("pyl_tap_call[]", max_records)
        self._max_records = max_records
        self._records: list[TapRecord] = []
        self._built = 0
        self._active = False
        self._n_calls = 0
        self._py_calls: list[_Call] = []
        self._c_calls: list[tuple[int, int, int, int, int]] = []
        self._splitting = _Splitting.of(ctx)
        self._inputs_by_pass: dict[tuple[int, str], tuple[int, int]] = {}
        self._indexed = 0
        self._py_index: list[int] = []

    # lifetime
    def __enter__(self) -> Capture:
        t = self._taps
        if t.capture is not None:
            raise TapError("a capture is already active on this context; end it first")
        s = t.state
        t.capture = self
        t.reset_counters()
        s.arena = ffi.from_buffer(self._arena)
        s.arena_cap = self.max_bytes
        s.records, s.records_cap = self._records_c, self._max_records
        s.calls, s.calls_cap = self._calls_c, self._max_records
        try:
            t.rearm()
        except BaseException:
            t.capture = None
            raise
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop capturing (idempotent); the records stay readable."""
        if not self._active:
            return
        t = self._taps
        s = t.state
        self._snapshot()
        t.capture = None
        s.arena, s.arena_cap = ffi.NULL, 0
        s.records, s.records_cap = ffi.NULL, 0
        s.calls, s.calls_cap = ffi.NULL, 0
        s.n_records = s.n_calls = 0
        self._py_calls = list(t.calls)
        t.calls = []
        t.rearm()
        self._active = False

    def _snapshot(self) -> None:
        s = self._taps.state
        self._n_records = int(s.n_records)
        self._n_calls = int(s.n_calls)
        self._c_calls = [
            (
                int(s.calls[i].first_pass),
                int(s.calls[i].n_rows),
                int(s.calls[i].token),
                int(s.calls[i].pos),
                int(s.calls[i].seq_id),
            )
            for i in range(self._n_calls)
        ]
        self._py_calls = list(self._taps.calls)
        self.nbytes_used = int(s.arena_used)

    # results
    @property
    def nbytes(self) -> int:
        """Bytes the copies take in the arena (alignment included)."""
        if self._active:
            return int(self._taps.state.arena_used)
        return getattr(self, "nbytes_used", 0)

    @property
    def n_passes(self) -> int:
        """Forward passes captured."""
        recs = self.records
        return 1 + max(r.pass_index for r in recs) if recs else 0

    @property
    def records(self) -> list[TapRecord]:
        """One record per captured tensor per pass, in the order they were computed (the
        automatic ``inp_tokens`` / ``inp_pos`` inputs left out unless asked for)."""
        if self._active:
            self._snapshot()
        self._build()
        return [r for r in self._records if not (r.kind == "input" and r.name in self._auto)]

    def _meta(self, call_index: int) -> _Call | None:
        if call_index < 0 or call_index >= len(self._c_calls):
            return None
        first, n_rows, tok, pos, seq = self._c_calls[call_index]
        if n_rows == 1:
            one = _Call(np.array([tok], np.int32), np.array([pos], np.int32), ((seq,),), None)
            one.ubatches = [np.zeros(1, np.int64)]
            one.first_pass = first
            return one
        if len(self._py_index) != len(self._c_calls):  # call -> its Context.decode batch, in order
            k, self._py_index = 0, []
            for cc in self._c_calls:
                self._py_index.append(k)
                k += cc[1] == 0
        py = self._py_index[call_index]
        if py >= len(self._py_calls):
            return None
        c = self._py_calls[py]
        c.first_pass = first
        return c

    def _build(self) -> None:
        known = {(n.name, n.kind, n.occurrence): n for n in self._all}
        rc = self._records_c
        for i in range(self._built, self._n_records):
            r = rc[i]
            name = ffi.string(r.name).decode("utf-8", "replace")
            kind = "input" if r.flags & lib.PYL_TAPREC_INPUT else "node"
            node = known.get((name, kind, int(r.occurrence)))
            if node is None:  # not in the listing (cannot happen: C only copies what was resolved)
                node = GraphNode(
                    -1,
                    name,
                    *split_name(name),
                    int(r.occurrence),
                    True,
                    _op_name(int(r.op)),
                    _type_id_name(int(r.type)),
                    (),
                    (0, 0, 0, 0),
                    False,
                    None,
                    (),
                    kind,
                    None,
                    1,
                )
            ne = tuple(int(r.ne[k]) for k in range(4))
            nb = tuple(int(r.nb[k]) for k in range(4))
            ndim = max(node.ndim, _n_dims(ne))
            shape = tuple(reversed(ne[:ndim]))
            data = self._data_view(r, ne, nb, ndim)
            call_index, pass_index = int(r.call), int(r.pass_no)
            meta = self._meta(call_index)
            ub = pass_index - (meta.first_pass if meta is not None else 0)
            rows = None
            if meta is not None:
                if meta.ubatches is None:
                    meta.ubatches = plan_ubatches(self._splitting, meta)
                if 0 <= ub < len(meta.ubatches):
                    rows = self._checked_rows(meta, ub, pass_index)
            rws, seq_ids, pos, outs = _rows_along(node, ne, rows, meta)
            self._records.append(
                TapRecord(
                    name=name,
                    site=node.site,
                    layer=node.layer,
                    occurrence=node.occurrence,
                    op=_op_name(int(r.op)),
                    type=_type_id_name(int(r.type)),
                    ne=ne,
                    nb=nb,
                    shape=shape,
                    call=call_index,
                    ubatch=ub,
                    pass_index=pass_index,
                    kind=kind,
                    token_axis=_token_axis(node, ne),
                    rows=rws,
                    tokens=None if rws is None or meta is None or meta.tokens is None else meta.tokens[rws],
                    pos=pos,
                    seq_ids=seq_ids,
                    outputs_only=outs,
                    data=data,
                    n_stream=int(ne[3]) if node.token_axis is not None and node.ndim - 1 - node.token_axis < 3 else 1,
                    offset=int(r.offset),
                    nbytes=int(r.nbytes),
                    buffer=ffi.string(r.buffer).decode("utf-8", "replace"),
                    buffer_offset=int(r.buffer_offset),
                    buffer_size=int(r.buffer_size),
                    buffer_usage=int(r.buffer_usage),
                    on_host=bool(r.is_host),
                )
            )
        self._built = self._n_records

    def _checked_rows(self, meta: _Call, ub: int, pass_index: int) -> np.ndarray | None:
        """The planner's rows for the pass, checked against the pass's own inp_tokens / inp_pos;
        when they disagree, rows matched by (token, position) in batch order instead."""
        assert meta.ubatches is not None
        rows = meta.ubatches[ub]
        got_pos = self._auto_input(pass_index, "inp_pos")
        got_tok = self._auto_input(pass_index, "inp_tokens")
        if got_pos is None and got_tok is None:
            return rows
        ok = True
        if got_pos is not None and (
            got_pos.size < rows.size or not np.array_equal(got_pos[: rows.size], meta.pos[rows])
        ):
            ok = False
        if ok and got_tok is not None and meta.tokens is not None:
            ok = got_tok.size == rows.size and np.array_equal(got_tok, meta.tokens[rows])
        if ok:
            return rows
        if got_pos is None or meta.tokens is None or got_tok is None:
            return None
        used = np.zeros(len(meta.pos), bool)
        out = []
        for tok, p in zip(got_tok.tolist(), got_pos[: got_tok.size].tolist()):
            cand = np.flatnonzero(~used & (meta.tokens == tok) & (meta.pos == p))
            if cand.size == 0:
                return None
            used[cand[0]] = True
            out.append(int(cand[0]))
        return np.asarray(out, np.int64)

    def _auto_input(self, pass_index: int, name: str) -> np.ndarray | None:
        """The pass's own ``inp_pos`` / ``inp_tokens`` (int32), from an index made once per record."""
        rc = self._records_c
        for i in range(self._indexed, self._n_records):  # records not indexed yet
            r = rc[i]
            if r.flags & lib.PYL_TAPREC_INPUT and not r.flags & lib.PYL_TAPREC_NO_DATA:
                key = (int(r.pass_no), ffi.string(r.name).decode("utf-8", "replace"))
                self._inputs_by_pass.setdefault(key, (int(r.offset), int(r.nbytes)))
        self._indexed = self._n_records
        where = self._inputs_by_pass.get((pass_index, name))
        if where is None:
            return None
        return self._arena[where[0] : where[0] + where[1]].view(np.int32)

    def _data_view(self, r, ne, nb, ndim) -> np.ndarray:
        t = int(r.type)
        shape = tuple(reversed(ne[:ndim]))
        off, n = int(r.offset), int(r.nbytes)
        dtype = _NUMPY.get(t)
        if r.flags & lib.PYL_TAPREC_NO_DATA or n == 0:  # nothing to copy (a pass with no output rows)
            return np.zeros(shape if 0 in shape else (0,), dtype or np.uint8)
        raw = self._arena[off : off + n]
        if dtype is None:  # quantized: raw rows of blocks
            row = int(lib.ggml_row_size(t, ne[0]))
            return np.lib.stride_tricks.as_strided(
                raw, shape=(*reversed(ne[1:ndim]), row), strides=(*reversed(nb[1:ndim]), 1), writeable=False
            )
        return np.ndarray(shape, dtype=dtype, buffer=raw, strides=tuple(reversed(nb[:ndim])))

    # lookup
    def _pick(self, key) -> list[TapRecord]:
        if isinstance(key, tuple):
            site, layer = key
            want = lambda r: r.site == site and r.layer == layer  # noqa: E731
        elif isinstance(key, str):
            want = lambda r: r.name == key or (r.site == key and r.layer is None)  # noqa: E731
        else:
            raise TypeError(f"a capture is indexed by a name or (site, layer), got {key!r}")
        recs = [r for r in self.records if want(r)]
        if not recs and isinstance(key, str) and any(r.site == key for r in self.records):
            layers = sorted({r.layer for r in self.records if r.site == key and r.layer is not None})
            raise KeyError(f"{key!r} is layered: index by ({key!r}, layer), layers captured: {layers}")
        if not recs:
            have = sorted({r.name for r in self.records})
            raise KeyError(f"{key!r}: nothing captured under that name (captured: {', '.join(have[:40])})")
        return recs

    def __getitem__(self, key: str | tuple[str, int]) -> np.ndarray:
        return self.get(key)

    def get(self, key: str | tuple[str, int], *, seq_id: int | None = None, call: int | None = None) -> np.ndarray:
        """The rows of a captured tensor, over every pass (or one decode call), in batch order.

        Args:
            key: ``"l_out-5"``, ``("l_out", 5)`` or an unlayered name (``"result_norm"``).
            seq_id: Only the rows of this sequence (a row belongs to every sequence it carries).
            call: Only the passes of this decode call (counted from the capture's start).

        Returns:
            The passes' arrays concatenated along their token axis, rows sorted by (call, batch
            index); a view of the record when one pass holds them all in order. Tensors without a
            token axis come stacked, one per pass, on a new first axis.

        Raises:
            KeyError: Nothing was captured under ``key``.
            TapError: Passes of different shapes (``n_kv`` grew) cannot be concatenated, or the
                rows of a pass are not known and ``seq_id`` was asked for.
        """
        recs = [r for r in self._pick(key) if call is None or r.call == call]
        if not recs:
            raise KeyError(f"{key!r}: nothing captured in call {call}")
        ax = recs[0].token_axis
        if ax is None or any(r.token_axis != ax for r in recs):
            if seq_id is not None:
                raise TapError(f"{key!r}: this tensor has no axis of batch rows to pick seq_id {seq_id} from")
            arrays = [r.array() for r in recs]
            if len({a.shape for a in arrays}) > 1:
                raise TapError(f"{key!r}: its passes have different shapes; read cap.records")
            return arrays[0][None] if len(arrays) == 1 else np.stack(arrays)
        parts = []
        for r in recs:
            a, ax = r.by_rows()
            if seq_id is not None:
                if r.seq_ids is None:
                    raise TapError(f"{r.name}: the rows of pass {r.pass_index} are not known; read cap.records")
                keep = np.array([i for i, s in enumerate(r.seq_ids) if seq_id in s], np.int64)
                if keep.size == 0:
                    continue
                if keep.size != a.shape[ax]:
                    a = np.take(a, keep, axis=ax)
                order = r.rows[keep] if r.rows is not None else None
            else:
                order = r.rows
            parts.append((r.call, order, a))
        if not parts:
            raise KeyError(f"{key!r}: no row of seq_id {seq_id} was captured")
        if len(parts) == 1 and (parts[0][1] is None or np.all(np.diff(parts[0][1]) > 0)):
            return parts[0][2]
        other = {tuple(np.delete(a.shape, ax)) for _, _, a in parts}
        if len(other) > 1:
            raise TapError(f"{key!r}: its passes have different shapes {sorted(other)}; read cap.records")
        keys = np.concatenate(
            [
                np.stack([np.full(a.shape[ax], c), o if o is not None else np.arange(a.shape[ax])], 1)
                for c, o, a in parts
            ]
        )
        cat = np.concatenate([a for _, _, a in parts], axis=ax)
        order = np.lexsort((keys[:, 1], keys[:, 0]))
        return np.take(cat, order, axis=ax)

    def rows(self, seq_id: int) -> _SeqView:
        """This capture seen through one sequence: ``cap.rows(seq_id=1)["l_out", 5]``.

        Args:
            seq_id: The sequence.

        Returns:
            An object indexed like the capture, giving only that sequence's rows.
        """
        return _SeqView(self, seq_id)

    def __repr__(self) -> str:
        return f"<Capture {self.names!r}: {len(self.records)} records, {self.nbytes:,} bytes>"


class _SeqView:
    def __init__(self, cap: Capture, seq_id: int) -> None:
        self.cap, self.seq_id = cap, seq_id

    def __getitem__(self, key) -> np.ndarray:
        return self.cap.get(key, seq_id=self.seq_id)


# -- patch -----------------------------------------------------------------------------------------


class Patch:
    """A Python function called at named nodes of every forward pass while active
    (:meth:`Context.patch`): it gets the tensor as a writable numpy array (numpy order) and a
    :class:`TapInfo`, and changes it in place or returns the new values; later nodes read what it
    left. An exception in it stops the decode (its ubatch rolled back) and the decode raises it.

    Attributes:
        nodes: The nodes it is called at.
        fn: The function.
        n_calls: How many times it was called.
        seconds: Wall time of those calls in Python: building the array and the
            :class:`TapInfo` (each patch at a shared node counts that part in full), the
            function, and the copy back for a tensor not in host memory. ``seconds / n_calls``
            is what one call costs.

    Args:
        ctx: The context (:meth:`Context.patch` makes patches).
        names: A :data:`NamesFilter`.
        fn: ``fn(array, info)``.
        layers: Only these layers of layered names.
        which: For names several nodes carry (see :func:`resolve`).
        n_tokens: The listing's probe size.

    Raises:
        TapError: A name the pass does not produce, or a context that cannot be tapped.
        TypeError: ``fn`` is not callable.
    """

    def __init__(
        self,
        ctx: Context,
        names: NamesFilter,
        fn: Callable[[np.ndarray, TapInfo], np.ndarray | None],
        *,
        layers: Sequence[int] | None = None,
        which: int | str | None = None,
        n_tokens: int = 3,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self._taps = taps_of(ctx)
        self.graph = _listing(ctx, n_tokens)
        self.nodes = resolve(self.graph, names, layers, which)
        self.fn = fn
        self.n_calls = 0
        self.seconds = 0.0
        self._active = False

    def __enter__(self) -> Patch:
        t = self._taps
        if t.capture is None and not t.patches:
            t.reset_counters()
        t.patches.append(self)
        t.rearm()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop patching (idempotent)."""
        if not self._active:
            return
        t = self._taps
        t.patches.remove(self)
        t.rearm()
        self._active = False
