"""Shared fixtures: the real compiled library and the real default model (no mocks)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def llama_cpp_dir() -> Path:
    """The llama.cpp source the extension was built from (vendored, or LLAMA_CPP_DIR)."""
    import pyllamacpp

    source = pyllamacpp.build_info()["llama_cpp_source"]
    if source.startswith("LLAMA_CPP_DIR="):
        return Path(source.split("=", 1)[1])
    return ROOT / "vendor" / "llama.cpp"


@pytest.fixture(scope="session")
def model_path() -> Path:
    import pyllamacpp

    return pyllamacpp.default_model_path()


@pytest.fixture(scope="session")
def model(model_path):
    import pyllamacpp

    m = pyllamacpp.Model(model_path)
    yield m
    m.close()


@pytest.fixture
def ctx(model):
    """A small single-sequence context, 2 threads."""
    c = model.context(n_ctx=512, n_threads=2, n_threads_batch=2)
    yield c
    c.close()


PROMPT = "The cat sat on the mat."

# The prefix store tests' prompt (tests/test_prefix_store*.py): several chunks of 8 tokens.
STORE_TEXT = (
    "The cat sat on the mat and looked at the dog, who was not amused at all by it, "
    "and then the two of them went out into the garden to see the birds."
)


def store_context(model, **kw):
    """The prefix store tests' context: 256 cells, one thread, flash attention off; ``kw`` overrides."""
    args = dict(n_ctx=256, n_threads=1, n_threads_batch=1, flash_attn=False)
    args.update(kw)
    return model.context(**args)


def next_logits(ctx, toks, start):
    """Decode ``toks[start:]`` after what sequence 0 holds; the last token's logits (a copy)."""
    import numpy as np

    ctx.prefill(toks[start:], 0, start)
    return np.array(ctx.logits(-1))


def saved_store(model, where, chunk_size: int = 8):
    """STORE_TEXT prefilled in a :func:`store_context` and saved into a ``PrefixStore`` at ``where``.

    Returns:
        ``(its tokens, the store, the keys of its whole chunks)``.
    """
    from pyllamacpp.prefix_store import PrefixStore

    toks = model.tokenize(STORE_TEXT)
    store = PrefixStore(where, chunk_size=chunk_size)
    with store_context(model) as ctx:
        ctx.prefill(toks)
        store.save(ctx, 0, toks)
        keys = store.keys(ctx, toks)
    return toks, store, keys


@pytest.fixture
def raising_log_handler():
    """``with raising_log_handler(exc):`` a handler on logger ``pyllamacpp.llama`` raises ``exc``
    for every record at ``level`` (WARNING) or above: an exception inside llama.cpp's log callback,
    which pyllamacpp must keep and raise once C has returned."""

    @contextlib.contextmanager
    def install(exc: BaseException, level: int = logging.WARNING):
        class Boom(logging.Handler):
            def emit(self, record):
                raise exc

        h, lg = Boom(level=level), logging.getLogger("pyllamacpp.llama")
        lg.addHandler(h)
        try:
            yield h
        finally:
            lg.removeHandler(h)

    return install


@dataclasses.dataclass
class Child:
    """What a child interpreter (:func:`run_child`) left: exit status and output."""

    rc: int
    stdout: str
    stderr: str

    @property
    def signal(self) -> str | None:
        """The signal that ended the child (``"SIGABRT"`` for a GGML_ASSERT), None when it exited."""
        if self.rc >= 0:
            return None
        try:
            return signal.Signals(-self.rc).name
        except ValueError:
            return f"signal {-self.rc}"

    def describe(self) -> str:
        """How the child ended, the assert llama.cpp printed, where in the snippet (faulthandler)
        and the end of its stdout: enough to see which case of a batch of cases ended it."""
        err = self.stderr.splitlines()
        if not self.signal:  # a Python exception (an assert in the snippet): its traceback
            return "\n".join(
                [f"the child process exited with {self.rc}", *err[-15:], "last stdout:", *self.stdout.splitlines()[-8:]]
            )
        asserts = [ln for ln in err if "GGML_ASSERT" in ln or "GGML_ABORT" in ln]
        where = [ln for ln in err if ln.startswith(("Fatal Python error", '  File "<string>"'))]
        lines = [f"the child process was killed by {self.signal}", *asserts[-3:], *where]
        lines += ["last stdout:", *self.stdout.splitlines()[-8:]]
        if not (asserts or where):
            lines += ["last stderr:", *err[-15:]]
        return "\n".join(lines)


def run_child(
    code: str, *args: object, timeout: float = 300, check: bool = True, env: dict[str, str] | None = None
) -> Child:
    """Run ``code`` in a fresh interpreter, so that an abort (SIGABRT from a GGML_ASSERT, a
    SIGSEGV) ends that process and fails the calling test, not the pytest run.

    ``python -X faulthandler -c code args...`` from the temporary folder (the installed package is
    imported), with ``GGML_NO_BACKTRACE=1`` (ggml's abort would run gdb for a backtrace).

    Args:
        code: The snippet (it imports what it needs; ``sys.argv[1:]`` are ``args``).
        args: Arguments, passed as strings.
        timeout: Seconds before the child is killed (``subprocess.TimeoutExpired``).
        check: Fail the test (``pytest.fail``, with :meth:`Child.describe`) unless the child
            exited with 0.
        env: Variables set in the child on top of this process's environment.

    Returns:
        The :class:`Child`.
    """
    env = {**os.environ, "GGML_NO_BACKTRACE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tempfile.gettempdir(),
        env=env,
    )
    child = Child(proc.returncode, proc.stdout, proc.stderr)
    if check and child.rc != 0:
        pytest.fail(child.describe(), pytrace=False)
    return child


