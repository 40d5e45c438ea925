"""bench_core's native side: ``native_driver.c`` (and a bench's own C loop) compiled against the
package's own llama.cpp and libllama, loaded through ctypes, run as a process; the formulas both
sides share with it (the synthetic prompt, the checksum of the generated tokens)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BUILD = HERE / "build"


def synthetic_tokens(n: int, n_vocab: int):
    """The same formula as native_driver.c's synth(): ordinary tokens, no specials."""
    import numpy as np

    return ((1000 + 37 * np.arange(n, dtype=np.int64)) % n_vocab).astype(np.int32)


def checksum(tokens) -> int:
    """FNV-1a over the token ids, as native_driver.c's checksum()."""
    h = 2166136261
    for t in tokens:
        h = ((h ^ (int(t) & 0xFFFFFFFF)) * 16777619) & 0xFFFFFFFF
    return h


# -- the native driver -------------------------------------------------------------------------
def build_driver(verbose: bool = False) -> tuple[Path, list[str]]:
    """Compile native_driver.c with the system C compiler against the package's own llama.cpp."""
    import pyllamacpp as pl

    info = pl.build_info()
    source = info["llama_cpp_source"]
    if source.startswith("LLAMA_CPP_DIR="):
        llama_dir = Path(source.split("=", 1)[1])
    elif source.startswith("pinned sdist"):
        llama_dir = REPO / "vendor" / "llama.cpp"
    else:
        raise SystemExit(f"bench: cannot tell where llama.cpp came from: {source!r}")
    header = llama_dir / "include" / "llama.h"
    digest = hashlib.sha256(header.read_bytes()).hexdigest()
    if digest != info["llama_h_sha256"]:  # the driver must see the header the package was built from
        raise SystemExit(
            f"bench: {header} (sha256 {digest[:12]}) is not the llama.h of this build ({info['llama_h_sha256'][:12]})"
        )
    lib_dir = info["lib_dir"]
    BUILD.mkdir(exist_ok=True)
    exe = BUILD / "native_driver"
    cmd = [
        os.environ.get("CC", "cc"),
        "-O2",
        "-std=c11",
        "-D_POSIX_C_SOURCE=200809L",
        "-Wall",
        "-Wextra",
        f"-I{llama_dir / 'include'}",
        f"-I{llama_dir / 'ggml' / 'include'}",
        str(HERE / "native_driver.c"),
        "-o",
        str(exe),
        f"-L{lib_dir}",
        "-lllama",
        "-lggml",
        "-lggml-base",
        f"-Wl,-rpath,{lib_dir}",
    ]
    if verbose:
        print("$", shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    # the same file as a shared library: its state_step() runs in the Python worker's process
    link = cmd[-5:]  # -L, -l..., rpath
    assert cmd[-7] == "-o" and link[0].startswith("-L")
    subprocess.run([*cmd[:-7], "-shared", "-fPIC", "-o", str(native_lib_path()), *link], check=True)
    return exe, cmd


def native_lib_path() -> Path:
    return BUILD / "native_driver.so"


# What the benches' own C loops (build_shared) start with: llama.h and a clock in seconds.
C_PRELUDE = r"""
#include "llama.h"
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static double now_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}
"""


def build_shared(name: str, source: str, verbose: bool = False) -> ctypes.CDLL:
    """C ``source``, after ``C_PRELUDE``, written to ``build/<name>.c`` and compiled into
    ``build/<name>.so`` with the command of :func:`build_driver` (which first checks that the
    headers are the package's own), loaded as a ``ctypes.CDLL``: a bench's own loop in C, its
    functions declared by the caller."""
    _, cmd = build_driver(verbose=verbose)
    assert cmd[-7] == "-o" and cmd[-8].endswith("native_driver.c"), cmd
    src, so = BUILD / f"{name}.c", BUILD / f"{name}.so"
    src.write_text(C_PRELUDE + source)
    subprocess.run([*cmd[:-8], str(src), "-shared", "-fPIC", "-o", str(so), *cmd[-5:]], check=True)
    return ctypes.CDLL(str(so))


def ptr_addr(p) -> int:
    """A cffi pointer (``ctx.ptr``, ``sampler.ptr``) as an address, for a ctypes ``c_void_p``."""
    import pyllamacpp as pl

    return int(pl.ffi.cast("uintptr_t", p))


def run_json(cmd: list[str]) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench: {shlex.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def native_cmd(exe: Path, model: str, workload: str, s: dict) -> list[str]:
    return [str(exe), model, workload, *(f"{k}={v}" for k, v in s.items())]


def native_lib():
    """native_driver.c built as a shared library (build_driver), its two exported loops declared,
    and a converter of cffi pointers (pl.ffi) to ctypes ones."""
    c = ctypes
    vp, P = c.c_void_p, c.POINTER
    so = c.CDLL(str(native_lib_path()))
    so.decode_in_process.restype = c.c_double
    # native_driver.c: (ctx, smpl, prompt, n_prompt, n_predict, *n_decoded, *sum)
    so.decode_in_process.argtypes = [vp, vp, P(c.c_int32), c.c_int, c.c_int, P(c.c_int), P(c.c_uint32)]
    so.state_step.restype = c.c_int
    so.state_step.argtypes = [vp, P(c.c_double), P(c.c_double), P(c.c_uint)]
    return so, lambda p: vp(ptr_addr(p))
