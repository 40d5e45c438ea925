"""Fill vendor/llama.cpp from the pinned llama-cpp-python sdist (see vendor/llama.cpp/PYLLAMACPP_PIN.txt).

Run by CMake when vendor/llama.cpp has no CMakeLists.txt, or by hand:
    python build_support/fetch_llama_cpp.py [--dest vendor/llama.cpp]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tarfile
import time
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
    cache = fetch.cache_dir() / "sdist"
    cached = (cache / pin["file"]).exists()
    _say(
        f"llama.cpp {pin['commit'][:12]} from {pin['package']} ({pin['file']}): "
        + (f"in the cache {cache}" if cached else f"fetching it with pip download into {cache} (about 77 MB)")
    )
    t0 = time.monotonic()
    sdist = fetch.pip_download(pin["package"], pin["file"], pin["sha256"], cache, binary=False)
    _say(
        f"{sdist.name}: {sdist.stat().st_size / 1e6:.1f} MB, sha256 checked"
        + ("" if cached else f", fetched in {time.monotonic() - t0:.0f} s")
    )
    prefix = pin["subtree"].rstrip("/") + "/"
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix) :]
                members.append(m)
        if not members:
            raise SystemExit(f"error: {sdist.name} has no {prefix} subtree")
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **kwargs)
        n = len(members)
        size = sum(m.size for m in members if m.isfile())
    if not (dest / "CMakeLists.txt").exists():
        raise SystemExit(f"error: extracted {n} entries but {dest}/CMakeLists.txt is missing")
    _say(f"extracted {n} entries ({size / 1e6:.1f} MB) of {pin['file']} (llama.cpp {pin['commit'][:12]}) into {dest}")


def _say(msg: str) -> None:
    # stderr, flushed: CMake shows it as the configure step runs (pip install -v .)
    print(f"pyllamacpp: {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dest", type=Path, default=ROOT / "vendor" / "llama.cpp")
    args = ap.parse_args()
    if (args.dest / "CMakeLists.txt").exists():
        _say(f"{args.dest} is already filled (llama.cpp sources present; nothing fetched)")
        return
    try:
        fill(args.dest)
    except Exception as e:  # CMake shows this line; the traceback would hide it
        raise SystemExit(f"error: could not fill {args.dest}: {e}") from None


if __name__ == "__main__":
    main()
