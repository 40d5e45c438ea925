"""pyllamacpp row-audit (experiments/rowaudit.py): A's rows of every node, alone and beside B, B',
and after B; the audit must report a leak planted with a patch, and none on the real engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pyllamacpp as pl
from pyllamacpp.experiments.rowaudit import audit, batch_rows, leak_hook, max_abs_diff
from pyllamacpp.testing import make_model

ABB = ("one two three four", "five six seven", "eight nine ten")  # A, B and B'
ONE = {"n_threads": 1, "n_threads_batch": 1, "n_ctx": 256, "n_batch": 256, "n_ubatch": 256}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_model(
        tmp_path_factory.mktemp("ra") / "llama.gguf", "llama", n_layer=2, n_embd=64, n_head=4, n_vocab=128
    )
    with pl.Model(path) as m:
        yield m


def test_rows_and_differences():
    assert batch_rows(2, 3, "AB", "b-first") == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert batch_rows(2, 3, "BA", "b-first")[:3] == [(1, 0), (1, 1), (1, 2)]
    assert batch_rows(2, 3, "BA", "interleave") == [(1, 0), (0, 0), (1, 1), (0, 1), (1, 2)]
    x = np.array([1.0, np.nan, 3.0])
    assert max_abs_diff(x, x.copy()) == 0.0  # NaN where both are NaN: no difference
    assert max_abs_diff(x, np.array([1.0, 2.0, 3.5])) == np.inf and max_abs_diff(x, x[:2]) is None


def test_a_planted_leak_is_reported_at_its_node(tiny):
    d = audit(tiny, *ABB, fa_modes=("off", "on"), n_gen=2, inject=leak_hook("ffn_out-0"), **ONE)
    assert d["leak"] and not d["ok"]
    for m in d["modes"]:
        assert m["leak"] and m["first"]["content"]["name"] == "ffn_out-0", m["first"]
        before = m["rows"][: next(i for i, r in enumerate(m["rows"]) if r["name"] == "ffn_out-0")]
        assert all(r["content"] == 0.0 for r in before)  # nothing before the planted node differs
        assert m["max"]["content"] > 0
        # width is AB vs solo: the planted B mean shows there too (solo has no B to mix in)
        assert m["first"]["width"]["name"] == "ffn_out-0"


def test_no_leak_on_a_small_model_with_flash_attention_off_and_on(tiny):
    d = audit(tiny, *ABB, fa_modes=("off", "on"), n_gen=3, order="interleave", **ONE)
    assert d["ok"] and not d["leak"]
    off, on = d["modes"]
    assert not off["flash_attn_on"] and on["flash_attn_on"]
    for m in (off, on):
        assert m["n_compared"] == m["n_nodes"] > 0 and m["max"]["content"] == 0.0
        assert all(m["greedy_same"].values())
    assert any(r["op"] == "FLASH_ATTN_EXT" for r in on["rows"]) and any(r["kv"] for r in off["rows"])


def test_the_default_model_leaks_nothing_and_rounds_only_where_rows_move(model):
    """Flash attention off, 1 thread: A's rows beside B are A's alone bit for bit (content and width
    0 at every node); with B first, A's cells move (12.. instead of 0..) and only the softmax's sum
    over the columns rounds differently; QK^T on A's cells, mapped by position, is the same."""
    d = audit(model, fa_modes=("off",), n_gen=2, **{**ONE, "n_ctx": 512, "n_batch": 512, "n_ubatch": 512})
    (m,) = d["modes"]
    assert d["ok"] and m["max"]["content"] == 0.0 and m["max"]["width"] == 0.0
    assert m["n_compared"] == m["n_nodes"] == 606
    by = {r["name"]: r for r in m["rows"]}
    assert by["kq-0"]["kv"] and by["kq-0"]["order"] == 0.0
    assert 0 < by["kq_soft_max-0"]["order"] < 1e-6 and m["first"]["order"]["name"] == "kq_soft_max-0"
    assert by["l_out-28"]["order"] == 0.0 and by["result_output"]["order"] == 0.0  # absorbed by f16 / q8_1 rounding
    assert all(m["greedy_same"].values())


def test_the_command_exits_1_on_a_planted_leak(tiny, capsys):
    from pyllamacpp.cli import main

    argv = ["row-audit", "-m", str(tiny.path), "-t", "1", "-c", "256", "-fa", "off", "-n", "1", "--json"]
    assert main([*argv, "--prompt-a", "one two three", "--prompt-b", "four five", "--prompt-b2", "six seven"]) == 0
    assert json.loads(capsys.readouterr().out)["leak"] is False
    assert main([*argv, "--inject-leak", "l_out-1"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["leak"] and d["injected"] == "l_out-1" and d["modes"][0]["first"]["content"]["name"] == "l_out-1"
    assert "inject" not in _help("row-audit")  # a test hook, not a user option


def _help(cmd: str) -> str:
    from pyllamacpp.cli import build_parser

    ap = build_parser()
    sub = next(a for a in ap._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    return sub.choices[cmd].format_help()


def test_a_and_b_in_separate_ubatches_are_refused(tiny):
    # separate streams: split_equal cuts A (4 tokens) and B (3) into several ubatches
    with pytest.raises(ValueError, match="not one.*split_equal"):
        audit(tiny, *ABB, fa_modes=("off",), n_gen=0, kv_unified=False, **ONE)
