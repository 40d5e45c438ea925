"""pyllamacpp.state on real dumps of the default model: parse, views, layout, addresses,
quantized rows, seq and session files, edits that load back, select_cells, errors and fuzzing.

Dumps come from the real library through the raw binding (no mocks); the small helpers here and
in state_helpers.py do what the Pythonic Context API does.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import state_helpers as sh
from state_helpers import (
    CONFIGS,
    HEAD_DIM,
    N_HEAD_KV,
    N_LAYER,
    N_THREADS,
    PROMPT,
    PROMPT_TOKENS,
    check_layout,
    clear,
    context,
    context_dump,
    decode,
    seq_dump,
)

from pyllamacpp import ffi, lib, state
from pyllamacpp.state import DumpKind, StateFormatError

# the module-scoped fixtures these tests share (state_helpers.py); pytest finds a fixture by its
# own name wherever a module holds it
model, runs, pl_model = sh.model, sh.runs, sh.pl_model


# bytes per 32-value block (ggml-common.h: block_q8_0 ... block_iq4_nl): fp16 d (and m for the
# _1 types), 4-bit or 8-bit quants, the 5th bits of q5 in a u32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}


def tokenize(model, text: str) -> list[int]:
    raw = text.encode()
    buf = ffi.new("llama_token[]", len(raw) + 8)
    n = lib.llama_tokenize(lib.llama_model_get_vocab(model), raw, len(raw), buf, len(raw) + 8, True, False)
    assert n > 0
    return list(buf[0:n])


def seq_load(ctx, data: bytes, seq_id=0) -> int:
    return lib.llama_state_seq_set_data_ext(ctx, ffi.from_buffer(data), len(data), seq_id, 0)


def test_import_needs_no_compiled_extension(tmp_path):
    code = (
        "import sys; sys.modules['pyllamacpp._pyllamacpp'] = None\n"  # any import of it fails
        "import pyllamacpp.state as s\n"
        "assert 'pyllamacpp._lib' not in sys.modules\n"
        "try:\n    s.parse(b'\\x00' * 8)\nexcept s.StateFormatError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK at byte 0: magic")


def test_tokens_match_the_facts_file(model):
    assert tokenize(model, PROMPT) == PROMPT_TOKENS


def test_sequence_dump_layout_matches_the_facts_file(runs):
    data = runs("f16-fa")["seq"]
    assert len(data) == 162_108
    st = state.parse(data, n_head_kv=N_HEAD_KV)
    assert st.kind is DumpKind.SEQUENCE and "sequence dump" in str(st)
    assert st.header.magic == 0xAF143CD8 and st.header.seq_id == 0 and st.header.nbytes == 8
    (part,) = st.parts
    assert part.name == "kv" and part.n_stream == 1
    s = st.stream()
    assert s.cell_count == 7 and s.v_trans == 0 and s.n_layer == N_LAYER
    assert st.cells["pos"].tolist() == list(range(7))
    assert st.cells["n_seq_id"].tolist() == [1] * 7 and st.cells["seq_id"][:, 0].tolist() == [0] * 7
    k0 = st.record("K", 0)
    assert (k0.header_offset, k0.data_offset, k0.type.name, k0.row_size) == (108, 120, "f16", 384)
    assert len(s.k_records) == len(s.v_records) == N_LAYER
    assert all(r.type.id == 1 and r.row_size == 384 for r in s.records)
    # zero-copy: the view is the bytes at 120
    assert st.k[0].shape == (7, N_HEAD_KV, HEAD_DIM) and st.k[0].dtype == np.float16
    assert np.shares_memory(st.k[0], st.buffer)
    np.testing.assert_array_equal(st.k[0].reshape(-1), np.frombuffer(data, "<f2", 7 * 192, 120))
    assert st.to_bytes() == data
    check_layout(st)
    lay = st.layout()
    assert lay.payload_bytes == 7 * 23_040 and lay.metadata_bytes == 108 + 60 * 12


@pytest.mark.parametrize("config", list(CONFIGS))
def test_round_trip_layout_and_repeatability(runs, config):
    r = runs(config)
    st = state.parse(r["seq"], n_head_kv=N_HEAD_KV)
    assert st.to_bytes() == r["seq"]
    check_layout(st)
    cfg = CONFIGS[config]
    s = st.stream()
    assert s.v_trans == (0 if cfg["flash_attn"] else 1)
    assert {x.type.name for x in s.k_records} == {cfg.get("type_k", "f16")}
    assert {x.type.name for x in s.v_records} == {cfg.get("type_v", "f16")}
    row_k, row_v = s.k_records[0].row_size, s.v_records[0].row_size
    assert st.nbytes == 108 + N_LAYER * (12 + 7 * row_k) + N_LAYER * (12 + 7 * row_v)
    # the K row of cell 0, layer 0 is what a second decode of the same prompt dumps
    st2 = state.parse(r["seq2"], n_head_kv=N_HEAD_KV)
    assert st2.record("K", 0).data[:row_k].tobytes() == st.record("K", 0).data[:row_k].tobytes()
    # the whole-context state holds the same memory after its arch string
    whole = state.parse(r["context"], n_head_kv=N_HEAD_KV)
    assert whole.kind is DumpKind.CONTEXT and whole.header.arch == "llama"
    assert whole.to_bytes() == r["context"] and r["context"][whole.header.nbytes :] == r["seq"][8:]
    check_layout(whole)


def test_transposed_v_is_an_untransposed_view(runs):
    fa, nofa = (state.parse(runs(c)["seq"], n_head_kv=N_HEAD_KV, writable=True) for c in ("f16-fa", "f16-nofa"))
    assert nofa.stream().v_trans == 1 and nofa.record("V", 0).transposed
    v = nofa.v[0]
    assert v.shape == (7, N_HEAD_KV, HEAD_DIM) and np.shares_memory(v, nofa.buffer)
    # layer 0 sees the same input with or without flash attention: identical V
    np.testing.assert_array_equal(v, fa.v[0])
    for il in range(N_LAYER):  # deeper layers drift with the attention kernel (<10%), not scrambled (~140%)
        a, b = nofa.v[il].astype(np.float32), fa.v[il].astype(np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.2
    # address() agrees with the view, and writing through the view lands there
    rec = nofa.record("V", 5)
    addr = nofa.address("V", 5, cell=4, head=2, element=7)
    assert addr == rec.data_offset + ((2 * HEAD_DIM + 7) * 7 + 4) * 2
    assert np.frombuffer(nofa.buffer[addr : addr + 2].tobytes(), "<f2")[0] == nofa.v[5][4, 2, 7]
    nofa.v[5][4, 2, 7] = 1234.0
    assert np.frombuffer(nofa.to_bytes()[addr : addr + 2], "<f2")[0] == 1234.0
    # in the cache tensor, transposed V is value-major: element j of cell c at j * kv_size + c
    assert nofa.tensor_offset("V", 5, cell=4, head=2, element=7, kv_size=256) == ((2 * 64 + 7) * 256 + 4) * 2
    assert fa.tensor_offset("V", 5, cell=4, head=2, element=7, kv_size=256) == 4 * 384 + (2 * 64 + 7) * 2
    assert (
        fa.tensor_offset("K", 0, cell=3, head=1, element=5, kv_size=256, dest_stream=2) == (2 * 256 + 3) * 384 + 69 * 2
    )
    assert fa.address("K", 1, cell=2, head=1, element=5) == 2820 + 2 * 384 + 69 * 2


# The worst error of one value of a 32-value block, from the quantizer the CPU backend uses for
# the cache (ggml-cpu/quants.c quantize_row_<type> -> ggml-quants.c quantize_row_<type>_ref);
# amax = max |x| of the block, span = max x - min x.
QUANT_ERROR = {
    "q8_0": lambda amax, span: amax / 127,  # d = amax/127, round to nearest: d/2 (a step, for margin)
    "q4_0": lambda amax, span: amax / 8,  # d = max/-8, q clamped to 15: the far end loses up to |d|
    "q5_0": lambda amax, span: amax / 16,  # the same with d = max/-16, q clamped to 31
    "q4_1": lambda amax, span: span / 30,  # d = span/15 above the block's min, round to nearest: d/2
    "q5_1": lambda amax, span: span / 62,  # d = span/31: d/2
    # levels kvalues_iq4nl at d = max/-127: widest gap 24, top clamp 113, so <= 14 d = 0.110 amax
    # before quantize_row_iq4_nl_impl refits d by least squares; amax/8 leaves room for the refit
    "iq4_nl": lambda amax, span: amax / 8,
}
# relative distance to the F16 run of the unrotated values of layers 10 and 29 (deeper layers
# drift with the quantized attention; layer 0 must be within a quarter of it). Measured here:
# 0.09 / 0.34 / 0.22 / 0.14 / 0.12 / 0.26 at most, in the order below.
DRIFT = {"q8_0": 0.15, "q4_0": 0.5, "q4_1": 0.4, "q5_0": 0.3, "q5_1": 0.3, "iq4_nl": 0.5}


@pytest.mark.parametrize("qtype", list(QUANT_ERROR))
def test_quantized_cache_dequantizes_close_to_f16(runs, qtype):
    drift = DRIFT[qtype]
    q = state.parse(runs(qtype)["seq"], n_head_kv=N_HEAD_KV)
    ref = state.parse(runs("f16-fa")["seq"], n_head_kv=N_HEAD_KV)
    rec = q.record("K", 0)
    assert rec.type.name == qtype and rec.type.block_size == 32 and rec.type.type_size == BLOCK_BYTES[qtype]
    assert rec.row_size == N_HEAD_KV * HEAD_DIM // 32 * BLOCK_BYTES[qtype]
    assert q.nbytes == 108 + 2 * N_LAYER * (12 + 7 * rec.row_size)  # sizes add up to the byte
    assert rec.type.quantized and q.k[0].dtype == np.uint8 and q.k[0].shape == (7, rec.row_size)
    assert np.shares_memory(q.k[0], q.buffer) and "Hadamard" in str(q)
    assert q.address("K", 0, cell=1, head=0, element=40) == rec.data_offset + rec.row_size + rec.type.type_size
    h = state.hadamard(64)
    np.testing.assert_allclose(h @ h, np.eye(64), atol=1e-6)
    for kind in ("K", "V"):
        r = q.record(kind, 0)
        assert r.rotation_size() == 64
        deq = r.dequantize()
        assert deq.shape == (7, N_HEAD_KV, HEAD_DIM) and deq.dtype == np.float32
        exact = ref.record(kind, 0).values.astype(np.float32)
        # A quantized cache holds K and V Hadamard-rotated in runs of 64 (attn_rot_k/_v:
        # ggml_is_quantized(type) and a head size that is a multiple of 64, llama_kv_cache's
        # constructor). Layer 0 sees the same input as with F16, so in the rotated basis the
        # difference is the quantization error of each 32-value block, plus fp16 rounding: the
        # block's scale (and min) are fp16, and so is the reference.
        rotated = (exact.reshape(7, -1, 64) @ h).reshape(-1, 32)
        amax = np.abs(rotated).max(axis=1, keepdims=True)
        span = rotated.max(axis=1, keepdims=True) - rotated.min(axis=1, keepdims=True)
        bound = QUANT_ERROR[qtype](amax, span) + amax * 2**-9 + 2e-3
        err = np.abs(deq.reshape(-1, 32) - rotated)
        assert (err <= bound).all(), (kind, float((err - bound).max()))
        un = r.dequantize(unrotate=True)
        assert np.linalg.norm(un - exact) / np.linalg.norm(exact) < drift / 4
        assert np.linalg.norm(deq - exact) / np.linalg.norm(exact) > 1  # still rotated: not comparable
        for il in (10, 29):  # deeper layers drift with the quantized attention, but stay close
            a, b = q.record(kind, il).dequantize(unrotate=True), ref.record(kind, il).values.astype(np.float32)
            assert np.linalg.norm(a - b) / np.linalg.norm(b) < drift


@pytest.mark.parametrize("qtype", ["q4_1", "q5_0", "q5_1", "iq4_nl"])
def test_quantized_v_without_flash_attention_is_a_clean_error(pl_model, qtype):
    import pyllamacpp as pl

    # llama_init_from_model refuses it ("quantized V cache requires flash_attn"): NULL, no abort
    with pytest.raises(pl.ContextError, match="requires flash_attn"):
        pl_model.context(n_ctx=256, n_threads=N_THREADS, type_k=qtype, type_v=qtype, flash_attn="off")


def test_non_unified_context_has_a_stream_per_sequence(model, runs):
    with context(model, kv_unified=False, n_seq_max=4) as ctx:
        decode(ctx, PROMPT_TOKENS, seq_ids=(0,))
        other = tokenize(model, "Hello world")
        decode(ctx, other, seq_ids=(2,))
        seq0, seq2, whole = seq_dump(ctx, 0), seq_dump(ctx, 2), context_dump(ctx)
    assert len(seq0) == 162_108 + 3 * 4  # each other stream adds a u32 cell_count of 0
    assert seq0[8:12] == (4).to_bytes(4, "little")
    st = state.parse(seq2, n_head_kv=N_HEAD_KV)
    part = st.part()
    assert part.n_stream == 4 and [s.cell_count for s in part.streams] == [0, 0, len(other), 0]
    assert st.stream().index == 2 and st.k[0].shape == (len(other), N_HEAD_KV, HEAD_DIM)
    assert st.cells["seq_id"][:, 0].tolist() == [2] * len(other)
    s0 = state.parse(seq0, n_head_kv=N_HEAD_KV)
    f16 = state.parse(runs("f16-fa")["seq"], n_head_kv=N_HEAD_KV)
    np.testing.assert_array_equal(s0.k[0][0], f16.k[0][0])
    w = state.parse(whole, n_head_kv=N_HEAD_KV)
    assert w.kind is DumpKind.CONTEXT
    with pytest.raises(ValueError, match="streams"):
        w.k
    assert w.stream(stream=0).cells["pos"].tolist() == list(range(7))
    assert w.stream(stream=2).cell_count == len(other)
    for x, data in ((st, seq2), (s0, seq0), (w, whole)):
        assert x.to_bytes() == data
        check_layout(x)


def _shared_prefix(ctx):
    """The prompt once for sequences 0, 1, 2 (one cell each, three seq ids), then one token each."""
    decode(ctx, PROMPT_TOKENS, seq_ids=(0, 1, 2))
    decode(ctx, [11, 12, 13], pos=[7, 7, 7], seq_ids=[(0,), (1,), (2,)])


def test_shared_prefix_context_state(model):
    with context(model, kv_unified=True, n_seq_max=3) as ctx:
        _shared_prefix(ctx)
        whole, seq1 = context_dump(ctx), seq_dump(ctx, 1)
    st = state.parse(whole, n_head_kv=N_HEAD_KV)
    assert st.kind is DumpKind.CONTEXT and st.header.arch == "llama"
    cells = st.cells
    assert cells["n_seq_id"].tolist() == [3] * 7 + [1] * 3
    assert cells["seq_id"][:7].tolist() == [[0, 1, 2]] * 7
    assert cells["seq_id"][7:, 0].tolist() == [0, 1, 2] and (cells["seq_id"][7:, 1:] == -1).all()
    assert cells["pos"].tolist() == list(range(7)) + [7, 7, 7]
    assert st.to_bytes() == whole and "seq [0, 1, 2]" in str(st)
    check_layout(st)
    s1 = state.parse(seq1, n_head_kv=N_HEAD_KV)  # a sequence dump lists only its own seq id
    assert s1.cells["n_seq_id"].tolist() == [1] * 8 and (s1.cells["seq_id"][:, 0] == 1).all()
    np.testing.assert_array_equal(s1.k[3], st.k[3][[0, 1, 2, 3, 4, 5, 6, 8]])
    # it loads back, and dumps back the same bytes
    with context(model, kv_unified=True, n_seq_max=3) as ctx:
        assert lib.llama_state_set_data(ctx, ffi.from_buffer(whole), len(whole)) == len(whole)
        assert context_dump(ctx) == whole


def test_seq_file_session_file_and_sidecar(model, model_path, tmp_path):
    with context(model) as ctx:
        decode(ctx, PROMPT_TOKENS)
        dump, whole = seq_dump(ctx), context_dump(ctx)
        toks = ffi.new("llama_token[]", PROMPT_TOKENS)
        seq_path, session_path = tmp_path / "seq.bin", tmp_path / "session.bin"
        assert lib.llama_state_seq_save_file(ctx, str(seq_path).encode(), 0, toks, 7) == seq_path.stat().st_size
        assert lib.llama_state_save_file(ctx, str(session_path).encode(), toks, 7)
    sq = state.parse(seq_path)
    assert sq.kind is DumpKind.SEQ_FILE and "seq file" in sq.describe()
    assert (sq.header.magic, sq.header.version) == (0x67677371, lib.LLAMA_STATE_SEQ_VERSION) == (0x67677371, 3)
    assert sq.tokens.tolist() == PROMPT_TOKENS and isinstance(sq.buffer, np.memmap) and not sq.writable
    raw = seq_path.read_bytes()
    assert sq.to_bytes() == raw and raw[12 + 4 * 7 :] == dump[8:]  # no io magic, no seq_id in the file
    check_layout(sq)
    se = state.parse(session_path)
    assert se.kind is DumpKind.SESSION_FILE and se.header.version == lib.LLAMA_SESSION_VERSION == 10
    assert se.header.arch == "llama" and se.tokens.tolist() == PROMPT_TOKENS
    assert session_path.read_bytes()[12 + 4 * 7 :] == whole and se.to_bytes() == session_path.read_bytes()
    check_layout(se)
    # writable=True maps copy-on-write: edits show in to_bytes(), never in the file
    cow = state.parse(seq_path, writable=True, n_head_kv=N_HEAD_KV)
    cow.k[0][:] = 0
    assert cow.to_bytes() != raw and seq_path.read_bytes() == raw
    # head counts: rows stay flat without one; a sidecar, model= or n_head_kv= supplies it
    assert sq.k[0].shape == (7, 192)
    facts = state.model_facts(model_path, sha256=True)  # what the GGUF says, and its hash prefix
    assert facts["arch"] == "llama" and facts["n_layer"] == N_LAYER and facts["n_head_kv"] == N_HEAD_KV
    assert facts["n_embd_head_k"] == facts["n_embd_head_v"] == HEAD_DIM and len(facts["model_sha256"]) == 16
    side = state.write_sidecar(
        seq_path,
        **facts,
        type_k="f16",
        type_v="f16",
        flash_attn=True,
        kv_unified=True,
        n_ctx=256,
        tokens=np.array(PROMPT_TOKENS),
    )
    assert side == tmp_path / "seq.bin.json" and sorted(p.name for p in tmp_path.iterdir()) == [
        "seq.bin",
        "seq.bin.json",
        "session.bin",
    ]  # the temp file was renamed, not left behind
    assert state.read_sidecar(seq_path)["tokens"] == PROMPT_TOKENS
    assert state.parse(seq_path).k[0].shape == (7, N_HEAD_KV, HEAD_DIM)
    with pytest.raises(TypeError, match="unknown sidecar fields"):
        state.write_sidecar(seq_path, n_heads_kv=3)
    assert state.parse(dump, model=model_path).n_head_kv == N_HEAD_KV

    class HasHeads:
        n_head_kv = 3

    assert state.parse(dump, model=HasHeads()).k[1].shape == (7, N_HEAD_KV, HEAD_DIM)


def test_editing_one_head_changes_the_next_logits(model):
    nxt = 578  # any token; fixed so the test does not depend on sampling
    with context(model) as ctx:
        decode(ctx, PROMPT_TOKENS)
        data = seq_dump(ctx)
        ref = decode(ctx, [nxt], pos0=7)

        def restore_and_step(blob):
            clear(ctx)
            assert seq_load(ctx, blob) == len(blob)
            assert lib.llama_memory_seq_pos_max(lib.llama_get_memory(ctx), 0) == 6
            return decode(ctx, [nxt], pos0=7)

        plain = restore_and_step(data)
        np.testing.assert_array_equal(plain, ref)  # same cells: bit-identical (LLAMA_CPP_FACTS)
        st = state.parse(data, n_head_kv=N_HEAD_KV, writable=True)
        assert not state.parse(data).writable and st.writable  # bytes in: one copy, asked for
        mutable = bytearray(data)  # writable in: writable views, no copy
        assert np.shares_memory(state.parse(mutable).k[0], np.frombuffer(mutable, np.uint8))
        assert not state.parse(mutable, writable=False).k[0].flags.writeable
        st.k[2][:, 1, :] = 0
        edited = st.to_bytes()
        changed = np.flatnonzero(np.frombuffer(edited, np.uint8) != np.frombuffer(data, np.uint8))
        head = {st.address("K", 2, c, 1, e) + b for c in range(7) for e in range(HEAD_DIM) for b in (0, 1)}
        assert changed.size and set(changed.tolist()) <= head
        after = restore_and_step(edited)
        assert np.abs(after - plain).max() > 1e-2
        np.testing.assert_array_equal(restore_and_step(data), ref)  # and the unedited one still matches


def test_select_cells_writes_a_smaller_dump_that_loads(model, runs):
    data = runs("f16-fa")["seq"]
    st = state.parse(data, n_head_kv=N_HEAD_KV)
    small = st.select_cells(st.cells["pos"] < 4)
    assert small.stream().cell_count == 4 and small.nbytes == 16 + 4 * 12 + 8 + 60 * (12 + 4 * 384)
    assert small.cells["pos"].tolist() == [0, 1, 2, 3] and small.writable
    for il in range(N_LAYER):
        np.testing.assert_array_equal(small.k[il], st.k[il][:4])
        np.testing.assert_array_equal(small.v[il], st.v[il][:4])
    check_layout(small)
    blob = small.to_bytes()
    with context(model) as ctx:
        assert seq_load(ctx, blob) == len(blob)
        assert lib.llama_memory_seq_pos_max(lib.llama_get_memory(ctx), 0) == 3
        restored = decode(ctx, PROMPT_TOKENS[4:5], pos0=4)
        clear(ctx)
        fresh = decode(ctx, PROMPT_TOKENS[:5])
    np.testing.assert_allclose(restored, fresh, atol=0.05)
    assert restored.argmax() == fresh.argmax()

    # transposed V: whole value-major columns are filtered, cells need not be contiguous
    nofa = state.parse(runs("f16-nofa")["seq"], n_head_kv=N_HEAD_KV)
    picked = nofa.select_cells([0, 2, 5])
    assert picked.cells["pos"].tolist() == [0, 2, 5] and picked.stream().v_trans == 1
    for il in (0, 17, 29):
        np.testing.assert_array_equal(picked.v[il], nofa.v[il][[0, 2, 5]])
        np.testing.assert_array_equal(picked.k[il], nofa.k[il][[0, 2, 5]])
    with context(model, flash_attn=False) as ctx:
        assert seq_load(ctx, picked.to_bytes()) == picked.nbytes
    with pytest.raises(ValueError, match="increasing"):
        nofa.select_cells([2, 0])


def test_select_cells_with_a_callable_over_streams(model):
    with context(model, kv_unified=True, n_seq_max=3) as ctx:
        _shared_prefix(ctx)
        whole = context_dump(ctx)
    st = state.parse(whole, n_head_kv=N_HEAD_KV)
    prefix = st.select_cells(lambda cells: cells["n_seq_id"] == 3)
    assert prefix.cells["pos"].tolist() == list(range(7))
    np.testing.assert_array_equal(prefix.v[9], st.v[9][:7])
    with context(model, kv_unified=True, n_seq_max=3) as ctx:
        blob = prefix.to_bytes()
        assert lib.llama_state_set_data(ctx, ffi.from_buffer(blob), len(blob)) == len(blob)
        for s in range(3):
            assert lib.llama_memory_seq_pos_max(lib.llama_get_memory(ctx), s) == 6


def _patched(data: bytes, offset: int, value: int, size: int = 4) -> bytes:
    b = bytearray(data)
    b[offset : offset + size] = value.to_bytes(size, "little", signed=value < 0)
    return bytes(b)


def test_errors_name_the_offset_and_what_was_expected(runs, tmp_path):
    data = runs("f16-fa")["seq"]

    def err(blob, **kw) -> StateFormatError:
        with pytest.raises(StateFormatError) as info:
            state.parse(blob, **kw)
        assert isinstance(info.value, ValueError) and str(info.value).startswith(f"at byte {info.value.offset}")
        return info.value

    e = err(data[:110])  # truncated inside K[0]'s header
    assert (e.offset, e.needed, e.left) == (108, 4, 2) and "K[0] type" in e.what
    e = err(data[:5000])  # truncated inside K[1]'s rows
    assert (e.offset, e.needed, e.left) == (2820, 2688, 2180) and "K[1] data" in e.what
    e = err(b"")
    assert (e.offset, e.needed, e.left) == (0, 4, 0) and e.what == "magic"
    assert "unknown magic 0x00000000" in str(err(b"\0" * 100))
    assert "expected 0 or 1" in str(err(_patched(data, 100, 2)))  # v_trans
    e = err(_patched(data, 8, 0))
    assert e.offset == 8 and "n_stream" in e.what
    e = err(_patched(data, 108, 99))
    assert e.offset == 108 and "unknown ggml type 99" in str(e)
    e = err(_patched(data, 112, 385, 8))  # half an f16 value
    assert e.offset == 112 and "not a whole number" in str(e)
    assert err(_patched(data, 112, 386, 8)).offset > 112  # a valid row size, but the sizes no longer add up
    e = err(_patched(data, 104, 31))  # n_layer
    assert e.offset >= 104
    e = err(_patched(data, 12, 100_000))  # cell_count
    assert e.offset == 16 and e.needed == 800_000
    e = err(data + b"\0\0\0")
    assert e.offset == len(data) and "3 trailing bytes" in str(e)
    e = err(data, n_head_kv=5)
    assert "n_head_kv=5" in str(e)
    seq_file = tmp_path / "bad.bin"
    seq_file.write_bytes((0x67677371).to_bytes(4, "little") + (2).to_bytes(4, "little") + b"\0" * 8)
    e = err(seq_file)
    assert e.offset == 4 and "version 2, expected 3" in str(e)
    seq_file.write_bytes(b"")
    assert err(seq_file).needed == 4
    with pytest.raises(ValueError, match="n_head_kv"):
        state.parse(data, n_head_kv=0)


def test_fuzzed_dumps_raise_only_state_format_errors(runs, model):
    rng = np.random.default_rng(20240601)
    with context(model, kv_unified=True, n_seq_max=3) as ctx:
        _shared_prefix(ctx)
        shared = context_dump(ctx)
    # a short 2-token dump keeps parses fast; the structure is what is fuzzed
    f16 = state.parse(runs("f16-fa")["seq"]).select_cells([0, 1]).to_bytes()
    nofa = state.parse(runs("f16-nofa")["seq"]).select_cells([0, 1, 2]).to_bytes()
    outcomes = {"ok": 0, "error": 0}

    def attempt(blob: bytes):
        try:
            st = state.parse(blob, n_head_kv=N_HEAD_KV)
        except StateFormatError:
            outcomes["error"] += 1
            return
        outcomes["ok"] += 1  # what parses is consistent: every byte accounted for, round trip exact
        assert st.layout().total_bytes == len(blob) and st.to_bytes() == blob

    for base in (f16, nofa, shared):
        meta = np.concatenate(
            [np.arange(s.offset, s.offset + s.nbytes) for s in state.parse(base).layout().segments if not s.payload]
        )
        for n in range(0, 200):
            attempt(base[:n])
        for n in rng.integers(0, len(base), 300):
            attempt(base[:n])
        arr = np.frombuffer(base, np.uint8)
        for i in range(700):
            mutated = arr.copy()
            where = rng.choice(meta, rng.integers(1, 4)) if i % 4 else rng.integers(0, len(base), 2)
            mutated[where] ^= (1 << rng.integers(0, 8, len(where))).astype(np.uint8)
            attempt(mutated.tobytes())
    assert outcomes["error"] > 2000 and outcomes["ok"] > 100, outcomes


# -- transposed V of a quantized type -------------------------------------------------------------
def test_transposed_quantized_v_is_refused(runs):
    data = state.parse(runs("f16-nofa")["seq"]).select_cells([0, 1]).to_bytes()
    v0 = state.parse(data).record("V", 0).header_offset
    for type_id in (lib.GGML_TYPE_Q8_0, lib.GGML_TYPE_Q4_0, lib.GGML_TYPE_Q4_1):
        blob = _patched(data, v0, int(type_id))
        for el in (2, 34):  # the real element size and ggml_type_size of q8_0: refused either way
            with pytest.raises(StateFormatError, match="never writes one .*flash attention") as info:
                state.parse(_patched(blob, v0 + 4, el), n_head_kv=N_HEAD_KV)
            assert info.value.offset == v0 and "V[0] type" in info.value.what
    # every type id in V's header: a refusal, never a misread
    for type_id in range(-2, 45):
        try:
            st = state.parse(_patched(data, v0, type_id))
        except StateFormatError:
            continue
        assert not st.record("V", 0).type.quantized and st.to_bytes() == _patched(data, v0, type_id)


def test_layout_is_a_sequence_of_its_rows(runs):
    lay = state.parse(runs("f16-fa")["seq"], n_head_kv=N_HEAD_KV).layout()
    assert len(lay) == len(lay.rows) == 2 * N_LAYER
    assert list(lay) == list(lay.rows) and lay[0] is lay.rows[0] and lay[-1].kind == "V"
    assert sum(r.nbytes for r in lay) == lay.payload_bytes


def test_n_layer_names_the_layer_count(model, runs, tmp_path):
    # issue 36: len(st.k) worked and was documented nowhere; n_layer names it, for every layout
    st = state.parse(runs("f16-fa")["seq"], n_head_kv=N_HEAD_KV)
    assert st.n_layer == N_LAYER == len(st.k) == st.stream().n_layer
    with context(model, kv_unified=False, n_seq_max=3) as ctx:
        decode(ctx, PROMPT_TOKENS, seq_ids=(0,))
        decode(ctx, PROMPT_TOKENS[:3], seq_ids=(1,))
        whole, empty = context_dump(ctx), seq_dump(ctx, 2)
    w = state.parse(whole, n_head_kv=N_HEAD_KV)
    with pytest.raises(ValueError, match="streams"):
        w.k  # a stream per sequence: k needs one picked, the count does not
    assert w.n_layer == N_LAYER
    assert state.parse(empty, n_head_kv=N_HEAD_KV).n_layer == 0  # no cells: no records written
    for arch, kw, want in (
        ("gemma2", dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4), 2),  # base + swa
        ("mamba", dict(n_layer=2, n_embd=32), 2),  # recurrent: its R and S records per layer
        ("lfm2", dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2), 4),  # attention + conv layers
    ):
        d = sh._synthetic(tmp_path, arch, **kw)
        assert state.parse(d["one"], n_head_kv=d["n_head_kv"] or None).n_layer == want, arch
