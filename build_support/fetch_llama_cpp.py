"""Fill vendor/llama.cpp from the pinned llama-cpp-python sdist (see vendor/llama.cpp/PYLLAMACPP_PIN.txt).

Run by CMake when vendor/llama.cpp has no CMakeLists.txt, or by hand:
    python build_support/fetch_llama_cpp.py [--dest vendor/llama.cpp]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _load_fetch():
    # The package is not built yet: load its stdlib-only fetch module by path.
    spec = importlib.util.spec_from_file_location("_pyllamacpp_fetch", ROOT / "pyllamacpp" / "_fetch.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fill(dest: Path) -> None:
    fetch = _load_fetch()
    pin = fetch.read_pin(dest / "PYLLAMACPP_PIN.txt")
    sdist = fetch.pip_download(pin["package"], pin["file"], pin["sha256"],
                               fetch.cache_dir() / "sdist", binary=False)
    prefix = pin["subtree"].rstrip("/") + "/"
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix):]
                members.append(m)
        if not members:
            raise SystemExit(f"error: {sdist.name} has no {prefix} subtree")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
        n = len(members)
    if not (dest / "CMakeLists.txt").exists():
        raise SystemExit(f"error: extracted {n} entries but {dest}/CMakeLists.txt is missing")
    print(f"pyllamacpp: extracted {n} entries of {pin['file']} (llama.cpp {pin['commit'][:12]}) into {dest}",
          file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dest", type=Path, default=ROOT / "vendor" / "llama.cpp")
    args = ap.parse_args()
    if (args.dest / "CMakeLists.txt").exists():
        print(f"pyllamacpp: {args.dest} is already filled", file=sys.stderr)
        return
    try:
        fill(args.dest)
    except Exception as e:  # CMake shows this line; the traceback would hide it
        raise SystemExit(f"error: could not fill {args.dest}: {e}")


if __name__ == "__main__":
    main()
