"""MkDocs hook: the architecture page's layer figure, drawn from the real import graph.

``assets/architecture/layers.svg``: one box per layer of the ``layers`` contract in pyproject.toml
(``[tool.importlinter]``, the contract tests/test_layers.py runs), top layer on top, each with its
modules; on the right, an arrow from a layer to each layer below it that it imports, with the number
of importer-imported module pairs (imports that run: module level or lazy; ``TYPE_CHECKING`` ones
never run and are not drawn); on the left, dashed, the contract's written exceptions (a Model or
Context convenience method importing upward inside its body), named by their methods. The graph is
grimp's, read by ``tools/house.py`` (the house's measuring command), so the figure, the contract and
the measurements read the same layers.

Like the other figures (``generate.py``), it lives only in the build (``File.generated``).
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import textwrap
from collections import Counter

from mkdocs.structure.files import File

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIGURE = "assets/architecture/layers.svg"


def _house():
    # tools/house.py, by path: neither tools/ nor this folder is a package
    spec = importlib.util.spec_from_file_location("pyllamacpp_tools_house", os.path.join(ROOT, "tools", "house.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def layer_counts():
    """(contract, modules per layer, imports between layers, imports inside each layer, exceptions).

    ``between[(i, j)]`` counts the module pairs from layer ``i`` to layer ``j < i`` (0 is the bottom)
    that run; the written exceptions are left out of it and returned as (importer, imported, methods,
    from-layer, to-layer).
    """
    from pathlib import Path

    house = _house()
    contract = house.load_contracts(Path(ROOT) / "pyproject.toml")["layers"]
    graph = house.build_graph(Path(ROOT))
    pairs = house.imports(graph, Path(ROOT))
    members: list[list[str]] = [[] for _ in contract.layers]
    for i, layer in enumerate(contract.layers):
        for m in layer.modules:
            if m in graph.modules:  # an optional place of the contract may be empty
                name = m.removeprefix("pyllamacpp.")
                members[i].append(name + "/" if graph.find_children(m) else name)
    between: Counter = Counter()
    inside: Counter = Counter()
    exceptions = []
    for p in pairs:
        a, b = contract.layer_of(p.importer), contract.layer_of(p.imported)
        if a is None or b is None or p.kind == "type":
            continue
        for importer, imported, methods in contract.exceptions:
            if house._matches(importer, p.importer) and house._matches(imported, p.imported):
                exceptions.append((p.importer, p.imported, methods, a, b))
                break
        else:
            if a == b:
                inside[a] += 1
            else:
                between[(a, b)] += 1
    return contract, members, between, inside, exceptions


def _apex(span: int) -> float:
    # how far right of the boxes an arc over ``span`` layers reaches (inches): each span its own lane
    return 0.3 + 0.32 * span


def figure(fmt: str = "svg") -> bytes:
    """The layer figure, as SVG (or another format matplotlib writes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    contract, members, between, inside, exceptions = layer_counts()
    n = len(contract.layers)
    gap, x0, x1 = 0.5, 2.4, 8.6
    texts = []  # per layer: (title, module lines, note lines)
    for i, layer in enumerate(contract.layers):
        title, _, said = layer.label.partition(":")
        sep = "  |  " if layer.independent and len(members[i]) > 1 else "   "
        texts.append((title or f"layer {i}", textwrap.wrap(sep.join(members[i]), 66), textwrap.wrap(said.strip(), 92)))
    heights = [0.55 + 0.17 * (len(mods) + len(note)) for _, mods, note in texts]
    bottoms = [sum(heights[:i]) + gap * i for i in range(n)]
    top = bottoms[-1] + heights[-1]
    reach = max((_apex(a - b) for a, b in between), default=1.0)
    right = x1 + reach + 0.3
    fig, ax = plt.subplots(figsize=(right + 0.6, top + 1.0))
    ax.set_xlim(0, right + 0.6)
    ax.set_ylim(-0.75, top + 0.1)
    ax.axis("off")

    def y_of(i: int) -> float:  # bottom edge of layer i's box
        return bottoms[i]

    palette = ["#e8f0fb", "#e6f4ea", "#fdf3e1", "#f3e8fd", "#fde8e8", "#e8f8f8", "#f0f0f0"]
    edges = ["#2b5d9e", "#2e7d46", "#a86a00", "#6b3fa0", "#b03a3a", "#1f7f7f", "#555555"]
    for i, (title, mods, note) in enumerate(texts):
        y, h = y_of(i), heights[i]
        ax.add_patch(
            FancyBboxPatch(
                (x0, y), x1 - x0, h, boxstyle="round,pad=0,rounding_size=0.08",
                fc=palette[i % len(palette)], ec="#555", lw=1,
            )
        )  # fmt: skip
        ax.text(x0 + 0.12, y + h - 0.1, title, weight="bold", fontsize=10, va="top")
        if inside[i]:
            ax.text(
                x1 - 0.12, y + h - 0.1, f"{inside[i]} imports inside", fontsize=7, color="#555", va="top", ha="right"
            )
        ax.text(x0 + 0.12, y + h - 0.38, "\n".join(mods), family="monospace", fontsize=8, va="top", linespacing=1.3)
        ax.text(x0 + 0.12, y + 0.08, "\n".join(note), fontsize=7, color="#555", va="bottom", linespacing=1.3)

    # imports down the layers: an arc from the layer to each layer below it that it imports, in the
    # importing layer's colour, the longer span further out, the count at the arc's far point
    out_of: Counter = Counter()
    into: Counter = Counter()
    for a, b in sorted(between, key=lambda ab: (-ab[0], ab[1])):
        ya = y_of(a) + 0.15 + 0.14 * out_of[a]
        yb = y_of(b) + heights[b] - 0.15 - 0.14 * into[b]
        out_of[a] += 1
        into[b] += 1
        count, colour = between[(a, b)], edges[a % len(edges)]
        rad = 2 * _apex(a - b) / (ya - yb)  # arc3 bends by rad * the chord; its middle lies half that out
        ax.add_patch(
            FancyArrowPatch(
                (x1, ya), (x1 + 0.02, yb), connectionstyle=f"arc3,rad={-rad}", arrowstyle="-|>",
                mutation_scale=9, color=colour, lw=0.7 + 0.3 * count**0.5, alpha=0.9,
            )
        )  # fmt: skip
        ax.text(
            x1 + _apex(a - b), (ya + yb) / 2, str(count), ha="center", va="center", fontsize=7.5,
            color=colour, bbox={"boxstyle": "round,pad=0.12", "fc": "white", "ec": colour, "lw": 0.6},
        )  # fmt: skip

    # the written exceptions: dashed, upward, on the left, grouped by the pair of layers
    groups: dict[tuple[int, int], list[str]] = {}
    for _, _, methods, a, b in exceptions:
        groups.setdefault((a, b), [])
        for m in methods.split(","):
            m = m.strip()
            if m and m not in groups[(a, b)]:
                groups[(a, b)].append(m)
    for k, ((a, b), methods) in enumerate(sorted(groups.items())):
        xl = x0 - 0.35 - 0.55 * k
        ya, yb = y_of(a) + heights[a] * 0.5 + 0.12 * k, y_of(b) + heights[b] * 0.5 - 0.12 * k
        ax.plot([x0, xl], [ya, ya], color="#b5452b", lw=1.2, ls=(0, (4, 2)))
        ax.plot([xl, xl], [ya, yb], color="#b5452b", lw=1.2, ls=(0, (4, 2)))
        ax.add_patch(FancyArrowPatch((xl, yb), (x0 - 0.02, yb), arrowstyle="-|>", mutation_scale=10, color="#b5452b"))
        label = "\n".join(textwrap.wrap(", ".join(methods), 22))
        ax.text(
            xl - 0.08, (ya + yb) / 2, label, ha="right", va="center", fontsize=7, color="#b5452b",
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none"},
        )  # fmt: skip

    caption = (
        "Boxes: the layers of pyproject.toml's import contract, top layer on top.  Arcs: imports down the layers "
        "in the importing layer's colour, counted as importer-imported module pairs that run.\n"
        "Dashed: the written exceptions, lazy imports inside Model and Context convenience methods.  "
        "Imports under TYPE_CHECKING never run and are not drawn."
    )
    ax.text(0.05, -0.45, caption, fontsize=7, color="#333", va="center")
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, bbox_inches="tight", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def on_files(files, config):
    files.append(File.generated(config, FIGURE, content=figure()))
    return files
