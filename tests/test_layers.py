"""The package's layers, checked from its source (no import of the package is needed to read it)."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pyllamacpp"

# Crossings allowed for now, each with why; the second test fails on an entry that no longer
# crosses. Empty: every private name stays inside its package.
KNOWN_CROSSINGS: dict[str, str] = {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module and package under ``root`` (named ``pyllamacpp``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = ("pyllamacpp", *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def crossings(root: Path = ROOT) -> dict[str, list[str]]:
    """``"importer -> target"`` -> the lines where a private name or module crosses a package border.

    See :func:`test_no_private_name_crosses_a_package_border` for the rule.
    """
    mods = _modules(root)
    found: dict[str, list[str]] = {}
    for mod in sorted(mods):
        _scan(mod, mods, root, found)
    return found


def _scan(mod: str, mods: dict[str, Path], root: Path, found: dict[str, list[str]]) -> None:
    """Add ``mod``'s crossings to ``found``."""
    path = mods[mod]

    def package(m: str) -> str:
        return m if mods[m].name == "__init__.py" else m.rpartition(".")[0]

    here = package(mod)
    rel = path.relative_to(root.parent)

    def cross(target: str, line: int) -> None:
        where = found.setdefault(f"{mod} -> {target}", [])
        if f"{rel}:{line}" not in where:  # m._x.y is seen at m._x and at m._x.y
            where.append(f"{rel}:{line}")

    def check_module(target: str, line: int) -> None:
        # a private module (or package) of P is P's, and of the packages below P
        parts = target.split(".")
        for i in range(1, len(parts)):
            owner = ".".join(parts[:i])
            if _private(parts[i]) and not (here == owner or here.startswith(owner + ".")):
                cross(target, line)
                return

    def check_name(owner: str, name: str, line: int) -> None:
        # a private name is its module's package's own
        if _private(name) and package(owner) != here:
            cross(f"{owner}.{name}", line)

    tree = ast.parse(path.read_text(), str(path))
    bound: dict[str, str] = {}  # a local name -> the pyllamacpp module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "pyllamacpp":
                continue
            check_module(source, node.lineno)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in mods:  # a module imported by name
                    check_module(full, node.lineno)
                    bound[alias.asname or alias.name] = full
                else:
                    check_name(source, alias.name, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pyllamacpp":
                    check_module(alias.name, node.lineno)
                    bound[alias.asname or "pyllamacpp"] = alias.name if alias.asname else "pyllamacpp"
    for node in ast.walk(tree):
        # M._name, pyllamacpp.sub._name: an attribute chain that starts at a module
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        v: ast.expr = node
        while isinstance(v, ast.Attribute):
            chain.append(v.attr)
            v = v.value
        if not isinstance(v, ast.Name) or v.id not in bound:
            continue
        owner = bound[v.id]
        for attr in reversed(chain):
            if f"{owner}.{attr}" in mods:
                owner = f"{owner}.{attr}"
                check_module(owner, node.lineno)
                continue
            check_name(owner, attr, node.lineno)
            break


def test_no_private_name_crosses_a_package_border():
    """What another package needs from a package is a named internal API of its owner.

    The rule, over every module of pyllamacpp/ (imports anywhere in a module count: lazy ones
    inside functions and ``TYPE_CHECKING`` ones too):

    - a package is a directory (its ``__init__.py`` and the modules beside it);
    - a private name (``_name``, not a dunder) belongs to the package of the module that holds
      it: ``from X import _name`` and ``X._name`` are allowed only where X is in the importer's
      own package. Another package gets a non-underscore name instead, exported by the owner
      package's ``__init__`` (outside ``__all__`` when it is not for users);
    - a private module or package (``_name.py``, ``_name/``) of package P is P's, and of the
      packages below P: so the top-level support modules (``_lib``, ``_handle``, ``_log``,
      ``_cpu``, ``_fetch``, ``_gguf_writer``) are the whole library's internal API, while
      ``state._sidecar`` or ``taps._graph`` may be imported only inside ``state/`` or ``taps/``.
      Private names inside an allowed private module still follow the rule above
      (``from .._lib import _x`` in a subpackage crosses).

    Private attributes of objects (``ctx._n_outputs``) are not module names and not checked here.
    """
    found = crossings()
    new = {k: v for k, v in found.items() if k not in KNOWN_CROSSINGS}
    assert not new, "private names across package borders:\n" + "\n".join(
        f"{k}  ({', '.join(v)})" for k, v in sorted(new.items())
    )


def test_known_crossings_still_cross():
    # an entry fixed since must leave KNOWN_CROSSINGS
    stale = set(KNOWN_CROSSINGS) - set(crossings())
    assert not stale, "fixed, remove from KNOWN_CROSSINGS:\n" + "\n".join(sorted(stale))


def test_the_check_sees_each_kind_of_crossing(tmp_path):
    """Each form the rule names is found, in a package written for the test, and the allowed
    forms are not."""
    pkg = tmp_path / "pkg"
    for d in ("", "a", "b", "b/_impl"):
        (pkg / d).mkdir(parents=True, exist_ok=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "_support.py").write_text("_hidden = 1\nshared = 2\n")
    (pkg / "a/_own.py").write_text("_x = 1\nx = 2\n")
    (pkg / "a/mod.py").write_text(
        "from ._own import _x\nfrom .._support import shared\nfrom . import _own\ny = _own._x\n"  # all allowed
    )
    (pkg / "b/mod.py").write_text(
        "from ..a._own import x\n"  # a private module of a sibling
        "from ..a import _own\n"  # the same, by name
        "from .._support import _hidden\n"  # a private name of the top level in a subpackage
        "import pyllamacpp.a.mod as m\n"
        "z = m._x.real\n"  # a private name by attribute
        "def f():\n"
        "    from pyllamacpp.a._own import _x\n"  # lazy, absolute
    )
    (pkg / "b/_impl/deep.py").write_text("from .. import mod\nfrom ...b import _impl\n")
    got = crossings(pkg)
    assert sorted(got) == [
        "pyllamacpp.b.mod -> pyllamacpp._support._hidden",
        "pyllamacpp.b.mod -> pyllamacpp.a._own",
        "pyllamacpp.b.mod -> pyllamacpp.a._own._x",
        "pyllamacpp.b.mod -> pyllamacpp.a.mod._x",
    ], got
    assert len(got["pyllamacpp.b.mod -> pyllamacpp.a._own"]) == 3  # two imports of the module, one of the lazy


# ---------------------------------------------------------------------------------------------
# The import contracts: pyproject.toml's [tool.importlinter] (import-linter, in the test extra):
# the layers bottom to top, the features' own order, the features that stand on the core alone,
# and nothing below the commands importing experiments, cli or evaluation. The one written
# exception, a convenience method of Model or Context importing upward inside its body, is each
# contract's ignore_imports. docs/explain/architecture.md states the same layers.

REPO = ROOT.parent

# lint-imports in a child run in the folder to check: an editable install's import hook is taken
# out (as in test_frictions' clone test), so grimp reads the package of that folder, not this
# checkout's through the hook.
_LINT = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in type(f).__module__]\n"
    "from importlinter.cli import lint_imports\n"
    "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))\n"
)


