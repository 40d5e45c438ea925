"""The decode ``pyllamacpp mask`` checks: the batch described, decoded with taps on the KQ masks
and the cell indices; the cells before it, from a whole-context state dump; each captured mask
checked against the rule (``_rule``), and the facts the report states.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...ubatch import N_PAD, layout_rows, pad
from ..common import progress, prompt_tokens
from ._rule import (
    GRID_CHARS,
    KEEP,
    OTHER_SEQ,
    PADDING,
    RULES,
    KVCells,
    _seqs,
    as_streams,
    check_mask,
    engine_seq_order,
)

if TYPE_CHECKING:
    from ...model import Model

# models/<arch>.cpp set hparams.swa_type; the other SWA archs are LLAMA_SWA_TYPE_STANDARD
_ARCH_SWA_TYPE = {"llama4": "chunked", "gemma-embedding": "symmetric", "modern-bert": "symmetric"}


def _swa_type(model: Model) -> str:
    arch = model.meta("general.architecture") or ""
    return _ARCH_SWA_TYPE.get(arch, "standard")


_LAYER_IN = re.compile(r"[^ ]+-(\d+)(?: |$)|cache_[kv]_l(\d+)")


def _layer_in(name: str) -> int | None:
    """The layer a tensor name says (``Kcur-3 (view)``, ``cache_k_l3 (view) (permuted)``), or None."""
    m = _LAYER_IN.match(name)
    return int(m.group(1) or m.group(2)) if m else None


def _parts_by_first_use(graph, model: Model, leaf: str) -> dict[int, str]:
    """Occurrence of an input leaf -> the cache part (kv, base, swa) it belongs to.

    Leaves of one name are numbered by first use (taps.py), so occurrence k is the k-th distinct
    cache among the nodes that read a leaf of that name, in graph order. A reader's layer is in its
    name (``kq_soft_max-3``) or, for an unnamed one (``FLASH_ATTN_EXT``, the ``SET_ROWS`` into
    ``cache_k_l3``), in its sources' names; the layer's cache from pyllamacpp.state's layer map.
    """
    from ...state import model_facts

    if sum(1 for i in graph.inputs if i.name == leaf) == 1:
        return {0: "kv"}
    layers = model_facts(model).get("layers") or {}
    part_of = {il: p for p, ils in layers.items() for il in ils}
    order: list[str] = []
    for n in graph.nodes:
        if leaf not in n.srcs:
            continue
        il = n.layer
        if il is None:
            il = next((x for x in map(_layer_in, n.srcs) if x is not None), None)
        p = part_of.get(il) if il is not None else None
        if p is None:
            raise ValueError(f"{leaf}: pyllamacpp.state does not say which cache layer {il} of this model uses")
        if p not in order:
            order.append(p)
    return dict(enumerate(order))


def _cache_size(part: str, ctx, model: Model, unified: bool) -> int:
    """Cells per stream of a cache part (``llama_kv_cache::get_size``)."""
    base = int(ctx.n_ctx_seq)
    if part != "swa" or ctx.params.swa_full:
        return base
    # llama_kv_cache_iswa's constructor
    return pad(min(base, model.n_swa * (ctx.n_seq_max if unified else 1) + int(ctx.n_ubatch)), N_PAD)


def _cells_before(state, part: str, n_stream: int, size: int) -> list[KVCells]:
    p = next((q for q in state.parts if q.name == part), None)
    if p is None:
        have = ", ".join(q.name for q in state.parts)
        raise ValueError(f"the state dump has no {part!r} part (it has {have})")
    out = []
    for s in range(n_stream):
        st = next((x for x in p.streams if x.index == s), None)
        if st is None or st.cell_count == 0:
            out.append(KVCells.empty(size))
            continue
        c = st.cells
        rows = [(int(c["pos"][i]), [int(x) for x in c["seq_id"][i] if x >= 0]) for i in range(st.cell_count)]
        out.append(KVCells.of(rows, size))
    return out


def _ranges(keep: np.ndarray) -> list[list[int]]:
    idx = np.flatnonzero(keep)
    if idx.size == 0:
        return []
    cut = np.flatnonzero(np.diff(idx) > 1)
    starts = np.concatenate([[idx[0]], idx[cut + 1]])
    ends = np.concatenate([idx[cut], [idx[-1]]])
    return [[int(a), int(b)] for a, b in zip(starts, ends)]


def _fill(ctx, model: Model, toks: np.ndarray, past: Sequence[int], n_shared: int, n_seqs: int) -> None:
    """The cells before the decode: the shared prefix (sequence 0, copied to the others), then
    each sequence's own past tokens after it."""
    if n_shared:
        ctx.prefill(toks[:n_shared], seq_id=0, start_pos=0)
        for s in range(1, n_seqs):
            ctx.memory.seq_cp(0, s)
    for s, p in enumerate(past):
        if p:
            ctx.prefill(toks[n_shared : n_shared + p], seq_id=s, start_pos=n_shared)


