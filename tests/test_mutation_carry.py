"""tools/mutation/carry.py: a new run carries the last run's kills of the same mutants of unchanged code.

The sessions are cosmic-ray's sqlite files, written here by hand (cosmic-ray is not a test
dependency): the tables and columns ``carry`` reads and writes.
"""

from __future__ import annotations

import shutil
import sqlite3
import sys
from pathlib import Path

import pytest
from conftest import load_tool

REPO = Path(__file__).resolve().parents[1]
CARRY = REPO / "tools" / "mutation" / "carry.py"
pytestmark = pytest.mark.skipif(not CARRY.exists(), reason="tools/ is not in an installed package")

REL = "pyllamacpp/mod.py"
OLD = '''"""Mod."""


def a(x):
    """Doc a."""
    return x + 1


def b(x):
    y = x * 2
    return y if x > 0 else x - 1


def c(x):
    y = x - 3
    return y - 3
'''
# a function above them all (every line moves), a's docstring edited (its code is the same), b's
# comparison changed (all its mutants run again, those of its unchanged line too), c as it was
NEW = (
    OLD.replace('"""Mod."""\n', '"""Mod."""\n\n\ndef first(x):\n    return x + 10\n')
    .replace('"""Doc a."""', '"""Doc a, longer now,\n    over two lines."""')
    .replace("x > 0", "x > 1")
)

SCHEMA = """
CREATE TABLE work_items (job_id VARCHAR NOT NULL, PRIMARY KEY (job_id));
CREATE TABLE mutation_specs (module_path VARCHAR, operator_name VARCHAR, operator_args JSON, occurrence INTEGER,
    start_pos_row INTEGER, start_pos_col INTEGER, end_pos_row INTEGER, end_pos_col INTEGER, definition_name VARCHAR,
    job_id VARCHAR NOT NULL, PRIMARY KEY (job_id));
CREATE TABLE work_results (worker_outcome VARCHAR(9), output TEXT, test_outcome VARCHAR(11), diff TEXT,
    job_id VARCHAR NOT NULL, PRIMARY KEY (job_id));
"""


def _load():
    return load_tool(CARRY, "carry")


def _at(text: str, line: str, span: str, nth: int = 0) -> tuple[int, int, int, int]:
    """The (row, col, row, col) of ``span`` in the ``nth`` line of ``text`` that equals ``line`` stripped."""
    rows = [i for i, ln in enumerate(text.splitlines(), 1) if ln.strip() == line]
    r = rows[nth]
    c = text.splitlines()[r - 1].index(span)
    return r, c, r, c + len(span)


# (job, operator, occurrence, line, span, nth line): the mutants of both runs, by their text
MUTANTS = [
    ("a+", "core/ReplaceBinaryOperator_Add_Sub", 0, "return x + 1", "+", 0),
    ("b*", "core/ReplaceBinaryOperator_Mul_Add", 0, "y = x * 2", "*", 0),  # its line is the same, not b
    ("c-", "core/ReplaceBinaryOperator_Sub_Add", 1, "y = x - 3", "-", 0),
    ("c3+", "core/NumberReplacer", 2, "y = x - 3", "3", 0),  # one number, two mutants (3 + 1, 3 - 1)
    ("c3-", "core/NumberReplacer", 3, "y = x - 3", "3", 0),
    ("cy", "core/ReplaceBinaryOperator_Sub_Add", 2, "return y - 3", "-", 0),
    ("cy3", "core/NumberReplacer", 4, "return y - 3", "3", 0),
]


def _session(path: Path, text: str, rows, results: dict[str, str]) -> None:
    db = sqlite3.connect(path)
    db.executescript(SCHEMA)
    for job, op, occ, line, span, nth in rows:
        r0, c0, r1, c1 = _at(text, line, span, nth)
        db.execute("INSERT INTO work_items VALUES (?)", (job,))
        db.execute(
            "INSERT INTO mutation_specs VALUES (?, ?, '{}', ?, ?, ?, ?, ?, 'f', ?)",
            (f"/w/src/{REL}", op, occ, r0, c0, r1, c1, job),
        )
    for job, outcome in results.items():
        db.execute("INSERT INTO work_results VALUES ('NORMAL', ?, ?, 'diff', ?)", (f"out {job}", outcome, job))
    db.commit()
    db.close()


