"""Mutation testing of one module against its test files, with cosmic-ray, on a copy of the tree.

    python tools/mutation/run.py lora                 # a target from tools/mutation/targets.toml
    python tools/mutation/run.py --list               # the targets
    python tools/mutation/run.py lora --report-only   # the last run's report again
    python tools/mutation/run.py taps --sample 150    # a random sample (the kill rate with its 95 % interval)

cosmic-ray mutates the module's file in place, runs the test command, and puts the file back, one
mutant at a time. It works here on a copy (``build/mutation/<target>/``): the package's Python
files, the compiled parts of the installed package (the extension and the libraries beside it,
editable install or not), ``tests/`` and links to ``vendor/`` and ``docs/``. A ``sitecustomize.py``
there takes scikit-build-core's editable finder off ``sys.meta_path``, so the tests' own child
interpreters import the mutated copy too. The working tree is never touched.

The report: mutants killed, survived and timed out per target, and each survivor as a diff. A
survivor is a behaviour no test holds, or an equivalent mutant (one that changes nothing a test
could see): name it in ``targets.toml``'s ``equivalent`` list (its line, operator and, where one line has
several mutants, ``to``: text of the mutated line; or ``function`` instead of ``line``, which
survives the module being split) with the reason, and the report
counts the kill rate over the others.

A run goes on only at the commit it began (``--resume``; ``--rerun-survivors`` with HEAD's tests).
After an edit of a target's module, start it afresh: the kills of the last run, and its survivors
named equivalent, whose mutant and code are unchanged carry over (``carry.py``), and the rest runs
against HEAD. The last run is the one in ``build/mutation/<target>/``, or, on a machine without
one, the group's ledger: ``--save-ledger`` writes a run's results so far into
``tools/mutation/ledger/<target>.jsonl`` (a run that ends writes it too); commit it, and a fresh
start on any machine goes on from there.

``--workers N`` runs N mutants at a time, each in a copy of its own (``build/mutation/<target>.wK/``
beside the first), through cosmic-ray's http distributor: one ``cosmic-ray http-worker`` per copy,
the module paths and the test command relative to the copy it runs in. The tests run one thread
each, so N up to the cores a machine has.

Needs ``pip install cosmic-ray pytest-cov`` (not test dependencies: too slow for CI on 2 cores;
pytest-cov for focus.py's coverage pass).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
NO_TEST = "focus: no test executes"  # what focus.py prints for a mutant whose statement no test runs
TIMED_OUT = "focus: timed out:"  # and for a mutant whose test ran past its limit
TARGETS = Path(__file__).with_name("targets.toml")
LEDGERS = Path(__file__).with_name("ledger")  # each group's last results, committed (carry.py)

SITECUSTOMIZE = """\
# mutation testing: import the mutated copy, not the editable install's source tree
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
sys.path[:] = [p for p in sys.path if p != {root!r}]
"""


def _compiled_dir() -> Path:
    """Where the installed package's compiled extension lies (site-packages/pyllamacpp/)."""
    spec = importlib.util.find_spec("pyllamacpp._pyllamacpp")
    if spec is None or spec.origin is None:
        sys.exit("pyllamacpp's compiled extension is not installed: pip install -e . first")
    return Path(spec.origin).parent


def _git(*args: str) -> bytes:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True).stdout


def _extract(work: Path, *paths: str) -> str:
    """HEAD's files under ``paths`` into ``work`` (``git archive``), HEAD resolved once; returns it."""
    head = _git("rev-parse", "HEAD").decode().strip()
    subprocess.run(["tar", "-x", "-C", str(work)], input=_git("archive", "--format=tar", head, *paths), check=True)
    return head


def _copy_tree(work: Path) -> str:
    """The committed tree (HEAD's ``pyllamacpp/`` and ``tests/``, not the working files, so that an
    edit in progress is never mutated and the report names the commit it is of). Returns HEAD."""
    if work.exists():
        shutil.rmtree(work)
    src = work / "src"
    src.mkdir(parents=True)
    head = _extract(work, "pyllamacpp", "tests")
    (work / "pyllamacpp").rename(src / "pyllamacpp")
    for f in _compiled_dir().iterdir():  # the extension, its libraries (_libs/), the build's records
        dst = src / "pyllamacpp" / f.name
        if f.is_dir() and f.name != "__pycache__" and not dst.exists():
            shutil.copytree(f, dst, symlinks=True)
        elif f.is_file() and f.suffix != ".py" and not dst.exists():
            shutil.copy2(f, dst)
    for name in ("vendor", "docs", "mkdocs.yml", "pyproject.toml", "README.md"):
        (work / name).symlink_to(ROOT / name)
    (src / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=str(ROOT)))
    return head


