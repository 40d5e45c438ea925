"""tools/mutation/walk_diff.py: a change of the walk run against the walk over random request sets."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_tool

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "mutation" / "walk_diff.py"
pytestmark = pytest.mark.skipif(not TOOL.exists(), reason="tools/ is not in an installed package")
ROOM = "        room = min(wo.room, self.n_ctx - self.used)"


def _load():
    return load_tool(TOOL, "walk_diff")


def test_a_change_that_feeds_one_token_a_batch_differs_and_the_same_text_does_not(capsys):
    from pyllamacpp.evaluation import _engine, _walk

    tool = _load()
    assert tool.main([ROOM, ROOM.replace("self.n_ctx - self.used", "1"), "--runs", "2"]) == 1
    out = capsys.readouterr().out
    assert out.endswith("2 of 2 runs differ\n") and "n_decodes" in out
    assert tool.main([ROOM, ROOM, "--runs", "2", "--seed", "1"]) == 0
    assert capsys.readouterr().out.endswith("0 of 2 runs differ\n")
    assert _engine._Walk is _walk._Walk  # put back
    with pytest.raises(SystemExit, match="found 0 times"):
        tool.main(["no such text", "x"])


def test_token_requests_build_what_text_requests_missed(capsys):
    """A slot that copies the shared nodes before one another slot still feeds, recorded as a
    holder of that node too (``deep << 1``): 60 runs of text requests passed it; the token
    requests of seed 32 (its first run) catch it, as test_evaluation.py's test built for it does."""
    tool = _load()
    old = "            for n in path[i : deep + 1]:"
    assert tool.main([old, old.replace("deep + 1", "deep << 1"), "--tokens", "--runs", "1", "--seed", "32",
                      "--max-requests", "10"]) == 1  # fmt: skip
    assert capsys.readouterr().out.endswith("1 of 1 runs differ\n")


def test_named_runs_the_mutants_targets_toml_names_and_no_other(capsys):
    """``--named``: the mutants of _walk.py run.py's report counts as named equivalent (the same
    test of a name), none withdrawn (``deep - 1`` was named, and differed); OLD and NEW, or
    --named, not both or one alone."""
    tool = _load()
    for argv in (["--named", "a", "b"], ["a"], []):
        with pytest.raises(SystemExit):
            tool.main(argv)
    assert "give OLD and NEW, or --named" in capsys.readouterr().err
    pytest.importorskip("cosmic_ray")  # a developer's tool, not a test dependency
    from pyllamacpp.evaluation import _walk

    src = Path(_walk.__file__).read_text()
    got = tool._named(src, {"_catch_up"})
    plus = [m[3] for m in got]
    assert {m[0] for m in got} == {"_catch_up"} and len(got) == len(set(plus))
    assert "+            for n in path[i : deep ** 1]:" in plus  # named: deep is 0 or 1 here
    assert not any("deep - 1" in p or "deep << 1" in p for p in plus)  # withdrawn, and never named
    assert all(m[3][1:] in m[4].splitlines() and m[3][1:] not in src.splitlines() for m in got)


def test_long_token_draws_have_nodes_past_256_tokens_and_the_others_do_not(capsys):
    """``--long`` (with ``--tokens``) draws runs of 300 tokens, counts that ``is`` compares wrongly,
    into n_ctx of 512 or 1024; without it no request passes 6 nodes of 40 tokens and a first one."""
    import random

    tool = _load()
    longest = [max(len(c) for c, _ in tool._draw_tokens(random.Random(s), 8, True)[0]) for s in range(20)]
    assert max(longest) > 256
    assert {tool._draw_tokens(random.Random(s), 8, True)[2]["n_ctx"] for s in range(20)} == {512, 1024}
    assert max(max(len(c) for c, _ in tool._draw_tokens(random.Random(s), 8)[0]) for s in range(200)) <= 6 * 40
    with pytest.raises(SystemExit):
        tool.main(["a", "b", "--long"])
    assert "--long goes with --tokens" in capsys.readouterr().err