def greedy_alone(ctx, prefix: str, prompts, n: int) -> dict[str, list[int]]:
    """Each of ``prompts`` after ``prefix`` generated alone (``generate``, greedy) in a fresh sequence
    of ``ctx``: what a scheduler's batched run must give (tests/test_scheduler.py and
    tests/test_prefix_store_wiring.py).

    Returns:
        ``{prompt: its n tokens}``.
    """
    import pyllamacpp

    out = {}
    for q in prompts:
        ctx.memory.seq_rm(-1)
        g = pyllamacpp.generate(ctx, ctx.model.tokenize(prefix + q), n)
        out[q] = list(g)
        assert g.finish_reason == "n_predict"
    return out


# A background job (CI, `pytest &`) starts with SIGINT ignored, children inherit that, and Python
# then installs no handler: the command runs through an exec that puts the default back first.
WITH_SIGINT = [
    sys.executable,
    "-c",
    (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, [sys.executable, '-m', 'pyllamacpp', *sys.argv[1:]])"
    ),
]


def popen_command(args: list[str], **kw) -> subprocess.Popen:
    """Start ``python -m pyllamacpp args...`` with SIGINT at its default, from the temporary folder
    (the installed package is imported, not the source folder), in text mode.

    Args:
        args: The command's arguments.
        **kw: More ``subprocess.Popen`` keywords (``stdout=subprocess.PIPE``...).

    Returns:
        The ``subprocess.Popen``.
    """
    return subprocess.Popen([*WITH_SIGINT, *args], cwd=tempfile.gettempdir(), text=True, **kw)


class UbatchAborter:
    """A ``cb_eval`` that counts the ubatches a context computes (one ``l_out-0`` node each) and
    calls ``ctx.abort()`` as ubatch ``at`` starts: with no node wanted, ggml_backend_sched asks
    about every node of the graph before computing it, so the abort lands in that ubatch.

    Pass ``cb=`` as ``cb_eval`` (with ``cb_eval_user_data=ffi.NULL``) and set ``ctx``, or let
    :meth:`context` do both.
    """

    def __init__(self):
        from pyllamacpp import ffi

        self.ctx, self.n, self.at = None, 0, None
        self.cb = ffi.callback("bool(struct ggml_tensor *, bool, void *)", self._cb)

    def _cb(self, t, ask, _):
        from pyllamacpp import ffi

        if ask and ffi.string(t.name) == b"l_out-0":
            self.n += 1
            if self.n == self.at:
                self.ctx.abort()
        return False

    def context(self, model, **kw):
        """``model.context(**kw)`` with this callback, remembered as the context to abort."""
        from pyllamacpp import ffi

        self.ctx = model.context(cb_eval=self.cb, cb_eval_user_data=ffi.NULL, **kw)
        return self.ctx


_RESULT = "@@call_in_child result: "  # marks the result's line among what llama.cpp may print

_CALL = (
    "import importlib, json, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "fn = getattr(importlib.import_module(sys.argv[2]), sys.argv[3])\n"
    "out = json.dumps(fn(*json.loads(sys.argv[4])))\n"
    "print('\\n' + sys.argv[5] + out, flush=True)\n"
)


def call_in_child(fn, *args: object, timeout: float = 300) -> object:
    """``fn(*args)`` in a fresh interpreter (:func:`run_child`), for the part of a test that
    samples from output rows a packing regression would leave unrequested: llama.cpp then aborts
    (``GGML_ASSERT(logits != nullptr)`` in ``llama_sampler_sample``), which ends that process and
    fails this test instead of ending the pytest run. The test asserts on what ``fn`` returned.

    Args:
        fn: A module-level function of a test module (the child imports it from ``tests/``). It
            loads what it needs (``pyllamacpp.Model()``) and returns plain data.
        args: Its arguments, JSON-encoded on the way in (dict keys become strings).
        timeout: Seconds before the child is killed (``subprocess.TimeoutExpired``).

    Returns:
        What ``fn`` returned, through JSON (tuples come back as lists).
    """
    folder = Path(fn.__code__.co_filename).parent
    child = run_child(
        _CALL, folder, fn.__module__, fn.__qualname__, json.dumps(args), _RESULT, timeout=timeout, check=False
    )
    if child.rc != 0:
        # faulthandler's stack of the thread that died: the pyllamacpp call and the line of fn
        err = child.stderr.splitlines()
        at = next((i for i, ln in enumerate(err) if ln.startswith(("Current thread", "Thread 0x"))), None)
        stack = [] if at is None else list(itertools.takewhile(str.strip, err[at + 1 : at + 12]))
        where = ["where it died (most recent call first):", *stack] if stack else []
        pytest.fail("\n".join([f"{fn.__name__}() in a child process: {child.describe()}", *where]), pytrace=False)
    lines = [ln for ln in child.stdout.splitlines() if ln.startswith(_RESULT)]
    assert lines, f"{fn.__name__}() exited with 0 and printed no result; stdout ends: {child.stdout[-500:]!r}"
    return json.loads(lines[-1][len(_RESULT) :])


def load_tool(path: Path, name: str):
    """A script of tools/ imported as a module, for its tests (tools/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
