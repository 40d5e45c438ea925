"""A cosmic-ray filter: mark as skipped the mutants inside annotations and ``if TYPE_CHECKING:``.

Under ``from __future__ import annotations`` (every module of the package) an annotation is a
string nobody evaluates at run time, and ``TYPE_CHECKING`` imports exist for mypy only: a mutant
there is equivalent by construction. run.py calls this after ``cosmic-ray init`` and counts them
apart from the others."""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

from cosmic_ray.tools.filters.filter_app import FilterApp
from cosmic_ray.work_item import WorkerOutcome, WorkResult


@cache
def _spans(path: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    tree = ast.parse(Path(path).read_text())
    out = []

    def add(node: ast.AST | None) -> None:
        if node is not None:
            out.append(((node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            add(node.returns)
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None:
                    add(arg.annotation)
        elif isinstance(node, ast.AnnAssign):
            add(node.annotation)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            add(node.test)
            for stmt in node.body:
                add(stmt)
    return out


def _inside(path: str, start: tuple[int, int]) -> bool:
    return any(a <= tuple(start) < b or a == tuple(start) for a, b in _spans(path))


class SkipAnnotations(FilterApp):
    def description(self) -> str:
        return __doc__ or ""

    def filter(self, work_db, _args) -> None:
        for item in work_db.work_items:
            if all(_inside(str(m.module_path), m.start_pos) for m in item.mutations):
                result = WorkResult(output="annotation", test_outcome=None, diff=None,
                                    worker_outcome=WorkerOutcome.SKIPPED)  # fmt: skip
                work_db.set_result(item.job_id, result)


if __name__ == "__main__":
    sys.exit(SkipAnnotations().main())
