"""A patch that raises stops the decode and rolls its ubatch back, wherever in the batch it raises
(issue 28): at the first, a middle and the last node of the first, a middle and the last ubatch.

llama.cpp rolls back the ubatch the abort flag stops; a raise at a graph's last node stops nothing
in its own pass, so that pass completes and the abort falls on the next ubatch (or on none, after
the batch's last): pyllamacpp then removes the failed pass's cells itself. Either way the cells of
the ubatches before the failed one stay, and nothing of the failed one or after it does.
"""

from __future__ import annotations

import numpy as np
import pytest

import pyllamacpp as pl

N_UBATCH = 4
N_TOKENS = 11  # ubatches of 4, 4 and 3 tokens
# the graph's first node, a middle one (layer 14 of 30) and its last
SITES = [("embd", None), ("l_out", [14]), ("result_output", None)]


class Boom(Exception):
    pass


@pytest.fixture(scope="module")
def rctx(model):
    with model.context(n_ctx=64, n_batch=16, n_ubatch=N_UBATCH, n_threads=2) as c:
        yield c


def _batch(model):
    toks = model.tokenize("The cat sat on the mat while the dog slept by the warm fire.")[:N_TOKENS]
    assert toks.size == N_TOKENS
    b = pl.Batch(16, 1, model=model)
    b.add_sequence(toks, 0, 0, logits="all")  # every ubatch has outputs: result_output in each pass
    return b


@pytest.mark.parametrize("failed_ub", [0, 1, 2], ids=["first-ubatch", "middle-ubatch", "last-ubatch"])
@pytest.mark.parametrize("site", SITES, ids=[s for s, _ in SITES])
def test_a_raising_patch_rolls_back_its_ubatch_and_those_after(model, rctx, site, failed_ub):
    name, layers = site
    batch = _batch(model)
    seen: list[int] = []

    def fn(x, info):
        seen.append(info.ubatch)
        if info.ubatch == failed_ub:
            raise Boom(f"at {info.name} in ubatch {info.ubatch}")
        return None

    rctx.memory.clear()
    with rctx.patch(name, fn, layers=layers), pytest.raises(Boom):
        rctx.decode(batch)
    assert seen == list(range(failed_ub + 1))  # the ubatches after the failed one were not computed
    kept = N_UBATCH * failed_ub  # the tokens of the ubatches before it
    assert rctx.memory.seq_pos_max(0) == kept - 1
    assert rctx.memory.seq_pos_min(0) == (0 if kept else -1)

    # the context is usable, and what it kept is what a clean decode of those tokens leaves
    rctx.memory.clear()
    rctx.decode(batch)
    assert rctx.memory.seq_pos_max(0) == N_TOKENS - 1
    full = rctx.logits_all().copy()
    assert np.isfinite(full).all()


def test_a_patch_that_raised_is_called_again_on_the_next_decode_in_the_same_block(model, rctx):
    """The failure disarms the taps for the rest of the failed decode only."""
    batch = _batch(model)
    calls: list[int] = []

    def fn(x, info):
        calls.append(info.call)
        if len(calls) == 1:
            raise Boom("once")
        return None

    rctx.memory.clear()
    with rctx.patch("result_output", fn):
        with pytest.raises(Boom):
            rctx.decode(batch)
        assert rctx.memory.seq_pos_max(0) == -1
        rctx.decode(batch)
    assert len(calls) == 1 + 3  # once in the failed decode, then each of the three passes
    assert rctx.memory.seq_pos_max(0) == N_TOKENS - 1
