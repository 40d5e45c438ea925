"""The text level: complete / chat, the streaming detokenizer, how generation ends, the KV cache
state generation leaves, and the generate / chat commands."""

from __future__ import annotations

import gc
import io
import json
import subprocess
import sys

import pytest

import pyllamacpp as pl
from pyllamacpp.text import Completion, Detokenizer, TextStream, chat_tokens

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LONG = " ".join(["The cat sat on the mat."] * 34)  # 238 tokens; greedy repeats it, no end token
CAT_JA = [{"role": "user", "content": "Write the Japanese word for cat."}]  # greedy: kana, 3 bytes over 2 tokens


def _splits(model, tokens) -> int:
    """How many tokens' bytes are not whole UTF-8 characters on their own."""
    n = 0
    for t in tokens:
        try:
            model.token_to_bytes(t).decode("utf-8")
        except UnicodeDecodeError:
            n += 1
    return n


def test_detokenizer_never_splits_a_character(model):
    text = "你好世界 🦙 Привет, naïve"
    toks = model.tokenize(text, add_special=False)
    assert _splits(model, toks) >= 8  # the vocabulary does split these characters across tokens
    d = Detokenizer(model)
    pieces = [d.feed(t) for t in toks]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) + d.flush() == text
    assert pieces[:3] == ["", "你", ""]  # "你" is e4 bd | a0: nothing, then the character


def test_stream_yields_whole_characters_and_equals_the_text(model):
    s = model.chat(CAT_JA, 24, stream=True)
    assert isinstance(s, TextStream)
    pieces = list(s)
    assert _splits(model, s.tokens) >= 10  # the answer's characters did come in halves
    assert pieces and all(p and "\ufffd" not in p for p in pieces)
    whole = model.chat(CAT_JA, 24)
    assert isinstance(whole, Completion) and isinstance(whole, str)
    assert "".join(pieces) == s.text == whole == model.detokenize(whole.tokens)
    assert s.finish_reason == whole.finish_reason == "n_predict" and s.tokens == whole.tokens
    # a character cut by n_predict: U+FFFD at the end, as llama_detokenize decoded with "replace"
    cut = model.complete("Emoji: 😀😀😀", 20, stream=True)
    pieces = list(cut)
    assert pieces[-1] == "\ufffd" and "\ufffd" not in "".join(pieces[:-1])
    assert "".join(pieces) == model.detokenize(cut.tokens)


def test_complete_stream_equals_complete(model):
    text = model.complete("The cat sat on the mat.", 24)
    assert text.finish_reason == "n_predict" and len(text.tokens) == 24 and text.n_prompt == 7
    assert "".join(model.complete("The cat sat on the mat.", 24, stream=True)) == text
    with model.context(n_ctx=256, n_threads=2) as ctx:
        assert text.tokens == list(pl.generate(ctx, model.tokenize("The cat sat on the mat."), 24))


def test_chat_parses_the_template_special_tokens_and_answers(model):
    toks = chat_tokens(model, FRANCE)
    assert toks.size == 16 and toks.tolist().count(model.tokenize("<|im_start|>", False, True)[0]) == 2
    answer = model.chat(FRANCE)  # greedy
    assert "Paris" in answer and answer.finish_reason == "eog" and model.is_eog(answer.tokens[-1])
    assert "<|im_end|>" not in answer  # the end token writes nothing
    with pytest.raises(TypeError, match="messages"):
        model.chat([{"role": "user"}])
    with pytest.raises(ValueError, match="messages"):
        model.chat([])
    with pytest.raises(TypeError):
        model.complete(b"bytes")
    with pytest.raises(ValueError, match="no tokens"):
        model.complete("")


