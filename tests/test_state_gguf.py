"""pyllamacpp.state's GGUF metadata reader (state._gguf), model facts read from a model's path,
and sidecars (state.write_sidecar / read_sidecar).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import state_helpers as sh
from state_helpers import (
    HEAD_DIM,
    N_HEAD_KV,
    N_LAYER,
    N_VOCAB,
    PROMPT_TOKENS,
    _metadata_gguf,
)

from pyllamacpp import state
from pyllamacpp.state import StateFormatError

# the module-scoped fixtures these tests share (state_helpers.py); pytest finds a fixture by its
# own name wherever a module holds it
model, runs, pl_model = sh.model, sh.runs, sh.pl_model


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
