"""Graph taps (pyllamacpp.taps): the listing, captures, patches and control vectors, checked
against independent numpy recomputations from the model's own weights (read with ``gguf``)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_child
from gguf import GGUFReader
from gguf.quants import dequantize

import pyllamacpp as pl
from pyllamacpp import lib
from pyllamacpp.errors import CaptureLimitError, TapError
from pyllamacpp.testing import make_model

A = "The cat sat on the mat."
B = "A dog ran in the park!"


@pytest.fixture(scope="module")
def weights(model_path):
    """name -> float32 array (numpy order) of the default model's tensors, dequantized on demand."""
    reader = GGUFReader(str(model_path))
    by_name = {t.name: t for t in reader.tensors}
    cache: dict[str, np.ndarray] = {}

    def get(name: str) -> np.ndarray:
        if name not in cache:
            t = by_name[name]
            cache[name] = dequantize(t.data, t.tensor_type).reshape(tuple(int(x) for x in reversed(t.shape)))
        return cache[name]

    return get


def _ctx(model, **kw):
    kw = {"n_ctx": 512, "n_threads": 1, "n_threads_batch": 1, "flash_attn": "off", **kw}
    return model.context(**kw)


def _batch(model, *seqs, logits="last"):
    b = pl.Batch(64, 1, model=model)
    for s, text in seqs:
        b.add_sequence(model.tokenize(text), s, 0, logits=logits)
    return b


# -- the listing -----------------------------------------------------------------------------------


def test_graph_nodes_lists_the_pass_in_graph_order(model):
    with _ctx(model) as ctx:
        g = ctx.graph_nodes()
    assert len(g) == 1086  # ../shared/LLAMA_CPP_FACTS.md: one pass of the default model
    assert g.nodes[0].name == "embd" and g.nodes[0].op == "GET_ROWS" and g.nodes[-1].name == "result_output"
    q = g.named("Qcur-0")
    assert [n.op for n in q] == ["MUL_MAT", "RESHAPE", "ROPE"] and [n.last for n in q] == [False, False, True]
    assert [n.op for n in g.named("norm-0")] == ["RMS_NORM", "RMS_NORM"]  # attention's and the FFN's
    l5 = g.named("l_out-5")[0]
    assert (l5.site, l5.layer, l5.op, l5.shape, l5.token_axis) == ("l_out", 5, "ADD", (3, 576), 0)
    sm = g.named("kq_soft_max-5")[0]
    assert sm.shape == (9, 3, 256) and sm.token_axis == 1  # (n_head, n_tokens, n_kv padded to 256)
    inputs = {i.name: i for i in g.inputs}
    assert {"inp_tokens", "inp_pos", "attn_inp_kq_mask", "cache_k_l0", "cache_v_l29"} <= set(inputs)
    assert inputs["attn_inp_kq_mask"].shape == (3, 256) and inputs["attn_inp_kq_mask"].token_axis == 0
    assert inputs["inp_pos"].token_axis == 0 and inputs["cache_k_l0"].token_axis is None
    assert "l_out-5" in g.table() and "RESHAPE" not in g.table() and "RESHAPE" in g.table(views=True)


@pytest.mark.parametrize(
    ("arch", "kw", "site"),
    [
        ("llama", {"n_head": 4}, "kq_soft_max"),
        ("gemma3", {"n_head": 4, "n_swa": 8, "swa_pattern": 2}, "kq_soft_max"),
        ("mamba", {"ssm_d_conv": 4, "ssm_d_state": 8}, "l_out"),
        ("lfm2", {"n_head": 4}, "l_out"),
        ("llama", {"n_head": 4, "n_ff": 32, "n_expert": 4, "n_expert_used": 2}, "ffn_moe_probs"),  # MoE
    ],
)
def test_graph_nodes_and_a_capture_on_every_memory_kind(tmp_path, arch, kw, site):
    path = make_model(tmp_path / f"{arch}.gguf", arch, n_layer=2, n_embd=64, n_vocab=128, **kw)
    with pl.Model(path) as m, m.context(n_ctx=256, n_threads=1, flash_attn="off") as ctx:
        g = ctx.graph_nodes()
        assert g.nodes and any(n.site == site for n in g.nodes), g.sites()
        if arch == "gemma3":  # iSWA: the sliding-window layers have a mask of their own, of the same name
            masks = [i for i in g.inputs if i.name == "attn_inp_kq_mask"]
            assert [m.occurrence for m in masks] == [0, 1] and sorted(m.read_by for m in masks) == [(0,), (1,)]
        b = pl.Batch(8, 1)
        b.add_sequence([5, 6, 7, 8], 0, 0, logits="last")
        with ctx.capture(site) as cap:
            ctx.decode(b)
        recs = [r for r in cap.records if r.site == site]
        # every row, but in the last layer: after inp_out_ids only the output row is left
        assert recs and all(r.rows.tolist() == ([3] if r.outputs_only else [0, 1, 2, 3]) for r in recs)
        assert [r.outputs_only for r in recs if r.site == "l_out"] in ([False, True], [])


