"""pyllamacpp.state: parse, views, layout, addresses and writing of real llama.cpp state dumps.

Dumps come from the real library through the raw binding (no mocks); small module-level
helpers below do what the Pythonic Context API will do later.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import numpy as np
import pytest

from pyllamacpp import ffi, lib, state
from pyllamacpp.state import DumpKind, StateFormatError

PROMPT = "The cat sat on the mat."
PROMPT_TOKENS = [504, 2644, 2643, 335, 260, 1171, 30]  # LLAMA_CPP_FACTS.md; this model adds no BOS
N_VOCAB = 49152
N_HEAD_KV, HEAD_DIM, N_LAYER = 3, 64, 30
# One thread: with two, OpenMP's barrier spins, and on a busy 2-core machine a 7-token decode
# went from 0.05 s to 3-12 s. The state format does not depend on the thread count.
N_THREADS = 1
TYPES = {
    "f16": lib.GGML_TYPE_F16,
    "q8_0": lib.GGML_TYPE_Q8_0,
    "q4_0": lib.GGML_TYPE_Q4_0,
    "q4_1": lib.GGML_TYPE_Q4_1,
    "q5_0": lib.GGML_TYPE_Q5_0,
    "q5_1": lib.GGML_TYPE_Q5_1,
    "iq4_nl": lib.GGML_TYPE_IQ4_NL,
}
# bytes per 32-value block (ggml-common.h: block_q8_0 ... block_iq4_nl): fp16 d (and m for the
# _1 types), 4-bit or 8-bit quants, the 5th bits of q5 in a u32
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}


# --- helpers over the raw binding ------------------------------------------------------------------


@contextlib.contextmanager
def context(model, *, flash_attn=True, type_k="f16", type_v="f16", kv_unified=True, n_seq_max=1, n_ctx=256):
    p = lib.llama_context_default_params()
    p.n_ctx, p.n_seq_max, p.kv_unified = n_ctx, n_seq_max, kv_unified
    p.n_threads = p.n_threads_batch = N_THREADS
    p.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.type_k, p.type_v = TYPES[type_k], TYPES[type_v]
    ctx = lib.llama_init_from_model(model, p)
    assert ctx != ffi.NULL
    try:
        yield ctx
    finally:
        lib.llama_free(ctx)


def tokenize(model, text: str) -> list[int]:
    raw = text.encode()
    buf = ffi.new("llama_token[]", len(raw) + 8)
    n = lib.llama_tokenize(lib.llama_model_get_vocab(model), raw, len(raw), buf, len(raw) + 8, True, False)
    assert n > 0
    return list(buf[0:n])


def decode(ctx, tokens, *, pos0=0, seq_ids=(0,), pos=None) -> np.ndarray:
    """Decode ``tokens`` (seq_ids: one tuple for all tokens, or one per token); return a copy of
    the last token's logits."""
    n = len(tokens)
    per_token = seq_ids if isinstance(seq_ids, list) else [seq_ids] * n
    batch = lib.llama_batch_init(n, 0, max(len(s) for s in per_token))
    try:
        batch.n_tokens = n
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos[i] if pos is not None else pos0 + i
            batch.n_seq_id[i] = len(per_token[i])
            for j, s in enumerate(per_token[i]):
                batch.seq_id[i][j] = s
            batch.logits[i] = i == n - 1
        assert lib.llama_decode(ctx, batch) == 0
    finally:
        lib.llama_batch_free(batch)
    return np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, -1), N_VOCAB * 4), dtype=np.float32).copy()


def seq_dump(ctx, seq_id=0) -> bytes:
    size = lib.llama_state_seq_get_size_ext(ctx, seq_id, 0)
    buf = ffi.new("uint8_t[]", size)
    assert lib.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, 0) == size
    return ffi.buffer(buf, size)[:]


def seq_load(ctx, data: bytes, seq_id=0) -> int:
    return lib.llama_state_seq_set_data_ext(ctx, ffi.from_buffer(data), len(data), seq_id, 0)


def context_dump(ctx) -> bytes:
    size = lib.llama_state_get_size(ctx)
    buf = ffi.new("uint8_t[]", size)
    assert lib.llama_state_get_data(ctx, buf, size) == size
    return ffi.buffer(buf, size)[:]


def clear(ctx) -> None:
    lib.llama_memory_clear(lib.llama_get_memory(ctx), True)


def check_layout(st) -> None:
    """Segments tile the dump byte for byte; totals add up to the input length."""
    lay = st.layout()
    pos = 0
    for seg in lay.segments:
        assert seg.offset == pos, seg
        pos += seg.nbytes
    assert pos == st.nbytes
    assert lay.metadata_bytes + lay.payload_bytes == lay.total_bytes == st.nbytes
    assert lay.payload_bytes == sum(r.nbytes for r in lay.rows)
    for row in lay.rows:  # a PLE row has no type field (llama_memory_recurrent::state_write_data)
        if st.part(row.part).kind in ("compressed", "compressor"):
            # a llama_kv_cache_dsv4 block: one 28-byte header per layer tensor, then each stream's rows
            assert row.data_offset - row.header_offset == 28 + row.stream * row.nbytes
            continue
        assert row.data_offset - row.header_offset == (8 if row.kind == "P" else 12)


# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(model_path):
    m = lib.llama_model_load_from_file(str(model_path).encode(), lib.llama_model_default_params())
    assert m != ffi.NULL
    yield m
    lib.llama_model_free(m)


CONFIGS = {
    "f16-fa": dict(flash_attn=True),  # V not transposed
    "f16-nofa": dict(flash_attn=False),  # V transposed
    "q8_0": dict(flash_attn=True, type_k="q8_0", type_v="q8_0"),  # quantized V needs FA
    "q4_0": dict(flash_attn=True, type_k="q4_0", type_v="q4_0"),
    **{t: dict(flash_attn=True, type_k=t, type_v=t) for t in ("q4_1", "q5_0", "q5_1", "iq4_nl")},
}


