"""Sampler, generate and generate_parallel against the raw binding and against each other.

generate_parallel samples each sequence at its own output slot of the step's batch: a packing
regression there (a slot's logits flag missing, or set on another slot) makes llama.cpp abort the
process. So its runs are made in a child process (``conftest.call_in_child``) and the test asserts
on what came back: such a regression fails that test, and the rest of the run goes on.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import PROMPT, call_in_child

import pyllamacpp as pl
from pyllamacpp import ffi, lib
from pyllamacpp.generation import ParallelResult


def _raw_greedy(model, tokens, n):
    """Greedy continuation through the raw binding only."""
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_threads, cparams.n_threads_batch = 256, 2, 2
    ctx = lib.llama_init_from_model(model.ptr, cparams)
    batch = lib.llama_batch_init(64, 0, 1)
    out = []
    try:
        toks, pos = list(tokens), 0
        for _ in range(n):
            batch.n_tokens = len(toks)
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(toks) - 1
            assert lib.llama_decode(ctx, batch) == 0
            pos += len(toks)
            logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, -1), model.n_vocab * 4), np.float32)
            nxt = int(np.argmax(logits))
            out.append(nxt)
            toks = [nxt]
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    return out


def test_generate_greedy_equals_raw_binding(model):
    toks = model.tokenize(PROMPT)
    with model.context(n_ctx=256, n_threads=2) as ctx:
        got = list(pl.generate(ctx, toks, 16))
    assert got == _raw_greedy(model, toks, 16)


def test_sampler_chain_is_deterministic_with_a_seed(model):
    toks = model.tokenize(PROMPT)
    runs = []
    for _ in range(2):
        s = pl.Sampler(model).penalties(64, 1.1).top_k(40).top_p(0.95).min_p(0.05).temp(0.9).dist(seed=1234)
        with model.context(n_ctx=256, n_threads=2) as ctx:
            runs.append(list(pl.generate(ctx, toks, 12, s)))
    assert runs[0] == runs[1]
    assert "top_k(40)" in repr(s)


# A prompt whose next-token distribution is flat enough for temperatures to show: the top
# token's probability among the 20 most likely is 0.42 at temp 0.5, 0.21 at 1.0, 0.11 at 2.0.
FLAT = "My favourite colour is"


@pytest.fixture(scope="module")
def flat(model):
    """A context holding FLAT, and its last logits (float64)."""
    with model.context(n_ctx=256, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(model.tokenize(FLAT))
        yield ctx, ctx.logits().astype(np.float64)


def _draws(ctx, sampler, n):
    return np.array([sampler.sample(ctx) for _ in range(n)])


def test_top_k_keeps_only_the_k_most_likely_tokens(flat, model):
    ctx, logits = flat
    top5 = set(np.argsort(-logits)[:5].tolist())
    # hot: at temp 3 the whole vocabulary would spread over thousands of tokens, top-k leaves five
    draws = _draws(ctx, pl.Sampler(model).top_k(5).temp(3.0).dist(7), 300)
    assert set(draws.tolist()) <= top5, sorted(set(draws.tolist()) - top5)
    assert len(set(draws.tolist())) >= 4  # hot enough that the test sees the cut
    # the control: without top-k the same chain leaves the top five
    wide = _draws(ctx, pl.Sampler(model).temp(3.0).dist(7), 300)
    assert len(set(wide.tolist()) - top5) > 100


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_temperature_shapes_the_distribution(flat, model, t):
    """top_k(20) -> temp(t) -> dist draws from softmax(logits[top 20] / t): the draws are far more
    likely under that than under temp 1 (log-likelihood ratio over 400 draws)."""
    ctx, logits = flat
    top = np.argsort(-logits)[:20]

    def logp(temp):
        z = logits[top] / temp
        return dict(zip(top.tolist(), z - z.max() - np.log(np.exp(z - z.max()).sum())))

    draws = _draws(ctx, pl.Sampler(model).top_k(20).temp(t).dist(11), 400)
    at_t, at_1 = logp(t), logp(1.0)
    llr = sum(at_t[x] - at_1[x] for x in draws.tolist())
    # expected 400 x KL(p_t || p_1): 39 nats at 2.0, 103 at 0.5; seen with seed 11: 36.1 and 100.0,
    # and -39.5 and -129.4 for the same seed drawing at temp 1
    assert llr > 20, llr
    freq = float(np.mean(draws == top[0]))
    assert abs(freq - np.exp(at_t[int(top[0])])) < 0.06, freq


def test_temperature_zero_is_greedy(flat, model):
    ctx, logits = flat
    draws = _draws(ctx, pl.Sampler(model).top_k(20).temp(0.0).dist(3), 50)
    assert set(draws.tolist()) == {int(np.argmax(logits))}


def test_grammar_constrains_output(model):
    s = pl.Sampler().grammar(model, 'root ::= "yes" | "no"').pick_greedy()
    with model.context(n_ctx=256, n_threads=2) as ctx:
        out = list(pl.generate(ctx, model.tokenize("Is the sky blue? Answer:"), 4, s))
    text = model.detokenize([t for t in out if not model.is_eog(t)])
    assert text in ("yes", "no")
    with pytest.raises(ValueError):
        pl.Sampler().grammar(model, "root ::= ((")


def _as_data(results: list[ParallelResult]) -> list[dict]:
    """generate_parallel's results as plain data, for the way back from a child."""
    return [dataclasses.asdict(r) for r in results]


