"""Mutation testing of one module against its test files, with cosmic-ray, on a copy of the tree.

    python tools/mutation/run.py lora                 # a target from tools/mutation/targets.toml
    python tools/mutation/run.py --list               # the targets
    python tools/mutation/run.py lora --report-only   # the last run's report again

cosmic-ray mutates the module's file in place, runs the test command, and puts the file back, one
mutant at a time. It works here on a copy (``build/mutation/<target>/``): the package's Python
files, the compiled parts of the installed package (the extension and the libraries beside it,
editable install or not), ``tests/`` and links to ``vendor/`` and ``docs/``. A ``sitecustomize.py``
there takes scikit-build-core's editable finder off ``sys.meta_path``, so the tests' own child
interpreters import the mutated copy too. The working tree is never touched.

The report: mutants killed, survived and timed out per target, and each survivor as a diff. A
survivor is a behaviour no test holds, or an equivalent mutant (one that changes nothing a test
could see): name it in ``targets.toml``'s ``equivalent`` list (its line, operator and, where one line has
several mutants, ``to``: text of the mutated line) with the reason, and the report
counts the kill rate over the others.

Needs ``pip install cosmic-ray`` (not a test dependency: too slow for CI on 2 cores).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
TARGETS = Path(__file__).with_name("targets.toml")

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


def _copy_tree(work: Path) -> None:
    if work.exists():
        shutil.rmtree(work)
    src = work / "src"
    shutil.copytree(ROOT / "pyllamacpp", src / "pyllamacpp", ignore=shutil.ignore_patterns("__pycache__"))
    for f in _compiled_dir().iterdir():  # the extension, its libraries (_libs/), the build's records
        dst = src / "pyllamacpp" / f.name
        if f.is_dir() and f.name != "__pycache__" and not dst.exists():
            shutil.copytree(f, dst, symlinks=True)
        elif f.is_file() and f.suffix != ".py" and not dst.exists():
            shutil.copy2(f, dst)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("vendor", "docs", "mkdocs.yml", "pyproject.toml", "README.md"):
        (work / name).symlink_to(ROOT / name)
    (src / "sitecustomize.py").write_text(SITECUSTOMIZE.format(root=str(ROOT)))


def _config(work: Path, target: dict, timeout: float) -> Path:
    tests = " ".join(target["tests"])
    k = f" -k {target['k']!r}" if target.get("k") else ""
    cmd = f"env PYTHONPATH={work / 'src'} {sys.executable} -m pytest -x -q -p no:cacheprovider {tests}{k}"
    cfg = work / "cosmic-ray.toml"
    modules = ", ".join(json.dumps(str(work / "src" / m)) for m in target["modules"])
    cfg.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{modules}]\n"
        f"timeout = {timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(cmd)}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
    )
    return cfg


def _report(work: Path, name: str, target: dict) -> dict:
    db = sqlite3.connect(work / "session.sqlite")
    rows = db.execute(
        "SELECT m.module_path, m.operator_name, m.start_pos_row, m.definition_name, r.test_outcome, r.diff "
        "FROM mutation_specs m JOIN work_results r ON m.job_id = r.job_id WHERE r.output IS NOT 'annotation'"
    ).fetchall()
    (n_annotation,) = db.execute("SELECT count(*) FROM work_results WHERE output = 'annotation'").fetchone()
    named = target.get("equivalent", [])

    def is_equivalent(line: int, op: str, diff: str | None) -> bool:
        plus = "\n".join(ln for ln in (diff or "").splitlines() if ln.startswith("+") and not ln.startswith("+++"))
        return any(e["line"] == line and e["operator"] == op and e.get("to", "") in plus for e in named)

    killed = survived = timeouts = equiv = 0
    survivors = []
    for module, op, line, where, outcome, diff in rows:
        if is_equivalent(line, op, diff):
            equiv += 1
        elif (outcome or "").lower() == "killed":
            killed += 1
        elif (outcome or "").lower() == "survived":
            survived += 1
            survivors.append((Path(module).name, line, where, op, diff))
        else:
            timeouts += 1  # an incompetent mutant or a hang: counted as killed by the timeout
    judged = killed + survived + timeouts
    rate = (killed + timeouts) / judged if judged else 0.0
    print(
        f"{name}: {len(rows)} mutants, {killed} killed, {timeouts} timed out, {survived} survived, "
        f"{equiv} equivalent named in targets.toml, {n_annotation} in annotations (skipped): kill rate "
        f"{rate:.1%} of the non-equivalent"
    )
    for module, line, where, op, diff in sorted(survivors):
        print(f"\n-- survived: {module}:{line} in {where} ({op})")
        changed = [ln for ln in (diff or "").splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
        print("\n".join(changed))
    return {
        "target": name,
        "mutants": len(rows),
        "killed": killed,
        "timeouts": timeouts,
        "survived": survived,
        "equivalent": equiv,
        "kill_rate": rate,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", nargs="?", help="a target of tools/mutation/targets.toml")
    ap.add_argument("--list", action="store_true", help="list the targets")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run")
    ap.add_argument("--report-only", action="store_true", help="print the last run's report")
    args = ap.parse_args()
    targets = tomllib.loads(TARGETS.read_text())["target"]
    if args.list or not args.target:
        for n, t in targets.items():
            print(f"{n:12} {' '.join(t['modules'])}  <-  {' '.join(t['tests'])}")
        return 0
    target = targets[args.target]
    work = ROOT / "build" / "mutation" / args.target
    if not args.report_only:
        if shutil.which("cosmic-ray") is None:
            sys.exit("cosmic-ray is not installed: pip install cosmic-ray")
        _copy_tree(work)
        cfg = _config(work, target, args.timeout)
        session = work / "session.sqlite"
        t0 = time.perf_counter()
        subprocess.run(["cosmic-ray", "init", str(cfg), str(session)], check=True, cwd=work)
        subprocess.run(["cr-filter-pragma", str(session)], check=True, cwd=work)  # "# pragma: no mutate"
        skip = Path(__file__).with_name("skip_annotations.py")
        subprocess.run([sys.executable, str(skip), str(session)], check=True, cwd=work)
        subprocess.run(["cosmic-ray", "baseline", str(cfg)], check=True, cwd=work)
        subprocess.run(["cosmic-ray", "exec", str(cfg), str(session)], check=True, cwd=work)
        print(f"{args.target}: {time.perf_counter() - t0:.0f} s", flush=True)
    out = _report(work, args.target, target)
    (work / "report.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