@pytest.fixture(scope="module")
def runs(model):
    """Per cache config: two dumps of the prompt (the second after clearing and decoding again),
    and the whole-context state. Computed on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            with context(model, **CONFIGS[name]) as ctx:
                decode(ctx, PROMPT_TOKENS)
                first, whole = seq_dump(ctx), context_dump(ctx)
                clear(ctx)
                decode(ctx, PROMPT_TOKENS)
                cache[name] = {"seq": first, "seq2": seq_dump(ctx), "context": whole}
        return cache[name]

    return get


# --- tests ---------------------------------------------------------------------------------------------


def test_import_needs_no_compiled_extension():
    code = (
        "import sys; sys.modules['pyllamacpp._pyllamacpp'] = None\n"  # any import of it fails
        "import pyllamacpp.state as s\n"
        "assert 'pyllamacpp._lib' not in sys.modules\n"
        "try:\n    s.parse(b'\\x00' * 8)\nexcept s.StateFormatError as e:\n    print('OK', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
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


# -- synthetic models: every memory layout, from the real library ------------------------------
def _synthetic(tmp_path, arch, n_tokens=10, **kw):
    """Dumps of tokens 1..n_tokens in sequence 0 of a synthetic model: two full ones, an
    ON_DEVICE one (single sequence: one contiguous range, which recurrent memory needs), the
    whole-context state, and the next logits."""
    import pyllamacpp as pl
    from pyllamacpp.testing import make_model

    path = make_model(tmp_path / f"{arch}.gguf", arch, n_vocab=128, seed=1, **kw)
    with pl.Model(path) as model, model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:
        b = pl.Batch(32, model=model)
        b.add_sequence(np.arange(1, n_tokens + 1), 0, 0, logits="last")
        ctx.decode(b)
        return {
            "one": ctx.seq_state(0).data,
            "two": ctx.seq_state(0).data,
            "dev": ctx.seq_state(0, pl.StateFlags.ON_DEVICE).data,
            "whole": ctx.state(),
            "logits": ctx.logits().copy(),
            "path": path,
            "n_head_kv": model.n_head_kv,
        }


def _synthetic_dump(tmp_path, arch, **kw):
    d = _synthetic(tmp_path, arch, **kw)
    return d["one"], d["two"], d["whole"], d["n_head_kv"]


def test_iswa_dump_parses_base_then_swa(tmp_path):
    one, two, whole, n_kv = _synthetic_dump(
        tmp_path, "gemma2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4
    )
    st = state.parse(one, n_head_kv=n_kv)
    assert [p.name for p in st.parts] == ["base", "swa"]
    base, swa = st.part("base").streams[0], st.part("swa").streams[0]
    assert base.cell_count == 10 and 0 < swa.cell_count < 10  # the window keeps only recent cells
    assert st.to_bytes() == one.tobytes()
    lay = st.layout()
    assert lay.metadata_bytes + lay.payload_bytes == one.size
    np.testing.assert_array_equal(
        st.part("base").streams[0].records[0].rows[0],
        state.parse(two, n_head_kv=n_kv).part("base").streams[0].records[0].rows[0],
    )
    w = state.parse(whole, n_head_kv=n_kv)
    assert w.kind == state.DumpKind.CONTEXT and [p.name for p in w.parts] == ["base", "swa"]


def test_recurrent_dump_parses(tmp_path):
    one, two, whole, _ = _synthetic_dump(tmp_path, "mamba", n_layer=2, n_embd=32)
    st = state.parse(one)
    assert [p.kind for p in st.parts] == ["recurrent"]
    kinds = {r.kind for r in st.parts[0].streams[0].records}
    assert kinds == {"R", "S"}
    assert st.to_bytes() == one.tobytes()
    lay = st.layout()
    assert lay.metadata_bytes + lay.payload_bytes == one.size
    assert state.parse(whole).kind == state.DumpKind.CONTEXT


# -- metadata-only dumps (StateFlags.ON_DEVICE) ---------------------------------------------------
@pytest.fixture(scope="module")
def pl_model(model_path):
    import pyllamacpp as pl

    with pl.Model(model_path) as m:
        yield m


def _same_headers(meta, full) -> None:
    """A metadata-only dump is the full dump without its rows: same cells, same record headers."""
    assert meta.metadata_only and not full.metadata_only
    assert [p.name for p in meta.parts] == [p.name for p in full.parts]
    for mp, fp in zip(meta.parts, full.parts):
        for ms, fs in zip(mp.streams, fp.streams):
            assert ms.cell_count == fs.cell_count and (ms.v_trans, ms.n_layer) == (fs.v_trans, fs.n_layer)
            assert ms.cells[["pos", "n_seq_id"]].tolist() == fs.cells[["pos", "n_seq_id"]].tolist()
            assert [(r.kind, r.type.id, r.row_size, r.n_embd, r.transposed, r.header_size) for r in ms.records] == [
                (r.kind, r.type.id, r.row_size, r.n_embd, r.transposed, r.header_size) for r in fs.records
            ]
            for mr, fr in zip(ms.records, fs.records):
                assert (
                    meta.buffer[mr.header_offset : mr.data_offset].tobytes()
                    == full.buffer[fr.header_offset : fr.data_offset].tobytes()
                )
    lay = meta.layout()
    assert lay.payload_bytes == 0 and lay.metadata_only and meta.nbytes == full.nbytes - full.layout().payload_bytes
    check_layout(meta)
    assert "metadata only (ON_DEVICE)" in meta.describe() and "metadata only (ON_DEVICE)" in lay.table()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_on_device_dump_is_metadata_only(pl_model, flash_attn):
    import pyllamacpp as pl

    with pl_model.context(n_ctx=256, n_threads=N_THREADS, n_threads_batch=N_THREADS, flash_attn=flash_attn) as ctx:
        ctx.prefill(PROMPT_TOKENS)
        full, dev = ctx.seq_state(0), ctx.seq_state(0, pl.StateFlags.ON_DEVICE)
        # 7 cells x 12 bytes, 60 record headers of 12 bytes: what LLAMA_CPP_FACTS's 828-byte metadata is
        assert len(dev) == 828 == 108 + 60 * 12
        meta = state.parse(dev.data, n_head_kv=N_HEAD_KV)
        _same_headers(meta, state.parse(full.data, n_head_kv=N_HEAD_KV))
        assert meta.to_bytes() == dev.data.tobytes() and meta.stream().v_trans == (flash_attn == "off")
        for get in (
            lambda: meta.k[0],
            lambda: meta.v[29],
            lambda: meta.record("K", 3).rows,
            lambda: meta.address("K", 0, cell=1),
            lambda: meta.record("V", 0).dequantize(),
        ):
            with pytest.raises(state.MetadataOnlyError, match="metadata-only dump .*ON_DEVICE.* 2,688 bytes"):
                get()
        # where the value lives in llama.cpp's tensor needs no rows
        assert meta.tensor_offset("K", 0, cell=3, head=1, element=5, kv_size=256) == 3 * 384 + 69 * 2
        with pytest.raises(ValueError, match="no rows to select"):
            meta.select_cells([0, 1])
        # pinned readings: each refuses the other kind of dump
        with pytest.raises(StateFormatError):
            state.parse(dev.data, metadata_only=False)
        with pytest.raises(StateFormatError):
            state.parse(full.data, metadata_only=True)
        assert state.parse(dev.data, metadata_only=True).metadata_only
        # llama.cpp reads the same bytes back with ON_DEVICE (the rows from its own copy)
        ctx.memory.clear()
        assert ctx.set_seq_state(0, dev, flags=pl.StateFlags.ON_DEVICE) == 828
        assert ctx.memory.seq_pos_max(0) == 6


def test_on_device_dump_with_several_streams(pl_model):
    import pyllamacpp as pl

    with pl_model.context(
        n_ctx=256, n_seq_max=4, kv_unified=False, n_threads=N_THREADS, n_threads_batch=N_THREADS
    ) as ctx:
        b = pl.Batch(64, n_seq_max=4, model=pl_model)
        b.add_sequence(PROMPT_TOKENS, 0)
        b.add_sequence(PROMPT_TOKENS[:3], 2)
        ctx.decode(b)
        dumps = {s: (ctx.seq_state(s), ctx.seq_state(s, pl.StateFlags.ON_DEVICE)) for s in (0, 2)}
        empty = ctx.seq_state(1, pl.StateFlags.ON_DEVICE)
    for s, (full, dev) in dumps.items():
        meta = state.parse(dev.data, n_head_kv=N_HEAD_KV)
        assert meta.part().n_stream == 4 and meta.stream().index == s
        _same_headers(meta, state.parse(full.data, n_head_kv=N_HEAD_KV))
    assert len(dumps[0][1]) == 828 + 3 * 4 and len(dumps[2][1]) == 108 + 3 * 4 - 4 * 12 + 60 * 12
    e = state.parse(empty.data)  # no cells, no records: it reads the same either way
    assert len(empty) == 8 + 4 + 4 * 4 and not e.metadata_only


def test_metadata_only_cli(pl_model, tmp_path, capsys):
    import pyllamacpp as pl
    from pyllamacpp.cli import main

    f = tmp_path / "dev.bin"
    with pl_model.context(n_ctx=256, n_threads=N_THREADS, n_threads_batch=N_THREADS) as ctx:
        ctx.prefill(PROMPT_TOKENS)
        ctx.save_seq_dump(f, 0, flags=pl.StateFlags.ON_DEVICE, sidecar=False)
    assert main(["parse-state", str(f), "--heads", "3", "--cells", "2"]) == 0
    out = capsys.readouterr().out
    assert "metadata only (ON_DEVICE)" in out and "payload 0 B = 828 B" in out and "K: " not in out
    assert main(["parse-state", str(f), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["metadata_only"] and data["payload_bytes"] == 0 and "metadata only (ON_DEVICE)" in data["kind_text"]


def test_synthetic_on_device_dumps(tmp_path):
    for arch, kw in (
        ("gemma2", dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4)),
        ("mamba", dict(n_layer=2, n_embd=32)),
        ("lfm2", dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2)),
    ):
        d = _synthetic(tmp_path, arch, **kw)
        meta, full = state.parse(d["dev"], model=d["path"]), state.parse(d["one"], model=d["path"])
        _same_headers(meta, full)
        assert meta.to_bytes() == d["dev"].tobytes() and meta.options["memory"] == full.options["memory"]
        assert meta.layers == full.layers is not None


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


# -- recurrent PLE rows (crafted from a real mamba dump) -------------------------------------------
def _with_ple(st, ple_layers, p_values=24, p_size=None, metadata_only=False, part=None) -> bytes:
    """The dump with a PLE record (u64 row size, rows; llama_memory_recurrent::state_write_data)
    after the R record of each layer (record index) in ``ple_layers`` of the recurrent ``part``:
    what a layer with p_l[il] writes."""
    out, pos = bytearray(), 0
    raw = st.to_bytes()
    n = st.stream(part).cell_count
    for r in st.stream(part).records:
        end = r.data_offset + r.nbytes
        out += raw[pos:end]
        pos = end
        if r.kind == "R" and r.layer in ple_layers:
            size = p_size(r.layer) if p_size else p_values * 4
            out += size.to_bytes(8, "little")
            if not metadata_only:
                out += np.arange(n * size // 4, dtype=np.float32).tobytes() + bytes(n * size % 4)
    return bytes(out + raw[pos:])


def test_recurrent_ple_rows(tmp_path):
    d = _synthetic(tmp_path, "mamba", n_layer=3, n_embd=32)
    st = state.parse(d["one"])
    for ple_layers in ([0, 1, 2], [1], [0, 2]):
        blob = _with_ple(st, ple_layers)
        ple = state.parse(blob, layers={"recurrent": [0, 1, 2]})
        s = ple.stream()
        assert [(r.kind, r.layer) for r in s.records] == [
            x for il in range(3) for x in [("R", il)] + ([("P", il)] if il in ple_layers else [])
        ] + [("S", il) for il in range(3)]
        assert s.p.layers == tuple(ple_layers) and [r.il for r in s.records if r.kind == "P"] == ple_layers
        p = s.p.record(ple_layers[0])
        assert (p.type.name, p.row_size, p.n_embd, p.header_size) == ("f32", 96, 24, 8)
        np.testing.assert_array_equal(s.p[ple_layers[0]], np.arange(24, dtype=np.float32)[None])
        for kind in "RS":
            for il in range(3):
                np.testing.assert_array_equal(getattr(s, kind.lower())[il], getattr(st.stream(), kind.lower())[il])
        assert ple.to_bytes() == blob
        check_layout(ple)
        assert ple.select_cells([0]).to_bytes() == blob
        assert ple.select_cells(np.zeros(1, bool)).stream().p.layers == tuple(ple_layers)
    # metadata-only: the u64 headers alone
    meta = state.parse(_with_ple(state.parse(d["dev"]), [0, 2], metadata_only=True))
    assert meta.metadata_only and [r.kind for r in meta.stream().records] == list("RPRRPSSS")
    # what state_read_data refuses is refused: PLE rows of different sizes, a truncated one
    with pytest.raises(StateFormatError):
        state.parse(_with_ple(st, [0, 1], p_size=lambda il: 96 + 4 * il))
    blob = _with_ple(st, [0])
    for cut in (1, 50, 96):
        with pytest.raises(StateFormatError):
            state.parse(blob[:-cut])
    with pytest.raises(StateFormatError):
        state.parse(_with_ple(st, [0], p_size=lambda il: 95))  # not whole f32 values


# -- a hybrid model (lfm2: attention layers in a KV cache, conv layers in recurrent memory) -------
def test_hybrid_dump(tmp_path):
    import pyllamacpp as pl

    kw = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2)
    d = _synthetic(tmp_path, "lfm2", **kw)
    one = d["one"].tobytes()
    st = state.parse(one, model=d["path"])
    assert st.options["memory"] == "hybrid" and [p.name for p in st.parts] == ["kv", "recurrent"]
    assert st.layers == {"kv": [1, 3], "recurrent": [0, 2]}  # head_count_kv [0, 2, 0, 2]
    kv, rec = st.stream("kv"), st.stream("recurrent")
    assert kv.cell_count == 10 and rec.cell_count == 1 and rec.n_layer == 4 and kv.n_layer == 2
    assert [r.il for r in kv.k_records] == [1, 3] and st.k.layers == (1, 3)
    assert st.k[3].shape == (10, 2, 16) and np.shares_memory(st.k[3], st.buffer)
    with pytest.raises(IndexError, match=r"model layers \(il\) \[1, 3\]"):
        st.k[0]  # layer 0 is a convolution layer
    assert st.to_bytes() == one
    check_layout(st)
    # sizes, to the byte: header, KV part, recurrent part (R: (l_cache - 1) x n_embd f32; S: 0 values)
    kv_row = 2 * 16 * 2
    assert st.nbytes == 8 + (4 + 4 + 10 * 12 + 8 + 4 * (12 + 10 * kv_row)) + (
        4 + 8 + 8 + 2 * (12 + 2 * 64 * 4) + 2 * 12
    )
    assert [r.row_size for r in rec.records] == [512, 512, 0, 0]
    two = state.parse(d["two"], model=d["path"])
    assert two.record("K", 1).rows[0].tobytes() == st.record("K", 1).rows[0].tobytes()
    np.testing.assert_array_equal(two.stream("recurrent").r[0], rec.r[0])
    whole = state.parse(d["whole"], model=d["path"])
    assert whole.kind is DumpKind.CONTEXT and whole.options["memory"] == "hybrid"
    # edits load back and change the next logits: one KV head, then the conv state
    with pl.Model(d["path"]) as model, model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:

        def step(blob):
            ctx.memory.clear()
            # checked first (per-layer head counts from the GGUF: llama.cpp's metadata API leaves
            # arrays out), then loaded
            assert ctx.set_seq_state(0, np.frombuffer(blob, np.uint8)) == len(blob)
            b = pl.Batch(4, model=model)
            b.add_sequence([5], 0, 10)
            ctx.decode(b)
            return ctx.logits().copy()

        base = step(one)
        np.testing.assert_allclose(base, step(one), rtol=0, atol=0)
        for edit in (
            lambda s: s.k[1].__setitem__((slice(None), 0), 0),
            lambda s: s.stream("recurrent").r[2].__setitem__(slice(None), 0),
        ):
            w = state.parse(one, model=d["path"], writable=True)
            edit(w)
            # tiny random weights (std 0.02) move logits by ~1e-4; the unedited reload moves them by 0
            assert np.abs(step(w.to_bytes()) - base).max() > 1e-5
    # fuzz: only StateFormatError
    rng = np.random.default_rng(7)
    arr = np.frombuffer(one, np.uint8)
    meta = np.concatenate([np.arange(s.offset, s.offset + s.nbytes) for s in st.layout().segments if not s.payload])
    errors = 0
    for i in range(600):
        if i % 3 == 0:
            blob = one[: int(rng.integers(0, len(one)))]
        else:
            m = arr.copy()
            m[rng.choice(meta, 2)] ^= (1 << rng.integers(0, 8, 2)).astype(np.uint8)
            blob = m.tobytes()
        try:
            got = state.parse(blob)
        except StateFormatError:
            errors += 1
            continue
        assert got.to_bytes() == blob and got.layout().total_bytes == len(blob)
    assert errors > 300


def test_hybrid_iswa_dump(tmp_path):
    # lfm2 with a sliding window: every attention layer slides (models/lfm2.cpp), so llama.cpp
    # builds llama_memory_hybrid_iswa: an iSWA cache (base: no layers, swa: 1 and 3), then the
    # recurrent state of the conv layers (0 and 2)
    import pyllamacpp as pl

    kw = dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_swa=4)
    d = _synthetic(tmp_path, "lfm2", **kw)
    one = d["one"].tobytes()
    st = state.parse(one, model=d["path"])
    assert st.options["memory"] == "hybrid-iswa" and [p.name for p in st.parts] == ["base", "swa", "recurrent"]
    assert st.layers == {"base": [], "swa": [1, 3], "recurrent": [0, 2]}
    base, swa, rec = st.stream("base"), st.stream("swa"), st.stream("recurrent")
    assert base.n_layer == 0 and not base.records and swa.n_layer == 2 and rec.n_layer == 4
    assert 0 < swa.cell_count < 10 and rec.cell_count == 1  # the window keeps only recent cells
    assert swa.cells["pos"].max() == 9 and [r.il for r in swa.k_records] == [1, 3]
    assert st.k[3].shape == (swa.cell_count, 2, 16) and np.shares_memory(st.k[3], st.buffer)
    assert st.to_bytes() == one and st.layout().total_bytes == len(one)
    check_layout(st)
    # the same bytes read as plain hybrid fail somewhere: without a hint the parts are found
    assert state.parse(one).options["memory"] == "hybrid-iswa"
    two = state.parse(d["two"], model=d["path"])
    assert two.record("K", 1, part="swa").rows[0].tobytes() == st.record("K", 1, part="swa").rows[0].tobytes()
    whole = state.parse(d["whole"], model=d["path"])
    assert whole.kind is DumpKind.CONTEXT and whole.options["memory"] == "hybrid-iswa"
    meta = state.parse(d["dev"], model=d["path"])
    assert meta.metadata_only and meta.options["memory"] == "hybrid-iswa"
    _same_headers(meta, st)
    with pl.Model(d["path"]) as model, model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:

        def step(blob, flags=0):
            if not flags:
                ctx.memory.clear()
            assert ctx.set_seq_state(0, np.frombuffer(blob, np.uint8), flags) > 0
            b = pl.Batch(4, model=model)
            b.add_sequence([5], 0, 10)
            ctx.decode(b)
            logits = ctx.logits().copy()
            ctx.memory.seq_rm(0, 10, -1)
            return logits

        base_logits = step(one)
        np.testing.assert_array_equal(step(one), base_logits)
        for edit in (
            lambda s: s.k[3].__setitem__((slice(None), 1), 0),
            lambda s: s.stream("recurrent").r[0].__setitem__(slice(None), 0),
        ):
            w = state.parse(one, model=d["path"], writable=True)
            edit(w)
            assert np.abs(step(w.to_bytes()) - base_logits).max() > 1e-5
        # PARTIAL_ONLY: the swa part and the recurrent state (llama_memory_hybrid_iswa::state_write)
        P = int(pl.StateFlags.PARTIAL_ONLY)
        ctx.memory.clear()
        ctx.set_seq_state(0, one)
        part = ctx.seq_state(0, P)
        p = state.parse(part.data, flags=P, model=d["path"])
        assert p.partial and [x.name for x in p.parts] == ["swa", "recurrent"]
        np.testing.assert_array_equal(p.k[3], st.k[3])
        np.testing.assert_array_equal(p.stream("recurrent").r[2], rec.r[2])
        assert p.to_bytes() == part.data.tobytes() and len(part) < len(one)
        # loaded over the full sequence with the flag: the same next logits
        ctx.memory.clear()
        ctx.set_seq_state(0, one)
        np.testing.assert_array_equal(step(part.data.tobytes(), P), base_logits)
        # and refused without it, with a reason (checked before llama.cpp sees it)
        with pytest.raises(pl.StateError, match="PARTIAL_ONLY"):
            ctx.set_seq_state(0, part.data.tobytes())


# -- layer numbers ------------------------------------------------------------------------------------
def test_iswa_layers_are_the_models(tmp_path):
    d = _synthetic(tmp_path, "gemma2", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4)
    plain = state.parse(d["one"], n_head_kv=2)
    assert plain.layers is None and "record indices" in plain.layout().table()
    with pytest.raises(ValueError, match="no layer map"):
        plain.k
    assert plain.stream("base").k.layers == (0, 1)  # record indices
    st = state.parse(d["one"], model=d["path"])
    assert st.layers == {"base": [1, 3], "swa": [0, 2]}  # pattern 2: il % 2 < 1 is SWA
    assert st.k.layers == (0, 1, 2, 3) and "record indices" not in st.layout().table()
    for il in range(4):
        part = "swa" if il % 2 == 0 else "base"
        rec = st.record("K", il)
        assert rec.part == part and rec.il == il
        np.testing.assert_array_equal(st.k[il], st.stream(part).k[il])
        assert st.address("V", il, cell=0) == st.record("V", il).data_offset
    assert [r.il for r in st.layout().rows] == [1, 3, 1, 3, 0, 2, 0, 2]
    # the sidecar carries the map for a dump parsed without model=
    f = tmp_path / "d.bin"
    f.write_bytes(d["one"].tobytes())
    facts = state.model_facts(d["path"])
    assert facts["layers"] == st.layers
    state.write_sidecar(f, **facts)
    assert state.parse(f).layers == st.layers and state.parse(f).k[2].shape[1:] == (2, 32)
    # a map that does not fit the dump is an error, not a silent renumbering
    with pytest.raises(StateFormatError, match="layer map"):
        state.parse(d["one"], layers={"base": [1, 2, 3], "swa": [0]})
    # the CLI shows il, and --layer takes it
    from pyllamacpp.cli import main

    assert main(["parse-state", str(f), "--layer", "3", "--cells", "1", "--json"]) == 0


def test_layer_map_rules():
    def m(arch, n, **kv):
        return state.layer_map(
            {"general.architecture": arch, f"{arch}.block_count": n, **{f"{arch}.{k}": v for k, v in kv.items()}}
        )

    assert m("llama", 3) == {"kv": [0, 1, 2]}
    assert m("gemma2", 4) == {"base": [1, 3], "swa": [0, 2]}
    assert m("gemma3", 7, **{"attention.sliding_window": 512}) == {"base": [5], "swa": [0, 1, 2, 3, 4, 6]}
    assert m("gemma3", 3) == {"kv": [0, 1, 2]}  # no sliding window: no SWA cache
    assert m(
        "gemma3", 3, **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False, True]}
    ) == {"base": [1], "swa": [0, 2]}
    assert m("mamba", 2) == {"recurrent": [0, 1]}
    assert m("lfm2", 4, **{"attention.head_count_kv": [0, 2, 0, 2]}) == {"kv": [1, 3], "recurrent": [0, 2]}
    assert m("lfm2", 4, **{"attention.head_count_kv": [0, 2, 0, 2], "attention.sliding_window": 8}) == {
        "base": [],
        "swa": [1, 3],
        "recurrent": [0, 2],
    }
    assert m("falcon-h1", 2) == {"kv": [0, 1], "recurrent": [0, 1]}
    assert m("deepseek4", 2) is None and m("llama", 2, nextn_predict_layers=1) is None


def test_default_model_layers_from_model(pl_model, runs):
    st = state.parse(runs("f16-fa")["seq"], model=pl_model)  # a Model: its GGUF gives the map
    assert st.layers == {"kv": list(range(N_LAYER))} and st.n_head_kv == N_HEAD_KV
    assert st.record("K", 7).il == 7 == st.record("K", 7).layer


# -- StateFlags.PARTIAL_ONLY: only the memory's partial part -----------------------------------------
# model, keywords, its memory, its layer map, and the part a PARTIAL_ONLY dump holds
PARTIAL_CASES = {
    "gemma2": (
        dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4),
        "iswa",
        {"base": [1, 3], "swa": [0, 2]},
        "swa",
    ),
    # uneven parts (il % 3 < 2 is SWA): a layer count taken from the wrong part shows
    "gemma3": (
        dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4, swa_pattern=3),
        "iswa",
        {"base": [2], "swa": [0, 1, 3]},
        "swa",
    ),
    "lfm2": (
        dict(n_layer=4, n_embd=64, n_head=4, n_head_kv=2),
        "hybrid",
        {"kv": [1, 3], "recurrent": [0, 2]},
        "recurrent",
    ),
}


@contextlib.contextmanager
def _partial_context(tmp_path, arch):
    """A synthetic model's context holding tokens 1..10 in sequence 0, with its full and its
    PARTIAL_ONLY dump (SeqState), and helpers to decode more."""
    import pyllamacpp as pl
    from pyllamacpp.testing import make_model

    kw = PARTIAL_CASES[arch][0]
    path = make_model(tmp_path / f"{arch}.gguf", arch, n_vocab=128, seed=1, **kw)
    with pl.Model(path) as model, model.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:

        def decode_more(tokens, pos0):
            b = pl.Batch(32, model=model)
            b.add_sequence(np.asarray(tokens), 0, pos0, logits="last")
            ctx.decode(b)
            return ctx.logits().copy()

        decode_more(np.arange(1, 11), 0)
        yield path, ctx, ctx.seq_state(0), ctx.seq_state(0, pl.StateFlags.PARTIAL_ONLY), decode_more


def test_partial_flags_match_llama_h():
    import pyllamacpp as pl

    assert state.PARTIAL_ONLY == lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY == lib.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
    assert state.ON_DEVICE == lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE == pl.StateFlags.ON_DEVICE
    # what each memory's state_write writes with the flag (llama-kv-cache-iswa.cpp,
    # llama-memory-hybrid.cpp, llama-memory-hybrid-iswa.cpp; plain and recurrent ignore it)
    assert state.written_parts("iswa", True) == (("kv", "swa"),)
    assert state.written_parts("hybrid", True) == (("recurrent", "recurrent"),)
    assert state.written_parts("hybrid-iswa", True) == (("kv", "swa"), ("recurrent", "recurrent"))
    assert state.written_parts("kv", True) == state.written_parts("kv", False) == (("kv", "kv"),)
    assert state.written_parts("recurrent", True) == state.written_parts("recurrent", False)
    assert state.memory_of({"base": [1], "swa": [0]}) == "iswa" and state.memory_of(None) is None


@pytest.mark.parametrize("arch", list(PARTIAL_CASES))
def test_partial_dump_is_the_partial_part(tmp_path, arch, capsys):
    import pyllamacpp as pl
    from pyllamacpp.cli import main

    _, memory, layers, name = PARTIAL_CASES[arch]
    with _partial_context(tmp_path, arch) as (path, ctx, full, part, _):
        ctx.save_seq_dump(tmp_path / "p.bin", 0, flags=pl.StateFlags.PARTIAL_ONLY, tokens=np.arange(1, 11))
        ctx.save_seq_dump(tmp_path / "f.bin", 0)
    f = state.parse(full.data, model=path)
    assert f.options["memory"] == memory and f.partial is False and f.layers == layers
    st = state.parse(part.data, model=path)  # the layer map says which memory; the reading says partial
    assert st.options["memory"] == memory and st.partial is True
    assert [p.name for p in st.parts] == [name] and st.layers == {name: layers[name]}
    # sizes: the io header, then the full dump's part byte for byte
    fp = f.part(name)
    assert st.nbytes == 8 + fp.end - fp.offset and part.data[8:].tobytes() == full.data[fp.offset : fp.end].tobytes()
    check_layout(st)
    assert st.to_bytes() == part.data.tobytes()
    # records carry the model's layers, and hold what the full dump holds for them
    kinds = ("K", "V") if name == "swa" else ("R", "S")
    for kind in kinds:
        assert [r.il for r in st.stream().records if r.kind == kind] == layers[name]
        for il in layers[name]:
            assert st.record(kind, il).rows.tobytes() == f.record(kind, il).rows.tobytes()
        other = next(il for il in range(len(sum(layers.values(), []))) if il not in layers[name])
        with pytest.raises(IndexError, match=r"model layers \(il\)"):
            st.record(kind, other)
    if name == "swa":
        assert st.k[layers["swa"][-1]].shape == (st.stream().cell_count, 2, 32)
    text = st.describe()
    assert "partial (PARTIAL_ONLY): only the" in text and "partial (PARTIAL_ONLY)" in repr(st)
    # flags= or partial= say it without a layer map: an iSWA cache's swa part then reads as a
    # plain cache would write it
    bare = state.parse(part.data, flags=pl.StateFlags.PARTIAL_ONLY)
    assert bare.partial is True and [p.name for p in bare.parts] == ["kv" if name == "swa" else "recurrent"]
    assert "pass model= to tell" in bare.describe() and bare.layers is None
    assert state.parse(part.data, partial=True, model=path).layers == st.layers
    assert state.parse(part.data).partial is None  # nothing says: read as some full layout
    with pytest.raises(StateFormatError):
        state.parse(part.data, model=path, partial=False)
    with pytest.raises(StateFormatError):
        state.parse(full.data, model=path, partial=True)
    with pytest.raises(ValueError, match="contradicts"):
        state.parse(part.data, partial=False, flags=pl.StateFlags.PARTIAL_ONLY)
    # the sidecar carries the flags (and the map): parse needs nothing else
    assert state.read_sidecar(tmp_path / "p.bin")["flags"] == 1 and state.read_sidecar(tmp_path / "f.bin")["flags"] == 0
    side = state.parse(tmp_path / "p.bin")
    assert side.partial is True and side.layers == st.layers and side.to_bytes() == part.data.tobytes()
    assert state.parse(tmp_path / "f.bin").partial is False
    # a smaller dump of it is still partial
    keep = np.zeros(st.stream().cell_count, bool)
    keep[-1] = True
    small = st.select_cells(keep)
    assert small.partial is True and small.layers == st.layers and small.stream().cell_count == 1
    # the CLI says so
    assert main(["parse-state", str(tmp_path / "p.bin"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["partial"] is True and data["memory"] == memory and "partial (PARTIAL_ONLY)" in data["kind_text"]
    raw = tmp_path / "raw.bin"
    raw.write_bytes(part.data.tobytes())
    assert main(["parse-state", str(raw), "--partial", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "partial (PARTIAL_ONLY)" in out and f"{name} stream 0" in out


@pytest.mark.parametrize("arch", list(PARTIAL_CASES))
def test_partial_dump_loads_back_with_the_flag(tmp_path, arch):
    import pyllamacpp as pl

    P = pl.StateFlags.PARTIAL_ONLY
    _, memory, layers, name = PARTIAL_CASES[arch]
    other = next(n for n in layers if n != name)  # the part a PARTIAL_ONLY load leaves alone
    with _partial_context(tmp_path, arch) as (path, ctx, full, part, decode_more):
        ref = decode_more(np.arange(11, 16), 10)
        advanced = ctx.seq_state(0)

        def parts(blob):
            s = state.parse(np.asarray(blob), model=path)
            return {p.name: s.buffer[p.offset : p.end].tobytes() for p in s.parts}, s

        # the wrong flag is refused by the check, before llama.cpp; the sequence stays
        for blob, flags, why in (
            (full, P, "full dump .* loaded with PARTIAL_ONLY"),
            (part, 0, "PARTIAL_ONLY dump .* load it with flags=StateFlags.PARTIAL_ONLY"),
        ):
            for b in (blob, bytes(blob)):  # the SeqState this context made, and bytes
                with pytest.raises(pl.StateError, match=why) as e:
                    ctx.set_seq_state(0, b, flags)
                assert e.value.func == "pyllamacpp.state.parse"
                assert bytes(ctx.seq_state(0)) == bytes(advanced)
        # with it, llama.cpp reads the partial part only: the rest of the sequence stays
        assert ctx.set_seq_state(0, bytes(part), P) == len(part)
        now, _ = parts(ctx.seq_state(0).data)
        assert now[other] == parts(advanced.data)[0][other]  # 15 tokens, untouched
        assert now[name] == part.data[8:].tobytes()  # back at 10 tokens
        assert bytes(ctx.seq_state(0, P)) == bytes(part)
        # iSWA: llama_kv_cache_iswa::seq_pos_max is the swa cache's; hybrid: the min of its parts'
        assert ctx.memory.seq_pos_max(0) == 9
        # with the positions the partial part lacks removed, the sequence is the one dumped, to
        # the byte, and decodes as it did (bit-identical: the same cells)
        assert ctx.memory.seq_rm(0, 10, -1)
        assert bytes(ctx.seq_state(0)) == bytes(full)
        np.testing.assert_array_equal(decode_more(np.arange(11, 16), 10), ref)
        # into an empty sequence: the partial part alone
        ctx.memory.clear()
        assert ctx.set_seq_state(0, part, P) == len(part)  # this context's SeqState, same flags: trusted
        now, s = parts(ctx.seq_state(0).data)
        assert [x.cell_count for x in s.part(other).streams] == [0] and now[name] == part.data[8:].tobytes()
        pos = state.parse(part.data, model=path).stream().cells["pos"]
        if memory == "iswa":  # the swa window of the 10 tokens
            assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (int(pos.min()), 9) and pos.min() > 0
        else:  # llama_memory_hybrid: max of the parts' minima, min of their maxima (attention: -1)
            assert pos.tolist() == [9] and (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (9, -1)
        if memory == "iswa":
            # why the check matters: llama_context::state_seq_set_data does not ask for every
            # byte to be read, so a full dump loaded with PARTIAL_ONLY unchecked has its base
            # part read into the swa cache: refused only when their layer counts differ
            fb = state.parse(full.data, model=path).part("base")
            if len(layers["base"]) != len(layers["swa"]):
                # the check compares a partial blob with the swa part's layers, not the model's
                forged = full.data[:8].tobytes() + full.data[fb.offset : fb.end].tobytes()
                with pytest.raises(pl.StateError, match=r"1 layers in the swa part, the model's has 3"):
                    ctx.set_seq_state(0, forged, P)
            if len(layers["base"]) == len(layers["swa"]):
                assert ctx.set_seq_state(0, bytes(full), P, validate=False) == fb.end < len(full)
            else:
                with pytest.raises(pl.StateError, match="unchanged") as e:
                    ctx.set_seq_state(0, bytes(full), P, validate=False)
                assert "mismatched layer count" in e.value.reason
            # ON_DEVICE too: the device reader must see the flags of the save (else llama.cpp
            # aborts: "memory buffer mismatch")
            ctx.memory.clear()
            ctx.set_seq_state(0, full)
            dev = ctx.seq_state(0, P | pl.StateFlags.ON_DEVICE)
            meta = state.parse(dev.data, flags=int(P | pl.StateFlags.ON_DEVICE), model=path)
            assert meta.metadata_only and meta.partial and [p.name for p in meta.parts] == ["swa"]
            with pytest.raises(pl.StateError, match="saved with flags=3"):
                ctx.set_seq_state(0, dev, pl.StateFlags.ON_DEVICE)
            assert ctx.set_seq_state(0, dev, P | pl.StateFlags.ON_DEVICE) == len(dev)
            assert bytes(ctx.seq_state(0)) == bytes(full)


def test_partial_only_changes_nothing_for_plain_and_recurrent_memories(pl_model, tmp_path):
    import pyllamacpp as pl
    from pyllamacpp.testing import make_model

    P = pl.StateFlags.PARTIAL_ONLY
    mamba = make_model(tmp_path / "mamba.gguf", "mamba", n_layer=2, n_embd=32, n_vocab=128, seed=1)
    with pl.Model(mamba) as mm:
        for model, toks in ((pl_model, PROMPT_TOKENS), (mm, list(range(1, 11)))):
            with model.context(n_ctx=256, n_threads=N_THREADS, n_threads_batch=N_THREADS) as ctx:
                ctx.prefill(toks)
                full, part = ctx.seq_state(0), ctx.seq_state(0, P)
                # llama_kv_cache::state_write and llama_memory_recurrent::state_write ignore the flag
                assert bytes(full) == bytes(part)
                st = state.parse(part.data, flags=P, model=model.path)
                assert st.partial is True and [p.name for p in st.parts] == [st.options["memory"]]
                assert "writes all of itself" in st.describe()
                assert state.parse(part.data, model=model.path).partial is None  # the bytes cannot tell
                # and loads either way, checked
                for blob, flags in ((bytes(full), P), (part, 0), (full, P)):
                    ctx.memory.clear()
                    assert ctx.set_seq_state(0, blob, flags) == len(full)
                    assert ctx.memory.seq_pos_max(0) == len(toks) - 1


def test_hybrid_iswa_partial_layout(tmp_path):
    # llama_memory_hybrid_iswa passes the flag to its iSWA cache: swa part, then recurrent. That
    # is the shape of an lfm2 hybrid dump (one KV part, then recurrent): read it that way.
    with _partial_context(tmp_path, "lfm2") as (path, ctx, full, part, _):
        pass
    m = {"base": [], "swa": [1, 3], "recurrent": [0, 2]}
    st = state.parse(full.data, layers=m)
    assert st.options["memory"] == "hybrid-iswa" and st.partial is True  # the full layout does not read
    assert [p.name for p in st.parts] == ["swa", "recurrent"] and st.k.layers == (1, 3)
    assert "only the swa and recurrent parts of a hybrid iSWA memory" in st.describe()
    # a layer map of another memory is an error that says so
    with pytest.raises(StateFormatError, match="layer map is for memory 'iswa' .* reads as memory 'hybrid'"):
        state.parse(full.data, layers={"base": [1, 3], "swa": [0, 2]})


# -- composed layouts this llama.cpp writes for archs make_model cannot make: dsa, msa,
# dsa-iswa, hybrid-idx. Crafted from real parts of real dumps, as their state_write concatenates
# them; a K-only part is a real KV part with its V records dropped (llama_kv_cache::
# state_write_data writes no V record for a layer without a V tensor, and nothing else changes).
@pytest.fixture(scope="module")
def composed_parts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("composed")
    lfm2 = _synthetic(tmp, "lfm2", n_layer=4, n_embd=64, n_head=4, n_head_kv=2)["one"].tobytes()
    llama = _synthetic(tmp, "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2)["one"].tobytes()
    gemma = _synthetic(tmp, "gemma2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_swa=4)[
        "one"
    ].tobytes()

    def kv_part(blob, name=None, k_only=False):
        st = state.parse(blob)
        part = st.part(name)
        assert part.n_stream == 1  # one stream: K records, then V records, contiguous
        if not k_only:
            return blob[part.offset : part.end]
        v0 = next(r for r in part.streams[0].records if r.kind == "V")
        return blob[part.offset : v0.header_offset]

    return {
        "hdr": llama[:8],
        "lfm2": lfm2,
        "rec": lfm2[state.parse(lfm2).part("recurrent").offset :],
        "A": kv_part(llama),
        "Ak": kv_part(llama, k_only=True),
        "B": kv_part(gemma, "swa"),
        "Bk": kv_part(gemma, "swa", k_only=True),
        "Ck": kv_part(gemma, "base", k_only=True),
    }


def _check_composed(st, blob, names, *, memory, has_v):
    assert [p.name for p in st.parts] == names and st.options["memory"] == memory
    assert st.options["has_v"] == has_v
    assert st.to_bytes() == blob and st.layout().total_bytes == len(blob)
    check_layout(st)
    for p in st.parts:
        for r in p.streams[0].records:
            assert r.rows is None or not r.nbytes or np.shares_memory(r.rows, st.buffer)


def test_composed_dsa_msa_look_like_iswa(composed_parts):
    c = composed_parts
    dsa = c["hdr"] + c["Ak"] + c["Bk"]  # llama_kv_cache_dsa: kv_mla, kv_lid (MLA: no V)
    msa = c["hdr"] + c["A"] + c["B"]  # llama_kv_cache_msa: kv_base, kv_idx
    # no hint: today's reading, an iSWA cache
    _check_composed(state.parse(dsa), dsa, ["base", "swa"], memory="iswa", has_v=False)
    _check_composed(state.parse(msa), msa, ["base", "swa"], memory="iswa", has_v=True)
    st = state.parse(dsa, memory="dsa")
    _check_composed(st, dsa, ["mla", "lid"], memory="dsa", has_v=False)
    assert st.part("lid").offset == 8 + len(c["Ak"])
    assert {r.kind for r in st.records()} == {"K"}
    assert st.stream("lid").k[0].tobytes() == state.parse(c["hdr"] + c["Bk"]).k[0].tobytes()
    st = state.parse(msa, memory="msa")
    _check_composed(st, msa, ["base", "idx"], memory="msa", has_v=True)
    # the flag changes nothing in what dsa and msa write: partial reads the same
    assert [p.name for p in state.parse(msa, memory="msa", partial=True).parts] == ["base", "idx"]
    assert state.written_parts("dsa", True) == state.written_parts("dsa", False) == (("kv", "mla"), ("kv", "lid"))
    # select_cells keeps the layout and its names
    small = st.select_cells(lambda cells: cells["pos"] >= 8)
    assert small.options["memory"] == "msa" and [p.name for p in small.parts] == ["base", "idx"]
    assert small.stream("idx").cells["pos"].tolist() == [8, 9]
    assert small.stream("idx").k[0].tobytes() == st.stream("idx").k[0][-2:].tobytes()
    # a dsa dump is not an msa dump with V
    with pytest.raises(StateFormatError):
        state.parse(dsa, memory="msa", has_v=True)


def test_composed_dsa_iswa(composed_parts, tmp_path):
    c = composed_parts
    full = c["hdr"] + c["Ak"] + c["Ck"] + c["Bk"]  # llama_kv_cache_dsa_iswa: mla, lid, then swa
    _check_composed(state.parse(full), full, ["mla", "lid", "swa"], memory="dsa-iswa", has_v=False)
    part = c["hdr"] + c["Bk"]  # PARTIAL_ONLY: kv_swa only
    st = state.parse(part, memory="dsa-iswa")
    _check_composed(st, part, ["swa"], memory="dsa-iswa", has_v=False)
    assert st.partial is True and "partial part" not in st.describe()
    assert state.parse(part, flags=state.PARTIAL_ONLY, memory="dsa-iswa").parts[0].name == "swa"
    assert state.parse(full, memory="dsa-iswa").partial is False
    assert state.written_parts("dsa-iswa", True) == (("kv", "swa"),)
    # a sidecar's "memory" names the parts of a dump with no layer map (dsa: two KV caches)
    f = tmp_path / "dsa.bin"
    f.write_bytes(c["hdr"] + c["Ak"] + c["Bk"])
    state.write_sidecar(f, memory="dsa")
    assert [p.name for p in state.parse(f).parts] == ["mla", "lid"] and state.parse(f).layers is None


def test_composed_hybrid_idx(composed_parts):
    c = composed_parts
    blob = c["lfm2"] + c["Ak"]  # llama_memory_hybrid_idx: the hybrid state, then mem_idx (no V)
    for st in (state.parse(blob), state.parse(blob, memory="hybrid-idx")):
        _check_composed(st, blob, ["kv", "recurrent", "idx"], memory="hybrid-idx", has_v=True)
        rec = st.stream("recurrent")
        assert [r.kind for r in rec.records] == ["R", "R", "S", "S"] and rec.n_layer == 4
        assert st.part("idx").offset == len(c["lfm2"]) == st.part("recurrent").end
        assert [r.kind for r in st.part("idx").streams[0].records] == ["K", "K"]
    hybrid = state.parse(c["lfm2"])
    np.testing.assert_array_equal(st.stream("recurrent").r[1], hybrid.stream("recurrent").r[1])
    with pytest.raises(StateFormatError, match="recurrent"):  # the indexer's bytes are no R/S records
        state.parse(blob, memory="hybrid")
    with pytest.raises(StateFormatError):
        state.parse(c["lfm2"], memory="hybrid-idx", partial=False)  # no indexer part
    # the indexer part with V: not what mem_idx writes
    with pytest.raises(StateFormatError):
        state.parse(c["lfm2"] + c["A"], memory="hybrid-idx")
    # PARTIAL_ONLY: the recurrent part only (llama_memory_hybrid::state_write skips mem_attn,
    # llama_memory_hybrid_idx::state_write mem_idx)
    part = c["hdr"] + c["rec"]
    st = state.parse(part, memory="hybrid-idx")
    assert [p.name for p in st.parts] == ["recurrent"] and st.partial is True and st.to_bytes() == part
    assert state.written_parts("hybrid-idx", True) == (("recurrent", "recurrent"),)
    # select_cells on the indexer part
    st = state.parse(blob)
    small = st.select_cells([0, 5], part="idx")
    assert [p.name for p in small.parts] == ["kv", "recurrent", "idx"]
    assert small.stream("idx").k[1].tobytes() == st.stream("idx").k[1][[0, 5]].tobytes()
    assert small.stream("kv").cell_count == 10


def test_composed_hybrid_idx_with_ple(composed_parts, tmp_path):
    # qwen4exp's memory at this pin: llama_memory_hybrid_idx, its recurrent part with PLE conv rows
    # (llama_memory_recurrent::state_write_data: u64 p_size_row and the rows right after the R
    # record of a layer with p_l[il], no type field), then the K-only indexer cache. The recurrent
    # part's end is not written: it is where the idx part then reads every byte.
    c = composed_parts
    lfm2 = state.parse(c["lfm2"])  # kv il 1, 3; recurrent il 0, 2 (R rows 512 bytes, S rows 0)
    rec = lfm2.stream("recurrent")
    idx_only = state.parse(c["hdr"] + c["Ak"])
    # qwen4exp's rule gives this dump's layers: full_attention_interval 2 over 4 layers
    q = _metadata_gguf(tmp_path / "qwen4exp.gguf", "qwen4exp", block_count=4, full_attention_interval=2)
    layers = {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]}
    assert state.model_facts(q)["layers"] == layers
    for ple_layers in ([0], [1], [0, 1]):
        hybrid = _with_ple(lfm2, ple_layers, part="recurrent")
        added = len(ple_layers) * (8 + 96)  # one cell: u64 row size, 24 f32 values
        assert len(hybrid) == len(c["lfm2"]) + added
        blob = hybrid + c["Ak"]
        for st in (state.parse(blob), state.parse(blob, memory="hybrid-idx"), state.parse(blob, model=q)):
            _check_composed(st, blob, ["kv", "recurrent", "idx"], memory="hybrid-idx", has_v=True)
            # the parts tile the dump: kv as in the hybrid dump, the recurrent part longer by its
            # P records, the indexer right after it
            assert st.header.nbytes + sum(p.end - p.offset for p in st.parts) == len(blob)
            assert st.part("kv").end == st.part("recurrent").offset == lfm2.part("recurrent").offset
            assert st.part("recurrent").end == st.part("idx").offset == len(c["lfm2"]) + added
            r = st.stream("recurrent")
            assert [(x.kind, x.layer) for x in r.records] == [
                x for i in range(2) for x in [("R", i)] + ([("P", i)] if i in ple_layers else [])
            ] + [("S", 0), ("S", 1)]
            for prev, x in zip(r.records, r.records[1:]):
                if x.kind == "P":  # right after its layer's R rows, an 8-byte header, f32 rows
                    assert prev.kind == "R" and prev.layer == x.layer and x.il == prev.il
                    assert x.header_offset == prev.data_offset + prev.nbytes and x.data_offset == x.header_offset + 8
                    assert (x.type.name, x.row_size, x.n_embd, x.n_cells) == ("f32", 96, 24, 1)
                    np.testing.assert_array_equal(x.values, np.arange(24, dtype=np.float32)[None])
            # R and S rows are the hybrid dump's, the indexer's K rows the K-only part's
            for kind in "RS":
                got = [x for x in r.records if x.kind == kind]
                want = [x for x in rec.records if x.kind == kind]
                assert [x.rows.tobytes() for x in got] == [x.rows.tobytes() for x in want]
            assert [x.rows.tobytes() for x in st.stream("idx").k_records] == [
                x.rows.tobytes() for x in idx_only.stream().k_records
            ]
        assert st.layers == layers and st.stream("recurrent").p.layers == tuple([0, 2][i] for i in ple_layers)
        assert st.record("K", 3, part="idx").il == 3
        # the indexer's cells can be selected; the recurrent part, PLE rows included, stays as it was
        small = st.select_cells([0, 5], part="idx")
        assert small.stream("recurrent").p.layers == st.stream("recurrent").p.layers
        assert small.to_bytes()[: st.part("idx").offset] == blob[: st.part("idx").offset]
        # truncated: no reading accounts for every byte
        for cut in (1, len(c["Ak"]), len(c["Ak"]) + 50):
            with pytest.raises(StateFormatError):
                state.parse(blob[:-cut], memory="hybrid-idx")
    # PARTIAL_ONLY: the recurrent part alone, PLE rows and all
    part = c["hdr"] + hybrid[lfm2.part("recurrent").offset :]
    st = state.parse(part, model=q)
    assert [p.name for p in st.parts] == ["recurrent"] and st.partial is True and st.to_bytes() == part
    assert [x.kind for x in st.stream().records] == ["R", "P", "R", "P", "S", "S"]
    assert st.layers == {"recurrent": [0, 2]} and st.stream().p.layers == (0, 2)


def test_composed_layouts_fuzz(composed_parts):
    c = composed_parts
    rng = np.random.default_rng(7)
    bases = [
        (c["lfm2"] + c["Ak"], None),
        (c["hdr"] + c["Ak"] + c["Ck"] + c["Bk"], None),
        (c["hdr"] + c["Ak"] + c["Bk"], "dsa"),
        (c["lfm2"] + c["Ak"], "hybrid-idx"),
    ]
    outcomes = {"ok": 0, "error": 0}
    for base, memory in bases:
        meta = np.concatenate(
            [
                np.arange(s.offset, s.offset + s.nbytes)
                for s in state.parse(base, memory=memory).layout().segments
                if not s.payload
            ]
        )
        arr = np.frombuffer(base, np.uint8)
        for i in range(100):
            if i % 3 == 0:
                blob = base[: int(rng.integers(0, len(base)))]
            else:
                mutated = arr.copy()
                where = rng.choice(meta, rng.integers(1, 3))
                mutated[where] ^= (1 << rng.integers(0, 8, len(where))).astype(np.uint8)
                blob = mutated.tobytes()
            try:
                st = state.parse(blob, memory=memory)
            except StateFormatError:
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            assert st.layout().total_bytes == len(blob) and st.to_bytes() == blob
    assert outcomes["error"] > 100 and outcomes["ok"] > 10, outcomes


def test_composed_memory_rules():
    def facts(arch, n=4, **kv):
        return {"general.architecture": arch, f"{arch}.block_count": n, **{f"{arch}.{k}": v for k, v in kv.items()}}

    assert state.layer_map(facts("deepseek32")) == {"mla": [0, 1, 2, 3], "lid": [0, 1, 2, 3]}
    assert state.memory_of(state.layer_map(facts("deepseek32"))) == "dsa"
    assert state.layer_map(facts("minimax-m3", leading_dense_block_count=1)) == {"base": [0, 1, 2, 3], "idx": [1, 2, 3]}
    assert state.memory_of({"base": [0], "idx": [0]}) == "msa"
    from pyllamacpp.state._layers import memory_for

    assert memory_for(facts("glm5-next")) == memory_for(facts("qwen4exp")) == "hybrid-idx"
    assert memory_for(facts("dots3note")) == "dsa-iswa" and memory_for(facts("glm-dsa")) == "dsa"
    assert memory_for(facts("hy_v4", **{"attention.indexer.top_k": 64})) == "dsa"
    assert memory_for(facts("hy_v4")) is None and memory_for(facts("deepseek4")) == "dsv4"
    assert memory_for(facts("glm-dsa", nextn_predict_layers=1)) is None
    # qwen4exp's MTP context builds the same llama_memory_hybrid_idx (create_memory's default branch)
    assert memory_for(facts("qwen4exp", nextn_predict_layers=1)) == "hybrid-idx"
    # a key these rules default when absent, but that the caller did not read: no map (below)
    assert state.layer_map(facts("glm5-next")) is None


# -- layer maps of the archs whose rule reads keys llama.cpp defaults (_layers.KEYED_RULES): every
# key is passed, None where the GGUF lacks it, as model_facts reads a GGUF
def _arch_facts(arch, n, **kv):
    from pyllamacpp.state._layers import KEYED_RULES

    keys = ("nextn_predict_layers",) + KEYED_RULES[arch]
    return {
        "general.architecture": arch,
        f"{arch}.block_count": n,
        **{f"{arch}.{k}": None for k in keys},
        **{f"{arch}.{k}": v for k, v in kv.items()},
    }


def _arch_map(arch, n, **kv):
    return state.layer_map(_arch_facts(arch, n, **kv))


def test_glm_dsa_layer_map():
    # llama_kv_cache_dsa: kv_mla every layer, kv_lid is_indexer_full(il) (create_memory, LLM_ARCH_GLM_DSA)
    m = _arch_map("glm-dsa", 4, context_length=202752)  # GLM 5 / 5.1 (< 1M context): every layer full
    assert m == {"mla": [0, 1, 2, 3], "lid": [0, 1, 2, 3]} and state.memory_of(m) == "dsa"
    # GLM 5.2 (1M context) without indexer.types: GLM_5_2_DEFAULT_INDEXER_TYPES, 0 past its 78 entries
    m = _arch_map("glm-dsa", 80, context_length=1048576)
    assert m["mla"] == list(range(80)) and m["lid"] == [0, 1] + list(range(2, 78, 4))
    assert _arch_map("glm-dsa", 4, **{"context_length": 1048576, "attention.indexer.types": [1, 0, 1, 0]}) == {
        "mla": [0, 1, 2, 3],
        "lid": [0, 2],
    }  # the key wins over the default
    assert _arch_map("glm-dsa", 3, **{"context_length": 4096, "attention.indexer.types": 0})["lid"] == []
    assert _arch_map("glm-dsa", 4, **{"context_length": 4096, "attention.indexer.types": [1, 0, 1]}) is None
    assert _arch_map("glm-dsa", 4) is None  # no context_length: no model loads
    # nextn layers: a main context's cache leaves them out, an MTP context's holds only them
    assert _arch_map("glm-dsa", 5, context_length=4096, nextn_predict_layers=1) is None
    # a caller that did not read indexer.types (context_state reads no array): no map
    assert (
        state.layer_map(
            {"general.architecture": "glm-dsa", "glm-dsa.block_count": 4, "glm-dsa.context_length": 1048576}
        )
        is None
    )


def test_hy_v4_layer_map():
    # indexer_top_k 0 (absent): a plain llama_kv_cache over every layer, MTP ones too (filter nullptr)
    assert _arch_map("hy_v4", 4) == {"kv": [0, 1, 2, 3]} and state.memory_of(_arch_map("hy_v4", 4)) == "kv"
    assert _arch_map("hy_v4", 5, nextn_predict_layers=1) == {"kv": [0, 1, 2, 3, 4]}
    m = _arch_map("hy_v4", 4, **{"attention.indexer.top_k": 64, "attention.indexer.types": [1, 0, 0, 1]})
    assert m == {"mla": [0, 1, 2, 3], "lid": [0, 3]} and state.memory_of(m) == "dsa"
    assert _arch_map("hy_v4", 3, **{"attention.indexer.top_k": 64, "attention.indexer.types": 1})["lid"] == [0, 1, 2]
    # load_arch_hparams throws unless layer 0 owns an indexer (absent types: none does)
    assert _arch_map("hy_v4", 4, **{"attention.indexer.top_k": 64, "attention.indexer.types": [0, 1, 1, 1]}) is None
    assert _arch_map("hy_v4", 4, **{"attention.indexer.top_k": 64}) is None
    # with nextn layers filter_lid asks is_indexer_full(il >= n_layer()): GGML_ABORT, no memory
    assert (
        _arch_map(
            "hy_v4", 5, **{"attention.indexer.top_k": 64, "attention.indexer.types": 1, "nextn_predict_layers": 1}
        )
        is None
    )


def test_dots3note_layer_map():
    # llama_kv_cache_dsa_iswa: mla the non-SWA layers, lid is_indexer_full(il), swa the SWA layers
    m = _arch_map(
        "dots3note",
        6,
        **{
            "attention.sliding_window_pattern": [False, True, True, False, True, True],
            "attention.indexer.types": [1, 0, 0, 1, 0, 0],
        },
    )
    assert m == {"mla": [0, 3], "lid": [0, 3], "swa": [1, 2, 4, 5]} and state.memory_of(m) == "dsa-iswa"
    # get_arr takes shorter arrays (later layers stay 0: not SWA, no indexer), and filter_lid is not
    # chained with !is_swa: an indexer flag on a SWA layer puts it in lid as well as in swa
    m = _arch_map(
        "dots3note", 6, **{"attention.sliding_window_pattern": [True, True, False], "attention.indexer.types": [0, 1]}
    )
    assert m == {"mla": [2, 3, 4, 5], "lid": [1], "swa": [0, 1]}
    # both are required arrays: a scalar or an absent key loads no model
    assert (
        _arch_map("dots3note", 2, **{"attention.sliding_window_pattern": 2, "attention.indexer.types": [1, 0]}) is None
    )
    assert _arch_map("dots3note", 2, **{"attention.sliding_window_pattern": [False, True]}) is None
    assert (
        _arch_map(
            "dots3note",
            3,
            **{
                "attention.sliding_window_pattern": [False, True],
                "attention.indexer.types": [1, 0],
                "nextn_predict_layers": 1,
            },
        )
        is None
    )


def test_glm5_next_layer_map():
    # llama_memory_hybrid_idx: KDA layers (head_count_kv 0) recurrent, the others in kv; idx those
    # of them with is_indexer_full (every layer when indexer.types is absent)
    m = _arch_map("glm5-next", 6, **{"attention.head_count_kv": [0, 0, 4, 0, 0, 4]})
    assert m == {"kv": [2, 5], "recurrent": [0, 1, 3, 4], "idx": [2, 5]} and state.memory_of(m) == "hybrid-idx"
    m = _arch_map("glm5-next", 4, **{"attention.head_count_kv": [4, 0, 0, 4], "attention.indexer.types": [0, 1, 1, 1]})
    assert m == {"kv": [0, 3], "recurrent": [1, 2], "idx": [3]}  # starts with attention; layer 0 shares
    assert _arch_map("glm5-next", 2, **{"attention.head_count_kv": 4}) == {"kv": [0, 1], "recurrent": [], "idx": [0, 1]}
    assert (
        _arch_map("glm5-next", 4, **{"attention.head_count_kv": [4, 0, 0, 4], "attention.indexer.types": [1, 1, 1]})
        is None
    )
    assert _arch_map("glm5-next", 4) is None  # no head counts: which layers are KDA is unknown
    assert _arch_map("glm5-next", 5, **{"attention.head_count_kv": [4, 0, 0, 4, 4], "nextn_predict_layers": 1}) is None


def test_qwen4exp_layer_map():
    # llama_memory_hybrid_idx: linear attention except every full_attention_interval-th layer
    # (default 4); idx holds the attention layers
    m = _arch_map("qwen4exp", 8)
    assert m == {"kv": [3, 7], "recurrent": [0, 1, 2, 4, 5, 6], "idx": [3, 7]} and state.memory_of(m) == "hybrid-idx"
    assert _arch_map("qwen4exp", 4, full_attention_interval=2) == {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]}
    # an MTP layer is in no part (filters il < n_layer()), and either context type builds the same memory
    assert _arch_map("qwen4exp", 9, nextn_predict_layers=1) == m
    # attention.recurrent_layers wins over the interval; here the pattern starts with attention,
    # and the MTP layer's 0 does not make it an attention layer of the trunk
    assert _arch_map(
        "qwen4exp",
        5,
        full_attention_interval=2,
        nextn_predict_layers=1,
        **{"attention.recurrent_layers": [0, 1, 1, 0, 0]},
    ) == {"kv": [0, 3], "recurrent": [1, 2], "idx": [0, 3]}
    assert _arch_map("qwen4exp", 4, **{"attention.recurrent_layers": [0, 1, 1]}) is None  # not n_layer_all entries
    assert _arch_map("qwen4exp", 4, full_attention_interval=0) is None  # load_arch_hparams refuses 0
    # not read by the caller: the default interval may not be the GGUF's
    assert state.layer_map({"general.architecture": "qwen4exp", "qwen4exp.block_count": 8}) is None


def _metadata_gguf(path, arch, **kv):
    """A GGUF holding only metadata (no tensors: llama.cpp would not load it, gguf reads it)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for key, value in kv.items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_keyed_layer_maps_from_a_gguf(tmp_path):
    # model_facts reads every key these rules need (arrays too), absent ones as None
    q = _metadata_gguf(tmp_path / "q.gguf", "qwen4exp", block_count=4, full_attention_interval=2)
    assert state.model_facts(q)["layers"] == {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]}
    d = _metadata_gguf(
        tmp_path / "d.gguf",
        "dots3note",
        block_count=4,
        **{
            "attention.sliding_window_pattern": [False, True, True, False],
            "attention.indexer.types": [True, False, False, True],
        },
    )
    assert state.model_facts(d)["layers"] == {"mla": [0, 3], "lid": [0, 3], "swa": [1, 2]}
    g = _metadata_gguf(tmp_path / "g.gguf", "glm-dsa", block_count=4, context_length=1048576)
    assert state.model_facts(g)["layers"] == {"mla": [0, 1, 2, 3], "lid": [0, 1, 2]}
    # nextn layers: no map, and the memory only where it does not depend on the context type
    g = _metadata_gguf(tmp_path / "g1.gguf", "glm-dsa", block_count=5, context_length=4096, nextn_predict_layers=1)
    facts = state.model_facts(g)
    assert facts["layers"] is None and "memory" not in facts

    # what a Context asks for its own model (context_state._model_memory): scalars through
    # llama.cpp's metadata (llama_model_meta_val_str), arrays from the GGUF; here an object with
    # the Model attributes it reads, as no such model can be loaded
    from types import SimpleNamespace

    from pyllamacpp.context_state import _model_memory

    scalars = {"qwen4exp.block_count": "4", "qwen4exp.full_attention_interval": "2"}
    fake = SimpleNamespace(arch="qwen4exp", path=str(q), meta=scalars.get, kv_head_counts=lambda: [2, 2, 2, 2])
    assert _model_memory(fake) == ("hybrid-idx", {"kv": [1, 3], "recurrent": [0, 2], "idx": [1, 3]})
    fake = SimpleNamespace(
        arch="dots3note", path=str(d), meta={"dots3note.block_count": "4"}.get, kv_head_counts=lambda: [2, 2, 2, 2]
    )
    assert _model_memory(fake) == ("dsa-iswa", {"mla": [0, 3], "lid": [0, 3], "swa": [1, 2]})


