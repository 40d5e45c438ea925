"""pyllamacpp mask (experiments/mask.py): the KQ mask llama.cpp builds, checked entry by entry
against set_input_kq_mask_impl's rule recomputed from the cells; the checker itself must see an
injected wrong entry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pyllamacpp.experiments.mask import (
    FUTURE,
    KEEP,
    OTHER_SEQ,
    PADDING,
    WINDOW,
    KVCells,
    check_mask,
    engine_seq_order,
    is_masked_swa,
    mask_rule,
    run_mask,
)
from pyllamacpp.testing import make_model

ONE = {"n_threads": 1, "n_threads_batch": 1}


def _engine_like(rule: np.ndarray) -> np.ndarray:
    """A mask as llama.cpp writes it for this rule: 0 where visible, -inf elsewhere."""
    return np.where(rule == KEEP, 0.0, -np.inf).astype(np.float32)


# -- the checker, a pure function --------------------------------------------------------------


def _two_sequences():
    # cells 0..2: positions 0..2 shared by sequences 0 and 1; 3, 4: sequence 0 at 3, 4; 5: sequence 1 at 3
    cells = [KVCells.of([(0, [0, 1]), (1, [0, 1]), (2, [0, 1]), (3, [0]), (4, [0]), (3, [1])], size=256)]
    pos = [3, 4, 3]
    seq_ids = [(0,), (0,), (1,)]  # rows 0, 1 wrote cells 3, 4; row 2 wrote cell 5
    return cells, pos, seq_ids


def test_the_rule_on_hand_made_cells():
    cells, pos, seq_ids = _two_sequences()
    rule = mask_rule(cells, pos, seq_ids, 256, 1, unified=True)
    assert rule.shape == (1, 3, 256)
    assert rule[0, 0, :6].tolist() == [KEEP, KEEP, KEEP, KEEP, FUTURE, OTHER_SEQ]
    assert rule[0, 1, :6].tolist() == [KEEP] * 5 + [OTHER_SEQ]
    assert rule[0, 2, :6].tolist() == [KEEP, KEEP, KEEP, OTHER_SEQ, OTHER_SEQ, KEEP]  # shared cells: seen by both
    assert (rule[..., 6:] == PADDING).all()  # the columns past the cells in use, up to n_kv


def test_an_injected_cross_sequence_cell_is_a_mismatch():
    cells, pos, seq_ids = _two_sequences()
    good = _engine_like(mask_rule(cells, pos, seq_ids, 256, 1, unified=True))
    assert check_mask(good, cells, pos, seq_ids, unified=True)[0] == []
    bad = good.copy()
    bad[0, 2, 3] = 0.0  # sequence 1's row sees sequence 0's cell at position 3
    mis, _ = check_mask(bad, cells, pos, seq_ids, unified=True)
    assert [(m.row, m.cell, m.rule, m.got) for m in mis] == [(2, 3, "other sequence", 0.0)]
    bad = good.copy()
    bad[0, 0, 200] = 0.0  # a padding column left visible
    bad[0, 1, 2] = -np.inf  # and a visible cell masked
    got = {(m.row, m.cell, m.rule) for m in check_mask(bad, cells, pos, seq_ids, unified=True)[0]}
    assert got == {(0, 200, "padding"), (1, 2, "keep")}
    half = good.astype(np.float16)  # flash attention's f16 mask reads the same
    assert check_mask(half, cells, pos, seq_ids, unified=True)[0] == []


def test_the_rule_with_streams_and_a_window():
    streams = [KVCells.of([(0, [0]), (1, [0])], 256), KVCells.of([(0, [1]), (1, [1]), (2, [1])], 256)]
    rule = mask_rule(streams, [1, 2], [(0,), (1,)], 256, 2, unified=False)
    assert rule.shape == (2, 1, 256)  # (n_stream, n_tokens / n_stream, n_kv)
    assert rule[0, 0, :3].tolist() == [KEEP, KEEP, PADDING] and rule[1, 0, :3].tolist() == [KEEP] * 3
    one = [KVCells.of([(p, [0]) for p in range(8)], 256)]
    w = mask_rule(one, [7], [(0,)], 256, 1, unified=True, n_swa=4, swa_type="standard")
    assert w[0, 0, :8].tolist() == [WINDOW] * 4 + [KEEP] * 4  # 7 - p0 >= 4: outside
    assert is_masked_swa(4, "chunked", np.arange(8), 7).tolist() == [True] * 4 + [False] * 4
    assert is_masked_swa(4, "symmetric", np.arange(8), 4).tolist() == [True] * 2 + [False] * 5 + [True]
    with pytest.raises(ValueError, match="swa_type"):
        is_masked_swa(4, "sliding", np.arange(3), 1)


def test_the_ubatch_order_of_a_rows_seq_ids():
    # std::unordered_set<llama_seq_id> iteration (libstdc++, 13 buckets): the last inserted first
    assert engine_seq_order((0, 1)) == (1, 0) and engine_seq_order((1, 0)) == (0, 1)
    assert engine_seq_order((0, 1, 2)) == (2, 1, 0)
    assert engine_seq_order((0, 1, 13)) == (1, 13, 0)  # 13 shares bucket 0: it goes before 0, not first
    assert engine_seq_order((5,)) == (5,)


# -- the real engine ----------------------------------------------------------------------------


def test_the_engine_mask_follows_the_rule_with_shared_and_cached_cells(model):
    d = run_mask(model, [3, 2], [2, 1], n_shared=2, n_ctx=512, n_seq_max=2, kv_unified=True, flash_attn="off", **ONE)
    assert d["ok"] and d["n_mismatches"] == 0 and d["problems"] == []
    (e,) = d["masks"]
    assert (e["ne"], e["shape"], e["type"]) == ([256, 5, 1, 1], [5, 256], "f32")  # n_kv padded to 256
    assert e["used"] == {"0": 10} and e["padding_masked"] and e["counts"]["padding"] == 5 * 246
    # cells 0, 1: the shared prefix, seen by both sequences' rows; 2, 3: sequence 0's past; 4: sequence 1's
    assert [c[2] for c in e["cells"]["0"][:5]] == [[0, 1], [0, 1], [0], [0], [1]]
    assert e["grid"][0][0] == "####s#ffss" and e["grid"][0][3] == "##ss#sss#f"
    assert d["cells_before"] == {"kv": 5}


def test_separate_streams_give_one_mask_stream_per_sequence(model):
    d = run_mask(model, [3, 3], [2, 3], n_ctx=1024, n_seq_max=2, kv_unified=False, flash_attn="off", **ONE)
    assert d["ok"] and d["n_stream_kv"] == 2
    (e,) = d["masks"]
    assert e["ne"] == [256, 3, 1, 2] and e["shape"] == [2, 1, 3, 256] and e["kv_streams"] == [0, 1]
    assert e["grid"][0][0] == "###ff-" and e["grid"][1][2] == "######"  # each stream has its own cells from 0


def test_a_row_of_several_sequences_masks_against_the_first_of_its_set(model):
    """Rows given as (0, 1) and (1, 0) at position 3, after 3 cells of each sequence: the ubatch's
    seq_id[i][0] is the first of llama_batch_ext's unordered_set, so the row given as (0, 1) sees
    sequence 1's cells and not sequence 0's (fails if llama.cpp kept the caller's order)."""
    d = run_mask(model, [1, 1], [3, 3], couple=True, n_ctx=512, n_seq_max=2, kv_unified=True, flash_attn="off", **ONE)
    assert d["ok"], d["masks"][0]["mismatches"][:3]
    (e,) = d["masks"]
    assert [r[2:] for r in e["rows"]] == [[[0, 1], [1, 0]], [[1, 0], [0, 1]]]
    # cells 0..2 sequence 0, 3..5 sequence 1, 6, 7 the two rows (both sequences)
    assert e["grid"][0] == ["sss#####", "###sss##"]
    assert any("std::unordered_set" in f for f in d["facts"])


def test_flash_attention_mask_is_f16_and_follows_the_rule(model):
    d = run_mask(model, [4], [2], n_ctx=512, n_ubatch=2, flash_attn="on", **ONE)
    assert d["ok"] and d["flash_attn"] and [e["type"] for e in d["masks"]] == ["f16", "f16"]
    assert [(e["call"], e["ubatch"], e["grid"][0]) for e in d["masks"]] == [
        (0, 0, ["###f", "####"]),
        (0, 1, ["#####f", "######"]),
    ]


@pytest.mark.parametrize("fa", ["off", "on"])
def test_sliding_window_layers_get_their_own_mask(tmp_path, fa):
    import pyllamacpp as pl

    kw = {"n_layer": 2, "n_embd": 64, "n_head": 4, "n_vocab": 128, "n_swa": 4, "swa_pattern": 2}
    path = make_model(tmp_path / "g3.gguf", "gemma3", **kw)
    with pl.Model(path) as m:
        d = run_mask(m, [6], [3], n_ctx=256, flash_attn=fa, **ONE)  # on: unnamed readers, an f16 mask
    assert d["ok"] and d["n_swa"] == 4 and d["swa_type"] == "standard"
    swa, base = (next(e for e in d["masks"] if e["cache"] == c) for c in ("swa", "base"))
    assert (swa["layers"], base["layers"]) == ([0], [1])  # swa_pattern 2: layer 0 slides, layer 1 sees all
    assert swa["counts"]["window"] == 15 and base["counts"]["window"] == 0
    assert swa["grid"][0][5] == "wwwww####" and base["grid"][0][5] == "#########"


def test_the_command_prints_json_and_a_figure(tmp_path, capsys):
    from pyllamacpp.cli import main

    out = tmp_path / "mask.png"
    argv = ["mask", "-t", "1", "--tokens", "2,2", "-np", "2", "--kv-unified", "-fa", "off", "--json", "-o", str(out)]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] and d["masks"][0]["grid"][0] == ["#fss", "##ss", "ss#f", "ss##"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["mask", "-t", "1", "--tokens", "2", "--mode", "equal"]) == 2
    assert "--mode" in capsys.readouterr().err
