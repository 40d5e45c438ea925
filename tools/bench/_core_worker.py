"""bench_core's Python worker, the side that runs in its own process like the native driver: the
decode, decode_raw, parallel, prefill, fill and state workloads, what they share (DecodeClock, the
context, the flash attention verdict), and the driver's own loops run through ctypes on the
worker's context (decode_in_process, state_in_process: the "one process" rows)."""

from __future__ import annotations

import ctypes
import statistics
import time

from _core_native import checksum, native_lib, native_lib_path, synthetic_tokens


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


def decode_in_process(ctx, tokens, sampler, clock: DecodeClock, s: dict, pairs: int = 2) -> dict:
    """The decode workload of both sides in this one process, on this one context and sampler:
    native_driver.c's ``decode_in_process`` (its run_decode, timed in C) through ctypes, and
    ``pl.generate`` timed as the worker times it, ``pairs`` times each, alternating which goes
    first. Both then decode with the same weights, KV cache and threads, so what differs between
    them is pyllamacpp's code alone (in two processes, where the model and cache land differs too)."""
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


def decode_workload(model, s: dict) -> dict:
    """``pl.generate`` greedy from the prompt, timed from the end of the prompt's decode; then, when
    the driver's shared library is built, both sides again in this process (decode_in_process)."""
    import pyllamacpp as pl

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
    return {**_decode_row("decode", ctx, int(tokens.size), n_dec, t, checksum(out)), **inproc}


def decode_raw_workload(model, s: dict) -> dict:
    """Diagnostic, not a user API: native_driver.c's loop written with pl.lib calls only, so the
    cost of a Python process + cffi shows apart from the cost of pyllamacpp's layers."""
    import pyllamacpp as pl

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
    return _decode_row("decode_raw", ctx, int(tokens.size), n_dec, t, checksum(out))


def parallel_workload(model, s: dict) -> dict:
    """``pl.generate_parallel`` (examples/batched), timed from the end of the shared prompt's decode."""
    import pyllamacpp as pl

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
    return _decode_row("parallel", ctx, clock.calls[0][1], n_dec, t, h)


def prefill_workload(model, s: dict) -> dict:
    """``ctx.prefill`` of a synthetic prompt in one decode, llama_synchronize included."""
    import pyllamacpp as pl

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
        "workload": "prefill",
        "flash_attn": flash_attn_verdict(ctx),
        "n_tokens": int(toks.size),
        "t_s": ts,
        "t_median_s": m,
        "tok_s": toks.size / m,
    }


def fill_workload(model, s: dict) -> dict:
    """``Batch.add_sequence`` of a synthetic prompt, without and with the vocabulary check (no decode)."""
    import pyllamacpp as pl

    toks = synthetic_tokens(s["n_tokens"], model.n_vocab)
    out = {"workload": "fill", "n_tokens": int(toks.size), "iters": s["iters"]}
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


def state_workload(model, s: dict) -> dict:
    """``ctx.seq_state`` / ``set_seq_state`` with their defaults, the fast path (``out=``,
    ``validate=False``, ``keep_on_error=False``), the dump at 8 page offsets, and, when the driver's
    shared library is built, both sides in this process (state_in_process)."""
    import numpy as np

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
    # different places. seq_state takes a function _context_state.data._new_state_buffer, when set,
    # for its buffer instead of malloc: pointed here at the chosen place. That path makes the
    # size and copy calls from Python (under a log capture) instead of one C call; the result
    # is an own, read-only state as by default.
    import pyllamacpp._context_state.data as cs

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
        "workload": "state",
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
