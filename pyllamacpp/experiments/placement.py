"""``pyllamacpp placement``: does a sequence restored from a dump give the logits it gave before?

A prompt minus its last token is decoded into sequence 0 of a fresh context (one unified KV stream,
so cells 0..n-2) and dumped (``llama_state_seq_get_data_ext``); the last token is then decoded, and
its logits are the reference. The dump is then restored twice, and the last token decoded again:

- same cells: the whole memory cleared (its head back at cell 0), the dump loaded into sequence 0,
  so its cells are 0..n-2 again, as when it was written;
- other cells: the memory cleared, --occupy tokens decoded into sequence 1 first (cells 0..m-1),
  then the dump loaded into sequence 0: it lands in cells m.. (the first ones are taken).

Both with flash attention on and off. Each row gives max |Δ logit| against the reference and whether
the greedy (argmax) token is the same. With flash attention off, the CPU result does not depend on
where the cells are: every Δ is 0. With it on, ggml's CPU kernel (ops.cpp,
ggml_compute_forward_flash_attn_ext_f16) splits the KV cells of a one-token ubatch into one chunk per
thread once n_kv >= 512, and merges the chunks' partial softmax sums: when the sequence sits in other
cells, or n_kv (the used cells, padded to 256) differs, the chunk boundaries cut it elsewhere and the
float sums round differently. So the effect needs a sequence of a few hundred cells (-p) and more than
one thread (-t); the greedy token usually holds. An iSWA model's sliding-window cache is a ring: a
reload may put its cells elsewhere even in the "same cells" case (reported for a Gemma 3 270M GGUF,
700 tokens, window 512; a small synthetic gemma3 did not show it): try -m on such a model.
Exit status 1 when a flash-attention-off row is not bit-identical.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import numpy as np

from .._cpu import default_n_threads
from .common import Command, add_cache_and_thread_flags, add_flash_attn_flag, add_model_path_flag

if TYPE_CHECKING:
    from ..model import Model

DEFAULT_PROMPT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker and his granddaughter. Every morning she opened the shop, wound the clocks on the "
    "wall one by one, and listened to them tick together. One winter day a stranger came in with a "
    "broken pocket watch and asked whether it could be mended before nightfall, because"
)
CASES = ("same cells", "other cells")
_BINS = np.concatenate([[0.0], np.logspace(-7, 1, 17)])  # |Δ logit| histogram edges


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_path_flag(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (default: a built-in story opening)")
    p.add_argument(
        "-p",
        "--n-prompt",
        type=int,
        default=400,
        help="repeat the prompt to this many tokens (0: as it is; default %(default)s)",
    )
    p.add_argument(
        "--occupy",
        type=int,
        default=100,
        help="tokens decoded into sequence 1 before the 'other cells' restore (default %(default)s)",
    )
    add_flash_attn_flag(
        p,
        choices=("on", "off", "both"),
        default="both",
        help="flash_attn_type of the runs (default %(default)s: one run each)",
    )
    add_cache_and_thread_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-o", "--output", help="write a plot (PNG): max |Δ logit| per case, and their histograms")


def _tokens(model, args) -> np.ndarray:
    toks = np.asarray(model.tokenize(args.prompt))
    if args.n_prompt > 0:
        toks = np.resize(toks, args.n_prompt)  # the prompt repeated, cut to n_prompt
    if toks.size < 2:
        raise ValueError(f"the prompt has {toks.size} token(s): at least 2 are needed (a dump and a next token)")
    return toks


def _row(fa: str, case: str, ref: np.ndarray, got: np.ndarray, cells: str) -> dict:
    d = np.abs(got.astype(np.float64) - ref)
    counts, _ = np.histogram(d, bins=_BINS)
    return {
        "flash_attn": fa,
        "case": case,
        "cells": cells,
        "max_abs_diff": float(d.max()),
        "mean_abs_diff": float(d.mean()),
        "n_differ": int(np.count_nonzero(d)),
        "argmax_ref": int(np.argmax(ref)),
        "argmax_restored": int(np.argmax(got)),
        "argmax_match": bool(np.argmax(ref) == np.argmax(got)),
        "bit_identical": bool(d.max() == 0),
        "abs_diff_hist": counts.tolist(),
    }


def run_one(
    model: Model,
    toks: np.ndarray,
    *,
    flash_attn: str,
    occupy: int,
    type_k: str = "f16",
    type_v: str = "f16",
    n_threads: int | None = None,
) -> list[dict]:
    """The two restores of ``toks[:-1]`` with ``flash_attn`` ("on"/"off"): one row per case.

    The dump is ``llama_state_seq_get_data_ext`` of sequence 0, the restores
    ``llama_state_seq_set_data_ext``; the logits are ``llama_get_logits_ith`` of the last token.

    Args:
        model: The :class:`~pyllamacpp.Model`.
        toks: The prompt's token ids (at least 2).
        flash_attn: ``"on"`` or ``"off"``.
        occupy: Tokens decoded into sequence 1 before the "other cells" restore.
        type_k: The K cache type.
        type_v: The V cache type.
        n_threads: ``n_threads`` and ``n_threads_batch``; None: the physical core count.

    Returns:
        One row per case (``CASES``): ``max_abs_diff``, ``mean_abs_diff``, ``n_differ``, the
        argmax tokens, ``bit_identical``, ``abs_diff_hist``...

    Raises:
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError``...).
        StateError: The sequence's state could not be written or loaded
            (``llama_state_seq_get_data_ext`` / ``llama_state_seq_set_data_ext``).
    """
    n, m = int(toks.size), int(occupy)
    threads = n_threads or default_n_threads()
    kw: dict[str, Any] = {
        "n_ctx": -(-(n + m + 1) // 256) * 256,
        "n_batch": max(512, n, m),
        "n_seq_max": 2,
        "kv_unified": True,
        "flash_attn": flash_attn,
        "type_k": type_k,
        "type_v": type_v,
        "n_threads": threads,
        "n_threads_batch": threads,
    }
    head, last = toks[:-1], toks[-1:]
    filler = np.resize(toks, m) if m else None
    with model.context(**kw) as ctx:
        ctx.prefill(head, 0, 0)
        dump = ctx.seq_state(0)
        ctx.prefill(last, 0, n - 1)
        ref = ctx.logits().astype(np.float64)
        rows = []
        for case in CASES:
            ctx.memory.clear()
            if case == "other cells" and m:
                ctx.prefill(filler, 1, 0)  # cells 0..m-1 taken by sequence 1
            ctx.set_seq_state(0, dump)
            ctx.prefill(last, 0, n - 1)
            start = m if case == "other cells" else 0
            rows.append(_row(flash_attn, case, ref, ctx.logits(), f"{start}..{start + n - 1}"))
    return rows


def run(args: argparse.Namespace) -> dict:
    """:func:`run_one` for each ``-fa`` value asked.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        The settings, ``hist_edges``, ``rows`` (those of :func:`run_one`) and ``ok`` (every
        flash-attention-off row bit-identical).

    Raises:
        ValueError: The prompt has fewer than 2 tokens.
        ModelLoadError: The model cannot be loaded.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError``...).
        StateError: The sequence's state could not be written or loaded
            (``llama_state_seq_get_data_ext`` / ``llama_state_seq_set_data_ext``).
        Interrupted: Ctrl-C; it carries the rows of the ``-fa`` values measured before it.
    """
    from .common import Interrupted, load_model, progress

    with load_model(args) as model:
        toks = _tokens(model, args)
        fas = ["on", "off"] if args.flash_attn == "both" else [args.flash_attn]
        rows: list[dict[str, Any]] = []
        try:
            for fa in progress(fas, "placement"):
                rows += run_one(
                    model,
                    toks,
                    flash_attn=fa,
                    occupy=args.occupy,
                    type_k=args.cache_type_k,
                    type_v=args.cache_type_v,
                    n_threads=args.threads,
                )
        except KeyboardInterrupt:  # Ctrl-C: the -fa values measured so far are still worth printing
            done = len({r["flash_attn"] for r in rows})
            part = _result(model, toks, args, rows) if rows else None
            raise Interrupted(part, done, len(fas), "-fa values") from None
    return _result(model, toks, args, rows)


def _result(model: Model, toks: np.ndarray, args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict:
    out = {
        "model": str(model.path),
        "n_prompt": int(toks.size),
        "n_occupy": int(args.occupy),
        "type_k": args.cache_type_k,
        "type_v": args.cache_type_v,
        "threads": args.threads,
        "hist_edges": _BINS.tolist(),
        "rows": rows,
    }
    out["ok"] = all(r["bit_identical"] for r in rows if r["flash_attn"] == "off")
    return out


def print_report(data: dict) -> None:
    """Print what :func:`run` returned as a table, one row per ``-fa`` value and case.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    print(
        f"model {data['model']}; prompt {data['n_prompt']} tokens (cells 0..{data['n_prompt'] - 2} when dumped, "
        f"the last token decoded after each restore); other cells: after {data['n_occupy']} tokens of "
        f"sequence 1; cache {data['type_k']}/{data['type_v']}, {data['threads']} threads"
    )
    rows = [
        {
            **r,
            "argmax": f"{r['argmax_ref']} -> {r['argmax_restored']}",
            "same": "yes" if r["argmax_match"] else "NO",
            "ident": "bit-identical" if r["bit_identical"] else f"{r['n_differ']} differ",
        }
        for r in data["rows"]
    ]
    print_table(
        rows,
        [
            ("flash_attn", "-fa", ""),
            ("case", "restored at", ""),
            ("cells", "cells*", ""),
            ("max_abs_diff", "max|Δ logit|", ".3g"),
            ("mean_abs_diff", "mean|Δ|", ".3g"),
            ("ident", "logits", ""),
            ("argmax", "argmax", ""),
            ("same", "greedy same", ""),
        ],
    )
    print(
        "* where llama.cpp puts them (each restore and decode fills the first free cells from the cache's head); "
        "not read back"
    )
    if not data["ok"]:
        print("\nflash attention OFF changed logits after a restore: not what the pinned llama.cpp does")


