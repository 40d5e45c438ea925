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
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import synthetic_tokens  # noqa: E402
from bench_pertoken import (  # noqa: E402
    PromptClock,
    add_model_args,
    compare_step_loop,
    finish,
    run_parallel,
    synthetic_model,
)


def run_scheduler(ctx: Any, prompt: Any, n_predict: int, samplers: Sequence[Any], clock: PromptClock):
    """The Python side: every request submitted, then the scheduler's loop to the end."""
    import pyllamacpp as pl

    sched = pl.Scheduler(ctx)
    reqs = [sched.submit(prompt, n_predict, s) for s in samplers]
    for _ in sched.run():
        pass
    return clock.elapsed(), [r.tokens for r in reqs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-p", "--pairs", type=int, default=9, help="timed runs per side and workload (9)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="decode threads (1)")
    ap.add_argument("--n-parallel", type=int, default=8, help="sequences (8)")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens per sequence (64)")
    add_model_args(ap)
    ap.add_argument("-w", "--workloads", default="scheduler,generate_parallel")
    ap.add_argument("--json", metavar="PATH", help="also write the raw results here")
    a = ap.parse_args(argv)

    import pyllamacpp as pl

    load_before = os.getloadavg()
    t_start = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_model(Path(tmp) / "sched.gguf", a.n_layer, a.n_embd, a.n_vocab)
        with pl.Model(path) as model:
            n = a.n_parallel
            with model.context(
                n_ctx=max(1024, n * (a.n_predict + 16)),
                n_batch=512,
                n_seq_max=n,
                kv_unified=True,
                n_threads=a.threads,
                n_threads_batch=a.threads,
            ) as ctx:
                prompt = synthetic_tokens(8, model.n_vocab)
                for w in [w.strip() for w in a.workloads.split(",") if w.strip()]:
                    run = {"scheduler": run_scheduler, "generate_parallel": run_parallel}.get(w)
                    if run is None:
                        raise SystemExit(f"unknown workload {w}")
                    r = compare_step_loop(
                        ctx, run, prompt=prompt, n_seq=n, n_predict=a.n_predict,
                        samplers=[pl.Sampler.greedy() for _ in range(n)], pairs=a.pairs, detok=True,
                    )  # fmt: skip
                    r["workload"] = w
                    r["label"] = f"`{w}`, {n} sequences x {a.n_predict}, a chain per sequence (per seq-step)"
                    rows.append(r)
                    print(f"{w}: {json.dumps(r)}", file=sys.stderr, flush=True)
    finish(rows, a, argv, load_before, t_start, script="bench_scheduler.py", unit="seq-step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
