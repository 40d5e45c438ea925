"""The text summary behind ``KVState.describe()`` / ``str(state)``."""

from __future__ import annotations

import numpy as np

from ._records import TensorRecord
from ._state import _SOURCES, KVState


def _ids(cells) -> str:
    ids = sorted({int(i) for i in np.unique(cells["seq_id"]) if i >= 0})
    return str(ids) if len(ids) <= 8 else f"[{ids[0]} .. {ids[-1]}] ({len(ids)} ids)"


def _record_text(r) -> str:
    shape = f"{r.n_head} x {r.head_dim}" if r.n_head else f"{r.n_embd}"
    notes = [
        ", transposed" if r.transposed else "",
        ", Hadamard-rotated if llama.cpp's attn_rot was on (dequantize(unrotate=True))"
        if r.type.quantized and r.kind in "KV"
        else "",
    ]
    return f"{r.kind} {r.type.name} ({shape} values, {r.row_size} B/cell{''.join(notes)})"


def _first_values(r, n_cells: int, n_values: int) -> list[str]:
    with np.errstate(all="ignore"):  # a corrupt block scale may give inf/nan: show it, do not warn
        return _values_text(r, n_cells, n_values)


def _values_text(r, n_cells: int, n_values: int) -> list[str]:
    n = min(n_cells, r.n_cells)
    if not r.type.quantized or r.transposed:
        vals = np.asarray(r.values[:n], dtype=np.float32) if r.type.name != "bf16" else r.dequantize()[:n]
    else:  # dequantize only the rows shown
        vals = r.type.dequantize(r.rows[:n])
    vals = vals.reshape(n, -1)[:, :n_values]
    return [" ".join(f"{v:+.4f}" for v in row) for row in vals]


def _partial_text(state) -> str:
    """What a PARTIAL_ONLY dump holds (llama_kv_cache_iswa / llama_memory_hybrid(_idx) /
    llama_kv_cache_dsa_iswa::state_write)."""
    mem = state.options["memory"]
    whose = {
        "iswa": "an iSWA",
        "hybrid": "a hybrid",
        "hybrid-iswa": "a hybrid iSWA",
        "dsa-iswa": "a DSA iSWA",
        "hybrid-idx": "a hybrid indexer",
        "dsv4": "a DeepSeek V4 (llama_kv_cache_dsv4)",
    }
    if mem in whose:
        names = " and ".join(p.name for p in state.parts)
        return f"only the {names} part{'s' if len(state.parts) > 1 else ''} of {whose[mem]} memory"
    if state.layers is None:  # read without a layer map: a plain cache and an iSWA swa part look alike
        return (
            f"{'one KV cache' if mem == 'kv' else 'recurrent state'}: all of a {mem} memory or the "
            f"partial part of {'an iSWA' if mem == 'kv' else 'a hybrid'} one (pass model= to tell)"
        )
    return f"a {mem} memory writes all of itself either way"


def _dsv4_text(b) -> list[str]:
    """A llama_kv_cache_dsv4 block (Dsv4Block): its header and layers."""
    if b.kind == "compressed":
        span = f"positions 0..{b.n_rows * b.ratio - 1}" if b.n_rows else "no positions"
        head = (
            f"  {b.name} (compressed K cache, 1 row per {b.ratio} positions): version {b.version}, "
            f"{b.n_rows} rows ({span}), {b.n_stream} stream(s), {b.n_layer} layers"
        )
    else:
        head = (
            f"  {b.name} (compressor state, ratio {b.ratio}): {b.state_size} ring rows of "
            f"{b.n_embd_state} values (kv and score), {b.n_stream} stream(s), {b.n_layer} layers"
        )
    out = [head]
    if b.records:
        r = b.records[0]
        out.append(f"      {r.type.name} rows of {r.n_embd} values ({r.row_size} B), layers (il): {list(b.layers)}")
    return out


