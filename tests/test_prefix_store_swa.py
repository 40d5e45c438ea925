"""The prefix store with a sliding-window model (an iSWA cache): chunks of the full cache's cells and,
beside a chunk, the window of the sliding-window cache's cells at its end."""

from __future__ import annotations

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp import state
from pyllamacpp.prefix_store import PrefixStore, window_key

C = 8  # chunk size; the window is 16 cells, two chunks
N_SWA = 16


@pytest.fixture(scope="module")
def swa_model(tmp_path_factory):
    from pyllamacpp.testing import make_model

    path = make_model(
        tmp_path_factory.mktemp("swa") / "g3.gguf",
        "gemma3",
        n_layer=4,
        n_embd=64,
        n_head=4,
        n_vocab=128,
        n_swa=N_SWA,
        swa_pattern=2,
        seed=5,
    )
    with pl.Model(path) as m:
        yield m


def _ctx(m, **kw):
    args = dict(n_ctx=128, n_batch=64, n_threads=1, n_threads_batch=1, flash_attn=False)
    args.update(kw)
    return m.context(**args)


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 128, n).astype(np.int32)


def _scratch(m, toks, **kw) -> np.ndarray:
    with _ctx(m, **kw) as ctx:
        ctx.prefill(toks)
        return np.array(ctx.logits(-1))


@pytest.mark.parametrize("seq_id, kw", [(0, {}), (1, {"n_seq_max": 2})])  # one stream; a stream per sequence
def test_a_sliding_window_prefix_restores_bit_identical(swa_model, tmp_path, seq_id, kw):
    toks = _tokens(43)
    store = PrefixStore(tmp_path / "s", chunk_size=C)
    with _ctx(swa_model, **kw) as ctx:
        assert store.prefill(ctx, 0, toks[:40]) == 0
    # every chunk's end has its window: a prompt sharing 35 tokens restores 32 of them
    other = np.concatenate([toks[:35], _tokens(6, seed=1)])
    with _ctx(swa_model, **kw) as ctx:
        n = store.restore(ctx, seq_id, other)
        assert n == 32
        # as after decoding 32 tokens: llama.cpp reports the window's first position as the minimum
        assert ctx.memory.seq_pos_max(seq_id) == 31 and ctx.memory.seq_pos_min(seq_id) == 32 - N_SWA
        ctx.prefill(other[n:], seq_id, n)
        got = np.array(ctx.logits(-1))
    np.testing.assert_array_equal(got, _scratch(swa_model, other, **kw))  # flash attention off: bit-identical
    with _ctx(swa_model, **kw) as ctx:  # the whole of the first prompt and more: its end's window too
        assert store.restore(ctx, seq_id, toks) == 40


def test_prefill_through_the_store_gives_the_logits_of_a_plain_prefill(swa_model, tmp_path):
    toks = _tokens(30)
    store = PrefixStore(tmp_path / "s", chunk_size=C)
    want = _scratch(swa_model, toks)
    for restored in (0, 24):  # stored on the first pass, restored on the second
        with _ctx(swa_model) as ctx:
            assert store.prefill(ctx, 0, toks) == restored
            np.testing.assert_array_equal(np.array(ctx.logits(-1)), want)
    assert store.stats.tokens_restored == 24


def test_without_its_window_a_chunk_is_not_restored(swa_model, tmp_path):
    toks = _tokens(30)
    store = PrefixStore(tmp_path / "s", chunk_size=C)
    with _ctx(swa_model) as ctx:
        ctx.prefill(toks[:29])  # the sequence does not end at a chunk's end: no window to keep
        assert store.save(ctx, 0, toks[:29]) == 3
    with _ctx(swa_model) as ctx:
        keys = store.keys(ctx, toks)
        assert all(store.backend.find(k) is not None for k in keys[:3])
        assert all(store.backend.find(window_key(k)) is None for k in keys)
        assert store.restore(ctx, 0, toks) == 0 and ctx.memory.seq_pos_max(0) == -1
        ctx.prefill(toks[:24])  # now one ends at 24
        assert store.save(ctx, 0, toks[:24]) == 1
        ctx.memory.clear()
        assert store.restore(ctx, 0, toks) == 24
        ctx.memory.clear()
        store.backend.remove(window_key(keys[2]))
        store.backend.remove(keys[0])  # the first chunk gone: nothing restores
        assert store.restore(ctx, 0, toks) == 0