def test_ctx_reuse_clears_the_sequence_and_keeps_the_context(model):
    with model.context(n_ctx=512, n_seq_max=2, n_threads=2) as ctx:
        ctx.prefill(model.tokenize("Another sequence entirely."), seq_id=1)
        other = ctx.memory.seq_pos_max(1)
        first = model.complete("The cat sat on the mat.", 12, ctx=ctx)
        # the prompt and every sampled token but the last are in sequence 0
        assert ctx.memory.seq_pos_max(0) == first.n_prompt + len(first.tokens) - 2
        again = model.complete("The cat sat on the mat.", 12, ctx=ctx)  # sequence 0 cleared first
        assert again == first and ctx.memory.seq_pos_max(0) == first.n_prompt + 10
        assert not ctx.closed and ctx.memory.seq_pos_max(1) == other  # the other sequence untouched
        on1 = model.chat(FRANCE, ctx=ctx, seq_id=1)
        assert "Paris" in on1 and ctx.memory.seq_pos_max(0) == first.n_prompt + 10
        with pytest.raises(ValueError, match="more than the context holds"):
            model.complete("word " * 600, 4, ctx=ctx)
        with pytest.raises(ValueError, match="seq_id"):
            model.complete("x", 4, ctx=ctx, seq_id=-1)


def test_a_closed_or_dropped_stream_frees_its_context(model):
    s = model.complete("Once upon a time", 100, stream=True)
    next(s)
    ctx = s.ctx
    assert not ctx.closed
    s.close()
    assert ctx.closed and s.finish_reason is None and 0 < len(s.tokens) < 100
    with pytest.raises(StopIteration):
        next(s)
    s = model.complete("Once upon a time", 100, stream=True)
    next(s)
    ctx = s.ctx
    del s  # abandoned mid-way: the generator closes at once (no reference cycle)
    assert ctx.closed
    with model.complete("Once upon a time", 100, stream=True) as s:  # never started
        ctx = s.ctx
    assert ctx.closed
    with model.context(n_ctx=256, n_threads=2) as mine:
        with model.complete("Once upon a time", 100, ctx=mine, stream=True) as s:
            next(s)
        assert not mine.closed  # a given context stays open
    gc.collect()


def test_a_full_context_ends_the_text_with_ctx_full(model):
    with model.context(n_ctx=256, n_threads=2) as ctx:
        s = model.complete(LONG, -1, ctx=ctx, stream=True)  # 238 prompt tokens: 19 more fit
        text = "".join(s)
        assert s.finish_reason == "ctx_full" and isinstance(s.generation.error, pl.KVCacheFullError)
        assert len(s.tokens) == 256 - s.n_prompt + 1 and ctx.memory.seq_pos_max(0) == 255
        assert text == model.detokenize(s.tokens) and text.startswith(" The cat sat")
        done = model.complete(LONG, 300, ctx=ctx)  # n_predict beyond the context
        assert done.finish_reason == "ctx_full" and done == text
    # without ctx=, the context made holds the prompt and n_predict tokens
    with model.complete(LONG, 300, stream=True) as s:
        assert s.ctx.n_ctx >= s.n_prompt + 300


def test_generate_and_generate_parallel_leave_the_same_cache(model):
    """Both leave the prompt and every sampled token but the last in memory (llama.cpp's examples
    do not decode the last token either): 9 prompt tokens + 16 sampled -> positions 0..23."""
    toks = model.tokenize("The cat sat on the mat. The dog")
    assert toks.size == 9
    with model.context(n_ctx=256, n_seq_max=3, kv_unified=True, n_threads=2) as ctx:
        g = pl.generate(ctx, toks, 16)
        out = list(g)
        assert len(out) == 16 and g.finish_reason == "n_predict"
        assert ctx.memory.seq_pos_max(0) == 23
        alone = bytes(ctx.seq_state(0))
        ctx.memory.clear()
        res = pl.generate_parallel(ctx, toks, 3, 16)
        assert [r.tokens for r in res] == [out] * 3 and {r.finish_reason for r in res} == {"n_predict"}
        assert [ctx.memory.seq_pos_max(s) for s in range(3)] == [23, 23, 23]
        ctx.memory.clear()
        pl.generate_parallel(ctx, toks, 1, 16)
        assert bytes(ctx.seq_state(0)) == alone  # the same cells, byte for byte
        # continuing: feed the last token back, as the convention says
        ctx.memory.clear()
        first = list(pl.generate(ctx, toks, 8))
        more = list(pl.generate(ctx, [first[-1]], 8))
        assert first + more == out


