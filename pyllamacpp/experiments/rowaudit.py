"""``pyllamacpp row-audit``: can the rows of one sequence in a ubatch change another's, op by op?

Four decodes of sequence A (seq 0), each in a fresh context of the same parameters, with graph
taps copying every node of the forward pass (``attn_inp_k_idxs`` too, for the cells):
  - ``solo``: A alone;
  - ``AB``: A, then B (seq 1), in one ubatch;
  - ``AB'``: A, then B', another prompt of B's length, in the same rows;
  - ``BA``: B first, then A (``--order b-first``), or the two interleaved (``--order interleave``).
For each node, in graph order, the largest |difference| of A's rows (picked by the records'
``seq_ids``, in position order) between the runs:
  - content = AB against AB': the same rows, the same widths, only B's tokens differ: anything
    but 0 is B leaking into A (the verdict says "no leak" only when it is exactly 0 at every node);
  - width = AB against solo: a difference that is not content comes from the number of rows, a
    kernel that blocks or splits its work by it and rounds differently;
  - order = BA against AB: the same rows placed elsewhere in the ubatch (and A's cells elsewhere).
Attention tensors with one column per KV cell (``kq``, ``kq_soft_max``) are compared on A's own
cells only, mapped by position (A's cells are other cell indices in BA), and only the cells each
row may see (position <= its own; the others are masked and hold no value that matters).
With ``-fa auto`` (the default) both flash attention off and on are audited. ``-n`` greedy steps
then continue A (beside B or B' in the pair runs) and say whether A's tokens change.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .common import Command, add_model_flags, context_kwargs, progress, run_on_model

if TYPE_CHECKING:
    from ..model import Model

RUNS = ("solo", "AB", "AB'", "BA")
COMPARISONS = (("content", "AB", "AB'"), ("width", "AB", "solo"), ("order", "BA", "AB"))
PROMPT_A = "The cat sat on the mat and looked at the door."
PROMPT_B = "A dog ran in the park while the children played."
PROMPT_B2 = "Rain fell on the old roof of the quiet house all night."

_UNNAMED = re.compile(r"node_\d+")
Inject = tuple[str, Callable[[np.ndarray, Any], Any]]
"""A test hook: ``(node name, fn)`` patched into the runs with B (``Context.patch``)."""


def leak_hook(name: str, scale: float = 1e-3) -> Inject:
    """A patch that mixes B's rows into A's at one node: A's rows get ``scale`` times the mean of
    B's rows added (a leak planted to see the audit report it).

    Args:
        name: A full node name (``ffn_out-5``).
        scale: How much of B's mean.

    Returns:
        The ``(name, fn)`` for :func:`audit`'s ``inject``.
    """

    def fn(x: np.ndarray, info) -> None:
        if info.seq_ids is None or info.token_axis is None:
            return
        a = [i for i, s in enumerate(info.seq_ids) if 0 in s]
        b = [i for i, s in enumerate(info.seq_ids) if 1 in s]
        if a and b:
            ax = info.token_axis
            mean = np.take(x, b, axis=ax).mean(axis=ax, keepdims=True)
            idx: list[Any] = [slice(None)] * x.ndim
            idx[ax] = a
            x[tuple(idx)] += scale * mean

    return name, fn


def batch_rows(n_a: int, n_b: int, run: str, order: str) -> list[tuple[int, int]]:
    """``(seq_id, index in its prompt)`` of each batch row of a run.

    Args:
        n_a: A's tokens.
        n_b: B's tokens.
        run: One of :data:`RUNS`.
        order: ``"b-first"`` or ``"interleave"``: the BA run's layout.

    Returns:
        The rows, in batch order.

    Raises:
        ValueError: An unknown run or order.
    """
    a = [(0, i) for i in range(n_a)]
    b = [(1, i) for i in range(n_b)]
    if run == "solo":
        return a
    if run in ("AB", "AB'"):
        return a + b
    if run != "BA":
        raise ValueError(f"run must be one of {RUNS}, got {run!r}")
    if order == "b-first":
        return b + a
    if order == "interleave":
        out = []
        for i in range(max(n_a, n_b)):
            out += ([(1, i)] if i < n_b else []) + ([(0, i)] if i < n_a else [])
        return out
    raise ValueError(f"order must be b-first or interleave, got {order!r}")


def _a_rows(rec) -> tuple[np.ndarray, np.ndarray] | None:
    """A's rows of a record in position order, and their positions; None when the rows are not
    known, there is no token axis, or none is A's."""
    if rec.token_axis is None or rec.seq_ids is None or rec.pos is None:
        return None
    idx = [i for i, s in enumerate(rec.seq_ids) if 0 in s]
    if not idx:
        return None
    idx = sorted(idx, key=lambda i: int(rec.pos[i]))
    return np.take(rec.array(), idx, axis=rec.token_axis), np.asarray(rec.pos)[idx]


