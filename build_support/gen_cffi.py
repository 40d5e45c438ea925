"""Generate the cffi extension's C source from the vendored headers (run by CMake at build time).

Nothing here lists llama.cpp's declarations by hand. The steps:

1. Run the real C compiler's preprocessor over ``llama.h`` (and any extra backend headers), with the
   C standard headers replaced by empty stubs, so only llama.cpp's and ggml's own declarations remain
   and the integer types are left as names cffi knows (``int32_t``, ``size_t``, ``FILE``...).
2. Parse that with pycparser and write it back out as a cffi ``cdef``: function bodies dropped,
   array lengths that are expressions (``GGML_MAX_OP_PARAMS / sizeof(int32_t)``) become ``[...]``
   so the compiler fills them in.
3. Take every object-like ``#define`` of those headers whose value is an integer expression and
   declare it as ``#define NAME ...``: cffi then asks the compiler for its value.
4. ``emit_c_code`` in API mode: the generated C includes the real headers, so the C compiler checks
   every declaration, struct field offset and size against them when the extension is compiled.

A llama.cpp bump therefore needs no edit of any declaration file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import cffi
from pycparser import c_ast, c_generator, c_parser

# Types cffi knows without a typedef; pycparser needs them declared to parse.
_BUILTIN_TYPES = [
    "size_t",
    "ssize_t",
    "ptrdiff_t",
    "intptr_t",
    "uintptr_t",
    "bool",
    "FILE",
    "int8_t",
    "int16_t",
    "int32_t",
    "int64_t",
    "uint8_t",
    "uint16_t",
    "uint32_t",
    "uint64_t",
    "va_list",
]
_STUB_HEADERS = ["stddef.h", "stdint.h", "stdio.h", "stdbool.h", "stdlib.h", "string.h", "stdarg.h"]

# Written in Python by pyllamacpp: C calls them through these trampolines. Each must match the
# typedef it is passed as (the C compiler checks that when the extension is compiled).
_PYTHON_CALLBACKS = """
extern "Python" void _pyllamacpp_log_cb(enum ggml_log_level, const char *, void *);
extern "Python" bool _pyllamacpp_abort_cb(void *);
extern "Python" bool _pyllamacpp_eval_cb(struct ggml_tensor *, bool, void *);
extern "Python" bool _pyllamacpp_progress_cb(float, void *);
const char *pyllamacpp_build_info(void);
"""
# pyllamacpp's own C helpers (build_support/helpers.h): what Python may call of them.
_HELPERS_CDEF = """
typedef struct { int abort_requested; int watch_sigint; void *taps; ...; } pyl_abort_state;
bool pyl_abort_flag_cb(void *);
int pyl_sigint_watch(void);
int pyl_sigint_unwatch(void);
typedef struct { int32_t rc; int32_t sigint; int32_t next; int32_t eog; } pyl_step_out;
#define PYL_STEP_TAPS_FAILED ...
void pyl_log_cb(enum ggml_log_level, const char *, void *);
int pyl_log_debug;
void pyl_decode_sample(struct llama_context *, struct llama_batch *, struct llama_sampler *,
                       pyl_abort_state *, int, llama_token, llama_pos, llama_seq_id,
                       const struct llama_vocab *, pyl_step_out *);
