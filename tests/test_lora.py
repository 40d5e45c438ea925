"""LoRA adapters (pyllamacpp.lora) on synthetic models and adapters written with ``gguf``: the
logits move by what numpy predicts, scale 0 and removal give the base logits back bit for bit,
a LoRA for another model is a clear error, and every order of closing is safe."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp.testing import make_lora, make_model

N_EMBD, N_VOCAB = 64, 128
TOKENS = np.array([1, 5, 9, 3, 77], np.int32)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    rng = np.random.default_rng(1)
    base = make_model(d / "base.gguf", n_layer=2, n_embd=N_EMBD, n_head=4, n_vocab=N_VOCAB, tie_embeddings=False)
    # rank 4 and rank 2 factors of the output projection (A: (rank, n_embd), B: (n_vocab, rank))
    f1 = (rng.normal(0, 0.1, (4, N_EMBD)), rng.normal(0, 0.1, (N_VOCAB, 4)))
    f2 = (rng.normal(0, 0.1, (2, N_EMBD)), rng.normal(0, 0.1, (N_VOCAB, 2)))
    return {
        "dir": d,
        "base": base,
        "f1": [x.astype(np.float32) for x in f1],
        "f2": [x.astype(np.float32) for x in f2],
        "out1": make_lora(d / "out1.gguf", base, {"output.weight": f1}, alpha=8.0),
        "out2": make_lora(d / "out2.gguf", base, {"output.weight": f2}),  # no alpha: the scale alone
        "attn": make_lora(d / "attn.gguf", base, ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"], alpha=4.0),
        "embd": make_lora(d / "embd.gguf", base, ["token_embd.weight"], rank=3, std=0.5),
    }


def _run(ctx):
    """Logits and the final hidden state (``result_norm``, the output projection's input) of TOKENS."""
    ctx.memory.clear()
    ctx.prefill(TOKENS)
    return ctx.logits().copy(), ctx.embeddings(-1).copy()


def test_an_output_lora_moves_the_logits_as_numpy_predicts(files):
    (a1, b1), (a2, b2) = files["f1"], files["f2"]
    with pl.Model(files["base"]) as m, m.context(n_ctx=64, n_threads=2, embeddings=True, pooling_type="none") as ctx:
        one, two = pl.LoraAdapter(m, files["out1"]), pl.LoraAdapter(m, files["out2"])
        assert one.alpha == 8.0 and two.alpha == 0.0 and one.meta("adapter.type") == "lora"
        base, h = _run(ctx)
        ctx.set_lora(one, 0.5)
        got, h1 = _run(ctx)
        assert np.array_equal(h1, h)  # only the output projection changed
        # build_lora_mm: W h + scale * alpha / rank * B (A h)
        want = base + 0.5 * 8.0 / 4 * (b1 @ (a1 @ h))
        assert np.abs(got - base).max() > 0.1 and np.abs(got - want).max() < 1e-4
        ctx.set_lora(two, -2.0)  # a second adapter adds its own term; no alpha: the scale alone
        got, _ = _run(ctx)
        want = base + 0.5 * 8.0 / 4 * (b1 @ (a1 @ h)) - 2.0 * (b2 @ (a2 @ h))
        assert np.abs(got - want).max() < 1e-4
        assert ctx.loras == {one: 0.5, two: -2.0}
        # scale 0 takes one off; set_loras({}) takes all off: the base logits, bit for bit
        ctx.set_lora(two, 0)
        assert ctx.loras == {one: 0.5}
        assert np.abs(_run(ctx)[0] - (base + 0.5 * 8.0 / 4 * (b1 @ (a1 @ h)))).max() < 1e-4
        ctx.set_loras({})
        assert ctx.loras == {} and np.array_equal(_run(ctx)[0], base)
        ctx.set_loras({one: 0.0, two: 0.0})
        assert ctx.loras == {} and np.array_equal(_run(ctx)[0], base)
        # a with block restores what was applied before it
        ctx.set_lora(two, 1.0)
        with_two = _run(ctx)[0]
        with one.applied(ctx, 1.0):
            assert ctx.loras == {two: 1.0, one: 1.0}
            assert not np.array_equal(_run(ctx)[0], with_two)
        assert ctx.loras == {two: 1.0} and np.array_equal(_run(ctx)[0], with_two)
        ctx.set_loras({})
        # scales are stored as float32
        ctx.set_lora(one, 0.1)
        assert ctx.loras[one] == float(np.float32(0.1))
        ctx.set_loras({})


def test_applied_restores_the_adapters_own_former_scale(files):
    """An adapter at 0.5, ``applied(ctx, 1.0)``: inside at 1.0, afterwards at 0.5 again (not taken
    off), with the 0.5 logits bit for bit."""

    def logits(ctx):
        ctx.memory.clear()
        ctx.prefill(TOKENS)
        return ctx.logits().copy()

    with pl.Model(files["base"]) as m, m.context(n_ctx=64, n_threads=1, n_threads_batch=1) as ctx:
        one = pl.LoraAdapter(m, files["out1"])
        base = logits(ctx)
        ctx.set_lora(one, 0.5)
        half = logits(ctx)
        with one.applied(ctx, 1.0) as same:
            assert same is one and ctx.loras == {one: 1.0}
            full = logits(ctx)
        assert ctx.loras == {one: 0.5}
        assert np.array_equal(logits(ctx), half)
        assert not np.array_equal(full, half) and not np.array_equal(half, base)


def test_layer_and_embedding_loras_change_the_logits_and_come_off_exactly(files):
    with pl.Model(files["base"]) as m, m.context(n_ctx=64, n_threads=2) as ctx:
        ctx.prefill(TOKENS)
        base = ctx.logits().copy()
        for name in ("attn", "embd"):
            ad = pl.LoraAdapter(m, files[name])
            with ad.applied(ctx, 1.0):
                ctx.memory.clear()
                ctx.prefill(TOKENS)
                assert np.abs(ctx.logits() - base).max() > 1e-3, name
            ctx.memory.clear()
            ctx.prefill(TOKENS)
            assert np.array_equal(ctx.logits(), base), name
            ad.close()


def test_a_lora_for_another_model_is_a_clear_error(files, tmp_path):
    d = files["dir"]
    small = make_model(tmp_path / "small.gguf", n_layer=2, n_embd=32, n_head=4, n_vocab=N_VOCAB, tie_embeddings=False)
    tied = make_model(tmp_path / "tied.gguf", n_layer=2, n_embd=N_EMBD, n_head=4, n_vocab=N_VOCAB)
    qwen = make_model(tmp_path / "qwen.gguf", "qwen3", n_layer=2, n_embd=N_EMBD, n_head=4, n_vocab=N_VOCAB)
    with pl.Model(small) as m:
        with pytest.raises(pl.ModelLoadError, match="incorrect shape") as e:
            pl.LoraAdapter(m, d / "out1.gguf")
        assert e.value.func == "llama_adapter_lora_init"
    with pl.Model(tied) as m:
        with pytest.raises(pl.ModelLoadError, match="does not exist in base model"):
            pl.LoraAdapter(m, d / "out1.gguf")  # no output.weight in a tied model
        # an embedding LoRA on a tied model: llama.cpp would abort at the first decode
        with pytest.raises(ValueError, match="no output.weight"):
            pl.LoraAdapter(m, make_lora(tmp_path / "tembd.gguf", tied, ["token_embd.weight"]))
    with pl.Model(qwen) as m:
        with pytest.raises(pl.ModelLoadError, match="arch mismatch"):
            pl.LoraAdapter(m, d / "attn.gguf")
    with pl.Model(files["base"]) as m:
        with pytest.raises(pl.ModelLoadError, match="general.type to be 'adapter'"):
            pl.LoraAdapter(m, files["base"])  # a model, not an adapter
        with pytest.raises(pl.ModelLoadError, match="no such file"):
            pl.LoraAdapter(m, tmp_path / "missing.gguf")
        # the same file loaded twice is two llama_models: an adapter of one is refused by the other
        with pl.Model(files["base"]) as other, other.context(n_ctx=64, n_threads=2) as ctx:
            ad = pl.LoraAdapter(m, d / "out1.gguf")
            with pytest.raises(ValueError, match="was loaded for"):
                ctx.set_lora(ad)
            with pytest.raises(TypeError, match="LoraAdapter"):
                ctx.set_loras({"out1.gguf": 1.0})
            ours = pl.LoraAdapter(other, d / "out1.gguf")
            with pytest.raises(ValueError, match="finite"):
                ctx.set_lora(ours, float("inf"))
            with pytest.raises(ValueError, match="finite"):
                ctx.set_lora(ours, 1e39)  # inf in float32
            with pytest.raises(TypeError, match="number"):
                ctx.set_lora(ours, "1")
            assert ctx.loras == {}
    # the writer checks its factors against the base it is given
    with pytest.raises(ValueError, match="not a 2-D weight"):
        make_lora(tmp_path / "x.gguf", files["base"], ["blk.9.attn_q.weight"])
    with pytest.raises(ValueError, match="expected"):
        make_lora(tmp_path / "x.gguf", files["base"], {"output.weight": (np.zeros((4, 8)), np.zeros((N_VOCAB, 4)))})


def test_metadata_and_alora_invocation_tokens(files, tmp_path):
    p = make_lora(tmp_path / "alora.gguf", files["base"], ["output.weight"], alora_invocation_tokens=[5, 6, 7])
    with pl.Model(files["base"]) as m:
        ad = pl.LoraAdapter(m, p)
        toks = ad.alora_invocation_tokens
        assert toks.tolist() == [5, 6, 7] and toks.dtype == np.int32 and not toks.flags.writeable
        md = ad.metadata
        assert md["general.type"] == "adapter" and md["general.architecture"] == "llama"
        assert "adapter.alora.invocation_tokens" not in md  # arrays are not in llama.cpp's string table
        assert ad.meta("no.such.key") is None and ad.alpha == 0.0
        plain = pl.LoraAdapter(m, files["out1"])
        assert plain.alora_invocation_tokens.size == 0 and float(plain.meta("adapter.lora.alpha")) == 8.0
        ad.close()
        ad.close()  # idempotent
        for use in (lambda: ad.meta("general.type"), lambda: ad.metadata, lambda: ad.alora_invocation_tokens):
            with pytest.raises(pl.ClosedError):
                use()
        assert toks.tolist() == [5, 6, 7]  # the view kept the adapter's memory
        assert "closed" in repr(ad) and "alpha=8" in repr(plain)


def test_lifetimes_in_every_order(files):
    """Each order in a child process: a wrong free would abort or crash it."""
    script = textwrap.dedent(
        f"""
        import gc, weakref
        import numpy as np
        import pyllamacpp as pl

        base, path = {str(files["base"])!r}, {str(files["out1"])!r}
        toks = np.array({TOKENS.tolist()}, np.int32)

        def logits(ctx):
            ctx.memory.clear()
            ctx.prefill(toks)
            return ctx.logits().copy()

        # 1. closing the adapter takes it off the context; use after close raises
        m = pl.Model(base)
        ctx = m.context(n_ctx=64, n_threads=2)
        plain = logits(ctx)
        ad = pl.LoraAdapter(m, path)
        ctx.set_lora(ad, 1.0)
        assert not np.array_equal(logits(ctx), plain)
        ad.close()
        assert ctx.loras == {{}} and np.array_equal(logits(ctx), plain)
        for bad in (lambda: ctx.set_lora(ad), lambda: ad.applied(ctx).__enter__(), lambda: ad.meta("x")):
            try:
                bad()
            except pl.ClosedError:
                pass
            else:
                raise AssertionError("no ClosedError")

        # 2. a dropped adapter stays alive (and applied) while its context lives
        ad = pl.LoraAdapter(m, path)
        ctx.set_lora(ad, 1.0)
        with_lora = logits(ctx)
        h = weakref.ref(ad._h)
        del ad
        gc.collect()
        assert h() is not None and np.array_equal(logits(ctx), with_lora)
        ctx.close()
        del ctx
        gc.collect()
        assert h() is None  # freed with the context

        # 3. closing the model first: its contexts close, the adapter still reads, then frees
        ad = pl.LoraAdapter(m, path)
        ctx = m.context(n_ctx=64, n_threads=2)
        ctx.set_lora(ad, 0.5)
        hm = weakref.ref(m._h)
        m.close()
        assert ctx.closed and ad.meta("adapter.type") == "lora"  # the adapter keeps the C model
        gc.collect()
        assert hm() is not None
        try:
            ctx.loras
        except pl.ClosedError:
            pass
        else:
            raise AssertionError("no ClosedError")
        ad.close()
        del ctx
        gc.collect()
        assert hm() is None

        # 4. nothing closed: the collector frees context, adapter and model in any order
        m = pl.Model(base)
        ctx = m.context(n_ctx=64, n_threads=2)
        ctx.set_lora(pl.LoraAdapter(m, path), 1.0)
        logits(ctx)
        del m
        gc.collect()
        logits(ctx)  # the context holds the model and the adapter
        del ctx
        gc.collect()
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=files["dir"])
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-3000:]


def test_a_lora_on_the_default_model(model, tmp_path):
    """A quantized base: the factors go beside the Q4_1 weights; applied, then off exactly."""
    p = make_lora(tmp_path / "q.gguf", model.path, ["blk.0.attn_q.weight", "blk.0.ffn_up.weight"], rank=8, std=0.05)
    ad = pl.LoraAdapter(model, p)
    toks = model.tokenize("The cat sat on the mat.")
    with model.context(n_ctx=64, n_threads=2) as ctx:
        ctx.prefill(toks)
        base = ctx.logits().copy()
        with ad.applied(ctx, 4.0):
            ctx.memory.clear()
            ctx.prefill(toks)
            assert np.abs(ctx.logits() - base).max() > 1e-2
        ctx.memory.clear()
        ctx.prefill(toks)
        assert np.array_equal(ctx.logits(), base)
    ad.close()


def test_the_tied_embedding_check_reads_every_file_of_a_split_model(tmp_path):
    """A split model: output.weight is looked for in each file (here it is in the second), and a
    tied split model, which has none in any, is refused an embedding LoRA."""
    import gguf

    untied = make_model(tmp_path / "u.gguf", n_layer=2, n_embd=N_EMBD, n_head=4, n_vocab=N_VOCAB,
                        tie_embeddings=False, split_max_tensors=2)  # fmt: skip
    tied = make_model(tmp_path / "t.gguf", n_layer=2, n_embd=N_EMBD, n_head=4, n_vocab=N_VOCAB, split_max_tensors=2)
    first = {t.name for t in gguf.GGUFReader(untied).tensors}
    assert "output.weight" not in first and "token_embd.weight" in first  # the check must read on
    plain = make_model(tmp_path / "plain.gguf", n_layer=2, n_embd=N_EMBD, n_head=4, n_vocab=N_VOCAB)
    embd = make_lora(tmp_path / "e.gguf", plain, ["token_embd.weight"])
    with pl.Model(untied) as m:
        assert int(m.meta("split.count")) == len(list(tmp_path.glob("u-*-of-*.gguf"))) > 1
        ad = pl.LoraAdapter(m, embd)  # its output.weight is its own: accepted
        with m.context(n_ctx=64, n_threads=2) as ctx, ad.applied(ctx, 1.0):
            ctx.prefill(TOKENS)
            assert np.isfinite(ctx.logits()).all()
        ad.close()
    with pl.Model(tied) as m, pytest.raises(ValueError, match="no output.weight"):
        pl.LoraAdapter(m, embd)


def test_the_default_scale_is_one(files):
    """``applied(ctx)``, ``set_lora(ad)`` and ``lora.set_lora(ctx, ad)`` without a scale: 1.0, as
    llama.cpp's --lora applies an adapter."""
    from pyllamacpp import lora

    with pl.Model(files["base"]) as m, m.context(n_ctx=64, n_threads=2) as ctx:
        ad = pl.LoraAdapter(m, files["attn"])
        with ad.applied(ctx):
            assert ctx.loras == {ad: 1.0}
        assert ctx.loras == {}
        ctx.set_lora(ad)
        assert ctx.loras == {ad: 1.0}
        ctx.set_loras({})
        lora.set_lora(ctx, ad)
        assert lora.applied(ctx) == {ad: 1.0}


def test_meta_tells_an_empty_value_from_a_missing_key(files, tmp_path):
    p = make_lora(tmp_path / "m.gguf", files["base"], ["output.weight"], metadata={"general.description": ""})
    with pl.Model(files["base"]) as m:
        ad = pl.LoraAdapter(m, p)
        assert ad.meta("general.description") == ""
        assert ad.meta("no.such.key") is None
        assert ad.metadata["general.description"] == ""


def test_a_file_that_is_not_a_gguf_is_llama_cpps_refusal(files, tmp_path):
    """The tied-embedding check reads the file with gguf first; a file gguf cannot read is left to
    llama_adapter_lora_init, whose refusal is the ModelLoadError."""
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 8)
    with pl.Model(files["base"]) as m, pytest.raises(pl.ModelLoadError) as e:
        pl.LoraAdapter(m, junk)
    assert e.value.func == "llama_adapter_lora_init"


def test_set_lora_while_another_thread_decodes_is_refused_at_once(files):
    """The context's lock held by another thread (a decode in progress): set_lora raises at once
    rather than waiting for it (llama_set_adapters_lora would change the graph under the decode)."""
    import threading
    import time

    with pl.Model(files["base"]) as m, m.context(n_ctx=64, n_threads=2) as ctx:
        ad = pl.LoraAdapter(m, files["attn"])
        held, done = threading.Event(), threading.Event()

        def decoding():
            with ctx._lock:
                held.set()
                done.wait(2.0)

        t = threading.Thread(target=decoding)
        t.start()
        held.wait()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="another thread"):
            ctx.set_lora(ad, 1.0)
        assert time.monotonic() - t0 < 1.0
        done.set()
        t.join()
        assert ctx.loras == {}
