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


def test_one_token_table_per_model_shared_by_every_text_path(model_path):
    # Model._tokens: token -> (bytes, is_eog, text), asked of llama.cpp once per model and token,
    # read by generate_parallel, the Detokenizer, the text streams and the Scheduler alike.
    import gc
    import weakref

    gc.disable()  # the model must go with its last reference, not wait for the collector
    try:
        m = pl.Model(model_path)
        table = m._tokens[0]
        with m.context(n_ctx=256, n_seq_max=2, kv_unified=True, n_threads=2) as ctx:
            res = pl.generate_parallel(ctx, m.tokenize("The cat sat on"), 2, 6)
        toks = {t for r in res for t in r.tokens}
        assert toks <= set(table)  # generate_parallel's eog checks filled it
        eos = m.eos
        for t in (*toks, eos):
            data, eog, text = table[t]
            assert data == m.token_to_bytes(t) and eog == m.is_eog(t)
            assert text == (data.decode() if text is not None else None)
        assert table[eos][1] and not m._tokens[1][m.tokenize("cat", add_special=False)[0]][1]
        assert pl.Detokenizer(m)._info is table and pl.Detokenizer(m, special=True)._info is m._tokens[1]
        with pytest.raises(ValueError):
            table[m.n_vocab]  # outside the vocabulary: nothing stored
        assert m.n_vocab not in table
        ref = weakref.ref(m)
        del m, ctx, res
        assert ref() is None  # the tables hold their model weakly: no cycle
        with pytest.raises(pl.ClosedError):
            table[999]  # a miss after the model is gone
    finally:
        gc.enable()
