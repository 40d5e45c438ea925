"""ggml's RPC backend from Python: run an ``rpc-server``, put a model's layers on remote hosts.

The protocol has no authentication: a server listens on loopback unless told otherwise. An
``rpc-server`` serves one client connection at a time; ggml-rpc keeps one connection per endpoint
(its ``rpc_dispatcher``), shared by every model and context on that server, and a server keeps a
buffer only as long as the connection that allocated it.

What ggml-rpc does on network failure, at this pin (``ggml-rpc.cpp``): a server it cannot connect
to, and a server that dies or answers garbage during a call, end in ``GGML_ABORT`` (the process
dies), and freeing a buffer on a server that is gone aborts or waits forever. What pyllamacpp does
about it:

- Before a load, each server must accept a TCP connection (or already be connected and alive):
  otherwise :class:`RPCError`.
- A model or context on RPC servers watches ggml's own connection to each server (found among the
  process's sockets by its peer address). When the server closes it (the process stopped, crashed
  or was restarted), any use of the object raises :class:`RPCError` naming the server, before
  anything enters ggml: one ``poll()`` of those sockets per use, about a microsecond.
- ``close()`` (and garbage collection) of an object whose server is gone does not call into ggml:
  the object's local and remote memory is left (the remote part went with the server) and one
  warning is logged. At interpreter exit nothing on an RPC server is freed through the network:
  the servers free a connection's buffers themselves when this process's connections close.
- A server restarted on the same port is a new process: the old connection is dead (the old
  objects raise RPCError and are left, as above) and the next load connects anew (ggml is given
  the endpoint under another spelling of the port, ``host:0port``, because it keeps the dead
  connection for the old objects under the old one).
- Still an abort: a server that dies *during* a call (decode, state read/write, load): ggml-rpc
  aborts inside that call. Run such work with :func:`run_in_subprocess` when this process must
  survive it.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import socket
import stat
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ._lib import EXTENSION_INFO, backend_function, ffi, lib
from .errors import RPCError

_T = TypeVar("_T")

__all__ = ["RPCError", "add_servers", "check_reachable", "devices", "run_in_subprocess", "start_server"]

log = logging.getLogger(__name__)

_DEV_TYPES = {
    getattr(lib, f"GGML_BACKEND_DEVICE_TYPE_{n}"): n.lower()
    for n in ("CPU", "GPU", "IGPU", "ACCEL")
    if hasattr(lib, f"GGML_BACKEND_DEVICE_TYPE_{n}")
}
# The peer closed or reset the connection (POLLHUP and POLLERR are always reported).
_GONE = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)
_exiting = [False]  # set by atexit: a Link reads it during finalization, when module globals may be gone
atexit.register(_exiting.__setitem__, 0, True)


def _s(p) -> str:
    return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else ""


def _split(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"RPC endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _sockets_to(addrs: set, exclude=()) -> list[tuple[int, int]] | None:
    """``(fd, inode)`` of this process's sockets connected to one of ``addrs`` (``(ip, port)``),
    ggml-rpc's connections among them; None where the process's fds cannot be listed."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    out = []
    for name in names:
        fd = int(name)
        try:
            st = os.fstat(fd)
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino in exclude:
                continue
            dup = os.dup(fd)  # a duplicate to look through: closing it leaves ggml's fd open
        except OSError:
            continue
        try:
            s = socket.socket(fileno=dup)
        except (OSError, ValueError):
            os.close(dup)
            continue
        with s:
            try:
                peer = s.getpeername()
            except OSError:
                continue
        if isinstance(peer, tuple) and peer[:2] in addrs:
            out.append((fd, st.st_ino))
    return out


class _Conn:
    """A server under one name given to ggml (``alias``): ggml's connection under that name,
    alive, or known gone (``down`` says why; it stays gone)."""

    def __init__(self, server: _Server, alias: str):
        self.server, self.alias, self.endpoint = server, alias, server.endpoint
        self.down: str | None = None

    def mark_down(self, why: str) -> None:
        if self.down is None:
            self.down = why

    def connections(self) -> list[tuple[int, int]] | None:
        return self.server.connections()


