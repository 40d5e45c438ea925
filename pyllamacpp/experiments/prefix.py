"""``pyllamacpp prefix-sharing``: llama.cpp's examples/batched as an experiment.

A shared prompt goes in once for -np sequences (each prompt token carries every sequence id), then
the continuations are decoded together, one token per sequence per batch. Against it: the same
prompt decoded once per sequence (N copies). KV cells are counted from a whole-context state dump
(``llama_state_get_data`` parsed by ``pyllamacpp.state``: a cell shared by N sequences is one
cell), not computed. With ``--no-kv-unified`` every sequence has its own stream, a batch whose
tokens carry several sequence ids is rejected ("coupled sequences"), and the prefix is decoded into
sequence 0 and copied with ``seq_cp`` into every other stream: one copy per stream, which is the cost
shown. Each greedy continuation is compared with the same prompt generated alone.
"""

from __future__ import annotations

import time

import numpy as np

from .common import load_model, progress

DEFAULT_PROMPT = (
    "You are a careful assistant. Here is a story to continue. Once upon a time, in a small "
    "village at the edge of a great forest, there lived an old clockmaker who"
)


def _cells(ctx) -> int:
    from ..state import parse

    st = parse(ctx.state(), n_head_kv=ctx.model.n_head_kv)
    return sum(s.cell_count for p in st.parts for s in p.streams)


def _continue(ctx, model, n_seq: int, first_out: dict, pos0: int, n_gen: int):
    """Greedy-decode n_gen tokens for every sequence together; returns tokens and seconds."""
    from ..batch import Batch

    batch = Batch(max(n_seq, 1), ctx.n_seq_max, model=model)
    out: dict[int, list[int]] = {s: [] for s in range(n_seq)}
    idx = dict(first_out)
    t0 = time.perf_counter()
    for step in range(n_gen):
        batch.clear()
        for s in range(n_seq):
            tok = int(np.argmax(ctx.logits(idx[s])))
            out[s].append(tok)
            if step < n_gen - 1:
                idx[s] = batch.add(tok, pos0 + step, s, logits=True)
        if step < n_gen - 1:
            ctx.decode(batch)
    return out, time.perf_counter() - t0


def run_mode(model, prompt, n_seq: int, n_gen: int, unified: bool, kw: dict) -> dict:
    """One row: the prompt shared by ``n_seq`` sequences, against ``n_seq`` copies of it.

    Shared: with ``unified`` one ``llama_decode`` of a batch whose tokens carry every seq id; else
    ``prefill`` into sequence 0 and ``llama_memory_seq_cp`` into each other stream. Then ``n_gen``
    greedy tokens per sequence, decoded together. Cells are counted from a state dump.

    Args:
        model: The :class:`~pyllamacpp.Model`.
        prompt: The prompt's token ids.
        n_seq: How many sequences (``n_seq_max``).
        n_gen: Greedy tokens to generate per sequence.
        unified: ``kv_unified`` of the contexts.
        kw: Further context keywords (``flash_attn``, ``type_k``...).

    Returns:
        The row: ``shared_cells``, ``copies_cells``, ``shared_prefill_s``, ``copies_prefill_s``,
        ``decode_tps``, ``tokens`` (per sequence) and the settings.

    Raises:
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError``, ``InvalidBatchError``...).
        StateError: The state dump cannot be read (``llama_state_get_data``).
    """
    from ..batch import Batch

    p = len(prompt)
    row: dict = {"kv_unified": unified, "n_seq": n_seq, "n_prompt": p, "n_gen": n_gen}
    n_ctx = max(256, 2 * n_seq * (p + n_gen))
    # shared prefix
    with model.context(n_ctx=n_ctx, n_batch=max(p * n_seq, 64), n_seq_max=n_seq, kv_unified=unified, **kw) as ctx:
        t0 = time.perf_counter()
        if unified:
            b = Batch(p, n_seq, model=model)
            b.add_sequence(prompt, list(range(n_seq)), 0, logits="last")
            ctx.decode(b)
            first = {s: p - 1 for s in range(n_seq)}
            row["shared_how"] = "one batch, every token in all sequences"
        else:
            ctx.prefill(prompt, 0, 0)
            for s in range(1, n_seq):
                ctx.memory.seq_cp(0, s)
            first = {s: -1 for s in range(n_seq)}
            row["shared_how"] = "decoded into seq 0, seq_cp into each other stream"
        row["shared_prefill_s"] = time.perf_counter() - t0
        row["shared_cells"] = _cells(ctx)
        toks, secs = _continue(ctx, model, n_seq, first, p, n_gen)
        row["decode_tps"] = n_seq * (n_gen - 1) / secs if n_gen > 1 else None
        row["tokens"] = [toks[s] for s in range(n_seq)]
    # N copies of the prompt, one per sequence, in one batch
    with model.context(n_ctx=n_ctx, n_batch=max(p * n_seq, 64), n_seq_max=n_seq, kv_unified=unified, **kw) as ctx:
        b = Batch(p * n_seq, n_seq, model=model)
        for s in range(n_seq):
            b.add_sequence(prompt, s, 0, logits="last")
        t0 = time.perf_counter()
        ctx.decode(b)
        row["copies_prefill_s"] = time.perf_counter() - t0
        row["copies_cells"] = _cells(ctx)
    return row