def _kv_axis(rec, n_kv: int | None) -> bool:
    """Whether the record's last axis is one column per KV cell (QK^T, its softmax)."""
    return rec.site.startswith("kq") and rec.shape[-1] == n_kv and rec.token_axis == len(rec.shape) - 2


def _one_run(
    model: Model,
    ctx_kw: dict,
    tokens: dict[int, np.ndarray],
    rows: list[tuple[int, int]],
    *,
    n_gen: int,
    inject: Inject | None,
    max_bytes: int,
    layers_per_capture: int,
) -> dict:
    """Decode the rows in a fresh context with every node captured; A's rows of each node."""
    from ..batch import Batch
    from ..context import Context
    from ..errors import CaptureLimitError

    out: dict[tuple[str, int], dict] = {}
    with Context(model, **ctx_kw) as ctx:
        if ctx.n_ubatch < len(rows):
            raise ValueError(f"the audit puts A and B in one ubatch: -ub {ctx.n_ubatch} < {len(rows)} rows")
        graph = ctx.graph_nodes()
        names = list(dict.fromkeys(n.name for n in graph.nodes if not n.is_view))
        layered = sorted({n.layer for n in graph.nodes if n.layer is not None})
        step = layers_per_capture or max(1, len(layered))
        groups = [layered[i : i + step] for i in range(0, len(layered), step)] or [[]]
        batch = Batch(max(len(rows), 2), 1, model=model)
        last = {s: max(i for i, (q, _) in enumerate(rows) if q == s) for s in {q for q, _ in rows}}

        def fill() -> None:
            batch.clear()
            for i, (s, t) in enumerate(rows):
                batch.add(int(tokens[s][t]), t, s, logits=i == last[s])

        patch = ctx.patch(inject[0], inject[1]) if inject is not None and len(last) > 1 else None
        if patch is not None:
            patch.__enter__()
        try:
            for gi, group in enumerate(groups):
                want = set(group)
                sel = [
                    nm
                    for nm in names
                    if (graph.named(nm)[0].layer in want) or (graph.named(nm)[0].layer is None and gi == 0)
                ]
                ctx.memory.clear()
                fill()
                try:
                    inputs = ["attn_inp_k_idxs", "attn_inp_kq_mask"]
                    with ctx.capture([*sel, *inputs], which="all", max_bytes=max_bytes) as cap:
                        ctx.decode(batch)
                except CaptureLimitError as e:
                    raise ValueError(f"{e}; or give --layers-per-capture a smaller N") from None
                if cap.n_passes != 1:  # split_equal (separate streams) cuts unequal sequences apart
                    raise ValueError(
                        f"A and B were decoded in {cap.n_passes} ubatches, not one (-ub {ctx.n_ubatch}"
                        f"{', separate KV streams: split_equal' if not ctx.params.kv_unified else ''}): "
                        "the audit needs them side by side; use --kv-unified"
                    )
                _collect(cap.records, graph, out)
            logits = ctx.logits(last[0]).copy()
            gen = _greedy(ctx, batch, logits, tokens, rows, last, n_gen)
            flash = bool(ctx.flash_attn)
        finally:
            if patch is not None:
                patch.__exit__(None, None, None)
    order = [(n.name, n.occurrence) for n in graph.nodes if not n.is_view]
    return {"nodes": out, "order": order, "argmax": int(np.argmax(logits)), "generated": gen, "flash_attn": flash}