def describe(state: KVState, *, max_rows: int, n_cells: int, n_values: int) -> str:
    """The text of ``KVState.describe()``: kind, header, parts and streams, layout, first values.

    Args:
        state: The parsed dump.
        max_rows: Layout table rows to show.
        n_cells: Cells whose values to show.
        n_values: Values per cell to show.

    Returns:
        The summary, lines joined by newlines.
    """
    h = state.header
    access = "writable" if state.writable else "read-only"
    meta = ", metadata only (ON_DEVICE): record headers without rows" if state.metadata_only else ""
    if state.partial:
        meta += ", partial (PARTIAL_ONLY): " + _partial_text(state)
    out = [f"{state.kind} ({_SOURCES[state.kind]}){meta}: {state.nbytes:,} bytes, from {state.source} ({access})"]
    fields = []
    if h.magic is not None:
        fields.append(f"magic 0x{h.magic:08x}")
    if h.version is not None:
        fields.append(f"version {h.version}")
    if h.seq_id is not None:
        fields.append(f"seq_id {h.seq_id}")
    if h.arch is not None:
        fields.append(f"arch {h.arch}")
    if h.tokens is not None:
        toks = h.tokens[:12].tolist()
        fields.append(f"{len(h.tokens)} tokens {toks}{' ...' if len(h.tokens) > 12 else ''}")
    out.append("header: " + (", ".join(fields) if fields else "-") + f" ({h.nbytes} bytes)")
    out.append(
        f"memory: {state.options['memory']}{' (partial)' if state.partial else ''}, n_head_kv={state.n_head_kv}"
        + (", cells carry llama_kv_cell_ext" if state.options.get("cell_ext") else "")
        + (
            ", layers numbered by the model's il"
            if state.layers
            else ", layers numbered by record index"
            + (" (the dsv4 blocks by the il they write)" if state.options["memory"] == "dsv4" else "")
        )
    )
    for p in state.parts:
        if p.kind in ("compressed", "compressor"):
            out.extend(_dsv4_text(p))
            continue
        what = "KV cache" if p.kind == "kv" else "recurrent memory"
        out.append(f"  {p.name} ({what})" + (f": {p.n_stream} stream(s)" if p.n_stream is not None else ""))
        empty = [s.index for s in p.streams if not s.cell_count]
        for s in p.streams:
            if not s.cell_count:
                continue
            pos = s.cells["pos"]
            flag = "v_trans" if p.kind == "kv" else "s_trans"
            out.append(
                f"    stream {s.index}: {s.cell_count} cells, pos {int(pos.min())}..{int(pos.max())}, "
                f"seq ids {_ids(s.cells)}, {flag}={s.v_trans}, {s.n_layer} layers"
            )
            kinds: dict[str, TensorRecord] = {}
            for r in s.records:
                kinds.setdefault(r.kind, r)
            for r in kinds.values():
                out.append(f"      {_record_text(r)}")
            ils = [r.il for r in s.records if r.kind == next(iter(kinds))]
            if ils and None not in ils:
                out.append(f"      layers (il): {ils}")
        if empty:
            out.append(f"    empty streams: {empty if len(empty) <= 8 else f'{len(empty)} streams'}")
    lay = state.layout()
    out.append(f"layout ({len(lay.rows)} records):")
    out.extend("  " + line for line in lay.table(max_rows).splitlines())
    for p in state.parts:
        for s in p.streams:
            if not s.cell_count or not s.records or n_cells <= 0 or state.metadata_only:
                continue
            firsts: dict[str, TensorRecord] = {}
            for r in s.records:
                if r.n_embd:  # lfm2's S records hold 0 values per cell
                    firsts.setdefault(r.kind, r)
            what = "head 0" if s.records[0].n_head else "row"
            first = s.records[0]
            label = f"il {first.il}" if first.il is not None else "record 0"
            out.append(f"first cells of {p.name} stream {s.index} ({label}, {what}, first {n_values} values):")
            texts = {k: _first_values(r, n_cells, n_values) for k, r in firsts.items()}
            for i in range(min(n_cells, s.cell_count)):
                c = s.cells[i]
                ids = [int(x) for x in c["seq_id"] if x >= 0]
                vals = "  ".join(f"{k} {t[i]}" for k, t in texts.items())
                out.append(f"  cell {i} pos {int(c['pos'])} seq {ids}: {vals}")
    return "\n".join(out)