def test_kills_and_named_survivors_of_unchanged_code_carry_at_their_new_places_and_nothing_else(tmp_path):
    carry = _load()
    old, new = tmp_path / "old.sqlite", tmp_path / "new.sqlite"
    # the old run: five kills and two survivors, one of them named equivalent
    _session(old, OLD, MUTANTS, {"a+": "KILLED", "b*": "KILLED", "c-": "KILLED", "c3+": "KILLED", "c3-": "KILLED",
                                 "cy": "SURVIVED", "cy3": "SURVIVED"})  # fmt: skip
    fresh = [(f"new-{j}", *rest) for j, *rest in MUTANTS]
    fresh.append(("new-first", "core/ReplaceBinaryOperator_Add_Sub", 0, "return x + 10", "+", 0))
    _session(new, NEW, fresh, {})
    results = carry.old_results(old)
    assert len(results) == 7
    seen = []

    def named(line, op, where, diff):  # targets.toml's test, on the new run's line
        seen.append((line, op))
        return op == "core/ReplaceBinaryOperator_Sub_Add" and NEW.splitlines()[line - 1].strip() == "return y - 3"

    assert carry.carry(results, {REL: OLD}, new, {REL: NEW}, named) == (4, 1)
    assert sorted(seen) == [(21, "core/NumberReplacer"), (21, "core/ReplaceBinaryOperator_Sub_Add")]
    db = sqlite3.connect(new)
    got = dict(db.execute("SELECT job_id, test_outcome FROM work_results").fetchall())
    outputs = dict(db.execute("SELECT job_id, output FROM work_results").fetchall())
    db.close()
    # a (docstring edited) and c (unchanged, its number's two mutants paired in order) carry, with
    # c's named survivor; b's changed code, the other survivor and the new function run again
    kills = {"new-a+": "KILLED", "new-c-": "KILLED", "new-c3+": "KILLED", "new-c3-": "KILLED"}
    assert got == {**kills, "new-cy": "SURVIVED"}
    assert outputs["new-c3+"] == f"{carry.CARRIED}\nout c3+" and outputs["new-c3-"] == f"{carry.CARRIED}\nout c3-"


def test_a_unit_is_its_code_without_docstrings():
    carry = _load()
    spans, code = carry.units(NEW)
    assert [s[0] for s in spans] == ["first", "a", "b", "c"] and spans[1][1:] == (8, 11)
    _, old_code = carry.units(OLD)
    assert [k for k in code if code[k] != old_code.get(k)] == ["first", "b"]
    assert code["<module>"] == old_code["<module>"]  # the module docstring is left out too


