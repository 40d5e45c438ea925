"""ggml's RPC backend: two rpc-server processes on loopback, a model split across them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from conftest import PROMPT

import pyllamacpp as pl

pytestmark = pytest.mark.skipif("rpc" not in pl.build_info()["backends"], reason="built without GGML_RPC")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyllamacpp.cli", "rpc-server", "--port", str(port), "-t", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tempfile.gettempdir(),
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"rpc-server exited: {proc.stdout.read().decode()}") from None
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("rpc-server did not start listening")


@pytest.fixture(scope="module")
def servers():
    ports = [_free_port(), _free_port()]
    procs = [start_server(p) for p in ports]
    yield [f"127.0.0.1:{p}" for p in ports]
    for p in procs:
        p.kill()
        p.wait()


def _run(model):
    toks = model.tokenize(PROMPT)
    with model.context(n_ctx=256, n_threads=2) as ctx:
        out = list(pl.generate(ctx, toks, 32))
        return out, bytes(ctx.seq_state(0)), ctx.buffers


def test_split_across_two_servers_equals_local(model_path, servers):
    with pl.Model(model_path) as local:
        ref_tokens, ref_state, _ = _run(local)
    with pl.Model(model_path, rpc=servers, n_gpu_layers=20) as split:
        tokens, state, buffers = _run(split)
    assert tokens == ref_tokens and len(tokens) == 32
    assert state == ref_state  # KV cells that lived on the servers come back byte for byte
    rpc_kv = [k["KV"] for name, k in buffers.items() if name.startswith("RPC") and "KV" in k]
    assert len(rpc_kv) == 2 and all(v > 0 for v in rpc_kv)  # the layers really are on both servers
    assert sum(d["backend"] == "RPC" for d in pl.devices()) >= 2


def test_unreachable_server_is_a_clear_exception_in_bounded_time(model_path):
    from pyllamacpp.rpc import RPCError

    port = _free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RPCError, match="not reachable"):
        pl.Model(model_path, rpc=[f"127.0.0.1:{port}"], n_gpu_layers=10)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="host:port"):
        pl.Model(model_path, rpc=["no-port-here"])


def test_rpc_server_binds_loopback_unless_told(capsys):
    from pyllamacpp.cli import main

    assert main(["rpc-server", "--host", "0.0.0.0"]) == 2
    assert "no authentication" in capsys.readouterr().err


def test_a_server_dying_mid_decode_takes_the_client_down(tmp_path):
    # What ggml-rpc does at this pin, documented in the README: GGML_ABORT in the client.
    code = f"""
import numpy as np, pyllamacpp as pl, threading, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_rpc import start_server, _free_port
port = _free_port(); srv = start_server(port)
m = pl.Model(rpc=[f"127.0.0.1:{{port}}"], n_gpu_layers=30)
ctx = m.context(n_ctx=2048, n_batch=2048, n_threads=1)
toks = np.resize(m.tokenize("The cat sat on the mat."), 1024)
threading.Timer(0.3, srv.kill).start()
for _ in range(50):
    ctx.memory.clear(); ctx.prefill(toks)
print("SURVIVED")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tempfile.gettempdir(),
    )
    assert "SURVIVED" not in proc.stdout
    assert proc.returncode != 0
    assert "Remote RPC server crashed" in proc.stderr


def test_rpc_devices_do_not_leak_into_other_models(model_path, servers):
    # A model loaded with default devices after an RPC model must not use (or need) the servers.
    with pl.Model(model_path, rpc=servers[:1], n_gpu_layers=5):
        pass
    with pl.Model(model_path, n_gpu_layers=99) as local, local.context(n_ctx=128, n_threads=2) as ctx:
        assert not any(name.startswith("RPC") for name in ctx.buffers)


# -- a client that outlives its servers (issue 16) ------------------------------------------------
# Each scenario runs in its own process group with a watchdog: a hang fails the test (and the
# group, servers included, is killed) instead of blocking the suite; an abort fails it too.
_PRELUDE = f"""
import logging, os, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(name)s %(message)s")
import pyllamacpp as pl
from pyllamacpp.errors import ClosedError, RPCError
from test_rpc import start_server, _free_port

def load(*ports):
    m = pl.Model(rpc=[f"127.0.0.1:{{p}}" for p in ports], n_gpu_layers=99)
    ctx = m.context(n_ctx=128, n_threads=1)
    print("TOKENS", list(pl.generate(ctx, m.tokenize("The cat sat"), 4)), flush=True)
    return m, ctx

def stop(*procs):
    for p in procs:
        p.kill(); p.wait()

def refused(what, fn):
    try:
        fn()
    except RPCError as e:
        print("REFUSED", what, e, flush=True)
"""


