"""Context: decode and its errors, outputs as views, memory, state, abort, buffers, lifetimes."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import PROMPT, UbatchAborter, run_child

import pyllamacpp as pl
from pyllamacpp import ffi, lib


def _greedy_next(ctx):
    return int(np.argmax(ctx.logits()))


def test_decode_and_logits_are_views(model, ctx):
    toks = model.tokenize(PROMPT)
    b = pl.Batch(64, model=model)
    b.add_sequence(toks, 0, 0, logits="all")
    ctx.decode(b)
    assert ctx.n_outputs == 7
    la = ctx.logits_all()
    assert la.shape == (7, model.n_vocab) and la.dtype == np.float32 and np.isfinite(la).all()
    last = ctx.logits(-1)
    assert not last.flags.owndata and np.shares_memory(last, la)  # views of one buffer
    p = lib.llama_get_logits_ith(ctx.ptr, -1)
    assert last.ctypes.data == int(ffi.cast("uintptr_t", p))
    np.testing.assert_array_equal(last, la[-1])
    np.testing.assert_array_equal(ctx.logits(3), la[3])


def test_decode_errors_leave_the_context_usable(model):
    with model.context(n_ctx=64, n_batch=64, n_threads=2) as ctx:
        b = pl.Batch(64)  # no model: the batch takes the token, decode refuses it before C
        b.add(model.n_vocab + 5, 0, 0, logits=True)
        with pytest.raises(pl.InvalidBatchError) as e:
            ctx.decode(b)
        assert e.value.code == -1 and "vocabulary" in str(e.value)
        # positions that go backwards inside one sequence: llama.cpp's check, with its reason
        b.clear()
        b.add_sequence([1, 2], 0, 0)
        b.add(3, 0, 0, logits=True)
        with pytest.raises(pl.InvalidBatchError) as e:
            ctx.decode(b)
        assert "decreasing" in (e.value.reason or "")
        assert ctx.memory.seq_pos_max(0) == -1
        # KV cache full: every cell used, then one more token
        n = ctx.n_ctx  # llama.cpp pads n_ctx up (64 -> 256)
        ctx.prefill(np.full(n, 100))
        b.clear()
        b.add(100, n, 0, logits=True)
        with pytest.raises(pl.KVCacheFullError) as e:
            ctx.decode(b)
        assert e.value.code == 1
        assert ctx.memory.seq_pos_max(0) == n - 1  # the sequence is as it was
        ctx.memory.seq_rm(0, 32, -1)
        b.clear()
        b.add(100, 32, 0, logits=True)
        ctx.decode(b)  # usable again
        assert np.isfinite(ctx.logits()).all()


def test_prefill_splits_by_n_batch(model):
    seen = []

    class Recording(pl.Context):
        def decode(self, batch):
            seen.append(len(batch))
            super().decode(batch)

    toks = np.resize(model.tokenize(PROMPT), 600)
    with Recording(model, n_ctx=1024, n_batch=256, n_ubatch=128, n_threads=2) as ctx:
        nxt = ctx.prefill(toks)
        assert seen == [256, 256, 88] and nxt == 600
        assert ctx.memory.seq_pos_max(0) == 599
        assert ctx.n_outputs == 1


def test_memory_operations(model):
    with model.context(n_ctx=256, n_seq_max=4, kv_unified=True, n_threads=2) as ctx:
        mem = ctx.memory
        ctx.prefill(model.tokenize(PROMPT), 0)
        mem.seq_cp(0, 1)
        assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (0, 6)
        assert mem.seq_rm(1, 3, -1) and mem.seq_pos_max(1) == 2
        assert mem.can_shift
        mem.seq_add(1, 0, -1, 10)
        assert (mem.seq_pos_min(1), mem.seq_pos_max(1)) == (10, 12)
        mem.seq_div(1, 0, -1, 2)
        assert mem.seq_pos_max(1) == 6
        mem.seq_keep(0)
        assert mem.seq_pos_max(1) == -1 and mem.seq_pos_max(0) == 6
        mem.clear()  # out-of-range seq ids: test_seq_ids_out_of_range_are_refused_before_c
        assert mem.seq_pos_max(0) == -1


def test_seq_state_round_trip_and_failed_set(model, ctx):
    toks = model.tokenize(PROMPT)
    ctx.prefill(toks)
    ref_state = ctx.seq_state(0)
    assert len(ref_state) == 162_108  # LLAMA_CPP_FACTS: 7-token prompt, F16, one stream
    b = pl.Batch(1, model=model)
    b.add(504, 7, 0, logits=True)
    ctx.decode(b)
    ref = ctx.logits().copy()
    ctx.memory.clear()
    assert ctx.set_seq_state(0, ref_state) == len(ref_state)
    ctx.decode(b)
    np.testing.assert_array_equal(ctx.logits(), ref)  # same cells: bit-identical
    # A bad blob: StateError, and the sequence holds what it held
    ctx.memory.seq_rm(0, 7, -1)
    garbage = ref_state.data.copy()
    garbage[40:80] = 0xFF
    with pytest.raises(pl.StateError):
        ctx.set_seq_state(0, garbage)
    assert ctx.memory.seq_pos_max(0) == 6
    ctx.decode(b)
    np.testing.assert_array_equal(ctx.logits(), ref)
    import pickle

    again = pickle.loads(pickle.dumps(ref_state))
    assert bytes(again) == bytes(ref_state) and again.seq_id == 0


def test_seq_state_is_a_view_and_trust_follows_its_array(model, ctx):
    import dataclasses
    import gc
    import pickle

    ctx.prefill(model.tokenize(PROMPT))
    st = ctx.seq_state(0)
    # a read-only view over the buffer pyl_state_seq_get malloc'd; a slice keeps it alive
    assert not st.data.flags.writeable and not st.data.flags.owndata
    head = st.data[:64]
    expect = bytes(head)
    del st
    gc.collect()
    assert bytes(head) == expect and bytes(ctx.seq_state(0).data[:64]) == expect
    # trusted (not parsed again) only as this context made it: not unpickled, not with another array
    checked = []
    ctx.check_state = lambda *a, _orig=ctx.check_state, **k: (checked.append(1), _orig(*a, **k))[1]
    st = ctx.seq_state(0)
    ctx.set_seq_state(0, st)
    assert checked == []
    ctx.set_seq_state(0, pickle.loads(pickle.dumps(st)))
    assert checked == [1]
    other = dataclasses.replace(st, data=st.data.copy())
    other.data.flags.writeable = False
    ctx.set_seq_state(0, other)
    assert checked == [1, 1]
    assert dataclasses.replace(st)._made is None  # replace() does not carry the trust
    # read-only down to the buffer: neither the view nor its base can be written through
    with pytest.raises(ValueError):
        st.data.flags.writeable = True
    with pytest.raises(ValueError):
        np.frombuffer(st.data.base, np.uint8)[0] = 1
    ctx.set_seq_state(0, st)
    assert checked == [1, 1]


def test_failed_state_load_reason_and_raising_log_handler(model, ctx, raising_log_handler):

    ctx.prefill(model.tokenize(PROMPT))
    good = ctx.seq_state(0)
    bad = good.data.copy()
    bad[12:16] = 0xFF  # stream 0's cell_count: far more cells than the context has
    with pytest.raises(pl.StateError, match="unchanged") as e:
        ctx.set_seq_state(0, bad, validate=False)
    assert e.value.reason  # llama.cpp's logged cause, kept in C (pyl_reason_text)
    assert ctx.memory.seq_pos_max(0) == 6

    with raising_log_handler(RuntimeError("handler failed")):
        with pytest.raises(RuntimeError, match="handler failed"):
            ctx.set_seq_state(0, bad, validate=False)
    assert ctx.memory.seq_pos_max(0) == 6  # put back before the handler's exception surfaced
    assert ctx.set_seq_state(0, good) == len(good)


def test_on_device_save_of_a_quantized_cache_is_refused(model):
    toks = model.tokenize("The cat sat on the mat. The dog sat on the log, and then")
    other = model.tokenize("Completely different text that fills other rows here ok")[: toks.size - 1]
    ON_DEVICE = int(pl.StateFlags.ON_DEVICE)
    for type_kv in ("f16", "q8_0"):
        with model.context(n_ctx=256, type_k=type_kv, type_v=type_kv, flash_attn="on") as c:
            b = pl.Batch(1, model=model)
            b.add(int(toks[-1]), toks.size - 1, 0, logits=True)
            c.prefill(toks[:-1])
            # llama.cpp itself, raw calls: save on device, overwrite the cache, load, decode
            size = pl.lib.llama_state_seq_get_size_ext(c.ptr, 0, ON_DEVICE)
            meta = pl.ffi.new("uint8_t[]", size)
            assert pl.lib.llama_state_seq_get_data_ext(c.ptr, meta, size, 0, ON_DEVICE) == size
            c.decode(b)
            ref = c.logits().copy()
            c.memory.clear()
            c.prefill(other)
            assert pl.lib.llama_state_seq_set_data_ext(c.ptr, meta, size, 0, ON_DEVICE) == size
            c.decode(b)
            diff = float(np.abs(c.logits() - ref).max())
            if type_kv == "f16":
                assert diff == 0.0
                assert c.seq_state(0, ON_DEVICE).flags == ON_DEVICE
            else:
                # wrong rows restored; when a llama.cpp bump fixes this, lift _check_device_save
                assert diff > 1.0
                with pytest.raises(pl.StateError, match=r"quantized cache \(type_k=q8_0, type_v=q8_0\)"):
                    c.seq_state(0, ON_DEVICE)
                assert len(c.seq_state(0)) > 0  # without ON_DEVICE: fine


def test_state_files(model, ctx, tmp_path):
    toks = model.tokenize(PROMPT)
    ctx.prefill(toks)
    path = tmp_path / "seq.bin"
    n = ctx.save_seq_state(path, 0, toks)
    assert path.stat().st_size == n and not list(tmp_path.glob(".*tmp*"))
    ctx.memory.clear()
    assert ctx.load_seq_state(path, 0).tolist() == toks.tolist()
    assert ctx.memory.seq_pos_max(0) == 6
    whole = tmp_path / "session.bin"
    ctx.save_state(whole, toks)
    blob = ctx.state()
    ctx.memory.clear()
    assert ctx.load_state(whole).tolist() == toks.tolist()
    assert ctx.memory.seq_pos_max(0) == 6
    ctx.memory.clear()
    assert ctx.set_state(blob) == blob.size and ctx.memory.seq_pos_max(0) == 6
    with pytest.raises(OSError):
        ctx.save_seq_state(tmp_path / "no" / "such" / "dir.bin", 0, toks)


def test_buffers_are_captured_from_the_log(model):
    with (
        model.context(n_ctx=512, n_ubatch=512, n_threads=2) as big,
        model.context(n_ctx=512, n_ubatch=64, n_threads=2) as small,
    ):
        kv = big.buffers["CPU"]["KV"]
        assert kv == pytest.approx(512 * model.kv_bytes_per_token() / 2**20, abs=0.01)
        assert big.buffers["CPU"]["compute"] > small.buffers["CPU"]["compute"] > 0
        assert any("model" in kinds for kinds in big.buffers.values())


def test_abort_from_another_thread(model):
    toks = np.resize(model.tokenize(PROMPT), 1024)
    with model.context(n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2) as ctx:
        b = pl.Batch(1024, model=model)
        b.add_sequence(toks)
        threading.Timer(0.05, ctx.abort).start()
        t0 = time.perf_counter()
        with pytest.raises(pl.DecodeAborted):
            ctx.decode(b)
        assert time.perf_counter() - t0 < 2.0
        b.clear()
        b.add_sequence(toks[:8])
        ctx.decode(b)  # usable afterwards
        assert np.isfinite(ctx.logits()).all()


def test_an_abort_in_the_middle_of_a_batch_keeps_the_ubatches_before_it(model):
    # 96 tokens in one decode, n_ubatch 32: aborted in the second ubatch, llama.cpp removes that
    # ubatch's positions and keeps the first's; DecodeAborted and prefill's resume_from say so
    toks = np.resize(model.tokenize(PROMPT), 96)
    kw = dict(n_ctx=256, n_batch=128, n_ubatch=32, n_threads=1, n_threads_batch=1)
    with model.context(**kw) as ref:
        ref.prefill(toks)
        want = ref.logits().copy()
    ab = UbatchAborter()
    with ab.context(model, **kw) as ctx:
        ab.at = ab.n + 2
        with pytest.raises(pl.DecodeAborted) as e:
            ctx.prefill(toks)
        assert ab.n == 2  # the third ubatch never started
        assert e.value.seq_pos_max == {0: 31} and e.value.resume_from == 32
        assert ctx.memory.seq_pos_min(0) == 0 and ctx.memory.seq_pos_max(0) == 31
        ctx.prefill(toks[32:], 0)  # resume: the same ubatches into the same cells
        assert ab.n == 4 and ctx.memory.seq_pos_max(0) == 95
        np.testing.assert_array_equal(ctx.logits(), want)


def test_ctrl_c_aborts_a_decode(model):
    toks = np.resize(model.tokenize(PROMPT), 1024)
    # A background job starts with SIGINT ignored (and then a decode keeps ignoring it): give the
    # test Python's usual handler.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with model.context(n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2) as ctx:
            b = pl.Batch(1024, model=model)
            b.add_sequence(toks)
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(KeyboardInterrupt, match="SIGINT") as info:
                ctx.decode(b)
            e = info.value
            assert isinstance(e, pl.DecodeInterrupted) and not isinstance(e, Exception)  # not swallowed
            assert e.func == "llama_decode" and e.code == 2 and set(e.seq_pos_max) == {0}
            assert ctx.memory.seq_pos_max(0) == e.seq_pos_max[0] < 1023  # the abort came in time
            ctx.memory.clear()
            b.clear()
            b.add_sequence(toks[:8])
            ctx.decode(b)  # usable afterwards
            assert np.isfinite(ctx.logits()).all() and ctx.memory.seq_pos_max(0) == 7
            # a prefill that Ctrl-C stops says where to resume
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(pl.DecodeInterrupted) as info:
                ctx.prefill(np.resize(toks, 1000), seq_id=0, start_pos=8)
            assert info.value.resume_from == ctx.memory.seq_pos_max(0) + 1 - 8
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back
    finally:
        signal.signal(signal.SIGINT, before)


def test_abort_still_raises_decode_aborted_not_keyboard_interrupt(model):
    toks = np.resize(model.tokenize(PROMPT), 256)
    with model.context(n_ctx=256, n_batch=256, n_threads=2) as ctx:
        b = pl.Batch(256, model=model)
        b.add_sequence(toks)
        ctx.abort()
        with pytest.raises(pl.DecodeAborted) as info:
            ctx.decode(b)
        assert not isinstance(info.value, KeyboardInterrupt)


def test_ctrl_c_with_the_programs_own_handler_runs_that_handler(model):
    """A program with its own SIGINT handler keeps it: the decode stops, the handler runs, and the
    decode raises DecodeAborted (a handler that does not raise asked for no KeyboardInterrupt)."""
    toks = np.resize(model.tokenize(PROMPT), 1024)
    calls = []
    before = signal.signal(signal.SIGINT, lambda sig, frame: calls.append(sig))
    try:
        with model.context(n_ctx=1024, n_batch=1024, n_ubatch=1024, n_threads=2) as ctx:
            b = pl.Batch(1024, model=model)
            b.add_sequence(toks)
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(pl.DecodeAborted, match="SIGINT"):
                ctx.decode(b)
            assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)


def test_default_context_fits_the_model_and_the_machine(model):
    from pyllamacpp.params import default_n_threads

    with model.context() as ctx:
        assert ctx.n_ctx == min(model.n_ctx_train, 4096) == ctx.params.n_ctx
        assert ctx.n_threads == default_n_threads() == lib.llama_n_threads_batch(ctx.ptr)
    with model.context(n_ctx=0, n_threads=1) as ctx:  # llama.cpp's 0: all of n_ctx_train
        assert ctx.n_ctx == model.n_ctx_train and ctx.n_threads == 1


def test_n_threads_sets_n_threads_batch_unless_it_is_given(model):
    # issue 36: model.context(n_threads=1) left n_threads_batch at the core count
    from pyllamacpp.params import default_n_threads

    with model.context(n_ctx=64, n_threads=1) as ctx:
        assert ctx.params.n_threads_batch == 1 == lib.llama_n_threads_batch(ctx.ptr) == lib.llama_n_threads(ctx.ptr)
    with pl.Context(model, n_ctx=64, n_threads=1, n_threads_batch=2) as ctx:  # given: kept
        assert (ctx.params.n_threads, ctx.params.n_threads_batch) == (1, 2)
        assert (lib.llama_n_threads(ctx.ptr), lib.llama_n_threads_batch(ctx.ptr)) == (1, 2)
    with model.context(pl.ContextParams(n_ctx=64, n_threads_batch=2), n_threads=1) as ctx:  # a keyword sets both
        assert (ctx.params.n_threads, ctx.params.n_threads_batch) == (1, 1)
    with model.context(pl.ContextParams(n_ctx=64, n_threads=1)) as ctx:  # a ContextParams keeps its fields
        assert ctx.params.n_threads_batch == default_n_threads()


def test_gil_is_released_during_decode(model):
    toks = np.resize(model.tokenize(PROMPT), 512)
    ticks = []
    stop = threading.Event()

    def count():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    with model.context(n_ctx=512, n_batch=512, n_threads=2) as ctx:
        b = pl.Batch(512, model=model)
        b.add_sequence(toks)
        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.01)
        t0 = time.perf_counter()
        ctx.decode(b)
        t1 = time.perf_counter()
        stop.set()
        t.join()
    during = [x for x in ticks if t0 < x < t1]
    assert t1 - t0 > 0.05 and len(during) > 10, (t1 - t0, len(during))


# Without these refusals the calls below read freed memory or a NULL pointer (SIGSEGV): in a child.
LIFETIMES = textwrap.dedent("""
    import numpy as np, pyllamacpp as pl

    def closed(call):
        try:
            call()
            raise AssertionError("used after close")
        except pl.ClosedError:
            pass

    m = pl.Model()
    ctx = m.context(n_ctx=256, n_threads=1, n_threads_batch=1)
    ctx.prefill(m.tokenize("The cat sat on the mat."))
    view = ctx.logits()
    keep = view.copy()
    b = pl.Batch(16, model=m)
    b.add_sequence(m.tokenize(" and"), 0, 7, logits="all")
    b.add_sequence(m.tokenize(" the dog"), 0, 8, logits="all")
    print("case: a decode that reallocates the outputs under a view", flush=True)
    try:
        ctx.decode(b)  # 3 outputs > 1 reserved while `view` is alive
        raise AssertionError("decoded")
    except pl.LlamaError as e:
        assert "view" in str(e), e
    ctx.close()
    closed(lambda: ctx.logits())
    print("case: a view read after close", flush=True)
    assert np.array_equal(view, keep)  # memory kept alive by the view
    del view
    ctx.close()
    for name, call in {
        "n_ctx": lambda: ctx.n_ctx,
        "prefill": lambda: ctx.prefill([1, 2]),
        "seq_state": lambda: ctx.seq_state(0),
        "memory.clear": lambda: ctx.memory.clear(),
        "perf": lambda: ctx.perf(),
    }.items():
        print("case: closed context,", name, flush=True)
        closed(call)
    m2 = pl.Model()
    c2 = m2.context(n_ctx=128, n_threads=1, n_threads_batch=1)
    m2.close()
    assert c2.closed
    print("case: a context of a closed model", flush=True)
    closed(lambda: c2.prefill([1]))
    print("OK")
