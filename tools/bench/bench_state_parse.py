"""How long pyllamacpp.state.parse takes on a 1 GiB sequence dump (memory-mapped, never read whole).

Writes a dump with the default model's layout (30 layers, F16 K and V rows of 384 bytes, one stream)
and enough cells to reach the size asked for, then times parse(path), layout() and reading the last
cell of the last layer's V, each the median of -r runs in fresh processes' worth of work (the file is
re-opened every time). Then the first parse(path, model=GGUF) of a process: the GGUF's metadata read
cold (caches cleared each run) by pyllamacpp.state (its KV section only) against gguf.GGUFReader
(what it used before), in the same run.

    python tools/bench/bench_state_parse.py [--gib 1] [-r 5] [--dir /tmp] [--model GGUF]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

N_LAYER, ROW, TYPE_F16 = 30, 384, 1
MAGIC = 0xAF143CD8


def write_dump(path: Path, target_bytes: int) -> int:
    per_cell = 12 + 2 * N_LAYER * ROW
    head = 4 + 4 + 4 + 4  # magic, seq_id, n_stream, cell_count
    tail = 4 + 4 + 2 * N_LAYER * 12  # v_trans, n_layer, record headers
    n = (target_bytes - head - tail) // per_cell
    size = head + tail + n * per_cell
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: zeros cost no disk
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    off = 0

    def put(fmt, *v):
        nonlocal off
        b = struct.pack("<" + fmt, *v)
        mm[off : off + len(b)] = np.frombuffer(b, np.uint8)
        off += len(b)

    put("IiII", MAGIC, 0, 1, n)
    cells = np.zeros((n, 3), dtype=np.int32)
    cells[:, 0] = np.arange(n)  # pos
    cells[:, 1] = 1  # n_seq_id
    mm[off : off + cells.nbytes] = cells.view(np.uint8).reshape(-1)
    off += cells.nbytes
    put("II", 0, N_LAYER)
    for _kind in "KV":
        for _ in range(N_LAYER):
            put("iQ", TYPE_F16, ROW)
            off += n * ROW
    mm.flush()  # unmapped when put() and mm go at return
    assert off == size, (off, size)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("-r", "--repeat", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--model", default=None, help="GGUF for the model= rows (default: the default model)")
    args = ap.parse_args()
    import pyllamacpp.state as st
    from pyllamacpp.state import _sidecar

    path = Path(args.dir) / "pyllamacpp-bench-1gib.bin"
    n = write_dump(path, int(args.gib * 2**30))
    try:
        size = path.stat().st_size
        t_parse, t_layout, t_read = [], [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            s = st.parse(path, n_head_kv=3)
            t1 = time.perf_counter()
            lay = s.layout()
            t2 = time.perf_counter()
            last = np.asarray(s.v[N_LAYER - 1][-1], dtype=np.float32).sum()
            t3 = time.perf_counter()
            t_parse.append(t1 - t0), t_layout.append(t2 - t1), t_read.append(t3 - t2)
            assert lay.metadata_bytes + lay.payload_bytes == size and s.stream().cell_count == n
            del s, lay, last
        print(f"dump: {size:,} bytes ({size / 2**30:.2f} GiB), {n:,} cells, {N_LAYER} layers, F16")
        print(f"parse(path)         median {statistics.median(t_parse) * 1e3:8.1f} ms  (of {args.repeat})")
        print(f"layout()            median {statistics.median(t_layout) * 1e3:8.1f} ms")
        print(f"last V row read     median {statistics.median(t_read) * 1e3:8.3f} ms")

        from gguf import GGUFReader

        from pyllamacpp.models import default_model_path

        gguf_path = Path(args.model) if args.model else default_model_path()
        t_model, t_reader = [], []
        for _ in range(args.repeat):
            _sidecar._gguf_meta.cache_clear(), _sidecar._gguf_facts.cache_clear()
            t0 = time.perf_counter()
            s = st.parse(path, model=gguf_path)  # first call: reads the GGUF's metadata
            t1 = time.perf_counter()
            GGUFReader(gguf_path)
            t2 = time.perf_counter()
            t_model.append(t1 - t0), t_reader.append(t2 - t1)
            assert s.n_head_kv == 3 and s.layers == {"kv": list(range(N_LAYER))}
            del s
        m, r = statistics.median(t_model), statistics.median(t_reader)
        print(f"parse(path, model=) first call median {m * 1e3:8.1f} ms  ({gguf_path.name}, metadata cold)")
        print(f"gguf.GGUFReader(model) alone  median {r * 1e3:8.1f} ms  (what model= read before: {r / m:.0f}x)")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
