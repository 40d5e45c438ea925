"""kv-live (pyllamacpp.experiments.kvlive): the KV cache tensors read in their buffer, against the
state dump, byte for byte; a flipped byte on either side must be reported where it is."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pyllamacpp as pl
import pyllamacpp.state as st
from pyllamacpp.cli import main
from pyllamacpp.experiments import kvlive
from pyllamacpp.testing import make_model

ONE = {"n_threads": 1, "n_threads_batch": 1}
ROW = 3 * 64 * 2  # the default model's K (and V) row: 3 KV heads x 64 values, f16


def _watched(model, *, layout="unified", flash_attn="off"):
    """A context holding both built-in prompts (the first split around the second), and its watch."""
    ctx = model.context(n_ctx=512, n_seq_max=2, kv_unified=layout == "unified", flash_attn=flash_attn, **ONE)
    batch = pl.Batch(64, 1, model=model)
    with kvlive.watch(ctx) as w:
        for seq, toks, start in kvlive.schedule(model, kvlive.PROMPTS):
            batch.clear()
            batch.add_sequence(toks, seq, start)
            ctx.decode(batch)
    return ctx, w


@pytest.mark.parametrize(("layout", "fa"), [("unified", "on"), ("unified", "off"), ("split", "off")])
def test_live_rows_equal_the_dump_byte_for_byte(model, layout, fa):
    r = kvlive.run_mode(model, layout=layout, flash_attn=fa, prompts=kvlive.PROMPTS, n_ctx=512, ctx_kwargs=ONE)
    assert r["ok"] and all(s["mismatches"] == 0 for s in r["seqs"])
    # 30 layers x (K + V) x cells x 384 bytes, compared for both sequences (7 and 12 tokens)
    assert [s["bytes"] for s in r["seqs"]] == [60 * 7 * ROW, 60 * 12 * ROW]
    mem = r["memory"]
    # printed from the offsets, not assumed: one buffer, K0 V0 K1 V1 ..., no gaps
    assert mem["order"][:4] == ["K0", "V0", "K1", "V1"] and mem["interleaved"] and mem["gaps"] == 0
    assert mem["buffers"] == {"CPU": 60 * 512 * ROW}
    offsets = {t["name"]: t["buffer_offset"] for t in r["tensors"]}
    assert (offsets["cache_k_l0"], offsets["cache_v_l0"], offsets["cache_k_l1"]) == (0, 512 * ROW, 2 * 512 * ROW)
    assert all(t["v_trans"] == (t["kind"] == "V" and fa == "off") for t in r["tensors"])
    s0, s1 = r["seqs"]
    if layout == "unified":  # seq 0's first 3 tokens, then seq 1's 12, then seq 0's other 4
        assert (s0["stream"], s0["cells"], s1["cells"]) == (0, [0, 1, 2, 15, 16, 17, 18], list(range(3, 15)))
    else:  # a stream each, of n_ctx / 2 cells: the tensors are [192, 256, 2]
        assert (s0["stream"], s1["stream"], s0["cells"], s1["cells"]) == (0, 1, list(range(7)), list(range(12)))
        assert r["tensors"][0]["ne"] == (192, 256, 2, 1)


def test_a_flipped_byte_is_reported_where_it_is(model):
    ctx, w = _watched(model, flash_attn="off")  # V transposed: the value-major comparison
    with ctx:
        blob = ctx.seq_state(0).data
        assert kvlive.compare_seq(ctx, w, 0, dump=blob)["ok"]
        s = st.parse(blob, model=model)
        v5 = s.record("V", 5)
        assert v5.transposed
        bad = blob.copy()
        at = s.address("V", 5, cell=4, head=2, element=7)  # dump cell 4 is cache cell 16 (cells 0..2, 15..18)
        bad[at] ^= 0x01
        r = kvlive.compare_seq(ctx, w, 0, dump=bad)
        assert not r["ok"] and r["mismatches"] == 1
        (hit,) = [x for x in r["layers"] if x["mismatches"]]
        f = hit["first"]
        assert (hit["kind"], hit["layer"], f["cell"], f["dump_offset"]) == ("V", 5, 16, at)
        # in the tensor: value j = 2 * 64 + 7 of cell 16, value-major over 512 cells
        assert f["tensor_offset"] in ((135 * 512 + 16) * 2, (135 * 512 + 16) * 2 + 1)
        tensors = w.tensors()
        v5t = next(t for t in tensors if t.name == "cache_v_l5")
        assert f["buffer_offset"] == v5t.buffer_offset + f["tensor_offset"]
        # and a byte flipped in a copy of a live K tensor (the dump untouched)
        k3 = next(t for t in tensors if t.name == "cache_k_l3")
        copy = np.array(k3.data)
        copy[16 * ROW + 100] ^= 0x80  # cell 16 holds seq 0's position 4
        swapped = [dataclasses.replace(t, data=copy) if t is k3 else t for t in tensors]
        stream, cells, _ = w.cells(0)
        r = kvlive.compare(swapped, s, stream, cells)
        assert r["mismatches"] == 1
        (hit,) = [x for x in r["layers"] if x["mismatches"]]
        assert (hit["kind"], hit["layer"], hit["first"]["cell"], hit["first"]["tensor_offset"]) == (
            "K",
            3,
            16,
            16 * ROW + 100,
        )
        # the wrong cells (seq 1's) are not the dump's rows: the comparison is not vacuous
        assert kvlive.compare(tensors, s, 0, list(range(3, 10)))["mismatches"] > 0


def test_the_tensors_are_views_of_one_live_buffer(model):
    ctx, w = _watched(model, flash_attn="on")
    with ctx:
        tensors = w.tensors()
        k0 = tensors[0]
        assert k0.name == "cache_k_l0" and k0.on_host and not k0.data.flags.writeable
        # every tensor is a view at its own offset of one allocation
        base = k0.data.__array_interface__["data"][0] - k0.buffer_offset
        assert all(t.data.__array_interface__["data"][0] - t.buffer_offset == base for t in tensors)
        # live: a token decoded after the watch shows in the same view, in the cell the
        # dump now lists last (the first free cell, 19)
        before = k0.cell_bytes(0, [19]).copy()
        ctx.prefill(model.tokenize(" It"), seq_id=0)
        after = k0.cell_bytes(0, [19])
        s = st.parse(ctx.seq_state(0).data, model=model)
        assert not np.array_equal(before, after)
        assert np.array_equal(after[0], s.record("K", 0).rows[-1])


def test_cells_moved_since_the_watch_are_an_error_not_a_comparison(model):
    ctx, w = _watched(model)
    with ctx:
        ctx.memory.seq_rm(0, 5, -1)
        with pytest.raises(ValueError, match="7 cells in stream 0.*the dump lists 5.*memory op moved"):
            kvlive.compare_seq(ctx, w, 0)
        with pytest.raises(ValueError, match="no K row of sequence 1"):
            with kvlive.watch(ctx) as w2:
                ctx.prefill(model.tokenize(" again"), seq_id=0)
            w2.cells(1)


def test_what_it_cannot_read_is_refused_with_a_reason(model, tmp_path):
    with model.context(n_ctx=256, type_k="q8_0", type_v="q8_0", flash_attn="on", **ONE) as ctx:
        with pytest.raises(ValueError, match="type_k, type_v is block-quantized"):
            kvlive.watch(ctx)
    path = make_model(tmp_path / "g.gguf", "gemma3", n_layer=2, n_embd=64, n_vocab=128, n_head=4, n_swa=8)
    with pl.Model(path) as m, m.context(n_ctx=256, **ONE) as ctx:
        with pytest.raises(ValueError, match="plain KV cache"):
            kvlive.watch(ctx)
    with model.context(n_ctx=256, **ONE) as ctx:
        with kvlive.watch(ctx) as w:
            pass
        with pytest.raises(ValueError, match="no forward pass"):
            w.tensors()


def test_kv_live_command(tmp_path, capsys):
    png = tmp_path / "k.png"
    assert main(["kv-live", "-t", "1", "--modes", "split:off", "-o", str(png)]) == 0
    out = capsys.readouterr().out
    assert "memory order (by offset): K0 V0 K1 V1" in out and "live = file, byte for byte" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "(52 more)" in out and "cache_v_l28 " not in out  # 60 tensors: the first six and the last two
    assert main(["kv-live", "-t", "1", "--modes", "split:off", "--all"]) == 0  # --all: every one
    out = capsys.readouterr().out
    assert "more)" not in out and "cache_v_l28 " in out
    assert main(["kv-live", "--modes", "unified"]) == 2  # layout:fa, said so
    assert "a mode is layout:fa" in capsys.readouterr().err
