"""pyllamacpp.evaluation on the real library and the default model: the loglikelihood engine
against each request decoded on its own (bit for bit below flash attention's 64-row tile), the
trie's counts, lm-eval's tokenization at the boundary, bad input, Ctrl-C, progress; and, where
lm-eval is installed, the lm-evaluation-harness backend run by lm-eval itself on local tasks."""

from __future__ import annotations

import io
import re
import signal
import sys
import time

import numpy as np
import pytest
from conftest import call_in_child

import pyllamacpp as pl
from pyllamacpp.batch import Batch
from pyllamacpp.evaluation._engine import encode_pair
from pyllamacpp.scoring import log_softmax

T = {"n_threads": 1, "n_threads_batch": 1}  # the machine is shared: one thread each
HEADER = (
    "The following are questions with their answers.\n\n"
    "Question: What is 12 plus 7?\nAnswer: 19\n\n"
    "Question: What is the capital of Italy?\nAnswer: Rome\n\n"
)
QUESTIONS = {
    "What is the capital of France?": [" Paris", " Berlin", " Madrid", " the city of Lyon"],
    "What is the capital of Spain?": [" Paris", " Madrid", " Lisbon", " Rome"],
    "What is 20 plus 5?": [" 25", " 24", " 35", " twenty-five"],
    "How many legs has a spider?": [" eight", " six", " four", " ten legs"],
}


def few_shot() -> list[tuple[str, str]]:
    reqs = [(f"{HEADER}Question: {q}\nAnswer:", c) for q, cs in QUESTIONS.items() for c in cs]
    # a duplicate, a context with a trailing space, and a continuation that extends another
    return [*reqs, reqs[0], (f"{HEADER}Question: What is 20 plus 5?\nAnswer: ", "25"), (reqs[0][0], " Paris is")]


def alone(model, pairs, n_batch=63, **kw):
    """Each ``(tokens, n_context)`` decoded on its own (memory cleared: cells from 0), logits at
    the continuation's rows: ``[(logprobs, greedy flags)]``."""
    longest = max(s.size for s, _ in pairs)
    out = []
    with model.context(n_ctx=longest, n_batch=n_batch, n_ubatch=n_batch, **{**T, **kw}) as ctx:
        batch = Batch(n_batch, 1, model=model)
        for seq, c in pairs:
            ctx.memory.clear()
            feed, lps, greedy = seq[:-1], [], []
            for b0 in range(0, feed.size, n_batch):
                j = np.arange(b0, min(b0 + n_batch, feed.size))
                mask = j >= c - 1
                batch.clear()
                batch.add_sequence(feed[j], 0, b0, logits=mask)
                ctx.decode(batch)
                if mask.any():
                    t = seq[j[mask] + 1]
                    r = log_softmax(ctx.logits_all(), t, argmax=True, n_threads=1)
                    lps.append(r.target)
                    greedy.append(r.argmax == t)
            out.append((np.concatenate(lps), np.concatenate(greedy)))
    return out


def pairs_of(model, reqs):
    out = []
    for c, x in reqs:
        ct, xt = encode_pair(model, c, x)
        out.append((np.concatenate([ct, xt]), int(ct.size)))
    return out


@pytest.fixture(scope="module")
def reference(model):
    reqs = few_shot()
    return reqs, alone(model, pairs_of(model, reqs))


@pytest.mark.parametrize("n_seq_max", [1, 3, 16])
def test_each_request_equals_it_decoded_alone_bit_for_bit(model, reference, n_seq_max):
    reqs, ref = reference
    res = pl.loglikelihood(model, reqs, n_seq_max=n_seq_max, **T)
    assert len(res) == len(reqs)
    for r, (lps, greedy) in zip(res, ref):
        assert np.array_equal(r.logprobs, lps)  # exact: same kernel, cells in the same order
        assert r.logprob == float(lps.sum()) and r.is_greedy == bool(greedy.all())
        assert r.n_tokens == lps.size == r.tokens.size
    assert res[0].logprob > res[1].logprob  # Paris over Berlin after "capital of France"
    assert res.n_seq == min(n_seq_max, res.n_nodes) and res.n_epochs == 0 and res.n_redecoded == 0


def test_epochs_when_the_cells_run_out_keep_the_results(model, reference):
    reqs, ref = reference
    longest = max(s.size - 1 for s, _ in pairs_of(model, reqs))
    res = pl.loglikelihood(model, reqs, n_ctx=longest + 8, n_seq_max=4, **T)
    assert res.n_epochs >= 2 and res.n_redecoded > 0  # the header decoded again in each epoch
    for r, (lps, _) in zip(res, ref):
        assert np.array_equal(r.logprobs, lps)


def test_a_new_epoch_has_exactly_n_ctx_cells(model):
    """Three requests of token ids, nothing shared: 200, 129 and 128 tokens to feed in 256 cells.
    The first fills its epoch; the second and third need 257 together, one cell more than an
    epoch has, so each gets an epoch of its own (a new epoch counting from -1 took both into one
    and fed 257 tokens into 256 cells)."""
    rng = np.random.default_rng(7)
    reqs = [
        (np.concatenate([[first], rng.integers(100, 5000, n - 1)]).astype(np.int32), np.array([42], np.int32))
        for first, n in ((10, 200), (20, 129), (30, 128))
    ]
    res = pl.loglikelihood(model, reqs, n_ctx=256, n_seq_max=3, **T)
    assert res.n_ctx == 256 and res.n_decoded == 200 + 129 + 128 and res.n_epochs == 2
    for r, (lps, _) in zip(res, alone(model, [(np.concatenate(q), q[0].size) for q in reqs])):
        assert np.array_equal(r.logprobs, lps)


def test_a_continuation_scored_against_another_prefix_would_be_seen(model, reference):
    # the comparison above is sharp enough: the same endings after another question differ by far
    # more than 0 (they would, if the trie mixed up two branches of one node)
    reqs, ref = reference
    swapped = [(reqs[4][0], x) for _, x in reqs[:4]]  # France's endings after Spain's question
    other = alone(model, pairs_of(model, swapped))
    diffs = [abs(float(a[0].sum() - b[0].sum())) for a, b in zip(other, ref[:4])]
    assert min(diffs) > 0.01, diffs
    res = pl.loglikelihood(model, reqs + swapped, n_seq_max=16, **T)
    for r, (lps, _) in zip(res[len(reqs) :], other):
        assert np.array_equal(r.logprobs, lps)


def test_counts_sharing_and_results(model):
    reqs = few_shot()
    res = pl.loglikelihood(model, reqs, **T)
    pairs = pairs_of(model, reqs)
    # the duplicate, and "Answer: " + "25" (its space moved: " 25"'s tokens) are scored once
    assert res.n_requests == len(reqs) and res.n_unique == len(reqs) - 2
    assert res[len(QUESTIONS) * 4] is res[0]
    assert np.array_equal(res[-2].logprobs, res[8].logprobs) and res[-2].n_bytes == 2 and res[8].n_bytes == 3
    assert res.n_unshared == sum(s.size - 1 for s, _ in pairs)
    # each distinct token position decoded once: the trie's tokens, less each leaf's last
    uniq = {(s.tobytes(), c): (s, c) for s, c in pairs}
    prefixes = {tuple(s[: i + 1]) for s, _ in uniq.values() for i in range(s.size)}
    leaves = {tuple(s) for s, _ in uniq.values()} - {p[:-1] for p in prefixes}
    assert res.n_decoded == len(prefixes) - len(leaves)
    assert res.n_decoded < res.n_unshared / 5  # the header once, not 19 times
    # one row per distinct prefix that predicts a continuation token
    rows = {tuple(s[: i + 1]) for s, c in uniq.values() for i in range(c - 1, s.size - 1)}
    assert res.n_outputs == len(rows)
    # room for all of it in one batch: the slots join the nodes they share, all in one decode
    one = pl.loglikelihood(model, reqs, n_batch=res.n_decoded, n_seq_max=16, **T)
    assert one.n_decodes == 1 and one.n_decoded == res.n_decoded
    r = res[3]
    assert r.n_bytes == len(" the city of Lyon") and r.n_tokens == len(model.tokenize(" the city of Lyon", False))
    assert res[-2].n_bytes == 2  # "25" as given; the space moved from the context is not counted
    assert list(res[0]) == [res[0].logprob, res[0].is_greedy]  # lm-eval's (logprob, is_greedy)
    # tokens in, the same result
    tok = pl.loglikelihood(model, [(pairs[0][0][: pairs[0][1]], pairs[0][0][pairs[0][1] :])], **T)
    assert np.array_equal(tok[0].logprobs, res[0].logprobs)
    assert tok[0].n_bytes == len(" Paris")


def test_tokenization_at_the_boundary_is_lm_evals(model):
    model_mod = pytest.importorskip("lm_eval.api.model")

    class Tok(model_mod.TemplateLM):
        def __init__(self):
            super().__init__()

        eot_token_id = property(lambda self: model.eos)

        def tok_encode(self, string, add_special_tokens=None, **kw):
            return model.tokenize(string).tolist()

        loglikelihood_rolling = generate_until = _loglikelihood_tokens = None

    Tok.__abstractmethods__ = frozenset()
    lm = Tok()
    for c, x in [
        ("Question: 2+2?\nAnswer:", " 4"),
        ("Question: 2+2?\nAnswer: ", "4"),  # the space moves to the continuation
        ("Answer:  ", " four"),
        ("The word is un", "believable"),  # a merge across the boundary
        ("x", "\n\nnext"),
        ("Count: 12 ", "34"),  # only the space moves (digits are tokens one by one: a digit more would show)
    ]:
        ctx, cont = encode_pair(model, c, x)
        want = lm._encode_pair(c, x)
        assert (ctx.tolist(), cont.tolist()) == (list(want[0]), list(want[1])), (c, x)
    # the empty context: the prefix token (BOS here), as lm-eval's loglikelihood does
    ctx, cont = encode_pair(model, "", "Hello")
    assert ctx.tolist() == [model.bos] and cont.tolist() == model.tokenize("Hello", False).tolist()


def test_all_trailing_whitespace_of_the_context_moves_to_the_continuation(model):
    # issue 36, section 2: newlines and tabs too, not only spaces (lm-eval's context.rstrip())
    for c, x in [("Question: 2+2?\nAnswer:\n", "4"), ("Answer:\t", "4"), ("Answer: \n\t", "four")]:
        tail = c[len(c.rstrip()) :]
        want_ctx = model.tokenize(c.rstrip(), True)
        want_cont = model.tokenize(c.rstrip() + tail + x, True)[want_ctx.size :]
        ctx, cont = encode_pair(model, c, x)
        assert (ctx.tolist(), cont.tolist()) == (want_ctx.tolist(), want_cont.tolist()), (c, x)
        # through the engine too, twice with one context (the second from its cache of contexts)
        res = pl.loglikelihood(model, [(c, x), (c, x + "!")], **T)
        assert res[0].n_context == want_ctx.size and res[0].tokens.tolist() == want_cont.tolist(), (c, x)
        assert res[1].n_context == want_ctx.size and res[1].tokens[:1].tolist() == want_cont[:1].tolist()
    # the same tokens from a space moved and a space given are one request to decode, each with its
    # own bytes whichever comes first (the first's kept for a longer second passed every test)
    for reqs, n_bytes in [
        ((("Paris is ", "big"), ("Paris is", " big")), [3, 4]),
        ((("Paris is", " big"), ("Paris is ", "big")), [4, 3]),
    ]:
        res = pl.loglikelihood(model, list(reqs), **T)
        assert res.n_unique == 1 and [r.n_bytes for r in res] == n_bytes and res[0].logprob == res[1].logprob


