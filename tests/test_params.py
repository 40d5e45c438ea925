"""ContextParams: every field, defaults from the library, validation before C, effective values."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import pyllamacpp as pl
from pyllamacpp import ffi, lib
from pyllamacpp.params import default_n_ctx, default_n_threads


def test_every_field_with_library_defaults():
    names = [f for f, _ in ffi.typeof("struct llama_context_params").fields]
    p = pl.ContextParams()
    assert [f.name for f in dataclasses.fields(p)] == names
    d = lib.llama_context_default_params()
    for n in ("n_batch", "n_ubatch", "n_seq_max", "n_outputs_max_per_seq", "kv_unified", "type_k"):
        assert getattr(p, n) == getattr(d, n)
    # the three that fit the machine and the model instead (see test_threads_default_*)
    assert p.n_ctx is None and p.n_threads == p.n_threads_batch == default_n_threads()


def test_names_for_types_and_flash_attention():
    p = pl.ContextParams(type_k="q8_0", type_v="BF16", flash_attn_type="on")
    assert p.type_k == lib.GGML_TYPE_Q8_0 and p.type_v == lib.GGML_TYPE_BF16
    assert p.flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert pl.ContextParams(flash_attn_type="off").flash_attn_type == lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert pl.ContextParams(pooling_type="mean").pooling_type == lib.LLAMA_POOLING_TYPE_MEAN


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(type_k="q9_9"), "type_k"),
        (dict(type_v=10_000), "type_v"),
        (dict(n_seq_max=100_000), "n_seq_max"),
        (dict(n_ctx=-1), "n_ctx"),
        (dict(n_batch=-5), "n_batch"),
        (dict(flash_attn_type="maybe"), "flash_attn_type"),
        (dict(n_threads=0), "n_threads"),
        (dict(kv_unified="yes"), "kv_unified"),
    ],
)
def test_bad_values_raise_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        pl.ContextParams(**bad)


def test_effective_values_after_clamps(model):
    with model.context(n_ctx=256, n_batch=64, n_ubatch=512, n_threads=2) as ctx:
        assert (ctx.n_batch, ctx.n_ubatch) == (64, 64)
        assert ctx.n_ctx == 256 and ctx.n_seq_max == 1
    with pytest.raises(TypeError, match="unknown"):
        model.context(n_ctxx=5)


def _physical_cores_from_sysfs(allowed: set[int]) -> int:
    """Counted another way than default_n_threads: distinct (package, core) ids, as lscpu does."""
    cores = set()
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
    return len(cores)


def test_threads_default_to_the_physical_cores():
    n = default_n_threads()
    assert n >= 1
    if sys.platform.startswith("linux") and Path("/sys/devices/system/cpu/cpu0/topology/core_id").exists():
        expected = _physical_cores_from_sysfs(os.sched_getaffinity(0))
        if not Path("/sys/fs/cgroup/cpu.max").exists() and not Path("/sys/devices/cpu_atom").exists():
            assert n == expected
        assert n <= expected
    assert n <= (os.cpu_count() or 1)
    assert pl.ContextParams().n_threads == n and pl.ContextParams().n_threads_batch == n
    assert pl.ContextParams(n_threads=1).n_threads_batch == n  # each field has its own default


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a CPU affinity of at least 2 CPUs to narrow",
)
def test_threads_default_follows_the_cpu_affinity():
    """`taskset -c 0 python ...`: one allowed CPU is one thread, whatever the machine has."""
    one = min(os.sched_getaffinity(0))
    code = (
        f"import os; os.sched_setaffinity(0, {{{one}}}); from pyllamacpp._cpu import default_n_threads; "
        "print(default_n_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()
    ).stdout
    assert out.strip() == "1"


def test_n_ctx_default_is_resolved_with_the_model():
    assert default_n_ctx(8192) == 4096 and default_n_ctx(2048) == 2048 and default_n_ctx(0) == 4096
    p = pl.ContextParams()
    with pytest.raises(ValueError, match="n_ctx: None"):
        p.to_c()  # None has no C value: the Context resolves it
    assert pl.ContextParams(n_ctx=0).to_c().n_ctx == 0  # llama.cpp's "n_ctx_train"
