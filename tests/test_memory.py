"""pyllamacpp.Memory (``llama_memory_*``): its repr."""

from __future__ import annotations

import numpy as np

import pyllamacpp as pl


def test_memory_repr_names_the_cache_and_the_sequences(model):
    with model.context(n_ctx=256, n_seq_max=3, n_threads=2) as ctx:
        assert repr(ctx.memory) == f"<Memory llama_kv_cache n_seq_max=3 n_ctx={ctx.n_ctx} seqs={{}}>"
        b = pl.Batch(16, model=model)
        b.add_sequence(np.arange(10, 17), 0, 0)
        b.add_sequence(np.arange(10, 13), 2, 0)
        ctx.decode(b)
        r = repr(ctx.memory)
        assert r.startswith("<Memory llama_kv_cache n_seq_max=3 ") and r.endswith("seqs={0: (0, 6), 2: (0, 2)}>")
        assert f"n_ctx={ctx.n_ctx}" in r
        ctx.memory.seq_rm(0, 0, 3)
        assert "seqs={0: (3, 6), 2: (0, 2)}" in repr(ctx.memory)
    assert repr(ctx.memory) == "<Memory (context closed)>"


def test_memory_repr_of_an_iswa_cache(tmp_path):
    from pyllamacpp.testing import make_model

    path = make_model(tmp_path / "g2.gguf", "gemma2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_vocab=64, n_swa=4)
    with pl.Model(path) as model, model.context(n_ctx=64, n_threads=1) as ctx:
        assert repr(ctx.memory).startswith("<Memory llama_kv_cache_iswa n_seq_max=1 ")