def test_a_context_that_ends_inside_a_node_asks_rows_only_for_the_continuation(model):
    # issue 36, section 2: each request's context ends inside its leaf (the endings follow different
    # questions): n_outputs is the continuation tokens, not every row of the node
    reqs = [("The capital of France is", " Paris, the city of light"), ("The capital of Spain is", " Madrid")]
    res = pl.loglikelihood(model, reqs, **T)
    assert res.n_nodes == 3  # the shared start, then one leaf per request holding context and continuation
    assert res.n_outputs == sum(r.n_tokens for r in res) == len(model.tokenize(" Paris, the city of light", False)) + 1
    ref = alone(model, pairs_of(model, reqs))
    for r, (lps, _) in zip(res, ref):
        assert np.array_equal(r.logprobs, lps)


def test_the_same_tokens_split_at_two_context_lengths_are_two_requests(model):
    # issue 36, section 2: (X, Y) and (X + Y[0], Y[1:]) are one path in the trie, two results
    x = model.tokenize("The capital of France is", True)
    y = model.tokenize(" Paris, of course", False)
    res = pl.loglikelihood(model, [(x, y), (np.concatenate([x, y[:1]]), y[1:]), (x, y)], **T)
    assert res.n_requests == 3 and res.n_unique == 2 and res.n_nodes == 1
    assert (res[0].n_context, res[0].n_tokens) == (x.size, y.size) and res[2] is res[0]
    assert (res[1].n_context, res[1].n_tokens) == (x.size + 1, y.size - 1)
    assert np.array_equal(res[1].logprobs, res[0].logprobs[1:])
    assert res[1].logprob == float(res[0].logprobs[1:].sum()) and res[1].logprob > res[0].logprob


def test_bad_input_is_refused_before_any_decode(model):
    with model.context(n_ctx=128, n_seq_max=2, kv_unified=True, **T) as ctx:
        ctx.prefill(model.tokenize("kept"), 0)
        bad = [
            ([("a context", "")], ValueError, "continuation is empty"),
            ([("a context", np.str_(""))], ValueError, "continuation is empty"),  # empty, of a str subclass
            ([(" ", "x")], ValueError, "context has no tokens"),  # all of it moved to the continuation
            ([([1, 2], [])], ValueError, "continuation.* no tokens"),
            ([([], [5])], ValueError, r"context has no tokens \(give at least one, e.g. BOS\)"),
            ([([1, 2], [10**6])], ValueError, "outside the vocabulary"),
            ([([1, -1], [5])], ValueError, "outside the vocabulary"),
            ([([1, model.n_vocab], [5])], ValueError, "a context token is outside the vocabulary"),
            ([([1, model.n_vocab + 1], [5])], ValueError, "a context token is outside the vocabulary"),
            ([(np.array(5), [6])], TypeError, "1-D array of token ids"),  # a 0-d array is not a sequence
            ([(np.ones((2, 2), int), [6])], TypeError, "1-D array of token ids"),
            ([("a", [5])], TypeError, "must both be str or both token ids"),
            (["just a string"], TypeError, "not a \\(context, continuation\\) pair"),
            ([("only a context",)], TypeError, "not a \\(context, continuation\\) pair"),
            ([("a context", " one", " two")], TypeError, "not a \\(context, continuation\\) pair"),
            (["ab"], TypeError, "not a \\(context, continuation\\) pair"),  # a str of two characters
            ("a, b", TypeError, "list of"),
            ([("word " * 300, " end")], ValueError, r"needs 30\d tokens .*, \d+ more than n_ctx=256"),
        ]
        for reqs, exc, match in bad:
            with pytest.raises(exc, match=match):
                pl.loglikelihood(ctx, reqs)
            assert ctx.memory.seq_pos_max(0) == 1  # nothing was decoded, nothing cleared
        with pytest.raises(ValueError, match="for a Model"):
            pl.loglikelihood(ctx, [("a", " b")], n_batch=8)
    with pytest.raises(TypeError, match="Model or a Context"):
        pl.loglikelihood("model.gguf", [("a", " b")])
    n = model.n_ctx_train
    with pytest.raises(ValueError, match=f"more than n_ctx_train={n}"):
        pl.loglikelihood(model, [(list(range(5, n + 6)), [7])])
    with pytest.raises(ValueError, match=r"request 0 needs 11 tokens in the cache \(9 of context, 3 of continuation, "
                       r"less the last\), 3 more than n_ctx=8"):  # fmt: skip
        pl.loglikelihood(model, [(list(range(5, 14)), [7, 8, 9])], n_ctx=8)
    with pytest.raises(ValueError, match=r"needs 11 tokens in the cache \(5 of context, 7 of continuation, "
                       r"less the last\), 5 more than n_ctx=6"):  # fmt: skip
        pl.loglikelihood(model, [(list(range(5, 10)), list(range(7, 14)))], n_ctx=6)  # 7, not 12 % 5; 5, not 11 ^ 6
    assert len(pl.loglikelihood(model, [(list(range(5, 13)), [7])], n_ctx=8, **T)) == 1  # 8 fit 8: no refusal
    assert len(pl.loglikelihood(model, [(list(range(5, 14)), [7])], n_ctx=9, **T)) == 1  # 10 tokens: 9 fit 9


def test_the_same_300_tokens_split_at_two_context_lengths_keep_both_continuations(model):
    """One node of 300 tokens holds two requests' continuations (split after token 10 and after
    token 200): the rows of both are marked, each request as scored alone (a node longer than 256
    tokens whose marks a size compared with ``is`` reset lost the first request's rows)."""
    seq = list(range(1000, 1300))
    reqs = [(seq[:10], seq[10:]), (seq[:200], seq[200:])]
    both = pl.loglikelihood(model, reqs, **T)
    for r, req in zip(both, reqs):
        alone = pl.loglikelihood(model, [req], **T)[0]
        assert r.n_tokens == alone.n_tokens and np.array_equal(r.logprobs, alone.logprobs)


def test_sizes_below_1_are_refused_and_n_batch_1_decodes_one_sequence(model, reference):
    """A size below 1 is refused by name (n_batch 0 was "n_seq_max 2 is more than the 0 outputs",
    n_seq_max 0 ran with 1). n_batch 1 leaves llama.cpp one output row, room for one sequence: one
    slot without a graveyard, bit for bit as the default (n_batch 2 has the graveyard)."""
    for name in ("n_ctx", "n_batch", "n_seq_max", "n_threads"):
        for v in (0, -1):
            with pytest.raises(ValueError, match=f"loglikelihood: {name} must be positive, not {v}"):
                pl.loglikelihood(model, [("a", " b")], **{**T, name: v})
    reqs, ref = reference
    for n_batch in (1, 2):
        res = pl.loglikelihood(model, reqs[:6], n_batch=n_batch, **T)
        assert res.n_seq == 1 and res.n_decodes >= res.n_decoded / n_batch  # at most n_batch tokens a decode
        for r, (lps, _) in zip(res, ref):
            assert np.array_equal(r.logprobs, lps)


