"""What graph taps cost, measured in one process, the two sides of each row alternating.

    python tools/bench/bench_taps.py [-r 7] [-t 2] [-n 64] [-p 512] [--rows idle,decode,...] [--json out.json]

Rows (the default model, flash attention off so every site exists; ratios are time with / time
without, so above 1 is slower):
  idle      single-token greedy decode (``pl.generate``) on a context with taps available and
            nothing armed, against one made with ``taps=False`` (no cb_eval at all). Target: the
            first decodes at >= 0.99x the second's speed (time ratio <= 1.01).
  decode    the same decode capturing one site at every layer (``l_out``: 30 nodes per pass),
            against the same context with nothing armed. Target <= 1.10.
  prefill   one 512-token decode with the same capture. Target <= 1.05.
  split     diagnostic: the decode row with ``copy=False`` (the 30 graph splits, no copies), and
            the same at one thread (no thread-pool wake-ups): where the cost comes from.
  patch     a no-op Python patch at one node per pass: µs per call, the median of the calls
            timed inside them (the array, the TapInfo and the function: what ``Patch.seconds``
            adds up), and the decode's time with it minus without (noisier: a difference of two
            ~15 ms spans).
  patch-warm  diagnostic: the same call made 20 times in a row inside each callback, the first
            left out: what it costs with the interpreter's code and data still in the caches,
            against the first call after a stretch of the pass.
Each ratio is the median of the ratios of the pairs (the two sides of one pair run back to back),
with the pairs' quartiles: a machine whose speed drifts moves both sides of a pair alike.
It measures; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _gen(ctx, prompt, n, sampler) -> float:
    import pyllamacpp as pl

    ctx.memory.clear()
    g = pl.generate(ctx, prompt, n, sampler)
    it = iter(g)
    next(it)  # the prompt's decode and the first sample: not in the span
    t0 = time.perf_counter()
    k = 0
    for _ in it:
        k += 1
    return (time.perf_counter() - t0) / max(k, 1)


def _prefill(ctx, tokens) -> float:
    from pyllamacpp import lib

    ctx.memory.clear()
    t0 = time.perf_counter()
    ctx.prefill(tokens)
    lib.llama_synchronize(ctx.ptr)
    return time.perf_counter() - t0


def _pairs(a, b, repeat: int) -> tuple[list[float], list[float]]:
    """Run a() and b() ``repeat`` times each, alternating which goes first."""
    ta, tb = [], []
    for i in range(repeat):
        if i % 2:
            tb.append(b())
            ta.append(a())
        else:
            ta.append(a())
            tb.append(b())
    return ta, tb


ROWS = ("idle", "decode", "prefill", "split", "split@1t", "patch", "patch-warm")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-r", "--repeat", type=int, default=7)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("--rows", default=",".join(ROWS), help="the rows to run, comma-separated (default: all)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    want = args.rows.split(",")
    if not set(want) <= set(ROWS):
        ap.error(f"--rows: one of {', '.join(ROWS)}")

    import pyllamacpp as pl

    model = pl.Model()
    kw = dict(
        n_ctx=2048, n_batch=512, n_ubatch=512, flash_attn="off", n_threads=args.threads, n_threads_batch=args.threads
    )
    plain = model.context(taps=False, **kw)
    tapped = model.context(**kw)
    prompt = model.tokenize("The capital of France is")
    long = np.resize(
        model.tokenize("The cat sat on the mat. The dog lay by the door and watched the rain. "), args.n_prompt
    ).astype(np.int32)
    sampler = pl.Sampler(model).greedy()
    tapped.graph_nodes()  # the listing (probe decodes) once, outside every timed span
    rows = []

    def report(name, unit, with_, without, target=None, extra=""):
        a, b = statistics.median(with_), statistics.median(without)
        pr = sorted(x / y for x, y in zip(with_, without))
        ratio = statistics.median(pr)
        q1, q3 = pr[len(pr) // 4], pr[(3 * len(pr)) // 4]
        rows.append(
            {"row": name, "with": a, "without": b, "ratio": ratio, "q1": q1, "q3": q3, "target": target, "unit": unit}
        )
        tgt = f"  target <= {target}" if target else ""
        scale = 1e3 if unit == "ms" else 1e6
        spread = f"[{q1:.3f}, {q3:.3f}]"
        print(f"{name:<10} {a * scale:10.3f} {b * scale:10.3f} {unit:<3} ratio {ratio:6.3f} {spread}{tgt}{extra}")

    print(f"model {model.path.name}, {args.threads} threads, -r {args.repeat}, flash attention off")
    print(f"{'row':<10} {'with':>10} {'without':>10}")

    def armed(fn, **cap_kw):
        def run():
            with tapped.capture("l_out", **cap_kw):
                return fn()

        return run

    dec = lambda: _gen(tapped, prompt, args.n_predict, sampler)  # noqa: E731
    if "idle" in want:  # taps available, nothing armed, against no callback at all
        a, b = _pairs(dec, lambda: _gen(plain, prompt, args.n_predict, sampler), args.repeat)
        report("idle", "ms", a, b, 1.01, "  (ms per token)")
    if "decode" in want:
        a, b = _pairs(armed(dec), dec, args.repeat)
        report("decode", "ms", a, b, 1.10, "  (ms per token, l_out at 30 layers)")
    if "prefill" in want:
        pre = lambda: _prefill(tapped, long)  # noqa: E731
        a, b = _pairs(armed(pre), pre, args.repeat)
        report("prefill", "ms", a, b, 1.05, f"  (ms per {args.n_prompt}-token decode)")
    if "split" in want:
        a, b = _pairs(armed(dec, copy=False), dec, args.repeat)
        report("split", "ms", a, b, None, "  (copy=False: the splits alone)")
    if "split@1t" in want:
        one = model.context(**{**kw, "n_threads": 1, "n_threads_batch": 1})
        dec1 = lambda: _gen(one, prompt, args.n_predict, sampler)  # noqa: E731

        def armed1():
            with one.capture("l_out", copy=False):
                return dec1()

        a, b = _pairs(armed1, dec1, args.repeat)
        report("split@1t", "ms", a, b, None, "  (copy=False, 1 thread: no thread-pool wake-ups)")
    from pyllamacpp.taps._taps import taps_of

    taps = taps_of(tapped)

    def timing(n_calls: int, first: list, again: list):
        """The context's patch entry point, made to run each call ``n_calls`` times and time them."""

        def on_patch(t, want_, occurrence, pass_index):
            for i in range(n_calls):
                t0 = time.perf_counter()
                ok = type(taps).on_patch(taps, t, want_, occurrence, pass_index)
                (first if i == 0 else again).append(time.perf_counter() - t0)
            return ok

        return on_patch

    noop = lambda x, info: None  # noqa: E731
    if "patch" in want:
        calls: list[float] = []

        def patched():
            taps.on_patch = timing(1, calls, [])  # the trampoline looks the method up on the instance
            try:
                with tapped.patch("l_out", noop, layers=[10]):
                    return dec()
            finally:
                del taps.on_patch

        a, b = _pairs(patched, dec, args.repeat)
        per_call = statistics.median(calls)
        diff = statistics.median([x - y for x, y in zip(a, b)])
        print(
            f"patch      {per_call * 1e6:10.1f} µs per Python call, median of {len(calls)} timed inside them "
            f"(a no-op patch at l_out-10, 1 call per pass; decode time with minus without: {diff * 1e6:.0f} µs)"
        )
        rows.append({"row": "patch", "us_per_call": per_call * 1e6, "us_decode_difference": diff * 1e6})
    if "patch-warm" in want:
        first: list[float] = []
        again: list[float] = []
        taps.on_patch = timing(20, first, again)
        try:
            for _ in range(args.repeat):
                with tapped.patch("l_out", noop, layers=[10]):
                    dec()
        finally:
            del taps.on_patch
        a, b = statistics.median(first), statistics.median(again)
        print(f"patch-warm {a * 1e6:10.1f} µs the first call of a callback, {b * 1e6:.1f} µs the 19 after it (medians)")
        rows.append({"row": "patch-warm", "us_first": a * 1e6, "us_warm": b * 1e6})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
