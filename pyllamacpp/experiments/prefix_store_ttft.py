"""``pyllamacpp prefix-store-ttft``: what a prefix store buys, time to first token against the stored prefix.

For each length N of -n, a prompt of N + --suffix tokens whose first N tokens are stored in a
prefix store (chunks of --chunk-size) is answered twice from an empty sequence of a fresh memory:

- restored: ``PrefixStore.restore`` (each chunk read, its sha256 checked, the chunks joined into one
  dump and loaded with ``llama_state_seq_set_data_ext``), then the --suffix tokens decoded;
- decoded: the whole prompt decoded (``llama_decode``), then its N tokens' chunks stored again
  (``PrefixStore.save``, after removing them), which is the cost of storing on a miss. A
  sliding-window model (Gemma 3) decodes N tokens, stores them with the window at N, then decodes
  the suffix, as ``PrefixStore.prefill`` does; the save's time is kept out of the decode's.

The time to first token ends when the last token's logits are out and their argmax is taken. The
two sides alternate (the first of each pair changes every run) and each figure is the median of
-r runs. Restore MB/s is the chunks' bytes over the restore alone; store % is the save's time over
the decode it follows. The chunks are read from the OS page cache (they were just written), as
in a store used all day; a first read from disk adds the disk's time. Each row also compares the
first token's logits with the whole prompt's decode: bit-identical with flash attention off; with
it on they differ where the suffix's rows are computed in a ubatch of their own rather than inside
the prompt's (ggml's tiled kernel from 64 rows on): decoding N tokens, then the suffix, differs
from the whole prompt the same way, and a restore gives that two-step decode bit for bit. The
greedy token must be the same. --store keeps the store in a directory (default: a temporary one,
removed after). Exit status 1 when a greedy token differs, or a -fa off row is not bit-identical.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .common import Command, add_cache_and_thread_flags, add_flash_attn_flag, add_model_path_flag

if TYPE_CHECKING:
    from ..model import Model


def _lengths(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one length, each at least 1")
    return out


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_path_flag(p)
    p.add_argument(
        "-n",
        "--n-stored",
        type=_lengths,
        default=[256, 512, 1024, 2048],
        metavar="N,N,...",
        help="stored prefix lengths, each a multiple of --chunk-size (default 256,512,1024,2048)",
    )
    p.add_argument("--suffix", type=int, default=16, help="tokens after the stored prefix (default %(default)s)")
    p.add_argument("--chunk-size", type=int, default=256, help="the store's chunk size (default %(default)s)")
    p.add_argument("-r", "--repeat", type=int, default=5, help="runs of each side; medians (default %(default)s)")
    p.add_argument("--store", help="a store directory to use and keep (default: a temporary one)")
    add_flash_attn_flag(p)
    add_cache_and_thread_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-o", "--output", help="write a plot (PNG): time to first token against N, both sides")


def _check(args: argparse.Namespace) -> None:
    c = args.chunk_size
    if c < 1:
        raise ValueError(f"--chunk-size must be at least 1, not {c}")
    bad = [n for n in args.n_stored if n % c]
    if bad:
        raise ValueError(f"-n {bad[0]} is not a multiple of --chunk-size {c}: only whole chunks are stored")
    if args.suffix < 1:
        raise ValueError(f"--suffix must be at least 1 (the first token's logits come from it), not {args.suffix}")
    if args.repeat < 1:
        raise ValueError(f"-r must be at least 1, not {args.repeat}")


def run_one(ctx: Any, store: Any, toks: np.ndarray, n_stored: int, repeat: int) -> dict:
    """Both sides for one prompt ``toks`` whose first ``n_stored`` tokens the store is to hold.

    Args:
        ctx: The :class:`~pyllamacpp.Context` (sequence 0 of an empty memory is used).
        store: The :class:`~pyllamacpp.prefix_store.PrefixStore`.
        toks: The prompt's token ids (more than ``n_stored``).
        n_stored: The stored prefix's length (whole chunks).
        repeat: Runs of each side.

    Returns:
        The row: medians in ms of ``ttft_restored_ms``, ``ttft_decoded_ms``, ``restore_ms``,
        ``store_ms``, ``store_share`` (of the decode), with ``speedup``, ``restore_mb_s``,
        ``bytes``, ``chunks``, ``chunks_stored`` (the fewest a timed save wrote), ``max_abs_diff``,
        ``bit_identical``, ``greedy_same``.

    Raises:
        DecodeError: A decode failed.
        RuntimeError: The store gave fewer tokens than stored (a chunk failed to load).
    """
    from ..prefix_store import window_key

    mem = ctx.memory
    head = toks[:n_stored]
    keys = store.keys(ctx, head)

    written: list[int] = []  # chunks each timed save wrote (all of them: they were removed first)
    # a sliding-window model keeps the window of N's chunk only while the sequence ends at N: the
    # decoded side stops there to store it (PrefixStore.prefill's way), then decodes the suffix
    swa = bool(ctx.model.n_swa)

    def decoded() -> tuple[float, float, float, np.ndarray]:
        mem.clear()
        for key in keys:
            store.backend.remove(key)
            store.backend.remove(window_key(key))
        t0 = time.perf_counter()
        ctx.prefill(head if swa else toks)
        t_save = 0.0
        if swa:
            t1 = time.perf_counter()
            written.append(store.save(ctx, 0, head))
            t_save = time.perf_counter() - t1
            ctx.prefill(toks[n_stored:], 0, n_stored)
        logits = ctx.logits(-1)
        int(np.argmax(logits))
        t1 = time.perf_counter()
        if not swa:
            written.append(store.save(ctx, 0, head))
            t_save = time.perf_counter() - t1
        return t1 - t0 - t_save, t_save, 0.0, np.array(logits)

    def restored() -> tuple[float, float, float, np.ndarray]:
        mem.clear()
        t0 = time.perf_counter()
        n = store.restore(ctx, 0, toks)
        t1 = time.perf_counter()
        ctx.prefill(toks[n:], 0, n)
        logits = ctx.logits(-1)
        int(np.argmax(logits))
        t2 = time.perf_counter()
        if n != n_stored:
            raise RuntimeError(f"the store restored {n} of the {n_stored} tokens it was given")
        return t2 - t0, 0.0, t1 - t0, np.array(logits)

    decoded()  # stores the chunks, and warms the caches of both sides once
    restored()
    written.clear()
    got: dict[str, list] = {"decoded": [], "restored": []}
    for r in range(repeat):
        for side in ("decoded", "restored") if r % 2 == 0 else ("restored", "decoded"):
            got[side].append(decoded() if side == "decoded" else restored())
    med = statistics.median
    dec, res = got["decoded"], got["restored"]
    diff = max(float(np.abs(a[3].astype(np.float64) - b[3]).max()) for a, b in zip(dec, res))
    greedy = all(int(np.argmax(a[3])) == int(np.argmax(b[3])) for a, b in zip(dec, res))
    read = keys + [window_key(keys[-1])] if swa and keys else keys  # what a restore reads
    nbytes = sum(f.nbytes for f in (store.backend.find(k) for k in read) if f is not None)
    t_dec, t_res = med(x[0] for x in dec), med(x[0] for x in res)
    t_restore = med(x[2] for x in res)
    return {
        "n_stored": int(n_stored),
        "n_prompt": int(toks.size),
        "chunks": len(keys),
        "bytes": int(nbytes),
        "ttft_decoded_ms": 1e3 * t_dec,
        "ttft_restored_ms": 1e3 * t_res,
        "speedup": t_dec / t_res if t_res > 0 else None,
        "restore_ms": 1e3 * t_restore,
        "restore_mb_s": nbytes / 1e6 / t_restore if t_restore > 0 else None,
        "store_ms": 1e3 * med(x[1] for x in dec),
        "chunks_stored": min(written),
        "store_share": med(x[1] / x[0] for x in dec),
        "max_abs_diff": diff,
        "bit_identical": diff == 0.0,
        "greedy_same": greedy,
    }


def run(args: argparse.Namespace) -> dict:
    """:func:`run_one` for each length of ``-n``, in one context.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        The settings, ``rows`` (those of :func:`run_one`) and ``ok``.

    Raises:
        ValueError: A length that is not a multiple of --chunk-size, --suffix or -r below 1, or
            --store names a file or a directory that is not a store.
        ModelLoadError: The model cannot be loaded.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed.
        Interrupted: Ctrl-C; it carries the rows measured before it.
    """
    from ..prefix_store import PrefixStore, StoreError
    from .common import Interrupted, cache_kwargs, load_model, progress, prompt_tokens

    _check(args)
    tmp = None if args.store else tempfile.TemporaryDirectory(prefix="pyllamacpp-prefix-store-")
    try:
        try:
            store = PrefixStore(args.store or tmp.name, chunk_size=args.chunk_size)  # type: ignore[union-attr]
        except StoreError as e:  # bad input, said as such (exit 2)
            raise ValueError(str(e)) from None
        with load_model(args) as model:
            longest = max(args.n_stored) + args.suffix
            kw = dict(cache_kwargs(args), n_ctx=-(-longest // 256) * 256)
            rows: list[dict] = []
            with model.context(**kw) as ctx:
                store.keys(ctx, np.zeros(0, np.int32))  # a memory the store cannot serve: refused now
                fa = {1: "on", 0: "off"}.get(int(ctx.params.flash_attn_type), "auto")
                try:
                    for n in progress(args.n_stored, "prefix-store-ttft"):
                        toks = prompt_tokens(model, n + args.suffix)
                        rows.append(run_one(ctx, store, toks, n, args.repeat))
                except KeyboardInterrupt:
                    part = _result(model, args, fa, rows) if rows else None
                    raise Interrupted(part, len(rows), len(args.n_stored), "lengths") from None
            return _result(model, args, fa, rows)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _result(model: Model, args: argparse.Namespace, fa: str, rows: list[dict]) -> dict:
    ok = all(r["greedy_same"] for r in rows) and (fa != "off" or all(r["bit_identical"] for r in rows))
    return {
        "model": str(model.path),
        "suffix": int(args.suffix),
        "chunk_size": int(args.chunk_size),
        "repeat": int(args.repeat),
        "flash_attn": fa,
        "type_k": args.cache_type_k,
        "type_v": args.cache_type_v,
        "threads": args.threads,
        "rows": rows,
        "ok": ok,
    }


# The table's columns, shared with tools/bench/bench_prefix_store.py (which puts its limits between them).
TTFT_COLUMNS = [
    ("mb", "MB", ".1f"),
    ("ttft_decoded_ms", "TTFT decoded ms", ".1f"),
    ("ttft_restored_ms", "TTFT restored ms", ".1f"),
    ("speedup", "speed-up", ".1f"),
    ("restore_ms", "restore ms", ".1f"),
    ("restore_mb_s", "restore MB/s", ".0f"),
]
STORE_COLUMNS = [
    ("store_ms", "store ms", ".1f"),
    ("share", "store % of decode", ".1f"),
    ("logits", "first logits", ""),
]


def table_fields(row: dict) -> dict:
    """The columns a row of :func:`run_one` shows that are not its own fields.

    Args:
        row: What :func:`run_one` returned.

    Returns:
        ``mb`` (the chunks' bytes in MB), ``share`` (storing, in % of the decode) and ``logits``
        (``bit-identical`` or the largest difference).
    """
    return {
        "mb": row["bytes"] / 1e6,
        "share": 100 * row["store_share"],
        "logits": "bit-identical" if row["bit_identical"] else f"max|Δ| {row['max_abs_diff']:.3g}",
    }


def print_report(data: dict) -> None:
    """Print what :func:`run` returned as a table, one row per stored length.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    print(
        f"model {data['model']}: a prompt of N + {data['suffix']} tokens, its first N in a prefix store "
        f"(chunks of {data['chunk_size']}); -fa {data['flash_attn']}, cache {data['type_k']}/{data['type_v']}, "
        f"{data['threads']} threads; medians of {data['repeat']} runs, the sides alternating"
    )
    rows = [{**r, **table_fields(r), "greedy": "yes" if r["greedy_same"] else "NO"} for r in data["rows"]]
    print_table(
        rows,
        [
            ("n_stored", "N", "d"),
            ("chunks", "chunks", "d"),
            *TTFT_COLUMNS,
            *STORE_COLUMNS,
            ("greedy", "same token", ""),
        ],
    )


def plot(data: dict, path: str) -> None:
    """Draw the time to first token against N, decoded and restored (matplotlib), into ``path``.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (PNG).
    """
    from .common import figure

    rows = data["rows"]
    n = [r["n_stored"] for r in rows]
    with figure(path, 1, 2, figsize=(11, 4), dpi=110) as (fig, (a1, a2)):
        a1.plot(n, [r["ttft_decoded_ms"] for r in rows], "o-", label="decoded (llama_decode)")
        a1.plot(n, [r["ttft_restored_ms"] for r in rows], "o-", label="restored from the store")
        a1.set_xlabel("stored prefix N (tokens)")
        a1.set_ylabel("time to first token (ms, median)")
        a1.set_title(f"a prompt of N + {data['suffix']} tokens")
        a1.legend(fontsize=8)
        a2.bar([str(x) for x in n], [r["speedup"] or 0 for r in rows], color="C2")
        for i, r in enumerate(rows):
            a2.annotate(f"{r['speedup'] or 0:.1f}x", (i, r["speedup"] or 0), ha="center", va="bottom", fontsize=8)
        a2.set_xlabel("stored prefix N (tokens)")
        a2.set_ylabel("decoded / restored")
        a2.set_title("speed-up of the first token")


COMMAND = Command(
    "prefix-store-ttft",
    "time to first token with the prompt's prefix restored from a prefix store against decoded",
    __name__,
    _flags,
    refused=(ValueError,),
)
add_parser, main = COMMAND.add_parser, COMMAND