class _Server:
    """One endpoint as the user names it, and the name ggml knows it by now (``conn.alias``)."""

    def __init__(self, endpoint: str):
        self.host, self.port = _split(endpoint)
        self.endpoint = endpoint
        self.generation = 0  # how many connections died: the leading zeros of the alias's port
        self.conn = _Conn(self, endpoint)
        self.dead: set[int] = set()  # inodes of connections found closed by the server
        self._addrs: set | None = None

    @property
    def addrs(self) -> set:
        if self._addrs is None:
            try:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            except OSError:
                infos = []
            self._addrs = {info[4][:2] for info in infos}
        return self._addrs

    def connections(self) -> list[tuple[int, int]] | None:
        return _sockets_to(self.addrs, self.dead)

    def connected(self) -> bool | None:
        """True when ggml holds a live connection to the server, False when it holds none, None
        where this cannot be known. A connection found closed marks the server down."""
        conns = self.connections()
        if conns is None:
            return None
        for fd, ino in conns:
            if _closed_by_peer(fd, ino):
                self.dead.add(ino)
                self.conn.mark_down("its connection was closed by the server")
        return bool(conns) and self.conn.down is None

    def renew(self) -> None:
        # ggml-rpc keeps one connection per endpoint string for as long as a buffer uses it, and the
        # objects left on the dead one keep it: a new connection needs a new string. ggml reads the
        # port with std::stoi, so leading zeros reach the same port.
        self.generation += 1
        self.conn = _Conn(self, f"{self.endpoint.rpartition(':')[0]}:{'0' * self.generation}{self.port}")


def _closed_by_peer(fd: int, ino: int) -> bool:
    p = select.poll()
    p.register(fd, _GONE)
    return any(ev & _GONE and not ev & select.POLLNVAL for _, ev in p.poll(0)) and _same(fd, ino)


def _same(fd: int, ino: int) -> bool:
    try:
        return os.fstat(fd).st_ino == ino
    except OSError:
        return False


_servers: dict[str, _Server] = {}
_added: list = []  # (device, _Conn) of RPC devices added in this process (not in ggml's registry)


def _server(endpoint: str) -> _Server:
    host, port = _split(endpoint)
    key = f"{host}:{port}"
    if key not in _servers:
        srv = _Server(endpoint)
        # One server under two names ("localhost:p", "127.0.0.1:p") would get two ggml connections,
        # and an rpc-server serves one at a time: the second load waited forever for its HELLO.
        _servers[key] = next((s for s in _servers.values() if s.addrs & srv.addrs), srv)
    return _servers[key]


