"""The state fast path: ``seq_state(seq_id, out=buf)`` and ``set_seq_state(seq_id, data,
validate=False, keep_on_error=False)`` with a reused buffer (one C call each, no size query, no
log capture). Behaviour only; the speed is measured by ``tools/bench/bench_core.py -w state_fast``."""

from __future__ import annotations

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp.errors import ClosedError, StateError

PROMPT = "The cat sat on the mat."
FILL = 0xAB  # what the buffers hold before a call: a byte llama.cpp's dump does not start with


@pytest.fixture
def fa_off(model):
    """flash attention off: a reload into the same cells gives bit-identical logits (see
    LLAMA_CPP_FACTS.md, placement); 2 sequences so a failed load can leave another one intact."""
    with model.context(n_ctx=256, n_seq_max=2, kv_unified=True, flash_attn="off", n_threads=2) as c:
        yield c


def _dump(ctx, seq_id=0) -> bytes:
    return bytes(ctx.seq_state(seq_id))


def test_out_returns_a_view_over_the_buffer_and_leaves_the_rest_alone(model, fa_off):
    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    ref = _dump(ctx)
    buf = np.full(3 * len(ref), FILL, np.uint8)  # room for the longer dump below
    st = ctx.seq_state(0, out=buf)
    assert isinstance(st, pl.SeqState) and st.seq_id == 0 and st.flags == 0
    assert len(st) == len(ref) and bytes(st) == ref
    assert np.shares_memory(st.data, buf) and st.data.ctypes.data == buf.ctypes.data  # a view at its start
    assert (buf[len(ref) :] == FILL).all()  # nothing written past the state
    # reused: the next dump goes into the same memory, and the earlier view sees it
    ctx.prefill(model.tokenize(" It was happy."))
    st2 = ctx.seq_state(0, out=buf)
    assert len(st2) > len(st) and np.shares_memory(st2.data, st.data)
    assert bytes(st2) == _dump(ctx)


def test_a_too_small_out_raises_with_both_sizes_and_writes_nothing_past_it(model, fa_off):
    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    size = len(_dump(ctx))
    for n in (10, 1000, size - 1):
        big = np.full(size + 256, FILL, np.uint8)
        out = big[:n]  # a view of a larger array: llama.cpp must stop at out's end
        with pytest.raises(ValueError, match=rf"out holds {n} bytes, the state needs {size}"):
            ctx.seq_state(0, out=out)
        assert (big[n:] == FILL).all()
    # the context is unharmed: the same dump again, into a buffer that fits
    assert bytes(ctx.seq_state(0, out=np.empty(size, np.uint8))) == _dump(ctx)