typedef struct { size_t size; size_t written; } pyl_state_out;
uint8_t *pyl_state_seq_get(struct llama_context *, llama_seq_id, llama_state_seq_flags, pyl_state_out *);
void pyl_free(void *);
size_t pyl_state_seq_set(struct llama_context *, const uint8_t *, size_t, llama_seq_id, llama_state_seq_flags);
const char *pyl_reason_text(void);
"""
_CALLBACK_CHECKS = """
/* The compiler checks that each Python trampoline has the type llama.cpp expects. */
static ggml_log_callback const _pyllamacpp_check_log = _pyllamacpp_log_cb;
static ggml_abort_callback const _pyllamacpp_check_abort = _pyllamacpp_abort_cb;
static ggml_backend_sched_eval_callback const _pyllamacpp_check_eval = _pyllamacpp_eval_cb;
static llama_progress_callback const _pyllamacpp_check_progress = _pyllamacpp_progress_cb;
"""


# Compiler extensions pycparser cannot parse, defined away in the file that is preprocessed (not on
# the command line: MSVC's /D takes no function-like macros).
_DEFINED_AWAY = [
    "__attribute__(x)",
    "__declspec(x)",
    "restrict",
    "__restrict",
    "__restrict__",
    "__extension__",
    "__forceinline",
    "__cdecl",
    "__stdcall",
]


def _is_msvc(cc: list[str]) -> bool:
    return Path(cc[0]).stem.lower() in ("cl", "clang-cl")


def preprocess(cc: list[str], headers: list[Path], include_dirs: list[Path], *, macros: bool) -> str:
    if macros and _is_msvc(cc):
        # MSVC has no -dM: the headers' own #define lines are the macro table (their values are
        # checked by the C compiler anyway, through cffi's `#define NAME ...`).
        # (only the headers that the given ones include, as the preprocessor would see them)
        seen: list[Path] = []
        todo = [d / h for h in headers for d in include_dirs if (d / h).exists()]
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.append(p)
            for inc in re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), re.M):
                todo += [d / inc for d in include_dirs if (d / inc).exists()]
        text = re.sub(r"/\*.*?\*/|//[^\n]*", "", "\n".join(p.read_text() for p in seen), flags=re.S)
        return "\n".join(
            "#define " + " ".join(m.groups()).strip()
            for m in re.finditer(r"^\s*#\s*define\s+(\w+(?:\([^)]*\))?)[ \t]*(.*)$", text, re.M)
            if not m.group(1).startswith("_")
        )  # platform macros (_WIN32_WINNT), not llama.cpp's
    with tempfile.TemporaryDirectory() as tmp:
        stub = Path(tmp)
        for name in _STUB_HEADERS:
            (stub / name).write_text("")
        main = stub / "pyllamacpp_all.h"
        main.write_text(
            "".join(f"#define {m}\n" for m in _DEFINED_AWAY)
            + "#define __inline inline\n"
            + "".join(f'#include "{h}"\n' for h in headers)
        )
        if _is_msvc(cc):  # /EP: preprocess to stdout without #line; /X: no standard include paths
            cmd = [*cc, "/nologo", "/EP", "/X", f"/I{stub}", *(f"/I{d}" for d in include_dirs), str(main)]
        else:
            cmd = [*cc, "-E", "-nostdinc", "-I", str(stub)]
            for d in include_dirs:
                cmd += ["-I", str(d)]
            cmd += ["-dM"] if macros else ["-P"]
            cmd.append(str(main))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"gen_cffi: preprocessing failed: {shlex.join(cmd)}\n{proc.stderr}")
        return proc.stdout


class _ToCdef(c_ast.NodeVisitor):
    """Rewrites array lengths that are not plain integers to cffi's ``...``."""

    def visit_ArrayDecl(self, node):
        if node.dim is not None and not (isinstance(node.dim, c_ast.Constant) and node.dim.type == "int"):
            node.dim = c_ast.ID("...")
        self.generic_visit(node)


def exported_symbols(nm: str, libs: list[str]) -> set[str]:
    """Functions the built shared libraries really export: ``nm -D --defined-only`` (ELF),
    ``nm -gU`` (Mach-O, names with a leading underscore), the PE export table (Windows DLLs)."""
    names: set[str] = set()
    for lib in libs:
        if lib.lower().endswith(".dll"):
            names.update(pe_exports(Path(lib)))
            continue
        darwin = sys.platform == "darwin"
        cmd = [nm, "-gU", lib] if darwin else [nm, "-D", "--defined-only", lib]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"gen_cffi: {nm} failed on {lib}: {proc.stderr}")
        for line in proc.stdout.splitlines():
            if line.strip() and not line.endswith(":"):
                name = line.split()[-1]
                names.add(name[1:] if darwin and name.startswith("_") else name)
    return names


