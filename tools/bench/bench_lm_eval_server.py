"""The lm-eval run of tests/test_evaluation.py's local tasks through two backends: lm-eval's own
``gguf`` (HTTP to llama.cpp's ``llama-server``, built from the vendored pin) and ``pyllamacpp``.

    python tools/bench/bench_lm_eval_server.py [-r 2] [-t 1] [--n-ctx 512] [-b 63] [--json out.json]

Opt-in: it builds ``build/llama-server/bin/llama-server`` once when it is missing (a build folder
of its own: the vendored llama.cpp configured as the package's libraries, Release, shared,
GGML_NATIVE, AMX compiled out, the server on, tests and examples off, ccache as the compiler
launcher when it is on PATH; only that target, ``-j2``; log in ``build.log`` there), then starts
it on a free loopback port with the default model (``pl.Model().path``), ``n_ctx``, threads and
batch the same as this side's, one slot, and waits for ``/health``.

The tasks are the test's (``write_tasks``, imported from tests/test_evaluation.py), written to a
temporary folder: ``pyl_mc``, 8 questions x 4 choices after a 3-shot header (32 loglikelihood
requests), and ``pyl_gen``, 4 greedy generations of at most 8 tokens, stopped at a newline. A
third task of this bench's own, ``pyl_gen_ws``, is ``pyl_gen`` with lm-eval's ``remove_whitespace``
filter before its ``exact_match`` (and the target without its leading space), the way lm-eval's
own generation tasks filter their answers: the gguf backend strips the text it returns, ours
returns it as decoded, so ``pyl_gen``'s metric tells the two apart and ``pyl_gen_ws``'s does not.

First it sends the gguf backend's own loglikelihood request (``/v1/completions`` with ``prompt =
context + continuation``, ``max_tokens=1``, ``echo=true``, ``logprobs=10``, ``temperature=0``)
for the first ``pyl_mc`` request and keeps the server's reply. Where the server refuses it, or
its reply lacks what ``lm_eval.models.gguf.get_result`` reads (``logprobs.text_offset``,
``tokens``, ``token_logprobs``, ``top_logprobs`` over the echoed prompt), the gguf side cannot
score a multiple-choice task: lm-eval's own gguf run of ``pyl_mc`` is tried once and the error it
raises kept, the comparison covers the generation task only, the report says so with the reply,
and this side's multiple-choice metrics are given on their own.

Each round runs ``lm_eval.simple_evaluate`` with ``model="gguf"`` (``base_url``) and with
``model="pyllamacpp"`` (``model=PATH,n_ctx=...,n_threads=...``: its wall time includes loading
the model) over the compared tasks, the order swapped from round to round (gguf first in round
0). The gguf backend sends no ``max_gen_toks``, so the server's ``--n-predict`` is the task's.
The report gives both sides' metrics (every number of lm-eval's results, compared exactly), each
sample whose filtered response differs, the wall time of each run, the medians and their ratio
(gguf / pyllamacpp). It measures; it exits 0 with a difference reported. The server is stopped
in every case (Ctrl-C and errors included).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "llama-server"
SRC = ROOT / "vendor" / "llama.cpp"
# ggml-cpu without AMX, as the package's CMakeLists.txt builds it (llama.cpp#20824 at this pin),
# its flags after ggml's own through a call deferred to the end of the configure step
AMX_HOOK = (
    "function(_pyl_amx_off)\n  if(TARGET ggml-cpu)\n    target_compile_options(ggml-cpu PRIVATE "
    "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)\n  endif()\nendfunction()\n"
    "cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL _pyl_amx_off)\n"
)
TASKS = ["pyl_mc", "pyl_gen", "pyl_gen_ws"]
GEN_TASKS = ["pyl_gen", "pyl_gen_ws"]
GGUF_LOGPROBS_KEYS = ("text_offset", "tokens", "token_logprobs", "top_logprobs")


def llama_server() -> Path:
    """``build/llama-server/bin/llama-server``, built when missing (``build_seconds.txt`` keeps
    how long the build took)."""
    exe = BUILD / "bin" / "llama-server"
    if exe.exists():
        return exe
    if not (SRC / "tools" / "server" / "server.cpp").exists():
        raise SystemExit("no vendored llama.cpp sources in vendor/llama.cpp")
    BUILD.mkdir(parents=True, exist_ok=True)
    hook = BUILD / "amx_off.cmake"
    hook.write_text(AMX_HOOK)
    launcher = []
    if shutil.which("ccache"):
        launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    cfg = [
        "cmake", "-S", str(SRC), "-B", str(BUILD), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_CCACHE=OFF", f"-DCMAKE_PROJECT_INCLUDE={hook}",
        *launcher,
    ]  # fmt: skip
    log_path = BUILD / "build.log"
    print(f"building llama-server (log: {log_path.relative_to(ROOT)}) ...", file=sys.stderr, flush=True)
    steps = [cfg, ["cmake", "--build", str(BUILD), "--target", "llama-server", "-j2"]]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        for cmd in steps:  # configure, then only that target
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    (BUILD / "build_seconds.txt").write_text(f"{seconds:.0f}\n")
    print(f"built llama-server in {seconds:.0f} s", file=sys.stderr)
    return exe


def free_port() -> int:
    """A loopback port nobody listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``llama-server`` as a context manager: started, ``/health`` awaited, always stopped."""

    def __init__(self, exe: Path, args: list[str], log_path: Path, timeout: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [str(exe), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.log_path, self.timeout = log_path, timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def __enter__(self) -> Server:
        import requests

        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            t_end = time.monotonic() + self.timeout
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                        return self
                except requests.RequestException:
                    pass  # not listening yet
                if time.monotonic() > t_end:
                    raise RuntimeError(f"llama-server not healthy after {self.timeout:.0f} s:\n{self.log_tail()}")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None and not self._log.closed:
            self._log.close()

    def log_tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")


def write_tasks(d: Path) -> None:
    """The test's local tasks (tests/test_evaluation.py's ``write_tasks``) into ``d``."""
    spec = importlib.util.spec_from_file_location("_pyl_test_evaluation", ROOT / "tests" / "test_evaluation.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_tasks(d)
    gen = (d / "pyl_gen.yaml").read_text()
    ws = gen.replace("task: pyl_gen\n", "task: pyl_gen_ws\n").replace(
        'doc_to_target: " {{answer}}"', "doc_to_target: answer"
    )
    if ws == gen or "doc_to_target: answer\n" not in ws:
        raise SystemExit("tests/test_evaluation.py's pyl_gen task changed shape: update write_tasks here")
    filters = (
        "filter_list:\n  - name: strip\n    filter:\n"
        "      - function: remove_whitespace\n      - function: take_first\n"
    )
    (d / "pyl_gen_ws.yaml").write_text(ws + filters)


def task(task_manager: Any, name: str) -> Any:
    """lm-eval's task object of that name."""
    return task_manager.load([name])["tasks"][name]