@pytest.mark.parametrize(
    "bad",
    [
        lambda n: np.zeros(n, np.int8),  # another dtype
        lambda n: np.zeros(n // 4 + 1, np.uint32),
        lambda n: np.zeros((2, n), np.uint8),  # 2-D
        lambda n: np.zeros(2 * n, np.uint8)[::2],  # not contiguous
        lambda n: bytearray(n),  # not a numpy array
    ],
    ids=["int8", "uint32", "2-D", "strided", "bytearray"],
)
def test_out_of_the_wrong_kind_raises_before_any_copy(model, fa_off, bad):
    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    out = bad(len(_dump(ctx)))
    before = bytes(memoryview(np.ascontiguousarray(out)).cast("B")) if isinstance(out, np.ndarray) else bytes(out)
    with pytest.raises(ValueError, match="writable, contiguous 1-D uint8"):
        ctx.seq_state(0, out=out)
    after = bytes(memoryview(np.ascontiguousarray(out)).cast("B")) if isinstance(out, np.ndarray) else bytes(out)
    assert after == before


def test_a_read_only_out_raises(model, fa_off):
    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    out = np.zeros(len(_dump(ctx)), np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        ctx.seq_state(0, out=out)
    assert not out.any()


def test_a_bad_seq_id_raises_on_both_paths(model, fa_off):
    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    st = ctx.seq_state(0, out=np.empty(len(_dump(ctx)), np.uint8))
    for seq in (2, -1, 99):
        with pytest.raises(ValueError, match="n_seq_max"):
            ctx.seq_state(seq, out=st.data)
        with pytest.raises(ValueError, match="n_seq_max"):
            ctx.set_seq_state(seq, st, validate=False, keep_on_error=False)
    assert ctx.seq_state(np.int64(0), out=np.empty(len(st), np.uint8)).seq_id == 0  # numpy ints are fine


def test_fast_set_round_trips_to_identical_next_token_logits(model, fa_off):
    ctx = fa_off
    toks = model.tokenize(PROMPT)
    nxt = model.tokenize(" It")[:1]
    ctx.prefill(toks)
    buf = np.empty(len(_dump(ctx)) + 100, np.uint8)
    st = ctx.seq_state(0, out=buf)
    saved = st.data.copy()
    ctx.prefill(nxt)
    want = ctx.logits(-1).copy()

    ctx.memory.clear()  # emptied, then loaded on the fast path from the reused buffer
    assert ctx.set_seq_state(0, st, validate=False, keep_on_error=False) == len(saved)
    assert ctx.memory.seq_pos_max(0) == toks.size - 1
    ctx.prefill(nxt)
    np.testing.assert_array_equal(ctx.logits(-1), want)  # bit-identical with flash attention off

    # into the occupied sequence, from plain bytes and from a uint8 array that is not a SeqState
    ctx.memory.seq_rm(0, toks.size, -1)
    for blob in (bytes(saved), saved, memoryview(saved)):
        assert ctx.set_seq_state(0, blob, validate=False, keep_on_error=False) == len(saved)
        ctx.prefill(nxt)
        np.testing.assert_array_equal(ctx.logits(-1), want)
        ctx.memory.seq_rm(0, toks.size, -1)


def test_a_bad_blob_on_the_fast_path_raises_and_empties_only_that_sequence(model, fa_off):
    ctx = fa_off
    toks = model.tokenize(PROMPT)
    ctx.prefill(toks, seq_id=0)
    ctx.prefill(toks[:3], seq_id=1)
    good = ctx.seq_state(0, out=np.empty(len(_dump(ctx)), np.uint8)).data.copy()
    other = _dump(ctx, 1)
    for bad, why in (
        (good[: good.size // 2], "failed to restore kv cache"),  # cut in the middle of the K rows
        (np.concatenate([np.zeros(4, np.uint8), good[4:]]), "wrong sequence state magic"),
    ):
        with pytest.raises(StateError, match="read 0 bytes; the sequence is now empty") as e:
            ctx.set_seq_state(0, bad, validate=False, keep_on_error=False)
        assert why in (e.value.reason or "")
        # llama.cpp may have cleared cells before it failed; the fast path leaves the sequence empty
        assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.seq_pos_min(0) == -1
        assert _dump(ctx, 1) == other  # the other sequence is as it was
        # the context is usable: the good blob loads, and decoding continues from it
        assert ctx.set_seq_state(0, good, validate=False, keep_on_error=False) == good.size
        assert ctx.memory.seq_pos_max(0) == toks.size - 1
    ctx.prefill(model.tokenize(" It")[:1], seq_id=0)
    assert np.isfinite(ctx.logits(-1)).all()
    with pytest.raises(StateError, match="empty state"):
        ctx.set_seq_state(0, b"", validate=False, keep_on_error=False)


def test_the_default_set_still_keeps_the_sequence_on_a_bad_blob(model, fa_off):
    # the fast path is opt-in: keep_on_error=True (the default) puts an occupied sequence back
    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    good = _dump(ctx)
    with pytest.raises(StateError, match="unchanged"):
        ctx.set_seq_state(0, np.frombuffer(good, np.uint8)[: len(good) // 2], validate=False)
    assert _dump(ctx) == good


def test_use_after_close_raises(model):
    ctx = model.context(n_ctx=256, n_threads=2)
    ctx.prefill(model.tokenize(PROMPT))
    buf = np.empty(len(_dump(ctx)), np.uint8)
    st = ctx.seq_state(0, out=buf)
    ctx.close()
    with pytest.raises(ClosedError):
        ctx.seq_state(0, out=buf)
    with pytest.raises(ClosedError):
        ctx.set_seq_state(0, st, validate=False, keep_on_error=False)
    assert bytes(st)  # the view is over the caller's buffer: still readable


def test_state_buffer_round_trip_through_its_pointer(model, fa_off):
    ctx = fa_off
    toks = model.tokenize(PROMPT)
    ctx.prefill(toks)
    ref = _dump(ctx)
    sb = pl.StateBuffer(2 * len(ref))
    sb.array[:] = FILL
    st = ctx.seq_state(0, out=sb)
    assert bytes(st) == ref and np.shares_memory(st.data, sb.array)
    assert st.data.ctypes.data == sb.array.ctypes.data and (sb.array[len(ref) :] == FILL).all()
    nxt = np.array([int(toks[-1])], np.int32)
    ctx.prefill(nxt, 0, toks.size)
    want = ctx.logits().copy()
    ctx.memory.clear()
    assert ctx.set_seq_state(0, st, validate=False, keep_on_error=False) == len(ref)
    ctx.prefill(nxt, 0, toks.size)
    assert np.array_equal(ctx.logits(), want)
    # the pointer is used only while st.data is the view seq_state made
    st.data = np.frombuffer(ref, np.uint8).copy()
    ctx.memory.clear()
    assert ctx.set_seq_state(0, st, validate=False, keep_on_error=False) == len(ref)
    import pickle

    back = pickle.loads(pickle.dumps(ctx.seq_state(0, out=sb)))  # the C pointer is not pickled
    assert bytes(back) == ref and back._cptr is None


def test_state_buffer_checks(model, fa_off):
    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    n = len(_dump(ctx))
    with pytest.raises(ValueError, match="positive"):
        pl.StateBuffer(0)
    for bad in (np.zeros(8, np.float32), np.zeros((2, 8), np.uint8), np.zeros(16, np.uint8)[::2]):
        with pytest.raises(ValueError, match="StateBuffer needs"):
            pl.StateBuffer(bad)
    ro = np.zeros(8, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="StateBuffer needs"):
        pl.StateBuffer(ro)
    own = np.zeros(n + 10, np.uint8)
    sb = pl.StateBuffer(own)  # adopted: no copy
    assert np.shares_memory(sb.array, own) and len(sb) == n + 10
    with pytest.raises(ValueError):  # numpy refuses to move memory the pointer holds
        own.resize(10 * n)
    small = pl.StateBuffer(n // 2)
    with pytest.raises(ValueError, match=str(n)):
        ctx.seq_state(0, out=small)
    # ON_DEVICE takes the checked path, with the StateBuffer's array
    st = ctx.seq_state(0, pl.StateFlags.ON_DEVICE, out=sb)
    assert np.shares_memory(st.data, own)
    ctx.close()
    with pytest.raises(ClosedError):
        ctx.seq_state(0, out=sb)


def test_state_buffer_gives_its_last_seqstate_again_only_while_it_still_fits(model, fa_off):
    # A dump of the same size, sequence and flags returns the StateBuffer's last SeqState (its
    # data, a view of the buffer, was overwritten by the dump either way); anything else is new.
    ctx = fa_off
    toks = model.tokenize(PROMPT)
    ctx.prefill(toks)
    ctx.memory.seq_cp(0, 1)
    sb = pl.StateBuffer(4 * len(_dump(ctx)))
    a = ctx.seq_state(0, out=sb)
    assert ctx.seq_state(0, out=sb) is a and a.seq_id == 0
    b = ctx.seq_state(1, out=sb)  # another sequence: another SeqState, and a keeps its seq_id
    assert b is not a and b.seq_id == 1 and a.seq_id == 0 and bytes(b) == _dump(ctx, 1)
    c = ctx.seq_state(0, out=sb)
    assert c is not b and c.seq_id == 0
    c.flags = pl.StateFlags.PARTIAL_ONLY  # a caller's edit: the next dump does not hand c back
    d = ctx.seq_state(0, out=sb)
    assert d is not c and d.flags == 0
    d.data = d.data.copy()  # replaced data: neither reused nor loaded through the buffer's pointer
    e = ctx.seq_state(0, out=sb)
    assert e is not d and np.shares_memory(e.data, sb.array)
    n0 = len(e)
    ctx.prefill(np.array([int(toks[-1])], np.int32), 0, toks.size)  # seq 0 grows: a longer view
    f = ctx.seq_state(0, out=sb)
    assert f is not e and len(f) > n0 and bytes(f) == _dump(ctx, 0) and len(e) == n0
    ctx.memory.clear()
    assert ctx.set_seq_state(0, f, validate=False, keep_on_error=False) == len(f)
    assert ctx.memory.seq_pos_max(0) == toks.size


def test_a_log_handlers_exception_from_an_earlier_raw_call_is_raised_by_the_next_fast_call(
    model, fa_off, raising_log_handler
):
    # The fast path runs without a capture; it re-raises what a logging handler raised inside C
    # on this thread (here during a raw lib call that failed), once, and the call after it is clean.
    import logging

    from pyllamacpp import _log

    ctx = fa_off
    ctx.prefill(model.tokenize(PROMPT))
    sb = pl.StateBuffer(2 * len(_dump(ctx)))

    with raising_log_handler(KeyError("from the handler"), logging.ERROR):
        small = np.empty(16, np.uint8)  # llama.cpp stops at its end and logs an ERROR line
        assert pl.lib.llama_state_seq_get_data_ext(ctx.ptr, pl.ffi.from_buffer(small), 16, 0, 0) == 0
    assert _log.pending
    with pytest.raises(KeyError, match="from the handler"):
        ctx.seq_state(0, out=sb)
    assert not _log.pending
    assert bytes(ctx.seq_state(0, out=sb)) == _dump(ctx)
