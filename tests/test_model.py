"""Model: properties from the library, vocabulary, lifetimes, load errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PROMPT

import pyllamacpp as pl


def test_properties_come_from_the_library(model):
    assert model.arch == "llama"
    assert (model.n_layer, model.n_head_kv, model.n_vocab) == (30, 3, 49152)
    assert model.n_embd == 576 and model.n_head == 9
    assert model.n_params > 100_000_000 and model.size > 50_000_000
    assert model.n_ctx_train > 0 and model.n_swa == 0
    md = model.metadata
    assert md["general.architecture"] == "llama"
    assert md["llama.block_count"] == "30"
    assert "Q4_1" in model.description


def test_kv_bytes_per_token_matches_a_real_state_dump(model):
    # 30 layers x (K + V) x 192 values x 2 bytes, as LLAMA_CPP_FACTS measured
    assert model.kv_bytes_per_token() == 23040
    assert model.kv_bytes_per_token("q8_0", "q8_0") == 30 * 2 * (192 // 32) * 34
    with model.context(n_ctx=256, n_threads=2) as ctx:
        ctx.prefill(model.tokenize(PROMPT))
        s7 = len(ctx.seq_state(0))
        ctx.prefill(model.tokenize(" And then"))
        n = ctx.memory.seq_pos_max(0) + 1
        s_n = len(ctx.seq_state(0))
    # each cell: K and V rows plus 12 bytes of metadata (pos, n_seq_id, one seq id)
    assert (s_n - s7) == (n - 7) * (model.kv_bytes_per_token() + 12)


def test_tokenize_detokenize(model):
    toks = model.tokenize(PROMPT)
    assert toks.dtype == np.int32 and toks.tolist() == [504, 2644, 2643, 335, 260, 1171, 30]
    assert model.detokenize(toks) == PROMPT
    assert "".join(model.token_to_piece(t) for t in toks) == PROMPT
    long = "word " * 3000  # longer than the first buffer guess: the retry path
    assert model.detokenize(model.tokenize(long)) == long
    with pytest.raises(ValueError):
        model.token_to_piece(model.n_vocab)
    with pytest.raises(ValueError):
        model.detokenize([-5])


def test_special_tokens_and_chat_template(model):
    assert model.is_eog(model.eos) and not model.is_eog(model.tokenize("cat")[0])
    text = model.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert "Hi there" in text and "<|im_start|>" in text and text.rstrip().endswith("assistant")


def test_use_after_close_raises(model_path):
    m = pl.Model(model_path)
    m.close()
    m.close()  # idempotent
    with pytest.raises(pl.ClosedError):
        m.n_vocab
    with pytest.raises(pl.ClosedError):
        m.tokenize("x")


def test_load_errors(tmp_path):
    with pytest.raises(pl.ModelLoadError, match="no such file"):
        pl.Model(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(pl.ModelLoadError) as e:
        pl.Model(bad)
    assert e.value.reason  # llama.cpp's logged reason is attached


def test_model_params_every_field_and_mmap_shorthand(model_path):
    p = pl.ModelParams()
    assert {"n_gpu_layers", "vocab_only", "load_mode", "tensor_split"} <= set(p.__dataclass_fields__)
    m = pl.Model(model_path, vocab_only=True, use_mmap=False)
    try:
        assert m.params.load_mode == pl.lib.LLAMA_LOAD_MODE_NONE
        assert m.tokenize(PROMPT).size == 7
    finally:
        m.close()
