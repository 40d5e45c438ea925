"""Carry the killed mutants of an earlier run into a new one, where the code they mutate is unchanged.

A fix in a target's module used to mean running the whole group again: its mutants are numbered
per operator (cosmic-ray's ``occurrence``), so an edit above a mutant moves it, and a run can only
go on at the commit it began. A new run (``cosmic-ray init`` at HEAD) carries over, from the last
run, the result of each mutant that is the same mutant of the same code:

- the same operator on the same text (the mutated span and its whole line) in the same module;
- inside a unit whose code is the same at both commits (its ``ast`` with the docstrings left out,
  so an edited docstring or a moved function keeps its results, and any other edit in it runs all
  its mutants again): a top-level ``def``, a method of a top-level ``class`` (the rest of the class,
  its bases, decorators and attributes, is one unit, and module-level code is one);
- several such mutants (one number replaced two ways, one line written twice in one function)
  pair in order, and only where the last run has a result for each of them: where some of them
  were not run, which result was whose is not known (pairing in order gave one mutant the result
  of another line's), and all of them run again.

The last run is its session (``build/mutation/<target>/session.sqlite``) where this machine has
one, else the group's ledger (``tools/mutation/ledger/<target>.jsonl``, :func:`write_ledger`): its
results in the same form, committed, so that a run of many hours goes on across sessions and
machines whose build folders do not survive.

Kills are carried (a test failed, or looped to its limit): a kill stays one against HEAD's tests,
which only grow. So are the survivors ``targets.toml`` names equivalent (the rate leaves them out,
and running them again costs every test that reaches them); the other survivors run again, against
HEAD's tests, as do the rest (incompetent). Skipped mutants (annotations, outside the target's
functions, unsampled) are decided afresh by the new run's filters.
"""

from __future__ import annotations

import ast
import copy
import json
import sqlite3
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

CARRIED = "carried: the result of the same mutant at the last run"


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def units(text: str) -> tuple[list[tuple[str, int, int]], dict[str, str]]:
    """The module's units: ``[(name, first line, last line)]`` of its top-level ``def``s, of each
    method of its top-level ``class``es (``Class.method``), and of the classes (decorators
    included; a method's span comes before its class's, which holds the rest of the class), and
    per name (``<module>`` for the rest) its code as ``ast.dump`` without docstrings or line
    numbers."""
    tree = ast.parse(text)
    spans, rest = [], []
    code: dict[str, str] = {}

    def add(name: str, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        spans.append((name, first, node.end_lineno or node.lineno))

    def dump(node: ast.AST) -> str:
        return ast.dump(_strip_docstrings(ast.parse(ast.unparse(node))))

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node.name, node)
            code[node.name] = dump(node)
        elif isinstance(node, ast.ClassDef):
            # each method a unit of its own: an edit of one method runs its mutants again, not the
            # class's (the trie's _Walk is most of its group's mutants)
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for m in methods:
                add(f"{node.name}.{m.name}", m)
                code[f"{node.name}.{m.name}"] = dump(m)
            add(node.name, node)
            shell = copy.copy(node)  # the class less its methods: its bases, decorators and attributes
            shell.body = [n for n in node.body if n not in methods] or [ast.Pass()]
            code[node.name] = dump(shell)
        else:
            rest.append(node)
    code["<module>"] = ast.dump(_strip_docstrings(ast.Module(body=rest, type_ignores=[])))
    return spans, code


def _unit_at(spans: list[tuple[str, int, int]], line: int) -> str:
    for name, first, last in spans:
        if first <= line <= last:
            return name
    return "<module>"


def _key(text_lines: list[str], spans, rel: str, op: str, r0: int, c0: int, r1: int, c1: int) -> tuple:
    """A mutant's identity in one commit's text: module, operator, unit, its line and its span."""
    line = text_lines[r0 - 1] if 0 < r0 <= len(text_lines) else ""
    if r0 == r1:
        span = line[c0:c1]
    else:
        last = text_lines[r1 - 1][:c1] if r1 <= len(text_lines) else ""
        span = "\n".join([line[c0:], *text_lines[r0 : r1 - 1], last])
    return (rel, op, _unit_at(spans, r0), line.strip(), span, c0 - (len(line) - len(line.lstrip())))


def _rel(module_path: str) -> str:
    """A mutated module's path in the package (``pyllamacpp/...``), from the copy's: absolute, or
    relative to the copy (``src/...``)."""
    p = str(module_path)
    return p.rsplit("/src/", 1)[-1] if "/src/" in p else p.removeprefix("src/")


SKIPPED = ("annotation", "outside", "unsampled")  # not run: the filters' marks (run.py), decided afresh


def old_results(session: Path, judged: bool = False) -> list[tuple]:
    """The killed and surviving mutants of a run (``judged``: every mutant run, an incompetent or
    timed-out one too): ``(module, operator, occurrence, start row, start col, end row, end col,
    worker_outcome, output, test_outcome, diff, definition_name)``, read before its copy is removed."""
    db = sqlite3.connect(session)
    which = (
        " AND ".join(f"r.output IS NOT '{m}'" for m in SKIPPED)
        if judged
        else "r.test_outcome IN ('KILLED', 'SURVIVED')"
    )
    try:
        return db.execute(
            "SELECT m.module_path, m.operator_name, m.occurrence, m.start_pos_row, m.start_pos_col, m.end_pos_row, "
            "m.end_pos_col, r.worker_outcome, r.output, r.test_outcome, r.diff, m.definition_name "
            f"FROM mutation_specs m JOIN work_results r ON r.job_id = m.job_id WHERE {which}"
        ).fetchall()
    finally:
        db.close()


