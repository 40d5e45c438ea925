"""Scheduler: continuous batching and the prefix cache against requests generated alone.

Greedy equality is claimed with flash attention off, on prompts whose greedy continuation has a
clear winner at every step (top-2 logit margin >= 1.36 over 8 tokens on the default model). With
this 135M model many prompts hit near-ties (margins under 0.1) within 10 tokens; there, decoding
in a batch with other sequences' tokens, or into cells interleaved with theirs, can flip the
greedy choice (measured: a 0.086 margin flipped), which is llama.cpp's numerics, not the scheduler.

The solo-run comparisons run the scheduler in a child process (``conftest.call_in_child``) and
assert on what came back: a packing regression that leaves a sampled row without its logits flag
makes llama.cpp abort the process, and then it fails that test instead of ending the run.
"""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import UbatchAborter, call_in_child, greedy_alone, run_child

import pyllamacpp as pl
from pyllamacpp import ffi
from pyllamacpp.experiments.prefix import LISTS, SYSTEM_PROMPT
from pyllamacpp.scheduler import Event, Request, Scheduler

SYSTEM = SYSTEM_PROMPT  # 34 tokens, then a list to continue
N = 8


def _ctx(model, n_seq_max=3, kv_unified=True, n_ctx=512, **kw):
    return model.context(
        n_ctx=n_ctx,
        n_seq_max=n_seq_max,
        kv_unified=kv_unified,
        flash_attn="off",
        n_threads=1,  # one thread: the suite shares the machine, and ggml's threads spin under load
        n_threads_batch=1,
        **kw,
    )


@pytest.fixture(scope="module")
def solo(model):
    """Each prompt generated alone with ``generate`` (greedy, flash attention off), in a fresh sequence."""
    with _ctx(model, n_seq_max=1) as ctx:
        return greedy_alone(ctx, SYSTEM, LISTS, N)


_REQUEST_FIELDS = (
    "id tokens text finish_reason done seq_id reused_from n_prompt n_prompt_reused "
    "n_prompt_decoded time_to_first_token tokens_per_s n_drafted n_accepted drafted_at accepted_at acceptance_rate"
).split()


def _request_data(r: Request) -> dict:
    """What the solo-run tests read of a finished request, as plain data (from a child)."""
    d = {k: getattr(r, k) for k in _REQUEST_FIELDS}
    d["report_keys"] = list(r.report())
    return d


def _solo_run(kv_unified: bool, prefix_cache: bool) -> dict:
    """In a child: 6 requests over 3 sequences, a 7th submitted after the first event. Returns the
    scheduler's counts before and after, each event as the test reads it, and the requests."""
    model = pl.Model()
    with _ctx(model, kv_unified=kv_unified) as ctx:
        sched = Scheduler(ctx, prefix_cache=prefix_cache)
        reqs = [sched.submit(SYSTEM + q, N) for q in LISTS[:6]]  # 6 requests, 3 sequences
        before = dict(n_waiting=sched.n_waiting, idle=sched.idle)
        events = []
        late = None
        for ev in sched.run():
            events.append(
                dict(
                    types=isinstance(ev, Event) and isinstance(ev.request, Request),
                    request_id=ev.request.id,
                    text=ev.text,
                    finish_reason=ev.finish_reason,
                    request_done=ev.request.done,
                    request_finish_reason=ev.request.finish_reason,
                    n_running=sched.n_running,
                )
            )
            if late is None:  # submitted while iterating, after the first event
                late = sched.submit(SYSTEM + LISTS[6], N)
                reqs.append(late)
        after = dict(
            idle=sched.idle,
            n_tokens=sched.n_tokens,
            n_prompt_decoded=sched.n_prompt_decoded,
            n_prompt_reused=sched.n_prompt_reused,
            cached=sorted(sched.cached().items()),
        )
        return dict(before=before, events=events, after=after, reqs=[_request_data(r) for r in reqs])


