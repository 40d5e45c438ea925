"""HellaSwag tasks per second on one file, four ways: ``llama-perplexity --hellaswag`` built from
the same pin, ``pyllamacpp.evaluation.hellaswag`` (its batch layout, copied), ``pl.loglikelihood``
(the trie engine) and each ending decoded on its own.

    python tools/bench/bench_multiple_choice.py [-f FILE] [-n 40] [-t 1] [-c 512] [-b 2048] [-ub 512]
        [-np 1] [-r 3] [--sides native,ours,trie,unshared] [--trie-batch 63] [--trie-seq-max 16]
        [--trie-ctx N] [--exe build/llama-perplexity/bin/llama-perplexity] [--json out.json]

llama-perplexity is the one tests/test_scoring.py builds (``PYLLAMACPP_SLOW=1``, or the same cmake
commands by hand) into build/llama-perplexity/. One process for ours, the model loaded once; each
round runs every side once, the order rotated from round to round (native ours trie unshared,
then ours trie unshared native...):

  native   ``llama-perplexity -m MODEL -f FILE --hellaswag --hellaswag-tasks N`` with the same -t,
           -c, -b, -ub, -np: the tasks' time is from its ``calculating hellaswag score`` log line
           (after the model load, the context and the tokenization; its log timestamps count from
           the process start) to the process's end
  ours     ``hellaswag(model, FILE, N, ...)`` in this process: its whole call, which also reads the
           file, tokenizes the tasks and makes the context (so the ratio leans against us)
  trie     the same N tasks (the package's reader and llama-perplexity's pick) as 4N token requests
           to ``pl.loglikelihood``: each ending's ``context + " " + ending`` tokenized whole, as
           llama-perplexity does, the context the tokens all 4 endings share, the continuation the
           rest; acc_norm is the argmax of each task's 4 mean log-probabilities (sum / tokens).
           Timed over reading, tokenizing and the call (which makes its context); ``--trie-batch``
           (n_batch = n_ubatch, the engine's default 63), ``--trie-seq-max``, ``--trie-ctx``
           (default: the engine's)
  unshared the same 4N requests, each decoded on its own in one context (memory cleared before
           each; context + continuation less its last token, logits at the continuation's rows:
           bench_evaluation.py's unshared side), n_batch = n_ubatch = ``--trie-batch``; timed over
           reading, tokenizing, the context and the decodes

ours and native print the same lines (tests/test_scoring.py checks it); this checks that each
round, and reports the median tasks/s of each side, the medians of the per-round ratios
side/native (the issue's target for the trie: >= 0.95), the tokens fed to ``llama_decode`` and
the ``llama_decode`` calls of ours, the trie and unshared (llama-perplexity's are ours's: the same
layout), the median of the per-round wall-time ratios unshared/trie, and what the trie changed
against ours (tasks whose pick differs, the largest |difference| of an ending's mean
log-probability, both accuracies) and against unshared (the largest |difference| of a
request's summed log-probability). It measures; it asserts nothing about time. The load average
is printed before and after: on a shared machine, compare within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_evaluation import unshared  # noqa: E402

import pyllamacpp as pl  # noqa: E402
from pyllamacpp.evaluation._mc_data import read_hellaswag  # noqa: E402
from pyllamacpp.evaluation._mc_random import hellaswag_order  # noqa: E402
from pyllamacpp.evaluation.llama_perplexity import _prep, hellaswag, sample_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I hellaswag_score : calculating", re.M)
SIDES = ("native", "ours", "trie", "unshared")


@dataclass
class Run:
    """One side's round: its time, and (but for native) what it picked and decoded."""

    seconds: float
    tasks: list[int] = field(default_factory=list)  # the file's task indices, in the order scored
    pred: np.ndarray | None = None  # (N,) the ending picked
    means: np.ndarray | None = None  # (N, 4) each ending's mean log-probability
    sums: np.ndarray | None = None  # (4N,) each ending's summed log-probability (trie, unshared)
    gold: list[int] = field(default_factory=list)
    n_tokens: int = 0  # tokens fed to llama_decode
    n_decodes: int = 0
    text: str = ""  # native and ours: the printed lines
    stats: dict = field(default_factory=dict)  # trie: the engine's counts (Loglikelihoods.summary)


