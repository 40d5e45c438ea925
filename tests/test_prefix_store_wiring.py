"""The prefix store wired in: the Scheduler's second tier and pl.loglikelihood's trie.

Exactness is claimed as the scheduler and the evaluation engine claim it, with flash attention off:
a second scheduler in another context, given the same prompts, restores stored chunks and samples
the same greedy tokens as each prompt generated alone (prompts whose greedy continuation has a
clear winner, tests/test_scheduler.py); loglikelihood's numbers are bit-identical with and without
the store.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import greedy_alone

import pyllamacpp as pl
from pyllamacpp.experiments.prefix import LISTS, SYSTEM_PROMPT
from pyllamacpp.prefix_store import PrefixStore
from pyllamacpp.scheduler import Scheduler

N = 8
CHUNK = 8  # small chunks: the 34-token system prompt is 4 of them, each prompt 4 to 6


def _ctx(model, n_seq_max=3, kv_unified=True, **kw):
    args = dict(n_ctx=512, n_seq_max=n_seq_max, kv_unified=kv_unified, flash_attn="off", n_threads=1)
    args.update(kw)
    return model.context(**args)


@pytest.fixture(scope="module")
def solo(model):
    """Each prompt generated alone (greedy, flash attention off) in a fresh sequence."""
    with _ctx(model, n_seq_max=1) as ctx:
        return greedy_alone(ctx, SYSTEM_PROMPT, LISTS, N)


def _run(sched, prompts):
    reqs = [sched.submit(SYSTEM_PROMPT + q, N) for q in prompts]
    list(sched.run())
    return reqs


@pytest.mark.parametrize(
    ("kv_unified", "prefix_cache"), [(True, True), (True, False), (False, True)], ids=["unified", "no-cache", "streams"]
)
def test_a_second_scheduler_restores_the_prompts_and_samples_the_same_tokens(
    model, solo, tmp_path, kv_unified, prefix_cache
):
    store = PrefixStore(tmp_path / "store", chunk_size=CHUNK)
    prompts = LISTS[:6]
    with _ctx(model, kv_unified=kv_unified) as ctx:
        first = _run(Scheduler(ctx, prefix_cache=prefix_cache, prefix_store=store), prompts)
    # the store was empty when the first three started; the later ones may find the system prompt
    # the first ones stored after their prefill
    assert all(r.n_prompt_restored == 0 for r in first[:3]) and store.stats.chunks_written > 0
    for r, q in zip(first, prompts):
        assert r.tokens == solo[q]
        assert r.report()["n_prompt_restored"] == r.n_prompt_restored
    # every prompt's whole chunks are stored (all but the last token of each is restorable)
    restored0, hits0 = store.stats.tokens_restored, store.stats.hits
    with _ctx(model, kv_unified=kv_unified) as ctx:
        sched = Scheduler(ctx, prefix_cache=prefix_cache, prefix_store=store)
        second = _run(sched, prompts)
    for r, q in zip(second, prompts):
        assert r.tokens == solo[q], (q, r)  # restored cells continue exactly as decoded ones
        assert r.n_prompt_reused + r.n_prompt_decoded == r.n_prompt
        assert r.n_prompt_restored % CHUNK == 0 and r.n_prompt_restored <= r.n_prompt_reused
        if r.n_prompt_restored:
            assert r.reused_from is None
    assert second[0].n_prompt_restored == (second[0].n_prompt - 1) // CHUNK * CHUNK  # nothing cached yet
    if not prefix_cache or not kv_unified:  # no sharing between sequences: each prompt comes from the store
        assert all(r.n_prompt_restored == (r.n_prompt - 1) // CHUNK * CHUNK for r in second)
    restored = sum(r.n_prompt_restored for r in second)
    assert sched.n_prompt_restored == restored == store.stats.tokens_restored - restored0 > 0
    assert store.stats.hits - hits0 == restored // CHUNK and store.stats.hit_rate > 0
    assert sched.n_prompt_decoded == sum(r.n_prompt_decoded for r in second)


def test_the_first_tier_comes_first_and_the_store_only_adds(model, solo, tmp_path):
    store = PrefixStore(tmp_path / "store", chunk_size=CHUNK)
    q = LISTS[0]
    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx, prefix_store=store)
        (a,) = _run(sched, [q])
        assert a.n_prompt_restored == 0
        # the same prompt again: the prefix cache holds all of it but the last token, more than
        # the store's whole chunks: nothing is loaded
        (b,) = _run(sched, [q])
        assert b.n_prompt_restored == 0 and b.n_prompt_reused == b.n_prompt - 1 and b.reused_from == a.seq_id
        assert b.tokens == solo[q]
        # the cache cleared: the store gives the whole chunks, the rest is decoded
        sched.clear_cache()
        (c,) = _run(sched, [q])
        n = (c.n_prompt - 1) // CHUNK * CHUNK
        assert c.n_prompt_restored == c.n_prompt_reused == n and c.n_prompt_decoded == c.n_prompt - n
        assert c.tokens == solo[q] and sched.n_prompt_restored == n


def test_a_corrupt_chunk_is_decoded_and_the_request_stays_exact(model, solo, tmp_path):
    store = PrefixStore(tmp_path / "store", chunk_size=CHUNK)
    q = LISTS[1]
    with _ctx(model, n_seq_max=1) as ctx:
        _run(Scheduler(ctx, prefix_store=store), [q])
        keys = store.keys(ctx, ctx.model.tokenize(SYSTEM_PROMPT + q))
    f = store.backend.find(keys[2])
    assert f is not None
    raw = bytearray(f.path.read_bytes())
    raw[-7] ^= 0x10
    f.path.write_bytes(bytes(raw))
    with _ctx(model, n_seq_max=1) as ctx:
        sched = Scheduler(ctx, prefix_store=store)
        (r,) = _run(sched, [q])
    assert r.n_prompt_restored == 2 * CHUNK and store.stats.corrupt == 1  # the chunks before it
    assert r.tokens == solo[q]
    assert store.backend.find(keys[2]) is not None  # stored again after the prefill


def test_a_store_the_memory_cannot_use_is_refused_when_the_scheduler_is_made(model, tmp_path):
    from pyllamacpp.testing import make_model

    store = PrefixStore(tmp_path / "store", chunk_size=4)
    with _ctx(model) as ctx, pytest.raises(TypeError, match="PrefixStore"):
        Scheduler(ctx, prefix_store=str(tmp_path / "store"))
    path = make_model(tmp_path / "swa.gguf", "gemma3", n_layer=2, n_embd=64, n_vocab=64, n_head=2, n_swa=16)
    with pl.Model(path) as m, m.context(n_ctx=64, n_threads=1) as ctx:
        with pytest.raises(ValueError, match="sliding-window"):
            Scheduler(ctx, prefix_store=store)
    assert list(store.backend.chunks()) == []


def test_stored_chunks_from_other_streams_join_into_one(model, tmp_path):
    """kv_unified=False: a chunk holds its cells in its sequence's stream; chunks saved from two
    sequences load together into a third, and the logits after them are the decoded ones."""
    toks = model.tokenize(SYSTEM_PROMPT + LISTS[0])
    store = PrefixStore(tmp_path / "store", chunk_size=CHUNK)
    with _ctx(model, kv_unified=False) as ctx:
        ctx.prefill(toks[: 2 * CHUNK], 1, 0)
        assert store.save(ctx, 1, toks[: 2 * CHUNK]) == 2  # chunks 0, 1 from stream 1
        ctx.prefill(toks, 2, 0)
        assert store.save(ctx, 2, toks) == toks.size // CHUNK - 2  # the rest from stream 2
        want = np.array(ctx.logits(-1))
    with _ctx(model, kv_unified=False) as ctx:
        n = store.restore(ctx, 0, toks)
        assert n == (toks.size - 1) // CHUNK * CHUNK > 2 * CHUNK
        ctx.prefill(toks[n:], 0, n)
        np.testing.assert_array_equal(np.array(ctx.logits(-1)), want)


def test_a_chunk_that_fails_falls_back_to_the_running_sequence_that_holds_more(model, solo, tmp_path):
    store = PrefixStore(tmp_path / "store", chunk_size=CHUNK)
    p, q = LISTS[0], LISTS[4]  # "1, 2, ..." and "10, 20, ...": they share more than the system prompt
    with _ctx(model, n_seq_max=1) as ctx:
        _run(Scheduler(ctx, prefix_store=store), [q])
        # its first chunk past the prefix it shares with p (positions 32..39; they share 36)
        f = store.backend.find(store.keys(ctx, model.tokenize(SYSTEM_PROMPT + q))[4])
    assert f is not None
    raw = bytearray(f.path.read_bytes())
    raw[-3] ^= 0x01
    f.path.write_bytes(bytes(raw))
    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx, prefix_store=store)
        d = sched.submit(SYSTEM_PROMPT + p, 20)
        while len(d.tokens) < 3:  # running, its prompt in its cells
            sched.step()
        e = sched.submit(SYSTEM_PROMPT + q, N)
        list(sched.run())
    lcp = pl.packing.common_prefix(d.prompt, e.prompt)
    assert 4 * CHUNK < lcp < (e.n_prompt - 1) // CHUNK * CHUNK  # the store would have given more
    assert d.n_prompt_restored == 4 * CHUNK  # the chunks both share
    assert store.stats.corrupt == 1 and e.n_prompt_restored == 0  # 4 chunks loaded, fewer than d holds
    assert e.reused_from == d.seq_id and e.n_prompt_reused == lcp and e.tokens == solo[q]


# -- pl.loglikelihood ---------------------------------------------------------------------------------
HEADER = (
    "Answer each question with one word, as the examples do. The capital of France is Paris. "
    "The sky on a clear day is blue. Water at room temperature is wet. Snow is cold. "
)
DOCS = ["The cat sat on the mat. ", "A dog ran in the park today. ", "Numbers: one two three four. "]
LL_CHUNK = 16


def _requests():
    reqs = [(HEADER + d + q, " " + a) for d in DOCS for q, a in [("Where? ", "home"), ("Who? ", "a cat")]]
    reqs.append((HEADER, " Yes"))  # a row at the header's last token: the store stops before it
    reqs.append(("The", " capital of France"))  # a continuation from the second token on
    return reqs


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)  # bit for bit
        assert x.is_greedy == y.is_greedy and x.n_context == y.n_context


def _rerun(model, tmp_path, reqs, **args):
    """``reqs`` without a store, then twice with a new one (the first run stores, the second
    restores): the second's results, checked bit for bit against the first."""
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    pl.loglikelihood(model, reqs, prefix_store=store, **args)
    second = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(second, base)
    return second, base