def _restore_modules(work: Path, target: dict) -> None:
    """The target's modules in the copy as the run's commit has them."""
    commit = (work / "COMMIT").read_text().strip()
    for m in target["modules"]:
        (work / "src" / m).write_bytes(_git("show", f"{commit}:{m}"))


def _refresh_tests(work: Path, target: dict) -> None:
    """HEAD's tests into the copy, for a run of the survivors again: only if the mutated modules
    are still what the run mutated (else its mutants are not HEAD's, and it must start afresh)."""
    if not (work / "session.sqlite").exists():
        sys.exit(f"no earlier run in {work}")
    for m in target["modules"]:
        now = subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{m}"], capture_output=True).stdout
        if now != (work / "src" / m).read_bytes():
            sys.exit(
                f"{m} changed since the run at {(work / 'COMMIT').read_text()[:10]}: run the target afresh "
                "(the kills and named survivors of code unchanged since carry over)"
            )
    shutil.rmtree(work / "tests")
    (work / "TESTS_COMMIT").write_text(_extract(work, "tests"))


def _config(work: Path, target: dict, timeout: float, focus: bool, urls: list[str] | None = None) -> Path:
    """cosmic-ray's configuration. Paths are relative to the copy the test command runs in (its
    working directory: ``work``, or a worker's copy), made absolute there for the tests' child
    interpreters (``$PWD``), which may run in another directory."""
    tests = " ".join(target["tests"])
    k = f" -k {target['k']!r}" if target.get("k") else ""
    pytest = f"{sys.executable} -m pytest -x -q -p no:cacheprovider{k}"
    if focus:  # the tests that execute the mutated statement (focus.py), fastest first
        run = f'{sys.executable} "$PWD/focus.py" run "$PWD" -- {pytest}'
    else:
        run = f"{pytest} {tests}"
    cmd = "sh -c " + shlex.quote(f'PYTHONPATH="$PWD/src" exec {run}')
    cfg = work / "cosmic-ray.toml"
    modules = ", ".join(json.dumps(f"src/{m}") for m in target["modules"])
    distributor = (
        f'[cosmic-ray.distributor]\nname = "http"\n[cosmic-ray.distributor.http]\nworker-urls = {json.dumps(urls)}\n'
        if urls
        else '[cosmic-ray.distributor]\nname = "local"\n'
    )
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{modules}]\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(cmd)}\n" + distributor
    )
    return cfg


def _relative_paths(session: Path) -> None:
    """The session's module paths relative to the copy (``src/...``), as a worker's copy has them
    (a run begun before the paths were relative has its copy's absolute ones)."""
    import carry  # beside this file

    db = sqlite3.connect(session)
    rows = db.execute("SELECT DISTINCT module_path FROM mutation_specs").fetchall()
    for (p,) in rows:
        if "/src/" in p:
            db.execute("UPDATE mutation_specs SET module_path = ? WHERE module_path = ?", ("src/" + carry._rel(p), p))
    db.commit()
    db.close()


