"""The raw binding: coverage of llama.h, struct layouts, constants, callbacks, and a smoke run."""
from __future__ import annotations

import json
import os
import logging
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pyllamacpp
from pyllamacpp import ffi, lib

from conftest import llama_cpp_dir


def _header_functions(path) -> set[str]:
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)  # the LLAMA_API / DEPRECATED macros themselves
    # Every "LLAMA_API <type> name(" declaration, including ones wrapped in DEPRECATED(...).
    text = re.sub(r"LLAMA_API\s+DEPRECATED\(", "LLAMA_API ", text)  # LLAMA_API DEPRECATED(decl, hint)
    return set(re.findall(r"LLAMA_API\b[^;(]*?\b([A-Za-z_]\w*)\s*\(", text))


def test_every_llama_api_function_is_bound():
    declared = _header_functions(llama_cpp_dir() / "include" / "llama.h")
    assert len(declared) > 200  # the regex found the API, not a handful of names
    bound = {name for name in dir(lib) if name.startswith("llama_")}
    assert declared - bound == set(), "declared in llama.h but not reachable through lib"
    assert bound - declared == set(), "reachable through lib but not declared in llama.h"
    for name in declared:
        assert callable(getattr(lib, name))


def test_struct_layout_matches_the_compiler():
    # API mode: cffi emitted C that checks each field's offset and each struct's size against the
    # real header when the extension was compiled. Read them back and cross-check with a fresh
    # compile of a tiny C program against the same headers.
    names = ["llama_batch", "llama_context_params", "llama_model_params", "llama_perf_context_data",
             "llama_sampler_chain_params", "ggml_tensor"]
    structs = {n: [f for f, _ in ffi.typeof(f"struct {n}").fields] for n in names}
    assert "n_outputs_max_per_seq" in structs["llama_context_params"]
    src = ["#include <stdio.h>", "#include <stddef.h>", '#include "llama.h"', "int main(void) {"]
    for s, fields in structs.items():
        src.append(f'printf("{s} %zu\\n", sizeof(struct {s}));')
        for f in fields:
            src.append(f'printf("{s}.{f} %zu\\n", offsetof(struct {s}, {f}));')
    src.append("return 0; }")
    import tempfile
    from pathlib import Path
    d = llama_cpp_dir()
    with tempfile.TemporaryDirectory() as tmp:
        c = Path(tmp) / "layout.c"
        c.write_text("\n".join(src))
        exe = Path(tmp) / "layout"
        subprocess.run(["cc", "-o", str(exe), str(c), f"-I{d / 'include'}", f"-I{d / 'ggml' / 'include'}"],
                       check=True)
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    compiled = dict(line.rsplit(" ", 1) for line in out.splitlines())
    for s, fields in structs.items():
        assert ffi.sizeof(f"struct {s}") == int(compiled[s])
        for f in fields:
            assert ffi.offsetof(f"struct {s}", f) == int(compiled[f"{s}.{f}"]), f"{s}.{f}"


def test_defines_are_available():
    assert lib.LLAMA_DEFAULT_SEED == 0xFFFFFFFF
    assert lib.LLAMA_TOKEN_NULL == -1
    assert lib.LLAMA_SESSION_MAGIC == lib.LLAMA_FILE_MAGIC_GGSN == 0x6767736E
    assert lib.LLAMA_STATE_SEQ_MAGIC == lib.LLAMA_FILE_MAGIC_GGSQ == 0x67677371
    assert lib.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY == 1 and lib.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE == 2
    # the values come from the header, not from a copy: compare with the text
    h = (llama_cpp_dir() / "include" / "llama.h").read_text()
    assert int(re.search(r"#define LLAMA_SESSION_VERSION (\d+)", h).group(1)) == lib.LLAMA_SESSION_VERSION
    assert int(re.search(r"#define LLAMA_STATE_SEQ_VERSION (\d+)", h).group(1)) == lib.LLAMA_STATE_SEQ_VERSION


def test_build_info_names_the_pin_and_the_libraries():
    info = pyllamacpp.build_info()
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", info["llama_cpp_commit"])
    assert "cpu" in info["backends"] and "CPU" in info["registered_backends"]
    assert info["pyllamacpp_version"] == pyllamacpp.__version__
    # found through RPATH $ORIGIN: every libllama/libggml mapped comes from the package folder
    assert info["loaded_libraries"], "no libllama/libggml mapped?"
    for p in info["loaded_libraries"]:
        assert p.startswith(info["lib_dir"]), p
    if info["llama_cpp_source"].startswith("pinned"):
        pin = (llama_cpp_dir() / "PYLLAMACPP_PIN.txt").read_text()
        assert f"commit={info['llama_cpp_commit']}" in pin


