"""The Redis backend: chunks on a Redis server that several machines share, checked on every read."""

from __future__ import annotations

import errno
import hashlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ._directory import ChunkCorrupt, StoreError

# The layout of a store's keys on the server; a store of another version is refused, not misread.
FORMAT = 1
SCHEMES = ("redis://", "rediss://")
_BATCH = 512  # keys per pipeline when walking the whole store


def is_redis_url(where: object) -> bool:
    """True for a ``redis://`` or ``rediss://`` URL (a string; a path never is one)."""
    return isinstance(where, str) and where.startswith(SCHEMES)


def redact(url: str) -> str:
    """``url`` with its password hidden, as messages show it."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = (parts.username or "") + ":***"
    return urlunsplit(parts._replace(netloc=f"{user}@{netloc[-1]}"))


@dataclass(frozen=True)
class RedisChunk:
    """One stored chunk as the server holds it (the fields of :class:`ChunkFile` that a server has).

    Attributes:
        key: The chunk's key (hex).
        checksum: The sha256 of its bytes (hex), stored beside them.
        name: The Redis key of the hash that holds it.
        nbytes: Its size.
        last_used: When it was last written or read (its score in the store's sorted set, seconds
            since the epoch by the clock of the client that used it).
    """

    key: str
    checksum: str
    name: str
    nbytes: int
    last_used: float


class RedisBackend:
    """Chunks on a Redis server: the same verbs as :class:`DirectoryBackend`, shared by every
    machine that reaches the server.

    Under ``namespace``: ``<ns>:manifest`` (JSON, the layout's format), one hash per chunk,
    ``<ns>:chunk:<key>`` with fields ``data`` (the sequence-state dump) and ``sha256``, and the
    sorted set ``<ns>:lru`` of chunk keys scored by their last use. A write is one ``MULTI``/``EXEC``
    (the hash and its score together): a reader sees the whole chunk or none, whatever happens to
    the writer. Reading checks the bytes against their sha256; a mismatch removes the chunk.

    Least recently used eviction goes by the sorted set, not by the server's ``maxmemory-policy``:
    that policy is the whole server's (other data on it would go too), needs ``CONFIG SET``, would
    evict the manifest and the index as readily as a chunk, and knows no per-store cap. Run a
    shared server with ``maxmemory-policy noeviction``: a full server then refuses writes (an
    ``OOM`` error, which this backend reports as ``ENOSPC``, so the store warns once and stops
    storing, as on a full disk).

    Every server error, a server gone or too slow included, is raised as an :class:`OSError`
    (``ConnectionError`` and ``TimeoutError`` for those two) naming the URL; the short socket
    timeouts and a single retry (for a connection the server closed meanwhile) keep a call from
    hanging. Options in the URL's query (``?socket_timeout=30``) override the keywords.

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]`` (or ``rediss://`` for TLS).
        namespace: The prefix of the store's keys (several stores may share one database).
        socket_timeout: Seconds to wait for a reply.
        connect_timeout: Seconds to wait for a connection.
        create: Write the manifest when the server has none (False: refuse, as a command that
            inspects a store does).

    Raises:
        ImportError: The ``redis`` package is missing (``pip install "redis>=5"``).
        StoreError: The server cannot be reached (the message names the URL), the URL is not
            valid, or the store under ``namespace`` is of another format (or missing with
            ``create=False``).
    """

    format = FORMAT

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "pyllamacpp-prefix-store",
        socket_timeout: float = 5.0,
        connect_timeout: float = 2.0,
        create: bool = True,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:
            raise ImportError(f'a prefix store on Redis needs the redis package: pip install "redis>=5" ({e})') from e
        self._redis = redis
        self.url = url
        self.root = redact(url)  # where the store is, as the store's messages name it
        self.namespace = namespace
        self._manifest = f"{namespace}:manifest"
        self._lru = f"{namespace}:lru"
        try:
            # typed Any: replies are bytes here (decode_responses off), which redis-py's stubs cannot say
            self.client: Any = redis.Redis.from_url(
                url,
                socket_timeout=socket_timeout,
                socket_connect_timeout=connect_timeout,
                retry=Retry(NoBackoff(), 1),
            )
        except ValueError as e:
            raise StoreError(f"{self.root} is not a Redis URL this client reads ({e})") from e
        try:
            with self._errors():
                self.client.ping()
                raw = self.client.get(self._manifest)
                if raw is None and create:
                    self.client.set(self._manifest, json.dumps({"format": FORMAT}), nx=True)
                    raw = self.client.get(self._manifest)
        except OSError as e:
            raise StoreError(f"cannot reach the Redis server at {self.root}: {e.__cause__ or e}") from e
        if raw is None:
            raise StoreError(f"{self.root} holds no prefix store under {namespace!r} (no {self._manifest} key)")
        try:
            got = json.loads(raw)
        except ValueError as e:
            raise StoreError(f"{self.root}: {self._manifest} is not a prefix store manifest ({e})") from e
        if not isinstance(got, dict) or got.get("format") != FORMAT:
            fmt = got.get("format") if isinstance(got, dict) else None
            raise StoreError(
                f"{self.root} holds a prefix store of format {fmt!r} under {namespace!r}; this pyllamacpp reads "
                f"format {FORMAT} (use another namespace or database, or delete its keys)"
            )

    def __repr__(self) -> str:
        return f"<RedisBackend {self.root} namespace={self.namespace!r}>"

    def close(self) -> None:
        """Close the client's connections (idempotent)."""
        self.client.close()

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Every Redis error as an OSError naming the server (the store catches OSError)."""
        exc = self._redis.exceptions
        try:
            yield
        except exc.ConnectionError as e:
            raise ConnectionError(errno.ECONNREFUSED, f"Redis at {self.root} is unreachable ({e})") from e
        except exc.TimeoutError as e:
            raise TimeoutError(errno.ETIMEDOUT, f"Redis at {self.root} did not answer in time ({e})") from e
        except exc.ResponseError as e:
            if str(e).startswith("OOM"):  # maxmemory reached under noeviction: the server's disk full
                raise OSError(errno.ENOSPC, f"Redis at {self.root} is out of memory ({e})") from e
            raise OSError(errno.EIO, f"Redis at {self.root}: {e}") from e
        except exc.RedisError as e:
            raise OSError(errno.EIO, f"Redis at {self.root}: {e}") from e

    def _name(self, key: str) -> str:
        return f"{self.namespace}:chunk:{key}"

    def find(self, key: str) -> RedisChunk | None:
        """The chunk stored under ``key``, or None.

        Args:
            key: The chunk's key (hex).

        Raises:
            OSError: The server failed (``ConnectionError``, ``TimeoutError`` when gone or slow).
        """
        name = self._name(key)
        with self._errors():
            p = self.client.pipeline(transaction=False)
            p.hget(name, "sha256")
            p.hstrlen(name, "data")
            p.zscore(self._lru, key)
            checksum, nbytes, score = p.execute()
        if checksum is None:
            return None
        return RedisChunk(key, checksum.decode(), name, int(nbytes), float(score or 0.0))

    def get(self, key: str, *, touch: bool = True) -> bytes | None:
        """The chunk's bytes, checked; None when absent.

        Args:
            key: The chunk's key.
            touch: Count the read as a use (least recently used eviction); False for a check that
                should leave the order alone.

        Returns:
            The bytes, or None.

        Raises:
            ChunkCorrupt: The bytes do not match their sha256 (the chunk is removed first).
            OSError: The server failed.
        """
        name = self._name(key)
        with self._errors():
            data, checksum = self.client.hmget(name, ["data", "sha256"])
            if data is None or checksum is None:
                return None
            if hashlib.sha256(data).hexdigest() != checksum.decode():
                self._delete([key])
                raise ChunkCorrupt(f"chunk {key[:16]}...: its bytes do not match their sha256 (removed)")
            if touch:
                self.client.zadd(self._lru, {key: time.time()})
        return bytes(data)

    def put(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key`` (the hash and its score in one transaction); returns the
        bytes written (0 when present).

        Args:
            key: The chunk's key (hex).
            data: The chunk's bytes.

        Raises:
            OSError: The write failed (``ENOSPC`` when the server is out of memory); nothing
                partial is left.
        """
        name = self._name(key)
        with self._errors():
            if self.client.exists(name):
                return 0
            p = self.client.pipeline(transaction=True)
            p.hset(name, mapping={"data": data, "sha256": hashlib.sha256(data).hexdigest()})
            p.zadd(self._lru, {key: time.time()})
            p.execute()
        return len(data)

    def remove(self, key: str) -> bool:
        """Remove the chunk under ``key``; False when there was none.

        Args:
            key: The chunk's key (hex).

        Raises:
            OSError: The server failed.
        """
        with self._errors():
            return self._delete([key]) > 0

    def _delete(self, keys: list[str]) -> int:
        p = self.client.pipeline(transaction=True)
        p.delete(*[self._name(k) for k in keys])
        p.zrem(self._lru, *keys)
        return int(p.execute()[0])

    def _walk(self) -> list[RedisChunk]:
        """Every chunk, least recently used first; index entries whose hash is gone are dropped."""
        with self._errors():
            scored = self.client.zrange(self._lru, 0, -1, withscores=True)
            out: list[RedisChunk] = []
            stale: list[str] = []
            for i in range(0, len(scored), _BATCH):
                part = scored[i : i + _BATCH]
                p = self.client.pipeline(transaction=False)
                for member, _ in part:
                    name = self._name(member.decode())
                    p.hget(name, "sha256")
                    p.hstrlen(name, "data")
                got = p.execute()
                for j, (member, score) in enumerate(part):
                    key = member.decode()
                    checksum, nbytes = got[2 * j], got[2 * j + 1]
                    if checksum is None:  # removed meanwhile, or evicted by the server itself
                        stale.append(key)
                        continue
                    out.append(RedisChunk(key, checksum.decode(), self._name(key), int(nbytes), float(score)))
            if stale:
                self.client.zrem(self._lru, *stale)
        return out

    def chunks(self) -> Iterator[RedisChunk]:
        """Every stored chunk, least recently used first.

        Raises:
            OSError: The server failed.
        """
        yield from self._walk()

    def evict(self, max_bytes: int) -> tuple[int, int]:
        """Remove the least recently used chunks until at most ``max_bytes`` remain.

        Args:
            max_bytes: The bytes to keep at most.

        Returns:
            ``(chunks removed, bytes removed)``.

        Raises:
            OSError: The server failed.
        """
        files = self._walk()
        total = sum(f.nbytes for f in files)
        drop: list[str] = []
        freed = 0
        for f in files:
            if total - freed <= max_bytes:
                break
            drop.append(f.key)
            freed += f.nbytes
        n = 0
        with self._errors():
            for i in range(0, len(drop), _BATCH):
                n += self._delete(drop[i : i + _BATCH])
        return n, freed