class Link:
    """The RPC servers one C object (a model, a context) lives on, and ggml's connections to them.

    :class:`~pyllamacpp._handle.Handle` asks it before every use (:meth:`check`) and before
    freeing (:meth:`must_leak`). Made right after the object is created, when the connections its
    buffers hold are open.

    Args:
        servers: The servers' connections (as ggml knows them) the object lives on.
        what: What the object is (``"model x.gguf"``, ``"context"``), for messages.
    """

    def __init__(self, servers: Iterable[_Conn], what: str) -> None:
        self.servers = tuple(servers)
        self.what = what
        self.known = True  # False where the process's sockets cannot be listed: TCP checks instead
        self._conns: dict[int, tuple[int, _Conn]] = {}
        for srv in self.servers:
            found = srv.connections()
            if found is None:
                self.known = False
                continue
            for fd, ino in found:
                self._conns[fd] = (ino, srv)
        self._poll = select.poll()
        for fd in self._conns:
            self._poll.register(fd, _GONE)
        self._warned = False
        self._exiting, self._is_finalizing = _exiting, sys.is_finalizing  # module globals may be None at exit

    def child(self, what: str) -> Link:
        """A link for an object made over this one (a context over its model).

        Args:
            what: What the new object is, for messages.

        Returns:
            A new link on the same servers.
        """
        return Link(self.servers, what)

    def down(self) -> _Conn | None:
        """The first of the servers known to be gone, polling ggml's connections (no network).

        Returns:
            That server's connection (its ``down`` says why), or None when none is known gone.
        """
        for srv in self.servers:
            if srv.down is not None:
                return srv
        if not self._conns:
            return None
        try:
            events = self._poll.poll(0)
        except RuntimeError:  # poll() running in another thread: a poll object of our own
            p = select.poll()
            for fd in self._conns:
                p.register(fd, _GONE)
            events = p.poll(0)
        for fd, ev in events:
            # POLLNVAL: closed by ggml, so held by an object that is gone, not by this one
            if ev & _GONE and not ev & select.POLLNVAL:
                ino, srv = self._conns[fd]
                if _same(fd, ino):
                    srv.server.dead.add(ino)
                    srv.mark_down("its connection was closed by the server")
                    return srv
        return None

    def check(self) -> None:
        """Raise :class:`RPCError` when one of the servers is known to be gone.

        Raises:
            RPCError: A server is gone; the object on it can only be closed.
        """
        srv = self.down()
        if srv is not None:
            raise RPCError(
                f"RPC server {srv.endpoint} is gone ({srv.down}); the {self.what} on it can only "
                "be closed (its memory there went with the server)",
                func="ggml_backend_rpc",
            )

    def must_leak(self) -> bool:
        """Whether freeing the object must not call into ggml.

        True at interpreter exit, or when a server is gone (then a warning, once). Called by
        ``Handle.__del__``.

        Returns:
            True to leave the object unfreed.
        """
        if self._exiting[0] or self._is_finalizing():
            return True  # the servers free this connection's buffers when the process's sockets close
        srv = self.down()
        if srv is None and not self.known:  # no sockets to look at: ask each server for a connection
            for s in self.servers:
                try:
                    check_reachable(s.endpoint, timeout=1.0)
                except RPCError as e:
                    s.mark_down(str(e.__cause__ or e))
                    srv = s
                    break
        if srv is None:
            return False
        if not self._warned:
            self._warned = True
            log.warning(
                "RPC server %s is gone (%s): the %s on it is left unfreed, since freeing it through "
                "ggml-rpc would abort or hang this process; its memory here stays allocated, and on "
                "servers still up until this process exits",
                srv.endpoint,
                srv.down,
                self.what,
            )
        return True


def link(endpoints: str | Sequence[str] | None, what: str) -> Link | None:
    """A :class:`Link` for an object made on these RPC endpoints.

    Args:
        endpoints: One ``"host:port"`` or a list of them.
        what: What the object is, for messages.

    Returns:
        The link, or None without endpoints.

    Raises:
        ValueError: An endpoint is not ``host:port``.
    """
    if not endpoints:
        return None
    return Link([_server(ep).conn for ep in ([endpoints] if isinstance(endpoints, str) else endpoints)], what)


def _usable(srv: _Server, timeout: float) -> bool:
    """True when a call to the server will not abort at connect: a live connection, or a server
    that accepts one. A server busy with this process's connection answers only two more connects
    (``listen(fd, 1)``), so a live connection is not tested with another one."""
    if srv.connected():
        return True
    if srv.conn.down is not None:
        return False
    try:
        check_reachable(srv.endpoint, timeout)
    except RPCError:
        return False
    return True


