"""split-plan (pure planner, no model) and trace-ubatches (planner against the real engine)."""

from __future__ import annotations

import argparse
import json

import pytest

from pyllamacpp.experiments import splits, trace
from pyllamacpp.experiments.splits import BatchAllocr, PlanError, plan


def _rows(p):
    return [u.n_tokens for u in p.ubatches]


# -- planner: the examples ------------------------------------------------------------


def test_one_sequence_1500_at_ub_512():
    p = plan(1500, n_batch=2048, n_ubatch=512)
    assert p.split == "simple" and len(p.calls) == 1
    assert _rows(p) == [512, 512, 476]
    assert [u.n_kv for u in p.ubatches] == [512, 1024, 1536]
    last = p.ubatches[-1]
    assert (last.rows[0].token, last.rows[-1].token, last.rows[-1].pos) == (1024, 1499, 1499)
    assert [u.n_outputs for u in p.ubatches] == [0, 0, 1]


def test_5000_tokens_make_three_decode_calls_and_ten_passes():
    p = plan(5000, n_batch=2048, n_ubatch=512, n_ctx=8192)
    assert [c.n_tokens for c in p.calls] == [2048, 2048, 904]
    assert [len(c.ubatches) for c in p.calls] == [4, 4, 2]
    assert _rows(p) == [512] * 9 + [392]
    assert p.calls[1].rows[0].slot == 0 and p.calls[1].rows[0].pos == 2048  # slots restart per call


def test_n_kv_is_padded_to_256():
    assert [u.n_kv for u in plan(300, 512, 128, n_ctx=1024).ubatches] == [256, 256, 512]
    assert plan(1, n_past=255).ubatches[0].n_kv == 256  # 256 cells used
    assert plan(1, n_past=256).ubatches[0].n_kv == 512  # 257 -> 512
    u = plan(1, n_past=600, n_ctx=700).ubatches[0]
    assert u.n_kv == 768 and u.mask_shape == (768, 1, 1, 1)


def test_eight_sequences_one_step_unified_is_one_8_row_ubatch():
    p = plan(1, n_seqs=8, n_past=40, kv_unified=True)
    assert p.split == "simple" and len(p.ubatches) == 1
    u = p.ubatches[0]
    assert u.n_tokens == 8 and u.seq_ids == tuple(range(8)) and u.n_stream == 1
    assert [r.pos for r in u.rows] == [40] * 8 and u.n_outputs == 8
    assert u.n_kv == 512 and u.mask_shape == (512, 8, 1, 1)  # 320 + 8 cells in one stream


def test_non_unified_takes_split_equal():
    p = plan([100, 50, 30, 10], n_seq_max=4, kv_unified=False)
    assert (p.split, p.sequential, p.n_stream_kv, p.n_ctx_seq) == ("equal", True, 4, 1024)
    assert _rows(p) == [40, 60, 40, 50]
    assert [(u.n_seqs, u.n_seq_tokens) for u in p.ubatches] == [(4, 10), (3, 20), (2, 20), (1, 50)]
    assert [u.mask_shape[1:] for u in p.ubatches] == [(10, 1, 4), (20, 1, 3), (20, 1, 2), (50, 1, 1)]
    # rows are grouped per sequence set, in order
    assert [r.seq_id for r in p.ubatches[0].rows] == [0] * 10 + [1] * 10 + [2] * 10 + [3] * 10
    # one sequence with one stream: split_simple even without --kv-unified
    assert plan(100, kv_unified=False).split == "simple"


def test_sequential_equal_split_needs_consecutive_seq_ids():
    p = plan([10, 0, 10], n_seq_max=3)  # seq 1 absent: seq 2 may not join seq 0's ubatch
    assert [u.seq_ids for u in p.ubatches] == [(0,), (2,)]
    p = plan([10, 0, 10], n_seq_max=3, mode="equal", kv_unified=True)  # not sequential: together
    assert [u.seq_ids for u in p.ubatches] == [(0, 2)] and not p.sequential


def test_interleaved_layout_and_n_batch_chunks():
    p = plan(5, n_seqs=3, layout="interleave", n_batch=4, n_ubatch=4, kv_unified=True)
    assert [c.n_tokens for c in p.calls] == [4, 4, 4, 3]
    assert [(r.seq_id, r.token) for r in p.calls[0].rows] == [(0, 0), (1, 0), (2, 0), (0, 1)]
    assert sum(u.n_outputs for u in p.ubatches) == 3


def test_split_seq_and_coupled_sequences():
    b = BatchAllocr([(0, 1), (0, 1), (0,), (1,)])
    assert splits.split_all(b, 8, "seq") == [([0, 1, 2], 1, True), ([3], 1, True)]
    b = BatchAllocr([(0, 1), (0, 1), (2,), (2,)])
    assert splits.split_all(b, 8, "equal", sequential=False) == [([0, 1, 2, 3], 2, True)]
    with pytest.raises(PlanError, match="coupled"):
        splits.split_all(b, 8, "equal", sequential=True)


def test_clamps_and_refusals():
    p = plan(100, n_batch=512, n_ubatch=512, n_ctx=256)
    assert (p.n_batch, p.n_ubatch) == (256, 256) and p.notes
    p = plan(10, n_seq_max=3, n_ctx=1000)  # n_ctx_seq = GGML_PAD(1024 / 3, 256)
    assert (p.n_ctx_seq, p.n_ctx) == (512, 1536)
    with pytest.raises(PlanError, match="KV cache full"):
        plan(5000, n_batch=2048, n_ctx=4096)
    with pytest.raises(PlanError, match="n_seq_max"):
        plan(1, n_seqs=4, n_seq_max=2)


