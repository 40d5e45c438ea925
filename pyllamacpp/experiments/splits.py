"""``pyllamacpp split-plan``: how a submitted batch becomes decode calls, ubatches and rows.

A pure-Python replica of the vendored llama.cpp's splitting (``pyllamacpp.experiments.ubatch_plan``),
no model needed:
  - decode calls: ``llama_decode`` refuses more than ``n_batch`` tokens (it asserts), so the
    submitter cuts the token stream into ``n_batch``-sized calls (as ``ctx.prefill`` does);
  - ubatches: ``llama_batch_allocr::split_simple`` / ``split_equal`` / ``split_seq``
    (src/llama-batch.cpp), chosen as ``llama_kv_cache::init_batch`` does: one KV stream
    (``--kv-unified``, or ``-np 1``) -> ``split_simple``; one stream per sequence ->
    ``split_equal(n_ubatch, sequential=true)`` (``split_seq`` is what recurrent/hybrid memories use
    when every token is an output);
  - per ubatch, the padded KV length the graph attends over, ``n_kv`` =
    ``min(kv_size, max(256, GGML_PAD(used_max_p1, 256)))`` over the ubatch's streams
    (``llama_kv_cache::get_n_kv``), and the KQ mask shape ``[n_kv, n_tokens/n_stream, 1, n_stream]``
    (``build_attn_inp_kq_mask``), for a cache that starts empty except ``--past`` tokens per sequence.
Each sequence's tokens are laid out one sequence after the other (``--layout seq``, like
``Batch.add_sequence``) or round-robin (``--layout interleave``, like a decode step of many
sequences); logits are asked for the last token of each sequence. ``-o plan.html`` writes a
self-contained page (hover a block: its rows; click: highlight that sequence everywhere).
"""

from __future__ import annotations

import argparse
import html
import json
import os

# BatchAllocr, PlanError, split_all: re-exported, as older code imports them from here
from ..ubatch import BatchAllocr as BatchAllocr
from ..ubatch import PlanError as PlanError
from ..ubatch import pad, per_seq, plan
from ..ubatch import split_all as split_all
from .common import Command, add_kv_unified_flags
from .ubatch_plan import add_plan_flags, shape_from_args, summary_line


def _flags(p: argparse.ArgumentParser) -> None:
    add_plan_flags(p)
    p.add_argument("-b", "--n-batch", "--batch-size", dest="batch_size", type=int, default=2048)
    p.add_argument("-ub", "--n-ubatch", "--ubatch-size", dest="ubatch_size", type=int, default=512)
    p.add_argument(
        "-c",
        "--ctx-size",
        "--n-ctx",
        dest="ctx_size",
        type=int,
        default=None,
        help="n_ctx (default: 4096, or enough for the tokens)",
    )
    p.add_argument(
        "-np",
        "--parallel",
        "--n-seq-max",
        dest="parallel",
        type=int,
        default=None,
        help="n_seq_max (default: the number of sequences)",
    )
    add_kv_unified_flags(p, default=False)
    p.add_argument("--rows", type=int, default=6, help="runs shown per ubatch in the text report (default %(default)s)")
    p.add_argument("-o", "--output", help="write a self-contained HTML page")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> dict:
    """:func:`plan` for the flags; ``-c`` not given: enough cells for everything, at least 4096.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        The plan as :meth:`Plan.to_dict` gives it (rows only for ``--json`` or ``-o``), and
        ``show_runs``.

    Raises:
        PlanError: Where llama.cpp would refuse the submission.
    """
    shape = shape_from_args(args)
    n_ctx = args.ctx_size
    if n_ctx is None:  # enough for everything, at least llama.cpp's usual 4096
        toks = per_seq(shape["tokens"], shape["n_seqs"], "tokens")
        past = per_seq(shape["n_past"], shape["n_seqs"], "n_past")
        need = (
            sum(toks) + sum(past)
            if args.kv_unified
            else max(t + p for t, p in zip(toks, past)) * (args.parallel or shape["n_seqs"])
        )
        n_ctx = max(4096, pad(need, 256))
    p = plan(
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        n_ctx=n_ctx,
        n_seq_max=args.parallel,
        kv_unified=args.kv_unified,
        **shape,
    )
    d = p.to_dict(rows=bool(getattr(args, "json", False) or getattr(args, "output", None)))
    d["show_runs"] = getattr(args, "rows", 6)
    return d


SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _bar(ub: dict, n_ubatch: int, width: int = 48) -> str:
    """One character per n_ubatch/width slots: the sequence holding most of them, '.' for empty."""
    width = min(width, n_ubatch)
    seq_at = []
    for r in ub["runs"]:
        seq_at += [r["seq_id"]] * r["n"]
    out = []
    for c in range(width):
        a, b = c * n_ubatch // width, max((c + 1) * n_ubatch // width, c * n_ubatch // width + 1)
        cell = seq_at[a:b]
        out.append(SYMBOLS[max(set(cell), key=cell.count) % len(SYMBOLS)] if cell else ".")
    return "|" + "".join(out) + "|"


def _runs_text(ub: dict, limit: int) -> str:
    parts = []
    for r in ub["runs"][:limit]:
        t = f"{r['token0']}" if r["n"] == 1 else f"{r['token0']}-{r['token1']}"
        parts.append(f"s{r['seq_id']}:{t}")
    more = len(ub["runs"]) - limit
    return " ".join(parts) + (f" (+{more} runs)" if more > 0 else "")


def print_report(data: dict) -> None:
    """Print the plan: the sizes, then per decode call one line per ubatch.

    Args:
        data: What :func:`run` returned.
    """
    n_ub = sum(len(c["ubatches"]) for c in data["calls"])
    seqs = len(data["tokens"])
    print(
        f"{seqs} sequence(s), tokens {list(data['tokens'])}"
        + (f" after past {list(data['n_past'])}" if any(data["n_past"]) else "")
        + f", layout {data['layout']}"
    )
    print(
        f"n_ctx {data['n_ctx']} ({data['n_ctx_seq']} cells per stream, {data['n_stream_kv']} stream(s), "
        f"kv_unified {data['kv_unified']}), n_batch {data['n_batch']}, n_ubatch {data['n_ubatch']}, "
        f"n_seq_max {data['n_seq_max']}"
    )
    seq_txt = f"sequential={str(data['sequential']).lower()}" if data["split"] == "equal" else ""
    print(
        f"split: split_{data['split']}({seq_txt}) (mode {data['mode']}) -> {len(data['calls'])} decode call(s), "
        f"{n_ub} ubatch(es) = forward passes"
    )
    for n in data["notes"]:
        print(f"note: {n}")
    print(
        "rows: s<seq>:<token index range> (token index within the sequence's submitted tokens); "
        "bar: one char per slot group, the sequence id, '.' unused"
    )
    for c in data["calls"]:
        print(f"\ndecode call {c['index']}: {c['n_tokens']} tokens")
        for u in c["ubatches"]:
            print(
                f"  ubatch {u['index']:3d} {_bar(u, data['n_ubatch'])} {u['n_tokens']:5d} rows "
                f"({u['n_seqs']}x{u['n_seq_tokens']}) n_kv {u['n_kv']:6d} mask {u['mask_shape']} "
                f"out {u['n_outputs']}  {_runs_text(u, data.get('show_runs', 6))}"
            )


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>split plan</title><style>
body{font:13px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:18px} .call{margin:1em 0;padding:.5em;border:1px solid #ccc;border-radius:4px}
.ub{display:flex;align-items:center;margin:3px 0} .lbl{width:8em;font-family:monospace;font-size:12px}
.bar{display:flex;width:60vw;height:20px;background:#f4f4f4;border:1px solid #999}
.seg{height:100%;box-sizing:border-box;border-right:1px solid #fff;cursor:pointer}
.kv{width:60vw;height:5px;background:#eee;margin-left:8em;position:relative}
.kv div{position:absolute;height:100%} .info{font-family:monospace;font-size:12px;margin-left:1em;white-space:nowrap}
.dim .seg{opacity:.15} .dim .seg.hl{opacity:1;outline:2px solid #000}
#box{position:fixed;right:1em;top:1em;background:#fff;border:1px solid #888;padding:.5em;font-family:monospace;
white-space:pre;max-width:40em}
</style></head><body><h1>split plan</h1><p>__SUMMARY__</p>
<p>Each bar is one ubatch (one forward pass), as wide as n_ubatch slots; colour = sequence. The thin bar under
it: cells used (dark) and n_kv, the padded KV length the graph attends over (light), out of __NKVMAX__.
Hover a block for its rows; click it to highlight that sequence everywhere (click again to clear).</p>
<div id="plan"></div><div id="box">hover a block</div>
<script>
const D = __DATA__;
const col = s => `hsl(${(s*137.5)%360},65%,55%)`;
const root = document.getElementById('plan'), box = document.getElementById('box');
let hl = null;
for (const c of D.calls) {
  const cd = document.createElement('div'); cd.className = 'call';
  cd.innerHTML = `<b>decode call ${c.index}</b>: ${c.n_tokens} tokens`;
  for (const u of c.ubatches) {
    const row = document.createElement('div'); row.className = 'ub';
    row.innerHTML = `<span class="lbl">ubatch ${u.index}</span>`;
    const bar = document.createElement('div'); bar.className = 'bar';
    for (const r of u.runs) {
      const s = document.createElement('div'); s.className = 'seg s' + r.seq_id;
      s.style.width = (100 * r.n / D.n_ubatch) + '%'; s.style.background = col(r.seq_id);
      s.onmouseenter = () => { box.textContent = `call ${c.index}, ubatch ${u.index} (split_${u.split})\\n` +
        `seq ${r.seq_id}: tokens ${r.token0}..${r.token1} (${r.n} rows)\\npos ${r.pos0}..${r.pos1}\\n` +
        `batch slots ${r.slot0}..${r.slot1}\\nubatch: ${u.n_tokens} rows = ${u.n_seqs} x ${u.n_seq_tokens}, ` +
        `seqs [${u.seq_ids}]\\nn_kv ${u.n_kv}, mask [${u.mask_shape}], outputs ${u.n_outputs}`; };
      s.onclick = () => { hl = hl === r.seq_id ? null : r.seq_id; paint(); };
      bar.appendChild(s);
    }
    row.appendChild(bar);
    const info = document.createElement('span'); info.className = 'info';
    info.textContent = `${u.n_tokens} rows  n_kv ${u.n_kv}  mask [${u.mask_shape}]  out ${u.n_outputs}`;
    row.appendChild(info); cd.appendChild(row);
    const kv = document.createElement('div'); kv.className = 'kv';
    const used = Math.max(...Object.values(u.kv_used));
    kv.innerHTML = `<div style="width:${100*u.n_kv/__NKVMAX__}%;background:#bcd"></div>` +
                   `<div style="width:${100*used/__NKVMAX__}%;background:#468"></div>`;
    cd.appendChild(kv);
  }
  root.appendChild(cd);
}
function paint() {
  root.classList.toggle('dim', hl !== null);
  document.querySelectorAll('.seg').forEach(
    e => e.classList.toggle('hl', hl !== null && e.classList.contains('s' + hl)));
}
</script></body></html>
"""


def plot(data: dict, path: str | os.PathLike) -> None:
    """Write the plan as one self-contained HTML page (inline CSS and JS, no network).

    Args:
        data: What :func:`run` returned (with rows).
        path: The HTML file to write.

    Raises:
        OSError: The file cannot be written.
    """
    slim = {
        "n_ubatch": data["n_ubatch"],
        "calls": [
            {
                "index": c["index"],
                "n_tokens": c["n_tokens"],
                "ubatches": [{k: v for k, v in u.items() if k != "rows"} for u in c["ubatches"]],
            }
            for c in data["calls"]
        ],
    }
    n_kv_max = max(u["n_kv"] for c in data["calls"] for u in c["ubatches"])
    page = (
        _PAGE.replace("__SUMMARY__", html.escape(summary_line(data)))
        .replace("__NKVMAX__", str(n_kv_max))
        .replace("__DATA__", json.dumps(slim).replace("</", "<\\/"))
    )
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)


COMMAND = Command("split-plan", "how a batch becomes decode calls and ubatches (no model)", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
