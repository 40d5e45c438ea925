"""ContextParams: every field, defaults from the library, validation before C, effective values."""
from __future__ import annotations

import dataclasses

import pytest

import pyllamacpp as pl
from pyllamacpp import ffi, lib


def test_every_field_with_library_defaults():
    names = [f for f, _ in ffi.typeof("struct llama_context_params").fields]
    p = pl.ContextParams()
    assert [f.name for f in dataclasses.fields(p)] == names
    d = lib.llama_context_default_params()
    for n in ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_outputs_max_per_seq", "kv_unified", "type_k"):
        assert getattr(p, n) == getattr(d, n)


def test_names_for_types_and_flash_attention():
    p = pl.ContextParams(type_k="q8_0", type_v="BF16", flash_attn_type="on")
    assert p.type_k == lib.GGML_TYPE_Q8_0 and p.type_v == lib.GGML_TYPE_BF16
    assert p.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert pl.ContextParams(flash_attn_type="off").flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert pl.ContextParams(pooling_type="mean").pooling_type == lib.LLAMA_POOLING_TYPE_MEAN


@pytest.mark.parametrize("bad, field", [
    (dict(type_k="q9_9"), "type_k"), (dict(type_v=10_000), "type_v"),
    (dict(n_seq_max=100_000), "n_seq_max"), (dict(n_ctx=-1), "n_ctx"), (dict(n_batch=-5), "n_batch"),
    (dict(flash_attn_type="maybe"), "flash_attn_type"), (dict(n_threads=0), "n_threads"),
    (dict(kv_unified="yes"), "kv_unified"),
])
def test_bad_values_raise_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        pl.ContextParams(**bad)


def test_effective_values_after_clamps(model):
    with model.context(n_ctx=256, n_batch=64, n_ubatch=512, n_threads=2) as ctx:
        assert (ctx.n_batch, ctx.n_ubatch) == (64, 64)
        assert ctx.n_ctx == 256 and ctx.n_seq_max == 1
    with pytest.raises(TypeError, match="unknown"):
        model.context(n_ctxx=5)