# -- captures --------------------------------------------------------------------------------------


def test_capture_returns_numpy_order_rows_and_changes_nothing(model):
    with _ctx(model) as plain, _ctx(model) as ctx:
        b = _batch(model, (0, A))
        plain.decode(b)
        with ctx.capture("l_out", "kq_soft_max", "attn_inp_kq_mask", layers=[0, 5]) as cap:
            ctx.decode(b)
        assert np.array_equal(ctx.logits(), plain.logits())  # taps take copies, change no rounding
    x = cap["l_out", 5]
    assert x.shape == (7, 576) and x.dtype == np.float32
    assert {r.name for r in cap.records} == {"l_out-0", "l_out-5", "kq_soft_max-0", "kq_soft_max-5", "attn_inp_kq_mask"}
    r = next(r for r in cap.records if r.name == "l_out-5")
    assert (r.op, r.type, r.call, r.ubatch, r.token_axis) == ("ADD", "f32", 0, 0, 0)
    assert r.rows.tolist() == list(range(7)) and r.pos.tolist() == list(range(7)) and r.seq_ids == ((0,),) * 7
    assert np.shares_memory(x, r.data)  # one pass: a view of the copy, not another copy
    assert cap.nbytes >= 2 * 7 * 576 * 4 + 2 * 9 * 7 * 256 * 4