def devices() -> list[dict]:
    """Every device this process can see (CPU, CUDA, RPC servers added so far), with memory.

    Reads ``ggml_backend_dev_get`` / ``ggml_backend_dev_memory`` for each device. An RPC server
    that is gone or unreachable keeps its row with ``memory_free`` and ``memory_total`` None (asking
    ggml would abort); devices of a connection that died (a server since restarted) are not listed.

    Returns:
        One dict per device: ``index``, ``name``, ``description``, ``type``, ``backend``,
        ``memory_free``, ``memory_total`` (bytes).
    """
    out = []
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    local = [(lib.ggml_backend_dev_get(i), None) for i in range(lib.ggml_backend_dev_count())]
    rpc = [(dev, conn) for dev, conn in _added if conn is conn.server.conn]
    ok = {id(c): c.down is None and _usable(c.server, 1.0) for c in {id(c): c for _, c in rpc}.values()}
    for i, (dev, srv) in enumerate(local + rpc):
        known = srv is None or ok[id(srv)]
        if known:
            lib.ggml_backend_dev_memory(dev, free, total)
        out.append(
            {
                "index": i,
                "name": _s(lib.ggml_backend_dev_name(dev)),
                "description": srv.endpoint if srv is not None else _s(lib.ggml_backend_dev_description(dev)),
                "type": _DEV_TYPES.get(lib.ggml_backend_dev_type(dev), str(lib.ggml_backend_dev_type(dev))),
                "backend": _s(lib.ggml_backend_reg_name(lib.ggml_backend_dev_backend_reg(dev))),
                "memory_free": int(free[0]) if known else None,
                "memory_total": int(total[0]) if known else None,
            }
        )
    return out