@pytest.mark.parametrize(("kv_unified", "prefix_cache"), [(False, False), (True, False), (True, True)])
def test_every_request_equals_its_solo_run(model, solo, kv_unified, prefix_cache):
    run = call_in_child(_solo_run, kv_unified, prefix_cache)
    start, sched = SimpleNamespace(**run["before"]), SimpleNamespace(**run["after"])
    reqs = [SimpleNamespace(**r) for r in run["reqs"]]
    assert start.n_waiting == 6 and start.idle is False
    texts: dict[int, list[str]] = {}
    for ev in (SimpleNamespace(**e) for e in run["events"]):
        assert ev.types  # an Event of a Request
        texts.setdefault(ev.request_id, []).append(ev.text)
        if ev.finish_reason is not None:
            assert ev.request_done and ev.request_finish_reason == ev.finish_reason
        assert ev.n_running <= 3
    assert sched.idle and sched.n_tokens == 7 * N
    for r, q in zip(reqs, LISTS):
        assert r.tokens == solo[q], (q, r)
        assert r.finish_reason == "n_predict" and r.done
        assert r.text == "".join(texts[r.id]) == model.detokenize(r.tokens)
        assert r.n_prompt_reused + r.n_prompt_decoded == r.n_prompt
        assert r.time_to_first_token > 0 and r.tokens_per_s > 0
        assert 0 <= r.seq_id < 3
    assert sched.n_prompt_decoded == sum(r.n_prompt_decoded for r in reqs)
    n_sys = len(model.tokenize(SYSTEM))
    if prefix_cache:
        # the first decodes the system prompt; the others share it at least (two of them waited
        # one step for the first one's prefill instead of decoding it too)
        assert reqs[0].n_prompt_reused == 0
        assert all(r.n_prompt_reused >= n_sys - 1 for r in reqs[1:])
        assert sched.n_prompt_reused == sum(r.n_prompt_reused for r in reqs) > 0
    else:
        assert sched.n_prompt_reused == 0 and all(r.reused_from is None for r in reqs)
        assert dict(sched.cached) == {}  # no cache: finished sequences are freed


def test_prefix_reuse_counts_and_outputs(model, solo):
    q0, q1 = LISTS[0], LISTS[4]  # "1, 2, ..." and "10, 20, ...": they share more than the system prompt
    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx)
        a = sched.submit(SYSTEM + q0, N)
        list(sched.run())
        assert a.n_prompt_reused == 0 and a.n_prompt_decoded == a.n_prompt and a.reused_from is None
        assert sched.cached() == {a.seq_id: a.n_prompt + N - 1}  # the last token is not decoded
        # a new prompt sharing a prefix: the free sequence that holds it is reused in place
        p0, p1 = model.tokenize(SYSTEM + q0), model.tokenize(SYSTEM + q1)
        lcp = int(np.flatnonzero(p0[: min(p0.size, p1.size)] != p1[: min(p0.size, p1.size)])[0])
        b = sched.submit(p1, N)
        list(sched.run())
        assert b.seq_id == a.seq_id and b.reused_from == a.seq_id
        assert b.n_prompt_reused == lcp > 0 and b.n_prompt_decoded == b.n_prompt - lcp
        assert b.tokens == solo[q1]
        # the same prompt again: all of it but the last token is reused
        c = sched.submit(p1, N)
        list(sched.run())
        assert c.n_prompt_reused == c.n_prompt - 1 and c.n_prompt_decoded == 1 and c.tokens == solo[q1]
        # from a RUNNING request: its prompt is copied (seq_cp) into the other sequence
        d = sched.submit(SYSTEM + q0, 20)
        while len(d.tokens) < 3:
            sched.step()
        e = sched.submit(SYSTEM + q0, N)
        list(sched.run())
        assert d.seq_id != e.seq_id and e.reused_from == d.seq_id
        assert e.n_prompt_reused == e.n_prompt - 1 and e.tokens == solo[q0] == d.tokens[:N]
        assert ctx.memory.seq_pos_max(d.seq_id) == d.n_prompt + len(d.tokens) - 2


def test_same_prompts_at_once_wait_for_the_first_prefill(model, solo):
    # four requests with one system prompt submitted together: the first decodes it, the others
    # wait one step for it and share its cells
    with _ctx(model, n_seq_max=4) as ctx:
        sched = Scheduler(ctx)
        reqs = [sched.submit(SYSTEM + q, N) for q in LISTS[:4]]
        list(sched.run())
        n_sys = len(model.tokenize(SYSTEM))
        assert reqs[0].n_prompt_reused == 0
        assert all(r.n_prompt_reused >= n_sys - 1 and r.reused_from == reqs[0].seq_id for r in reqs[1:])
        assert [r.tokens for r in reqs] == [solo[q] for q in LISTS[:4]]


def test_non_unified_reuses_only_its_own_sequence(model, solo):
    with _ctx(model, n_seq_max=2, kv_unified=False) as ctx:
        sched = Scheduler(ctx)
        assert not sched.kv_unified
        a = sched.submit(SYSTEM + LISTS[0], N)
        list(sched.run())
        b = sched.submit(SYSTEM + LISTS[4], N)  # takes a's free sequence, reuses it in place
        c = sched.submit(SYSTEM + LISTS[4], N)  # the other sequence holds nothing: no copy across streams
        list(sched.run())
        assert b.seq_id == a.seq_id and b.n_prompt_reused > 0 and b.reused_from == a.seq_id
        assert c.seq_id != a.seq_id and c.n_prompt_reused == 0 and c.reused_from is None
        assert b.tokens == c.tokens == solo[LISTS[4]]


