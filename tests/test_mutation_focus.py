"""tools/mutation/focus.py: each mutant is run against the tests that execute its statement.

A survivor of the mutation run is read as "a behaviour no test holds": that holds only if the
tests left out could not have seen the mutant. These check the choice: the function around the
changed line (nested functions inside their parent, a signature's defaults inside their function),
the statement around it in the body (a compound statement's header alone, an ``except`` clause as
its whole ``try``), every test where no function narrows it or the statement ran outside a test's
call, the tests that start a child always, none where no test executes the statement."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOCUS = REPO / "tools" / "mutation" / "focus.py"
pytestmark = pytest.mark.skipif(not FOCUS.exists(), reason="tools/ is not in an installed package")

MODULE = '''\
"""A module."""
import functools

LIMIT = 3


@functools.lru_cache
def outer(n: int,
          k: int = 2) -> int:
    """Doc."""

    def inner(x):
        return x * k

    return inner(n) + LIMIT


class Box:
    def get(self) -> int:
        return 1

    def put(self, v) -> None:
        self.v = v


def untested():
    return 0
'''


def _focus():
    spec = importlib.util.spec_from_file_location("focus_under_test", FOCUS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_spans_are_top_level_functions_and_methods():
    f = _focus()
    spans = {name: (first, body, last) for first, body, last, name in f._spans(MODULE)}
    assert set(spans) == {"outer", "get", "put", "untested"}  # inner is inside outer
    lines = MODULE.splitlines()
    first, body, last = spans["outer"]
    assert lines[first - 1] == "@functools.lru_cache" and lines[last - 1] == "    return inner(n) + LIMIT"
    assert lines[body - 1] == '    """Doc."""'  # the signature's lines (its defaults) are before the body
    assert lines[spans["put"][2] - 1] == "        self.v = v"


def test_changed_line():
    f = _focus()
    assert f._changed_line(MODULE, MODULE) is None
    lines = MODULE.splitlines(keepends=True)
    for i in (0, 9, len(lines) - 1):
        mutant = lines.copy()
        mutant[i] = "changed = 1\n"
        assert f._changed_line(MODULE, "".join(mutant)) == i + 1


def _work(tmp_path: Path, f, tests_of: dict[str, list[str]]) -> tuple[Path, dict]:
    (tmp_path / "pristine" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "pristine" / "pkg" / "m.py").write_text(MODULE)
    (tmp_path / "src" / "pkg" / "m.py").write_text(MODULE)
    entries = [{"first": a, "last": c, "name": n, "tests": tests_of.get(n, []), "reached": bool(tests_of.get(n))}
               for a, _, c, n in f._spans(MODULE)]  # fmt: skip
    fmap = {"modules": ["pkg/m.py"], "functions": {"pkg/m.py": entries}, "every": ["t::a", "t::b", "t::c"]}
    return tmp_path, fmap


def test_choose_narrows_to_the_function_of_the_changed_line(tmp_path):
    f = _focus()
    work, fmap = _work(tmp_path, f, {"outer": ["t::b", "t::a"], "get": ["t::c"], "put": ["t::a"]})
    src = work / "src" / "pkg" / "m.py"
    assert f.choose(work, fmap) == (None, "no line changed")  # cosmic-ray's baseline: every test

    def mutate(old: str, new: str):
        assert old in MODULE
        src.write_text(MODULE.replace(old, new, 1))
        return f.choose(work, fmap)

    assert mutate("return x * k", "return x / k")[0] == ["t::b", "t::a"]  # a nested function: its parent's
    assert mutate("k: int = 2", "k: int = 3")[0] == ["t::b", "t::a"]  # a default: the function's tests
    assert mutate("@functools.lru_cache", "@functools.cache")[0] == ["t::b", "t::a"]
    assert mutate("return 1", "return 2") == (["t::c"], f"line {MODULE.splitlines().index('        return 1') + 1}"
                                              " of get in pkg/m.py")  # fmt: skip
    assert mutate("LIMIT = 3", "LIMIT = 4")[0] is None  # the module's own code: every test
    assert mutate("return 0", "return 1")[0] == []  # no test executes it


def test_run_says_when_no_test_executes_the_function(tmp_path):
    f = _focus()
    work, fmap = _work(tmp_path, f, {"outer": ["t::a"], "get": ["t::c"]})
    (work / "focus.json").write_text(json.dumps(fmap))
    (work / "src" / "pkg" / "m.py").write_text(MODULE.replace("return 0", "return 1"))
    run = [sys.executable, str(FOCUS), "run", str(work), "--", sys.executable, "-c"]
    r = subprocess.run([*run, "raise SystemExit(3)"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("focus: no test executes line ") and "of untested" in r.stdout
    (work / "src" / "pkg" / "m.py").write_text(MODULE.replace("return 1", "return 2"))  # get: one test
    r = subprocess.run([*run, "import sys; print(sys.argv[1:]); raise SystemExit(3)"], capture_output=True, text=True)
    assert r.returncode == 3 and "['t::c']" in r.stdout and "focus: 1 of 3 tests for line" in r.stdout


def test_map_gives_each_function_the_tests_that_execute_it(tmp_path):
    pytest.importorskip("pytest_cov")
    f = _focus()
    work = tmp_path
    (work / "src" / "pkg").mkdir(parents=True)
    (work / "src" / "pkg" / "__init__.py").write_text("")
    (work / "src" / "pkg" / "m.py").write_text(MODULE)
    (work / "tests").mkdir()
    (work / "tests" / "test_m.py").write_text(
        "import subprocess, sys\nimport pytest\nfrom pkg import m\n\n"
        "@pytest.fixture(scope='module')\ndef boxed():\n    b = m.Box()\n    b.put(1)\n    return b\n\n"
        "def test_outer():\n    assert m.outer(2) == 7\n\n"
        "def test_get():\n    assert m.Box().get() == 1\n\n"
        "def test_boxed(boxed):\n    assert boxed.v == 1\n\n"
        "def test_child():\n    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n\n"
        "def test_compiler():\n    subprocess.run(['true'], check=True)\n"
    )
    fmap = f.build_map(work, ["pkg/m.py"], ["tests/test_m.py"])
    tests = {e["name"]: sorted(t.rsplit("::", 1)[1] for t in e["tests"]) for e in fmap["functions"]["pkg/m.py"]}
    assert fmap["spawned"] == ["tests/test_m.py::test_child"]  # a Python child; `true` runs none of ours
    assert tests["outer"] == ["test_child", "test_outer"] and tests["get"] == ["test_child", "test_get"]
    assert len(tests["put"]) == 5  # run in a module fixture's setup, which other tests share: every test
    assert tests["untested"] == ["test_child"]
    # and each line of a body the tests that ran it (indices into every): get's line only test_get
    src_lines = MODULE.splitlines()
    get = next(e for e in fmap["functions"]["pkg/m.py"] if e["name"] == "get")
    ran = get["lines"][str(src_lines.index("        return 1") + 1)]
    assert [fmap["every"][i].rsplit("::", 1)[1] for i in ran] == ["test_get"]
    put = next(e for e in fmap["functions"]["pkg/m.py"] if e["name"] == "put")
    assert put["outside_lines"] == [src_lines.index("        self.v = v") + 1]
    assert (work / "pristine" / "pkg" / "m.py").read_text() == MODULE


BRANCHY = """\
def pick(n, items):
    if (n > 0
            and items):
        out = [i * n
               for i in items]
    elif n == 0:
        out = []
    else:
        try:
            out = [1 / n]
        except ZeroDivisionError:
            out = None
    for i in range(2):
        if i: n += 1
    return out