def _results(data: list[dict]) -> list[ParallelResult]:
    return [ParallelResult(**d) for d in data]


def _parallel_alone(prompt: str, kv_unified: bool) -> list[dict]:
    """In a child: 4 sequences of 12 tokens."""
    model = pl.Model()
    with model.context(n_ctx=1024, n_seq_max=4, kv_unified=kv_unified, n_threads=2) as ctx:
        return _as_data(pl.generate_parallel(ctx, prompt, 4, 12))


@pytest.mark.parametrize("kv_unified", [True, False])
def test_generate_parallel_equals_each_sequence_alone(model, kv_unified):
    prompt = "Once upon a time"
    results = _results(call_in_child(_parallel_alone, prompt, kv_unified))
    with model.context(n_ctx=256, n_threads=2) as ctx:
        alone = list(pl.generate(ctx, model.tokenize(prompt), 12))
    assert [r.seq_id for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r.tokens == alone
        assert r.finish_reason in ("eog", "n_predict") and r.text
        assert r.finished_by == r.finish_reason  # the former name


# With flash attention off, llama.cpp's CPU kernels gave identical rows of one batch logits that
# differ by up to 0.59 (measured); with it on they were bit-identical, so a same-seed draw is too.
_EXACT = dict(n_ctx=512, kv_unified=True, flash_attn="on", n_threads=2)


def _seeded() -> list[list[dict]]:
    """In a child: seeds 1.. (twice), then one seed for every sequence."""
    model = pl.Model()
    with model.context(n_seq_max=4, **_EXACT) as ctx:
        a = pl.generate_parallel(ctx, "Once upon a time", 4, 12, seed=1)
        ctx.memory.clear()
        b = pl.generate_parallel(ctx, "Once upon a time", 4, 12, seed=1)
        ctx.memory.clear()
        same = pl.generate_parallel(
            ctx, "Once upon a time", 4, 12, lambda i: pl.Sampler(model).top_k(40).temp(1.0).dist(99)
        )
    return [_as_data(a), _as_data(b), _as_data(same)]


def test_generate_parallel_seeds_one_chain_per_sequence():
    a, b, same = (_results(x) for x in call_in_child(_seeded))
    assert len({tuple(r.tokens) for r in a}) == 4  # different seeds: different continuations
    assert [r.tokens for r in a] == [r.tokens for r in b]  # the same seeds: the same ones
    assert len({tuple(r.tokens) for r in same}) == 1  # one seed for all: equal continuations
    for i, r in enumerate(a):
        assert r.seed == 1 + i and r.sampler.endswith(f"dist({1 + i})") and not r.shared_sampler
        assert r.sampler == pl.Sampler.common(1 + i).describe()
    assert {r.sampler for r in same} == {"top_k(40) -> temp(1.0) -> dist(99)"} and same[0].seed == 99


def _penalized(toks: list[int]) -> tuple[list[dict], list[dict], list[int]]:
    """In a child: sequence 0 penalized, 1 greedy; one penalized chain shared; the chain alone."""
    model = pl.Model()

    def penalized():
        return pl.Sampler(model).penalties(64, 1.5).pick_greedy()

    with model.context(n_seq_max=2, **_EXACT) as ctx:
        own = pl.generate_parallel(ctx, toks, 2, 16, [penalized(), pl.Sampler.greedy()])
        ctx.memory.clear()
        shared = pl.generate_parallel(ctx, toks, 2, 16, penalized())
        ctx.memory.clear()
        alone = list(pl.generate(ctx, toks, 16, penalized()))
    return _as_data(own), _as_data(shared), alone


def test_generate_parallel_penalties_never_see_another_sequences_tokens(model):
    """Sequence 0 has a strong repeat penalty; sequence 1, greedy, repeats the prompt. Sequence 0's
    output equals the same chain run alone; with one chain shared by both it does not (so the
    comparison can fail)."""
    toks = model.tokenize(" ".join(["The cat sat on the mat."] * 3))
    own, shared, alone = call_in_child(_penalized, toks.tolist())
    own, shared = _results(own), _results(shared)
    repeated = set(own[1].tokens) & set(alone)
    assert len(repeated) >= 5  # sequence 1 does repeat what the penalty counts in sequence 0
    assert own[0].tokens == alone
    assert shared[0].tokens != alone and shared[0].shared_sampler
    assert own[0].sampler == "penalties(64, 1.5, 0.0, 0.0) -> greedy" and own[1].sampler == "greedy"


def test_generate_parallel_sampler_arguments_are_checked(model):
    with model.context(n_ctx=256, n_seq_max=2, n_threads=2) as ctx:
        s = pl.Sampler.greedy()
        with pytest.raises(ValueError, match="a list of 1 samplers for n_parallel=2"):
            pl.generate_parallel(ctx, "Hi", 2, 2, [s])
        with pytest.raises(ValueError, match="one Sampler object for several sequences"):
            pl.generate_parallel(ctx, "Hi", 2, 2, [s, s])
        with pytest.raises(ValueError, match="one Sampler object for several sequences"):
            pl.generate_parallel(ctx, "Hi", 2, 2, lambda i: s)
        with pytest.raises(TypeError, match="not a Sampler"):
            pl.generate_parallel(ctx, "Hi", 2, 2, [s, "greedy"])
        with pytest.raises(TypeError, match="must be a Sampler"):
            pl.generate_parallel(ctx, "Hi", 2, 2, 42)  # type: ignore[arg-type]
        for spec in ([s, pl.Sampler.greedy()], lambda i: pl.Sampler.greedy(), s):
            with pytest.raises(ValueError, match="does not combine with sampler="):
                pl.generate_parallel(ctx, "Hi", 2, 2, spec, seed=3)
        closed = pl.Sampler.greedy()
        closed.close()
        with pytest.raises(pl.ClosedError):
            pl.generate_parallel(ctx, "Hi", 2, 2, [s, closed])
        assert ctx.memory.seq_pos_max(0) == -1  # every check came before the prompt's decode
        r = pl.generate_parallel(ctx, "Hi", 2, 0)
        assert [x.tokens for x in r] == [[], []] and {x.finish_reason for x in r} == {"n_predict"}


def _one_shared(prompt: list[int]) -> tuple[list[dict], list[int], list[dict], bool]:
    """In a child: one greedy chain for 3 sequences, generate alone, one dist chain for 3;
    and whether the greedy chain was closed."""
    model = pl.Model()
    with model.context(n_seq_max=3, **_EXACT) as ctx:
        g = pl.Sampler.greedy()
        res = pl.generate_parallel(ctx, prompt, 3, 8, g)
        ctx.memory.clear()
        alone = list(pl.generate(ctx, prompt, 8))
        ctx.memory.clear()
        draws = pl.generate_parallel(ctx, prompt, 3, 8, pl.Sampler(model).top_k(40).temp(1.0).dist(99))
    return _as_data(res), alone, _as_data(draws), g.closed


def test_generate_parallel_one_shared_sampler_as_examples_batched(model):
    """One Sampler serves every sequence (examples/batched): greedy gives every sequence the greedy
    continuation; a shared dist chain draws for all sequences from one RNG."""
    prompt = model.tokenize("Once upon a time")
    res, alone, draws, g_closed = call_in_child(_one_shared, prompt.tolist())
    res, draws = _results(res), _results(draws)
    assert not g_closed  # the caller's chain is not closed
    assert all(r.tokens == alone and r.shared_sampler and r.sampler == "greedy" for r in res)
    assert res[0].seed is None and {r.seed for r in draws} == {99}
    assert len({tuple(r.tokens) for r in draws}) > 1  # one RNG, drawn in turn: not the same draws


def test_generate_stops_when_the_context_is_full_and_the_context_goes_on(model):
    """A step that finds no room ends generation with finish_reason "ctx_full" (no exception);
    what was generated up to there is what a roomy context generates, and the context decodes
    afterwards."""
    toks = model.tokenize(" ".join(["The cat sat on the mat."] * 34))  # 238 tokens; greedy repeats it
    with model.context(n_ctx=512, n_threads=2) as roomy:
        want = list(pl.generate(roomy, toks, 24))
    assert not any(model.is_eog(t) for t in want)
    with model.context(n_ctx=256, n_threads=2) as ctx:
        assert ctx.n_ctx == 256
        g = pl.generate(ctx, toks, 24)
        got = list(g)
        assert g.finish_reason == "ctx_full" and g.tokens == got
        assert isinstance(g.error, pl.KVCacheFullError) and g.error.reason  # llama.cpp's reason, kept in C
        # cells 0..255 hold the prompt and every generated token but the last, which found no cell
        assert ctx.memory.seq_pos_max(0) == 255
        assert len(got) == 256 - toks.size + 1 and got == want[: len(got)]
        ctx.memory.clear()
        g = pl.generate(ctx, toks, -1)  # no limit: runs until the context is full too
        assert list(g) == got and g.finish_reason == "ctx_full"
        ctx.memory.clear()
        assert list(pl.generate(ctx, toks, 5)) == want[:5]  # the context decodes afterwards


def test_generate_says_how_it_ended(model):
    toks = model.tokenize(PROMPT)
    with model.context(n_ctx=256, n_threads=2) as ctx:
        g = pl.generate(ctx, toks, 3)
        assert g.finish_reason is None and next(g) == g.tokens[0]
        assert list(g) == g.tokens[1:] and g.finish_reason == "n_predict" and g.error is None
        ctx.memory.clear()
        g = pl.generate(ctx, toks, 0)  # prefill only
        assert list(g) == [] and g.finish_reason == "n_predict" and ctx.memory.seq_pos_max(0) == toks.size - 1
        ctx.memory.clear()
        chat = model.tokenize(
            model.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]),
            parse_special=True,
        )
        g = pl.generate(ctx, chat, 200)
        out = list(g)
        assert g.finish_reason == "eog" and model.is_eog(out[-1]) and len(out) < 200
        ctx.memory.clear()
        with pl.generate(ctx, toks, 50) as g:  # closed early: no reason
            next(g)
        assert g.finish_reason is None
        with pytest.raises(StopIteration):
            next(g)