def _scenario(body: str, timeout: float = 240) -> tuple[str, str]:
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # an abort fails fast instead of attaching gdb
    proc = subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + body],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tempfile.gettempdir(),
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"the scenario hung (killed after {timeout} s)\n--- stdout\n{out}\n--- stderr\n{err[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, 9)  # servers a failed scenario left running
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, f"rc {proc.returncode}\n--- stdout\n{out}\n--- stderr\n{err[-3000:]}"
    assert "Exception ignored" not in err, err
    return out, err


def _tokens(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("TOKENS")]


def test_servers_stopped_then_close_returns_and_warns():
    out, _ = _scenario("""
a, b = _free_port(), _free_port()
sa, sb = start_server(a), start_server(b)
m, ctx = load(a, b)
stop(sa, sb)
ctx.close()
m.close()
print("CLOSED", ctx.closed, m.closed, flush=True)
try:
    ctx.logits()
except ClosedError:
    print("USE AFTER CLOSE RAISES")
c = _free_port(); sc = start_server(c)
pl.rpc.add_servers([f"127.0.0.1:{c}"])  # devices, no model: nothing holds a connection to it
stop(sc)
print("DEVICES", sorted((d["description"] == f"127.0.0.1:{c}", d["memory_total"]) for d in pl.devices()
                        if d["backend"] == "RPC"), flush=True)
""")
    assert "CLOSED True True" in out and "USE AFTER CLOSE RAISES" in out
    # ggml would abort asking a server that is gone for its memory (stopped: known; c: not reachable)
    assert "DEVICES [(False, None), (False, None), (True, None)]" in out
    warnings = [line for line in out.splitlines() if line.startswith("LOG pyllamacpp.rpc")]
    assert len(warnings) == 2, out  # once for the context, once for the model
    assert "the context on it is left unfreed" in warnings[0] and "the model" in warnings[1]
    assert all("is gone" in w and "127.0.0.1:" in w for w in warnings)


def test_servers_stopped_then_interpreter_exit_with_objects_alive():
    out, _ = _scenario("""
a, b = _free_port(), _free_port()
sa, sb = start_server(a), start_server(b)
m, ctx = load(a, b)
logits = ctx.logits()  # a view that holds the context too
stop(sa, sb)
print("END", flush=True)
""")
    assert "END" in out and len(_tokens(out)) == 1


def test_servers_stopped_then_decode_raises_rpc_error_and_the_process_lives():
    out, _ = _scenario("""
a, b = _free_port(), _free_port()
sa, sb = start_server(a), start_server(b)
m, ctx = load(a, b)
toks = m.tokenize("The cat sat")
stop(sa, sb)
refused("generate", lambda: list(pl.generate(ctx, toks, 4)))
refused("prefill", lambda: ctx.prefill(toks, seq_id=0))
refused("seq_state", lambda: ctx.seq_state(0))
refused("memory.clear", lambda: ctx.memory.clear())
refused("context", lambda: m.context(n_ctx=128))
print("ALIVE", flush=True)
""")
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert [line.split()[1] for line in refused] == ["generate", "prefill", "seq_state", "memory.clear", "context"]
    assert all("is gone" in line and "127.0.0.1:" in line for line in refused)
    assert "ALIVE" in out


def test_one_of_two_servers_stopped():
    out, _ = _scenario("""
a, b = _free_port(), _free_port()
sa, sb = start_server(a), start_server(b)
m, ctx = load(a, b)
stop(sb)
refused("generate", lambda: list(pl.generate(ctx, m.tokenize("The cat sat"), 4)))
ctx.close(); m.close()
print("CLOSED", flush=True)
m2, ctx2 = load(a)  # the server still up takes a new model (on the connection the old one holds)
print("DOWN", b, [d["memory_total"] for d in pl.devices() if d["description"] == f"127.0.0.1:{b}"])
ctx2.close(); m2.close()
stop(sa)
""")
    b = out.split("DOWN ")[1].split()[0]
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 1 and f"127.0.0.1:{b} is gone" in refused[0]
    assert "CLOSED" in out
    first, second = _tokens(out)
    assert first == second  # same greedy tokens with all layers on the one server left
    assert f"DOWN {b} [None]" in out  # devices() does not ask a server that is gone


