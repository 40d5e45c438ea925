"""What ``pyllamacpp kv-live`` prints and draws: per mode the tensors in memory order and each
sequence's comparison; with ``-o``, the first mode's live buffer against sequence 0's dump.
"""

from __future__ import annotations

import os

import numpy as np

from ._compare import _ranges


def print_report(data: dict, *, all_tensors: bool = False) -> None:
    """Print what :func:`run` returned: per mode the tensors in memory order and each sequence's
    comparison.

    Args:
        data: What :func:`run` returned.
        all_tensors: List every tensor (otherwise the first six and the last two).
    """
    from ..common import print_table

    print(f"model {data['model']}; prompts: " + "; ".join(f"seq {i}: {p!r}" for i, p in enumerate(data["prompts"])))
    for m in data["modes"]:
        mem = m["memory"]
        t0 = m["tensors"][0]
        streams = t0["ne"][2]
        print(
            f"\n{m['layout']}, flash_attn {m['flash_attn']} (v_trans {int(m['v_trans'])}): n_ctx {m['n_ctx']}, "
            f"n_seq_max {m['n_seq_max']}, {streams} stream(s) of {t0['ne'][1]} cells; "
            f"{m['n_passes']} passes watched"
        )
        bufs = ", ".join(f"{b} {n:,} bytes" for b, n in mem["buffers"].items())
        order = mem["order"]
        shown = order if len(order) <= 8 else [*order[:6], "...", *order[-2:]]
        print(
            f"  memory order (by offset): {' '.join(shown)}; buffer(s): {bufs}; "
            f"{mem['gaps']:,} bytes not covered by a tensor"
        )
        ts = m["tensors"]
        cut = not all_tensors and len(ts) > 8
        rows = [
            {
                **t,
                "ne_s": " x ".join(str(x) for x in t["ne"][:3]),
                "nb_s": ", ".join(str(x) for x in t["nb"][:3]),
                "end": t["buffer_offset"] + t["nbytes"],
            }
            for t in (ts[:6] + ts[-2:] if cut else ts)
        ]
        if cut:  # --all lists every one
            rows.insert(6, {"name": f"({len(ts) - 8} more)"})
        print_table(
            rows,
            [
                ("name", "tensor", "s"),
                ("type", "type", "s"),
                ("ne_s", "ne", "s"),
                ("nb_s", "nb (bytes)", "s"),
                ("buffer", "buffer", "s"),
                ("buffer_offset", "offset", ","),
                ("end", "end", ","),
                ("nbytes", "bytes", ","),
            ],
        )
        for s in m["seqs"]:
            k = [r for r in s["layers"] if r["kind"] == "K"]
            v = [r for r in s["layers"] if r["kind"] == "V"]
            verdict = "live = file, byte for byte" if s["ok"] else f"{s['mismatches']:,} BYTES DIFFER"
            print(
                f"  seq {s['seq_id']}: stream {s['stream']}, cells {_ranges(s['cells'])} (from attn_inp_k_idxs; "
                f"the dump's {len(s['cells'])} cells have the same positions); {len(k)} K + {len(v)} V layers, "
                f"{s['bytes']:,} bytes of the {s['dump_bytes']:,}-byte dump: {verdict}"
            )
            for r in s["layers"]:
                if r["mismatches"]:
                    f = r["first"]
                    print(
                        f"    {r['kind']} layer {r['layer']}: {r['mismatches']} bytes differ; "
                        f"first at cell {f['cell']} "
                        f"({f['what']}): tensor byte {f['tensor_offset']:,} (buffer {f['buffer_offset']:,}), "
                        f"dump byte {f['dump_offset']:,}"
                    )
    n_seq = sum(len(m["seqs"]) for m in data["modes"])
    n_bytes = sum(s["bytes"] for m in data["modes"] for s in m["seqs"])
    if data["ok"]:
        print(f"\nlive = file: {n_bytes:,} bytes of {n_seq} sequences in {len(data['modes'])} modes, every one equal")
    else:
        print(f"\nLIVE AND FILE DIFFER: {sum(s['mismatches'] for m in data['modes'] for s in m['seqs']):,} bytes")


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw the first mode's live buffer against sequence 0's dump (matplotlib) into ``path``: the
    tensors in memory order, the dump's records (lines join a tensor to its record), and which
    cells hold which sequence.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (its suffix picks the format).
    """
    from matplotlib.patches import ConnectionPatch

    from ..common import figure

    m = data["modes"][0]
    seq = m["seqs"][0]
    ts = m["tensors"]
    size = next(iter(m["memory"]["buffers"].values()))
    colors = {"K": ("#4c72b0", "#8fa9d6"), "V": ("#dd8452", "#efb48f")}
    with figure(
        path,
        3,
        1,
        figsize=(11, 6.8),
        gridspec_kw={"height_ratios": [1, 1, 1.1], "hspace": 1.3},
        tight=False,
        bbox_inches="tight",
    ) as (fig, (live, dump, cellmap)):
        mib = 2**20
        for t in ts:
            live.barh(0, t["nbytes"] / mib, left=t["buffer_offset"] / mib, color=colors[t["kind"]][t["layer"] % 2])
        live.set_xlim(0, size / mib)
        live.set_yticks([])
        live.set_xlabel("MiB from the buffer's base", fontsize=8)
        live.set_title(
            f"the live {ts[0]['buffer']} buffer ({size:,} bytes), tensors sorted by the offset each one reports: "
            f"{' '.join(m['memory']['order'][:4])} ... {' '.join(m['memory']['order'][-2:])}",
            fontsize=9,
        )
        n_layer = len({t["layer"] for t in ts})
        row = seq["bytes"] // (2 * n_layer)
        total = seq["dump_bytes"]
        meta = total - 2 * n_layer * row
        kib = 1024
        for i in range(2 * n_layer):
            kind = "K" if i < n_layer else "V"
            dump.barh(0, row / kib, left=(meta + i * row) / kib, color=colors[kind][(i % n_layer) % 2])
        dump.set_xlim(0, total / kib)
        dump.set_yticks([])
        dump.set_xlabel("KiB from the dump's start", fontsize=8)
        dump.set_title(
            f"sequence 0's llama_state_seq_get_data_ext dump ({total:,} bytes): {meta} bytes of metadata, every "
            f"layer's K, then every layer's V\n{seq['bytes']:,} bytes compared with the same rows of the live tensors: "
            + ("all equal" if seq["ok"] else f"{seq['mismatches']:,} DIFFER"),
            fontsize=9,
        )
        for t in ts[:4]:
            rec = t["layer"] + (n_layer if t["kind"] == "V" else 0)
            fig.add_artist(
                ConnectionPatch(
                    xyA=((t["buffer_offset"] + t["nbytes"] / 2) / mib, -0.4),
                    coordsA=live.transData,
                    xyB=((meta + rec * row + row / 2) / kib, 0.4),
                    coordsB=dump.transData,
                    color=colors[t["kind"]][0],
                    lw=1.2,
                )
            )
        # which cells hold which sequence (the stream of sequence 0)
        kv_size = ts[0]["ne"][1]
        owner = np.full(kv_size, -1)
        for s in m["seqs"]:
            if s["stream"] == seq["stream"]:
                owner[s["cells"]] = s["seq_id"]
        used = np.flatnonzero(owner >= 0)
        n_show = min(kv_size, int(used.max()) + 6 if used.size else 16)
        palette = ["#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#ccb974"]
        for c in range(n_show):
            o = owner[c]
            cellmap.barh(0, 1, left=c, color=palette[o % len(palette)] if o >= 0 else "#dddddd", edgecolor="white")
        for s in m["seqs"]:
            if s["stream"] == seq["stream"]:
                for c, p in zip(s["cells"], s["pos"]):
                    if c < n_show:
                        cellmap.text(c + 0.5, 0, str(p), ha="center", va="center", fontsize=7, color="white")
        cellmap.set_xlim(0, n_show)
        cellmap.set_yticks([])
        cellmap.set_xlabel(f"cell of stream {seq['stream']} (of {kv_size})", fontsize=8)
        row_b = ts[0]["nb"][1]
        layout = (
            "V transposed (v_trans 1): value j of cell c at byte "
            f"(j x {kv_size} + c) x {ts[1]['nb'][0]} of cache_v_l<il>"
            if m["v_trans"]
            else "V the same way (v_trans 0)"
        )
        from matplotlib.patches import Patch

        here = [s for s in m["seqs"] if s["stream"] == seq["stream"]]
        cellmap.legend(
            handles=[Patch(color=palette[s["seq_id"] % len(palette)], label=f"seq {s['seq_id']}") for s in here]
            + [Patch(color="#dddddd", label="empty")],
            loc="upper right",
            fontsize=7,
            ncol=len(here) + 1,
            bbox_to_anchor=(1.0, -0.45),
        )
        cellmap.set_title(
            "which cells hold which sequence, from attn_inp_k_idxs (numbers: positions)\ncell c of K is bytes "
            f"c x {row_b} of cache_k_l<il>; {layout}",
            fontsize=8,
        )
