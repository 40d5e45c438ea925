"""``pyllamacpp ubatch-sweep``: what -ub really does to buffers and speed.

For each n_ubatch at fixed -c and -b: the effective n_ubatch, the compute buffer per backend and the
KV buffer (from the sizes llama.cpp logs when the context is created, captured in ``ctx.buffers``),
prefill tokens/s for a -p token prompt and decode tokens/s, each the median of -r runs. One more
row shows the clamp: -b below -ub gives n_ubatch == n_batch and a smaller compute buffer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from .common import Command, Interrupted, add_model_flags, cache_kwargs, load_model, progress

if TYPE_CHECKING:
    from ..model import Model


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--ubatch-list", default="512,256,128,64", help="the -ub values (default %(default)s)")
    p.add_argument("--clamp-b", type=int, default=0, help="-b of the clamp row (default: smallest ub / 2)")
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=32)
    p.add_argument("-r", "--repeat", type=int, default=3)
    p.add_argument("-o", "--output", help="write a two-panel plot (PNG)")


def _prompt(model, n: int) -> np.ndarray:
    base = model.tokenize("The cat sat on the mat. The dog lay by the door and watched the rain. ")
    return np.resize(base, n).astype(np.int32)


def measure(
    model: Model, *, n_ctx: int, n_batch: int, n_ubatch: int, n_prompt: int, n_gen: int, repeat: int, ctx_kwargs: dict
) -> dict:
    """One row of the sweep: a context with these sizes, its buffers, prefill and decode speed.

    The sizes are read back with ``llama_n_batch`` / ``llama_n_ubatch`` (after llama.cpp's clamps)
    and the buffers from the sizes llama.cpp logged at ``llama_init_from_model``.

    Args:
        model: The :class:`~pyllamacpp.Model`.
        n_ctx: ``n_ctx`` of the context.
        n_batch: ``n_batch`` asked for.
        n_ubatch: ``n_ubatch`` asked for.
        n_prompt: Prompt tokens to prefill.
        n_gen: Tokens to decode one at a time after the prompt (greedy).
        repeat: Runs; the speeds are their medians.
        ctx_kwargs: Further context keywords (``flash_attn``, ``type_k``...).

    Returns:
        The row: the sizes asked and got, ``buffers``, ``compute_mib``, ``kv_mib``,
        ``prefill_tps``, ``decode_tps`` (None without ``n_gen``).

    Raises:
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError`` when the prompt does not fit...).
    """
    from ..batch import Batch

    prompt = _prompt(model, n_prompt)
    with model.context(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, **ctx_kwargs) as ctx:
        row = {
            "n_batch_asked": n_batch,
            "n_ubatch_asked": n_ubatch,
            "n_batch": ctx.n_batch,
            "n_ubatch": ctx.n_ubatch,
            "buffers": ctx.buffers,
        }
        row["compute_mib"] = {b: k["compute"] for b, k in ctx.buffers.items() if "compute" in k}
        row["kv_mib"] = sum(k.get("KV", 0.0) for k in ctx.buffers.values())
        pre, dec = [], []
        batch = Batch(1, model=model)
        for _ in range(repeat):
            ctx.memory.clear()
            t0 = time.perf_counter()
            pos = ctx.prefill(prompt)
            t1 = time.perf_counter()
            pre.append(n_prompt / (t1 - t0))
            tok = int(np.argmax(ctx.logits()))
            t0 = time.perf_counter()
            for _ in range(n_gen):
                batch.clear()
                batch.add(tok, pos, 0, logits=True)
                ctx.decode(batch)
                tok = int(np.argmax(ctx.logits()))
                pos += 1
            dec.append(n_gen / (time.perf_counter() - t0))
        row["prefill_tps"] = statistics.median(pre)
        row["decode_tps"] = statistics.median(dec) if n_gen else None
        row["n_prompt"], row["n_gen"], row["repeat"] = n_prompt, n_gen, repeat
    return row


def run(args: argparse.Namespace) -> dict:
    """:func:`measure` for each ``-ub`` of the list, plus one row with ``-b`` below ``-ub`` (the clamp).

    Args:
        args: The parsed flags: ``ubatch_list``, ``clamp_b``, ``n_prompt``, ``n_gen``, ``repeat``
            and those of :func:`~pyllamacpp.experiments.common.add_model_flags`.

    Returns:
        ``model``, ``n_ctx``, ``threads`` and ``rows`` (``clamp_row`` marks the last).

    Raises:
        ModelLoadError: The model cannot be loaded.
        ValueError: An empty ``-ub`` list.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError`` when the prompt does not fit...).
        Interrupted: Ctrl-C; it carries the rows measured before it.
    """
    ubs = [int(x) for x in str(args.ubatch_list).split(",") if x]
    kw = cache_kwargs(args)
    clamp_b = args.clamp_b if args.clamp_b else max(1, min(ubs) // 2)
    plan = [(args.batch_size, ub) for ub in ubs] + [(clamp_b, max(ubs))]
    with load_model(args) as model:
        rows: list[dict] = []
        data = {"model": str(model.path), "n_ctx": args.ctx_size, "threads": args.threads, "rows": rows}
        try:
            for b, ub in progress(plan, "ubatch-sweep"):
                r = measure(
                    model,
                    n_ctx=args.ctx_size,
                    n_batch=b,
                    n_ubatch=ub,
                    n_prompt=min(args.n_prompt, args.ctx_size),
                    n_gen=args.n_gen,
                    repeat=args.repeat,
                    ctx_kwargs=kw,
                )
                r["clamp_row"] = (b, ub) == plan[-1]
                rows.append(r)
        except KeyboardInterrupt:  # Ctrl-C: the rows measured so far are still worth printing
            raise Interrupted(data if rows else None, len(rows), len(plan), "rows") from None
    return data


def print_report(data: dict) -> None:
    """Print what :func:`run` returned as a table, one row per ``-ub``.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    rows = []
    for r in data["rows"]:
        rows.append(
            {
                **r,
                "compute": ", ".join(f"{b} {v:.2f}" for b, v in r["compute_mib"].items()),
                "note": "clamp: -b < -ub" if r["clamp_row"] else "",
            }
        )
    print(
        f"model {data['model']}, -c {data['n_ctx']}, -t {data['threads']}; MiB as llama.cpp logged them; "
        f"tokens/s median of {data['rows'][0]['repeat']} runs"
    )
    print_table(
        rows,
        [
            ("n_batch_asked", "-b", "d"),
            ("n_ubatch_asked", "-ub", "d"),
            ("n_ubatch", "n_ubatch", "d"),
            ("compute", "compute MiB", "s"),
            ("kv_mib", "KV MiB", ".2f"),
            ("prefill_tps", "prefill t/s", ".1f"),
            ("decode_tps", "decode t/s", ".1f"),
            ("note", "note", "s"),
        ],
    )


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw the compute buffers and the speeds against ``n_ubatch`` (matplotlib) into ``path``.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (its suffix picks the format).
    """
    from .common import figure

    rows = [r for r in data["rows"] if not r["clamp_row"]]
    ub = [r["n_ubatch"] for r in rows]
    with figure(path, 1, 2, figsize=(10, 4)) as (fig, (a, b)):
        for backend in sorted({k for r in rows for k in r["compute_mib"]}):
            a.plot(ub, [r["compute_mib"].get(backend, 0) for r in rows], "o-", label=f"{backend} compute")
        a.plot(ub, [r["kv_mib"] for r in rows], "s--", label="KV")
        a.set_xscale("log", base=2)
        a.set_xlabel("n_ubatch")
        a.set_ylabel("MiB")
        a.set_title("buffers")
        a.legend()
        b.plot(ub, [r["prefill_tps"] for r in rows], "o-", label=f"prefill ({rows[0]['n_prompt']} tokens)")
        b.set_xscale("log", base=2)
        b.set_xlabel("n_ubatch")
        b.set_ylabel("tokens/s")
        b.set_title("prefill throughput")
        b.legend()
        fig.suptitle(f"{data['model'].split('/')[-1]}  -c {data['n_ctx']}  -t {data['threads']}")


COMMAND = Command("ubatch-sweep", "buffers and speed against -ub", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
