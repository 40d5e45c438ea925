"""``pyllamacpp batch-isolation``: do rows of unrelated sequences in one ubatch leak into each other?

Continuous batching rests on this: in a ubatch, only attention reads across rows, and the KQ mask
keeps each sequence to its own cells. K prompts are decoded together in one batch (one sequence id
each, one unified KV stream, so their rows share ubatches) and each alone; per sequence we report
the max |Δ logit| at its last token and whether the greedy tokens agree, for a few -ub values.

The check can fail, and a control shows it: the same prompts put into ONE shared sequence (each
prompt now attends to the ones before it) must give different logits.
"""

from __future__ import annotations

import argparse

import numpy as np

from .common import Command, Interrupted, add_model_flags, cache_kwargs, load_model, progress

DEFAULT_PROMPTS = [
    "The cat sat on the mat.",
    "In 1492, Columbus sailed across the Atlantic Ocean",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Water boils at a temperature of",
]


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    p.add_argument("--ubatch-list", default="512,16,4")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: 4 built-in)")
    p.add_argument("--tolerance", type=float, default=1e-3, help="max |Δ logit| accepted (default %(default)g)")


def _decode_rows(ctx, model, items):
    """items: [(tokens, seq_id, start_pos)]; returns the last-token logits of each item (copies)."""
    from ..batch import Batch

    n = sum(len(t) for t, _, _ in items)
    batch = Batch(n, ctx.n_seq_max, model=model)
    last = []
    for toks, seq, p0 in items:
        sl = batch.add_sequence(toks, seq, p0, logits="last")
        last.append(sl.stop - 1)
    ctx.decode(batch)
    return [ctx.logits(i).copy() for i in last]


def run(args: argparse.Namespace) -> dict:
    """Decode the prompts together and each alone, for each ``-ub``, and compare the logits.

    Each ``-ub`` value gets a context with ``kv_unified=True`` and one sequence per prompt; the
    batch is decoded with ``llama_decode`` and the last token's logits read with
    ``llama_get_logits_ith``.

    Args:
        args: The parsed flags: ``prompt``, ``ubatch_list``, ``tolerance`` and those of
            :func:`~pyllamacpp.experiments.common.add_model_flags`.

    Returns:
        ``model``, ``prompts``, ``tolerance``, ``runs`` (per ``-ub``: ``n_ubatch``, ``n_batch``,
        ``seqs`` with each prompt's ``max_abs_diff`` and greedy tokens, ``isolated``,
        ``control_breaks``) and ``verdict``.

    Raises:
        ModelLoadError: The model cannot be loaded.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError``, ``InvalidBatchError``...).
        Interrupted: Ctrl-C; it carries the ``-ub`` values compared before it.
    """
    prompts = args.prompt or DEFAULT_PROMPTS
    ubs = [int(x) for x in str(args.ubatch_list).split(",") if x]
    with load_model(args) as model:
        toks = [model.tokenize(p) for p in prompts]
        k = len(toks)
        total = sum(len(t) for t in toks)
        out = {"model": str(model.path), "prompts": prompts, "tolerance": args.tolerance, "runs": []}
        try:
            for ub in progress(ubs, "batch-isolation"):
                kw = dict(
                    n_ctx=max(256, 2 * total),
                    n_batch=max(total, ub),
                    n_ubatch=ub,
                    n_seq_max=k,
                    kv_unified=True,
                    **cache_kwargs(args),
                )
                with model.context(**kw) as ctx:
                    together = _decode_rows(ctx, model, [(t, i, 0) for i, t in enumerate(toks)])
                    alone = []
                    for i, t in enumerate(toks):
                        ctx.memory.clear()
                        alone.append(_decode_rows(ctx, model, [(t, i, 0)])[0])
                    # control: all prompts in one shared sequence, one after the other
                    ctx.memory.clear()
                    items, pos = [], 0
                    for t in toks:
                        items.append((t, 0, pos))
                        pos += len(t)
                    shared = _decode_rows(ctx, model, items)
                seqs = []
                for i in range(k):
                    seqs.append(
                        {
                            "seq_id": i,
                            "n_tokens": int(len(toks[i])),
                            "max_abs_diff": float(np.max(np.abs(together[i] - alone[i]))),
                            "greedy_together": int(np.argmax(together[i])),
                            "greedy_alone": int(np.argmax(alone[i])),
                            "control_max_abs_diff": float(np.max(np.abs(shared[i] - alone[i]))),
                        }
                    )
                for s in seqs:
                    s["greedy_agree"] = s["greedy_together"] == s["greedy_alone"]
                isolated = all(s["greedy_agree"] and s["max_abs_diff"] <= args.tolerance for s in seqs)
                # the control must break isolation for every prompt after the first
                control_breaks = all(s["control_max_abs_diff"] > args.tolerance for s in seqs[1:])
                out["runs"].append(
                    {
                        "n_ubatch": ub,
                        "n_batch": kw["n_batch"],
                        "seqs": seqs,
                        "isolated": isolated,
                        "control_breaks": control_breaks,
                    }
                )
        except KeyboardInterrupt:  # Ctrl-C: the -ub values compared so far are still worth printing
            n = len(out["runs"])
            raise Interrupted(_verdict(out) if n else None, n, len(ubs), "-ub values") from None
    return _verdict(out)


def _verdict(out: dict) -> dict:
    out["verdict"] = ("isolated" if all(r["isolated"] for r in out["runs"]) else "LEAK") + (
        "" if all(r["control_breaks"] for r in out["runs"]) else " (control did not break: check is blind)"
    )
    return out


def print_report(data: dict) -> None:
    """Print what :func:`run` returned: a table per ``-ub`` value, then the verdict.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    print(f"model {data['model']}; tolerance {data['tolerance']:g} on max |Δ logit| at each prompt's last token")
    for r in data["runs"]:
        print(
            f"\n-ub {r['n_ubatch']} (-b {r['n_batch']}): {'isolated' if r['isolated'] else 'LEAK'}; "
            f"control (one shared sequence) {'breaks it, as it must' if r['control_breaks'] else 'did NOT break it'}"
        )
        print_table(
            r["seqs"],
            [
                ("seq_id", "seq", "d"),
                ("n_tokens", "tokens", "d"),
                ("max_abs_diff", "max|Δ| together vs alone", ".3g"),
                ("greedy_agree", "greedy agree", ""),
                ("control_max_abs_diff", "max|Δ| shared seq (control)", ".3g"),
            ],
        )
    print(f"\nverdict: {data['verdict']}")


COMMAND = Command("batch-isolation", "do rows of different sequences leak?", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
