#!/usr/bin/env bash
# The CUDA wheel variant: the release profile (portable CPU variants) plus GGML_CUDA=ON for
# Ampere to Blackwell, version <version>+cu<major> (a local version tag: the index takes no
# local versions, so these wheels go to a release page or a separate index), with cuBLAS taken
# from NVIDIA's nvidia-cublas wheel as a declared dependency (pyllamacpp preloads it at import).
#
#   PYTHON=/path/to/python JOBS=2 [CUDA_ARCHS="80;86;89;90;100;120"] bash tools/release/build_cuda.sh
#
# Needs nvcc (CUDA >= 12.8 for sm_100/sm_120; the dev machine has 13.0), no GPU. cudart is copied
# into the wheel by auditwheel; libcublas*, libcuda (the driver) stay outside it. On a toolkit
# without the driver stub (lib64/stubs/libcuda.so) ggml cannot link the driver API and is built with
# GGML_CUDA_NO_VMM=ON (the legacy memory pool): a CI image with the full toolkit avoids that.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PYTHON:-python3}
source tools/release/require_tools.sh  # every tool before any work, or say what is missing
OUT=${OUT_DIR:-dist}
ARCHS=${CUDA_ARCHS:-"80;86;89;90;100;120"}
export CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2}
export PYLLAMACPP_PROFILE=release
NVCC=$(command -v nvcc)
CU=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
t0=$(date +%s)
stamp() { echo "== $(date -u +%H:%M:%S) [$(( $(date +%s) - t0 )) s] $*"; }
WORK=$(mktemp -d /tmp/pyllamacpp-cuda.XXXXXX)

stamp "sdist"
"$PY" build_support/fetch_llama_cpp.py
mkdir -p "$OUT/raw-cuda"
"$PY" -m build --sdist --no-isolation --outdir "$OUT" . | tail -1
SDIST=$(ls -t "$OUT"/pyllamacpp_cffi-*.tar.gz | head -1)
tar -xzf "$SDIST" -C "$WORK"
SRC=$(ls -d "$WORK"/pyllamacpp_cffi-*)

stamp "the +cu$CU variant in $SRC: local version, nvidia-cublas dependency"
sed -i -E "s/^__version__ = \"([^\"+]*)\"/__version__ = \"\1+cu$CU\"/" "$SRC/pyllamacpp/_version.py"
sed -i -E "s/^dependencies = \[(.*)\]$/dependencies = [\1, \"nvidia-cublas>=$CU,<$((CU + 1))\"]/" "$SRC/pyproject.toml"
grep -H "__version__" "$SRC/pyllamacpp/_version.py"; grep -H "^dependencies" "$SRC/pyproject.toml"

CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCHS"
if ! ls "$CUDA_HOME"/lib64/libcublas.so >/dev/null 2>&1; then
    stamp "cuBLAS: the toolkit has none; headers and libraries from the nvidia-cublas wheel"
    "$PY" -m pip download -q --no-deps --only-binary=:all: "nvidia-cublas>=$CU,<$((CU + 1))" -d "$WORK/whl"
    # unpacked at a fixed place per wheel: its -I path is part of every CUDA compile's command line,
    # so a temporary folder would make the compiler cache miss all of them on the next run
    CUBLAS_WHL=$(ls "$WORK"/whl/nvidia_cublas-*.whl | head -1)
    CUBLAS_DIR=${CUBLAS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pyllamacpp/$(basename "$CUBLAS_WHL" .whl)}
    [ -d "$CUBLAS_DIR" ] || "$PY" -m zipfile -e "$CUBLAS_WHL" "$CUBLAS_DIR"
    CB=$(dirname "$(find "$CUBLAS_DIR" -name 'libcublas.so.*' | head -1)")
    CMAKE_ARGS="$CMAKE_ARGS -DCUDA_cublas_LIBRARY=$(ls "$CB"/libcublas.so.* | head -1)"
    CMAKE_ARGS="$CMAKE_ARGS -DCUDA_cublasLt_LIBRARY=$(ls "$CB"/libcublasLt.so.* | head -1)"
    CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CUDA_FLAGS=-I$(dirname "$CB")/include"
fi
if ! ls "$CUDA_HOME"/lib64/stubs/libcuda.so "$CUDA_HOME"/lib64/libcuda.so /usr/lib/x86_64-linux-gnu/libcuda.so >/dev/null 2>&1; then
    stamp "no libcuda.so (driver or stub): GGML_CUDA_NO_VMM=ON"
    CMAKE_ARGS="$CMAKE_ARGS -DGGML_CUDA_NO_VMM=ON"
fi
export CMAKE_ARGS
stamp "wheel: CMAKE_ARGS=$CMAKE_ARGS"
"$PY" -m pip wheel -v --no-deps --no-build-isolation --no-index -w "$OUT/raw-cuda" "$SRC"
RAW=$(ls -t "$OUT"/raw-cuda/*+cu"$CU"*.whl | head -1)

stamp "auditwheel repair $RAW (cuBLAS and the driver stay outside)"
"$PY" -m auditwheel repair -w "$OUT" --exclude 'libcublas.so.*' --exclude 'libcublasLt.so.*' \
    --exclude 'libcuda.so.*' "$RAW"
WHEEL=$(ls -t "$OUT"/pyllamacpp_cffi-*+cu"$CU"*manylinux*.whl | head -1)
"$PY" -m auditwheel show "$WHEEL"
stamp "done"
ls -l "$WHEEL"
"$PY" -c "import os, sys; print(f'{os.path.basename(sys.argv[1])}: {os.path.getsize(sys.argv[1]) / 1e6:.1f} MB')" "$WHEEL"
rm -rf "$WORK"
