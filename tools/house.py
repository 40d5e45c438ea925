"""The house in numbers: modules, levels, imports (and which point upward against the layers contract),
the largest file, and the decode loops still written by hand outside the packing core.

    python tools/house.py            # this checkout
    python tools/house.py TREE       # another checkout of the repository (a git worktree, say)

The layers are always this checkout's: the ``layers`` contract of ``[tool.importlinter]`` in its
pyproject.toml, so an older tree is measured against the house as it is meant to be now. Modules that
are gone since were renamed into the place in ``RENAMED`` (``_state_*.py`` became ``context_state/``).

What is counted (grimp reads the import graph; the standard library's ``ast`` says where each import
stands):
- modules: every module of the package (a package's ``__init__`` is one), and the top-level ones.
- levels: the longest import chain, each cycle counted as one level: over all imports, over the
  imports the contracts read (type-only ones and the written exceptions left out), and over the
  imports that run at import time (module level, not under ``TYPE_CHECKING``).
- imports: importer-imported pairs, each classed by its strongest statement: module level, lazy
  (inside a function) or type-only (under ``if TYPE_CHECKING:``); upward ones go from a lower layer
  of the contract to a higher one; the contract's ``ignore_imports`` are the written exceptions.
- decode loops: files that fill a Batch and decode it themselves: a call ``X.add_sequence(...)``, or
  ``X.decode(B)`` with one argument, where X is no work order or text decoder and B no context
  (``ctx.decode(batch)``; not the packing core's ``order.decode(probe)``, nor ``bytes.decode("utf-8")``).
  ``packing.py`` is the core and ``batch.py`` the Batch itself; ``experiments/`` is counted apart,
  since its batches are hand-built on purpose (that is the experiment).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # import-linter brings tomli on Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found]

import grimp

PACKAGE = "pyllamacpp"
EXTENSION = "_pyllamacpp"
HERE = Path(__file__).resolve().parent.parent

# Modules of older trees that became a module of the layers contract under another name.
RENAMED = {
    r"pyllamacpp\._state_\w+": "pyllamacpp.context_state",
    r"pyllamacpp\._scoring_cli": "pyllamacpp.cli",
}

# Import kinds, strongest first: the kind of an importer-imported pair is its strongest statement's.
KINDS = ("module", "lazy", "type")


@dataclass
class Layer:
    """One layer of the contract: its modules (full names) and whether they are independent siblings."""

    modules: list[str]
    independent: bool
    label: str = ""  # the comment line above it in pyproject.toml


@dataclass
class Contract:
    """A ``layers`` contract of a pyproject.toml, bottom to top, and its written exceptions."""

    layers: list[Layer]
    exceptions: list[tuple[str, str, str]] = field(default_factory=list)  # (importer, imported, comment)
    name: str = ""

    def _held(self, module: str) -> list[tuple[int, str]]:
        # (layer, the entry's module that holds ``module``: itself or an ancestor) for each entry
        for pattern, new in RENAMED.items():
            if re.fullmatch(pattern, module):
                module = new
        parts = module.split(".")
        prefixes = [".".join(parts[:k]) for k in range(len(parts), 0, -1)]
        return [
            (i, next(p for p in prefixes if _matches(m, p)))
            for i, layer in enumerate(self.layers)
            for m in layer.modules
            if any(_matches(m, p) for p in prefixes)
        ]

    def layer_of(self, module: str) -> int | None:
        """The index (0 = bottom) of the layer holding ``module``, or None when no layer holds it."""
        held = self._held(module)
        return max(held, key=lambda h: len(h[1]))[0] if held else None

    def sibling_of(self, module: str) -> str | None:
        """The module of its layer's entry that holds ``module`` (for ``pyllamacpp.experiments.*``: the
        experiment), or None."""
        held = self._held(module)
        return max(held, key=lambda h: len(h[1]))[1] if held else None

    def is_exception(self, importer: str, imported: str) -> bool:
        """Whether an import is one of the contract's ``ignore_imports`` (``*`` one name, ``**`` any)."""
        return any(_matches(a, importer) and _matches(b, imported) for a, b, _ in self.exceptions)


def _matches(expression: str, module: str) -> bool:
    rx = re.escape(expression).replace(r"\*\*", ".+").replace(r"\*", "[^.]+")
    return re.fullmatch(rx, module) is not None


