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
        b.add(1, 0, seq_ids=2)
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
