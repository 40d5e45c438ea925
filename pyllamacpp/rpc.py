"""ggml's RPC backend from Python: run an ``rpc-server``, put a model's layers on remote hosts.

The protocol has no authentication: a server listens on loopback unless told otherwise.

What ggml-rpc does on network failure, at this pin (``ggml-rpc.cpp``): a server it cannot connect
to, and a server that dies or answers garbage mid-decode, end in ``GGML_ABORT`` -- the whole
process dies. pyllamacpp checks that each server accepts a TCP connection (with a timeout) before
handing its endpoint to ggml, so an unreachable server at load time is a Python exception; a server
that dies after that still takes the client process down, and nothing in Python can prevent it.
"""
from __future__ import annotations

import socket

from ._lib import EXTENSION_INFO, ffi, lib
from .errors import LlamaError

_DEV_TYPES = {getattr(lib, f"GGML_BACKEND_DEVICE_TYPE_{n}"): n.lower()
              for n in ("CPU", "GPU", "IGPU", "ACCEL") if hasattr(lib, f"GGML_BACKEND_DEVICE_TYPE_{n}")}


class RPCError(LlamaError):
    """An RPC server could not be used."""


def _s(p) -> str:
    return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else ""


_added: list = []  # RPC devices added in this process (kept out of ggml's registry)


def devices() -> list[dict]:
    """Every device this process can see (CPU, CUDA, RPC servers added so far), with memory."""
    out = []
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    for i, dev in enumerate([lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())] + _added):
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append({"index": i, "name": _s(lib.ggml_backend_dev_name(dev)),
                    "description": _s(lib.ggml_backend_dev_description(dev)),
                    "type": _DEV_TYPES.get(lib.ggml_backend_dev_type(dev), str(lib.ggml_backend_dev_type(dev))),
                    "backend": _s(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))),
                    "memory_free": int(free[0]), "memory_total": int(total[0])})
    return out


def _split(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"RPC endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def check_reachable(endpoint: str, timeout: float = 3.0) -> None:
    """Raise RPCError unless ``endpoint`` accepts a TCP connection within ``timeout`` seconds
    (ggml-rpc would abort the process instead)."""
    host, port = _split(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise RPCError(f"RPC server {endpoint} is not reachable: {e}", func="ggml_backend_rpc_add_server") from e


def add_servers(endpoints, timeout: float = 3.0) -> list:
    """``ggml_backend_rpc_add_server`` for each endpoint (checked first); returns the device handles
    they bring, for a model's ``devices`` list. They are not put in ggml's global registry (see
    below). Adding the same endpoint twice returns its devices again."""
    if "rpc" not in EXTENSION_INFO["backends"]:
        raise RPCError("this build has no RPC backend (build with -DGGML_RPC=ON)")
    devs = []
    for ep in endpoints:
        check_reachable(ep, timeout)
        reg = lib.ggml_backend_rpc_add_server(ep.encode())
        if reg == ffi.NULL:
            raise RPCError(f"RPC server {ep} reports no devices", func="ggml_backend_rpc_add_server")
        # Not registered globally: a registered device would be used by every later model loaded
        # with default devices, and talking to a server that is gone aborts the process.
        for i in range(lib.ggml_backend_reg_dev_count(reg)):
            dev = lib.ggml_backend_reg_dev_get(reg, i)
            devs.append(dev)
            if dev not in _added:
                _added.append(dev)
    return devs


def start_server(host: str = "127.0.0.1", port: int = 50052, *, threads: int = 2, cache_dir: str | None = None) -> None:
    """``ggml_backend_rpc_start_server`` on this process's CPU device; blocks until the process ends."""
    cpu = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())
           if lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) == lib.GGML_BACKEND_DEVICE_TYPE_CPU]
    if not cpu:
        raise RPCError("no CPU device to serve")
    arr = ffi.new("ggml_backend_dev_t[]", cpu[:1])
    endpoint = f"{host}:{port}".encode()
    cdir = cache_dir.encode() if cache_dir else ffi.NULL
    lib.ggml_backend_rpc_start_server(endpoint, cdir, threads, 1, arr)
