"""The local directory backend: one file per chunk, written atomically, checked on every read."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The layout of a store directory; a directory of another version is refused, not misread.
FORMAT = 1
_MANIFEST = "pyllamacpp-prefix-store.json"
_SUFFIX = ".kv"


class StoreError(Exception):
    """A store that cannot be used: a path that is not a store directory, or another format."""


class ChunkCorrupt(Exception):
    """A chunk whose bytes do not match the checksum in its name (it is removed)."""


@dataclass(frozen=True)
class ChunkFile:
    """One stored chunk as the directory holds it.

    Attributes:
        key: The chunk's key (hex).
        checksum: The sha256 of its bytes (hex), part of its file name.
        path: The file.
        nbytes: Its size.
        last_used: When it was last written or read (the file's mtime, seconds).
    """

    key: str
    checksum: str
    path: Path
    nbytes: int
    last_used: float


class DirectoryBackend:
    """Chunks as files ``<root>/<key[:2]>/<key>-<sha256 of the bytes>.kv``.

    Each file is a sequence-state dump as ``llama_state_seq_get_data_ext`` writes it (``pyllamacpp
    parse-state`` reads it). A write goes to a temporary file in the same folder, then
    ``os.replace``: a reader sees the whole chunk or none, and a process killed while writing leaves
    only a temporary file that no lookup matches. Two processes writing the same chunk write the same
    bytes to the same name; the last rename wins. Reading checks the bytes against the checksum in
    the name; a read refreshes the file's mtime, which the least-recently-used eviction orders by.

    Args:
        root: The store's directory (made when missing, with its manifest).

    Raises:
        StoreError: ``root`` is a file, or a directory that is neither empty nor a store of this
            format.
    """

    format = FORMAT

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(f"{self.root} is a file, not a store directory")
        manifest = self.root / _MANIFEST
        if manifest.exists():
            try:
                got = json.loads(manifest.read_text())
            except (OSError, ValueError) as e:
                raise StoreError(f"{manifest}: not a prefix store manifest ({e})") from e
            if got.get("format") != FORMAT:
                raise StoreError(
                    f"{self.root} is a prefix store of format {got.get('format')!r}; this pyllamacpp reads "
                    f"format {FORMAT} (use another directory, or empty this one)"
                )
        else:
            if self.root.exists() and any(self.root.iterdir()):
                raise StoreError(f"{self.root} is a directory with other files in it, not a prefix store")
            self.root.mkdir(parents=True, exist_ok=True)
            _atomic_write(manifest, json.dumps({"format": FORMAT}).encode())

    def _dir(self, key: str) -> Path:
        return self.root / key[:2]

    def find(self, key: str) -> ChunkFile | None:
        """The chunk stored under ``key``, or None.

        Args:
            key: The chunk's key (hex).

        Returns:
            Its record, or None.
        """
        d = self._dir(key)
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return None
        prefix = key + "-"
        for name in names:
            if name.startswith(prefix) and name.endswith(_SUFFIX):
                path = d / name
                try:
                    st = path.stat()
                except FileNotFoundError:  # evicted by another process meanwhile
                    continue
                return ChunkFile(key, name[len(prefix) : -len(_SUFFIX)], path, st.st_size, st.st_mtime)
        return None

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The chunk's bytes, checked; None when absent (``touch=False``: the read is not counted
        as a use, as for a check that should leave the eviction order alone).

        Args:
            key: The chunk's key (hex).
            touch: Count the read as a use (refresh the file's mtime).

        Raises:
            ChunkCorrupt: The bytes do not match their checksum (the file is removed first).
        """
        f = self.find(key)
        if f is None:
            return None
        try:
            data = f.path.read_bytes()
        except FileNotFoundError:
            return None
        if hashlib.sha256(data).hexdigest() != f.checksum:
            _unlink(f.path)
            raise ChunkCorrupt(f"chunk {key[:16]}...: its bytes do not match their sha256 (removed)")
        if not touch:
            return data
        try:
            os.utime(f.path)  # least recently used: a read counts as a use
        except OSError:
            pass
        return data

    def put(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key`` (atomically); returns the bytes written (0 when present).

        Args:
            key: The chunk's key (hex).
            data: The chunk's bytes.

        Raises:
            OSError: The write failed (the disk full: ``errno.ENOSPC``); nothing partial is left.
        """
        if self.find(key) is not None:
            return 0
        d = self._dir(key)
        d.mkdir(exist_ok=True)
        _atomic_write(d / f"{key}-{hashlib.sha256(data).hexdigest()}{_SUFFIX}", data)
        return len(data)

    def remove(self, key: str) -> bool:
        """Remove the chunk under ``key``; False when there was none.

        Args:
            key: The chunk's key (hex).
        """
        f = self.find(key)
        return f is not None and _unlink(f.path)

    def chunks(self) -> Iterator[ChunkFile]:
        """Every stored chunk (in no order)."""
        for d in sorted(p for p in self.root.iterdir() if p.is_dir() and len(p.name) == 2):
            for name in os.listdir(d):
                if not name.endswith(_SUFFIX) or "-" not in name:
                    continue
                key, checksum = name[: -len(_SUFFIX)].split("-", 1)
                try:
                    st = (d / name).stat()
                except FileNotFoundError:
                    continue
                yield ChunkFile(key, checksum, d / name, st.st_size, st.st_mtime)

    def evict(self, max_bytes: int) -> tuple[int, int]:
        """Remove the least recently used chunks until at most ``max_bytes`` remain.

        Args:
            max_bytes: The bytes to keep at most.

        Returns:
            ``(chunks removed, bytes removed)``.
        """
        files = sorted(self.chunks(), key=lambda f: f.last_used)
        total = sum(f.nbytes for f in files)
        n = freed = 0
        for f in files:
            if total - freed <= max_bytes:
                break
            if _unlink(f.path):
                n += 1
            freed += f.nbytes
        return n, freed


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        _unlink(Path(tmp))
        raise


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def is_disk_full(e: OSError) -> bool:
    """True for the errors that mean no room is left (ENOSPC, EDQUOT)."""
    return e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