def _no_ctx_train(folder: str) -> dict:
    """In a child process (call_in_child): a tiny GGUF with its context_length patched to 0, loaded
    and scored. A llama.cpp that asserts on n_ctx_train 0 then ends that child, not the run."""
    from pathlib import Path

    import gguf

    from pyllamacpp.testing import make_model

    tmp = Path(folder)
    src = make_model(tmp / "tiny.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_vocab=64)
    data = bytearray(src.read_bytes())
    r = gguf.GGUFReader(src)
    part = r.fields["llama.context_length"].parts[-1]
    off = part.ctypes.data - r.data.ctypes.data
    del r, part
    data[off : off + 4] = bytes(4)
    (tmp / "no-ctx.gguf").write_bytes(bytes(data))
    data[off : off + 4] = (1).to_bytes(4, "little")  # says 1: a context of 1, not "does not say"
    (tmp / "one.gguf").write_bytes(bytes(data))
    with pl.Model(tmp / "one.gguf") as one:
        try:
            pl.loglikelihood(one, [([1, 2, 3], [4, 5])], **T)
            refused = ""
        except ValueError as e:
            refused = str(e)
    with pl.Model(tmp / "no-ctx.gguf") as tiny:
        short = pl.loglikelihood(tiny, [([1, 2, 3], [4, 5])], **T)
        long = pl.loglikelihood(tiny, [(list(range(3, 63)) * 80, [7])], **T)  # 4,800 tokens, past 4096
        two = pl.loglikelihood(tiny, [(list(range(k, k + 60)) * 35, [7]) for k in (3, 4)], **T)
        return {
            "n_ctx_train": tiny.n_ctx_train,
            "n_ctx": [short.n_ctx, long.n_ctx, two.n_ctx],
            "finite": [bool(np.isfinite(x.logprob)) for x in (*long, *two)],
            "refused": refused,
        }


def _a_path_of_exactly_n_ctx_cells_after_an_epoch() -> dict:
    """In a child process (call_in_child): a hang fails the test, not the run."""
    model = pl.Model(pl.default_model_path())
    reqs = [(list(range(100, 250)), [250]), (list(range(300, 556)), [556])]
    r = pl.loglikelihood(model, reqs, n_ctx=256, n_seq_max=1, **T)
    return {"n_epochs": r.summary()["n_epochs"], "finite": [bool(np.isfinite(x.logprob)) for x in r]}


def test_a_path_of_exactly_n_ctx_cells_fits_the_next_epoch():
    """256 cells: a request of 150 tokens to feed, then one of 256, which cannot share the first
    epoch and fills the second to the last cell (an epoch that began with one cell taken waited
    for room that never came: a hang)."""
    got = call_in_child(_a_path_of_exactly_n_ctx_cells_after_an_epoch, timeout=240)
    assert got == {"n_epochs": 1, "finite": [True, True]}


def test_more_than_256_requests_end_the_walk(model):
    """300 requests of token ids, each its own leaf: the walk ends when the next leaf is past the
    last (a leaf count compared with ``is`` holds only below 257: the walk went on into an empty
    epoch and raised)."""
    reqs = [([100 + k % 50, 200 + k], [600 + k]) for k in range(300)]
    res = pl.loglikelihood(model, reqs, n_ctx=512, n_seq_max=4, flash_attn="on", **T)
    assert len(res) == res.n_requests == res.n_unique == 300 and res.n_epochs == 0
    assert all(np.isfinite(r.logprob) for r in res)


@pytest.mark.parametrize("arch", ["gemma3", "mamba", "lfm2"])
def test_a_memory_that_cannot_be_cut_back_to_a_prefix_is_refused(tmp_path, arch):
    """A sliding window (gemma3's, n_swa 8), a recurrent state (mamba) or a hybrid of both kinds
    (lfm2): the trie cuts each branch back to its shared prefix, which these memories cannot do,
    so loglikelihood refuses them before any decode, with a Model and with a Context (an SWA model
    that is neither recurrent nor hybrid was scored when the test was n_swa and recurrent)."""
    from pyllamacpp.testing import make_model

    kw = {"n_swa": 8, "swa_pattern": [1, 0]} if arch == "gemma3" else {}
    heads = {} if arch == "mamba" else {"n_head": 2}
    path = make_model(tmp_path / f"{arch}.gguf", arch, n_layer=2, n_embd=32, n_vocab=64, seed=3, **heads, **kw)
    with pl.Model(path) as tiny:
        with pytest.raises(ValueError, match="needs a plain KV cache: a sliding window or a recurrent state"):
            pl.loglikelihood(tiny, [([1, 2, 3], [4, 5])], **T)
        with tiny.context(n_ctx=64, **T) as ctx:
            with pytest.raises(ValueError, match="needs a plain KV cache"):
                pl.loglikelihood(ctx, [([1, 2, 3], [4, 5])])
            assert ctx.memory.seq_pos_max(0) == -1  # nothing decoded


def test_a_model_that_does_not_say_its_n_ctx_train_takes_4096_cells_or_the_longest_request(tmp_path):
    """A GGUF whose context_length is 0 (llama_model_n_ctx_train 0: it does not say): the cells
    are capped at 4096 or the longest request, not at 0 (a cap of n_ctx_train 0 refused every
    request). Two of 2,100 tokens: their trie is more than 4,096, each less: 4,096 cells (4,095
    passed). A model that says 1 gets its 1 cell: a request of 4 is refused (1 read as "does not
    say" scored it in 4,096)."""
    got = call_in_child(_no_ctx_train, str(tmp_path))
    refused = got.pop("refused")
    assert got == {"n_ctx_train": 0, "n_ctx": [4, 4800, 4096], "finite": [True, True, True]}
    assert refused.startswith("request 0 needs 4 tokens in the cache") and refused.endswith("than n_ctx_train=1")


@pytest.mark.parametrize("copied", [3, 1])
def test_a_slot_that_copies_the_nodes_before_one_still_fed_holds_only_those(model, copied):
    """Two slots, n_batch 16. Slot 0 decodes an unrelated request (21 tokens: two batches) while
    slot 1 feeds the shared nodes (A, B, C with a branch after each; or A alone) and starts J (30
    tokens). Then slot 0 takes the path through J too: it copies the nodes before J from slot 1
    and waits for J, which slot 1 is still feeding; once J is whole, it copies J from the slot that
    holds it. Recording slot 0 as a holder of J at the first copy (``_catch_up``'s ``path[i : deep
    << 1]`` past three nodes; ``path[i : deep - 1]`` past one, as ``[0:-1]`` is all but the last)
    made it copy J from itself, and llama_decode refused its next token."""
    a, b, c, j = [200, 201], [300, 301], [400, 401], list(range(500, 530))
    if copied == 3:
        reqs = [(a + b + c + j, [600, 603]), (a + b + c + j, [601, 602]), (a + b + c, [700, 701]), (a + b, [710, 711])]
    else:
        reqs = [(a + j, [600, 603]), (a + j, [601, 602])]
    reqs = [(list(range(100, 120)), [120, 121]), *reqs, (a, [720, 721])]
    with model.context(n_ctx=512, n_batch=512, n_ubatch=512, n_seq_max=2, kv_unified=True, **T) as ctx:
        whole = pl.loglikelihood(ctx, reqs)
    with model.context(n_ctx=512, n_batch=16, n_ubatch=16, n_seq_max=3, kv_unified=True, **T) as ctx:
        cut = pl.loglikelihood(ctx, reqs)
    assert cut.n_seq == 2
    for x, y in zip(whole, cut):
        assert np.array_equal(x.logprobs, y.logprobs)


def test_a_context_of_the_callers(model, reference):
    reqs, ref = reference
    with model.context(n_ctx=512, n_batch=63, n_ubatch=63, n_seq_max=5, kv_unified=True, **T) as ctx:
        res = pl.loglikelihood(ctx, reqs)
        assert res.n_seq == 4  # the fifth sequence is the graveyard
        assert all(ctx.memory.seq_pos_max(s) == -1 for s in range(5))  # cleared after
        for r, (lps, _) in zip(res, ref):
            assert np.array_equal(r.logprobs, lps)
    # one stream per sequence: one slot, cells freed as branches end (not bit-exact then)
    with model.context(n_ctx=512, n_batch=63, n_ubatch=63, n_seq_max=2, **T) as ctx:
        res = pl.loglikelihood(ctx, reqs)
        assert res.n_seq == 1
        for r, (lps, _) in zip(res, ref):
            assert np.allclose(r.logprobs, lps, atol=1.5)
        assert [r.logprob for r in res[:4]].index(max(r.logprob for r in res[:4])) == 0
    # one unified sequence: one slot, no graveyard (one sequence taken for the graveyard left no slot)
    with model.context(n_ctx=512, n_batch=63, n_ubatch=63, n_seq_max=1, kv_unified=True, **T) as ctx:
        res = pl.loglikelihood(ctx, reqs[:3])
        assert res.n_seq == 1 and all(r is not None for r in res)


def test_a_model_closed_during_a_run_on_the_callers_context_raises_closed_error(model_path, monkeypatch):
    """The caller closes the Model between two decodes of a run on its own Context (a callback, a
    second thread): the run raises ClosedError, no crash, and the Context is closed with its Model;
    the run's end does not clear the closed Context (whose error would hide the run's)."""
    from pyllamacpp import packing
    from pyllamacpp.evaluation import llama_perplexity as mc

    real = packing.WorkOrder.decode
    for run in (
        lambda ctx: pl.loglikelihood(ctx, [("The sky on a clear day is", " blue"), ("Snow in the hills is", " cold")]),
        lambda ctx: mc.winogrande(ctx, None, 3),
    ):
        m = pl.Model(model_path)
        calls = []

        def decode(self, *a, _m=m, _calls=calls, **kw):
            _calls.append(1)
            if len(_calls) == 2:
                _m.close()
            return real(self, *a, **kw)

        monkeypatch.setattr(packing.WorkOrder, "decode", decode)
        ctx = m.context(n_ctx=512, n_batch=8, n_seq_max=4, kv_unified=True, **T)
        with pytest.raises(pl.ClosedError) as e:
            run(ctx)
        assert e.value.__context__ is None and ctx.closed and m.closed and len(calls) == 2
        monkeypatch.setattr(packing.WorkOrder, "decode", real)


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test: a job started in a shell's background inherits
    SIGINT ignored, and Ctrl-C would then raise nothing."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prev)


def test_ctrl_c_keeps_what_was_scored(model, sigint_raises):
    reqs = few_shot()
    with model.context(n_ctx=512, n_batch=20, n_ubatch=20, n_seq_max=3, kv_unified=True, **T) as ctx:
        real, calls = ctx.decode, []

        def decode(batch):
            calls.append(len(batch))
            if len(calls) == 4:
                signal.raise_signal(signal.SIGINT)  # Ctrl-C between two decodes
            real(batch)

        ctx.decode = decode
        with pytest.raises(KeyboardInterrupt) as e:
            pl.loglikelihood(ctx, reqs)
        del ctx.decode
        part = e.value.results
        assert len(part) == len(reqs)
        done = [i for i, r in enumerate(part) if r is not None]
        assert 0 < len(done) < len(reqs)
        full = pl.loglikelihood(ctx, reqs)
        for i in done:
            assert np.array_equal(part[i].logprobs, full[i].logprobs)
        assert all(ctx.memory.seq_pos_max(s) == -1 for s in range(3))
        # issue 36: the part has the run's counts so far, as the whole has them
        counts = part.summary()
        assert counts.keys() == full.summary().keys() and counts["n_requests"] == len(reqs)
        assert 0 < counts["n_decoded"] < full.n_decoded and counts["n_decodes"] == 3 and counts["seconds"] > 0


def _ctrl_c_at_result(monkeypatch, n: int) -> None:
    """The engine's ``_result`` raises KeyboardInterrupt at its ``n``-th call (a Ctrl-C while a
    result is reported), and works at the others."""
    from pyllamacpp.evaluation import _engine

    real, calls = _engine._result, []

    def result(*a):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(_engine, "_result", result)


def test_ctrl_c_while_results_are_reported_keeps_those_not_reported_yet(model, monkeypatch):
    """Ctrl-C after a decode whose rows completed every request, while the second of them is
    being reported: the part holds all of them, reported or not (their log-probabilities are in)."""

    reqs = few_shot()[:4]
    full = pl.loglikelihood(model, reqs, **T)
    _ctrl_c_at_result(monkeypatch, 2)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt) as e:
        pl.loglikelihood(model, reqs, **T)
    elapsed = time.perf_counter() - t0
    part = e.value.results
    assert 0 < part.seconds <= elapsed  # the run's own time, up to the interrupt
    assert full.n_decodes == part.n_decodes == 1  # one decode completed them all
    assert all(r is not None for r in part)
    for a, b in zip(part, full):
        assert np.array_equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("end", ["whole", "ctrl-c"])
def test_seconds_is_the_clocks_difference_even_on_a_clock_started_just_before(model, monkeypatch, end):
    """`seconds` is end - start of perf_counter, whatever the clock's origin: here one at 0.25 s
    that moves 1.5 s a reading, as a machine booted just before the run has (end % start would
    pass for a difference while the run is shorter than the uptime at its start)."""
    import types

    from pyllamacpp.evaluation import _engine

    reads: list[float] = []

    def perf_counter() -> float:
        reads.append(0.25 + 1.5 * len(reads))
        return reads[-1]

    monkeypatch.setattr(_engine, "time", types.SimpleNamespace(perf_counter=perf_counter))
    reqs = few_shot()[:4]
    if end == "whole":
        res = pl.loglikelihood(model, reqs, **T)
        assert len(reads) == 2 and res.seconds == reads[1] - reads[0] == 1.5
        return
    _ctrl_c_at_result(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt) as e:
        pl.loglikelihood(model, reqs, **T)
    assert len(reads) == 3 and e.value.results.seconds == reads[1] - reads[0] == 1.5  # read at the interrupt


def test_progress_bar_on_stderr(model, capsys):
    reqs = few_shot()[:4]
    pl.loglikelihood(model, reqs, progress=True, **T)
    assert "loglikelihood" in capsys.readouterr().err
    pl.loglikelihood(model, reqs, **T)  # a short list: no bar
    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_by_tokens_for_one_long_request(model, monkeypatch):
    # issue 36: one 5,000-token request ran two minutes without a line; the bar counts tokens
    from pyllamacpp.evaluation import _engine

    monkeypatch.setattr(_engine, "_PROGRESS_TOKENS", 100)  # the threshold, small for the test
    err = _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    ctx_text = " ".join(["one two three four five six seven eight nine ten"] * 12)
    with model.context(n_ctx=256, n_batch=16, n_ubatch=16, n_seq_max=2, kv_unified=True, **T) as ctx:
        res = pl.loglikelihood(ctx, [(ctx_text, " eleven")])  # one request, on a terminal: a bar
        assert "decode" not in vars(ctx)  # the bar's hook on ctx.decode is gone after the call
    text = err.getvalue()
    assert "loglikelihood" in text and "tok" in text and "1 requests" in text, text
    assert res.n_decodes > 1  # many decodes: the bar moved while the one request was decoded
    short = _Terminal()
    monkeypatch.setattr(sys, "stderr", short)
    pl.loglikelihood(model, [("The sky is", " blue")], **T)  # a few tokens: no bar
    assert short.getvalue() == ""


def test_the_bar_comes_at_exactly_the_threshold_of_tokens(model, monkeypatch):
    """Work of exactly `_PROGRESS_TOKENS` tokens to decode shows the bar on a terminal; one token
    fewer than the threshold does not."""
    from pyllamacpp.evaluation import _engine

    real, n_feed = _engine._trie_tokens, []

    def count(root):
        n_feed.append(real(root))
        return n_feed[-1]

    monkeypatch.setattr(_engine, "_trie_tokens", count)
    reqs = [("The sky is", " blue")]
    said = []
    for threshold in (None, "n", "n + 1"):
        if threshold is not None:
            monkeypatch.setattr(_engine, "_PROGRESS_TOKENS", n_feed[0] + (threshold == "n + 1"))
        err = _Terminal()
        monkeypatch.setattr(sys, "stderr", err)
        pl.loglikelihood(model, reqs, **T)
        said.append("loglikelihood" in err.getvalue())
    assert 2 < n_feed[0] < 2048 and said == [False, True, False]


