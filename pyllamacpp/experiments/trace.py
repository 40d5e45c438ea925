"""``pyllamacpp trace-ubatches``: what the engine really ran, pass by pass, against ``split-plan``.

Runs the decode calls ``split-plan`` plans for the same shape (``--tokens``, ``--seqs``, ``--past``,
``--layout``; -b -ub -c -np --kv-unified as for llama.cpp) on a real model with a ``cb_eval``
callback (``ggml_backend_sched_eval_callback``), which the scheduler calls with ``ask=true`` for
every graph node before computing it. Per forward pass it reads, from the graph llama.cpp built:
  - the KQ mask, ``attn_inp_kq_mask`` ``[n_kv, n_tokens/n_stream, 1, n_stream]``: graph inputs
    are leaves, never shown to the callback, so it is read as ``src[3]`` of the
    ``GGML_OP_FLASH_ATTN_EXT`` node (``src[1]`` of ``GGML_OP_SOFT_MAX`` with -fa off); its ne[0] is
    n_kv, ne[1] x ne[3] the token rows; the K view (``cache_k_l<il>``) must show the same n_kv;
  - the positions, ``inp_pos``, as ``src[1]`` of the first ``GGML_OP_ROPE`` node (values read with
    ``ggml_backend_tensor_get``), compared with the planner's rows one by one;
  - the outputs: ne[1] of ``result_output``.
A pass starts at each reappearance of the graph's first node (``embd``); within a pass every
attention layer must appear once. Only the traced decode calls count: no callback fires while the
context is created (the reserve passes build graphs but compute none; the report says how many
fired) and the ``--past`` prefill runs untraced. Any disagreement with the planner fails the
command (exit 1) naming the pass and the field.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..ubatch import PlanError, plan
from .common import Command, add_model_flags, context_kwargs, progress, prompt_tokens, run_on_model
from .ubatch_plan import add_plan_flags, shape_from_args, summary_line

if TYPE_CHECKING:
    from ..model import Model

FIELDS = ("n_tokens", "n_kv", "n_stream", "n_outputs")


class EvalTrace:
    """A ``cb_eval`` that records, per forward pass, the shapes of the attention inputs.

    Called from the thread that runs ``llama_decode``; an exception never crosses into C: the
    first one is stored, the decode is aborted (``on_error``) and :meth:`check` re-raises it.

    Attributes:
        cb: The cffi callback to pass as ``cb_eval`` (``ggml_backend_sched_eval_callback``).
        passes: One dict per forward pass seen while recording.
        n_unrecorded: Callbacks that fired while not recording (context creation).
        on_error: Called once when the callback catches an exception (e.g. ``ctx.abort``).
    """

    def __init__(self) -> None:
        from .._lib import ffi, lib

        self.ffi, self.lib = ffi, lib
        self.recording = False
        self.call: int | None = None
        self.passes: list[dict] = []
        self.cur: dict | None = None
        self.first_name: str | None = None
        self.n_unrecorded = 0
        self.error: BaseException | None = None
        self.on_error = None
        self.cb = ffi.callback("bool(struct ggml_tensor *, bool, void *)", self._cb)

    def _cb(self, t, ask, user_data):
        try:
            if ask:
                self._see(t)
        except BaseException as e:  # noqa: BLE001 - stored, re-raised after llama_decode returns
            if self.error is None:
                self.error = e
                if self.on_error is not None:
                    self.on_error()
        return False  # need no data: the scheduler computes the whole split in one go

    def begin(self, call: int) -> None:
        """Record the passes that follow as those of decode call ``call``.

        Args:
            call: The planner's index of the decode call.
        """
        self.recording, self.call, self.cur = True, call, None

    def end(self) -> None:
        """Stop recording (callbacks are counted in ``n_unrecorded`` until the next :meth:`begin`)."""
        self.recording, self.cur = False, None

    def check(self) -> None:
        """Re-raise the exception the callback stored, once.

        Raises:
            BaseException: The first exception raised inside the callback, if any.
        """
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def _name(self, t) -> str:
        return self.ffi.string(t.name).decode("utf-8", "replace")

    def _ne(self, t) -> list[int]:
        return [int(t.ne[i]) for i in range(4)]

    def _base_name(self, t) -> str:
        while t.view_src != self.ffi.NULL:
            t = t.view_src
        return self._name(t)

    def _see(self, t) -> None:
        if not self.recording:
            self.n_unrecorded += 1
            return
        ffi, lib = self.ffi, self.lib
        name = self._name(t)
        if self.first_name is None:
            self.first_name = name
        if self.cur is None or name == self.first_name:
            self.cur = {"call": self.call, "first_node": name, "attn": [], "pos": None, "n_outputs": None}
            self.passes.append(self.cur)
        cur = self.cur
        op = t.op
        mask = k = None
        if op == lib.GGML_OP_FLASH_ATTN_EXT:
            k, mask = t.src[1], t.src[3]
        elif op == lib.GGML_OP_SOFT_MAX and t.src[1] != ffi.NULL:
            mask = t.src[1]
            kq = t.src[0]  # kq = mul_mat(k, q)
            k = kq.src[0] if kq != ffi.NULL and kq.op == lib.GGML_OP_MUL_MAT else None
        if mask is not None and mask != ffi.NULL and "kq_mask" in self._name(mask):
            cur["attn"].append(
                {
                    "op": "FLASH_ATTN_EXT" if op == lib.GGML_OP_FLASH_ATTN_EXT else "SOFT_MAX",
                    "mask": self._name(mask),
                    "mask_ne": self._ne(mask),
                    "k": self._base_name(k) if k is not None and k != ffi.NULL else None,
                    "k_ne": self._ne(k) if k is not None and k != ffi.NULL else None,
                }
            )
        elif op == lib.GGML_OP_ROPE and cur["pos"] is None and t.src[1] != ffi.NULL:
            p = t.src[1]
            if p.type == lib.GGML_TYPE_I32 and (p.buffer != ffi.NULL or p.view_src != ffi.NULL):
                n = int(p.ne[0])
                buf = ffi.new("int32_t[]", n)
                lib.ggml_backend_tensor_get(p, buf, 0, 4 * n)
                cur["pos"] = list(buf)
                cur["pos_tensor"] = self._name(p)
        elif name == "result_output":
            cur["n_outputs"] = int(t.ne[1])


def summarize(p: dict) -> dict:
    """One pass's engine figures from its attention nodes.

    Args:
        p: One entry of ``EvalTrace.passes``.

    Returns:
        ``call``, ``n_attn``, ``pos``, ``n_outputs``, and from the first KQ mask ``n_kv``,
        ``n_stream``, ``n_tokens``, ``mask_ne``...; ``problems`` lists what does not add up.
    """
    out = {"call": p["call"], "n_attn": len(p["attn"]), "pos": p["pos"], "n_outputs": p["n_outputs"], "problems": []}
    if not p["attn"]:
        out["problems"].append("no attention node with a KQ mask seen in this pass")
        return out
    a0 = p["attn"][0]
    ne = a0["mask_ne"]
    out.update(
        mask=a0["mask"],
        mask_ne=ne,
        attn_op=a0["op"],
        n_kv=ne[0],
        n_stream=ne[3],
        n_tokens=ne[1] * ne[3],
        k_ne=a0["k_ne"],
    )
    if any(a["mask_ne"] != ne for a in p["attn"]):
        shapes = sorted({tuple(a["mask_ne"]) for a in p["attn"]})
        out["problems"].append(f"mask shapes differ between layers: {shapes}")
    ks = [a["k"] for a in p["attn"] if a["k"]]
    if len(ks) != len(set(ks)):
        out["problems"].append("an attention layer appears twice in one pass (pass boundaries not found)")
    bad_k = [a for a in p["attn"] if a["k_ne"] and a["k_ne"][1] != ne[0]]
    if bad_k:
        out["problems"].append(f"K view length {bad_k[0]['k_ne'][1]} != mask n_kv {ne[0]} ({bad_k[0]['k']})")
    if p["pos"] is not None and len(p["pos"]) != out["n_tokens"]:
        out["problems"].append(f"inp_pos has {len(p['pos'])} entries, the mask {out['n_tokens']} rows")
    return out


def compare(pl: dict, engine: list[dict]) -> list[str]:
    """Planner ubatches against engine passes, call by call.

    Args:
        pl: The plan, as ``Plan.to_dict(rows=True)``.
        engine: The passes, as :func:`summarize` gives them.

    Returns:
        One message per disagreement (empty when they agree).
    """
    bad = []
    for c in pl["calls"]:
        eng = [e for e in engine if e["call"] == c["index"]]
        if len(eng) != len(c["ubatches"]):
            bad.append(f"decode call {c['index']}: planner {len(c['ubatches'])} ubatches, engine {len(eng)} passes")
        for u, e in zip(c["ubatches"], eng):
            where = f"call {c['index']} ubatch {u['index']}"
            for msg in e["problems"]:
                bad.append(f"{where}: engine: {msg}")
            for f in FIELDS:
                if e.get(f) is not None and e[f] != u[f]:
                    bad.append(f"{where}: {f} planner {u[f]} engine {e[f]}")
            if e.get("mask_ne") and list(e["mask_ne"]) != list(u["mask_shape"]):
                bad.append(f"{where}: mask planner {u['mask_shape']} engine {e['mask_ne']}")
            if e["pos"] is not None:
                want = [r[3] for r in u["rows"]]
                if e["pos"] != want:
                    got = e["pos"]
                    i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
                    bad.append(
                        f"{where}: positions differ from row {i}: planner {want[i : i + 4]} engine {got[i : i + 4]}"
                    )
    extra = [e for e in engine if e["call"] not in {c["index"] for c in pl["calls"]}]
    if extra:
        bad.append(f"{len(extra)} engine passes outside the planned decode calls")
    return bad


def trace(model: Model, shape: dict, *, tracer: EvalTrace | None = None, **ctx_kw: Any) -> dict:
    """Plan ``shape``, run it on ``model`` with a tracing context, and compare.

    The context has a ``cb_eval`` callback (``ggml_backend_sched_eval_callback``); each planned
    decode call is one ``llama_decode``.

    Args:
        model: The :class:`~pyllamacpp.Model`.
        shape: Keywords of :func:`~pyllamacpp.ubatch.plan` (the batch's shape).
        tracer: The :class:`EvalTrace` to use; None: a new one.
        **ctx_kw: :class:`~pyllamacpp.Context` keywords.

    Returns:
        ``plan``, ``engine`` (one summary per pass), ``disagreements``, ``ok``,
        ``callbacks_at_creation``, ``graphs_reused``, ``attn_ops``, ``first_node``.

    Raises:
        PlanError: The planner refuses the shape (what llama.cpp would reject).
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError``, ``InvalidBatchError``...).
        Exception: Whatever the ``cb_eval`` callback raised, re-raised after the decode.
    """
    from ..batch import Batch
    from ..context import Context
    from ..errors import DecodeAborted

    tr = tracer or EvalTrace()
    n_seqs = shape.get("n_seqs") or 1
    ctx_kw["n_seq_max"] = max(ctx_kw.get("n_seq_max", 1), n_seqs)
    ctx_kw.setdefault("no_perf", False)  # for n_reused: passes that reused the previous graph
    with Context(model, cb_eval=tr.cb, cb_eval_user_data=tr.ffi.NULL, **ctx_kw) as ctx:
        tr.on_error = ctx.abort
        at_creation = tr.n_unrecorded
        unified = bool(ctx.params.kv_unified)
        asked = ctx.params  # the values asked for, before llama.cpp's clamps (the planner applies them)
        p = plan(
            n_batch=asked.n_batch,
            n_ubatch=asked.n_ubatch,
            n_ctx=asked.n_ctx or model.n_ctx_train,
            n_seq_max=asked.n_seq_max,
            kv_unified=unified,
            **shape,
        )
        pl = p.to_dict(rows=True)
        bad = []
        for what, planned, real in (
            ("n_batch", p.n_batch, ctx.n_batch),
            ("n_ubatch", p.n_ubatch, ctx.n_ubatch),
            ("n_ctx", p.n_ctx, ctx.n_ctx),
            ("n_ctx_seq", p.n_ctx_seq, ctx.n_ctx_seq),
            ("n_seq_max", p.n_seq_max, ctx.n_seq_max),
        ):
            if planned != real:
                bad.append(f"context: {what} planner {planned} engine {real}")
        tokens = prompt_tokens(model, max(a + b for a, b in zip(p.tokens, p.n_past)))
        for s, n in enumerate(p.n_past):  # untraced: one sequence after the other
            if n:
                ctx.prefill(tokens[:n], seq_id=s, start_pos=0)
        batch = Batch(p.n_batch, ctx.n_seq_max, model=model)
        ctx.perf_reset()
        for call in progress(p.calls, "trace-ubatches"):
            batch.clear()
            for r in call.rows:
                batch.add(int(tokens[r.pos]), r.pos, r.seq_id, logits=r.output)
            tr.begin(call.index)
            try:
                ctx.decode(batch)
            except DecodeAborted:
                tr.check()  # the callback failed: raise its exception instead
                raise
            finally:
                tr.end()
            tr.check()
        flash = {a["op"] for ps in tr.passes for a in ps["attn"]}
        n_reused = ctx.perf().n_reused if not ctx.params.no_perf else None
    engine = [summarize(ps) for ps in tr.passes]
    bad += compare(pl, engine)
    return {
        "plan": pl,
        "engine": engine,
        "disagreements": bad,
        "ok": not bad,
        "callbacks_at_creation": at_creation,
        "graphs_reused": n_reused,
        "attn_ops": sorted(flash),
        "first_node": tr.first_name,
    }


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_plan_flags(p)


def run(args: argparse.Namespace) -> dict:
    """:func:`trace` for the shape and context the flags ask for.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        What :func:`trace` returns, plus ``model`` and ``threads``.

    Raises:
        ModelLoadError: The model cannot be loaded.
        PlanError: The planner refuses the shape (what llama.cpp would reject).
        ContextError: llama.cpp cannot make a context with these settings.
        DecodeError: A decode failed (``KVCacheFullError``, ``InvalidBatchError``...).
        Exception: Whatever the ``cb_eval`` callback raised, re-raised after the decode.
    """
    return run_on_model(args, trace, shape_from_args(args), **context_kwargs(args))


def print_report(data: dict) -> None:
    """Print what :func:`run` returned: planner and engine side by side, one row per ubatch.

    Args:
        data: What :func:`run` returned.
    """
    from .common import print_table

    pl = data["plan"]
    print(f"model {data.get('model', '?')}")
    print(f"planner: {summary_line(pl)}")
    print(
        f"engine: n_kv and rows from the KQ mask ({', '.join(data['attn_ops']) or 'no attention node'} node's mask "
        f"source), positions from inp_pos, outputs from result_output; {len(data['engine'])} passes traced; "
        f"{data['callbacks_at_creation']} callbacks fired while the context was created; "
        f"{data['graphs_reused']} passes reused the previous pass's graph (and were seen all the same)"
    )
    rows = []
    ubs = [u for c in pl["calls"] for u in c["ubatches"]]
    for i in range(max(len(ubs), len(data["engine"]))):
        u = ubs[i] if i < len(ubs) else {}
        e = data["engine"][i] if i < len(data["engine"]) else {}
        pos_ok = None
        if u and e and e.get("pos") is not None:
            pos_ok = "same" if e["pos"] == [r[3] for r in u["rows"]] else "DIFF"
        match = (
            all(u.get(f) == e.get(f) for f in FIELDS if e.get(f) is not None)
            and bool(u)
            and bool(e)
            and not e.get("problems")
            and pos_ok != "DIFF"
        )
        call = next(c["index"] for c in pl["calls"] if u in c["ubatches"]) if u else e.get("call", "-")
        rows.append(
            {
                "call": call,
                "ub": i,
                "p_rows": u.get("n_tokens"),
                "e_rows": e.get("n_tokens"),
                "p_kv": u.get("n_kv"),
                "e_kv": e.get("n_kv"),
                "p_st": u.get("n_stream"),
                "e_st": e.get("n_stream"),
                "p_out": u.get("n_outputs"),
                "e_out": e.get("n_outputs"),
                "mask": str(e.get("mask_ne", "-")),
                "pos": pos_ok or "-",
                "ok": "ok" if match else "DISAGREE",
            }
        )
    print_table(
        rows,
        [
            ("call", "call", ""),
            ("ub", "ubatch", "d"),
            ("p_rows", "rows plan", "d"),
            ("e_rows", "rows engine", "d"),
            ("p_kv", "n_kv plan", "d"),
            ("e_kv", "n_kv engine", "d"),
            ("p_st", "streams plan", "d"),
            ("e_st", "streams engine", "d"),
            ("p_out", "out plan", "d"),
            ("e_out", "out engine", "d"),
            ("mask", "engine mask ne", "s"),
            ("pos", "positions", "s"),
            ("ok", "agree", "s"),
        ],
    )
    if data["ok"]:
        print("\nplanner and engine agree")
    else:
        print(f"\n{len(data['disagreements'])} DISAGREEMENT(S):")
        for d in data["disagreements"]:
            print(f"  {d}")


def _disagree(data: dict) -> str:
    n = len(data["disagreements"])
    return f"planner and engine DISAGREE ({n}): {data['disagreements'][0]}"


COMMAND = Command(
    "trace-ubatches",
    "trace the engine's forward passes against split-plan",
    __name__,
    _flags,
    refused=(PlanError,),
    refused_as="planner: ",
    failure=_disagree,
)
add_parser, main = COMMAND.add_parser, COMMAND
