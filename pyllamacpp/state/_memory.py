"""The memory part of a dump: which memory modules wrote it, found by reading.

A dump's memory part is one or more memory modules' states back to back. Their number and kind
are not written down, nor whether cells carry llama_kv_cell_ext, whether layers have V, whether
rows were written at all (StateFlags.ON_DEVICE), or whether only the memory's partial part was
(StateFlags.PARTIAL_ONLY), so ``parse_memory`` tries the layouts llama.cpp can write and keeps the
first that accounts for every byte.
"""
from __future__ import annotations

import dataclasses

from ._buffer import Buffer, StateFormatError
from ._parse import parse_kv
from ._recurrent import parse_recurrent
from ._records import MemoryPart

# memory= names -> the parts, in the order llama.cpp writes them
MEMORY_LAYOUTS = {
    "kv": ("kv",),                                 # llama_kv_cache
    "iswa": ("kv", "kv"),                          # llama_kv_cache_iswa: base, then swa
    "hybrid": ("kv", "recurrent"),                 # llama_memory_hybrid: attn, then recurrent
    "hybrid-iswa": ("kv", "kv", "recurrent"),      # llama_memory_hybrid_iswa
    "recurrent": ("recurrent",),                   # llama_memory_recurrent
}
PART_NAMES = {
    "kv": ("kv",), "iswa": ("base", "swa"), "hybrid": ("kv", "recurrent"),
    "hybrid-iswa": ("base", "swa", "recurrent"), "recurrent": ("recurrent",),
}
# What each memory writes with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (llama.h: "work only with
# partial states, such as SWA KV cache or recurrent cache"), as (kind, name) per part:
# llama_kv_cache::state_write and llama_memory_recurrent::state_write ignore the flag (all of
# themselves); llama_kv_cache_iswa::state_write skips kv_base; llama_memory_hybrid::state_write
# skips mem_attn; llama_memory_hybrid_iswa::state_write passes the flag to its iSWA cache (swa
# only) and writes its recurrent memory.
PARTIAL_PARTS = {
    "kv": (("kv", "kv"),), "iswa": (("kv", "swa"),), "hybrid": (("recurrent", "recurrent"),),
    "hybrid-iswa": (("kv", "swa"), ("recurrent", "recurrent")), "recurrent": (("recurrent", "recurrent"),),
}
# llama.h's LLAMA_STATE_SEQ_FLAGS_* (this package must not need the compiled extension)
PARTIAL_ONLY = 1   # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (== SWA_ONLY)
ON_DEVICE = 2      # LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


def written_parts(memory: str, partial: bool) -> tuple[tuple[str, str], ...]:
    """``(kind, name)`` of each part ``memory`` writes, in order, with or without PARTIAL_ONLY."""
    if partial:
        return PARTIAL_PARTS[memory]
    return tuple(zip(MEMORY_LAYOUTS[memory], PART_NAMES[memory]))


def memory_of(layers: dict | None) -> str | None:
    """The memory whose parts a layer map names ({"base", "swa"}: iswa ...), or None."""
    if not layers:
        return None
    for name, parts in PART_NAMES.items():
        if set(parts) == set(layers):
            return name
    return None


def _rename(part: MemoryPart, name: str) -> MemoryPart:
    if part.name == name:
        return part
    streams = tuple(dataclasses.replace(s, part=name, records=tuple(dataclasses.replace(r, part=name)
                                                                  for r in s.records))
                    for s in part.streams)
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
        kinds = [tuple(k for k, _ in written_parts(memory, p)) for p in (False, True)]
        return [(memory, False)] + ([(memory, True)] if kinds[0] != kinds[1] else [])
    if partial:
        return [("kv", True), ("hybrid-iswa", True), ("recurrent", True)]
    return [(name, False) for name in MEMORY_LAYOUTS]


def parse_memory(buf: Buffer, off: int, *, memory: str | None = None, cell_ext: bool | None = None,
                 has_v: bool | None = None, n_head: int | None = None,
                 metadata_only: bool | None = None,
                 partial: bool | None = None) -> tuple[tuple[MemoryPart, ...], dict]:
    """The memory part from ``off`` to the end: the first layout that reads every byte.

    Full dumps are tried before metadata-only ones (``StateFlags.ON_DEVICE``: every record's
    header, no rows), unless ``metadata_only`` says which. ``partial``: the dump was written with
    ``StateFlags.PARTIAL_ONLY`` (True), without it (False), or unknown (None: with ``memory``,
    the full layout then the partial one; without, full layouts only). Returns the parts and the
    options that read them (memory, partial, cell_ext, has_v, metadata_only; partial is None when
    the reading cannot tell). When no layout fits, raises the error of the attempt that read the
    most records (the earliest attempt on a tie): a misreading attempt fails before its first
    record, so its error is not the one that explains the dump, even when it fails at a later byte.
    """
    if memory is not None and memory not in MEMORY_LAYOUTS:
        raise ValueError(f"memory={memory!r}: expected one of {sorted(MEMORY_LAYOUTS)}")
    layouts = _candidates(memory, partial)
    exts = [cell_ext] if cell_ext is not None else [False, True]
    has_vs = [has_v] if has_v is not None else [True, False]
    readings = [bool(metadata_only)] if metadata_only is not None else [False, True]
    memo: dict = {}  # a part at an offset reads the same in every layout that has it there
    best: tuple[int, StateFormatError] | None = None

    def part_at(kind: str, i: int, p: int, ext: bool, hv: bool, meta: bool) -> MemoryPart:
        label = kind if i == 0 else f"{kind}#{i + 1}"
        key = (label, p, ext, hv, meta) if kind == "kv" else (label, p, meta)
        if key not in memo:
            tally = [0]
            try:
                memo[key] = (parse_kv(buf, p, label, ext=ext, has_v=hv, n_head=n_head, tally=tally, data=not meta)
                             if kind == "kv" else parse_recurrent(buf, p, label, tally, data=not meta))
            except StateFormatError as e:
                e._records_read = tally[0]
                memo[key] = e
        if isinstance(memo[key], StateFormatError):
            raise memo[key]
        return memo[key]

    for meta in readings:
        for name, part_only in layouts:
            kinds, names = zip(*written_parts(name, part_only))
            combos = [(e, h) for e in exts for h in has_vs] if "kv" in kinds else [(exts[0], has_vs[0])]
            for ext, hv in combos:
                parts, p, n_records = [], off, 0
                try:
                    for i, kind in enumerate(kinds):
                        parts.append(part_at(kind, i, p, ext, hv, meta))
                        p = parts[-1].end
                        n_records += sum(len(s.records) for s in parts[-1].streams)
                    if p != buf.size:
                        raise StateFormatError(f"{buf.size - p} trailing bytes after the memory part",
                                               offset=p, what="end of dump")
                except StateFormatError as e:
                    score = n_records + getattr(e, "_records_read", 0)
                    if best is None or score > best[0]:
                        best = (score, e)
                    continue
                named = tuple(_rename(part, n) for part, n in zip(parts, names))
                # a dump with no record at all reads the same both ways: call it full
                has_records = any(s.records for part in parts for s in part.streams)
                # partial: as given, or told apart by the reading (memory known, layouts differ)
                told = partial if partial is not None else (part_only if memory and len(layouts) > 1 else None)
                opts = {"memory": name, "partial": told, "cell_ext": ext if "kv" in kinds else None,
                        "has_v": hv if "kv" in kinds else None, "metadata_only": meta and has_records}
                return named, opts
    assert best is not None
    raise best[1]