def test_eog_ends_a_request_and_frees_its_sequence(model):
    prompt = "You are a helpful assistant. Answer briefly and precisely. Name a color."
    with _ctx(model, n_seq_max=1, n_ctx=256) as ctx:
        ref = pl.generate(ctx, model.tokenize(prompt), 20)
        ref_tokens = list(ref)
        assert ref.finish_reason == "eog"  # this prompt's greedy answer is an end-of-generation token
        sched = Scheduler(ctx)
        r = sched.submit(prompt, 20)
        s = sched.submit(SYSTEM + LISTS[0], 3)  # waits for the only sequence
        evs = list(sched.run())
        assert r.tokens == ref_tokens and model.is_eog(r.tokens[-1]) and r.finish_reason == "eog"
        last = [ev for ev in evs if ev.request is r][-1]
        assert last.finish_reason == "eog" and last.token == r.tokens[-1]
        assert s.finish_reason == "n_predict" and len(s.tokens) == 3 and s.seq_id == r.seq_id


def test_n_predict_zero_and_no_limit(model):
    with _ctx(model, n_seq_max=2, n_ctx=256) as ctx:
        sched = Scheduler(ctx)
        r = sched.submit(SYSTEM + LISTS[0], 0)
        evs = list(sched.run())
        assert r.finish_reason == "n_predict" and r.tokens == [] and evs == [Event(r, None, "", "n_predict")]
        assert r.n_prompt_decoded == r.n_prompt and sched.cached() == {r.seq_id: r.n_prompt}
        inf = sched.submit(SYSTEM + LISTS[0], -1)
        for _ in range(5):
            sched.step()
        assert len(inf.tokens) == 5 and not inf.done
        inf.cancel()
        evs = sched.step()
        assert inf.finish_reason == "cancelled" and evs[-1] == Event(inf, None, "", "cancelled")
        assert sched.idle