def pe_exports(path: Path) -> list[str]:
    """Names in a DLL's export table (PE/COFF: the export directory of the optional header)."""
    import struct

    data = path.read_bytes()
    pe = struct.unpack_from("<I", data, 0x3C)[0]
    if data[pe : pe + 4] != b"PE\0\0":
        sys.exit(f"gen_cffi: {path} is not a PE file")
    n_sections, opt_size = struct.unpack_from("<H", data, pe + 6)[0], struct.unpack_from("<H", data, pe + 20)[0]
    opt = pe + 24
    magic = struct.unpack_from("<H", data, opt)[0]
    export_rva = struct.unpack_from("<I", data, opt + (112 if magic == 0x20B else 96))[0]  # PE32+ / PE32
    sections = [struct.unpack_from("<8sIIII", data, opt + opt_size + 40 * i) for i in range(n_sections)]

    def offset(rva: int) -> int:
        for _name, vsize, vaddr, rawsize, rawptr in sections:
            if vaddr <= rva < vaddr + max(vsize, rawsize):
                return rva - vaddr + rawptr
        raise ValueError(f"RVA {rva:#x} is in no section of {path}")

    if not export_rva:
        return []
    d = offset(export_rva)
    n_names, names_rva = struct.unpack_from("<I", data, d + 24)[0], struct.unpack_from("<I", data, d + 32)[0]
    out = []
    for i in range(n_names):
        p = offset(struct.unpack_from("<I", data, offset(names_rva) + 4 * i)[0])
        out.append(data[p : data.index(b"\0", p)].decode())
    return out


def make_cdef(pp: str, exported: set[str] | None) -> tuple[str, list[str], list[str]]:
    prelude = "".join(f"typedef int {t};\n" for t in _BUILTIN_TYPES)
    ast = c_parser.CParser().parse(prelude + pp, filename="<llama.h preprocessed>")
    gen = c_generator.CGenerator()
    out, functions, typedefs, missing = [], [], set(), []
    for node in ast.ext[len(_BUILTIN_TYPES) :]:
        if isinstance(node, c_ast.Typedef):
            if node.name in typedefs:  # C11 allows repeating a typedef; cffi does not
                continue
            typedefs.add(node.name)
        inline = isinstance(node, c_ast.FuncDef)
        if inline:
            node = node.decl  # a static inline function: keep only its declaration
        _ToCdef().visit(node)
        if isinstance(node, c_ast.Decl) and isinstance(node.type, c_ast.FuncDecl):
            # ggml declares a few functions that no library of this build defines; binding them
            # would make the import fail with an undefined symbol.
            if exported is not None and not inline and node.name not in exported:
                missing.append(node.name)
                continue
            functions.append(node.name)
            node.storage = [s for s in node.storage if s != "extern"]
        out.append(gen.visit(node) + ";")
    return "\n".join(out) + "\n", functions, missing


_INT_LITERAL = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b")


def integer_macros(defs: str, headers_text: str) -> list[str]:
    """Names of object-like macros defined in the headers whose value is an integer expression."""
    table = {}
    for line in defs.splitlines():
        m = re.match(r"#define (\w+)(\(.*?\))?(?: (.*))?$", line)
        if m and not m.group(2):
            table[m.group(1)] = (m.group(3) or "").strip()
    ours = set(re.findall(r"^\s*#\s*define\s+([A-Za-z_]\w*)(?![\w(])", headers_text, re.M))

    def value(name, depth=0):
        expr = table.get(name, "")
        if depth > 10 or not expr or '"' in expr or "'" in expr:
            return None
        expr = _INT_LITERAL.sub(r"\1", expr)
        for ident in set(re.findall(r"\b[A-Za-z_]\w*", expr)):
            v = value(ident, depth + 1)
            if v is None:
                return None
            expr = re.sub(rf"\b{ident}\b", f"({v})", expr)
        if not re.fullmatch(r"[\s\d()xXa-fA-F+\-*/%<>|&~^]+", expr):
            return None
        try:
            v = eval(expr, {"__builtins__": {}})  # digits and operators only, checked above
        except Exception:
            return None
        return v if isinstance(v, int) else None

    return sorted(n for n in ours if n in table and value(n) is not None)


