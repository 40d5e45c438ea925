"""Scoring a text against decoding it: what the log-softmax costs on top of the prefill.

    python tools/bench/bench_scoring.py [-n 4096] [-c 4096] [-b 512] [-ub 512] [-t 2] [-r 3] [--json out.json]

One process, one model (the default), one context of ``-c`` cells, the first ``-n`` tokens of the
shipped Shakespeare excerpt (``pyllamacpp.scoring.sample_text()``). Each round runs every side once
on the same context, the order rotated from round to round (A B C D, B C D A, ...):

  decode      the batches ``score`` decodes (``-b`` tokens each, logits at every row but the last
              token's), bare ``ctx.decode`` calls: the prefill that produces the scored rows
  score       ``pyllamacpp.scoring.score(ctx, tokens)``: the same decodes, each batch's rows
              scored in place (C row loop, build_support/score.h, over the context's threads)
  numpy       the same decodes, each batch's rows scored with a float64 numpy log-softmax (what the
              C loop replaces)
  prefill     ``ctx.prefill(tokens)``: the same tokens with logits at the last one only
  split       the decodes and the rows of ``score``, each timed on its own in the same run: the
              rows' share, ``rows s / decodes s``, is what the log-softmax adds to the decode, and
              ``decodes / (decodes + rows)`` the ratio it allows; on a machine shared with other
              work this is steadier than comparing whole runs, whose load differs from run to run.
              The same rows are then scored with numpy too (timed apart; its share likewise)

The table gives each side's median tokens/s and its ratio to ``decode`` (median of the per-round
ratios), by wall time and by the process's CPU time (``time.process_time``: with ``-t 1`` it is
robust to a loaded machine, where wall time is not); the issue's target is
``score / decode >= 0.98``. ``prefill`` shows what producing logits at
every row costs in the decode itself (the output matrix multiplication for those rows). It
measures; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

import pyllamacpp as pl
from pyllamacpp import scoring
from pyllamacpp.batch import Batch
from pyllamacpp.params import default_n_threads


def decode_rows(ctx, tokens: np.ndarray, n_batch: int, rows, decode=None) -> None:
    """The decodes of ``score`` for a text that fits the window; ``rows(ctx, targets)`` after each
    (``decode(batch)`` instead of ``ctx.decode`` when given)."""
    n = tokens.size
    batch = Batch(n_batch, 1, model=ctx.model)
    decode = decode or ctx.decode
    ctx.memory.seq_rm(0)
    for b0 in range(0, n, n_batch):
        chunk = tokens[b0 : b0 + n_batch]
        j = np.arange(b0, b0 + chunk.size)
        mask = j < n - 1
        batch.clear()
        batch.add_sequence(chunk, 0, b0, logits=mask)
        decode(batch)
        if rows is not None:
            rows(ctx, tokens[j[mask] + 1])


class Split:
    """``score``'s loop (the decodes of ``decode_rows``, each batch's rows scored in place with
    ``scoring.log_softmax``), the decodes and the rows timed apart."""

    def __init__(self) -> None:
        self.decode = self.rows = 0.0
        self.runs: list[tuple[float, float]] = []
        self.numpy_runs: list[float] = []

    def __call__(self, ctx, tokens: np.ndarray, n_batch: int) -> None:
        spent = {"decode": 0.0, "rows": 0.0, "numpy": 0.0}
        threads = ctx.params.n_threads_batch

        def decode(batch) -> None:
            t0 = time.perf_counter()
            ctx.decode(batch)
            spent["decode"] += time.perf_counter() - t0

        def rows(ctx, targets) -> None:
            t1 = time.perf_counter()
            scoring.log_softmax(ctx.logits_all(), targets, n_threads=threads)
            t2 = time.perf_counter()
            numpy_rows(ctx, targets)  # the same rows again, as the numpy side scores them
            spent["rows"] += t2 - t1
            spent["numpy"] += time.perf_counter() - t2

        decode_rows(ctx, tokens, n_batch, rows, decode)
        self.runs.append((spent["decode"], spent["rows"]))
        self.numpy_runs.append(spent["numpy"])


def numpy_rows(ctx, targets: np.ndarray) -> None:
    x = ctx.logits_all()
    out = np.empty(len(targets))
    for i in range(0, len(targets), 64):  # blocks of 64 rows: float64 temporaries stay small
        xb = x[i : i + 64].astype(np.float64)
        m = xb.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(xb - m).sum(axis=1))
        out[i : i + 64] = xb[np.arange(len(xb)), targets[i : i + 64]] - lse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--n-tokens", type=int, default=4096, help="tokens of the text to score (4096)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096, help="n_ctx (4096)")
    ap.add_argument("-b", "--batch-size", type=int, default=512, help="n_batch (512, score's default)")
    ap.add_argument("-ub", "--ubatch-size", type=int, default=512, help="n_ubatch (512)")
    ap.add_argument("-t", "--threads", type=int, default=default_n_threads(), help="threads (the physical cores)")
    ap.add_argument("-r", "--rounds", type=int, default=3, help="rounds (each runs every side once)")
    ap.add_argument("--no-numpy", action="store_true", help="leave out the numpy side")
    ap.add_argument("--sides", help="run only these sides, e.g. split (decode is always run: the baseline)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args(argv)

    model = pl.Model()
    tokens = model.tokenize(scoring.sample_text())[: a.n_tokens]
    if tokens.size < a.n_tokens:
        raise SystemExit(f"the sample text has only {tokens.size} tokens")
    kw = dict(n_ctx=a.ctx_size, n_batch=a.batch_size, n_ubatch=a.ubatch_size)
    ctx = model.context(**kw, n_threads=a.threads, n_threads_batch=a.threads)
    n = int(tokens.size)
    split = Split()
    sides = {
        "decode": lambda: decode_rows(ctx, tokens, ctx.n_batch, None),
        "score": lambda: scoring.score(ctx, tokens),
        "numpy": lambda: decode_rows(ctx, tokens, ctx.n_batch, numpy_rows),
        "prefill": lambda: (ctx.memory.seq_rm(0), ctx.prefill(tokens, 0, 0)),
        "split": lambda: split(ctx, tokens, ctx.n_batch),
    }
    if a.no_numpy:
        del sides["numpy"]
    if a.sides:
        sides = {k: sides[k] for k in a.sides.split(",")}
        sides.setdefault("decode", lambda: decode_rows(ctx, tokens, ctx.n_batch, None))
    names = list(sides)
    ref = scoring.score(ctx, tokens)  # warm-up, and the check below
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            sides[name]()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            print(
                f"round {r + 1}/{a.rounds} {name:8s} {times[name][-1]:7.3f} s wall {cpu[name][-1]:7.3f} s cpu",
                file=sys.stderr,
                flush=True,
            )
    again = scoring.score(ctx, tokens)
    rows = []
    for name in names:
        if name == "split":  # its runs score every batch twice (C, then numpy): only its split counts
            continue
        ratios = [d / t for d, t in zip(times["decode"], times[name])]
        cpu_ratios = [d / t for d, t in zip(cpu["decode"], cpu[name])]
        rows.append(
            {
                "side": name,
                "seconds": statistics.median(times[name]),
                "tokens_per_s": n / statistics.median(times[name]),
                "ratio_to_decode": statistics.median(ratios),
                "cpu_seconds": statistics.median(cpu[name]),
                "cpu_ratio_to_decode": statistics.median(cpu_ratios),
                "runs": times[name],
                "cpu_runs": cpu[name],
            }
        )
    out = {
        "model": model.path.name,
        "n_tokens": n,
        "n_ctx": ctx.n_ctx,
        "n_batch": ctx.n_batch,
        "n_ubatch": ctx.n_ubatch,
        "threads": a.threads,
        "rounds": a.rounds,
        "load_average": os.getloadavg()[0],
        "simd": bool(pl.lib.pyl_score_simd()),
        "perplexity": ref.perplexity,
        "same_logprobs_again": bool(np.array_equal(ref.logprobs, again.logprobs)),
        "rows": rows,
    }
    print(
        f"model {out['model']}; {n} tokens, -c {out['n_ctx']} -b {out['n_batch']} -ub {out['n_ubatch']} "
        f"-t {a.threads}; {a.rounds} rounds, order rotated; medians; AVX2 row loop: {out['simd']}; "
        f"load average {out['load_average']:.1f} at the end"
    )
    print(f"{'side':8s} {'wall s':>8s} {'tokens/s':>9s} {'/ decode':>9s} {'cpu s':>8s} {'/ decode':>9s}")
    for row in rows:
        print(
            f"{row['side']:8s} {row['seconds']:8.3f} {row['tokens_per_s']:9.1f} {row['ratio_to_decode']:9.3f} "
            f"{row['cpu_seconds']:8.3f} {row['cpu_ratio_to_decode']:9.3f}"
        )
    shares = [r / d for d, r in split.runs]
    out["split"] = {
        "runs": split.runs,
        "rows_share": statistics.median(shares),
        "allowed_ratio": statistics.median([d / (d + r) for d, r in split.runs]),
    }
    out["split"]["numpy_rows_share"] = statistics.median(r / d for (d, _), r in zip(split.runs, split.numpy_runs))
    print(
        f"split, numpy: the same rows {statistics.median(split.numpy_runs):.3f} s: "
        f"{100 * out['split']['numpy_rows_share']:.2f} % of the decodes"
    )
    print(
        f"split: rows {statistics.median(r for _, r in split.runs):.3f} s against decodes "
        f"{statistics.median(d for d, _ in split.runs):.3f} s in the same runs: the rows add "
        f"{100 * out['split']['rows_share']:.2f} % (ratio {out['split']['allowed_ratio']:.4f}); medians"
    )
    print(f"perplexity of the text {ref.perplexity:.4f}; scored again bit-identical: {out['same_logprobs_again']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
