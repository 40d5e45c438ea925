"""The experiment commands run end to end on the default model, and their output has substance."""
from __future__ import annotations

import json

import pytest

from pyllamacpp.cli import main


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_ubatch_sweep_buffers_fall_with_ub_and_clamp(capsys, tmp_path):
    data = _json(capsys, ["ubatch-sweep", "-c", "512", "-p", "64", "-n", "2", "-r", "1", "-t", "2",
                          "--ubatch-list", "256,128,64"])
    rows = [r for r in data["rows"] if not r["clamp_row"]]
    assert [r["n_ubatch"] for r in rows] == [256, 128, 64]
    compute = [r["compute_mib"]["CPU"] for r in rows]
    assert compute[0] > compute[1] > compute[2] > 0
    # almost all of it is one ubatch of logits: ub x n_vocab x 4 bytes
    assert compute[0] == pytest.approx(256 * 49152 * 4 / 2**20, rel=0.05)
    assert len({r["kv_mib"] for r in rows}) == 1  # KV does not depend on ub
    clamp = data["rows"][-1]
    assert clamp["clamp_row"] and clamp["n_batch_asked"] == 32 and clamp["n_ubatch"] == 32
    assert clamp["compute_mib"]["CPU"] < compute[-1]
    assert all(r["prefill_tps"] > 0 and r["decode_tps"] > 0 for r in data["rows"])
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    assert main(["ubatch-sweep", "-c", "256", "-p", "16", "-n", "1", "-r", "1", "--ubatch-list", "64,32",
                 "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch_isolation_holds_and_its_control_breaks(capsys):
    data = _json(capsys, ["batch-isolation", "-t", "2", "--ubatch-list", "512,4"])
    assert data["verdict"] == "isolated"
    for run in data["runs"]:
        assert run["isolated"] and run["control_breaks"]
        assert all(s["greedy_agree"] for s in run["seqs"])
        assert max(s["control_max_abs_diff"] for s in run["seqs"]) > 1.0
    out = main(["batch-isolation", "--ubatch-list", "8"])
    assert out == 0 and "verdict: isolated" in capsys.readouterr().out
