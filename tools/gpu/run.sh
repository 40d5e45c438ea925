#!/usr/bin/env bash
# On the device machine (one NVIDIA GPU, nvcc, no network), from the repo root, after
# tools/gpu/prepare.sh here and with .gpu carried:
#
#   bash tools/gpu/run.sh            (GPU_CHECK_CPU=1: the same without CUDA, to try it anywhere)
#
# Installs .gpu's prebuilt CUDA wheel when there is one (prepare.sh with CUDA_WHEEL=), else builds
# the package from .gpu's sdist with -DGGML_CUDA=ON for the GPU's architecture, into /tmp/pl; then
# prints what was installed (profile, backends, CPU variant) and runs tools/gpu/check.py.
# Everything it prints goes to $OUT/run.log as well; check.py writes $OUT/gpu_check.json. Exits non-zero when the build or a check fails.
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
SDIST=$(ls .gpu/pyllamacpp_cffi-*.tar.gz)
CUDA_WHEEL=$(ls .gpu/pyllamacpp_cffi-*+cu*.whl 2>/dev/null | head -1 || true)
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
START=$(date +%s)
if [ -n "$CUDA_WHEEL" ] && [ "${GPU_CHECK_CPU:-0}" != 1 ]; then
    # the prebuilt CUDA wheel (release profile): no build; cuBLAS from the image's nvidia-cublas wheel
    echo "installing $CUDA_WHEEL (no build)"
    $PY -m pip install -q --no-deps --no-index --upgrade --target /tmp/pl "$CUDA_WHEEL"
    echo "install: $(( $(date +%s) - START )) s"
else
    echo "CMAKE_ARGS=$CMAKE_ARGS"
    CMAKE_ARGS="$CMAKE_ARGS" $PY -m pip install -q --no-build-isolation --no-deps --no-index --upgrade \
        --target /tmp/pl "$SDIST"
    echo "build + install: $(( $(date +%s) - START )) s"
fi
export PYTHONPATH=/tmp/pl:/tmp/site
cd /tmp  # not the repo root: its pyllamacpp/ folder would shadow the installed package
$PY -c "import pyllamacpp._lib as l; i = l.build_info(); print('installed:', i['pyllamacpp_version'], i.get('profile'), i['backends'], 'CPU variant', i['cpu_variant_loaded'], [d['name'] for d in i['devices']])"
$PY -X faulthandler "$REPO/tools/gpu/check.py" --out "$OUT" "${ARGS[@]}"