def check_reachable(endpoint: str, timeout: float = 3.0) -> None:
    """Raise RPCError unless ``endpoint`` accepts a TCP connection within ``timeout`` seconds.

    Checked before ``ggml_backend_rpc_add_server``, which would abort the process instead.

    Args:
        endpoint: ``"host:port"``.
        timeout: Seconds to wait for the connection.

    Raises:
        RPCError: The server is not reachable.
        ValueError: ``endpoint`` is not ``host:port``.
    """
    host, port = _split(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise RPCError(f"RPC server {endpoint} is not reachable: {e}", func="ggml_backend_rpc_add_server") from e


def add_servers(endpoints: Iterable[str], timeout: float = 3.0) -> list:
    """Add RPC servers: ``ggml_backend_rpc_add_server`` for each endpoint (checked first).

    The devices they bring are not put in ggml's global registry (a registered device would be
    used by every later model loaded with default devices). Adding the same endpoint twice returns
    its devices again; after its server went away (restarted on the same port), new devices on a
    new connection.

    Args:
        endpoints: ``"host:port"`` strings.
        timeout: Seconds to wait for each server's TCP connection.

    Returns:
        The device handles (``ggml_backend_dev_t``) they bring, for a model's ``devices`` list.

    Raises:
        RPCError: A server is not reachable (TCP connect within ``timeout``) or reports no devices;
            the build has no RPC backend.
        ValueError: An endpoint is not ``host:port``.
    """
    if "rpc" not in EXTENSION_INFO["backends"]:
        raise RPCError("this build has no RPC backend (build with -DGGML_RPC=ON)")
    devs: list[Any] = []  # ggml_backend_dev_t
    for ep in endpoints:
        srv = _server(ep)
        alive = srv.conn.down is None and srv.connected()
        if srv.conn.down is not None:
            srv.renew()  # the dead connection stays with the objects left on it
        if not alive:
            check_reachable(ep, timeout)
        reg = _rpc_add_server()(srv.conn.alias.encode())
        if reg == ffi.NULL:
            raise RPCError(f"RPC server {ep} reports no devices", func="ggml_backend_rpc_add_server")
        # Not registered globally: a registered device would be used by every later model loaded
        # with default devices, and talking to a server that is gone aborts the process.
        for i in range(lib.ggml_backend_reg_dev_count(reg)):
            dev = lib.ggml_backend_reg_dev_get(reg, i)
            if any(dev == d for d in devs):
                continue  # the same server named twice
            devs.append(dev)
            if not any(dev == d for d, _ in _added):
                _added.append((dev, srv.conn))
    return devs


def _rpc_add_server():  # linked, or a GGML_BACKEND_DL module's (release profile)
    return backend_function("RPC", "ggml_backend_rpc_add_server", "ggml_backend_reg_t (*)(const char *)")


def _rpc_start_server():
    return backend_function(
        "RPC",
        "ggml_backend_rpc_start_server",
        "void (*)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *)",
    )


def start_server(host: str = "127.0.0.1", port: int = 50052, *, threads: int = 2, cache_dir: str | None = None) -> None:
    """Serve this process's CPU device over RPC (``ggml_backend_rpc_start_server``).

    Blocks until the process ends.

    Args:
        host: The address to listen on.
        port: The port to listen on.
        threads: CPU threads the server computes with.
        cache_dir: A directory for the server's tensor cache; None: no cache.

    Raises:
        RPCError: No CPU device to serve.
        AttributeError: The build has no RPC backend (``ggml_backend_rpc_start_server`` not found).
    """
    cpu = [
        lib.ggml_backend_dev_get(i)
        for i in range(lib.ggml_backend_dev_count())
        if lib.ggml_backend_dev_type(lib.ggml_backend_dev_get(i)) == lib.GGML_BACKEND_DEVICE_TYPE_CPU
    ]
    if not cpu:
        raise RPCError("no CPU device to serve")
    arr = ffi.new("ggml_backend_dev_t[]", cpu[:1])
    endpoint = f"{host}:{port}".encode()
    cdir = cache_dir.encode() if cache_dir else ffi.NULL
    _rpc_start_server()(endpoint, cdir, threads, 1, arr)


# -- the way out for a server that dies during a call -------------------------------------------
def _child(conn, fn, args, kwargs) -> None:
    try:
        result = (True, fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 (sent back and re-raised in the parent)
        result = (False, e)
    try:
        conn.send(result)
    except Exception as e:  # noqa: BLE001 (an unpicklable result or exception)
        conn.send((False, RPCError(f"{fn.__qualname__}'s result could not be sent back: {e!r}")))
    conn.close()


def run_in_subprocess(fn: Callable[..., _T], /, *args: Any, timeout: float | None = None, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` in a fresh Python process (``multiprocessing``, spawn), and its result.

    For RPC work this process must survive: a server that dies during a call makes ggml-rpc abort
    the process that made it, which here is the child; this process gets :class:`RPCError`. The
    child loads its own models (nothing C-side crosses processes): ``fn`` must be a module-level
    function, and ``args``, the result and any exception must pickle.

    Args:
        fn: A module-level function.
        *args: Its positional arguments.
        timeout: Seconds to wait for the result; None: no limit.
        **kwargs: Its keyword arguments.

    Returns:
        What ``fn`` returned.

    Raises:
        RPCError: The child died without a result (an abort: ``exitcode`` is minus the signal) or
            ran past ``timeout`` seconds (then it is killed).
        Exception: Whatever ``fn`` raised in the child, re-raised here.
    """
    import multiprocessing

    mp = multiprocessing.get_context("spawn")  # fork would copy ggml's locks without its threads
    recv, send = mp.Pipe(duplex=False)
    proc = mp.Process(target=_child, args=(send, fn, args, kwargs), daemon=True)
    proc.start()
    send.close()
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        if not recv.poll(timeout):
            proc.kill()
            raise RPCError(f"{name} ran past {timeout} s in its child process (killed)")
        try:
            ok, value = recv.recv()
        except EOFError:
            proc.join()
            code = proc.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            err = RPCError(
                f"{name}'s child process died ({how}) without a result; an RPC server going away "
                "during a call aborts the process that made it (ggml-rpc's GGML_ABORT)"
            )
            err.exitcode = code  # type: ignore[attr-defined]
            raise err from None
    finally:
        recv.close()
        proc.join(10)
    if not ok:
        raise value
    return value