def load_contracts(pyproject: Path = HERE / "pyproject.toml") -> dict[str, Contract]:
    """The ``layers`` contracts of ``[tool.importlinter]`` by id, bottom layer first (an ``independence``
    contract is read as one layer of independent siblings).

    The comment after each ``ignore_imports`` entry (``# why``) is kept: the figure labels with it.
    """
    text = pyproject.read_text()
    config = tomllib.loads(text)["tool"]["importlinter"]
    comments = dict(re.findall(r'"([\w.*]+ -> [\w.*]+)",?[ \t]*#[ \t]*(.*)', text))
    out = {}
    for spec in config["contracts"]:
        if spec["type"] not in ("layers", "independence"):
            continue
        containers = spec.get("containers", [])

        def full(name: str, containers: list[str] = containers) -> str:
            name = name.strip().strip("()")
            return f"{containers[0]}.{name}" if containers else name

        layers = [Layer(list(spec["modules"]), True)] if spec["type"] == "independence" else []
        for raw in reversed(spec.get("layers", [])):  # import-linter lists the top layer first
            said = re.search(r"#[ \t]*(.*)\n[ \t]*" + re.escape(f'"{raw}"'), text)
            label = said.group(1).strip() if said else ""
            layers.append(Layer([full(p) for p in re.split(r"[|:]", raw)], ":" not in raw, label))
        exceptions = []
        for line in spec.get("ignore_imports", []):
            a, b = (s.strip() for s in line.split("->"))
            exceptions.append((a, b, comments.get(line, "")))
        out[spec.get("id", spec["name"])] = Contract(layers, exceptions, spec["name"])
    return out


def build_graph(tree: Path = HERE) -> grimp.ImportGraph:
    """The package's import graph in ``tree``, every import counted (lazy and type-only too)."""
    # grimp finds the package by its import spec: let that be ``tree``'s copy for the call, whatever
    # an editable install's finder (before sys.path) or an earlier import says, then put all back.
    saved = sys.path[:], sys.meta_path[:], sys.modules.pop(PACKAGE, None)
    sys.path.insert(0, str(tree))
    keep = []
    for finder in sys.meta_path:
        try:
            spec = finder.find_spec(PACKAGE, None)  # type: ignore[attr-defined]
        except Exception:
            spec = None
        origin = Path(getattr(spec, "origin", None) or tree)
        if spec is None or origin.resolve().is_relative_to(tree.resolve()):
            keep.append(finder)
    sys.meta_path[:] = keep
    try:
        return grimp.build_graph(PACKAGE, cache_dir=None)
    finally:
        sys.path[:], sys.meta_path[:] = saved[0], saved[1]
        if saved[2] is not None:
            sys.modules[PACKAGE] = saved[2]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_kinds(source: str) -> dict[int, str]:
    """Line number of each import statement -> ``module``, ``lazy`` (in a function) or ``type``."""
    kinds: dict[int, str] = {}

    def visit(nodes: Iterable[ast.AST], kind: str) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                kinds[node.lineno] = kind
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                visit(node.body, "type")
                visit(node.orelse, kind)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(list(ast.iter_child_nodes(node)), "lazy" if kind == "module" else kind)
            else:
                visit(list(ast.iter_child_nodes(node)), kind)

    visit(ast.parse(source).body, "module")
    return kinds


def module_path(tree: Path, module: str) -> Path:
    """The file of ``module`` in ``tree`` (a package's ``__init__.py``)."""
    base = tree.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    kind: str  # the strongest of its statements: module, lazy, type
    lines: tuple[int, ...]


def imports(graph: grimp.ImportGraph, tree: Path) -> list[Import]:
    """Every importer-imported pair of the package, with its kind and line numbers."""
    out = []
    kinds_of: dict[str, dict[int, str]] = {}
    for importer in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            if importer not in kinds_of:
                kinds_of[importer] = import_kinds(module_path(tree, importer).read_text())
            details = graph.get_import_details(importer=importer, imported=imported)
            # grimp reads ``from . import _pyllamacpp`` (the compiled extension, no Python file) as an
            # import of the package itself: not an import of the house
            details = [d for d in details if not re.search(rf"\b{EXTENSION}\b", d["line_contents"])]
            if not details:
                continue
            lines = tuple(sorted(d["line_number"] for d in details))
            kinds = {kinds_of[importer].get(n, "module") for n in lines} or {"module"}
            kind = next(k for k in KINDS if k in kinds)
            out.append(Import(importer, imported, kind, lines))
    return out