def test_kv_cache_full_ends_requests_and_the_scheduler_goes_on(model, solo):
    # a grammar with no end: an end-of-generation token is never allowed, so only the cache ends them
    endless = 'root ::= "1, " root'
    with _ctx(model, n_seq_max=2, n_ctx=256, n_batch=256) as ctx:
        n_ctx = ctx.n_ctx
        sched = Scheduler(ctx)
        cached = sched.submit(SYSTEM + LISTS[2], 4)  # leaves cells cached, freed when cells run out
        list(sched.run())
        assert sched.cached()
        long = np.resize(model.tokenize(SYSTEM + LISTS[0]), n_ctx // 2 - 20)
        a = sched.submit(long, -1, sampler=pl.Sampler(model).grammar(model, endless).pick_greedy())
        b = sched.submit(long[::-1], -1, sampler=pl.Sampler(model).grammar(model, endless).pick_greedy())
        evs = list(sched.run())
        assert cached.finish_reason == "n_predict"
        assert a.finish_reason == b.finish_reason == "ctx_full"
        assert isinstance(a.error, pl.KVCacheFullError) and isinstance(b.error, pl.KVCacheFullError)
        assert [ev.token for ev in evs if ev.finish_reason == "ctx_full"] == [None, None]
        # the longer one went first; the other then ran until it alone filled the cache
        assert len(b.tokens) > len(a.tokens) > 0 and b.n_prompt + len(b.tokens) - 1 >= n_ctx - 2 * 32
        assert sched.cached() == {}  # both freed
        # the scheduler and the context go on
        c = sched.submit(SYSTEM + LISTS[0], N)
        list(sched.run())
        assert c.finish_reason == "n_predict" and c.tokens == solo[LISTS[0]]


def test_a_full_cache_ends_the_request_with_the_most_cells_first(model):
    # two endless requests of clearly different lengths (180 and 40 prompt tokens): when the 256
    # cells run out, the longer one ends with ctx_full and the shorter one goes on
    endless = 'root ::= "1, " root'
    long = np.resize(model.tokenize(SYSTEM + LISTS[0]), 180)
    with _ctx(model, n_seq_max=2, n_ctx=256, n_batch=256) as ctx:
        sched = Scheduler(ctx)
        a = sched.submit(long, -1, sampler=pl.Sampler(model).grammar(model, endless).pick_greedy())
        b = sched.submit(long[::-1][:40], -1, sampler=pl.Sampler(model).grammar(model, endless).pick_greedy())
        ended = []
        while not ended:
            ended = [ev.request for ev in sched.step() if ev.finish_reason == "ctx_full"]
        assert ended == [a] and not b.done
        held_a, held_b = a.n_prompt + len(a.tokens) - 1, b.n_prompt + len(b.tokens) - 1
        assert held_a > held_b + 100 and held_a + held_b >= ctx.n_ctx - 2  # the cache was full
        assert sched.cached() == {b.seq_id: held_b}  # a's cells freed, b's kept
        b.cancel()
        list(sched.run())
        assert b.finish_reason == "cancelled"


def test_a_full_cache_evicts_an_idle_cached_prefix_before_ending_a_request(model):
    # a finished request leaves 19 cells cached in its sequence; two live endless requests
    # (prompts sharing nothing with it) fill the cache: those idle cells go first, and only when
    # the cache fills again does a live request end
    endless = 'root ::= "1, " root'
    toks = model.tokenize(SYSTEM + LISTS[0])
    with _ctx(model, n_seq_max=3, n_ctx=256, n_batch=256) as ctx:
        sched = Scheduler(ctx)
        c = sched.submit(toks[:16], 4)
        list(sched.run())
        assert sched.cached() == {c.seq_id: 19}
        a = sched.submit(
            np.resize(toks[::-1], 150), -1, sampler=pl.Sampler(model).grammar(model, endless).pick_greedy()
        )
        b = sched.submit(np.resize(toks[1:], 70), -1, sampler=pl.Sampler(model).grammar(model, endless).pick_greedy())
        evicted_at = None
        while True:
            evs = sched.step()
            if evicted_at is None and c.seq_id not in sched.cached():
                evicted_at = sched.n_steps
            if any(ev.finish_reason == "ctx_full" for ev in evs):
                break
        assert c.seq_id not in (a.seq_id, b.seq_id)  # the live requests ran beside the cache
        assert a.n_prompt_reused == b.n_prompt_reused == 0
        assert evicted_at is not None and evicted_at < sched.n_steps  # evicted at an earlier step
        ended = a if a.done else b
        assert ended is a and not b.done  # then the one with the most cells
        assert a.n_prompt + len(a.tokens) - 1 + b.n_prompt + len(b.tokens) - 1 >= ctx.n_ctx - 2
        b.cancel()
        list(sched.run())


def test_an_abort_in_the_middle_of_a_prefill_is_rolled_back(model, solo):
    # a 48-token prompt in ubatches of 16, aborted in the second: llama.cpp removes that ubatch's
    # positions and keeps the first's, which the scheduler removes; the retry gives the solo tokens
    ab = UbatchAborter()
    with _ctx(model, n_seq_max=2, n_ubatch=16, cb_eval=ab.cb, cb_eval_user_data=ffi.NULL) as ctx:
        ab.ctx = ctx
        sched = Scheduler(ctx)
        r = sched.submit(SYSTEM + LISTS[0], N)
        assert r.n_prompt == 48
        ab.at = ab.n + 2
        with pytest.raises(pl.DecodeAborted) as e:
            sched.step()
        assert e.value.seq_pos_max == {r.seq_id: 15}  # what llama.cpp kept: the first ubatch
        assert ctx.memory.seq_pos_max(r.seq_id) == -1 and sched.cached() == {}  # rolled back
        list(sched.run())
        assert r.tokens == solo[LISTS[0]] and r.n_prompt_decoded == 48


def test_abort_rolls_back_and_the_next_step_retries(model, solo):
    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx)
        r = sched.submit(SYSTEM + LISTS[0], N)
        sched.step()
        sched.step()
        ctx.abort()
        with pytest.raises(pl.DecodeAborted):
            sched.step()
        assert ctx.memory.seq_pos_max(r.seq_id) == r.n_prompt + len(r.tokens) - 2  # nothing of the batch stayed
        list(sched.run())
        assert r.tokens == solo[LISTS[0]]