def test_import_fails_clearly_on_a_version_mismatch(tmp_path):
    # Simulate a stale build: the Python package says another version than the extension.
    code = textwrap.dedent("""
        import pyllamacpp._version as v
        v.__version__ = "999.0"
        try:
            import pyllamacpp._lib
        except ImportError as e:
            print("IMPORTERROR", e)
    """)
    # run outside the checkout, so the installed package (not the source folder) is imported
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path).stdout
    assert "IMPORTERROR" in out and "999.0" in out and "rebuild" in out


def test_log_callback_routes_into_python_logging(model_path, caplog):
    caplog.set_level(logging.DEBUG, logger="pyllamacpp.llama")
    mparams = lib.llama_model_default_params()
    model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
    assert model != ffi.NULL
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = 512
    ctx = lib.llama_init_from_model(model, cparams)
    try:
        lines = [r.getMessage() for r in caplog.records if r.name == "pyllamacpp.llama"]
        assert any("compute buffer size" in line for line in lines)
        assert any(re.search(r"KV buffer size\s*=\s*[\d.]+ MiB", line) for line in lines)
    finally:
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def test_callbacks_can_be_written_in_python(model_path):
    # The trampolines exist with the exact C types llama.cpp expects (checked at compile time);
    # here: progress during load, abort during decode.
    seen = []

    @ffi.callback("bool(float, void *)")
    def progress(p, _):
        seen.append(p)
        return True

    mparams = lib.llama_model_default_params()
    mparams.progress_callback = progress
    model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
    assert model != ffi.NULL and seen and seen[-1] == pytest.approx(1.0)
    lib.llama_model_free(model)
    for name in ("_pyllamacpp_log_cb", "_pyllamacpp_abort_cb", "_pyllamacpp_eval_cb", "_pyllamacpp_progress_cb"):
        assert hasattr(lib, name)


def _tokenize(vocab, text: str) -> np.ndarray:
    raw = text.encode()
    buf = ffi.new("llama_token[]", len(raw) + 8)
    n = lib.llama_tokenize(vocab, raw, len(raw), buf, len(raw) + 8, True, False)
    assert n > 0
    return np.frombuffer(ffi.buffer(buf, n * 4), dtype=np.int32).copy()


def _decode(ctx, batch, tokens, start_pos):
    batch.n_tokens = len(tokens)
    for i, t in enumerate(tokens):
        batch.token[i] = int(t)
        batch.pos[i] = start_pos + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == len(tokens) - 1
    assert lib.llama_decode(ctx, batch) == 0


def test_raw_smoke_decode_and_state_round_trip(model_path):
    model = lib.llama_model_load_from_file(str(model_path).encode(), lib.llama_model_default_params())
    assert model != ffi.NULL
    vocab = lib.llama_model_get_vocab(model)
    n_vocab = lib.llama_vocab_n_tokens(vocab)
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = 256
    cparams.n_threads = cparams.n_threads_batch = 2
    ctx = lib.llama_init_from_model(model, cparams)
    assert ctx != ffi.NULL
    batch = lib.llama_batch_init(64, 0, 1)
    try:
        tokens = _tokenize(vocab, "The cat sat on the mat.")
        assert tokens.tolist() == [504, 2644, 2643, 335, 260, 1171, 30]  # as in LLAMA_CPP_FACTS
        _decode(ctx, batch, tokens, 0)
        logits = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, -1), n_vocab * 4), dtype=np.float32)
        assert logits.shape == (n_vocab,) and np.isfinite(logits).all()
        nxt = int(np.argmax(logits))

        # Reference: next-token logits after feeding `nxt`, computed straight away.
        _decode(ctx, batch, [nxt], len(tokens))
        ref = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, -1), n_vocab * 4), dtype=np.float32).copy()

        mem = lib.llama_get_memory(ctx)
        assert lib.llama_memory_seq_rm(mem, 0, len(tokens), -1)  # back to the 7-token prompt
        size = lib.llama_state_seq_get_size_ext(ctx, 0, 0)
        blob = ffi.new("uint8_t[]", size)
        assert lib.llama_state_seq_get_data_ext(ctx, blob, size, 0, 0) == size
        assert size > 7 * 23040  # K and V for 30 layers x 7 tokens at least
        lib.llama_memory_clear(mem, True)
        assert lib.llama_memory_seq_pos_max(mem, 0) == -1
        assert lib.llama_state_seq_set_data_ext(ctx, blob, size, 0, 0) == size
        assert lib.llama_memory_seq_pos_max(mem, 0) == len(tokens) - 1

        _decode(ctx, batch, [nxt], len(tokens))
        after = np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(ctx, -1), n_vocab * 4), dtype=np.float32)
        # Restored into the same cells: llama.cpp gives bit-identical logits (see LLAMA_CPP_FACTS).
        np.testing.assert_array_equal(after, ref)
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
        lib.llama_model_free(model)


