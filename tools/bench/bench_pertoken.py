"""Python's own cost per generated token: pyllamacpp's loops against a C loop, one process, one context.

    python tools/bench/bench_pertoken.py [-p 15] [-t 1] [-n 256] [--n-parallel 8] [--json out.json]

Both sides run on one tiny synthetic model (``pyllamacpp.testing.make_model``: 2 llama layers, a
decode of a few hundred µs on one thread), in this one process, on the very same context and sampler
chains, alternating which goes first (C, Python, Python, C, C ...). The C side is
``pertoken_loop`` (the source is ``NATIVE_SOURCE`` below), compiled with ``bench_core.build_driver``'s
command against the headers and the ``libllama`` the package loads, called through ctypes: the loop
of ``pl.generate`` / ``pl.generate_parallel`` step for step (one ``llama_decode`` per step, each
sequence sampled with its own chain at its own output index, a sequence's last token not decoded).
Both sides then decode the same tokens with the same weights, KV cells and threads, so

    Python µs per token = (Python seconds - C seconds) / tokens sampled

is pyllamacpp's code alone (for ``generate_parallel``: per sequence-step). Each run is timed from
the end of the prompt's decode to the end of the loop. The table gives medians over ``-p`` pairs
of the per-pair values, the ratio Python / C, and the issue's target (at most 10 µs). It measures;
it asserts nothing about time.

Workloads (rows):
  generate            ``list(pl.generate(ctx, prompt, n, sampler))``, greedy
  complete            ``"".join(model.complete(text, n, ctx=ctx, sampler=s, stream=True))``: text
                      pieces too (the C loop makes none, so the row includes the streaming detokenizer)
  parallel            ``pl.generate_parallel(ctx, prompt, 8, n, [one greedy chain per sequence])``;
                      both sides detokenize every sequence at the end, as generate_parallel does
  parallel, shared    the same with one Sampler for all sequences (examples/batched)
  scheduler           ``pl.Scheduler``: the same requests submitted at once, run with ``sched.run()``
                      (events and text pieces per token; ``run_scheduler`` of bench_scheduler.py)

Adding a workload (e.g. a continuous-batching scheduler) takes a few lines. Write the Python
side as ``run(ctx, prompt, n_predict, samplers, clock) -> (clock.elapsed(), tokens_per_sequence)``:
it runs the loop once from a cleared memory and reset samplers; ``clock`` (a ``PromptClock``) wraps
``ctx.decode`` and starts the span when the run's first decode (the prompt's) returns. Then::

    from bench_pertoken import compare_step_loop

    def run_scheduler(ctx, prompt, n_predict, samplers, clock):
        sched = pl.Scheduler(ctx)                        # the API is the scheduler's own
        reqs = [sched.submit(prompt, n_predict, s) for s in samplers]
        for _ in sched:
            pass
        return clock.elapsed(), [r.tokens for r in reqs]

    r = compare_step_loop(ctx, run_scheduler, prompt=tokens, n_seq=8, n_predict=64,
                          samplers=[pl.Sampler.greedy() for _ in range(8)], detok=True)
    r["cpu"]["py_us_per_token"], r["cpu"]["ratio"], r["same_tokens"]

``compare_step_loop`` builds the C loop on first use, alternates the sides ``pairs`` times and
returns medians per clock (``cpu``: this thread's CPU time, robust to a loaded machine with
``-t 1``; ``wall``), Python's own µs per token and the ratio, and whether both sides sampled the
same tokens. ``samplers`` is one chain per sequence, or one chain repeated (the C side then samples
every sequence with it, as Python does). The C loop decodes the prompt once with every seq id (the
context needs ``kv_unified=True`` for ``n_seq > 1``), then one token per live sequence per decode;
a loop that shares the prompt otherwise (``seq_cp``) differs only before the span starts. To get a
row in the table, add a branch in ``main`` as the ``parallel`` one.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_core import build_shared, checksum, ptr_addr, synthetic_tokens  # noqa: E402

# after bench_core.C_PRELUDE (llama.h, now_s), which build_shared puts first
NATIVE_SOURCE = r"""
// n_seq sequences from one prompt: the loop of pl.generate (n_seq 1) and pl.generate_parallel.
// Sequence s is sampled with smpl[s] at its own output index; it ends at an end-of-generation
// token or after n_predict tokens, its last token not decoded. detok: detokenize each sequence at
// the end (generate_parallel does). Returns the seconds from the end of the prompt's decode to
// the end (CLOCK_MONOTONIC, Python's perf_counter), or -1 when a decode failed; *cpu: the same
// span in this thread's CPU time (CLOCK_THREAD_CPUTIME_ID, Python's thread_time); *sum is
// bench_core's checksum (per sequence, h*31 + sum).
double pertoken_loop(struct llama_context * ctx, struct llama_sampler ** smpl, int n_seq,
                     const llama_token * prompt, int n_prompt, int n_predict, int detok,
                     int * n_sampled, int * n_decoded, uint32_t * sum, double * cpu) {
    const struct llama_vocab * vocab = llama_model_get_vocab(llama_get_model(ctx));
    int cap = n_prompt > n_seq ? n_prompt : n_seq;
    struct llama_batch b = llama_batch_init(cap, 0, n_seq);
    llama_token * toks = malloc(sizeof(llama_token) * (size_t) (n_seq * n_predict));
    int * n_toks = calloc((size_t) n_seq, sizeof(int));
    int * out_index = malloc(sizeof(int) * (size_t) n_seq);
    int * live = malloc(sizeof(int) * (size_t) n_seq);
    for (int i = 0; i < n_prompt; i++) {
        b.token[i] = prompt[i];
        b.pos[i] = i;
        b.n_seq_id[i] = n_seq;
        for (int s = 0; s < n_seq; s++) b.seq_id[i][s] = s;
        b.logits[i] = i == n_prompt - 1;
    }
    b.n_tokens = n_prompt;
    double t = -1;
    if (llama_decode(ctx, b) != 0) goto done;
    double t0 = now_s(CLOCK_MONOTONIC), c0 = now_s(CLOCK_THREAD_CPUTIME_ID);
    int n_live = n_predict > 0 ? n_seq : 0, pos = n_prompt, ns = 0, nd = 0;
    for (int s = 0; s < n_seq; s++) { out_index[s] = -1; live[s] = s; }
    while (n_live) {
        b.n_tokens = 0;
        int still = 0;
        for (int k = 0; k < n_live; k++) {
            int s = live[k];
            llama_token tok = llama_sampler_sample(smpl[s], ctx, out_index[s]);
            toks[s * n_predict + n_toks[s]++] = tok;
            ns++;
            if (llama_vocab_is_eog(vocab, tok) || n_toks[s] >= n_predict) continue;
            int i = b.n_tokens++;
            b.token[i] = tok;
            b.pos[i] = pos;
            b.n_seq_id[i] = 1;
            b.seq_id[i][0] = s;
            b.logits[i] = 1;
            out_index[s] = i;
            live[still++] = s;
        }
        n_live = still;
        if (!n_live) break;
        nd += b.n_tokens;
        if (llama_decode(ctx, b) != 0) goto done;
        pos++;
    }
    if (detok) {
        char text[1 << 16];
        for (int s = 0; s < n_seq; s++) {
            int n = n_toks[s];
            if (n && llama_vocab_is_eog(vocab, toks[s * n_predict + n - 1])) n--;
            llama_detokenize(vocab, &toks[s * n_predict], n, text, sizeof text, false, false);
        }
    }
    t = now_s(CLOCK_MONOTONIC) - t0;
    *cpu = now_s(CLOCK_THREAD_CPUTIME_ID) - c0;
    uint32_t h = 0;
    for (int s = 0; s < n_seq; s++) {
        uint32_t c = 2166136261u;
        for (int i = 0; i < n_toks[s]; i++) { c ^= (uint32_t) toks[s * n_predict + i]; c *= 16777619u; }
        h = h * 31u + c;
    }
    *n_sampled = ns;
    *n_decoded = nd;
    *sum = h;
done:
    free(live);
    free(out_index);
    free(n_toks);
    free(toks);
    llama_batch_free(b);
    return t;
}
"""


def native_pertoken_lib(verbose: bool = False) -> ctypes.CDLL:
    """``NATIVE_SOURCE`` compiled into ``build/pertoken.so`` (``bench_core.build_shared``)."""
    lib = build_shared("pertoken", NATIVE_SOURCE, verbose=verbose)
    c = ctypes
    lib.pertoken_loop.restype = c.c_double
    lib.pertoken_loop.argtypes = [
        c.c_void_p,
        c.POINTER(c.c_void_p),
        c.c_int,
        c.POINTER(c.c_int32),
        c.c_int,
        c.c_int,
        c.c_int,
        c.POINTER(c.c_int),
        c.POINTER(c.c_int),
        c.POINTER(c.c_uint32),
        c.POINTER(c.c_double),
    ]
    return lib


class PromptClock:
    """Wraps ``ctx.decode`` (what ``ctx.prefill`` and ``generate_parallel`` call): after
    :meth:`start`, the clocks are read when the first decode returns (a run's prompt), and
    :meth:`elapsed` gives the span from there. Cost: one Python call per decode, all before the
    start of the span in ``generate`` (its steps are C calls), one per step in ``generate_parallel``
    (a fraction of a µs, counted against Python)."""

    def __init__(self, ctx: Any) -> None:
        self.t0: tuple[float, float] | None = None
        orig, wall, cpu = ctx.decode, time.perf_counter, time.thread_time

        def decode(batch: Any) -> None:
            orig(batch)
            if self.t0 is None:
                self.t0 = (wall(), cpu())

        ctx.decode = decode

    def start(self) -> None:
        self.t0 = None

    def elapsed(self) -> tuple[float, float]:
        """``(wall, cpu)`` seconds since the first decode after :meth:`start`: ``perf_counter``
        (CLOCK_MONOTONIC) and ``thread_time`` (this thread's CPU time, CLOCK_THREAD_CPUTIME_ID)."""
        now = (time.perf_counter(), time.thread_time())
        if self.t0 is None:
            raise RuntimeError("no decode since start()")
        return now[0] - self.t0[0], now[1] - self.t0[1]


PythonRun = Callable[[Any, Any, int, Sequence[Any], PromptClock], tuple[tuple[float, float], list[list[int]]]]


def _seq_checksum(tokens_per_seq: list[list[int]]) -> int:
    h = 0
    for toks in tokens_per_seq:
        h = (h * 31 + checksum(toks)) & 0xFFFFFFFF
    return h


def _summary(nat: list[float], py: list[float], n: int) -> dict:
    """Per token: medians per side, Python's own cost (median over pairs of (Python - C) / n, and
    the difference of the two sides' minimums) and the median ratio Python / C."""
    over = [(p - c) / n * 1e6 for p, c in zip(py, nat)]
    return {
        "native_us_per_token": statistics.median(nat) / n * 1e6,
        "python_us_per_token": statistics.median(py) / n * 1e6,
        "py_us_per_token": statistics.median(over),
        "py_us_per_token_of_mins": (min(py) - min(nat)) / n * 1e6,
        "py_us_per_token_min": min(over),
        "py_us_per_token_max": max(over),
        "ratio": statistics.median(p / c for p, c in zip(py, nat)),
        "native_s_all": nat,
        "python_s_all": py,
    }


def compare_step_loop(
    ctx: Any,
    run: PythonRun,
    *,
    prompt: Any,
    n_seq: int,
    n_predict: int,
    samplers: Sequence[Any],
    pairs: int = 15,
    detok: bool = False,
    warmup: int = 1,
) -> dict:
    """Time a Python step loop against ``pertoken_loop`` on the same context, alternating.

    Args:
        ctx: The context (``kv_unified=True`` when ``n_seq > 1``).
        run: ``run(ctx, prompt, n_predict, samplers, clock) -> (clock.elapsed(), tokens per
            sequence)``: the Python side once, from a cleared memory and reset samplers.
        prompt: The prompt's token ids (int32 array), shared by every sequence.
        n_seq: How many sequences.
        n_predict: Most tokens per sequence.
        samplers: One chain per sequence (the same object repeated: one shared chain).
        pairs: Runs per side.
        detok: The C side detokenizes every sequence at the end (as generate_parallel does).
        warmup: Runs per side before the timed ones.

    Returns:
        Tokens sampled and decoded per run, ``same_tokens``, and per clock (``wall``: perf_counter;
        ``cpu``: this thread's CPU time, which time slices given to other processes do not
        inflate; meaningful with one decode thread) the medians per side in µs per token,
        ``py_us_per_token`` (median over pairs of (Python - C) / tokens sampled),
        ``py_us_per_token_of_mins`` and ``ratio`` (median of Python / C).

    Raises:
        RuntimeError: A decode of the C loop failed, or the sides sampled different token counts.
    """
    import numpy as np

    if not _LIB:  # built once per process
        _LIB.append(native_pertoken_lib())
    lib = _LIB[0]
    assert len(samplers) == n_seq
    toks = np.ascontiguousarray(prompt, dtype=np.int32)
    cprompt = toks.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
    chains = (ctypes.c_void_p * n_seq)(*[ptr_addr(s.ptr) for s in samplers])
    cptr = ctypes.c_void_p(ptr_addr(ctx.ptr))
    ns, nd, sm, cpu = ctypes.c_int(), ctypes.c_int(), ctypes.c_uint32(), ctypes.c_double()
    clock = PromptClock(ctx)
    unique = list({id(s): s for s in samplers}.values())

    def reset() -> None:
        ctx.memory.clear()
        for s in unique:
            s.reset()

    def native() -> tuple[float, float, int, int, int]:
        reset()
        t = lib.pertoken_loop(cptr, chains, n_seq, cprompt, int(toks.size), n_predict, int(detok), ns, nd, sm, cpu)
        if t < 0:
            raise RuntimeError("pertoken_loop: llama_decode failed")
        return t, cpu.value, ns.value, nd.value, sm.value

    def python() -> tuple[float, float, int, int]:
        reset()
        clock.start()
        (t, c), out = run(ctx, toks, n_predict, samplers, clock)
        return t, c, sum(len(o) for o in out), _seq_checksum(out)

    for _ in range(warmup):
        native(), python()
    wall: dict[str, list[float]] = {"c": [], "py": []}
    cpus: dict[str, list[float]] = {"c": [], "py": []}
    sums, counts = set(), set()
    n_decoded = 0
    for k in range(2 * pairs):
        if (k % 2 == 0) == (k % 4 < 2):  # C, py, py, C, C, py ...
            t, c, n, n_decoded, h = native()
            side = "c"
        else:
            t, c, n, h = python()
            side = "py"
        wall[side].append(t)
        cpus[side].append(c)
        sums.add(h)
        counts.add(n)
    if len(counts) != 1:
        raise RuntimeError(f"the sides sampled different numbers of tokens: {sorted(counts)}")
    n_sampled = counts.pop()
    return {
        "n_seq": n_seq,
        "n_sampled": n_sampled,
        "n_decoded": n_decoded,
        "same_tokens": len(sums) == 1,
        "wall": _summary(wall["c"], wall["py"], n_sampled),
        "cpu": _summary(cpus["c"], cpus["py"], n_sampled),
    }


_LIB: list[Any] = []


# -- the Python sides ----------------------------------------------------------------------------
def run_generate(ctx: Any, prompt: Any, n_predict: int, samplers: Sequence[Any], clock: PromptClock):
    import pyllamacpp as pl

    out = list(pl.generate(ctx, prompt, n_predict, samplers[0]))
    return clock.elapsed(), [out]


def make_run_complete(text: str) -> PythonRun:
    def run(ctx: Any, prompt: Any, n_predict: int, samplers: Sequence[Any], clock: PromptClock):
        stream = ctx.model.complete(text, n_predict, ctx=ctx, sampler=samplers[0], stream=True)
        "".join(stream)  # what a user streaming text does, less the printing
        return clock.elapsed(), [list(stream.tokens)]

    return run


def run_parallel(ctx: Any, prompt: Any, n_predict: int, samplers: Sequence[Any], clock: PromptClock):
    import pyllamacpp as pl

    shared = all(s is samplers[0] for s in samplers)
    res = pl.generate_parallel(ctx, prompt, len(samplers), n_predict, samplers[0] if shared else list(samplers))
    return clock.elapsed(), [r.tokens for r in res]


def synthetic_model(path: Path, n_layer: int, n_embd: int, n_vocab: int) -> Path:
    from pyllamacpp.testing import make_model

    return make_model(path, "llama", n_layer=n_layer, n_embd=n_embd, n_head=4, n_vocab=n_vocab, seed=1)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The synthetic model's sizes (``synthetic_model``): --n-layer, --n-embd, --n-vocab."""
    ap.add_argument("--n-layer", type=int, default=2, help="synthetic model: layers (2)")
    ap.add_argument("--n-embd", type=int, default=256, help="synthetic model: embedding size (256)")
    ap.add_argument("--n-vocab", type=int, default=4096, help="synthetic model: vocabulary (4096)")


def step_args(
    argv: list[str] | None,
    doc: str | None,
    *,
    pairs: int,
    workloads: str,
    add: Callable[[argparse.ArgumentParser], None],
) -> argparse.Namespace:
    """The flags of a ``compare_step_loop`` bench (also bench_scheduler.py's), parsed: -p and -t,
    the bench's own (``add``), the synthetic model's sizes, -w and --json."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-p", "--pairs", type=int, default=pairs, help=f"timed runs per side and workload ({pairs})")
    ap.add_argument("-t", "--threads", type=int, default=1, help="decode threads (1)")
    add(ap)
    add_model_args(ap)
    ap.add_argument("-w", "--workloads", default=workloads)
    ap.add_argument("--json", metavar="PATH", help="also write the raw results here")
    return ap.parse_args(argv)


@contextmanager
def step_context(a: argparse.Namespace, name: str, *, n_ctx: int, n_seq_max: int) -> Iterator[tuple[Any, Any, Any]]:
    """The synthetic model of ``a``'s sizes, written as ``name`` in a temporary folder, and the one
    context ``compare_step_loop`` runs on (also bench_scheduler.py's): -b 512, a unified KV cache,
    ``a.threads`` threads. Yields the model, the context and an 8-token prompt."""
    import pyllamacpp as pl

    with tempfile.TemporaryDirectory() as tmp:
        path = synthetic_model(Path(tmp) / name, a.n_layer, a.n_embd, a.n_vocab)
        with pl.Model(path) as model:
            with model.context(
                n_ctx=n_ctx,
                n_batch=512,
                n_seq_max=n_seq_max,
                kv_unified=True,
                n_threads=a.threads,
                n_threads_batch=a.threads,
            ) as ctx:
                yield model, ctx, synthetic_tokens(8, model.n_vocab)


def keep(rows: list[dict], r: dict, workload: str, label: str) -> None:
    """One workload's ``compare_step_loop`` result, named, kept in ``rows`` and printed to stderr."""
    r["workload"], r["label"] = workload, label
    rows.append(r)
    print(f"{workload}: {json.dumps(r)}", file=sys.stderr, flush=True)


def finish(
    rows: list[dict],
    a: argparse.Namespace,
    argv: list[str] | None,
    load_before: tuple[float, float, float],
    t_start: float,
    *,
    script: str,
    unit: str = "token",
    indent: int | None = None,
) -> None:
    """After the runs (also bench_scheduler.py's): the load, the command line, ``print_report``,
    and with ``--json`` the command, the loads and the rows written there."""
    load_after = os.getloadavg()
    cmd = f"python tools/bench/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
    print_report(rows, cmd, a, load_before, load_after, t_start, unit=unit)
    if a.json:
        out = dict(command=cmd, load_before=load_before, load_after=load_after, rows=rows)
        Path(a.json).write_text(json.dumps(out, indent=indent))


def print_report(
    rows: list[dict],
    cmd: str,
    a: argparse.Namespace,
    load_before: tuple[float, float, float],
    load_after: tuple[float, float, float],
    t_start: float,
    unit: str = "token",
) -> None:
    """The markdown report of ``compare_step_loop`` rows (also bench_scheduler.py's): the command,
    the model and the load, one table row per workload and clock, then what each row checked."""
    print(
        f"\n`{cmd.strip()}`: synthetic llama, {a.n_layer} layers, n_embd {a.n_embd}, n_vocab {a.n_vocab}; "
        f"{a.threads} thread(s); {a.pairs} pairs per workload, alternating, one process, one context; "
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}; {time.time() - t_start:.0f} s\n"
    )
    print(
        f"| workload | clock | C µs/{unit} | Python µs/{unit} | Python's own µs/{unit}: median of pairs (min..max) "
        "| of the minimums | Python / C | target | met |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        for k in ("cpu", "wall"):
            m = r[k]
            print(
                f"| {r['label']} | {k} | {m['native_us_per_token']:.1f} | {m['python_us_per_token']:.1f} | "
                f"{m['py_us_per_token']:.1f} ({m['py_us_per_token_min']:.1f}..{m['py_us_per_token_max']:.1f}) | "
                f"{m['py_us_per_token_of_mins']:.1f} | {m['ratio']:.3f} | <= 10 µs | "
                f"{'yes' if m['py_us_per_token'] <= 10 else 'no'} |"
            )
    print()
    print(
        "- cpu: this thread's CPU time (CLOCK_THREAD_CPUTIME_ID), which time given to other processes does not "
        "inflate; with one decode thread the decode runs in this thread. wall: CLOCK_MONOTONIC."
    )
    for r in rows:
        print(
            f"- {r['workload']}: {r['n_sampled']} tokens sampled, {r['n_decoded']} decoded per run; tokens "
            + ("identical on both sides" if r["same_tokens"] else "DIFFER between the sides")
        )


def _flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("-n", "--n-predict", type=int, default=256, help="generate/complete: tokens sampled (256)")
    ap.add_argument("--n-parallel", type=int, default=8, help="parallel: sequences (8)")
    ap.add_argument("--n-parallel-predict", type=int, default=64, help="parallel: tokens per sequence (64)")


def main(argv: list[str] | None = None) -> int:
    a = step_args(argv, __doc__, pairs=15, workloads="generate,complete,parallel,parallel_shared,scheduler", add=_flags)

    import pyllamacpp as pl

    _LIB.append(native_pertoken_lib(verbose=True))
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    load_before = os.getloadavg()
    t_start = time.time()
    rows: list[dict] = []
    n_ctx = max(1024, a.n_parallel * (a.n_parallel_predict + 16), a.n_predict + 64)
    with step_context(a, "pertoken.gguf", n_ctx=n_ctx, n_seq_max=max(a.n_parallel, 1)) as (model, ctx, prompt):
        text = "Once upon a time"
        for w in workloads:
            if w == "generate":
                r = compare_step_loop(
                    ctx, run_generate, prompt=prompt, n_seq=1, n_predict=a.n_predict,
                    samplers=[pl.Sampler.greedy()], pairs=a.pairs,
                )  # fmt: skip
                label = f"`generate`, 1 sequence, {a.n_predict} tokens"
            elif w == "complete":
                r = compare_step_loop(
                    ctx, make_run_complete(text), prompt=model.tokenize(text), n_seq=1,
                    n_predict=a.n_predict, samplers=[pl.Sampler.greedy()], pairs=a.pairs,
                )  # fmt: skip
                label = f"`complete(stream=True)`, {a.n_predict} tokens (text pieces too)"
            elif w in ("parallel", "parallel_shared"):
                n = a.n_parallel
                one = pl.Sampler.greedy()
                chains = [pl.Sampler.greedy() for _ in range(n)] if w == "parallel" else [one] * n
                r = compare_step_loop(
                    ctx, run_parallel, prompt=prompt, n_seq=n, n_predict=a.n_parallel_predict,
                    samplers=chains, pairs=a.pairs, detok=True,
                )  # fmt: skip
                which = "a chain per sequence" if w == "parallel" else "one shared Sampler"
                label = f"`generate_parallel`, {n} sequences x {a.n_parallel_predict}, {which} (per seq-step)"
            elif w == "scheduler":
                from bench_scheduler import run_scheduler

                n = a.n_parallel
                r = compare_step_loop(
                    ctx, run_scheduler, prompt=prompt, n_seq=n, n_predict=a.n_parallel_predict,
                    samplers=[pl.Sampler.greedy() for _ in range(n)], pairs=a.pairs, detok=True,
                )  # fmt: skip
                label = f"`Scheduler`, {n} requests x {a.n_parallel_predict}, events and text (per seq-step)"
            else:
                raise SystemExit(f"unknown workload {w}")
            keep(rows, r, w, label)
    finish(rows, a, argv, load_before, t_start, script="bench_pertoken.py", indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