def test_bad_input_raises_before_any_decode(model):
    with _ctx(model, n_seq_max=2, n_ctx=256) as ctx:
        sched = Scheduler(ctx)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            sched.submit([1, model.n_vocab], 4)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            sched.submit([-1], 4)
        with pytest.raises(ValueError, match="no tokens"):
            sched.submit([], 4)
        with pytest.raises(ValueError, match="must be integers"):
            sched.submit([1.5], 4)
        with pytest.raises(ValueError, match="n_ctx_seq"):
            sched.submit(np.ones(ctx.n_ctx_seq + 1, np.int32), 4)
        with pytest.raises(ValueError, match="n_predict"):
            sched.submit("hi", -2)
        with pytest.raises(TypeError, match="Sampler"):
            sched.submit("hi", 2, sampler="greedy")
        smp = pl.Sampler.greedy()
        sched.submit("hi", 2, sampler=smp)
        with pytest.raises(ValueError, match="another live request"):
            sched.submit("hello", 2, sampler=smp)
        closed = pl.Sampler.greedy()
        closed.close()
        with pytest.raises(pl.ClosedError):
            sched.submit("hi", 2, sampler=closed)
        assert sched.n_steps == 0 and sched.n_waiting == 1
        assert all(ctx.memory.seq_pos_max(s) == -1 for s in range(2))  # nothing was decoded
        list(sched.run())
        sched.submit("hello", 2, sampler=smp)  # its request finished: the sampler is free again
    with pytest.raises(pl.ClosedError):
        sched.submit("hi", 2)


def test_own_sampler_per_request(model):
    with _ctx(model, n_seq_max=3, n_ctx=256) as ctx:
        sched = Scheduler(ctx)
        prompt = "Once upon a time"
        reqs = [sched.submit(prompt, 12, sampler=pl.Sampler(model).temp(1.5).dist(seed)) for seed in (1, 1, 2)]
        list(sched.run())
        assert reqs[0].tokens == reqs[1].tokens  # same seed, same chain: same draws
        assert reqs[0].tokens != reqs[2].tokens


def test_closed_sampler_raises_before_the_decode_and_cancel_goes_on(model, solo):
    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx)
        smp = pl.Sampler.greedy()
        a = sched.submit(SYSTEM + LISTS[1], N, sampler=smp)
        b = sched.submit(SYSTEM + LISTS[0], N)
        sched.step()
        sched.step()
        n_steps, held = sched.n_steps, sched.cached()
        smp.close()
        with pytest.raises(pl.ClosedError):
            sched.step()
        assert sched.n_steps == n_steps and sched.cached() == held  # nothing decoded
        a.cancel()
        list(sched.run())
        assert a.finish_reason == "cancelled" and b.tokens == solo[LISTS[0]]


def test_text_pieces_never_split_a_character(model):
    # the grammar makes it write two emoji; this model spells one as three tokens (f0 9f / 98 / 80)
    with _ctx(model, n_seq_max=1, n_ctx=256) as ctx:
        sched = Scheduler(ctx)
        smp = pl.Sampler(model).grammar(model, 'root ::= "😀😀 ok"').pick_greedy()
        r = sched.submit("Smile:", 12, sampler=smp)
        pieces = [ev.text for ev in sched.run()]
        assert r.text == "".join(pieces) == "😀😀 ok" and r.finish_reason == "eog"
        assert len(r.tokens) > 4 and all("\ufffd" not in p for p in pieces)
        assert "" in pieces  # a token that ended inside a character gave no text


@pytest.mark.parametrize("arch", ["gemma3", "mamba"])
def test_prefix_cache_off_without_a_plain_kv_cache(tmp_path, arch):
    from pyllamacpp.testing import make_model

    kw = dict(n_head=4, n_swa=4, swa_pattern=2) if arch == "gemma3" else dict(ssm_d_conv=4, ssm_d_state=8)
    path = make_model(tmp_path / f"{arch}.gguf", arch, n_layer=2, n_embd=64, n_vocab=128, **kw)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 11, 12], [5, 6]]
    with pl.Model(path) as model:
        with model.context(n_ctx=256, n_seq_max=2, kv_unified=True, flash_attn="off", n_threads=1) as ctx:
            alone = []
            for p in prompts:
                ctx.memory.clear()
                alone.append(list(pl.generate(ctx, p, 6)))
            sched = Scheduler(ctx)
            assert not sched.plain_kv and not sched.prefix_cache
            reqs = [sched.submit(p, 6) for p in prompts]
            list(sched.run())
            assert all(r.n_prompt_reused == 0 and r.n_prompt_decoded == r.n_prompt for r in reqs)
            assert [r.tokens for r in reqs] == alone and sched.cached() == {}


