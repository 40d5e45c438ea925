"""What a new user met (issue 21, part 3), each held by a test that failed before its fix.

- Ctrl-C in an experiment prints the rows measured before it and says it was interrupted.
- ``pyllamacpp demo | head -3`` stops at the first write after the reader left.
- llama.cpp's detail lines (the X / Y of a position gap) reach the error, by both reason paths.
- "n_stream mismatch" says which context parameters to change.
- A context with several threads on a machine whose cores are taken warns (BusyCoresWarning).

The commands run as real child processes, from a temporary folder (the installed package is
imported, not the source folder).

Issue 29 (the taps, speculative and state-file guides, tried as a new user), at the end: what
``layers=`` keeps (views, negative layers), the capture limit's count, one naming of the inputs,
a pass counter on the taps, the plots, a control-vector file that is not a GGUF, the printable
``compare_speculative``, kvprobe loading a seq file, experiments importing only shared modules,
the docs extra, and the source-folder error that the troubleshooting page quotes.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np
import pytest
from conftest import popen_command

import pyllamacpp as pl
import pyllamacpp.context as context_module
from pyllamacpp.errors import (
    BusyCoresWarning,
    CaptureLimitError,
    InvalidBatchError,
    StateError,
    TapError,
    n_stream_hint,
)


def test_ctrl_c_after_the_first_row_prints_it_and_says_so():
    """A real SIGINT to a child running ubatch-sweep once its second row has begun (the progress
    line "step 2/4" on stderr): exit 130, the first row's table on stdout, "interrupted"."""
    proc = popen_command(
        ["ubatch-sweep", "-t", "1", "-c", "256", "-p", "64", "-n", "16", "-r", "1", "--ubatch-list", "64,32,16"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    err = []
    try:
        for line in proc.stderr:
            err.append(line)
            if line.startswith("ubatch-sweep: step 2/4"):
                break
        proc.send_signal(signal.SIGINT)  # row 2 is being measured: row 1 is done
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    err = "".join(err) + rest
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = out.splitlines()
    assert lines[0].startswith("model SmolLM2"), out
    assert lines[1].split()[:3] == ["-b", "-ub", "n_ubatch"] and set(lines[2]) == {"-", " "}, out
    assert lines[3].split()[:3] == ["2048", "64", "64"], out  # the first row: -ub 64, measured
    assert "-ub < " not in out and len(lines) == 5, out  # no other row, not the clamp row
    assert lines[4] == "interrupted (Ctrl-C) after 1 of 4 rows: the rows above are all that was measured", out
    assert "pyllamacpp ubatch-sweep: interrupted (Ctrl-C) after 1 of 4 rows" in err


def _demo_run(close_after: int | None) -> tuple[float, int, str, str]:
    """``demo -n 400`` into a reader that closes its end after ``close_after`` lines (None: reads
    it all); the child's wall time, status, stdout read, stderr."""
    t0 = time.perf_counter()
    proc = popen_command(["demo", "-t", "1", "-c", "1024", "-n", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        if close_after is None:
            out = proc.stdout.read()
        else:
            out = "".join(proc.stdout.readline() for _ in range(close_after))
            proc.stdout.close()  # the reader leaves, as `head -3` does
        err = proc.stderr.read()
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return time.perf_counter() - t0, rc, out, err


def test_demo_into_head_stops_at_the_first_write_after_the_reader_left():
    """``pyllamacpp demo | head -3``: the lines come as they are known and the generation is
    streamed, so the write after the reader left fails at once and the command exits 141, quietly,
    instead of generating to the end. Against the same command read to the end, in this test."""
    t_full, rc, out, err = _demo_run(None)
    assert rc == 0, err
    n = int(re.search(r"\((\d+) tokens, greedy", out).group(1))
    assert n >= 100, out  # a long generation to stop early (greedy on this prompt: an EOG after 200+)
    t_head, rc, out, err = _demo_run(3)
    assert rc == 141, (rc, err)
    assert out.splitlines()[2] == "top next tokens:", out
    assert "Traceback" not in err and "Broken pipe" not in err and "Exception ignored" not in err, err
    # the full run is model load + prefill + n tokens; stopped at once, the other is the first two
    assert t_head < 0.5 * t_full, (t_head, t_full, n)


def _gap(model):
    """A context whose sequence 0 holds positions 0..2 and a one-token batch at position 10."""
    ctx = model.context(n_ctx=256, n_threads=2)
    ctx.prefill(model.tokenize("The cat sat"))
    batch = pl.Batch(4, model=model)
    batch.add(5, 10, 0, logits=True)
    return ctx, batch


def _has_x_and_y(msg: str, y: int) -> bool:
    return "inconsistent sequence positions:" in msg and "is X = 2" in msg and f"position of Y = {y}" in msg


def test_position_gap_reason_keeps_the_x_and_y_lines(model):
    """llama.cpp logs one message of four lines ("inconsistent sequence positions:", then X, Y and
    the rule): Context.decode's error (its log capture) carries all of it, on one line."""
    ctx, batch = _gap(model)
    with ctx, pytest.raises(InvalidBatchError) as e:
        ctx.decode(batch)
    assert _has_x_and_y(str(e.value), 10) and "\n" not in str(e.value), str(e.value)
    assert e.value.reason.endswith("it is required that the sequence positions remain consecutive: Y = X + 1")


def test_position_gap_reason_of_a_generation_step_keeps_them_too(model):
    """A generation step's reason is kept in C (pyl_decode_sample), which keeps the first line;
    the lines after it come from what the log callback saw."""
    ctx, _ = _gap(model)
    with ctx:
        step, _ = ctx._generation_step(pl.Sampler.greedy(), 0)
        with pytest.raises(InvalidBatchError) as e:
            step(5, 20, False)
        assert _has_x_and_y(str(e.value), 20), str(e.value)
        ctx.prefill(model.tokenize(" on"), start_pos=3)  # still usable
        assert ctx.memory.seq_pos_max(0) == 3


def test_n_stream_mismatch_says_what_to_change(model, tmp_path):
    """A sequence state, a sequence file and a session file from a kv_unified=True context,
    loaded into a kv_unified=False one: each error says what the state has, what this context
    has, and what to make the context with."""
    with model.context(n_ctx=256, n_threads=2, n_seq_max=2, kv_unified=True) as ctx:
        ctx.prefill(model.tokenize("The cat sat on the mat."))
        ctx.save_seq_state(tmp_path / "s.bin", 0)
        ctx.save_state(tmp_path / "c.bin")
        blob = ctx.seq_state(0).data.copy()
    with model.context(n_ctx=256, n_threads=2, n_seq_max=2, kv_unified=False) as ctx:
        for load in (
            lambda: ctx.set_seq_state(0, blob),
            lambda: ctx.load_seq_state(tmp_path / "s.bin", 0),
            lambda: ctx.load_state(tmp_path / "c.bin"),
        ):
            with pytest.raises(StateError) as e:
                load()
            msg = str(e.value)
            # llama.cpp's own reason ("n_stream mismatch") or the check before it: either way, the hint
            assert "kv_unified=True" in msg and "n_seq_max" in msg, msg
            assert "this context has 2 (kv_unified=False, n_seq_max=2)" in msg or "n_stream mismatch (" in msg, msg
            assert "make this one with kv_unified=True" in msg or "n_stream mismatch (" in msg, msg
        ctx.prefill(model.tokenize("The cat"))  # untouched and usable


def test_n_stream_hint_says_what_each_side_has():
    assert n_stream_hint(1, 4, False, 4) == (
        "the state has 1 KV stream(s), this context has 4 (kv_unified=False, n_seq_max=4): the state was "
        "saved by a kv_unified=True context (or one with n_seq_max=1); make this one with kv_unified=True"
    )
    assert n_stream_hint(4, 1, True, 4).endswith(
        "n_seq_max=4): the state was saved by a kv_unified=False context with n_seq_max=4; "
        "make this one with kv_unified=False, n_seq_max=4"
    )
    assert n_stream_hint(4, 2, False, 2).endswith("make this one with n_seq_max=4")


@pytest.fixture
def load(monkeypatch):
    """``load(avg, cpus)``: what pyllamacpp.context reads as the load average from here on."""

    def set_load(avg: float | None, cpus: int = 2) -> None:
        monkeypatch.setattr(context_module, "_loadavg", lambda: None if avg is None else (avg, cpus))
        monkeypatch.setattr(context_module, "_busy_cores_warned", False)  # said once per process

    return set_load


def test_busy_cores_warn_at_context_creation(model, load):
    load(5.5, 2)  # the machine: 2 cores, load 5.5
    with pytest.warns(BusyCoresWarning, match=r"the load average is 5\.5 on 2 CPU\(s\): every core is taken") as w:
        model.context(n_ctx=256, n_threads=2, n_threads_batch=2).close()
    assert "n_threads=1, n_threads_batch=1" in str(w[0].message)
    assert w[0].filename == __file__  # it points at the caller's line, not at the package
    for quiet in (lambda: load(1.2, 2), lambda: load(None)):  # cores free, or no load average (Windows)
        quiet()
        with warnings.catch_warnings():
            warnings.simplefilter("error", BusyCoresWarning)
            model.context(n_ctx=256, n_threads=2).close()
    load(5.5, 2)
    with warnings.catch_warnings():  # one thread waits for nobody
        warnings.simplefilter("error", BusyCoresWarning)
        model.context(n_ctx=256, n_threads=1, n_threads_batch=1).close()


def test_busy_cores_warn_once_per_process(model, load):
    # issue 36: the getting-started script made six contexts and read the warning six times
    load(5.5, 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")  # not Python's once-per-line: three lines would warn three times
        model.context(n_ctx=256, n_threads=2).close()
        model.context(n_ctx=128, n_threads=2).close()
        with model.context(n_ctx=64, n_threads=2):
            pass
    assert [type(x.message) for x in w] == [BusyCoresWarning], [str(x.message) for x in w]


def test_the_command_says_the_warning_without_a_file_path():
    # a real child running the command, its load average set as the fixture above sets it
    code = (
        "import sys, pyllamacpp.context as c; c._loadavg = lambda: (9.0, 2); "
        "from pyllamacpp.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "demo", "-t", "2", "-n", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tempfile.gettempdir(),
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["generated_tokens"] == 1
    assert proc.stderr.startswith("pyllamacpp demo: warning: the load average is 9.0 on 2 CPU(s)"), proc.stderr
    assert ".py:" not in proc.stderr and "/" not in proc.stderr, proc.stderr


# -- issue 29: the taps, speculative and state-file guides, tried as a new user -------------------


def _taps_ctx(model, **kw):
    kw = {"n_ctx": 512, "n_threads": 1, "n_threads_batch": 1, "flash_attn": "off", **kw}
    return model.context(**kw)


def _cat(model, n=64):
    b = pl.Batch(n, 1, model=model)
    b.add_sequence(model.tokenize("The cat sat on the mat."), 0, 0, logits="last")
    return b


def test_layers_keeps_views_of_those_layers_only(model):
    """``"cache_*", layers=[3]``: the views of the KV cache (``cache_k_l3 (view)``, layer None
    as a GraphNode) are layered by their name, so only layer 3's are kept (they were every
    layer's, 182 records)."""
    with _taps_ctx(model) as ctx:
        with ctx.capture("cache_*", layers=[3]) as cap:
            ctx.decode(_cat(model))
        names = sorted({r.name for r in cap.records})
        assert names and all("_l3" in n for n in names), names
        assert {"cache_k_l3", "cache_k_l3 (view)", "cache_v_l3"} <= set(names), names  # inputs and views
        assert {pl.taps.name_layer(n) for n in ctx.graph_nodes().named("cache_k_l3 (view)")} == {3}
        text = ctx.graph_nodes().table(views=True, layers=[3])
        assert "cache_k_l3 (view)" in text and "cache_k_l4 (view)" not in text and "l_out-4" not in text


def test_negative_layers_count_from_the_last(model):
    """``layers=[-1]`` is the last layer, as a Python index (TransformerLens users write it);
    one past either end is a TapError naming the layers there are."""
    with _taps_ctx(model) as ctx:
        g = ctx.graph_nodes()
        assert g.n_layer == 30
        with ctx.capture("l_out", "kq_soft_max", layers=[-1, -30]) as cap:
            ctx.decode(_cat(model))
        assert sorted({r.name for r in cap.records}) == ["kq_soft_max-0", "kq_soft_max-29", "l_out-0", "l_out-29"]
        for bad in ([-31], [30], [3, 30]):
            with pytest.raises(TapError, match=r"the model's layers are 0\.\.29 \(negative layers count from"):
                ctx.capture("l_out", layers=bad)
        with pytest.raises(TypeError, match="a list of layers"):
            ctx.capture("l_out", layers=3)


def test_capture_limit_counts_the_records_the_capture_shows(model):
    """``max_bytes`` too small for the second ``l_out``: the message counts the records
    ``cap.records`` holds (1), not the automatic inp_tokens / inp_pos copies (3 before)."""
    with _taps_ctx(model) as ctx:
        with pytest.raises(CaptureLimitError) as e, ctx.capture("l_out", max_bytes=20000) as cap:
            ctx.decode(_cat(model))
        assert len(cap.records) == 1
        assert "l_out-1 did not fit" in str(e.value) and "(1 record captured before it)" in str(e.value), str(e.value)
        ctx.memory.clear()
        with pytest.raises(CaptureLimitError) as e, ctx.capture("l_out", max_bytes=40000) as cap:
            ctx.decode(_cat(model))
        assert len(cap.records) == 2 and "(2 records captured before it)" in str(e.value), str(e.value)


def test_the_inputs_have_one_naming(model):
    """The TapError's list of inputs, ``Graph.input_names()`` and ``pyllamacpp graph --sites``
    name them alike: ``cache_k_l<0..29>``, in order of first use."""
    import dataclasses

    from pyllamacpp.experiments.graph import _input_names

    with _taps_ctx(model) as ctx:
        g = ctx.graph_nodes()
        names = g.input_names()
        assert "cache_k_l<0..29>" in names and "cache_v_l<0..29>" in names and "cache_k" not in names
        assert names == _input_names([dataclasses.asdict(n) for n in g.inputs])  # the command's
        assert names[:2] == ["inp_tokens", "inp_pos"]
        with pytest.raises(TapError) as e:
            ctx.capture("attention_probs")
        assert f"Inputs: {', '.join(names)}." in str(e.value), str(e.value)


def test_a_pass_counter_on_the_taps_counts_while_the_context_is_tapped(model):
    """``PassCounter(ctx)`` counts on the context's taps: the same passes and nodes as a counter
    with its own cb_eval on a twin context, while a capture on the same context sees its
    passes from 0 as without the counter; closed, it counts no more."""
    batch = _cat(model)  # 7 tokens: 2 passes under n_ubatch 4

    def work(ctx, capture):
        ctx.decode(batch)
        ctx.memory.clear()
        with capture(ctx) as cap:
            ctx.decode(batch)
        ctx.memory.clear()
        list(pl.generate(ctx, model.tokenize("The cat sat on the mat."), 4, pl.Sampler.greedy()))
        return cap

    ref = pl.PassCounter()
    with _taps_ctx(model, n_ubatch=4, **ref.context_params()) as twin:
        work(twin, lambda c: contextlib.nullcontext())
    assert ref.n_passes == 2 + 2 + 2 + 3  # prompt x3 (2 passes each), then 3 single-token steps
    with _taps_ctx(model, n_ubatch=4) as ctx:
        with pl.PassCounter(ctx) as pc:
            cap = work(ctx, lambda c: c.capture("l_out", layers=[3]))
            assert (pc.n_passes, pc.n_nodes) == (ref.n_passes, ref.n_nodes)
            assert [r.pass_index for r in cap.records] == [0, 1] and cap["l_out", 3].shape == (7, 576)
            pc.reset()
            ctx.memory.clear()
            ctx.decode(batch)
            assert pc.n_passes == 2
        ctx.memory.clear()
        ctx.decode(batch)
        assert pc.n_passes == 2 and not ctx._taps.armed  # closed: counts kept, taps idle again
        with pytest.raises(ValueError, match="counts on a context's taps"):
            pc.context_params()
    with model.context(n_ctx=256, taps=False) as off, pytest.raises(TapError, match="taps=False"):
        pl.PassCounter(off)


def test_generate_speculative_takes_a_counter_on_the_taps(model):
    with _taps_ctx(model, n_ubatch=4) as ctx, pl.PassCounter(ctx) as pc:
        prompt = model.tokenize("one two three four one two three four one two three")
        s = pl.generate_speculative(ctx, prompt, 8, pl.NgramDraft(), n_draft=5, passes=pc)
        list(s)
        by_rows = s.stats.passes_by_rows()
        assert by_rows and all(p == [-(-rows // 4)] * len(p) for rows, p in by_rows.items()), by_rows
        with _taps_ctx(model) as other, pytest.raises(ValueError, match="does not count ctx's passes"):
            pl.generate_speculative(other, prompt, 4, passes=pc)  # counting, but another context's


def test_plots_draw_the_captured_data(model):
    """Each helper returns a Figure whose image or lines are the captured tensors: the head's
    probabilities cut to the cells in use, the mask's finite entries, the rows' L2 norms."""
    from matplotlib.figure import Figure

    from pyllamacpp.taps import plot_attention, plot_mask, plot_residual_norms

    with _taps_ctx(model, n_ctx=1024, n_seq_max=2, kv_unified=True) as ctx:
        two = _cat(model)
        two.add_sequence(model.tokenize("A dog ran in the park!"), 1, 0, logits="last")
        with ctx.capture("l_out", "kq_soft_max", "attn_inp_kq_mask") as cap:
            ctx.decode(two)
    p = cap["kq_soft_max", 5]  # (9 heads, 14 rows, 256 cells)
    fig = plot_attention(cap, 5, 3)
    assert isinstance(fig, Figure)
    img = np.asarray(fig.axes[0].images[0].get_array())
    assert np.array_equal(img, p[3, :, :14])  # 14 cells hold the two prompts
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[0] == "0 'The'" and labels[7] == "0 'A'", labels  # the context's model labels them
    fig = plot_attention(cap, -1, seq_id=1)  # every head of the last layer, sequence 1's rows
    assert len(fig.axes[0].images) == 1 and sum(len(a.images) for a in fig.axes) == 9
    assert np.array_equal(np.asarray(fig.axes[4].images[0].get_array()), cap.rows(1)["kq_soft_max", 29][4, :, :14])
    with pytest.raises(IndexError, match="9 heads"):
        plot_attention(cap, 5, 9)
    mask = cap["attn_inp_kq_mask"]
    img = np.asarray(plot_mask(cap).axes[0].images[0].get_array())
    assert img.shape == (14, 14) and np.array_equal(img, np.isfinite(mask[:, :14]))
    assert img[:7, 7:].sum() == 0 and img[7:, :7].sum() == 0 and img.sum() == 2 * 28  # two causal triangles
    with _taps_ctx(model) as ctx:  # a finite bias in the mask (as ALiBi's) is a cell seen: patched in
        with ctx.patch("attn_inp_kq_mask", lambda m, info: np.where(np.isinf(m), m, -5.0)):
            with ctx.capture("attn_inp_kq_mask") as biased:
                ctx.decode(_cat(model))
    assert (biased["attn_inp_kq_mask"][:, :7] == -5).sum() == 28
    assert np.asarray(plot_mask(biased).axes[0].images[0].get_array()).sum() == 28
    fig = plot_residual_norms(cap)
    lines = fig.axes[0].lines
    assert len(lines) == 14 and list(lines[0].get_xdata()) == list(range(30))
    for row in (0, 6, 13):
        want = [np.linalg.norm(cap["l_out", il][row]) if il < 29 else np.nan for il in range(29)]
        assert np.allclose(lines[row].get_ydata()[:29], want, equal_nan=True)
    # l_out-29 holds the output rows only (6 and 13): the others have no point there
    last = [lines[r].get_ydata()[29] for r in range(14)]
    assert np.isnan(last[0]) and np.isclose(last[6], np.linalg.norm(cap["l_out", 29][0]))
    assert np.isclose(last[13], np.linalg.norm(cap["l_out", 29][1]))
    with pytest.raises(KeyError, match="no layer of it"):
        plot_residual_norms(cap, site="ffn_out")


def test_plots_say_when_matplotlib_is_missing(model, monkeypatch):
    import builtins

    from pyllamacpp.taps import plot_mask

    real = builtins.__import__

    def no_mpl(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, *a, **kw)

    with _taps_ctx(model) as ctx:
        with ctx.capture("attn_inp_kq_mask") as cap:
            ctx.decode(_cat(model))
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(ImportError, match="need matplotlib, which is not installed"):
        plot_mask(cap)


def test_a_file_that_is_not_a_gguf_is_named_in_the_error(model, tmp_path):
    from pyllamacpp.cvec import read_control_vector, write_control_vector

    bad = tmp_path / "direction.bin"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match=r"direction\.bin: not a GGUF file that gguf can read \(GGUF magic invalid\)"):
        read_control_vector(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with _taps_ctx(model) as ctx, pytest.raises(ValueError, match=r"empty\.gguf: not a GGUF file"):
        ctx.control_vector(empty)  # through Context.control_vector too
    with pytest.raises(FileNotFoundError):
        read_control_vector(tmp_path / "missing.gguf")
    good = tmp_path / "v.gguf"
    write_control_vector(good, {2: np.arange(576, dtype=np.float32)})
    assert set(read_control_vector(good)) == {2}


def test_compare_speculative_prints_a_report(model):
    """A dict (the keys the tests and the docs read, JSON-ready) whose str is a short report."""
    from pyllamacpp.speculative import SpeculativeComparison

    with _taps_ctx(model) as ctx:
        prompt = model.tokenize("one two three four one two three four one two three")
        c = pl.compare_speculative(ctx, prompt, 12, pl.NgramDraft(), n_draft=4, repeat=1)
    assert isinstance(c, dict) and json.loads(json.dumps(c)) == json.loads(json.dumps(dict(c)))
    text = str(c)
    assert text == c.report() and len(text.splitlines()) == 5, text
    st = c["speculative"]["stats"]
    assert f"plain generate:       {c['plain']['tokens_per_s']:8.1f} tokens/s" in text, text
    assert f"speed-up: {c['speedup']:.2f}x wall time (pairs {c['speedups'][0]:.2f})" in text, text
    assert f"), {c['speedup_cpu']:.2f}x this thread's CPU time" in text, text
    assert f"{st['n_rounds']} verifies, {st['n_drafted']} tokens drafted, {st['n_accepted']} accepted" in text
    assert ("the same tokens on both sides" in text) == c["same_tokens"], text
    assert repr(c) == f"<SpeculativeComparison {c['speedup']:.2f}x, 12 tokens, same_tokens={c['same_tokens']}>"
    differ = SpeculativeComparison({**c, "same_tokens": False, "first_difference": 5})
    assert "the sides differ from token 5 on" in str(differ)


def test_kvprobe_loads_a_seq_file_too(model, tmp_path, capsys):
    """``load:`` reads a ``save_seq_state`` file (by its magic) as well as a sequence dump: the
    tokens stored in it are the sequence's history, so ``gen`` continues as after ``text``."""
    from pyllamacpp.cli import main

    seq = tmp_path / "cat.seq"
    toks = model.tokenize("The cat sat on the mat.")
    with model.context(n_ctx=256, n_threads=1, n_threads_batch=1) as ctx:
        ctx.prefill(toks)
        ctx.save_seq_state(seq, 0, toks)

    def ops(spec):
        assert main(["kvprobe", "-t", "1", "-c", "256", "--ops", spec, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert "error" not in data, data
        return data["ops"]

    direct = ops("text:0:The cat sat on the mat.;gen:0:3")
    got = ops(f"load:0:{seq};show:0;gen:0:3;save:0:{tmp_path / 'd.bin'};clear;load:0:{tmp_path / 'd.bin'}")
    assert "(a seq file holding 7 token ids), pos 0..6" in got[0]["did"], got[0]
    assert got[0]["bytes"] == seq.stat().st_size and got[1]["cells"] == 7
    assert got[2]["tokens"] == direct[1]["tokens"]
    assert "(a sequence dump), pos 0..9" in got[5]["did"], got[5]


def test_the_source_folder_error_is_the_one_troubleshooting_quotes(tmp_path):
    """Python run in a clone's root after a plain install: ``import pyllamacpp`` succeeds (the
    compiled parts load on first use) and ``pl.Model()`` raises the ImportError that the
    troubleshooting page quotes, word for word, with the command it names. The clone is a copy of
    the package's sources without its compiled files; an editable install's import hook (this
    checkout's, when there is one) is taken out of the child, as a plain install has none."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    clone = tmp_path / "clone"
    shutil.copytree(
        root / "pyllamacpp",
        clone / "pyllamacpp",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "_libs", "__pycache__", "_build_info.json"),
    )
    shutil.copy(root / "pyproject.toml", clone / "pyproject.toml")
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]\n"
        "import pyllamacpp as pl\n"
        "assert pl.__file__.startswith(sys.argv[1]), pl.__file__\n"
        "print('imported')\n"
        "try:\n"
        "    pl.Model()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(clone)], cwd=clone, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    said = r.stdout.splitlines()
    assert said[0] == "imported", r.stdout
    page = (root / "docs/guide/troubleshooting.md").read_text()
    quoted = page.split("```text\n", 1)[1].split("\n```", 1)[0]
    import sysconfig

    site = sysconfig.get_paths()["purelib"]  # where the installed package's extension is
    got = (
        said[1].replace(str(clone / "pyllamacpp"), "/path/to/clone/pyllamacpp").replace(site, "/path/to/site-packages")
    )
    got = " ".join(got.split())
    assert got == " ".join(quoted.removeprefix("ImportError: ").split()), (got, quoted)
    assert "`pip install -e .`" in got and "`pip install -e .`" in page


def test_the_docs_extra_has_what_the_site_build_needs():
    """``pip install ".[docs]"`` then ``mkdocs serve``: the extra holds every mkdocs requirement
    the test extra builds the site with (the same pins), matplotlib for the build's figures, and
    import-linter (grimp) for the layer figure drawn from the import graph."""
    import re
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    extras = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def name(req: str) -> str:
        return re.split(r"[<>=!~; \[]", req, maxsplit=1)[0]

    site = {r for r in extras["test"] if name(r).startswith(("mkdocs", "pymdown"))}
    assert {name(r) for r in site} == {"mkdocs", "mkdocs-material", "mkdocstrings-python", "pymdown-extensions"}
    assert site <= set(extras["docs"]), sorted(site - set(extras["docs"]))
    assert {name(r) for r in extras["docs"]} - {name(r) for r in site} == {"matplotlib", "import-linter"}
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert 'pip install -v ".[docs]"' in readme and "mkdocs serve" in readme