def test_the_bar_counts_every_request_scored_by_one_shared_row(model, monkeypatch):
    """Three one-token continuations of one context are scored by its last row, the first as the
    row's target, the others from the same row again: the bar says 3/3 requests before it closes."""
    import tqdm

    said: list[str] = []

    class Seen(tqdm.tqdm):
        def close(self):  # tqdm's __del__ closes a closed bar again (disabled then): once each
            if not self.disable:
                said.append(self.postfix or "")
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Seen)
    reqs = [("The capital of France is", x) for x in (" Paris", " Berlin", " Rome")]
    assert all(model.tokenize(x, False).size == 1 for _, x in reqs)
    res = pl.loglikelihood(model, reqs, progress=True, **T)
    assert res.n_outputs == 1 and said == ["3/3 requests"]
    # continuations of 1 to 4 tokens, no two with the same first: each is reported as its node's
    # last token is scored (a node of an even size reported at size ^ 1 passed every test)
    said.clear()
    reqs = [("The capital of France is", x) for x in (" Paris", " Berlin is", " a city in", " the city of Lyon")]
    assert [model.tokenize(x, False).size for _, x in reqs] == [1, 2, 3, 4]
    pl.loglikelihood(model, reqs, progress=True, **T)
    assert said == ["4/4 requests"]
    # a continuation whose node has 300 tokens: reported at its last, index 299 (an index compared
    # with ``is``, which holds below 257 only, never reported it)
    said.clear()
    pl.loglikelihood(model, [(list(range(100, 110)), list(range(200, 490)))], progress=True, **T)
    assert said == ["1/1 requests"]


def test_the_bar_is_cleared_when_the_run_ends(model, capsys):
    """The bar is drawn on stderr and wiped when the run ends: no line is left behind (leave=True
    left its last state and a newline). Its token counts are scaled, as 5.00k for a request of
    thousands (tqdm's unit_scale: three figures, so 5.00 here; without it, 5)."""
    pl.loglikelihood(model, [("The capital of France is", " Paris")], progress=True, **T)
    err = capsys.readouterr().err
    assert "loglikelihood" in err and "\n" not in err and err.endswith("\r")
    assert re.search(r" \d\.\d\d/\d\.\d\d ", err), err


def test_nothing_of_a_run_outlives_it_waiting_for_the_garbage_collector(model, monkeypatch):
    """With the cyclic GC off, the bar and every reference to the caller's Context are gone when
    the call returns (the walk held its report hook, which held the bar's tick, which held the
    walk: a cycle kept both until a collection)."""
    import gc
    import weakref

    import tqdm

    bars: list[weakref.ref] = []

    class Seen(tqdm.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            bars.append(weakref.ref(self))

    monkeypatch.setattr(tqdm, "tqdm", Seen)
    reqs = [("The capital of France is", x) for x in (" Paris", " Berlin is")]
    with model.context(n_ctx=256, n_seq_max=2, **T) as ctx:
        before = sys.getrefcount(ctx)
        gc.collect()
        gc.disable()
        try:
            pl.loglikelihood(ctx, reqs, progress=True)
            alive = [b() is not None for b in bars]
            after = sys.getrefcount(ctx)
        finally:
            gc.enable()
    assert alive == [False] and after == before


def test_a_callers_own_decode_is_put_back_after_the_bar(model):
    reqs = few_shot()[:4]
    with model.context(n_ctx=256, n_seq_max=3, kv_unified=True, **T) as ctx:
        real, calls = ctx.decode, []

        def spy(batch, *a, **kw):
            calls.append(len(batch))
            return real(batch, *a, **kw)

        ctx.decode = spy
        t0 = time.perf_counter()
        res = pl.loglikelihood(ctx, reqs, progress=True)
        assert 0 < res.seconds <= time.perf_counter() - t0
        assert ctx.decode is spy and len(calls) == res.n_decodes > 0  # the bar went through the spy, then left
        del ctx.decode


def test_an_empty_list_of_requests_scores_nothing(model):
    res = pl.loglikelihood(model, [])
    assert len(res) == 0 and res.n_requests == res.n_unique == res.n_decoded == 0


def test_the_settings_are_keyword_only(model):
    # a third positional argument is refused, not read as n_ctx; the model and the requests may be named
    with pytest.raises(TypeError, match="positional"):
        pl.loglikelihood(model, [], 64)
    res = pl.loglikelihood(model_or_ctx=model, requests=[])
    assert len(res) == 0


EMPTY = ("", " Paris")


@pytest.mark.parametrize("where", ["alone", "first", "last", "among", "two alone"])
@pytest.mark.parametrize("via", ["model", "context"])
def test_an_empty_context_is_scored_after_bos_wherever_it_comes(model, via, where):
    # issue 36: alone it raised an n_seq_max/outputs error (a context of 1 cell), among others it was BOS
    others = [("The capital of France is", " Paris"), ("The capital of Spain is", " Madrid")]
    reqs = {
        "alone": [EMPTY],
        "first": [EMPTY, *others],
        "last": [*others, EMPTY],
        "among": [others[0], EMPTY, others[1]],
        "two alone": [EMPTY, ("", " Berlin")],  # two one-token leaves under the BOS node
    }[where]
    paris = model.tokenize(" Paris", False)
    ((lps, greedy),) = alone(model, [(np.concatenate([[model.bos], paris]).astype(np.int32), 1)])
    if via == "model":
        res = pl.loglikelihood(model, reqs, **T)
    else:
        with model.context(n_ctx=64, n_batch=63, n_ubatch=63, n_seq_max=3, kv_unified=True, **T) as ctx:
            res = pl.loglikelihood(ctx, reqs)
    r = res[reqs.index(EMPTY)]
    assert r.n_context == 1 and r.tokens.tolist() == paris.tolist()
    assert np.array_equal(r.logprobs, lps) and r.is_greedy == bool(greedy.all())


def test_an_empty_context_without_bos_names_the_request(model, monkeypatch):
    monkeypatch.setattr(type(model), "bos", property(lambda self: -1))
    with pytest.raises(ValueError, match=r"request 1: the context is empty and the model has no BOS token"):
        pl.loglikelihood(model, [("The capital of France is", " Paris"), EMPTY], **T)
    with pytest.raises(ValueError, match="no BOS token"):
        encode_pair(model, "", " Paris")
    with pytest.raises(ValueError, match="no BOS token"):  # an empty str of a subclass (a numpy column's) is empty
        encode_pair(model, np.str_(""), " Paris")
    with pytest.raises(ValueError, match=r"request 0: the context is empty and the model has no BOS token"):
        pl.loglikelihood(model, [(np.str_(""), " Paris")], **T)
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    # the lm-eval backend keeps lm-eval's own rule there: its prefix token, EOS without BOS
    lm = PyllamacppLM(model=model, n_ctx=64, n_threads=1)
    (got,) = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=EMPTY, idx=0)])
    (want,) = pl.loglikelihood(model, [([model.eos], model.tokenize(" Paris", False))], **T)
    assert got == (want.logprob, want.is_greedy)
    # a context that is not empty is lm-eval's pair as ever, BOS or not
    pair = ("The capital of France is", " Paris")
    (scored,) = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0)])
    (as_pair,) = pl.loglikelihood(model, [pair], **T)
    assert scored == (as_pair.logprob, as_pair.is_greedy)
    # ... and the continuation tokenized without special tokens (a vocabulary that adds some adds none there)
    tokenize = type(model).tokenize

    def adds_eos(self, text, add_special=True, parse_special=False):
        t = tokenize(self, text, False, parse_special)
        return np.concatenate([t, [self.eos]]).astype(np.int32) if add_special else t

    monkeypatch.setattr(type(model), "tokenize", adds_eos)
    (again,) = lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=EMPTY, idx=0)])
    assert again == got


def test_the_bos_is_the_prefix_whatever_its_id(model, monkeypatch):
    # GPT-NeoX's vocabulary (Pythia) has BOS = EOS = token 0: an empty context is scored after it
    monkeypatch.setattr(type(model), "bos", property(lambda self: 0))
    paris = model.tokenize(" Paris", False)
    ctx, cont = encode_pair(model, "", " Paris")
    assert ctx.tolist() == [0] and cont.tolist() == paris.tolist()
    ((lps, greedy),) = alone(model, [(np.concatenate([[0], paris]).astype(np.int32), 1)])
    (r,) = pl.loglikelihood(model, [EMPTY], **T)
    assert r.n_context == 1 and r.tokens.tolist() == paris.tolist() and np.array_equal(r.logprobs, lps)
    (t,) = pl.loglikelihood(model, [([0], paris)], **T)  # token 0 is in the vocabulary
    assert np.array_equal(t.logprobs, lps)
    # a BOS whose id is above the continuation's first token: that token is not taken for it
    monkeypatch.setattr(type(model), "bos", property(lambda self: self.n_vocab - 1))
    ctx, cont = encode_pair(model, "", " Paris")
    assert ctx.tolist() == [model.n_vocab - 1] and cont.tolist() == paris.tolist()


def test_an_empty_context_and_a_continuation_that_starts_with_bos(model, monkeypatch):
    # parse_special: the BOS written as text is the prefix token itself, not a token before it
    bos = model.token_to_piece(model.bos, special=True)
    paris = model.tokenize(" Paris", False)
    ctx, cont = encode_pair(model, "", bos + " Paris", parse_special=True)
    assert ctx.tolist() == [model.bos] and cont.tolist() == paris.tolist()
    ctx, cont = encode_pair(model, "", bos + " Paris")  # parse_special is off unless asked: the BOS's text is text
    assert ctx.tolist() == [model.bos] and cont.tolist() == model.tokenize(bos + " Paris", False).tolist()
    # a BOS id above CPython's cached small ints (256): compared by value
    monkeypatch.setattr(type(model), "bos", property(lambda self: int(paris[0])))
    ctx, cont = encode_pair(model, "", " Paris is")
    assert ctx.tolist() == paris.tolist() and cont.tolist() == model.tokenize(" is", False).tolist()


def test_a_vocabulary_that_adds_bos_has_it_in_the_context_only(model, monkeypatch):
    # the default model adds no BOS (add_special changes nothing); Llama's and Gemma's do
    tokenize = type(model).tokenize

    def adds_bos(self, text, add_special=True, parse_special=False):
        t = tokenize(self, text, False, parse_special)
        return np.concatenate([[self.bos], t]).astype(np.int32) if add_special else t

    monkeypatch.setattr(type(model), "tokenize", adds_bos)
    c = "The capital of France is"
    reqs = [(c, " Paris"), (c, " Madrid"), ("", " Paris")]  # the second's context comes from the first's
    for (ct, x), r in zip(reqs, pl.loglikelihood(model, reqs, **T)):
        assert (
            r.n_context == 1 + tokenize(model, ct, False).size
            and r.tokens.tolist() == tokenize(model, x, False).tolist()
        )


