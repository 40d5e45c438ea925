"""``pyllamacpp prefill-profile``: where prefill time and compute workspace go, for each -ub.

The compute buffer llama.cpp reserves (``sched_reserve``) is sized for the worst ubatch: -ub
tokens, every one an output (``n_outputs = min(n_ubatch, n_outputs_max)``), attending to the whole
cache. For each -ub this prints, all measured:
  - the buffer reserved (the size llama.cpp logged, ``ctx.buffers``), the same reserve with
    ``n_outputs_max=1`` (what a prefill that wants the last token's logits only is sized for), and
    the bytes the -p token prefill really used: the highest byte any tensor of any of its passes
    reached in the compute buffer (each tensor's offset from the buffer's base, read as the graph
    ran);
  - the largest tensors of one all-output ubatch (ggml's ``ne`` and type: on a small model the
    logits, ``result_output``, -ub x n_vocab x 4 bytes);
  - the prefill's time by op type, from a pass where every node that computes is its own group
    (a Python ``cb_eval`` answers ``ask=true`` for each non-view node, so the scheduler computes
    it alone, synchronizes, and calls ``ask=false``; the time between two ``ask=false`` is the
    node's). What is left of the decode's wall time (graph build, inputs, the logits copy) is
    "outside nodes". Splitting costs time itself: the same prefill without the callback, in a
    context made the same way, is the baseline the distortion is measured against.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .common import Command, Interrupted, add_context_flags, add_model_path_flag, cache_kwargs, load_model, progress

if TYPE_CHECKING:
    from ..model import Model

CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.process_time_ns}

__all__ = ["NodeTimer", "measure", "run", "print_report", "plot", "add_parser", "main"]


class NodeTimer:
    """A Python ``cb_eval`` for a throwaway context: off, listing nodes, or timing them.

    ``mode`` is read at every call: ``"off"`` wants no node (the scheduler computes the graph in
    one go, as without a callback, but asks about each node); ``"list"`` records each node (name,
    op, type, ``ne``, bytes, and where it and the leaves it reads sit in the compute buffer) and
    wants none; ``"time"`` wants every node that computes (not RESHAPE, VIEW, PERMUTE, TRANSPOSE:
    they are computed with the next one, and cost nothing) and stamps the clock at each
    ``ask=false`` and where a pass starts: ``clock`` ``"wall"`` is ``time.perf_counter_ns``,
    ``"cpu"`` is ``time.process_time_ns`` (the CPU time of the whole process: with one thread the
    compute's own, which other processes on a busy machine do not inflate). An exception inside is kept and stops the
    decode; :meth:`check` raises it.

    Args:
        first: The name of the graph's first node until a ``"list"`` decode has seen it.
        clock: ``"wall"`` or ``"cpu"``.

    Attributes:
        cb: The cffi callback: ``model.context(cb_eval=timer.cb, taps=False)``; keep the timer
            alive as long as the context.
        mode: ``"off"``, ``"list"`` or ``"time"``.
        first: The name of the graph's first node (a pass starts there): the first node the
            first ``"list"`` decode sees.
        passes: ``"list"``: one list of node dicts per pass. ``"time"``: one dict per pass with
            ``start`` (ns) and ``nodes`` (``(t_ns, op, name)`` at each ``ask=false``).
    """

    def __init__(self, first: str = "embd", clock: str = "wall") -> None:
        from .._lib import ffi, lib

        if clock not in CLOCKS:
            raise ValueError(f"clock: {' or '.join(CLOCKS)}, got {clock!r}")
        self.clock = CLOCKS[clock]
        self.mode = "off"
        self.first = first.encode()
        self._seen_first = False
        self.passes: list[Any] = []
        self.error: BaseException | None = None
        self._ffi, self._lib = ffi, lib
        self._views = {lib.GGML_OP_RESHAPE, lib.GGML_OP_VIEW, lib.GGML_OP_PERMUTE, lib.GGML_OP_TRANSPOSE}
        self._get_rows = lib.GGML_OP_GET_ROWS
        self.cb = ffi.callback("bool(struct ggml_tensor *, bool, void *)", self._call)

    def reset(self, mode: str) -> None:
        """Start recording afresh in ``mode``.

        Args:
            mode: ``"off"``, ``"list"`` or ``"time"``.

        Raises:
            ValueError: Another mode.
        """
        if mode not in ("off", "list", "time"):
            raise ValueError(f"mode: off, list or time, got {mode!r}")
        self.mode, self.passes, self.error = mode, [], None

    def check(self) -> None:
        """Raise what the callback caught during the last decode, if anything.

        Raises:
            BaseException: What the callback raised.
        """
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _call(self, t, ask, _ud):
        try:
            mode = self.mode
            if mode == "time":
                if ask:
                    op = t.op
                    if op == self._get_rows and self._ffi.string(t.name) == self.first:
                        self.passes.append({"start": self.clock(), "nodes": []})
                    return op not in self._views
                now = self.clock()
                self.passes[-1]["nodes"].append((now, int(t.op), self._ffi.string(t.name)))
                return True
            if mode == "list" and ask:
                name = self._ffi.string(t.name)
                if not self.passes and not self._seen_first:  # the graph's first node: a pass starts there
                    self.first, self._seen_first = name, True
                if name == self.first:
                    self.passes.append([])
                self.passes[-1].append(self._node(t, name))
            return False
        except BaseException as e:  # noqa: BLE001 - never into C: kept, the decode stops, check() raises
            self.error = e
            return False

    def _place(self, t) -> tuple[int, int] | None:
        """(offset from the compute buffer's base, bytes) of a tensor that lives there, else None."""
        ffi, lib = self._ffi, self._lib
        src = t.view_src if t.view_src != ffi.NULL else t
        buf = src.buffer
        if buf == ffi.NULL or t.data == ffi.NULL:
            return None
        if lib.ggml_backend_buffer_get_usage(buf) != lib.GGML_BACKEND_BUFFER_USAGE_COMPUTE:
            return None
        base = int(ffi.cast("uintptr_t", lib.ggml_backend_buffer_get_base(buf)))
        return int(ffi.cast("uintptr_t", t.data)) - base, int(lib.ggml_nbytes(t))

    def _node(self, t, name: bytes) -> dict:
        ffi, lib = self._ffi, self._lib
        leaves = []
        for i in range(lib.GGML_MAX_SRC):
            s = t.src[i]
            if s == ffi.NULL:
                break
            if s.op == lib.GGML_OP_NONE:
                place = self._place(s)
                if place is not None:
                    leaves.append((ffi.string(s.name).decode("utf-8", "replace"), *place))
        return {
            "name": name.decode("utf-8", "replace"),
            "op": ffi.string(lib.ggml_op_name(t.op)).decode(),
            "type": ffi.string(lib.ggml_type_name(t.type)).decode(),
            "ne": tuple(int(t.ne[k]) for k in range(4)),
            "nbytes": int(lib.ggml_nbytes(t)),
            "view": t.view_src != ffi.NULL,
            "place": self._place(t),
            "leaves": leaves,
        }


def _op_name(op: int) -> str:
    from .._lib import ffi, lib

    return ffi.string(lib.ggml_op_name(op)).decode()


def _prompt(model: Model, n: int) -> np.ndarray:
    base = model.tokenize("The cat sat on the mat. The dog lay by the door and watched the rain. ")
    return np.resize(base, n).astype(np.int32)


def _high_water(passes: Sequence[list[dict]]) -> tuple[int, dict | None]:
    """The highest byte of the compute buffer any tensor of these passes reached, and that tensor."""
    best, who = 0, None
    for nodes in passes:
        for n in nodes:
            places = [(n["name"], *n["place"])] if n["place"] else []
            for name, off, size in places + n["leaves"]:
                if off + size > best:
                    best, who = off + size, {"name": name, "offset": off, "nbytes": size}
    return best, who


def _largest(nodes: Sequence[dict], k: int) -> list[dict]:
    """The ``k`` largest tensors a pass computed (views left out: they own no bytes)."""
    own = [n for n in nodes if not n["view"]]
    own.sort(key=lambda n: -n["nbytes"])
    return [
        {
            "name": n["name"],
            "op": n["op"],
            "type": n["type"],
            "shape": list(reversed(n["ne"][:2])),
            "bytes": n["nbytes"],
        }
        for n in own[:k]
    ]


def _timed(passes: list[dict], wall_ns: int) -> dict:
    """Per op type: ns between consecutive ``ask=false`` (from the pass's start for its first node);
    what is left of the wall time is ``outside``."""
    by_op: dict[str, int] = {}
    by_name: dict[str, int] = {}
    n_groups = 0
    for p in passes:
        prev = p["start"]
        for t, op, name in p["nodes"]:
            name_s = name.decode("utf-8", "replace")
            if name_s.startswith("node_"):  # unnamed (FLASH_ATTN_EXT): ggml numbers it by graph index
                site = "(unnamed)"
            else:
                site = name_s.rsplit("-", 1)[0] if name_s.rsplit("-", 1)[-1].isdigit() else name_s
            key = _op_name(op)
            by_op[key] = by_op.get(key, 0) + (t - prev)
            by_name[f"{site} ({key})"] = by_name.get(f"{site} ({key})", 0) + (t - prev)
            prev = t
            n_groups += 1
    inside = sum(by_op.values())
    return {"by_op": by_op, "by_site": by_name, "inside": inside, "outside": wall_ns - inside, "groups": n_groups}


def measure(
    model: Model,
    *,
    n_ctx: int,
    n_batch: int,
    n_ubatch: int,
    n_prompt: int,
    repeat: int,
    top: int = 5,
    clock: str = "wall",
    ctx_kwargs: dict | None = None,
) -> dict:
    """One -ub: the buffers, the largest tensors and where the prefill's time goes.

    Three contexts with these sizes: one with ``n_outputs_max=1`` (its reserved buffer), then,
    open together, a plain one (the reserved buffer, the baseline prefill time) and one with a
    :class:`NodeTimer` (the listing and the profiled prefill), whose prefills alternate.

    Args:
        model: The :class:`~pyllamacpp.Model`.
        n_ctx: ``n_ctx``.
        n_batch: ``n_batch`` (the prompt goes in one decode call when it is at least ``n_prompt``).
        n_ubatch: ``n_ubatch``.
        n_prompt: Prompt tokens to prefill.
        repeat: Runs of each timing; medians (wall), means (per op).
        top: How many of the largest tensors to keep.
        clock: What the times are: ``"wall"`` (``time.perf_counter_ns``) or ``"cpu"`` (the
            process's CPU time, ``time.process_time_ns``: what one thread computes, however busy
            the machine; with several threads it counts their spinning too).
        ctx_kwargs: Further context keywords (``flash_attn``, threads, cache types).

    Returns:
        ``n_ubatch``, ``reserved`` (bytes: ``default`` and ``one_output``, from llama.cpp's log),
        ``high_water`` (bytes the prefill used, and the tensor that reached it), ``largest``
        (the all-output ubatch's largest tensors) and ``largest_prefill`` (those of the prefill's
        last pass), ``plain_ms``, ``profiled_ms`` (and each run's: ``plain_runs_ms``,
        ``profiled_runs_ms``), ``distortion``, ``groups`` (nodes timed per
        prefill), ``by_op`` and ``by_site`` (ms, largest first), ``outside_ms``.

    Raises:
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed.
        ValueError: The prompt does not fit ``n_ctx``.
    """
    from ..batch import Batch

    kw = dict(ctx_kwargs or {})
    if n_prompt > n_ctx:
        raise ValueError(f"-p {n_prompt} does not fit -c {n_ctx}")
    prompt = _prompt(model, n_prompt)
    sizes = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, **kw)
    mib = 2**20
    row: dict[str, Any] = {"n_ubatch_asked": n_ubatch, "n_prompt": n_prompt, "repeat": repeat, "clock": clock}

    now = CLOCKS[clock]

    def prefill_ns(ctx) -> int:
        ctx.memory.clear()
        t0 = now()
        ctx.prefill(prompt)
        return now() - t0

    with model.context(**sizes, n_outputs_max=1) as ctx:
        one_output = _compute_bytes(ctx.buffers)
    timer = NodeTimer(clock=clock)
    with model.context(**sizes) as plain_ctx, model.context(**sizes, cb_eval=timer.cb, taps=False) as ctx:
        row["n_ubatch"] = ctx.n_ubatch
        row["reserved"] = {"default": _compute_bytes(plain_ctx.buffers), "one_output": one_output}
        # the reserve's shape: one ubatch, every token an output
        b = Batch(row["n_ubatch"], 1, model=model)
        b.add_sequence(prompt[: row["n_ubatch"]], 0, 0, logits="all")
        timer.reset("list")
        ctx.decode(b)
        timer.check()
        row["largest"] = _largest(timer.passes[0], top)
        row["high_water_all_outputs"] = _high_water(timer.passes)[0]
        # the prefill as it runs: its passes, n_kv growing, one output in the last
        ctx.memory.clear()
        timer.reset("list")
        ctx.prefill(prompt)
        timer.check()
        hw, who = _high_water(timer.passes)
        row["high_water"] = {"bytes": hw, "tensor": who}
        row["n_passes"] = len(timer.passes)
        row["largest_prefill"] = _largest(timer.passes[-1], top)
        timer.reset("off")
        prefill_ns(plain_ctx)  # warm both: pages of the weights and buffers touched once
        prefill_ns(ctx)
        plain, runs = [], []
        for _ in range(repeat):  # alternated, so a change in the machine's load hits both alike
            plain.append(prefill_ns(plain_ctx))
            timer.reset("time")
            wall = prefill_ns(ctx)
            timer.mode = "off"
            timer.check()
            runs.append((wall, _timed(timer.passes, wall)))
    profiled = [w for w, _ in runs]
    row["plain_runs_ms"] = [x / 1e6 for x in plain]
    row["profiled_runs_ms"] = [x / 1e6 for x in profiled]
    row["plain_ms"] = statistics.median(plain) / 1e6
    row["profiled_ms"] = statistics.median(profiled) / 1e6
    row["distortion"] = row["profiled_ms"] / row["plain_ms"]
    row["groups"] = runs[0][1]["groups"]
    ops: dict[str, float] = {}
    sites: dict[str, float] = {}
    for _, t in runs:
        for k, v in t["by_op"].items():
            ops[k] = ops.get(k, 0.0) + v / 1e6 / repeat
        for k, v in t["by_site"].items():
            sites[k] = sites.get(k, 0.0) + v / 1e6 / repeat
    row["by_op"] = dict(sorted(ops.items(), key=lambda kv: -kv[1]))
    row["by_site"] = dict(sorted(sites.items(), key=lambda kv: -kv[1])[:12])
    row["inside_ms"] = sum(t["inside"] for _, t in runs) / 1e6 / repeat
    row["outside_ms"] = sum(t["outside"] for _, t in runs) / 1e6 / repeat
    row["wall_ms_mean"] = sum(profiled) / 1e6 / repeat
    row["per_group_us"] = (row["profiled_ms"] - row["plain_ms"]) * 1e3 / max(1, row["groups"])
    row["reserved_mib"] = {k: v / mib for k, v in row["reserved"].items()}
    return row


def _compute_bytes(buffers: dict) -> int:
    """The compute buffers llama.cpp logged, summed over backends, in bytes (the log's MiB, 2 places)."""
    return round(sum(k.get("compute", 0.0) for k in buffers.values()) * 2**20)


def run(args: argparse.Namespace) -> dict:
    """:func:`measure` for each ``-ub`` of ``--ubatch-list``.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        ``model``, ``n_ctx``, ``n_prompt``, ``threads``, ``flash_attn``, ``clock``, ``n_vocab`` and
        ``rows``.

    Raises:
        ModelLoadError: The model cannot be loaded.
        ValueError: An empty ``-ub`` list, or a prompt longer than ``-c``.
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed.
        Interrupted: Ctrl-C; it carries the rows measured before it.
    """
    ubs = [int(x) for x in str(args.ubatch_list).split(",") if x.strip()]
    if not ubs:
        raise ValueError("prefill-profile: --ubatch-list is empty")
    kw = cache_kwargs(args)
    with load_model(args) as model:
        rows: list[dict] = []
        data = {
            "model": str(model.path),
            "n_ctx": args.ctx_size,
            "n_prompt": args.n_prompt,
            "threads": args.threads,
            "flash_attn": args.flash_attn,
            "clock": args.clock,
            "n_vocab": model.n_vocab,
            "rows": rows,
        }
        try:
            for ub in progress(ubs, "prefill-profile"):
                rows.append(
                    measure(
                        model,
                        n_ctx=args.ctx_size,
                        n_batch=max(args.batch_size, args.n_prompt),
                        n_ubatch=ub,
                        n_prompt=args.n_prompt,
                        repeat=args.repeat,
                        top=args.top,
                        clock=args.clock,
                        ctx_kwargs=kw,
                    )
                )
        except KeyboardInterrupt:
            raise Interrupted(data if rows else None, len(rows), len(ubs), "rows") from None
    return data


def _spread(xs: Sequence[float]) -> float:
    """(max - min) / median, in percent."""
    return 100 * (max(xs) - min(xs)) / statistics.median(xs) if xs else 0.0


def _top_ops(rows: Sequence[dict], k: int = 5) -> list[str]:
    total: dict[str, float] = {}
    for r in rows:
        for op, ms in r["by_op"].items():
            total[op] = total.get(op, 0.0) + ms / r["n_prompt"]
    return [op for op, _ in sorted(total.items(), key=lambda kv: -kv[1])[:k]]


def print_report(data: dict) -> None:
    """Print what :func:`run` returned: a buffer table, a time table, and each -ub's largest tensors.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    mib = 2**20
    rows = data["rows"]
    print(
        f"model {data['model']}, -c {data['n_ctx']}, -p {data['n_prompt']}, -t {data['threads']}, "
        f"-fa {data['flash_attn']}; times: {data.get('clock', 'wall')} clock, median of {rows[0]['repeat']} prefills"
    )
    print("\ncompute buffer (MiB): reserved as llama.cpp logged it, and what the prefill used")
    print_table(
        [
            {
                "ub": r["n_ubatch"],
                "res": r["reserved"]["default"] / mib,
                "logits": next((x["bytes"] for x in r["largest"] if x["name"] == "result_output"), 0) / mib,
                "share": 100
                * next((x["bytes"] for x in r["largest"] if x["name"] == "result_output"), 0)
                / max(1, r["reserved"]["default"]),
                "res1": r["reserved"]["one_output"] / mib,
                "hw": r["high_water"]["bytes"] / mib,
                "used": 100 * r["high_water"]["bytes"] / max(1, r["reserved"]["default"]),
                "top": f"{r['largest_prefill'][0]['name']} {r['largest_prefill'][0]['bytes'] / mib:.2f}",
            }
            for r in rows
        ],
        [
            ("ub", "-ub", "d"),
            ("res", "reserved", ".2f"),
            ("logits", "result_output (all out)", ".2f"),
            ("share", "% of reserved", ".1f"),
            ("res1", "reserved, n_outputs_max 1", ".2f"),
            ("hw", "prefill used", ".2f"),
            ("used", "% used", ".1f"),
            ("top", "prefill's largest tensor", "s"),
        ],
    )
    ops = _top_ops(rows)
    print(f"\nprefill time (ms for the {data['n_prompt']}-token prompt); by op: each node timed alone")
    print_table(
        [
            {
                "ub": r["n_ubatch"],
                "passes": r["n_passes"],
                "plain": r["plain_ms"],
                "prof": r["profiled_ms"],
                "x": r["distortion"],
                **{f"op_{op}": r["by_op"].get(op, 0.0) * r["profiled_ms"] / r["wall_ms_mean"] for op in ops},
                "other": (r["inside_ms"] - sum(r["by_op"].get(op, 0.0) for op in ops))
                * r["profiled_ms"]
                / r["wall_ms_mean"],
                "outside": r["outside_ms"] * r["profiled_ms"] / r["wall_ms_mean"],
            }
            for r in rows
        ],
        [
            ("ub", "-ub", "d"),
            ("passes", "passes", "d"),
            ("plain", "plain", ".1f"),
            ("prof", "profiled", ".1f"),
            ("x", "x", ".2f"),
            *[(f"op_{op}", op, ".1f") for op in ops],
            ("other", "other ops", ".1f"),
            ("outside", "outside nodes", ".1f"),
        ],
    )
    print(
        "(op columns scaled to the median profiled prefill; 'x' = profiled / plain: the cost of one group per node, "
        + ", ".join(f"{r['per_group_us']:.1f} us per group at -ub {r['n_ubatch']}" for r in rows)
        + "; the plain runs spread "
        + ", ".join(f"{_spread(r['plain_runs_ms']):.1f}%" if "plain_runs_ms" in r else "?" for r in rows)
        + " (max - min over the median))"
    )
    for r in rows:
        big = ", ".join(f"{x['name']} {x['bytes'] / mib:.2f}" for x in r["largest"][:3])
        sites = ", ".join(f"{k} {v:.1f}" for k, v in list(r["by_site"].items())[:4])
        print(f"-ub {r['n_ubatch']}: largest tensors of an all-output ubatch (MiB): {big}; slowest sites (ms): {sites}")


def plot(data: dict, path: str | os.PathLike) -> None:
    """Draw the buffers and the time by op type against ``-ub`` (matplotlib) into ``path``.

    Args:
        data: What :func:`run` returned.
        path: The image file to write (its suffix picks the format).
    """
    from .common import figure

    mib = 2**20
    rows = data["rows"]
    ub = [r["n_ubatch"] for r in rows]
    with figure(path, 1, 2, figsize=(12, 4.4)) as (fig, (a, b)):
        a.plot(ub, [r["reserved"]["default"] / mib for r in rows], "o-", label="reserved (llama.cpp's log)")
        logits = [next((x["bytes"] for x in r["largest"] if x["name"] == "result_output"), 0) / mib for r in rows]
        a.plot(ub, logits, "s--", label="result_output of an all-output ubatch")
        a.plot(ub, [r["reserved"]["one_output"] / mib for r in rows], "^-", label="reserved with n_outputs_max=1")
        a.plot(
            ub,
            [r["high_water"]["bytes"] / mib for r in rows],
            "v-",
            label=f"used by the {data['n_prompt']}-token prefill",
        )
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("n_ubatch")
        a.set_ylabel("MiB")
        a.set_title("compute buffer")
        a.legend(fontsize=8)
        ops = _top_ops(rows)
        x = np.arange(len(rows))
        bottom = np.zeros(len(rows))
        per_tok = np.array([r["profiled_ms"] / r["wall_ms_mean"] / r["n_prompt"] * 1e3 for r in rows])  # us per token
        for op in ops:
            h = np.array([r["by_op"].get(op, 0.0) for r in rows]) * per_tok
            b.bar(x, h, bottom=bottom, label=op)
            bottom += h
        other = np.array([r["inside_ms"] - sum(r["by_op"].get(op, 0.0) for op in ops) for r in rows]) * per_tok
        b.bar(x, other, bottom=bottom, label="other ops", color="#bbbbbb")
        bottom += other
        outside = np.array([r["outside_ms"] for r in rows]) * per_tok
        b.bar(x, outside, bottom=bottom, label="outside nodes", color="#444444")
        b.plot(
            x,
            [r["plain_ms"] / r["n_prompt"] * 1e3 for r in rows],
            "k_",
            markersize=30,
            mew=2,
            label="plain (no callback)",
        )
        b.set_xticks(x, [str(u) for u in ub])
        b.set_xlabel("n_ubatch")
        b.set_ylabel(f"µs per prompt token ({data.get('clock', 'wall')} clock)")
        b.set_title(f"prefill time by op type (each node timed alone), -t {data['threads']}")
        b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.suptitle(
            f"{str(data['model']).split('/')[-1]}  -c {data['n_ctx']}  -p {data['n_prompt']}  -fa {data['flash_attn']}"
        )


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_path_flag(p)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="n_ctx (default %(default)s)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="n_batch, at least -p (default %(default)s)")
    p.add_argument("-ub", "--ubatch-list", default="512,128,32,8", help="the -ub values (default %(default)s)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (default %(default)s)")
    p.add_argument("-r", "--repeat", type=int, default=3, help="prefills per timing (default %(default)s)")
    add_context_flags(p)
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: time.perf_counter_ns; cpu: the process's CPU time (time.process_time_ns), which other "
        "processes do not inflate: use it with -t 1 on a busy machine (default %(default)s)",
    )
    p.add_argument("--top", type=int, default=5, help="largest tensors kept per -ub (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("-o", "--output", help="write a two-panel figure (PNG)")


COMMAND = Command("prefill-profile", "compute buffer and prefill time by op type against -ub", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
