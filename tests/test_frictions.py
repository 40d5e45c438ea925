"""What a new user met (issue 21, part 3), each held by a test that failed before its fix.

- Ctrl-C in an experiment prints the rows measured before it and says it was interrupted.
- ``pyllamacpp demo | head -3`` stops at the first write after the reader left.
- llama.cpp's detail lines (the X / Y of a position gap) reach the error, by both reason paths.
- "n_stream mismatch" says which context parameters to change.
- A context with several threads on a machine whose cores are taken warns (BusyCoresWarning).

The commands run as real child processes, from a temporary folder (the installed package is
imported, not the source folder).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

import pyllamacpp as pl
import pyllamacpp.context as context_module
from pyllamacpp.errors import BusyCoresWarning, InvalidBatchError, StateError, n_stream_hint

# The command with SIGINT at its default, even under a job control that started us with it
# ignored (CI, `pytest &`), as tests/test_cli.py runs it.
WITH_SIGINT = [
    sys.executable,
    "-c",
    (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, '-m', 'pyllamacpp', *sys.argv[1:]])"
    ),
]


def _popen(args, **kw):
    return subprocess.Popen([*WITH_SIGINT, *args], cwd=tempfile.gettempdir(), text=True, **kw)


def test_ctrl_c_after_the_first_row_prints_it_and_says_so():
    """A real SIGINT to a child running ubatch-sweep once its second row has begun (the progress
    line "step 2/4" on stderr): exit 130, the first row's table on stdout, "interrupted"."""
    proc = _popen(
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
    proc = _popen(["demo", "-t", "1", "-c", "1024", "-n", "400"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
