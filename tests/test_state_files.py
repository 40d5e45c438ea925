"""State files (seq files, session files): checked against what they claim before llama.cpp reads them.

llama.cpp's file reader (llama_file::read_raw) does not stop at the end of a file: it reads what
is left and counts the bytes it was asked for, so a file cut short makes llama_state_seq_load_file
assert (SIGABRT) and llama_state_load_file load part of a state. Every load that could reach that
runs in a child process (``run_child``): an abort fails the test that found it.
"""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from conftest import PROMPT, run_child

import pyllamacpp as pl
import pyllamacpp.state as st

# One child per file kind: it makes the file, then loads it cut at every field boundary (and one
# byte either side), cut at random, and with one bit flipped in each byte of every header (file
# header, cells, per-layer record headers); it prints each case before loading it, so an abort
# names its case, then one JSON line per case.
FILE_FUZZ = textwrap.dedent("""
    import json, os, sys, tempfile, numpy as np, pyllamacpp as pl, pyllamacpp.state as st
    kind, seed, n_random = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    m = pl.Model()
    ctx = m.context(n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=1, n_threads_batch=1)
    toks = m.tokenize("The cat sat on the mat.")
    ctx.prefill(toks, 0)
    ctx.prefill(toks[:3], 1)  # another sequence: a refused load leaves it too as it was
    d = tempfile.mkdtemp()
    good, bad = os.path.join(d, "good.bin"), os.path.join(d, "bad.bin")
    if kind == "seq":
        ctx.save_seq_state(good, 0, toks)
        load = lambda p: ctx.load_seq_state(p, 0)
        snap = lambda: ctx.seq_state(0).data.tobytes() + ctx.seq_state(1).data.tobytes()
    else:
        ctx.save_state(good, toks)
        load = lambda p: ctx.load_state(p)
        snap = lambda: ctx.state().tobytes()
    data = np.fromfile(good, np.uint8)
    s = st.parse(data)
    h = s.header
    # field boundaries: the file header, the memory part, each cell, each record's fields
    bounds = {0, 4, 8, 12, h.nbytes}
    if h.arch is not None:
        bounds |= {h.nbytes - len(h.arch), h.nbytes - len(h.arch) - 4}
    heads = list(range(h.nbytes))  # header bytes to flip
    for part in s.parts:
        bounds |= {part.offset, part.offset + 4, part.end}
        heads += range(part.offset, part.offset + 4)
        for sm in part.streams:
            bounds |= {sm.offset, sm.cells_offset, sm.cells_offset + sm.cells_nbytes}
            heads += range(sm.offset, sm.cells_offset + sm.cells_nbytes + 8)  # cells, v_trans, n_layer
            for c in sm.cells:
                bounds |= {int(c["offset"]) + i for i in (0, 4, 8)}
            bounds.add(sm.cells_offset + sm.cells_nbytes + 4)
            for r in sm.records:
                p = r.header_offset
                bounds |= {p, p + 4, p + 8, r.data_offset, r.data_offset + r.nbytes}
                heads += range(r.header_offset, r.data_offset)
    cuts = sorted({b + e for b in bounds for e in (-1, 0, 1) if 0 <= b + e < data.size})
    rng = np.random.default_rng(seed)
    cuts += sorted(int(x) for x in rng.integers(0, data.size, n_random))
    cases = [("cut", n) for n in cuts] + [("flip", off) for off in sorted(set(heads))] + [("trailing", 1)]
    before = snap()
    for what, n in cases:
        if what == "cut":
            b = data[:n]
        elif what == "flip":
            b = data.copy()
            b[n] ^= np.uint8(1 << int(rng.integers(0, 8)))
        else:
            b = np.concatenate([data, np.zeros(n, np.uint8)])
        b.tofile(bad)
        print("case", what, n, flush=True)
        try:
            got = load(bad)
            out = ["loaded", [int(t) for t in got]]
        except pl.StateError as e:
            out = ["refused", str(e)]
            if snap() != before:
                out = ["CHANGED", str(e)]
        print(json.dumps([what, n, *out]), flush=True)
        if out[0] == "loaded":  # a flip llama.cpp takes (a token, a position): the good file again
            load(good)
            before = snap()
    # the context decodes as before the fuzz
    ctx.memory.clear()
    load(good)
    ctx.memory.seq_rm(0, 6, -1)
    bt = pl.Batch(1, model=m)
    bt.add(int(toks[-1]), 6, 0, logits=True)
    ctx.decode(bt)
    fuzzed = ctx.logits().copy()
    ctx.memory.clear()
    ctx.prefill(toks, 0)
    first = min(r.header_offset for r in s.records())
    print("SAME", bool(np.array_equal(fuzzed, ctx.logits())), "SIZE", data.size, "HEADER", h.nbytes, "RECORDS", first)
""")


