"""pyllamacpp.ubatch: llama.cpp's batch split, replayed (the commands' tests are in test_splits.py)."""

from __future__ import annotations

import pyllamacpp.ubatch as ubatch


def test_the_old_import_paths_give_the_library_objects():
    """``pyllamacpp.experiments.ubatch_plan`` (where the replay lived) and ``experiments.splits``
    forward to ``pyllamacpp.ubatch``: the same objects, so ``isinstance`` and ``except PlanError``
    hold across them."""
    from pyllamacpp.experiments import splits, ubatch_plan

    for name in ubatch.__all__:
        assert getattr(ubatch_plan, name) is getattr(ubatch, name), name
    for name in ("BatchAllocr", "PlanError", "split_all", "plan", "pad", "per_seq"):
        assert getattr(splits, name) is getattr(ubatch, name), name
    assert ubatch.plan.__module__ == "pyllamacpp.ubatch"


def test_the_taps_split_a_call_as_the_plan_does():
    """The taps' rows per ubatch come from the library's split: four sequences of 3 tokens, one KV
    stream per sequence, n_ubatch 8: ``split_equal`` takes 2 tokens of each sequence, then the
    last of each."""
    import numpy as np

    from pyllamacpp.taps._rows import _Splitting, plan_ubatches

    class Call:
        seq_ids = [(s,) for s in range(4) for _ in range(3)]
        outputs = np.zeros(12, bool)

    got = plan_ubatches(_Splitting(8, unified=False, recurrent=False, hybrid=False), Call())  # type: ignore[arg-type]
    assert [u.tolist() for u in got] == [[0, 1, 3, 4, 6, 7, 9, 10], [2, 5, 8, 11]]
    p = ubatch.plan([3, 3, 3, 3], n_batch=12, n_ubatch=8, n_ctx=4096)
    assert [[r.slot for r in u.rows] for u in p.ubatches] == [u.tolist() for u in got]
