"""``pyllamacpp prefix-sharing``: llama.cpp's examples/batched as an experiment.

A shared prompt goes in once for -np sequences (each prompt token carries every sequence id), then
the continuations are decoded together, one token per sequence per batch. Against it: the same
prompt decoded once per sequence (N copies). KV cells are counted from a whole-context state dump
(``llama_state_get_data`` parsed by ``pyllamacpp.state``: a cell shared by N sequences is one
cell), not computed. With ``--no-kv-unified`` every sequence has its own stream, a batch whose
tokens carry several sequence ids is rejected ("coupled sequences"), and the prefix is decoded into
sequence 0 and copied with ``seq_cp`` into every other stream: one copy per stream, which is the cost
shown. Each greedy continuation is compared with the same prompt generated alone.

Workload mode (``--requests N``): N requests that share a system prompt (``--prompt-text``, else a
built-in one; each request adds a list to continue) go through a :class:`~pyllamacpp.Scheduler`
with ``-np`` sequences, once without and once with its prefix cache, in fresh contexts
(``kv_unified`` unless ``--no-kv-unified``). Per run: prompt tokens decoded and reused, KV cells in
use (counted from a whole-context state dump after every step; the peak is shown), steps, the time
spent in ``Scheduler.step`` (the dumps are outside it), mean time to first token, and whether each
request's greedy tokens are the same in both runs. ``-o`` draws prompt tokens decoded and KV cells
against the step.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

import numpy as np

from .common import Command, Interrupted, add_model_flags, cache_kwargs, context_kwargs, load_model, progress

if TYPE_CHECKING:
    from ..model import Model

DEFAULT_PROMPT = (
    "You are a careful assistant. Here is a story to continue. Once upon a time, in a small "
    "village at the edge of a great forest, there lived an old clockmaker who"
)


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, n_parallel=4)
    p.add_argument("--modes", default="unified,split", help="unified and/or split (default %(default)s)")
    p.add_argument("--prompt-text", default=None, help="the shared prompt (default: a built-in story opening)")
    p.add_argument("-p", "--n-prompt", type=int, default=0, help="repeat the prompt to this many tokens")
    p.add_argument("-n", "--n-gen", type=int, default=16)
    p.add_argument(
        "--requests",
        type=int,
        default=0,
        help="workload mode: this many requests sharing a system prompt (--prompt-text) through the "
        "Scheduler, without and with its prefix cache (default 0: off)",
    )
    p.add_argument("-o", "--output", help="write a plot (PNG)")


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


def run_mode(model: Model, prompt: np.ndarray, n_seq: int, n_gen: int, unified: bool, kw: dict) -> dict:
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


def run(args: argparse.Namespace) -> dict:
    """Run :func:`run_mode` for each mode (``unified``, ``split``) and compare with the prompt alone.

    With ``--requests N``, the workload mode instead (:func:`run_workload`).

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
        Interrupted: Ctrl-C; it carries the modes measured before it.
    """
    if getattr(args, "requests", 0):
        return run_workload(args)
    with load_model(args) as model:
        prompt = model.tokenize(args.prompt_text or DEFAULT_PROMPT)
        if args.n_prompt:
            prompt = np.resize(prompt, args.n_prompt).astype(np.int32)
        kw = cache_kwargs(args)
        modes = [m.strip() for m in args.modes.split(",")]
        if args.kv_unified is not None:
            modes = ["unified" if args.kv_unified else "split"]
        # the reference: the prompt generated alone
        from ..generation import generate

        with model.context(n_ctx=max(256, 2 * (len(prompt) + args.n_gen)), **kw) as ctx:
            alone = list(generate(ctx, prompt, args.n_gen))
        rows: list[dict] = []
        try:
            for mode in progress(modes, "prefix-sharing"):
                r = run_mode(model, prompt, args.parallel, args.n_gen, mode == "unified", kw)
                r["mode"] = mode
                r["matches_alone"] = [t == alone[: len(t)] for t in r.pop("tokens")]
                rows.append(r)
        except KeyboardInterrupt:  # Ctrl-C: the modes measured so far are still worth printing
            raise Interrupted(_result(model, prompt, rows) if rows else None, len(rows), len(modes), "modes") from None
    return _result(model, prompt, rows)


def _result(model: Model, prompt: np.ndarray, rows: list[dict]) -> dict:
    ok = all(all(r["matches_alone"]) for r in rows)
    return {"model": str(model.path), "n_prompt": int(len(prompt)), "alone_text": None, "rows": rows, "ok": ok}


def print_report(data: dict) -> None:
    """Print what :func:`run` returned as a table, one row per mode.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    if data.get("mode") == "workload":
        print_workload(data)
        return
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


SYSTEM_PROMPT = (
    "You are a careful assistant that continues lists. Read the start of a list and write the next items "
    "in the same style, separated by commas, without any explanation. "
)
LISTS = [
    "1, 2, 3, 4, 5,",
    "January, February, March,",
    "A, B, C, D, E,",
    "one, two, three, four,",
    "10, 20, 30, 40,",
    "2, 4, 6, 8, 10,",
    "a b c d e f",
    "100, 200, 300,",
]