def _sccs(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    # Tarjan's strongly connected components, iteratively (the graph may be deep).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(comp)
    return out


def levels(nodes: list[str], pairs: list[Import]) -> tuple[int, list[str]]:
    """(levels, largest cycle): the longest chain of the graph with each cycle one level, and the
    modules of its largest cycle."""
    edges: dict[str, set[str]] = {}
    for p in pairs:
        edges.setdefault(p.importer, set()).add(p.imported)
    comps = _sccs(nodes, edges)  # Tarjan yields a component after every component it reaches
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    depth: list[int] = []
    for i, comp in enumerate(comps):
        below = [depth[comp_of[w]] for v in comp for w in edges.get(v, ()) if comp_of[w] != i]
        depth.append(1 + max(below, default=0))
    largest: list[str] = max(comps, key=len, default=[])
    return max(depth, default=0), sorted(largest)


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def decodes_by_hand(source: str) -> bool:
    """Whether a file fills a Batch and decodes it itself (see the module's docstring)."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr == "add_sequence":
            return True
        if node.func.attr == "decode" and len(node.args) == 1 and not node.keywords:
            arg, receiver = node.args[0], _name(node.func.value)
            if isinstance(arg, ast.Constant) or "decoder" in receiver.lower():
                continue
            # the packing core's ``order.decode(ctx)``: a work order decoding itself
            if re.fullmatch(r"(\w*_)?(order|wo)", receiver) or re.fullmatch(r"(ctx|context|\w*_ctx)", _name(arg)):
                continue
            return True
    return False


def upward(contract: Contract, pairs: list[Import]) -> tuple[list[Import], list[Import]]:
    """The imports that go up the contract's layers, and those between independent siblings of a layer."""
    up, side = [], []
    for p in pairs:
        a, b = contract.layer_of(p.importer), contract.layer_of(p.imported)
        if a is None or b is None:
            continue
        if a < b:
            up.append(p)
        elif a == b and contract.layers[a].independent:
            if contract.sibling_of(p.importer) != contract.sibling_of(p.imported):
                side.append(p)
    return up, side


def measure(tree: Path, contracts: dict[str, Contract]) -> list[str]:
    """The report's lines for ``tree``."""
    graph = build_graph(tree)
    nodes = sorted(graph.modules)
    pairs = imports(graph, tree)
    top = {m.split(".")[1] for m in nodes if m.count(".") >= 1}
    packages = {t for t in top if (tree / PACKAGE / t).is_dir()}

    lines = [f"tree: {_describe(tree)}"]
    lines.append(
        f"modules: {len(nodes)} files; {len(top)} top-level ({len(top) - len(packages)} modules, "
        f"{len(packages)} packages)"
    )
    all_levels, cycle = levels(nodes, pairs)
    run_levels, run_cycle = levels(nodes, [p for p in pairs if p.kind == "module"])
    main = next(iter(contracts.values()))
    read = [p for p in pairs if p.kind != "type" and not main.is_exception(p.importer, p.imported)]
    read_levels, read_cycle = levels(nodes, read)
    lines.append(
        f"levels: {all_levels} over all imports (largest cycle {len(cycle)} files); {read_levels} as the contracts "
        f"read them, type-only imports and the written exceptions left out (largest cycle {len(read_cycle)}: "
        f"{', '.join(map(_short, read_cycle))}); {run_levels} at import time (largest cycle {len(run_cycle)})"
    )
    by_kind = Counter(p.kind for p in pairs)
    lines.append(f"imports: {len(pairs)} ({_kinds(by_kind)})")

    for cid, contract in contracts.items():
        up, side = upward(contract, pairs)
        written = [p for p in up + side if contract.is_exception(p.importer, p.imported)]
        side = [p for p in side if p not in written]
        lines.append(
            f"upward against the contract {cid!r}: {len(up)} ({_kinds(Counter(p.kind for p in up))}); "
            f"its written exceptions among them: {len(written)}; between independent siblings: {len(side)}"
        )
        for p in up:
            mark = " (written exception)" if p in written else ""
            lines.append(f"  up: {_short(p.importer)} -> {_short(p.imported)} [{p.kind}]{mark}")
        for p in side:
            lines.append(f"  sideways: {_short(p.importer)} -> {_short(p.imported)} [{p.kind}]")
    unplaced = sorted(_short(m) for m in nodes if main.layer_of(m) is None)
    if unplaced:
        lines.append(f"in no layer of {next(iter(contracts))!r}: {', '.join(unplaced)}")

    sizes = sorted(
        ((len(f.read_text().splitlines()), f.relative_to(tree).as_posix()) for f in (tree / PACKAGE).rglob("*.py")),
        reverse=True,
    )
    lines.append(
        "largest files: " + ", ".join(f"{name} {n:,} lines" for n, name in sizes[:3]) + f" (of {len(sizes)} files)"
    )

    loops: dict[bool, list[str]] = {False: [], True: []}
    for f in sorted((tree / PACKAGE).rglob("*.py")):
        rel = f.relative_to(tree / PACKAGE).as_posix()
        if rel in ("packing.py", "batch.py"):
            continue
        if decodes_by_hand(f.read_text()):
            loops[rel.startswith("experiments/")].append(rel)
    named = f" ({', '.join(loops[False])})" if loops[False] else ""
    lines.append(f"decode loops by hand outside packing.py: {len(loops[False])}{named}")
    lines.append(f"  in experiments/ (hand-built on purpose, counted apart): {len(loops[True])}")
    return lines


def _kinds(counts: Counter) -> str:
    names = {"module": "module level", "lazy": "lazy", "type": "type-only"}
    return ", ".join(f"{names[k]} {counts.get(k, 0)}" for k in KINDS)


def _short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def _describe(tree: Path) -> str:
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    rev = git("log", "-1", "--format=%h %s")
    if not rev:
        return tree.name
    dirty = git("status", "--porcelain", "--", PACKAGE)
    return f"{rev[:72]}" + (" + uncommitted changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("tree", nargs="?", type=Path, default=HERE, help="a checkout of the repository (default: this one)")
    args = ap.parse_args(argv)
    print("\n".join(measure(args.tree, load_contracts())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