def _two_slots_below_a_head(n_head):
    """Three requests for two slots, and their settings: slot 0's first leaf (3 tokens, done in the
    first decode); slot 1's, a head of ``n_head`` tokens then 60 more it feeds over two decodes;
    slot 0's second, the same head then 17 tokens of its own."""
    head = list(range(100, 100 + n_head))
    reqs = [([50, 51, 52], [53]), (head + list(range(300, 360)), [501]), (head + list(range(400, 417)), [502])]
    return reqs, dict(n_threads=1, n_seq_max=2, flash_attn="on", n_ctx=256)


@pytest.mark.parametrize(
    "kw",
    [{"flash_attn": "on"}, {"flash_attn": "on", "n_ctx": 64}, {"flash_attn": "off", "n_seq_max": 1}],
    ids=["one-epoch", "epochs", "fa-off-one-slot"],
)
def test_loglikelihood_with_a_store_is_bit_identical_and_restores_the_shared_header(model, tmp_path, kw):
    """Bit-identical where the engine's rows do not depend on where the cells lie: flash attention
    on with ubatches under 64 rows (the default n_batch, 63), or one slot (the cells in the same
    places). With flash attention off and several slots, a restored header lets the other slots'
    nodes land in other cells, and there the softmax's sums move (as without the store between runs
    of other n_seq_max)."""
    reqs = _requests()
    args = dict(n_threads=1, **kw)
    base = pl.loglikelihood(model, reqs, **args)
    assert "n_restored" not in base.summary() and base.n_restored is None
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    n = (len(model.tokenize(HEADER)) - 1) // LL_CHUNK * LL_CHUNK  # before the row its own request needs
    first = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(first, base)
    # stored in the first epoch, the shared header is restored in each later one instead of decoded
    assert first.n_restored == n * first.n_epochs and store.stats.chunks_written > 0
    second = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(second, base)
    assert second.n_restored == n * (1 + second.n_epochs) > 0
    assert second.summary()["n_restored"] == second.n_restored
    for r in (first, second):
        assert r.n_decoded == base.n_decoded - r.n_restored and r.n_epochs == base.n_epochs
    assert store.stats.tokens_restored == first.n_restored + second.n_restored
    if kw.get("n_ctx"):
        assert second.n_epochs > 0


