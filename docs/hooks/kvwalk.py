"""The KV walk-through's run: dump a 7-token prompt from the default model, draw what is in it.

``run()`` makes the dumps (unified and non-unified cache), ``figures()`` draws them with matplotlib.
The page docs/explain/kv-cache-in-memory.md runs the same calls in its code blocks (executed by
tests/test_docs.py), so the numbers in its text are checked against the same run.
"""

from __future__ import annotations

import io

import numpy as np

PROMPT = "The cat sat on the mat."


def run() -> dict:
    """Dump sequence 0 after ``PROMPT`` from a unified and a non-unified (4 streams) cache."""
    import pyllamacpp as pl
    import pyllamacpp.state as st

    model = pl.Model()
    try:
        tokens = model.tokenize(PROMPT)
        out = {"tokens": tokens, "pieces": [model.token_to_piece(int(t)) for t in tokens]}
        for unified in (True, False):
            with model.context(
                n_ctx=512, n_seq_max=4, kv_unified=unified, flash_attn="on", type_k="f16", type_v="f16"
            ) as ctx:
                ctx.prefill(tokens, 0)
                dump = ctx.seq_state(0)
            out["unified" if unified else "split"] = st.parse(dump.data, model=model)
        return out
    finally:
        model.close()


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def figures(data: dict) -> dict[str, bytes]:
    """The walk-through's PNGs by file name."""
    import matplotlib

    matplotlib.use("Agg")
    return {"heads.png": _heads(data), "file-layout.png": _layout(data), "streams.png": _streams(data)}