def test_capture_values_match_numpy_recomputations_from_the_weights(model, weights):
    """Nodes recomputed with numpy from the weights (gguf dequantizes them) and the captured
    inputs of each op."""
    toks = model.tokenize(A)
    with _ctx(model) as ctx:
        with ctx.capture(
            "embd",
            "norm",
            "attn_norm",
            "Qcur",
            "kq",
            "kq_soft_max",
            "attn_inp_kq_mask",
            "ffn_gate",
            "ffn_up",
            "ffn_swiglu",
            "ffn_out",
            "ffn_inp",
            "l_out",
            layers=[0],
        ) as cap:
            ctx.decode(_batch(model, (0, A)))
    emb = weights("token_embd.weight")[toks]
    assert np.allclose(cap["embd"], emb, atol=1e-6)  # GET_ROWS of a Q8_0 table
    e = cap["embd"].astype(np.float64)
    normed = e / np.sqrt((e * e).mean(-1, keepdims=True) + 1e-5)
    assert np.allclose(cap.get(("attn_norm", 0)), normed * weights("blk.0.attn_norm.weight"), rtol=1e-5, atol=1e-5)
    # the MUL_MAT Qcur-0 (which=0: the first node of that name), a Q4_1 weight against q8 activations
    with _ctx(model) as ctx:
        with ctx.capture("Qcur", layers=[0], which="MUL_MAT") as capq:
            ctx.decode(_batch(model, (0, A)))
    q = cap["attn_norm", 0] @ weights("blk.0.attn_q.weight").T
    rel = np.abs(capq["Qcur", 0] - q).max() / np.abs(q).max()
    assert rel < 0.02, rel
    g, u = cap["ffn_gate", 0].astype(np.float64), cap["ffn_up", 0]
    assert np.allclose(cap["ffn_swiglu", 0], g / (1 + np.exp(-g)) * u, rtol=1e-4, atol=1e-5)
    assert np.array_equal(cap["l_out", 0], cap["ffn_out", 0] + cap["ffn_inp", 0])  # one f32 add: bit for bit
    # attention: softmax(kq / sqrt(head_dim) + mask) over the cells, from the captured kq and mask
    kq, mask, p = cap["kq", 0], cap["attn_inp_kq_mask"], cap["kq_soft_max", 0]
    z = kq.astype(np.float64) / 8.0 + mask  # (9, 7, 256) + (7, 256); head_dim 64
    ref = np.exp(z - z.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    assert np.allclose(p, ref, atol=1e-6)
    assert np.allclose(p.sum(-1), 1.0, atol=1e-6)
    assert (p[np.broadcast_to(mask == -np.inf, p.shape)] == 0).all()  # masked cells: exactly 0
    assert (p[:, np.triu_indices(7, 1)[0], np.triu_indices(7, 1)[1]] == 0).all()  # no future position


def test_rows_of_two_sequences_in_one_ubatch(model):
    """A beside B in one ubatch: A's rows of every row-wise node equal A's alone bit for bit (1
    thread, flash attention off); attention gives B's cells exactly 0 for A's rows and back."""
    with _ctx(model, n_seq_max=2, kv_unified=True) as one, _ctx(model, n_seq_max=2, kv_unified=True) as both:
        with one.capture(lambda n: n.startswith(("l_out", "ffn_out", "attn_out", "kq_soft_max"))) as ca:
            one.decode(_batch(model, (0, A)))
        with both.capture(lambda n: n.startswith(("l_out", "ffn_out", "attn_out", "kq_soft_max"))) as cb:
            both.decode(_batch(model, (0, A), (1, B)))
        assert np.array_equal(one.logits(), both.logits(6))
    for site in ("l_out", "ffn_out", "attn_out"):
        for il in (0, 15, 29):
            assert np.array_equal(ca[site, il], cb.rows(seq_id=0)[site, il]), (site, il)
    p = cb["kq_soft_max", 12]  # (n_head, 14 rows, n_kv); A in cells 0..6, B in 7..13
    assert p[:, :7, 7:14].max() == 0 and p[:, 7:, :7].max() == 0
    assert np.array_equal(p[:, :7], ca["kq_soft_max", 12])
    assert cb.rows(seq_id=1)["l_out", 3].shape == (7, 576)


def _captured_in_generate(model, *sites):
    """``sites`` (layer 3) captured while ``generate`` makes 4 greedy tokens after A at -ub 4: the
    capture, the tokens and the l_out-3 records, checked to be one per (call, ubatch)."""
    with _ctx(model, n_ubatch=4, n_batch=64) as ctx:
        with ctx.capture(*sites, layers=[3]) as cap:
            out = list(pl.generate(ctx, model.tokenize(A), 4, pl.Sampler(model).greedy()))
    recs = [r for r in cap.records if r.name == "l_out-3"]
    # the prompt's decode (7 tokens: ubatches of 4 and 3), then one call per generated token but the last
    assert [(r.call, r.ubatch, r.rows.tolist()) for r in recs] == [
        (0, 0, [0, 1, 2, 3]),
        (0, 1, [4, 5, 6]),
        (1, 0, [0]),
        (2, 0, [0]),
        (3, 0, [0]),
    ]
    return cap, out, recs


def test_capture_across_ubatches_and_inside_generate(model):
    cap, out, recs = _captured_in_generate(model, "l_out", "result_norm")
    assert [r.pos.tolist() for r in recs[2:]] == [[7], [8], [9]]
    assert cap["l_out", 3].shape == (10, 576)
    assert cap["result_norm"].shape == (4, 576)  # output rows only: the prompt's last, then each step
    # cut to the output rows in the prompt's two ubatches (none, then the last token); a step's one row is its output
    assert [r.outputs_only for r in cap.records if r.name == "result_norm"] == [True, True, False, False, False]
    assert len(out) == 4


def test_capture_inside_generate_parallel_and_the_scheduler(model):
    with _ctx(model, n_ctx=1024, n_seq_max=3, kv_unified=True) as ctx:
        with ctx.capture("l_out", layers=[2]) as cap:
            pl.generate_parallel(ctx, A, 3, 3)
        first = cap.records[0]
        assert first.seq_ids == ((0, 1, 2),) * 7  # the prompt, once for three sequences
        assert cap.rows(seq_id=1)["l_out", 2].shape == (9, 576)  # 7 shared + 2 of its own
    with _ctx(model, n_ctx=1024, n_seq_max=2, kv_unified=True) as ctx:
        sched = pl.Scheduler(ctx)
        req = sched.submit(A, 3)
        with ctx.capture("l_out", layers=[1]) as cap:
            list(sched.run())
        assert cap.records and all(r.rows is not None for r in cap.records)
        assert req.done and cap.rows(seq_id=0)["l_out", 1].shape[0] >= 7


def test_a_capture_past_its_limit_raises_and_rolls_the_decode_back(model):
    with _ctx(model) as ctx:
        ctx.prefill(model.tokenize(A))
        with ctx.capture("kq_soft_max", max_bytes=200_000) as cap:
            with pytest.raises(CaptureLimitError, match="max_bytes is 200,000"):
                ctx.decode(_batch_at(model, 7))
        assert ctx.memory.seq_pos_max(0) == 6  # the failed decode's cells are gone
        assert cap.nbytes <= 200_000
        ctx.decode(_batch_at(model, 7))  # usable
        assert ctx.memory.seq_pos_max(0) == 13


def _batch_at(model, pos0):
    b = pl.Batch(16, 1, model=model)
    b.add_sequence(model.tokenize(B), 0, pos0, logits="last")
    return b


def test_names_that_the_pass_does_not_produce_are_errors(model):
    with _ctx(model) as ctx:
        with pytest.raises(TapError, match="Sites of this pass: embd, norm, attn_norm"):
            ctx.capture("attention_probs")
        with pytest.raises(TapError, match="layers are 0..29"):
            ctx.capture("l_out", layers=[30])
        with pytest.raises(TapError, match="ROPE"):
            ctx.capture("Qcur-0", which="GLU")
    with _ctx(model, flash_attn="on") as fa, pytest.raises(TapError, match="flash attention is on.*flash_attn='off'"):
        fa.capture("kq_soft_max")
    with model.context(n_ctx=256, taps=False) as off, pytest.raises(TapError, match="taps=False"):
        off.capture("l_out")


# -- patches ---------------------------------------------------------------------------------------


def test_activation_patching_reproduces_the_source_run(model):
    """l_out-5 of prompt A patched into a run of prompt B (same length): every later layer sees
    A's residual stream, so the logits are A's, bit for bit."""
    with _ctx(model) as ctx:
        with ctx.capture("l_out", layers=[5]) as src:
            ctx.decode(_batch(model, (0, A)))
        logits_a = ctx.logits().copy()
        ctx.memory.clear()
        ctx.decode(_batch(model, (0, B)))
        logits_b = ctx.logits().copy()
        ctx.memory.clear()
        donor = src["l_out", 5]

        def put(x, info):
            assert info.rows.tolist() == list(range(7)) and info.token_axis == 0
            x[:] = donor[info.rows]

        with ctx.patch("l_out", put, layers=[5]) as p:
            ctx.decode(_batch(model, (0, B)))
        assert p.n_calls == 1 and 0 < p.seconds < 10
        assert np.array_equal(ctx.logits(), logits_a) and not np.array_equal(logits_a, logits_b)


def test_a_patch_that_raises_stops_the_decode_and_rolls_its_ubatch_back(model):
    with _ctx(model, n_ubatch=4, n_batch=64) as ctx:

        def boom(x, info):
            if info.ubatch == 1:
                raise ZeroDivisionError("in ubatch 1")

        with ctx.patch("l_out", boom, layers=[10]), pytest.raises(ZeroDivisionError, match="in ubatch 1"):
            ctx.decode(_batch(model, (0, A)))
        assert ctx.memory.seq_pos_max(0) == 3  # ubatch 0 (positions 0..3) stays, ubatch 1 is gone
        # at the graph's last node nothing comes after to abort: the ubatch is removed all the same
        with ctx.patch("result_output", boom), pytest.raises(ZeroDivisionError):
            ctx.decode(_batch_at(model, 4))
        assert ctx.memory.seq_pos_max(0) == 7  # that decode's ubatch 0 (4..7) stays, ubatch 1 (8..10) is gone
        with pytest.raises(IndexError):
            ctx.logits()
        ctx.decode(_batch_at(model, 8))
        assert ctx.memory.seq_pos_max(0) == 14


def test_a_patch_in_generate_steers_and_a_control_vector_is_the_same_addition(model):
    """A vector added at l_out-10 by a patch and the same vector as a control vector for layer 10
    give bit-identical logits: llama.cpp adds it just before naming the tensor l_out-10."""
    rng = np.random.default_rng(0)
    vec = rng.normal(0, 0.5, 576).astype(np.float32)
    with _ctx(model) as ctx:
        ctx.decode(_batch(model, (0, A)))
        base = ctx.logits().copy()
        ctx.memory.clear()
        with ctx.patch("l_out", lambda x, info: x + vec, layers=[10]):
            ctx.decode(_batch(model, (0, A)))
        patched = ctx.logits().copy()
        ctx.memory.clear()
        ctx.control_vector({10: vec}, layers=(10, 10))
        ctx.decode(_batch(model, (0, A)))
        assert np.array_equal(ctx.logits(), patched) and not np.array_equal(patched, base)
        ctx.control_vector(None)
        ctx.memory.clear()
        ctx.decode(_batch(model, (0, A)))
        assert np.array_equal(ctx.logits(), base)


def test_control_vector_from_a_cvector_generator_file(model, tmp_path):
    from pyllamacpp.cvec import read_control_vector, write_control_vector

    rng = np.random.default_rng(1)
    vecs = {il: rng.normal(0, 0.3, 576).astype(np.float32) for il in (3, 4)}
    path = tmp_path / "cv.gguf"
    write_control_vector(path, vecs)
    back = read_control_vector(path, strength=2.0)
    assert set(back) == {3, 4} and np.array_equal(back[3], vecs[3] * 2)
    with _ctx(model) as ctx:
        ctx.control_vector(path, strength=2.0)
        ctx.decode(_batch(model, (0, A)))
        from_file = ctx.logits().copy()
        ctx.memory.clear()
        ctx.control_vector({il: 2 * v for il, v in vecs.items()})
        ctx.decode(_batch(model, (0, A)))
        assert np.array_equal(ctx.logits(), from_file)
        with pytest.raises(ValueError, match="n_embd is 576"):
            ctx.control_vector({3: np.ones(10)})
        with pytest.raises(ValueError, match="1..29"):
            ctx.control_vector({0: np.ones(576)})


def test_a_patched_input_is_what_every_layer_reads(model):
    """The KQ mask patched to hide the first token from every later one changes the logits like
    a run without that token's cell visible: the patch writes the leaf before its first reader."""
    with _ctx(model) as ctx:

        def hide_first(x, info):
            x[1:, 0] = -np.inf

        with ctx.patch("attn_inp_kq_mask", hide_first) as p:
            ctx.decode(_batch(model, (0, A)))
        assert p.n_calls == 1
        hidden = ctx.logits().copy()
        ctx.memory.clear()
        ctx.decode(_batch(model, (0, A)))
        assert not np.array_equal(ctx.logits(), hidden)


def test_lifetimes_records_outlive_the_context_and_closed_contexts_raise(model):
    ctx = _ctx(model)
    with ctx.capture("l_out", layers=[1]) as cap:
        ctx.decode(_batch(model, (0, A)))
    ctx.close()
    assert cap["l_out", 1].shape == (7, 576)  # the arena belongs to the capture
    with pytest.raises(pl.ClosedError):
        ctx.capture("l_out")


def test_lib_has_the_tap_helpers():
    assert lib.PYL_TAP_NAME == 64


def test_a_synthetic_models_nodes_match_numpy(tmp_path):
    """On a random-weight F32 llama with a mixture of experts: the projections, the router's
    softmax and its top-k choice, recomputed with numpy from the GGUF's own tensors."""
    path = make_model(
        tmp_path / "moe.gguf",
        "llama",
        n_layer=2,
        n_embd=64,
        n_head=4,
        n_vocab=128,
        n_ff=32,
        n_expert=4,
        n_expert_used=2,
    )
    w = {
        t.name: np.asarray(t.data, np.float64).reshape(tuple(int(x) for x in reversed(t.shape)))
        for t in GGUFReader(str(path)).tensors
    }
    with pl.Model(path) as m, m.context(n_ctx=256, n_threads=1, flash_attn="off") as ctx:
        b = pl.Batch(8, 1)
        b.add_sequence([5, 6, 7, 8, 9], 0, 0, logits="last")
        with ctx.capture(
            "embd",
            "attn_norm",
            "Qcur",
            "ffn_norm",
            "ffn_moe_logits",
            "ffn_moe_probs",
            "ffn_moe_topk",
            layers=[1],
            which="all",
        ) as cap:
            ctx.decode(b)
    assert np.array_equal(cap["embd"], w["token_embd.weight"][[5, 6, 7, 8, 9]].astype(np.float32))
    x = cap.get("attn_norm-1").astype(np.float64)
    q = next(r for r in cap.records if r.name == "Qcur-1" and r.op == "MUL_MAT").data
    assert np.allclose(q, x @ w["blk.1.attn_q.weight"].T, rtol=1e-5, atol=1e-6)
    logits = cap["ffn_norm", 1].astype(np.float64) @ w["blk.1.ffn_gate_inp.weight"].T
    assert np.allclose(cap["ffn_moe_logits", 1], logits, rtol=1e-5, atol=1e-6)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    assert np.allclose(cap["ffn_moe_probs", 1], probs, atol=1e-6)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :2]
    assert np.array_equal(np.sort(cap["ffn_moe_topk", 1], -1), np.sort(top, -1))