def test_loglikelihood_on_a_context_of_one_stream_per_sequence(model, tmp_path):
    reqs = _requests()
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    with _ctx(model, n_seq_max=2, kv_unified=False, n_ctx=256) as ctx:
        base = pl.loglikelihood(ctx, reqs)
        pl.loglikelihood(ctx, reqs, prefix_store=store)
        again = pl.loglikelihood(ctx, reqs, prefix_store=store)
    _same(again, base)
    assert again.n_restored > 0 and again.n_seq == 1


def test_loglikelihood_refuses_what_is_not_a_store_before_any_decode(model, tmp_path):
    with pytest.raises(TypeError, match="PrefixStore"):
        pl.loglikelihood(model, _requests(), prefix_store=str(tmp_path), n_threads=1)


def test_the_lm_eval_backend_takes_a_store_where_model_args_name_it(model, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    def ask(lm):
        reqs = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(_requests())]
        return lm.loglikelihood(reqs, disable_tqdm=True)

    base = ask(PyllamacppLM(model=model, n_ctx=256, n_threads=1))
    # a path, as model_args give it
    lm = PyllamacppLM(model=model, n_ctx=256, n_threads=1, prefix_store=str(tmp_path / "store"))
    assert isinstance(lm.prefix_store, PrefixStore) and lm.prefix_store.chunk_size == 256
    lm.prefix_store.chunk_size = LL_CHUNK  # the header is shorter than 256 tokens
    assert ask(lm) == base and lm.last_stats["n_restored"] == 0
    assert ask(lm) == base and lm.last_stats["n_restored"] > 0


