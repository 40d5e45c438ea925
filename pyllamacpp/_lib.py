"""The one place that imports the compiled extension: re-exports its ``ffi`` and ``lib``.

At import it checks that the extension was built for this Python package and from the same
configure as the libraries next to it; a stale build raises ImportError saying what to rebuild.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ._version import __version__

_REBUILD = "rebuild it: `pip install .` (or `pip install --no-build-isolation -e .` in a checkout)"


def _preload_nvidia_wheels() -> None:
    """A CUDA build links libcublas; when it comes from NVIDIA's PyPI wheels (site-packages/nvidia/
    <name>/lib), the loader does not look there: load those libraries first, globally."""
    info_file = Path(__file__).with_name("_build_info.json")
    try:
        if "cuda" not in json.loads(info_file.read_text()).get("backends", []):
            return
        import nvidia  # namespace package of the nvidia-* wheels
    except (OSError, ValueError, ImportError):
        return
    import ctypes

    if sys.platform == "win32":  # nvidia/<name>/bin/cublas64_13.dll
        names, sub = ("cublasLt64_*.dll", "cublas64_*.dll"), "bin"
    else:
        names, sub = ("libcublasLt.so*", "libcublas.so*"), "lib"
    for base in map(Path, nvidia.__path__):
        for name in names:
            for lib_path in sorted(base.glob(f"*/{sub}/{name}")):
                try:
                    ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass


_preload_nvidia_wheels()
if sys.platform == "win32":  # no RPATH there: the DLLs in _libs are found through this
    os.add_dll_directory(str(Path(__file__).parent / "_libs"))


def _shadowing_source_tree() -> str | None:
    """When this package is a source checkout's folder with no compiled extension (and not an
    editable install), what to tell the user: typically `python` run from the clone's root after a
    non-editable `pip install .`, where the current folder comes first on sys.path."""
    pkg = Path(__file__).resolve().parent
    if (
        not (pkg.parent / "pyproject.toml").is_file()
        or any(pkg.glob("_pyllamacpp*.so"))
        or any(pkg.glob("_pyllamacpp*.pyd"))
    ):
        return None
    installed = ""
    try:
        from importlib.metadata import distribution

        dist = distribution("pyllamacpp-cffi")  # the distribution name, not the import name
        url = json.loads(dist.read_text("direct_url.json") or "{}")
        if url.get("dir_info", {}).get("editable") and url.get("url") == pkg.parent.as_uri():
            return None  # this tree's own editable install: its extension lives elsewhere, a build problem
        ext = [dist.locate_file(f) for f in dist.files or () if f.name.startswith("_pyllamacpp")]
        if ext:
            installed = f" (the installed pyllamacpp, with its extension, is in {Path(str(ext[0])).parent.parent})"
    except Exception:  # noqa: BLE001 (no or odd metadata: the message above is still right)
        pass
    return (
        f"pyllamacpp was imported from the source tree at {pkg}, which has no compiled extension: it "
        f"shadows the installed package{installed}, as the current folder comes first on sys.path; "
        "run from another folder, or install with `pip install -e .`"
    )


try:
    from . import _pyllamacpp
except ImportError as e:  # a missing or half-built extension, or a library it cannot find
    _why = _shadowing_source_tree()
    if _why:
        raise ImportError(_why) from e
    raise ImportError(f"pyllamacpp's compiled extension could not be loaded ({e}); {_REBUILD}") from e

ffi = _pyllamacpp.ffi
lib = _pyllamacpp.lib

EXTENSION_INFO: dict = json.loads(ffi.string(lib.pyllamacpp_build_info()).decode())
"""Facts the build embedded in the extension: llama.cpp commit and source, backends, flags."""

if EXTENSION_INFO.get("pyllamacpp_version") != __version__:
    raise ImportError(
        f"pyllamacpp's compiled extension was built for pyllamacpp "
        f"{EXTENSION_INFO.get('pyllamacpp_version')}, but the Python package is {__version__}; {_REBUILD}"
    )

_installed_info = Path(_pyllamacpp.__file__).with_name("_build_info.json")
if _installed_info.exists():
    _other = json.loads(_installed_info.read_text())
    for _key in ("llama_cpp_commit", "llama_cpp_source", "backends", "pyllamacpp_version"):
        if _other.get(_key) != EXTENSION_INFO.get(_key):
            raise ImportError(
                f"pyllamacpp's compiled extension says {_key}={EXTENSION_INFO.get(_key)!r} but the libraries "
                f"installed with it say {_other.get(_key)!r} ({_installed_info}); {_REBUILD}"
            )

LIB_DIR = Path(_pyllamacpp.__file__).parent / "_libs"
"""Where libllama/libggml* and the backend modules live (the extension finds them through RPATH
``$ORIGIN/_libs``); a folder without ``__init__.py``, so ``pkgutil`` and ``help()`` do not list them."""

__all__ = ["ffi", "lib", "EXTENSION_INFO", "LIB_DIR", "build_info", "backend_function"]

# What ggml names a backend module: [lib]ggml-<name>.so|.dll (ggml-backend-reg.cpp: backend_filename_*).
_MODULE_PREFIX, _MODULE_SUFFIX = ("ggml-", ".dll") if sys.platform == "win32" else ("libggml-", ".so")


def _module_path(name: str) -> Path:
    return LIB_DIR / f"{_MODULE_PREFIX}{name}{_MODULE_SUFFIX}"


def _load_backend_modules() -> None:
    """A GGML_BACKEND_DL build (the release profile) links no backend: register the modules installed
    in ``_libs``. ``ggml_backend_load_all_from_path`` picks the best-scoring CPU variant;
    ``PYLLAMACPP_CPU_VARIANT=<name>`` loads that one instead with ``ggml_backend_load`` (no check that
    this CPU can run it: for tests and comparisons)."""
    if not EXTENSION_INFO.get("backend_dl"):
        return
    # ggml logs each module it loads; pyllamacpp's log callback (_log) is not installed yet, so
    # keep those lines (build_info()["backend_load_log"]) rather than let ggml print them.
    try:
        cb = ffi.callback(
            "ggml_log_callback",
            lambda level, text, ud: BACKEND_LOAD_LOG.append(ffi.string(text).decode("utf-8", "replace")),
        )
    except MemoryError:  # no writable+executable memory for a closure (hardened runtimes): ggml prints
        _load_backend_modules_quiet()
        return
    lib.llama_log_set(cb, ffi.NULL)
    try:
        _load_backend_modules_quiet()
    finally:
        lib.llama_log_set(ffi.NULL, ffi.NULL)


BACKEND_LOAD_LOG: list[str] = []
"""What ggml logged while loading the backend modules at import (release profile)."""


def _load_backend_modules_quiet() -> None:
    variant = os.environ.get("PYLLAMACPP_CPU_VARIANT", "")
    if not variant:
        lib.ggml_backend_load_all_from_path(os.fsencode(LIB_DIR))
        if lib.ggml_backend_reg_by_name(b"CPU") == ffi.NULL:
            raise ImportError(
                f"pyllamacpp: no CPU backend module in {LIB_DIR} could be loaded "
                f"(present: {cpu_variants_present()}); {_REBUILD}"
            )
        return
    names = [f"cpu-{variant}"] + [b for b in EXTENSION_INFO.get("backends", []) if b != "cpu"]
    for name in names:
        path = _module_path(name)
        if not path.exists():
            raise ImportError(
                f"pyllamacpp: PYLLAMACPP_CPU_VARIANT={variant}: no {path.name} in {LIB_DIR} "
                f"(present: {cpu_variants_present()})"
            )
        if lib.ggml_backend_load(os.fsencode(path)) == ffi.NULL:
            raise ImportError(f"pyllamacpp: ggml_backend_load({path}) failed (see the log above)")


def cpu_variants_present() -> list[str]:
    """The CPU backend variants installed in ``_libs`` (release profile), e.g. ``haswell``."""
    pre = f"{_MODULE_PREFIX}cpu-"
    return sorted(p.name[len(pre) : -len(_MODULE_SUFFIX)] for p in LIB_DIR.glob(f"{pre}*{_MODULE_SUFFIX}"))


def cpu_variant_loaded() -> str | None:
    """Which CPU variant module this process loaded (None for a build that links its CPU backend)."""
    for name in cpu_variants_present():
        if _is_loaded(_module_path(f"cpu-{name}")):
            return name
    return None


def _is_loaded(path: Path) -> bool:
    import ctypes

    if sys.platform == "win32":
        return bool(ctypes.WinDLL("kernel32").GetModuleHandleW(str(path)))
    try:  # RTLD_NOLOAD: a handle only if the library is already mapped, nothing is loaded
        ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD)
        return True
    except OSError:
        return False


def backend_function(reg_name: str, name: str, ctype: str):
    """A function a backend exports (e.g. ``ggml_backend_rpc_add_server``): ``lib.<name>`` when the
    backend is linked, else (GGML_BACKEND_DL) ``ggml_backend_reg_get_proc_address`` on the backend
    registered as ``reg_name``, cast to ``ctype``.

    Raises:
        AttributeError: the backend is not registered or does not offer that function.
    """
    try:
        return getattr(lib, name)
    except AttributeError:
        pass
    reg = lib.ggml_backend_reg_by_name(reg_name.encode())
    if reg == ffi.NULL:
        raise AttributeError(f"{name}: no backend {reg_name!r} is registered")
    ptr = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if ptr == ffi.NULL:
        raise AttributeError(f"{name}: backend {reg_name!r} does not offer it (ggml_backend_reg_get_proc_address)")
    return ffi.cast(ctype, ptr)


_load_backend_modules()


def _str(p) -> str:
    return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else ""


def build_info() -> dict:
    """What this build is: llama.cpp commit and source, backends (compiled, and registered now),
    devices, compiler and flags, where the libraries are, and ``llama_print_system_info()``.

    Returns:
        EXTENSION_INFO's keys plus ``registered_backends`` (``ggml_backend_reg_name`` of each),
        ``devices`` (name and description of each ``ggml_backend_dev_get``), ``system_info``,
        ``lib_dir``, the CPU variants present and loaded, the backend load log and the loaded
        libraries' paths.
    """
    info = dict(EXTENSION_INFO)
    info["registered_backends"] = [
        _str(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i))) for i in range(lib.ggml_backend_reg_count())
    ]
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        devices.append(
            {"name": _str(lib.ggml_backend_dev_name(dev)), "description": _str(lib.ggml_backend_dev_description(dev))}
        )
    info["devices"] = devices
    info["system_info"] = _str(lib.llama_print_system_info()).strip()
    info["lib_dir"] = str(LIB_DIR)
    info["cpu_variants_present"] = cpu_variants_present()
    info["cpu_variant_loaded"] = cpu_variant_loaded()
    info["backend_load_log"] = "".join(BACKEND_LOAD_LOG).strip()
    info["loaded_libraries"] = _loaded_libraries()
    return info


def _loaded_libraries() -> list[str]:
    """Paths of libllama/libggml* this process mapped (Linux: /proc/self/maps), to show RPATH at work."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line and (".so" in line)}
    except OSError:
        return []
    return sorted(p for p in paths if Path(p).name.startswith(("libllama", "libggml")))