# cosmic-ray exec with the http distributor, whose requests aiohttp ends after 5 minutes by default:
# a survivor's tests may run longer (cosmic-ray's own timeout still ends a mutant that hangs)
EXEC_HTTP = """\
import sys
import aiohttp.client
aiohttp.client.DEFAULT_TIMEOUT = aiohttp.client.ClientTimeout(total=None, sock_connect=30)
from cosmic_ray.cli import main
sys.argv = ["cosmic-ray", "exec", *sys.argv[1:]]
sys.exit(main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_workers(work: Path, n: int) -> tuple[list[subprocess.Popen], list[str]]:
    """``n`` http workers: one in ``work``, the others in fresh copies of it beside it."""
    dirs = [work]
    for k in range(2, n + 1):
        d = work.parent / f"{work.name}.w{k}"
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(work, d, symlinks=True, ignore=shutil.ignore_patterns("session.sqlite*", "report.json"))
        dirs.append(d)
    procs, urls = [], []
    for d in dirs:
        port = _free_port()
        log = open(d / "worker.log", "w")  # noqa: SIM115 (the worker's, closed with it)
        procs.append(subprocess.Popen(["cosmic-ray", "http-worker", "--port", str(port)], cwd=d,
                                      stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    for url, proc in zip(urls, procs):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(600):
            if proc.poll() is not None:
                sys.exit(f"the http worker at {url} ended: see its worker.log")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
    return procs, urls


UNREACHED = "Cannot connect to host"  # aiohttp's error for a worker gone: cosmic-ray records it as ABNORMAL


def _unreached(session: Path) -> int:
    """Put back, as not run, the mutants a stop cut off: those an http worker never got (gone
    before the run ended: cosmic-ray records each as an abnormal result), and those whose tests
    were killed with the run (a kill with no word from pytest, only focus.py's first line; a
    mutant that crashes the interpreter leaves Python's fatal error). Returns how many."""
    db = sqlite3.connect(session)
    n = db.execute("DELETE FROM work_results WHERE worker_outcome = 'ABNORMAL' AND output LIKE ?",
                   (UNREACHED + "%",)).rowcount  # fmt: skip
    cut = [
        (job,)
        for job, output in db.execute("SELECT job_id, output FROM work_results WHERE test_outcome = 'KILLED'")
        if all(not line.strip() or line.startswith("focus: ") for line in (output or "").splitlines())
        and TIMED_OUT not in (output or "")
        and output != "timeout"
    ]
    db.executemany("DELETE FROM work_results WHERE job_id = ?", cut)
    db.commit()
    db.close()
    return n + len(cut)


def _exec(work: Path, target: dict, args, session: Path) -> None:
    """cosmic-ray exec, here or through ``args.workers`` http workers."""
    _relative_paths(session)
    _unreached(session)
    if args.workers <= 1:
        cfg = _config(work, target, args.timeout, not args.no_focus)
        subprocess.run(["cosmic-ray", "exec", str(cfg), str(session)], check=True, cwd=work)
        return
    _config(work, target, args.timeout, not args.no_focus)  # the copies' own (local) configuration
    # a stop (SIGTERM) ends the workers too: the default handler would leave them serving
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs, urls = _start_workers(work, args.workers)
    try:
        cfg = _config(work, target, args.timeout, not args.no_focus, urls)
        subprocess.run([sys.executable, "-c", EXEC_HTTP, str(cfg), str(session)], check=True, cwd=work)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        _config(work, target, args.timeout, not args.no_focus)
        n = _unreached(session)
        if n:
            print(f"{n} mutants no worker got are left to run", flush=True)


def _focus_map(work: Path, target: dict) -> None:
    """HEAD's focus.py into the copy, and its coverage pass over the target's tests (focus.json)."""
    (work / "focus.py").write_bytes(_git("show", "HEAD:tools/mutation/focus.py"))
    cmd = [sys.executable, str(work / "focus.py"), "map", str(work), *target["modules"], "--", *target["tests"]]
    if target.get("k"):
        cmd[-len(target["tests"]) :] = ["-k", target["k"], *target["tests"]]
    subprocess.run(cmd, check=True, cwd=work)
    fmap = json.loads((work / "focus.json").read_text())
    n = sum(len(v) for v in fmap["functions"].values())
    unreached = [f["name"] for v in fmap["functions"].values() for f in v if not f["reached"]]
    print(f"focus: {len(fmap['every'])} tests mapped onto {n} functions in {fmap['seconds']} s"
          + (f"; no test executes {', '.join(unreached)}" if unreached else ""), flush=True)  # fmt: skip


def _describe(work: Path) -> str:
    """The run's commit, and what it carried and against which tests its survivors ran again."""
    commit = (work / "COMMIT").read_text().strip() if (work / "COMMIT").exists() else "?"
    if (work / "CARRIED").exists():  # kills of an earlier run's same mutants of unchanged code
        kills, equiv, was = (work / "CARRIED").read_text().split()
        commit += f", {kills} kills and {equiv} named equivalents carried from the run at {was[:10]}"
    if (work / "TESTS_COMMIT").exists():  # survivors run again against later tests
        commit += f", survivors against the tests of {(work / 'TESTS_COMMIT').read_text()[:10]}"
    return commit


def _save_ledger(work: Path, ledger: Path) -> int:
    """The run's results into its group's ledger (carry.py), what a fresh start on another machine
    carries, and what ``--report-only`` reads where there is no run here."""
    import carry  # beside this file

    n_skipped, n_pending = _counts(work / "session.sqlite")
    return carry.write_ledger(work / "session.sqlite", (work / "COMMIT").read_text().strip(), ledger,
                              (NO_TEST, TIMED_OUT), skipped=n_skipped, not_run=n_pending,
                              described=_describe(work))  # fmt: skip


def _is_equivalent(named: list[dict], line: int, op: str, where: str, diff: str | None) -> bool:
    """Whether ``targets.toml`` names this mutant equivalent: by line, or by function (which
    survives the module being split or edited above it), its operator, ``to`` in its + lines, and
    ``from`` (where given) in its - lines: two lines of a function that mutate to the same text
    (``for k in order:`` and ``for k in range(n):`` both to ``for k in []:``) are told apart by
    what they were."""
    lines = (diff or "").splitlines()
    plus = "\n".join(ln for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    minus = "\n".join(ln for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    return any((e.get("line") == line or e.get("function") == where) and e["operator"] == op
               and e.get("to", "") in plus and e.get("from", "") in minus for e in named)  # fmt: skip


def _wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson's score interval for k of n: the kill rate of a sample, as an estimate of the module's."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def _counts(session: Path) -> tuple[dict[str, int], int]:
    """A run's mutants skipped, per reason (the filters' marks), and not run yet."""
    import carry  # beside this file

    marks = ", ".join("?" * len(carry.SKIPPED))
    db = sqlite3.connect(session)
    try:
        n_skipped = dict(db.execute(f"SELECT output, count(*) FROM work_results WHERE output IN ({marks}) "
                                    "GROUP BY output", carry.SKIPPED).fetchall())  # fmt: skip
        (n_pending,) = db.execute(
            "SELECT count(*) FROM work_items WHERE job_id NOT IN (SELECT job_id FROM work_results)"
        ).fetchone()
    finally:
        db.close()
    return n_skipped, n_pending


def _report(name: str, target: dict, commit: str, results: list[tuple], n_skipped: dict, n_pending: int) -> dict:
    """The report of a run's ``results`` (carry.old_results(..., judged=True), from its session or
    its ledger)."""
    rows = [
        (m, op, r0, where, test, diff, output)
        for m, op, _o, r0, _c0, _r1, _c1, _w, output, test, diff, where in results
    ]
    n_annotation = n_skipped.get("annotation", 0)
    named = target.get("equivalent", [])
    killed = survived = timeouts = equiv = untested = 0
    survivors = []
    by_function: dict[str, list[int]] = {}  # killed (timeouts too), survived, equivalent
    for module, op, line, where, outcome, diff, output in rows:
        counts = by_function.setdefault(f"{Path(module).name}:{where}", [0, 0, 0])
        if _is_equivalent(named, line, op, where, diff):
            equiv += 1
            counts[2] += 1
        elif (outcome or "").lower() == "killed" and (TIMED_OUT in (output or "") or output == "timeout"):
            timeouts += 1  # a test ran past its limit (focus.py's watchdog) or the run past --timeout: a loop
            counts[0] += 1
        elif (outcome or "").lower() == "killed":
            killed += 1
            counts[0] += 1
        elif (outcome or "").lower() == "survived":
            survived += 1
            counts[1] += 1
            no_test = NO_TEST in (output or "")
            untested += no_test
            survivors.append((Path(module).name, line, where, op, diff, " (no test executes its statement)" * no_test))
        else:
            timeouts += 1  # an incompetent mutant or a hang: counted as killed by the timeout
            counts[0] += 1
    judged = killed + survived + timeouts
    rate = (killed + timeouts) / judged if judged else 0.0
    lo, hi = _wilson(killed + timeouts, judged)
    sampled = n_skipped.get("unsampled", 0)
    scope = f", {n_skipped['outside']} outside the target's functions" if n_skipped.get("outside") else ""
    print(
        f"{name} (at {commit[:10]}{commit[40:]}): {len(rows)} mutants, {killed} killed, {timeouts} timed out, "
        f"{survived} survived" + (f" ({untested} in statements no test executes)" if untested else "") + ", "
        f"{equiv} equivalent named in targets.toml, {n_annotation} in annotations (skipped){scope}: kill rate "
        f"{rate:.1%} of the non-equivalent"
        + (f" (a random sample of {len(rows) + n_pending} of the {len(rows) + n_pending + sampled} in scope; "
           f"95 % interval {lo:.1%} to {hi:.1%})" if sampled else "")
        + (f"; {n_pending} not run yet" if n_pending else "")
    )  # fmt: skip
    if by_function:  # the promise's parts: each function's mutants run
        print(f"\n{'function':44} {'killed':>7} {'survived':>9} {'equivalent':>11}")
        for f, (k, sv, eq) in sorted(by_function.items()):
            print(f"{f:44} {k:7} {sv:9} {eq:11}")
    for module, line, where, op, diff, why in sorted(survivors):
        print(f"\n-- survived: {module}:{line} in {where} ({op}){why}")
        changed = [ln for ln in (diff or "").splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
        print("\n".join(changed))
    return {
        "target": name,
        "mutants": len(rows),
        "killed": killed,
        "timeouts": timeouts,
        "survived": survived,
        "survived_untested": untested,
        "by_function": {f: dict(zip(("killed", "survived", "equivalent"), c)) for f, c in sorted(by_function.items())},
        "equivalent": equiv,
        "kill_rate": rate,
        "interval_95": [lo, hi],
        "commit": commit,
        "not_run": n_pending,
        "skipped": n_skipped,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", help="a target of tools/mutation/targets.toml")
    ap.add_argument("--list", action="store_true", help="list the targets")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run")
    ap.add_argument("--report-only", action="store_true", help="print the last run's report")
    ap.add_argument(
        "--sample", type=int, help="run a random sample of this many mutants (default: the target's `sample`, or all)"
    )
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--resume", action="store_true", help="go on with the last run's session (after a stop)")
    ap.add_argument(
        "--rerun-survivors", action="store_true", help="run the last run's survivors again against HEAD's tests"
    )
    ap.add_argument(
        "--no-carry",
        action="store_true",
        help="start afresh without the last run's results (default: its kills, and its survivors named "
        "equivalent, of code unchanged since carry over, tools/mutation/carry.py)",
    )
    ap.add_argument(
        "--save-ledger",
        action="store_true",
        help="write the run's results so far to tools/mutation/ledger/<target>.jsonl (done at a run's end too), "
        "which a fresh start where this machine has no run carries from; commit it",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="mutants run at a time, each in a copy of its own (cosmic-ray's http workers; default: 1)",
    )
    ap.add_argument(
        "--no-focus",
        action="store_true",
        help="run every test of the target against each mutant (default: only the "
        "tests that execute the mutated statement, tools/mutation/focus.py)",
    )
    args = ap.parse_args()
    # HEAD's list, as the tree mutated is HEAD's (a target edited in the working tree may name files not committed)
    committed = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:tools/mutation/targets.toml"],
                               capture_output=True, text=True)  # fmt: skip
    text = committed.stdout if committed.returncode == 0 and not args.report_only else TARGETS.read_text()
    targets = tomllib.loads(text)["target"]
    if args.list or not args.target:
        for n, t in targets.items():
            print(f"{n:12} {' '.join(t['modules'])}  <-  {' '.join(t['tests'])}")
        return 0
    target = targets[args.target]
    work = ROOT / "build" / "mutation" / args.target
    session = work / "session.sqlite"
    cfg = work / "cosmic-ray.toml"
    ledger = LEDGERS / f"{args.target}.jsonl"
    if args.save_ledger:
        if not session.exists():
            sys.exit(f"no run of {args.target} in {work}")
        _unreached(session)  # a run stopped with its workers gone first
        n = _save_ledger(work, ledger)
        print(f"{args.target}: {n} results of the run at {(work / 'COMMIT').read_text()[:10]} written to "
              f"{ledger.relative_to(ROOT)}")  # fmt: skip
        return 0
    if not args.report_only:
        if shutil.which("cosmic-ray") is None:
            sys.exit("cosmic-ray is not installed: pip install cosmic-ray pytest-cov")
        if not args.no_focus and importlib.util.find_spec("pytest_cov") is None:
            sys.exit("pytest-cov is not installed (focus.py's coverage pass; or --no-focus): pip install pytest-cov")
        t0 = time.perf_counter()
        if (args.resume or args.rerun_survivors) and (work / "COMMIT").exists():
            _restore_modules(work, target)  # a run stopped mid-mutant leaves its mutant in the copy
        if args.rerun_survivors:
            _refresh_tests(work, target)
            cfg = _config(work, target, args.timeout, not args.no_focus)  # HEAD's test files for the target
            if not args.no_focus:
                _focus_map(work, target)
            db = sqlite3.connect(session)
            survivors = db.execute(
                "SELECT r.job_id, m.start_pos_row, m.operator_name, m.definition_name, r.diff FROM work_results r "
                "JOIN mutation_specs m ON m.job_id = r.job_id WHERE r.test_outcome = 'SURVIVED'"
            ).fetchall()
            named = target.get("equivalent", [])  # HEAD's list: a mutant named equivalent cannot be killed
            again = [j for j, line, op, where, diff in survivors if not _is_equivalent(named, line, op, where, diff)]
            db.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in again])
            db.commit()
            db.close()
            print(f"{args.target}: {len(again)} survivors to run again against the tests of HEAD "
                  f"({len(survivors) - len(again)} named equivalent, not run)", flush=True)  # fmt: skip
        elif not (args.resume and session.exists()):
            import carry  # beside this file

            prev = None  # the last run's kills, carried into this one where their code is unchanged
            if not args.no_carry and session.exists() and (work / "COMMIT").exists():
                was = (work / "COMMIT").read_text().strip()
                prev = (was, carry.old_results(session))
            elif not args.no_carry and ledger.exists():  # no run on this machine: the committed one
                meta, results = carry.read_ledger(ledger)
                prev = (meta["commit"], results)
            if prev is not None:
                texts = {m: _git("show", f"{prev[0]}:{m}").decode() for m in target["modules"]}
                prev = (*prev, texts)
            commit = _copy_tree(work)
            (work / "COMMIT").write_text(commit)
            cfg = _config(work, target, args.timeout, not args.no_focus)
            if not args.no_focus:
                _focus_map(work, target)
            subprocess.run(["cosmic-ray", "init", str(cfg), str(session)], check=True, cwd=work)
            subprocess.run(["cr-filter-pragma", str(session)], check=True, cwd=work)  # "# pragma: no mutate"
            here = Path(__file__).parent
            subprocess.run([sys.executable, str(here / "skip_annotations.py"), str(session)], check=True, cwd=work)
            sample = args.sample if args.sample is not None else target.get("sample", 0)
            select = [sys.executable, str(here / "select_mutants.py"), str(session), "--sample", str(sample),
                      "--seed", str(args.seed), "--functions", ",".join(target.get("functions", []))]  # fmt: skip
            subprocess.run(select, check=True, cwd=work)
            if prev is not None:
                now = {m: (work / "src" / m).read_text() for m in target["modules"]}
                named = target.get("equivalent", [])
                kills, equiv = carry.carry(prev[1], prev[2], session, now,
                                           lambda *m: _is_equivalent(named, *m))  # fmt: skip
                (work / "CARRIED").write_text(f"{kills} {equiv} {prev[0]}")
                print(f"{args.target}: from the run at {prev[0][:10]}, {kills} kills and {equiv} survivors named "
                      "equivalent carried (the same mutants of unchanged code)", flush=True)  # fmt: skip
            subprocess.run(["cosmic-ray", "baseline", str(cfg)], check=True, cwd=work)
        elif (
            not args.no_focus
            and (work / "focus.json").exists()
            and ((work / "focus.py").read_bytes() != _git("show", "HEAD:tools/mutation/focus.py"))
        ):
            _focus_map(work, target)  # HEAD's focus.py changed since the run began: the rest goes by its map
        _exec(work, target, args, session)
        _save_ledger(work, ledger)
        print(f"{args.target}: {time.perf_counter() - t0:.0f} s", flush=True)
    import carry  # beside this file

    if session.exists():
        n_skipped, n_pending = _counts(session)
        out = _report(
            args.target, target, _describe(work), carry.old_results(session, judged=True), n_skipped, n_pending
        )
        (work / "report.json").write_text(json.dumps(out, indent=1))
    elif args.report_only and ledger.exists():  # no run on this machine: the committed one's
        meta, results = carry.read_ledger(ledger)
        print(f"(from {ledger.relative_to(ROOT)})")
        _report(args.target, target, meta["described"], results, meta["skipped"], meta["not_run"])
    else:
        sys.exit(f"no run of {args.target} in {work}, and no ledger")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