def _run_cli(argv, capsys, stdin: str | None = None, monkeypatch=None):
    from pyllamacpp.cli import main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_generate_streams_the_text(model, capsys):
    rc, out, _ = _run_cli(["generate", "-p", "The cat sat on the mat.", "-n", "12", "-t", "2"], capsys)
    want = model.complete("The cat sat on the mat.", 12)
    assert rc == 0 and out == "The cat sat on the mat." + want + "\n"
    rc, out, _ = _run_cli(
        ["generate", "-p", "The cat sat on the mat.", "-n", "12", "--no-display-prompt", "--temp", "0.8", "-s", "7"],
        capsys,
    )
    assert rc == 0 and out.endswith("\n") and len(out) > 1
    rc, out, err = _run_cli(["generate", "-p", LONG, "-n", "-1", "-c", "256", "--no-display-prompt"], capsys)
    assert rc == 0 and "context full after 19 tokens" in err and out.startswith(" The cat sat")


def test_cli_chat_answers_stdin_turns(capsys, monkeypatch):
    rc, out, _ = _run_cli(
        ["chat", "-n", "32"], capsys, "What is the capital of France?\n\nAnd of Germany?\n", monkeypatch
    )
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2 and "Paris" in lines[0] and "Berlin" in lines[1]  # the history is kept


def test_cli_chat_piped(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", "import sys; from pyllamacpp.cli import main; sys.exit(main())", "chat", "-n", "32"],
        input="What is the capital of France?\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,  # `python -c` puts the folder first on sys.path: not the checkout (no extension there)
    )
    assert r.returncode == 0 and "Paris" in r.stdout and "Traceback" not in r.stderr


def test_cli_demo_generates_and_names_the_size(capsys):
    rc, out, _ = _run_cli(["demo", "-n", "8"], capsys)
    assert rc == 0 and "134.5M params" in out and "generated: " in out
    top = [ln for ln in out.splitlines() if ln.startswith("  ")]
    logits = [float(ln.split("logit")[1].split()[0]) for ln in top]
    assert logits == sorted(logits, reverse=True)  # the prompt's logits, not the generation's
    rc, out, _ = _run_cli(["demo", "-n", "8", "--json"], capsys)
    d = json.loads(out)
    assert d["n_params"] == 134_515_008 and d["generated_tokens"] == 8 and d["generated"]
    assert d["finish_reason"] == "n_predict"


def test_detokenizer_cache_keeps_split_characters_whole_and_raises_after_close(model_path):
    # a token's text is kept per model; a character split across tokens still goes through the
    # incremental decoder, and a cached token on a closed model raises as an uncached one does
    with pl.Model(model_path) as m:
        toks = [int(t) for t in m.tokenize("héllo 日本語 wörld ✓ 😀 héllo", add_special=False)]
        want = m.detokenize(toks)
        for _ in range(2):  # the second pass answers whole tokens from the cache
            d = Detokenizer(m)
            pieces = [d.feed(t) for t in toks] + [d.flush()]
            assert "".join(pieces) == want
            assert all("\ufffd" not in p for p in pieces)
        assert m._tokens[0], "nothing was cached"
        cached = next(iter(m._tokens[0]))
    with pytest.raises(pl.ClosedError):
        d.feed(cached)


# -- stop strings ---------------------------------------------------------------------------------
PARIS = "The capital of France is"  # greedy: " Paris" "." "\n" "\n" "The" " United" " States" " has" ...


def _released(text: str, stops: list[str]) -> str:
    """What a stream may yield of ``text``: all but its longest end that begins a stop string."""
    for n in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return text[:-n]
    return text


