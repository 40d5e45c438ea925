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
import ctypes
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD = HERE / "build"

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


def synthetic_tokens(n: int, n_vocab: int):
    """The same formula as native_driver.c's synth(): ordinary tokens, no specials."""
    import numpy as np

    return ((1000 + 37 * np.arange(n, dtype=np.int64)) % n_vocab).astype(np.int32)


def checksum(tokens) -> int:
    """FNV-1a over the token ids, as native_driver.c's checksum()."""
    h = 2166136261
    for t in tokens:
        h = ((h ^ (int(t) & 0xFFFFFFFF)) * 16777619) & 0xFFFFFFFF
    return h


# -- the native driver -------------------------------------------------------------------------
def build_driver(verbose: bool = False) -> tuple[Path, list[str]]:
    """Compile native_driver.c with the system C compiler against the package's own llama.cpp."""
    import pyllamacpp as pl

    info = pl.build_info()
    source = info["llama_cpp_source"]
    if source.startswith("LLAMA_CPP_DIR="):
        llama_dir = Path(source.split("=", 1)[1])
    elif source.startswith("pinned sdist"):
        llama_dir = REPO / "vendor" / "llama.cpp"
    else:
        raise SystemExit(f"bench: cannot tell where llama.cpp came from: {source!r}")
    header = llama_dir / "include" / "llama.h"
    digest = hashlib.sha256(header.read_bytes()).hexdigest()
    if digest != info["llama_h_sha256"]:  # the driver must see the header the package was built from
        raise SystemExit(
            f"bench: {header} (sha256 {digest[:12]}) is not the llama.h of this build ({info['llama_h_sha256'][:12]})"
        )
    lib_dir = info["lib_dir"]
    BUILD.mkdir(exist_ok=True)
    exe = BUILD / "native_driver"
    cmd = [
        os.environ.get("CC", "cc"),
        "-O2",
        "-std=c11",
        "-D_POSIX_C_SOURCE=200809L",
        "-Wall",
        "-Wextra",
        f"-I{llama_dir / 'include'}",
        f"-I{llama_dir / 'ggml' / 'include'}",
        str(HERE / "native_driver.c"),
        "-o",
        str(exe),
        f"-L{lib_dir}",
        "-lllama",
        "-lggml",
        "-lggml-base",
        f"-Wl,-rpath,{lib_dir}",
    ]
    if verbose:
        print("$", shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    # the same file as a shared library: its state_step() runs in the Python worker's process
    link = cmd[-5:]  # -L, -l..., rpath
    assert cmd[-7] == "-o" and link[0].startswith("-L")
    subprocess.run([*cmd[:-7], "-shared", "-fPIC", "-o", str(native_lib_path()), *link], check=True)
    return exe, cmd


def native_lib_path() -> Path:
    return BUILD / "native_driver.so"


# What the benches' own C loops (build_shared) start with: llama.h and a clock in seconds.
C_PRELUDE = r"""
#include "llama.h"
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static double now_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}
"""


def build_shared(name: str, source: str, verbose: bool = False) -> ctypes.CDLL:
    """C ``source``, after ``C_PRELUDE``, written to ``build/<name>.c`` and compiled into
    ``build/<name>.so`` with the command of :func:`build_driver` (which first checks that the
    headers are the package's own), loaded as a ``ctypes.CDLL``: a bench's own loop in C, its
    functions declared by the caller."""
    _, cmd = build_driver(verbose=verbose)
    assert cmd[-7] == "-o" and cmd[-8].endswith("native_driver.c"), cmd
    src, so = BUILD / f"{name}.c", BUILD / f"{name}.so"
    src.write_text(C_PRELUDE + source)
    subprocess.run([*cmd[:-8], str(src), "-shared", "-fPIC", "-o", str(so), *cmd[-5:]], check=True)
    return ctypes.CDLL(str(so))


def ptr_addr(p) -> int:
    """A cffi pointer (``ctx.ptr``, ``sampler.ptr``) as an address, for a ctypes ``c_void_p``."""
    import pyllamacpp as pl

    return int(pl.ffi.cast("uintptr_t", p))


def run_json(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: {shlex.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def native_cmd(exe: Path, model: str, workload: str, s: dict) -> list[str]:
    return [str(exe), model, workload, *(f"{k}={v}" for k, v in s.items())]


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


# -- the Python side (runs in its own process, like the native driver) -------------------------
class DecodeClock:
    """Wraps ``ctx.decode`` to note when each decode returned and how many tokens it had.

    ctx.prefill and generate_parallel call ``ctx.decode`` (generate's steps are one C call each
    and do not), so the decode phase can be timed from the end of the prompt's decode, as the
    native driver does. Cost: one Python call per decode (well under a microsecond, against
    milliseconds of decode)."""

    def __init__(self, ctx):
        self.calls: list[tuple[float, int]] = []
        orig, calls, clock = ctx.decode, self.calls, time.perf_counter

        def decode(batch):
            orig(batch)
            calls.append((clock(), batch.n_tokens))

        ctx.decode = decode


def flash_attn_verdict(ctx) -> str:
    for _, line in ctx.creation_log:
        if "Flash Attention" in line:
            return "enabled" if "enabled" in line else "disabled" if "disabled" in line else line
    return "unknown"


def py_context(model, s: dict, n_seq_max: int | None = None):
    return model.context(
        n_ctx=s["n_ctx"],
        n_batch=s["n_batch"],
        n_ubatch=s["n_ubatch"],
        n_seq_max=n_seq_max or s["n_seq_max"],
        kv_unified=bool(s["kv_unified"]),
        n_threads=s["threads"],
        n_threads_batch=s["threads"],
    )


def native_lib():
    """native_driver.c built as a shared library (build_driver), its two exported loops declared,
    and a converter of cffi pointers (pl.ffi) to ctypes ones."""
    import ctypes

    c = ctypes
    so = c.CDLL(str(native_lib_path()))
    so.decode_in_process.restype = c.c_double
    so.decode_in_process.argtypes = [
        c.c_void_p,
        c.c_void_p,
        c.POINTER(c.c_int32),
        c.c_int,
        c.c_int,
        c.POINTER(c.c_int),
        c.POINTER(c.c_uint32),
    ]
    so.state_step.restype = c.c_int
    so.state_step.argtypes = [c.c_void_p, c.POINTER(c.c_double), c.POINTER(c.c_double), c.POINTER(c.c_uint)]
    return so, lambda p: c.c_void_p(ptr_addr(p))


def decode_in_process(ctx, tokens, sampler, clock: DecodeClock, s: dict, pairs: int = 2) -> dict:
    """The decode workload of both sides in this one process, on this one context and sampler:
    native_driver.c's ``decode_in_process`` (its run_decode, timed in C) through ctypes, and
    ``pl.generate`` timed as the worker times it, ``pairs`` times each, alternating which goes
    first. Both then decode with the same weights, KV cache and threads, so what differs between
    them is pyllamacpp's code alone (in two processes, where the model and cache land differs too)."""
    import ctypes

    import pyllamacpp as pl

    so, addr = native_lib()
    prompt = (ctypes.c_int32 * tokens.size)(*tokens.tolist())
    n_dec, sums = ctypes.c_int(), ctypes.c_uint32()
    nat, py, checks = [], [], set()
    for k in range(2 * pairs):
        ctx.memory.clear()
        sampler.reset()
        if (k % 2 == 0) == (k % 4 < 2):  # C, py, py, C, C, py ...
            t = so.decode_in_process(
                addr(ctx.ptr),
                addr(sampler.ptr),
                prompt,
                tokens.size,
                s["n_predict"],
                ctypes.byref(n_dec),
                ctypes.byref(sums),
            )
            nat.append(n_dec.value / t)
            checks.add(sums.value)
        else:
            out = list(pl.generate(ctx, tokens, s["n_predict"], sampler))
            t = time.perf_counter() - clock.calls[-1][0]
            py.append((len(out) - 1) / t)  # every token but the last is decoded
            checks.add(checksum(out))
    return {
        "inproc_native_tok_s": statistics.median(nat),
        "inproc_tok_s": statistics.median(py),
        "inproc_same_tokens": len(checks) == 1,
    }


def state_in_process(ctx, s: dict) -> dict:
    """The state round trip of both sides in this one process, on this one context: native_driver.c's
    ``state_step`` (its timed get + set, into a fresh ``malloc`` buffer, freed after) through ctypes,
    and ``seq_state`` + ``set_seq_state`` with their defaults, alternating which goes first.

    Why: llama.cpp's copy runs faster or slower with where the dump sits relative to the KV tensors
    it copies from (its page offset moved get by ~18% here), and where those tensors sit depends on
    the heap of the process that made the context; in two processes the sides copy from different
    places. Here both copy from the same tensors. The C side's timing is C's own (CLOCK_MONOTONIC
    inside the call), so ctypes' call costs nothing to it."""
    import ctypes

    so, addr = native_lib()
    cptr = addr(ctx.ptr)
    t_get, t_set, off = ctypes.c_double(), ctypes.c_double(), ctypes.c_uint()
    clock = time.perf_counter
    ng, ns, pg, ps, offs = [], [], [], [], set()
    for it in range(-s["warmup"], 3 * s["iters"]):
        for side in ("c", "py") if it % 2 == 0 else ("py", "c"):
            if side == "c":
                if so.state_step(cptr, ctypes.byref(t_get), ctypes.byref(t_set), ctypes.byref(off)) != 0:
                    raise SystemExit("native state_step failed")
                g, t = t_get.value, t_set.value
                offs.add(off.value)
            else:
                t0 = clock()
                st = ctx.seq_state(0)
                t1 = clock()
                ctx.set_seq_state(0, st)
                g, t = t1 - t0, clock() - t1
                del st
            if it >= 0:
                (ng if side == "c" else pg).append(g), (ns if side == "c" else ps).append(t)
    ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
    trip = lambda a, b: statistics.median([x + y for x, y in zip(a, b)]) * 1e3  # noqa: E731
    return {
        "inproc_native_get_ms": ms(ng),
        "inproc_native_set_ms": ms(ns),
        "inproc_native_roundtrip_ms": trip(ng, ns),
        "inproc_get_ms": ms(pg),
        "inproc_set_ms": ms(ps),
        "inproc_roundtrip_ms": trip(pg, ps),
        "inproc_native_page_offsets": sorted(offs),
    }


def text_workload(model, s: dict) -> dict:
    """``model.complete(..., stream=True)`` against ``pl.generate``: one context, one sampler,
    ``pairs`` runs each, alternating which goes first (g c, c g, g c ...). Each is timed from the
    end of its prompt's decode (DecodeClock) to its last token; both decode every token but the
    last, so tokens/s = (tokens - 1) / time."""
    import pyllamacpp as pl

    ctx = py_context(model, s)
    tokens = model.tokenize(s["prompt"])
    sampler = pl.Sampler.greedy()
    if s["warmup"]:
        "".join(model.complete(s["prompt"], 16, ctx=ctx, sampler=sampler, stream=True))
        ctx.memory.clear()
        sampler.reset()
    clock = DecodeClock(ctx)
    rates: dict[str, list[float]] = {"generate": [], "complete": []}
    texts = set()
    for k in range(2 * s["pairs"]):
        ctx.memory.clear()
        sampler.reset()
        side = "generate" if (k % 2 == 0) == (k % 4 < 2) else "complete"  # g, c, c, g, g, c ...
        if side == "generate":
            out = list(pl.generate(ctx, tokens, s["n_predict"], sampler))
            t = time.perf_counter() - clock.calls[-1][0]
            texts.add(model.detokenize([x for x in out if not model.is_eog(x)]))
        else:
            stream = model.complete(s["prompt"], s["n_predict"], ctx=ctx, sampler=sampler, stream=True)
            text = "".join(stream)  # what a user streaming text does, less the printing
            t = time.perf_counter() - clock.calls[-1][0]
            out = stream.tokens
            texts.add(text)
        rates[side].append((len(out) - 1) / t)
    ratios = [c / g for g, c in zip(rates["generate"], rates["complete"])]
    return {
        "workload": "text",
        "flash_attn": flash_attn_verdict(ctx),
        "n_prompt": int(tokens.size),
        "n_decoded": len(out) - 1,
        "generate_tok_s": statistics.median(rates["generate"]),
        "complete_tok_s": statistics.median(rates["complete"]),
        "ratio": statistics.median(ratios),
        "same_text": len(texts) == 1,
    }


def state_fast_workload(model, s: dict) -> dict:
    """The state fast path against the plain C calls, in this one process, on one context and one
    reused buffer: ``ctx.seq_state(0, out=buf)`` then ``ctx.set_seq_state(0, st, validate=False,
    keep_on_error=False)``, against ``lib.llama_state_seq_get_data_ext`` /
    ``lib.llama_state_seq_set_data_ext`` called with a context pointer and a buffer pointer made
    once (the C calls themselves, through cffi). ``pairs`` steps of each side, alternating which
    goes first (c p, p c, ...), for an ``n_tokens``-token sequence and an ``n_short``-token one.
    Same tensors, same destination, same page offset: what differs is pyllamacpp's Python alone."""
    import numpy as np

    import pyllamacpp as pl

    lib, ffi = pl.lib, pl.ffi
    ctx = py_context(model, s)
    out: dict = {"workload": "state_fast", "flash_attn": flash_attn_verdict(ctx), "pairs": s["pairs"]}
    get, put, clock = lib.llama_state_seq_get_data_ext, lib.llama_state_seq_set_data_ext, time.perf_counter
    for key, n_tok in (("", s["n_tokens"]), ("short_", s["n_short"])):
        ctx.memory.clear()
        ctx.prefill(synthetic_tokens(n_tok, model.n_vocab))
        cptr = ctx.ptr
        size = lib.llama_state_seq_get_size_ext(cptr, 0, 0)
        buf = np.empty(size, dtype=np.uint8)
        p = ffi.from_buffer(buf)
        sb = pl.StateBuffer(buf)  # the same memory, its pointer made once
        t: dict[str, list[float]] = {f"{side}_{op}": [] for side in ("c", "py", "sb") for op in ("get", "set")}
        for it in range(-20, s["pairs"]):
            for side in ("c", "py", "sb") if it % 2 == 0 else ("sb", "py", "c"):
                if side == "c":
                    t0 = clock()
                    n = get(cptr, p, size, 0, 0)
                    t1 = clock()
                    m = put(cptr, p, size, 0, 0)
                    t2 = clock()
                else:  # pyllamacpp into the numpy array (py) or the StateBuffer over it (sb)
                    dest = sb if side == "sb" else buf
                    t0 = clock()
                    st = ctx.seq_state(0, out=dest)
                    t1 = clock()
                    m = ctx.set_seq_state(0, st, validate=False, keep_on_error=False)
                    t2 = clock()
                    n = len(st)
                if n != size or m != size:
                    raise SystemExit(f"state_fast: {side} moved {n} / {m} bytes of {size}")
                if it >= 0:
                    t[f"{side}_get"].append(t1 - t0), t[f"{side}_set"].append(t2 - t1)
        med = statistics.median
        out[f"{key}n_tokens"], out[f"{key}state_bytes"] = n_tok, size
        for op in ("get", "set"):
            c, py = t[f"c_{op}"], t[f"py_{op}"]
            out[f"{key}c_{op}_us"], out[f"{key}py_{op}_us"] = med(c) * 1e6, med(py) * 1e6
            out[f"{key}{op}_ratio"] = med(b / a for a, b in zip(c, py))  # the steps' pairs
            sbt = t[f"sb_{op}"]
            out[f"{key}sb_{op}_us"], out[f"{key}sb_{op}_ratio"] = med(sbt) * 1e6, med(b / a for a, b in zip(c, sbt))
    return out


def llama_cpp_python_workload(model, s: dict) -> dict:
    """pyllamacpp against llama-cpp-python (``llama_cpp``, when importable; never a dependency),
    in this one process on the same libllama when llama_cpp loads it (``LLAMA_CPP_LIB_PATH``):

    - state get into a reused buffer: ``ctx.seq_state(0, out=buf)`` against llama_cpp's ctypes
      ``llama_state_seq_get_data_ext`` on the same context and buffer (what a llama-cpp-python user
      calls; its ``Llama.save_state`` copies the whole context into a fresh buffer instead);
    - decode: ``pl.generate`` (greedy) against ``llama_cpp.Llama.generate`` (temp 0: greedy) on
      contexts of the same parameters, tokens/s from the first generated token to the last.
    Alternating, ``pairs`` steps (state) and ``decode_pairs`` runs each (decode).

    To run it without building llama-cpp-python's own llama.cpp: its sdist's ``llama_cpp`` package
    on ``PYTHONPATH`` (with ``diskcache``), ``LLAMA_CPP_LIB_PATH`` = ``pl.build_info()["lib_dir"]``
    (docs/explain/benchmarks.md)."""
    import ctypes

    import numpy as np

    import pyllamacpp as pl

    try:
        import llama_cpp
    except ImportError:
        return {"workload": "llama_cpp_python", "absent": True}
    pl._log.install()  # llama_cpp set its own log callback at import: ours again, for both sides
    ctx = py_context(model, s)
    out: dict = {
        "workload": "llama_cpp_python",
        "version": getattr(llama_cpp, "__version__", "?"),
        "lib": getattr(getattr(llama_cpp.llama_cpp, "_lib", None), "_name", "?"),  # which libllama it loaded
    }
    ctx.prefill(synthetic_tokens(s["n_tokens"], model.n_vocab))
    size = pl.lib.llama_state_seq_get_size_ext(ctx.ptr, 0, 0)
    buf = np.empty(size, dtype=np.uint8)
    cctx = ctypes.c_void_p(int(pl.ffi.cast("uintptr_t", ctx.ptr)))
    cbuf = (ctypes.c_uint8 * size).from_buffer(buf)
    lget, clock = llama_cpp.llama_state_seq_get_data_ext, time.perf_counter
    tl, tp = [], []
    for it in range(-20, s["pairs"]):
        for side in ("l", "p") if it % 2 == 0 else ("p", "l"):
            t0 = clock()
            n = lget(cctx, cbuf, size, 0, 0) if side == "l" else len(ctx.seq_state(0, out=buf))
            t1 = clock()
            if n != size:
                raise SystemExit(f"llama_cpp_python: {side} wrote {n} of {size} bytes")
            if it >= 0:
                (tl if side == "l" else tp).append(t1 - t0)
    out["flash_attn"] = flash_attn_verdict(ctx)
    out["lcp_get_us"], out["py_get_us"] = statistics.median(tl) * 1e6, statistics.median(tp) * 1e6
    out["get_ratio"] = statistics.median(b / a for a, b in zip(tl, tp))
    del cbuf  # the ctypes array holds buf's buffer
    ctx.close()

    # decode: each side on its own context of the same parameters
    tokens = model.tokenize(s["prompt"])
    ctx = py_context(model, s)
    sampler = pl.Sampler.greedy()
    clock_py = DecodeClock(ctx)
    llm = llama_cpp.Llama(
        model_path=str(model.path),
        n_ctx=s["n_ctx"],
        n_batch=s["n_batch"],
        n_ubatch=s["n_ubatch"],
        n_threads=s["threads"],
        n_threads_batch=s["threads"],
        flash_attn=flash_attn_verdict(ctx) == "enabled",  # ours resolved "auto"; Llama takes a bool
        verbose=False,
    )
    pl._log.install()  # Llama() may set llama_cpp's log callback again

    def run_lcp(n_predict: int) -> tuple[float, list[int]]:
        llm.reset()
        got: list[int] = []
        t0 = 0.0
        for tok in llm.generate(tokens.tolist(), temp=0.0, top_k=1, reset=True):
            if not got:
                t0 = clock()  # the prompt is decoded and the first token sampled
            got.append(int(tok))
            if len(got) >= n_predict or tok == llm.token_eos():
                break
        return clock() - t0, got

    def run_py(n_predict: int) -> tuple[float, list[int]]:
        ctx.memory.clear()
        sampler.reset()
        got = [int(x) for x in pl.generate(ctx, tokens, n_predict, sampler)]
        return clock() - clock_py.calls[-1][0], got

    run_lcp(16), run_py(16)  # warm-up
    rates: dict[str, list[float]] = {"lcp": [], "py": []}
    same = set()
    for k in range(2 * s["decode_pairs"]):
        side = "py" if (k % 2 == 0) == (k % 4 < 2) else "lcp"  # py, lcp, lcp, py, py ...
        tt, got = run_py(s["n_predict"]) if side == "py" else run_lcp(s["n_predict"])
        rates[side].append((len(got) - 1) / tt)  # tokens after the first, over the time after it
        same.add(tuple(got))
    out["lcp_tok_s"], out["py_tok_s"] = statistics.median(rates["lcp"]), statistics.median(rates["py"])
    out["decode_ratio"] = statistics.median(p / q for p, q in zip(rates["py"], rates["lcp"]))
    out["same_tokens"] = len(same) == 1
    return out


def _decode_row(workload: str, ctx, n_prompt: int, n_dec: int, t: float, check: int) -> dict:
    """A decode workload's result, as the native driver prints it: tokens decoded over the time."""
    return {
        "workload": workload,
        "flash_attn": flash_attn_verdict(ctx),
        "n_prompt": n_prompt,
        "n_decoded": n_dec,
        "t_s": t,
        "tok_s": n_dec / t,
        "checksum": check,
    }


def worker(workload: str, model_path: str, s: dict) -> dict:
    import numpy as np

    import pyllamacpp as pl

    model = pl.Model(model_path)
    if workload == "decode":
        ctx = py_context(model, s)
        tokens = model.tokenize(s["prompt"])
        sampler = pl.Sampler.greedy()
        if s["warmup"]:
            list(pl.generate(ctx, tokens, 16, sampler))
            ctx.memory.clear()
            sampler.reset()
        clock = DecodeClock(ctx)  # generate's prefill goes through ctx.decode; its steps do not
        out = list(pl.generate(ctx, tokens, s["n_predict"], sampler))  # what a user writes
        t = time.perf_counter() - clock.calls[-1][0]
        n_dec = len(out) - 1  # every token but the last is decoded (generate's convention)
        inproc = decode_in_process(ctx, tokens, sampler, clock, s) if native_lib_path().exists() else {}
        return {**_decode_row(workload, ctx, int(tokens.size), n_dec, t, checksum(out)), **inproc}
    if workload == "text":
        return text_workload(model, s)
    if workload == "state_fast":
        return state_fast_workload(model, s)
    if workload == "llama_cpp_python":
        return llama_cpp_python_workload(model, s)
    if workload == "decode_raw":
        # Diagnostic, not a user API: native_driver.c's loop written with pl.lib calls only, so the
        # cost of a Python process + cffi shows apart from the cost of pyllamacpp's layers.
        lib = pl.lib
        ctx = py_context(model, s)
        cptr, tokens, sampler = ctx.ptr, model.tokenize(s["prompt"]), pl.Sampler.greedy()
        smpl, vocab = sampler.ptr, model._vocab_ptr()

        def run(n_predict):
            pb = lib.llama_batch_init(s["n_batch"], 0, 1)
            for i, tok in enumerate(tokens.tolist()):
                pb.token[i], pb.pos[i], pb.n_seq_id[i], pb.seq_id[i][0] = tok, i, 1, 0
                pb.logits[i] = i == tokens.size - 1
            pb.n_tokens = tokens.size
            if lib.llama_decode(cptr, pb) != 0:
                raise RuntimeError("prompt decode failed")
            t0 = time.perf_counter()
            b = lib.llama_batch_init(1, 0, 1)
            out, pos = [], int(tokens.size)
            for _ in range(n_predict):
                tok = lib.llama_sampler_sample(smpl, cptr, -1)
                out.append(tok)
                if lib.llama_vocab_is_eog(vocab, tok):
                    break
                b.n_tokens = 1
                b.token[0], b.pos[0], b.n_seq_id[0], b.seq_id[0][0], b.logits[0] = tok, pos, 1, 0, 1
                if lib.llama_decode(cptr, b) != 0:
                    raise RuntimeError("decode failed")
                pos += 1
            t = time.perf_counter() - t0
            lib.llama_batch_free(b)
            lib.llama_batch_free(pb)
            return t, out

        if s["warmup"]:
            run(16)
            lib.llama_memory_clear(lib.llama_get_memory(cptr), True)
            lib.llama_sampler_reset(smpl)
        t, out = run(s["n_predict"])
        n_dec = len(out) - (1 if out and model.is_eog(out[-1]) else 0)
        return _decode_row(workload, ctx, int(tokens.size), n_dec, t, checksum(out))
    if workload == "parallel":
        ctx = py_context(model, s)
        sampler = pl.Sampler.greedy()
        if s["warmup"]:
            pl.generate_parallel(ctx, s["prompt"], s["n_parallel"], 4, sampler)
            ctx.memory.clear()
            sampler.reset()
        clock = DecodeClock(ctx)
        res = pl.generate_parallel(ctx, s["prompt"], s["n_parallel"], s["n_predict"], sampler)
        t = time.perf_counter() - clock.calls[0][0]
        n_dec = sum(n for _, n in clock.calls[1:])
        h = 0
        for r in res:
            h = (h * 31 + checksum(r.tokens)) & 0xFFFFFFFF
        return _decode_row(workload, ctx, clock.calls[0][1], n_dec, t, h)
    if workload == "prefill":
        ctx = py_context(model, s)
        toks = synthetic_tokens(s["n_tokens"], model.n_vocab)
        ts = []
        for it in range(-s["warmup"], s["iters"]):
            ctx.memory.clear()
            t0 = time.perf_counter()
            ctx.prefill(toks)
            pl.lib.llama_synchronize(ctx.ptr)  # the native side synchronizes too
            t = time.perf_counter() - t0
            if it >= 0:
                ts.append(t)
        m = statistics.median(ts)
        return {
            "workload": workload,
            "flash_attn": flash_attn_verdict(ctx),
            "n_tokens": int(toks.size),
            "t_s": ts,
            "t_median_s": m,
            "tok_s": toks.size / m,
        }
    if workload == "fill":
        toks = synthetic_tokens(s["n_tokens"], model.n_vocab)
        out = {"workload": workload, "n_tokens": int(toks.size), "iters": s["iters"]}
        for key, batch in (("", pl.Batch(toks.size, 1)), ("checked_", pl.Batch(toks.size, 1, model=model))):
            clock = time.perf_counter_ns
            ts = []
            for it in range(-100, s["iters"]):
                t0 = clock()
                batch.clear()
                batch.add_sequence(toks, 0, 0, logits="last")
                t = clock() - t0
                if it >= 0:
                    ts.append(t)
            out[f"{key}best_us"] = min(ts) / 1e3
            out[f"{key}median_us"] = statistics.median(ts) / 1e3
            out["n_filled"] = len(batch)
        return out
    if workload == "state":
        ctx = py_context(model, s)
        ctx.prefill(synthetic_tokens(s["n_tokens"], model.n_vocab))
        tg, ts, te = [], [], []
        size = 0
        clock = time.perf_counter
        for it in range(-s["warmup"], s["iters"]):
            t0 = clock()
            st = ctx.seq_state(0)
            t1 = clock()
            ctx.set_seq_state(0, st)  # into the sequence that still holds it
            t2 = clock()
            ctx.memory.seq_rm(0)
            t3 = clock()
            ctx.set_seq_state(0, st)  # into the emptied sequence
            t4 = clock()
            size = len(st)
            page_offset = st.data.ctypes.data % 4096  # where malloc put it (pyl_state_seq_get; see native_driver.c)
            del st
            if it >= 0:
                tg.append(t1 - t0), ts.append(t2 - t1), te.append(t4 - t3)
        # The fast path a user can choose: a reused buffer (no page faults), no re-validation of a
        # blob this context just made, no backup copy (a failed load leaves the sequence empty).
        reuse = np.empty(size, dtype=np.uint8)
        fg, fs = [], []
        for it in range(-s["warmup"], s["iters"]):
            t0 = clock()
            st = ctx.seq_state(0, out=reuse)
            t1 = clock()
            ctx.set_seq_state(0, st, validate=False, keep_on_error=False)
            t2 = clock()
            if it >= 0:
                fg.append(t1 - t0), fs.append(t2 - t1)
        ms = lambda v: statistics.median(v) * 1e3  # noqa: E731
        # The default get / set again with the dump at page offsets 0, 512 ... 3584 of one buffer,
        # as native_driver.c does: llama.cpp's copy runs ~15% faster or slower depending on the
        # destination's place in its page, and the two processes' heaps put a fresh buffer at
        # different places. seq_state takes a function context_state._new_state_buffer, when set,
        # for its buffer instead of malloc: pointed here at the chosen place. That path makes the
        # size and copy calls from Python (under a log capture) instead of one C call; the result
        # is an own, read-only state as by default.
        import pyllamacpp.context_state as cs

        default_buffer = cs._new_state_buffer
        big = np.empty(size + 8192, dtype=np.uint8)
        pg, ps = [], []
        for k in range(8):
            at = (512 * k - big.ctypes.data) % 4096
            cs._new_state_buffer = lambda n, at=at: big[at : at + n]
            g, st_ = [], []
            for it in range(-s["warmup"], s["iters"]):
                t0 = clock()
                st = ctx.seq_state(0)
                t1 = clock()
                ctx.set_seq_state(0, st)
                t2 = clock()
                del st
                if it >= 0:
                    g.append(t1 - t0), st_.append(t2 - t1)
            pg.append(ms(g)), ps.append(ms(st_))
        cs._new_state_buffer = default_buffer
        inproc = state_in_process(ctx, s) if native_lib_path().exists() else {}
        return {
            **inproc,
            "workload": workload,
            "n_tokens": s["n_tokens"],
            "state_bytes": size,
            "flash_attn": flash_attn_verdict(ctx),
            "get_ms": ms(tg),
            "set_ms": ms(ts),
            "set_empty_ms": ms(te),
            "fast_get_ms": ms(fg),
            "fast_set_ms": ms(fs),
            "fast_roundtrip_ms": statistics.median([a + b for a, b in zip(fg, fs)]) * 1e3,
            "place_get_ms": pg,
            "place_set_ms": ps,
            "buf_page_offset": page_offset,
        }
    raise SystemExit(f"unknown workload {workload}")


# -- the report ----------------------------------------------------------------------------------
# (workload, metric, label, unit, kind, target): kind "rate" -> ratio py/native of a rate (higher is
# better); "time" -> ratio py/native of a time (lower is better).
ROWS = [
    ("decode", "tok_s", "decode, 1 seq greedy", "tok/s", "rate", ">= 0.99x"),
    ("parallel", "tok_s", "decode, 8 seqs shared prompt", "tok/s", "rate", ">= 0.99x"),
    ("prefill", "tok_s", "prefill 512 in one decode", "tok/s", "rate", ">= 0.99x"),
    ("fill", "best_us", "fill 2048-token batch, best", "µs", "time", "< 50 µs"),
    ("fill", "median_us", "fill 2048-token batch, median", "µs", "time", "< 50 µs"),
    ("state", "get_ms", "seq_state 512 tok (get)", "ms", "time", ""),
    ("state", "set_ms", "set_seq_state, seq occupied", "ms", "time", ""),
    ("state", "set_empty_ms", "set_seq_state, seq empty", "ms", "time", ""),
    ("state", "roundtrip_ms", "round trip get + set (occupied)", "ms", "time", "<= 1.1x"),
    ("state", "fast_roundtrip_ms", "round trip, out= + validate=False + keep_on_error=False", "ms", "time", "<= 1.1x"),
    ("state", "place_get_min_ms", "  get, defaults, dump at the best of 8 page offsets", "ms", "time", ""),
    ("state", "place_get_max_ms", "  get, defaults, dump at the worst of 8 page offsets", "ms", "time", ""),
    (
        "state",
        "place_roundtrip_ms",
        "round trip, defaults, dump at 8 page offsets on both sides (median)",
        "ms",
        "time",
        "<= 1.1x",
    ),
]


def target_met(target: str, py: float, ratio: float) -> str:
    if not target:
        return ""
    if target.startswith(">="):
        return "yes" if ratio >= float(target[2:].strip(" x")) else "no"
    if target.startswith("<="):
        return "yes" if ratio <= float(target[2:].strip(" x")) else "no"
    if target.startswith("<"):
        return "yes" if py < float(target[1:].split()[0]) else "no"
    return ""


def row(wl, metric, label, unit, kind, target, nat: list, py: list) -> dict:
    """Medians per side, and the ratio as the median of the per-repeat ratios: the two runs of one
    repeat ran back to back, so their ratio cancels the drift of the machine between repeats."""
    mn, mp = statistics.median(nat), statistics.median(py)
    paired = statistics.median(p / n for p, n in zip(py, nat))
    return dict(
        workload=wl,
        metric=metric,
        label=label,
        unit=unit,
        kind=kind,
        native=mn,
        python=mp,
        ratio=paired,
        ratio_of_medians=mp / mn,
        target=target,
        met=target_met(target, mp, paired),
        native_all=nat,
        python_all=py,
    )


def summarize(runs: dict) -> list[dict]:
    for side in ("native", "python"):
        for r in runs.get("state", {}).get(side, []):
            r["roundtrip_ms"] = r["get_ms"] + r["set_ms"]
            r.setdefault("fast_roundtrip_ms", r["roundtrip_ms"])  # native C has one path
            if "place_get_ms" in r:  # per page offset of the destination: the median, the extremes
                trips = [g + t for g, t in zip(r["place_get_ms"], r["place_set_ms"])]
                r["place_roundtrip_ms"] = statistics.median(trips)
                r["place_get_min_ms"], r["place_get_max_ms"] = min(r["place_get_ms"]), max(r["place_get_ms"])
    rows = []
    for wl, metric, label, unit, kind, target in ROWS:
        if wl not in runs:
            continue
        nat = [r[metric] for r in runs[wl]["native"]]
        py = [r[metric] for r in runs[wl]["python"]]
        rows.append(row(wl, metric, label, unit, kind, target, nat, py))
    if runs.get("decode", {}).get("python_raw"):  # diagnostic: Python process + cffi, no pyllamacpp layers
        py = [r["tok_s"] for r in runs["decode"]["python_raw"]]
        nat = [r["tok_s"] for r in runs["decode"]["native"]]
        rows.insert(
            1, row("decode", "raw_tok_s", "  same loop in raw pl.lib calls (diagnostic)", "tok/s", "rate", "", nat, py)
        )
    pyd = runs.get("decode", {}).get("python", [])
    if pyd and "inproc_tok_s" in pyd[0]:  # both sides in one process, on one context
        rows.insert(
            2 if runs["decode"].get("python_raw") else 1,
            row(
                "decode",
                "inproc_tok_s",
                "  same, both sides in one process on one context",
                "tok/s",
                "rate",
                ">= 0.99x",
                [r["inproc_native_tok_s"] for r in pyd],
                [r["inproc_tok_s"] for r in pyd],
            ),
        )
    pys = runs.get("state", {}).get("python", [])
    if pys and "inproc_roundtrip_ms" in pys[0]:  # both sides in one process, on one context
        for metric, label, target in (
            ("get_ms", "get, both sides in one process on one context", ""),
            ("set_ms", "set (occupied), both sides in one process on one context", ""),
            ("roundtrip_ms", "round trip, both sides in one process on one context", "<= 1.1x"),
        ):
            rows.append(
                row(
                    "state",
                    f"inproc_{metric}",
                    label,
                    "ms",
                    "time",
                    target,
                    [r[f"inproc_native_{metric}"] for r in pys],
                    [r[f"inproc_{metric}"] for r in pys],
                )
            )
    for key in ("", "short_"):  # the state fast path against the C calls: 512 tokens, short
        rs = runs.get("state_fast", {}).get("python", [])
        for side, op, label in (
            ("py", "get", "seq_state(out=buf)"),
            ("py", "set", "set_seq_state(validate=False, keep_on_error=False)"),
            ("sb", "get", "seq_state(out=StateBuffer)"),
            ("sb", "set", "set_seq_state(its state, validate=False, keep_on_error=False)"),
        ):
            if not rs or f"{key}{side}_{op}_us" not in rs[0]:
                continue
            r = row(
                "state_fast",
                f"{key}{side}_{op}_us",
                f"state fast path, {label}, {rs[0][f'{key}n_tokens']} tok, one process ('native' = the cffi call)",
                "µs",
                "time",
                "<= 1.02x" if not key else "",
                [x[f"{key}c_{op}_us"] for x in rs],
                [x[f"{key}{side}_{op}_us"] for x in rs],
            )
            ratio_key = f"{key}{op}_ratio" if side == "py" else f"{key}sb_{op}_ratio"
            r["ratio"] = statistics.median(x[ratio_key] for x in rs)  # the steps' pairs, in the worker
            r["met"] = target_met(r["target"], r["python"], r["ratio"])
            rows.append(r)
    rs = [x for x in runs.get("llama_cpp_python", {}).get("python", []) if not x.get("absent")]
    if rs:  # pyllamacpp against llama-cpp-python ('native' column: llama-cpp-python)
        for metric, lcp, py, label, unit, kind in (
            ("get_ratio", "lcp_get_us", "py_get_us", "state get into a reused buffer, 512 tok", "µs", "time"),
            ("decode_ratio", "lcp_tok_s", "py_tok_s", "decode, 1 seq greedy (generate)", "tok/s", "rate"),
        ):
            r = row(
                "llama_cpp_python",
                metric,
                f"vs llama-cpp-python {rs[0]['version']}: {label}, one process ('native' = llama-cpp-python)",
                unit,
                kind,
                "",
                [x[lcp] for x in rs],
                [x[py] for x in rs],
            )
            r["ratio"] = statistics.median(x[metric] for x in rs)
            rows.append(r)
    if runs.get("text", {}).get("python"):  # Python only: complete(stream=True) against generate
        rs = runs["text"]["python"]
        r = row(
            "text",
            "complete_tok_s",
            "text: complete(stream=True) / generate, one process ('native' = generate)",
            "tok/s",
            "rate",
            ">= 0.98x",
            [x["generate_tok_s"] for x in rs],
            [x["complete_tok_s"] for x in rs],
        )
        r["ratio"] = statistics.median(x["ratio"] for x in rs)  # the paired runs' ratios, in the worker
        r["met"] = target_met(r["target"], r["python"], r["ratio"])
        rows.append(r)
    if "fill" in runs:  # Batch(model=...) checks tokens against the vocabulary: shown for reference
        for metric in ("checked_best_us", "checked_median_us"):
            py = [r[metric] for r in runs["fill"]["python"]]
            nat = [r[metric.replace("checked_", "")] for r in runs["fill"]["native"]]
            rows.append(
                row(
                    "fill",
                    metric,
                    f"  same, Batch(model=) vocab check, {metric.split('_')[1]}",
                    "µs",
                    "time",
                    "< 50 µs",
                    nat,
                    py,
                )
            )
    return rows


def fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"


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
    load_after = os.getloadavg()
    rows = summarize(runs)

    print(f"\nmodel {model}; {a.threads} threads; {a.repeats} runs per side, alternating; medians")
    print(
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}; 1-min load after each run "
        f"{min(loads):.2f}..{max(loads):.2f} (this benchmark alone adds up to ~{a.threads}); "
        f"{time.time() - t_start:.0f} s\n"
    )
    print("| workload | unit | native | Python | Python / native | (of medians) | target | met |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['unit']} | {fmt(r['native'])} | {fmt(r['python'])} | {r['ratio']:.3f} | "
            f"{r['ratio_of_medians']:.3f} | {r['target']} | {r['met']} |"
        )
    notes = []
    fa = {
        f"{w}/{side}": res[0].get("flash_attn")
        for w in workloads
        for side in ("native", "python")
        for res in [runs[w][side]]
        if res and "flash_attn" in res[0]
    }
    notes.append(
        "flash attention: requested auto on both sides; resolved to "
        + ", ".join(sorted({v for v in fa.values()}))
        + f" ({len(fa)} workload/side pairs)"
    )
    for w in ("decode", "parallel"):
        if w in runs:
            same = {r["checksum"] for r in runs[w]["native"] + runs[w]["python"] + runs[w]["python_raw"]}
            notes.append(
                f"{w}: generated tokens {'identical on both sides' if len(same) == 1 else 'DIFFER'} "
                f"({len(same)} distinct checksum(s)); decoded tokens per run: "
                f"native {runs[w]['native'][0]['n_decoded']}, python {runs[w]['python'][0]['n_decoded']}"
            )
    if runs.get("text", {}).get("python"):
        same = all(r["same_text"] for r in runs["text"]["python"])
        notes.append(
            f"text: complete(stream=True) and generate alternated, {all_settings['text']['pairs']} runs each "
            f"per worker, {runs['text']['python'][0]['n_decoded']} decoded tokens per run; text "
            + ("identical" if same else "DIFFERS")
        )
    if runs.get("decode", {}).get("python") and "inproc_tok_s" in runs["decode"]["python"][0]:
        same = all(r["inproc_same_tokens"] for r in runs["decode"]["python"])
        notes.append(
            "decode, one process: native_driver.c's run_decode through ctypes on the Python side's context "
            "and sampler, alternating with pl.generate, 2 runs each per worker; tokens "
            + ("identical" if same else "DIFFER")
        )
    if "state" in runs:
        notes.append(
            f"state bytes: native {runs['state']['native'][0]['state_bytes']}, "
            f"python {runs['state']['python'][0]['state_bytes']}"
        )
        offs = {
            side: sorted({r.get("buf_page_offset") for r in runs["state"][side]}, key=str)
            for side in ("native", "python")
        }
        notes.append(
            f"state: page offset of each side's fresh dump buffer (malloc in each process): native {offs['native']}, "
            f"python {offs['python']}"
        )
        if runs["state"]["python"] and "inproc_native_page_offsets" in runs["state"]["python"][0]:
            notes.append(
                "state, one process: native_driver.c's state_step through ctypes on the Python side's "
                "context, alternating with seq_state + set_seq_state, "
                f"{3 * all_settings['state']['iters']} steps each per run; its malloc page offsets "
                f"{sorted({o for r in runs['state']['python'] for o in r['inproc_native_page_offsets']})}"
            )
    if runs.get("state_fast", {}).get("python"):
        r0 = runs["state_fast"]["python"][0]
        notes.append(
            f"state fast path: {r0['pairs']} steps (get + set) per side per worker, alternating, in one process on "
            f"one context and one reused buffer ({r0['state_bytes']} and {r0['short_state_bytes']} bytes); "
            "'native' = lib.llama_state_seq_get_data_ext / set_data_ext with pointers made once; "
            "ratio = median of the steps' paired ratios"
        )
    if "llama_cpp_python" in runs:
        lcp = runs["llama_cpp_python"]["python"]
        if not lcp or lcp[0].get("absent"):
            notes.append("llama-cpp-python: not importable (import llama_cpp failed): its rows skipped")
        else:
            notes.append(
                f"llama-cpp-python {lcp[0]['version']} ({lcp[0].get('lib', '?')}): decode tokens "
                + ("identical" if all(x["same_tokens"] for x in lcp) else "DIFFER")
            )
    notes.append(
        "Python / native: median over repeats of the ratio of the two back-to-back runs; rates (tok/s): "
        "higher is better, times: lower is better; 'met' uses it (the fill target: the Python µs)"
    )
    print()
    for n in notes:
        print("-", n)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                dict(
                    model=model,
                    threads=a.threads,
                    repeats=a.repeats,
                    settings=all_settings,
                    build_cmd=build_cmd,
                    load_before=load_before,
                    load_after=load_after,
                    loads=loads,
                    rows=rows,
                    notes=notes,
                    runs=runs,
                ),
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