def test_a_ledger_carries_what_its_session_carries_and_holds_no_path_of_the_machine(tmp_path):
    carry = _load()
    old, ledger = tmp_path / "old.sqlite", tmp_path / "ledger" / "g.jsonl"
    _session(old, OLD, MUTANTS, {"a+": "KILLED", "b*": "KILLED", "c-": "KILLED", "c3+": "KILLED", "c3-": "KILLED",
                                 "cy": "SURVIVED", "cy3": "SURVIVED"})  # fmt: skip
    db = sqlite3.connect(old)  # what cosmic-ray and focus.py leave: pytest's text, the diff's file names
    db.execute("UPDATE work_results SET output = 'timeout' WHERE job_id = 'c-'")
    db.execute("UPDATE work_results SET output = '/w/x.py:3: in a\nfocus: timed out: t1 after 9 s\n' "
               "WHERE job_id = 'c3+'")  # fmt: skip
    db.execute("UPDATE work_results SET diff = '--- mutation diff ---\n--- a/w/src/m.py\n+++ b/w/src/m.py\n"
               "@@ -1 +1 @@\n-    return y - 3\n+    return y + 3' WHERE job_id = 'cy'")  # fmt: skip
    db.commit()
    db.close()
    # a mutant of unchanged code that neither killed nor survived: in the ledger (the report counts
    # it), not carried; one the filters skipped: in neither
    db = sqlite3.connect(old)
    for job, outcome, output in (("cy*", "INCOMPETENT", ""), ("skipped", "SKIPPED", "annotation")):
        r0, c0, r1, c1 = _at(OLD, "return y - 3", "-")
        db.execute("INSERT INTO work_items VALUES (?)", (job,))
        db.execute("INSERT INTO mutation_specs VALUES (?, 'core/ReplaceBinaryOperator_Sub_Mul', '{}', ?, ?, ?, ?, ?, "
                   "'f', ?)", (f"/w/src/{REL}", len(job), r0, c0, r1, c1, job))  # fmt: skip
        db.execute("INSERT INTO work_results VALUES ('ABNORMAL', ?, ?, '', ?)", (output, outcome, job))
    db.commit()
    db.close()
    assert carry.write_ledger(old, "abc123", ledger, ("focus: timed out:",), not_run=3) == 8
    text = ledger.read_text()
    assert "/w/" not in text  # neither the outputs' nor the diffs' paths
    meta, rows = carry.read_ledger(ledger)
    assert meta == {"commit": "abc123", "results": 8, "not_run": 3} and len(rows) == 8
    outputs = sorted(r[8] for r in rows)
    assert outputs == ["", "", "", "", "", "", "focus: timed out: t1 after 9 s", "timeout"]
    assert "-    return y - 3\n+    return y + 3" in [r[10] for r in rows]

    def named(line, op, where, diff):
        return op == "core/ReplaceBinaryOperator_Sub_Add" and NEW.splitlines()[line - 1].strip() == "return y - 3"

    got = {}
    for name, results in (("session", carry.old_results(old)), ("ledger", rows)):
        new = tmp_path / f"new-{name}.sqlite"
        more = [("cy*", "core/ReplaceBinaryOperator_Sub_Mul", 3, "return y - 3", "-", 0)]
        _session(new, NEW, [(f"new-{j}", *rest) for j, *rest in MUTANTS + more], {})
        assert carry.carry(results, {REL: OLD}, new, {REL: NEW}, named) == (4, 1)
        db = sqlite3.connect(new)
        got[name] = dict(db.execute("SELECT job_id, test_outcome FROM work_results").fetchall())
        db.close()
    assert got["ledger"] == got["session"] == {"new-a+": "KILLED", "new-c-": "KILLED", "new-c3+": "KILLED",
                                               "new-c3-": "KILLED", "new-cy": "SURVIVED"}  # fmt: skip
    ledger.write_text(text.replace('"results": 8', '"results": 9'))
    with pytest.raises(ValueError, match="8 results, its header says 9"):
        carry.read_ledger(ledger)