def test_abort_with_a_recurrent_state(tmp_path):
    from pyllamacpp.testing import make_model

    path = make_model(tmp_path / "m.gguf", "mamba", n_layer=2, n_embd=64, n_vocab=128, ssm_d_conv=4, ssm_d_state=8)
    with pl.Model(path) as model, model.context(n_ctx=256, n_seq_max=2, n_threads=1) as ctx:
        alone = list(pl.generate(ctx, [1, 2, 3, 4], 8))
        ctx.memory.clear()
        sched = Scheduler(ctx)
        r = sched.submit([1, 2, 3, 4], 8)
        sched.step()
        sched.step()
        held = r.n_prompt + len(r.tokens) - 1  # positions 0..held-1 before the aborted step
        ctx.abort()
        with pytest.raises(pl.DecodeAborted) as exc:
            sched.step()
        if exc.value.seq_pos_max[r.seq_id] >= held:  # the state moved on: it cannot be cut back
            assert r.finish_reason == "cancelled" and sched.cached() == {} and sched.idle
        else:
            list(sched.run())
            assert r.tokens == alone
        again = sched.submit([1, 2, 3, 4], 8)
        list(sched.run())
        assert again.tokens == alone


# -- drafts ----------------------------------------------------------------------------------------
class _Oracle:
    """Proposes the solo run's continuation: the greedy target accepts every drafted token."""

    def __new__(cls, continuation, n_prompt):
        from pyllamacpp.speculative import Draft

        class Oracle(Draft):
            def draft(self, history, n_max):
                i = len(history) - n_prompt
                return list(continuation)[i : i + n_max]

        return Oracle()


def _wrong():
    """Proposes a token the greedy target never takes here (the last vocabulary id): all rejected."""
    from pyllamacpp.speculative import Draft

    class Wrong(Draft):
        def draft(self, history, n_max):
            return [self.n_vocab - 1] * n_max

        def bind(self, model):
            self.n_vocab = model.n_vocab

    return Wrong()


def _cells(ctx, sched) -> list[tuple[int, int, int]]:
    """``(seq id, its last position, the cells the scheduler says it holds)`` of each sequence."""
    return [(s, ctx.memory.seq_pos_max(s), sched.cached().get(s, 0)) for s in range(sched.n_seq_max)]


def _cells_held(cells) -> None:
    """Each sequence holds exactly the cells the scheduler says (no rejected row left behind)."""
    for s, pos_max, n in cells:
        assert pos_max == n - 1, (s, n)


def _cells_match(ctx, sched):
    _cells_held(_cells(ctx, sched))


def _solo_run_with_drafts(solo: dict[str, list[int]]) -> dict:
    """In a child: 6 requests, drafted by nothing, n-grams, the solo run (an oracle) and a wrong
    token in turn. Returns each request, its oracle's report, the steps each request had an event
    in, and the cells of each sequence after each finishing event and at the end."""
    from pyllamacpp.speculative import NgramDraft

    model = pl.Model()
    with _ctx(model) as ctx:
        sched = Scheduler(ctx)
        reqs, steps, cells = [], {}, []
        for k, q in enumerate(LISTS[:6]):
            prompt = model.tokenize(SYSTEM + q)
            draft = [None, NgramDraft(), _Oracle(solo[q], prompt.size), _wrong()][k % 4]
            reqs.append(sched.submit(prompt, N, draft=draft, n_draft=3))
        for ev in sched.run():
            steps.setdefault(ev.request.id, set()).add(sched.n_steps)
            cells.append(_cells(ctx, sched)) if ev.finish_reason else None
        cells.append(_cells(ctx, sched))
        return dict(
            reqs=[_request_data(r) for r in reqs],
            oracle_report=reqs[2].report(),
            steps={i: sorted(s) for i, s in steps.items()},
            cells=cells,
        )


def test_drafts_keep_every_request_equal_to_its_solo_run(solo):
    run = call_in_child(_solo_run_with_drafts, solo)
    reqs = [SimpleNamespace(**r) for r in run["reqs"]]
    steps = {int(i): s for i, s in run["steps"].items()}
    for cells in run["cells"]:  # after each finishing event, and at the end
        _cells_held(cells)
    for r, q in zip(reqs, LISTS):
        assert r.tokens == solo[q], (q, r)
        assert r.finish_reason == "n_predict"
    plain, ngram, oracle, wrong = reqs[0], reqs[1], reqs[2], reqs[3]
    assert "n_drafted" not in plain.report_keys and plain.acceptance_rate is None
    # all of the oracle's drafts are taken: 8 tokens in 1 + ceil(7 / 4) steps; n_predict caps
    # the last draft (3 tokens to go: 2 drafted)
    assert oracle.n_accepted == oracle.n_drafted == 3 + 2 and oracle.acceptance_rate == 1.0
    assert len(steps[oracle.id]) == 3 and len(steps[plain.id]) == N
    rep = run["oracle_report"]
    assert rep["acceptance_at"] == [1.0, 1.0, 1.0] and rep["n_draft"] == 3
    # one token per step; the last step has none left to draft for (3 + 3 + 3 + 3 + 2 + 1 drafted)
    assert wrong.n_accepted == 0 and wrong.drafted_at[0] == N - 2 and wrong.n_drafted == 15
    assert ngram.n_drafted >= ngram.n_accepted >= 0