def _greedy(ctx, batch, logits_a, tokens, rows, last, n_gen: int) -> list[int]:
    """n_gen greedy steps of A (and of B, in one batch, in the run's row order)."""
    if n_gen <= 0:
        return []
    seqs = list(dict.fromkeys(s for s, _ in rows))
    nxt = {s: int(np.argmax(ctx.logits(last[s]))) for s in seqs}
    nxt[0] = int(np.argmax(logits_a))
    pos = {s: max(t for q, t in rows if q == s) + 1 for s in seqs}
    gen = [nxt[0]]
    for _ in range(n_gen - 1):
        batch.clear()
        for s in seqs:
            batch.add(nxt[s], pos[s], s, logits=True)
        ctx.decode(batch)
        for i, s in enumerate(seqs):
            nxt[s] = int(np.argmax(ctx.logits(i)))
            pos[s] += 1
        gen.append(nxt[0])
    return gen


def _collect(records, graph, out: dict) -> None:
    """A's rows of every computing node of one capture (one pass), cells mapped for the KV-axis ones."""
    views = {(n.name, n.occurrence) for n in graph.nodes if n.is_view}
    # a layer's kq columns are the cells of the cache its mask belongs to: mask and k_idxs leaves
    # are numbered by first use, the same order (an iSWA model's two caches)
    occ_of = {il: m.occurrence for m in graph.inputs if m.name == "attn_inp_kq_mask" for il in m.read_by}
    kidx = {r.occurrence: r for r in records if r.name == "attn_inp_k_idxs"}
    n_kv = {r.occurrence: int(r.ne[0]) for r in records if r.name == "attn_inp_kq_mask"}
    for r in records:
        if r.kind == "input" or (r.name, r.occurrence) in views:
            continue
        entry = out.setdefault(
            (r.name, r.occurrence),
            {"site": r.site, "layer": r.layer, "op": r.op, "parts": [], "kv": False, "why": None},
        )
        got = _a_rows(r)
        if got is None:
            entry["why"] = "no token axis" if r.token_axis is None else "rows not known"
            continue
        a, row_pos = got
        occ = occ_of.get(r.layer, 0) if r.layer is not None else 0
        k = kidx.get(occ)
        if k is not None and _kv_axis(r, n_kv.get(occ)):
            a = _a_cells(a, row_pos, k)
            entry["kv"] = True
        entry["parts"].append(a)


def _a_cells(a: np.ndarray, row_pos: np.ndarray, k) -> np.ndarray:
    """A's rows of a KV-axis tensor cut to A's cells in position order, with the cells a row may
    not see (later positions: masked) set to 0."""
    idx = sorted((i for i, s in enumerate(k.seq_ids) if 0 in s), key=lambda i: int(k.pos[i]))
    cells = np.asarray(k.array())[idx].astype(np.int64)
    pos = np.asarray(k.pos)[idx]
    cut = np.take(a, cells, axis=-1).astype(np.float64)
    cut[..., pos[None, :] > row_pos[:, None]] = 0.0
    return cut


def _one(parts: list[np.ndarray]) -> np.ndarray | None:
    return parts[0] if len(parts) == 1 else None  # one pass per capture: A and B in one ubatch