def test_report_only_reads_from_the_ledger_what_the_run_reported(tmp_path, monkeypatch, capsys):
    """run.py ``--save-ledger`` writes the run's counts beside its results (skipped per reason, not
    run yet, what it carried), and ``--report-only`` on a machine without the run prints from the
    ledger the report the run printed."""
    monkeypatch.syspath_prepend(str(CARRY.parent))  # run.py imports carry.py from beside it
    run = load_tool(REPO / "tools" / "mutation" / "run.py", "mutation_run")
    root = tmp_path / "repo"  # no git here: run.py reads the targets from TARGETS
    (root / "tools" / "mutation").mkdir(parents=True)
    targets = root / "tools" / "mutation" / "targets.toml"
    r0 = _at(OLD, "return y - 3", "-")[0]
    targets.write_text(
        f'[target.g]\nmodules = ["{REL}"]\ntests = ["tests/test_mod.py"]\n'
        f'[[target.g.equivalent]]\nline = {r0}\noperator = "core/ReplaceBinaryOperator_Sub_Add"\nwhy = "y"\n'
    )
    monkeypatch.setattr(run, "ROOT", root)
    monkeypatch.setattr(run, "TARGETS", targets)
    monkeypatch.setattr(run, "LEDGERS", root / "tools" / "mutation" / "ledger")
    work = root / "build" / "mutation" / "g"
    work.mkdir(parents=True)
    (work / "COMMIT").write_text("c0ffee" * 6 + "abcd")
    (work / "CARRIED").write_text("2 1 " + "be" * 20)
    (work / "TESTS_COMMIT").write_text("fade" * 10)
    _session(work / "session.sqlite", OLD, MUTANTS,
             {"a+": "KILLED", "b*": "SURVIVED", "c-": "KILLED", "cy": "SURVIVED"})  # fmt: skip
    db = sqlite3.connect(work / "session.sqlite")  # the filters' marks; c3+ and cy3 not run yet
    db.execute("UPDATE work_results SET output = 'timeout' WHERE job_id = 'c-'")
    db.execute("INSERT INTO work_results VALUES ('SKIPPED', 'annotation', 'SKIPPED', '', 'c3-')")
    db.commit()
    db.close()

    def main(*argv: str) -> str:
        monkeypatch.setattr(sys, "argv", ["run.py", "g", *argv])
        assert run.main() in (0, None)
        return capsys.readouterr().out

    assert "4 results of the run at c0ffeec0ff written to tools/mutation/ledger/g.jsonl" in main("--save-ledger")
    here = main("--report-only")
    assert here.startswith(
        "g (at c0ffeec0ff, 2 kills and 1 named equivalents carried from the run at bebebebebe, survivors against "
        "the tests of fadefadefa): 4 mutants, 1 killed, 1 timed out, 1 survived, 1 equivalent named in "
        "targets.toml, 1 in annotations (skipped): kill rate 66.7% of the non-equivalent; 2 not run yet"
    )
    assert "-- survived: mod.py:" in here
    shutil.rmtree(root / "build")
    assert main("--report-only") == "(from tools/mutation/ledger/g.jsonl)\n" + here


def test_a_stop_puts_back_the_mutants_it_cut_off_and_keeps_every_result(tmp_path, monkeypatch):
    """run.py: a stop's cut-off mutants go back to not run (an http worker gone: cosmic-ray's
    abnormal "Cannot connect to host"; a test run killed with the run: nothing but focus.py's first
    line), while a kill, a crash, a timeout and a survivor stay; the session's module paths become
    relative to the copy (``src/...``), which carry reads as the absolute ones."""
    monkeypatch.syspath_prepend(str(CARRY.parent))
    run = load_tool(REPO / "tools" / "mutation" / "run.py", "mutation_run")
    carry = load_tool(CARRY, "mutation_carry")
    path = tmp_path / "session.sqlite"
    _session(path, OLD, MUTANTS[:6], {j: "KILLED" for j, *_ in MUTANTS[:6]})
    head = "focus: 3 of 9 tests for line 5 of a in pyllamacpp/mod.py\n"
    outputs = {
        "a+": ("NORMAL", "KILLED", head + "F\nFAILED tests/test_mod.py::t - assert 1 == 2\n"),
        "b*": ("NORMAL", "KILLED", head),  # killed with the run
        "c-": ("ABNORMAL", None, "Cannot connect to host 127.0.0.1:9 ssl:default [Connect call failed]"),
        "c3+": ("NORMAL", "KILLED", head + "Fatal Python error: Segmentation fault\n"),
        "c3-": ("NORMAL", "KILLED", head + "focus: timed out: tests/test_mod.py::t ran past its limit of 20 s\n"),
        "cy": ("NORMAL", "SURVIVED", head + ".\n1 passed\n"),
    }
    db = sqlite3.connect(path)
    for job, (worker, test, out) in outputs.items():
        db.execute("UPDATE work_results SET worker_outcome = ?, test_outcome = ?, output = ? WHERE job_id = ?",
                   (worker, test, out, job))  # fmt: skip
    db.commit()
    assert run._unreached(path) == 2
    run._relative_paths(path)
    assert {j for (j,) in db.execute("SELECT job_id FROM work_results")} == {"a+", "c3+", "c3-", "cy"}
    assert {p for (p,) in db.execute("SELECT module_path FROM mutation_specs")} == {f"src/{REL}"}
    db.close()
    assert carry._rel(f"src/{REL}") == carry._rel(f"/w/src/{REL}") == REL