NARROW_BATCH = textwrap.dedent("""
    import pyllamacpp as pl
    from pyllamacpp.experiments.prefix import LISTS, SYSTEM_PROMPT
    from pyllamacpp.scheduler import Scheduler
    from pyllamacpp.speculative import Draft

    class Oracle(Draft):  # proposes the solo continuation: every drafted token is taken
        def __init__(self, cont, n_prompt):
            self.cont, self.n_prompt = cont, n_prompt

        def draft(self, history, n_max):
            i = len(history) - self.n_prompt
            return self.cont[i : i + n_max]

    m = pl.Model()
    kw = dict(n_ctx=512, kv_unified=True, flash_attn="off", n_threads=1, n_threads_batch=1)
    prompts = [m.tokenize(SYSTEM_PROMPT + q) for q in LISTS[:3]]
    with m.context(n_seq_max=1, **kw) as ctx:
        solo = []
        for p in prompts:
            ctx.memory.seq_rm(-1)
            solo.append(list(pl.generate(ctx, p, 8)))
    # n_batch 4 and three generating sequences: one row left per step for all drafts together
    with m.context(n_seq_max=3, n_batch=4, n_ubatch=4, **kw) as ctx:
        sched = Scheduler(ctx)
        reqs = [sched.submit(p, 8, draft=Oracle(c, p.size), n_draft=8) for p, c in zip(prompts, solo)]
        widths = []
        while not sched.idle:
            sched.step()
            widths.append(sched._batch.n_tokens)
        assert max(widths) <= 4, widths
        assert [r.tokens for r in reqs] == solo
        assert sum(r.n_drafted for r in reqs) > 0 and all(r.acceptance_rate in (None, 1.0) for r in reqs)
        for s in range(3):
            assert ctx.memory.seq_pos_max(s) == sched.cached().get(s, 0) - 1
    print("OK")
""")


def test_drafts_take_only_the_rows_the_batch_has_left():
    # in a child: drafts written past the batch's n_batch rows would overrun its C arrays
    assert run_child(NARROW_BATCH).stdout.endswith("OK\n")


def test_drafts_give_way_when_the_cache_is_full(model):
    # two endless "1, 1, ..." requests with n-gram drafts (nearly all accepted): when the cells
    # run out, the step is retried without drafts first, so the cache fills to its last cells
    from pyllamacpp.speculative import NgramDraft

    endless = 'root ::= "1, " root'
    long = np.resize(model.tokenize(SYSTEM + LISTS[0]), 180)
    with _ctx(model, n_seq_max=2, n_ctx=256, n_batch=256) as ctx:
        sched = Scheduler(ctx)
        g = lambda: pl.Sampler(model).grammar(model, endless).pick_greedy()  # noqa: E731
        a = sched.submit(long, -1, g(), draft=NgramDraft(), n_draft=6)
        b = sched.submit(long[::-1][:40], -1, g(), draft=NgramDraft(), n_draft=6)
        ended, most = [], 0
        while not ended:
            ended = [ev.request for ev in sched.step() if ev.finish_reason == "ctx_full"]
            most = max(most, sum(sched.cached().values()))
        assert ended == [a] and not b.done
        assert a.n_accepted > 10 and b.n_accepted > 0  # the drafts did run
        # every cell was used before a ended: a step without room for its drafts ran without them
        assert most == ctx.n_ctx
        assert sched.cached() == {b.seq_id: b.n_prompt + len(b.tokens) - 1}
        _cells_match(ctx, sched)
        b.cancel()
        list(sched.run())