def test_rows_of_a_pass_split_into_kv_streams(model):
    """Without kv_unified, two sequences in one ubatch give attention tensors of ne[3] = 2 streams:
    their rows run stream by stream, and one sequence's rows equal that sequence decoded alone."""
    kw = {"n_ctx": 1024, "n_seq_max": 2, "kv_unified": False}
    with _ctx(model, **kw) as both, _ctx(model, **kw) as alone:
        with both.capture("l_out", "kq_soft_max", "attn_inp_kq_mask", layers=[3]) as cap:
            both.decode(_batch(model, (0, A), (1, B)))
        with alone.capture("kq_soft_max", layers=[3]) as one:
            alone.decode(_batch(model, (1, B)))
    sm = next(r for r in cap.records if r.name == "kq_soft_max-3")
    assert sm.shape == (2, 9, 7, 256) and sm.n_stream == 2 and sm.rows.tolist() == list(range(14))
    assert cap["kq_soft_max", 3].shape == (9, 14, 256)  # the streams joined on the rows axis
    assert np.array_equal(cap.rows(seq_id=1)["kq_soft_max", 3], one["kq_soft_max", 3])
    mask = next(r for r in cap.records if r.name == "attn_inp_kq_mask")
    assert mask.ne == (256, 7, 1, 2) and mask.n_stream == 2  # [n_kv, n_tokens/n_stream, 1, n_stream]
    assert cap["l_out", 3].shape == (14, 576)


