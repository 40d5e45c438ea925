#!/usr/bin/env bash
# On the device machine (one NVIDIA GPU, nvcc, no network), from the repo root, after
# tools/gpu/prepare.sh here and with .gpu carried:
#
#   bash tools/gpu/run.sh            (GPU_CHECK_CPU=1: the same without CUDA, to try it anywhere)
#
# Builds the package from .gpu's sdist with -DGGML_CUDA=ON for the GPU's architecture into
# /tmp/pl, then runs tools/gpu/check.py. Everything it prints goes to $OUT/run.log as well;
# check.py writes $OUT/gpu_check.json. Exits non-zero when the build or a check fails.
set -euo pipefail
REPO=$(pwd)
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! $PY -c "import cffi, pycparser, gguf" 2>/dev/null; then  # the device image lacks them
    $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/whl/*.whl
fi
export PYTHONPATH=/tmp/site
SDIST=$(ls .gpu/pyllamacpp-*.tar.gz)
ARGS=()
if [ "${GPU_CHECK_CPU:-0}" = 1 ]; then
    CMAKE_ARGS=""
    ARGS=(--cpu-only)
else
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv || true
    nvcc --version | tail -2
    ARCH=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
    CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${ARCH:-90}"
    # cuBLAS: the toolkit's when it has one, else the nvidia-cublas wheel's (versioned names only,
    # so CMake is told where; the package preloads it at import)
    if ! ls "$(dirname "$(dirname "$(command -v nvcc)")")"/lib64/libcublas.so >/dev/null 2>&1; then
        LIB=$($PY -c "import glob, site; print(sorted(glob.glob(site.getsitepackages()[0] + '/nvidia/**/libcublas.so.*', recursive=True))[0])")
        LIBDIR=$(dirname "$LIB")
        CMAKE_ARGS="$CMAKE_ARGS -DCUDA_cublas_LIBRARY=$LIB -DCUDA_cublasLt_LIBRARY=$(ls "$LIBDIR"/libcublasLt.so.* | head -1)"
        CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CUDA_FLAGS=-I$(dirname "$LIBDIR")/include"
    fi
fi
echo "CMAKE_ARGS=$CMAKE_ARGS"
START=$(date +%s)
CMAKE_ARGS="$CMAKE_ARGS" $PY -m pip install -q --no-build-isolation --no-deps --no-index --upgrade \
    --target /tmp/pl "$SDIST"
echo "build + install: $(( $(date +%s) - START )) s"
export PYTHONPATH=/tmp/pl:/tmp/site
cd /tmp  # not the repo root: its pyllamacpp/ folder would shadow the installed package
$PY "$REPO/tools/gpu/check.py" --out "$OUT" "${ARGS[@]}"