def test_a_raising_log_handler_during_a_failed_step_surfaces_there(tmp_path, raising_log_handler):

    from pyllamacpp.testing import make_model

    path = make_model(tmp_path / "m.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_vocab=128)

    with pl.Model(path) as m, m.context(n_ctx=256, n_batch=64, n_threads=2) as ctx:
        with raising_log_handler(RuntimeError("handler failed")):
            # a full context ends generation quietly, but not when a handler failed in that step:
            with pytest.raises(pl.KVCacheFullError) as e:  # the step's own error, the handler's as context
                for _ in pl.generate(ctx, np.arange(1, 20, dtype=np.int32), 300):
                    pass
            assert isinstance(e.value.__context__, RuntimeError)
        ctx.memory.clear()
        b = pl.Batch(8, model=m)
        b.add_sequence(np.arange(1, 5), 0, 0, logits="last")
        ctx.decode(b)  # nothing left over to raise here
        assert ctx.memory.seq_pos_max(0) == 3


def test_generate_after_close_raises_and_abort_stops_it(model):
    toks = model.tokenize(PROMPT)
    ctx = model.context(n_ctx=256, n_threads=2)
    g = pl.generate(ctx, toks, 50)
    next(g)
    ctx.close()
    with pytest.raises(pl.ClosedError):
        next(g)
    with model.context(n_ctx=256, n_threads=2) as ctx:
        sampler = pl.Sampler.greedy()
        g = pl.generate(ctx, toks, 50, sampler)
        next(g)
        sampler.close()
        with pytest.raises(pl.ClosedError, match="the sampler is closed"):
            next(g)
        assert sampler.closed
        with pl.Sampler.greedy() as s:
            assert not s.closed and list(pl.generate(ctx, toks, 2, s))
        assert s.closed
        # abort() between steps is not lost: the next decode stops, and its exception says how far
        ctx.memory.clear()
        g = pl.generate(ctx, toks, 50)
        first = [next(g), next(g)]
        ctx.abort()
        with pytest.raises(pl.DecodeAborted) as info:
            next(g)
        assert info.value.seq_pos_max == {0: toks.size}  # prompt + the first token; the second not
        assert len(first) == 2
        assert list(pl.generate(ctx, [first[1]], 3))  # usable afterwards, the flag was consumed


def test_ctrl_c_stops_generate_and_the_context_goes_on(model):
    """SIGINT during a generation step's decode is a DecodeAborted (the C step watches it); one
    that lands between two steps is Python's own KeyboardInterrupt. Either way generation stops
    and the context decodes afterwards."""
    import os
    import signal
    import threading

    toks = model.tokenize("Once upon a time")
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with model.context(n_ctx=512, n_threads=2) as ctx:
            got = []
            with pytest.raises((pl.DecodeAborted, KeyboardInterrupt)) as info:
                for t in pl.generate(ctx, toks, 400):
                    if not got:  # from the first token on: a loaded machine may take 0.2 s to prefill
                        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
                    got.append(t)
            assert 0 < len(got) < 400
            if isinstance(info.value, pl.DecodeAborted):
                assert "SIGINT" in str(info.value)
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            ctx.memory.clear()
            assert list(pl.generate(ctx, toks, 3))[: len(got)] == got[:3]  # got may hold 1 token on a busy machine
    finally:
        signal.signal(signal.SIGINT, before)


def test_public_names_are_not_shadowed_by_submodules():
    import importlib

    importlib.import_module("pyllamacpp.generation")
    importlib.import_module("pyllamacpp.experiments.prefix")
    assert callable(pl.generate) and callable(pl.generate_parallel) and isinstance(pl.Sampler, type)
