"""The directory store with several processes: two writing the same chunks at once both succeed
and leave exact chunks; a process killed while writing leaves no chunk anyone can see."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from pyllamacpp.prefix_store import DirectoryBackend, PrefixStore

TEXT = (
    "The cat sat on the mat and looked at the dog, who was not amused at all by it, "
    "and then the two of them went out into the garden to see the birds."
)

# A writer: prefill TEXT, wait for the go file, save into the store; each rename waits 0.2 s, so
# the two writers are inside the same chunk's write at once.
WRITER = r"""
import os, sys, time, warnings
import pyllamacpp as pl
from pyllamacpp.prefix_store import PrefixStore

root, go, text = sys.argv[1:4]
real = os.replace
def slow_replace(src, dst):
    time.sleep(0.2)
    real(src, dst)
os.replace = slow_replace
with pl.Model(pl.default_model_path()) as m, m.context(n_ctx=256, n_threads=1, flash_attn=False) as ctx:
    toks = m.tokenize(text)
    ctx.prefill(toks)
    store = PrefixStore(root, chunk_size=8)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        n = store.save(ctx, 0, toks)
    print("wrote", n, "warnings", len(w), *[str(x.message) for x in w], flush=True)
"""

# A slow writer: a 1 MiB chunk written 4 KiB at a time, 10 ms apart; says "writing" once under way.
SLOW = r"""
import os, sys, time
from pyllamacpp.prefix_store import DirectoryBackend

real_fdopen = os.fdopen
class Slow:
    def __init__(self, f):
        self.f = f
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self.f.close()
    def write(self, data):
        view = memoryview(data)
        for i in range(0, len(view), 4096):
            self.f.write(view[i : i + 4096])
            self.f.flush()
            if i == 4096:
                print("writing", flush=True)
            time.sleep(0.01)
os.fdopen = lambda fd, mode: Slow(real_fdopen(fd, mode))
DirectoryBackend(sys.argv[1]).put("ab" * 32, os.urandom(1 << 20))
print("done", flush=True)
"""


def _child(code, *args):
    return subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tempfile.gettempdir(),
    )


def test_two_processes_writing_the_same_chunks_at_once_both_succeed(model, tmp_path):
    root, go = tmp_path / "store", tmp_path / "go"
    store = PrefixStore(root, chunk_size=8)  # the manifest first, as a store in use has it
    kids = [_child(WRITER, root, go, TEXT) for _ in range(2)]
    try:
        for k in kids:
            line = k.stdout.readline()
            assert line == "ready\n", (line, k.stderr.read() if k.poll() is not None else "")
        go.touch()  # both save now
        outs = [k.communicate(timeout=120) for k in kids]
    finally:
        for k in kids:
            if k.poll() is None:
                k.kill()
                k.wait()
    toks = model.tokenize(TEXT)
    n_chunks = toks.size // 8
    for k, (out, err) in zip(kids, outs):
        assert k.returncode == 0, err
        assert out.startswith("wrote ") and out.split()[2:4] == ["warnings", "0"], out  # no write failed
    assert sum(int(out.split()[1]) for out, _ in outs) >= n_chunks
    files = sorted(p.name for p in root.rglob("*") if p.is_file() and p.name != "pyllamacpp-prefix-store.json")
    assert len(files) == n_chunks and not [f for f in files if f.startswith(".tmp")], files  # one file a chunk
    with model.context(n_ctx=256, n_threads=1, n_threads_batch=1, flash_attn=False) as ctx:
        ctx.prefill(toks)
        want = np.array(ctx.logits(-1))
    with model.context(n_ctx=256, n_threads=1, n_threads_batch=1, flash_attn=False) as ctx:
        n = store.restore(ctx, 0, toks)
        assert n == ((toks.size - 1) // 8) * 8 and store.stats.corrupt == 0
        ctx.prefill(toks[n:], 0, n)
        np.testing.assert_array_equal(np.array(ctx.logits(-1)), want)


def test_a_process_killed_while_writing_leaves_no_visible_chunk(tmp_path):
    root = tmp_path / "store"
    DirectoryBackend(root)
    kid = _child(SLOW, root)
    try:
        line = kid.stdout.readline()
        assert line == "writing\n", (line, kid.stderr.read() if kid.poll() is not None else "")
        time.sleep(0.1)
        kid.send_signal(signal.SIGKILL)
        kid.wait(30)
    finally:
        if kid.poll() is None:
            kid.kill()
            kid.wait()
    assert kid.returncode == -signal.SIGKILL
    partial = [p for p in root.rglob("*") if p.is_file() and p.name != "pyllamacpp-prefix-store.json"]
    assert len(partial) == 1 and 0 < partial[0].stat().st_size < 1 << 20, partial  # it died mid-write
    b = DirectoryBackend(root)
    assert b.find("ab" * 32) is None and b.get("ab" * 32) is None and list(b.chunks()) == []
    assert b.evict(0) == (0, 0)
    data = os.urandom(1000)
    assert b.put("ab" * 32, data) == 1000 and b.get("ab" * 32) == data  # the next writer is not in its way
