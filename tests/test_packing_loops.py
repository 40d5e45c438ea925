"""The loops moved onto the packing core decode the work orders they built by hand before.

Every ``llama_decode`` of a loop is recorded (each slot's token, position, seq ids and logits
flag, batch by batch) and compared with the orders the loop's former hand-written code built,
written out here: the same tokens, seq ids, positions and flags in the same batches in the same
order are what keeps their results bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp.scoring._perplexity import _check_vocab_flags
from pyllamacpp.taps._graph import _probe

Slot = tuple[int, int, tuple[int, ...], bool]
PROMPT = "The cat sat on the mat. A dog ran in the park today, and the birds sang."


@pytest.fixture
def decoded(monkeypatch):
    """Each batch ``Context.decode`` is given, as a list of ``(token, pos, seq ids, logits)``."""
    seen: list[list[Slot]] = []
    decode = pl.Context.decode

    def record(self, batch):
        ids = batch.seq_id
        seen.append(
            [
                (int(t), int(p), tuple(int(s) for s in ids[i, :k]), bool(f))
                for i, (t, p, k, f) in enumerate(zip(batch.token, batch.pos, batch.n_seq_id, batch.logits))
            ]
        )
        return decode(self, batch)

    monkeypatch.setattr(pl.Context, "decode", record)
    return seen


def _run(tokens, seq_ids, pos, n_batch, flags) -> list[list[Slot]]:
    """``tokens`` at ``pos, pos + 1...`` cut every ``n_batch``; ``flags(j)`` for offset ``j``."""
    return [
        [(int(tokens[j]), pos + j, tuple(seq_ids), bool(flags(j))) for j in range(i0, min(i0 + n_batch, len(tokens)))]
        for i0 in range(0, len(tokens), n_batch)
    ]


def test_prefill(model, decoded):
    toks = np.resize(model.tokenize(PROMPT), 40)
    with model.context(n_ctx=256, n_batch=16, n_ubatch=16, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(toks[:3], 0)
        assert ctx.prefill(toks, 0) == 43
    assert decoded == _run(toks[:3], (0,), 0, 16, lambda j: j == 2) + _run(toks, (0,), 3, 16, lambda j: j == 39)


@pytest.mark.parametrize("kv_unified", [True, False])
def test_generate_parallel_prompt(model, decoded, kv_unified):
    toks = np.resize(model.tokenize(PROMPT), 20)
    with model.context(
        n_ctx=256, n_batch=8, n_ubatch=8, n_seq_max=3, kv_unified=kv_unified, n_threads=1, n_threads_batch=1
    ) as ctx:
        pl.generate_parallel(ctx, toks, 3, 1)
        kv = [ctx.memory.seq_pos_max(s) for s in range(3)]
    # one token carrying every seq id; without a unified cache: sequence 0, then copied
    ids = (0, 1, 2) if kv_unified else (0,)
    assert decoded == _run(toks, ids, 0, 8, lambda j: j == 19) and kv == [19, 19, 19]


def test_score_windows(model, decoded):
    toks = np.resize(model.tokenize(PROMPT), 90)
    bos = model.bos
    toks[0] = bos
    s = pl.score(model, toks, n_ctx=40, n_batch=16, n_threads=1, n_threads_batch=1)
    want, windows, target, W, keep = [], [], 1, 40, 20
    while target < toks.size:  # score's windows as its hand-written loop fed them
        start = 0 if target == 1 else target - keep
        pre = [bos] if start > 0 else []  # the text starts with BOS: so does each later window
        end = min(toks.size, start + W - len(pre))
        feed = np.concatenate([np.asarray(pre, np.int32), toks[start:end]])
        first = target - 1 - start + len(pre)  # the row that predicts text token ``target``
        want += _run(feed, (0,), 0, 16, lambda j, f=feed, a=first: a <= j < f.size - 1)
        windows.append((start, target))
        target = end
    assert decoded == want and s.windows == windows and len(windows) == 4


@pytest.mark.parametrize(("n_batch", "n_chunks"), [(64, 3), (16, 2)])
def test_perplexity_chunks(model, decoded, n_batch, n_chunks):
    n_ctx = 32
    toks = np.resize(model.tokenize(PROMPT), 4 * n_ctx)
    pl.perplexity(model, toks, n_ctx, n_batch, n_chunks=n_chunks, n_threads=1, n_threads_batch=1)
    add_bos, n_seq = _check_vocab_flags(model), max(1, n_batch // n_ctx)
    want = []
    for i in range(0, n_chunks, n_seq):  # llama-perplexity's batches, as perplexity.cpp builds them
        for b0 in range(0, n_ctx, n_batch):
            batch = []
            for seq in range(min(n_seq, n_chunks - i)):
                chunk = toks[(i + seq) * n_ctx : (i + seq + 1) * n_ctx].copy()
                if add_bos:
                    chunk[0] = model.bos
                for p in range(b0, min(b0 + n_batch, n_ctx)):
                    batch.append((int(chunk[p]), p, (seq,), p >= n_ctx // 2))
            want.append(batch)
    assert decoded == want


def test_embed_groups(model, decoded):
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell.", "The dog"]
    model.embed(texts, pooling="mean", n_batch=8, n_threads=1, n_threads_batch=1)
    t = [model.tokenize(x, True, True) for x in texts]
    assert [len(x) for x in t] == [7, 8, 4, 2]
    # groups of at most n_batch (8) tokens, text i of a group in sequence i, every token an output
    [a], [b], [c], [d] = (_run(x, (s,), 0, 8, lambda j: True) for x, s in zip(t, (0, 0, 0, 1)))
    assert decoded == [a, b, c + d]


def test_graph_probe(model, decoded):
    with model.context(n_ctx=256, n_threads=1, n_threads_batch=1) as ctx:
        shown = _probe(ctx, [(2, True), (3, True), (5, False)])
    n_vocab = model.n_vocab
    want = [
        [((7 + 13 * j) % n_vocab, j, (0,), a or j == n - 1) for j in range(n)]
        for n, a in ((2, True), (3, True), (5, False))
    ]
    assert decoded == want and len(shown) == 3 and all(shown)