def test_bad_drafts_are_refused_before_any_decode(model, tmp_path):
    from pyllamacpp.speculative import NgramDraft
    from pyllamacpp.testing import make_model

    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx)
        d = NgramDraft()
        with pytest.raises(TypeError, match="Draft"):
            sched.submit(SYSTEM, 4, draft=object())
        with pytest.raises(ValueError, match="n_draft"):
            sched.submit(SYSTEM, 4, draft=d, n_draft=0)
        r = sched.submit(SYSTEM, 4, draft=d)
        with pytest.raises(ValueError, match="another live request"):
            sched.submit(SYSTEM, 4, draft=d)
        list(sched.run())
        assert r.finish_reason == "n_predict"
        sched.submit(SYSTEM, 2, draft=d)  # free again once that request ended
        list(sched.run())
    path = make_model(tmp_path / "m.gguf", "mamba", n_layer=2, n_embd=64, n_vocab=128, ssm_d_conv=4, ssm_d_state=8)
    with pl.Model(path) as m, m.context(n_ctx=256, n_seq_max=2, n_threads=1) as ctx:
        with pytest.raises(ValueError, match="drop a suffix"):
            Scheduler(ctx).submit([1, 2, 3], 4, draft=NgramDraft())


# -- behaviours held against the mutants of a sample (issue 28: tools/mutation/run.py scheduler-drafts)


class _Fixed:
    """A draft (pyllamacpp.speculative.Draft) proposing the same tokens every step."""

    def __new__(cls, tokens):
        from pyllamacpp.speculative import Draft

        class Fixed(Draft):
            def draft(self, history, n_max):
                return list(tokens)[:n_max]

        return Fixed()


def test_a_draft_outside_the_vocabulary_is_refused_and_token_0_is_not(model):
    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx)
        sched.submit(SYSTEM, 4, draft=_Fixed([-1]))
        with pytest.raises(ValueError, match=r"proposed token -1, outside the vocabulary \[0, 49152\)"):
            list(sched.run())
    with _ctx(model, n_seq_max=2) as ctx:
        sched = Scheduler(ctx)
        r = sched.submit(SYSTEM, 4, draft=_Fixed([0, 0]))
        list(sched.run())
        assert r.finish_reason == "n_predict" and r.n_drafted > 0


def test_drafts_stop_one_short_of_the_sequences_last_cell(model, caplog):
    """Near the end of its cells a request drafts only as many tokens as positions remain after
    the pending one: it fills its sequence to the last cell and ends ctx_full, with one failed
    decode only (the last token's, which has no cell left) and no step retried without drafts."""
    prompt = np.resize(model.tokenize(SYSTEM + LISTS[0]), 240)
    with _ctx(model, n_seq_max=1, n_ctx=256, n_batch=256) as ctx:
        sched = Scheduler(ctx)
        r = sched.submit(prompt, -1, pl.Sampler.greedy(), draft=_Fixed([11] * 8), n_draft=8)
        with caplog.at_level("WARNING", logger="pyllamacpp.llama"):
            list(sched.run())
        assert r.finish_reason == "ctx_full"
        assert r.n_prompt + len(r.tokens) == 256 + 1  # the last sampled token needs no cell
    failed = [m for m in caplog.messages if "failed to find a memory slot" in m]
    assert failed == ["decode: failed to find a memory slot for batch of size 1"], failed


def test_a_prefill_shares_the_step_with_a_generating_request(model):
    """One generating request takes one row of the step's batch; a prompt prefilled in the same
    step gets the other n_batch - 1."""
    with _ctx(model, n_seq_max=2, n_batch=32) as ctx:
        sched = Scheduler(ctx, prefix_cache=False)
        a = sched.submit(model.tokenize(SYSTEM)[:8], 20, pl.Sampler.greedy())
        sched.step()
        assert len(a.tokens) == 1
        b = sched.submit(np.resize(model.tokenize(SYSTEM + LISTS[1]), 100), 4, pl.Sampler.greedy())
        sched.step()
        assert len(a.tokens) == 2 and b._i == 31  # prompt tokens fed so far


def _flagless_run() -> str:
    """A scheduler whose work orders lose every logits flag after add_trusted; what it raised."""
    from pyllamacpp import packing

    trusted = packing.WorkOrder.add_trusted

    def flagless(self, *a, **k):
        out = trusted(self, *a, **k)
        self.batch._logits[:] = 0  # every slot added so far loses its flag
        return out

    packing.WorkOrder.add_trusted = flagless
    with pl.Model() as model, _ctx(model) as ctx:
        sched = Scheduler(ctx)
        sched.submit(SYSTEM_PROMPT + LISTS[0], 4)
        try:
            list(sched.run())
        except RuntimeError as e:
            return str(e)
    return "nothing raised"


def test_a_batch_slot_without_its_logits_flag_raises_instead_of_aborting():
    """The sampler aborts the process (GGML_ASSERT) on a row llama_decode did not output; the
    scheduler checks the slot's logits flag first, so a packing fault is a RuntimeError. Run in a
    child: without the check the abort would end the pytest run."""
    assert "has no logits to sample from" in call_in_child(_flagless_run)