# -- the lm-evaluation-harness backend ------------------------------------------------------------
TRAIN = [
    ("What is the capital of Italy?", ["Rome", "Paris", "Oslo", "Cairo"], 0),
    ("What is 12 plus 7?", ["18", "19", "21", "17"], 1),
    ("What is the opposite of hot?", ["warm", "wet", "cold", "big"], 2),
]
TEST = [
    ("What is the capital of France?", ["Berlin", "Paris", "Madrid", "Lyon"], 1),
    ("What is the capital of Spain?", ["Madrid", "Rome", "Lisbon", "Paris"], 0),
    ("What is 20 plus 5?", ["24", "35", "25", "52"], 2),
    ("What is the opposite of up?", ["left", "down", "over", "high"], 1),
    ("What is the plural of mouse?", ["mouses", "mice", "meese", "mousen"], 1),
    ("What is the capital of Japan?", ["Kyoto", "Osaka", "Tokyo", "Seoul"], 2),
    ("How many legs has a spider?", ["six", "four", "ten", "eight"], 3),
    ("What colour is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
]
GEN = [
    ("What is the capital of France?", "Paris"),
    ("What is 2 plus 2?", "4"),
    ("What is the opposite of up?", "down"),
    ("What colour is grass?", "green"),
]
GEN_PREFIX = "Question: What is the capital of Italy?\\nAnswer: Rome\\n\\n"


def write_tasks(d) -> None:
    """Two lm-eval tasks over local JSON lines (no network): a 3-shot multiple choice (the same
    header before every question: ``first_n``) and a generation task."""
    import json

    for name, rows in (
        ("train", [{"question": q, "choices": c, "answer": a} for q, c, a in TRAIN]),
        ("test", [{"question": q, "choices": c, "answer": a} for q, c, a in TEST]),
        ("gen", [{"question": q, "answer": a} for q, a in GEN]),
    ):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "pyl_mc.yaml").write_text(
        f"""task: pyl_mc
dataset_path: json
dataset_kwargs:
  data_files:
    train: {d}/train.jsonl
    test: {d}/test.jsonl
training_split: train
test_split: test
fewshot_split: train
num_fewshot: 3
fewshot_config:
  sampler: first_n
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""
    )
    (d / "pyl_gen.yaml").write_text(
        f"""task: pyl_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{GEN_PREFIX}Question: {{{{question}}}}\\nAnswer:"
doc_to_target: " {{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
    )


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def generate_alone(model, prompt: str, n: int, until: list[str], n_batch: int = 63) -> str:
    """One prompt generated greedily in a context of its own (the unshared reference)."""
    toks = model.tokenize(prompt, True, True)
    with model.context(n_ctx=toks.size + n, n_batch=n_batch, n_ubatch=n_batch, **T) as ctx:
        d = pl.Detokenizer(model)
        text = "".join(d.feed(t) for t in pl.generate(ctx, toks, n)) + d.flush()
    for t in until:
        text = text.split(t)[0]
    return text


def test_lm_eval_scores_local_tasks_as_each_request_alone(model, tmp_path, offline):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    write_tasks(tmp_path)
    lm = PyllamacppLM(model=model, n_ctx=512, n_threads=1)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["pyl_mc", "pyl_gen"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True
    )
    res, samples = out["results"], out["samples"]
    # multiple choice: lm-eval's (logprob, is_greedy) per request are each request decoded alone
    acc, acc_norm, stats = [], [], lm.last_stats
    mc = sorted(samples["pyl_mc"], key=lambda s: s["doc_id"])
    assert len(mc) == len(TEST)
    for s in mc:
        fit = [lm._fit(*encode_pair(model, c, x, parse_special=True)) for c, x in s["arguments"]]
        ref = alone(model, [(np.concatenate([ct, xt]), ct.size) for ct, xt in fit])
        ref = [(float(lps.sum()), bool(g.all())) for lps, g in ref]
        assert [tuple(r) for r in s["filtered_resps"]] == ref
        assert s["arguments"][0][0].startswith("Question: What is the capital of Italy?\nAnswer: Rome\n\n")
        lls = np.array([lp for lp, _ in ref])
        lens = np.array([len(c) for c in s["doc"]["choices"]], float)
        acc.append(float(np.argmax(lls) == s["target"]))
        acc_norm.append(float(np.argmax(lls / lens) == s["target"]))
    assert res["pyl_mc"]["acc,none"] == pytest.approx(np.mean(acc))
    assert res["pyl_mc"]["acc_norm,none"] == pytest.approx(np.mean(acc_norm))
    assert res["pyl_mc"]["acc,none"] >= 0.5  # a small model still knows most of these
    assert stats["n_requests"] == 4 * len(TEST) and stats["n_decoded"] < stats["n_unshared"] / 3
    # generation: each prompt generated on its own gives the same text, hence the same metric
    gen = sorted(samples["pyl_gen"], key=lambda s: s["doc_id"])
    hits = []
    for s in gen:
        (prompt, kw) = s["arguments"][0]
        text = generate_alone(model, prompt, kw["max_gen_toks"], kw["until"])
        assert s["filtered_resps"][0] == text
        hits.append(float(text.strip() == s["target"].strip()))
    assert res["pyl_gen"]["exact_match,none"] == pytest.approx(np.mean(hits))


def test_lm_eval_keeps_the_last_n_ctx_plus_one_tokens_of_a_long_request(model):
    """As lm-eval's HF backend: a context + continuation longer than the window is cut to its last
    n_ctx + 1 tokens (the last is never fed), the continuation whole when it fits."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    context, cont = pl.scoring.sample_text()[:400], " and the rest of it"
    lm = PyllamacppLM(model=model, n_ctx=32, n_threads=1)
    c, x = encode_pair(model, context, cont)
    assert c.size + x.size - 1 > 32 and x.size < 32
    seq = np.concatenate([c, x])[-33:]
    ((lps, greedy),) = alone(model, [(seq, seq.size - x.size)])
    ((got, is_greedy),) = lm.loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=(context, cont), idx=0)]
    )
    assert got == pytest.approx(float(lps.sum()), abs=1e-9) and is_greedy == bool(greedy.all())
    # exactly n_ctx + 1 tokens: nothing is cut
    fits = (np.asarray(seq[: seq.size - x.size]), np.asarray(x))
    assert [t.tolist() for t in lm._fit(*fits)] == [t.tolist() for t in fits]


def test_lm_eval_fit_cuts_only_what_does_not_fit(model):
    # context + continuation - 1 fed tokens against n_ctx: each way the sum could be misread
    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    lm = PyllamacppLM(model=model, n_ctx=32, n_threads=1)

    def fit(n_ctx_tokens, n_cont):
        seq = np.arange(100, 100 + n_ctx_tokens + n_cont, dtype=np.int32)
        c, x = lm._fit(seq[:n_ctx_tokens], seq[n_ctx_tokens:])
        assert np.array_equal(np.concatenate([c, x]), seq[-(c.size + x.size) :])  # the last tokens, in order
        return c.size, x.size

    assert fit(31, 2) == (31, 2)  # 33 = n_ctx + 1: fits
    assert fit(32, 2) == (31, 2)  # one more: the context's first token goes
    assert fit(33, 2) == (31, 2)
    assert fit(10, 30) == (3, 30)  # a long continuation: the context gives way
    assert fit(5, 40) == (1, 32)  # longer than the window: its last n_ctx tokens after one token
    assert fit(1, 40) == (1, 32)
    assert fit(1, 33) == (1, 32) and fit(33, 1) == (32, 1)  # a side of one token: one past the window
    lm = PyllamacppLM(model=model, n_ctx=33, n_threads=1)  # an odd window (n_ctx + 1 even)
    assert fit(40, 2) == (32, 2)
    # an empty continuation: nothing to score, refused as such after a short context or a long one (after a
    # long one it was cut as if the window's last token were a continuation: "the context has no tokens")
    assert fit(10, 0) == (10, 0) and fit(100, 0) == (100, 0)
    from lm_eval.api.instance import Instance

    for context in ("Short context", pl.scoring.sample_text()[:400].rstrip()):  # (trailing blanks would be scored)
        with pytest.raises(ValueError, match="request 0: the continuation .* has no tokens of its own"):
            lm.loglikelihood([Instance(request_type="loglikelihood", doc={}, arguments=(context, ""), idx=0)])


def test_lm_eval_with_a_prefix_store_restores_on_a_rerun(model, tmp_path):
    # model_args prefix_store=DIR: the engine stores each request's chunks; a second run loads them
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM
    from pyllamacpp.prefix_store import PrefixStore

    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(few_shot())]
    plain = PyllamacppLM(model=model, n_ctx=256, n_threads=1)
    assert "n_restored" not in (plain.loglikelihood(reqs) and plain.last_stats)
    lm = PyllamacppLM(model=model, n_ctx=256, n_threads=1, prefix_store=PrefixStore(tmp_path, chunk_size=16))
    first = lm.loglikelihood(reqs)
    assert lm.last_stats["n_restored"] == 0 and len(list(tmp_path.rglob("*"))) > 1
    again = lm.loglikelihood(reqs)
    assert lm.last_stats["n_restored"] >= 32 and again == first
    by_path = PyllamacppLM(model=model, n_ctx=256, n_threads=1, prefix_store=str(tmp_path))  # a path: a store
    by_path.loglikelihood(reqs[:1])
    assert by_path.last_stats["n_restored"] == 0  # chunks of 256 (the default): none stored of that size


def test_lm_eval_rolling_windows(model):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    text = pl.scoring.sample_text()[:600]
    toks = model.tokenize(text, False)
    lm = PyllamacppLM(model=model, n_ctx=512, n_threads=1)

    def req(s):
        return Instance(request_type="loglikelihood_rolling", doc={}, arguments=(s,), idx=0)

    (one,) = lm.loglikelihood_rolling([req(text)])  # one window: pl.score of BOS + the text
    s = pl.score(model, np.concatenate([[lm.prefix_token_id], toks]), n_batch=63, **T)
    assert one == float(s.logprobs.sum())
    short = PyllamacppLM(model=model, n_ctx=48, n_threads=1)
    (many,) = short.loglikelihood_rolling([req(text)])  # windows of 48: each window alone
    import lm_eval.utils as u

    wins = list(map(u.make_disjoint_window, u.get_rolling_token_windows(toks.tolist(), lm.prefix_token_id, 48, 1)))
    assert len(wins) > 2 and sum(len(p) for _, p in wins) == toks.size
    ref = alone(model, [(np.array(c + p, np.int32), len(c)) for c, p in wins])
    assert many == pytest.approx(sum(float(lps.sum()) for lps, _ in ref), abs=1e-9)
    assert short.last_stats["n_requests"] == len(wins)


def test_lm_eval_generate_until_sizes_its_context_to_the_requests(model, monkeypatch):
    """One context for all of a generate_until call: n_seq_max sequences of the longest prompt
    plus its max_gen_toks each (memory bounded by the requests, not the model's n_ctx_train)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    made = []
    real = pl.Model.context

    def spy(self, **kw):
        made.append(kw)
        return real(self, **kw)

    monkeypatch.setattr(pl.Model, "context", spy)
    prompts = ["Question: What is 2 plus 2?\nAnswer:", "The sky is", "One, two, three, four, five, six, seven,"]
    lm = PyllamacppLM(model=model, n_ctx=512, n_threads=1)
    gen = {"until": ["\n"], "max_gen_toks": 5, "do_sample": False}
    reqs = [Instance(request_type="generate_until", doc={}, arguments=(p, gen), idx=i) for i, p in enumerate(prompts)]
    out = lm.generate_until(reqs)
    assert len(out) == 3 and all("\n" not in t for t in out)
    longest = max(model.tokenize(p, True).size for p in prompts)
    (kw,) = made
    assert kw["n_seq_max"] == 3 and kw["n_ctx"] == 3 * (longest + 5) and kw["kv_unified"] is True
    assert kw["n_threads"] == kw["n_threads_batch"] == 1  # the backend's n_threads, for both
    import pyllamacpp.evaluation.lm_eval as backend

    samplers = []
    real_sampler = backend._sampler
    monkeypatch.setattr(backend, "_sampler", lambda gen: samplers.append(real_sampler(gen)) or samplers[-1])
    PyllamacppLM(model=model, n_ctx=512).generate_until(reqs[:1])
    assert "n_threads" not in made[-1] and "n_threads_batch" not in made[-1]  # none given: the context's defaults
    one = model.tokenize(prompts[0], True).size + 5
    assert made[-1]["n_seq_max"] == 1 and made[-1]["n_ctx"] == one  # one request: one sequence
    assert len(samplers) == 1 and samplers[0].closed  # each request's sampler is closed at the end


def test_lm_eval_says_what_the_trie_saved(model):
    # issue 36: at the end of an lm-eval run, the tokens decoded against request by request
    import logging

    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lm_eval.models.pyllamacpp")  # under lm-eval's logger: its CLI prints it
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        lm = PyllamacppLM(model=model, n_ctx=256, n_threads=1)
        reqs = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(few_shot())]
        lm.loglikelihood(reqs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    s = lm.last_stats
    (line,) = lines
    assert line.startswith(f"pyllamacpp loglikelihood: {s['n_requests']} requests ({s['n_unique']} distinct), ")
    assert f"{s['n_decoded']:,} tokens decoded where request by request would decode {s['n_unshared']:,} (" in line
    assert f"({s['n_unshared'] / s['n_decoded']:.1f}x fewer), in {s['n_decodes']} decodes" in line


def test_lm_eval_generate_until_keeps_a_long_prompts_last_tokens(model, monkeypatch):
    # issue 36, section 2: a prompt longer than n_ctx - max_gen_toks keeps its end (the question), not its start
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    submitted = _record_submits(monkeypatch, "prompt")
    prompt = "One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve,"
    toks = model.tokenize(prompt, True)
    lm = PyllamacppLM(model=model, n_ctx=16, n_threads=1)
    assert toks.size > 16
    gen = {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}
    (out,) = lm.generate_until([Instance(request_type="generate_until", doc={}, arguments=(prompt, gen), idx=0)])
    assert submitted == [toks[-12:].tolist()]
    assert out == _stop_at_first(generate_alone_tokens(model, toks[-12:], 4), ["\n"])


def _record_submits(monkeypatch, what: str) -> list:
    """Each ``Scheduler.submit``'s prompt (as a list of tokens) or ``n_predict``, the scheduler run as ever."""
    from pyllamacpp.scheduler import Scheduler

    got: list = []
    real = Scheduler.submit

    def spy(self, prompt, n_predict, *a, **kw):
        got.append(np.asarray(prompt).tolist() if what == "prompt" else n_predict)
        return real(self, prompt, n_predict, *a, **kw)

    monkeypatch.setattr(Scheduler, "submit", spy)
    return got


def _gen_requests(reqs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="generate_until", doc={}, arguments=r, idx=i) for i, r in enumerate(reqs)]