def max_abs_diff(x: np.ndarray | None, y: np.ndarray | None) -> float | None:
    """The largest |x - y| (0 where both are NaN, inf where one is); None when they cannot be
    compared (missing, or of different shapes).

    Args:
        x: One run's rows.
        y: The other's.

    Returns:
        The difference, or None.
    """
    if x is None or y is None or x.shape != y.shape:
        return None
    if x.size == 0:
        return 0.0
    a, b = x.astype(np.float64), y.astype(np.float64)
    d = np.abs(a - b)
    both = np.isnan(a) & np.isnan(b)
    d[both] = 0.0
    d[np.isnan(d)] = np.inf
    return float(d.max())


def compare_runs(runs: dict[str, dict], graph_order: Sequence[tuple[str, int]]) -> list[dict]:
    """Per node in graph order, the largest difference of A's rows for each comparison.

    Args:
        runs: What each run captured (``{"solo": {...}, "AB": ...}``, each with ``nodes``).
        graph_order: The nodes' keys in graph order.

    Returns:
        One dict per node: name, site, layer, op, kv (compared on A's cells), and one value per
        comparison (None: not compared, with ``why``).
    """
    out = []
    for key in graph_order:
        ent = runs["solo"]["nodes"].get(key)
        if ent is None:
            continue
        row = {"name": key[0], "occurrence": key[1], "site": ent["site"], "layer": ent["layer"], "op": ent["op"]}
        row["kv"] = ent["kv"]
        row["why"] = ent["why"]
        arrays = {r: _one(runs[r]["nodes"].get(key, {}).get("parts", [])) for r in RUNS}
        for what, x, y in COMPARISONS:
            row[what] = max_abs_diff(arrays[x], arrays[y])
        out.append(row)
    return out


def first_nonzero(rows: list[dict], what: str) -> dict | None:
    """The first node (graph order) where a comparison is not exactly 0.

    Args:
        rows: What :func:`compare_runs` returned.
        what: ``"content"``, ``"width"`` or ``"order"``.

    Returns:
        The node's row, or None.
    """
    return next((r for r in rows if r[what] not in (None, 0.0)), None)


