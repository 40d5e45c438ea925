"""The packing core: segments in order -> work orders -> decode -> rows mapped back."""

from __future__ import annotations

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp.packing import Segment, WorkOrder, common_prefix, decode, fork, model_and_context, plan


def test_a_long_segment_is_cut_as_llama_cpp_cuts_a_prompt():
    orders = plan([Segment(np.zeros(5000, np.int32))], 2048)
    assert orders == [[(0, 0, 2048)], [(0, 2048, 4096)], [(0, 4096, 5000)]]


def test_segments_keep_their_order_and_fill_each_order_before_the_next():
    segs = [Segment(np.zeros(n, np.int32), s, 0, "none") for s, n in enumerate([3, 4, 5, 1])]
    assert plan(segs, 6) == [[(0, 0, 3), (1, 0, 3)], [(1, 3, 4), (2, 0, 5)], [(3, 0, 1)]]
    # exactly full: the next segment starts a new order
    assert plan([Segment(np.zeros(4, np.int32)), Segment(np.zeros(2, np.int32))], 4) == [[(0, 0, 4)], [(1, 0, 2)]]


def test_output_rows_bound_an_order_too():
    mask = np.arange(7) % 2 == 0  # rows at 0, 2, 4, 6
    segs = [Segment(np.zeros(10, np.int32), 0, 0, "all"), Segment(np.zeros(7, np.int32), 1, 0, mask)]
    orders = plan(segs, 8, 3)
    assert orders == [[(0, 0, 3)], [(0, 3, 6)], [(0, 6, 9)], [(0, 9, 10), (1, 0, 4)], [(1, 4, 7)]]
    for o in orders:
        assert sum(segs[i].n_outputs(lo, hi) for i, lo, hi in o) <= 3
        assert sum(hi - lo for _, lo, hi in o) <= 8
    # "last": the last slot needs a row of room; without it the segment's rest goes on
    last = [Segment(np.zeros(3, np.int32), 0, 0, "all"), Segment(np.zeros(4, np.int32), 1, 0, "last")]
    assert plan(last, 16, 3) == [[(0, 0, 3), (1, 0, 3)], [(1, 3, 4)]]


def test_outputs_are_compared_by_value_not_identity():
    """A caller's "all" built at run time (read from argv, JSON, a join) is not the interned literal."""
    built = "".join(["a", "ll"])
    assert built == "all" and built is not "all"  # noqa: F632 (the point of the test)
    seg = Segment(np.zeros(10, np.int32), 0, 0, built)
    assert seg.n_outputs() == 10 and seg.n_outputs(2, 5) == 3
    assert plan([seg], 8, 3) == plan([Segment(np.zeros(10, np.int32), 0, 0, "all")], 8, 3)


def test_every_slot_is_planned_once_whatever_the_sizes():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(1, 40, rng.integers(1, 6))
        segs = [Segment(np.zeros(n, np.int32), 0, 0, rng.random(n) < 0.3) for n in sizes]
        n_batch, n_out = int(rng.integers(1, 50)), int(rng.integers(1, 10))
        orders = plan(segs, n_batch, n_out)
        seen = [(i, lo, hi) for o in orders for i, lo, hi in o]
        flat = [(i, j) for i, lo, hi in seen for j in range(lo, hi)]
        assert flat == [(i, j) for i, n in enumerate(sizes) for j in range(n)]
        for o in orders:
            assert 0 < sum(hi - lo for _, lo, hi in o) <= n_batch
            assert sum(segs[i].n_outputs(lo, hi) for i, lo, hi in o) <= n_out