"""


def test_statement_is_the_innermost_around_the_line():
    f = _focus()
    lines = BRANCHY.splitlines()

    def at(text: str) -> tuple[int, int]:
        n = next(i for i, ln in enumerate(lines, 1) if text in ln)
        lo, hi = f._statement(BRANCHY, n)
        return lines[lo - 1].strip(), lines[hi - 1].strip()

    assert at("and items") == ("if (n > 0", "and items):")  # a header of two lines, without its body
    assert at("for i in items]") == ("out = [i * n", "for i in items]")  # a statement of two lines
    assert at("elif n == 0") == ("elif n == 0:", "elif n == 0:")
    assert at("out = []") == ("out = []", "out = []")
    assert at("out = [1 / n]") == ("out = [1 / n]", "out = [1 / n]")
    assert at("except ZeroDivisionError") == ("try:", "out = None")  # in no child: the whole try
    assert at("for i in range(2)") == ("for i in range(2):", "for i in range(2):")
    assert at("if i: n += 1") == ("if i: n += 1", "if i: n += 1")
    assert at("return out") == ("return out", "return out")
    assert f._statement(BRANCHY, len(lines) + 5) is None


def test_choose_narrows_to_the_tests_that_ran_the_statement(tmp_path):
    f = _focus()
    (tmp_path / "pristine" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "pristine" / "pkg" / "b.py").write_text(BRANCHY)
    src = tmp_path / "src" / "pkg" / "b.py"
    lines = BRANCHY.splitlines()
    num = {ln.strip(): i for i, ln in enumerate(lines, 1)}
    every = ["t::fast", "t::mid", "t::slow", "t::child"]  # fastest first
    ran = {"if (n > 0": [1, 2], "out = [i * n": [2], "for i in items]": [2, 1], "elif n == 0:": [0, 1],
           "out = []": [0], "return out": [0, 1, 2]}  # fmt: skip
    entry = {"first": 1, "body": 2, "last": len(lines), "name": "pick", "tests": every,
             "lines": {str(num[k]): v for k, v in ran.items()}, "outside_lines": [num["if i: n += 1"]]}  # fmt: skip
    fmap = {"modules": ["pkg/b.py"], "functions": {"pkg/b.py": [entry]}, "every": every, "spawned": ["t::child"]}

    def mutate(old: str, new: str):
        assert old in BRANCHY
        src.write_text(BRANCHY.replace(old, new, 1))
        return f.choose(tmp_path, fmap)[0]

    assert mutate("i * n", "i + n") == ["t::mid", "t::slow", "t::child"]  # either line of the statement
    assert mutate("out = []", "out = [0]") == ["t::fast", "t::child"]
    assert mutate("and items", "or items") == ["t::mid", "t::slow", "t::child"]  # the body's first statement
    assert mutate("if (n > 0", "if (n >= 0") == ["t::mid", "t::slow", "t::child"]
    assert mutate("[1 / n]", "[1 * n]") == ["t::child"]  # no test ran it here; a child may have
    fmap["spawned"] = []
    assert mutate("[1 / n]", "[1 * n]") == []  # no test ran it
    fmap["spawned"] = ["t::child"]
    assert mutate("if i: n += 1", "if i: n -= 1") == every  # ran outside a test's call: every test
    assert mutate("def pick(n, items)", "def pick(n, items=())") == every  # the signature: the function's


def test_run_puts_the_tests_that_killed_the_functions_mutants_first(tmp_path):
    f = _focus()
    work, fmap = _work(tmp_path, f, {"outer": ["t::a", "t::b", "t::c"], "get": ["t::a", "t::c"]})
    (work / "focus.json").write_text(json.dumps(fmap))
    src = work / "src" / "pkg" / "m.py"
    run = [sys.executable, str(FOCUS), "run", str(work), "--", sys.executable, "-c"]
    fake = "import sys; print(sys.argv[1:]); print('FAILED t::c - assert 1 == 2'); raise SystemExit(1)"

    def once(old: str, new: str, script: str = fake) -> str:
        src.write_text(MODULE.replace(old, new, 1))
        r = subprocess.run([*run, script], capture_output=True, text=True)
        return r.stdout.splitlines()[1]

    assert once("return x * k", "return x / k") == "['t::a', 't::b', 't::c']"  # fastest first
    assert once("return x * k", "return x + k") == "['t::c', 't::a', 't::b']"  # t::c killed outer's last
    assert once("return 1", "return 2") == "['t::a', 't::c']"  # get's own record: none yet
    passed = "import sys; print(sys.argv[1:])"
    assert once("return x * k", "return x - k", passed) == "['t::c', 't::a', 't::b']"  # a survivor adds none
    kills = json.loads((work / "focus-kills.json").read_text())
    assert kills == {"outer in pkg/m.py": {"t::c": 2}, "get in pkg/m.py": {"t::c": 1}}


def test_failed_is_the_whole_test_id_of_the_summary_line():
    f = _focus()
    out = "....F\nFAILED t::a[one two] - AssertionError: x\n1 failed, 4 passed in 1.0s\n"
    assert f._failed(out, ["t::a", "t::a[one two]"]) == "t::a[one two]"  # a parameter with a blank
    assert f._failed("ERROR t::b - fixture\n", ["t::a", "t::b"]) == "t::b"
    assert f._failed("1 passed\n", ["t::a"]) is None


def _one_test_work(tmp_path: Path, f, body: str, *pytest_flags: str) -> tuple[Path, dict, list[str], dict]:
    """A copy with one test file, ``tests/test_loop.py`` whose ``test_get`` is ``body`` (after
    ``from pkg import m``), mapped onto ``get`` with a watchdog of 2 s plus: the copy, its map,
    focus's run command (pytest ``-x -q`` and ``pytest_flags``) and the environment it runs in."""
    work, fmap = _work(tmp_path, f, {"get": ["tests/test_loop.py::test_get"]})
    (work / "src" / "pkg" / "__init__.py").write_text("")
    (work / "tests").mkdir()
    (work / "tests" / "test_loop.py").write_text(f"from pkg import m\n\ndef test_get():\n{body}")
    fmap.update(every=["tests/test_loop.py::test_get"], spawned=[], limit_base=2.0,
                durations={"tests/test_loop.py::test_get": 0.1})  # fmt: skip
    (work / "focus.json").write_text(json.dumps(fmap))
    run = [sys.executable, str(FOCUS), "run", str(work), "--", sys.executable, "-m", "pytest", "-x", "-q",
           *pytest_flags, "-p", "no:cacheprovider"]  # fmt: skip
    return work, fmap, run, {**os.environ, "PYTHONPATH": str(work / "src")}


