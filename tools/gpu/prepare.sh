#!/usr/bin/env bash
# Here, before a device run: put under .gpu/ (ignored through .git/info/exclude) what the device
# machine needs and cannot fetch: this package's sdist (it carries the parts of llama.cpp the
# library build reads, ~5 MB; the pinned llama-cpp-python sdist is 77 MB, over the 64 MiB a run
# may carry) and wheels of cffi, pycparser and gguf for the device's Python 3.12 (its image has
# numpy, scikit-build-core, cmake, ninja, pytest, nvcc and the nvidia-cublas wheel).
#
#   bash tools/gpu/prepare.sh      then the device run:  bash tools/gpu/run.sh   (carry: .gpu)
#
# CUDA_WHEEL=dist/pyllamacpp_cffi-<v>+cu13-...manylinux...whl (tools/release/build_cuda.sh) puts that
# wheel under .gpu/ as well: run.sh then installs it instead of building (it must fit, with the
# rest, in the 64 MiB a run carries: build it for the device's architecture only, CUDA_ARCHS=90).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
python -m build --sdist --no-isolation --outdir .gpu . >/dev/null
if [ -n "${CUDA_WHEEL:-}" ]; then
    cp "$CUDA_WHEEL" .gpu/
fi
ver() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "cffi==$(ver cffi)" "pycparser==$(ver pycparser)" "gguf==$(ver gguf)"
ls -l .gpu .gpu/whl
du -sh .gpu