def first_loglikelihood_request(task_manager: Any) -> tuple[str, str]:
    """``(context, continuation)`` of ``pyl_mc``'s first request, as lm-eval builds it."""
    mc = task(task_manager, "pyl_mc")
    mc.build_all_requests(limit=1, rank=0, world_size=1)
    context, continuation = mc.instances[0].args
    return context, continuation


def probe_loglikelihood(url: str, context: str, continuation: str) -> dict[str, Any]:
    """The gguf backend's loglikelihood request (its ``gguf_completion`` body), sent once: the
    HTTP status, the reply, and whether ``get_result`` could read it."""
    import requests

    body: dict[str, Any] = {
        "prompt": context + continuation,
        "logprobs": 10,
        "temperature": 0.0,
        "max_tokens": 1,
        "echo": True,
    }
    r = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    try:
        reply: Any = r.json()
    except ValueError:
        reply = r.text
    readable, finding = False, f"HTTP {r.status_code}: {json.dumps(reply)[:600]}"
    if r.ok and isinstance(reply, dict) and reply.get("choices"):
        choice = reply["choices"][0]
        lp = choice.get("logprobs") or {}
        readable = isinstance(lp, dict) and all(k in lp for k in GGUF_LOGPROBS_KEYS)
        if not readable:
            keys = sorted(lp) if isinstance(lp, dict) else type(lp).__name__
            n = len(lp.get("content") or []) if isinstance(lp, dict) else 0
            usage = reply.get("usage", {})
            finding = (
                f"HTTP {r.status_code} with text {choice.get('text')!r} (echo=true: the prompt not echoed), "
                f"logprobs keys {keys} with {n} entries for {usage.get('prompt_tokens')} prompt and "
                f"{usage.get('completion_tokens')} completion tokens; lm_eval.models.gguf.get_result reads "
                f"logprobs[{', '.join(GGUF_LOGPROBS_KEYS)}] over the echoed prompt"
            )
    return {"request": body, "status": r.status_code, "reply": reply, "readable_by_gguf": readable, "finding": finding}


def lm_eval_error(model: str, model_args: dict[str, Any], tasks: list[str], task_manager: Any) -> str | None:
    """What ``simple_evaluate`` raises on those tasks (None: it ran)."""
    try:
        evaluate(model, model_args, tasks, task_manager)
    except Exception as e:  # the finding reported, not a failure of the bench
        return f"{type(e).__name__}: {e}"
    return None