def _lint(tree: Path) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("importlinter") is None:
        pytest.skip("import-linter is not installed (it comes with the test extra)")
    return subprocess.run([sys.executable, "-c", _LINT], cwd=tree, capture_output=True, text=True, timeout=600)


def _contracts() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}


def _house():
    # tools/house.py, loaded by path: tools/ is no package
    if importlib.util.find_spec("grimp") is None:
        pytest.skip("grimp is not installed (it comes with the test extra)")
    spec = importlib.util.spec_from_file_location("pyllamacpp_tools_house", REPO / "tools" / "house.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_import_contracts_hold():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def _copy_sources(dst: Path) -> None:
    def not_python(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or not (n.endswith(".py") or Path(folder, n).is_dir())}

    shutil.copytree(ROOT, dst / "pyllamacpp", ignore=not_python)
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")


def test_planted_imports_break_the_contracts(tmp_path):
    """The package's sources copied: the copy passes; with ``from . import cli`` added to its
    batch.py, the layers and the top's forbidden contract fail, and with ``from . import kvprobe``
    in experiments/sweep.py, the experiments' independence fails, each naming the import."""
    _copy_sources(tmp_path)
    r = _lint(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    planted = {}
    for rel, line, name in (
        ("batch.py", "from . import cli  # planted", "pyllamacpp.batch -> pyllamacpp.cli"),
        ("experiments/sweep.py", "from . import kvprobe  # planted", "pyllamacpp.experiments.sweep -> "
         "pyllamacpp.experiments.kvprobe"),
    ):  # fmt: skip
        path = tmp_path / "pyllamacpp" / rel
        path.write_text(path.read_text() + f"\n{line}\n")
        planted[name] = len(path.read_text().splitlines())
    r = _lint(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    contracts = _contracts()
    said = " ".join(r.stdout.split())
    for cid in ("layers", "top", "experiments"):
        assert f"{contracts[cid]['name']} BROKEN" in said, (cid, r.stdout)
    for name, line in planted.items():
        assert f"{name} (l.{line})" in r.stdout, r.stdout


def _imports_in(path: Path, module: str) -> list[tuple[int, str, list[str]]]:
    """(line, imported module or name, enclosing class and function names) of each import in a file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str, list[str]]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                parts = package.split(".")
                base = parts[: len(parts) - (child.level - 1)] if child.level else []
                stem = ".".join(base + ([child.module] if child.module else []))
                out.append((child.lineno, stem, scope))
                out.extend((child.lineno, f"{stem}.{alias.name}", scope) for alias in child.names)
            elif isinstance(child, ast.Import):
                out.extend((child.lineno, alias.name, scope) for alias in child.names)
            inner = scope + [child.name] if isinstance(child, (ast.ClassDef, ast.FunctionDef)) else scope
            visit(child, inner)

    visit(ast.parse(path.read_text()), [])
    return out


def test_the_written_exceptions_are_lazy_imports_in_model_and_context_methods():
    """Each ``ignore_imports`` of the layers contract is a method of Model or Context importing
    upward inside its body: no statement of that import runs at module level (one under
    ``TYPE_CHECKING`` never runs), and each lazy one is in a method of the class."""
    house = _house()
    contract = _contracts()["layers"]
    assert contract["ignore_imports"], "the layers contract lists its written exceptions"
    for expression in contract["ignore_imports"]:
        importer, imported = (s.strip() for s in expression.split("->"))
        path = house.module_path(REPO, importer)
        kinds = house.import_kinds(path.read_text())
        found = [
            (line, kinds[line], scope)
            for line, name, scope in _imports_in(path, importer)
            if name == imported or name.startswith(imported + ".")
        ]
        for line, kind, scope in found:
            assert kind != "module", f"{expression}: {path.name}:{line} imports at module level"
            if kind == "lazy":
                assert scope[:1] in (["Model"], ["Context"]) and len(scope) >= 2, (expression, line, scope)
        assert any(kind == "lazy" for _, kind, _ in found), f"{expression}: no lazy import; take it off the list"


def test_the_contracts_agree_with_the_layers():
    """The features' contracts list the layers contract's exceptions, and the forbidden contract's
    sources are every module the layers place below the commands, but evaluation."""
    contracts = _contracts()
    layers = contracts["layers"]
    for cid in ("features", "leaves"):
        assert contracts[cid]["ignore_imports"] == layers["ignore_imports"], cid
    below = set()
    for layer in layers["layers"][1:]:
        below |= {"pyllamacpp." + m.strip().strip("()") for m in layer.replace("|", ":").split(":")}
    assert set(contracts["top"]["source_modules"]) == below - {"pyllamacpp.evaluation"}
    assert set(contracts["top"]["forbidden_modules"]) == {
        "pyllamacpp.experiments",
        "pyllamacpp.cli",
        "pyllamacpp.evaluation",
    }


def test_the_house_counts_hand_written_decode_loops():
    """tools/house.py's count: ``ctx.decode(batch)``, ``probe.decode(batch)`` and ``add_sequence``
    are a hand-built batch; the packing core's ``order.decode(ctx)`` and text decoding are not."""
    house = _house()
    assert house.decodes_by_hand("ctx.decode(batch)")
    assert house.decodes_by_hand("self.ctx.decode(self.batch)")
    assert house.decodes_by_hand("probe.decode(batch)")
    assert house.decodes_by_hand("b.add_sequence(tokens, 0, 0)")
    assert not house.decodes_by_hand("order.decode(ctx)\nwo.decode(self.ctx)\norder.decode(probe)")
    assert not house.decodes_by_hand("data.decode('utf-8')\nself._decoder.decode(data)\nraw.decode()")


def test_the_layer_figure_draws_the_contract():
    """The docs build's figure (docs/hooks/layers.py): every top-level module in one box, no arc
    going up, the written exceptions drawn apart as the contract lists them; the page shows it."""
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib (the test and docs extras)")
    pytest.importorskip("mkdocs", reason="the hook needs mkdocs (the test and docs extras)")
    house = _house()
    spec = importlib.util.spec_from_file_location("pyllamacpp_docs_layers", REPO / "docs" / "hooks" / "layers.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    contract, members, between, inside, exceptions = hook.layer_counts()
    drawn = sorted(m.rstrip("/") for box in members for m in box)
    top_level = sorted({p.stem if p.is_file() else p.name for p in ROOT.glob("*") if _is_module(p)} - {"__init__"})
    assert drawn == top_level
    assert all(a > b for a, b in between), between
    assert sum(between.values()) > 0 and sum(inside.values()) > 0
    listed = {(a, b) for a, b, _ in house.load_contracts(REPO / "pyproject.toml")["layers"].exceptions}
    assert {(a, b) for a, b, *_ in exceptions} == listed
    assert all(a < b for *_, a, b in exceptions)  # each goes up
    assert hook.figure().lstrip().startswith(b"<?xml")
    page = (REPO / "docs" / "explain" / "architecture.md").read_text()
    assert f"pyllamacpp-cffi/{hook.FIGURE})" in page


def _is_module(p: Path) -> bool:
    return (p.suffix == ".py") or (p.is_dir() and (p / "__init__.py").exists())