# -- pyllamacpp prefix-store-ttft ---------------------------------------------------------------------
def test_the_ttft_experiment_restores_each_length_and_says_what_it_costs(capsys, tmp_path):
    import json

    from pyllamacpp.cli import main

    argv = ["prefix-store-ttft", "-n", "16,48", "--chunk-size", "16", "--suffix", "3", "-r", "2", "-t", "1"]
    store = tmp_path / "kept"
    assert main(argv + ["-fa", "off", "--store", str(store), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["flash_attn"] == "off" and data["chunk_size"] == 16
    assert [r["n_stored"] for r in data["rows"]] == [16, 48]
    assert [r["chunks"] for r in data["rows"]] == [1, 3] and [r["n_prompt"] for r in data["rows"]] == [19, 51]
    for r in data["rows"]:
        assert r["bit_identical"] and r["greedy_same"]
        assert r["ttft_decoded_ms"] > 0 and r["ttft_restored_ms"] > r["restore_ms"] > 0
        assert r["bytes"] > 0 and r["restore_mb_s"] > 0 and 0 < r["store_share"] < 1
        assert r["chunks_stored"] == r["chunks"]  # each timed save wrote every chunk
    assert len(list(PrefixStore(store, chunk_size=16).backend.chunks())) == 3  # kept: 48 tokens, 3 chunks
    pytest.importorskip("matplotlib")
    png = tmp_path / "ttft.png"
    assert main(argv[:3] + ["-r", "1", "-t", "1", "--chunk-size", "16", "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert "TTFT decoded ms" in out and "restore MB/s" in out and "store % of decode" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_ttft_experiment_refuses_bad_input_before_any_decode(capsys, tmp_path):
    from pyllamacpp.cli import main

    assert main(["prefix-store-ttft", "-n", "20", "--chunk-size", "16"]) == 2
    assert "-n 20 is not a multiple of --chunk-size 16" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert main(["prefix-store-ttft", "-n", "16", "--chunk-size", "16", "--store", str(tmp_path / "f")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_prefill_through_the_store_on_a_plain_cache_restores_decodes_and_stores(model, tmp_path):
    """PrefixStore.prefill on a plain KV cache: restore, Context.prefill of the rest, save; the last
    token's logits are a plain prefill's."""
    toks = model.tokenize(SYSTEM_PROMPT + LISTS[0])
    store = PrefixStore(tmp_path / "store", chunk_size=CHUNK)
    with _ctx(model, n_seq_max=1) as ctx:
        ctx.prefill(toks)
        want = np.array(ctx.logits(-1))
    for restored in (0, ((toks.size - 1) // CHUNK) * CHUNK):  # stored by the first, restored by the second
        with _ctx(model, n_seq_max=1) as ctx:
            assert store.prefill(ctx, 0, toks) == restored
            assert ctx.memory.seq_pos_max(0) == toks.size - 1
            np.testing.assert_array_equal(np.array(ctx.logits(-1)), want)
    assert store.stats.chunks_written == toks.size // CHUNK  # every whole chunk, once
    with _ctx(model, n_seq_max=1) as ctx, pytest.raises(ValueError, match="no tokens"):
        store.prefill(ctx, 0, toks[:0])


LONG_DOCS = [
    "The cat sat on the mat all afternoon, watching the birds in the garden and the clouds above the "
    "old stone wall, until the sun went down behind the hills. ",
    "A dog ran in the park today, chasing a red ball across the wet grass while children laughed and "
    "their parents talked on the benches under the tall trees. ",
    "Numbers come in order: one, two, three, four, five, six, seven, eight, nine and ten, and after "
    "them eleven, twelve, thirteen and fourteen, counted slowly. ",
]


@pytest.mark.parametrize("kw", [{}, {"n_ctx": 160}, {"n_ctx": 128}], ids=["one-epoch", "two-epochs", "tight"])
def test_a_rerun_restores_each_requests_own_stored_chunks_past_the_shared_header(model, tmp_path, kw):
    """A branch whose first nodes another slot holds loads its own copy of them with the stored
    chunks past them (each document's), where the epoch has the cells for the copy; the numbers
    stay bit-identical (flash attention on, n_batch 63)."""
    reqs = [(HEADER + d + "Where? ", " " + a) for d in LONG_DOCS for a in ("home", "a cat")]
    args = dict(n_threads=1, n_seq_max=3, flash_attn="on", **kw)
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    first = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    second = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(first, base)
    _same(second, base)
    header = len(model.tokenize(HEADER))
    own = [len(model.tokenize(HEADER + d + "Where?")) - 1 for d in LONG_DOCS]  # up to each first row
    # every document's whole chunks come from the store: the first branch's with the header, the
    # others' each with its own copy of the header's chunks
    want = sum(n // LL_CHUNK * LL_CHUNK for n in own)
    if kw.get("n_ctx") == 128:  # too few cells for every copy: a branch takes the header from the cache
        assert 0 < second.n_restored < want and second.n_decoded < first.n_decoded
        return
    assert second.n_restored >= want > (header // LL_CHUNK * LL_CHUNK) * (1 + second.n_epochs)
    assert second.n_decoded < first.n_decoded <= base.n_decoded
    # each copy repeats the header's cells (a node held whole), the rest of its chunks were not decoded
    assert second.n_decoded <= base.n_decoded - (want - header * (len(own) - 1))


@pytest.mark.parametrize(("n_ctx", "copies"), [(192, 1), (208, 1), (228, 1), (229, 2)])
def test_copies_of_cached_nodes_take_only_the_cells_the_epoch_has_spare(model, tmp_path, n_ctx, copies):
    """Three branches start together and two of them could load a copy of the header; below 229
    cells the epoch has spare cells for one copy only: the other branch copies the header from the
    cache. 228 is one cell short of the second copy: the first branch's load (no node of it in the
    cache) takes none of the spare cells, and a load that counted one fewer cell for it took the
    second copy and overran the epoch (a second one, 256 tokens restored)."""
    reqs = [(HEADER + d + "Where? ", " home") for d in LONG_DOCS]
    args = dict(n_threads=1, n_seq_max=3, flash_attn="on", n_ctx=n_ctx)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_epochs == base.n_epochs == 0 and second.n_restored == 64 + 64 * copies


def _rerun_with_corrupt_chunks(model, tmp_path, monkeypatch, reqs, args, chunk_size, k, docs):
    """``reqs`` without a store, then stored, then again with the ``k``-th chunk of HEADER + each
    of ``docs`` corrupt (one byte flipped), the memory's seq_cp and seq_rm calls recorded with
    their range as llama.cpp reads it (p0 below 0 is 0, p1 below 0 is -1, to the end): (the first
    results, the last, the store, the calls)."""
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=chunk_size)
    pl.loglikelihood(model, reqs, prefix_store=store, **args)
    with _ctx(model, flash_attn="on") as ctx:  # loglikelihood's identity: flash attention on, one stream
        keys = [store.keys(ctx, model.tokenize(HEADER + d))[k] for d in docs]
    for key in keys:
        f = store.backend.find(key)
        raw = bytearray(f.path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.path.write_bytes(bytes(raw))
    from pyllamacpp.memory import Memory

    calls: list[tuple[str, tuple]] = []

    def read(a: tuple) -> tuple:
        *seqs, p0, p1 = a
        return (*seqs, max(p0, 0), p1 if p1 >= 0 else -1)

    for name in ("seq_cp", "seq_rm"):
        real = getattr(Memory, name)
        monkeypatch.setattr(
            Memory, name, lambda self, *a, _n=name, _r=real: (calls.append((_n, read(a))), _r(self, *a))[1]
        )
    return base, pl.loglikelihood(model, reqs, prefix_store=store, **args), store, calls


def test_a_copy_cut_short_by_a_corrupt_chunk_is_let_go(model, tmp_path, monkeypatch):
    """The lookup found a branch's chunks, but one fails its checksum when read: the load ends
    inside the header the cache holds, so the branch lets go of its partial copy and copies the
    header from the cache; the numbers stay bit-identical."""
    reqs = [(HEADER + d + "Where? ", " home") for d in LONG_DOCS]
    args = dict(n_threads=1, n_seq_max=3, flash_attn="on", n_ctx=256)
    # each document's chunk across the header's end (40 tokens): positions 32-47
    base, second, store, calls = _rerun_with_corrupt_chunks(
        model, tmp_path, monkeypatch, reqs, args, LL_CHUNK, 2, LONG_DOCS
    )
    _same(second, base)
    # the first branch restores 32 tokens and decodes the header's end; each other one finds its
    # 4 chunks by lookup but reads 2 before the corrupt one: 32 loaded, let go
    assert store.stats.corrupt == 3 and second.n_restored == 3 * 32
    # a copy let go, as any branch cut, moves to the graveyard sequence (3: after the 3 slots) before
    # it is cut, so that no cell is free again before the epoch ends
    cuts = [i for i, (n, a) in enumerate(calls) if n == "seq_rm" and a[0] != 3]
    assert len(cuts) >= 2, calls
    assert all(calls[i - 1] == ("seq_cp", (calls[i][1][0], 3, *calls[i][1][1:])) for i in cuts), calls


@pytest.mark.parametrize(("n_ctx", "restored"), [(200, 65 + 39), (256, 65 + 39 + 78)])
def test_a_load_let_go_at_the_end_of_the_cached_nodes_keeps_its_cells_out_of_the_spare(
    model, tmp_path, monkeypatch, n_ctx, restored
):
    """Chunks of 13 tokens: the header node (39 tokens, the request's tokenization of HEADER) is
    3 of them. The first branch's chunk past the header fails its checksum: it restores the
    header, the second branch's load of the header's copy (its lookup found its chunks past it)
    reads exactly the 39 cells the cache holds and is let go, as a load that ends inside them
    is, so the branch copies the header from the cache. Those 39 cells stay taken until the
    epoch ends: the third branch loads its copy only where the epoch has them spare besides (256
    cells, not 200; counting them as spare, a load took that copy at 200 and overran the epoch
    into a second one, every branch restored twice)."""
    reqs = [(HEADER + d + "Where? ", " home") for d in LONG_DOCS]
    args = dict(n_threads=1, n_seq_max=3, flash_attn="on", n_ctx=n_ctx)
    # the first document's chunk past the header: positions 39-51
    base, second, store, calls = _rerun_with_corrupt_chunks(
        model, tmp_path, monkeypatch, reqs, args, 13, 3, LONG_DOCS[:1]
    )
    _same(second, base)
    assert store.stats.corrupt == 1 and second.n_epochs == base.n_epochs == 0
    assert second.n_restored == restored
    # slot 1's copy to the graveyard (3) and cut, then the header from slot 0, before any other
    # (a copy of a sequence into itself, which llama.cpp returns from at once, left out)
    calls = [c for c in calls if not (c[0] == "seq_cp" and c[1][0] == c[1][1])]
    assert calls[:3] == [("seq_cp", (1, 3, 0, -1)), ("seq_rm", (1, 0, -1)), ("seq_cp", (0, 1, 0, 39))], calls


def test_a_load_below_more_than_256_cached_nodes_stops_at_the_node_another_slot_feeds(model, tmp_path):
    """The walk's state set by hand: a path of 265 one-token nodes whole in the cache (slot 0 holds
    them) and a leaf of 45 tokens slot 0 has fed 16 of. Slot 1, given that path, would load past
    the cached nodes only into cells no slot has or feeds: the leaf is slot 0's, so its load ends
    where the cache's nodes end, less than a chunk past them, and the store is not asked. (Compared
    with ``is``, which holds for Python's small ints only, the check at node 265 was skipped: the
    load reached into the leaf slot 0 feeds.)"""
    from pyllamacpp.evaluation._engine import Loglikelihoods
    from pyllamacpp.evaluation._trie import _build, _finish_nodes, _path
    from pyllamacpp.evaluation._walk import _Walk

    chain = np.arange(100, 410, dtype=np.int32)
    root, _ends, leaves = _build([chain[:k] for k in range(1, 266)] + [chain])
    _finish_nodes(root)
    path = _path(leaves[-1])
    assert len(path) == 266 and path[-1].tokens.size == 45
    for node in path[:-1]:
        node.n_dec, node.holders = node.n_feed, {0}
    path[-1].n_dec, path[-1].owner = 16, 0
    store = PrefixStore(tmp_path / "store", chunk_size=16)
    asked: list[int] = []
    real = store.stored
    store.stored = lambda ctx, toks: (asked.append(len(toks)), real(ctx, toks))[1]
    with _ctx(model, n_seq_max=3, n_ctx=1024) as ctx:
        walk = _Walk(ctx, leaves, 2, 2, 1024, Loglikelihoods([None]), store=store)
        walk.paths[1], walk.spare = path, 1024
        walk._restore(1)
        assert asked == [] and walk.held[1] == 0 and path[-1].n_dec == 16 and path[-1].owner == 0


def test_a_stored_context_of_more_than_256_tokens_stops_before_its_last_row(model, tmp_path):
    """A context of 272 tokens (17 chunks) whose last token's row predicts both continuations: the
    store holds all of it, and the rerun restores 16 chunks and decodes the last one, whose last
    row it needs (a token count compared with ``is`` holds only below 257)."""
    text = " ".join(LONG_DOCS)
    words = iter(("and so on", "again", "once more", "then", "still") * 40)
    while len(model.tokenize(text)) < 272:
        text += " " + next(words)
    while len(model.tokenize(text)) % LL_CHUNK:
        text = text[: text.rstrip().rfind(" ")]  # a word fewer, until a whole number of chunks
    size = len(model.tokenize(text))
    assert size > 256 and size % LL_CHUNK == 0
    reqs = [(text, " Yes"), (text, " No")]
    args = dict(n_threads=1, n_seq_max=2, flash_attn="on", n_ctx=512)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_restored == size - LL_CHUNK


@pytest.mark.parametrize(("n_seq_max", "n_ctx", "copies"), [(3, 152, 0), (3, 192, 1), (4, 232, 2)])
def test_a_branch_that_waits_for_the_header_copies_it_only_into_cells_the_epoch_has_spare(
    model, tmp_path, n_seq_max, n_ctx, copies
):
    """The request that ends at the header's last token restores its 32 stored tokens and decodes
    the header's last 8; the branches wait for them, then (the epoch under way, its cells partly
    taken) each loads its own copy of the header with its document's chunks (64 tokens) only where
    the cells the epoch has left, less those the paths in flight will take, hold it."""
    reqs = [(HEADER + d + "Where? ", " home") for d in LONG_DOCS] + [(HEADER, " Yes")]
    args = dict(n_threads=1, n_seq_max=n_seq_max, flash_attn="on", n_ctx=n_ctx)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_epochs == base.n_epochs == 0 and second.n_restored == 32 + 64 * copies


SUN = " in the sun until the evening came"


@pytest.mark.parametrize(
    ("cat", "n_seq_max", "restored"),
    [("", 2, 48), (SUN, 2, 48 + 64), (SUN, 3, 48 + 64)],
    ids=["5-past", "16-past", "16-past-third-slot"],
)
def test_a_branch_whose_first_two_nodes_are_cached_loads_a_copy_only_with_a_chunk_past_them(
    model, tmp_path, cat, n_seq_max, restored
):
    """The header (39 tokens) then "Grass is green." (4 more) are two nodes, as a third request
    branches after the header. The dog's branch restores its 48 stored tokens and is still being fed
    (n_batch 8) when the slot of a one-token request takes the cat's branch: both its first nodes
    are whole in the cache, 43 tokens. It loads its own copy only where the store holds a chunk past
    them: 64 tokens, not 48 (5 past them, and the cache has the 43 to copy). With a third slot the
    cat's branch starts at once in slot 2, above the dog's slot 1: its copy ends inside its third
    node, and it holds both first nodes already (counting one fewer, it copied the second again
    from slot 1 on top of its own cells, and its logits moved)."""
    grass = HEADER + "Grass is green. "
    reqs = [
        ("A", " b"),  # sorted first: its slot is free again after one decode
        (grass + "A dog ran in the park all day, and then slept. Where? ", " home"),
        (grass + f"The cat sat on the mat all day, and then slept{cat}. Where? ", " home"),
        (HEADER + "Stones are hard. Where? ", " home"),  # sorted last: the header is a node of its own
    ]
    sizes = [len(model.tokenize(c)) for c, _ in reqs[1:3]]
    assert len(model.tokenize(HEADER + "Stones")) == 40 and sizes[0] == 59 and sizes[1] in (59, 66)
    args = dict(n_threads=1, n_seq_max=n_seq_max, n_batch=8, flash_attn="on", n_ctx=256)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_epochs == base.n_epochs == 0 and second.n_restored == restored


def test_a_branch_whose_first_three_nodes_are_cached_measures_the_chunk_past_the_third(model, tmp_path):
    """The same with three nodes whole in the cache: the header (39 tokens), "Grass is green." (to
    43) and "Fire is hot." (to 47). The store holds the cat's branch up to 48, one token past the
    third node: no copy is loaded, only the dog's 48 (measured from the second node's end, 43, the
    copy was loaded: 96)."""
    g3 = HEADER + "Grass is green. Fire is hot. "
    reqs = [
        ("A", " b"),
        (g3 + "A dog ran in the park all day, and then slept. Where? ", " home"),
        (g3 + "The cat sat on the mat all day, and then slept. Where? ", " home"),
        (HEADER + "Grass is green. Ice is cold. Where? ", " home"),
        (HEADER + "Stones are hard. Where? ", " home"),
    ]
    assert [len(model.tokenize(t)) for t in (HEADER + "Grass is green. Ice", g3 + "A", reqs[2][0])] == [44, 48, 63]
    args = dict(n_threads=1, n_seq_max=2, n_batch=8, flash_attn="on", n_ctx=256)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_epochs == base.n_epochs == 0 and second.n_restored == 48


def test_a_slot_does_not_claim_the_node_its_load_ends_before(model, tmp_path):
    """Ten requests (found by a differential run against the mutant this holds): slot 2 restores 64
    tokens, the header and the numbers' node, up to the start of "Where? ", whose first token is
    decoded for its row. That node is not slot 2's yet: slot 1, copying the 64 tokens, feeds it in
    the same batch, 6 decodes. (Claimed by the load that holds nothing of it, slot 1 waited a
    batch for it: 7.)"""
    numbers = "Numbers come in order: one, two, three, four, five, six, seven, eight, nine and ten. "
    dog = "A dog ran in the park today, chasing a red ball across the wet grass while children laughed. "
    reqs = [
        (HEADER + "Where? ", " Yes"),
        ("The" + dog + " was", " No"),
        (HEADER + numbers + "Where? ", " a cat"),
        (HEADER + "The cat sat on the mat.  was", " Yes"),
        ("TheThe cat sat on the mat. Who? ", " home"),
        ("AThe cat sat on the mat. Where? ", " home"),
        (HEADER + dog + " was", " a cat"),
        (HEADER + numbers + "Where? ", " Yes"),
        ("TheGrass is green.  was", " home"),
        (HEADER + numbers + "When? ", " a cat"),
    ]
    assert len(model.tokenize(HEADER + numbers.rstrip())) == 4 * LL_CHUNK
    args = dict(n_threads=1, n_seq_max=3, n_batch=16, flash_attn="on", n_ctx=256)
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    pl.loglikelihood(model, [reqs[1], reqs[2]], prefix_store=store, **args)
    again = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(again, base)
    assert again.n_restored == 16 + 32 + 64 and again.n_decodes == 6


def test_a_shared_node_of_more_than_256_tokens_whole_in_the_cache_lets_a_copy_load(model, tmp_path):
    """Two requests of token ids share a context of 303 tokens; the second goes on for 321 more.
    Both stored (chunks of 8), the rerun restores 296 of the shared node into slot 0, decodes its
    last 7 (its last row predicts both continuations), and, the node whole in the cache, loads
    slot 1's own copy of it with the 321 past it: 616 tokens (found by a differential run; a
    token count compared with ``is`` holds only below 257: the node of 303 taken as not whole
    stopped the load, and the 321 were decoded, 331 tokens in all)."""
    shared = list(range(122, 425))
    reqs = [(shared, [425, 426, 427]), (shared + list(range(428, 749)), [749, 750])]
    args = dict(n_threads=1, n_seq_max=2, n_batch=32, flash_attn="on", n_ctx=1024)
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=8)
    pl.loglikelihood(model, reqs, prefix_store=store, **args)
    again = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(again, base)
    assert (again.n_restored, again.n_decoded, again.n_epochs) == (296 + 616, 18, 0)


def test_a_load_stops_at_a_node_another_slot_has_not_fed_whole(model, tmp_path):
    """Four requests of token ids (found by a differential run with long nodes): a shared node of
    69 tokens and branches of 1, 3 and 29 more, and one of 300 apart; the first run stores three
    of them (chunks of 4), the rerun restores 436 tokens and decodes 43, bit for bit as without a
    store. A node held by a slot that has fed only part of it is not whole in the cache: a load
    that took it for whole (``n_dec <= n_feed``) gave other log-probabilities, its counts the same."""
    shared = list(range(402, 471))
    a = (shared + [471], [472])
    b = (shared + list(range(473, 479)), [479, 480, 481])
    c = (shared + list(range(473, 476)) + list(range(482, 490)) + list(range(513, 534)), [534, 535, 536])
    d = (list(range(100, 400)), [400, 401])
    args = dict(n_threads=1, n_seq_max=3, n_batch=8, flash_attn="on", n_ctx=512)
    base = pl.loglikelihood(model, [a, b, c, d], **args)
    store = PrefixStore(tmp_path / "store", chunk_size=4)
    pl.loglikelihood(model, [c, a, d], prefix_store=store, **args)
    again = pl.loglikelihood(model, [a, b, c, d], prefix_store=store, **args)
    _same(again, base)
    assert (again.n_restored, again.n_decoded, again.n_epochs) == (436, 43, 0)


def test_a_path_of_exactly_one_chunk_is_stored(model, tmp_path):
    """A node fed whole stores its path's whole chunks: 15 tokens to feed store none, 16 one (the
    first chunk ends at the node's end; a store that skipped an end of exactly one chunk lost it),
    32 two."""
    for n, chunks in [(15, 0), (16, 1), (32, 2)]:
        store = PrefixStore(tmp_path / f"store{n}", chunk_size=LL_CHUNK)
        res = pl.loglikelihood(model, [(list(range(100, 100 + n)), [200])], prefix_store=store, n_threads=1)
        assert res.n_decoded == n and len(list(store.backend.chunks())) == chunks


def test_a_load_of_exactly_one_chunk_into_an_empty_cache_is_taken(model, tmp_path):
    """17 context tokens and one continuation token: the first run stores a chunk (16 tokens), the
    rerun loads exactly that chunk, up to the row at token 16 it needs, and decodes one token (a
    walk that counted a load with nothing in the cache as starting past one cell found it a
    token short of a chunk and loaded nothing)."""
    req = [(list(range(100, 117)), [200])]
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    first = pl.loglikelihood(model, req, prefix_store=store, n_threads=1)
    second = pl.loglikelihood(model, req, prefix_store=store, n_threads=1)
    _same(second, first)
    assert (first.n_restored, second.n_restored, second.n_decoded) == (0, 16, 1)


def test_a_store_that_holds_only_what_the_cache_holds_is_not_loaded(model, tmp_path):
    """A 48-token node (3 chunks) that slot 1 feeds and stores in the first decode; slot 0 then
    starts a leaf below it. The store holds the node's 3 chunks and nothing of the leaf: no more
    than the cache holds, so the slot copies the node (``seq_cp``) and loads nothing (a walk that
    loaded when the store held exactly what the cache does took 48 cells for a copy it let go)."""
    reqs, args = _two_slots_below_a_head(48)  # slot 0's second: 16 tokens past the head to load
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    res = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(res, base)
    assert (res.n_restored, res.n_decoded, res.n_decodes) == (0, base.n_decoded, base.n_decodes)


def test_the_progress_bar_counts_each_token_once_decoded_or_restored(model, tmp_path, monkeypatch):
    """The bar's total is the trie's tokens to feed; a token restored for a node not scored yet is
    work done, a copy of a node scored already is not: the bar ends at its total, not past it."""
    import tqdm

    ends: list[tuple[int, int]] = []

    class Seen(tqdm.tqdm):
        def close(self):
            ends.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Seen)
    reqs = [(HEADER + d + "Where? ", " home") for d in LONG_DOCS] + [(HEADER, " Yes")]
    args = dict(n_threads=1, n_seq_max=4, flash_attn="on", n_ctx=232, progress=True)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    pl.loglikelihood(model, reqs, prefix_store=store, **args)
    second = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    assert second.n_restored == 32 + 64 * 2  # the header's chunks, then two copies of it with a document's
    assert [n for n, _ in ends] == [t for _, t in ends] and ends[0][1] == ends[1][1] > 0


def test_a_run_with_other_questions_restores_the_shared_header_whole(model, tmp_path):
    """The prefix store's main use: a header of 48 tokens (3 chunks), stored by one run, restored
    by a run with other questions after it. The load ends where the header's node ends; the
    questions are decoded, the numbers bit-identical."""
    header = HEADER + "Grass is green. Fire is hot. Ice"
    n = len(model.tokenize(header))
    assert n == 3 * LL_CHUNK
    args = dict(n_threads=1, n_seq_max=2, flash_attn="on", n_ctx=256)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    pl.loglikelihood(model, [(header + " Where? ", " home")], prefix_store=store, **args)
    reqs = [(header + q, " home") for q in (" Who? ", " When? ")]
    base = pl.loglikelihood(model, reqs, **args)
    again = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(again, base)
    assert again.n_restored == n and again.n_decoded == base.n_decoded - n and again.n_epochs == 0


def test_a_stored_header_of_whole_chunks_stops_before_the_row_its_answers_need(model, tmp_path):
    """The same below 257 tokens: a header of 48 (3 chunks) followed by one-token answers; the
    store holds all 48, the rerun restores 32 and decodes the last chunk for its last row."""
    header = HEADER + "Grass is green. Fire is hot. Ice"
    assert len(model.tokenize(header)) == 3 * LL_CHUNK
    reqs = [(header, " Yes"), (header, " No")]
    args = dict(n_threads=1, n_seq_max=2, flash_attn="on", n_ctx=128)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_restored == 2 * LL_CHUNK


def test_a_stored_leaf_whose_one_continuation_token_ends_it_is_restored_up_to_its_row(model, tmp_path):
    """A leaf of 16 context tokens and one continuation token after a 48-token header: the store
    holds its 4 chunks (64 tokens), the rerun restores the header's 3 and decodes the leaf's 16,
    the last of which has the row that predicts the continuation."""
    header = HEADER + "Grass is green. Fire is hot. Ice"
    tail = " is cold and the wind blows over the hills where the sheep sleep at night now"
    reqs = [(header + tail, " end"), (header + " was", " end")]
    assert len(model.tokenize(header)) == 48 and len(model.tokenize(header + tail)) == 64
    args = dict(n_threads=1, n_seq_max=2, flash_attn="on", n_ctx=256)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_restored == 48


MORE = "Grass is green. Fire is hot. Ice is cold and hard. The night sky is dark and full of stars. Lemons are sour. "


@pytest.mark.parametrize(
    ("more", "n_ctx", "extra", "restored"),
    [("", 228, 1, 256), (MORE + "Sugar is sweet. ", 320, 1000, 512)],
    ids=["one-cell-short", "past-256-cells"],
)
def test_an_epoch_that_runs_out_of_cells_with_a_path_in_flight_starts_another(
    model, tmp_path, monkeypatch, more, n_ctx, extra, restored
):
    """The walk's safety net, reached by a planted fault: each load counted as freeing ``extra``
    cells of the epoch. At 228 cells (the copies test, one cell short of the second copy) the
    third branch loads its copy of the header into a cell a path in flight needs; with a header
    of 73 tokens at 320 cells every copy is loaded. The walk finds every cell taken with a path not
    fed, starts a new epoch, and the numbers stay bit for bit as without a store (the first epoch
    scored something: not a path too long, which the walk raises for). The batch's cap, the cells
    left, binds: 36 of 228 and 16 of 320 (320 - 304; 320 ^ 304 would be 112)."""
    from pyllamacpp.evaluation._walk import _Walk

    reqs = [(HEADER + more + d + "Where? ", " home") for d in LONG_DOCS]
    args = dict(n_threads=1, n_seq_max=3, flash_attn="on", n_ctx=n_ctx)
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    pl.loglikelihood(model, reqs, prefix_store=store, **args)
    real = _Walk._restore

    def restore(self, s):
        used = self.used
        real(self, s)
        if self.used > used:
            self.spare += extra

    monkeypatch.setattr(_Walk, "_restore", restore)
    second = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(second, base)
    assert (second.n_restored, second.n_epochs, base.n_epochs) == (restored, 1, 0)


def test_a_load_that_ends_at_the_end_of_a_node_of_more_than_256_tokens_takes_it_whole(model, tmp_path):
    """A shared context of 320 token ids (20 chunks of 16), then two branches of 5 more and a
    continuation each: the rerun restores the shared node whole, 320 tokens ending exactly at its
    end, and decodes both branches in one decode, bit for bit as without a store. A load whose
    end a count past 256 compared with ``is`` took for short of the node left it to its slot to
    feed (nothing): the other branch waited a decode for it."""
    shared = list(range(1000, 1320))
    reqs = [(shared + list(range(2000, 2005)), [2100]), (shared + list(range(3000, 3005)), [3100])]
    args = dict(n_threads=1, n_seq_max=2, n_batch=32, flash_attn="on", n_ctx=512)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert (second.n_restored, second.n_decoded, second.n_decodes, second.n_epochs) == (320, 10, 1, 0)


def test_a_load_into_a_leaf_stops_before_the_row_of_its_last_fed_token(model, tmp_path):
    """A leaf of 17 context tokens and one continuation token below a 47-token node another slot
    holds: the store holds the leaf's path to its end (64 tokens, 4 chunks, stored by a run of that
    request alone), but the row that predicts the continuation is the leaf's last fed token's, so
    the load stops before it (48 restored) and the slot decodes the rest, bit for bit as without a
    store. A load that read the leaf's wanted rows one short (``want[1 : n | 1]``: at an odd
    n_feed, 17, the last row is not looked at) took all 64 tokens and marked the leaf scored with
    no log-probability for its continuation."""
    reqs, args = _two_slots_below_a_head(47)  # slot 0's second: the head in the cache, 17 more
    base = pl.loglikelihood(model, reqs, **args)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    pl.loglikelihood(model, reqs[2:], prefix_store=store, **args)
    second = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(second, base)
    # the second request loads the head's first 2 chunks (its own past them are not stored); the
    # third's 48 are the head, which the run without a store copied, and its leaf's first token
    assert second.n_restored == 32 + 48 and second.n_decoded == base.n_decoded - 32 - 1


def test_a_copy_below_three_cached_nodes_counts_the_cells_of_all_three(model, tmp_path):
    """Nodes of 16, 8 and 24 tokens (the branch points of four requests, one a slot): the rerun's
    slot 0 loads its path, the three nodes and 16 tokens of its own (64); slot 1 finds all three
    in the cache, 48 cells, and 8 tokens of its own before the row it needs: less than a chunk past
    the cache, so it copies them (seq_cp) and loads nothing. A walk that took the cache's end from
    the second node's length (24 + 8) saw a chunk past it and loaded the 48 tokens it had (112)."""
    h = list(range(100, 148))  # the nodes end at 16, 24 and 48
    reqs = [
        (h[:16] + [300, 301, 302, 303], [501]),
        (h[:24] + [310, 311, 312, 313], [502]),
        (h + list(range(320, 340)), [503]),
        (h + list(range(350, 359)), [504]),
    ]
    args = dict(n_threads=1, n_seq_max=4, flash_attn="on", n_ctx=256)
    second, base = _rerun(model, tmp_path, reqs, **args)
    assert second.n_restored == 64


def test_a_slot_in_flight_loads_nothing_past_the_node_it_fed(model, tmp_path):
    """One slot; a store that holds a 32-token head, a 16-token node and a 40-token leaf below it.
    The slot's first path takes the head from the store; its second keeps the head, feeds the node
    in one decode of 16 and stops there (the batch is full), its leaf not begun. The slot is in
    flight with cells of its own: a load would go into a sequence that holds cells, so it loads only
    when it starts a path with none (or in flight into a new epoch); it decodes the leaf, and the
    numbers are those of a run without a store (a walk that loaded for every slot in flight raised
    the store's "restore into an empty sequence")."""
    head, node, leaf = list(range(100, 132)), list(range(300, 316)), list(range(400, 440))
    reqs = [(head + list(range(200, 208)), [208]), (head + node, [900]), (head + node + leaf, [441])]
    args = dict(n_threads=1, n_seq_max=1, n_batch=16, flash_attn="on", n_ctx=256)
    store = PrefixStore(tmp_path / "store", chunk_size=LL_CHUNK)
    pl.loglikelihood(model, reqs[2:], prefix_store=store, **args)
    base = pl.loglikelihood(model, reqs, **args)
    res = pl.loglikelihood(model, reqs, prefix_store=store, **args)
    _same(res, base)
    assert (res.n_restored, res.n_decoded) == (32, 8 + 16 + 40)
