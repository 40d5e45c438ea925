"""Checks of a state blob against a :class:`~pyllamacpp.context.Context` before anything
reaches C: it is parsed with :mod:`pyllamacpp.state` and compared with what llama.cpp will read.
``StateChecks`` is a base of ``StateMethods`` (context_state.py)."""

from __future__ import annotations

from typing import Any, NoReturn, cast

import numpy.typing as npt

from ._lib import lib
from ._state_facts import StateFacts, _kv_has_v
from ._state_types import SeqState, _as_uint8
from .errors import StateError, n_stream_hint


class StateChecks(StateFacts):
    """check_state and its comparisons for Context (see the module docstring)."""

    def check_state(self, data: SeqState | npt.ArrayLike, *, kind: str = "sequence", flags: int = 0) -> None:
        """Check a state blob against this context before anything reaches C.

        Parses it with :mod:`pyllamacpp.state` (no llama.cpp call) and compares: dump kind, the
        memory parts llama.cpp will read with ``flags`` (``StateFlags.PARTIAL_ONLY``: an iSWA
        cache reads only its swa part, a hybrid memory only its recurrent part), streams
        (``kv_unified``), layer counts, K/V types, row sizes, V layout (flash attention), cell
        count, sequence ids: what ``llama_state_seq_set_data_ext`` / ``llama_state_set_data``
        would read. Used by ``set_seq_state`` and ``set_state``.

        Args:
            data: a ``SeqState``, bytes-like or uint8 array.
            kind: ``"sequence"`` (a ``llama_state_seq_get_data_ext`` dump) or ``"context"`` (a
                ``llama_state_get_data`` one).
            flags: the ``StateFlags`` it will be loaded with.

        Raises:
            StateError: the blob does not parse (the offset and what was being read), is of the
                other kind, is a metadata-only (``ON_DEVICE``) dump, or does not fit this
                context (the message names what does not match).
        """
        from . import state as st

        try:
            parsed = st.parse(_as_uint8(data))  # rows stay flat: a dump of another model still parses
        except st.StateFormatError as e:
            raise StateError(f"not a valid state: {e}", func="pyllamacpp.state.parse") from e
        want = {"sequence": (st.DumpKind.SEQUENCE,), "context": (st.DumpKind.CONTEXT,)}[kind]
        if parsed.kind not in want:
            raise StateError(f"this is a {parsed.kind}, not a {want[0]}", func="pyllamacpp.state.parse")
        StateChecks._check_parsed(self, parsed, kind, flags)  # unbound: tests check it on stand-ins of a Context

    def _check_parsed(self, parsed: Any, kind: str, flags: int) -> None:
        """check_state's comparison of a parsed dump (a ``KVState``: a blob's, or a state file's
        body) with this context; ``kind`` "sequence" or "context" says how llama.cpp reads it."""
        from . import state as st
        from .params import ggml_type_name

        def bad(what: str) -> NoReturn:
            raise StateError(f"state does not fit this context: {what}", func="pyllamacpp.state.parse")

        if parsed.metadata_only:
            bad(
                "a metadata-only dump (seq_state(seq, ON_DEVICE): the rows stayed in llama.cpp); load it "
                "with flags=StateFlags.ON_DEVICE into the context that made it"
            )
        # llama_context::state_read_data (whole states) reads with flags 0
        partial = kind == "sequence" and bool(int(flags) & lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        memory, layers = self._memory_layers()
        m = self.model
        arch = parsed.header.arch
        if arch is not None and arch != m.arch:  # state_read_data: "wrong model arch"
            bad(f"a state of a {arch!r} model, this context's model is {m.arch!r}")
        # the parts llama.cpp will read, each with its model layers (None: unknown architecture)
        expect: list[tuple[str, Any] | None] = [None] * len(parsed.parts)
        if memory is not None:
            reads = st.written_parts(memory, partial)
            got = tuple(p.kind for p in parsed.parts)
            if got != tuple(k for k, _ in reads):
                other = st.written_parts(memory, not partial)
                names, others = [n for _, n in reads], [n for _, n in other]
                if kind == "sequence" and got == tuple(k for k, _ in other) and other != reads:
                    bad(
                        f"a full dump (parts {others}) loaded with PARTIAL_ONLY, with which this context's "
                        f"{memory} memory reads only {names}"
                        if partial
                        else f"a PARTIAL_ONLY dump (parts {others} of this context's {memory} memory); load it "
                        "with flags=StateFlags.PARTIAL_ONLY"
                    )
                bad(
                    f"memory parts {[p.kind for p in parsed.parts]}, this context's {memory} memory reads "
                    f"{[f'{k} ({n})' for k, n in reads]}" + (" with PARTIAL_ONLY" if partial else "")
                )
            expect = [(n, cast(dict, layers)[n]) for _, n in reads]  # a known memory has its layer map
        # llama_kv_cache_dsv4 (every deepseek4 context) builds its caches non-unified whatever
        # kv_unified says (unified_raw in its constructor)
        dsv4 = memory == "dsv4" or m.arch == "deepseek4"
        n_stream = 1 if self.params.kv_unified and not dsv4 else self.n_seq_max
        kv_parts = [(p, e) for p, e in zip(parsed.parts, expect) if p.kind == "kv"]
        if lib.llama_model_is_recurrent(m.ptr) and kv_parts:
            bad("a KV cache state for a recurrent model")
        k_len, v_len = m.kv_head_sizes()
        # llama_model_loader reads attention.key_length_swa / value_length_swa for SWA layers
        # (default: the full layers' sizes; llama_hparams::n_embd_head_k(il))
        k_swa = int(m.meta(f"{m.arch}.attention.key_length_swa") or k_len)
        v_swa = int(m.meta(f"{m.arch}.attention.value_length_swa") or v_len)
        swa_layers = set((layers or {}).get("swa") or ())
        mla = not _kv_has_v(m)
        # per-layer KV heads, 0 for a layer without attention (hybrid models)
        heads = m.kv_head_counts()
        # without a layer map: a lone "kv" part holds every attention layer, in order, unless a
        # PARTIAL_ONLY load into a non-plain memory reads it (then which layers is unknown)
        plain = (
            len(kv_parts) == 1
            and kv_parts[0][0].name == "kv"
            and kv_parts[0][1] is None
            and (self._plain_kv or not partial)
        )
        for part, exp in kv_parts:
            # no map: a plain part's records are the attention layers in order
            ils = exp[1] if exp is not None else ([il for il, n in enumerate(heads) if n > 0] if plain else None)
            label = exp[0] if exp is not None else part.name
            # row widths are key/value_length x head_count_kv[il] only in caches built from the
            # model's own hparams with GQA heads: not in an indexer cache (lid, idx: one head of
            # indexer_head_size values) nor in an MLA one (dsa's mla, dsa-iswa's, dsv4's caches)
            widths = label in ("kv", "base", "swa") and memory not in ("dsa", "dsa-iswa") and not dsv4
            if part.n_stream != n_stream:
                bad(n_stream_hint(part.n_stream, n_stream, bool(self.params.kv_unified), self.n_seq_max))
            for s in part.streams:
                if not s.cell_count:
                    continue
                if s.cell_count > self.n_ctx_seq:
                    bad(f"{s.cell_count} cells in stream {s.index}, more than n_ctx_seq={self.n_ctx_seq}")
                if s.v_trans != (0 if self.flash_attn else 1):
                    bad(f"v_trans={s.v_trans}, this context has flash attention {'on' if self.flash_attn else 'off'}")
                if ils is not None and s.n_layer != len(ils):
                    bad(
                        f"{s.n_layer} layers in the {label} part, the model's has {len(ils)}"
                        if exp is not None
                        else f"{s.n_layer} layers, the model has {len(ils)}"
                    )
                n_v = sum(1 for r in s.records if r.kind == "V")
                if widths and n_v != (0 if mla else s.n_layer):
                    # a dump cut right after its K records reads as a cache without V
                    bad(
                        f"{n_v} V records in stream {s.index} of the {label} part, this context's cache "
                        f"has {0 if mla else s.n_layer}"
                    )
                for r in s.records:
                    want_t = self.params.type_k if r.kind == "K" else self.params.type_v
                    if r.type.id != want_t:
                        bad(f"{r.kind}[{r.layer}] is {r.type.name}, this context's cache is {ggml_type_name(want_t)}")
                    if widths and ils is not None and r.layer < len(ils):
                        il = ils[r.layer]
                        size = (
                            (k_swa if r.kind == "K" else v_swa)
                            if il in swa_layers
                            else (k_len if r.kind == "K" else v_len)
                        )
                        n_embd = size * heads[il]
                        if r.n_embd != n_embd:
                            bad(
                                f"{r.kind}[{r.layer}] rows hold {r.n_embd} values, "
                                f"the model's (layer {il}) hold {n_embd}"
                            )
                ids = s.cells["seq_id"]
                if ids.size and ((ids >= self.n_seq_max) | (ids < -1)).any():
                    bad(f"a cell of stream {s.index} names a sequence outside [0, {self.n_seq_max})")
                pos = s.cells["pos"]
                if pos.size and pos.min() < 0:
                    bad(f"a cell of stream {s.index} has a negative position")
                if kind == "sequence" and (s.cells["n_seq_id"] != 1).any():
                    # llama_kv_cache::state_read_meta: "invalid seq_id-agnostic kv cell"
                    bad(
                        f"a cell of stream {s.index} lists {int(s.cells['n_seq_id'].max())} sequences; "
                        "a sequence dump's cells list exactly one"
                    )
            if kind == "sequence" and sum(1 for s in part.streams if s.cell_count) > 1:
                # llama.cpp writes one sequence's cells from its one stream; loading several would
                # put each into the same stream, the later ones removing the earlier
                bad(
                    f"cells in {sum(1 for s in part.streams if s.cell_count)} streams of {part.name}; "
                    "a sequence dump has them in one"
                )
        for part in parsed.parts:
            # llama_memory_recurrent::state_write_data writes n_layer = hparams.n_layer()
            if part.kind == "recurrent" and part.streams[0].n_layer != m.n_layer:
                bad(f"{part.streams[0].n_layer} layers in the recurrent part, the model has {m.n_layer}")

    def _check_no_pending_copy(self, seq_id, func: str) -> None:
        if self._pending_stream_copies and (seq_id is None or seq_id in self._pending_stream_copies):
            which = sorted(self._pending_stream_copies) if seq_id is None else [seq_id]
            raise StateError(
                f"a cross-stream seq_cp into seq {which} is still queued in llama.cpp (kv_unified=False): "
                "it runs at the next decode and would overwrite what is loaded now; decode first",
                func=func,
            )