def test_the_listing_has_the_contexts_kv_streams(model):
    """Without kv_unified each sequence has its own KV stream and the cache's nodes are named
    after that ("cache_k_l0 (reshaped) (view)"): the listing's probe has as many streams."""
    with _ctx(model, n_ctx=1024, n_seq_max=2, kv_unified=False) as ctx:
        writes = [n.name for n in ctx.graph_nodes() if n.op == "SET_ROWS" and n.layer is None]
        assert writes[0] == "cache_k_l0 (reshaped) (view)"
        with ctx.capture("cache_k_l0 (reshaped) (view)") as cap:
            ctx.decode(_batch(model, (0, A), (1, B)))
    assert cap.records[0].op == "SET_ROWS" and cap.records[0].shape == (1024, 192)  # both streams' cells
    with _ctx(model, n_ctx=1024, n_seq_max=2, kv_unified=True) as uni:
        assert [n.name for n in uni.graph_nodes() if n.op == "SET_ROWS"][0] == "cache_k_l0 (view)"


# -- behaviours held against planted bugs (issue 28)


def test_a_site_is_the_last_node_of_its_name_and_which_counts_from_the_end(model):
    """``Qcur-0`` names a MUL_MAT, a RESHAPE and a ROPE: a site means the last (the ROPE, what
    attention reads); ``which=`` an index among them, negative from the end."""
    with _ctx(model) as ctx:
        g = ctx.graph_nodes()
        assert [n.op for n in pl.taps.resolve(g, "Qcur", layers=[0])] == ["ROPE"]
        for which, op in ((-1, "ROPE"), (-2, "RESHAPE"), (-3, "MUL_MAT"), (0, "MUL_MAT"), (2, "ROPE")):
            assert [n.op for n in pl.taps.resolve(g, "Qcur-0", which=which)] == [op], which
        with pytest.raises(TapError, match=r"which=-4: Qcur-0 names 3 node\(s\)"):
            pl.taps.resolve(g, "Qcur-0", which=-4)
        with ctx.capture("Qcur", layers=[0]) as plain:
            ctx.decode(_batch(model, (0, A)))
        ctx.memory.clear()
        with ctx.capture("Qcur", layers=[0], which=-1) as last:
            ctx.decode(_batch(model, (0, A)))
    # the op of the tensor C copied, not the listing's: the ROPE, both ways
    assert [(r.name, r.op, r.occurrence) for r in plain.records] == [("Qcur-0", "ROPE", 2)]
    assert [(r.name, r.op, r.occurrence) for r in last.records] == [("Qcur-0", "ROPE", 2)]
    assert np.array_equal(plain["Qcur", 0], last["Qcur", 0])