@pytest.mark.parametrize("kind", ["seq", "session"])
def test_cut_and_flipped_files_are_refused_before_llama_cpp_reads_them(model, kind):
    child = run_child(FILE_FUZZ, kind, 11, 40, timeout=600)
    lines = child.stdout.splitlines()
    cases = [json.loads(ln) for ln in lines if ln.startswith("[")]
    tail = lines[-1].split()
    assert tail[0] == "SAME" and tail[1] == "True", "the context decodes differently after the fuzz"
    size, header, records = int(tail[3]), int(tail[5]), int(tail[7])
    assert not [c for c in cases if c[2] == "CHANGED"], "a refused load changed the context"
    cuts = [c for c in cases if c[0] == "cut"]
    assert len(cuts) > 300
    for _, n, outcome, msg in cuts:
        # every cut is refused, the message measuring the file against what its fields need
        assert outcome == "refused" and f"file is {n:,} bytes; its " in msg and "needs" in msg, (n, msg)
    assert all(c[2] == "refused" and "trailing bytes" in c[3] for c in cases if c[0] == "trailing")
    flips = [c for c in cases if c[0] == "flip"]
    loaded = [c for c in flips if c[2] == "loaded"]
    # what loads is a flip llama.cpp cannot tell from a real file: a stored token, a cell's
    # position or sequence; never the magic, version, n_token_count, nor a record's header
    assert loaded and all(12 <= n < records for _, n, _, _ in loaded)
    assert all(c[2] == "refused" for c in flips if c[1] < 12)
    toks = model.tokenize(PROMPT).tolist()
    assert all(c[3] != toks for c in loaded if 12 <= c[1] < 12 + 4 * 7)  # a flipped token comes back flipped
    print(
        f"{kind} file fuzz ({size:,} bytes, header {header}): {len(cuts)} cuts refused, "
        f"{len(flips)} flips: {len(flips) - len(loaded)} refused, {len(loaded)} loaded, 0 crashes"
    )


RAW_CUT_LOAD = textwrap.dedent("""
    import os, sys, tempfile, numpy as np, pyllamacpp as pl
    from pyllamacpp import ffi, lib
    m = pl.Model()
    ctx = m.context(n_ctx=256, n_threads=1, n_threads_batch=1)
    toks = m.tokenize("The cat sat on the mat.")
    ctx.prefill(toks)
    f = os.path.join(tempfile.mkdtemp(), "s.bin")
    n = ctx.save_seq_state(f, 0, toks)
    os.truncate(f, n // 2)
    buf, count = np.empty(256, np.int32), ffi.new("size_t *")
    print("loading", flush=True)
    print(lib.llama_state_seq_load_file(ctx.ptr, f.encode(), 0, ffi.from_buffer("llama_token[]", buf), 256, count))
""")


def test_llama_cpp_itself_aborts_on_a_cut_seq_file():
    # why the check exists: when this stops aborting, llama.cpp checks file lengths itself
    child = run_child(RAW_CUT_LOAD, check=False)
    assert child.signal == "SIGABRT", child.describe()
    assert "loading" in child.stdout and "GGML_ASSERT" in child.stderr and "nread <= state_size" in child.stderr
    assert "killed by SIGABRT" in child.describe()


@pytest.fixture
def files(model, tmp_path):
    with model.context(n_ctx=256, n_threads=1, n_threads_batch=1) as c:
        toks = model.tokenize(PROMPT)
        c.prefill(toks)
        seq, session = tmp_path / "s.bin", tmp_path / "w.bin"
        c.save_seq_state(seq, 0, toks)
        c.save_state(session, toks)
        yield c, seq, session


def _cut(path, n, tmp_path):
    out = tmp_path / f"cut{n}.bin"
    out.write_bytes(path.read_bytes()[:n])
    return out


