"""Two builds of pyllamacpp on the same workload, alternating, in one run: e.g. the release wheel
(portable CPU variants, picked at run time) against the native source build.

    python tools/bench/bench_profiles.py --a /work/venv/bin/python --b /tmp/wheelvenv/bin/python [-r 5]

Each side is a Python interpreter with a pyllamacpp installed; each repeat starts a fresh process
per side, the side that goes first alternating. A process loads the default model, makes a context
(n_ctx 1024, the given threads), then times
  decode   a short prompt, then ``-n`` greedy tokens with ``pyllamacpp.generate`` (tokens/s, from the
           end of the prompt to the last token; one warm-up generation first)
  prefill  512 tokens in one llama_decode (tokens/s, best of 3 after a warm-up)
and prints its profile, loaded CPU variant and greedy tokens (which must match across sides).
Reports medians and b/a ratios. It measures; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time
import numpy as np
from pyllamacpp import Model, generate
from pyllamacpp._lib import build_info
n_predict, threads = int(sys.argv[1]), int(sys.argv[2])
with Model() as m:
    prompt = m.tokenize("The cat sat on the mat.")
    with m.context(n_ctx=1024, n_batch=512, n_threads=threads) as ctx:
        list(generate(ctx, prompt, 16))  # warm-up
    with m.context(n_ctx=1024, n_batch=512, n_threads=threads) as ctx:
        g = generate(ctx, prompt, n_predict)
        toks = [next(g)]  # the prompt's decode ends here
        t0 = time.perf_counter()
        toks += list(g)
        decode = (len(toks) - 1) / (time.perf_counter() - t0)
    best = 0.0
    long = np.random.default_rng(0).integers(100, 20000, size=512).astype(np.int32)
    for i in range(4):
        with m.context(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads) as c:
            t0 = time.perf_counter()
            c.prefill(long)
            dt = time.perf_counter() - t0
        if i:  # the first is a warm-up
            best = max(best, 512 / dt)
info = build_info()
print(json.dumps({"decode_tps": decode, "prefill_tps": best, "tokens": [int(t) for t in toks[:32]],
                  "profile": info.get("profile", "native"), "variant": info.get("cpu_variant_loaded"),
                  "lib_dir": info["lib_dir"]}))
"""


def run(python: str, n_predict: int, threads: int) -> dict:
    proc = subprocess.run(
        [python, "-c", WORKER, str(n_predict), str(threads)], capture_output=True, text=True, cwd="/tmp", timeout=900
    )
    if proc.returncode != 0:
        sys.exit(f"{python} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="python of side a (e.g. the native source build)")
    ap.add_argument("--b", required=True, help="python of side b (e.g. a venv with the release wheel)")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res: dict[str, list[dict]] = {"a": [], "b": []}
    for r in range(args.repeats):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        for side in order:
            out = run(getattr(args, side), args.n_predict, args.threads)
            res[side].append(out)
            print(
                f"repeat {r + 1} {side}: decode {out['decode_tps']:.1f} t/s, prefill {out['prefill_tps']:.1f} t/s",
                flush=True,
            )
    for side in "ab":
        o = res[side][0]
        print(f"{side}: {getattr(args, side)}  profile {o['profile']}, CPU variant {o['variant']}, {o['lib_dir']}")
    same = all(o["tokens"] == res["a"][0]["tokens"] for s in "ab" for o in res[s])
    print(f"greedy tokens identical across all runs of both sides: {same}")
    print(f"{'workload':10} {'a median':>10} {'b median':>10} {'b/a':>6}")
    table = {}
    for key, name in (("decode_tps", "decode"), ("prefill_tps", "prefill")):
        ma = statistics.median(o[key] for o in res["a"])
        mb = statistics.median(o[key] for o in res["b"])
        table[name] = {"a": ma, "b": mb, "ratio": mb / ma}
        print(
            f"{name:10} {ma:10.1f} {mb:10.1f} {mb / ma:6.3f}   "
            f"(tokens/s, {args.repeats} runs each, {args.threads} threads)"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "runs": res, "table": table, "tokens_identical": same},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