def _fake_context(model, memory_layers, params, *, n_seq_max=1, plain_kv=False):
    """What check_state / _partial_differs read of a Context, for archs no model of which can be
    loaded here; ``model`` has what they read of a Model."""
    from types import SimpleNamespace

    return SimpleNamespace(
        _memory_layers=lambda: memory_layers,
        model=model,
        params=params,
        n_seq_max=n_seq_max,
        n_ctx_seq=256,
        flash_attn=True,
        _plain_kv=plain_kv,
    )


def test_context_checks_of_composed_memories(tmp_path, composed_parts):
    """check_state and _partial_differs for the memories of archs make_model cannot make."""
    from types import SimpleNamespace

    import pyllamacpp as pl
    from pyllamacpp.context_state import StateMethods, _model_memory
    from pyllamacpp.testing import make_model

    # PARTIAL_ONLY changes what dsa-iswa, hybrid-idx and dsv4 write (and so which device chunks an
    # ON_DEVICE load takes); dsa and msa write all of themselves either way
    for arch, meta, heads, want in (
        ("qwen4exp", {"qwen4exp.block_count": "4", "qwen4exp.full_attention_interval": "2"}, [2] * 4, True),
        ("glm5-next", {"glm5-next.block_count": "4"}, [2, 0, 2, 0], True),
        ("glm-dsa", {"glm-dsa.block_count": "2", "glm-dsa.context_length": "4096"}, [2, 2], False),
    ):
        fake = SimpleNamespace(arch=arch, path=None, meta=meta.get, kv_head_counts=lambda h=heads: h)
        mem = _model_memory(fake)
        assert StateMethods._partial_differs(_fake_context(fake, mem, None)) is want, arch
    # a glm-dsa context checks a dsa dump whose indexer rows (lid: one head of 16 values) are
    # not key_length x head_count_kv wide, as its MLA rows need not be either
    dumps = {}
    for n_kv in (2, 1):
        path = make_model(
            tmp_path / f"l{n_kv}.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=n_kv, n_vocab=128
        )
        with pl.Model(path) as m, m.context(n_ctx=256, flash_attn="on", n_threads=1, n_threads_batch=1) as c:
            c.prefill(np.arange(1, 8))
            dumps[n_kv], params = c.seq_state(0).data.tobytes(), c.params

    def k_part(blob):
        part = state.parse(blob).part("kv")
        return blob[part.offset : next(r for r in part.streams[0].records if r.kind == "V").header_offset]

    dsa = dumps[2][:8] + k_part(dumps[2]) + k_part(dumps[1])
    meta = {
        "glm-dsa.block_count": "2",
        "glm-dsa.context_length": "4096",
        "glm-dsa.attention.indexer.types": "1",
        "glm-dsa.attention.key_length": "16",
        "glm-dsa.attention.value_length": "16",
    }
    with pl.Model(tmp_path / "l2.gguf") as m2:
        glm = SimpleNamespace(
            arch="glm-dsa",
            path=None,
            meta=meta.get,
            kv_head_counts=lambda: [2, 2],
            ptr=m2.ptr,
            kv_head_sizes=lambda: (16, 16),
            n_layer=2,
        )
        mem = _model_memory(glm)
        assert mem == ("dsa", {"mla": [0, 1], "lid": [0, 1]})
        StateMethods.check_state(_fake_context(glm, mem, params), dsa)  # no width complaint
        # the same check still refuses what does not fit: a K type other than the context's
        bad = bytearray(dsa)
        bad[state.parse(dsa, memory="dsa").record("K", 0, part="lid").header_offset] = 0  # F32
        with pytest.raises(pl.StateError, match=r"K\[0\] is f32"):
            StateMethods.check_state(_fake_context(glm, mem, params), bytes(bad))
    # a deepseek4 context expects n_seq_max streams even with kv_unified=True: llama_kv_cache_dsv4
    # builds its caches non-unified (unified_raw)
    c = composed_parts
    two = lambda part: _u32(2) + part[4:] + _u32(0)  # noqa: E731  (a second, empty stream)
    blocks, _ = _dsv4_blocks(2)
    seq = c["hdr"] + _u32(DSV4_MAGIC, 1, 0) + two(c["Ck"]) + two(c["Bk"]) + blocks
    ds = SimpleNamespace(
        arch="deepseek4",
        path=None,
        meta={"deepseek4.block_count": "2"}.get,
        kv_head_counts=lambda: [2, 2],
        ptr=None,
        kv_head_sizes=lambda: (32, 32),
        n_layer=2,
    )
    unified = SimpleNamespace(**{**vars(params), "kv_unified": True}) if hasattr(params, "__dict__") else params
    with pl.Model(tmp_path / "l2.gguf") as m2:
        ds.ptr = m2.ptr
        ctx2 = _fake_context(ds, (None, None), unified, n_seq_max=2)
        try:
            StateMethods.check_state(ctx2, seq)
        except pl.StateError as e:  # whatever else it finds, not the stream count
            assert "stream(s)" not in str(e), e
        ctx1 = _fake_context(ds, (None, None), unified, n_seq_max=1)
        with pytest.raises(pl.StateError, match=r"2 KV stream\(s\), this context has 1"):
            StateMethods.check_state(ctx1, seq)


