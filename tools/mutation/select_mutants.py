"""A cosmic-ray filter: keep the mutants of some functions, and of those a random sample.

    python select_mutants.py SESSION [--functions a,b] [--sample N --seed S]

``--functions``: mutants outside the named functions (cosmic-ray's ``definition_name``, the
innermost ``def`` or ``class`` around the mutation) are marked skipped with output ``outside``.
``--sample``: of the mutants still pending after that (annotations are already skipped), N drawn
with ``random.Random(S)`` are kept and the others marked skipped with output ``unsampled``. The
report counts neither, and gives the kill rate of a sample with its 95 % interval (Wilson), as the
estimate it is: a module of a thousand mutants whose tests take a minute is days of work on two
cores, a sample of sixty is an hour."""

from __future__ import annotations

import argparse
import random
import sys

from carry import _rel  # beside this file
from cosmic_ray.work_db import WorkDB, use_db
from cosmic_ray.work_item import WorkerOutcome, WorkResult


def _skip(db: WorkDB, job_id: str, why: str) -> None:
    db.set_result(job_id, WorkResult(output=why, test_outcome=None, diff=None, worker_outcome=WorkerOutcome.SKIPPED))


def _what(item) -> list:
    """A mutant's identity across runs: job ids are drawn anew by each ``cosmic-ray init``, so the
    sample is drawn in this order, and a seed names the same sample of the same code."""
    return [(_rel(m.module_path), tuple(m.start_pos), m.operator_name, m.occurrence) for m in item.mutations]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("session")
    ap.add_argument("--functions", default="", help="comma-separated names of the functions to mutate")
    ap.add_argument("--sample", type=int, default=0, help="how many of the pending mutants to keep (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    wanted = {f.strip() for f in args.functions.split(",") if f.strip()}
    with use_db(args.session, WorkDB.Mode.open) as db:
        pending = [item for item in db.pending_work_items]
        if wanted:
            keep = []
            for item in pending:
                if any(m.definition_name in wanted for m in item.mutations):
                    keep.append(item)
                else:
                    _skip(db, item.job_id, "outside")
            pending = keep
        if args.sample and args.sample < len(pending):
            # job ids are drawn anew by each `cosmic-ray init`: order by what the mutant is instead, so
            # that a seed names the same sample of the same code
            pending.sort(key=_what)
            chosen = {item.job_id for item in random.Random(args.seed).sample(pending, args.sample)}
            for item in pending:
                if item.job_id not in chosen:
                    _skip(db, item.job_id, "unsampled")
        print(f"{args.session}: {len(pending)} mutants in scope, {min(len(pending), args.sample or len(pending))} kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
