"""``pyllamacpp parse-state`` and ``plot-state``: what is in a dump, down to the bytes."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import numpy as np

from ..state import parse


def _heads_kwargs(args) -> dict:
    kw = {"partial": True} if getattr(args, "partial", False) else {}
    if getattr(args, "heads", None):
        return {**kw, "n_head_kv": args.heads}
    if getattr(args, "model", None):
        return {**kw, "model": str(args.model)}
    return kw


def _cell_rows(rec, cell: int, n_values: int, with_hex: bool) -> dict:
    """First bytes (hex) and first decoded values of one cell of one record."""
    out: dict[str, Any] = {}
    if rec.type.dtype is not None:
        vals = np.asarray(rec.values[cell]).reshape(-1)[:n_values].astype(np.float64)
    else:
        vals = np.asarray(rec.dequantize()[cell]).reshape(-1)[:n_values].astype(np.float64)
    out["values"] = [float(v) for v in vals]
    if with_hex:
        if rec.transposed:
            el = rec.row_size // rec.n_embd if rec.n_embd else 0
            # value j of this cell lives at j * n_cells + cell (value-major): gather its bytes
            raw = b"".join(
                rec.data[(j * rec.n_cells + cell) * el : (j * rec.n_cells + cell + 1) * el].tobytes()
                for j in range(min(n_values, rec.n_embd))
            )
        else:
            raw = rec.rows[cell][: 2 * n_values].tobytes()
        out["hex"] = raw.hex(" ")
    return out


def parse_state(args: argparse.Namespace) -> int:
    """``pyllamacpp parse-state``: print what a dump holds (layout, cells, values) or JSON.

    Args:
        args: The parsed flags (file, --heads/-m, --layer, --json ...).

    Returns:
        The exit status, 0.

    Raises:
        StateFormatError: The file is not a state dump llama.cpp wrote.
        OSError: The file cannot be read.
    """
    st = parse(args.file, **_heads_kwargs(args))
    lay = st.layout()
    layer = args.layer
    data = {
        "file": str(args.file),
        "file_size": os.path.getsize(args.file),
        "kind": st.kind.name,
        "kind_text": str(st.kind)
        + (", metadata only (ON_DEVICE)" if st.metadata_only else "")
        + (", partial (PARTIAL_ONLY)" if st.partial else ""),
        "metadata_only": st.metadata_only,
        "partial": st.partial,
        "memory": st.options["memory"],
        "layers": st.layers,
        "metadata_bytes": lay.metadata_bytes,
        "payload_bytes": lay.payload_bytes,
        "parts": [],
        "records": [dataclasses.asdict(r) for r in lay.rows],
    }
    for part in st.parts:
        for s in part.streams:
            entry: dict[str, Any] = {
                "part": part.name,
                "stream": s.index,
                "cell_count": s.cell_count,
                "v_trans": s.v_trans,
                "n_layer": s.n_layer,
                "cells": [],
            }
            # --layer is the model's il when the layer map is known, else the record index
            recs = {r.kind: r for r in s.records if r.key == layer and r.has_data and r.n_embd}
            for c in range(min(args.cells, s.cell_count) if recs else 0):
                cell = s.cells[c]
                row = {"cell": c, "pos": int(cell["pos"]), "seq_ids": [int(x) for x in cell["seq_id"] if x >= 0]}
                for kind, rec in sorted(recs.items()):
                    row[kind] = _cell_rows(rec, c, args.values, args.hex)
                entry["cells"].append(row)
            data["parts"].append(entry)
    if args.json:
        print(json.dumps(data, indent=1, default=str))
        return 0
    print(f"file {args.file}: {data['file_size']:,} bytes")
    if st.metadata_only:
        print("metadata only (ON_DEVICE): no K/V rows to show, only the record headers")
    if st.partial:
        print(f"partial (PARTIAL_ONLY): parts {[p.name for p in st.parts]}, memory {st.options['memory']!r}")
    print(st.describe(max_rows=args.rows, n_cells=0, n_values=0).rstrip())
    for entry in data["parts"]:
        if not entry["cells"]:
            continue
        which = f"il {layer}" if st.layers else f"record {layer}"
        print(f"\n{entry['part']} stream {entry['stream']}, {which}, first {len(entry['cells'])} cells:")
        for row in entry["cells"]:
            print(f"  cell {row['cell']} pos {row['pos']} seq {row['seq_ids']}")
            for kind in ("K", "V", "R", "P", "S"):
                if kind in row:
                    r = row[kind]
                    vals = ", ".join(f"{v:.4f}" for v in r["values"])
                    hx = f"{r['hex']} -> " if "hex" in r else ""
                    print(f"    {kind}: {hx}{vals}")
    return 0


def plot_state(args: argparse.Namespace) -> int:
    """``pyllamacpp plot-state``: draw a dump's byte layout and K/V values (matplotlib) to ``-o``.

    Args:
        args: The parsed flags (file, -o, --heads/-m ...).

    Returns:
        The exit status: 0, or 1 for a metadata-only dump (no rows to plot).

    Raises:
        StateFormatError: The file is not a state dump llama.cpp wrote.
        OSError: The file cannot be read or the image written.
        StopIteration: No stream holds cells, or no K record of ``--layer``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = parse(args.file, **_heads_kwargs(args))
    if st.metadata_only:
        print(f"{args.file}: metadata only (ON_DEVICE): no K/V rows to plot")
        return 1
    part = st.parts[0]
    stream = next(s for s in part.streams if s.cell_count)
    k = next(r for r in stream.records if r.kind == "K" and r.key == args.layer)
    v = next((r for r in stream.records if r.kind == "V" and r.key == args.layer), None)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), gridspec_kw={"width_ratios": [2, 2, 1.4]})
    for ax, rec in zip(axes[:2], (k, v)):
        if rec is None:
            ax.set_axis_off()
            continue
        vals = rec.dequantize() if rec.type.dtype is None else np.asarray(rec.values, dtype=np.float32)
        mat = vals.reshape(rec.n_cells, -1)
        im = ax.imshow(
            mat, aspect="auto", cmap="RdBu_r", interpolation="nearest", vmin=-np.abs(mat).max(), vmax=np.abs(mat).max()
        )
        if rec.n_head:
            for h in range(1, rec.n_head):
                ax.axvline(h * rec.head_dim - 0.5, color="k", lw=0.8)
        ax.set_title(f"{rec.name} ({rec.type.name}, {rec.n_head or '?'} heads)")
        ax.set_xlabel("head x dim" if rec.n_head else "n_embd_gqa (pass --heads to separate heads)")
        ax.set_ylabel("cell")
        fig.colorbar(im, ax=ax, fraction=0.046)
    per_layer: dict[int, dict[str, int]] = {}
    for r in stream.records:
        per_layer.setdefault(r.key, {}).setdefault(r.kind, 0)
        per_layer[r.key][r.kind] += r.nbytes
    layers = sorted(per_layer)
    bottom = np.zeros(len(layers))
    for kind in sorted({kd for d in per_layer.values() for kd in d}):
        b = np.array([per_layer[il].get(kind, 0) for il in layers], dtype=np.float64)
        axes[2].bar(layers, b, bottom=bottom, label=kind)
        bottom += b
    axes[2].set_title("bytes per layer")
    axes[2].set_xlabel("layer (il)" if st.layers else "record index")
    axes[2].legend()
    fig.suptitle(f"{os.path.basename(str(args.file))}: {st.kind}, {stream.cell_count} cells")
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    plt.close(fig)
    print(f"wrote {args.output}")
    return 0