""")


def test_views_close_and_use_after_close():
    assert run_child(LIFETIMES).stdout.endswith("OK\n")


def test_perf(model):
    with model.context(n_ctx=128, n_threads=2, no_perf=False) as ctx:
        ctx.prefill(model.tokenize(PROMPT))
        p = ctx.perf()
        assert p.n_p_eval == 7 and p.t_p_eval_ms > 0
        ctx.perf_reset()
        p = ctx.perf()
        assert p.t_p_eval_ms == 0 and p.n_p_eval == 1  # llama.cpp reports max(1, n_p_eval)


GUARDS = textwrap.dedent("""
    import numpy as np, pyllamacpp as pl
    m = pl.Model()
    with m.context(n_ctx=256, n_batch=32, n_seq_max=2, n_threads=1, n_threads_batch=1) as ctx:
        b = pl.Batch(64, model=m)
        b.add_sequence(np.arange(40) + 100)
        print("case: 40 tokens, n_batch 32", flush=True)
        try:
            ctx.decode(b)  # GGML_ASSERT(n_tokens_all <= n_batch) in llama.cpp
            raise AssertionError("decoded")
        except pl.InvalidBatchError as e:
            assert "n_batch" in str(e), e
        for n in (2, 20):  # the small-batch checks, and the vectorized ones
            b.clear()
            b.add_sequence(np.arange(n) + 100)
            b.n_seq_id[n - 1] = 0
            print(f"case: a token with n_seq_id 0 in a batch of {n}", flush=True)
            try:
                ctx.decode(b)  # a division by zero (SIGFPE) in llama.cpp
                raise AssertionError("decoded")
            except pl.InvalidBatchError as e:
                assert f"token {n - 1} has n_seq_id 0" in str(e), e
        ctx.prefill(m.tokenize("The cat sat on the mat."), 0)
        print("case: a partial seq_cp across streams", flush=True)
        try:
            ctx.memory.seq_cp(0, 1, 2, 5)  # GGML_ASSERT(is_full) in llama.cpp
            raise AssertionError("copied")
        except ValueError as e:
            assert "different streams" in str(e), e
        assert ctx.memory.seq_pos_max(1) == -1
    print("OK")