def test_a_mutant_that_loops_ends_at_its_tests_limit(tmp_path):
    f = _focus()
    work, fmap, run, env = _one_test_work(tmp_path, f, "    assert m.Box().get() == 1\n")
    assert f.limits(fmap["durations"], fmap["every"], 2.0) == {"tests/test_loop.py::test_get": 2.0 + 0.5 + 0.1}
    src = work / "src" / "pkg" / "m.py"
    src.write_text(MODULE.replace("        return 1", "        while True:\n            pass"))
    t0 = time.perf_counter()
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "focus: timed out: tests/test_loop.py::test_get ran past its limit of 3 s" in r.stdout
    assert time.perf_counter() - t0 < 60
    src.write_text(MODULE.replace("        return 1", "        return 2"))  # fails, does not loop
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "timed out" not in r.stdout and "FAILED tests/test_loop.py::test_get" in r.stdout
    src.write_text(MODULE.replace("        return 1", "        return 1  # unchanged"))  # passes
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "1 passed" in r.stdout


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # dead, not yet reaped


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child subreaper is Linux's")
def test_a_child_the_tests_leave_running_ends_with_the_run(tmp_path):
    """A test that starts a process and ends without it, by the watchdog while the mutant loops
    (a test's ``subprocess.run(timeout=...)`` child is not ended when pytest is) or by passing:
    the child holds pytest's stdout (``-s``) and sleeps for 300 s; ``run`` returns at once, and the child is gone."""
    f = _focus()
    body = (
        "    import subprocess, sys\n"
        "    from pathlib import Path\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "    Path('child.pid').write_text(str(p.pid))\n"
        "    assert m.Box().get() == 1\n"
    )
    # -s: the child inherits pytest's own stdout, the pipe or file run reads pytest's output from
    work, _, run, env = _one_test_work(tmp_path, f, body, "-s")
    src = work / "src" / "pkg" / "m.py"
    for body, rc, said in (
        ("while True:\n            pass", 1, "focus: timed out:"),
        ("return 1  # unchanged", 0, "1 passed"),
    ):
        src.write_text(MODULE.replace("return 1", body, 1))
        (work / "child.pid").unlink(missing_ok=True)
        t0 = time.perf_counter()
        try:
            r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)
        finally:
            pid = int((work / "child.pid").read_text()) if (work / "child.pid").exists() else None
            alive = pid is not None and not _gone(pid)
            if alive:  # the failure below says so; do not leave it to the machine
                os.kill(pid, 9)
        assert pid is not None and not alive, r.stdout
        assert (
            r.returncode == rc and said in r.stdout and "focus: ended 1 process(es) the tests left running" in r.stdout
        )
        assert time.perf_counter() - t0 < 60
