"""Python vs native llama.cpp on the same workloads, measured in one run.

    python tools/bench/bench_core.py [-r 5] [-t 2] [--json out.json] [-w decode,parallel,...]

Builds ``native_driver.c`` against the headers of the llama.cpp the package was built from and the
very ``libllama`` it loads, then runs each workload as a fresh process per side (the native driver,
and this file with ``--worker``), alternating which side goes first, ``-r`` times. Both sides load
the model, create a context with the same parameters (flash attention left at llama.cpp's default,
"auto"), warm up the same way and time the same span. Prints medians and Python / native ratios
next to the targets of the issue. It measures; it asserts nothing about time.

The driver is also built as a shared library: for decode and state the Python worker runs its loop
(``decode_in_process``, ``state_step``) through ctypes on the worker's own context, alternating with
the Python side ("one process" rows). There both sides use the same weights, KV cache and tensors,
so the ratio is pyllamacpp's cost alone; across processes, where each heap put them moves results
by a few percent (see the raw ``pl.lib`` decode loop, which has none of pyllamacpp's code).

Workloads:
  decode    prompt, then N greedy tokens one llama_decode each: ``pl.generate`` (tokens/s from the
            end of the prompt's decode to the end of generation). A third, diagnostic side runs the
            same loop in raw ``pl.lib`` calls (cost of a Python process + cffi, without pyllamacpp's
            layers); ``--no-raw-cffi`` skips it.
  parallel  examples/batched: 8 sequences share a prompt, 64 tokens each: ``pl.generate_parallel``
            (kv_unified=True; decode-phase tokens/s, the same span)
  prefill   512 tokens in one llama_decode: ``ctx.prefill`` (tokens/s, llama_synchronize included)
  fill      a 2048-token batch: ``Batch.add_sequence`` vs a C loop over llama_batch (µs, no decode)
  state     ``ctx.seq_state`` / ``ctx.set_seq_state`` of a 512-token sequence vs
            llama_state_seq_get_data_ext / set_data_ext (ms)
  text      Python only: ``model.complete(prompt, N, ctx=ctx, stream=True)`` (text pieces) against
            ``pl.generate`` on the same prompt, context and sampler, alternating in one process
            (tokens/s of the decode phase; the row's "native" column is generate). Not in the
            default list: ``-w text``.
  state_fast  Python only, both sides in one process on one context and one reused buffer:
            ``seq_state(0, out=buf)`` and ``set_seq_state(0, st, validate=False,
            keep_on_error=False)`` against ``lib.llama_state_seq_get_data_ext`` / ``set_data_ext``
            called with pointers made once (the C calls themselves), alternating, for a 512-token
            and a 32-token sequence (µs; target <= 1.02x at 512).
  llama_cpp_python  optional, when ``import llama_cpp`` works (never a dependency; a one-line note
            otherwise): state get into a reused buffer through llama-cpp-python's ctypes binding
            on the same context and buffer, and greedy decode with ``Llama.generate`` against
            ``pl.generate``, in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# The pieces, one concept each, each importing only ones named before it: _core_native
# (native_driver.c built, loaded and run; the formulas both sides share), _core_worker (the Python
# side in its own process), _core_python_only (both sides in the worker), _core_report (the table).
from _core_native import (
    BUILD,
    C_PRELUDE,
    HERE,
    REPO,
    build_driver,
    build_shared,
    checksum,
    native_cmd,
    native_lib,
    native_lib_path,
    ptr_addr,
    run_json,
    synthetic_tokens,
)
from _core_python_only import llama_cpp_python_workload, state_fast_workload, text_workload
from _core_report import ROWS, fmt, notes, report, row, summarize, target_met
from _core_worker import (
    DecodeClock,
    _decode_row,
    decode_in_process,
    decode_raw_workload,
    decode_workload,
    fill_workload,
    flash_attn_verdict,
    parallel_workload,
    prefill_workload,
    py_context,
    state_in_process,
    state_workload,
)

# what other benches import from here, and every name this file had before it was split
__all__ = [
    "BUILD",
    "C_PRELUDE",
    "HERE",
    "PROMPT_DECODE",
    "PROMPT_PARALLEL",
    "PYTHON_ONLY",
    "REPO",
    "ROWS",
    "WORKERS",
    "DecodeClock",
    "_decode_row",
    "build_driver",
    "build_shared",
    "checksum",
    "decode_in_process",
    "flash_attn_verdict",
    "fmt",
    "llama_cpp_python_workload",
    "main",
    "native_cmd",
    "native_lib",
    "native_lib_path",
    "notes",
    "ptr_addr",
    "py_context",
    "python_cmd",
    "report",
    "row",
    "run_json",
    "settings",
    "state_fast_workload",
    "state_in_process",
    "summarize",
    "synthetic_tokens",
    "target_met",
    "text_workload",
    "worker",
]

PROMPT_DECODE = "Once upon a time"  # greedy runs 256 tokens from it without an end-of-generation token
PROMPT_PARALLEL = "Hello my name is"  # examples/batched's default prompt
# workloads whose two sides both run in one Python worker (no native process)
PYTHON_ONLY = ("text", "state_fast", "llama_cpp_python")


def settings(threads: int, n_predict: int, n_parallel_predict: int, text_pairs: int = 3) -> dict[str, dict]:
    """Per workload, the keys both sides receive (native: key=value arguments)."""
    common = dict(threads=threads, n_ctx=1024, n_batch=512, n_ubatch=512, n_seq_max=1, kv_unified=0, warmup=1)
    return {
        "decode": {**common, "n_predict": n_predict, "prompt": PROMPT_DECODE},
        "parallel": {
            **common,
            "n_seq_max": 8,
            "kv_unified": 1,
            "n_parallel": 8,
            "n_predict": n_parallel_predict,
            "prompt": PROMPT_PARALLEL,
        },
        "prefill": {**common, "n_tokens": 512, "iters": 2},
        "fill": {**common, "n_tokens": 2048, "iters": 5000},
        "state": {**common, "n_tokens": 512, "iters": 20},
        "text": {**common, "n_predict": n_predict, "prompt": PROMPT_DECODE, "pairs": text_pairs},
        "state_fast": {**common, "n_tokens": 512, "n_short": 32, "pairs": 200},
        "llama_cpp_python": {
            **common,
            "n_tokens": 512,
            "pairs": 100,
            "n_predict": n_predict,
            "prompt": PROMPT_DECODE,
            "decode_pairs": 3,
        },
    }


def python_cmd(model: str, workload: str, s: dict) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        workload,
        "--model",
        model,
        "--settings",
        json.dumps(s),
    ]


# The Python side of each workload (--worker), by the name the native driver takes it under;
# decode_raw is the diagnostic third side of decode, Python only.
WORKERS = {
    "decode": decode_workload,
    "text": text_workload,
    "state_fast": state_fast_workload,
    "llama_cpp_python": llama_cpp_python_workload,
    "decode_raw": decode_raw_workload,
    "parallel": parallel_workload,
    "prefill": prefill_workload,
    "fill": fill_workload,
    "state": state_workload,
}


def worker(workload: str, model_path: str, s: dict) -> dict:
    """One workload's Python side, in this process: its result, as the native driver prints one."""
    if workload not in WORKERS:
        raise SystemExit(f"unknown workload {workload}")
    import pyllamacpp as pl

    return WORKERS[workload](pl.Model(model_path), s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-r", "--repeats", type=int, default=5, help="runs per side and workload (default 5)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-w", "--workloads", default="decode,parallel,prefill,fill,state,state_fast,llama_cpp_python")
    ap.add_argument("-n", "--n-predict", type=int, default=256, help="decode: tokens generated (256)")
    ap.add_argument("--n-parallel-predict", type=int, default=64, help="parallel: tokens per sequence (64)")
    ap.add_argument(
        "--text-pairs", type=int, default=3, help="text: generate / complete runs each per worker, alternating (3)"
    )
    ap.add_argument(
        "--no-raw-cffi",
        dest="raw_cffi",
        action="store_false",
        help="skip the diagnostic third side of decode: the same loop in raw pl.lib calls",
    )
    ap.add_argument("-m", "--model", default=None, help="default: pyllamacpp.default_model_path()")
    ap.add_argument("--json", metavar="PATH", help="also write every raw result and the table here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        print(json.dumps(worker(a.worker, a.model, json.loads(a.settings))), flush=True)
        return 0

    import pyllamacpp as pl

    model = str(a.model or pl.default_model_path())
    exe, build_cmd = build_driver(verbose=True)
    all_settings = settings(a.threads, a.n_predict, a.n_parallel_predict, a.text_pairs)
    info = dict(model=model, threads=a.threads, repeats=a.repeats, settings=all_settings, build_cmd=build_cmd)
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    load_before = os.getloadavg()
    loads: list[float] = []  # 1-min load after each run: another busy process skews both sides
    t_start = time.time()
    runs: dict[str, dict[str, list]] = {w: {"native": [], "python": [], "python_raw": []} for w in workloads}
    for rep in range(a.repeats):
        for w in workloads:
            s = all_settings[w]
            sides = ["native", "python"] if rep % 2 == 0 else ["python", "native"]
            if w in PYTHON_ONLY:  # both of its sides run in the one Python worker
                sides = ["python"]
            if w == "decode" and a.raw_cffi:  # the diagnostic third side, in the rotation
                sides = sides + ["python_raw"] if rep % 3 != 1 else ["python_raw"] + sides
            for side in sides:
                cmd = (
                    native_cmd(exe, model, w, s)
                    if side == "native"
                    else python_cmd(model, w, s)
                    if side == "python"
                    else python_cmd(model, "decode_raw", s)
                )
                res = run_json(cmd)
                runs[w][side].append(res)
                loads.append(os.getloadavg()[0])
                print(
                    f"[rep {rep + 1}/{a.repeats}] {w:8s} {side:6s} "
                    + " ".join(
                        f"{k}={fmt(v) if isinstance(v, float) else v}"
                        for k, v in res.items()
                        if k != "workload" and not isinstance(v, list)
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    info.update(load_before=load_before, load_after=os.getloadavg(), loads=loads)
    report(info, runs, workloads, t_start, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
