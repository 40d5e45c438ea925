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

import pyllamacpp as pl
from conftest import PROMPT

pytestmark = pytest.mark.skipif("rpc" not in pl.build_info()["backends"], reason="built without GGML_RPC")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "pyllamacpp.cli", "rpc-server", "--port", str(port), "-t", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"rpc-server exited: {proc.stdout.read().decode()}")
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
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())
    assert "SURVIVED" not in proc.stdout
    assert proc.returncode != 0
    assert "Remote RPC server crashed" in proc.stderr


def test_rpc_devices_do_not_leak_into_other_models(model_path, servers):
    # A model loaded with default devices after an RPC model must not use (or need) the servers.
    with pl.Model(model_path, rpc=servers[:1], n_gpu_layers=5):
        pass
    with pl.Model(model_path, n_gpu_layers=99) as local, local.context(n_ctx=128, n_threads=2) as ctx:
        assert not any(name.startswith("RPC") for name in ctx.buffers)
