"""bench_core's report: the table's rows (ROWS and the rows summarize adds), the Python / native
ratios against the targets, the notes under the table and the JSON of a run."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path


def _rows(workload: str, unit: str, kind: str, *rows: tuple[str, str, str]) -> list[tuple[str, ...]]:
    """``(metric, label, target)`` rows of one workload, unit and kind, as ROWS' 6-tuples."""
    return [(workload, metric, label, unit, kind, target) for metric, label, target in rows]


# (workload, metric, label, unit, kind, target): kind "rate" -> ratio py/native of a rate (higher is
# better); "time" -> ratio py/native of a time (lower is better).
ROWS = [
    *_rows("decode", "tok/s", "rate", ("tok_s", "decode, 1 seq greedy", ">= 0.99x")),
    *_rows("parallel", "tok/s", "rate", ("tok_s", "decode, 8 seqs shared prompt", ">= 0.99x")),
    *_rows("prefill", "tok/s", "rate", ("tok_s", "prefill 512 in one decode", ">= 0.99x")),
    *_rows(
        "fill",
        "µs",
        "time",
        ("best_us", "fill 2048-token batch, best", "< 50 µs"),
        ("median_us", "fill 2048-token batch, median", "< 50 µs"),
    ),
    *_rows(
        "state",
        "ms",
        "time",
        ("get_ms", "seq_state 512 tok (get)", ""),
        ("set_ms", "set_seq_state, seq occupied", ""),
        ("set_empty_ms", "set_seq_state, seq empty", ""),
        ("roundtrip_ms", "round trip get + set (occupied)", "<= 1.1x"),
        ("fast_roundtrip_ms", "round trip, out= + validate=False + keep_on_error=False", "<= 1.1x"),
        ("place_get_min_ms", "  get, defaults, dump at the best of 8 page offsets", ""),
        ("place_get_max_ms", "  get, defaults, dump at the worst of 8 page offsets", ""),
        ("place_roundtrip_ms", "round trip, defaults, dump at 8 page offsets on both sides (median)", "<= 1.1x"),
    ),
]


def target_met(target: str, py: float, ratio: float) -> str:
    if not target:
        return ""
    if target.startswith(">="):
        return "yes" if ratio >= float(target[2:].strip(" x")) else "no"
    if target.startswith("<="):
        return "yes" if ratio <= float(target[2:].strip(" x")) else "no"
    if target.startswith("<"):
        return "yes" if py < float(target[1:].split()[0]) else "no"
    return ""


def row(wl, metric, label, unit, kind, target, nat: list, py: list) -> dict:
    """Medians per side, and the ratio as the median of the per-repeat ratios: the two runs of one
    repeat ran back to back, so their ratio cancels the drift of the machine between repeats."""
    mn, mp = statistics.median(nat), statistics.median(py)
    paired = statistics.median(p / n for p, n in zip(py, nat))
    return dict(
        workload=wl,
        metric=metric,
        label=label,
        unit=unit,
        kind=kind,
        native=mn,
        python=mp,
        ratio=paired,
        ratio_of_medians=mp / mn,
        target=target,
        met=target_met(target, mp, paired),
        native_all=nat,
        python_all=py,
    )