def run(args) -> dict:
    """Run :func:`run_mode` for each mode (``unified``, ``split``) and compare with the prompt alone.

    Args:
        args: The parsed flags: ``prompt_text``, ``n_prompt``, ``n_gen``, ``modes`` and those of
            :func:`~pyllamacpp.experiments.common.add_model_flags`.

    Returns:
        ``model``, ``n_prompt``, ``rows`` (one per mode, each with ``matches_alone`` per
        sequence) and ``ok`` (every continuation matches the prompt generated alone).

    Raises:
        ModelLoadError: The model cannot be loaded.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError``, ``InvalidBatchError``...).
        StateError: The state dump cannot be read (``llama_state_get_data``).
    """
    model = load_model(args)
    try:
        prompt = model.tokenize(args.prompt_text or DEFAULT_PROMPT)
        if args.n_prompt:
            prompt = np.resize(prompt, args.n_prompt).astype(np.int32)
        kw = dict(
            flash_attn=args.flash_attn,
            type_k=args.cache_type_k,
            type_v=args.cache_type_v,
            n_threads=args.threads,
            n_threads_batch=args.threads,
        )
        modes = [m.strip() for m in args.modes.split(",")]
        if args.kv_unified is not None:
            modes = ["unified" if args.kv_unified else "split"]
        # the reference: the prompt generated alone
        from ..generation import generate

        with model.context(n_ctx=max(256, 2 * (len(prompt) + args.n_gen)), **kw) as ctx:
            alone = list(generate(ctx, prompt, args.n_gen))
        rows = []
        for mode in progress(modes, "prefix-sharing"):
            r = run_mode(model, prompt, args.parallel, args.n_gen, mode == "unified", kw)
            r["mode"] = mode
            r["matches_alone"] = [t == alone[: len(t)] for t in r.pop("tokens")]
            rows.append(r)
    finally:
        model.close()
    ok = all(all(r["matches_alone"]) for r in rows)
    return {"model": str(model.path), "n_prompt": int(len(prompt)), "alone_text": None, "rows": rows, "ok": ok}


def print_report(data: dict) -> None:
    """Print what :func:`run` returned as a table, one row per mode.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    print(
        f"model {data['model']}: a {data['n_prompt']}-token prompt shared by -np sequences; "
        "KV cells counted from a whole-context state dump"
    )
    rows = [
        {
            **r,
            "saved": 1 - r["shared_cells"] / r["copies_cells"] if r["copies_cells"] else 0,
            "match": f"{sum(r['matches_alone'])}/{len(r['matches_alone'])}",
            "sp_ms": r["shared_prefill_s"] * 1e3,
            "cp_ms": r["copies_prefill_s"] * 1e3,
        }
        for r in data["rows"]
    ]
    print_table(
        rows,
        [
            ("mode", "mode", "s"),
            ("n_seq", "-np", "d"),
            ("shared_cells", "cells shared", "d"),
            ("copies_cells", "cells N copies", "d"),
            ("saved", "saved", ".0%"),
            ("sp_ms", "prefill shared ms", ".1f"),
            ("cp_ms", "prefill copies ms", ".1f"),
            ("decode_tps", "decode t/s", ".1f"),
            ("match", "greedy = alone", "s"),
        ],
    )
    for r in data["rows"]:
        print(f"  {r['mode']}: prefix {r['shared_how']}")
    print(
        "verdict: every continuation equals the prompt generated alone"
        if data["ok"]
        else "verdict: MISMATCH between shared and alone continuations"
    )