def test_lm_eval_generate_until_reads_the_first_length_kwarg_given(model, monkeypatch):
    # lm-eval's tasks name the length four ways; the first given (not None) wins, else max_gen_toks
    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    asked = _record_submits(monkeypatch, "n_predict")
    lm = PyllamacppLM(model=model, n_ctx=64, n_threads=1, max_gen_toks=5)
    gens = [
        {"max_gen_toks": 2, "max_new_tokens": 6, "max_tokens": 7},
        {"max_gen_toks": None, "max_new_tokens": 3, "max_tokens": 6},
        {"max_tokens": 4, "max_completion_tokens": 1},
        {"max_completion_tokens": 1},
        {"until": "\n"},
        None,
    ]
    out = lm.generate_until(_gen_requests([("The sky is", g) for g in gens]))
    assert asked == [2, 3, 4, 1, 5, 5] and len(out) == 6


def test_lm_eval_generate_until_needs_room_for_a_prompt(model, monkeypatch):
    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    lm = PyllamacppLM(model=model, n_ctx=16, n_threads=1)
    for n in (16, 17):
        with pytest.raises(ValueError, match=f"max_gen_toks {n} leaves no room for a prompt in n_ctx 16"):
            lm.generate_until(_gen_requests([("The sky is", {"max_gen_toks": n})]))
    submitted = _record_submits(monkeypatch, "prompt")
    lm.generate_until(_gen_requests([("The sky is", {"max_gen_toks": 15, "until": []})]))  # one token of prompt
    assert submitted == [model.tokenize("The sky is", True)[-1:].tolist()]


def test_lm_eval_generate_until_stops_decoding_at_a_stop_string(model, monkeypatch, caplog):
    # a stop string ends the request's decoding (not only its text); a request that ends as asked
    # logs nothing, one that runs out of KV cells says so
    import logging

    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import PyllamacppLM
    from pyllamacpp.scheduler import Scheduler

    ends = {}
    real_run = Scheduler.run

    def spy(self):
        for ev in real_run(self):
            if ev.finish_reason is not None:
                ends[ev.request.id] = (ev.finish_reason, len(ev.request.tokens))
            yield ev

    monkeypatch.setattr(Scheduler, "run", spy)
    lm = PyllamacppLM(model=model, n_ctx=64, n_threads=1)
    prompt = "One, two, three, four,"
    toks = model.tokenize(prompt, True)
    free = generate_alone_tokens(model, toks, 12)
    assert "," in free[: len(free) // 2]  # the model goes on counting: the stop string comes early
    caplog.set_level(logging.WARNING, logger="pyllamacpp.evaluation.lm_eval")
    (out,) = lm.generate_until(_gen_requests([(prompt, {"until": [","], "max_gen_toks": 12})]))
    assert out == free.split(",")[0]
    ((reason, n),) = ends.values()
    assert reason == "cancelled" and n < 12
    (out,) = lm.generate_until(_gen_requests([(prompt, {"until": [], "max_gen_toks": 3})]))
    ours = lambda: [r.getMessage() for r in caplog.records if r.name == "pyllamacpp.evaluation.lm_eval"]  # noqa: E731
    assert out == generate_alone_tokens(model, toks, 3) and not ours()
    # the context sized for the request, then cut to 256 cells (llama.cpp's smallest: it pads n_ctx to 256)
    real_context = pl.Model.context
    monkeypatch.setattr(pl.Model, "context", lambda self, **kw: real_context(self, **{**kw, "n_ctx": 256}))
    lm = PyllamacppLM(model=model, n_ctx=512, n_threads=1)
    (out,) = lm.generate_until(_gen_requests([(prompt, {"until": [], "max_gen_toks": 300})]))
    ((reason, n),) = list(ends.values())[-1:]
    assert reason == "ctx_full" and n == 256 - toks.size + 1
    assert ours() == [f"generate_until: request 0 ran out of KV cells after {n} tokens"]


def test_lm_eval_generate_until_progress_bar_only_for_many_requests_on_a_terminal(model, monkeypatch):
    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    class Tty(io.StringIO):
        def isatty(self):
            return True

    import tqdm

    counts = []

    class Bar(tqdm.tqdm):  # what the bar counted when it closed
        def close(self):
            counts.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    lm = PyllamacppLM(model=model, n_ctx=64, n_threads=1)
    gen = {"until": [], "max_gen_toks": 2}
    seen = {}
    for name, reqs, off in [("two", 2, None), ("one", 1, None), ("off", 2, True)]:
        err = Tty()
        monkeypatch.setattr(sys, "stderr", err)
        kw = {} if off is None else {"disable_tqdm": off}  # lm-eval's evaluator passes none: a bar by default
        lm.generate_until(_gen_requests([("The sky is", gen)] * reqs), **kw)
        seen[name] = err.getvalue()
    assert set(counts) == {(2, 2)}  # one bar (for the two requests), at 2 of 2
    assert seen["two"].startswith("\rgenerate_until:   0%|") and " 0/2 " in seen["two"]
    assert seen["two"].split("\r")[-1].strip() == "" and not seen["two"].endswith("\n")  # the bar is cleared
    assert seen["one"] == seen["off"] == ""
    # loglikelihood: the engine's bar from 100 requests on a terminal, unless lm-eval disables it
    from lm_eval.api.instance import Instance

    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i) for i, r in enumerate(few_shot() * 7)]
    docs = [
        Instance(request_type="loglikelihood_rolling", doc={}, arguments=(f"Item {i}.",), idx=i) for i in range(100)
    ]
    for off in (None, True):
        for call, what in ((lm.loglikelihood, reqs), (lm.loglikelihood_rolling, docs)):
            err = Tty()
            monkeypatch.setattr(sys, "stderr", err)
            call(what, **({} if off is None else {"disable_tqdm": off}))
            assert ("requests" in err.getvalue()) == (off is None), (call, err.getvalue())


def test_lm_eval_cache_hook_gets_each_requests_own_result(model):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    class Hook:
        def __init__(self):
            self.got = []

        def add_partial(self, attr, req, res):
            self.got.append((attr, req, res))

    lm = PyllamacppLM(model=model, n_ctx=64, n_threads=1)
    lm.cache_hook = Hook()
    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " Rome"),
        ("Two plus two is", " four"),
    ]
    ll = lm.loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    )
    assert len(set(ll)) == 3 and lm.cache_hook.got == [("loglikelihood", p, r) for p, r in zip(pairs, ll)]
    lm.cache_hook = Hook()
    docs = [("The sky is blue.",), ("Grass is green and the sun is yellow.",)]
    rl = lm.loglikelihood_rolling(
        [Instance(request_type="loglikelihood_rolling", doc={}, arguments=d, idx=i) for i, d in enumerate(docs)]
    )
    assert rl[0] != rl[1] and lm.cache_hook.got == [("loglikelihood_rolling", d, r) for d, r in zip(docs, rl)]
    lm.cache_hook = Hook()
    reqs = [("One, two,", {"until": [], "max_gen_toks": 3}), ("The sky is", {"until": [], "max_gen_toks": 2})]
    gu = lm.generate_until(_gen_requests(reqs))
    assert gu[0] != gu[1]
    assert sorted(lm.cache_hook.got, key=str) == sorted([("generate_until", r, t) for r, t in zip(reqs, gu)], key=str)


def test_lm_eval_reads_what_lm_eval_asks_of_a_model(model, model_path):
    # the attributes lm-eval reads beside the three request types (--apply_chat_template, its caches)
    pytest.importorskip("lm_eval")
    import os

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    lm = PyllamacppLM(model=model, n_ctx=96, n_threads=1)
    assert lm.max_length == 96 and lm.tokenizer_name == os.path.basename(model_path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert lm.apply_chat_template(chat) == model.apply_chat_template(chat, add_assistant=True)
    assert lm.apply_chat_template(chat, add_generation_prompt=False) == model.apply_chat_template(
        chat, add_assistant=False
    )
    assert lm.apply_chat_template(chat) != lm.apply_chat_template(chat, add_generation_prompt=False)
    template = model.meta("tokenizer.chat_template")
    assert template and lm.chat_template(True) == lm.chat_template("default") == template
    assert lm.chat_template(False) is None and lm.chat_template(None) is None and lm.chat_template() is None


def test_lm_eval_stop_at_cuts_at_each_stop_string_in_turn():
    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import _stop_at

    assert _stop_at("a, b. c\nd", ["", "\n", "."]) == "a, b"
    assert _stop_at("a, b. c\nd", []) == "a, b. c\nd"
    assert _stop_at("a, b. c\nd", ["x"]) == "a, b. c\nd"


def test_lm_eval_sampler_follows_the_generation_kwargs():
    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import _sampler

    def chain(**gen):
        s = _sampler(gen)
        try:
            return s.describe(), s.get_seed()
        finally:
            s.close()

    # greedy: nothing asked, a temperature of 0 or below, or do_sample False whatever the temperature
    for gen in ({}, {"temperature": 0.0}, {"temperature": None}, {"temperature": -0.5}, {"do_sample": True},
                {"do_sample": True, "temperature": -1.0}, {"do_sample": False, "temperature": 0.8}):  # fmt: skip
        assert chain(**gen) == ("greedy", None), gen
    # a temperature above 0 samples without do_sample; the steps asked, in that order; the seed given
    assert chain(temperature=0.5, seed=7) == ("temp(0.5) -> dist(7)", 7)
    assert chain(temperature=0.5) == ("temp(0.5) -> dist(0)", 0)  # no seed: 0, a fixed draw (lm-eval's default)
    assert chain(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=3) == (
        "top_k(40) -> top_p(0.9) -> min_p(0.05) -> temp(0.7) -> dist(3)",
        3,
    )
    # top_k 0 is off (llama.cpp's "0 = off"); a top_p or min_p of 0.0 is asked; no seed is 0
    assert chain(temperature=1.5, top_k=0, top_p=0.0, min_p=0.0, seed=None) == (
        "top_p(0.0) -> min_p(0.0) -> temp(1.5) -> dist(0)",
        0,
    )


def test_lm_eval_an_empty_context_with_a_bos_of_id_0(model, monkeypatch):
    # GPT-NeoX's BOS is token 0: the backend takes encode_pair's route (a continuation written
    # starting with the BOS has it as the prefix, not twice), the EOS route only without a BOS
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    lm = PyllamacppLM(model=model, n_ctx=64, n_threads=1)  # parse_special: on, as lm-eval's default
    assert lm.prefix_token_id == model.bos == 1  # lm-eval's rule: BOS, else EOS
    paris = model.tokenize(" Paris", False)
    # the model's own BOS written at the continuation's start: the prefix, not a token after it
    ((lps, greedy),) = alone(model, [(np.concatenate([[model.bos], paris]).astype(np.int32), 1)])
    text = model.token_to_piece(model.bos, special=True) + " Paris"
    ((got, is_greedy),) = lm.loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=("", text), idx=0)]
    )
    assert got == pytest.approx(float(lps.sum()), abs=1e-9) and is_greedy == bool(greedy.all())
    monkeypatch.setattr(type(model), "bos", property(lambda self: -1))
    assert lm.prefix_token_id == model.eos
    monkeypatch.setattr(type(model), "bos", property(lambda self: 0))
    assert lm.prefix_token_id == 0
    ((lps, greedy),) = alone(model, [(np.concatenate([[0], paris]).astype(np.int32), 1)])
    text = model.token_to_piece(0, special=True) + " Paris"
    ((got, is_greedy),) = lm.loglikelihood(
        [Instance(request_type="loglikelihood", doc={}, arguments=("", text), idx=0)]
    )
    assert got == pytest.approx(float(lps.sum()), abs=1e-9) and is_greedy == bool(greedy.all())