def audit(
    model: Model,
    prompt_a: str = PROMPT_A,
    prompt_b: str = PROMPT_B,
    prompt_b2: str = PROMPT_B2,
    *,
    order: str = "b-first",
    fa_modes: Sequence[str] = ("off", "on"),
    n_gen: int = 4,
    inject: Inject | None = None,
    max_bytes: int = 1 << 30,
    layers_per_capture: int = 0,
    **ctx_kw: Any,
) -> dict:
    """The four runs per flash-attention mode, compared node by node (see the module docstring).

    Args:
        model: The :class:`~pyllamacpp.Model`.
        prompt_a: Sequence A's text.
        prompt_b: Sequence B's text.
        prompt_b2: B''s text (its tokens cut or repeated to B's length).
        order: The BA run's layout: ``"b-first"`` or ``"interleave"``.
        fa_modes: Flash attention settings audited (``"off"``, ``"on"``).
        n_gen: Greedy tokens of A generated after the prompt in each run.
        inject: A test hook: ``(node name, fn)`` patched into the runs that have B (a planted leak:
            :func:`leak_hook`).
        max_bytes: The capture's arena (per capture).
        layers_per_capture: Capture this many layers per decode (the batch decoded again for
            each group, memory cleared); 0: all at once.
        **ctx_kw: :class:`~pyllamacpp.Context` keywords (``n_seq_max`` is at least 2).

    Returns:
        ``modes``: per flash-attention mode its ``rows`` (:func:`compare_runs`), first nodes of
        each difference, the greedy tokens; ``leak`` (any content difference), ``ok``.

    Raises:
        ValueError: An empty prompt, more rows than ``n_batch``, or a capture past ``max_bytes``.
        DecodeError: A decode failed.
    """
    toks_a = model.tokenize(prompt_a)
    toks_b = model.tokenize(prompt_b)
    toks_b2 = np.resize(model.tokenize(prompt_b2), toks_b.size).astype(np.int32)
    if not toks_a.size or not toks_b.size:
        raise ValueError("prompts A and B need at least one token each")
    if np.array_equal(toks_b, toks_b2):
        raise ValueError("B and B' are the same tokens: give another --prompt-b2")
    ctx_kw["n_seq_max"] = max(2, int(ctx_kw.get("n_seq_max") or 1))
    ctx_kw.setdefault("kv_unified", True)
    ctx_kw.setdefault("n_batch", 2048)
    if toks_a.size + toks_b.size > ctx_kw["n_batch"]:
        raise ValueError(f"{toks_a.size + toks_b.size} tokens do not fit one decode of n_batch {ctx_kw['n_batch']}")
    modes = []
    steps = [(fa, r) for fa in fa_modes for r in RUNS]
    runs_by_fa: dict[str, dict[str, dict]] = {}
    for fa, run in progress(steps, "row-audit"):
        kw = {**ctx_kw, "flash_attn": fa}
        tokens = {0: toks_a, 1: toks_b2 if run == "AB'" else toks_b}
        layout = batch_rows(toks_a.size, toks_b.size, run, order)
        runs_by_fa.setdefault(fa, {})[run] = _one_run(
            model,
            kw,
            tokens,
            layout,
            n_gen=n_gen,
            inject=inject,
            max_bytes=max_bytes,
            layers_per_capture=layers_per_capture,
        )
    for fa in fa_modes:
        runs = runs_by_fa[fa]
        flash = runs["solo"]["flash_attn"]
        rows = compare_runs(runs, runs["solo"]["order"])
        compared = [r for r in rows if r["content"] is not None]
        if not compared:
            raise ValueError(f"flash attention {fa}: no node could be compared (A's rows not known)")
        mode = {
            "flash_attn": fa,
            "flash_attn_on": flash,
            "n_nodes": len(rows),
            "n_compared": len(compared),
            "not_compared": sorted({f"{r['site']} ({r['why']})" for r in rows if r["content"] is None}),
            "rows": rows,
            "first": {what: _brief(first_nonzero(rows, what)) for what, _, _ in COMPARISONS},
            "max": {w: max((r[w] for r in compared if r[w] is not None), default=0.0) for w, _, _ in COMPARISONS},
            "argmax": {r: runs[r]["argmax"] for r in RUNS},
            "generated": {r: runs[r]["generated"] for r in RUNS},
        }
        gen = mode["generated"]
        mode["greedy_same"] = {r: gen[r] == gen["solo"] for r in RUNS if r != "solo"}
        mode["leak"] = mode["max"]["content"] != 0.0
        modes.append(mode)
    leak = any(m["leak"] for m in modes)
    return {
        "prompt_a": prompt_a,
        "prompt_b": prompt_b,
        "prompt_b2": prompt_b2,
        "n_a": int(toks_a.size),
        "n_b": int(toks_b.size),
        "order": order,
        "n_gen": n_gen,
        "injected": inject[0] if inject is not None else None,
        "modes": modes,
        "leak": leak,
        "ok": not leak,
    }


def _brief(row: dict | None) -> dict | None:
    if row is None:
        return None
    return {k: row[k] for k in ("name", "occurrence", "site", "layer", "op", "content", "width", "order")}