# -- llama_kv_cache_dsv4 (DeepSeek V4): no such model can be made here, so its dumps are composed
# as llama_kv_cache_dsv4::state_write concatenates them: u32 'DSV4', version 1, mode; kv_raw (a
# K-only iSWA cache: real K-only gemma2 parts); then, unless PARTIAL_ONLY, the compressed K caches
# csa, hca, lid (dsv4_state_write_k_cache) and always the compressor states csa, hca, lid
# (llama_dsv4_comp_state::state_write), written by the small writer below.
DSV4_MAGIC = 0x34565344
# a 4-layer model with compress ratios [4, 128, 4, 0]: csa and lid hold il 0 and 2, hca il 1
DSV4_LAYERS = {"csa": [0, 2], "hca": [1], "lid": [0, 2]}
DSV4_HEAD, DSV4_INDEXER = 8, 32  # n_embd_head_k, indexer_head_size


def _u32(*values) -> bytes:
    return b"".join(int(v).to_bytes(4, "little") for v in values)


def _dsv4_tensor(type_name: str, values: np.ndarray, *, rows_out: bool = True) -> bytes:
    """dsv4_state_write_tensor_streams: i32 type, u64 ne0, u64 rows, u64 row_size, then each
    stream's rows (``values``: (ns, rows, ne0)); ``rows_out=False``: as ON_DEVICE writes it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from pyllamacpp.state._types import type_by_name

    t = type_by_name(type_name)
    ns, rows, ne0 = values.shape
    if t.quantized:
        raw = quantize(values.reshape(-1, ne0).astype(np.float32), GGMLQuantizationType(t.id)).tobytes()
    else:
        raw = values.astype(t.dtype).tobytes()
    head = int(t.id).to_bytes(4, "little", signed=True) + b"".join(
        int(v).to_bytes(8, "little") for v in (ne0, rows, ne0 // t.block_size * t.type_size)
    )
    return head + (raw if rows_out else b"")


def _dsv4_values(seed: int, ns: int, rows: int, ne0: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(ns, rows, ne0)).astype(np.float32)


def _dsv4_blocks(n_rows: int, ns: int = 1, *, partial: bool = False, rows_out: bool = True, n_embd_state=None):
    """The blocks after kv_raw, and the values written in them: {(block, kind, il): (ns, rows, ne0)}.
    ``n_embd_state``: {state name: n_embd_state} instead of the model's."""
    values, out = {}, b""
    if not partial:
        # hca: one row per 128 positions, 32 times fewer than csa and lid
        for name, (type_name, ne0, rows) in {
            "csa": ("f16", 16, n_rows),
            "hca": ("f32", 16, n_rows // 32),
            "lid": ("q8_0", DSV4_INDEXER, n_rows),
        }.items():
            out += _u32(2, rows, ns, len(DSV4_LAYERS[name]))
            for il in DSV4_LAYERS[name]:
                v = values[name, "K", il] = _dsv4_values(len(values), ns, rows, ne0)
                out += _u32(il) + _dsv4_tensor(type_name, v, rows_out=rows_out)
    for name, ratio, size, n_embd in (
        ("csa-state", 4, 8, 2 * DSV4_HEAD),
        ("hca-state", 128, 128, DSV4_HEAD),
        ("lid-state", 4, 8, 2 * DSV4_INDEXER),
    ):
        ils = DSV4_LAYERS[name.split("-")[0]]
        n_embd = (n_embd_state or {}).get(name, n_embd)
        out += _u32(1, ratio, size, n_embd, ns, len(ils))
        for il in ils:
            out += _u32(il)
            for kind in ("KV", "SCORE"):
                v = values[name, kind, il] = _dsv4_values(len(values), ns, size, n_embd)
                out += _dsv4_tensor("f32", v, rows_out=rows_out)
    return out, values


@pytest.fixture(scope="module")
def dsv4(composed_parts):
    c = composed_parts
    pos_max = int(state.parse(c["hdr"] + c["Bk"]).cells["pos"].max())
    n_rows = (pos_max + 1) // 4  # dsv4_state_n_used_k_rows: csa and lid; hca's is (pos_max + 1) / 128
    assert n_rows == 2
    blocks, values = _dsv4_blocks(n_rows)
    head = c["hdr"] + _u32(DSV4_MAGIC, 1, 0)
    full = head + c["Ck"] + c["Bk"] + blocks
    pblocks, pvalues = _dsv4_blocks(n_rows, partial=True)
    partial = c["hdr"] + _u32(DSV4_MAGIC, 1, 1) + c["Bk"] + pblocks
    return {
        "full": full,
        "values": values,
        "partial": partial,
        "pvalues": pvalues,
        "n_rows": n_rows,
        "raw_end": len(head) + len(c["Ck"]) + len(c["Bk"]),
        "c": c,
    }


def _dsv4_checks(st, blob, values, names):
    """Parts, bytes, layout, and every value written, through records, views, address and layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    assert [p.name for p in st.parts] == names and st.options["memory"] == "dsv4"
    assert st.options["has_v"] is False and st.to_bytes() == blob
    check_layout(st)
    lay = st.layout()
    rows = {(r.part, r.kind, r.il, r.stream): r for r in lay.rows if r.il is not None}
    assert lay.payload_bytes == sum(r.nbytes for r in st.records())
    blocks = [p for p in st.parts if p.kind in ("compressed", "compressor")]
    assert len(lay.rows) == sum(len(s.records) for p in st.parts for s in p.streams)
    assert [(r.part, r.kind, r.il) for r in st.records() if r.part in [b.name for b in blocks]] == [
        (name, kind, il) for name, kind, il in values for _ in range(values[name, kind, il].shape[0])
    ]
    for (name, kind, il), v in values.items():
        for s in range(v.shape[0]):
            rec = st.record(kind, il, part=name, stream=s)
            assert rec.il == il and rec.stream == s and rec.n_cells == v.shape[1] and rec.n_embd == v.shape[2]
            row = rows[name, kind, il, s]
            assert (row.header_offset, row.data_offset, row.nbytes) == (rec.header_offset, rec.data_offset, rec.nbytes)
            if rec.type.quantized:
                raw = quantize(v[s], GGMLQuantizationType(rec.type.id))
                assert rec.values.tobytes() == raw.tobytes()  # raw rows
                np.testing.assert_array_equal(rec.dequantize(), dequantize(raw, GGMLQuantizationType(rec.type.id)))
                np.testing.assert_allclose(rec.dequantize(), v[s], atol=np.abs(v).max() / 127 + 1e-3)
            else:
                assert rec.values.shape == v[s].shape
                np.testing.assert_array_equal(rec.values, v[s].astype(rec.type.dtype))
            assert rec.values.size == 0 or np.shares_memory(rec.values, st.buffer)
            # the rows as the layout places them, and one value through address()
            got = np.frombuffer(blob, np.uint8, row.nbytes, row.data_offset)
            assert got.tobytes() == rec.rows.tobytes()
            if v.shape[1] and not rec.type.quantized:
                r_, j = v.shape[1] - 1, v.shape[2] - 1
                at = st.address(kind, il, r_, 0, j, part=name, stream=s)
                assert at == rec.data_offset + r_ * rec.row_size + j * rec.type.type_size
                assert blob[at : at + rec.type.type_size] == v[s, r_, j].astype(rec.type.dtype).tobytes()
    return lay


def test_dsv4_round_trip_layout_and_views(dsv4):
    blob = dsv4["full"]
    st = state.parse(blob)
    names = ["base", "swa", "csa", "hca", "lid", "csa-state", "hca-state", "lid-state"]
    lay = _dsv4_checks(st, blob, dsv4["values"], names)
    assert st.partial is False and st.metadata_only is False
    # the raw cache is the K-only iSWA dump it was made of
    raw = state.parse(dsv4["c"]["hdr"] + dsv4["c"]["Ck"] + dsv4["c"]["Bk"], has_v=False)
    assert st.stream("swa").k[0].tobytes() == raw.stream("swa").k[0].tobytes()
    assert st.part("base").offset == 8 + 12 and st.part("csa").offset == dsv4["raw_end"]
    # blocks: headers as written
    csa, hca, lid = st.part("csa"), st.part("hca"), st.part("lid")
    assert (csa.version, csa.ratio, csa.n_rows, csa.n_stream, csa.layers) == (2, 4, 2, 1, (0, 2))
    assert (hca.ratio, hca.n_rows, hca.layers) == (128, 0, (1,)) and hca.records[0].values.shape == (0, 16)
    assert lid.records[0].type.name == "q8_0" and lid.records[0].values.shape == (2, 34)  # raw q8_0 rows
    cs = st.part("csa-state")
    assert (cs.kind, cs.ratio, cs.state_size, cs.n_embd_state, cs.layers) == ("compressor", 4, 8, 16, (0, 2))
    assert [r.kind for r in cs.records] == ["KV", "SCORE", "KV", "SCORE"]
    np.testing.assert_array_equal(st.stream("csa-state").views("score")[2], dsv4["values"]["csa-state", "SCORE", 2][0])
    assert st.stream("csa").k.layers == (0, 2) and st.stream("csa").k[2].shape == (2, 16)
    # every byte is metadata or payload; the payload is the raw K rows and the blocks' rows
    assert lay.metadata_bytes + lay.payload_bytes == len(blob)
    assert lay.payload_bytes == sum(r.nbytes for r in raw.records()) + sum(
        v[0].size * {"csa": 2, "hca": 4, "lid": 34 / 32}.get(name, 4) for (name, _, _), v in dsv4["values"].items()
    )
    segs = {s.what for s in lay.segments}
    assert {
        "dsv4: magic, version, mode",
        "csa: version, n_rows, ns, n_layer",
        "csa layer 1: il",
        "hca-state: version, ratio, state_size, n_embd_state, ns, n_layer",
    } <= segs
    # the table and the text show the blocks
    assert "csa-state" in lay.table() and "SCORE" in lay.table()
    text = st.describe()
    assert "csa (compressed K cache, 1 row per 4 positions): version 2, 2 rows (positions 0..7)" in text
    assert "hca-state (compressor state, ratio 128): 128 ring rows of 8 values" in text
    # memory="dsv4" reads the same; tensor_offset places a row in llama.cpp's [ne0, kv_size, n_stream] tensor
    assert state.parse(blob, memory="dsv4").to_bytes() == blob
    assert st.tensor_offset("K", 2, 1, 0, 3, kv_size=256, part="csa", dest_stream=1) == (256 + 1) * 32 + 3 * 2
    # edits through a writable view land in the dump, at the record's offset
    w = state.parse(bytearray(blob))
    w.record("KV", 2, part="lid-state").values[7, 5] = 42.0
    r = w.record("KV", 2, part="lid-state")
    out = w.to_bytes()
    at = r.data_offset + 7 * r.row_size + 5 * 4
    assert out[at : at + 4] == np.float32(42).tobytes() and out[:at] == blob[:at] and out[at + 4 :] == blob[at + 4 :]


def test_dsv4_partial_only(dsv4):
    blob = dsv4["partial"]
    for st in (state.parse(blob), state.parse(blob, memory="dsv4"), state.parse(blob, flags=state.PARTIAL_ONLY)):
        _dsv4_checks(st, blob, dsv4["pvalues"], ["swa", "csa-state", "hca-state", "lid-state"])
        assert st.partial is True
    assert (
        "partial (PARTIAL_ONLY): only the swa and csa-state and hca-state and lid-state parts of a DeepSeek V4"
        in state.parse(blob).describe()
    )
    assert state.written_parts("dsv4", True) == (
        ("kv", "swa"),
        ("compressor", "csa-state"),
        ("compressor", "hca-state"),
        ("compressor", "lid-state"),
    )
    assert [n for _, n in state.written_parts("dsv4", False)][:5] == ["base", "swa", "csa", "hca", "lid"]
    # state_read refuses a mode that is not the load's flag ("DSV4 state flags mismatch")
    for data, kw in ((blob, {"partial": False}), (dsv4["full"], {"partial": True}), (blob, {"flags": 0})):
        with pytest.raises(StateFormatError, match="mode") as e:
            state.parse(data, **kw)
        assert e.value.offset == 16 and e.value.what == "dsv4: mode"
    # a whole-context state is written with flags 0: mode 1 cannot be one
    ctx_head = _u32(9) + b"deepseek4"
    with pytest.raises(StateFormatError, match="mode") as e:
        state.parse(ctx_head + blob[8:])
    assert e.value.offset == len(ctx_head) + 8


def test_dsv4_metadata_only(dsv4):
    # ON_DEVICE: llama_io_write_device::write_tensor writes nothing into the blob, write() every
    # header: the dump without its payload segments
    for blob, _values, names in ((dsv4["full"], dsv4["values"], 8), (dsv4["partial"], dsv4["pvalues"], 4)):
        full = state.parse(blob)
        meta = b"".join(blob[s.offset : s.offset + s.nbytes] for s in full.layout().segments if not s.payload)
        # the blocks as the writer above writes them without rows
        blocks = _dsv4_blocks(dsv4["n_rows"], partial=names == 4, rows_out=False)[0]
        first = next(p for p in state.parse(meta).parts if p.kind in ("compressed", "compressor"))
        assert meta[first.offset :] == blocks
        for st in (
            state.parse(meta),
            state.parse(meta, flags=state.ON_DEVICE | (state.PARTIAL_ONLY if names == 4 else 0)),
        ):
            assert st.metadata_only and len(st.parts) == names and st.to_bytes() == meta
            check_layout(st)
            lay = st.layout()
            assert lay.payload_bytes == 0 and lay.total_bytes == len(meta)
            assert [(r.part, r.kind, r.il, r.type, r.row_size) for r in st.records()] == [
                (r.part, r.kind, r.il, r.type, r.row_size) for r in full.records()
            ]
            rec = st.record("KV", 0, part="csa-state")
            assert rec.data is None and rec.rows_nbytes == 8 * 16 * 4
            with pytest.raises(state.MetadataOnlyError):
                rec.values
            assert rec.tensor_offset(7, 0, 1, kv_size=8) == 7 * 64 + 4
            with pytest.raises(ValueError, match="metadata-only"):
                st.select_cells(lambda cells: cells["pos"] >= 0)


def test_dsv4_streams_of_a_whole_memory(dsv4):
    """A whole-context state (seq_id -1): every block writes ns = n_stream streams per layer
    tensor, interleaved (dsv4_state_write_tensor_streams); the raw cache's n_stream is that n."""
    c = dsv4["c"]

    def two_streams(part: bytes) -> bytes:  # a K-only part with an empty second stream
        assert part[:4] == _u32(1)
        return _u32(2) + part[4:] + _u32(0)

    blocks, values = _dsv4_blocks(256, ns=2)
    head = _u32(9) + b"deepseek4"
    blob = head + _u32(DSV4_MAGIC, 1, 0) + two_streams(c["Ck"]) + two_streams(c["Bk"]) + blocks
    st = state.parse(blob)
    assert st.kind is DumpKind.CONTEXT and st.part("csa").n_stream == 2 and st.part("swa").n_stream == 2
    _dsv4_checks(st, blob, values, ["base", "swa", "csa", "hca", "lid", "csa-state", "hca-state", "lid-state"])
    np.testing.assert_array_equal(st.stream("csa", 1).k[2], values["csa", "K", 2][1].astype(np.float16))
    with pytest.raises(ValueError, match="pass stream="):
        st.stream("csa")
    r0, r1 = st.record("K", 0, part="csa", stream=0), st.record("K", 0, part="csa", stream=1)
    assert r0.header_offset == r1.header_offset and r1.data_offset == r0.data_offset + r0.nbytes
    assert r1.header_size == 28
    # a sequence dump is of one stream (dsv4_state_dst_stream_range: ns must be 1)
    seq = c["hdr"] + blob[len(head) :]
    with pytest.raises(StateFormatError, match="streams") as e:
        state.parse(seq)
    csa_at = len(c["hdr"]) + 12 + len(two_streams(c["Ck"])) + len(two_streams(c["Bk"]))
    assert e.value.offset == csa_at + 8 and e.value.what == "csa: ns"
    # a whole state with one stream per block while the raw cache has two
    one_blocks, _ = _dsv4_blocks(256, ns=1)
    with pytest.raises(StateFormatError, match="streams") as e:
        state.parse(head + _u32(DSV4_MAGIC, 1, 0) + two_streams(c["Ck"]) + two_streams(c["Bk"]) + one_blocks)
    assert e.value.what == "csa: ns"


def _dsv4_fields(st, start: int):
    """(offset, size) of every header field of the dsv4 blocks from ``start``, and each rows chunk."""
    sizes = {"il": [4], "header": [4, 8, 8, 8]}
    out = []
    for seg in st.layout().segments:
        if seg.offset < start:
            continue
        if seg.payload:
            out.append((seg.offset, seg.nbytes))
            continue
        key = seg.what.split()[-1]
        widths = sizes.get(key, [4] * (seg.nbytes // 4))
        at = seg.offset
        for w in widths:
            out.append((at, w))
            at += w
        assert at == seg.offset + seg.nbytes, seg
    return out


def test_dsv4_errors_name_the_offset(dsv4):
    blob, c = dsv4["full"], dsv4["c"]
    st = state.parse(blob)

    def patched(at: int, value: int, size: int = 4) -> bytes:
        return blob[:at] + int(value).to_bytes(size, "little", signed=value < 0) + blob[at + size :]

    def fails(data, at, match, **kw):
        with pytest.raises(StateFormatError, match=match) as e:
            state.parse(data, **kw)
        assert e.value.offset == at, (e.value, at)
        return e.value

    csa, hca, lid = st.part("csa"), st.part("hca"), st.part("lid")
    cs, hs, ls = st.part("csa-state"), st.part("hca-state"), st.part("lid-state")
    k0 = csa.records[0]
    fails(c["hdr"] + c["Ck"] + c["Bk"], 8, "DSV4_STATE_MAGIC", memory="dsv4")
    fails(blob, 8, "not memory 'iswa'", memory="iswa")
    fails(patched(12, 2), 12, "version 2, expected 1")
    fails(patched(16, 2), 16, "mode 2")
    fails(blob, 8, "K-only", has_v=True)
    fails(patched(csa.offset, 3), csa.offset, "version 3, expected 2")
    assert state.parse(patched(csa.offset, 1)).part("csa").version == 1  # dsv4_state_read_k_cache reads 1
    fails(patched(csa.offset + 8, 2), csa.offset + 8, "2 streams, expected 1")
    fails(patched(hca.offset + 8, 0), hca.offset + 8, "0 streams")
    fails(patched(csa.offset + 4, 3), k0.header_offset + 12, "rows 2, expected the block's 3")
    fails(
        patched(k0.header_offset + 20, k0.row_size + 2, 8),
        k0.header_offset + 20,
        r"row_size 34, but ggml_row_size\(f16, 16\) is 32",
    )
    fails(patched(k0.header_offset + 4, 15, 8), k0.header_offset + 20, r"ggml_row_size\(f16, 15\) is 30")
    q0 = lid.records[0]
    fails(patched(q0.header_offset + 4, 16, 8), q0.header_offset + 4, "whole blocks of 32")
    fails(patched(k0.header_offset, 99), k0.header_offset, "unknown ggml type 99")
    fails(patched(csa.offset + 20 + 28 + k0.nbytes, 0), csa.offset + 20 + 28 + k0.nbytes, "il 0 after il 0")
    fails(patched(csa.offset + 16, 600), csa.offset + 16, "LLAMA_MAX_LAYERS")
    fails(patched(cs.offset, 2), cs.offset, "version 2, expected 1")
    fails(patched(cs.offset + 4, 8), cs.offset + 4, "8, expected 4")
    fails(patched(hs.offset + 8, 64), hs.offset + 8, "64, expected 128")
    fails(patched(ls.offset + 12, 63), ls.offset + 12, "even")
    fails(patched(cs.offset + 12, 18), cs.records[0].header_offset + 4, "ne0 16, expected n_embd_state 18")
    fails(patched(cs.records[1].header_offset, 1), cs.records[1].header_offset, "F32")
    fails(
        patched(cs.records[0].header_offset + 12, 7, 8),
        cs.records[0].header_offset + 12,
        "rows 7, expected the block's 8",
    )
    # layer sets: lid holds csa's layers, a state a prefix of its cache's, csa and hca apart
    fails(patched(lid.records[1].header_offset - 4, 3), lid.offset, r"layers \[0, 3\], but csa has \[0, 2\]")
    fails(patched(ls.records[2].header_offset - 4, 3), ls.offset, r"but csa-state has \[0, 2\]")
    fails(patched(hs.records[0].header_offset - 4, 2), hs.offset, "not the first layers of hca")
    # n_embd_state: csa-state's is 2 x hca-state's; lid's rows are half lid-state's n_embd_state
    e = fails(patched(hs.offset + 12, 4), hs.records[0].header_offset + 4, "ne0 8, expected n_embd_state 4")
    fails(
        blob[: cs.offset] + _dsv4_blocks(2, partial=True, n_embd_state={"csa-state": 24})[0],
        cs.offset + 12,
        "24, expected 2 x hca-state's 8",
    )
    fails(
        blob[: cs.offset] + _dsv4_blocks(2, partial=True, n_embd_state={"lid-state": 48})[0],
        lid.records[0].header_offset + 4,
        r"ne0 32, expected half of lid-state's n_embd_state 48",
    )
    # trailing bytes, and a dump cut anywhere after the raw cache: the offset of the field cut short
    fails(blob + b"\0", len(blob), "1 trailing bytes")
    for at, size in _dsv4_fields(st, dsv4["raw_end"]):
        for cut in {at, at + size // 2, at + size - 1}:
            e = fails(blob[:cut], at, "needs")
            assert e.needed == size and e.left == cut - at
    for cut in (8, 9, 12, 15, 16, 19):  # the dsv4 header itself
        e = fails(blob[:cut], cut - cut % 4, "needs", memory="dsv4")
        assert e.what.startswith("dsv4: ")


def test_dsv4_select_cells_is_refused(dsv4):
    st = state.parse(dsv4["full"])
    # even a mask that keeps every cell: the raw cells are not what the compressed rows index
    for mask in (lambda cells: cells["pos"] >= 8, np.ones(st.stream("swa").cell_count, bool)):
        with pytest.raises(ValueError, match="llama_kv_cache_dsv4 dump.*one row per 4 or 128 positions.*seq_rm"):
            st.select_cells(mask, part="swa")


def test_dsv4_layer_map(dsv4):
    def facts(n=4, **kv):
        return {
            "general.architecture": "deepseek4",
            "deepseek4.block_count": n,
            **{f"deepseek4.{k}": v for k, v in kv.items()},
        }

    m = state.layer_map(facts(**{"attention.compress_ratios": [4, 128, 4, 0]}))
    assert m == {
        "base": [],
        "swa": [0, 1, 2, 3],
        "csa": [0, 2],
        "hca": [1],
        "lid": [0, 2],
        "csa-state": [0, 2],
        "hca-state": [1],
        "lid-state": [0, 2],
    }
    assert state.memory_of(m) == "dsv4"
    assert state.layer_map(facts()) is None  # no ratios: no map
    assert state.layer_map(facts(**{"attention.compress_ratios": [4, 128, 4, 0], "nextn_predict_layers": 1})) is None
    # the composed raw cache is gemma2's (base il 1, swa il 0): a map of this dump
    layers = {**m, "base": [1], "swa": [0]}
    st = state.parse(dsv4["full"], layers=layers)
    assert st.layers == layers and st.layout().layers_known and "record indices" not in st.layout().table()
    assert st.k[1].tobytes() == st.stream("base").k[1].tobytes() and st.record("K", 1, part="hca").il == 1
    part = state.parse(dsv4["partial"], layers=layers)  # a partial dump, told by its mode
    assert part.partial is True and part.layers == {
        k: layers[k] for k in ("swa", "csa-state", "hca-state", "lid-state")
    }
    with pytest.raises(StateFormatError, match="a dump of another model") as e:
        state.parse(dsv4["full"], layers={**layers, "hca": [3], "hca-state": [3]})
    assert e.value.what == "hca: layers"
    # a map of a dsv4 memory, but a dump of another: named
    with pytest.raises(StateFormatError, match="memory 'dsv4'"):
        state.parse(dsv4["c"]["hdr"] + dsv4["c"]["Ck"] + dsv4["c"]["Bk"], layers=layers)


def test_dsv4_fuzz(dsv4):
    rng = np.random.default_rng(11)
    full = dsv4["full"]
    meta = b"".join(full[s.offset : s.offset + s.nbytes] for s in state.parse(full).layout().segments if not s.payload)
    outcomes = {"ok": 0, "error": 0}
    for base in (full, dsv4["partial"], meta):
        st = state.parse(base)
        start = st.part("swa").offset
        heads = np.concatenate(
            [
                np.arange(s.offset, s.offset + s.nbytes)
                for s in st.layout().segments
                if not s.payload and s.offset >= start - 12
            ]
        )
        arr = np.frombuffer(base, np.uint8)
        for i in range(150):
            if i % 3 == 0:
                blob = base[: int(rng.integers(0, len(base)))]
            else:
                mutated = arr.copy()  # headers after the raw cache, or anywhere
                where = rng.choice(heads if i % 3 == 1 else len(base), rng.integers(1, 3))
                mutated[where] ^= (1 << rng.integers(0, 8, len(where))).astype(np.uint8)
                blob = mutated.tobytes()
            try:
                got = state.parse(blob)
            except StateFormatError:
                outcomes["error"] += 1
                continue
            outcomes["ok"] += 1
            assert got.layout().total_bytes == len(blob) and got.to_bytes() == blob
            check_layout(got)
    assert outcomes["error"] > 200 and outcomes["ok"] > 50, outcomes


# -- the GGUF metadata reader (state._gguf), sidecars, Layout as a sequence ---------------------------


def _reader_fields(path) -> dict:
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


def _big_endian_gguf(path):
    import gguf

    w = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_uint32("llama.block_count", 3)
    w.add_array("llama.attention.head_count_kv", [1, 0, 2])
    w.add_float64("x.f64", 1.5)
    w.add_int64("x.i64", -(2**40))
    w.add_array("x.strings", ["a", "héllo"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_metadata_reader_matches_gguf_reader(model_path, tmp_path):
    from pyllamacpp.state._gguf import read_metadata
    from pyllamacpp.testing import make_model

    # the default model (a 49k-token vocabulary), synthetic models with per-layer arrays and
    # floats, and a metadata-only file with bool and uint arrays
    paths = [
        model_path,
        make_model(
            tmp_path / "g3.gguf",
            "gemma3",
            n_layer=4,
            n_embd=64,
            n_head=4,
            n_head_kv=2,
            n_vocab=64,
            n_swa=4,
            swa_pattern=3,
        ),
        make_model(tmp_path / "lfm2.gguf", "lfm2", n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_vocab=64),
        _metadata_gguf(
            tmp_path / "d.gguf",
            "dots3note",
            block_count=4,
            **{"attention.sliding_window_pattern": [False, True, True, False], "attention.indexer.types": [1, 0, 0, 1]},
        ),
        _big_endian_gguf(tmp_path / "be.gguf"),
    ]
    for path in paths:
        ref = _reader_fields(path)
        got = read_metadata(path)
        assert list(got) == list(ref)  # every key, in file order
        for k in ref:
            assert got[k] == ref[k] and type(got[k]) is type(ref[k]), k
        # the keys the layer rules and model_facts read, alone: the others are skipped
        arch = ref["general.architecture"]
        used = (
            ["general.architecture"]
            + [f"{arch}.{k}" for k in state._layers.rule_keys(arch)]
            + [f"{arch}.attention.head_count", f"{arch}.embedding_length"]
        )
        assert read_metadata(path, used) == {k: ref[k] for k in used if k in ref}


def test_gguf_metadata_reader_stops_before_the_tensor_infos(model_path, tmp_path):
    import gguf

    from pyllamacpp.state._gguf import read_metadata

    fields = list(gguf.GGUFReader(model_path).fields.values())
    end = fields[-1].offset + sum(int(p.nbytes) for p in fields[-1].parts)  # the KV section's end
    head = tmp_path / "head.gguf"
    head.write_bytes(model_path.read_bytes()[:end])  # no tensor infos, no data
    meta = read_metadata(head, ("llama.block_count", "tokenizer.ggml.eos_token_id"))
    assert meta == {"llama.block_count": N_LAYER, "tokenizer.ggml.eos_token_id": 2}
    # cut inside the vocabulary: the error says what was being read and where
    short = tmp_path / "short.gguf"
    short.write_bytes(model_path.read_bytes()[: end // 2])
    with pytest.raises(StateFormatError, match="tokenizer.ggml") as e:
        read_metadata(short, ("llama.block_count",))
    assert e.value.offset < end // 2 and e.value.needed is not None
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUG" + bytes(40))
    with pytest.raises(StateFormatError, match="GGUF magic"):
        read_metadata(bad)


def test_parse_with_a_model_path_reads_only_metadata(model_path, runs, pl_model):
    from pyllamacpp.state import _sidecar

    _sidecar._gguf_meta.cache_clear(), _sidecar._gguf_facts.cache_clear()
    dump = runs("f16-fa")["seq"]
    by_path = state.parse(dump, model=model_path)
    by_model, by_heads = state.parse(dump, model=pl_model), state.parse(dump, n_head_kv=N_HEAD_KV)
    assert by_path.layers == by_model.layers == {"kv": list(range(N_LAYER))}
    assert by_path.n_head_kv == by_heads.n_head_kv == N_HEAD_KV
    assert by_path.layout().rows == by_model.layout().rows
    for il in (0, N_LAYER - 1):
        assert by_path.k[il].shape == by_heads.k[il].shape == (7, N_HEAD_KV, HEAD_DIM)
    assert state.model_facts(model_path) == {
        "model": model_path.name,
        "arch": "llama",
        "n_layer": N_LAYER,
        "n_head_kv": N_HEAD_KV,
        "n_embd_head_k": HEAD_DIM,
        "n_embd_head_v": HEAD_DIM,
        "layers": {"kv": list(range(N_LAYER))},
    }
    # gguf_field reads an array the metadata cache leaves out (the tokenizer's) on its own
    assert len(_sidecar.gguf_field(model_path, "tokenizer.ggml.token_type")) == N_VOCAB
    assert _sidecar.gguf_field(model_path, "llama.no_such_key") is None


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_sidecar_follows_the_umask_like_the_dump(runs, tmp_path, umask):
    import os

    old = os.umask(umask)
    try:
        dump = tmp_path / "d.bin"
        dump.write_bytes(runs("f16-fa")["seq"])
        side = state.write_sidecar(dump, model="m.gguf", n_head_kv=N_HEAD_KV)
    finally:
        os.umask(old)
    assert side.stat().st_mode & 0o777 == dump.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_sidecar_writes_lists_of_numbers_on_one_line(tmp_path):
    layers = {"base": [1, 3, 5], "swa": list(range(30))}
    side = state.write_sidecar(
        tmp_path / "d.bin", layers=layers, tokens=np.array(PROMPT_TOKENS), n_layer=30, model="m.gguf"
    )
    text = side.read_text()
    assert '"swa": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10' in text and '"tokens": [504, 2644, 2643' in text
    assert len(text.splitlines()) == 9  # {, layers {, base, swa, }, model, n_layer, tokens, }
    assert json.loads(text) == {"layers": layers, "tokens": PROMPT_TOKENS, "n_layer": 30, "model": "m.gguf"}
    assert state.read_sidecar(tmp_path / "d.bin")["layers"] == layers


def test_layout_is_a_sequence_of_its_rows(runs):
    lay = state.parse(runs("f16-fa")["seq"], n_head_kv=N_HEAD_KV).layout()
    assert len(lay) == len(lay.rows) == 2 * N_LAYER
    assert list(lay) == list(lay.rows) and lay[0] is lay.rows[0] and lay[-1].kind == "V"
    assert sum(r.nbytes for r in lay) == lay.payload_bytes