def workload_prompts(model: Model, n_requests: int, system: str | None = None, n_system: int = 0) -> list[np.ndarray]:
    """The prompts of the workload: one system prompt, then a list to continue (cycled).

    Args:
        model: The :class:`~pyllamacpp.Model`.
        n_requests: How many prompts.
        system: The system prompt (None: :data:`SYSTEM_PROMPT`).
        n_system: Repeat the system prompt's tokens to this many (0: as it is).

    Returns:
        One int32 token array per request (the system prompt's tokens, then the list's).
    """
    sys_toks = model.tokenize(system or SYSTEM_PROMPT)
    if n_system:
        sys_toks = np.resize(sys_toks, n_system).astype(np.int32)
    return [
        np.concatenate([sys_toks, model.tokenize(LISTS[i % len(LISTS)], add_special=False)]).astype(np.int32)
        for i in range(n_requests)
    ]


def run_scheduler(model: Model, prompts: list[np.ndarray], n_gen: int, prefix_cache: bool, kw: dict) -> dict:
    """Run ``prompts`` through a :class:`~pyllamacpp.Scheduler` in a fresh context; count per step.

    Args:
        model: The :class:`~pyllamacpp.Model`.
        prompts: The prompts' token ids, all submitted before the first step.
        n_gen: ``n_predict`` of each request (greedy).
        prefix_cache: The scheduler's ``prefix_cache``.
        kw: Context keywords (``n_ctx``, ``n_seq_max``, ``kv_unified``, ``flash_attn``...).

    Returns:
        The run: ``prefix_cache``, totals (``n_prompt``, ``n_prompt_decoded``, ``n_prompt_reused``,
        ``n_tokens``, ``n_steps``, ``step_s``, ``peak_cells``, ``mean_ttft_s``), per-step series
        (``series_decoded``, ``series_cells``), ``requests`` (each request's report) and
        ``tokens`` (each request's tokens).

    Raises:
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed.
        StateError: The state dump cannot be read (``llama_state_get_data``).
    """
    from ..scheduler import Scheduler

    with model.context(**kw) as ctx:
        sched = Scheduler(ctx, prefix_cache=prefix_cache)
        reqs = [sched.submit(p, n_gen) for p in prompts]
        decoded, cells, step_s = [0], [0], 0.0
        t0 = time.perf_counter()
        while not sched.idle:
            t = time.perf_counter()
            sched.step()
            step_s += time.perf_counter() - t
            decoded.append(sched.n_prompt_decoded)
            cells.append(_cells(ctx))  # a state dump: outside the timed step
        wall = time.perf_counter() - t0
        ttft = [r.time_to_first_token for r in reqs if r.time_to_first_token is not None]
        return {
            "prefix_cache": prefix_cache,
            "kv_unified": sched.kv_unified,
            "n_requests": len(reqs),
            "n_seq_max": sched.n_seq_max,
            "n_prompt": int(sum(r.n_prompt for r in reqs)),
            "n_prompt_decoded": sched.n_prompt_decoded,
            "n_prompt_reused": sched.n_prompt_reused,
            "n_tokens": sched.n_tokens,
            "n_steps": sched.n_steps,
            "step_s": step_s,
            "wall_s": wall,
            "peak_cells": max(cells),
            "mean_ttft_s": float(np.mean(ttft)) if ttft else None,
            "series_decoded": decoded,
            "series_cells": cells,
            "requests": [{k: v for k, v in r.report().items() if k != "text"} for r in reqs],
            "tokens": [list(r.tokens) for r in reqs],
        }


def run_workload(args: argparse.Namespace) -> dict:
    """The workload mode: N requests sharing a system prompt, without and with the prefix cache.

    Args:
        args: The parsed flags: ``requests``, ``prompt_text``, ``n_prompt``, ``n_gen`` and those of
            :func:`~pyllamacpp.experiments.common.add_model_flags`.

    Returns:
        ``mode`` ("workload"), ``model``, ``n_system`` (system prompt tokens), ``rows`` (one per run,
        see :func:`run_scheduler`), ``same_tokens`` (per request: equal greedy tokens in both runs)
        and ``ok`` (the cache decoded fewer prompt tokens, or there was nothing to share).

    Raises:
        ValueError: ``--requests`` is less than 1.
        ModelLoadError: The model cannot be loaded.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed.
        StateError: The state dump cannot be read.
        Interrupted: Ctrl-C (with nothing to print: the report compares both runs).
    """
    if args.requests < 1:
        raise ValueError(f"--requests must be at least 1, got {args.requests}")
    with load_model(args) as model:
        prompts = workload_prompts(model, args.requests, args.prompt_text, args.n_prompt)
        n_system = len(model.tokenize(args.prompt_text or SYSTEM_PROMPT)) if not args.n_prompt else args.n_prompt
        kw = context_kwargs(args)
        kw.setdefault("kv_unified", True)
        rows = []
        try:
            for cache in progress([False, True], "workload"):
                rows.append(run_scheduler(model, prompts, args.n_gen, cache, kw))
        except KeyboardInterrupt:  # the report compares the two runs: one alone has nothing to print
            raise Interrupted(None, len(rows), 2, "runs") from None
    off, on = rows
    same = [a == b for a, b in zip(off.pop("tokens"), on.pop("tokens"))]
    ok = on["n_prompt_decoded"] < off["n_prompt_decoded"] or args.requests == 1
    return {
        "mode": "workload",
        "model": str(model.path),
        "n_system": n_system,
        "n_gen": args.n_gen,
        "flash_attn": args.flash_attn,
        "rows": rows,
        "same_tokens": same,
        "ok": ok,
    }


