"""The one place that imports the compiled extension: re-exports its ``ffi`` and ``lib``.

At import it checks that the extension was built for this Python package and from the same
configure as the libraries next to it; a stale build raises ImportError saying what to rebuild.
"""
from __future__ import annotations

import json
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
    for base in map(Path, nvidia.__path__):
        for name in ("libcublasLt.so*", "libcublas.so*"):
            for lib_path in sorted(base.glob(f"*/lib/{name}")):
                try:
                    ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass


_preload_nvidia_wheels()

try:
    from . import _pyllamacpp
except ImportError as e:  # a missing or half-built extension, or a library it cannot find
    raise ImportError(f"pyllamacpp's compiled extension could not be loaded ({e}); {_REBUILD}") from e

ffi = _pyllamacpp.ffi
lib = _pyllamacpp.lib

EXTENSION_INFO: dict = json.loads(ffi.string(lib.pyllamacpp_build_info()).decode())
"""Facts the build embedded in the extension: llama.cpp commit and source, backends, flags."""

if EXTENSION_INFO.get("pyllamacpp_version") != __version__:
    raise ImportError(
        f"pyllamacpp's compiled extension was built for pyllamacpp "
        f"{EXTENSION_INFO.get('pyllamacpp_version')}, but the Python package is {__version__}; {_REBUILD}")

_installed_info = Path(_pyllamacpp.__file__).with_name("_build_info.json")
if _installed_info.exists():
    _other = json.loads(_installed_info.read_text())
    for _key in ("llama_cpp_commit", "llama_cpp_source", "backends", "pyllamacpp_version"):
        if _other.get(_key) != EXTENSION_INFO.get(_key):
            raise ImportError(
                f"pyllamacpp's compiled extension says {_key}={EXTENSION_INFO.get(_key)!r} but the libraries "
                f"installed with it say {_other.get(_key)!r} ({_installed_info}); {_REBUILD}")

LIB_DIR = Path(_pyllamacpp.__file__).parent
"""Where the extension and libllama/libggml* live (found through RPATH $ORIGIN)."""

__all__ = ["ffi", "lib", "EXTENSION_INFO", "LIB_DIR", "build_info"]


def _str(p) -> str:
    return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else ""


def build_info() -> dict:
    """What this build is: llama.cpp commit and source, backends (compiled, and registered now),
    devices, compiler and flags, where the libraries are, and ``llama_print_system_info()``."""
    info = dict(EXTENSION_INFO)
    info["registered_backends"] = [_str(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)))
                                   for i in range(lib.ggml_backend_reg_count())]
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        devices.append({"name": _str(lib.ggml_backend_dev_name(dev)),
                        "description": _str(lib.ggml_backend_dev_description(dev))})
    info["devices"] = devices
    info["system_info"] = _str(lib.llama_print_system_info()).strip()
    info["lib_dir"] = str(LIB_DIR)
    info["loaded_libraries"] = _loaded_libraries()
    return info


def _loaded_libraries() -> list[str]:
    """Paths of libllama/libggml* this process mapped (Linux: /proc/self/maps), to show RPATH at work."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/lib" in line and (".so" in line)}
    except OSError:
        return []
    return sorted(p for p in paths if Path(p).name.startswith(("libllama", "libggml")))
