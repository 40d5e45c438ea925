"""No input from Python crashes the process; failures leave things as they were (issue: hardening).

Fuzzers, and every test whose failure would be an abort, run in a child process
(``conftest.run_child``): a crash (SIGFPE, SIGABRT, SIGSEGV) fails that test instead of ending pytest.
"""

from __future__ import annotations

import json
import os
import textwrap
import threading

import numpy as np
import pytest
from conftest import PROMPT, run_child

import pyllamacpp as pl

BATCH_FUZZ = textwrap.dedent("""
    import sys, numpy as np, pyllamacpp as pl
    m = pl.Model()
    ctx = m.context(n_ctx=256, n_batch=64, n_ubatch=32, n_seq_max=4, n_threads=1, n_threads_batch=1)
    rng = np.random.default_rng(int(sys.argv[1]))
    b = pl.Batch(80, n_seq_max=4)
    counts = {"ok": 0, "refused": 0}
    for i in range(int(sys.argv[2])):
        n = int(rng.integers(0, 81))
        b.clear()
        if n:
            b.add_sequence(np.zeros(n, np.int32), 0, 0, logits="none")
            kind = int(rng.integers(0, 7))   # which field goes bad
            b.token[:] = rng.integers(-5, m.n_vocab + 5, n) if kind == 0 else rng.integers(0, m.n_vocab, n)
            b.pos[:] = rng.integers(-3, 300, n) if kind in (1, 5) else np.arange(n) + int(rng.integers(0, 100))
            b.n_seq_id[:] = rng.integers(0, 5, n) if kind == 2 else 1
            b.seq_id[:, :] = rng.integers(-2, 6, (n, 4)) if kind in (3, 5) else rng.integers(0, 4, (n, 4))
            b.logits[:] = 0 if kind == 6 else rng.integers(0, 2, n)
            if kind == 4:  # duplicated positions
                b.pos[:] = b.pos[0]
        try:
            ctx.decode(b)
            counts["ok"] += 1
        except pl.LlamaError:
            counts["refused"] += 1
        if rng.random() < 0.2:
            ctx.memory.clear()
    # the context still decodes correctly afterwards
    ctx.memory.clear()
    ctx.prefill(m.tokenize("The cat sat on the mat."))
    assert int(np.argmax(ctx.logits())) == 198
    print("SURVIVED", counts["ok"], counts["refused"])
""")


def _run_fuzz(code: str, *args, timeout=600) -> str:
    return run_child(code, *args, timeout=timeout).stdout  # a crash fails the test, naming its signal


@pytest.mark.parametrize("seed", [3, 4])
def test_adversarial_batches_raise_or_decode_never_crash(seed):
    out = _run_fuzz(BATCH_FUZZ, seed, 250)
    ok, refused = map(int, out.split("SURVIVED")[1].split())
    print(f"batch fuzz seed {seed}: 250 batches, {ok} decoded, {refused} refused, 0 crashes")
    assert ok > 0 and refused > 0  # both paths were exercised


