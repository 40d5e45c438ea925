"""Decode and prefill tokens/s: the default model local against split over loopback RPC.

Starts two ``pyllamacpp rpc-server`` processes on free loopback ports, then alternates runs of the
local model and of the model with ``-ngl`` layers on the two servers, and prints medians and the
ratio (split / local). Everything runs on this machine: the servers share its cores.

Then the cost of the liveness check a model or context on RPC servers makes on each use (one
``poll()`` of ggml's connections, see pyllamacpp.rpc): the time of one check, how many checks one
greedy decode step and one prefill make, and that cost as a share of the step's time, measured on
the split model in the same run. ``--check-only`` skips the table.

    python tools/bench/bench_rpc.py [-r 5] [-ngl 30] [-t 2] [-p 512] [-n 64] [--check-only]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import timeit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int, threads: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-m", "pyllamacpp.cli", "rpc-server", "--port", str(port), "-t", str(threads)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tempfile.gettempdir(),
    )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return p
        except OSError:
            time.sleep(0.1)
    raise SystemExit("rpc-server did not start")


def measure(model, n_prompt: int, n_gen: int, threads: int) -> tuple[float, float]:
    """One prefill of n_prompt tokens and n_gen greedy decode steps (ubatch-sweep's measurement)."""
    from pyllamacpp.experiments.sweep import measure as sweep_measure

    r = sweep_measure(
        model,
        n_ctx=n_prompt + n_gen + 16,
        n_batch=n_prompt,
        n_ubatch=n_prompt,
        n_prompt=n_prompt,
        n_gen=n_gen,
        repeat=1,
        ctx_kwargs=dict(n_threads=threads, n_threads_batch=threads),
    )
    return r["prefill_tps"], r["decode_tps"]


def check_cost(model, n_prompt: int, n_gen: int, threads: int, repeat: int) -> None:
    """The liveness check's share of a decode step and of a prefill on the split model."""
    import numpy as np

    import pyllamacpp as pl

    ctx = model.context(
        n_ctx=n_prompt + n_gen + 16, n_batch=n_prompt, n_ubatch=n_prompt, n_threads=threads, n_threads_batch=threads
    )
    links = [ctx._h.rpc, model._h.rpc]
    count = [0]

    def counting(check):
        def wrapper():
            count[0] += 1
            check()

        return wrapper

    n = 200_000
    check_us = min(timeit.repeat(links[0].check, number=n, repeat=5)) / n * 1e6
    prompt = np.resize(model.tokenize("The cat sat on the mat."), n_prompt)
    steps, prefills = [], []
    for _ in range(repeat):
        ctx.memory.clear()
        for link in links:
            link.check = counting(type(link).check.__get__(link))
        count[0] = 0
        t0 = time.perf_counter()
        ctx.prefill(prompt)
        prefills.append((time.perf_counter() - t0, count[0]))
        count[0] = 0
        t0 = time.perf_counter()
        out = list(pl.generate(ctx, [int(prompt[-1])], n_gen, seq_id=0))
        steps.append(((time.perf_counter() - t0) / len(out), count[0] / len(out)))
        for link in links:
            del link.check
    ctx.close()
    step_s = statistics.median(s for s, _ in steps)
    per_step = statistics.median(c for _, c in steps)
    prefill_s = statistics.median(s for s, _ in prefills)
    per_prefill = statistics.median(c for _, c in prefills)
    print(
        f"\nliveness check (Link.check, one poll() of {len(links[0]._conns)} connections): {check_us:.2f} us, "
        f"best of 5 x {n}"
    )
    print("| | time | checks | checks' share |\n|---|---:|---:|---:|")
    print(
        f"| greedy decode step (pl.generate) | {step_s * 1e3:.2f} ms | {per_step:.1f} | "
        f"{check_us * per_step / (step_s * 1e6):.4%} |"
    )
    print(
        f"| prefill {n_prompt} tokens | {prefill_s * 1e3:.1f} ms | {per_prefill:.0f} | "
        f"{check_us * per_prefill / (prefill_s * 1e6):.4%} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-r", "--repeat", type=int, default=5)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=30)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--check-only", action="store_true", help="only the liveness check's cost")
    args = ap.parse_args()
    import pyllamacpp as pl

    ports = [free_port(), free_port()]
    servers = [start(p, args.threads) for p in ports]
    local = split = None
    try:
        split = pl.Model(rpc=[f"127.0.0.1:{p}" for p in ports], n_gpu_layers=args.n_gpu_layers)
        if args.check_only:
            check_cost(split, args.n_prompt, args.n_gen, args.threads, args.repeat)
            return
        local = pl.Model()
        res = {"local": [], "split": []}
        for i in range(args.repeat):
            for name, m in (("local", local), ("split", split)) if i % 2 == 0 else (("split", split), ("local", local)):
                res[name].append(measure(m, args.n_prompt, args.n_gen, args.threads))
        med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in res.items()}
        print(
            f"default model, -t {args.threads}, -ngl {args.n_gpu_layers} on 2 loopback rpc-servers, "
            f"{args.repeat} alternating runs, medians"
        )
        print("| | local | split over RPC | split / local |\n|---|---:|---:|---:|")
        for i, what in enumerate((f"prefill {args.n_prompt} tok/s", f"decode {args.n_gen} tok/s")):
            print(
                f"| {what} | {med['local'][i]:.1f} | {med['split'][i]:.1f} | {med['split'][i] / med['local'][i]:.3f} |"
            )
        check_cost(split, args.n_prompt, args.n_gen, args.threads, args.repeat)
    finally:
        # models first: freeing a split model talks to its servers (one that is gone: left unfreed)
        for m in (split, local):
            if m is not None:
                m.close()
        for s in servers:
            s.kill()


if __name__ == "__main__":
    main()