def test_bad_segments_and_sizes_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        Segment(np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="exactly one of"):
        Segment()
    with pytest.raises(ValueError, match="expected \\(3,\\)"):
        Segment(np.zeros(3, np.int32), outputs=[True])
    with pytest.raises(ValueError, match="'none', 'last', 'all'"):
        Segment(np.zeros(3, np.int32), outputs="first")
    with pytest.raises(ValueError, match="n_batch"):
        plan([Segment(np.zeros(3, np.int32))], 0)


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, [1, 2, 9]) == 2
    assert common_prefix(a, a) == 4
    assert common_prefix(a, [1, 2, 3, 4, 5], [1, 2, 3]) == 3
    assert common_prefix(a, []) == 0
    assert common_prefix([7], [8]) == 0
    assert common_prefix([7], [7, 8]) == 1 and common_prefix([7, 8], [7]) == 1  # one token shared
    assert common_prefix(a) == 4


def test_model_and_context(model, ctx):
    assert model_and_context(model) == (model, None)
    assert model_and_context(ctx) == (ctx.model, ctx)
    with pytest.raises(TypeError, match="a Model or a Context, not str"):
        model_and_context("model")


def test_rows_map_back_to_their_segment_and_offset(model):
    """Two prompts in two sequences, cut across three orders of 5 slots: every requested row's
    logits equal those of the same token decoded alone in one batch."""
    a = model.tokenize("The cat sat on the mat.")
    b = model.tokenize("A dog ran in the park today.")
    mask_b = np.zeros(b.size, bool)
    mask_b[[1, 4, b.size - 1]] = True
    segs = [Segment(a, 0, 0, "all", tag="a"), Segment(b, 1, 0, mask_b, tag="b")]
    with model.context(n_ctx=128, n_batch=5, n_ubatch=5, n_seq_max=2, n_threads=1, n_threads_batch=1) as ctx:
        got: dict[tuple[str, int], np.ndarray] = {}
        n_orders = 0
        for order in decode(ctx, segs):
            n_orders += 1
            assert len(order) <= 5
            logits = ctx.logits_all()
            for p in order.pieces:
                for row, off in zip(range(p.rows.start, p.rows.stop), p.at.tolist()):
                    got[(p.tag, off)] = logits[row].copy()
            del logits
        assert n_orders == -(-(a.size + b.size) // 5)
    want = {("a", j) for j in range(a.size)} | {("b", j) for j in np.flatnonzero(mask_b).tolist()}
    assert set(got) == want
    with model.context(n_ctx=128, n_batch=64, n_seq_max=2, n_threads=1, n_threads_batch=1) as ref:
        for tag, toks in (("a", a), ("b", b)):
            ref.memory.clear()
            batch = pl.Batch(64, model=model)
            batch.add_sequence(toks, 0, 0, logits="all")
            ref.decode(batch)
            for (t, off), v in got.items():
                if t == tag:
                    np.testing.assert_allclose(v, ref.logits(off), atol=2e-3)


def test_a_work_order_joins_sequences_and_refuses_what_it_cannot_hold(model):
    batch = pl.Batch(8, 2, model=model)
    wo = WorkOrder(batch, n_outputs_max=2)
    p = wo.add([1, 2, 3], 0, 0, "last")
    wo.join(p, 1)
    assert batch.n_seq_id[:3].tolist() == [2, 2, 2] and batch.seq_id[:3, 1].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="carry 2 seq ids already"):
        wo.join(p, 2)
    with pytest.raises(ValueError, match="more than its n_outputs_max 2"):
        wo.add([4, 5], 0, 3, "all")
    assert len(wo) == 3 and wo.room == 5  # the refused slots were taken back
    q = wo.add([4], 0, 3, "last")
    assert (p.rows, q.rows) == (slice(0, 1), slice(1, 2)) and q.at.tolist() == [0]


