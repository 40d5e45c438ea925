"""Where the state fast path's last few percent go: ``seq_state(out=buf)`` against the bare
``llama_state_seq_get_data_ext`` call, with one line of its Python added at a time; then
``seq_state(out=StateBuffer)``, and ``set_seq_state(validate=False, keep_on_error=False)`` of
both kinds of state against the bare ``llama_state_seq_set_data_ext``.

    python tools/bench/state_fast_lines.py [-p 300] [-n 512] [-t 1]

One process, one context, one reused buffer; each variant is timed around one get, then the state
is set back with the bare C call (as bench_core's ``state_fast`` does), variants alternating in
order and reverse order every step. Printed: the median µs of each and the median of its paired
ratios to the bare call. After a copy of megabytes the interpreter's code and data are out of the
caches, so each Python line around the call costs microseconds, not the nanoseconds it costs warm.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_core import synthetic_tokens  # noqa: E402

import pyllamacpp as pl  # noqa: E402
from pyllamacpp._log import pending  # noqa: E402
from pyllamacpp.context_state import SeqState  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-p", "--pairs", type=int, default=300, help="steps per variant (default 300)")
    ap.add_argument("-n", "--n-tokens", type=int, default=512, help="tokens in the sequence (default 512)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads (default 1)")
    a = ap.parse_args(argv)
    lib, ffi = pl.lib, pl.ffi
    model = pl.Model()
    ctx = model.context(n_ctx=max(1024, a.n_tokens + 64), n_threads=a.threads, flash_attn="on")
    ctx.prefill(synthetic_tokens(a.n_tokens, model.n_vocab))
    cptr, h = ctx.ptr, ctx._h
    size = lib.llama_state_seq_get_size_ext(cptr, 0, 0)
    buf = np.empty(size, dtype=np.uint8)
    p = ffi.from_buffer(buf)
    get, put, clock, u8 = (
        lib.llama_state_seq_get_data_ext,
        lib.llama_state_seq_set_data_ext,
        time.perf_counter,
        np.dtype(np.uint8),
    )

    def bare():
        return get(cptr, p, size, 0, 0)

    def view_and_seqstate():
        n = get(cptr, p, size, 0, 0)
        return SeqState(buf[:n], 0, 0)

    def plus_from_buffer():
        q = ffi.from_buffer(buf, require_writable=True)
        n = get(cptr, q, buf.size, 0, 0)
        return SeqState(buf[:n], 0, 0)

    def plus_array_checks():
        if buf.ndim != 1 or (buf.dtype is not u8 and buf.dtype != u8):
            raise ValueError
        n = get(cptr, p, size, 0, 0)
        return SeqState(buf[:n], 0, 0)

    def plus_pointer_check():
        ptr = h.ptr if h is not None and h.rpc is None else ctx.ptr
        n = get(ptr, p, size, 0, 0)
        return SeqState(buf[:n], 0, 0)

    def plus_log_check():
        n = get(cptr, p, size, 0, 0)
        if pending:  # threads with a log line or a handler's exception left (pyllamacpp._log)
            raise RuntimeError
        return SeqState(buf[:n], 0, 0)

    def seq_state():
        return ctx.seq_state(0, out=buf)

    sb = pl.StateBuffer(buf)  # the same memory (llama.cpp's copy speed depends on where it lands)

    def seq_state_sb():
        return ctx.seq_state(0, out=sb)

    variants = {
        "bare llama_state_seq_get_data_ext": bare,
        "+ out[:n] and SeqState": view_and_seqstate,
        "+ ffi.from_buffer(out)": plus_from_buffer,
        "+ out's ndim/dtype check": plus_array_checks,
        "+ the closed/RPC pointer check": plus_pointer_check,
        "+ the pending log-error check": plus_log_check,
        "ctx.seq_state(0, out=buf), all of it": seq_state,
        "ctx.seq_state(0, out=StateBuffer), all of it": seq_state_sb,
    }
    names = list(variants)
    t: dict[str, list[float]] = {k: [] for k in names}
    for it in range(-20, a.pairs):
        for k in names if it % 2 == 0 else names[::-1]:
            t0 = clock()
            variants[k]()
            t1 = clock()
            put(cptr, p, size, 0, 0)
            if it >= 0:
                t[k].append(t1 - t0)
    # set: the bare call against set_seq_state with a SeqState from a numpy out and from a StateBuffer
    st_np, st_sb = ctx.seq_state(0, out=buf), ctx.seq_state(0, out=sb)
    sets = {
        "bare llama_state_seq_set_data_ext": lambda: put(cptr, p, size, 0, 0),
        "set_seq_state(st from out=buf)": lambda: ctx.set_seq_state(0, st_np, validate=False, keep_on_error=False),
        "set_seq_state(st from out=StateBuffer)": lambda: ctx.set_seq_state(
            0, st_sb, validate=False, keep_on_error=False
        ),
    }
    set_names = list(sets)
    ts: dict[str, list[float]] = {k: [] for k in set_names}
    for it in range(-20, a.pairs):
        for k in set_names if it % 2 == 0 else set_names[::-1]:
            get(cptr, p, size, 0, 0)  # the caches as a dump leaves them, as before each set in a loop
            t0 = clock()
            sets[k]()
            t1 = clock()
            if it >= 0:
                ts[k].append(t1 - t0)
    base = t[names[0]]
    print(f"{a.n_tokens}-token sequence, {size} bytes, {a.pairs} steps per variant, {a.threads} thread(s)")
    print("| variant | median µs | ratio to the bare call (median of pairs) |\n|---|---:|---:|")
    for k in names:
        ratio = statistics.median(b / x for x, b in zip(base, t[k]))
        print(f"| {k} | {statistics.median(t[k]) * 1e6:.1f} | {ratio:.3f} |")
    print("\n| set variant | median µs | ratio to the bare call (median of pairs) |\n|---|---:|---:|")
    for k in set_names:
        ratio = statistics.median(b / x for x, b in zip(ts[set_names[0]], ts[k]))
        print(f"| {k} | {statistics.median(ts[k]) * 1e6:.1f} | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