def test_a_shorter_run_is_restored_when_the_longest_has_no_window(swa_model, tmp_path):
    toks = _tokens(41)
    store = PrefixStore(tmp_path / "s", chunk_size=C)
    with _ctx(swa_model) as ctx:
        store.prefill(ctx, 0, toks)
        keys = store.keys(ctx, toks)
        store.backend.remove(window_key(keys[4]))
        ctx.memory.clear()
        assert store.restore(ctx, 0, toks) == 32
        ctx.memory.clear()
        got_n = store.restore(ctx, 0, toks[:36])
        assert got_n == 32
        ctx.prefill(toks[32:36], 0, 32)
        got = np.array(ctx.logits(-1))
    np.testing.assert_array_equal(got, _scratch(swa_model, toks[:36]))


def test_chunks_and_windows_are_dumps_of_their_cells(swa_model, tmp_path):
    toks = _tokens(24)
    store = PrefixStore(tmp_path / "s", chunk_size=C)
    with _ctx(swa_model) as ctx:
        store.prefill(ctx, 0, toks)
        keys = store.keys(ctx, toks)
    for k, key in enumerate(keys):
        st = state.parse(store.backend.get(key), memory="iswa")
        assert [p.name for p in st.parts] == ["base", "swa"]
        assert list(st.stream("base", 0).cells["pos"]) == list(range(k * C, (k + 1) * C))
        assert st.stream("swa", 0).cell_count == 0
        w = state.parse(store.backend.get(window_key(key)), memory="iswa")
        assert w.stream("base", 0).cell_count == 0
        end = (k + 1) * C  # what llama.cpp holds of the window when the sequence ends there
        assert list(w.stream("swa", 0).cells["pos"]) == list(range(max(0, end - N_SWA), end))


def test_chunks_saved_from_two_streams_join_into_one(swa_model, tmp_path):
    """With a stream per sequence, chunks saved from sequence 0 and from sequence 1 lie in two
    streams; restored into either sequence they are joined into its one stream, both parts."""
    toks = _tokens(35)
    store = PrefixStore(tmp_path / "s", chunk_size=C)
    with _ctx(swa_model, n_seq_max=2) as ctx:
        store.prefill(ctx, 0, toks[:16])  # chunks 0-1 and their windows from stream 0
        store.prefill(ctx, 1, toks[:33])  # chunks 2-3 and their windows from stream 1
        ctx.memory.clear()
        for seq in (0, 1):
            assert store.restore(ctx, seq, toks) == 32
            ctx.prefill(toks[32:], seq, 32)
            np.testing.assert_array_equal(np.array(ctx.logits(-1)), _scratch(swa_model, toks, n_seq_max=2))
            ctx.memory.clear()


def test_gemma3_270m_restored_from_its_window_is_bit_identical(tmp_path):
    """The real model (window 512, 18 layers, 5 of each 6 sliding): 768 tokens stored, a prompt of
    800 restored from them. Runs where `pyllamacpp fetch-model gemma3-270m` has cached it."""
    from pyllamacpp.models import GEMMA3_270M, cache_dir
    from pyllamacpp.scoring import sample_text_path

    path = cache_dir() / "models" / GEMMA3_270M["gguf"]
    if not path.is_file():
        pytest.skip("Gemma 3 270M is not cached (pyllamacpp fetch-model gemma3-270m)")
    with pl.Model(path) as m:
        assert m.n_swa == 512
        toks = m.tokenize(sample_text_path().read_text())[:800]
        store = PrefixStore(tmp_path / "s")
        with _ctx(m, n_ctx=1024, n_batch=512) as ctx:
            store.prefill(ctx, 0, toks[:768])
        with _ctx(m, n_ctx=1024, n_batch=512) as ctx:
            assert store.restore(ctx, 0, toks) == 768
            ctx.prefill(toks[768:], 0, 768)
            got = np.array(ctx.logits(-1))
        np.testing.assert_array_equal(got, _scratch(m, toks, n_ctx=1024, n_batch=512))


def test_stored_says_what_a_restore_would_load_without_loading(swa_model, tmp_path):
    toks = _tokens(41)
    store = PrefixStore(tmp_path / "s", chunk_size=C)
    with _ctx(swa_model) as ctx:
        assert store.stored(ctx, toks) == 0
        store.prefill(ctx, 0, toks[:40])
        keys = store.keys(ctx, toks)
        assert store.stored(ctx, toks) == 40 and store.stored(ctx, toks[:39]) == 32
        store.backend.remove(window_key(keys[4]))  # the last chunk's window gone: a run of 4
        assert store.stored(ctx, toks) == 32
        store.backend.remove(keys[0])
        assert store.stored(ctx, toks) == 0
        # only the prefill's own restore looked up a chunk; stored() read and loaded nothing
        assert store.stats.lookups == 1 and ctx.memory.seq_pos_max(0) == 39
