"""Speculative decoding against plain generate: speed-up, exactness, and Python's own cost per verify.

    python tools/bench/bench_speculative.py [-t 1] [-p 3] [-s ngram,layerskip,python,exactness,rows] [--json out.json]

Sections (each a table in the report; every ratio is measured in this one process, on one context,
the two sides alternating: plain, speculative, speculative, plain, ...):

  ngram       lookup decoding (``NgramDraft``) on the ``quote`` workload of ``pyllamacpp
              speculative`` (a chat request to repeat a 30-line Python module with one name
              changed), the default model, ``--n-quote`` tokens, for each ``--ngram-drafts``
              length: tokens/s of both sides (the prompt's prefill included on both), the
              speed-up (median over pairs), whether the greedy tokens are identical, acceptance,
              tokens per verify. ``--requant q4_0`` adds the same rows on a Q4_0 requantization of
              the default model (``llama_model_quantize``, written once under the build folder):
              its batched matmuls have repacked kernels, the default model's Q4_1 has none.
  layerskip   ``ModelDraft.layer_skip`` at each depth of ``--depths`` on the ``free`` workload (a
              short story), for each ``--skip-drafts`` length: the best depth and its speed-up.
  python      Python's own cost per verify step, measured as the per-token budget is
              (``bench_pertoken.py``): the tiny synthetic model of that bench, one context, the
              Python loop (``generate_speculative``) against a C loop that replays the very same
              rounds (the drafts the Python side made, recorded: same decodes, same samples, same
              ``seq_rm``), alternating, ``--py-pairs`` pairs. Python's own µs per verify =
              (Python span - C span) / rounds, both spans from the end of the prompt's prefill to
              the last token, thread CPU time and wall. Two Python rows: the loop alone (the
              recorded drafts handed back) and with ``NgramDraft`` looking them up.
  exactness   greedy ``generate_speculative`` (n-gram drafts, ``--exact-draft`` tokens) against
              plain ``generate`` on ``--exact-prompts`` prompts of the default model, ``--n-exact``
              tokens each: how many runs differ, where, and the target's top-1 minus top-2 logit
              at the first difference (from one batched decode of the plain continuation).
  scheduler   the quote workload as a ``Scheduler`` request with an ``NgramDraft`` (``--sched-draft``
              tokens) against the same request without one, alone and beside ``--sched-others``
              plain requests that share its batches (list prompts, as many tokens): the time
              per side from the end of the first step (every prompt's prefill) to the last
              token, the speed-up, the quote request's
              acceptance, and which requests' tokens differ between the sides (0: the one with
              the draft; with the index of the first token that differs).
  rows        what a verify batch costs: one decode of r rows, every row with logits, against a
              one-row decode, on the default model (and ``--requant`` models): the ceiling of
              any speed-up, since r rows buy at most r tokens.

Speed-ups are given in wall time and in this thread's CPU time (``time.thread_time``): with
``-t 1`` (the default) ggml computes in the calling thread, so CPU time leaves out the time the
process waited for a core, which a loaded machine adds unevenly to the two sides.

It measures; it asserts nothing about time. Figures depend on the machine and its load (printed
with the report): compare ratios from one run, not across runs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import BUILD, build_shared, ptr_addr, synthetic_tokens  # noqa: E402

from pyllamacpp.speculative import Draft  # noqa: E402

# after bench_core.C_PRELUDE (llama.h, now_s), which build_shared puts first
NATIVE_SOURCE = r"""
// generate_speculative's rounds, replayed: the prompt but its last token is prefilled (untimed),
// then round r decodes [last, drafts[r]...] with logits for every row, samples rows while they agree
// with the draft (llama_sampler_sample: it accepts each token), and cuts the sequence back with
// llama_memory_seq_rm; the rounds after the recorded ones have no draft (the Python loop asks no
// draft when n_predict leaves room for one token only), until n_predict tokens or an end token.
// Returns the seconds from the end of the prefill to the last token (wall; *cpu: this thread's
// CPU time), or -1 when a decode failed; *n_out: tokens sampled; *n_rounds.
double spec_loop(struct llama_context * ctx, struct llama_sampler * smpl, const llama_token * prompt,
                 int n_prompt, const int * draft_len, const llama_token * drafts, int n_rounds_max,
                 int n_predict, llama_token * out, int * n_out, int * n_rounds, double * cpu) {
    const struct llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    llama_memory_t mem = llama_get_memory(ctx);
    int cap = n_prompt > 256 ? n_prompt : 256;
    struct llama_batch b = llama_batch_init(cap, 0, 1);
    double t = -1;
    for (int i = 0; i < n_prompt - 1; i++) {
        b.token[i] = prompt[i]; b.pos[i] = i; b.n_seq_id[i] = 1; b.seq_id[i][0] = 0;
        b.logits[i] = i == n_prompt - 2;
    }
    b.n_tokens = n_prompt - 1;
    if (b.n_tokens > 0 && llama_decode(ctx, b) != 0) goto done;
    double t0 = now_s(CLOCK_MONOTONIC), c0 = now_s(CLOCK_THREAD_CPUTIME_ID);
    llama_token last = prompt[n_prompt - 1];
    int pos = n_prompt - 1, produced = 0, off = 0, r = 0;
    for (;; r++) {
        int n = r < n_rounds_max ? draft_len[r] : 0; // past the recorded rounds: no draft
        const llama_token * d = drafts + off;
        off += n;
        b.n_tokens = n + 1;
        for (int i = 0; i <= n; i++) {
            b.token[i] = i == 0 ? last : d[i - 1]; b.pos[i] = pos + i; b.n_seq_id[i] = 1;
            b.seq_id[i][0] = 0; b.logits[i] = 1;
        }
        if (llama_decode(ctx, b) != 0) goto done;
        int m = 0, stop = 0;
        for (int i = 0; i <= n; i++) {
            llama_token tok = llama_sampler_sample(smpl, ctx, i);
            out[produced + m++] = tok;
            int hit = i < n && tok == d[i];
            if (llama_vocab_is_eog(vocab, tok) || produced + m == n_predict) { stop = 1; break; }
            if (!hit) break;
        }
        llama_memory_seq_rm(mem, 0, pos + m, -1);
        produced += m;
        last = out[produced - 1];
        pos += m;
        if (stop) { r++; break; }
    }
    t = now_s(CLOCK_MONOTONIC) - t0;
    *cpu = now_s(CLOCK_THREAD_CPUTIME_ID) - c0;
    *n_out = produced;
    *n_rounds = r;
done:
    llama_batch_free(b);
    return t;
}
"""

DEFAULT_EXACT_PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "The three most important things to know about volcanoes are",
    "def fibonacci(n):\n",
    "<|im_start|>user\nWhat is the capital of Spain?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList five fruits.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nExplain what a hash table is in two sentences.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "In 1969, the first humans",
    "Water boils at",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "A recipe for pancakes:\n1.",
    "The difference between a list and a tuple in Python is",
    "<|im_start|>user\nRepeat this Python code exactly, renaming add to plus. Reply with the code only.\n\n"
    "```python\ndef add(a, b):\n    total = a + b\n    return total\n\n\ndef scale(values, factor):\n"
    "    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n```<|im_end|>\n"
    "<|im_start|>assistant\n```python\n",
    "Count from one to twenty in words: one, two, three, four,",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "<|im_start|>user\nWrite one sentence about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Dear Sir or Madam,\n\nI am writing to",
    "import numpy as np\n\n\ndef normalize(x):\n",
    "The theory of relativity says that",
    "<|im_start|>user\nTranslate 'good morning' into French, Spanish and German.<|im_end|>\n<|im_start|>assistant\n",
    "Step 1: Preheat the oven to 180 degrees.\nStep 2:",
    "SELECT name, age FROM users WHERE",
    "The mitochondria is",
    "<|im_start|>user\nGive me three tips for better sleep.<|im_end|>\n<|im_start|>assistant\n",
]


def native_spec_lib() -> ctypes.CDLL:
    """``NATIVE_SOURCE`` compiled into ``build/speculative.so`` (``bench_core.build_shared``)."""
    lib = build_shared("speculative", NATIVE_SOURCE)
    c = ctypes
    lib.spec_loop.restype = c.c_double
    lib.spec_loop.argtypes = [
        c.c_void_p,
        c.c_void_p,
        c.POINTER(c.c_int32),
        c.c_int,
        c.POINTER(c.c_int),
        c.POINTER(c.c_int32),
        c.c_int,
        c.c_int,
        c.POINTER(c.c_int32),
        c.POINTER(c.c_int),
        c.POINTER(c.c_int),
        c.POINTER(c.c_double),
    ]
    return lib


def _sweep(ctx: Any, prompt: Any, n: int, draft: Any, drafts: list[int], pairs: int, label: str) -> list[dict]:
    import pyllamacpp as pl

    rows = []
    for nd in drafts:
        c = pl.compare_speculative(ctx, prompt, n, draft, n_draft=nd, repeat=pairs)
        st = c["speculative"]["stats"]
        rows.append(
            {
                "label": label,
                "n_draft": nd,
                "plain_tps": c["plain"]["tokens_per_s"],
                "spec_tps": c["speculative"]["tokens_per_s"],
                "speedup": c["speedup"],
                "speedups": c["speedups"],
                "speedup_cpu": c["speedup_cpu"],
                "speedups_cpu": c["speedups_cpu"],
                "same_tokens": c["same_tokens"],
                "first_difference": c["first_difference"],
                "n_tokens": c["n_tokens"],
                "acceptance_rate": st["acceptance_rate"],
                "acceptance_at": st["acceptance_at"],
                "tokens_per_round": st["tokens_per_round"],
                "n_rounds": st["n_rounds"],
                "t_draft": st["t_draft"],
                "t_target": st["t_target"],
                "t_total": st["t_total"],
            }
        )
        print(f"{label} n_draft {nd}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def _requant(src: Path, kind: str) -> Path:
    import pyllamacpp as pl
    from pyllamacpp import ffi, lib

    out = BUILD / f"{src.stem}.requant-{kind}.gguf"
    if out.exists() and out.stat().st_mtime_ns > src.stat().st_mtime_ns:
        return out
    BUILD.mkdir(exist_ok=True)
    p = lib.llama_model_quantize_default_params()
    p.ftype = {"q4_0": lib.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": lib.LLAMA_FTYPE_MOSTLY_Q8_0}[kind]
    p.allow_requantize = True
    pp = ffi.new("llama_model_quantize_params *", p)
    tmp = out.with_name(out.name + ".tmp")
    pl.sync_log_level()
    if lib.llama_model_quantize(os.fsencode(src), os.fsencode(tmp), pp) != 0:
        raise SystemExit(f"llama_model_quantize failed for {kind}")
    os.replace(tmp, out)
    return out


def _requantized(kinds: str) -> list[tuple[str, Path]]:
    """The default model, then its requantization to each of ``kinds`` (comma-separated): (name, path)."""
    import pyllamacpp as pl

    default = pl.default_model_path()
    return [("default", default), *((kind, _requant(default, kind)) for kind in kinds.split(",") if kind)]


def section_ngram(a: argparse.Namespace) -> list[dict]:
    import pyllamacpp as pl
    from pyllamacpp.experiments.speculative import WORKLOADS

    rows = []
    for name, path in _requantized(a.requant):
        with pl.Model(path) as m, m.context(n_ctx=2048, n_threads=a.threads, n_threads_batch=a.threads) as ctx:
            toks = m.tokenize(WORKLOADS["quote"], parse_special=True)
            rows += _sweep(ctx, toks, a.n_quote, pl.NgramDraft(), _ints(a.ngram_drafts), a.pairs, f"ngram, {name}")
    return rows


def section_layerskip(a: argparse.Namespace) -> list[dict]:
    import pyllamacpp as pl
    from pyllamacpp.experiments.speculative import WORKLOADS

    rows = []
    with pl.Model() as m, m.context(n_ctx=2048, n_threads=a.threads, n_threads_batch=a.threads) as ctx:
        toks = m.tokenize(WORKLOADS["free"], parse_special=True)
        for k in _ints(a.depths):
            with pl.ModelDraft.layer_skip(
                m, k, n_ctx=2048, n_threads=a.threads, n_threads_batch=a.threads, p_min=a.p_min
            ) as d:
                for r in _sweep(ctx, toks, a.n_free, d, _ints(a.skip_drafts), a.pairs, f"layer-skip {k}/{m.n_layer}"):
                    rows.append({**r, "depth": k})
    return rows


class _Recorder(Draft):
    """Wraps a draft and records what it proposed per round (cut to n_max, as the loop cuts it)."""

    def __init__(self, inner: Draft) -> None:
        self.inner, self.rounds = inner, []

    def begin(self, history: list[int]) -> None:
        self.rounds = []
        self.inner.begin(history)

    def draft(self, history: list[int], n_max: int) -> list[int]:
        d = self.inner.draft(history, n_max)[:n_max]
        self.rounds.append(d)
        return d


class _Replay(Draft):
    """Hands back recorded drafts, one per round: the loop's own cost, without a lookup."""

    def __init__(self, rounds: list[list[int]]) -> None:
        self.rounds, self.i = rounds, 0

    def begin(self, history: list[int]) -> None:
        self.i = 0

    def draft(self, history: list[int], n_max: int) -> list[int]:
        d = self.rounds[self.i] if self.i < len(self.rounds) else []
        self.i += 1
        return d[:n_max]