def batch_rows(
    tokens: Sequence[int], past: Sequence[int], *, n_shared: int = 0, layout: str = "seq", couple: bool = False
) -> list[tuple[tuple[int, ...], int, bool]]:
    """The decoded batch's rows: ``(seq_ids, pos, output)`` in batch order.

    Args:
        tokens: Tokens per sequence.
        past: Tokens each sequence has cached after the shared prefix.
        n_shared: The shared prefix's length.
        layout: ``"seq"`` or ``"interleave"`` (split-plan's layouts).
        couple: Each row also carries the other sequences' ids, after its own.

    Returns:
        The rows.

    Raises:
        PlanError: An unknown layout.
    """
    n_seqs = len(tokens)
    out = []
    for s, _t, p, o in layout_rows(list(tokens), [n_shared + x for x in past], layout):
        ids = (s, *[x for x in range(n_seqs) if x != s]) if couple else (s,)
        out.append((ids, p, o))
    return out


def run_mask(
    model: Model,
    tokens: Sequence[int],
    past: Sequence[int],
    *,
    n_shared: int = 0,
    layout: str = "seq",
    couple: bool = False,
    **ctx_kw: Any,
) -> dict:
    """Decode the batch described, capture each ubatch's KQ masks and cell indices, and check
    every entry against the rule (see :mod:`pyllamacpp.experiments.mask`).

    Args:
        model: The :class:`~pyllamacpp.Model`.
        tokens: Tokens per sequence decoded.
        past: Tokens per sequence cached before it (after the shared prefix).
        n_shared: Tokens cached once for every sequence (``seq_cp`` from sequence 0).
        layout: ``"seq"`` or ``"interleave"``.
        couple: Each row also carries the other sequences' ids, after its own.
        **ctx_kw: :class:`~pyllamacpp.Context` keywords.

    Returns:
        ``masks`` (one entry per mask per ubatch: its shape, rows, cells, rule counts, grid,
        mismatches), ``facts``, ``n_mismatches``, ``n_entries``, ``ok`` and the context's settings.

    Raises:
        ValueError: A shape llama.cpp would refuse (``--couple`` with different pasts or separate
            streams), or a model without a KQ mask (recurrent memory).
        DecodeError: llama.cpp refused a decode.
    """
    from ...batch import Batch
    from ...context import Context
    from ...state import parse

    n_seqs = len(tokens)
    past = list(past)
    if len(past) != n_seqs:
        raise ValueError(f"--past: {len(past)} values for {n_seqs} sequences")
    ctx_kw["n_seq_max"] = max(int(ctx_kw.get("n_seq_max") or 1), n_seqs)
    with Context(model, **ctx_kw) as ctx:
        unified = bool(ctx.params.kv_unified) or ctx.n_seq_max == 1
        if couple and n_seqs > 1 and (not unified or len(set(past)) > 1):
            raise ValueError(
                "--couple: coupled sequences need one KV stream (--kv-unified) and the same --past for "
                "every sequence (llama_batch_allocr::init refuses them otherwise)"
            )
        graph = ctx.graph_nodes()
        masks = sorted((i for i in graph.inputs if i.name == "attn_inp_kq_mask"), key=lambda i: i.occurrence)
        if not masks:
            raise ValueError("this model's forward pass has no attn_inp_kq_mask input (no KV-cache attention)")
        parts = _parts_by_first_use(graph, model, "attn_inp_kq_mask")
        kparts = {p: k for k, p in _parts_by_first_use(graph, model, "attn_inp_k_idxs").items()}
        rows = batch_rows(tokens, past, n_shared=n_shared, layout=layout, couple=couple)
        toks = prompt_tokens(model, n_shared + max(p + t for p, t in zip(past, tokens)))
        _fill(ctx, model, toks, past, n_shared, n_seqs)
        state = parse(np.asarray(ctx.state()), model=model)
        n_stream_kv = 1 if unified else ctx.n_seq_max
        cells: dict[str, list[KVCells]] = {}
        sizes: dict[str, int] = {}
        for part in dict.fromkeys(parts.values()):
            sizes[part] = _cache_size(part, ctx, model, unified)
            cells[part] = _cells_before(state, part, n_stream_kv, sizes[part])
        problems = _check_against_memory(ctx, cells, n_seqs)
        n_before = {p: sum(c.used_max_p1 for c in cs) for p, cs in cells.items()}
        batch = Batch(ctx.n_batch, max(len(r[0]) for r in rows), model=model)
        calls = [rows[i : i + ctx.n_batch] for i in range(0, len(rows), ctx.n_batch)]
        with ctx.capture("attn_inp_kq_mask", "attn_inp_k_idxs") as cap:
            for call in progress(calls, "mask"):
                batch.clear()
                for ids, p, o in call:
                    batch.add(int(toks[p % toks.size]), p, list(ids), logits=o)
                ctx.decode(batch)
        flash = bool(ctx.flash_attn)
        settings = {
            "n_ctx": ctx.n_ctx,
            "n_ctx_seq": ctx.n_ctx_seq,
            "n_batch": ctx.n_batch,
            "n_ubatch": ctx.n_ubatch,
            "n_seq_max": ctx.n_seq_max,
            "kv_unified": unified,
            "n_stream_kv": n_stream_kv,
            "flash_attn": flash,
            "cache_size": sizes,
        }
    out = _check_records(cap.records, masks, parts, kparts, cells, unified, model, problems)
    if any(not e["layers"] for e in out["masks"]):  # flash attention: the readers are unnamed
        from ...state import model_facts

        by_part = model_facts(model).get("layers") or {}
        for e in out["masks"]:
            e["layers"] = e["layers"] or list(by_part.get(e["cache"], range(model.n_layer)))
    out.update(settings)
    out.update(
        tokens=list(tokens),
        past=past,
        shared=n_shared,
        layout=layout,
        couple=couple,
        cells_before=n_before,
        problems=problems,
    )
    out["facts"] = _facts(out)
    out["ok"] = out["n_mismatches"] == 0 and not problems
    return out


