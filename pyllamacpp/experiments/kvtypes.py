"""``pyllamacpp kv-types``: what a KV cache type costs, in memory, in predictions and in speed.

For each cache type (``-ctk`` = ``-ctv``, f16 first as the reference): the KV buffer llama.cpp
allocates for a context of --kv-ctx cells (``... KV buffer size = N MiB``, from ``ctx.buffers``) and
the bytes one token takes (``Model.kv_bytes_per_token``); the perplexity of the text as
llama-perplexity computes it (``-c`` tokens per chunk, the second half scored); the KL divergence
against the f16 cache's logits and the top-1 agreement, on llama-perplexity's definitions (the f16
run writes the base logits, every type is read against them, f16 itself included: its row shows the
floor that the base's 16-bit storage leaves); the HellaSwag score (acc_norm) as ``llama-perplexity
--hellaswag`` computes it, on --hellaswag-tasks tasks of --hellaswag-file (default: the 40 shipped,
pyllamacpp/data/hellaswag.txt), with the share of tasks whose pick is f16's; and the speed of a -p
token prefill and of -n single-token decodes after it (medians of -r runs, the types taken in turn
in each run).

A quantized V cache needs flash attention (llama.cpp refuses the context otherwise), so -fa is on by
default, for every type alike. The text defaults to the shipped public-domain Shakespeare excerpt
(pyllamacpp/data/shakespeare.txt, 7,310 tokens with the default model).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .common import Command, add_flash_attn_flag, add_gpu_layers_flag, add_model_path_flag, add_threads_flag, progress

DEFAULT_TYPES = "f16,q8_0,q5_1,q4_0"


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_path_flag(p)
    p.add_argument("-f", "--file", type=Path, default=None, help="the text (default: the shipped Shakespeare excerpt)")
    p.add_argument("--types", default=DEFAULT_TYPES, help="cache types, K and V alike; f16 is the reference")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per perplexity chunk")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="n_batch")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="n_ubatch")
    p.add_argument("--chunks", type=int, default=-1, help="most perplexity chunks (-1: all)")
    add_flash_attn_flag(p, choices=("on", "auto", "off"), default="on", help="flash_attn_type")
    add_gpu_layers_flag(p, help="n_gpu_layers")
    p.add_argument("--kv-ctx", type=int, default=4096, help="cells of the context whose KV buffer is reported")
    p.add_argument(
        "--hellaswag-file", type=Path, default=None, help="HellaSwag tasks (default: the 40 shipped with the package)"
    )
    p.add_argument("--hellaswag-tasks", type=int, default=40, help="HellaSwag tasks per type (0: no HellaSwag column)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prefill tokens of the speed test")
    p.add_argument("-n", "--n-gen", type=int, default=64, help="single-token decodes after the prefill")
    p.add_argument("-r", "--repeat", type=int, default=3, help="speed runs per type (median)")
    add_threads_flag(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-o", "--output", help="write a figure (PNG)")


def _kv_mib(buffers: dict[str, dict[str, float]]) -> float:
    return float(sum(kinds.get("KV", 0.0) for kinds in buffers.values()))


def _speed(model, tokens: np.ndarray, kws: dict[str, dict], n_prompt: int, n_gen: int, repeat: int) -> dict:
    """Per type: the KV buffer of a context made with ``kws[type]``, and the median speed of a
    prefill of ``n_prompt`` tokens and ``n_gen`` single-token decodes after it. The contexts stay
    open side by side and each run goes through the types in a rotated order (A B C, B C A, ...),
    so a change in the machine's load falls on every type alike."""
    from ..batch import Batch

    prompt, gen = tokens[:n_prompt], tokens[n_prompt : n_prompt + n_gen]
    one = Batch(1, 1, model=model)
    ctxs = {t: model.context(**kw) for t, kw in kws.items()}
    try:
        times: dict[str, tuple[list[float], list[float]]] = {t: ([], []) for t in ctxs}
        names = list(ctxs)
        for r in progress(range(repeat), "kv-types speed"):
            for t in names[r % len(names) :] + names[: r % len(names)]:
                ctx = ctxs[t]
                ctx.memory.clear()
                t0 = time.perf_counter()
                ctx.prefill(prompt, 0, 0)
                t1 = time.perf_counter()
                for i, tok in enumerate(gen):
                    one.clear()
                    one.add(int(tok), n_prompt + i, 0, True)
                    ctx.decode(one)
                t2 = time.perf_counter()
                times[t][0].append(t1 - t0)
                times[t][1].append(t2 - t1)
        return {
            t: {
                "kv_mib": _kv_mib(ctx.buffers),
                "kv_ctx": ctx.n_ctx,
                "prefill_tps": prompt.size / float(np.median(times[t][0])),
                "decode_tps": gen.size / float(np.median(times[t][1])) if gen.size else None,
            }
            for t, ctx in ctxs.items()
        }
    finally:
        for ctx in ctxs.values():
            ctx.close()


