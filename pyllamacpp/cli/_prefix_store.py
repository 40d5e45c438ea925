"""``pyllamacpp prefix-store``: look into a prefix store and keep it, on a directory or a Redis server.

    pyllamacpp prefix-store info   DIR_OR_URL               chunks, bytes, oldest and newest use, format
    pyllamacpp prefix-store ls     DIR_OR_URL               one line per chunk: key, bytes, last use
    pyllamacpp prefix-store verify DIR_OR_URL               every chunk's sha256; bad ones removed (exit 1)
    pyllamacpp prefix-store evict  DIR_OR_URL --max-bytes N the least recently used chunks, down to N bytes

DIR_OR_URL is a store directory (as ``PrefixStore(DIR)`` makes) or ``redis://host:port/db``. A
store is never made here: a path without a store is an error. ``ls`` and ``verify`` go least
recently used first, the order ``evict`` removes in; ``verify`` leaves the order as it was.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import time
from typing import Any

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.I)


def byte_count(text: str) -> int:
    """``--max-bytes``: a count of bytes, with an optional binary suffix (``500M``, ``2GiB``, ``0``).

    Args:
        text: The argument.

    Returns:
        The bytes.

    Raises:
        argparse.ArgumentTypeError: Not a size.
    """
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (like 1000000, 500M or 2G)")
    return int(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " ")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``prefix-store`` command and its four subcommands to ``sub`` (the ``pyllamacpp``
    parser's subparsers); nothing of the store is imported until one runs.

    Args:
        sub: The ``add_subparsers()`` object of the ``pyllamacpp`` parser.

    Returns:
        The command's parser.
    """
    p = sub.add_parser(
        "prefix-store",
        help="inspect and manage a prefix store: info, ls, verify, evict",
        description=__doc__,
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    where = "a store directory, or redis://host:port/db"

    a = actions.add_parser("info", help="chunks, bytes, oldest and newest use, format", description=_doc(_info))
    a.add_argument("store", metavar="DIR_OR_URL", help=where)
    a.set_defaults(func=_info)

    a = actions.add_parser("ls", help="one line per chunk: key, bytes, last use", description=_doc(_ls))
    a.add_argument("store", metavar="DIR_OR_URL", help=where)
    a.add_argument("--key-chars", type=int, default=16, metavar="N", help="hex digits of each key to show")
    a.set_defaults(func=_ls)

    a = actions.add_parser(
        "verify", help="check every chunk's sha256; remove and list bad ones (exit 1)", description=_doc(_verify)
    )
    a.add_argument("store", metavar="DIR_OR_URL", help=where)
    a.add_argument("--key-chars", type=int, default=16, metavar="N", help="hex digits of each key to show")
    a.set_defaults(func=_verify)

    a = actions.add_parser(
        "evict", help="remove the least recently used chunks down to --max-bytes", description=_doc(_evict)
    )
    a.add_argument("store", metavar="DIR_OR_URL", help=where)
    a.add_argument(
        "--max-bytes",
        type=byte_count,
        required=True,
        metavar="N",
        help="bytes to keep at most (a suffix K, M, G or T counts in 1024s: 500M)",
    )
    a.set_defaults(func=_evict)
    return p


def _doc(func: Any) -> str:
    return inspect.cleandoc(func.__doc__ or "")


def _open(args) -> Any:
    from ..prefix_store import open_backend

    return open_backend(args.store, create=False)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def _run(func):
    """Run a subcommand; a store that cannot be opened is bad input (exit 2), said in one line."""

    def run(args) -> int:
        from ..prefix_store import StoreError

        try:
            return func(args)
        except StoreError as e:
            print(f"pyllamacpp prefix-store {args.action}: error: {e}", file=sys.stderr)
            return 2

    run.__doc__ = func.__doc__
    return run


@_run
def _info(args) -> int:
    """What a store holds: its chunks, their bytes, the oldest and newest use, the format."""
    from ..prefix_store import RedisBackend

    b = _open(args)
    files = list(b.chunks())
    kind = "redis" if isinstance(b, RedisBackend) else "directory"
    print(f"store      {b.root}")
    print(f"backend    {kind}, format {b.format}")
    print(f"chunks     {len(files):,}")
    print(f"bytes      {_size(sum(f.nbytes for f in files))}")
    if files:
        print(f"oldest use {_when(min(f.last_used for f in files))}")
        print(f"newest use {_when(max(f.last_used for f in files))}")
    return 0


@_run
def _ls(args) -> int:
    """One line per chunk, least recently used first: its key's first hex digits, its bytes, its
    last use."""
    for f in sorted(_open(args).chunks(), key=lambda f: (f.last_used, f.key)):
        print(f"{f.key[: args.key_chars]}  {f.nbytes:>12,}  {_when(f.last_used)}")
    return 0


@_run
def _verify(args) -> int:
    """Read every chunk and check its bytes against its sha256; a bad chunk is removed and listed
    (exit 1 when any was bad). Reading for the check does not count as a use."""
    from ..prefix_store import ChunkCorrupt

    b = _open(args)
    n = bad = 0
    for f in sorted(b.chunks(), key=lambda f: (f.last_used, f.key)):
        try:
            if b.get(f.key, touch=False) is None:
                continue  # removed by another process meanwhile
        except ChunkCorrupt:
            bad += 1
            print(f"bad  {f.key[: args.key_chars]}  {f.nbytes:>12,}  (removed)")
        n += 1
    print(f"{n:,} chunk(s) checked, {bad:,} bad" + (" (removed)" if bad else ""))
    return 1 if bad else 0


@_run
def _evict(args) -> int:
    """Remove the least recently used chunks until the store holds at most ``--max-bytes``."""
    b = _open(args)
    n, freed = b.evict(args.max_bytes)
    left = sum(f.nbytes for f in b.chunks())
    print(f"evicted {n:,} chunk(s), {_size(freed)}; {_size(left)} left")
    return 0