def _check_against_memory(ctx, cells: dict[str, list[KVCells]], n_seqs: int) -> list[str]:
    """The dump's cells against ``llama_memory_seq_pos_max``: what the memory API says of each sequence."""
    bad = []
    part = "kv" if "kv" in cells else "base" if "base" in cells else next(iter(cells))
    for s in range(n_seqs):
        got = [int(c.pos[i]) for c in cells[part] for i in range(c.pos.size) if s in c.seqs[i]]
        want = ctx.memory.seq_pos_max(s)
        have = max(got) if got else -1
        if have != want:
            bad.append(f"sequence {s}: the state dump's cells end at position {have}, seq_pos_max says {want}")
    return bad


def _check_records(records, masks, parts, kparts, cells, unified, model, problems) -> dict:
    by_pass: dict[int, dict[tuple[str, int], Any]] = {}
    for r in records:
        by_pass.setdefault(r.pass_index, {})[(r.name, r.occurrence)] = r
    n_swa = int(model.n_swa)
    swa_type = _swa_type(model)
    entries = []
    n_mis = n_entries = 0
    for pi in sorted(by_pass):
        recs = by_pass[pi]
        for part, k in kparts.items():
            kr = recs.get(("attn_inp_k_idxs", k))
            if kr is None or kr.rows is None:
                raise ValueError(f"pass {pi}: attn_inp_k_idxs of the {part} cache was not captured with its rows")
            size = cells[part][0].pos.size
            for row, (kk, p, ids) in enumerate(zip(kr.array().tolist(), kr.pos.tolist(), kr.seq_ids)):
                strm, idx = divmod(int(kk), size)
                want = 0 if unified else ids[0]
                if strm != want:
                    problems.append(f"pass {pi}: row {row} in stream {strm}; its sequence {ids[0]} reads {want}")
                    continue
                if cells[part][strm].write(idx, p, ids) and part != "swa":
                    problems.append(
                        f"pass {pi}: row {row} written over cell {idx} of stream {strm}, in use as the dump was read "
                        "(the cache has holes: cell indices from the dump are wrong)"
                    )
        for m in masks:
            mr = recs.get(("attn_inp_kq_mask", m.occurrence))
            if mr is None:
                continue
            part = parts[m.occurrence]
            kr = recs[("attn_inp_k_idxs", kparts[part])]
            window = part == "swa"
            mis, rule = check_mask(
                mr.array(),
                cells[part],
                kr.pos,
                [engine_seq_order(ids) for ids in kr.seq_ids],
                unified=unified,
                n_swa=n_swa if window else 0,
                swa_type=swa_type if window else "none",
            )
            entries.append(_entry(mr, m, part, kr, cells[part], rule, mis, n_swa if window else 0, unified))
            n_mis += len(mis)
            n_entries += rule.size
    return {
        "masks": entries,
        "n_mismatches": n_mis,
        "n_entries": n_entries,
        "n_swa": n_swa,
        "swa_type": swa_type,
    }