def section_python(a: argparse.Namespace) -> list[dict]:
    import numpy as np

    import pyllamacpp as pl
    from pyllamacpp.testing import make_model

    lib = native_spec_lib()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "tiny.gguf", "llama", n_layer=2, n_embd=256, n_head=4, n_vocab=4096, seed=1)
        with pl.Model(path) as m, m.context(n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads) as ctx:
            unit = synthetic_tokens(16, m.n_vocab)
            prompt = np.concatenate([unit] * 4).astype(np.int32)
            n = a.n_python
            smpl = pl.Sampler.greedy()
            rec = _Recorder(pl.NgramDraft())
            ctx.memory.clear()
            s = pl.generate_speculative(ctx, prompt, n, rec, smpl, n_draft=a.py_draft)
            ref = list(s)
            rounds = rec.rounds
            lens = (ctypes.c_int * len(rounds))(*[len(d) for d in rounds])
            flat = [t for d in rounds for t in d] or [0]
            dr = (ctypes.c_int32 * len(flat))(*flat)
            cp = np.ascontiguousarray(prompt)
            cprompt = cp.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
            out = (ctypes.c_int32 * (n + 16))()
            n_out, n_rounds, cpu = ctypes.c_int(), ctypes.c_int(), ctypes.c_double()
            cctx, csmpl = ctypes.c_void_p(ptr_addr(ctx.ptr)), ctypes.c_void_p(ptr_addr(smpl.ptr))

            def native() -> tuple[float, float, list[int], int]:
                ctx.memory.clear()
                smpl.reset()
                t = lib.spec_loop(
                    cctx, csmpl, cprompt, int(prompt.size), lens, dr, len(rounds), n, out, n_out, n_rounds, cpu
                )
                if t < 0:
                    raise RuntimeError("spec_loop: llama_decode failed")
                return t, cpu.value, list(out[: n_out.value]), n_rounds.value

            def python(draft: Any) -> tuple[float, float, list[int], int]:
                ctx.memory.clear()
                smpl.reset()
                w0, c0 = time.perf_counter(), time.thread_time()
                sp = pl.generate_speculative(ctx, prompt, n, draft, smpl, n_draft=a.py_draft)
                it = iter(sp)
                first = next(it)  # the prefill and the first round
                t_pre = sp.stats.t_prefill
                got = [first, *it]
                w, c = time.perf_counter() - w0 - t_pre, time.thread_time() - c0 - t_pre
                return w, c, got, sp.stats.n_rounds

            for label, make in (
                ("loop alone (recorded drafts handed back)", lambda: _Replay(rounds)),
                ("with NgramDraft looking them up", pl.NgramDraft),
            ):
                for _ in range(2):  # warm-up
                    native(), python(make())
                wall: dict[str, list[float]] = {"c": [], "py": []}
                cpus: dict[str, list[float]] = {"c": [], "py": []}
                same = True
                nr = 0
                for k in range(2 * a.py_pairs):
                    if (k % 2 == 0) == (k % 4 < 2):
                        t, c, got, nr = native()
                        side = "c"
                    else:
                        t, c, got, nr = python(make())
                        side = "py"
                    wall[side].append(t)
                    cpus[side].append(c)
                    same &= got == ref
                rows.append(
                    {
                        "label": label,
                        "n_tokens": len(ref),
                        "n_rounds": nr,
                        "tokens_per_round": len(ref) / nr,
                        "same_tokens": same,
                        **{
                            f"{clock}_{k}": v
                            for clock, d in (("cpu", cpus), ("wall", wall))
                            for k, v in _py_cost(d["c"], d["py"], nr).items()
                        },
                    }
                )
                print(f"python: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def _py_cost(nat: list[float], py: list[float], n_rounds: int) -> dict:
    over = [(p - c) / n_rounds * 1e6 for p, c in zip(py, nat)]
    return {
        "c_us_per_round": statistics.median(nat) / n_rounds * 1e6,
        "py_us_per_round": statistics.median(py) / n_rounds * 1e6,
        "own_us": statistics.median(over),
        "own_us_min": min(over),
        "own_us_max": max(over),
    }


def section_exactness(a: argparse.Namespace) -> list[dict]:
    import numpy as np

    import pyllamacpp as pl

    prompts = DEFAULT_EXACT_PROMPTS[: a.exact_prompts]
    rows = []
    with pl.Model() as m, m.context(n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads) as ctx:
        for text in prompts:
            toks = m.tokenize(text, parse_special=True)
            ctx.memory.seq_rm(0)
            plain = list(pl.generate(ctx, toks, a.n_exact))
            ctx.memory.seq_rm(0)
            s = pl.generate_speculative(ctx, toks, a.n_exact, pl.NgramDraft(), n_draft=a.exact_draft)
            got = list(s)
            diff = next((i for i, (x, y) in enumerate(zip(plain, got)) if x != y), None)
            margin = None
            if diff is not None:  # the target's own top-1 minus top-2 at that step, in one batched decode
                ctx.memory.seq_rm(0)
                allt = np.concatenate([toks, plain[:diff]]).astype(np.int32)
                b = pl.Batch(allt.size, 1, model=m)
                b.add_sequence(allt, 0, 0, logits="last")
                ctx.decode(b)
                srt = np.sort(ctx.logits())
                margin = float(srt[-1] - srt[-2])
            rows.append(
                {
                    "prompt": text[:40],
                    "n_tokens": len(plain),
                    "first_difference": diff,
                    "margin_at_difference": margin,
                    "n_drafted": s.stats.n_drafted,
                    "n_accepted": s.stats.n_accepted,
                }
            )
            print(f"exactness: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    return rows


def section_rows(a: argparse.Namespace) -> list[dict]:
    """What a verify batch costs: one decode of r rows (all with logits) against one of 1 row."""
    import numpy as np

    import pyllamacpp as pl

    out = []
    for name, path in _requantized(a.requant):
        with pl.Model(path) as m, m.context(n_ctx=1024, n_threads=a.threads, n_threads_batch=a.threads) as ctx:
            toks = m.tokenize("Once upon a time, in a small village by the sea, there lived an old fisherman who")
            ctx.prefill(toks)
            n0 = int(toks.size)
            b = pl.Batch(64, 1, model=m)
            widths = _ints(a.widths)
            cpu: dict[int, list[float]] = {r: [] for r in widths}
            wall: dict[int, list[float]] = {r: [] for r in widths}
            for _ in range(a.rows_repeat):
                for r in widths:
                    b.clear()
                    b.add_sequence(np.resize(toks, r), 0, n0, logits="all")
                    w, c = time.perf_counter(), time.thread_time()
                    ctx.decode(b)
                    wall[r].append(time.perf_counter() - w)
                    cpu[r].append(time.thread_time() - c)
                    ctx.memory.seq_rm(0, n0, -1)
            c1, w1 = statistics.median(cpu[widths[0]]), statistics.median(wall[widths[0]])
            for r in widths:
                out.append(
                    {
                        "model": name,
                        "rows": r,
                        "cpu_ms": statistics.median(cpu[r]) * 1e3,
                        "cpu_x": statistics.median(cpu[r]) / c1,
                        "wall_ms": statistics.median(wall[r]) * 1e3,
                        "wall_x": statistics.median(wall[r]) / w1,
                    }
                )
                print(f"rows: {json.dumps(out[-1])}", file=sys.stderr, flush=True)
    return out


def section_scheduler(a: argparse.Namespace) -> list[dict]:
    """A draft per request in the Scheduler: the whole run with the quote request's draft and without."""
    import pyllamacpp as pl
    from pyllamacpp.experiments.prefix import LISTS, SYSTEM_PROMPT
    from pyllamacpp.experiments.speculative import WORKLOADS

    out = []
    with pl.Model() as m:
        quote = m.tokenize(WORKLOADS["quote"], parse_special=True)
        for n_others in _ints(a.sched_others):
            kw = dict(n_ctx=2048, n_seq_max=n_others + 1, kv_unified=True, n_threads=a.threads)
            with m.context(**kw, n_threads_batch=a.threads) as ctx:
                times: dict[str, list[float]] = {"plain": [], "draft": []}
                toks: dict[str, list] = {}
                stats = {}
                for i in range(a.pairs):
                    for side in ("plain", "draft") if i % 2 == 0 else ("draft", "plain"):
                        sched = pl.Scheduler(ctx, prefix_cache=False)
                        d = pl.NgramDraft() if side == "draft" else None
                        r = sched.submit(quote, a.n_quote, draft=d, n_draft=a.sched_draft)
                        others = [sched.submit(SYSTEM_PROMPT + q, a.n_quote) for q in LISTS[:n_others]]
                        sched.step()  # every prompt's prefill (one batch): not timed
                        w = time.perf_counter()
                        steps = 1
                        while not sched.idle:
                            sched.step()
                            steps += 1
                        times[side].append(time.perf_counter() - w)
                        toks[side] = [r.tokens] + [o.tokens for o in others]
                        if side == "draft":
                            stats = {"acceptance_rate": r.acceptance_rate, "n_drafted": r.n_drafted, "steps": steps}
                        else:
                            stats_plain_steps = steps
                sp = [p / q for p, q in zip(times["plain"], times["draft"])]
                out.append(
                    {
                        "n_others": n_others,
                        "n_draft": a.sched_draft,
                        "n_tokens": a.n_quote * (n_others + 1),
                        "plain_s": statistics.median(times["plain"]),
                        "draft_s": statistics.median(times["draft"]),
                        "speedup": statistics.median(sp),
                        "speedups": sp,
                        "same_tokens": toks["plain"] == toks["draft"],
                        # which requests (0: the one with the draft) and from which token on
                        "differ": [
                            (k, next(j for j, (x, y) in enumerate(zip(p, q)) if x != y))
                            for k, (p, q) in enumerate(zip(toks["plain"], toks["draft"]))
                            if p != q
                        ],
                        "steps_plain": stats_plain_steps,
                        **stats,
                    }
                )
                print(f"scheduler: {json.dumps(out[-1])}", file=sys.stderr, flush=True)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _pairs(xs: list[float]) -> str:
    """Per-pair figures as the tables print them: two decimals, comma-separated."""
    return ", ".join(f"{x:.2f}" for x in xs)


def _f2(x: float | None) -> str:
    """A figure with two decimals; None as it is (a row with nothing drafted has no acceptance)."""
    return str(x) if x is None else f"{x:.2f}"


def report(a: argparse.Namespace, cmd: str, res: dict, load: tuple, t0: float) -> None:
    print(
        f"\n`{cmd}`: {a.threads} thread(s), {a.pairs} pair(s) per row (alternating), load average before "
        f"{load[0][0]:.2f}/{load[0][1]:.2f}/{load[0][2]:.2f}, after {load[1][0]:.2f}/{load[1][1]:.2f}/"
        f"{load[1][2]:.2f}; {time.time() - t0:.0f} s\n"
    )
    for key in ("ngram", "layerskip"):
        rows = res.get(key)
        if not rows:
            continue
        print(
            "| draft | n_draft | plain t/s | speculative t/s | speed-up, wall (pairs) | speed-up, CPU time (pairs) "
            "| same tokens | acceptance | tokens/verify |"
        )
        print("|---|---:|---:|---:|---|---|---|---:|---:|")
        for r in rows:
            same = "yes" if r["same_tokens"] else f"no (token {r['first_difference']})"
            print(
                f"| {r['label']} | {r['n_draft']} | {r['plain_tps']:.1f} | {r['spec_tps']:.1f} | "
                f"**{r['speedup']:.2f}** ({_pairs(r['speedups'])}) | **{r['speedup_cpu']:.2f}** "
                f"({_pairs(r['speedups_cpu'])}) | {same} | {_f2(r['acceptance_rate'])} | {r['tokens_per_round']:.2f} |"
            )
        if key == "layerskip":
            best = max(rows, key=lambda r: r["speedup_cpu"])
            print(
                f"\nbest: {best['label']}, n_draft {best['n_draft']}: speed-up {best['speedup_cpu']:.2f} "
                f"(CPU time), {best['speedup']:.2f} (wall)"
            )
        print()
    rows = res.get("rows")
    if rows:
        print("| model | rows | CPU ms | x 1 row | wall ms | x 1 row |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['model']} | {r['rows']} | {r['cpu_ms']:.1f} | {r['cpu_x']:.2f} | {r['wall_ms']:.1f} | "
                f"{r['wall_x']:.2f} |"
            )
        print()
    rows = res.get("scheduler")
    if rows:
        print(
            "| other requests | n_draft | tokens in all | plain s | with the draft s | speed-up (pairs) | steps "
            "| acceptance | requests whose tokens differ |"
        )
        print("|---:|---:|---:|---:|---:|---|---|---:|---|")
        for r in rows:
            print(
                f"| {r['n_others']} | {r['n_draft']} | {r['n_tokens']} | {r['plain_s']:.2f} | {r['draft_s']:.2f} | "
                f"**{r['speedup']:.2f}** ({_pairs(r['speedups'])}) | {r['steps_plain']} -> {r['steps']} | "
                f"{_f2(r['acceptance_rate'])} | {r['differ'] or 'none'} |"
            )
        print()
    rows = res.get("python")
    if rows:
        print(
            "| Python side | clock | C µs/verify | Python µs/verify "
            "| Python's own µs/verify (min..max) | tokens/verify |"
        )
        print("|---|---|---:|---:|---:|---:|")
        for r in rows:
            for clock in ("cpu", "wall"):
                print(
                    f"| {r['label']} | {clock} | {r[f'{clock}_c_us_per_round']:.1f} | "
                    f"{r[f'{clock}_py_us_per_round']:.1f} | **{r[f'{clock}_own_us']:.1f}** "
                    f"({r[f'{clock}_own_us_min']:.1f}..{r[f'{clock}_own_us_max']:.1f}) | {r['tokens_per_round']:.2f} |"
                )
        print(
            f"\n{rows[0]['n_tokens']} tokens in {rows[0]['n_rounds']} verifies per run; tokens identical on both "
            f"sides: {all(r['same_tokens'] for r in rows)}\n"
        )
    rows = res.get("exactness")
    if rows:
        n_diff = sum(r["first_difference"] is not None for r in rows)
        print(f"exactness: {n_diff} of {len(rows)} greedy runs differ from plain generate")
        print("| prompt | tokens | first difference | top-1 - top-2 there | drafted | accepted |")
        print("|---|---:|---:|---:|---:|---:|")
        for r in rows:
            m, d = r["margin_at_difference"], r["first_difference"]
            print(
                f"| {r['prompt']!r} | {r['n_tokens']} | {'-' if d is None else d}"
                f" | {'-' if m is None else f'{m:.4f}'} | {r['n_drafted']} | {r['n_accepted']} |"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--threads", type=int, default=1, help="decode threads (1)")
    ap.add_argument("-p", "--pairs", type=int, default=3, help="runs per side and row, ngram/layerskip (3)")
    ap.add_argument("-s", "--sections", default="rows,ngram,layerskip,python,exactness")
    ap.add_argument("--n-quote", type=int, default=192, help="ngram: tokens per run (192)")
    ap.add_argument("--ngram-drafts", default="2,4,8,16", help="ngram: draft lengths (2,4,8,16)")
    ap.add_argument("--requant", default="", help="ngram: also on these requantizations (q4_0, q8_0)")
    ap.add_argument("--n-free", type=int, default=96, help="layerskip: tokens per run (96)")
    ap.add_argument("--depths", default="8,16,22,26,28", help="layerskip: layers kept (8,16,22,26,28)")
    ap.add_argument("--skip-drafts", default="1,2,4", help="layerskip: draft lengths (1,2,4)")
    ap.add_argument("--p-min", type=float, default=0.0, help="layerskip: ModelDraft p_min (0)")
    ap.add_argument("--n-python", type=int, default=256, help="python: tokens per run (256)")
    ap.add_argument("--py-draft", type=int, default=4, help="python: n_draft (4)")
    ap.add_argument("--py-pairs", type=int, default=15, help="python: pairs (15)")
    ap.add_argument("--exact-prompts", type=int, default=24, help="exactness: prompts (24)")
    ap.add_argument("--n-exact", type=int, default=96, help="exactness: tokens per prompt (96)")
    ap.add_argument("--exact-draft", type=int, default=8, help="exactness: n_draft (8)")
    ap.add_argument("--sched-others", default="0,1,3", help="scheduler: plain requests beside it (0,1,3)")
    ap.add_argument("--sched-draft", type=int, default=3, help="scheduler: n_draft (3)")
    ap.add_argument("--widths", default="1,2,3,4,5,6,9,17", help="rows: batch widths (1,2,3,4,5,6,9,17)")
    ap.add_argument("--rows-repeat", type=int, default=7, help="rows: decodes per width (7)")
    ap.add_argument("--json", metavar="PATH", help="also write the raw results here")
    a = ap.parse_args(argv)
    cmd = "python tools/bench/bench_speculative.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load0, t0 = os.getloadavg(), time.time()
    res: dict[str, Any] = {}
    fns = {
        "ngram": section_ngram,
        "layerskip": section_layerskip,
        "python": section_python,
        "exactness": section_exactness,
        "rows": section_rows,
        "scheduler": section_scheduler,
    }
    for s in [x.strip() for x in a.sections.split(",") if x.strip()]:
        if s not in fns:
            raise SystemExit(f"unknown section {s}: {sorted(fns)}")
        res[s] = fns[s](a)
    load1 = os.getloadavg()
    report(a, cmd.strip(), res, (load0, load1), t0)
    if a.json:
        Path(a.json).write_text(json.dumps({"command": cmd, "load": [load0, load1], **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