def test_rows_of_several_calls_are_joined_in_call_then_ubatch_order(model):
    """The prompt's two ubatches and three one-token steps: ``cap[site, layer]`` is the records'
    data end to end in (call, ubatch) order, value for value, and so is one sequence's view."""
    cap, _, recs = _captured_in_generate(model, "l_out")
    want = np.concatenate([r.data for r in sorted(recs, key=lambda r: (r.call, r.ubatch))])
    assert want.shape == (10, 576) and len({row.tobytes() for row in want}) == 10  # ten different rows
    assert np.array_equal(cap["l_out", 3], want)
    assert np.array_equal(cap.rows(seq_id=0)["l_out", 3], want)
    assert np.array_equal(cap.get(("l_out", 3), call=0), want[:7])


def test_a_patch_that_raised_is_called_again_on_the_next_decode_in_the_block(model):
    """A failure disarms the taps for the rest of that decode only: in the same ``with`` block the
    next decode calls the patch again, and what it writes reaches the logits."""
    vec = np.random.default_rng(2).normal(0, 0.5, 576).astype(np.float32)
    with _ctx(model) as ctx:
        ctx.decode(_batch(model, (0, A)))
        base = ctx.logits().copy()
        ctx.memory.clear()
        calls = []

        def once(x, info):
            calls.append(info.call)
            if len(calls) == 1:
                raise ZeroDivisionError("the first call")
            return x + vec

        with ctx.patch("l_out", once, layers=[10]) as p:
            with pytest.raises(ZeroDivisionError, match="the first call"):
                ctx.decode(_batch(model, (0, A)))
            assert ctx.memory.seq_pos_max(0) == -1  # the failed ubatch is gone
            ctx.decode(_batch(model, (0, A)))
            assert p.n_calls == 2 and calls == [0, 1]
            patched = ctx.logits().copy()
        ctx.memory.clear()
        with ctx.patch("l_out", lambda x, info: x + vec, layers=[10]):
            ctx.decode(_batch(model, (0, A)))
        assert np.array_equal(patched, ctx.logits()) and not np.array_equal(patched, base)


# -- behaviours held against the mutants of a sample (issue 28: tools/mutation/run.py taps)


def test_one_pass_of_a_tensor_without_rows_is_a_view_and_passes_of_two_shapes_are_refused(model):
    """``cap[name]`` of a tensor with no token axis: one pass is that record's memory with a
    leading passes axis (a view, not a copy); passes of different shapes (the attention's view of
    the cache grows with n_kv) are refused with the reason, not left to numpy."""
    with _ctx(model, n_ctx=1024, n_batch=512) as ctx:
        first = pl.Batch(512, 1)
        first.add_sequence(model.tokenize(A), 0, 0, logits="last")
        with ctx.capture("cache_k_l0") as one:
            ctx.decode(first)
        [rec] = one.records
        assert rec.token_axis is None and one["cache_k_l0"].shape == (1, *rec.shape)
        assert np.shares_memory(one["cache_k_l0"], rec.data)
        ctx.memory.clear()
        second = pl.Batch(512, 1)
        second.add_sequence(list(range(100, 400)), 0, len(model.tokenize(A)), logits="last")
        with ctx.capture("cache_k_l0 (view)") as grown:
            ctx.decode(first)
            ctx.decode(second)  # n_kv 256, then 512
    assert [r.shape[0] for r in grown.records] == [256, 512]
    with pytest.raises(TapError, match="its passes have different shapes"):
        grown["cache_k_l0 (view)"]


