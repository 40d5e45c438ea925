"""bench_core's Python-only workloads (PYTHON_ONLY): both sides run in the one Python worker, on one
context, alternating: ``text`` (``model.complete(stream=True)`` against ``pl.generate``),
``state_fast`` (the state fast path against the bare C calls) and ``llama_cpp_python``
(pyllamacpp against llama-cpp-python, when ``import llama_cpp`` works)."""

from __future__ import annotations

import ctypes
import statistics
import time

from _core_native import synthetic_tokens
from _core_worker import DecodeClock, flash_attn_verdict, py_context


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
