"""The ``pyllamacpp`` command behaves like a command: --version, ``python -m``, exit 130 on Ctrl-C
with no traceback, quiet on a closed pipe, plain help text with its defaults, progress when piped.

Each runs the real command in a subprocess, from a temporary folder (so the installed package is
imported, not the source folder: see test_import_from_a_source_tree_says_so for that case).
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import popen_command

import pyllamacpp as pl
from pyllamacpp._cpu import default_n_threads
from pyllamacpp.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
CMD = [sys.executable, "-m", "pyllamacpp"]


def _run(args, **kw):
    return subprocess.run(
        args, check=False, capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=120, **kw
    )


def test_version_and_python_dash_m():
    proc = _run([*CMD, "--version"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"pyllamacpp {pl.__version__} (llama.cpp ")
    assert pl.build_info()["llama_cpp_commit"] in proc.stdout


def test_help_is_plain_text_with_a_description():
    proc = _run([*CMD, "--help"])
    assert proc.returncode == 0
    assert "``" not in proc.stdout and "The pyllamacpp command." not in proc.stdout
    assert "llama.cpp's C API from Python" in proc.stdout and "--version" in proc.stdout


def _subparsers():
    ap = build_parser()
    sub = next(a for a in ap._actions if a.choices and isinstance(a.choices, dict))
    return sub.choices


def test_every_command_help_shows_its_defaults_without_markup():
    n = default_n_threads()
    commands = _subparsers()
    with_threads = []
    for name, p in commands.items():
        text = p.format_help()
        assert "``" not in text and ":func:`" not in text and ":class:`" not in text, name
        flat = " ".join(text.split())  # argparse wraps lines
        if "--threads" in text:
            with_threads.append(name)
            assert f"(default {n}: the physical cores)" in flat, (name, flat)
        for a in p._actions:  # every option taking a value says its default
            if a.option_strings and a.nargs != 0 and a.default not in (None, [], argparse.SUPPRESS):
                assert "default" in (a.help or ""), (name, a.option_strings)
    assert {"demo", "rpc-server", "ubatch-sweep", "kvprobe", "trace-ubatches"} <= set(with_threads)
    sweep = " ".join(commands["ubatch-sweep"].format_help().split())
    # Python 3.13's argparse names the metavar once ("-p, --n-prompt N_PROMPT"), earlier ones twice
    assert re.search(r"-p( N_PROMPT)?, --n-prompt N_PROMPT default: 512", sweep), sweep


def test_threads_flag_defaults_to_the_physical_cores():
    args = build_parser().parse_args(["ubatch-sweep"])
    assert args.threads == default_n_threads()
    assert build_parser().parse_args(["rpc-server"]).threads == default_n_threads()


@pytest.fixture(scope="module")
def dump(tmp_path_factory, model):
    f = tmp_path_factory.mktemp("cli") / "d.bin"
    with model.context(n_ctx=256, n_threads=2) as ctx:
        ctx.prefill(model.tokenize("The cat sat on the mat."))
        ctx.save_seq_dump(f, 0, sidecar=False)
    return f


@pytest.mark.parametrize(
    "args", [["info"], ["demo"], ["split-plan", "--tokens", "100"], ["parse-state", "DUMP", "--heads", "3"]]
)
def test_a_closed_pipe_ends_quietly(args, dump):
    """The reader is gone before the command writes: exit 141 (128 + SIGPIPE, as a C tool killed
    by the signal), nothing on stderr but what the command says before writing."""
    args = [str(dump) if a == "DUMP" else a for a in args]
    proc = popen_command(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves at once
    err = proc.stderr.read()
    rc = proc.wait(timeout=120)
    assert rc == 141, (rc, err)
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_piped_into_head():
    script = (
        f"{' '.join(CMD)} split-plan --tokens 5000 --seqs 8 | head -1; "
        f'{" ".join(CMD)} info | head -1; echo "status ${{PIPESTATUS[0]}}"'
    )
    proc = _run(["bash", "-c", script])
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("8 sequence(s)") and lines[1] == "{", proc.stdout
    assert lines[2] in ("status 0", "status 141")  # 0 when head read it all before leaving
    assert proc.stderr == "", proc.stderr


def test_ctrl_c_exits_130_without_traceback_and_progress_shows_when_piped():
    """SIGINT while ubatch-sweep runs (piped: its progress comes as lines on stderr)."""
    proc = popen_command(
        ["ubatch-sweep", "-c", "1024", "-p", "512", "-n", "256", "-r", "3", "-t", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    err = []
    for line in proc.stderr:  # the first step's line: it is running now
        err.append(line)
        if line.startswith("ubatch-sweep: step 1/"):
            break
    time.sleep(0.5)  # well into the step's decodes
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    err.append(rest)
    err = "".join(err)
    assert proc.returncode == 130, err
    assert "ubatch-sweep: step 1/" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rpc_server_ctrl_c_exits_130_without_traceback():
    port = _free_port()
    proc = popen_command(["rpc-server", "--port", str(port), "-t", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(600):  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_progress_is_one_line_per_step_when_stderr_is_not_a_terminal(capsys):
    from pyllamacpp.experiments.common import progress

    assert list(progress(["a", "b", "c"], "demo-steps")) == ["a", "b", "c"]
    err = capsys.readouterr().err.splitlines()
    assert [e.split(" (")[0] for e in err[:3]] == [f"demo-steps: step {i}/3" for i in (1, 2, 3)]
    assert err[3].startswith("demo-steps: done, 3 steps")


def test_bad_input_still_exits_2_with_a_message(capsys):
    assert main(["parse-state", "/no/such/file.bin"]) == 2
    assert "pyllamacpp parse-state: error:" in capsys.readouterr().err


def test_import_from_a_source_tree_says_so(tmp_path):
    """`python -c "import pyllamacpp; pyllamacpp.Model()"` in a checkout's root after a non-editable
    install: the source folder (no compiled extension) shadows the installed package. A copy of the
    Python files beside a pyproject.toml is such a tree; the editable finder of this venv is taken
    out of sys.meta_path, as a non-editable install has none."""
    src = ROOT / "pyllamacpp"
    shutil.copytree(
        src,
        tmp_path / "pyllamacpp",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "*.dll", "*.dylib", "*.json", "__pycache__"),
    )
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'pyllamacpp'\n")
    code = (
        "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'Redirect' not in type(f).__name__]; "
        "import pyllamacpp; assert pyllamacpp.__file__.startswith(sys.argv[1]), pyllamacpp.__file__; "
        "pyllamacpp.Model()"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: pyllamacpp was imported from the source tree at "), proc.stderr
    assert str(tmp_path / "pyllamacpp") in last and "no compiled extension" in last
    assert "run from another folder, or install with `pip install -e .`" in last
    # From this checkout's root: with an editable install (the checkout is what is installed) it
    # imports fine; with a regular install (`pip install .`, as CI does) it is the shadowing case.
    where = subprocess.run(
        [sys.executable, "-c", "import pyllamacpp; print(pyllamacpp.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path.parent,
        timeout=60,
    ).stdout.strip()
    editable = Path(where).resolve().is_relative_to(ROOT.resolve())
    at_root = subprocess.run(
        [sys.executable, "-c", "import pyllamacpp; pyllamacpp.lib"],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    if editable:
        assert at_root.returncode == 0, at_root.stderr
    else:
        assert at_root.returncode == 1
        assert f"source tree at {ROOT / 'pyllamacpp'}" in at_root.stderr, at_root.stderr
