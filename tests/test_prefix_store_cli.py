"""``pyllamacpp prefix-store``: info, ls, verify and evict on a real store made by PrefixStore.save."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from redis_helpers import RedisServer, free_port, redis_server_binary

from pyllamacpp.cli import build_parser, main
from pyllamacpp.cli._prefix_store import byte_count
from pyllamacpp.prefix_store import DirectoryBackend, PrefixStore

TEXT = (
    "The cat sat on the mat and looked at the dog, who was not amused at all by it, "
    "and then the two of them went out into the garden to see the birds."
)
T0 = 1_700_000_000  # chunk k was last used at T0 + 60 k


def _when(t):
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@pytest.fixture(scope="module")
def made(tmp_path_factory, model):
    """A store made by PrefixStore.save, its chunks' last uses set one minute apart in key order."""
    root = tmp_path_factory.mktemp("cli") / "store"
    store = PrefixStore(root, chunk_size=8)
    toks = model.tokenize(TEXT)
    with model.context(n_ctx=256, n_threads=1, flash_attn=False) as ctx:
        ctx.prefill(toks)
        assert store.save(ctx, 0, toks) == toks.size // 8
        keys = store.keys(ctx, toks)
    for k, key in enumerate(keys):
        f = store.backend.find(key)
        os.utime(f.path, (T0 + 60 * k, T0 + 60 * k))
    return root, keys


@pytest.fixture
def store(made, tmp_path):
    """A copy of the made store, for a test to change (mtimes copied too)."""
    root, keys = made
    dst = tmp_path / "store"
    shutil.copytree(root, dst)
    return dst, keys


