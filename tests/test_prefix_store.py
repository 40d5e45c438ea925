"""The prefix store: chunks keyed along the tokens and the context's identity, restored exactly."""

from __future__ import annotations

import errno
import os
import warnings

import numpy as np
import pytest
from conftest import STORE_TEXT, next_logits, saved_store, store_context

import pyllamacpp as pl
from pyllamacpp import state
from pyllamacpp.prefix_store import DirectoryBackend, PrefixStore, PrefixStoreWarning, StoreError


def test_a_restored_prefix_continues_exactly_as_decoded_from_scratch(model, tmp_path):
    toks = model.tokenize(STORE_TEXT)
    assert toks.size > 17
    store = PrefixStore(tmp_path / "store", chunk_size=8)
    with store_context(model) as ctx:
        want = next_logits(ctx, toks, 0)
        assert store.save(ctx, 0, toks) == toks.size // 8
        assert store.save(ctx, 0, toks) == 0  # stored once
    with store_context(model) as ctx:
        n = store.restore(ctx, 0, toks)
        assert n == ((toks.size - 1) // 8) * 8  # the last token is decoded for its logits
        assert ctx.memory.seq_pos_max(0) == n - 1
        got = next_logits(ctx, toks, n)
    np.testing.assert_array_equal(got, want)  # flash attention off, the same cells: bit-identical
    assert store.stats.hits == n // 8 and store.stats.tokens_restored == n


def test_a_prompt_that_shares_only_its_first_chunk_restores_only_that(model, tmp_path):
    toks, store, _ = saved_store(model, tmp_path / "s")
    other = toks.copy()
    other[10] = (int(other[10]) + 1) % model.n_vocab  # inside the second chunk
    first = toks.copy()
    first[0] = (int(first[0]) + 1) % model.n_vocab
    with store_context(model) as ctx:
        assert store.restore(ctx, 0, other) == 8
        ctx.memory.clear()
        assert store.restore(ctx, 0, first) == 0


def test_a_chunk_made_under_other_settings_is_never_loaded(model, tmp_path):
    toks, store, _ = saved_store(model, tmp_path / "s")
    for kw in ({"type_k": "q8_0"}, {"flash_attn": True}, {"rope_freq_base": 20000.0}):
        with store_context(model, **kw) as ctx, warnings.catch_warnings():
            warnings.simplefilter("error", PrefixStoreWarning)  # a miss by key, not a load that failed
            assert store.restore(ctx, 0, toks) == 0, kw
    assert store.stats.hits == 0
    with store_context(model) as ctx, pytest.raises(ValueError, match="holds cells"):
        ctx.prefill(toks[:3])
        store.restore(ctx, 0, toks)
    # another chunk size is another key: nothing found, nothing misread
    with store_context(model) as ctx:
        assert PrefixStore(tmp_path / "s", chunk_size=4).restore(ctx, 0, toks) == 0


def test_a_flipped_byte_is_a_miss_the_chunk_removed(model, tmp_path):
    toks, store, keys = saved_store(model, tmp_path / "s")
    f = store.backend.find(keys[1])
    assert f is not None
    raw = bytearray(f.path.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    f.path.write_bytes(bytes(raw))
    with store_context(model) as ctx:
        assert store.restore(ctx, 0, toks) == 8  # the first chunk only
        assert store.stats.corrupt == 1 and store.backend.find(keys[1]) is None


def test_each_chunk_is_a_sequence_dump_parse_state_reads(model, tmp_path):
    toks, store, keys = saved_store(model, tmp_path / "s")
    f = store.backend.find(keys[1])
    assert f is not None
    st = state.parse(f.path)
    assert st.cells["pos"].tolist() == list(range(8, 16))
    assert len(st.k) == model.n_layer


def test_bad_stores_are_refused_before_anything_is_written(model, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(StoreError, match="is a file"):
        PrefixStore(f)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="other files in it"):
        PrefixStore(other)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    with pytest.raises(ValueError, match="chunk_size"):
        PrefixStore(tmp_path / "a", chunk_size=0)
    old = tmp_path / "old"
    PrefixStore(old)
    (old / "pyllamacpp-prefix-store.json").write_text('{"format": 0}')
    with pytest.raises(StoreError, match="format 0"):
        PrefixStore(old)


def test_a_full_disk_warns_once_and_the_run_goes_on(model, tmp_path, monkeypatch):
    toks = model.tokenize(STORE_TEXT)
    store = PrefixStore(tmp_path / "s", chunk_size=8)

    def full(key, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.backend, "put", full)
    with store_context(model) as ctx:
        ctx.prefill(toks)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert store.save(ctx, 0, toks) == 0
            assert store.save(ctx, 0, toks) == 0
        said = [x for x in w if issubclass(x.category, PrefixStoreWarning)]
        assert len(said) == 1 and "disk is full" in str(said[0].message)


def test_a_write_never_leaves_a_partial_chunk_visible(tmp_path, monkeypatch):
    b = DirectoryBackend(tmp_path / "s")
    real = os.replace

    def killed(src, dst):
        raise KeyboardInterrupt  # the process stops between the write and the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        b.put("ab" * 32, b"x" * 100)
    monkeypatch.setattr(os, "replace", real)
    assert b.find("ab" * 32) is None and list(b.chunks()) == []
    assert not [p for p in (tmp_path / "s" / "ab").iterdir()]  # the temporary file went too


def test_least_recently_used_chunks_go_first(tmp_path):
    b = DirectoryBackend(tmp_path / "s")
    for i, key in enumerate(["aa" * 32, "bb" * 32, "cc" * 32]):
        b.put(key, bytes([i]) * 100)
        f = b.find(key)
        assert f is not None
        os.utime(f.path, (1000 + i, 1000 + i))
    assert b.get("aa" * 32) == bytes([0]) * 100  # a read is a use: "aa" is now the newest
    assert b.evict(200) == (1, 100)
    assert {f.key for f in b.chunks()} == {"aa" * 32, "cc" * 32}


@pytest.mark.parametrize(
    "arch, kw, why",
    [
        ("lfm2", {"n_layer": 4, "n_head": 2}, "recurrent \\(or hybrid\\)"),
        ("mamba", {}, "recurrent"),
    ],
)
def test_memories_a_store_cannot_serve_are_refused(tmp_path, arch, kw, why):
    from pyllamacpp.testing import make_model

    path = make_model(tmp_path / f"{arch}.gguf", arch, **{"n_layer": 2, "n_embd": 64, "n_vocab": 64, **kw})
    store = PrefixStore(tmp_path / "s", chunk_size=4)
    with pl.Model(path) as m, m.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:
        with pytest.raises(ValueError, match=why):
            store.restore(ctx, 0, list(range(10)))
        with pytest.raises(ValueError, match=why):
            store.save(ctx, 0, list(range(10)))
    assert list(store.backend.chunks()) == []


@pytest.mark.parametrize("flash_attn", [True, False])  # V by rows (v_trans 0) and value-major (1)
def test_join_cells_undoes_a_cut_byte_for_byte(model, flash_attn):
    toks = model.tokenize(STORE_TEXT)
    with store_context(model, flash_attn=flash_attn) as ctx:
        ctx.prefill(toks)
        blob = ctx.seq_state(0).data
    st = state.parse(blob)
    assert st.stream().v_trans == (0 if flash_attn else 1)
    pos = st.cells["pos"]
    parts = [st.select_cells((pos >= a) & (pos < b)) for a, b in ((0, 5), (5, 16), (16, 10**6))]
    assert state.join_cells(parts).to_bytes() == blob.tobytes()
    assert state.join_cells(parts[:2]).cells["pos"].tolist() == list(range(16))
    with pytest.raises(ValueError, match="no dumps"):
        state.join_cells([])


def test_chunks_saved_under_another_llama_cpp_pin_are_refused_by_key(model, tmp_path, monkeypatch):
    """A store written by a build of another llama.cpp commit: its chunks are never found (their
    keys hash that commit), so nothing is read or loaded, and they stay, another build's to use."""
    import pyllamacpp.prefix_store._store as store_module

    real = store_module.build_info
    ours = real()["llama_cpp_commit"]
    assert ours and len(ours) == 40  # the pin is known: two builds never share a None
    older = dict(real(), llama_cpp_commit="b" * 40)
    with monkeypatch.context() as m:
        m.setattr(store_module, "build_info", lambda: older)
        toks, store, old_keys = saved_store(model, tmp_path / "s")
    stored = sorted((f.key, f.checksum, f.nbytes) for f in store.backend.chunks())
    assert len(stored) == toks.size // 8 and sorted(k for k, _, _ in stored) == sorted(old_keys)

    gets, loads = [], []
    real_get = store.backend.get
    monkeypatch.setattr(store.backend, "get", lambda key, **kw: gets.append(real_get(key, **kw)) or gets[-1])
    real_load = pl.Context.set_seq_state
    monkeypatch.setattr(pl.Context, "set_seq_state", lambda *a, **kw: loads.append(a) or real_load(*a, **kw))
    with store_context(model) as ctx, warnings.catch_warnings():
        warnings.simplefilter("error", PrefixStoreWarning)  # a miss by key, not a load that failed
        assert store.restore(ctx, 0, toks) == 0
        assert ctx.memory.seq_pos_max(0) == -1
        assert not set(store.keys(ctx, toks)) & set(old_keys)
        assert store_module.context_identity(ctx).get("llama_cpp") == ours
    assert gets == [None] and loads == []  # the first key missed: nothing read, nothing loaded
    assert store.stats.hits == 0 and store.stats.corrupt == 0
    assert sorted((f.key, f.checksum, f.nbytes) for f in store.backend.chunks()) == stored  # not removed

    # they are whole chunks, for the build they came from
    with monkeypatch.context() as m, store_context(model) as ctx:
        m.setattr(store_module, "build_info", lambda: older)
        assert store.restore(ctx, 0, toks) == ((toks.size - 1) // 8) * 8
