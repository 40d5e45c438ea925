"""The taps of one context (:class:`Taps`): the C state's want table from the active capture,
patches and pass counters, the decode hooks, and the trampoline C calls for a patch."""

from __future__ import annotations

import math
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .._handle import view
from .._lib import ffi, lib
from ..errors import CaptureLimitError, TapError
from ._graph import _NUMPY, Graph, GraphNode, _n_dims, _op_name, _type_name
from ._rows import TapInfo, _Call, _rows_along, _token_axis, plan_ubatches

if TYPE_CHECKING:
    from ..context import Context
    from ._capture import Capture, Patch


class Taps:
    """The taps of one context: the armed capture and patches, and the C state's tables.

    Made by the context on first use; users go through :meth:`Context.capture` and
    :meth:`Context.patch`. One capture at a time, any number of patches."""

    def __init__(self, ctx: Context) -> None:
        state = ctx._taps_state
        if state is None:
            why = (
                "it was made with its own cb_eval" if ctx.params.cb_eval is not None else "it was made with taps=False"
            )
            raise TapError(f"this context cannot be tapped: {why}")
        self._ctx = weakref.ref(ctx)
        self.state = state
        self.capture: Capture | None = None
        self.patches: list[Patch] = []
        self.calls: list[_Call] = []  # Context.decode batches: all while capturing, else the last
        self._keep: list[Any] = []  # C tables alive while armed
        self._ring = ffi.new("pyl_tap_call[]", 1)  # patches only: the current call
        self._handle = ffi.new_handle(self)
        state.handle = self._handle
        self.want_nodes: dict[tuple[int, int], GraphNode] = {}  # (want, occurrence) -> node
        self.want_patches: dict[tuple[int, int], list[Patch]] = {}
        self.error: BaseException | None = None
        self.counting: Graph | None = None  # a PassCounter counts here: the listing whose first node starts a pass
        self.n_counters = 0
        self._passes_before = 0  # passes and asks counted before the C counters were last reset
        self._asked_before = 0

    @property
    def armed(self) -> bool:
        """Whether a capture, a patch or a pass counter is active."""
        return self.capture is not None or bool(self.patches) or self.n_counters > 0

    def passes(self) -> tuple[int, int]:
        """Forward passes begun and graph nodes asked about while armed (the C state's
        ``cur_pass`` and ``n_asked``, summed across the resets of captures): running counts,
        meaningful as differences (what a :class:`~pyllamacpp.PassCounter` reads)."""
        s = self.state
        return self._passes_before + int(s.cur_pass) + 1, self._asked_before + int(s.n_asked)

    def count(self, graph: Graph | None, on: bool) -> None:
        """Start (``on``, with the context's listing) or stop one pass counter: armed with no
        want, the C callback still counts each pass where the graph's first node comes again
        (``cur_pass``)."""
        self.n_counters = max(0, self.n_counters + (1 if on else -1))
        if on:
            self.counting = graph
        elif self.n_counters == 0:
            self.counting = None
        self.rearm()

    def ctx(self) -> Context:
        """The context (raises TapError once it is gone)."""
        c = self._ctx()
        if c is None:
            raise TapError("the context is gone")
        return c

    def rearm(self) -> None:
        """Rebuild the C want table from the active capture and patches (between decodes)."""
        ctx = self.ctx()
        s = self.state
        s.armed = 0
        ctx._abort_state.taps = ffi.NULL
        if not self.armed:
            s.wants, s.table, s.n_wants, s.n_input_wants = ffi.NULL, ffi.NULL, 0, 0
            self._keep = []
            return
        graph = None
        sources: list[tuple[list[GraphNode], int, Patch | None]] = []
        if self.capture is not None:
            graph = self.capture.graph
            copy = lib.PYL_TAP_CAPTURE if self.capture.copy else lib.PYL_TAP_META
            sources.append((self.capture.nodes, copy, None))
            sources.append((self.capture.auto_inputs, lib.PYL_TAP_CAPTURE, None))
        for p in self.patches:
            graph = graph or p.graph
            sources.append((p.nodes, lib.PYL_TAP_PATCH, p))
        graph = graph or self.counting  # a counter alone: no want, passes counted all the same
        # one want per name; per occurrence its mode bits, its node and the patches there
        by_name: dict[str, dict[int, list]] = {}
        for nodes, bit, patch in sources:
            for n in nodes:
                occ = by_name.setdefault(n.name, {}).setdefault(n.occurrence, [n, 0, []])
                occ[1] |= bit
                if patch is not None:
                    occ[2].append(patch)
        n_wants = len(by_name)
        arr = ffi.new("pyl_tap_want[]", n_wants)
        size = 1 << max(4, math.ceil(math.log2(2 * n_wants + 1)))
        table = ffi.new("int32_t[]", size)
        self.want_nodes = {}
        self.want_patches = {}
        n_inputs = 0
        ops = _op_ids()
        for i, (name, occs) in enumerate(by_name.items()):
            raw = name.encode()
            if len(raw) >= lib.PYL_TAP_NAME:
                raise TapError(f"{name}: longer than ggml's {lib.PYL_TAP_NAME - 1}-byte names")
            w = arr[i]
            w.name = raw
            for k in range(lib.PYL_TAP_OCC):
                w.ops[k] = -1
            for k, (node, mode, pl) in occs.items():
                if k >= lib.PYL_TAP_OCC:
                    raise TapError(f"{name}: occurrence {k}: taps tell apart the first {lib.PYL_TAP_OCC} of a name")
                w.modes[k] = mode
                w.ops[k] = ops[node.op] if node.kind == "node" else -1
                w.input = node.kind == "input"
                n_inputs += node.kind == "input"
                self.want_nodes[(i, k)] = node
                self.want_patches[(i, k)] = pl
        s.wants, s.n_wants, s.n_input_wants = arr, n_wants, n_inputs
        s.table, s.table_mask = table, size - 1
        for i in range(n_wants):
            lib.pyl_tap_table_add(s, i)
        assert graph is not None
        first = graph.first.encode()
        s.pass_start = first
        s.pass_start_hash = lib.pyl_tap_hash(first)
        s.inputs_left = n_inputs
        s.pending = -1
        if self.capture is None:  # patches only: one call slot, reused
            s.calls, s.calls_cap, s.calls_ring = self._ring, 1, 1
        else:
            s.calls_ring = 0
        self._keep = [arr, table]
        s.abort_flag = ffi.addressof(ctx._abort_state, "abort_requested")
        s.armed = 1
        ctx._abort_state.taps = s

    def reset_counters(self) -> None:
        """Start counting calls, passes and records from zero (a new capture, or the first patch)."""
        s = self.state
        passes, asked = self.passes()  # kept for the pass counters
        self._passes_before, self._asked_before = passes, asked
        s.n_records = s.n_calls = s.n_calls_total = 0
        s.arena_used = s.arena_need = 0
        s.cur_pass = -1
        s.error = 0
        s.n_asked = 0
        self.calls = []
        self.error = None

    def before_call(self, batch) -> None:
        """A Context.decode is about to run: note its batch, and a new call in C."""
        if self.capture is None and not self.patches:  # pass counters only: no rows to know
            lib.pyl_taps_begin_call(self.state, 0, 0, 0, 0)
            return
        n = len(batch)
        tokens = batch.token[:n].copy() if batch._token is not None else None
        nsid = batch.n_seq_id
        sid = batch.seq_id
        seq_ids = tuple(tuple(int(x) for x in sid[i, : nsid[i]]) for i in range(n))
        call = _Call(tokens, batch.pos[:n].copy(), seq_ids, batch.logits[:n] != 0)
        if self.capture is None:
            self.calls = [call]
        else:
            self.calls.append(call)
        lib.pyl_taps_begin_call(self.state, 0, 0, 0, 0)

    def failed(self) -> BaseException | None:
        """The failure kept during the last decode, as the exception to raise (cleared)."""
        s = self.state
        if not s.error and self.error is None:
            return None
        err, self.error = self.error, None
        code, name = int(s.error), ffi.string(s.error_name).decode("utf-8", "replace")
        s.error = 0
        if self.armed:
            s.armed = 1  # pyl_tap_fail disarmed it for the rest of the failed decode
        if err is not None:
            return err
        if code == lib.PYL_TAPERR_ARENA:
            n = self._n_visible_records()
            return CaptureLimitError(
                f"capture: {name} did not fit: the copies need {int(s.arena_need):,} bytes, max_bytes is "
                f"{int(s.arena_cap):,} ({n} record{'s' if n != 1 else ''} captured before it); raise "
                "max_bytes, or capture fewer nodes or layers"
            )
        if code in (lib.PYL_TAPERR_RECORDS, lib.PYL_TAPERR_CALLS):
            what = "tensor copies" if code == lib.PYL_TAPERR_RECORDS else "decode calls"
            return CaptureLimitError(f"capture: more {what} than max_records={int(s.records_cap)}; raise it")
        if code == lib.PYL_TAPERR_OP:
            return TapError(
                f"{name}: this pass's graph differs from the listing (a {_op_name(int(s.error_op))} node where "
                "the listing had another op): tap it with which='all'"
            )
        return TapError(f"taps: failure {code} at {name}")

    def _n_visible_records(self) -> int:
        """Records the capture shows (``cap.records``): the automatic ``inp_tokens`` / ``inp_pos``
        copies left out, as the capture leaves them out."""
        s, cap = self.state, self.capture
        auto = {i.name.encode() for i in cap.auto_inputs} if cap is not None else set()
        n = 0
        for i in range(int(s.n_records)):
            r = s.records[i]
            n += not (r.flags & lib.PYL_TAPREC_INPUT and ffi.string(r.name) in auto)
        return n

    def current_call(self) -> tuple[int, _Call | None]:
        """The running decode call: its index (counted from when the taps were armed) and batch."""
        s = self.state
        i = int(s.n_calls) - 1
        if i < 0:
            return -1, None
        c = s.calls[i]
        index = int(s.n_calls_total) - 1
        if c.n_rows == 1:
            one = _Call(np.array([c.token], np.int32), np.array([c.pos], np.int32), ((int(c.seq_id),),), None)
            one.ubatches = [np.zeros(1, np.int64)]
            one.first_pass = int(c.first_pass)
            return index, one
        call = self.calls[-1] if self.calls else None
        if call is not None:
            call.first_pass = int(c.first_pass)
        return index, call

    def on_patch(self, t, want: int, occurrence: int, pass_index: int) -> bool:
        """C calls this (through the trampoline) for a patched node; False stops the decode."""
        try:
            self._patch(t, (want, occurrence), pass_index)
            return True
        except BaseException as e:  # noqa: BLE001 - raised by the decode once C has returned
            if self.error is None:
                self.error = e
            return False

    def _patch(self, t, want: tuple[int, int], pass_index: int) -> None:
        t0 = time.perf_counter()
        node = self.want_nodes[want]
        call_index, meta = self.current_call()
        ub = pass_index - (meta.first_pass if meta is not None else 0)
        rows = None
        if meta is not None:
            if meta.ubatches is None:
                meta.ubatches = plan_ubatches(self.ctx(), meta)
            if 0 <= ub < len(meta.ubatches):
                rows = meta.ubatches[ub]
        ne = tuple(int(t.ne[k]) for k in range(4))
        nb = tuple(int(t.nb[k]) for k in range(4))
        ndim = max(node.ndim, _n_dims(ne))
        rows, seq_ids, pos, _ = _rows_along(node, ne, rows, meta)
        buf = t.view_src.buffer if t.view_src != ffi.NULL else t.buffer
        on_host = buf != ffi.NULL and bool(lib.ggml_backend_buffer_is_host(buf))
        dtype = _NUMPY.get(int(t.type))
        if dtype is None:
            raise TapError(f"{node.name}: patching a {_type_name(int(t.type))} tensor is not supported")
        nbytes = int(lib.ggml_nbytes(t))
        tmp = None
        if on_host:
            base = view(t.data, (nbytes,), np.uint8, self)
        else:
            base = tmp = np.empty(nbytes, np.uint8)
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(tmp), 0, nbytes)
        arr = np.ndarray(tuple(reversed(ne[:ndim])), dtype=dtype, buffer=base, strides=tuple(reversed(nb[:ndim])))
        info = TapInfo(
            name=node.name,
            site=node.site,
            layer=node.layer,
            op=_op_name(int(t.op)),
            call=call_index,
            ubatch=ub,
            token_axis=_token_axis(node, ne),
            rows=rows,
            seq_ids=seq_ids,
            pos=pos,
            on_host=on_host,
        )
        patches = self.want_patches[want]
        setup = time.perf_counter() - t0
        for p in patches:
            p.n_calls += 1
            t1 = time.perf_counter()
            try:
                out = p.fn(arr, info)
                if out is not None:
                    arr[...] = out
            finally:
                p.seconds += setup + time.perf_counter() - t1
        if tmp is not None:
            t1 = time.perf_counter()
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(tmp), 0, nbytes)
            for p in patches:
                p.seconds += time.perf_counter() - t1


@ffi.def_extern()
def _pyllamacpp_tap_patch(t, want, occurrence, pass_index, handle):
    try:
        return ffi.from_handle(handle).on_patch(t, want, occurrence, pass_index)
    except BaseException:  # noqa: BLE001 - never into C; the decode stops
        return False


_OP_IDS: dict[str, int] = {}


def _op_ids() -> dict[str, int]:
    if not _OP_IDS:
        for i in range(lib.GGML_OP_COUNT):
            _OP_IDS[_op_name(i)] = i
    return _OP_IDS


def taps_of(ctx: Context) -> Taps:
    """The context's :class:`Taps` (made on first use)."""
    t = ctx._taps
    if t is None:
        t = ctx._taps = Taps(ctx)
    return t