def test_check_state_file_says_what_is_wrong_with_numbers(files, tmp_path):
    ctx, seq, session = files
    size = seq.stat().st_size
    assert size == 12 + 4 * 7 + 162_100  # the seq file header, then the dump without its 8-byte magic and seq_id
    ctx.check_state_file(seq)
    ctx.check_state_file(session, kind="context")
    cases = {
        0: "file is 0 bytes; its magic needs 4",
        8: "file is 8 bytes; its seq file header (u32 magic, version, n_token_count) needs 12",
        20: "file is 20 bytes; its seq file header (12 bytes, then n_token_count 7 tokens of 4) needs 40",
        50_000: "file is 50,000 bytes; its kv stream 0 K[18] data (7 rows x 384 bytes) (from byte 48,752) needs 51,440",
        size - 1: f"file is {size - 1:,} bytes; its kv stream 0 V[29] data (7 rows x 384 bytes) (from byte 159,452) "
        f"needs {size:,}",
    }
    for n, msg in cases.items():
        with pytest.raises(pl.StateError) as e:
            ctx.check_state_file(_cut(seq, n, tmp_path))
        assert str(e.value) == f"{tmp_path / f'cut{n}.bin'} is not a seq file this context can load: {msg}"
    # a flipped n_token_count claims more tokens than the file holds
    big = bytearray(seq.read_bytes())
    big[10] = 1  # n_token_count 7 + 65,536
    (tmp_path / "big.bin").write_bytes(bytes(big))
    with pytest.raises(
        pl.StateError, match=r"its seq file header \(12 bytes, then n_token_count 65,543 tokens of 4\) needs 262,184"
    ):
        ctx.check_state_file(tmp_path / "big.bin", max_tokens=100_000)
    with pytest.raises(pl.StateError, match="holds 7 tokens, more than max_tokens=3"):
        ctx.check_state_file(seq, max_tokens=3)
    with pytest.raises(pl.StateError, match=r"it is a session file \(load it with load_state\)"):
        ctx.check_state_file(session)
    with pytest.raises(pl.StateError, match=r"it is a seq file \(load it with load_seq_state\)"):
        ctx.check_state_file(seq, kind="context")
    version = bytearray(seq.read_bytes())
    version[4] = 2
    (tmp_path / "v2.bin").write_bytes(bytes(version))
    with pytest.raises(pl.StateError, match=r"version 2, expected 3 \(LLAMA_STATE_SEQ_VERSION"):
        ctx.check_state_file(tmp_path / "v2.bin")
    # the session file: its arch string, then the memory
    ssize = session.stat().st_size
    with pytest.raises(pl.StateError, match=r"file is 45 bytes; its arch name \(from byte 44\) needs 49"):
        ctx.check_state_file(_cut(session, 45, tmp_path), kind="context")
    with pytest.raises(pl.StateError, match=f"file is {ssize - 7:,} bytes; its kv stream 0 V\\[29\\] data"):
        ctx.check_state_file(_cut(session, ssize - 7, tmp_path), kind="context")
    with pytest.raises(FileNotFoundError):
        ctx.check_state_file(tmp_path / "none.bin")
    with pytest.raises(ValueError, match="kind"):
        ctx.check_state_file(seq, kind="seq")


def test_load_seq_state_checks_the_file_against_max_tokens(files):
    """A 7-token file with ``max_tokens=3`` is refused by the package before llama.cpp reads it
    (llama.cpp's own refusal, "token count ... exceeded capacity", clears the sequence), and the
    sequence keeps what it held; ``max_tokens=7`` is room enough."""
    ctx, seq, _ = files
    toks = ctx.model.tokenize(PROMPT).tolist()
    assert len(toks) == 7 and ctx.n_ctx == 256
    before = ctx.seq_state(0).data.tobytes()
    with pytest.raises(
        pl.StateError, match="is not a seq file this context can load: it holds 7 tokens, more than max_tokens=3"
    ):
        ctx.load_seq_state(seq, 0, max_tokens=3)
    assert ctx.seq_state(0).data.tobytes() == before and ctx.memory.seq_pos_max(0) == 6
    assert ctx.load_seq_state(seq, 0, max_tokens=7).tolist() == toks
    assert ctx.seq_state(0).data.tobytes() == before


def test_a_state_cut_after_its_k_records_is_refused(files, tmp_path):
    # it reads as a cache without V (has_v=False), byte for byte: the checks know this one has V
    ctx, seq, _ = files
    v0 = next(r for r in st.parse(seq).records() if r.kind == "V")
    cut = _cut(seq, v0.header_offset, tmp_path)
    assert st.parse(cut).options["has_v"] is False
    n = v0.header_offset
    with pytest.raises(pl.StateError, match=f"file is {n:,} bytes; its kv stream 0 V\\[0\\] type .* needs {n + 4:,}"):
        ctx.check_state_file(cut)
    blob = ctx.seq_state(0).data
    k_only = blob[: next(r for r in st.parse(blob).records() if r.kind == "V").header_offset].copy()
    with pytest.raises(pl.StateError, match="0 V records in stream 0 of the kv part, this context's cache has 30"):
        ctx.check_state(k_only)


