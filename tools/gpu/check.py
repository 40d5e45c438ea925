"""What only a GPU shows: run on the device machine by tools/gpu/run.sh, after the CUDA build.

    python tools/gpu/check.py [--out DIR] [--cpu-only]

Uses a synthetic model (``pyllamacpp.testing.make_model``: no weights travel) and compares a
context with every layer offloaded (``n_gpu_layers=99``) against a CPU one of the same model:

- the build registers CUDA and sees the GPU (``build_info()``, ``devices()``);
- the model and KV buffers llama.cpp logs are on the GPU (``ctx.buffers``);
- logits of the same prompt, GPU against CPU (max |diff|), and greedy continuations;
- sequence state: a dump from the GPU context parses with ``pyllamacpp.state`` to the same layout
  as the CPU one (same bytes of metadata, payload within the logits' tolerance), loads into the
  CPU context and the other way round, and the next logits follow;
- ``StateFlags.ON_DEVICE`` on the GPU: the blob holds headers only while the rows stay in GPU
  memory; after clearing the sequence, loading it back gives bit-identical next logits;
- ``generate`` tokens/s against the same loop in raw ``lib`` calls on the GPU (where a decode takes
  about a millisecond, Python's share per token matters more than on the CPU);
- 8 sequences: ``generate_parallel`` (a chain per sequence) and ``Scheduler`` tokens/s against the
  same step loop in raw ``lib`` calls (issue #15's GPU goal: at least 0.95x);
- graph taps (issue #22): a capture (l_out, kq_soft_max, the KQ mask, positions, the K cache) and
  a patch (a vector added at l_out-3, against the same control vector) on the GPU against the CPU,
  the copies' buffers, and decode tokens/s without a callback, with taps idle and capturing.

Prints a summary and writes ``gpu_check.json`` to ``--out`` (default ``$OUT`` or the current
folder). Exits 1 when a check fails. ``--cpu-only`` runs the same code with both contexts on the
CPU, to try the script without a GPU (the offload checks are then skipped).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu-only", action="store_true", help="both contexts on the CPU (a dry run)")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    args = ap.parse_args(argv)
    # a crash in C prints the Python line it came from (the first device run died with a bare
    # 'Segmentation fault' between the device checks and the buffers check)
    faulthandler.enable()

    import pyllamacpp as pl
    from pyllamacpp import lib, state
    from pyllamacpp.testing import make_model

    results: dict = {"checks": {}, "figures": {}}
    failed: list[str] = []

    def check(name: str, ok: bool, detail) -> None:
        results["checks"][name] = {"ok": bool(ok), "detail": detail}
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)
        if not ok:
            failed.append(name)

    info = pl.build_info()
    results["package"] = pl.__file__
    print(f"pyllamacpp from {pl.__file__}; backends {info.get('backends')}", flush=True)
    results["build_info"] = {k: info.get(k) for k in ("backends", "devices", "llama_cpp_commit", "ggml_options")}
    gpu = not args.cpu_only
    devs = pl.devices()
    results["devices"] = devs
    if gpu:
        check("cuda backend registered", "cuda" in info.get("backends", []), info.get("backends"))
        check(
            "a GPU device",
            any(d["type"] == "gpu" for d in devs),
            [(d["name"], d["description"], d["memory_total"]) for d in devs],
        )
        if failed:
            return finish(args, results, failed)

    stage("a synthetic model")
    tmp = Path(tempfile.mkdtemp(prefix="pyl-gpu-"))
    # big enough that a GPU decode is not all launch overhead, small enough to make in seconds
    path = make_model(
        tmp / "synth-llama.gguf", "llama", n_layer=8, n_embd=512, n_head=8, n_head_kv=4, n_vocab=2048, n_ff=1024, seed=1
    )
    toks = (np.arange(48, dtype=np.int32) * 37 + 11) % 2048
    kw = dict(n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=4, n_threads_batch=4, flash_attn="on")
    stage("two models (CPU, GPU) and a context on each")
    with (
        # n_gpu_layers=0: llama.cpp's default (-1) offloads every layer where a GPU is registered
        pl.Model(path, n_gpu_layers=0) as m_cpu,
        pl.Model(path, n_gpu_layers=99 if gpu else 0) as m_gpu,
        m_cpu.context(**kw) as c_cpu,
        m_gpu.context(**kw) as c_gpu,
    ):
        results["buffers"] = {"cpu": c_cpu.buffers, "gpu": c_gpu.buffers}
        if gpu:
            on_gpu = [b for b in c_gpu.buffers if b.upper().startswith("CUDA")]
            check(
                "model and KV buffers on the GPU",
                any("model" in c_gpu.buffers[b] for b in on_gpu) and any("KV" in c_gpu.buffers[b] for b in on_gpu),
                c_gpu.buffers,
            )

        # logits of the same prompt
        c_cpu.prefill(toks)
        c_gpu.prefill(toks)
        lc, lg = c_cpu.logits().copy(), c_gpu.logits().copy()
        diff = float(np.abs(lc - lg).max())
        scale = float(np.abs(lc).max())
        results["figures"]["logits_max_abs_diff"] = diff
        check("logits GPU vs CPU", diff <= 1e-2 * max(scale, 1.0), f"max |diff| {diff:.3g} (max |logit| {scale:.3g})")
        ref_cpu = pl_generate(pl, c_cpu, toks, 16)
        ref_gpu = pl_generate(pl, c_gpu, toks, 16)
        same = sum(a == b for a, b in zip(ref_cpu, ref_gpu))
        results["figures"]["greedy_agree_of_16"] = same
        check("greedy continuation GPU vs CPU", same >= 8, f"{same}/16 tokens equal (random weights: ties can split)")

        # sequence state across devices
        for c in (c_cpu, c_gpu):
            c.memory.clear()
            c.prefill(toks)
        s_cpu, s_gpu = c_cpu.seq_state(0), c_gpu.seq_state(0)
        p_cpu, p_gpu = state.parse(s_cpu.data, model=str(path)), state.parse(s_gpu.data, model=str(path))
        lay_cpu, lay_gpu = p_cpu.layout(), p_gpu.layout()
        same_layout = [(r.kind, r.il, r.type, r.row_size, r.data_offset) for r in lay_cpu.rows] == [
            (r.kind, r.il, r.type, r.row_size, r.data_offset) for r in lay_gpu.rows
        ]
        check(
            "GPU dump parses to the CPU dump's layout",
            same_layout and len(s_cpu) == len(s_gpu),
            f"{len(s_gpu):,} bytes, {len(lay_gpu.rows)} records, metadata {lay_gpu.metadata_bytes:,} B",
        )
        k0 = float(np.abs(p_cpu.k[0].astype(np.float32) - p_gpu.k[0].astype(np.float32)).max())
        results["figures"]["k0_max_abs_diff"] = k0
        check("K of layer 0, GPU vs CPU", k0 <= 5e-2, f"max |diff| {k0:.3g}")
        nxt = np.array([int(toks[-1])], np.int32)
        after = {}
        for name, c, blob in (("gpu<-cpu", c_gpu, s_cpu.data), ("cpu<-gpu", c_cpu, s_gpu.data)):
            c.memory.clear()
            n = c.set_seq_state(0, blob)
            c.prefill(nxt, 0, toks.size)
            after[name] = c.logits().copy()
            check(f"state {name} loads", n == len(blob), f"{n:,} bytes")
        d = float(np.abs(after["gpu<-cpu"] - after["cpu<-gpu"]).max())
        check("next logits after a cross-device load agree", d <= 1e-2 * max(scale, 1.0), f"max |diff| {d:.3g}")

        # ON_DEVICE: headers in the blob, rows kept where they are
        c_gpu.memory.clear()
        c_gpu.prefill(toks)
        c_gpu.prefill(nxt, 0, toks.size)
        want = c_gpu.logits().copy()
        c_gpu.memory.seq_rm(0, toks.size)
        meta = c_gpu.seq_state(0, pl.StateFlags.ON_DEVICE)
        pm = state.parse(meta.data)
        check(
            "ON_DEVICE blob is metadata only",
            pm.metadata_only and len(meta) < len(s_gpu) // 10,
            f"{len(meta):,} bytes against {len(s_gpu):,}",
        )
        c_gpu.memory.clear()
        c_gpu.set_seq_state(0, meta, pl.StateFlags.ON_DEVICE)
        c_gpu.prefill(nxt, 0, toks.size)
        got = c_gpu.logits()
        check(
            "ON_DEVICE load gives the same next logits",
            np.array_equal(got, want),
            f"max |diff| {float(np.abs(got - want).max()):.3g}",
        )

        # generate against raw lib calls, same context
        rates = {}
        for side in ("raw", "generate", "raw", "generate"):
            c_gpu.memory.clear()
            t, n = (
                raw_loop(pl, lib, c_gpu, toks, args.n_predict)
                if side == "raw"
                else timed_generate(pl, c_gpu, toks, args.n_predict)
            )
            rates.setdefault(side, []).append(n / t)
        r = {k: float(np.median(v)) for k, v in rates.items()}
        results["figures"]["decode_tok_s"] = r
        print(
            f"[figure] decode on {'GPU' if gpu else 'CPU'}: generate {r['generate']:.1f} tok/s, raw lib loop "
            f"{r['raw']:.1f} tok/s, ratio {r['generate'] / r['raw']:.3f}",
            flush=True,
        )

        # 8 sequences: generate_parallel and the Scheduler against the same step loop in raw lib calls
        # (issue #15's GPU goal: Python-driven decode at least 0.95x native)
        n_par = 8
        # cells: the prompt once (every sequence's) and n_predict - 1 decoded tokens per sequence
        n_ctx_par = max(kw["n_ctx"], -(-(toks.size + n_par * args.n_predict) // 256) * 256)
        stage(f"{n_par} sequences, n_ctx {n_ctx_par}")
        with m_gpu.context(**{**kw, "n_ctx": n_ctx_par, "n_seq_max": n_par, "kv_unified": True}) as c_par:
            par_rates: dict[str, list[float]] = {}
            for side in ("raw", "generate_parallel", "scheduler", "scheduler", "generate_parallel", "raw") * 2:
                c_par.memory.clear()
                t0 = time.perf_counter()
                if side == "raw":
                    n_tok = raw_parallel_loop(pl, lib, c_par, toks, n_par, args.n_predict)
                elif side == "generate_parallel":
                    chains = [pl.Sampler.greedy() for _ in range(n_par)]
                    res = pl.generate_parallel(c_par, toks, n_par, args.n_predict, chains)
                    n_tok = sum(len(r.tokens) for r in res)
                else:
                    sched = pl.Scheduler(c_par)  # the prompt decoded once and shared (seq_cp), as raw does
                    reqs = [sched.submit(toks, args.n_predict, pl.Sampler.greedy()) for _ in range(n_par)]
                    for _ in sched.run():
                        pass
                    n_tok = sum(len(r.tokens) for r in reqs)
                par_rates.setdefault(side, []).append(n_tok / (time.perf_counter() - t0))
            pr = {k: float(np.median(v)) for k, v in par_rates.items()}
            results["figures"]["parallel_tok_s"] = pr
            print(
                f"[figure] {n_par} sequences on {'GPU' if gpu else 'CPU'} (prompt prefill included): raw lib loop "
                f"{pr['raw']:.1f} tok/s, generate_parallel {pr['generate_parallel']:.1f} "
                f"({pr['generate_parallel'] / pr['raw']:.3f}), Scheduler {pr['scheduler']:.1f} "
                f"({pr['scheduler'] / pr['raw']:.3f})",
                flush=True,
            )
        taps_checks(pl, check, results, m_cpu, m_gpu, toks, kw, gpu, args.n_predict)
    return finish(args, results, failed)


def taps_checks(pl, check, results, m_cpu, m_gpu, toks, kw, gpu, n_predict) -> None:
    """Graph taps on the GPU (issue #22): a capture and a patch compared with the same run on the
    CPU, where the copies come from (CUDA buffers, ggml_backend_tensor_get/set), and what taps
    cost in decode speed there (idle, and one site at every layer)."""
    kw = {**kw, "flash_attn": "off"}  # kq_soft_max exists only without flash attention
    names = ("l_out", "kq_soft_max", "attn_inp_kq_mask", "inp_pos", "cache_k")
    caps = {}
    with m_cpu.context(**kw) as c_cpu, m_gpu.context(**kw) as c_gpu:
        for side, c in (("cpu", c_cpu), ("gpu", c_gpu)):
            with c.capture(*names) as cap:
                c.prefill(toks)
            caps[side] = cap
        rc, rg = caps["cpu"], caps["gpu"]
        check(
            "taps: the same records on GPU and CPU",
            [(r.name, r.shape) for r in rc.records] == [(r.name, r.shape) for r in rg.records],
            f"{len(rg.records)} records, {rg.nbytes:,} bytes",
        )
        bufs = sorted({r.buffer for r in rg.records if r.site in ("l_out", "cache_k")})
        results["figures"]["taps_buffers_gpu"] = bufs
        if gpu:
            check("taps: copies come from GPU buffers", any(b.upper().startswith("CUDA") for b in bufs), bufs)
        d_l = max(float(np.abs(rc["l_out", il] - rg["l_out", il]).max()) for il in range(8))
        d_p = max(float(np.abs(rc["kq_soft_max", il] - rg["kq_soft_max", il]).max()) for il in range(8))
        same_in = np.array_equal(rc["inp_pos"], rg["inp_pos"]) and np.array_equal(
            rc["attn_inp_kq_mask"], rg["attn_inp_kq_mask"]
        )
        results["figures"]["taps_l_out_max_abs_diff"] = d_l
        results["figures"]["taps_kq_soft_max_max_abs_diff"] = d_p
        check("taps: inputs (positions, KQ mask) equal on GPU and CPU", same_in, "inp_pos, attn_inp_kq_mask")
        tol = 5e-2 * max(1.0, float(np.abs(rc["l_out", 7]).max()))
        check("taps: l_out GPU vs CPU", d_l <= tol, f"max |diff| {d_l:.3g}")
        check("taps: kq_soft_max GPU vs CPU", d_p <= 1e-2, f"max |diff| {d_p:.3g}")

        # a patch: a vector added to l_out-3 (written back with ggml_backend_tensor_set on the GPU),
        # and the same vector as a control vector, on each device
        rng = np.random.default_rng(0)
        vec = rng.normal(0, 1, m_cpu.n_embd).astype(np.float32)
        shift, exact = {}, {}
        for side, c in (("cpu", c_cpu), ("gpu", c_gpu)):
            c.memory.clear()
            c.prefill(toks)
            base = c.logits().copy()
            c.memory.clear()
            with c.patch("l_out", lambda x, info: x + vec, layers=[3]) as p:
                c.prefill(toks)
            patched = c.logits().copy()
            c.memory.clear()
            c.control_vector({3: vec}, layers=(3, 3))
            c.prefill(toks)
            exact[side] = float(np.abs(c.logits() - patched).max())
            c.control_vector(None)
            shift[side] = patched - base
            check(f"taps: patch called on {side}", p.n_calls >= 1, f"{p.n_calls} calls")
        d = float(np.abs(shift["cpu"] - shift["gpu"]).max())
        results["figures"]["taps_patch_shift_diff"] = d
        results["figures"]["taps_patch_vs_cvec_max_abs_diff"] = exact
        scale = float(np.abs(shift["cpu"]).max())
        check("taps: the patch moves GPU logits as CPU ones", d <= 0.1 * max(scale, 1.0), f"max |diff| {d:.3g}")
        check("taps: patch at l_out == control vector (GPU)", exact["gpu"] <= 1e-3, f"max |diff| {exact['gpu']:.3g}")

        # cost on this device: taps idle against taps=False, and l_out at every layer
        with m_gpu.context(**kw, taps=False) as c_off:
            rates: dict[str, list[float]] = {}
            for side in ("off", "idle", "capture", "capture", "idle", "off") * 2:
                c = c_off if side == "off" else c_gpu
                c.memory.clear()
                if side == "capture":
                    with c.capture("l_out"):
                        t, n = timed_generate(pl, c, toks, n_predict)
                else:
                    t, n = timed_generate(pl, c, toks, n_predict)
                rates.setdefault(side, []).append(n / t)
        r = {k: float(np.median(v)) for k, v in rates.items()}
        results["figures"]["taps_decode_tok_s"] = r
        print(
            f"[figure] taps on {'GPU' if gpu else 'CPU'}: decode {r['off']:.1f} tok/s without a callback, "
            f"{r['idle']:.1f} idle ({r['idle'] / r['off']:.3f}), {r['capture']:.1f} capturing l_out at 8 layers "
            f"({r['capture'] / r['idle']:.3f} of idle)",
            flush=True,
        )


def raw_parallel_loop(pl, lib, ctx, toks, n_seq, n):
    """generate_parallel's work in raw lib calls: the prompt once with every seq id, then one token
    per sequence per decode, each sequence sampled with its own greedy chain; tokens sampled."""
    ptr = ctx.ptr
    chains = [pl.Sampler.greedy() for _ in range(n_seq)]
    b = lib.llama_batch_init(max(int(toks.size), n_seq), 0, n_seq)
    try:
        b.n_tokens = int(toks.size)
        for i, t in enumerate(toks.tolist()):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, n_seq, i == toks.size - 1
            for s in range(n_seq):
                b.seq_id[i][s] = s
        rc = lib.llama_decode(ptr, b)
        if rc != 0:
            raise RuntimeError(f"prompt decode failed: llama_decode returned {rc}")
        idx, pos, n_tok = [int(toks.size) - 1] * n_seq, int(toks.size), 0
        for step in range(n):
            toks_now = [lib.llama_sampler_sample(chains[s].ptr, ptr, idx[s]) for s in range(n_seq)]
            n_tok += n_seq
            if step == n - 1:
                break  # the last token of each sequence is not decoded (as generate_parallel)
            b.n_tokens = n_seq
            for s, t in enumerate(toks_now):
                b.token[s], b.pos[s], b.n_seq_id[s], b.seq_id[s][0], b.logits[s] = t, pos, 1, s, 1
            rc = lib.llama_decode(ptr, b)
            if rc != 0:
                raise RuntimeError(f"decode failed at step {step}: llama_decode returned {rc}")
            idx, pos = list(range(n_seq)), pos + 1
        return n_tok
    finally:
        lib.llama_batch_free(b)


def stage(what: str) -> None:
    """A line before each part that calls into llama.cpp: where a crash leaves no other trace."""
    print(f"[stage] {what}", flush=True)


def pl_generate(pl, ctx, toks, n):
    ctx.memory.clear()
    return list(pl.generate(ctx, toks, n))


def timed_generate(pl, ctx, toks, n):
    g = pl.generate(ctx, toks, n)
    next(g)  # prefill and the first sample, as raw_loop's clock starts after them
    t0 = time.perf_counter()
    k = sum(1 for _ in g)
    return time.perf_counter() - t0, k


def raw_loop(pl, lib, ctx, toks, n):
    ptr, smpl = ctx.ptr, pl.Sampler.greedy()
    ctx.prefill(toks)
    b = lib.llama_batch_init(1, 0, 1)
    try:
        pos = int(toks.size)
        tok = lib.llama_sampler_sample(smpl.ptr, ptr, -1)
        t0 = time.perf_counter()
        for i in range(n):  # what generate does after its first token: n decodes, n - 1 samples
            b.n_tokens = 1
            b.token[0], b.pos[0], b.n_seq_id[0], b.seq_id[0][0], b.logits[0] = tok, pos, 1, 0, 1
            rc = lib.llama_decode(ptr, b)
            if rc != 0:
                raise RuntimeError(f"decode failed at step {i}: llama_decode returned {rc}")
            if i < n - 1:
                tok = lib.llama_sampler_sample(smpl.ptr, ptr, -1)
            pos += 1
        return time.perf_counter() - t0, n - 1
    finally:
        lib.llama_batch_free(b)


def finish(args, results, failed) -> int:
    results["failed"] = failed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str))
    print(
        f"{len(results['checks']) - len(failed)}/{len(results['checks'])} checks passed; "
        f"wrote {out / 'gpu_check.json'}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
