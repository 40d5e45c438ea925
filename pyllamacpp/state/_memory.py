"""The memory part of a dump: which memory modules wrote it, found by reading.

A dump's memory part is one or more memory modules' states back to back. Their number and kind
are not written down, nor whether cells carry llama_kv_cell_ext, whether layers have V, whether
rows were written at all (StateFlags.ON_DEVICE), or whether only the memory's partial part was
(StateFlags.PARTIAL_ONLY), so ``parse_memory`` tries the layouts llama.cpp can write and keeps the
first that accounts for every byte. Some layouts look alike (dsa and msa are two KV caches, as
iswa): without ``memory=`` (or a layer map, a model, a sidecar that says which) the first listed
is kept, and only the names of the parts differ. llama_kv_cache_dsv4's state says what it is (its
magic, version and mode): it is read by _dsv4, never by trying layouts.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from . import _dsv4
from ._buffer import Buffer, StateFormatError
from ._parse import parse_kv
from ._records import MemoryPart
from ._recurrent import parse_recurrent, parse_recurrent_splits

# memory= names -> the parts, in the order llama.cpp writes them; the order of this dict is the
# order layouts are tried without a hint (the first five before the later look-alikes). "kv-k":
# a KV cache that never has V: llama_memory_hybrid_idx's indexer cache sets
# n_embd_head_{k,v}_mla_impl ("fool llama_kv_cache into thinking this is a MLA cache"), and the
# llama_kv_cache constructor makes no V tensor when hparams.is_mla(), so state_write_data writes
# no V record. Other KV parts follow the model (has_v: one value for all of them, as every part
# of these memories is built from the same hparams' is_mla()).
MEMORY_LAYOUTS = {
    "kv": ("kv",),  # llama_kv_cache
    "iswa": ("kv", "kv"),  # llama_kv_cache_iswa: base, then swa
    "hybrid": ("kv", "recurrent"),  # llama_memory_hybrid: attn, then recurrent
    "hybrid-iswa": ("kv", "kv", "recurrent"),  # llama_memory_hybrid_iswa
    "recurrent": ("recurrent",),  # llama_memory_recurrent
    "dsa": ("kv", "kv"),  # llama_kv_cache_dsa: kv_mla, then kv_lid
    "msa": ("kv", "kv"),  # llama_kv_cache_msa: kv_base, then kv_idx
    "dsa-iswa": ("kv", "kv", "kv"),  # llama_kv_cache_dsa_iswa: kv_dsa (mla, lid), kv_swa
    "hybrid-idx": ("kv", "recurrent", "kv-k"),  # llama_memory_hybrid_idx: hybrid, then mem_idx
    # llama_kv_cache_dsv4 (after its 12-byte header, see _dsv4): kv_raw, a K-only iSWA cache
    # (dsv4_make_k_only), then the compressed K caches and the compressor states. Read by
    # _dsv4 only (never tried as a layout: its magic says what it is).
    "dsv4": ("kv-k", "kv-k") + ("compressed",) * 3 + ("compressor",) * 3,
}
PART_NAMES = {
    "kv": ("kv",),
    "iswa": ("base", "swa"),
    "hybrid": ("kv", "recurrent"),
    "hybrid-iswa": ("base", "swa", "recurrent"),
    "recurrent": ("recurrent",),
    "dsa": ("mla", "lid"),
    "msa": ("base", "idx"),
    "dsa-iswa": ("mla", "lid", "swa"),
    "hybrid-idx": ("kv", "recurrent", "idx"),
    "dsv4": _dsv4.PART_NAMES,
}
# What each memory writes with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (llama.h: "work only with
# partial states, such as SWA KV cache or recurrent cache"), as (kind, name) per part:
# llama_kv_cache::state_write and llama_memory_recurrent::state_write ignore the flag (all of
# themselves); llama_kv_cache_iswa::state_write skips kv_base; llama_memory_hybrid::state_write
# skips mem_attn; llama_memory_hybrid_iswa::state_write passes the flag to its iSWA cache (swa
# only) and writes its recurrent memory. llama_kv_cache_dsa and _msa pass the flag to their two
# plain caches (all of both); llama_kv_cache_dsa_iswa::state_write skips kv_dsa;
# llama_memory_hybrid_idx::state_write skips mem_attn (llama_memory_hybrid's) and mem_idx.
# llama_kv_cache_dsv4::state_write passes the flag to kv_raw (swa only) and skips the
# compressed K caches, but writes its three compressor states.
PARTIAL_PARTS = {
    "kv": (("kv", "kv"),),
    "iswa": (("kv", "swa"),),
    "hybrid": (("recurrent", "recurrent"),),
    "hybrid-iswa": (("kv", "swa"), ("recurrent", "recurrent")),
    "recurrent": (("recurrent", "recurrent"),),
    "dsa": (("kv", "mla"), ("kv", "lid")),
    "msa": (("kv", "base"), ("kv", "idx")),
    "dsa-iswa": (("kv", "swa"),),
    "hybrid-idx": (("recurrent", "recurrent"),),
    "dsv4": (("kv-k", "swa"),) + tuple(("compressor", n) for n in _dsv4.PARTIAL_NAMES[1:]),
}
DSV4_STATE_MAGIC = _dsv4.DSV4_STATE_MAGIC
# llama.h's LLAMA_STATE_SEQ_FLAGS_* (this package must not need the compiled extension)
PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (== SWA_ONLY)
ON_DEVICE = 2  # LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


def _layout(memory: str, partial: bool) -> tuple[tuple[str, str], ...]:
    # (kind, name) with kind "kv-k" for a KV cache without V (see MEMORY_LAYOUTS)
    if partial:
        return PARTIAL_PARTS[memory]
    return tuple(zip(MEMORY_LAYOUTS[memory], PART_NAMES[memory]))


def written_parts(memory: str, partial: bool) -> tuple[tuple[str, str], ...]:
    """``(kind, name)`` of each part ``memory`` writes to a dump, in order.

    Args:
        memory: A memory name of ``parse(memory=...)`` ("kv", "iswa", "hybrid" ...).
        partial: Whether the dump was written with ``StateFlags.PARTIAL_ONLY``.

    Returns:
        ``(kind, name)`` pairs; kind as MemoryPart.kind says it ("kv", "recurrent", or a dsv4
        block's "compressed" / "compressor").

    Raises:
        KeyError: ``memory`` is not a known memory name.
    """
    return tuple(("kv" if k == "kv-k" else k, n) for k, n in _layout(memory, partial))


def memory_of(layers: dict | None) -> str | None:
    """The memory whose parts a layer map names (``{"base", "swa"}``: iswa ...).

    Args:
        layers: A layer map (``layer_map()``'s result), or None.

    Returns:
        The memory name, or None for no map or a set of parts no memory writes.
    """
    if not layers:
        return None
    for name, parts in PART_NAMES.items():
        if set(parts) == set(layers):
            return name
    return None


def _rename(part: MemoryPart, name: str) -> MemoryPart:
    if part.name == name:
        return part
    streams = tuple(
        dataclasses.replace(s, part=name, records=tuple(dataclasses.replace(r, part=name) for r in s.records))
        for s in part.streams
    )
    return dataclasses.replace(part, name=name, streams=streams)


def _candidates(memory: str | None, partial: bool | None) -> list[tuple[str, bool]]:
    """(memory, partial) readings to try, in order. Without ``memory``, a partial dump's one KV
    part reads as "kv" (a plain cache and an iSWA cache's SWA part look alike) and its one
    recurrent part as "recurrent" (a recurrent memory or a hybrid's recurrent part); unknown
    ``partial`` tries full layouts only, as every partial layout is also some full one."""
    if memory is not None:
        if partial is not None:
            return [(memory, partial)]
        # full first; the partial layout only where it differs (an iSWA or hybrid memory)
        kinds = [tuple(k for k, _ in _layout(memory, p)) for p in (False, True)]
        return [(memory, False)] + ([(memory, True)] if kinds[0] != kinds[1] else [])
    if partial:
        return [("kv", True), ("hybrid-iswa", True), ("recurrent", True)]
    return [(name, False) for name in MEMORY_LAYOUTS if name != "dsv4"]


def parse_memory(
    buf: Buffer,
    off: int,
    *,
    memory: str | None = None,
    cell_ext: bool | None = None,
    has_v: bool | None = None,
    n_head: int | None = None,
    metadata_only: bool | None = None,
    partial: bool | None = None,
    seq_id: int | None = None,
) -> tuple[tuple[MemoryPart, ...], dict]:
    """The memory part from ``off`` to the end: the first layout that reads every byte.

    Full dumps are tried before metadata-only ones (``StateFlags.ON_DEVICE``: every record's
    header, no rows), unless ``metadata_only`` says which. ``partial``: the dump was written with
    ``StateFlags.PARTIAL_ONLY`` (True), without it (False), or unknown (None: with ``memory``,
    the full layout then the partial one; without, full layouts only). Returns the parts and the
    options that read them (memory, partial, cell_ext, has_v, metadata_only; partial is None when
    the reading cannot tell). When no layout fits, raises the error of the attempt that read the
    most records (the earliest attempt on a tie): a misreading attempt fails before its first
    record, so its error is not the one that explains the dump, even when it fails at a later byte.
    ``seq_id``: the sequence the dump was written for, -1 for the whole memory, None unknown (a
    seq file); only a llama_kv_cache_dsv4 state depends on it (its blocks' stream counts).

    Args:
        buf: The dump.
        off: Byte offset of the memory part.
        memory: The memory name, or None to try each layout.
        cell_ext: Whether cells carry llama_kv_cell_ext, or None to try both.
        has_v: Whether attention records include V, or None to try both.
        n_head: n_head_kv to shape K/V views with, or None for flat rows.
        metadata_only: Whether the dump is metadata-only, or None to try both.
        partial: Whether the dump is PARTIAL_ONLY, or None (see above).
        seq_id: The sequence the dump was written for (see above).

    Returns:
        The parts, and the options that read them.

    Raises:
        ValueError: ``memory`` is not a known memory name.
        StateFormatError: No layout reads the bytes exactly.
    """
    if memory is not None and memory not in MEMORY_LAYOUTS:
        raise ValueError(f"memory={memory!r}: expected one of {sorted(MEMORY_LAYOUTS)}")
    is_dsv4 = off + 4 <= buf.size and buf.u32(off, "memory") == DSV4_STATE_MAGIC
    if memory == "dsv4" or (memory is None and is_dsv4):
        return _parse_dsv4(
            buf,
            off,
            cell_ext=cell_ext,
            has_v=has_v,
            n_head=n_head,
            metadata_only=metadata_only,
            partial=partial,
            seq_id=seq_id,
        )
    if is_dsv4:
        raise StateFormatError(
            f"a llama_kv_cache_dsv4 state (magic 'DSV4', DeepSeek V4), not memory {memory!r}",
            offset=off,
            what="memory layout",
        )
    layouts = _candidates(memory, partial)
    exts = [cell_ext] if cell_ext is not None else [False, True]
    has_vs = [has_v] if has_v is not None else [True, False]
    readings = [bool(metadata_only)] if metadata_only is not None else [False, True]
    memo: dict = {}  # a part at an offset reads the same in every layout that has it there
    best: list = [None]  # (score, error) of the attempt that read the most records

    def fail(score: int, e: StateFormatError) -> None:
        if best[0] is None or score > best[0][0]:
            best[0] = (score, e)

    def part_at(kind: str, i: int, p: int, ext: bool, hv: bool, meta: bool, last: bool) -> list:
        """The readings of part ``i`` at ``p``: one, except a recurrent part that another part
        follows (its end is not written down: every candidate end, see parse_recurrent_splits)."""
        base = "kv" if kind == "kv-k" else kind
        hv = hv and kind != "kv-k"
        label = base if i == 0 else f"{base}#{i + 1}"
        key = (label, p, ext, hv, meta) if base == "kv" else (label, p, meta, last)
        if key not in memo:
            tally = [0]
            try:
                if base == "kv":
                    memo[key] = [parse_kv(buf, p, label, ext=ext, has_v=hv, n_head=n_head, tally=tally, data=not meta)]
                elif last:
                    memo[key] = [parse_recurrent(buf, p, label, tally, data=not meta)]
                else:
                    memo[key] = parse_recurrent_splits(buf, p, label, tally, data=not meta)
            except StateFormatError as e:
                e._records_read = tally[0]
                memo[key] = e
        if isinstance(memo[key], StateFormatError):
            raise memo[key]
        if not isinstance(memo[key], list):  # a generator: read its readings once, lazily
            memo[key] = _Lazy(memo[key])
        return memo[key]

    def read(kinds, i, p, n_records, ext, hv, meta):
        """The first reading of parts i.. from p to the last byte, or None (errors go to fail)."""
        if i == len(kinds):
            if p == buf.size:
                return []
            fail(
                n_records,
                StateFormatError(f"{buf.size - p} trailing bytes after the memory part", offset=p, what="end of dump"),
            )
            return None
        n_read = 0
        try:
            for part in part_at(kinds[i], i, p, ext, hv, meta, i == len(kinds) - 1):
                n_read += 1
                rest = read(
                    kinds, i + 1, part.end, n_records + sum(len(s.records) for s in part.streams), ext, hv, meta
                )
                if rest is not None:
                    return [part] + rest
        except StateFormatError as e:
            fail(n_records + getattr(e, "_records_read", 0), e)
            return None
        if not n_read:
            fail(
                n_records,
                StateFormatError(
                    "no reading of the recurrent records (as many R as S, one "
                    "header each) is followed by the next part",
                    offset=p,
                    what=f"{kinds[i]}#{i + 1} records",
                ),
            )
        return None

    for meta in readings:
        for name, part_only in layouts:
            kinds, names = zip(*_layout(name, part_only))
            has_kv = any(k in ("kv", "kv-k") for k in kinds)
            combos = [(e, h) for e in exts for h in has_vs] if has_kv else [(exts[0], has_vs[0])]
            # a V-less part alone: has_v says nothing of it, one reading is enough
            if "kv" not in kinds:
                combos = list(dict.fromkeys((e, has_vs[0]) for e, _ in combos))
            for ext, hv in combos:
                parts = read(kinds, 0, off, 0, ext, hv, meta)
                if parts is None:
                    continue
                named = tuple(_rename(part, n) for part, n in zip(parts, names))
                # a dump with no record at all reads the same both ways: call it full
                has_records = any(s.records for part in parts for s in part.streams)
                # partial: as given, or told apart by the reading (memory known, layouts differ)
                told = partial if partial is not None else (part_only if memory and len(layouts) > 1 else None)
                opts = {
                    "memory": name,
                    "partial": told,
                    "cell_ext": ext if has_kv else None,
                    "has_v": hv if "kv" in kinds else None,
                    "metadata_only": meta and has_records,
                }
                return named, opts
    assert best[0] is not None
    raise best[0][1]


def _parse_dsv4(
    buf: Buffer, off: int, *, cell_ext, has_v, n_head, metadata_only, partial, seq_id
) -> tuple[tuple[MemoryPart, ...], dict]:
    """llama_kv_cache_dsv4's state (see _dsv4): the readings of its raw cache (cells with or
    without llama_kv_cell_ext) with rows, then without (ON_DEVICE); the error of the one that
    read the most records when none reads every byte."""
    if has_v:
        raise StateFormatError(
            "has_v=True, but llama_kv_cache_dsv4's raw cache is K-only (dsv4_make_k_only: "
            "hparams.is_mla(), no V tensor, no V record)",
            offset=off,
            what="dsv4 raw cache",
        )
    mode = _dsv4.read_header(buf, off, partial)
    best = None
    for meta in [bool(metadata_only)] if metadata_only is not None else [False, True]:
        for ext in [cell_ext] if cell_ext is not None else [False, True]:
            tally = [0]
            try:
                parts = _dsv4.parse_dsv4(
                    buf, off, seq_id=seq_id, mode=mode, ext=ext, n_head=n_head, data=not meta, tally=tally
                )
            except StateFormatError as e:
                if best is None or tally[0] > best[0]:
                    best = (tally[0], e)
                continue
            has_records = any(s.records for p in parts for s in p.streams)
            return parts, {
                "memory": "dsv4",
                "partial": mode == _dsv4.MODE_PARTIAL,
                "cell_ext": ext,
                "has_v": False,
                "metadata_only": meta and has_records,
            }
    raise cast("tuple[int, StateFormatError]", best)[1]  # every reading failed, so best is set


class _Lazy:
    """A generator's items, read on demand and kept, so that every layout that meets the same
    part at the same offset iterates the same readings."""

    def __init__(self, gen):
        self._gen, self._items = gen, []

    def __iter__(self):
        i = 0
        while True:
            if i < len(self._items):
                yield self._items[i]
            elif self._gen is None:
                return
            else:
                try:
                    self._items.append(next(self._gen))
                except StopIteration:
                    self._gen = None
                    return
                continue
            i += 1