# -- command -----------------------------------------------------------------------------------


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, ctx=512, batch=512, ubatch=512, n_parallel=2)
    p.set_defaults(kv_unified=True)
    p.add_argument("--prompt-a", default=PROMPT_A, help="sequence A")
    p.add_argument("--prompt-b", default=PROMPT_B, help="sequence B")
    p.add_argument("--prompt-b2", default=PROMPT_B2, help="B' (cut or repeated to B's token count)")
    p.add_argument("--order", choices=("b-first", "interleave"), default="b-first", help="the BA run's rows")
    p.add_argument("-n", "--n-gen", type=int, default=4, help="greedy tokens of A after the prompt")
    p.add_argument("--max-mb", type=int, default=1024, help="the capture's arena, MiB")
    p.add_argument("--layers-per-capture", type=int, default=0, help="layers captured per decode (0: all)")
    p.add_argument("--rows", type=int, default=12, help="nodes with a difference to list")
    p.add_argument("-o", "--output", help="write the differences per node as a figure (PNG)")
    # test hook: plant a leak (B's mean rows mixed into A's) at this node; not a user option
    p.add_argument("--inject-leak", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> dict:
    """:func:`audit` for the flags.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        What :func:`audit` returns, plus ``model``, ``threads`` and ``rows_shown``.

    Raises:
        ValueError: Bad flags, or a capture past ``--max-mb``.
        ModelLoadError: The model cannot be loaded.
        DecodeError: A decode failed.
    """
    if args.n_gen < 0 or args.max_mb <= 0 or args.layers_per_capture < 0:
        raise ValueError("-n and --layers-per-capture must be >= 0, --max-mb > 0")
    kw = context_kwargs(args)
    fa = kw.pop("flash_attn")
    data = run_on_model(
        args,
        audit,
        args.prompt_a,
        args.prompt_b,
        args.prompt_b2,
        order=args.order,
        fa_modes=("off", "on") if fa == "auto" else (fa,),
        n_gen=args.n_gen,
        inject=leak_hook(args.inject_leak) if args.inject_leak else None,
        max_bytes=args.max_mb << 20,
        layers_per_capture=args.layers_per_capture,
        **kw,
    )
    data["rows_shown"] = args.rows
    return data


def _g(x: float | None) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.3g}")


def _where(r: dict | None) -> str:
    return "none" if r is None else f"{r['name']} ({r['op']})"