def _parser(mod):
    ap = argparse.ArgumentParser()
    mod.add_parser(ap.add_subparsers(dest="command", required=True))
    return ap


def test_split_plan_command_text_json_html(capsys, tmp_path):
    ap = _parser(splits)
    args = ap.parse_args(["split-plan", "--tokens", "1500", "--n-batch", "2048", "--n-ubatch", "512"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "split_simple" in out and "476 rows" in out and "3 ubatch(es)" in out
    html = tmp_path / "plan.html"
    args = ap.parse_args(["split-plan", "--tokens", "100,50,30,10", "-np", "4", "--json", "-o", str(html)])
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert [u["n_tokens"] for c in data["calls"] for u in c["ubatches"]] == [40, 60, 40, 50]
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "split_equal" in page and "<script src" not in page


# -- planner against the engine (default model) ------------------------------------------------

CTX = dict(n_threads=1, n_threads_batch=1)


def _check(data, rows, n_kv=None, streams=None):
    assert data["ok"], data["disagreements"]
    assert [e["n_tokens"] for e in data["engine"]] == rows
    if n_kv is not None:
        assert [e["n_kv"] for e in data["engine"]] == n_kv
    if streams is not None:
        assert [e["n_stream"] for e in data["engine"]] == streams
    assert all(e["pos"] is not None for e in data["engine"])  # positions were compared
    assert data["callbacks_at_creation"] == 0


def test_engine_300_tokens_at_ub_128(model):
    data = trace.trace(model, dict(tokens=300), n_ctx=1024, n_batch=512, n_ubatch=128, flash_attn="on", **CTX)
    _check(data, [128, 128, 44], n_kv=[256, 256, 512], streams=[1, 1, 1])
    assert data["attn_ops"] == ["FLASH_ATTN_EXT"]
    assert data["engine"][0]["n_attn"] == model.n_layer
    assert [e["n_outputs"] for e in data["engine"]] == [0, 0, 1]
    assert data["graphs_reused"] == 1  # pass 1 reused pass 0's graph and still reached the callback


def test_engine_n_kv_padding_past_256_without_flash_attn(model):
    data = trace.trace(model, dict(tokens=10, n_past=250), n_ctx=1024, n_ubatch=6, flash_attn="off", **CTX)
    _check(data, [6, 4], n_kv=[256, 512])  # 256 cells used -> 256, 260 -> 512
    assert data["attn_ops"] == ["SOFT_MAX"]


def test_engine_eight_sequences_one_step_unified(model):
    data = trace.trace(model, dict(tokens=1, n_seqs=8, n_past=4), n_ctx=512, n_seq_max=8, kv_unified=True, **CTX)
    _check(data, [8], n_kv=[256], streams=[1])
    assert data["engine"][0]["mask_ne"] == [256, 8, 1, 1] and data["engine"][0]["pos"] == [4] * 8


def test_engine_non_unified_split_equal(model):
    data = trace.trace(model, dict(tokens=[12, 6, 4, 2]), n_ctx=1000, n_ubatch=32, n_seq_max=4, kv_unified=False, **CTX)
    assert data["plan"]["split"] == "equal" and data["plan"]["n_ctx_seq"] == 256
    _check(data, [8, 6, 4, 6], streams=[4, 3, 2, 1])


def test_engine_disagreement_fails_loudly(capsys):
    ap = _parser(trace)
    # forcing split_simple on a one-stream-per-sequence cache: the engine does split_equal
    args = ap.parse_args(
        [
            "trace-ubatches",
            "--tokens",
            "16,16",
            "-np",
            "2",
            "--no-kv-unified",
            "-c",
            "512",
            "-ub",
            "8",
            "-t",
            "1",
            "--mode",
            "simple",
        ]
    )
    assert args.func(args) == 1
    cap = capsys.readouterr()
    assert "DISAGREE" in cap.err and "n_stream planner 1 engine 2" in cap.out
    args = ap.parse_args(
        ["trace-ubatches", "--tokens", "16,16", "-np", "2", "--no-kv-unified", "-c", "512", "-ub", "8", "-t", "1"]
    )
    assert args.func(args) == 0 and "planner and engine agree" in capsys.readouterr().out


def test_a_refused_shape_says_the_planner_refused_it(capsys):
    """A shape the planner refuses (three sequences, two --past values): exit 2 and one line that
    names the command and the planner, no traceback."""
    ap = _parser(trace)
    args = ap.parse_args(["trace-ubatches", "--tokens", "5,5,5", "--past", "1,2", "-c", "256", "-t", "1"])
    assert args.func(args) == 2
    cap = capsys.readouterr()
    assert cap.err.splitlines()[-1] == "pyllamacpp trace-ubatches: planner: n_past: 2 values for 3 sequences"
    assert cap.out == ""


def test_callback_exception_is_raised_after_decode(model):
    class Boom(trace.EvalTrace):
        def _see(self, t):
            super()._see(t)
            if self.recording:
                raise KeyError("boom in cb_eval")

    with pytest.raises(KeyError, match="boom in cb_eval"):
        trace.trace(model, dict(tokens=4), n_ctx=256, tracer=Boom(), **CTX)
