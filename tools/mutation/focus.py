"""Run, against each mutant, only the tests that execute the mutated statement, fastest first.

    python focus.py map WORK TEST...            # the coverage pass: WORK/focus.json
    python focus.py run WORK -- PYTEST_ARGS...  # cosmic-ray's test command, one mutant at a time

A mutant changes one statement of one function. A test that never executes that statement cannot
see the change, so running it is time spent for nothing; a survivor used to cost every test of the
target (80 s and more), and now costs the tests that reach its statement.

``map`` runs the target's tests once on the unmutated copy under coverage (pytest-cov, one context
per test), and writes, for each function of the target's modules (its whole ``def``, nested ones
included), the tests that executed a line of it, and for each line of its body the tests that
executed that line. It falls back to more tests where a per-test trace would miss one:
- a function executed outside a test's call (at collection, or in a fixture's setup or teardown,
  whose result other tests share), or by a test that starts a process (``subprocess``,
  ``os.fork``, ``multiprocessing``: coverage does not follow it into the child), is given every
  test that spawns, or every test of the target where it ran outside a call;
- a line outside every function (the module's own code) runs every test.

``run`` compares each module of the copy with its unmutated text (``WORK/pristine/``), finds the
function around the first changed line and, in the function's body, the statement around it (the
innermost; a compound statement's header, ``if``/``for``/``while``/``with``, is a statement of its
own; a line of it in no child, an ``except`` clause, stands for the whole compound statement). It
runs pytest with ``-x`` on the tests that executed a line of that statement, fastest first (the
durations of the coverage pass); a line before the body (a decorator, a default) gets the
function's tests. No changed line (cosmic-ray's baseline): every test. No test reaches the
statement: it prints ``focus: no test executes ...`` and exits 0, a survivor whose reason the
report names. Each test runs under a watchdog (the plugin, ``faulthandler``): a mutant that
loops ends at its test's limit (``limits``), not at cosmic-ray's timeout for the whole run, and
``focus: timed out:`` says which test. The tests that killed earlier mutants of the same function go first (most kills
first; ``WORK/focus-kills.json``): a mutant is most often caught by the test that caught its
neighbours, and a kill costs the tests run before it. A process a test started and left running
(the test ended by the watchdog while its child loops on the mutant, a server it forgot) is
ended when pytest returns: ``run`` adopts its descendants' orphans (Linux's child subreaper) and
kills every process left under it, and says how many (``focus: ended``), so no mutant's child
goes on eating the cores the next mutants run on.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAP = "focus.json"
KILLS = "focus-kills.json"  # per function, how many of its mutants each test killed
NO_TEST = "focus: no test executes"
TIMED_OUT = "focus: timed out:"
ENDED = "focus: ended"


# -- the pytest plugin of the coverage pass (loaded with -p focus) ------------------------------
_current: list[str] = []
_spawned: set[str] = set()
_durations: dict[str, float] = {}


def _runs_python(args) -> bool:
    """Whether a process started with ``args`` runs Python (a compiler or a C program it starts
    runs none of the package's code)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        args = [args]
    first = os.fsdecode(list(args)[0]) if args else ""
    return "python" in os.path.basename(first) or os.path.realpath(first) == os.path.realpath(sys.executable)


def _wrap(owner, name: str, python_only: bool) -> None:
    real = getattr(owner, name, None)
    if real is None:
        return

    def spy(*a, **kw):
        if _current and (not python_only or _runs_python(kw.get("args", a[1] if len(a) > 1 else ""))):
            _spawned.add(_current[-1])
        return real(*a, **kw)

    setattr(owner, name, spy)


_limits: dict[str, float] = {}  # run: each test's seconds before the watchdog ends the process


def pytest_configure(config) -> None:  # noqa: ARG001 (pytest's hook signature)
    import multiprocessing.process
    import subprocess as sp

    if os.environ.get("FOCUS_RECORD"):  # the coverage pass
        _wrap(sp.Popen, "__init__", python_only=True)  # Popen(self, args, ...)
        _wrap(os, "fork", python_only=False)
        _wrap(multiprocessing.process.BaseProcess, "start", python_only=False)
    if os.environ.get("FOCUS_LIMITS"):  # a mutant's run
        _limits.update(json.loads(Path(os.environ["FOCUS_LIMITS"]).read_text()))


def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001
    _current.append(item.nodeid)
    limit = _limits.get(item.nodeid)
    if limit:  # a mutant that loops: the process ends (exit 1) instead of waiting for cosmic-ray's timeout
        import faulthandler

        Path(os.environ["FOCUS_LIMITS"] + ".running").write_text(f"{item.nodeid}\n{limit:.0f}")
        faulthandler.dump_traceback_later(limit, exit=True, file=sys.__stderr__)


def pytest_runtest_logreport(report) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown" and _current and _current[-1] == report.nodeid:
        _current.pop()
        if _limits:
            import faulthandler

            faulthandler.cancel_dump_traceback_later()


def pytest_sessionfinish(session) -> None:  # noqa: ARG001
    out = os.environ.get("FOCUS_RECORD")
    if out:
        Path(out).write_text(json.dumps({"spawned": sorted(_spawned), "durations": _durations}))
    if _limits:
        Path(os.environ["FOCUS_LIMITS"] + ".running").unlink(missing_ok=True)


def limits(durations: dict[str, float], tests: list[str], base: float = 20.0) -> dict[str, float]:
    """Each test's limit in a mutant's run: ``base`` seconds, five times its time in the coverage
    pass (which traces every line, so runs slower), and the slowest test's time again (a fixture
    the coverage pass set up for another test may fall to this one in the new order)."""
    slack = max(durations.values(), default=0.0)
    return {t: base + 5.0 * durations.get(t, slack) + slack for t in tests}


# -- map --------------------------------------------------------------------------------------
def _spans(source: str) -> list[tuple[int, int, int, str]]:
    """``(first line, first line of the body, last line, name)`` of every top-level function and
    method (nested ones are inside their parent's span): the unit a mutant's tests are chosen by.
    The lines before the body (decorators, the signature and its defaults) run at import."""
    out = []

    def visit(node, depth_in_def: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not depth_in_def:
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((first, child.body[0].lineno, child.end_lineno or child.lineno, child.name))
                visit(child, True)
            else:
                visit(child, depth_in_def)

    visit(ast.parse(source), False)
    return out


def build_map(work: Path, modules: list[str], tests: list[str]) -> dict:
    """The coverage pass on the unmutated copy; writes and returns ``WORK/focus.json``."""
    src = work / "src"
    pristine = work / "pristine"
    for m in modules:
        (pristine / m).parent.mkdir(parents=True, exist_ok=True)
        (pristine / m).write_bytes((src / m).read_bytes())
    cov_file = work / ".coverage.focus"
    record = work / "focus-record.json"
    for f in (cov_file, record):
        f.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{Path(__file__).parent}", "FOCUS_RECORD": str(record),
           "COVERAGE_FILE": str(cov_file)}  # fmt: skip
    cov = [f"--cov={d}" for d in sorted({str((src / m).parent) for m in modules})]  # coverage's sources are folders
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "focus", *cov,
           "--cov-context=test", "--cov-report=", *tests]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=work, env=env)
    if r.returncode != 0:
        sys.exit(f"the coverage pass failed (rc {r.returncode}): the tests must pass on the unmutated copy")
    import coverage

    data = coverage.CoverageData(basename=str(cov_file))
    data.read()
    rec = json.loads(record.read_text())
    durations: dict[str, float] = rec["durations"]
    spawned: list[str] = rec["spawned"]
    every = sorted(durations, key=durations.__getitem__)
    pos = {t: i for i, t in enumerate(every)}
    functions: dict[str, list] = {}
    for m in modules:
        path = str((src / m).resolve())
        by_line = data.contexts_by_lineno(path) if path in data.measured_files() else {}
        entries = []
        for first, body, last, name in _spans((src / m).read_text()):
            calls: set[str] = set()
            outside = False
            lines: dict[str, list[int]] = {}  # a line of the body: the tests (indices into every) that ran it
            outside_lines: list[int] = []  # lines run outside a test's call
            for line in range(body, last + 1):
                ran: set[str] = set()
                for ctx in by_line.get(line, []):
                    nodeid, _, phase = ctx.rpartition("|")
                    if phase == "run" and nodeid:
                        ran.add(nodeid)
                    else:
                        outside = True
                        outside_lines.append(line)
                calls |= ran
                if ran:
                    lines[str(line)] = sorted(pos[t] for t in ran if t in pos)
            if outside:
                chosen = every
            elif calls:
                chosen = sorted(calls | set(spawned), key=lambda t: durations.get(t, 0.0))
            else:
                chosen = sorted(spawned, key=lambda t: durations.get(t, 0.0))
            entries.append({"first": first, "body": body, "last": last, "name": name, "tests": chosen,
                            "reached": bool(calls) or outside, "lines": lines,
                            "outside_lines": sorted(set(outside_lines))})  # fmt: skip
        functions[m] = entries
    out = {"modules": modules, "functions": functions, "every": every, "spawned": spawned,
           "durations": durations, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    (work / MAP).write_text(json.dumps(out, indent=1))
    cov_file.unlink(missing_ok=True)
    return out


# -- run --------------------------------------------------------------------------------------
def _changed_line(before: str, after: str) -> int | None:
    """The first line of ``before`` that the mutant changed (1-based), None when equal."""
    if before == after:
        return None
    a, b = before.splitlines(), after.splitlines()
    for tag, i1, _i2, _j1, _j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            return i1 + 1
    return len(a)


def _statement(source: str, line: int) -> tuple[int, int] | None:
    """The lines of the innermost statement around ``line``: a compound statement's header alone
    where ``line`` is in it, the whole compound statement where ``line`` is in none of its children
    (an ``except`` or ``case`` clause); None outside every statement."""
    best = None
    nodes = list(ast.parse(source).body)
    while nodes:
        node = nodes.pop()
        if not (node.lineno <= line <= (node.end_lineno or node.lineno)):
            continue
        children = [c for c in ast.walk(node) if c is not node and isinstance(c, ast.stmt)]
        header_end = min((c.lineno for c in children), default=node.end_lineno or node.lineno) - 1
        if not children or line <= header_end:
            return node.lineno, max(header_end, node.lineno) if children else node.end_lineno or node.lineno
        best = (node.lineno, node.end_lineno or node.lineno)
        nodes = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
        nodes += [s for h in ast.iter_child_nodes(node) if not isinstance(h, ast.stmt)
                  for s in ast.iter_child_nodes(h) if isinstance(s, ast.stmt)]  # fmt: skip
    return best


def _statement_tests(fmap: dict, f: dict, span: tuple[int, int]) -> list[str] | None:
    """The tests that executed a line of ``span`` in ``f``, fastest first, with the tests that
    start a Python child (coverage does not see what the child runs); None (every test) where a
    line of it ran outside a test's call; [] where no test may have run it."""
    lo, hi = span
    if any(lo <= n <= hi for n in f["outside_lines"]):
        return None
    idx = {i for n in range(lo, hi + 1) for i in f["lines"].get(str(n), [])}
    every = fmap["every"]
    pos = {t: i for i, t in enumerate(every)}
    return sorted({every[i] for i in idx} | set(fmap["spawned"]), key=lambda t: pos.get(t, len(every)))


def choose(work: Path, fmap: dict) -> tuple[list[str] | None, str]:
    """The tests for the copy as it stands: None means every test (no function to narrow to)."""
    for m in fmap["modules"]:
        before = (work / "pristine" / m).read_text()
        line = _changed_line(before, (work / "src" / m).read_text())
        if line is None:
            continue
        for f in fmap["functions"][m]:
            if f["first"] <= line <= f["last"]:
                where = f"line {line} of {f['name']} in {m}"
                if "lines" not in f or line < f["body"]:  # a map of functions only; a decorator or a default
                    return f["tests"], where
                span = _statement(before, line) or (line, line)
                tests = _statement_tests(fmap, f, span)
                return (fmap["every"] if tests is None else tests), where
        return None, f"line {line} of {m}, outside every function"
    return None, "no line changed"


def _failed(stdout: str, tests: list[str]) -> str | None:
    """The test that failed (pytest's ``FAILED``/``ERROR`` summary line; -x stops at the first)."""
    for line in stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            rest = line.split(" ", 1)[1]
            for t in tests:
                if rest == t or rest.startswith(t + " "):
                    return t
    return None


def _adopt_orphans() -> bool:
    """Make this process the one its descendants' orphans are given to (Linux's
    ``PR_SET_CHILD_SUBREAPER``), so that what pytest's tests started stays findable under it after
    pytest is gone. False where the system has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER


def _children() -> list[int]:
    """The processes whose parent is this one (``/proc/PID/stat``'s fourth field)."""
    me, kids = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path("/proc", d, "stat").read_text()
            except OSError:  # gone since the listing
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:  # the name in parentheses may hold blanks
                kids.append(int(d))
    return kids


def end_descendants() -> int:
    """SIGKILL every process left under this one, reap it, and go on with the orphans each one
    leaves (given to this process, ``_adopt_orphans``) until none is left; how many were ended."""
    ended = 0
    for _ in range(1000):
        kids = _children()
        if not kids:
            break
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in kids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        ended += len(kids)
    return ended


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "map":
        work = Path(argv[1])
        sep = argv.index("--")
        build_map(work, argv[2:sep], argv[sep + 1 :])
        return 0
    if len(argv) >= 3 and argv[0] == "run" and "--" in argv:
        work = Path(argv[1])
        pytest_args = argv[argv.index("--") + 1 :]
        fmap = json.loads((work / MAP).read_text())
        tests, where = choose(work, fmap)
        if tests is None:
            tests = fmap["every"]
        elif not tests:
            print(f"{NO_TEST} {where}", flush=True)
            return 0
        key = where.split(" of ", 1)[1] if " of " in where else ""  # "FUNCTION in MODULE"
        kills_file = work / KILLS
        kills = json.loads(kills_file.read_text()) if kills_file.exists() else {}
        mine: dict[str, int] = kills.get(key, {})
        tests = sorted(tests, key=lambda t: -mine.get(t, 0))  # the function's killers first, then fastest first
        print(f"focus: {len(tests)} of {len(fmap['every'])} tests for {where}", flush=True)
        env = dict(os.environ)
        watch = work / "focus-limits.json"
        if "durations" in fmap:  # a watchdog per test (the focus plugin), where the map has the times
            watch.write_text(json.dumps(limits(fmap["durations"], tests, fmap.get("limit_base", 20.0))))
            env["FOCUS_LIMITS"] = str(watch)
            pp = env.get("PYTHONPATH", "")
            env["PYTHONPATH"] = f"{pp}{os.pathsep}{Path(__file__).parent}" if pp else str(Path(__file__).parent)
            pytest_args = [*pytest_args, "-p", "focus"]
        running = Path(str(watch) + ".running")
        running.unlink(missing_ok=True)
        adopted = _adopt_orphans()
        # Files, not pipes: a child the tests left holding pytest's stdout would keep a pipe open
        # past pytest's exit, and reading it to its end would wait on that child.
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            r = subprocess.run([*pytest_args, *tests], cwd=work, stdout=out, stderr=err, text=True, env=env)
            n = end_descendants() if adopted else 0
            out.seek(0)
            err.seek(0)
            r.stdout = out.read()
            sys.stdout.write(r.stdout)
            sys.stderr.write(err.read())
        if n:
            print(f"{ENDED} {n} process(es) the tests left running", flush=True)
        if r.returncode == 1 and running.exists():  # the watchdog ended it (a test failing ends the session)
            test, limit = running.read_text().split("\n")
            print(f"{TIMED_OUT} {test} ran past its limit of {limit} s", flush=True)
            running.unlink()
            return 1
        failed = _failed(r.stdout, tests) if r.returncode != 0 and key else None
        if failed is not None:
            mine[failed] = mine.get(failed, 0) + 1
            kills[key] = mine
            kills_file.write_text(json.dumps(kills, indent=1))
        return r.returncode
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
