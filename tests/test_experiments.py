"""The experiment commands run end to end on the default model, and their output has substance."""

from __future__ import annotations

import json

import pytest

from pyllamacpp.cli import main


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_ubatch_sweep_buffers_fall_with_ub_and_clamp(capsys, tmp_path):
    data = _json(
        capsys,
        ["ubatch-sweep", "-c", "512", "-p", "64", "-n", "2", "-r", "1", "-t", "2", "--ubatch-list", "256,128,64"],
    )
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
    assert (
        main(["ubatch-sweep", "-c", "256", "-p", "16", "-n", "1", "-r", "1", "--ubatch-list", "64,32", "-o", str(png)])
        == 0
    )
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


def test_kvprobe_save_parses_and_cells_equal_the_prompt(capsys, tmp_path, model):
    import pyllamacpp.state as st

    f = tmp_path / "state-f16.bin"
    data = _json(
        capsys,
        [
            "kvprobe",
            "-c",
            "512",
            "-np",
            "2",
            "--kv-unified",
            "--ops",
            f"text:0:The cat sat on the mat.;save:0:{f};show:0;gen:0:3;cp:0:1;rm:1:2:-1;show:1;"
            f"shift:1:4;show:1;clear;load:1:{f};gen:1:2;show:1",
        ],
    )
    assert "error" not in data
    ops = data["ops"]
    assert ops[0]["tokens"] == model.tokenize("The cat sat on the mat.").tolist()
    parsed = st.parse(f)  # uses the sidecar for the head count
    assert parsed.stream().cell_count == 7 and parsed.k[0].shape == (7, 3, 64)
    assert parsed.nbytes == ops[1]["bytes"] == f.stat().st_size
    assert st.read_sidecar(f)["tokens"] == ops[0]["tokens"]
    assert (ops[2]["cells"], ops[2]["pos_max"]) == (7, 6)
    assert (ops[6]["pos_min"], ops[6]["pos_max"], ops[6]["cells"]) == (0, 1, 2)
    assert (ops[8]["pos_min"], ops[8]["pos_max"]) == (4, 5)
    # greedy continuation after reloading equals the one before saving
    assert ops[11]["tokens"] == ops[3]["tokens"][:2]
    assert ops[12]["cells"] == 9


@pytest.mark.parametrize(
    "ops, why",
    [
        ("text:0:hi;bogus:1", "unknown op"),
        ("text:3:hi", "outside"),
        ("gen:0:x", "invalid literal"),
        ("load:0:/nonexistent/file.bin", "no such file"),
        ("rm:0:1", "field"),
        ("", "no ops"),
    ],
)
def test_kvprobe_refuses_bad_ops_before_running(capsys, ops, why):
    assert main(["kvprobe", "-np", "2", "--ops", ops]) == 2
    err = capsys.readouterr().err
    assert why in err


def test_kvprobe_stops_at_a_queued_cross_stream_copy(capsys, tmp_path):
    # llama.cpp queues seq_cp between streams until the next decode: a load before it would be
    # overwritten, so the load is refused, with the ops before it reported.
    f = tmp_path / "s.bin"
    data = json.loads(
        (
            main(
                [
                    "kvprobe",
                    "-c",
                    "512",
                    "-np",
                    "2",
                    "--no-kv-unified",
                    "--json",
                    "--ops",
                    f"text:0:The cat;save:0:{f};cp:0:1;clear;load:1:{f}",
                ]
            ),
            capsys.readouterr().out,
        )[1]
    )
    assert len(data["ops"]) == 4 and "queued" in data["error"]