def print_report(data: dict) -> None:
    """Print what :func:`run` returned: per mode the sites' largest differences, the first node of
    each kind, the greedy tokens, the verdict.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    print(
        f"model {data.get('model', '?')}; A {data['n_a']} tokens, B and B' {data['n_b']}; BA: {data['order']}; "
        f"{data.get('threads', '?')} threads; content = AB vs AB', width = AB vs solo, order = BA vs AB "
        "(largest |difference| of A's rows)"
    )
    if data["injected"]:
        print(f"TEST HOOK: a leak planted at {data['injected']} (B's mean rows mixed into A's)")
    for m in data["modes"]:
        print(
            f"\nflash attention {m['flash_attn']}: {m['n_compared']} of {m['n_nodes']} nodes compared"
            + (f" (not: {', '.join(m['not_compared'])})" if m["not_compared"] else "")
        )
        sites: dict[tuple[str, str], dict] = {}
        for r in m["rows"]:
            site = "node_*" if _UNNAMED.fullmatch(r["site"]) else r["site"]  # unnamed: FLASH_ATTN_EXT, out_ids rows
            s = sites.setdefault((site, r["op"]), {"site": site, "op": r["op"], "n": 0, "layers": set()})
            s["n"] += 1
            if r["layer"] is not None:
                s["layers"].add(r["layer"])
            for what, _, _ in COMPARISONS:
                v = r[what]
                if v is not None:
                    s[what] = max(s.get(what, 0.0), v)
                    if v != 0 and f"first_{what}" not in s:
                        s[f"first_{what}"] = r["name"]
        table = []
        for s in sites.values():
            table.append(
                {
                    "site": s["site"],
                    "op": s["op"],
                    "n": s["n"],
                    "content": _g(s.get("content")),
                    "width": _g(s.get("width")),
                    "order": _g(s.get("order")),
                    "fw": s.get("first_width", "-"),
                }
            )
        print_table(
            table,
            [
                ("site", "site", "s"),
                ("op", "op", "s"),
                ("n", "nodes", "d"),
                ("content", "content", "s"),
                ("width", "width", "s"),
                ("order", "order", "s"),
                ("fw", "first width diff", "s"),
            ],
        )
        diff = [r for r in m["rows"] if any(r[w] for w, _, _ in COMPARISONS)]
        if diff:
            n = data.get("rows_shown", 12)
            print(f"nodes with a difference (first {min(n, len(diff))} of {len(diff)}, graph order):")
            print_table(
                [{**r, **{w: _g(r[w]) for w, _, _ in COMPARISONS}} for r in diff[:n]],
                [
                    ("name", "node", "s"),
                    ("op", "op", "s"),
                    ("content", "content", "s"),
                    ("width", "width", "s"),
                    ("order", "order", "s"),
                ],
            )
        f = m["first"]
        print(
            f"first node with a content difference: {_where(f['content'])}; width: {_where(f['width'])}; "
            f"order: {_where(f['order'])}"
        )
        print(
            "greedy tokens of A: "
            + ", ".join(f"{r} {m['generated'][r]}" for r in RUNS)
            + " -> "
            + ("the same in every run" if all(m["greedy_same"].values()) else "they CHANGE")
        )
        print(
            f"verdict (flash attention {m['flash_attn']}): "
            + (
                f"LEAK: B changes A's rows (content up to {_g(m['max']['content'])})"
                if m["leak"]
                else "no leak (content exactly 0 at every node compared)"
            )
            + (
                f"; width differences up to {_g(m['max']['width'])} (rounding of kernels chosen by the row count)"
                if m["max"]["width"]
                else "; no width difference (A's rows bit-identical to A alone)"
            )
        )


_STYLE = {"content": ("#d7191c", "o"), "width": ("#2c7bb6", "s"), "order": ("#1a9641", "^")}


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw, per flash-attention mode, each node's largest difference of A's rows (graph order)
    for the three comparisons; exact zeros on the bottom line.

    Args:
        data: What :func:`run` returned.
        path: The PNG to write.

    Raises:
        OSError: The file cannot be written.
    """
    from .common import figure

    modes = data["modes"]
    with figure(path, len(modes), 1, figsize=(10, 3.2 * len(modes) + 0.6), squeeze=False, sharex=True, dpi=110) as (
        fig,
        axes,
    ):
        for ax, m in zip(axes[:, 0], modes):
            vals = [v for r in m["rows"] for w in _STYLE if (v := r[w]) not in (None, 0.0) and np.isfinite(v)]
            floor = min(vals) / 10 if vals else 1e-12
            for what, (color, marker) in _STYLE.items():
                xs = [i for i, r in enumerate(m["rows"]) if r[what] is not None]
                ys = [max(m["rows"][i][what], floor) for i in xs]
                ax.scatter(xs, ys, s=6, color=color, marker=marker, label=f"{what} (first: {_where(m['first'][what])})")
            ax.set_yscale("log")
            ax.axhline(floor, color="#888", lw=0.6)
            ax.set_ylabel("max |Δ| of A's rows\n(bottom line: exactly 0)", fontsize=8)
            ax.set_title(
                f"flash attention {m['flash_attn']}: "
                + ("LEAK" if m["leak"] else "no leak")
                + f"; greedy tokens {'the same' if all(m['greedy_same'].values()) else 'CHANGE'}",
                fontsize=9,
            )
            ax.legend(fontsize=7, loc="upper left")
        axes[-1, 0].set_xlabel("node, in graph order", fontsize=8)
        fig.suptitle(
            f"row-audit: A ({data['n_a']} tokens) alone, beside B, beside B', after B; content = AB vs AB', "
            "width = AB vs solo, order = BA vs AB",
            fontsize=9,
        )


COMMAND = Command(
    "row-audit", "does sequence B change sequence A's rows in one ubatch? every node compared", __name__, _flags
)
add_parser, main = COMMAND.add_parser, COMMAND