def test_rows_are_matched_by_token_and_position_when_the_plan_disagrees(model, monkeypatch):
    """Each record's rows come from the ubatch plan, checked against the pass's own inp_tokens and
    inp_pos; where the plan is wrong they are found by (token, position) instead: a plan that
    lists the ubatch's rows backwards still gives the right rows and the same data."""
    from pyllamacpp.taps import _capture

    def run(tokens):
        with _ctx(model, n_ubatch=4, n_batch=64) as ctx, ctx.capture("l_out", layers=[3]) as cap:
            b = pl.Batch(64, 1)
            b.add_sequence(tokens, 0, 0, logits="last")
            ctx.decode(b)
        return cap

    text, same = model.tokenize(A), [model.tokenize(" the")[-1]] * 7  # one token 7 times: only positions differ
    right = [run(text), run(same)]
    plan = _capture.plan_ubatches
    monkeypatch.setattr(_capture, "plan_ubatches", lambda f, call: [u[::-1].copy() for u in plan(f, call)])
    wrong = [run(text), run(same)]
    for r, w in zip(right, wrong):
        assert [x.rows.tolist() for x in r.records if x.name == "l_out-3"] == [[0, 1, 2, 3], [4, 5, 6]]
        assert [x.rows.tolist() for x in w.records if x.name == "l_out-3"] == [[0, 1, 2, 3], [4, 5, 6]]
        assert np.array_equal(w["l_out", 3], r["l_out", 3]) and r.n_passes == w.n_passes == 2


def test_a_patch_is_told_each_call_of_its_block(model):
    """``info.call`` counts the decodes since the patch was armed: 0, 1, 2, 3 over four calls."""
    seen = []
    with _ctx(model) as ctx, ctx.patch("l_out", lambda x, info: seen.append((info.call, info.ubatch)), layers=[2]):
        ctx.decode(_batch(model, (0, A)))
        for i in range(3):
            b = pl.Batch(1, 1)
            b.add(model.tokenize(B)[i], len(model.tokenize(A)) + i, 0, logits=True)
            ctx.decode(b)
    assert seen == [(0, 0), (1, 0), (2, 0), (3, 0)]


def test_the_inputs_named_as_graph_sites_lists_them(model):
    """``Graph.input_names()``: a leaf input by its name, a layered KV tensor once with its layers."""
    with _ctx(model) as ctx:
        names = ctx.graph_nodes().input_names()
    assert names[:2] == ["inp_tokens", "inp_pos"] and "cache_k_l<0..29>" in names and "cache_v_l<0..29>" in names
    assert not any("None" in n for n in names)


def test_pass_counters_on_the_taps_nest(model):
    """Two counters on one context's taps: each counts the passes of its own lifetime, and the
    outer one still counts after the inner one closed (7 tokens at n_ubatch 4: 2 passes)."""
    with _ctx(model, n_ubatch=4, n_batch=64) as ctx:
        with pl.PassCounter(ctx) as outer:
            with pl.PassCounter(ctx) as inner:
                ctx.decode(_batch(model, (0, A)))
            ctx.memory.clear()
            ctx.decode(_batch(model, (0, A)))
            assert (inner.n_passes, outer.n_passes) == (2, 4)
        assert not ctx._taps.armed


def test_layers_past_the_end_are_refused_with_the_models_range(model):
    with _ctx(model) as ctx:
        with pytest.raises(
            TapError, match=r"layers \[-31, 30\]: the model's layers are 0\.\.29 .*-1 is layer 29, -30 is"
        ):
            ctx.capture("l_out", layers=[-31, 30, 2])
        with ctx.capture("l_out", layers=[0]) as cap:
            pass
    assert cap.n_passes == 0 and cap.records == []


def test_a_quantized_cache_is_read_dequantized(model):
    """A q8_0 KV cache's record: ``data`` its blocks as bytes, ``array()`` float32 numbers as
    ``gguf.quants.dequantize`` reads them, of the record's shape."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    n = len(model.tokenize(A))
    with _ctx(model, type_k="q8_0", type_v="q8_0", flash_attn="on") as ctx:
        ctx.decode(_batch(model, (0, A)))
        step = pl.Batch(1, 1)
        step.add(model.tokenize(B)[0], n, 0, logits=True)
        with ctx.capture("cache_k_l0") as cap:  # an input is copied as the pass first reads it
            ctx.decode(step)
    [rec] = cap.records
    assert rec.type == "q8_0" and rec.data.dtype == np.uint8
    x = rec.array()
    assert x.dtype == np.float32 and x.shape == rec.shape == (512, 192)
    assert np.array_equal(x, gguf_dequantize(rec.data, GGMLQuantizationType.Q8_0).reshape(rec.shape))
    assert all(np.abs(x[i]).max() > 0 for i in range(n)) and not x[n + 1 :].any()  # the prompt's cells, no others


RAW_DECODE = """
import pyllamacpp as pl
from pyllamacpp import lib
m = pl.Model()
seen = []
def batch(s, text):
    b = pl.Batch(64, 1, model=m)
    b.add_sequence(m.tokenize(text), s, 0, logits="last")
    return b
