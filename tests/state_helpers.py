"""What the pyllamacpp.state tests (tests/test_state_*.py) share: the default model's numbers,
helpers over the raw binding, dumps of synthetic models and crafted parts of them, and the
module-scoped fixtures ``model`` (the raw ``llama_model``), ``runs``, ``pl_model`` and
``composed_parts``.

Dumps come from the real library through the raw binding (no mocks). A test module takes a
fixture by holding it under its name (``model, runs = sh.model, sh.runs``): pytest finds fixtures
by their own name in a module, and an imported name that only tests' parameters use reads to
linters as unused. A module that uses ``runs`` must hold ``model`` too (``runs`` asks for it, and
conftest's ``model`` is a ``pyllamacpp.Model``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from pyllamacpp import ffi, lib, state

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


@pytest.fixture(scope="module")
def pl_model(model_path):
    import pyllamacpp as pl

    with pl.Model(model_path) as m:
        yield m


# -- synthetic models: every memory layout, from the real library, and parts crafted from them ------


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