def _heads(data) -> bytes:
    import matplotlib.pyplot as plt

    s = data["unified"]
    fig, axes = plt.subplots(2, 1, figsize=(10, 4.6), constrained_layout=True)
    for ax, kind in zip(axes, ("K", "V")):
        t = (s.k if kind == "K" else s.v)[0]  # (cells, n_head_kv, head_dim) view
        n_cell, n_head, head_dim = t.shape
        img = np.asarray(t, dtype=np.float32).reshape(n_cell, n_head * head_dim)
        lim = float(np.abs(img).max())
        im = ax.imshow(img, aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
        for h in range(1, n_head):
            ax.axvline(h * head_dim - 0.5, color="black", lw=1.5)
        ax.set_yticks(range(n_cell), [f"pos {i}: {p!r}" for i, p in enumerate(data["pieces"])], fontsize=8)
        ax.set_xticks(
            [h * head_dim + head_dim / 2 for h in range(n_head)],
            [f"head {h} (values {h * head_dim}..{(h + 1) * head_dim - 1})" for h in range(n_head)],
        )
        ax.set_title(
            f"{kind}, layer 0: one row per token, {n_head} KV heads × {head_dim} values side by side "
            f"({t.dtype}, {n_head * head_dim * t.itemsize} bytes per row)",
            fontsize=10,
        )
        fig.colorbar(im, ax=ax, shrink=0.8)
    return _png(fig)


def _layout(data) -> bytes:
    import matplotlib.pyplot as plt

    s = data["unified"]
    total = s.nbytes
    segs = s.segments()
    fig, (top, zoom) = plt.subplots(2, 1, figsize=(11, 4.2), constrained_layout=True)
    # whole file, to scale: the metadata is a sliver before 30 K records and 30 V records
    for g in segs:
        if g.payload:
            rec = s.record("K" if " K[" in g.what else "V", int(g.what.split("il ")[1].split("]")[0]))
            shade = ("#4c72b0", "#8fa9d6") if rec.kind == "K" else ("#dd8452", "#efb48f")
            top.barh(0, g.nbytes, left=g.offset, color=shade[rec.key % 2], edgecolor="none", height=0.6)
    k0, v0 = s.record("K", 0), s.record("V", 0)
    top.set_xticks([0, v0.header_offset, total], ["0", f"{v0.header_offset:,}: V, layer 0", f"{total:,}"])
    top.text(
        k0.header_offset + (v0.header_offset - k0.header_offset) / 2,
        0,
        "K: 30 records, one per layer",
        ha="center",
        va="center",
        color="white",
    )
    top.text(
        v0.header_offset + (total - v0.header_offset) / 2,
        0,
        "V: 30 records, one per layer",
        ha="center",
        va="center",
        color="white",
    )
    top.set_xlim(0, total)
    top.set_yticks([])
    top.set_title(
        f"the whole dump, {total:,} bytes: {k0.header_offset} bytes of metadata, then K of every "
        "layer, then V of every layer",
        fontsize=10,
    )
    # the first bytes, field by field
    end = k0.data_offset + 24
    fields = []
    for g in segs:
        if g.offset >= end:
            break
        if "cells" in g.what:
            per = g.nbytes // len(s.cells)
            fields += [(g.offset + i * per, per, f"cell {i}\npos, n_seq_id,\nseq_id") for i in range(len(s.cells))]
        elif g.what.startswith("header"):
            fields += [(0, 4, "magic"), (4, 4, "seq_id")]
        elif "v_trans" in g.what:
            fields += [(g.offset, 4, "v_trans"), (g.offset + 4, 4, "n_layer")]
        elif g.what.endswith("header"):
            fields += [(g.offset, 4, "type"), (g.offset + 4, 8, "row_size")]
        elif g.payload:
            fields.append((g.offset, end - g.offset, "K rows of layer 0 →"))
        else:
            fields.append((g.offset, g.nbytes, g.what.split(": ")[-1]))
    palette = ["#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd"]
    for i, (off, n, label) in enumerate(fields):
        color = (
            "#4c72b0" if label.startswith("K rows") else ("#cccccc" if label.startswith("cell ") else palette[i % 5])
        )
        zoom.barh(0, n, left=off, color=color, edgecolor="white", height=1.0)
        zoom.text(off + n / 2, 0, label, ha="center", va="center", fontsize=7, rotation=90 if n <= 8 else 0)
    zoom.set_xticks([f[0] for f in fields if f[1] >= 8 or f[0] in (0, 8, 12, 16, 100, 104, 108, 112, 120)])
    zoom.tick_params(axis="x", labelsize=7)
    zoom.set_xlim(0, end)
    zoom.set_ylim(-0.5, 0.5)
    zoom.set_yticks([])
    zoom.set_title(
        f"bytes 0..{end}: header, stream 0's cells, then the first K record (12-byte header, then one row per cell)",
        fontsize=10,
    )
    return _png(fig)


def _streams(data) -> bytes:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(11, 2.8), constrained_layout=True)
    for ax, key, title in (
        (axes[0], "unified", "kv_unified=True: one stream"),
        (axes[1], "split", "kv_unified=False, n_seq_max=4: one stream per sequence"),
    ):
        s = data[key]
        # one box per field, not to scale: records are folded into one box per stream
        boxes, last_rec = [], None
        for g in s.segments():
            rec = " K[" in g.what or " V[" in g.what
            label = "60 K/V records" if rec else g.what.replace("kv stream ", "s").replace("kv: ", "")
            if rec and last_rec:
                boxes[-1][1] += g.nbytes
                continue
            boxes.append([label, g.nbytes, g.offset])
            last_rec = rec
        for i, (label, n, off) in enumerate(boxes):
            ax.barh(0, 1, left=i, color="#4c72b0" if "records" in label else "#cccccc", edgecolor="white")
            ax.text(i + 0.5, 0, f"{label}\n@{off}, {n:,} B", ha="center", va="center", fontsize=7)
        ax.set_xlim(0, max(len(b) for b in [boxes]))
        ax.set_yticks([])
        ax.set_xticks([])
        ax.set_title(f"{title}: {s.nbytes:,} bytes", fontsize=10)
    return _png(fig)