def test_parse_state_cli(capsys, tmp_path, model):
    f = tmp_path / "d.bin"
    with model.context(n_ctx=256, n_threads=2) as ctx:
        ctx.prefill(model.tokenize("The cat sat on the mat."))
        ctx.save_seq_dump(f, 0, sidecar=False)
    assert main(["parse-state", str(f), "--heads", "3", "--hex", "--cells", "2"]) == 0
    out = capsys.readouterr().out
    assert "sequence dump" in out and "162,108 bytes" in out and "metadata 828 B + payload 161,280 B" in out
    assert "K: " in out and " -> " in out
    data = _json(capsys, ["parse-state", str(f), "--heads", "3"])
    assert data["metadata_bytes"] + data["payload_bytes"] == data["file_size"] == 162_108
    assert data["records"][0]["header_offset"] == 108 and data["records"][0]["data_offset"] == 120
    assert len(data["parts"][0]["cells"]) == 3
    pytest.importorskip("matplotlib")
    png = tmp_path / "kv.png"
    assert main(["plot-state", str(f), "--heads", "3", "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_prefix_sharing_uses_fewer_cells_and_matches(capsys):
    data = _json(capsys, ["prefix-sharing", "-np", "3", "-n", "4", "-t", "2"])
    assert data["ok"]
    by = {r["mode"]: r for r in data["rows"]}
    p = data["n_prompt"]
    uni, split = by["unified"], by["split"]
    assert uni["shared_cells"] == p and uni["copies_cells"] == 3 * p  # counted from the state dump
    assert split["shared_cells"] == 3 * p  # one copy of the prefix per stream: the cost
    for r in data["rows"]:
        assert all(r["matches_alone"]) and r["decode_tps"] > 0


def test_prefix_sharing_workload_through_the_scheduler(capsys, tmp_path):
    argv = ["prefix-sharing", "--requests", "5", "-np", "2", "-n", "4", "-t", "1", "-fa", "off", "-c", "512"]
    data = _json(capsys, argv)
    assert data["mode"] == "workload" and data["ok"]
    off, on = data["rows"]
    assert not off["prefix_cache"] and on["prefix_cache"] and on["kv_unified"]
    assert off["n_prompt_reused"] == 0 and off["n_prompt_decoded"] == off["n_prompt"]
    # the system prompt is decoded once, then shared: every later request reuses at least it
    assert on["n_prompt_decoded"] + on["n_prompt_reused"] == on["n_prompt"] == off["n_prompt"]
    assert on["n_prompt_reused"] >= 4 * (data["n_system"] - 1)
    assert on["peak_cells"] < off["peak_cells"]  # counted from state dumps
    assert off["n_tokens"] == on["n_tokens"] == 5 * 4 and all(data["same_tokens"])
    assert [r["n_prompt_reused"] for r in on["requests"]][0] == 0
    pytest.importorskip("matplotlib")
    png = tmp_path / "workload.png"
    assert main(argv + ["-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert "prefix cache" in out and "same greedy tokens with and without the cache: 5/5" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["prefix-sharing", "--requests", "-1"]) == 2


def test_placement_flash_attention_off_restores_bit_identical(capsys, tmp_path):
    # one thread and a short prompt keep it quick; the effect with flash attention on needs
    # n_kv >= 512 and several threads (see the module), which the default flags give
    data = _json(capsys, ["placement", "-t", "1", "-p", "40", "--occupy", "16"])
    assert data["ok"] and data["n_prompt"] == 40
    rows = {(r["flash_attn"], r["case"]): r for r in data["rows"]}
    assert sorted(rows) == [("off", "other cells"), ("off", "same cells"), ("on", "other cells"), ("on", "same cells")]
    for fa, case in rows:
        r = rows[fa, case]
        assert r["argmax_match"] and r["argmax_ref"] == rows["off", "same cells"]["argmax_ref"]
        if fa == "off" or case == "same cells":  # no cell moved, or a kernel that does not care
            assert r["max_abs_diff"] == 0 and r["bit_identical"] and r["n_differ"] == 0
    assert rows["on", "other cells"]["cells"] == "16..55" and rows["on", "same cells"]["cells"] == "0..39"
    assert main(["placement", "-t", "1", "-p", "24", "--occupy", "8", "-fa", "off"]) == 0
    out = capsys.readouterr().out
    assert out.count("bit-identical") == 2 and "other cells" in out and "greedy same" in out
    pytest.importorskip("matplotlib")
    png = tmp_path / "placement.png"
    assert main(["placement", "-t", "1", "-p", "24", "--occupy", "8", "-o", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["placement", "--prompt", "a", "-p", "0"]) == 2  # one token: nothing to restore
    err = capsys.readouterr().err  # the command's own words, not the generic "error:" line
    assert err.splitlines()[-1].startswith("pyllamacpp placement: the prompt has 1 token(s): at least 2"), err
