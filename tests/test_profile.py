"""prefill-profile (pyllamacpp.experiments.profile): the compute buffer against the tensors that
fill it, and a prefill's time by op type from a pass timed node by node."""

from __future__ import annotations

import json

import pytest

from pyllamacpp.cli import main
from pyllamacpp.experiments import profile

ONE = {"n_threads": 1, "n_threads_batch": 1}
N_FF = 1536  # the default model's FFN width (llama.feed_forward_length)


@pytest.fixture(scope="module")
def row(model):
    # 48 tokens at -ub 16: three passes of 16 rows, the last with the one output
    return profile.measure(
        model, n_ctx=256, n_batch=64, n_ubatch=16, n_prompt=48, repeat=1, clock="cpu", ctx_kwargs=ONE
    )


def test_the_reserve_is_the_logits_of_an_all_output_ubatch(model, row):
    n_vocab = model.n_vocab
    top = row["largest"][0]
    # llama.cpp reserves for -ub tokens that are all outputs: the logits dominate
    assert (top["name"], top["op"], top["shape"], top["bytes"]) == (
        "result_output",
        "MUL_MAT",
        [16, n_vocab],
        16 * n_vocab * 4,
    )
    reserved = row["reserved"]["default"]
    assert top["bytes"] > 0.9 * reserved
    # the tensors of that pass reach as far into the buffer as the reserve (the log rounds MiB
    # to 2 places: 5,243 bytes)
    assert abs(row["high_water_all_outputs"] - reserved) <= 5243
    # a prefill outputs one token: one row of logits, then the FFN activations of its 16 rows; it
    # needs what a context reserving for one output reserves
    big = [(x["name"], x["shape"], x["bytes"]) for x in row["largest_prefill"][:2]]
    assert big == [("result_output", [1, n_vocab], n_vocab * 4), ("ffn_gate-0", [16, N_FF], 16 * N_FF * 4)]
    assert abs(row["high_water"]["bytes"] - row["reserved"]["one_output"]) <= 5243
    assert row["high_water"]["bytes"] < 0.2 * reserved
    assert row["n_passes"] == 3


def test_the_profile_accounts_for_the_pass(row):
    # every node that computes is one group: 3 passes of the same graph, each ~580 groups
    assert row["groups"] % 3 == 0 and 500 <= row["groups"] // 3 <= 700
    ops = row["by_op"]
    assert next(iter(ops)) == "MUL_MAT" and all(v >= 0 for v in ops.values())
    assert "RESHAPE" not in ops and "VIEW" not in ops  # views are computed with the next node
    # node times and the rest partition the decode's time; the nodes are most of it
    assert sum(ops.values()) == pytest.approx(row["inside_ms"])
    assert row["inside_ms"] + row["outside_ms"] == pytest.approx(row["wall_ms_mean"])
    assert 0 <= row["outside_ms"] < row["inside_ms"]
    assert row["plain_ms"] > 0 and row["distortion"] > 0


def test_an_exception_in_the_timer_stops_the_decode_and_is_raised(model):
    timer = profile.NodeTimer(first="no such node")  # no pass ever starts: the first stamp fails
    with model.context(n_ctx=256, cb_eval=timer.cb, taps=False, **ONE) as ctx:
        timer.reset("time")
        ctx.prefill(model.tokenize("The cat sat on the mat."))
        with pytest.raises(IndexError):
            timer.check()
        timer.check()  # raised once
    with pytest.raises(ValueError, match="off, list or time"):
        timer.reset("fast")


def test_the_command_prints_both_tables_and_draws(tmp_path, capsys):
    png = tmp_path / "p.png"
    argv = ["prefill-profile", "-t", "1", "-c", "256", "-p", "8", "-ub", "8,2", "-r", "1", "--clock", "cpu"]
    assert main([*argv, "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert "reserved, n_outputs_max 1" in out and "outside nodes" in out and "MUL_MAT" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["n_ubatch"] for r in data["rows"]] == [8, 2] and data["clock"] == "cpu"
    assert data["rows"][1]["n_passes"] == 4