def test_files_of_another_context_are_refused_with_its_settings(model, files, tmp_path):
    _, seq, session = files
    with model.context(n_ctx=256, n_seq_max=4, n_threads=1, n_threads_batch=1) as four:  # kv_unified=False: 4 streams
        with pytest.raises(pl.StateError, match=r"1 KV stream\(s\), this context has 4"):
            four.check_state_file(seq)
        with pytest.raises(pl.StateError, match=r"1 KV stream\(s\), this context has 4"):
            four.check_state_file(session, kind="context")
    with model.context(n_ctx=256, type_k="q8_0", type_v="q8_0", flash_attn="on", n_threads=1, n_threads_batch=1) as q8:
        with pytest.raises(pl.StateError, match="K\\[0\\] is f16, this context's cache is q8_0"):
            q8.check_state_file(seq)


def test_a_checked_load_short_of_room_keeps_the_sequence(model, tmp_path):
    # one stream shared by two sequences: seq 1 holds 150 cells of its own (loaded from a dump),
    # seq 0 holds 7, so a 150-cell file into seq 0 finds only 106 free once seq 0's go; llama.cpp
    # fails (no abort: the file is whole), and the copy of seq 0 kept aside is put back
    toks = np.resize(model.tokenize(PROMPT), 150)
    with model.context(n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(toks, 0)
        f = tmp_path / "s150.bin"
        ctx.save_seq_state(f, 0, toks)
        st150 = ctx.seq_state(0)
        ctx.memory.clear()
        ctx.prefill(toks[:7], 0)
        ctx.set_seq_state(1, st150)
        before = ctx.seq_state(0).data.tobytes()
        with pytest.raises(pl.StateError, match="could not load .*the sequence is unchanged"):
            ctx.load_seq_state(f, 0)
        assert ctx.seq_state(0).data.tobytes() == before and ctx.memory.seq_pos_max(1) == 149
        # seq 0's cells shared with seq 1 (seq_cp): they stay taken, and its copy does not fit
        # back either; said, not hidden
        ctx.memory.clear()
        ctx.prefill(toks, 0)
        ctx.memory.seq_cp(0, 1)
        with pytest.raises(pl.StateError, match="now empty: the copy kept aside did not fit back"):
            ctx.load_seq_state(f, 0)
        assert ctx.memory.seq_pos_max(0) == -1 and ctx.memory.seq_pos_max(1) == 149
        ctx.memory.seq_cp(1, 0)  # shared again: the same through set_seq_state
        with pytest.raises(pl.StateError, match="now empty: the copy kept aside did not fit back"):
            ctx.set_seq_state(0, st150)
        assert ctx.memory.seq_pos_max(0) == -1
        ctx.memory.seq_rm(1)
        assert ctx.load_seq_state(f, 0).tolist() == toks.tolist() and ctx.memory.seq_pos_max(0) == 149


def test_parse_state_reads_a_cut_file_header_with_numbers(files, tmp_path):
    # pyllamacpp.state alone (what parse-state prints): the header measured as one read
    _, seq, session = files
    with pytest.raises(st.StateFormatError) as e:
        st.parse(_cut(seq, 30, tmp_path))
    assert (e.value.offset, e.value.needed, e.value.left) == (0, 40, 30)
    with pytest.raises(st.StateFormatError) as e:
        st.parse(_cut(session, 9, tmp_path))
    assert (e.value.offset, e.value.needed, e.value.left) == (0, 12, 9) and "session file header" in str(e.value)


def test_a_plain_dump_of_another_layer_count_is_refused(tmp_path):
    """A dump of a 2-layer model is refused by a 3-layer model's context with both counts, before
    llama.cpp reads it, and the sequence stays empty."""
    from pyllamacpp.errors import StateError
    from pyllamacpp.testing import make_model

    kw = {"n_embd": 32, "n_head": 2, "n_vocab": 64}
    two = make_model(tmp_path / "two.gguf", "llama", n_layer=2, **kw)
    three = make_model(tmp_path / "three.gguf", "llama", n_layer=3, **kw)
    with pl.Model(two) as m2, m2.context(n_ctx=256, n_threads=1) as c2:
        b = pl.Batch(8, 1)
        b.add_sequence([5, 6, 7, 8], 0, 0, logits="last")
        c2.decode(b)
        dump = bytes(c2.seq_state(0))
    with pl.Model(three) as m3, m3.context(n_ctx=256, n_threads=1) as c3:
        with pytest.raises(StateError, match="2 layers in the kv part, the model.s has 3"):
            c3.check_state(dump)
        assert c3.memory.seq_pos_max(0) == -1


def test_a_dump_with_other_k_and_v_types_checks_against_each(model):
    """K and V of different types (q8_0 K, f16 V, flash attention on): a dump is checked record by
    record against the context's type_k for K and type_v for V, and passes in a twin context."""
    from pyllamacpp.errors import StateError

    kw = {"n_ctx": 256, "n_threads": 1, "flash_attn": "on"}
    with model.context(type_k="q8_0", type_v="f16", **kw) as a, model.context(type_k="q8_0", type_v="f16", **kw) as b:
        batch = pl.Batch(8, 1)
        batch.add_sequence(model.tokenize("The cat sat."), 0, 0, logits="last")
        a.decode(batch)
        dump = bytes(a.seq_state(0))
        b.check_state(dump)
        with model.context(type_k="f16", type_v="q8_0", **kw) as swapped, pytest.raises(StateError, match="q8_0"):
            swapped.check_state(dump)


def test_a_failed_save_says_why(model, tmp_path):
    with model.context(n_ctx=128, n_threads=1) as ctx:
        with pytest.raises(OSError, match=r"could not write .*: llama_state_save_file: .*No such file or directory"):
            ctx.save_state(tmp_path / "missing" / "x.state")


def test_a_dump_of_another_memory_kind_is_refused_naming_both(tmp_path):
    """A plain KV cache's dump in a recurrent model's context, an iSWA one's in a plain model's:
    refused with the parts the dump holds and those the context's memory reads."""
    from pyllamacpp.errors import StateError
    from pyllamacpp.testing import make_model

    kw = {"n_layer": 2, "n_embd": 64, "n_vocab": 128}
    llama = make_model(tmp_path / "l.gguf", "llama", n_head=4, **kw)
    mamba = make_model(tmp_path / "m.gguf", "mamba", ssm_d_conv=4, ssm_d_state=8, **kw)
    gemma = make_model(tmp_path / "g.gguf", "gemma3", n_head=4, n_swa=8, swa_pattern=2, **kw)

    def dump(path):
        with pl.Model(path) as m, m.context(n_ctx=256, n_threads=1) as c:
            b = pl.Batch(8, 1)
            b.add_sequence([5, 6, 7, 8], 0, 0, logits="last")
            c.decode(b)
            return bytes(c.seq_state(0))

    for into, data, want in (
        (
            mamba,
            dump(llama),
            r"memory parts \['kv'\], this context's recurrent memory reads \['recurrent \(recurrent\)'\]$",
        ),
        (llama, dump(gemma), r"memory parts \['kv', 'kv'\], this context's kv memory reads \['kv \(kv\)'\]$"),
    ):
        with pl.Model(into) as m, m.context(n_ctx=256, n_threads=1) as c, pytest.raises(StateError, match=want):
            c.check_state(data)


@pytest.mark.parametrize("arch", ["lfm2", "gemma3"])
def test_a_sequence_file_of_a_hybrid_or_iswa_memory_loads_back(tmp_path, arch):
    """A file holds a flags-0 dump, and the load checks it as one: for a hybrid (lfm2) and an iSWA
    (gemma3) memory, whose PARTIAL_ONLY dumps differ from full ones, it loads back whole."""
    from pyllamacpp.testing import make_model

    extra = {"n_swa": 8, "swa_pattern": 2} if arch == "gemma3" else {}
    path = make_model(tmp_path / f"{arch}.gguf", arch, n_layer=2, n_embd=64, n_head=4, n_vocab=128, **extra)
    with pl.Model(path) as m, m.context(n_ctx=256, n_threads=1) as c:
        b = pl.Batch(8, 1)
        b.add_sequence([5, 6, 7, 8, 9], 0, 0, logits="last")
        c.decode(b)
        c.save_seq_state(tmp_path / "s.seq", 0, [5, 6, 7, 8, 9])
        c.memory.clear()
        assert c.load_seq_state(tmp_path / "s.seq", 0).tolist() == [5, 6, 7, 8, 9]
        assert c.memory.seq_pos_max(0) == 4
