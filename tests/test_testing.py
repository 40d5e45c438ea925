"""pyllamacpp.testing.make_model: synthetic GGUFs that the real llama.cpp loads and decodes."""

from __future__ import annotations

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp import lib
from pyllamacpp.testing import ARCHS, make_model

SEQ_MAGIC = 0xAF143CD8  # io_magic in llama-context.cpp, first u32 of every seq state
N_TOKENS = 10


def _decode(model, n_tokens=N_TOKENS, **ctx_kwargs):
    """A 2-thread context with tokens 1..n_tokens decoded in sequence 0 (all logits)."""
    ctx = model.context(n_ctx=64, n_threads=2, n_threads_batch=2, **ctx_kwargs)
    batch = pl.Batch(32, model=model)
    batch.add_sequence(np.arange(1, n_tokens + 1), 0, 0, logits="all")
    ctx.decode(batch)
    logits = ctx.logits_all()
    assert logits.shape == (n_tokens, model.n_vocab)
    assert np.isfinite(logits).all()
    assert np.ptp(logits) > 0  # random weights, not a constant output
    return ctx


def _magic(state) -> int:
    return int.from_bytes(bytes(state)[:4], "little")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_plain_attention_gqa_head_dim(tmp_path, arch):
    # head_dim 32 != n_embd / n_head = 16: llama.cpp must take attention.key_length/value_length
    n_layer, n_embd, n_head, n_head_kv, hd, n_vocab = 2, 64, 4, 2, 32, 128
    path = make_model(
        tmp_path / f"{arch}.gguf",
        arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=hd,
        n_vocab=n_vocab,
        n_ff=96,
    )
    assert path.stat().st_size < 1_000_000
    with pl.Model(path) as model:
        assert (model.arch, model.n_layer, model.n_embd, model.n_head, model.n_head_kv, model.n_vocab, model.n_swa) == (
            arch,
            n_layer,
            n_embd,
            n_head,
            n_head_kv,
            n_vocab,
            0,
        )
        assert model.meta(f"{arch}.attention.key_length") == str(hd)
        kv_bpt = model.kv_bytes_per_token()
        assert kv_bpt == n_layer * 2 * hd * n_head_kv * 2  # K and V rows, f16
        assert not lib.llama_model_is_recurrent(model.ptr)
        ctx = _decode(model)
        state = ctx.seq_state(0)
        assert _magic(state) == SEQ_MAGIC
        # llama_kv_cache::state_write, one stream: magic, seq_id, n_stream, cell_count; per cell
        # pos + n_seq_id + seq_id; v_trans, n_layer; per layer and K/V a 12-byte header
        # (type + row size, or type + element size + n_embd_v_gqa when V is transposed)
        assert len(state) == 16 + 8 + n_layer * 2 * 12 + N_TOKENS * (12 + kv_bpt)
        ctx.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_iswa(tmp_path, arch):
    n_layer, n_swa, n_head_kv, hd = 2, 4, 2, 32
    path = make_model(
        tmp_path / f"{arch}.gguf",
        arch,
        n_layer=n_layer,
        n_embd=64,
        n_head=4,
        n_head_kv=n_head_kv,
        head_dim=hd,
        n_vocab=128,
        n_swa=n_swa,
        swa_pattern=2,
    )
    with pl.Model(path) as model:
        assert (model.n_layer, model.n_head_kv, model.n_embd, model.n_vocab, model.n_swa) == (
            n_layer,
            n_head_kv,
            64,
            128,
            n_swa,
        )
        ctx = _decode(model, swa_full=False)
        log = "\n".join(text for _, text in ctx.creation_log)
        assert "llama_kv_cache_iswa" in log and "SWA KV cache" in log
        assert ctx.buffers["CPU"]["KV"] > 0
        state = ctx.seq_state(0)
        assert _magic(state) == SEQ_MAGIC

        # pattern 2: layer 0 SWA, layer 1 full. The full cache writes all N_TOKENS cells, the SWA
        # cache only the n_swa not masked for pos_max (llama_hparams::is_masked_swa)
        def one_layer_cache(n_cells):  # n_stream, cell_count, v_trans, n_layer, K/V headers, cells
            return 16 + 2 * 12 + n_cells * (12 + 2 * hd * n_head_kv * 2)

        assert len(state) == 8 + one_layer_cache(N_TOKENS) + one_layer_cache(n_swa)
        ctx.close()


def test_recurrent_mamba(tmp_path):
    n_layer, n_embd, d_conv, d_state = 2, 32, 4, 8
    path = make_model(
        tmp_path / "mamba.gguf",
        "mamba",
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=96,
        ssm_d_conv=d_conv,
        ssm_d_state=d_state,
    )
    with pl.Model(path) as model:
        assert (model.n_layer, model.n_embd, model.n_vocab, model.n_head_kv, model.n_swa) == (n_layer, n_embd, 96, 0, 0)
        assert lib.llama_model_is_recurrent(model.ptr)
        sizes = []
        for n in (4, N_TOKENS):
            ctx = _decode(model, n)
            assert "RS" in ctx.buffers["CPU"] and "KV" not in ctx.buffers["CPU"]
            state = ctx.seq_state(0)
            assert _magic(state) == SEQ_MAGIC
            sizes.append(len(state))
            ctx.close()
        # one cell per sequence, whatever the length: conv state (d_conv-1) x d_inner and SSM
        # state d_state x d_inner per layer, f32
        d_inner = 2 * n_embd
        assert sizes[0] == sizes[1] >= n_layer * ((d_conv - 1) + d_state) * d_inner * 4


