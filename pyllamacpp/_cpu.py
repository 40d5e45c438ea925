"""How many threads to compute with: llama.cpp's tools' choice, ported (pure Python, no extension).

``llama_context_default_params()`` says 4 threads (``GGML_DEFAULT_N_THREADS``) whatever the machine;
llama.cpp's own tools (llama-cli, llama-server, llama-bench...) take ``common_cpu_get_num_math()``
from common/common.cpp instead: the number of physical cores, without the efficiency cores of a
hybrid Intel CPU. This module gives the same number, and also honours what the process may use.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from pathlib import Path

_SYS_CPU = Path("/sys/devices/system/cpu")


def _cpulist(text: str) -> set[int]:
    """The CPUs of a Linux cpulist ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus.update(range(int(a), int(b) + 1))
        elif part:
            cpus.add(int(part))
    return cpus


def _fallback(n_logical: int) -> int:
    # common_cpu_get_num_physical_cores' last resort: hardware_concurrency, halved above 4
    return n_logical if n_logical <= 4 else n_logical // 2


def _linux_physical_cores(allowed: set[int]) -> int:
    """Distinct ``topology/thread_siblings`` masks among the CPUs this process may run on, as
    common_cpu_get_num_physical_cores counts them (it looks at every CPU: here only the allowed
    ones, so ``taskset -c 0,1`` gives 2 on a 64-core machine). E-cores of a hybrid CPU
    (/sys/devices/cpu_atom/cpus) are left out, as common_cpu_get_num_math does through cpuid;
    0 when sysfs says nothing."""
    try:
        atom = _cpulist((Path("/sys/devices/cpu_atom/cpus")).read_text())
    except (OSError, ValueError):
        atom = set()
    siblings: set[str] = set()
    for cpu in sorted(allowed - atom) or sorted(allowed):  # all E-cores: use them rather than none
        try:
            siblings.add((_SYS_CPU / f"cpu{cpu}" / "topology" / "thread_siblings").read_text().strip())
        except OSError:
            continue
    return len(siblings)


def _cgroup_cpus() -> int | None:
    """The CPU quota of this process's cgroup (v2 ``cpu.max``), rounded up; None when unlimited.
    A container started with ``--cpus 2`` on a 64-core host sees all 64 in its affinity."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def _macos_physical_cores() -> int:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    for name in (b"hw.perflevel0.physicalcpu", b"hw.physicalcpu"):  # performance cores, else all cores
        value, size = ctypes.c_int32(0), ctypes.c_size_t(4)
        if (
            libc.sysctlbyname(name, ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)) == 0
            and value.value > 0
        ):
            return value.value
    return 0


@functools.cache
def default_n_threads() -> int:
    """Threads for ``n_threads`` and ``n_threads_batch`` when none are given: the number of physical
    cores this process may use, as llama.cpp's tools decide it (``common_cpu_get_num_math()``).

    - Linux: distinct ``/sys/devices/system/cpu/cpu<N>/topology/thread_siblings`` masks over the
      CPUs of ``os.sched_getaffinity(0)``, without a hybrid CPU's E-cores
      (``/sys/devices/cpu_atom/cpus``), capped by a cgroup v2 CPU quota (``cpu.max``); on
      ppc64, times the SMT factor up to 2, as llama.cpp does.
    - macOS: ``sysctl hw.perflevel0.physicalcpu`` (the performance cores), else ``hw.physicalcpu``.
    - elsewhere (Windows...): the logical CPU count, halved above 4 (llama.cpp's own fallback).

    Always at least 1. Computed once per process.

    Returns:
        The thread count.
    """
    n = 0
    if sys.platform.startswith("linux"):
        allowed = os.sched_getaffinity(0)
        n = _linux_physical_cores(allowed) or _fallback(len(allowed))
        if platform.machine().startswith(("ppc64", "powerpc")):
            n = n * min(max(len(allowed) // max(n, 1), 1), 2)  # common_cpu_get_num_math on powerpc
        quota = _cgroup_cpus()
        if quota is not None:
            n = min(n, quota)
    elif sys.platform == "darwin":
        try:
            n = _macos_physical_cores()
        except (OSError, AttributeError):
            n = 0
    if n <= 0:
        n = _fallback(os.cpu_count() or 1)
    return max(1, n)
