"""``pyllamacpp speculative``: speculative decoding against plain generate, over draft length and -ub.

For each -ub of --ubatch-list, a target context with a forward-pass counter (a ``cb_eval`` in C,
``pyllamacpp.speculative.PassCounter``); for each draft length of --draft-list, plain
``generate`` and ``generate_speculative`` on that context, alternating, --repeat runs each
(``compare_speculative``). Per row: tokens/s of both and the speed-up, whether the greedy tokens
are the same, drafted and accepted tokens, the acceptance rate per draft position, forward passes
per verify, tokens per target pass and per verify, and the time in the draft and in the target.

The seed's claim, checked: "verifying a five-token draft under -ub 4 costs two passes". Every
verify batch of every run is counted, and its passes must be ceil(rows / n_ubatch) (rows: the
last token, the draft, tokens replayed after a checkpoint restore); one more verify per -ub
with a fixed five-token draft (six rows) is counted on its own. A pass count that differs fails
the command (exit 1).

Drafts (--draft): ``ngram`` (lookup over the prompt and the text so far), ``layer-skip:K`` (the
target's first K layers, a GGUF written once and cached), ``model:PATH`` (a draft GGUF of the same
vocabulary). Workloads (--workload): ``quote`` (a chat request to repeat a Python module with one
name changed: the answer quotes the prompt), ``free`` (a story), or your own --prompt.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING, Any

from .common import Command, Interrupted, add_model_flags, context_kwargs, load_model, progress

if TYPE_CHECKING:
    from ..model import Model
    from ..speculative import Draft

QUOTE_CODE = '''import json


def load_records(path):
    """Read one JSON record per line and keep the valid ones."""
    records = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                print("skipping a bad line:", line[:40])
    return records


def count_by_key(records, key):
    """How many records have each value of key."""
    counts = {}
    for record in records:
        value = record.get(key)
        counts[value] = counts.get(value, 0) + 1
    return counts


if __name__ == "__main__":
    rows = load_records("events.jsonl")
    print(count_by_key(rows, "kind"))
'''

WORKLOADS = {
    "quote": (
        "<|im_start|>user\nRepeat this Python module exactly, renaming the function load_records to "
        f"read_records. Reply with the code only.\n\n```python\n{QUOTE_CODE}```<|im_end|>\n"
        "<|im_start|>assistant\n```python\n"
    ),
    "free": (
        "<|im_start|>user\nWrite a short story about an old lighthouse keeper who finds a message in a "
        "bottle.<|im_end|>\n<|im_start|>assistant\n"
    ),
}
"""The built-in prompts (ChatML, the default model's template): ``quote`` and ``free``."""


def make_draft(spec: str, model: Model, *, n_ctx: int, threads: int, p_min: float = 0.0) -> Draft:
    """The draft ``spec`` names: ``ngram``, ``layer-skip:K`` or ``model:PATH``.

    Args:
        spec: The --draft value.
        model: The target model (a layer-skip draft is made from its file).
        n_ctx: ``n_ctx`` of a draft model's context.
        threads: Threads of a draft model's context.
        p_min: A draft model stops at a token less likely than this.

    Returns:
        The :class:`~pyllamacpp.speculative.Draft` (the caller closes it).

    Raises:
        ValueError: An unknown spec, or a bad K.
        ModelLoadError: The draft GGUF cannot be loaded.
    """
    from ..speculative import ModelDraft, NgramDraft

    kind, _, arg = spec.partition(":")
    kw: dict[str, Any] = {"n_ctx": n_ctx, "n_threads": threads, "n_threads_batch": threads, "p_min": p_min}
    if kind == "ngram" and not arg:
        return NgramDraft()
    if kind == "layer-skip" and arg.isdigit():
        return ModelDraft.layer_skip(model, int(arg), **kw)
    if kind == "model" and arg:
        return ModelDraft(arg, **kw)
    raise ValueError(f"--draft {spec!r}: use ngram, layer-skip:K or model:PATH")


def _ints(text: str, flag: str) -> list[int]:
    vals = [int(x) for x in str(text).split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag}: a comma-separated list of integers >= 1, got {text!r}")
    return vals


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, ctx=2048)
    p.add_argument("--draft", default="ngram", help="ngram, layer-skip:K or model:PATH")
    p.add_argument("--draft-list", default="2,4,8", help="draft lengths (n_draft) to sweep")
    p.add_argument("--ubatch-list", default="512,4", help="-ub values to sweep (each a context of its own)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="quote", help="the built-in prompt")
    p.add_argument("--prompt", default=None, help="your own prompt instead of --workload (special tokens parsed)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per run")
    p.add_argument("-r", "--repeat", type=int, default=2, help="runs per side and row")
    p.add_argument("--p-min", type=float, default=0.0, help="a draft model stops below this probability")
    p.add_argument("-o", "--output", default=None, help="write a plot (PNG)")


def run(args: argparse.Namespace) -> dict:
    """The sweep: one row per (-ub, draft length), plus the seed's five-token check per -ub.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        ``rows`` (one dict per row: ``n_ubatch``, ``n_draft``, tokens/s, ``speedup``,
        ``same_tokens``, acceptance figures, ``passes_by_rows``, ``passes_check``...),
        ``seed_claim`` (per -ub: rows 6, passes counted and expected), ``ok`` (every pass count
        as expected), the settings.

    Raises:
        ValueError: A bad list or --draft.
        ModelLoadError: A model cannot be loaded.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed.
        Interrupted: Ctrl-C; it carries the rows measured before it.
    """
    from ..speculative import Draft, PassCounter, compare_speculative, generate_speculative

    class _Five(Draft):
        """The prompt's first five tokens, every round (any five tokens will do: the pass count is the point)."""

        def __init__(self, tokens: list[int]) -> None:
            self.t = tokens

        def draft(self, history: list[int], n_max: int) -> list[int]:
            return self.t[:n_max]

    drafts, ubs = _ints(args.draft_list, "--draft-list"), _ints(args.ubatch_list, "--ubatch-list")
    model = load_model(args)
    text = args.prompt if args.prompt is not None else WORKLOADS[args.workload]
    rows: list[dict] = []
    seed: dict[str, dict] = {}
    data: dict[str, Any] = {
        "model": str(model.path),
        "draft": args.draft,
        "workload": "prompt" if args.prompt is not None else args.workload,
        "n_predict": args.n_predict,
        "repeat": args.repeat,
        "threads": args.threads,
        "rows": rows,
        "seed_claim": seed,
    }
    plan = [(ub, nd) for ub in ubs for nd in drafts]
    draft: Draft | None = None
    try:
        toks = model.tokenize(text, parse_special=True)
        data["n_prompt"] = int(toks.size)
        draft = make_draft(args.draft, model, n_ctx=args.ctx_size, threads=args.threads, p_min=args.p_min)
        steps = iter(progress(plan, "speculative"))
        for ub in ubs:
            pc = PassCounter()
            kw = context_kwargs(args, n_ubatch=ub, **pc.context_params())
            with model.context(**kw) as ctx:
                for nd in drafts:
                    next(steps)
                    c = compare_speculative(ctx, toks, args.n_predict, draft, n_draft=nd, repeat=args.repeat, passes=pc)
                    st = c["speculative"]["stats"]
                    bad = {r: p for r, p in st["passes_by_rows"].items() if p != [math.ceil(int(r) / ctx.n_ubatch)]}
                    rows.append(
                        {
                            "n_ubatch": ctx.n_ubatch,
                            "n_draft": nd,
                            "plain_tps": c["plain"]["tokens_per_s"],
                            "spec_tps": c["speculative"]["tokens_per_s"],
                            "speedup": c["speedup"],
                            "same_tokens": c["same_tokens"],
                            "first_difference": c["first_difference"],
                            "n_tokens": c["n_tokens"],
                            **{
                                k: st[k]
                                for k in (
                                    "n_rounds",
                                    "n_drafted",
                                    "n_accepted",
                                    "acceptance_rate",
                                    "acceptance_at",
                                    "passes_per_verify",
                                    "tokens_per_pass",
                                    "tokens_per_round",
                                    "t_draft",
                                    "t_target",
                                    "t_sample",
                                    "t_total",
                                    "passes_by_rows",
                                    "n_restores",
                                )
                            },
                            "passes_check": "ok" if not bad else f"DIFF {bad}",
                        }
                    )
                # the seed's own case: a five-token draft and the last token, six rows
                from .._lib import lib

                ctx.memory.seq_rm(0)
                five = _Five([int(x) % lib.llama_vocab_n_tokens(model._vocab_ptr()) for x in toks[:5]])
                s = generate_speculative(ctx, toks, 6, five, n_draft=5, passes=pc)
                next(s)
                s.close()
                ctx.memory.seq_rm(0)
                seed[str(ctx.n_ubatch)] = {
                    "rows": s.stats.verify_rows[0],
                    "passes": s.stats.verify_passes[0],
                    "expected": math.ceil(s.stats.verify_rows[0] / ctx.n_ubatch),
                }
    except KeyboardInterrupt:  # Ctrl-C: the rows measured so far are still worth printing
        data["ok"] = _ok(data)
        raise Interrupted(data if rows else None, len(rows), len(plan), "rows") from None
    finally:
        if draft is not None:
            draft.close()
        model.close()
    data["ok"] = _ok(data)
    return data


def _ok(data: dict) -> bool:
    return all(r["passes_check"] == "ok" for r in data["rows"]) and all(
        v["passes"] == v["expected"] for v in data["seed_claim"].values()
    )


def print_report(data: dict) -> None:
    """Print the rows as a table, then the seed's check.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    print(
        f"model {os.path.basename(data['model'])}, draft {data['draft']}, workload {data['workload']} "
        f"({data.get('n_prompt', '?')} prompt tokens), {data['n_predict']} tokens per run, "
        f"{data['repeat']} runs per side, -t {data['threads']}"
    )
    rows = []
    for r in data["rows"]:
        acc = r["acceptance_at"] or []
        rows.append(
            {
                **r,
                "acc_at": " ".join(f"{a:.2f}" for a in acc[:8]) or "-",
                "same": "yes" if r["same_tokens"] else f"no@{r['first_difference']}",
            }
        )
    print_table(
        rows,
        [
            ("n_ubatch", "ub", "d"),
            ("n_draft", "draft", "d"),
            ("plain_tps", "plain t/s", ".1f"),
            ("spec_tps", "spec t/s", ".1f"),
            ("speedup", "speed-up", ".2f"),
            ("same", "same", "s"),
            ("n_drafted", "drafted", "d"),
            ("n_accepted", "accepted", "d"),
            ("acceptance_rate", "acc", ".2f"),
            ("acc_at", "acc per position", "s"),
            ("passes_per_verify", "pass/verify", ".2f"),
            ("tokens_per_pass", "tok/pass", ".2f"),
            ("t_draft", "draft s", ".2f"),
            ("t_target", "target s", ".2f"),
            ("passes_check", "passes", "s"),
        ],
    )
    print()
    for ub, v in data["seed_claim"].items():
        verdict = "as claimed" if v["passes"] == v["expected"] else "NOT as expected"
        print(
            f"-ub {ub}: a five-token draft and the last token ({v['rows']} rows) ran as {v['passes']} "
            f"forward pass(es), ceil({v['rows']}/{ub}) = {v['expected']}: {verdict}"
        )


def plot(data: dict, path: str | os.PathLike) -> None:
    """Speed-up against draft length per -ub, and acceptance per draft position (matplotlib).

    Args:
        data: What :func:`run` returned.
        path: The image file to write (its suffix picks the format).
    """
    from .common import figure

    with figure(path, 1, 2, figsize=(10, 4), dpi=None) as (fig, (a, b)):
        for ub in sorted({r["n_ubatch"] for r in data["rows"]}):
            rs = [r for r in data["rows"] if r["n_ubatch"] == ub]
            a.plot([r["n_draft"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"-ub {ub}")
        a.axhline(1.0, color="grey", lw=0.8)
        a.set_xlabel("draft length")
        a.set_ylabel("speed-up over generate")
        a.set_title("tokens/s, speculative / plain")
        a.legend()
        best = max(data["rows"], key=lambda r: len(r["acceptance_at"] or []), default=None)
        if best is not None and best["acceptance_at"]:
            acc = best["acceptance_at"]
            b.bar(range(1, len(acc) + 1), acc)
            b.set_title(f"acceptance per position (-ub {best['n_ubatch']}, draft {best['n_draft']})")
        b.set_xlabel("draft position")
        b.set_ylabel("accepted / drafted")
        b.set_ylim(0, 1)
        fig.suptitle(f"{os.path.basename(data['model'])}  draft {data['draft']}  workload {data['workload']}")


COMMAND = Command(
    "speculative",
    "speculative decoding against plain generate: acceptance, passes per verify, speed-up",
    __name__,
    _flags,
)
add_parser, main = COMMAND.add_parser, COMMAND
