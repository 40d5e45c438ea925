"""Model.embed: llama.cpp's pooling types and ``common_embd_normalize``, checked against the
per-token embeddings (``pooling="none"``) of the same texts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today.", "The dog"]


@pytest.fixture(scope="module")
def rows(model):
    """Per-token embeddings, not normalized: one (n_tokens, n_embd) array per text."""
    return model.embed(TEXTS, pooling="none", normalize=-1, n_threads=2)


def test_pooled_embeddings_are_the_pooled_token_rows(model, rows):
    assert [r.shape for r in rows] == [(7, 576), (8, 576), (6, 576), (2, 576)]
    mean = model.embed(TEXTS, pooling="mean", normalize=-1, n_threads=2)
    assert mean.shape == (4, 576) and mean.dtype == np.float32
    np.testing.assert_allclose(mean, np.stack([r.mean(0) for r in rows]), atol=1e-5)
    cls = model.embed(TEXTS, pooling="cls", normalize=-1, n_threads=2)
    last = model.embed(TEXTS, pooling="last", normalize=-1, n_threads=2)
    assert np.array_equal(cls, np.stack([r[0] for r in rows]))
    assert np.array_equal(last, np.stack([r[-1] for r in rows]))
    # a causal model: the first token sees only itself, so texts that start alike share "cls"
    assert np.array_equal(cls[0], cls[3]) and not np.array_equal(last[0], last[3])
    # texts in separate decodes (n_batch 8 holds one text) give the same vectors
    np.testing.assert_allclose(
        model.embed(TEXTS, pooling="mean", normalize=-1, n_batch=8, n_threads=2), mean, atol=1e-5
    )
    # a single str gives one vector; the model's own pooling (none declared) is per token
    one = model.embed(TEXTS[0], pooling="last", n_threads=2)
    assert one.shape == (576,) and np.isclose(np.linalg.norm(one), 1.0)
    own = model.embed(TEXTS[0], n_threads=2)
    assert own.shape == (7, 576) and np.allclose(np.linalg.norm(own, axis=1), 1.0)


def test_normalization_as_common_embd_normalize(model, rows):
    raw = np.stack([r.mean(0) for r in rows])
    for p, check in (
        (2, lambda e: np.linalg.norm(e, axis=1)),
        (1, lambda e: np.abs(e).sum(1)),
        (3, lambda e: (np.abs(e.astype(np.float64)) ** 3).sum(1) ** (1 / 3)),
        (0, lambda e: np.abs(e).max(1) / 32760),  # max-abs scaled to the int16 range
    ):
        e = model.embed(TEXTS, pooling="mean", normalize=p, n_threads=2)
        np.testing.assert_allclose(check(e), 1.0, rtol=1e-5, err_msg=f"normalize={p}")
        # a positive factor per row: the direction is the raw one
        cos = (e * raw).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(raw, axis=1)
        np.testing.assert_allclose(cos, 1.0, rtol=1e-5)
    # Euclidean is the default; similar sentences are closer than unrelated ones (mean pooling)
    e = model.embed(TEXTS, pooling="mean", n_threads=2)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > 0.9


def test_embed_refuses_what_llama_cpp_would_get_wrong(model):
    with pytest.raises(ValueError, match="needs a reranker"):
        model.embed(TEXTS, pooling="rank")
    with pytest.raises(ValueError, match="pooling must be"):
        model.embed(TEXTS, pooling="max")
    with pytest.raises(ValueError, match="no texts"):
        model.embed([])
    with pytest.raises(ValueError, match="gave no tokens"):
        model.embed(["fine", ""])
    with pytest.raises(TypeError, match=r"texts\[1\]"):
        model.embed(["fine", b"bytes"])
    with pytest.raises(ValueError, match="normalize"):
        model.embed(TEXTS, normalize=-2)


def test_mean_pooling_with_any_number_of_texts(tmp_path):
    """llama.cpp aborts at context creation (GGML_ASSERT in build_pooling) for mean pooling when
    n_ubatch is not a multiple of n_seq_max (3 texts, n_ubatch 512): embed rounds n_batch up.
    In a child process: a regression aborts it, not the test run."""
    script = (
        "import numpy as np, pyllamacpp as pl\n"
        "m = pl.Model()\n"
        f"texts = {TEXTS!r} + ['One more.']\n"
        "for n in (3, 5, 2):\n"
        "    e = m.embed(texts[:n], pooling='mean', n_threads=2, n_batch=255)\n"
        "    assert e.shape == (n, 576) and np.allclose(np.linalg.norm(e, axis=1), 1.0)\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_a_mean_pooling_context_llama_cpp_would_abort_on_is_refused():
    """Mean pooling with n_ubatch not a multiple of n_seq_max aborts in llama_init_from_model
    (seen at n_seq_max 2, 3, 4 with n_ubatch 255, 256, 510): Context refuses it first. In a
    child: without the check the abort ends that process, not the test run."""
    from conftest import run_child

    child = run_child(
        "import pyllamacpp as pl\n"
        "m = pl.Model()\n"
        "for n_seq, ub in ((3, 256), (2, 255), (4, 510)):\n"
        "    try:\n"
        "        m.context(n_ctx=1024, n_seq_max=n_seq, n_batch=ub, n_ubatch=ub, embeddings=True,\n"
        "                  pooling_type='mean', n_threads=1)\n"
        "    except ValueError as e:\n"
        "        assert 'multiple of n_seq_max' in str(e), e\n"
        "        print('refused', n_seq, ub)\n"
        "for n_seq, ub in ((3, 255), (4, 512)):\n"
        "    with m.context(n_ctx=1024, n_seq_max=n_seq, n_batch=ub, n_ubatch=ub, embeddings=True,\n"
        "                   pooling_type='mean', n_threads=1):\n"
        "        print('made', n_seq, ub)\n"
    )
    assert child.stdout.split("\n")[:5] == [
        "refused 3 256",
        "refused 2 255",
        "refused 4 510",
        "made 3 255",
        "made 4 512",
    ]