def test_fetch_refuses_a_file_with_the_wrong_sha256(tmp_path):
    # A local wheel stands in for the registry: pip download copies it, the hash check must refuse it.
    import zipfile
    from pyllamacpp._fetch import FetchError, pip_download, sha256_file
    whl = tmp_path / "src" / "fakepkg-0.1-py3-none-any.whl"
    whl.parent.mkdir()
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("fakepkg/__init__.py", "")
        z.writestr("fakepkg-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakepkg\nVersion: 0.1\n")
        z.writestr("fakepkg-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("fakepkg-0.1.dist-info/RECORD", "")
    dest = tmp_path / "dest"
    with pytest.raises(FetchError, match="sha256 mismatch"):
        pip_download(str(whl), whl.name, "0" * 64, dest, binary=True)
    assert not (dest / whl.name).exists()  # nothing unverified is left behind
    good = pip_download(str(whl), whl.name, sha256_file(whl), dest, binary=True)
    assert good.exists()


def test_cmake_configures_against_a_user_checkout(tmp_path):
    # LLAMA_CPP_DIR replaces the pinned source; the build records where it came from.
    import shutil
    cmake = shutil.which("cmake")
    if cmake is None or pyllamacpp.build_info()["llama_cpp_source"].startswith("LLAMA_CPP_DIR"):
        pytest.skip("needs cmake on PATH and a build from the pinned source")
    from conftest import ROOT
    checkout = tmp_path / "my-llama.cpp"
    checkout.symlink_to(ROOT / "vendor" / "llama.cpp", target_is_directory=True)
    env = dict(os.environ, LLAMA_CPP_DIR=str(checkout))
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    proc = subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path / "b"), *gen, "-DCMAKE_BUILD_TYPE=Release",
                           f"-DPython_EXECUTABLE={sys.executable}"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads((tmp_path / "b" / "_build_info.json").read_text())
    assert info["llama_cpp_source"] == f"LLAMA_CPP_DIR={checkout}"
    assert info["llama_cpp_commit"] == "unknown"  # not a git checkout


def test_an_exception_in_a_log_handler_is_raised_after_the_c_call(tmp_path):
    # The log callback runs inside C: an exception there is kept and raised once C has returned.
    from pyllamacpp import _log

    class Boom(logging.Handler):
        def emit(self, record):
            raise KeyError("from the handler")

        def handleError(self, record):  # logging would swallow it otherwise
            raise

    lg = logging.getLogger("pyllamacpp.llama")
    h = Boom(level=logging.ERROR)
    lg.addHandler(h)
    try:
        with pytest.raises(KeyError, match="from the handler"):
            with _log.capture():
                ptr = lib.llama_model_load_from_file(str(tmp_path / "missing.gguf").encode(),
                                                     lib.llama_model_default_params())
        assert ptr == ffi.NULL  # C finished its work: the exception came after it returned
    finally:
        lg.removeHandler(h)
    with _log.capture():  # nothing left over for the next call
        lib.llama_model_load_from_file(str(tmp_path / "missing.gguf").encode(), lib.llama_model_default_params())


def test_debug_lines_reach_python_only_when_the_logger_wants_them(model_path, caplog):
    # pyl_log_cb keeps llama.cpp's DEBUG lines in C (about 1,100 per context creation) unless
    # logger pyllamacpp.llama is enabled for DEBUG; INFO and above always come through.
    import pyllamacpp as pl
    levels = {}
    with pl.Model(model_path) as model:
        for level in (logging.INFO, logging.DEBUG):
            caplog.set_level(level, logger="pyllamacpp.llama")
            with model.context(n_ctx=256, n_threads=2) as ctx:
                levels[level] = {lvl for lvl, _ in ctx.creation_log}
                assert ctx.buffers["CPU"]["KV"] > 0 and ctx.flash_attn in (True, False)
    assert logging.DEBUG not in levels[logging.INFO] and logging.INFO in levels[logging.INFO]
    assert logging.DEBUG in levels[logging.DEBUG]