def test_model_load_errors_carry_llama_cpp_reason(tmp_path, model_path):
    from pyllamacpp.testing import make_model

    good = make_model(tmp_path / "tiny.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=64)
    data = good.read_bytes()
    trunc = tmp_path / "truncated.gguf"
    trunc.write_bytes(data[: len(data) // 2])
    with pytest.raises(pl.ModelLoadError) as e:
        pl.Model(trunc)
    assert e.value.reason
    # tensors whose shapes disagree with the metadata: change feed_forward_length in place (same
    # byte size, so every offset stays valid) and the ffn tensors have the wrong shape
    import gguf

    r = gguf.GGUFReader(good)
    part = r.fields["llama.feed_forward_length"].parts[-1]
    off = part.ctypes.data - r.data.ctypes.data
    n_ff = int(part[0])
    del r, part
    shaped = bytearray(data)
    shaped[off : off + 4] = (2 * n_ff).to_bytes(4, "little")
    bad = tmp_path / "wrong-shape.gguf"
    bad.write_bytes(bytes(shaped))
    with pytest.raises(pl.ModelLoadError) as e:
        pl.Model(bad)
    assert "wrong shape" in e.value.reason and "ffn" in e.value.reason


def test_context_keeps_its_model_alive(model_path):
    def make():
        m = pl.Model(model_path)
        return m.context(n_ctx=128, n_threads=2)  # the model goes out of scope in user code here

    ctx = make()
    import gc

    gc.collect()
    ctx.prefill([504, 2644, 2643])
    assert np.isfinite(ctx.logits()).all()
    ctx.close()


def test_kv_full_then_room_made_by_another_sequence(model):
    with model.context(n_ctx=256, n_batch=256, n_seq_max=2, kv_unified=True, n_threads=2) as ctx:
        ctx.prefill(np.full(200, 100), 0)
        b = pl.Batch(100, 2, model=model)
        b.add_sequence(np.full(100, 101), 1, 0)
        with pytest.raises(pl.KVCacheFullError):
            ctx.decode(b)
        assert ctx.memory.seq_pos_max(1) == -1 and ctx.memory.seq_pos_max(0) == 199
        ctx.memory.seq_rm(0)
        ctx.decode(b)  # the same batch goes through
        assert ctx.memory.seq_pos_max(1) == 99


def test_two_contexts_in_two_threads_match_sequential(model):
    toks = model.tokenize(PROMPT)
    alone = []
    for _ in range(2):
        with model.context(n_ctx=256, n_threads=1) as ctx:
            alone.append(list(pl.generate(ctx, toks, 8)))
    results = [None, None]

    def work(i):
        with model.context(n_ctx=256, n_threads=1) as ctx:
            results[i] = list(pl.generate(ctx, toks, 8))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


def test_one_context_from_two_threads_raises(model):
    toks = np.resize(model.tokenize(PROMPT), 512)
    with model.context(n_ctx=1024, n_batch=512, n_threads=2) as ctx:
        b = pl.Batch(512, model=model)
        b.add_sequence(toks)
        errors = []
        started = threading.Event()

        def other():
            started.wait()
            small = pl.Batch(1, model=model)
            small.add(100, 900, 0, logits=True)
            try:
                ctx.decode(small)
            except RuntimeError as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        threading.Timer(0.02, started.set).start()
        ctx.decode(b)
        t.join()
        assert errors and "another thread" in str(errors[0])


def test_failed_save_keeps_the_earlier_file(model, tmp_path, monkeypatch):
    import errno

    import pyllamacpp._context_state.files as context_mod  # where save_seq_dump opens its file

    with model.context(n_ctx=256, n_threads=2) as ctx:
        ctx.prefill(model.tokenize(PROMPT))
        with pytest.raises(OSError):
            ctx.save_seq_dump(tmp_path / "no-such-folder" / "s.bin", 0)
        f = tmp_path / "s.bin"
        ctx.save_seq_dump(f, 0)
        before = f.read_bytes()

        class Full:  # a disk that fills up in the middle of the write
            def __init__(self, *a, **k):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def write(self, data):
                raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(context_mod, "open", Full, raising=False)
        ctx.prefill(model.tokenize(" And the dog"))
        with pytest.raises(OSError, match="No space"):
            ctx.save_seq_dump(f, 0)
        assert f.read_bytes() == before  # the earlier file is intact
        assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin", "s.bin.json"]  # no temp left


STATE_FUZZ = textwrap.dedent("""
    import sys, numpy as np, pyllamacpp as pl
    m = pl.Model()
    ctx = m.context(n_ctx=256, n_threads=1, n_threads_batch=1)
    toks = m.tokenize("The cat sat on the mat.")
    ctx.prefill(toks)
    ref = ctx.logits().copy()
    blob = ctx.seq_state(0).data
    rng = np.random.default_rng(int(sys.argv[1]))
    refused = loaded = 0
    for i in range(int(sys.argv[2])):
        b = blob.copy()
        if i % 2:
            b = b[: int(rng.integers(0, b.size))].copy()
        else:
            for _ in range(int(rng.integers(1, 4))):
                off = int(rng.integers(0, 1000)) if rng.random() < 0.7 else int(rng.integers(0, b.size))
                b[off] ^= np.uint8(1 << int(rng.integers(0, 8)))
        try:
            ctx.set_seq_state(0, b)
            loaded += 1
        except pl.StateError:
            refused += 1
            assert ctx.memory.seq_pos_max(0) == 6, "a refused load changed the sequence"
        ctx.memory.clear()
        ctx.set_seq_state(0, blob)
    ctx.memory.seq_rm(0, 6, -1)
    bt = pl.Batch(1, model=m); bt.add(int(toks[-1]), 6, 0, logits=True); ctx.decode(bt)
    assert np.array_equal(ctx.logits(), ref), "the context decodes differently after the fuzz"
    print("SURVIVED", loaded, refused)
""")


def test_fuzzed_state_blobs_never_crash_and_leave_the_sequence(tmp_path):
    out = _run_fuzz(STATE_FUZZ, 7, 2000)
    loaded, refused = map(int, out.split("SURVIVED")[1].split())
    assert refused > 1000  # most are caught by the parse-and-check before C
    print(f"state fuzz: 2000 cases, {refused} refused, {loaded} loaded (payload-only flips), 0 crashes")


def test_states_from_elsewhere_are_refused_before_c(model, tmp_path):
    from pyllamacpp.testing import make_model

    toks = model.tokenize(PROMPT)
    blobs = {}
    for name, kw in {
        "q8_0 cache": dict(type_k="q8_0", type_v="q8_0"),
        "4 streams": dict(n_seq_max=4),
        "flash attention off": dict(flash_attn="off"),
    }.items():
        with model.context(n_ctx=256, n_threads=2, **kw) as c:
            c.prefill(toks)
            blobs[name] = c.seq_state(0)
    other = make_model(tmp_path / "other.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=64)
    with pl.Model(other) as om, om.context(n_ctx=64, n_threads=1) as c:
        c.prefill(np.arange(1, 8))
        blobs["another model"] = c.seq_state(0)
    with model.context(n_ctx=256, n_threads=2) as ctx:
        ctx.prefill(toks)
        for name, blob in blobs.items():
            with pytest.raises(pl.StateError, match="does not fit"):
                ctx.set_seq_state(0, blob)
            assert ctx.memory.seq_pos_max(0) == 6, name  # unchanged
        with pytest.raises(pl.StateError, match="not a valid state"):
            ctx.set_seq_state(0, bytes(64))
        with pytest.raises(pl.StateError, match="seq file"):
            f = tmp_path / "x.seq"
            ctx.save_seq_state(f, 0, toks)
            ctx.set_seq_state(0, f.read_bytes())


def test_resource_use_stays_flat_over_cycles(model_path):
    # model + context + batch + decode + state round trip, over and over: RSS must not grow.

    def rss_kb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

    def cycle():
        with pl.Model(model_path) as m, m.context(n_ctx=128, n_threads=1) as ctx:
            b = pl.Batch(16, model=m)
            b.add_sequence([504, 2644, 2643, 335], 0, 0)
            ctx.decode(b)
            s = ctx.seq_state(0)
            ctx.memory.clear()
            ctx.set_seq_state(0, s)

    for _ in range(5):  # warm-up: allocator pools, lazy imports
        cycle()
    start = rss_kb()
    n = int(os.environ.get("PYLLAMACPP_LEAK_CYCLES", "200"))
    for _ in range(n):
        cycle()
    growth = rss_kb() - start
    print(f"RSS growth over {n} cycles: {growth} KiB")
    assert growth < 20 * 1024, f"RSS grew {growth} KiB over {n} cycles"


def test_aborted_prefill_says_where_to_resume(model):
    toks = np.resize(model.tokenize(PROMPT), 1024)
    with model.context(n_ctx=2048, n_batch=1024, n_ubatch=128, n_threads=2) as ctx:
        threading.Timer(0.15, ctx.abort).start()
        with pytest.raises(pl.DecodeAborted) as e:
            ctx.prefill(toks)
        done = e.value.resume_from
        assert e.value.seq_pos_max == {0: done - 1}
        assert done % 128 == 0 and 0 <= done < 1024  # whole ubatches made it in, no more
        ctx.prefill(toks[done:], 0)  # resume from there
        assert ctx.memory.seq_pos_max(0) == 1023
        resumed = ctx.logits().copy()
    with model.context(n_ctx=2048, n_batch=1024, n_ubatch=128, n_threads=2) as ctx:
        ctx.prefill(toks)
        assert int(np.argmax(ctx.logits())) == int(np.argmax(resumed))


ON_DEVICE_FORGERIES = textwrap.dedent("""
    import numpy as np, pyllamacpp as pl
    m = pl.Model()
    on_dev = pl.StateFlags.ON_DEVICE

    def refused(f, match):
        try:
            f()
        except pl.StateError as e:
            assert match in str(e), e
            return
        raise AssertionError(f"accepted, expected a StateError with {match!r}")

    def forged_cells(st):  # one cell fewer: cell_count - 1 (u32 at byte 12, one stream)
        b = st.data.copy()
        b[12:16] = np.frombuffer(np.uint32(int(b[12:16].view("<u4")[0]) - 1).tobytes(), np.uint8)
        return b

    toks = m.tokenize("The cat sat on the mat.")
    with m.context(n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(toks, 0)
        meta = ctx.seq_state(0, on_dev)
        assert len(meta) < 2000  # metadata only: the rows stay in llama.cpp
        ctx.memory.clear()
        assert ctx.set_seq_state(0, meta, on_dev) > 0 and ctx.memory.seq_pos_max(0) == 6
        forged = meta.data.copy()
        forged[4:8] = np.frombuffer(np.int32(1).tobytes(), np.uint8)  # names seq 1: never saved on device
        print("case: a blob naming a sequence never saved on device", flush=True)
        refused(lambda: ctx.set_seq_state(1, forged, on_dev), "ON_DEVICE")
        with m.context(n_ctx=256, n_threads=1, n_threads_batch=1) as other:
            print("case: another context", flush=True)
            refused(lambda: other.set_seq_state(0, meta, on_dev), "ON_DEVICE")
        # llama.cpp keeps the rows of a sequence's latest ON_DEVICE save only, and aborts
        # ("memory buffer mismatch") on a blob whose cells do not add up to them: an older blob of
        # the same sequence, or one edited, is refused; without the flag, a metadata-only blob is
        # refused by the check
        ctx.prefill(toks, 0)
        newer = ctx.seq_state(0, on_dev)
        for name, stale in (("an older blob", meta), ("an edited blob", forged_cells(newer))):
            print("case:", name, flush=True)
            refused(lambda: ctx.set_seq_state(0, stale, on_dev), "latest")
        assert ctx.memory.seq_pos_max(0) == 13
        refused(lambda: ctx.set_seq_state(1, newer), "metadata-only")
        assert ctx.set_seq_state(1, newer, on_dev) > 0 and ctx.memory.seq_pos_max(1) == 13
    print("OK")
""")


def test_on_device_state_from_elsewhere_is_refused():
    # With ON_DEVICE, llama.cpp keeps the data and the blob only names the sequence; loading a
    # blob that names a sequence this context never saved on device is a GGML_ASSERT abort there
    assert run_child(ON_DEVICE_FORGERIES).stdout.endswith("OK\n")


CONTEXT_OVER_OUTPUTS = textwrap.dedent("""
    import json, sys, pyllamacpp as pl
    m = pl.Model()
    try:
        m.context(n_ctx=256, n_threads=1, n_threads_batch=1, **json.loads(sys.argv[1]))
    except ValueError as e:
        print("REFUSED", e)
""")


@pytest.mark.parametrize(
    "kw", [dict(n_seq_max=4, n_batch=2, n_ubatch=2), dict(n_seq_max=4, n_batch=64, n_outputs_max=2)]
)
def test_more_sequences_than_outputs_is_refused_before_c(kw):
    # llama.cpp reserves n_seq_max output rows at creation: GGML_ASSERT(n_outputs_max <= ...) aborts
    out = run_child(CONTEXT_OVER_OUTPUTS, json.dumps(kw)).stdout
    assert "REFUSED n_seq_max 4 is more than the 2 outputs" in out, out


OUTPUTS_OVER_MAX = textwrap.dedent("""
    import numpy as np, pyllamacpp as pl
    m = pl.Model()
    with m.context(n_ctx=256, n_batch=64, n_outputs_max=8, n_threads=1, n_threads_batch=1) as c:
        b = pl.Batch(32, 1, model=m)
        toks = np.arange(100, 120, dtype=np.int32)
        b.add_sequence(toks, 0, 0, logits="all")
        try:
            c.decode(b)
            raise AssertionError("a batch of 20 outputs was decoded")
        except pl.InvalidBatchError as e:
            assert "20 outputs, more than this context's n_outputs_max 8" in str(e), e
        assert c.memory.seq_pos_max(0) == -1  # nothing reached memory
        b.clear()
        b.add_sequence(toks, 0, 0, logits="last")
        c.decode(b)  # the context is still usable
        assert c.memory.seq_pos_max(0) == 19
    print("OK")
""")


def test_batch_with_more_outputs_than_n_outputs_max_is_refused():
    # without the check llama_decode aborts the process in llama_context::output_reserve
    assert run_child(OUTPUTS_OVER_MAX).stdout.endswith("OK\n")