with m.context(n_ctx=512, n_threads=1, n_threads_batch=1, flash_attn="off", n_seq_max=2) as ctx:
    b0 = batch(0, "The cat sat on the mat.")
    with ctx.patch("l_out", lambda x, info: seen.append((info.call, info.rows, info.seq_ids)), layers=[2]):
        assert lib.llama_decode(ctx.ptr, b0.struct) == 0
        ctx.decode(batch(1, "A dog ran in the park!"))
n = len(m.tokenize("A dog ran in the park!"))
assert seen[0] == (-1, None, None) and seen[1][0] == 0 and seen[1][2] == ((1,),) * n, seen
print("OK")
"""


def test_a_patch_in_a_raw_llama_decode_is_told_no_call():
    """A decode that does not go through ``Context.decode`` (``lib.llama_decode`` on the batch's
    struct) still runs the patch, which is told call -1 and no rows: the taps saw no batch. In a
    child process: a regression here reads the taps' C call table out of bounds."""
    assert run_child(RAW_DECODE).stdout.endswith("OK\n")


def test_sites_leave_out_views_and_unnamed_nodes(model):
    with _ctx(model) as ctx:
        sites = ctx.graph_nodes().sites()
    assert sites[:2] == ["embd", "norm"] and {"attn_norm", "Qcur", "l_out", "result_output"} <= set(sites)
    assert not [s for s in sites if " (" in s or s.startswith("node_")]


def test_a_counter_keeps_its_count_across_a_capture_on_the_same_taps(model):
    """A capture resets the C counters when it starts: the counter around it loses no pass."""
    with _ctx(model, n_ubatch=4, n_batch=64) as ctx, pl.PassCounter(ctx) as pc:
        ctx.decode(_batch(model, (0, A)))
        ctx.memory.clear()
        with ctx.capture("l_out", layers=[1]) as cap:
            ctx.decode(_batch(model, (0, A)))
        ctx.memory.clear()
        ctx.decode(_batch(model, (0, A)))
        assert pc.n_passes == 6 and cap.n_passes == 2


OP_DIFFERS = """
import dataclasses
import pyllamacpp as pl
from pyllamacpp.errors import TapError
m = pl.Model()
def batch():
    b = pl.Batch(64, 1, model=m)
    b.add_sequence(m.tokenize("The cat sat on the mat."), 0, 0, logits="last")
    return b
with m.context(n_ctx=512, n_threads=1, n_threads_batch=1, flash_attn="off") as ctx:
    with ctx.capture("l_out", layers=[4]) as cap:
        cap.nodes[:] = [dataclasses.replace(n, op="MUL_MAT") for n in cap.nodes]
        ctx._taps.rearm()
        try:
            ctx.decode(batch())
            raise SystemExit("no TapError")
        except TapError as e:
            assert "l_out-4: this pass's graph differs from the listing (a ADD node" in str(e), e
    assert ctx.memory.seq_pos_max(0) == -1
    ctx.decode(batch())  # the context is usable
print("OK")
"""


def test_a_pass_whose_op_differs_from_the_listing_is_refused():
    """C checks each wanted node's op against the listing's: a listing that says MUL_MAT where
    the pass has an ADD (``l_out``) stops the decode with a TapError naming the op it met, and the
    context stays usable. In a child process: the C failure path is what is tested."""
    assert run_child(OP_DIFFERS).stdout.endswith("OK\n")


def test_rows_of_a_long_ubatch(model):
    """A 40-token ubatch: each record's rows are the batch's 40, checked against the pass's own
    inp_tokens and inp_pos copies (160 bytes each, read back from the capture's arena)."""
    tokens = (model.tokenize(A + " " + B).tolist() * 4)[:40]
    with _ctx(model) as ctx, ctx.capture("l_out", "attn_norm", layers=[3]) as cap:
        b = pl.Batch(64, 1)
        b.add_sequence(tokens, 0, 0, logits="all")
        ctx.decode(b)
    for r in cap.records:
        assert r.rows.tolist() == list(range(40)) and r.pos.tolist() == list(range(40)), r.name
        assert r.tokens.tolist() == tokens


def test_the_listing_table_names_each_nodes_rows_axis(model):
    with _ctx(model) as ctx:
        lines = ctx.graph_nodes().table(layers=[5]).splitlines()
    assert lines[0].split()[-1] == "rows"
    by_name = {ln.split()[1]: ln for ln in lines[1:]}
    assert by_name["l_out-5"].endswith("axis 0") and by_name["kq_soft_max-5"].endswith("axis 1")
    assert by_name["cache_k_l5"].endswith(" -")  # the cache has no axis of batch rows