def summarize(runs: dict) -> list[dict]:
    for side in ("native", "python"):
        for r in runs.get("state", {}).get(side, []):
            r["roundtrip_ms"] = r["get_ms"] + r["set_ms"]
            r.setdefault("fast_roundtrip_ms", r["roundtrip_ms"])  # native C has one path
            if "place_get_ms" in r:  # per page offset of the destination: the median, the extremes
                trips = [g + t for g, t in zip(r["place_get_ms"], r["place_set_ms"])]
                r["place_roundtrip_ms"] = statistics.median(trips)
                r["place_get_min_ms"], r["place_get_max_ms"] = min(r["place_get_ms"]), max(r["place_get_ms"])
    rows = []
    for wl, metric, label, unit, kind, target in ROWS:
        if wl not in runs:
            continue
        nat = [r[metric] for r in runs[wl]["native"]]
        py = [r[metric] for r in runs[wl]["python"]]
        rows.append(row(wl, metric, label, unit, kind, target, nat, py))
    if runs.get("decode", {}).get("python_raw"):  # diagnostic: Python process + cffi, no pyllamacpp layers
        py = [r["tok_s"] for r in runs["decode"]["python_raw"]]
        nat = [r["tok_s"] for r in runs["decode"]["native"]]
        rows.insert(
            1, row("decode", "raw_tok_s", "  same loop in raw pl.lib calls (diagnostic)", "tok/s", "rate", "", nat, py)
        )
    pyd = runs.get("decode", {}).get("python", [])
    if pyd and "inproc_tok_s" in pyd[0]:  # both sides in one process, on one context
        nat, py = [r["inproc_native_tok_s"] for r in pyd], [r["inproc_tok_s"] for r in pyd]
        label = "  same, both sides in one process on one context"
        at = 2 if runs["decode"].get("python_raw") else 1  # after the raw pl.lib row, when there is one
        rows.insert(at, row("decode", "inproc_tok_s", label, "tok/s", "rate", ">= 0.99x", nat, py))
    pys = runs.get("state", {}).get("python", [])
    if pys and "inproc_roundtrip_ms" in pys[0]:  # both sides in one process, on one context
        for metric, label, target in (
            ("get_ms", "get, both sides in one process on one context", ""),
            ("set_ms", "set (occupied), both sides in one process on one context", ""),
            ("roundtrip_ms", "round trip, both sides in one process on one context", "<= 1.1x"),
        ):
            rows.append(
                row(
                    "state",
                    f"inproc_{metric}",
                    label,
                    "ms",
                    "time",
                    target,
                    [r[f"inproc_native_{metric}"] for r in pys],
                    [r[f"inproc_{metric}"] for r in pys],
                )
            )
    for key in ("", "short_"):  # the state fast path against the C calls: 512 tokens, short
        rs = runs.get("state_fast", {}).get("python", [])
        for side, op, label in (
            ("py", "get", "seq_state(out=buf)"),
            ("py", "set", "set_seq_state(validate=False, keep_on_error=False)"),
            ("sb", "get", "seq_state(out=StateBuffer)"),
            ("sb", "set", "set_seq_state(its state, validate=False, keep_on_error=False)"),
        ):
            if not rs or f"{key}{side}_{op}_us" not in rs[0]:
                continue
            r = row(
                "state_fast",
                f"{key}{side}_{op}_us",
                f"state fast path, {label}, {rs[0][f'{key}n_tokens']} tok, one process ('native' = the cffi call)",
                "µs",
                "time",
                "<= 1.02x" if not key else "",
                [x[f"{key}c_{op}_us"] for x in rs],
                [x[f"{key}{side}_{op}_us"] for x in rs],
            )
            ratio_key = f"{key}{op}_ratio" if side == "py" else f"{key}sb_{op}_ratio"
            r["ratio"] = statistics.median(x[ratio_key] for x in rs)  # the steps' pairs, in the worker
            r["met"] = target_met(r["target"], r["python"], r["ratio"])
            rows.append(r)
    rs = [x for x in runs.get("llama_cpp_python", {}).get("python", []) if not x.get("absent")]
    if rs:  # pyllamacpp against llama-cpp-python ('native' column: llama-cpp-python)
        for metric, lcp, py, label, unit, kind in (
            ("get_ratio", "lcp_get_us", "py_get_us", "state get into a reused buffer, 512 tok", "µs", "time"),
            ("decode_ratio", "lcp_tok_s", "py_tok_s", "decode, 1 seq greedy (generate)", "tok/s", "rate"),
        ):
            r = row(
                "llama_cpp_python",
                metric,
                f"vs llama-cpp-python {rs[0]['version']}: {label}, one process ('native' = llama-cpp-python)",
                unit,
                kind,
                "",
                [x[lcp] for x in rs],
                [x[py] for x in rs],
            )
            r["ratio"] = statistics.median(x[metric] for x in rs)
            rows.append(r)
    if runs.get("text", {}).get("python"):  # Python only: complete(stream=True) against generate
        rs = runs["text"]["python"]
        nat, py = [x["generate_tok_s"] for x in rs], [x["complete_tok_s"] for x in rs]
        label = "text: complete(stream=True) / generate, one process ('native' = generate)"
        r = row("text", "complete_tok_s", label, "tok/s", "rate", ">= 0.98x", nat, py)
        r["ratio"] = statistics.median(x["ratio"] for x in rs)  # the paired runs' ratios, in the worker
        r["met"] = target_met(r["target"], r["python"], r["ratio"])
        rows.append(r)
    if "fill" in runs:  # Batch(model=...) checks tokens against the vocabulary: shown for reference
        for metric in ("checked_best_us", "checked_median_us"):
            py = [r[metric] for r in runs["fill"]["python"]]
            nat = [r[metric.replace("checked_", "")] for r in runs["fill"]["native"]]
            rows.append(
                row(
                    "fill",
                    metric,
                    f"  same, Batch(model=) vocab check, {metric.split('_')[1]}",
                    "µs",
                    "time",
                    "< 50 µs",
                    nat,
                    py,
                )
            )
    return rows


def fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"