def _topic_files(suffix: str) -> list[Path]:
    """The helpers of one topic each (``build_support/<topic>.h`` with its ``<topic>.cdef``: what
    Python may call of it), compiled after helpers.h in name order."""
    here = Path(__file__).parent
    return sorted(p for p in here.glob(f"*{suffix}") if p.name != "helpers.h")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--llama-dir", type=Path, required=True)
    ap.add_argument("--cc", required=True, help="the C compiler (as CMake found it)")
    ap.add_argument("--nm", default="nm")
    ap.add_argument("--lib", action="append", default=[], help="a built shared library to bind")
    ap.add_argument("--header", action="append", default=[], help="extra ggml header, e.g. ggml-rpc.h")
    ap.add_argument("--info-file", type=Path, required=True, help="JSON with build facts to embed")
    ap.add_argument("--out-c", type=Path, required=True)
    ap.add_argument("--out-cdef", type=Path, required=True)
    args = ap.parse_args()

    src = args.llama_dir
    include_dirs = [src / "include", src / "ggml" / "include"]
    headers = [Path("llama.h"), *map(Path, args.header)]
    cc = shlex.split(args.cc)

    pp = preprocess(cc, headers, include_dirs, macros=False)
    exported = exported_symbols(args.nm, args.lib) if args.lib else None
    cdef, functions, missing = make_cdef(pp, exported)
    header_files = sorted({p for d in include_dirs for p in d.glob("*.h")})
    used = [p for p in header_files if p.name in pp or p.name in {h.name for h in headers}]
    headers_text = "\n".join(
        p.read_text()
        for p in header_files
        if p.name
        in {
            "llama.h",
            "ggml.h",
            "ggml-cpu.h",
            "ggml-backend.h",
            "ggml-alloc.h",
            "ggml-opt.h",
            "gguf.h",
            *(h.name for h in headers),
        }
    )
    names = integer_macros(preprocess(cc, headers, include_dirs, macros=True), headers_text)
    cdef += "".join(f"#define {n} ...\n" for n in names)
    cdef += _PYTHON_CALLBACKS + _HELPERS_CDEF + "".join(f.read_text() for f in _topic_files(".cdef"))

    info = json.loads(args.info_file.read_text())
    info["llama_h_sha256"] = hashlib.sha256((src / "include" / "llama.h").read_bytes()).hexdigest()
    info["n_functions"] = len(functions)
    info["n_constants"] = len(names)
    info["declared_but_not_exported"] = missing
    info_c = json.dumps(json.dumps(info, sort_keys=True))  # a C string literal

    ffi = cffi.FFI()
    ffi.cdef(cdef)
    ffi.set_source(
        "pyllamacpp._pyllamacpp",
        "".join(f'#include "{h}"\n' for h in headers)
        + f"static const char *pyllamacpp_build_info(void) {{ return {info_c}; }}\n"
        + (Path(__file__).with_name("helpers.h")).read_text()
        + "".join(f.read_text() for f in _topic_files(".h")),
        # After cffi's own code, so its declarations of the trampolines are in scope.
    )
    args.out_cdef.parent.mkdir(parents=True, exist_ok=True)
    args.out_cdef.write_text(cdef)
    ffi.emit_c_code(str(args.out_c))
    with open(args.out_c, "a") as f:
        f.write(_CALLBACK_CHECKS)
    print(
        f"gen_cffi: {len(functions)} functions, {len(names)} integer macros, "
        f"{len(missing)} declared but not exported ({', '.join(missing) or 'none'}), "
        f"{len(used)} headers -> {args.out_c.name}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