def _expected_pieces(model, tokens: list[int], stops: list[str]) -> list[str]:
    """The pieces a stream with ``stops`` yields over ``tokens`` when no stop string appears in
    them: after each token, what became releasable; at the end, the rest."""
    d, text, out, done = Detokenizer(model), "", [], 0
    for t in tokens:
        text += d.feed(t)
        r = _released(text, stops)
        if len(r) > done:
            out.append(r[done:])
            done = len(r)
    text += d.flush()
    if len(text) > done:
        out.append(text[done:])
    return out


def test_a_stop_string_across_two_tokens_ends_the_text_before_it(model):
    whole = model.complete(PARIS, 12)
    pieces = [model.token_to_piece(t) for t in whole.tokens]
    assert pieces[5:7] == [" United", " States"]  # "United States" spans two tokens
    with model.context(n_ctx=256, n_threads=2) as ctx:
        text = model.complete(PARIS, 12, ctx=ctx, stop="United States")
        assert text == " Paris.\n\nThe " and text.finish_reason == "stop"
        # generation ended with the token that completed the stop string, and did not decode it
        assert text.tokens == whole.tokens[:7]
        assert ctx.memory.seq_pos_max(0) == text.n_prompt + len(text.tokens) - 2
        s = model.complete(PARIS, 12, ctx=ctx, stop=["United States"], stream=True)
        streamed = list(s)
        assert "".join(streamed) == s.text == text and s.finish_reason == "stop" and s.tokens == text.tokens
        assert not any("United" in p or "States" in p for p in streamed)
        # the stop string that appears first wins, whatever the order of the list
        assert model.complete(PARIS, 12, stop=["States", "United States"]) == " Paris.\n\nThe "
        assert model.complete(PARIS, 12, stop=["million", "\n\n"]) == " Paris."
        assert model.complete(PARIS, 12, stop="Par") == " "  # inside the first token
        # a stop string that never appears changes nothing
        none = model.complete(PARIS, 12, stop=["Berlin", "Paris!"])
        assert none == whole and none.finish_reason == "n_predict" and none.tokens == whole.tokens


def test_a_stream_holds_back_only_what_may_still_be_a_stop_string(model):
    whole = model.complete(PARIS, 12)
    for stops in (["Paris!"], ["Paris!", ".\n\nThe Unix", "States of"], ["\n\nX", "Xyz"]):
        assert not any(st in whole for st in stops)
        s = model.complete(PARIS, 12, stop=stops, stream=True)
        got = list(s)
        # piece by piece what the reference says: held text comes out once it cannot be a stop
        assert got == _expected_pieces(model, whole.tokens, stops), stops
        assert "".join(got) == whole and s.finish_reason == "n_predict"
    # "Paris" was held after " Paris" (it may begin "Paris!"), then released with "."
    got = list(model.complete(PARIS, 12, stop="Paris!", stream=True))
    assert got[:2] == [" ", "Paris."]
    # an end-of-generation token releases what is held too
    answer = model.chat(FRANCE, stop="Paris is")
    assert answer == "The capital of France is Paris." and answer.finish_reason == "eog"


def test_chat_stop_and_bad_stop_arguments(model):
    answer = model.chat(FRANCE, stop="Paris")
    assert answer == "The capital of France is " and answer.finish_reason == "stop"
    with pytest.raises(ValueError, match="empty stop string"):
        model.complete(PARIS, 4, stop=["x", ""])
    with pytest.raises(TypeError, match="stop must be a str"):
        model.complete(PARIS, 4, stop=[b"x"])
    with pytest.raises(TypeError, match="stop must be a str"):
        model.chat(FRANCE, 4, stop=5)


def test_cli_stop(capsys, monkeypatch):
    argv = ["generate", "-p", PARIS, "-n", "12", "-t", "2", "--no-display-prompt"]
    rc, out, _ = _run_cli([*argv, "--stop", "million", "--stop", "United States"], capsys)
    assert rc == 0 and out == " Paris.\n\nThe \n"
    rc, out, _ = _run_cli(["chat", "-n", "32", "-t", "2", "--stop", "Paris"], capsys, FRANCE[0]["content"], monkeypatch)
    assert rc == 0 and out == "The capital of France is \n"