def test_hybrid_lfm2(tmp_path):
    # attention at layers 1 and 3 (head_count_kv [0, 2, 0, 2]), short convolutions at 0 and 2
    n_layer, n_embd, n_head, n_head_kv, l_cache = 4, 64, 4, 2, 3
    path = make_model(
        tmp_path / "lfm2.gguf",
        "lfm2",
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_vocab=96,
        conv_l_cache=l_cache,
    )
    with pl.Model(path) as model:
        assert (model.arch, model.n_layer, model.n_embd, model.n_vocab) == ("lfm2", n_layer, n_embd, 96)
        assert lib.llama_model_is_hybrid(model.ptr) and not lib.llama_model_is_recurrent(model.ptr)
        assert model.n_head_kv == 0  # llama_model_n_head_kv is layer 0's count: a conv layer
        ctx = _decode(model)
        assert {"KV", "RS"} <= set(ctx.buffers["CPU"])
        # the per-layer counts come from the GGUF (llama.cpp's metadata API leaves arrays out): two
        # attention layers of 2 KV heads x 16 dims, K and V in f16
        assert model.kv_head_counts() == [0, n_head_kv, 0, n_head_kv]
        assert model.kv_bytes_per_token() == 2 * 2 * (n_head_kv * (n_embd // n_head) * 2)
        assert ctx.buffers["CPU"]["KV"] == pytest.approx(ctx.n_ctx * model.kv_bytes_per_token() / 2**20, abs=0.01)
        state = ctx.seq_state(0)
        assert _magic(state) == SEQ_MAGIC
        # llama_memory_hybrid::state_write: the KV cache of the 2 attention layers (one stream),
        # then the recurrent memory: 1 cell, s_trans, n_layer, R records of (l_cache - 1) x n_embd
        # f32 and S records of 0 values (hparams.n_embd_s() is 0 for lfm2), headers only
        kv = 4 + 4 + N_TOKENS * 12 + 8 + 2 * 2 * (12 + N_TOKENS * (n_embd // n_head) * n_head_kv * 2)
        rs = 4 + 8 + 8 + 2 * (12 + (l_cache - 1) * n_embd * 4) + 2 * 12
        assert len(state) == 8 + kv + rs
        ctx.close()


def test_test_tokenizer_works(tmp_path):
    # llama.cpp's "test" vocabulary: tokenize hashes 5-byte chunks, pieces are hex ids; no abort
    path = make_model(tmp_path / "tok.gguf", "llama", n_layer=1, n_embd=32, n_head=2, n_vocab=64)
    with pl.Model(path) as model:
        tokens = model.tokenize("hello world")
        assert tokens.size == 3 and ((0 <= tokens) & (tokens < 64)).all()
        assert model.token_to_piece(42) == "2a"


def test_deterministic_and_atomic(tmp_path):
    kw = dict(n_layer=1, n_embd=32, n_head=2, n_vocab=64)
    a = make_model(tmp_path / "a.gguf", "qwen3", seed=1, **kw).read_bytes()
    assert make_model(tmp_path / "b.gguf", "qwen3", seed=1, **kw).read_bytes() == a
    assert make_model(tmp_path / "c.gguf", "qwen3", seed=2, **kw).read_bytes() != a
    assert len(make_model(tmp_path / "h.gguf", "qwen3", dtype="f16", **kw).read_bytes()) < len(a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf", "h.gguf"]


@pytest.mark.parametrize(
    "arch, kwargs, error",
    [
        ("gpt5", dict(n_head=2), ValueError),
        ("llama", dict(n_head=2, n_swa=4), TypeError),  # not an option of llama
        ("llama", dict(n_head=4, n_head_kv=3), ValueError),  # GQA groups must divide
        ("llama", dict(n_head=3), ValueError),  # 32 % 3, no head_dim
        ("qwen3", dict(), ValueError),  # attention without n_head
        ("mamba", dict(n_head=2), ValueError),
        ("mamba", dict(ssm_d_inner=48), ValueError),  # llama.cpp: expansion factor 2 only
        ("gemma2", dict(n_head=2, swa_pattern=[True]), ValueError),
        ("lfm2", dict(n_head=2, head_dim=32), ValueError),  # lfm2 has no key_length
        ("lfm2", dict(n_head=2, attn_layers=[True]), ValueError),
        ("lfm2", dict(n_head=2, conv_l_cache=1), ValueError),
    ],
)
def test_bad_arguments(tmp_path, arch, kwargs, error):
    with pytest.raises(error):
        make_model(tmp_path / "x.gguf", arch, n_layer=2, n_embd=32, n_vocab=64, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_archs_listed():
    assert set(ARCHS) >= {"llama", "qwen3", "gemma2", "gemma3", "mamba", "lfm2"}
