"""HellaSwag tasks per second: ``pyllamacpp.evaluation.hellaswag`` against ``llama-perplexity
--hellaswag`` built from the same pin, on the same file, with the same settings.

    python tools/bench/bench_multiple_choice.py [-f FILE] [-n 40] [-t 1] [-c 512] [-b 2048] [-ub 512]
        [-np 1] [-r 3] [--exe build/llama-perplexity/bin/llama-perplexity] [--json out.json]

llama-perplexity is the one tests/test_scoring.py builds (``PYLLAMACPP_SLOW=1``, or the same cmake
commands by hand) into build/llama-perplexity/. One process for ours, the model loaded once; each
round runs both sides once, the order swapped from round to round (native ours, ours native...):

  native   ``llama-perplexity -m MODEL -f FILE --hellaswag --hellaswag-tasks N`` with the same -t,
           -c, -b, -ub, -np: the tasks' time is from its ``calculating hellaswag score`` log line
           (after the model load, the context and the tokenization; its log timestamps count from
           the process start) to the process's end
  ours     ``hellaswag(model, FILE, N, ...)`` in this process: its whole call, which also reads the
           file, tokenizes the tasks and makes the context (so the ratio leans against us)

Both print the same lines (tests/test_scoring.py checks it); this checks the accuracies agree
and reports the median tasks/s of each side and the median of the per-round ratios ours/native
(the issue's target: >= 0.95). It measures; it asserts nothing about time. The load average is
printed before and after: on a shared machine, compare within one run only.
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
from pathlib import Path

import pyllamacpp as pl
from pyllamacpp.evaluation.llama_perplexity import hellaswag, sample_path

ROOT = Path(__file__).resolve().parents[2]
_STAMP = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I hellaswag_score : calculating", re.M)


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
    ap.add_argument("--exe", type=Path, default=ROOT / "build" / "llama-perplexity" / "bin" / "llama-perplexity")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)
    if not a.exe.exists():
        raise SystemExit(f"{a.exe}: not built (PYLLAMACPP_SLOW=1 pytest tests/test_scoring.py -k hellaswag builds it)")
    path = a.file or sample_path("hellaswag")
    model_path = Path(a.model) if a.model else pl.default_model_path()
    settings = ["-c", str(a.ctx_size), "-b", str(a.batch_size), "-ub", str(a.ubatch_size), "-np", str(a.parallel)]
    nat_args = ["-f", str(path), "--hellaswag", "--hellaswag-tasks", str(a.tasks), "-t", str(a.threads), *settings]
    kw = dict(n_ctx=a.ctx_size, n_batch=a.batch_size, n_parallel=a.parallel, n_ubatch=a.ubatch_size)
    kw.update(n_threads=a.threads, n_threads_batch=a.threads)
    load0 = os.getloadavg()
    rows: list[dict] = []
    with pl.Model(model_path) as model:
        hellaswag(model, path, 2, **kw)  # warm: page cache, thread pool
        for r in range(a.rounds):
            got: dict[str, float] = {}
            for side in ("native", "ours") if r % 2 == 0 else ("ours", "native"):
                if side == "native":
                    s, out = native(a.exe, model_path, nat_args)
                    got["native"] = s
                    nat_out = out
                else:
                    res = hellaswag(model, path, a.tasks, **kw)
                    got["ours"] = res.seconds
                    n_tasks = res.n_tasks
                    ours_out = res.report() + "\n"
            same = ours_out == nat_out
            rows.append({"round": r, **got, "same_output": same})
            print(
                f"round {r}: native {got['native']:.2f} s, ours {got['ours']:.2f} s "
                f"({n_tasks / got['native']:.3f} / {n_tasks / got['ours']:.3f} tasks/s), same output: {same}",
                file=sys.stderr,
            )
    load1 = os.getloadavg()
    nat = statistics.median(n_tasks / r["native"] for r in rows)
    ours = statistics.median(n_tasks / r["ours"] for r in rows)
    ratio = statistics.median(r["native"] / r["ours"] for r in rows)
    cmd = " ".join(["python", "tools/bench/bench_multiple_choice.py", *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {cmd}")
    print(
        f"model {model_path.name}; {path.name}, {n_tasks} tasks; -t {a.threads} {' '.join(settings)}; {a.rounds} rounds"
    )
    print(f"load average {load0[0]:.1f} before, {load1[0]:.1f} after")
    print(f"{'side':<8} {'tasks/s':>9}")
    print(f"{'native':<8} {nat:>9.3f}")
    print(f"{'ours':<8} {ours:>9.3f}")
    same = all(r["same_output"] for r in rows)
    print(f"ours / native: {ratio:.3f} (median of the rounds' ratios); same output every round: {same}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"rounds": rows, "native_tps": nat, "ours_tps": ours, "ratio": ratio}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
