"""Batch: numpy views over llama_batch, vectorized filling, errors at the call that causes them."""

from __future__ import annotations

import time

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp import ffi


def test_views_are_the_c_arrays():
    b = pl.Batch(16, n_seq_max=4)
    b.add_sequence([5, 6, 7], seq_ids=[0, 2], start_pos=10, logits="all")
    assert len(b) == 3 and b.n_tokens == 3
    s = b.struct
    assert b.token.ctypes.data == int(ffi.cast("uintptr_t", s.token))
    assert b.pos.ctypes.data == int(ffi.cast("uintptr_t", s.pos))
    assert b.logits.ctypes.data == int(ffi.cast("uintptr_t", s.logits))
    # each slot's seq_id pointer points at the row of the 2-D view
    for i in range(3):
        assert int(ffi.cast("uintptr_t", s.seq_id[i])) == b.seq_id[i].ctypes.data
        assert list(s.seq_id[i][0:2]) == [0, 2]
    b.pos[1] = 99  # writing the view writes the batch
    assert s.pos[1] == 99
    assert b.seq_id.shape == (3, 4) and b.n_seq_id.tolist() == [2, 2, 2]


def test_add_sequence_logits_modes_and_shared_prefix():
    b = pl.Batch(32, n_seq_max=3)
    sl = b.add_sequence(np.arange(4), seq_ids=[0, 1, 2])  # shared prefix: stored once
    assert sl == slice(0, 4) and len(b) == 4
    assert b.logits.tolist() == [0, 0, 0, 1]
    b.add_sequence([1, 2], seq_ids=1, start_pos=4, logits=np.array([True, False]))
    assert b.logits.tolist() == [0, 0, 0, 1, 1, 0] and b.pos.tolist() == [0, 1, 2, 3, 4, 5]
    b.add_sequence([3], logits="none")
    assert b.n_outputs == 2
    b.clear()
    assert len(b) == 0


def test_errors_at_the_call(model):
    b = pl.Batch(4, n_seq_max=2, model=model)
    with pytest.raises(ValueError, match="capacity"):
        b.add_sequence(range(5))
    with pytest.raises(ValueError, match="seq id"):
        b.add(1, 0, seq_ids=-1)
    with pytest.raises(ValueError, match="1..2 seq ids"):
        b.add(1, 0, seq_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="vocabulary"):
        b.add(model.n_vocab, 0)
    with pytest.raises(TypeError, match="integers"):
        b.add_sequence(np.array([1.5, 2.0]))
    with pytest.raises(ValueError, match="logits"):
        b.add_sequence([1], logits="some")
    assert len(b) == 0  # nothing was half-added
    b.close()
    with pytest.raises(pl.ClosedError):
        b.add(1, 0)


def test_views_keep_the_memory_alive_after_close():
    b = pl.Batch(8)
    b.add_sequence([1, 2, 3])
    tok = b.token
    b.close()
    del b
    assert tok.tolist() == [1, 2, 3]  # still valid memory


def test_filling_2048_tokens_is_fast():
    b = pl.Batch(2048)
    toks = np.arange(2048, dtype=np.int32)
    best = float("inf")
    for _ in range(50):
        b.clear()
        t0 = time.perf_counter()
        b.add_sequence(toks, 0, 0, logits="last")
        best = min(best, time.perf_counter() - t0)
    # The real figure goes in tools/bench; here only: no per-token Python loop (that takes ~ms).
    assert best < 1e-3, f"{best * 1e6:.0f} µs"


def test_2048_tokens_add_sequence_equals_slot_by_slot(model):
    toks = (np.arange(2048) * 7919 % 40000 + 100).astype(np.int32)
    results = []
    for mode in ("vector", "slots"):
        with model.context(n_ctx=2048, n_batch=2048, n_ubatch=512, n_threads=2, n_threads_batch=2) as ctx:
            b = pl.Batch(2048, model=model)
            if mode == "vector":
                b.add_sequence(toks, 0, 0, logits="last")
            else:
                for i, t in enumerate(toks):
                    b.add(int(t), i, 0, logits=i == 2047)
            ctx.decode(b)
            results.append(ctx.logits().copy())
    np.testing.assert_array_equal(results[0], results[1])