def print_workload(data: dict) -> None:
    """Print what :func:`run_workload` returned: one row per run, then the verdict.

    Args:
        data: What :func:`run_workload` returned.
    """
    from .common import print_table

    r0 = data["rows"][0]
    print(
        f"model {data['model']}: {r0['n_requests']} requests sharing a {data['n_system']}-token system prompt, "
        f"{data['n_gen']} greedy tokens each, {r0['n_seq_max']} sequences (kv_unified {r0['kv_unified']}); "
        "KV cells counted from a state dump after each step"
    )
    rows = [
        {
            **r,
            "cache": "on" if r["prefix_cache"] else "off",
            "step_ms": r["step_s"] * 1e3,
            "ttft_ms": r["mean_ttft_s"] * 1e3 if r["mean_ttft_s"] is not None else None,
            "tps": r["n_tokens"] / r["step_s"] if r["step_s"] else None,
        }
        for r in data["rows"]
    ]
    print_table(
        rows,
        [
            ("cache", "prefix cache", "s"),
            ("n_prompt", "prompt tokens", "d"),
            ("n_prompt_decoded", "decoded", "d"),
            ("n_prompt_reused", "reused", "d"),
            ("peak_cells", "peak KV cells", "d"),
            ("n_steps", "steps", "d"),
            ("step_ms", "time ms", ".1f"),
            ("ttft_ms", "mean TTFT ms", ".1f"),
            ("tps", "tokens/s", ".1f"),
        ],
    )
    same = data["same_tokens"]
    print(f"same greedy tokens with and without the cache: {sum(same)}/{len(same)} requests")
    off, on = data["rows"]
    saved = 1 - on["n_prompt_decoded"] / off["n_prompt_decoded"] if off["n_prompt_decoded"] else 0
    print(
        f"verdict: the prefix cache decoded {on['n_prompt_decoded']} of {on['n_prompt']} prompt tokens "
        f"({saved:.0%} fewer than without it)"
        if data["ok"]
        else "verdict: the prefix cache saved no prompt tokens"
    )


def plot(data: dict, path: str) -> None:
    """Draw the run as a PNG (matplotlib) into ``path``.

    Workload mode: prompt tokens decoded and KV cells in use against the step, without and with
    the prefix cache. Otherwise: KV cells with sharing against N copies, per mode.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (PNG).
    """
    from .common import figure

    if data.get("mode") == "workload":
        with figure(path, 1, 2, figsize=(11, 4)) as (fig, (a1, a2)):
            for r in data["rows"]:
                label = f"prefix cache {'on' if r['prefix_cache'] else 'off'}"
                a1.plot(r["series_decoded"], label=label, drawstyle="steps-post")
                a2.plot(r["series_cells"], label=label, drawstyle="steps-post")
            r0 = data["rows"][0]
            a1.set_title(f"{r0['n_requests']} requests, {data['n_system']}-token system prompt, -np {r0['n_seq_max']}")
            a1.set_xlabel("scheduler step (one llama_decode)")
            a1.set_ylabel("prompt tokens decoded (cumulative)")
            a2.set_title("KV cells in use (state dump after each step)")
            a2.set_xlabel("scheduler step (one llama_decode)")
            a2.set_ylabel("cells")
            a1.legend(fontsize=8)
            a2.legend(fontsize=8)
    else:
        with figure(path, figsize=(6, 4)) as (fig, a1):
            rows = data["rows"]
            x = np.arange(len(rows))
            a1.bar(x - 0.2, [r["shared_cells"] for r in rows], 0.4, label="shared prefix")
            a1.bar(x + 0.2, [r["copies_cells"] for r in rows], 0.4, label="N copies")
            a1.set_xticks(x, [f"{r['mode']} (-np {r['n_seq']})" for r in rows])
            a1.set_ylabel("KV cells")
            a1.set_title(f"a {data['n_prompt']}-token prompt for -np sequences")
            a1.legend(fontsize=8)


COMMAND = Command("prefix-sharing", "a shared prompt for -np sequences: cells, time, outputs", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