def _entry(mr, m, part, kr, cells, rule, mis, n_swa, unified) -> dict:
    n_stream, n_tps, n_kv = rule.shape
    got_keep = as_streams(mr.array()).astype(np.float32) == 0
    kv_streams = [0 if unified else engine_seq_order(kr.seq_ids[s * n_tps])[0] for s in range(n_stream)]
    used = {s: cells[s].used_max_p1 for s in sorted(set(kv_streams))}
    shown = min(n_kv, max(used.values(), default=0))
    grid = []
    for s in range(n_stream):
        lines = []
        for ii in range(n_tps):
            chars = []
            for j in range(shown):
                want_keep = rule[s, ii, j] == KEEP
                if got_keep[s, ii, j] == want_keep:
                    chars.append(GRID_CHARS[rule[s, ii, j]])
                else:
                    chars.append("X" if got_keep[s, ii, j] else "!")
            lines.append("".join(chars))
        grid.append(lines)
    counts = {name: int((rule == i).sum()) for i, name in enumerate(RULES)}
    n_tok = n_stream * n_tps
    # batch row, position, seq ids as given, and in the ubatch's order (its first is the mask's)
    rows = [
        [int(kr.rows[i]), int(kr.pos[i]), list(kr.seq_ids[i]), list(engine_seq_order(kr.seq_ids[i]))]
        for i in range(n_tok)
    ]
    cell_list = {}
    for s, c in enumerate(cells):
        nz = np.flatnonzero(c.pos >= 0)
        if nz.size:
            cell_list[str(s)] = [[int(j), int(c.pos[j]), sorted(c.seqs[j])] for j in nz]
    keep = rule == KEEP
    return {
        "call": mr.call,
        "ubatch": mr.ubatch,
        "pass": mr.pass_index,
        "occurrence": m.occurrence,
        "cache": part,
        "layers": list(m.read_by),
        "n_swa": n_swa,
        "type": mr.type,
        "ne": list(mr.ne),
        "shape": list(mr.shape),
        "n_kv": n_kv,
        "n_stream": n_stream,
        "n_tps": n_tps,
        "kv_streams": kv_streams,
        "used": {str(s): u for s, u in used.items()},
        "columns_shown": shown,
        "padding_masked": bool((rule[..., shown:] == PADDING).all() and not got_keep[..., shown:].any()),
        "rows": rows,
        "cells": cell_list,
        "counts": counts,
        "visible": [[_ranges(keep[s, ii]) for ii in range(n_tps)] for s in range(n_stream)],
        "grid": grid,
        "n_mismatches": len(mis),
        "mismatches": [x.to_dict() for x in mis[:50]],
    }