def run(args: argparse.Namespace) -> dict:
    """Measure every cache type of ``--types`` against f16 on the text.

    Per type: a context of ``--kv-ctx`` cells (``llama_init_from_model``) for the KV buffer and the
    speed (``llama_decode`` of ``-p`` tokens, then ``-n`` single tokens; the types in turn, ``-r``
    times); then
    :func:`pyllamacpp.scoring.perplexity` (f16, writing the base logits),
    :func:`pyllamacpp.scoring.kl_divergence` against them (every type) and
    :func:`pyllamacpp.evaluation.hellaswag` (``-c`` tokens per sequence, ``-b``; every type).

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        ``model``, ``text``, ``n_tokens``, the settings, and ``rows``: per type ``type``,
        ``kv_mib``, ``kv_ctx``, ``bytes_per_token``, ``ppl``, ``ppl_err``, ``kld``, ``kld_err``,
        ``kld_99``, ``kld_max``, ``same_top``, ``same_top_err``, ``rms_p_diff``, ``ln_ratio``,
        ``prefill_tps``, ``decode_tps``, and with ``--hellaswag-tasks`` above 0 ``hellaswag`` (the
        accuracy, a fraction), ``hellaswag_interval`` (its Wilson 95% interval), ``hellaswag_tasks``
        and ``hellaswag_same_pick`` (the share of tasks whose ending picked is f16's).

    Raises:
        ValueError: An unknown cache type, a text too short for two chunks, a HellaSwag file in the
            wrong format or a negative task count.
        ModelLoadError: The model cannot be loaded.
        ContextError: llama.cpp refuses a context (a quantized V cache with -fa off).
        DecodeError: A decode failed.
    """
    from ..evaluation.llama_perplexity import hellaswag, read_hellaswag, sample_path
    from ..params import ggml_type
    from ..scoring import kl_divergence, perplexity, sample_text_path
    from .common import load_model

    if args.hellaswag_tasks < 0:
        raise ValueError(f"--hellaswag-tasks must be 0 (none) or more, not {args.hellaswag_tasks}")
    hs_path = args.hellaswag_file or sample_path("hellaswag")
    if args.hellaswag_tasks:
        read_hellaswag(hs_path)  # a file in the wrong format fails here, before any work
    types = [t.strip() for t in str(args.types).split(",") if t.strip()]
    for t in types:
        ggml_type(t, "cache type")  # an unknown name fails here, before any work
    types = ["f16", *[t for t in types if t != "f16"]]  # the reference first
    path = args.file or sample_text_path()
    data = path.read_bytes()
    data = data[:-1] if data.endswith(b"\n") else data  # as llama-perplexity's -f
    threads = {"n_threads": args.threads, "n_threads_batch": args.threads}
    with load_model(args) as model:
        out: dict[str, Any] = {
            "model": str(model.path),
            "text": path.name,
            "n_ctx": args.ctx_size,
            "n_batch": args.batch_size,
            "flash_attn": args.flash_attn,
            "threads": args.threads,
            "kv_ctx": args.kv_ctx,
            "n_prompt": args.n_prompt,
            "n_gen": args.n_gen,
            "hellaswag_file": hs_path.name if args.hellaswag_tasks else None,
            "rows": [],
        }
        tokens = model.tokenize(data)
        out["n_tokens"] = int(tokens.size)
        with tempfile.TemporaryDirectory() as tmp:
            base = os.path.join(tmp, "f16.kld")
            kws = {
                t: dict(type_k=t, type_v=t, flash_attn=args.flash_attn, n_ubatch=args.ubatch_size, **threads)
                for t in types
            }
            speed = _speed(
                model,
                tokens,
                {t: dict(kw, n_ctx=args.kv_ctx, n_batch=max(args.n_prompt, 1)) for t, kw in kws.items()},
                args.n_prompt,
                args.n_gen,
                args.repeat,
            )
            for t in progress(types, "kv-types"):
                kw, sp = kws[t], speed[t]
                if t == "f16":
                    ref = perplexity(
                        model, tokens, args.ctx_size, args.batch_size, n_chunks=args.chunks, save_base=base, **kw
                    )
                    out["n_chunk"] = ref.n_chunk
                k = kl_divergence(model, base, args.batch_size, **kw)
                hs: dict[str, Any] = {}
                if args.hellaswag_tasks:
                    h = hellaswag(
                        model, hs_path, args.hellaswag_tasks, n_ctx=args.ctx_size, n_batch=args.batch_size, **kw
                    )
                    picks = [r.pred for r in h.tasks]
                    if t == "f16":
                        ref_picks = picks
                    same = sum(a == b for a, b in zip(picks, ref_picks)) / len(picks)
                    hs = dict(
                        hellaswag=h.accuracy,
                        hellaswag_interval=h.interval,
                        hellaswag_tasks=h.n_tasks,
                        hellaswag_same_pick=same,
                    )
                out["rows"].append(
                    {
                        "type": t,
                        **sp,
                        "bytes_per_token": model.kv_bytes_per_token(t, t),
                        "ppl": k.ppl,
                        "ppl_err": k.ppl_err,
                        "kld": k.kld,
                        "kld_err": k.kld_err,
                        "kld_99": k.kld_percentiles[99.0],
                        "kld_max": k.kld_max,
                        "same_top": k.same_top,
                        "same_top_err": k.same_top_err,
                        "rms_p_diff": k.rms_p_diff,
                        "ln_ratio": k.ln_ratio,
                        **hs,
                    }
                )
    return out