def native(exe: Path, model: Path, args: list[str]) -> tuple[float, str]:
    """``(seconds of the tasks, stdout)`` of one llama-perplexity run."""
    t0 = time.perf_counter()
    r = subprocess.run([str(exe), "-m", str(model), *args], capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({r.returncode}):\n{r.stderr[-3000:]}")
    m = _STAMP.search(r.stderr)
    if m is None:
        raise SystemExit("no 'calculating hellaswag score' line with a timestamp in llama-perplexity's log")
    minutes, sec, ms, us = (int(g) for g in m.groups())
    return wall - (minutes * 60 + sec + ms / 1e3 + us / 1e6), r.stdout


def ours(model: pl.Model, path: Path, n_tasks: int, kw: dict) -> Run:
    """One ``hellaswag`` call."""
    res = hellaswag(model, path, n_tasks, **kw)
    t = res.tasks
    return Run(
        res.seconds, [x.task for x in t], np.array([x.pred for x in t]), np.array([x.scores for x in t]),
        gold=[x.gold[0] for x in t], n_tokens=res.n_tokens, n_decodes=res.n_decodes, text=res.report() + "\n",
    )  # fmt: skip


def hellaswag_requests(model: pl.Model, path: Path, n_tasks: int) -> tuple[list[int], list[int], list[tuple]]:
    """``(tasks, gold, requests)``: the tasks llama-perplexity picks (the file's indices, in its
    order), their right endings, and per ending a token request: the tokens all 4 endings of its
    task share (``context + " " + ending`` tokenized whole, as ``hellaswag_score`` does) and the
    ending's tokens after them, which are the tokens it scores."""
    tasks = read_hellaswag(path)
    order = hellaswag_order(len(tasks), n_tasks)
    requests = []
    for i in order:
        t = tasks[i]
        p = _prep(model, [t.context + " " + e for e in t.endings], f"HellaSwag task {i} (line {t.line})")
        requests += [(s[: p.cp], s[p.cp :]) for s in p.seqs]
    return order, [tasks[i].gold for i in order], requests


def _picked(t0: float, order: list[int], gold: list[int], sums: np.ndarray, lengths: np.ndarray) -> Run:
    means = (sums / lengths).reshape(-1, 4)
    return Run(time.perf_counter() - t0, order, means.argmax(axis=1), means, sums, gold)  # argmax: the first best


def trie(model: pl.Model, path: Path, n_tasks: int, kw: dict) -> Run:
    """The tasks through ``pl.loglikelihood``, tokenizing included."""
    t0 = time.perf_counter()
    order, gold, requests = hellaswag_requests(model, path, n_tasks)
    res = pl.loglikelihood(model, requests, progress=False, **kw)
    run = _picked(t0, order, gold, np.array([x.logprob for x in res]), np.array([x.n_tokens for x in res]))
    run.n_tokens, run.n_decodes, run.stats = res.n_decoded, res.n_decodes, res.summary()
    return run


def unshared_side(model: pl.Model, path: Path, n_tasks: int, n_batch: int, n_threads: int) -> Run:
    """Each request decoded on its own in one context, tokenizing and the context included."""
    t0 = time.perf_counter()
    order, gold, requests = hellaswag_requests(model, path, n_tasks)
    pairs = [(np.concatenate([c, x]), int(c.size)) for c, x in requests]
    kw = dict(n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads, n_threads_batch=n_threads)
    with model.context(n_ctx=max(s.size for s, _ in pairs), n_seq_max=1, **kw) as ctx:
        res, fed = unshared(ctx, pairs)
    run = _picked(t0, order, gold, np.array([lp for lp, _ in res]), np.array([x.size for _, x in requests]))
    run.n_tokens, run.n_decodes = fed, sum(-(-(s.size - 1) // n_batch) for s, _ in pairs)
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("-f", "--file", type=Path, default=None, help="HellaSwag file (default: the 40 tasks shipped)")
    ap.add_argument("-n", "--tasks", type=int, default=40, help="--hellaswag-tasks (default 40)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-c", "--ctx-size", type=int, default=512)
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("-ub", "--ubatch-size", type=int, default=512)
    ap.add_argument("-np", "--parallel", type=int, default=1)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)} (all)")
    ap.add_argument("--trie-batch", type=int, default=63, help="n_batch = n_ubatch of trie and unshared (63)")
    ap.add_argument("--trie-seq-max", type=int, default=16, help="the trie's n_seq_max (16)")
    ap.add_argument("--trie-ctx", type=int, default=None, help="the trie's n_ctx (default: the engine's)")
    ap.add_argument("--exe", type=Path, default=ROOT / "build" / "llama-perplexity" / "bin" / "llama-perplexity")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)
    sides = tuple(s.strip() for s in a.sides.split(",") if s.strip())
    if not sides or any(s not in SIDES for s in sides) or len(set(sides)) != len(sides):
        raise SystemExit(f"--sides {a.sides!r}: name each of {', '.join(SIDES)} at most once")
    if "native" in sides and not a.exe.exists():
        raise SystemExit(f"{a.exe}: not built (PYLLAMACPP_SLOW=1 pytest tests/test_scoring.py -k hellaswag builds it)")
    path = a.file or sample_path("hellaswag")
    model_path = Path(a.model) if a.model else pl.default_model_path()
    settings = ["-c", str(a.ctx_size), "-b", str(a.batch_size), "-ub", str(a.ubatch_size), "-np", str(a.parallel)]
    nat_args = ["-f", str(path), "--hellaswag", "--hellaswag-tasks", str(a.tasks), "-t", str(a.threads), *settings]
    kw = dict(n_ctx=a.ctx_size, n_batch=a.batch_size, n_parallel=a.parallel, n_ubatch=a.ubatch_size)
    kw.update(n_threads=a.threads, n_threads_batch=a.threads)
    trie_kw = dict(n_batch=a.trie_batch, n_seq_max=a.trie_seq_max, n_ctx=a.trie_ctx, n_threads=a.threads)
    n_tasks = min(a.tasks, len(read_hellaswag(path)))  # as llama-perplexity, which scores all when asked for more
    load0 = os.getloadavg()
    rows: list[dict] = []
    last: dict[str, Run] = {}
    with pl.Model(model_path) as model:
        hellaswag(model, path, 2, **kw)  # warm: page cache, thread pool
        for r in range(a.rounds):
            got: dict[str, Run] = {}
            k = r % len(sides)
            for side in sides[k:] + sides[:k]:
                if side == "native":
                    s, out = native(a.exe, model_path, nat_args)
                    got[side] = Run(s, text=out)
                elif side == "ours":
                    got[side] = ours(model, path, a.tasks, kw)
                elif side == "trie":
                    got[side] = trie(model, path, a.tasks, trie_kw)
                else:
                    got[side] = unshared_side(model, path, a.tasks, a.trie_batch, a.threads)
            row: dict = {"round": r, **{s: got[s].seconds for s in sides}}
            if "native" in got and "ours" in got:
                row["same_output"] = got["ours"].text == got["native"].text
            rows.append(row)
            last = got
            times = ", ".join(f"{s} {got[s].seconds:.2f} s ({n_tasks / got[s].seconds:.3f} tasks/s)" for s in sides)
            same = f", same output: {row['same_output']}" if "same_output" in row else ""
            print(f"round {r}: {times}{same}", file=sys.stderr)
    load1 = os.getloadavg()
    tps = {s: statistics.median(n_tasks / row[s] for row in rows) for s in sides}
    vs_native = {s: statistics.median(row["native"] / row[s] for row in rows) for s in sides if "native" in sides}
    cmd = " ".join(["python", "tools/bench/bench_multiple_choice.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {cmd}")
    print(
        f"model {model_path.name}; {path.name}, {n_tasks} tasks; -t {a.threads} {' '.join(settings)}; "
        f"trie and unshared -b {a.trie_batch}, trie n_seq_max {a.trie_seq_max}, n_ctx {a.trie_ctx or 'default'}; "
        f"{a.rounds} rounds"
    )
    print(f"load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"{'side':<9} {'tasks/s':>9} {'/ native':>9} {'tokens decoded':>15} {'llama_decode calls':>19}")
    for s in sides:
        ratio = f"{vs_native[s]:.3f}" if s in vs_native else "-"
        toks, calls = (f"{last[s].n_tokens:,}", f"{last[s].n_decodes:,}") if s != "native" else ("-", "-")
        print(f"{s:<9} {tps[s]:>9.3f} {ratio:>9} {toks:>15} {calls:>19}")
    out: dict = {"command": cmd, "sides": list(sides), "n_tasks": n_tasks, "rounds": rows, "loadavg": [load0, load1]}
    out.update(tps=tps, ratio_to_native=vs_native)
    out["tokens"] = {s: last[s].n_tokens for s in sides if s != "native"}
    out["decodes"] = {s: last[s].n_decodes for s in sides if s != "native"}
    if "trie" in sides:
        out["trie_stats"] = last["trie"].stats
    if "native" in sides:
        print("(/ native: the median of the rounds' ratios; llama-perplexity decodes ours's batches)")
    if "native" in sides and "ours" in sides:
        same = all(row["same_output"] for row in rows)
        out.update(native_tps=tps["native"], ours_tps=tps["ours"], ratio=vs_native["ours"], same_output=same)
        print(f"ours / native: {vs_native['ours']:.3f}; same output every round: {same}")
    if "trie" in sides and "native" in sides:
        print(f"trie / native: {vs_native['trie']:.3f} (the issue's target: >= 0.95)")
    if "trie" in sides and "unshared" in sides:
        tr, un = last["trie"], last["unshared"]
        wall = statistics.median(row["unshared"] / row["trie"] for row in rows)
        d = np.abs(tr.sums - un.sums)  # type: ignore[operator]
        out["unshared_vs_trie"] = {
            "tokens_ratio": un.n_tokens / tr.n_tokens, "wall_ratio": wall,
            "max_abs_diff_logprob": float(d.max()), "requests_differing": int((d > 0).sum()),
            "picks_differing": int((tr.pred != un.pred).sum()),
        }  # fmt: skip
        print(
            f"tokens decoded: trie {tr.n_tokens:,} / unshared {un.n_tokens:,} ({un.n_tokens / tr.n_tokens:.2f}x); "
            f"wall unshared / trie: {wall:.2f} (median of the rounds' ratios)"
        )
        print(
            f"trie against unshared: max |d logprob| {d.max():.4g} ({int((d > 0).sum())} of {d.size} requests "
            f"differ at all), {int((tr.pred != un.pred).sum())} pick(s) differ"
        )
    if "trie" in sides and "ours" in sides:
        tr, ou = last["trie"], last["ours"]
        if tr.tasks != ou.tasks:
            raise SystemExit("trie and ours scored different tasks: the pick of the tasks is not shared")
        d = np.abs(tr.means - ou.means)  # type: ignore[operator]
        differ = [ou.tasks[i] for i in np.flatnonzero(tr.pred != ou.pred)]
        acc = {s: float(np.mean(last[s].pred == np.array(last[s].gold))) for s in ("ours", "trie")}
        out["trie_vs_ours"] = {
            "picks_differing": len(differ), "tasks_differing": differ, "max_abs_diff_mean_logprob": float(d.max()),
            "endings_differing_1e-6": int((d > 1e-6).sum()), "accuracy": acc,
        }  # fmt: skip
        print(
            f"trie against ours: {len(differ)} of {n_tasks} picks differ{f' (tasks {differ})' if differ else ''}; "
            f"max |d mean logprob| {d.max():.4g} ({int((d > 1e-6).sum())} of {d.size} endings by more than 1e-6); "
            f"acc_norm ours {acc['ours']:.4f}, trie {acc['trie']:.4f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