def test_server_restarted_on_the_same_port():
    out, _ = _scenario("""
a = _free_port()
sa = start_server(a)
m, ctx = load(a)
stop(sa)
sa = start_server(a)  # a new process: the old connection and its buffers are gone
m2, ctx2 = load(a)    # loads before the old objects were even looked at
refused("old generate", lambda: list(pl.generate(ctx, m.tokenize("The cat sat"), 4)))
ctx.close(); m.close()
print("OLD CLOSED", flush=True)
ctx2.memory.clear()
print("NEW AGAIN", list(pl.generate(ctx2, m2.tokenize("The cat sat"), 4)), flush=True)
print("DEVICES", [d["memory_total"] for d in pl.devices() if d["backend"] == "RPC"], flush=True)
ctx2.close(); m2.close()
stop(sa)
print("END", flush=True)
""")
    first, second = _tokens(out)
    assert first == second
    assert "REFUSED old generate" in out and "OLD CLOSED" in out and "END" in out
    assert "NEW AGAIN " + first.split(" ", 1)[1] in out
    devices = out.split("DEVICES ")[1].splitlines()[0]
    assert devices.startswith("[") and "None" not in devices  # only the new connection's device


def test_a_server_busy_with_this_process_takes_more_models(model_path, servers):
    # An rpc-server serves one connection at a time and queues at most two more (listen(fd, 1)): a
    # TCP connect to check it, while a model holds it, timed out from the third model on.
    models = []
    try:
        for _ in range(4):
            models.append(pl.Model(model_path, rpc=servers[:1], n_gpu_layers=5))
    finally:
        for m in models:
            m.close()
    assert len(models) == 4


def test_one_server_under_two_names_is_one_connection(servers):
    # ggml-rpc keeps a connection per endpoint string and an rpc-server serves one connection at a
    # time: "localhost:p" while "127.0.0.1:p" was held waited forever for the server's HELLO.
    port = servers[0].rpartition(":")[2]  # idle: a server serves one process, and this one holds none
    out, _ = _scenario(
        f"""
m = pl.Model(rpc=["127.0.0.1:{port}"], n_gpu_layers=5)
m2 = pl.Model(rpc=["localhost:{port}", "127.0.0.1:{port}"], n_gpu_layers=5)
print("LOADED", sum(d["backend"] == "RPC" for d in pl.devices()), flush=True)
m2.close(); m.close()
""",
        timeout=120,
    )
    assert "LOADED 1" in out


def _worker(kill_mid_call: bool):
    """run_in_subprocess's test: a server of its own, killed during a prefill or not."""
    import threading

    os.environ["GGML_NO_BACKTRACE"] = "1"
    port = _free_port()
    srv = start_server(port)
    m = pl.Model(rpc=[f"127.0.0.1:{port}"], n_gpu_layers=30)
    ctx = m.context(n_ctx=2048, n_batch=2048, n_threads=1)
    if not kill_mid_call:
        out = list(pl.generate(ctx, m.tokenize("The cat sat"), 4))
        ctx.close(), m.close()
        srv.kill()
        return out
    toks = np.resize(m.tokenize("The cat sat on the mat."), 1024)
    threading.Timer(0.3, srv.kill).start()
    for _ in range(200):
        ctx.memory.clear()
        ctx.prefill(toks)
    return "SURVIVED"


def _raises():
    raise KeyError("from the child")


def test_run_in_subprocess_survives_a_server_dying_mid_call():
    from pyllamacpp.rpc import RPCError, run_in_subprocess

    tokens = run_in_subprocess(_worker, False, timeout=240)
    assert len(tokens) == 4 and all(isinstance(t, int) for t in tokens)
    with pytest.raises(RPCError, match="died") as e:
        run_in_subprocess(_worker, True, timeout=240)
    assert e.value.exitcode == -6  # SIGABRT: ggml-rpc's GGML_ABORT, in the child only
    with pytest.raises(KeyError, match="from the child"):
        run_in_subprocess(_raises, timeout=120)
    with pytest.raises(RPCError, match="ran past 2 s"):
        run_in_subprocess(time.sleep, 60, timeout=2)