def evaluate(model: Any, model_args: dict[str, Any], tasks: list[str], task_manager: Any) -> dict[str, Any]:
    """One ``lm_eval.simple_evaluate``: its wall time, results and each sample's filtered response."""
    import lm_eval  # type: ignore[import-untyped, import-not-found]

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=tasks, task_manager=task_manager, log_samples=True
    )
    seconds = time.perf_counter() - t0
    assert out is not None
    samples = {
        t: {s["doc_id"]: s["filtered_resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])}
        for t in tasks
    }
    results = {t: {k: v for k, v in out["results"][t].items() if k != "alias"} for t in tasks}
    return {"seconds": seconds, "results": results, "samples": samples}


def plain(v: Any) -> str:
    """A result as a number or a string (numpy's scalars without their type's name)."""
    return repr(v.item() if hasattr(v, "item") else v)


def differences(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Every results entry and every sample's filtered response that differ between two runs."""
    metrics, samples = [], []
    for t in a["results"]:
        ra, rb = a["results"][t], b["results"][t]
        for k in sorted(set(ra) | set(rb)):
            if ra.get(k) != rb.get(k) and not (ra.get(k) != ra.get(k) and rb.get(k) != rb.get(k)):  # NaN == NaN
                metrics.append(f"{t} {k}: gguf {plain(ra.get(k))}, pyllamacpp {plain(rb.get(k))}")
        for doc in sorted(set(a["samples"][t]) | set(b["samples"][t])):
            sa, sb = a["samples"][t].get(doc), b["samples"][t].get(doc)
            if sa != sb:
                why = ""
                if isinstance(sa, list) and isinstance(sb, list) and all(isinstance(x, str) for x in sa + sb):
                    if [x.strip() for x in sa] == [x.strip() for x in sb]:
                        why = " (equal after str.strip(): gguf's generate_until strips the text)"
                samples.append(f"{t} doc {doc}: gguf {sa!r}, pyllamacpp {sb!r}{why}")
    return metrics, samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-r", "--rounds", type=int, default=2, help="rounds, each one run of each side (default 2)")
    p.add_argument("-t", "--threads", type=int, default=1, help="n_threads and n_threads_batch, both sides")
    p.add_argument("--n-ctx", type=int, default=512, help="n_ctx of both sides (the test's 512)")
    p.add_argument("-b", "--n-batch", type=int, default=63, help="n_batch = n_ubatch, both sides (our default 63)")
    p.add_argument(
        "--preload",
        action="store_true",
        help="pass this side a PyllamacppLM over a model loaded once (its load out of the timing,\n"
        'as the server\'s is) instead of model="pyllamacpp" with model_args',
    )
    p.add_argument("--json", help="write the report here as JSON")
    a = p.parse_args()
    if a.rounds < 1:
        p.error("-r must be at least 1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import lm_eval.models.gguf  # type: ignore[import-untyped, import-not-found]  # noqa: F401 (registers "gguf")
    from lm_eval.tasks import TaskManager  # type: ignore[import-untyped, import-not-found]

    import pyllamacpp as pl
    import pyllamacpp.evaluation.lm_eval  # noqa: F401  (registers "pyllamacpp")

    exe = llama_server()
    model_path = str(pl.Model().path)
    seconds_file = BUILD / "build_seconds.txt"
    report: dict[str, Any] = {
        "command": " ".join(["python", "tools/bench/bench_lm_eval_server.py", *sys.argv[1:]]),
        "model": os.path.basename(model_path),
        "loadavg_start": list(os.getloadavg()),
        "n_ctx": a.n_ctx,
        "threads": a.threads,
        "n_batch": a.n_batch,
        "server_build_seconds": int(seconds_file.read_text()) if seconds_file.exists() else None,
    }
    ours: dict[str, Any] = {"model": model_path, "n_ctx": a.n_ctx, "n_threads": a.threads, "n_batch": a.n_batch}
    t0 = time.perf_counter()
    loaded = pl.Model(model_path)
    report["pyllamacpp_model_load_seconds"] = time.perf_counter() - t0  # what model_args pay in each run
    ours_model: Any = "pyllamacpp"
    if a.preload:
        ours_model = pyllamacpp.evaluation.lm_eval.PyllamacppLM(**{**ours, "model": loaded})
    report["pyllamacpp_model"] = "PyllamacppLM instance (model loaded once)" if a.preload else "pyllamacpp"
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_tasks(d)
        tm = TaskManager(include_path=str(d))
        n_predict = int(task(tm, "pyl_gen").config.generation_kwargs["max_gen_toks"])
        server_args: list[str] = [
            "-m", model_path, "-c", str(a.n_ctx), "-np", "1", "-t", str(a.threads), "-tb", str(a.threads),
            "-b", str(a.n_batch), "-ub", str(a.n_batch), "--n-predict", str(n_predict),
        ]  # fmt: skip
        report["server_args"] = [os.path.basename(model_path) if s == model_path else s for s in server_args]
        with Server(exe, server_args, BUILD / "server.log") as srv:
            ctx, cont = first_loglikelihood_request(tm)
            probe = probe_loglikelihood(srv.url, ctx, cont)
            path_json = json.dumps(model_path)[1:-1]  # the reply names the model by its path: no machine paths
            probe["reply"] = json.loads(json.dumps(probe["reply"]).replace(path_json, os.path.basename(model_path)))
            report["probe"] = probe
            compared = TASKS if probe["readable_by_gguf"] else GEN_TASKS
            report["compared_tasks"] = compared
            if not probe["readable_by_gguf"]:
                print(f"gguf loglikelihood request answered: {probe['finding']}", file=sys.stderr, flush=True)
                err = lm_eval_error("gguf", {"base_url": srv.url}, ["pyl_mc"], tm)
                report["gguf_pyl_mc_error"] = err
                print(f"lm-eval's gguf run of pyl_mc: {err or 'ran'}; compared: {compared}", file=sys.stderr)
            runs: dict[str, list[dict[str, Any]]] = {"gguf": [], "pyllamacpp": []}
            for rnd in range(a.rounds):
                order = ["gguf", "pyllamacpp"] if rnd % 2 == 0 else ["pyllamacpp", "gguf"]
                for side in order:
                    if side == "gguf":
                        run = evaluate("gguf", {"base_url": srv.url}, compared, tm)
                    else:
                        run = evaluate(ours_model, ours, compared, tm)
                    runs[side].append(run)
                    print(f"round {rnd} {side:10s} {run['seconds']:7.2f} s", file=sys.stderr, flush=True)
        alone = [t for t in TASKS if t not in compared]
        if alone:
            report["pyllamacpp_only"] = evaluate(ours_model, ours, alone, tm)
    g, o = runs["gguf"], runs["pyllamacpp"]
    metric_diffs, sample_diffs = [], []
    for rg in g:
        for ro in o:
            m, s = differences(rg, ro)
            metric_diffs += [x for x in m if x not in metric_diffs]
            sample_diffs += [x for x in s if x not in sample_diffs]
    med_g = statistics.median(r["seconds"] for r in g)
    med_o = statistics.median(r["seconds"] for r in o)
    report.update(
        loadavg_end=list(os.getloadavg()),
        gguf={"seconds": [r["seconds"] for r in g], "results": g[0]["results"], "samples": g[0]["samples"]},
        pyllamacpp={"seconds": [r["seconds"] for r in o], "results": o[0]["results"], "samples": o[0]["samples"]},
        same_across_rounds={k: all(r["results"] == v[0]["results"] for r in v) for k, v in runs.items()},
        metric_differences=metric_diffs,
        sample_differences=sample_diffs,
        median_seconds={"gguf": med_g, "pyllamacpp": med_o},
        ratio_gguf_over_pyllamacpp=med_g / med_o,
    )
    print(f"model {report['model']}, n_ctx {a.n_ctx}, threads {a.threads}, n_batch {a.n_batch}, rounds {a.rounds}")
    load_s = report["pyllamacpp_model_load_seconds"]
    print(f"pyllamacpp side: {report['pyllamacpp_model']}; the model loads in {load_s:.2f} s")
    print(f"load average (1, 5, 15 min) at start {report['loadavg_start']}, at end {report['loadavg_end']}")
    if not probe["readable_by_gguf"]:
        print(f"gguf loglikelihood (pyl_mc's first request, gguf's own body): {probe['finding']}")
        print(f"lm-eval's gguf run of pyl_mc: {report['gguf_pyl_mc_error'] or 'ran'}")
        print("  -> pyl_mc cannot be scored on the gguf side; compared:", ", ".join(compared))
    for t in compared:
        for k, v in g[0]["results"][t].items():
            print(f"{t:8s} {k:24s} gguf {plain(v):24s} pyllamacpp {plain(o[0]['results'][t].get(k))}")
    if "pyllamacpp_only" in report:
        print(f"pyllamacpp only, {', '.join(alone)}: {report['pyllamacpp_only']['seconds']:.2f} s")
    for t, res in report.get("pyllamacpp_only", {}).get("results", {}).items():
        for k, v in res.items():
            print(f"{t:8s} {k:24s} pyllamacpp only: {plain(v)}")
    print("metrics:", "identical" if not metric_diffs else "DIFFER")
    for line in metric_diffs:
        print("  " + line)
    print("samples:", "identical filtered responses" if not sample_diffs else "filtered responses differ")
    for line in sample_diffs:
        print("  " + line)
    for side, med in (("gguf", med_g), ("pyllamacpp", med_o)):
        each = " ".join(f"{s:.2f}" for s in report[side]["seconds"])
        print(f"wall time {side:10s} {each} s (median {med:.2f})")
    print(f"ratio gguf / pyllamacpp {med_g / med_o:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
