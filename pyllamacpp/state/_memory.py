"""The memory part of a dump: which memory modules wrote it, found by reading.

A dump's memory part is one or more memory modules' states back to back. Their number and kind
are not written down, nor whether cells carry llama_kv_cell_ext, whether layers have V, or whether
rows were written at all (StateFlags.ON_DEVICE), so ``parse_memory`` tries the layouts llama.cpp
can write and keeps the first that accounts for every byte.
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


def _rename(part: MemoryPart, name: str) -> MemoryPart:
    if part.name == name:
        return part
    streams = tuple(dataclasses.replace(s, part=name, records=tuple(dataclasses.replace(r, part=name)
                                                                  for r in s.records))
                    for s in part.streams)
    return dataclasses.replace(part, name=name, streams=streams)


def parse_memory(buf: Buffer, off: int, *, memory: str | None = None, cell_ext: bool | None = None,
                 has_v: bool | None = None, n_head: int | None = None,
                 metadata_only: bool | None = None) -> tuple[tuple[MemoryPart, ...], dict]:
    """The memory part from ``off`` to the end: the first layout that reads every byte.

    Full dumps are tried before metadata-only ones (``StateFlags.ON_DEVICE``: every record's
    header, no rows), unless ``metadata_only`` says which. Returns the parts and the options that
    read them (memory, cell_ext, has_v, metadata_only). When no layout fits, raises the error of
    the attempt that read the most records (the earliest attempt on a tie): a misreading attempt
    fails before its first record, so its error is not the one that explains the dump, even when
    it fails at a later byte.
    """
    if memory is not None and memory not in MEMORY_LAYOUTS:
        raise ValueError(f"memory={memory!r}: expected one of {sorted(MEMORY_LAYOUTS)}")
    layouts = [memory] if memory else list(MEMORY_LAYOUTS)
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
        for name in layouts:
            kinds = MEMORY_LAYOUTS[name]
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
                named = tuple(_rename(part, n) for part, n in zip(parts, PART_NAMES[name]))
                # a dump with no record at all reads the same both ways: call it full
                has_records = any(s.records for part in parts for s in part.streams)
                opts = {"memory": name, "cell_ext": ext if "kv" in kinds else None,
                        "has_v": hv if "kv" in kinds else None, "metadata_only": meta and has_records}
                return named, opts
    assert best is not None
    raise best[1]