def test_fork_shares_a_prefix_with_other_sequences(model):
    toks = model.tokenize("The cat sat on the mat.")
    with model.context(n_ctx=128, n_seq_max=3, kv_unified=True, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(toks, 0)
        fork(ctx, 0, [1, 2], 0, 4)
        assert [ctx.memory.seq_pos_max(s) for s in range(3)] == [toks.size - 1, 3, 3]
        with pytest.raises(ValueError, match="both the source and a destination"):
            fork(ctx, 0, [0])
    with model.context(n_ctx=128, n_seq_max=2, kv_unified=False, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(toks, 0)
        with pytest.raises(ValueError, match="whole sequences"):
            fork(ctx, 0, [1], 0, 4)


def test_add_trusted_fills_the_slots_add_token_fills(model):
    """The unchecked per-token path writes what the checked one writes (after a multi-sequence
    order in the same batch), returns the first slot of each run, counts the rows, and checks the room."""
    ref, fast = pl.Batch(8, 2, model=model), pl.Batch(8, 2, model=model)
    runs = [([5, 6, 7], 10, 1, False), ([], 13, 1, True), ([8, 9], 13, 1, True), ([3], 0, 0, True)]
    wr, wf = WorkOrder(ref), WorkOrder(fast)
    wf.join(wf.add([1, 2, 3, 4, 5, 6, 7, 8], 0, 0, "all"), 1)  # an earlier order: two seq ids per slot
    wf.clear()
    firsts = []
    for toks, pos, sid, out in runs:
        for j, t in enumerate(toks):
            wr.add_token(t, pos + j, sid, out)
        firsts.append(wf.add_trusted(toks, pos, sid, out))
    assert firsts == [0, 3, 3, 5] and len(wf) == 6 and wf.n_outputs == wr.n_outputs == 3
    for name in ("token", "pos", "n_seq_id", "logits"):
        assert getattr(fast, name).tolist() == getattr(ref, name).tolist(), name
    assert fast.seq_id[:, 0].tolist() == [1, 1, 1, 1, 1, 0]
    with pytest.raises(ValueError, match="capacity exceeded: 6 \\+ 3 slots > capacity 8"):
        wf.add_trusted([1, 2, 3], 20, 0, False)
    assert len(wf) == 6
    with pytest.raises(TypeError, match="embedding batch"):
        WorkOrder(pl.Batch(4, 1, 8)).add_trusted([1], 0, 0, True)


def test_embedding_segments_fill_their_slots_and_decode(model):
    """Embedding rows go through the same core: positions, seq ids and output flags as for tokens
    (mutation survivors: pos ** j, the last flag at -2, the order's pos ** lo)."""
    rows = np.random.default_rng(0).normal(0, 0.02, (5, model.n_embd)).astype(np.float32)
    batch = pl.Batch(8, 2, model.n_embd)
    wo = WorkOrder(batch)
    p = wo.add_embd(rows[:3], [0, 1], 4, "last")
    assert batch.pos[:3].tolist() == [4, 5, 6] and batch.logits[:3].tolist() == [0, 0, 1]
    assert batch.n_seq_id[:3].tolist() == [2, 2, 2] and p.rows == slice(0, 1) and p.at.tolist() == [2]
    q = wo.add_embd(rows[3:5], seq_ids=1, pos=0, outputs="all")  # by keyword, as documented
    assert batch.pos[3:5].tolist() == [0, 1] and batch.logits[3:5].tolist() == [1, 1] and q.rows == slice(1, 3)
    with pytest.raises(ValueError, match="2-D"):
        Segment(embd=rows[0])
    with model.context(n_ctx=64, n_batch=3, n_ubatch=3, n_threads=1, n_threads_batch=1) as ctx:
        seen = []
        for order in decode(ctx, [Segment(embd=rows, seq_ids=0, pos=2, outputs="all")]):
            seen.append(order.batch.pos[: len(order)].tolist())
            assert ctx.logits_all().shape[0] == len(order)
        assert seen == [[2, 3, 4], [5, 6]]


def test_a_piece_joins_several_sequences():
    batch = pl.Batch(4, 4)
    wo = WorkOrder(batch)
    p = wo.add([1, 2], 0, 0, "none")
    for s in (1, 2, 3):
        wo.join(p, s)
    assert batch.n_seq_id[:2].tolist() == [4, 4] and batch.seq_id[0, :4].tolist() == [0, 1, 2, 3]