def plot(data: dict, path: str) -> None:
    """Draw max |Δ logit| per case and the histograms of the differences (matplotlib) into ``path``.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (PNG).
    """
    from .common import figure

    rows = data["rows"]
    with figure(path, 1, 2, figsize=(11, 4), dpi=110) as (fig, (a1, a2)):
        labels = [f"-fa {r['flash_attn']}\n{r['case']}" for r in rows]
        vals = [r["max_abs_diff"] for r in rows]
        bars = a1.bar(range(len(rows)), vals, color=["C3" if r["flash_attn"] == "on" else "C0" for r in rows])
        for b, r in zip(bars, rows):
            a1.annotate(
                "0 (bit-identical)" if r["bit_identical"] else f"{r['max_abs_diff']:.3g}",
                (b.get_x() + b.get_width() / 2, b.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        a1.set_xticks(range(len(rows)), labels, fontsize=8)
        a1.set_ylabel("max |Δ logit| vs the original")
        a1.set_title(f"restored sequence, next-token logits ({data['n_prompt']} tokens)")
        edges = np.asarray(data["hist_edges"])
        for r in rows:
            if not r["bit_identical"]:
                a2.stairs(r["abs_diff_hist"][1:], edges[1:], label=f"-fa {r['flash_attn']}, {r['case']}")
        a2.set_xscale("log")
        a2.set_xlabel("|Δ logit|")
        a2.set_ylabel("vocabulary entries")
        a2.set_title("where the differences are (rows with any)")
        if a2.get_legend_handles_labels()[0]:
            a2.legend(fontsize=8)
        else:
            a2.text(0.5, 0.5, "every row bit-identical", ha="center", transform=a2.transAxes)


COMMAND = Command(
    "placement",
    "restore a sequence at the same or other KV cells, -fa on/off: do the logits change?",
    __name__,
    _flags,
    refused=(ValueError,),
)
add_parser, main = COMMAND.add_parser, COMMAND