def notes(runs: dict, workloads: list[str], all_settings: dict) -> list[str]:
    """The lines under the table: flash attention as resolved, whether the sides' tokens agree, state
    sizes and page offsets, what the one-process and Python-only rows compared."""
    out = []
    fa = {
        f"{w}/{side}": res[0].get("flash_attn")
        for w in workloads
        for side in ("native", "python")
        for res in [runs[w][side]]
        if res and "flash_attn" in res[0]
    }
    out.append(
        "flash attention: requested auto on both sides; resolved to "
        + ", ".join(sorted({v for v in fa.values()}))
        + f" ({len(fa)} workload/side pairs)"
    )
    for w in ("decode", "parallel"):
        if w in runs:
            same = {r["checksum"] for r in runs[w]["native"] + runs[w]["python"] + runs[w]["python_raw"]}
            out.append(
                f"{w}: generated tokens {'identical on both sides' if len(same) == 1 else 'DIFFER'} "
                f"({len(same)} distinct checksum(s)); decoded tokens per run: "
                f"native {runs[w]['native'][0]['n_decoded']}, python {runs[w]['python'][0]['n_decoded']}"
            )
    if runs.get("text", {}).get("python"):
        same = all(r["same_text"] for r in runs["text"]["python"])
        out.append(
            f"text: complete(stream=True) and generate alternated, {all_settings['text']['pairs']} runs each "
            f"per worker, {runs['text']['python'][0]['n_decoded']} decoded tokens per run; text "
            + ("identical" if same else "DIFFERS")
        )
    if runs.get("decode", {}).get("python") and "inproc_tok_s" in runs["decode"]["python"][0]:
        same = all(r["inproc_same_tokens"] for r in runs["decode"]["python"])
        out.append(
            "decode, one process: native_driver.c's run_decode through ctypes on the Python side's context "
            "and sampler, alternating with pl.generate, 2 runs each per worker; tokens "
            + ("identical" if same else "DIFFER")
        )
    if "state" in runs:
        out.append(
            f"state bytes: native {runs['state']['native'][0]['state_bytes']}, "
            f"python {runs['state']['python'][0]['state_bytes']}"
        )
        offs = {
            side: sorted({r.get("buf_page_offset") for r in runs["state"][side]}, key=str)
            for side in ("native", "python")
        }
        out.append(
            f"state: page offset of each side's fresh dump buffer (malloc in each process): native {offs['native']}, "
            f"python {offs['python']}"
        )
        if runs["state"]["python"] and "inproc_native_page_offsets" in runs["state"]["python"][0]:
            out.append(
                "state, one process: native_driver.c's state_step through ctypes on the Python side's "
                "context, alternating with seq_state + set_seq_state, "
                f"{3 * all_settings['state']['iters']} steps each per run; its malloc page offsets "
                f"{sorted({o for r in runs['state']['python'] for o in r['inproc_native_page_offsets']})}"
            )
    if runs.get("state_fast", {}).get("python"):
        r0 = runs["state_fast"]["python"][0]
        out.append(
            f"state fast path: {r0['pairs']} steps (get + set) per side per worker, alternating, in one process on "
            f"one context and one reused buffer ({r0['state_bytes']} and {r0['short_state_bytes']} bytes); "
            "'native' = lib.llama_state_seq_get_data_ext / set_data_ext with pointers made once; "
            "ratio = median of the steps' paired ratios"
        )
    if "llama_cpp_python" in runs:
        lcp = runs["llama_cpp_python"]["python"]
        if not lcp or lcp[0].get("absent"):
            out.append("llama-cpp-python: not importable (import llama_cpp failed): its rows skipped")
        else:
            out.append(
                f"llama-cpp-python {lcp[0]['version']} ({lcp[0].get('lib', '?')}): decode tokens "
                + ("identical" if all(x["same_tokens"] for x in lcp) else "DIFFER")
            )
    out.append(
        "Python / native: median over repeats of the ratio of the two back-to-back runs; rates (tok/s): "
        "higher is better, times: lower is better; 'met' uses it (the fill target: the Python µs)"
    )
    return out


def report(info: dict, runs: dict, workloads: list[str], t_start: float, json_path: str | None) -> None:
    """Prints the table and its notes and, with ``json_path``, writes there ``info`` (the run: model,
    threads, repeats, settings, build_cmd, the load averages), the rows, the notes and every raw result."""
    rows = summarize(runs)
    model, threads, repeats = info["model"], info["threads"], info["repeats"]
    load_before, load_after, loads = info["load_before"], info["load_after"], info["loads"]

    print(f"\nmodel {model}; {threads} threads; {repeats} runs per side, alternating; medians")
    print(
        f"load average (1/5/15 min) before {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f}; 1-min load after each run "
        f"{min(loads):.2f}..{max(loads):.2f} (this benchmark alone adds up to ~{threads}); "
        f"{time.time() - t_start:.0f} s\n"
    )
    print("| workload | unit | native | Python | Python / native | (of medians) | target | met |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['unit']} | {fmt(r['native'])} | {fmt(r['python'])} | {r['ratio']:.3f} | "
            f"{r['ratio_of_medians']:.3f} | {r['target']} | {r['met']} |"
        )
    lines = notes(runs, workloads, info["settings"])
    print()
    for n in lines:
        print("-", n)
    if json_path:
        Path(json_path).write_text(json.dumps({**info, "rows": rows, "notes": lines, "runs": runs}, indent=1))