def test_lm_eval_a_vocabulary_that_adds_bos(model, monkeypatch):
    # the generation prompt is tokenized as llama.cpp's tools do (BOS where the vocabulary adds it);
    # a rolling document as lm-eval's backends do (no special tokens: the prefix token comes first)
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    lm = PyllamacppLM(model=model, n_ctx=24, n_threads=1)
    doc = [
        Instance(
            request_type="loglikelihood_rolling", doc={}, arguments=("The sky is blue and grass is green.",), idx=0
        )
    ]
    plain = lm.loglikelihood_rolling(doc)
    tokenize = type(model).tokenize

    def adds_bos(self, text, add_special=True, parse_special=False):
        t = tokenize(self, text, False, parse_special)
        return np.concatenate([[self.bos], t]).astype(np.int32) if add_special else t

    monkeypatch.setattr(type(model), "tokenize", adds_bos)
    assert lm.loglikelihood_rolling(doc) == plain
    submitted = _record_submits(monkeypatch, "prompt")
    lm.generate_until(_gen_requests([("The sky is", {"until": [], "max_gen_toks": 2})]))
    assert submitted == [[model.bos, *tokenize(model, "The sky is", False).tolist()]]


def generate_alone_tokens(model, toks, n: int) -> str:
    with model.context(n_ctx=toks.size + n, n_batch=63, n_ubatch=63, **T) as ctx:
        d = pl.Detokenizer(model)
        return "".join(d.feed(t) for t in pl.generate(ctx, toks, n)) + d.flush()


def _stop_at_first(text: str, until: list[str]) -> str:
    for t in until:
        text = text.split(t)[0]
    return text


def test_lm_eval_by_name_and_from_the_command_line(model_path, tmp_path, offline, capsys):
    pytest.importorskip("lm_eval")
    import json

    from lm_eval.api.registry import get_model

    from pyllamacpp import cli
    from pyllamacpp.cli._lm_eval import lm_eval_argv
    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    assert get_model("pyllamacpp") is PyllamacppLM
    lm = PyllamacppLM.create_from_arg_string(
        f"model={model_path},n_ctx=256,n_seq_max=4,flash_attn=on", {"batch_size": 1}
    )
    assert (lm.n_ctx, lm.n_seq_max, lm.ctx_kwargs) == (256, 4, {"flash_attn": "on"})
    with pytest.raises(TypeError):
        PyllamacppLM(model=lm.model, no_such_param=1)
    assert lm_eval_argv(["--tasks", "x"]) == ["lm-eval", "run", "--model", "pyllamacpp", "--tasks", "x"]
    assert lm_eval_argv(["ls", "tasks"]) == ["lm-eval", "ls", "tasks"]
    assert lm_eval_argv(["--model", "hf"]) == ["lm-eval", "run", "--model", "hf"]
    write_tasks(tmp_path)
    rc = cli.main(
        ["lm-eval", "--model_args", f"model={model_path},n_ctx=256,n_threads=1", "--tasks", "pyl_gen",
         "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"), "--limit", "2"]
    )  # fmt: skip
    assert rc == 0
    files = list((tmp_path / "out").rglob("results_*.json"))
    assert files and json.loads(files[0].read_text())["config"]["model"] == "pyllamacpp"
    assert cli.main(["lm-eval", "--help"]) == 0
    assert "--model_args" in capsys.readouterr().out


def test_lm_eval_subcommand_without_lm_eval(monkeypatch, capsys):
    import sys

    from pyllamacpp import cli

    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # import fails as if not installed
    assert cli.main(["lm-eval", "--tasks", "x"]) == 2
    assert 'pip install "pyllamacpp-cffi[eval]"' in capsys.readouterr().err


def test_lm_eval_install_hint_works_from_a_clone(monkeypatch, capsys):
    # issue 36: the extra's package name is not on the index yet; the hint gives what works today
    import sys

    from pyllamacpp import cli

    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)
    assert cli.main(["lm-eval", "--tasks", "x"]) == 2
    err = capsys.readouterr().err
    assert 'from a clone: pip install ".[eval]"' in err and 'pip install "lm-eval>=0.4"' in err


def test_the_parser_does_not_import_lm_eval():
    import subprocess
    import sys

    code = "import sys; from pyllamacpp.cli import build_parser; build_parser(); print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "False"


WALK_GUARD = """
import sys
import pyllamacpp as pl
from pyllamacpp.evaluation._engine import Loglikelihoods
from pyllamacpp.evaluation._trie import _build, _finish_nodes, _mark
from pyllamacpp.evaluation._walk import _Walk

model = pl.Model(sys.argv[1])
seq = model.tokenize("The capital of France is Paris")
root, ends, leaves = _build([seq])
_mark([seq.size - 1], ends)
_finish_nodes(root)
with model.context(n_ctx=64, n_seq_max=2, kv_unified=True, n_threads=1, n_threads_batch=1) as ctx:
    try:
        _Walk(ctx, leaves, 1, 1, seq.size - 2, Loglikelihoods([None])).run()  # one cell short
    except AssertionError as e:
        print("refused:", e)
    ok = _Walk(ctx, leaves, 1, 1, seq.size - 1, Loglikelihoods([None]))
    ok.run()
    print("fits:", ok.n_scored > 0 and ok.stats.n_epochs == 0)
"""