def _facts(data: dict) -> list[str]:
    """The details the seeds name, as this run shows them."""
    out: list[str] = []
    es = data["masks"]
    if not es:
        return out
    e0 = es[0]
    out.append(
        f"columns: every mask has n_kv columns (here {sorted({e['n_kv'] for e in es})}), the cells in use padded "
        f"to a multiple of {N_PAD} (llama_kv_cache::get_n_kv); the padding columns are masked in every row: "
        + ("yes" if all(e["padding_masked"] for e in es) else "NO")
    )
    out.append(
        f"shape: ne {e0['ne']} = [n_kv, n_tokens/n_stream, 1, n_stream], numpy {e0['shape']}"
        + (
            f", {e0['n_stream']} streams of {e0['n_tps']} rows (kv_unified off: one per sequence of the ubatch)"
            if e0["n_stream"] > 1
            else ", one stream"
        )
        + f"; type {e0['type']} ("
        + ("flash attention on: FLASH_ATTN_EXT takes an f16 mask" if data["flash_attn"] else "flash attention off")
        + ")"
    )
    shared_seen: dict[int, int] = {}
    n_shared_cells = 0
    first_only = 0
    multi_rows = 0
    reordered: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for e in es:
        cells = {(int(s), c[0]): set(c[2]) for s, cl in e["cells"].items() for c in cl}
        n_shared_cells = max(n_shared_cells, sum(1 for v in cells.values() if len(v) > 1))
        for ii, (_b, _p, given, ids) in enumerate(e["rows"]):
            s, r = divmod(ii, e["n_tps"])
            strm = 0 if data["kv_unified"] else ids[0]
            for a, z in e["visible"][s][r]:
                for j in range(a, z + 1):
                    if len(cells.get((strm, j), ())) > 1:
                        shared_seen[ids[0]] = shared_seen.get(ids[0], 0) + 1
            if len(ids) > 1:
                multi_rows += 1
                if given[0] != ids[0]:
                    reordered.add((tuple(given), tuple(ids)))
                line = e["grid"][s][r]
                for j, ch in enumerate(line):
                    if ch == GRID_CHARS[OTHER_SEQ] and cells.get((strm, j), set()) & set(ids[1:]):
                        first_only += 1
    if n_shared_cells:
        out.append(
            f"shared cells: {n_shared_cells} cells hold several sequences; seen (entries visible) by the rows of "
            + ", ".join(f"sequence {s}: {n}" for s, n in sorted(shared_seen.items()))
        )
    if multi_rows:
        out.append(
            f"first sequence id only: {multi_rows} row-masks of rows with several seq ids; {first_only} entries masked "
            "as 'other sequence' whose cell is in one of the row's OTHER sequences (set_input_kq_mask_impl reads "
            "ubatch->seq_id[i][0])"
        )
    if reordered:
        out.append(
            "the ubatch's first seq id is not the caller's: llama_batch_ext keeps a row's ids in a std::unordered_set "
            "(src/llama-batch.h), iterated "
            + ", ".join(f"{_seqs(g)} -> {_seqs(i)}" for g, i in sorted(reordered))
            + "; each such row masks against the set's first"
        )
    win = [e for e in es if e["cache"] == "swa"]
    if win:
        out.append(
            f"sliding window: the SWA cache's mask (layers {win[0]['layers']}, n_swa {win[0]['n_swa']}, "
            f"{data['swa_type']}) masks {sum(e['counts']['window'] for e in win)} entries as outside the window; "
            f"the other mask (layers {next((e['layers'] for e in es if e['cache'] != 'swa'), [])}) has none"
        )
    return out