""")


def test_guards_for_what_would_abort_llama_cpp():
    assert run_child(GUARDS).stdout.endswith("OK\n")


# Every call that takes a seq id, given one outside [0, n_seq_max): llama.cpp indexes its
# per-sequence vectors with it (seq_to_stream[seq_id]) or asserts; refused in Python first.
SEQ_IDS = textwrap.dedent("""
    import os, tempfile, numpy as np, pyllamacpp as pl
    m = pl.Model()
    f = os.path.join(tempfile.mkdtemp(), "s.bin")
    with m.context(n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(m.tokenize("The cat sat on the mat."), 0)
        mem = ctx.memory
        ctx.save_seq_state(f, 0)
        st = ctx.seq_state(0)
        calls = {
            "seq_rm": lambda s: mem.seq_rm(s, 0, 2),
            "seq_cp src": lambda s: mem.seq_cp(s, 0),
            "seq_cp dst": lambda s: mem.seq_cp(0, s),
            "seq_keep": lambda s: mem.seq_keep(s),
            "seq_add": lambda s: mem.seq_add(s, 0, -1, 3),
            "seq_div": lambda s: mem.seq_div(s, 0, -1, 2),
            "seq_pos_min": lambda s: mem.seq_pos_min(s),
            "seq_pos_max": lambda s: mem.seq_pos_max(s),
            "seq_state": lambda s: ctx.seq_state(s),
            "seq_state out": lambda s: ctx.seq_state(s, out=pl.StateBuffer(1 << 20)),
            "set_seq_state": lambda s: ctx.set_seq_state(s, st),
            "set_seq_state fast": lambda s: ctx.set_seq_state(s, st, validate=False, keep_on_error=False),
            "save_seq_state": lambda s: ctx.save_seq_state(f + ".x", s),
            "load_seq_state": lambda s: ctx.load_seq_state(f, s),
        }
        accepted = []
        for name, call in calls.items():
            for s in (2, 3, -2) if name != "seq_rm" else (2, 3):  # seq_rm takes a negative id: all
                print("case:", name, s, flush=True)
                try:
                    call(s)
                    accepted.append(f"{name}({s})")
                except ValueError as e:
                    assert f"seq_id {s} is outside [0, 2)" in str(e), (name, e)
        assert not accepted, f"not refused: {accepted}"
        assert mem.seq_pos_max(0) == 6 and mem.seq_pos_max(1) == -1  # nothing changed
    print("OK")
""")


def test_seq_ids_out_of_range_are_refused_before_c():
    assert run_child(SEQ_IDS).stdout.endswith("OK\n")


def test_sidecar_written_with_dumps(model, tmp_path):
    import pyllamacpp.state as st

    with model.context(n_ctx=256, n_threads=2) as ctx:
        toks = model.tokenize(PROMPT)
        ctx.prefill(toks)
        ctx.save_seq_dump(tmp_path / "a.bin", 0, tokens=toks)
        ctx.save_seq_state(tmp_path / "b.seq", 0, toks, sidecar=True)
    side = st.read_sidecar(tmp_path / "a.bin")
    assert side["n_head_kv"] == 3 and side["type_k"] == "f16" and side["tokens"] == toks.tolist()
    assert side["flash_attn"] is True and side["model"] == model.path.name
    assert side["flags"] == 0 == st.read_sidecar(tmp_path / "b.seq")["flags"]  # the flags the dump was made with
    assert st.parse(tmp_path / "a.bin").k[0].shape == (7, 3, 64)
    assert st.parse(tmp_path / "b.seq").kind == st.DumpKind.SEQ_FILE


def test_extended_batch_api_is_reachable_raw(model):
    # llama_batch_ext_* / llama_process are bound raw (not wrapped): the same prompt through them
    # gives the same logits as through a llama_batch.
    toks = model.tokenize(PROMPT)
    with model.context(n_ctx=256, n_threads=2) as ctx:
        ctx.prefill(toks)
        ref = ctx.logits().copy()
        ctx.memory.clear()
        be = lib.llama_batch_ext_init(ctx.ptr)
        try:
            pos = ffi.new("llama_pos *")
            for i, t in enumerate(toks):
                idx = lib.llama_batch_ext_add_token(be, 0, int(t))
                assert idx == i
                pos[0] = i
                assert lib.llama_batch_ext_set_pos(be, idx, pos)
            assert lib.llama_batch_ext_set_output_logits(be, len(toks) - 1, True)
            assert lib.llama_process(ctx.ptr, lib.LLAMA_PROCESS_TYPE_DECODE, be) == 0
            got = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx.ptr, -1), model.n_vocab * 4), np.float32)
            np.testing.assert_array_equal(got, ref)
        finally:
            lib.llama_batch_ext_free(be)


def test_embeddings_views(model):
    toks = model.tokenize(PROMPT)
    with model.context(n_ctx=256, n_threads=2, embeddings=True, pooling_type="mean") as ctx:
        b = pl.Batch(16, model=model)
        b.add_sequence(toks, 0, 0, logits="all")
        ctx.decode(b)
        pooled = ctx.seq_embeddings(0)
        assert pooled.shape == (model.n_embd,) and np.isfinite(pooled).all() and not pooled.flags.owndata
    with model.context(n_ctx=256, n_threads=2, embeddings=True, pooling_type="none") as ctx:
        b = pl.Batch(16, model=model)
        b.add_sequence(toks, 0, 0, logits="all")
        ctx.decode(b)
        e = ctx.embeddings(2)
        assert e.shape == (model.n_embd,) and np.isfinite(e).all()
        assert not np.array_equal(e, ctx.embeddings(3))


def test_seq_state_into_a_reused_buffer_and_fast_set(model, ctx):
    ctx.prefill(model.tokenize(PROMPT))
    ref = ctx.seq_state(0)
    assert not ref.data.flags.writeable  # made here: set_seq_state trusts it without re-parsing
    buf = np.zeros(ref.data.size + 100, np.uint8)
    st = ctx.seq_state(0, out=buf)
    assert np.shares_memory(st.data, buf) and bytes(st) == bytes(ref)
    with pytest.raises(ValueError, match="needs"):
        ctx.seq_state(0, out=np.zeros(10, np.uint8))
    assert ctx.set_seq_state(0, st, validate=False, keep_on_error=False) == len(ref)
    assert ctx.memory.seq_pos_max(0) == 6


def test_a_handle_frees_its_pointer_before_its_dependencies():
    # A context's handle holds its model's: llama_free must run before llama_model_free, whatever
    # order CPython clears the handle's slots in (AddressSanitizer caught the wrong order once).
    from pyllamacpp._handle import Handle

    order = []

    @ffi.callback("void(void *)")
    def free_model(p):
        order.append("model")

    @ffi.callback("void(void *)")
    def free_ctx(p):
        order.append("context")

    a, b = ffi.new("int *"), ffi.new("int *")
    model_h = Handle(ffi.cast("void *", a), free_model)
    ctx_h = Handle(ffi.cast("void *", b), free_ctx, deps=(model_h,))
    del model_h
    assert order == []
    del ctx_h
    assert order == ["context", "model"]


@pytest.mark.parametrize("flash_attn", ["on", "off"])  # V rows, or V transposed: other record headers
def test_a_load_that_cannot_fail_skips_the_backup_and_one_that_can_keeps_the_sequence(model, flash_attn):
    """set_seq_state backs an occupied sequence up only when llama.cpp could fail to load the blob
    (room): a checked blob of c cells always finds them when c <= n_ctx_seq - cells of the other
    sequences of the stream. Both sides of that rule, against what llama.cpp does."""
    toks = np.resize(model.tokenize(PROMPT), 200)
    with model.context(n_ctx=256, n_seq_max=2, kv_unified=True, flash_attn=flash_attn, n_threads=2) as ctx:
        assert ctx.n_ctx_seq == 256
        ctx.prefill(toks[:100], 0)
        st100 = ctx.seq_state(0)
        ctx.memory.clear()
        ctx.prefill(toks[:30], 0)
        st30 = ctx.seq_state(0)
        ctx.prefill(toks[:200], 1)  # seq 1: 200 cells; seq 0: 30; 26 free
        before = bytes(ctx.seq_state(0))
        backups = []
        orig = ctx.seq_state
        ctx.seq_state = lambda *a, **k: backups.append(a) or orig(*a, **k)
        # 30 cells into seq 0: at most 256 - 200 others' are needed, so no backup, and it loads
        assert ctx._load_fits(0, st30.data)
        assert ctx.set_seq_state(0, st30) == len(st30) and backups == []
        # 100 cells: only 56 would be free once seq 0's 30 go; backed up, llama.cpp fails, put back
        assert not ctx._load_fits(0, st100.data)
        with pytest.raises(pl.StateError, match="unchanged"):
            ctx.set_seq_state(0, st100)
        assert len(backups) == 1
        del ctx.seq_state
        assert bytes(ctx.seq_state(0)) == before and ctx.memory.seq_pos_max(1) == 199
        assert ctx._cells_held(1) == 200 and ctx._cells_held(0) == 30
    with model.context(n_ctx=256, n_threads=2) as ctx:  # one sequence: an own blob always fits
        ctx.prefill(toks[:100])
        assert ctx._load_fits(0, ctx.seq_state(0).data)