def print_report(data: dict) -> None:
    """Print what :func:`run` returned as a table.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    print(
        f"model {Path(data['model']).name}; text {data['text']} ({data['n_tokens']} tokens, {data.get('n_chunk')} "
        f"chunks of {data['n_ctx']}, -b {data['n_batch']}); -fa {data['flash_attn']}, -t {data['threads']}; "
        f"KV buffer at {data['kv_ctx']} cells; speed: -p {data['n_prompt']}, then -n {data['n_gen']}"
    )
    rows = [
        dict(
            r,
            ppl_pm=f"{r['ppl']:.4f} ± {r['ppl_err']:.4f}",
            same_top_pct=100 * r["same_top"],
            rms_pct=100 * r["rms_p_diff"],
            hs_pct=100 * r["hellaswag"] if "hellaswag" in r else None,
            hs_same_pct=100 * r["hellaswag_same_pick"] if "hellaswag" in r else None,
        )
        for r in data["rows"]
    ]
    hs_cols = (
        [("hs_pct", "HellaSwag %", ".2f"), ("hs_same_pct", "same pick %", ".1f")] if data.get("hellaswag_file") else []
    )
    print_table(
        rows,
        [
            ("type", "-ctk/-ctv", ""),
            ("kv_mib", "KV MiB", ".2f"),
            ("bytes_per_token", "bytes/token", "d"),
            ("ppl_pm", "PPL", ""),
            ("kld", "mean KLD", ".6f"),
            ("kld_99", "99% KLD", ".6f"),
            ("same_top_pct", "same top %", ".3f"),
            ("rms_pct", "RMS Δp %", ".3f"),
            *hs_cols,
            ("prefill_tps", "prefill t/s", ".1f"),
            ("decode_tps", "decode t/s", ".1f"),
        ],
    )
    print("KL divergence and top-1 agreement against the f16 cache's logits (the f16 row: the base's 16-bit floor)")
    if data.get("hellaswag_file"):
        r0 = data["rows"][0]
        lo, hi = r0["hellaswag_interval"]
        print(
            f"HellaSwag: acc_norm on {r0['hellaswag_tasks']} tasks of {data['hellaswag_file']}, as llama-perplexity "
            f"--hellaswag (f16's 95% interval {100 * lo:.1f}-{100 * hi:.1f} %); same pick: the tasks whose ending "
            "picked is f16's"
        )


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw KV memory, KL divergence with top-1 agreement, and speed per cache type into ``path``.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (its suffix picks the format).
    """
    from .common import figure

    rows = data["rows"]
    names = [r["type"] for r in rows]
    x = np.arange(len(rows))
    with figure(path, 1, 3, figsize=(13, 4)) as (fig, (a, b, c)):
        a.bar(x, [r["kv_mib"] for r in rows], color="tab:blue")
        a.set_xticks(x, names)
        a.set_ylabel(f"MiB (KV buffer, {data['kv_ctx']} cells)")
        a.set_title("KV cache memory")
        b.bar(x, [max(r["kld"], 1e-7) for r in rows], color="tab:red")
        b.set_yscale("log")
        b.set_xticks(x, names)
        b.set_ylabel("mean KL divergence vs f16 (nats)")
        b.set_title("predictions")
        b2 = b.twinx()
        b2.plot(x, [100 * r["same_top"] for r in rows], "ko-")
        b2.set_ylabel("same top token as f16 (%)")
        w = 0.4
        c.bar(x - w / 2, [r["prefill_tps"] for r in rows], w, label=f"prefill ({data['n_prompt']} tokens)")
        c.bar(x + w / 2, [r["decode_tps"] or 0 for r in rows], w, label=f"decode (after {data['n_prompt']})")
        c.set_xticks(x, names)
        c.set_ylabel("tokens/s")
        c.set_title("speed")
        c.legend()
        name = Path(data["model"]).name
        fig.suptitle(f"{name}, {data['text']}: -c {data['n_ctx']}, -fa {data['flash_attn']}, -t {data['threads']}")


COMMAND = Command(
    "kv-types",
    "KV cache types against f16: buffer, bytes/token, perplexity, KL divergence, top-1, speed",
    __name__,
    _flags,
)
add_parser, main = COMMAND.add_parser, COMMAND