def carry(
    old: list[tuple],
    old_texts: dict[str, str],
    session: Path,
    new_texts: dict[str, str],
    equivalent: Callable[[int, str, str, str | None], bool] = lambda *a: False,
) -> tuple[int, int]:
    """Write into the new run's ``session`` the results of ``old`` (:func:`old_results`) for its
    pending mutants that are the same mutants of unchanged code; ``old_texts`` and ``new_texts``
    map a module (relative, ``pyllamacpp/...``) to its text at each commit; a survivor is carried
    where ``equivalent(new line, operator, function, diff)`` names it. Returns (kills, survivors)
    carried."""
    parsed = {}
    for rel in set(old_texts) | set(new_texts):
        if rel in old_texts and rel in new_texts:
            parsed[rel] = (units(old_texts[rel]), units(new_texts[rel]))
    olds: dict[tuple, list[tuple]] = defaultdict(list)
    for row in sorted(old, key=lambda r: (r[0], r[1], r[2])):
        rel = _rel(row[0])
        if rel not in parsed or row[9] not in ("KILLED", "SURVIVED"):
            continue
        (spans, code), (_, new_code) = parsed[rel]
        key = _key(old_texts[rel].splitlines(), spans, rel, *row[1:2], *row[3:7])
        if code.get(key[2]) is None or code[key[2]] != new_code.get(key[2]):
            continue  # its unit changed (or is gone): its mutants run again
        olds[key].append(row)
    db = sqlite3.connect(session)
    try:
        pending = db.execute(
            "SELECT m.job_id, m.module_path, m.operator_name, m.occurrence, m.start_pos_row, m.start_pos_col, "
            "m.end_pos_row, m.end_pos_col FROM mutation_specs m LEFT JOIN work_results r ON r.job_id = m.job_id "
            "WHERE r.job_id IS NULL ORDER BY m.module_path, m.operator_name, m.occurrence"
        ).fetchall()
        keyed = []
        for job, path, op, _occ, r0, c0, r1, c1 in pending:
            rel = _rel(path)
            if rel in parsed:
                spans = parsed[rel][1][0]
                keyed.append((job, op, r0, _key(new_texts[rel].splitlines(), spans, rel, op, r0, c0, r1, c1)))
        n_new: dict[tuple, int] = defaultdict(int)
        for *_, key in keyed:
            n_new[key] += 1
        whole = {key for key, n in n_new.items() if len(olds.get(key, ())) == n}  # each has its result
        out = []
        for job, op, r0, key in keyed:
            if key in whole:  # paired in order
                *_, worker, output, test, diff, where = olds[key].pop(0)
                if test == "SURVIVED" and not equivalent(r0, op, where, diff):
                    continue  # runs again, against HEAD's tests
                # the first line says it was carried: a ledger keeps no pytest text, and a kill with
                # nothing but focus.py's lines is one a stop cut off (run.py's _unreached drops it)
                if output != "timeout" and not (output or "").startswith(CARRIED):
                    output = f"{CARRIED}\n{output or ''}"
                out.append((worker, output, test, diff, job))
        db.executemany(
            "INSERT INTO work_results (worker_outcome, output, test_outcome, diff, job_id) VALUES (?, ?, ?, ?, ?)", out
        )
        db.commit()
        n_kills = sum(1 for row in out if row[2] == "KILLED")
        return n_kills, len(out) - n_kills
    finally:
        db.close()


def _marker(output: str | None, markers: tuple[str, ...]) -> str:
    """What the report reads of a mutant's test output: cosmic-ray's ``timeout``, or the line of
    focus.py's that names no test run or a test's time limit; the rest (pytest's text, with the
    machine's paths) is left out."""
    if output == "timeout":
        return output
    return next((ln.strip() for ln in (output or "").splitlines() if any(m in ln for m in markers)), "")


def _changed(diff: str | None) -> str:
    """A mutant's diff as its - and + lines (the file names, with the machine's paths, left out)."""
    return "\n".join(ln for ln in (diff or "").splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---"))


def write_ledger(session: Path, commit: str, path: Path, markers: tuple[str, ...], **header: object) -> int:
    """The run's results (:func:`old_results`, every mutant run, of ``commit``) into ``path``: a
    header line (the commit, the count, and ``header``: what the run's report needs besides), then
    one JSON list per mutant, in a stable order. Returns how many."""
    rows = sorted(old_results(session, judged=True), key=lambda r: (_rel(r[0]), r[1], r[2], r[3], r[4]))
    lines = [json.dumps({"commit": commit, "results": len(rows), **header})]
    for module, op, occ, r0, c0, r1, c1, worker, output, test, diff, where in rows:
        lines.append(json.dumps([_rel(module), op, occ, r0, c0, r1, c1, worker, _marker(output, markers),
                                 test, _changed(diff), where]))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(rows)


def read_ledger(path: Path) -> tuple[dict, list[tuple]]:
    """A ledger's header (``commit``, ``results`` and what the run added) and its results, in
    :func:`old_results`' form."""
    head, *rows = path.read_text().splitlines()
    meta = json.loads(head)
    got = [tuple(json.loads(r)) for r in rows if r.strip()]
    if len(got) != meta["results"]:
        raise ValueError(f"{path}: {len(got)} results, its header says {meta['results']}")
    return meta, got
