"""The Scheduler's own Python cost per sequence-step, against a C loop on the same context.

    python tools/bench/bench_scheduler.py [-p 9] [-t 1] [--n-parallel 8] [--n-predict 64] [--json out.json]

Uses ``compare_step_loop`` of ``bench_pertoken.py`` (read its docstring): one tiny synthetic model
(2 llama layers), one process, one context, the C loop ``pertoken_loop`` and the Python side
alternating. Rows:

  scheduler          ``pl.Scheduler(ctx)``: N requests with one prompt and a greedy chain each, all
                     submitted before the first step, run with ``for ev in sched.run()`` (events,
                     text pieces, per-request timing and the prefix cache's bookkeeping included)
  generate_parallel  ``pl.generate_parallel(ctx, prompt, N, n, [a chain per sequence])``, the same
                     run for comparison

Both are timed from the end of the first decode (the prompts') to the end of the loop; Python's own
µs per sequence-step = (Python seconds - C seconds) / tokens sampled. The scheduler decodes the N
prompts as N copies in its first batch (an 8-token prompt is below its ``defer_min_tokens``), the C
loop decodes it once with every seq id: both before the span starts. It measures; it asserts
nothing about time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pertoken import PromptClock, compare_step_loop, finish, keep, run_parallel, step_args, step_context  # noqa: E402


def run_scheduler(ctx: Any, prompt: Any, n_predict: int, samplers: Sequence[Any], clock: PromptClock):
    """The Python side: every request submitted, then the scheduler's loop to the end."""
    import pyllamacpp as pl

    sched = pl.Scheduler(ctx)
    reqs = [sched.submit(prompt, n_predict, s) for s in samplers]
    for _ in sched.run():
        pass
    return clock.elapsed(), [r.tokens for r in reqs]


def _flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--n-parallel", type=int, default=8, help="sequences (8)")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens per sequence (64)")


def main(argv: list[str] | None = None) -> int:
    a = step_args(argv, __doc__, pairs=9, workloads="scheduler,generate_parallel", add=_flags)

    import pyllamacpp as pl

    load_before = os.getloadavg()
    t_start = time.time()
    rows: list[dict] = []
    n = a.n_parallel
    with step_context(a, "sched.gguf", n_ctx=max(1024, n * (a.n_predict + 16)), n_seq_max=n) as (_, ctx, prompt):
        for w in [w.strip() for w in a.workloads.split(",") if w.strip()]:
            run = {"scheduler": run_scheduler, "generate_parallel": run_parallel}.get(w)
            if run is None:
                raise SystemExit(f"unknown workload {w}")
            r = compare_step_loop(
                ctx, run, prompt=prompt, n_seq=n, n_predict=a.n_predict,
                samplers=[pl.Sampler.greedy() for _ in range(n)], pairs=a.pairs, detok=True,
            )  # fmt: skip
            keep(rows, r, w, f"`{w}`, {n} sequences x {a.n_predict}, a chain per sequence (per seq-step)")
    finish(rows, a, argv, load_before, t_start, script="bench_scheduler.py", unit="seq-step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