def test_the_kills_a_run_carries_from_a_ledger_stay_when_it_starts(tmp_path, monkeypatch):
    """A ledger keeps no pytest text: a kill's output there is empty or focus.py's line alone, what
    a stop leaves of a test run it cut off. The run that carries them from the ledger marks each as
    carried, and the clean-up of its start (``_unreached``) keeps them: it had put back every kill
    carried from a ledger (a fresh machine ran all of them again, 883 of the trie group's)."""
    monkeypatch.syspath_prepend(str(CARRY.parent))
    run = load_tool(REPO / "tools" / "mutation" / "run.py", "mutation_run")
    carry = load_tool(CARRY, "mutation_carry")
    old, ledger = tmp_path / "old.sqlite", tmp_path / "g.jsonl"
    _session(old, OLD, MUTANTS, {"a+": "KILLED", "c-": "KILLED", "c3+": "KILLED", "c3-": "KILLED", "cy": "SURVIVED"})
    db = sqlite3.connect(old)
    db.execute("UPDATE work_results SET output = 'focus: 3 of 9 tests for line 5 of a in m.py\nF' WHERE job_id = 'a+'")
    db.execute("UPDATE work_results SET output = 'timeout' WHERE job_id = 'c-'")
    db.execute("UPDATE work_results SET output = 'focus: timed out: t1 after 9 s' WHERE job_id = 'c3+'")
    db.commit()
    db.close()
    carry.write_ledger(old, "abc123", ledger, (run.NO_TEST, run.TIMED_OUT))
    _meta, rows = carry.read_ledger(ledger)
    assert sorted(r[8] for r in rows) == ["", "", "", "focus: timed out: t1 after 9 s", "timeout"]
    new = tmp_path / "new.sqlite"
    _session(new, NEW, [(f"new-{j}", *rest) for j, *rest in MUTANTS], {})
    assert carry.carry(rows, {REL: OLD}, new, {REL: NEW}) == (4, 0)
    assert run._unreached(new) == 0
    db = sqlite3.connect(new)
    got = dict(db.execute("SELECT job_id, output FROM work_results").fetchall())
    db.close()
    assert set(got) == {"new-a+", "new-c-", "new-c3+", "new-c3-"}
    assert got["new-c-"] == "timeout" and got["new-c3+"] == f"{carry.CARRIED}\nfocus: timed out: t1 after 9 s"
    assert got["new-a+"] == got["new-c3-"] == f"{carry.CARRIED}\n"
    # carried again from that session (the same machine's next run): marked once
    again = tmp_path / "again.sqlite"
    _session(again, NEW, [(f"again-{j}", *rest) for j, *rest in MUTANTS], {})
    assert carry.carry(carry.old_results(new), {REL: NEW}, again, {REL: NEW}) == (4, 0)
    db = sqlite3.connect(again)
    assert db.execute("SELECT output FROM work_results WHERE job_id = 'again-a+'").fetchone() == (f"{carry.CARRIED}\n",)
    db.close()


def test_a_name_tells_two_lines_that_mutate_to_the_same_text_apart_by_what_they_were():
    """``to`` is matched in a mutant's + lines and ``from`` in its - lines: two loops of one
    function that both become ``for k in []:`` are one name's with ``from``, both without it."""
    run = load_tool(REPO / "tools" / "mutation" / "run.py", "mutation_run")
    op = "core/ZeroIterationForLoop"
    first = "--- a\n+++ b\n@@ -1 +1 @@\n-    for k in order:\n+    for k in []:\n"
    last = "--- a\n+++ b\n@@ -1 +1 @@\n-    for k in range(len(uniq)):\n+    for k in []:\n"
    name = {"function": "loglikelihood", "operator": op, "to": "+    for k in []:"}
    narrow = {**name, "from": "-    for k in range(len(uniq)):"}
    assert run._is_equivalent([name], 328, op, "loglikelihood", first)
    assert run._is_equivalent([name], 442, op, "loglikelihood", last)
    assert not run._is_equivalent([narrow], 328, op, "loglikelihood", first)
    assert run._is_equivalent([narrow], 442, op, "loglikelihood", last)
    assert not run._is_equivalent([narrow], 442, op, "_walk", last)  # another function's
    assert not run._is_equivalent([narrow], 442, "core/NumberReplacer", "loglikelihood", last)


