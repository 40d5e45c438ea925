"""What a :class:`~pyllamacpp.context.Context` checks before a state reaches C: the facts its
dumps do not say about themselves (flash attention, the model's memory and layer map,
``sidecar_facts``), ``check_state`` (a blob parsed with :mod:`pyllamacpp.state` and compared with
what llama.cpp will read), and the room for a load (whether loading into a sequence can fail, and
the copy of the sequence kept aside when it can: llama.cpp clears a sequence whose load fails).

Each function is a method of Context (``StateMethods``, in ``__init__.py``, lists them), the context
its ``self``; they call each other directly. ``check_state`` and ``_partial_differs`` read
``_memory_layers()`` and ``flash_attn`` through ``self``: tests check them on stand-ins of a
Context, for memories no model of which can be loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from .._lib import ffi, lib
from ..errors import StateError, n_stream_hint
from .data import _as_uint8

if TYPE_CHECKING:
    from ..context import Context
    from .data import SeqState


def _kv_has_v(m) -> bool:
    """Whether model ``m``'s KV caches hold V: the llama_kv_cache constructor makes V tensors,
    and state_write_data writes V records, unless hparams.is_mla() (attention.key_length_mla and
    value_length_mla both set)."""
    return not all(int(m.meta(f"{m.arch}.attention.{x}_length_mla") or 0) for x in ("key", "value"))


def model_memory(m) -> tuple[str | None, dict | None]:
    """(memory, layer map) of model ``m`` from llama.cpp's metadata (llama_model_meta_val_str).
    Not from the GGUF through gguf.GGUFReader, which reads the whole vocabulary (~2 s for 49k
    tokens): only an array key the rule needs is read there (llama.cpp's metadata leaves arrays
    out), as ``Model._meta_list`` does for per-layer head counts."""
    from ..state import arch_keys, gguf_field, layer_map, memory_of, rule_keys

    arch = m.arch

    def num(key: str) -> int | None:
        v = m.meta(f"{arch}.{key}")
        return int(v) if v is not None and v.strip().lstrip("-").isdigit() else None

    # every key the rule reads, None when absent: scalars from the metadata; the arch's own keys
    # (arrays among them) from the GGUF when the metadata lacks them
    own = arch_keys(arch)
    fields = {"general.architecture": arch}
    for k in rule_keys(arch):
        v = m.kv_head_counts() if k == "attention.head_count_kv" else num(k)
        if v is None and k in own and m.path is not None:
            v = gguf_field(m.path, f"{arch}.{k}")
        fields[f"{arch}.{k}"] = v
    layers = layer_map(fields)
    return memory_of(layers), layers


def flash_attn(self: Context) -> bool:
    """Whether flash attention is on: ``"auto"`` resolved as llama.cpp logged it when the
    context was created (``llama_init_from_model``), else the ``flash_attn_type`` asked for.
    It decides the V layout of a dump (``v_trans``)."""
    for _, text in self.creation_log:
        if "Flash Attention enabled" in text:
            return True
        if "Flash Attention disabled" in text:
            return False
    return self.params.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_ENABLED


def sidecar_facts(self: Context, tokens: npt.ArrayLike | None = None, *, flags: int = 0) -> dict:
    """What a dump of this context does not say about itself, for a ``pyllamacpp.state``
    sidecar: model name and sha256 prefix, architecture, layer map, head sizes, K/V types,
    flash attention, ``kv_unified``, ``n_ctx``, the llama.cpp commit. No llama.cpp call
    beyond the model's metadata (``llama_model_meta_val_str``).

    Args:
        tokens: the token ids the dump holds, recorded when given.
        flags: the ``llama_state_seq_flags`` the dump is made with (PARTIAL_ONLY, ON_DEVICE).

    Returns:
        A JSON-ready dict (``pyllamacpp.state.write_sidecar`` takes it as keywords).

    Raises:
        ClosedError: the context or its model is closed.
    """
    from .._lib import EXTENSION_INFO
    from ..params import ggml_type_name
    from ..state import model_facts

    m = self.model
    if getattr(m, "_sha256_prefix", None) is None:
        m._sha256_prefix = model_facts(str(m.path), sha256=True)["model_sha256"]
    k_len, v_len = m.kv_head_sizes()
    # llama_model_n_head_kv is layer 0's count (0 when layer 0 has no attention): give the
    # attention layers' count when they agree, and the layer map the parser uses for il
    heads = {n for n in m.kv_head_counts() if n > 0}
    facts = {
        "model": m.path.name,
        "model_sha256": m._sha256_prefix,
        "arch": m.arch,
        "n_layer": m.n_layer,
        "n_head_kv": heads.pop() if len(heads) == 1 else None,
        "layers": self._memory_layers()[1],  # the map check_state uses
        "n_embd_head_k": k_len,
        "n_embd_head_v": v_len,
        "type_k": ggml_type_name(self.params.type_k),
        "type_v": ggml_type_name(self.params.type_v),
        "flash_attn": self.flash_attn,
        "kv_unified": bool(self.params.kv_unified),
        "n_ctx": self.n_ctx,
        "llama_cpp_commit": EXTENSION_INFO.get("llama_cpp_commit"),
        "flags": int(flags),
    }
    if tokens is not None:
        facts["tokens"] = [int(t) for t in np.asarray(tokens).reshape(-1)]
    return facts


def _memory_layers(self: Context) -> tuple[str | None, dict | None]:
    """This context's memory as pyllamacpp.state names it (kv, iswa, hybrid, hybrid-iswa,
    recurrent) and its layer map (state._layers); (None, None) for an architecture whose rule
    that module does not know. Read once per context."""
    if self._memory_layers_cache is None:
        self._memory_layers_cache = model_memory(self.model)
    return self._memory_layers_cache


def _partial_differs(self: Context) -> bool:
    """Whether PARTIAL_ONLY changes what this context's memory writes and reads (iSWA, hybrid,
    dsa-iswa, hybrid-idx, dsv4 memories; plain KV caches, recurrent memories, dsa and msa
    ignore the flag)."""
    memory, _ = self._memory_layers()
    if memory is None:
        return not self._plain_kv
    from ..state import written_parts  # what each memory writes with and without the flag

    return written_parts(memory, True) != written_parts(memory, False)


def check_state(self: Context, data: SeqState | npt.ArrayLike, *, kind: str = "sequence", flags: int = 0) -> None:
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
    from .. import state as st

    arr = _as_uint8(data)
    parsed = None
    memory = self._memory_layers()[0]
    if memory is not None:
        # read first as this context's memory writes it, as llama.cpp will read it: no layout to
        # detect (an iSWA dump detected took ~40 ms for 2,560 cells, read so 1 ms)
        partial = kind == "sequence" and bool(int(flags) & lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        try:
            parsed = st.parse(arr, memory=memory, partial=partial)
        except st.StateFormatError:
            parsed = None  # another layout: detected below, and the comparison says what differs
    if parsed is None:
        try:
            parsed = st.parse(arr)  # rows stay flat: a dump of another model still parses
        except st.StateFormatError as e:
            raise StateError(f"not a valid state: {e}", func="pyllamacpp.state.parse") from e
    want = {"sequence": (st.DumpKind.SEQUENCE,), "context": (st.DumpKind.CONTEXT,)}[kind]
    if parsed.kind not in want:
        raise StateError(f"this is a {parsed.kind}, not a {want[0]}", func="pyllamacpp.state.parse")
    _check_parsed(self, parsed, kind, flags)


def _check_parsed(self: Context, parsed: Any, kind: str, flags: int) -> None:
    """check_state's comparison of a parsed dump (a ``KVState``: a blob's, or a state file's
    body) with this context; ``kind`` "sequence" or "context" says how llama.cpp reads it."""
    from .. import state as st
    from ..params import ggml_type_name

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
                        (k_swa if r.kind == "K" else v_swa) if il in swa_layers else (k_len if r.kind == "K" else v_len)
                    )
                    n_embd = size * heads[il]
                    if r.n_embd != n_embd:
                        bad(f"{r.kind}[{r.layer}] rows hold {r.n_embd} values, the model's (layer {il}) hold {n_embd}")
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


def _check_no_pending_copy(self: Context, seq_id, func: str) -> None:
    if self._pending_stream_copies and (seq_id is None or seq_id in self._pending_stream_copies):
        which = sorted(self._pending_stream_copies) if seq_id is None else [seq_id]
        raise StateError(
            f"a cross-stream seq_cp into seq {which} is still queued in llama.cpp (kv_unified=False): "
            "it runs at the next decode and would overwrite what is loaded now; decode first",
            func=func,
        )


def _occupied(self: Context, seq_id: int) -> bool:
    # a hybrid memory whose attention part is empty has seq_pos_max -1 (the min of its
    # parts' maxima, llama_memory_hybrid::seq_pos_max) but seq_pos_min >= 0
    return self.memory.seq_pos_max(seq_id) >= 0 or self.memory.seq_pos_min(seq_id) >= 0


def _load_fits(self: Context, seq_id: int, buf: np.ndarray) -> bool:
    """True when loading this checked sequence blob into ``seq_id`` cannot fail, so the
    sequence needs no backup. Checked, the blob can still fail on room alone:
    llama_kv_cache::state_read_meta removes ``seq_id``'s cells, then ``find_slot`` needs
    ``cell_count`` usable cells of its stream, any of them (not contiguous). So it fits when
    ``cell_count <= n_ctx_seq - (cells the other sequences of that stream hold)``.
    Plain KV caches only (iSWA, recurrent and hybrid memories restore more than one part:
    they get the backup)."""
    if not self._plain_kv:
        return False
    if _own_stream_fits(self):
        return True
    if buf.size < 12 or not buf.flags.c_contiguous:
        return False
    n_stream = int(buf[8:12].view("<u4")[0])
    if not 1 <= n_stream <= 256 or buf.size < 12 + 4 * n_stream:
        return False
    # u32 cell_count of stream 0, then its cells...: only a leading run of empty streams
    # reads as counts, and a checked sequence blob has cells in one stream
    counts = buf[12 : 12 + 4 * n_stream].view("<u4")
    nz = np.flatnonzero(counts)
    return _room_for(self, seq_id, int(counts[nz[0]]) if nz.size else 0)


def _room_for(self: Context, seq_id: int, cell_count: int) -> bool:
    """True when ``cell_count`` cells loaded into ``seq_id`` cannot fail on room (see
    _load_fits): always with a stream of its own, else when the cells the other sequences
    of the one stream hold leave that many (plain KV caches only)."""
    if not self._plain_kv:
        return False
    if _own_stream_fits(self):
        return True
    room = self.n_ctx_seq  # of the one stream the other sequences share
    for s in range(self.n_seq_max):
        if s != seq_id and self.memory.seq_pos_max(s) >= 0:
            c = _cells_held(self, s)
            if c is None:
                return False
            room -= c
    return cell_count <= room


def _own_stream_fits(self: Context) -> bool:
    """A plain KV cache whose every sequence has a stream of its own: a checked blob (or one
    this context made) has cell_count <= n_ctx_seq, so it always fits (see _load_fits)."""
    return self._plain_kv and not (self.params.kv_unified and self.n_seq_max > 1)


def _cells_held(self: Context, s: int) -> int | None:
    """Cells sequence ``s`` holds in a one-stream plain KV cache, from two sizes llama.cpp
    counts without copying anything (llama_io_write_dummy): with and without
    ``ON_DEVICE`` (headers only). Their difference is cells x the K+V row bytes of a token;
    the headers-only size is 16 + cells x (12 or 24 with llama_kv_cell_ext) + 8 + 12 per
    K/V record. Both must agree, else None (the caller then keeps a backup)."""
    ptr = self.ptr
    meta = int(lib.llama_state_seq_get_size_ext(ptr, s, lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE))
    full = int(lib.llama_state_seq_get_size_ext(ptr, s, 0))
    if self._kv_row_bytes is None:
        m = self.model
        n_kv_layers = sum(1 for n in m.kv_head_counts() if n > 0)
        self._kv_row_bytes = (m.kv_bytes_per_token(self.params.type_k, self.params.type_v), n_kv_layers)
    row_bytes, n_layers = self._kv_row_bytes
    cells, rest = divmod(full - meta, row_bytes)
    if rest or meta - 16 - 8 - 24 * n_layers not in (12 * cells, 24 * cells):
        return None
    return cells


def _put_back(self: Context, seq_id: int, backup: SeqState) -> bool:
    """Load the copy of ``seq_id`` kept aside before a load that failed; False (the sequence
    left empty) when it does not fit back either."""
    if lib.pyl_state_seq_set(self.ptr, ffi.from_buffer(backup.data), len(backup), seq_id, 0):
        return True
    self.memory.seq_rm(seq_id)
    return False