def _run(capsys, *args):
    rc = main(["prefix-store", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def _files(root):
    return {f.key: f for f in DirectoryBackend(root).chunks()}


def test_info_says_chunks_bytes_uses_and_format(store, capsys):
    root, keys = store
    rc, out, err = _run(capsys, "info", root)
    assert rc == 0 and err == ""
    lines = {line[:10].strip(): line[11:] for line in out.splitlines()}  # a label, then its value
    total = sum(f.nbytes for f in _files(root).values())
    assert lines["store"] == str(root)
    assert lines["backend"] == "directory, format 1"
    assert lines["chunks"] == str(len(keys))
    assert lines["bytes"].startswith(f"{total:,} bytes (")
    assert lines["oldest use"] == _when(T0) and lines["newest use"] == _when(T0 + 60 * (len(keys) - 1))
    assert len(lines) == 6


def test_ls_lists_each_chunk_least_recently_used_first(store, capsys):
    root, keys = store
    files = _files(root)
    rc, out, _ = _run(capsys, "ls", root)
    assert rc == 0
    want = [f"{key[:16]}  {files[key].nbytes:>12,}  {_when(T0 + 60 * k)}" for k, key in enumerate(keys)]
    assert out.splitlines() == want
    rc, out, _ = _run(capsys, "ls", "--key-chars", 8, root)
    assert [line.split()[0] for line in out.splitlines()] == [key[:8] for key in keys]


def test_verify_checks_every_chunk_and_removes_a_bad_one(store, capsys):
    root, keys = store
    before = {k: f.last_used for k, f in _files(root).items()}
    rc, out, _ = _run(capsys, "verify", root)
    assert rc == 0 and out.splitlines() == [f"{len(keys)} chunk(s) checked, 0 bad"]
    assert {k: f.last_used for k, f in _files(root).items()} == before  # a check is not a use
    f = _files(root)[keys[2]]
    raw = bytearray(f.path.read_bytes())
    raw[100] ^= 1
    f.path.write_bytes(bytes(raw))
    rc, out, _ = _run(capsys, "verify", root)
    assert rc == 1
    assert out.splitlines() == [
        f"bad  {keys[2][:16]}  {f.nbytes:>12,}  (removed)",
        f"{len(keys)} chunk(s) checked, 1 bad (removed)",
    ]
    assert set(_files(root)) == set(keys) - {keys[2]}
    assert _run(capsys, "verify", root)[0] == 0


def test_evict_keeps_the_most_recently_used_within_max_bytes(store, capsys):
    root, keys = store
    files = _files(root)
    keep = files[keys[-1]].nbytes + files[keys[-2]].nbytes
    rc, out, _ = _run(capsys, "evict", root, "--max-bytes", keep)
    assert rc == 0
    freed = sum(f.nbytes for f in files.values()) - keep
    assert out.startswith(f"evicted {len(keys) - 2} chunk(s), {freed:,} bytes") and f"{keep:,} bytes" in out
    assert set(_files(root)) == set(keys[-2:])
    assert _run(capsys, "evict", root, "--max-bytes", "1M")[1].startswith("evicted 0 chunk(s), 0 bytes;")
    assert byte_count("500M") == 500 * 2**20 and byte_count("2GiB") == 2 * 2**30 and byte_count("7") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        byte_count("-1")
    with pytest.raises(SystemExit) as e:  # argparse: bad input, exit 2
        main(["prefix-store", "evict", str(root), "--max-bytes", "lots"])
    assert e.value.code == 2 and "not a size" in capsys.readouterr().err


def test_a_store_that_is_not_there_is_an_error_and_is_not_made(tmp_path, capsys):
    missing = tmp_path / "typo"
    rc, out, err = _run(capsys, "info", missing)
    assert rc == 2 and out == "" and err == f"pyllamacpp prefix-store info: error: {missing}: no such directory\n"
    assert not missing.exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    rc, _, err = _run(capsys, "verify", other)
    assert rc == 2 and "not a prefix store" in err and sorted(os.listdir(other)) == ["notes.txt"]
    url = f"redis://127.0.0.1:{free_port()}/0"
    rc, _, err = _run(capsys, "ls", url)
    assert rc == 2 and f"cannot reach the Redis server at {url}" in err


@pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server binary (see tests/redis_helpers.py)")
def test_the_subcommands_on_a_redis_store(made, model, tmp_path, capsys):
    pytest.importorskip("redis")
    _, keys = made
    srv = RedisServer(tmp_path)
    try:
        store = PrefixStore(srv.url, chunk_size=8)
        toks = model.tokenize(TEXT)
        with model.context(n_ctx=256, n_threads=1, flash_attn=False) as ctx:
            ctx.prefill(toks)
            store.save(ctx, 0, toks)
        rc, out, _ = _run(capsys, "info", srv.url)
        assert rc == 0 and f"store      {srv.url}" in out and "backend    redis, format 1" in out
        assert f"chunks     {len(keys)}" in out
        rc, out, _ = _run(capsys, "ls", srv.url)
        assert rc == 0 and sorted(line.split()[0] for line in out.splitlines()) == sorted(k[:16] for k in keys)
        assert _run(capsys, "verify", srv.url)[:2] == (0, f"{len(keys)} chunk(s) checked, 0 bad\n")
        rc, out, _ = _run(capsys, "evict", srv.url, "--max-bytes", 0)
        assert rc == 0 and out.startswith(f"evicted {len(keys)} chunk(s)") and list(store.backend.chunks()) == []
    finally:
        srv.stop()


def test_help_shows_defaults_and_the_command_runs(store):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices["prefix-store"]
    actions = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert list(actions.choices) == ["info", "ls", "verify", "evict"]
    for name, a in actions.choices.items():
        text = a.format_help()
        assert "``" not in text and "DIR_OR_URL" in text, name
        for act in a._actions:
            if act.option_strings and act.nargs != 0 and act.default not in (None, [], argparse.SUPPRESS):
                assert "default" in (act.help or ""), (name, act.option_strings)
    assert "(default: 16)" in " ".join(actions.choices["ls"].format_help().split())
    root, keys = store
    proc = subprocess.run(  # the installed command, as a user runs it
        [sys.executable, "-m", "pyllamacpp", "prefix-store", "info", str(root)],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
        timeout=120,
    )
    assert proc.returncode == 0 and f"chunks     {len(keys)}" in proc.stdout, proc.stderr