def test_mutants_of_one_text_carry_only_where_each_of_them_has_its_result(tmp_path):
    """A method with two lines written twice (one unit, one text each): where the last run has a
    result for the second one only, neither carries (paired in order, the first got the second's);
    where it has both, they pair in order."""
    carry = _load()
    text = (
        "class K:\n    def f(self, x):\n        y = x * 2\n        x = x + 1\n"
        "        y = x * 2\n        x = x + 1\n        return x + y\n"
    )
    rows = [
        ("f+", "core/ReplaceBinaryOperator_Add_Sub", 0, "x = x + 1", "+", 0),
        ("g+", "core/ReplaceBinaryOperator_Add_Sub", 1, "x = x + 1", "+", 1),
        ("f*", "core/ReplaceBinaryOperator_Mul_Add", 0, "y = x * 2", "*", 0),
        ("g*", "core/ReplaceBinaryOperator_Mul_Add", 1, "y = x * 2", "*", 1),
    ]
    old, new = tmp_path / "old.sqlite", tmp_path / "new.sqlite"
    _session(old, text, rows, {"g+": "KILLED", "f*": "KILLED", "g*": "KILLED"})  # f+ not run
    _session(new, text, [(f"new-{j}", *rest) for j, *rest in rows], {})
    assert carry.carry(carry.old_results(old), {REL: text}, new, {REL: text}) == (2, 0)
    db = sqlite3.connect(new)
    outputs = dict(db.execute("SELECT job_id, output FROM work_results").fetchall())
    db.close()
    assert outputs == {"new-f*": f"{carry.CARRIED}\nout f*", "new-g*": f"{carry.CARRIED}\nout g*"}  # f+, g+ run again


def test_each_method_of_a_class_is_a_unit_of_its_own(tmp_path):
    """An edit of one method runs that method's mutants again and carries the other methods' (the
    trie's ``_Walk`` is one class: a one-line fix in ``_restore`` ran all its methods' again); an
    edit of the class's own attributes carries every method's."""
    carry = _load()
    old = (
        "class K:\n    size = 2\n\n    def f(self, x):\n        return x + 1\n\n"
        "    def g(self, x):\n        return x * 2\n"
    )
    spans, code = carry.units(old)
    assert [s[0] for s in spans] == ["K.f", "K.g", "K"] and spans[0][1:] == (4, 5) and spans[2][1:] == (1, 8)
    assert carry._unit_at(spans, 5) == "K.f" and carry._unit_at(spans, 2) == "K"
    rows = [
        ("f+", "core/ReplaceBinaryOperator_Add_Sub", 0, "return x + 1", "+", 0),
        ("g*", "core/ReplaceBinaryOperator_Mul_Add", 0, "return x * 2", "*", 0),
    ]
    edited = [rows[0], ("g*", "core/ReplaceBinaryOperator_Mul_Add", 0, "return x * 2 + 0", "*", 0)]
    for new_text, new_rows, carried in (
        (old.replace("x * 2", "x * 2 + 0"), edited, {"new-f+"}),  # g edited
        (old.replace("size = 2", "size = 3"), rows, {"new-f+", "new-g*"}),  # the class's attribute
    ):
        a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
        for p in (a, b):
            p.unlink(missing_ok=True)
        _session(a, old, rows, {"f+": "KILLED", "g*": "KILLED"})
        _session(b, new_text, [(f"new-{j}", *rest) for j, *rest in new_rows], {})
        assert carry.carry(carry.old_results(a), {REL: old}, b, {REL: new_text}) == (len(carried), 0)
        db = sqlite3.connect(b)
        assert {j for (j,) in db.execute("SELECT job_id FROM work_results")} == carried
        db.close()
