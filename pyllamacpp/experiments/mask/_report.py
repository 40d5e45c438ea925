"""What ``pyllamacpp mask`` prints and draws: a line per mask, the grids of small ones, the facts
and the verdict; a figure of every mask with ``-o``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..common import figure, print_table
from ._rule import GRID_CHARS, PADDING, RULES, _seqs

_TEXT_ROWS, _TEXT_COLS = 48, 48  # the text grid is printed up to this size; -o draws any size


def grid_text(entry: dict) -> list[str]:
    """One mask as text: a line per query row, a character per cell (``#`` visible; masked: ``.``
    empty, ``s`` other sequence, ``f`` future, ``w`` window; ``X``/``!`` a mismatch).

    Args:
        entry: One of ``data["masks"]``.

    Returns:
        The lines (a note instead when it is too large to print).
    """
    n = entry["columns_shown"]
    if entry["n_tps"] > _TEXT_ROWS or n > _TEXT_COLS:
        return [f"  ({entry['n_tps']} rows x {n} cells: too large to print; -o draws it)"]
    out = []
    for s in range(entry["n_stream"]):
        rows = entry["rows"][s * entry["n_tps"] : (s + 1) * entry["n_tps"]]
        strm = entry["kv_streams"][s]
        cells = {c[0]: c for c in entry["cells"].get(str(strm), [])}
        out.append(
            f"  stream {s} (cells of KV stream {strm}); columns 0..{n - 1} of {entry['n_kv']} "
            f"({n}..{entry['n_kv'] - 1}: padding)"
        )
        labels = {j: _seqs(c[2], short=True) for j, c in cells.items()}
        w = max(3, 1 + max((len(x) for x in labels.values()), default=0), 1 + len(str(n - 1)))
        pre = "  " + " " * 22
        out.append(pre + "cell " + "".join(f"{j:>{w}}" for j in range(n)))
        out.append(pre + " pos " + "".join(f"{cells[j][1]:>{w}}" if j in cells else f"{'.':>{w}}" for j in range(n)))
        out.append(pre + "seqs " + "".join(f"{labels[j]:>{w}}" if j in cells else f"{'.':>{w}}" for j in range(n)))
        for (b, p, _given, ids), line in zip(rows, entry["grid"][s]):
            head = f"row {b:>3} seq {_seqs(ids):<5} pos {p:>3}"
            out.append(f"  {head:<27}" + "".join(f"{c:>{w}}" for c in line))
    return out


def print_report(data: dict) -> None:
    """Print what :func:`run` returned: one line per mask, the grids of small ones, the facts, the verdict.

    Args:
        data: What :func:`run` returned.
    """

    n_st = data["n_stream_kv"]
    print(
        f"model {data.get('model', '?')}; flash_attn {'on' if data['flash_attn'] else 'off'}; "
        f"kv_unified {'on' if data['kv_unified'] else 'off'} ({n_st} KV stream{'s' if n_st > 1 else ''}), n_seq_max "
        f"{data['n_seq_max']}, n_ubatch {data['n_ubatch']}, n_ctx_seq {data['n_ctx_seq']}; tokens {data['tokens']} "
        f"after {data['shared']} shared + {data['past']} cached ({data['layout']}"
        f"{', coupled' if data['couple'] else ''})"
    )
    print(
        f"cells before the decode (whole-context state dump): {data['cells_before']}; each ubatch's own cells from "
        "attn_inp_k_idxs; rule: llama_kv_cache::set_input_kq_mask"
    )
    rows = []
    for e in data["masks"]:
        c = e["counts"]
        rows.append(
            {
                "call": e["call"],
                "ub": e["ubatch"],
                "cache": f"{e['cache']} #{e['occurrence']}",
                "ne": str(e["ne"]),
                "type": e["type"],
                "used": max(int(u) for u in e["used"].values()) if e["used"] else 0,
                "keep": c["keep"],
                "empty": c["empty"],
                "pad": c["padding"],
                "other": c["other sequence"],
                "future": c["future"],
                "window": c["window"],
                "bad": e["n_mismatches"],
            }
        )
    print_table(
        rows,
        [
            ("call", "call", "d"),
            ("ub", "ubatch", "d"),
            ("cache", "mask of cache", "s"),
            ("ne", "ne", "s"),
            ("type", "type", "s"),
            ("used", "cells used", "d"),
            ("keep", "visible", "d"),
            ("empty", "empty", "d"),
            ("pad", "padding", "d"),
            ("other", "other seq", "d"),
            ("future", "future", "d"),
            ("window", "window", "d"),
            ("bad", "mismatches", "d"),
        ],
    )
    small = [e for e in data["masks"] if e["n_tps"] <= _TEXT_ROWS and e["columns_shown"] <= _TEXT_COLS]
    if small:
        print(
            "\n# visible; masked: . empty  s other sequence  f future  w window; X/! the engine differs; "
            "a row's seq ids in the ubatch's order (its first is the one masked against)"
        )
        n_occ = len({x["occurrence"] for x in data["masks"]})
        for e in small[:8]:
            where = f"call {e['call']} ubatch {e['ubatch']}, mask of the {e['cache']} cache"
            print(f"\n{where} (layers {_span(e['layers'], n_occ)}):")
            for line in grid_text(e):
                print(line)
    print()
    for f in data["facts"]:
        print(f"- {f}")
    for p in data["problems"]:
        print(f"PROBLEM: {p}")
    n = data["n_mismatches"]
    if n == 0 and not data["problems"]:
        n_masks = len(data["masks"])
        print(f"\nevery entry agrees with the rule: {data['n_entries']:,} entries of {n_masks} masks, 0 mismatches")
    else:
        print(f"\n{n} MISMATCH(ES) in {data['n_entries']:,} entries:")
        for e in data["masks"]:
            for m in e["mismatches"][:10]:
                print(
                    f"  call {e['call']} ubatch {e['ubatch']} {e['cache']}: stream {m['stream']} row {m['row']} cell "
                    f"{m['cell']}: engine {m['got']}, rule {m['want']} ({m['rule']})"
                )


def _span(layers: Sequence[int], n_masks: int = 2) -> str:
    if not layers:
        return "all" if n_masks == 1 else "-"  # flash attention's FLASH_ATTN_EXT nodes are unnamed
    ls = sorted(layers)
    return f"{ls[0]}..{ls[-1]}" if ls == list(range(ls[0], ls[-1] + 1)) and len(ls) > 2 else ",".join(map(str, ls))


_COLORS = ["#1b7837", "#f0f0f0", "#d9d9d9", "#f1a340", "#9e9ac8", "#6baed6"]  # per rule


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw each mask (one panel per mask, ubatch and stream): which query row sees which cell,
    coloured by the rule that decides it; mismatches in red.

    Args:
        data: What :func:`run` returned.
        path: The PNG to write.

    Raises:
        OSError: The file cannot be written.
    """

    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    panels = [(e, s) for e in data["masks"] for s in range(e["n_stream"])][:16]
    n = len(panels)
    cols = min(n, 4)
    nrows = (n + cols - 1) // cols
    with figure(
        path,
        nrows,
        cols,
        figsize=(max(8.0, 4.2 * cols), 3.6 * nrows + 0.8),
        squeeze=False,
        dpi=110,
        rect=(0, 0.05, 1, 0.95),
    ) as (fig, axes):
        cmap = ListedColormap(_COLORS + ["#d7191c"])
        code = {ch: i for i, ch in enumerate(GRID_CHARS)} | {"X": 6, "!": 6}
        for ax, (e, s) in zip(axes.flat, panels):
            grid = e["grid"][s]
            shown = e["columns_shown"]
            extra = min(8, e["n_kv"] - shown)  # a few padding columns, to show they are masked
            a = np.array([[code[c] for c in line] + [PADDING] * extra for line in grid], np.int8).reshape(len(grid), -1)
            ax.imshow(a, cmap=cmap, vmin=0, vmax=6, aspect="auto", interpolation="nearest")
            rows = e["rows"][s * e["n_tps"] : (s + 1) * e["n_tps"]]
            if len(rows) <= 24:
                ax.set_yticks(range(len(rows)), [f"s{_seqs(r[3])} p{r[1]}" for r in rows], fontsize=6)
            ax.set_xlabel(f"KV cell (0..{shown - 1} in use, then padding to n_kv {e['n_kv']})", fontsize=7)
            ax.set_title(
                f"call {e['call']} ub {e['ubatch']} {e['cache']} mask, stream {s}\nne {e['ne']}, {e['type']}, "
                f"{e['n_mismatches']} mismatches",
                fontsize=8,
            )
            ax.tick_params(labelsize=6)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        legend = [Patch(color=_COLORS[i], label=RULES[i]) for i in range(6)] + [
            Patch(color="#d7191c", label="mismatch")
        ]
        fig.legend(handles=legend, loc="lower center", ncol=7, fontsize=7, frameon=False)
        fig.suptitle(
            f"attn_inp_kq_mask as llama.cpp built it; colour: the rule of set_input_kq_mask_impl "
            f"({data['n_mismatches']} mismatches in {data['n_entries']:,} entries)",
            fontsize=9,
        )