def test_the_walk_refuses_a_path_longer_than_its_cells(model_path, tmp_path):
    """loglikelihood checks every request against n_ctx before the walk; the walk's own guard says
    what went wrong rather than looping, should a path ever reach it longer than its cells. In a
    child with a time limit: a guard that regressed loops, and must not stop the whole run."""
    import subprocess

    r = subprocess.run(
        [sys.executable, "-c", WALK_GUARD, str(model_path)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert "refused: a path does not fit in an empty epoch\nfits: True\n" in r.stdout, r.stdout


def test_a_result_says_what_it_is(model):
    (r,) = pl.loglikelihood(model, [("The capital of France is", " Paris")], **T)
    lp, greedy = r  # lm-eval's tuple
    assert (lp, greedy) == (r.logprob, r.is_greedy)
    assert repr(r) == (f"<Loglikelihood {r.logprob:.4f} over 1 token(s), 6 byte(s), is_greedy={r.is_greedy}>")


def test_the_lm_eval_backend_takes_empty_lists_and_refuses_sizes_below_1(model):
    pytest.importorskip("lm_eval")
    from pyllamacpp.evaluation.lm_eval import PyllamacppLM

    lm = PyllamacppLM(model=model, n_ctx=64, n_threads=1)
    assert lm.loglikelihood([]) == lm.loglikelihood_rolling([]) == lm.generate_until([]) == []
    for kw in ({"n_ctx": 0}, {"n_batch": 0}, {"n_seq_max": 0}):
        with pytest.raises(ValueError, match=r"n_ctx \(.*\), n_batch \(.*\) and n_seq_max \(.*\) must be >= 1"):
            PyllamacppLM(model=model, **{"n_ctx": 64, "n_threads": 1, **kw})


def test_the_context_made_for_a_model_is_sized_to_the_work(model, reference):
    """No more cells than the longest request feeds (its tokens less the last), and no more slots
    than n_batch - 1 (llama.cpp keeps an output row per sequence, the graveyard's included)."""
    (r,) = one = pl.loglikelihood(model, [("The capital of France is", " Paris")], **T)
    assert one.n_ctx == r.n_context + r.n_tokens - 1
    reqs, ref = reference
    small = pl.loglikelihood(model, reqs[:4], n_batch=3, **T)
    assert small.n_seq == 2
    for a, (lps, _) in zip(small, ref):
        assert np.array_equal(a.logprobs, lps)


@pytest.fixture
def copies(monkeypatch) -> list[tuple[int, ...]]:
    """The (src, dst, p0, p1) of each llama_memory_seq_cp while the test runs."""
    from pyllamacpp.memory import Memory

    calls: list[tuple[int, ...]] = []
    real = Memory.seq_cp
    monkeypatch.setattr(Memory, "seq_cp", lambda self, *a: (calls.append(a), real(self, *a))[1])
    return calls


FOX = " ".join(["the quick brown fox jumps over the lazy dog."] * 30)  # 300 tokens
THREE_39 = [(" ".join([w] * 39), " end") for w in ("red", "green", "blue")]  # 39 tokens each, nothing shared


def test_n_threads_sets_both_thread_counts_of_the_context_made(model, monkeypatch):
    """n_threads gives the context it makes both n_threads and n_threads_batch; without it, the
    context's defaults (neither is passed)."""
    seen: list[dict] = []
    real = type(model).context
    monkeypatch.setattr(type(model), "context", lambda self, **kw: (seen.append(kw), real(self, **kw))[1])
    req = [("The capital of France is", " Paris")]
    pl.loglikelihood(model, req, n_threads=1)
    pl.loglikelihood(model, req)
    assert seen[0]["n_threads"] == seen[0]["n_threads_batch"] == 1
    assert "n_threads" not in seen[1] and "n_threads_batch" not in seen[1]


def test_a_greedy_continuation_after_another_of_the_same_context_is_greedy(model):
    """Two continuations of one context, " A" and the model's own greedy three tokens: both
    first tokens come from the context's last row, the greedy one's as the second child scored
    there (a lower token id sorts " A" first). Its is_greedy is True, as decoded alone (its first
    token's flag compared with its last token passed every test)."""
    ctx_text = "The capital of France is"
    g = generate_alone(model, ctx_text, 3, [])
    reqs = [(ctx_text, g), (ctx_text, " A")]
    toks = [model.tokenize(c) for _, c in reqs]
    assert len(toks[0]) == 3 and toks[0][0] != toks[0][-1] and toks[1][0] < toks[0][0]
    res = pl.loglikelihood(model, reqs, **T)
    ref = alone(model, pairs_of(model, reqs))
    assert [r.is_greedy for r in res] == [bool(gr.all()) for _, gr in ref] == [True, False]


def test_a_continuation_past_256_tokens_is_scored_as_alone(model):
    """A continuation of 300 tokens beside a short one: its node asks a row for each of its
    tokens, bit for bit as alone (the node's row flags compared by size with ``is``, which holds
    only for Python's small ints, were cleared and the request had no result)."""
    reqs = [("Once upon a time", " " + FOX), ("Once upon a time", " there")]
    res = pl.loglikelihood(model, reqs, **T)
    assert res[0].n_tokens > 256
    for r, (lps, _) in zip(res, alone(model, pairs_of(model, reqs))):
        assert np.array_equal(r.logprobs, lps)


def test_the_default_is_16_slots(model):
    # n_seq_max's default, as the docstring says: 16 slots for 20 leaves
    reqs = [(f"{HEADER}Question: What is {i} plus {i}?\nAnswer:", f" {2 * i}") for i in range(20)]
    res = pl.loglikelihood(model, reqs, **T)
    assert res.n_unique == 20 and res.n_seq == 16


def test_a_leaf_is_given_a_slot_while_a_long_node_is_fed_over_several_batches(model):
    """Three requests of 39 tokens to feed with nothing shared, in batches of 63 and two slots: the
    first batch holds the first and 24 tokens of the second; as the second is still being fed, the
    slot the first freed takes the third (the 15 cells the second still needs are counted, not all
    its 39): 117 tokens in 2 decodes, one epoch, each request bit for bit as if alone (ubatches
    under 64 rows: the kernels' sums do not change with the rows beside them)."""
    reqs = THREE_39
    with model.context(n_ctx=512, n_batch=63, n_ubatch=63, n_seq_max=3, kv_unified=True, **T) as ctx:
        res = pl.loglikelihood(ctx, reqs)
    assert res.n_decoded == 117 and res.n_decodes == 2 and res.n_epochs == 0 and res.n_seq == 2
    for r, (lps, _) in zip(res, alone(model, pairs_of(model, reqs))):
        assert np.array_equal(r.logprobs, lps)


@pytest.mark.parametrize(("n_ctx", "n_decodes", "n_epochs"), [(117, 2, 0), (116, 3, 1)])
def test_a_leaf_waits_for_the_next_epoch_when_the_cells_owed_leave_no_room(model, n_ctx, n_decodes, n_epochs):
    """As above, with the epoch's cells to the token: after the first batch (63 cells used, 15
    owed to the second request), the third's 39 fit in 117 cells and start in the same epoch; in
    116 they wait for the next one. Either way each token is decoded once (the cells owed
    undercounted, the third started, ran out of cells one token short and was decoded again: 155)."""
    reqs = THREE_39
    res = pl.loglikelihood(model, reqs, n_ctx=n_ctx, n_batch=63, n_seq_max=2, **T)
    assert res.n_ctx == n_ctx and res.n_seq == 2
    assert (res.n_decoded, res.n_decodes, res.n_epochs) == (117, n_decodes, n_epochs)
    for r, (lps, _) in zip(res, alone(model, pairs_of(model, reqs))):
        assert np.array_equal(r.logprobs, lps)


def test_a_leaf_goes_to_the_free_slot_that_holds_most_of_its_path(model, copies):
    """A free slot that holds the header and question a leaf needs takes it, rather than the first
    free slot copying them from it (llama_memory_seq_cp): the few-shot set with three slots copies
    8 cells from slot to slot, not 24."""
    res = pl.loglikelihood(model, few_shot(), n_seq_max=3, **T)
    grave = 3  # the graveyard sequence, after the 3 slots
    between = [(src, dst, p0, p1) for src, dst, p0, p1 in copies if grave not in (src, dst)]
    assert sum(p1 - p0 for _, _, p0, p1 in between) == 8 and res.n_decoded == 91


def test_a_leaf_goes_to_the_free_slot_that_holds_one_node_of_its_path(model, copies):
    """Two slots: slot 0 scores a leaf of its own, slot 1 a node of 4 tokens and a leaf under it.
    Both free, the next leaf (under that node) goes to slot 1, which holds the node, not to slot 0
    with a copy of it (a best count that began at 1, not -1, passed over a slot holding one node:
    slot 0 took the leaf and copied [0, 4) from slot 1)."""
    a = [100, 101, 102, 103]
    reqs = [([5], [6]), (a + [200], [201]), (a + [300], [301])]
    res = pl.loglikelihood(model, reqs, n_seq_max=2, **T)
    grave = 2  # the graveyard sequence, after the 2 slots
    assert res.n_seq == 2 and res.n_decoded == 7 and copies
    assert [c for c in copies if grave not in c[:2]] == []
    one = pl.loglikelihood(model, reqs, n_seq_max=1, **T)
    for r, o in zip(res, one):
        assert np.array_equal(r.logprobs, o.logprobs)


def test_a_context_of_two_unified_sequences_gives_one_slot_and_the_graveyard(model, reference, copies):
    """n_seq_max 2 with kv_unified: one slot walks the trie and sequence 1 keeps the cells of the
    branches it cuts (llama_memory_seq_cp there first), so no cell is free again in the epoch."""
    reqs, ref = reference
    with model.context(n_ctx=512, n_batch=63, n_ubatch=63, n_seq_max=2, kv_unified=True, **T) as ctx:
        res = pl.loglikelihood(ctx, reqs)
    assert res.n_seq == 1 and copies and all(src == 0 and dst == 1 for src, dst, _, _ in copies)
    for r, (lps, _) in zip(res, ref):
        assert np.array_equal(r.logprobs, lps)


def test_special_token_text_is_text_unless_parse_special(model):
    eos = model.token_to_piece(model.eos, special=True)
    text = f"Hello {eos} world"
    (plain,) = pl.loglikelihood(model, [(text, " end")], **T)
    (parsed,) = pl.loglikelihood(model, [(text, " end")], parse_special=True, **T)
    assert eos and parsed.n_context < plain.n_context  # its text is several tokens, parsed one


def test_a_node_past_256_tokens_fed_over_several_batches_is_copied_to_the_slot_that_waited(model, copies):
    """A header of 300 tokens, fed by slot 0 in batches of 63, while slot 1 waits for it: once it is
    whole in the cache, slot 1 takes it with one ``llama_memory_seq_cp`` of [0, 300) and scores its
    own ending bit for bit as alone. (Whether a node is whole compares two counts past 256: with
    ``is``, which holds only for Python's small ints, slot 1 fed its ending with no header in its
    sequence and its second token's log-probability moved from -7.91 to -8.58.)"""
    reqs = [(FOX, " yes"), (FOX, " no"), (FOX, " maybe so")]
    with model.context(n_ctx=1024, n_batch=63, n_ubatch=63, n_seq_max=3, kv_unified=True, **T) as ctx:
        res = pl.loglikelihood(ctx, reqs)
    assert res[0].n_context == 300 and res.n_seq == 2 and (0, 1, 0, 300) in copies
    for r, (lps, _) in zip(res, alone(model, pairs_of(model, reqs))):
        assert np.array_equal(r.logprobs, lps)


def test_a_model_gets_batches_of_63_tokens_by_default(model):
    """The default ``n_batch`` (and ``n_ubatch``) of a run on a Model is 63, below flash attention's
    64-row tile: 126 tokens to feed go in two decodes, 127 in three."""
    for n, decodes in [(126, 2), (127, 3)]:
        res = pl.loglikelihood(model, [(list(range(100, 100 + n)), [7])], **T)
        assert (res.n_decoded, res.n_decodes) == (n, decodes)


def test_a_node_of_more_than_256_tokens_fed_whole_lets_its_branches_into_the_same_decode(model):
    """A shared context of 300 token ids and two branches, in batches of 512: the node goes whole
    into the first batch, the other slot joins it, and both branches follow in the same decode (a
    count past 256 compared with ``is`` took the node for unfinished: the branches waited a decode)."""
    shared = list(range(1000, 1300))
    reqs = [(shared + list(range(2000, 2005)), [2100]), (shared + list(range(3000, 3005)), [3100])]
    res = pl.loglikelihood(model, reqs, n_batch=512, n_seq_max=2, **T)
    assert (res.n_decoded, res.n_decodes, res.n_epochs) == (310, 1, 0)
    for r, seq in zip(res, [np.array(s + c, np.int32) for s, c in reqs]):
        ((lp, _),) = alone(model, [(seq, 305)], n_batch=512)
        np.testing.assert_allclose(r.logprobs, lp, atol=1e-4)  # past one tile: not bit for bit


def test_a_slot_past_256_nodes_whose_leaf_another_slot_scored_copies_the_node_it_never_held(model, copies):
    """A path of 265 one-token nodes (a request ends at each token), then a node of 40 fed by slot 0
    over several batches of 16, and six leaves after it: three of one token, which the node's last
    row scores as slot 0 feeds it, and three of two; four slots. Slots 1 to 3 join the 265 small
    nodes and wait for the long one; its last row scores the one-token leaves of slots 1 and 2, so
    these are done holding 265 of their path's 267 nodes. Given a two-token leaf next, slot 1 holds
    265 nodes of it, not the long node: it copies that node from slot 0 (``llama_memory_seq_cp`` of
    [265, 305)), and each token is decoded once. (Counting the nodes held with ``is not``, which
    holds for Python's small ints only, went past 265 into the long node: slot 1 fed its leaf at
    position 305 with its sequence ending at 264, and llama_decode refused the batch.)"""
    chain, node = list(range(100, 365)), list(range(1000, 1040))
    reqs = [(chain[:i], [chain[i]]) for i in range(1, 265)] + [(chain + node[:-1], [node[-1]])]
    reqs += [(chain + node, [2000 + j]) for j in range(3)] + [(chain + node, [3000 + j, 3100 + j]) for j in range(3)]
    res = pl.loglikelihood(model, reqs, n_ctx=1024, n_batch=16, n_seq_max=4, **T)
    assert (res.n_seq, res.n_decoded, res.n_epochs) == (4, 308, 0)
    assert (0, 1, 265, 305) in copies
    one = pl.loglikelihood(model, reqs, n_ctx=1024, n_batch=16, n_seq_max=1, **T)  # one slot, no copies
    for r, o in zip(res, one):
        assert np.array_equal(r.logprobs, o.logprobs)


def test_a_slot_whose_batch_is_full_claims_no_node_for_the_next(model):
    """Two slots, batches of 16. Slot 0's first leaf feeds 15 tokens, slot 1 starts the shared
    node X (17 tokens) with the last cell of the batch; slot 0, given the next leaf under X, waits
    while slot 1 feeds X's other 16, which fill the second batch. In the third, slot 0 copies X and
    feeds the node after it (Y) and its leaf, slot 1 joins Y and feeds its own: three decodes. (A
    slot that went on at room 0 claimed Y with an empty piece: slot 0 waited on it a batch more,
    and a fourth decode fed its leaf.)"""
    x, y = list(range(100, 117)), list(range(200, 204))
    reqs = [(list(range(10, 25)), [25]), (x[:-1], [x[-1]]), (x + y + [300], [301]), (x + y + [400], [401])]
    res = pl.loglikelihood(model, reqs, n_ctx=256, n_batch=16, n_seq_max=2, **T)
    assert (res.n_seq, res.n_decoded, res.n_decodes, res.n_epochs) == (2, 38, 3, 0)
    one = pl.loglikelihood(model, reqs, n_ctx=256, n_batch=16, n_seq_max=1, **T)
    for r, o in zip(res, one):
        assert np.array_equal(r.logprobs, o.logprobs)


def test_a_leaf_of_300_tokens_let_go_owes_no_cells_to_the_epoch(model):
    """One slot: a leaf of 300 tokens to feed, then two of 10 in 400 cells. The first leaf is let
    go when the second starts; the third fits the epoch (320 cells in all), no new epoch (a count
    past 256 compared with ``is not`` kept the let-go leaf reserved and owed its 300 cells again)."""
    reqs = [(list(range(100, 400)), [400]), (list(range(2000, 2010)), [2010]), (list(range(3000, 3010)), [3010])]
    res = pl.loglikelihood(model, reqs, n_ctx=400, n_seq_max=1, **T)
    assert (res.n_decoded, res.n_epochs, res.n_seq) == (320, 0, 1)