def test_n_seq_max_bounds_ids_per_token_not_their_values():
    """llama_batch_init(n_tokens, embd, n_seq_max): n_seq_max is how many seq ids one token may
    carry; llama.cpp's server makes its batch with 1 and seq ids up to n_parallel - 1."""
    b = pl.Batch(4)
    assert b.add(7, 0, seq_ids=1) == 0 and b.add(8, 0, seq_ids=np.int32(5)) == 1
    b.add_sequence([9], seq_ids=3, start_pos=0)
    b.add(10, 1, seq_ids=[6])
    assert b.seq_id[:, 0].tolist() == [1, 5, 3, 6] and b.n_seq_id.tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="1..1 seq ids"):
        pl.Batch(4).add_sequence([1], seq_ids=[0, 1])
    with pytest.raises(ValueError, match="seq id"):
        pl.Batch(4).add(1, 0, seq_ids=2**31)
    e = pl.Batch(2, embd=8)
    assert e.add_embd(np.zeros(8), 0, seq_ids=4) == 0


def test_general_path_slots_hold_what_was_given():
    """add() with several seq ids (its general path, not the one-int fast path) and add_embd()
    write the position, the ids, the logits flag and the value of their own slot."""
    b = pl.Batch(4, n_seq_max=3)
    b.add(11, 7, seq_ids=0)
    assert b.add(np.int64(12), 8, seq_ids=[0, 2], logits=True) == 1
    assert b.token.tolist() == [11, 12] and b.pos.tolist() == [7, 8] and b.logits.tolist() == [0, 1]
    assert b.n_seq_id.tolist() == [1, 2] and b.seq_id[1, :2].tolist() == [0, 2]
    e = pl.Batch(3, embd=4, n_seq_max=2)
    e.add_embd(np.full(4, 0.5), 5, seq_ids=[1, 0])
    assert e.add_embd(np.arange(4.0), 6, seq_ids=1, logits=True) == 1
    assert e.pos[:2].tolist() == [5, 6] and e.logits[:2].tolist() == [0, 1]
    assert e.n_seq_id[:2].tolist() == [2, 1] and e.seq_id[0, :2].tolist() == [1, 0]
    assert e.embd[1].tolist() == [0.0, 1.0, 2.0, 3.0] and e.n_tokens == 2


@pytest.mark.parametrize("n_per_seq", [3, 12])  # 6 tokens: the small-batch checks; 24: the vectorized ones
def test_seq_id_values_are_checked_at_decode_against_the_context(model, n_per_seq):
    toks = model.tokenize("The cat sat on the mat.")[:n_per_seq]
    toks = np.resize(toks, n_per_seq)
    with model.context(n_ctx=512, n_seq_max=2, n_threads=2) as ctx:
        b = pl.Batch(64, model=model)  # n_seq_max 1, as llama.cpp's server builds it
        b.add_sequence(toks, seq_ids=0)
        b.add_sequence(toks, seq_ids=1)
        ctx.decode(b)
        assert ctx.memory.seq_pos_max(0) == ctx.memory.seq_pos_max(1) == n_per_seq - 1
        np.testing.assert_allclose(ctx.logits(n_per_seq - 1), ctx.logits(2 * n_per_seq - 1), atol=1e-4)
        b.clear()
        b.add_sequence(toks, seq_ids=2, start_pos=0)  # a batch takes it; this context has 2 sequences
        with pytest.raises(pl.InvalidBatchError, match=r"seq_id 2, outside \[0, n_seq_max=2\)"):
            ctx.decode(b)
        assert ctx.memory.seq_pos_max(0) == n_per_seq - 1  # nothing changed
