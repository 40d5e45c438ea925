"""Graph taps: read and change the tensors of a forward pass, from Python, at the speed of C.

Every context pyllamacpp makes (unless ``taps=False`` or your own ``cb_eval``) gets a C
``cb_eval`` (``ggml_backend_sched_eval_callback``, build_support/taps.h) that answers "not wanted"
to every node until a capture or a patch is armed. Then it answers from a hash table of the exact
node names and occurrences this module resolved from a listing of the graph; a wanted node is
copied in C (``ggml_backend_tensor_get``, so CUDA and RPC too) into an arena numpy owns, and
Python builds arrays over it only when you read them, after the decode.

Names are the graph callback's (``llama_context::graph_get_cb``): ``<site>-<layer>``
(``l_out-5``, ``attn_norm-0``, ``kq_soft_max-3``) or unlayered (``embd``, ``norm``,
``result_norm``, ``result_output``). A name is not unique (``Qcur-0`` names a MUL_MAT, a RESHAPE
and a ROPE; ``norm-0`` the attention and the FFN RMS_NORM): a site means the **last** node of that
name in graph order (the value later ops read) unless ``which=`` says another. Graph inputs (the
KQ mask ``attn_inp_kq_mask``, ``inp_pos``, ``inp_tokens``, ``out_ids``, the KV cache tensors
``cache_k_l<il>``) are leaves the callback never visits: they are read, once per pass, from the
``src[]`` of the first node that reads them, before it computes.

The listing (:meth:`Graph`) comes from probe decodes in a throwaway context with the same
parameters (2 and 3 tokens, every row an output, and the shape you ask for), so the context you
tap is not touched by it: the token axis of each node is the axis whose length follows the
token count.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._handle import view
from ._lib import ffi, lib
from .errors import CaptureLimitError, TapError

if TYPE_CHECKING:
    from .context import Context

NamesFilter = str | Sequence[str] | Callable[[str], bool]
"""What to tap: a name, site or glob (``"l_out"``, ``"l_out-5"``, ``"ffn_*"``), several of them,
or a predicate on the full node name."""

__all__ = ["NamesFilter", "GraphNode", "Graph", "TapRecord", "TapInfo", "Capture", "Patch", "split_name"]

_LAYERED = re.compile(r"(.+)-(\d+)")
_KV_TENSOR = re.compile(r"cache_[kv]_l(\d+)")
_AUTO_INPUTS = ("inp_tokens", "inp_pos")  # captured with every capture: they say which rows a pass holds
_ATTENTION_FUSED = ("kq", "kq_soft_max", "kqv")
_NUMPY = {
    lib.GGML_TYPE_F32: np.float32,
    lib.GGML_TYPE_F16: np.float16,
    lib.GGML_TYPE_F64: np.float64,
    lib.GGML_TYPE_I8: np.int8,
    lib.GGML_TYPE_I16: np.int16,
    lib.GGML_TYPE_I32: np.int32,
    lib.GGML_TYPE_I64: np.int64,
    lib.GGML_TYPE_BF16: np.uint16,  # numpy has no bfloat16: the raw halves (TapRecord.array() widens)
}


def split_name(name: str) -> tuple[str, int | None]:
    """A node name as ``(site, layer)``: ``"l_out-5"`` -> ``("l_out", 5)``, ``"embd"`` ->
    ``("embd", None)``; the KV cache tensors ``cache_k_l3`` -> ``("cache_k", 3)``. Names with a view
    suffix (``"Qcur-0 (view)"``) are their own site.

    Args:
        name: A ggml tensor name.

    Returns:
        The site and the layer (None for an unlayered name).
    """
    m = _LAYERED.fullmatch(name)
    if m:
        return m.group(1), int(m.group(2))
    m = _KV_TENSOR.fullmatch(name)
    if m:
        return name[: name.rindex("_l")], int(m.group(1))
    return name, None


def _op_name(op: int) -> str:
    return ffi.string(lib.ggml_op_name(op)).decode()


def _type_name(t: int) -> str:
    return ffi.string(lib.ggml_type_name(t)).decode()


def _n_dims(ne: Sequence[int]) -> int:
    for i in range(3, 0, -1):
        if ne[i] > 1:
            return i + 1
    return 1


# -- the listing ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GraphNode:
    """One node (or input leaf) of a forward pass, as the probe decode saw it.

    Attributes:
        index: Position in graph order (``-1`` for an input).
        name: The tensor's name (``l_out-5``, ``Qcur-0 (view)``, ``node_21`` when unnamed).
        site: The name without its layer (:func:`split_name`).
        layer: The layer, or None.
        occurrence: Which node of this name it is, in graph order (0-based).
        last: Whether it is the last node of its name (what a site names by default).
        op: ggml's op name (``MUL_MAT``, ``ROPE``; ``NONE`` for an input).
        type: ggml's type name (``f32``, ``f16``).
        shape: numpy order (ggml's ``ne`` reversed), at the probe's token count.
        ne: ggml's ``ne``.
        is_view: A view of another tensor's data (``view_src`` set): no compute of its own.
        view_of: The tensor it views.
        srcs: Names of the tensors it reads.
        kind: ``"node"`` or ``"input"``.
        token_axis: The numpy axis that holds the ubatch's rows (None: no such axis, or unclear).
        ndim: numpy dimensions of its arrays (kept for one-token passes, where ggml drops them).
        read_by: For an input, the layers of the nodes that read it (an iSWA model's two leaves
            named ``attn_inp_kq_mask`` are told apart by these and their occurrence).
    """

    index: int
    name: str
    site: str
    layer: int | None
    occurrence: int
    last: bool
    op: str
    type: str
    shape: tuple[int, ...]
    ne: tuple[int, int, int, int]
    is_view: bool
    view_of: str | None
    srcs: tuple[str, ...]
    kind: str
    token_axis: int | None
    ndim: int
    read_by: tuple[int, ...] = ()


class Graph:
    """What one forward pass of a model under given context parameters computes: the nodes in
    graph order and the input leaves they read (:meth:`Context.graph_nodes`).

    Attributes:
        nodes: Every node, in graph order.
        inputs: The input leaves (``ggml_set_input``: mask, positions, token ids, indices) and the
            KV cache tensors, in order of first use.
        n_tokens: The probe's token count.
        flash_attn: Whether the context computes attention with ``FLASH_ATTN_EXT``.
        first: The name of the graph's first node (a pass starts there).

    Args:
        nodes: The nodes, in graph order.
        inputs: The input leaves.
        n_tokens: The probe's token count.
        flash_attn: Whether flash attention is on.
    """

    def __init__(self, nodes: list[GraphNode], inputs: list[GraphNode], n_tokens: int, flash_attn: bool) -> None:
        self.nodes, self.inputs, self.n_tokens, self.flash_attn = nodes, inputs, n_tokens, flash_attn
        self.first = nodes[0].name if nodes else ""
        self._by_name: dict[str, list[GraphNode]] = {}
        for n in [*nodes, *inputs]:
            self._by_name.setdefault(n.name, []).append(n)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[GraphNode]:
        return iter(self.nodes)

    def named(self, name: str) -> list[GraphNode]:
        """Every node (or the input) of that exact name, in graph order.

        Args:
            name: A full node name.

        Returns:
            The nodes; empty if the pass has none of that name.
        """
        return list(self._by_name.get(name, ()))

    def sites(self) -> list[str]:
        """The sites of this pass, in order of first appearance (``embd``, ``norm``, ``attn_norm``...):
        the names the graph callback gave, without views (``Qcur-0 (view)``) and unnamed nodes
        (``node_21``)."""
        seen: dict[str, None] = {}
        for n in self.nodes:
            if not n.name.startswith("node_") and " (" not in n.name:  # unnamed nodes and views
                seen.setdefault(n.site, None)
        return list(seen)

    def table(self, *, views: bool = False, layers: Sequence[int] | None = None) -> str:
        """The listing as text: index, name, op, type, shape, token axis.

        Args:
            views: Also list view nodes (RESHAPE, VIEW, PERMUTE, TRANSPOSE: no compute).
            layers: Only these layers (and the unlayered nodes).

        Returns:
            One line per node, then one per input.
        """
        lines = [f"{'#':>5}  {'name':<34} {'op':<15} {'type':<5} {'shape':<22} rows"]
        for n in [*self.nodes, *self.inputs]:
            if n.is_view and not views:
                continue
            if layers is not None and n.layer is not None and n.layer not in layers:
                continue
            idx = "in" if n.kind == "input" else str(n.index)
            rows = "-" if n.token_axis is None else f"axis {n.token_axis}"
            lines.append(f"{idx:>5}  {n.name:<34} {n.op:<15} {n.type:<5} {str(n.shape):<22} {rows}")
        return "\n".join(lines)


def _record_node(t) -> dict:
    srcs = []
    for i in range(lib.GGML_MAX_SRC):
        s = t.src[i]
        if s == ffi.NULL:
            break
        srcs.append(
            {
                "name": ffi.string(s.name).decode("utf-8", "replace"),
                "addr": int(ffi.cast("uintptr_t", s)),
                "leaf": s.op == lib.GGML_OP_NONE,
                "input": bool(s.flags & lib.GGML_TENSOR_FLAG_INPUT),
                "weight": s.buffer != ffi.NULL
                and lib.ggml_backend_buffer_get_usage(s.buffer) == lib.GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
                "op": int(s.op),
                "type": int(s.type),
                "ne": tuple(int(s.ne[k]) for k in range(4)),
            }
        )
    vs = t.view_src
    return {
        "name": ffi.string(t.name).decode("utf-8", "replace"),
        "op": int(t.op),
        "type": int(t.type),
        "ne": tuple(int(t.ne[k]) for k in range(4)),
        "view_of": ffi.string(vs.name).decode("utf-8", "replace") if vs != ffi.NULL else None,
        "srcs": srcs,
    }


def _probe(ctx: Context, shapes: Sequence[tuple[int, bool]]) -> list[list[dict]]:
    """The nodes one decode computes, for each ``(n_tokens, all_outputs)``, in one throwaway
    context with ``ctx``'s parameters (its memory cleared between them)."""
    from .batch import Batch
    from .context import Context

    nodes: list[dict] = []
    err: list[BaseException] = []

    def cb(t, ask, _ud):
        if ask:
            try:
                nodes.append(_record_node(t))
            except BaseException as e:  # noqa: BLE001 - kept, raised after the decode
                err.append(e)
        return False

    c_cb = ffi.callback("bool(struct ggml_tensor *, bool, void *)", cb)
    model = ctx.model
    most = max(n for n, _ in shapes)
    probe = Context(
        model,
        dataclasses.replace(
            ctx.params,
            n_ctx=256,
            n_batch=max(8, most),
            n_ubatch=max(8, most),
            n_seq_max=1,
            n_outputs_max=0,
            n_threads=1,  # the nodes do not depend on it, and one thread never waits for a busy core
            n_threads_batch=1,
            cb_eval=c_cb,
            cb_eval_user_data=ffi.NULL,
            abort_callback=None,
            abort_callback_data=None,
        ),
        taps=False,
        handle_sigint=False,
    )
    out = []
    try:
        batch = Batch(most, 1, model=model)
        n_vocab = model.n_vocab
        for n_tokens, all_outputs in shapes:
            batch.clear()
            toks = [(7 + 13 * i) % n_vocab for i in range(n_tokens)]
            batch.add_sequence(toks, 0, 0, logits="all" if all_outputs else "last")
            probe.memory.clear()
            nodes = []
            probe.decode(batch)
            if err:
                raise err[0]
            out.append(nodes)
    finally:
        probe.close()
    return out


def _listing(ctx: Context, n_tokens: int) -> Graph:
    key = _listing_key(ctx) + (n_tokens,)
    cache = ctx.model.__dict__.setdefault("_graph_listings", {})
    g = cache.get(key)
    if g is not None:
        return g
    a, b, shown = _probe(ctx, [(2, True), (3, True), (n_tokens, False)])
    g = _build_graph(shown, a, b, n_tokens, ctx.flash_attn)
    cache[key] = g
    return g


def _listing_key(ctx: Context) -> tuple:
    skip = {"n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch", "no_perf", "n_outputs_max"}
    out = []
    for f in dataclasses.fields(ctx.params):
        if f.name in skip:
            continue
        v = getattr(ctx.params, f.name)
        if v is None or isinstance(v, (bool, int, float, str)):
            out.append((f.name, v))
    return (*out, ("flash_attn", ctx.flash_attn))


def _occurrences(nodes: list[dict]) -> list[tuple[str, int]]:
    count: dict[str, int] = {}
    keys = []
    for n in nodes:
        k = count.get(n["name"], 0)
        count[n["name"]] = k + 1
        keys.append((n["name"], k))
    return keys


def _token_dims(a: list[dict], b: list[dict]) -> dict[tuple[str, int], tuple[int | None, int]]:
    """(name, occurrence) -> (ggml dim holding the tokens, ndim), from probes of 2 and 3 rows."""
    out: dict[tuple[str, int], tuple[int | None, int]] = {}
    ne_a = dict(zip(_occurrences(a), (n["ne"] for n in a)))
    for key, n in zip(_occurrences(b), b):
        ne2, ne3 = ne_a.get(key), n["ne"]
        dim = None
        if ne2 is not None:
            diff = [i for i in range(4) if ne2[i] != ne3[i]]
            if len(diff) == 1 and ne2[diff[0]] == 2 and ne3[diff[0]] == 3:
                dim = diff[0]
        ndim = max(_n_dims(ne3), _n_dims(ne2) if ne2 else 1, (dim + 1) if dim is not None else 1)
        out[key] = (dim, ndim)
    return out


def _layer_of(node: dict) -> int | None:
    """A node's layer: from its name, else (unnamed ``FLASH_ATTN_EXT``, suffixed views such as
    ``cache_k_l0 (view)``) from the first of its sources that names one."""
    for name in (node["name"], *(s["name"] for s in node["srcs"])):
        base = name.split(" (")[0]
        _, layer = split_name(base)
        if layer is not None:
            return layer
    return None


def _leaves(nodes: list[dict]) -> dict[tuple[str, int], dict]:
    """The non-weight leaves the nodes read, by (name, occurrence): distinct tensors of one name
    (an iSWA model's two KQ masks) numbered in order of first use."""
    out: dict[tuple[str, int], dict] = {}
    seen: dict[int, tuple[str, int]] = {}
    count: dict[str, int] = {}
    for n in nodes:
        layer = _layer_of(n)
        for src in n["srcs"]:
            if not src["leaf"] or src["weight"]:
                continue
            key = seen.get(src["addr"])
            if key is None:
                k = count.get(src["name"], 0)
                count[src["name"]] = k + 1
                key = seen[src["addr"]] = (src["name"], k)
                out[key] = {**src, "read_by": []}
            if layer is not None and layer not in out[key]["read_by"]:
                out[key]["read_by"].append(layer)
    return out


def _input_dims(a: list[dict], b: list[dict]) -> dict[tuple[str, int], tuple[int | None, int]]:
    la, lb = _leaves(a), _leaves(b)
    out = {}
    for key, leaf in lb.items():
        ne3 = leaf["ne"]
        ne2 = la[key]["ne"] if key in la else None
        dim = None
        if ne2 is not None:
            diff = [i for i in range(4) if ne2[i] != ne3[i]]
            if len(diff) == 1 and ne2[diff[0]] == 2 and ne3[diff[0]] == 3:
                dim = diff[0]
        out[key] = (dim, max(_n_dims(ne3), (dim + 1) if dim is not None else 1))
    return out


def _build_graph(shown: list[dict], a: list[dict], b: list[dict], n_tokens: int, flash_attn: bool) -> Graph:
    dims = _token_dims(a, b)
    in_dims = _input_dims(a, b)
    keys = _occurrences(shown)
    last: dict[str, int] = {}
    for name, k in keys:
        last[name] = k
    nodes = []
    inputs: dict[tuple[str, int], GraphNode] = {}
    for i, ((name, k), n) in enumerate(zip(keys, shown)):
        dim, ndim = dims.get((name, k), (None, _n_dims(n["ne"])))
        ndim = max(ndim, _n_dims(n["ne"]))
        site, layer = split_name(name)
        nodes.append(
            GraphNode(
                index=i,
                name=name,
                site=site,
                layer=layer,
                occurrence=k,
                last=last[name] == k,
                op=_op_name(n["op"]),
                type=_type_name(n["type"]),
                shape=tuple(reversed(n["ne"][:ndim])),
                ne=n["ne"],
                is_view=n["view_of"] is not None,
                view_of=n["view_of"],
                srcs=tuple(s["name"] for s in n["srcs"]),
                kind="node",
                token_axis=None if dim is None else ndim - 1 - dim,
                ndim=ndim,
            )
        )
    for (name, k), leaf in _leaves(shown).items():
        if not (leaf["input"] or _KV_TENSOR.fullmatch(name)):
            continue
        idim, indim = in_dims.get((name, k), (None, _n_dims(leaf["ne"])))
        indim = max(indim, _n_dims(leaf["ne"]))
        isite, ilayer = split_name(name)
        inputs[(name, k)] = GraphNode(
            index=-1,
            name=name,
            site=isite,
            layer=ilayer,
            occurrence=k,
            last=True,
            op="NONE",
            type=_type_name(leaf["type"]),
            shape=tuple(reversed(leaf["ne"][:indim])),
            ne=leaf["ne"],
            is_view=False,
            view_of=None,
            srcs=(),
            kind="input",
            token_axis=None if idim is None else indim - 1 - idim,
            ndim=indim,
            read_by=tuple(leaf["read_by"]),
        )
    return Graph(nodes, list(inputs.values()), n_tokens, flash_attn)


# -- resolving a filter --------------------------------------------------------------------------


def _matcher(names: NamesFilter) -> Callable[[GraphNode], bool]:
    if callable(names):
        pred = names
        return lambda n: bool(pred(n.name))
    pats = [names] if isinstance(names, str) else list(names)
    if not pats or not all(isinstance(p, str) for p in pats):
        raise TypeError(f"names: a name, a glob, a list of them or a predicate, got {names!r}")
    globs = [p for p in pats if any(c in p for c in "*?[")]
    plain = set(pats) - set(globs)

    def match(n: GraphNode) -> bool:
        if n.name in plain or n.site in plain:
            return True
        return any(fnmatch.fnmatchcase(n.name, g) or fnmatch.fnmatchcase(n.site, g) for g in globs)

    return match


def _missing_message(graph: Graph, names: NamesFilter, layers) -> str:
    asked = names if isinstance(names, str) else ("a predicate" if callable(names) else ", ".join(names))
    lay = f" at layers {sorted(layers)}" if layers is not None else ""
    msg = f"no node of this forward pass matches {asked!r}{lay}"
    plain = [names] if isinstance(names, str) else ([] if callable(names) else list(names))
    if graph.flash_attn and any(p in _ATTENTION_FUSED or p.split("-")[0] in _ATTENTION_FUSED for p in plain):
        msg += (
            ": flash attention is on, which computes QK^T, the softmax and the product with V in one "
            "FLASH_ATTN_EXT node (unnamed; its output is kqv_out-<il>), so kq, kq_soft_max and kqv do not "
            "exist; make the context with flash_attn='off' to tap them"
        )
    layered = sorted({n.layer for n in graph.nodes if n.layer is not None})
    if layers is not None and layered and not set(layers) & set(layered):
        msg += f"; the model's layers are {layered[0]}..{layered[-1]}"
    return (
        f"{msg}. Sites of this pass: {', '.join(graph.sites())}. Inputs: "
        f"{', '.join(sorted({i.site for i in graph.inputs}))}. See ctx.graph_nodes() for every node."
    )


def resolve(
    graph: Graph,
    names: NamesFilter,
    layers: Sequence[int] | None = None,
    which: int | str | None = None,
) -> list[GraphNode]:
    """The nodes a filter names in ``graph``.

    Args:
        graph: The listing (:meth:`Context.graph_nodes`).
        names: A :data:`NamesFilter`.
        layers: Keep only these layers of layered nodes (unlayered names that match stay).
        which: For a name that several nodes carry: None (the last in graph order), an index
            among them (negative counts from the end), an op name (``"MUL_MAT"``), or ``"all"``
            (every node of the name but views, which hold their source's data).

    Returns:
        The nodes and inputs, in graph order (inputs last).

    Raises:
        TapError: Nothing matches (the message lists the sites and inputs the pass has, and says
            when flash attention hides the one asked for), or ``which`` fits no node of a name.
        TypeError: ``names`` is not a name, glob, list or predicate.
    """
    match = _matcher(names)
    lay = None if layers is None else {int(x) for x in layers}
    picked: dict[str, GraphNode | list[GraphNode]] = {}
    for n in [*graph.nodes, *graph.inputs]:
        if n.name in picked or not match(n):
            continue
        if lay is not None and n.layer is not None and n.layer not in lay:
            continue
        same = graph.named(n.name)
        if n.kind == "input":  # each leaf of that name is its own data (iSWA: two KQ masks)
            picked[n.name] = [m for m in same if m.kind == "input"]
        elif which is None:
            picked[n.name] = same[-1]
        elif which == "all":  # every node of the name that computes (a view holds its source's data)
            picked[n.name] = [m for m in same if not m.is_view] or same
        elif isinstance(which, int):
            if not -len(same) <= which < len(same):
                raise TapError(f"which={which}: {n.name} names {len(same)} node(s) ({_ops(same)})")
            picked[n.name] = same[which]
        elif isinstance(which, str):
            hits = [m for m in same if m.op == which.upper()]
            if not hits:
                raise TapError(f"which={which!r}: no {which.upper()} node is named {n.name} ({_ops(same)})")
            picked[n.name] = hits[-1]
        else:
            raise TypeError(f"which: None, an int, an op name or 'all', got {which!r}")
    out: list[GraphNode] = []
    for v in picked.values():
        out.extend(v if isinstance(v, list) else [v])
    if not out:
        raise TapError(_missing_message(graph, names, lay))
    return sorted(out, key=lambda n: (n.kind == "input", n.index))


def _ops(nodes: Sequence[GraphNode]) -> str:
    return ", ".join(f"#{m.occurrence} {m.op}" for m in nodes)


# -- records -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TapRecord:
    """One captured tensor of one forward pass (ubatch).

    Attributes:
        name: The tensor's name (``l_out-5``).
        site: The name without its layer.
        layer: The layer, or None.
        occurrence: Which node of that name (graph order).
        op: ggml's op name; ``NONE`` for an input.
        type: ggml's type name.
        ne: ggml's ``ne``; ``nb``: its strides in bytes.
        nb: ggml's ``nb``.
        shape: numpy order (``ne`` reversed).
        call: The decode call, counted from the capture's start.
        ubatch: The pass within that call (0 for its first ubatch).
        pass_index: The pass, counted from the capture's start.
        kind: ``"node"``, or ``"input"`` (read before its first reader computed).
        token_axis: The numpy axis of :attr:`data` that holds the pass's rows (None: none).
        rows: The batch index (in its decode call's batch) of each row along ``token_axis``, or
            None when not known.
        tokens: The token id of each row (None where not known).
        pos: The position of each row.
        seq_ids: The sequence ids of each row, in the order the batch gave them (llama.cpp keeps a
            token's ids in an ``unordered_set``: the "first" the KQ mask tests is that set's first,
            not necessarily this tuple's; see ``pyllamacpp mask``).
        outputs_only: The rows are the pass's output rows only (after ``inp_out_ids``).
        n_stream: KV streams the tensor is split into (``ne[3]``, without ``kv_unified`` and with
            several sequences in the ubatch): its rows then run stream by stream, each stream's
            along ``token_axis`` (see :meth:`by_rows`).
        data: The copy, a numpy view in numpy order over the capture's arena (raw uint8 rows for
            a quantized type).
        offset: Where the copy starts in the arena; ``nbytes``: its size.
        nbytes: Bytes copied.
        buffer: The backend buffer the tensor lives in (``ggml_backend_buffer_name``: ``CPU``,
            ``CUDA0``...), ``buffer_offset`` its data's byte offset from the buffer's base,
            ``buffer_size`` the buffer's size: where a KV cache tensor sits in its allocation.
        buffer_offset: See ``buffer``.
        buffer_size: See ``buffer``.
        buffer_usage: ``GGML_BACKEND_BUFFER_USAGE_*`` (weights, compute, any), -1 without a buffer.
        on_host: The buffer is host memory.
    """

    name: str
    site: str
    layer: int | None
    occurrence: int
    op: str
    type: str
    ne: tuple[int, ...]
    nb: tuple[int, ...]
    shape: tuple[int, ...]
    call: int
    ubatch: int
    pass_index: int
    kind: str
    token_axis: int | None
    rows: np.ndarray | None
    tokens: np.ndarray | None
    pos: np.ndarray | None
    seq_ids: tuple[tuple[int, ...], ...] | None
    outputs_only: bool
    data: np.ndarray = dataclasses.field(repr=False)
    n_stream: int = 1
    offset: int = 0
    nbytes: int = 0
    buffer: str = ""
    buffer_offset: int = 0
    buffer_size: int = 0
    buffer_usage: int = -1
    on_host: bool = False

    def array(self) -> np.ndarray:
        """The data as numbers: :attr:`data` for f32/f16/integer types, float32 for bf16 and the
        quantized types (dequantized with ``gguf.quants``).

        Returns:
            An array of :attr:`shape` (a view when no conversion is needed).
        """
        t = lib.GGML_TYPE_COUNT
        for k, v in _TYPE_IDS.items():
            if v == self.type:
                t = k
        if t in _NUMPY and t != lib.GGML_TYPE_BF16:
            return self.data
        if t == lib.GGML_TYPE_BF16:
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        from gguf.quants import dequantize

        return dequantize(np.ascontiguousarray(self.data), t).reshape(self.shape)

    def by_rows(self) -> tuple[np.ndarray, int]:
        """The data with every row of the pass on one axis, in :attr:`rows`' order: the array
        itself, or for a tensor split into KV streams the stream axis merged into the token axis
        (a copy only when numpy cannot reshape in place).

        Returns:
            ``(array, axis)``.

        Raises:
            TapError: The record has no token axis.
        """
        if self.token_axis is None:
            raise TapError(f"{self.name}: this tensor has no axis of batch rows")
        a = self.array()
        if self.n_stream <= 1 or a.ndim < 4 or self.token_axis == 0:
            return a, self.token_axis
        ax = self.token_axis - 1  # the stream axis (numpy 0, ggml ne[3]) goes right before the token axis
        a = np.moveaxis(a, 0, ax)
        return a.reshape(*a.shape[:ax], -1, *a.shape[ax + 2 :]), ax

    def select(self, rows: np.ndarray) -> np.ndarray:
        """The entries of these rows (positions along :attr:`token_axis`, in :attr:`rows`' order).

        Args:
            rows: Indices into this record's rows.

        Returns:
            An array with the token axis cut to ``rows`` (a copy: numpy fancy indexing).

        Raises:
            TapError: The record has no token axis.
        """
        a, ax = self.by_rows()
        return np.take(a, rows, axis=ax)


_TYPE_IDS: dict[int, str] = {}


def _type_id_name(t: int) -> str:
    name = _TYPE_IDS.get(t)
    if name is None:
        name = _TYPE_IDS[t] = _type_name(t)
    return name


@dataclasses.dataclass(frozen=True)
class TapInfo:
    """What a patch function is told about the tensor it gets (see :meth:`Context.patch`).

    Attributes:
        name: The tensor's name.
        site: The name without its layer.
        layer: The layer, or None.
        op: ggml's op name.
        call: The decode call, counted from the patch's start.
        ubatch: The pass within that call.
        token_axis: The numpy axis of the array that holds the pass's rows (None: none).
        rows: The batch index of each row along ``token_axis`` (None when not known).
        seq_ids: The sequence ids of each row (None when not known).
        pos: The position of each row (None when not known).
        on_host: The array is the tensor's own memory (host buffer); else a copy written back after
            the function returns (``ggml_backend_tensor_set``).
    """

    name: str
    site: str
    layer: int | None
    op: str
    call: int
    ubatch: int
    token_axis: int | None
    rows: np.ndarray | None
    seq_ids: tuple[tuple[int, ...], ...] | None
    pos: np.ndarray | None
    on_host: bool


# -- the per-context manager --------------------------------------------------------------------


class _Call:
    """A decode call seen while armed: its batch (Context.decode), or the one row of a C step."""

    __slots__ = ("tokens", "pos", "seq_ids", "outputs", "ubatches", "first_pass")

    def __init__(self, tokens, pos, seq_ids, outputs) -> None:
        self.tokens, self.pos, self.seq_ids, self.outputs = tokens, pos, seq_ids, outputs
        self.ubatches: list[np.ndarray] | None = None  # batch indices of each ubatch
        self.first_pass = 0


class Taps:
    """The taps of one context: the armed capture and patches, and the C state's tables.

    Made by the context on first use; users go through :meth:`Context.capture` and
    :meth:`Context.patch`. One capture at a time, any number of patches."""

    def __init__(self, ctx: Context) -> None:
        state = ctx._taps_state
        if state is None:
            why = (
                "it was made with its own cb_eval" if ctx.params.cb_eval is not None else "it was made with taps=False"
            )
            raise TapError(f"this context cannot be tapped: {why}")
        self._ctx = weakref.ref(ctx)
        self.state = state
        self.capture: Capture | None = None
        self.patches: list[Patch] = []
        self.calls: list[_Call] = []  # Context.decode batches: all while capturing, else the last
        self._keep: list[Any] = []  # C tables alive while armed
        self._ring = ffi.new("pyl_tap_call[]", 1)  # patches only: the current call
        self._handle = ffi.new_handle(self)
        state.handle = self._handle
        self.want_nodes: dict[tuple[int, int], GraphNode] = {}  # (want, occurrence) -> node
        self.want_patches: dict[tuple[int, int], list[Patch]] = {}
        self.error: BaseException | None = None

    @property
    def armed(self) -> bool:
        """Whether a capture or a patch is active."""
        return self.capture is not None or bool(self.patches)

    def ctx(self) -> Context:
        """The context (raises TapError once it is gone)."""
        c = self._ctx()
        if c is None:
            raise TapError("the context is gone")
        return c

    def rearm(self) -> None:
        """Rebuild the C want table from the active capture and patches (between decodes)."""
        ctx = self.ctx()
        s = self.state
        s.armed = 0
        ctx._abort_state.taps = ffi.NULL
        if not self.armed:
            s.wants, s.table, s.n_wants, s.n_input_wants = ffi.NULL, ffi.NULL, 0, 0
            self._keep = []
            return
        graph = None
        sources: list[tuple[list[GraphNode], int, Patch | None]] = []
        if self.capture is not None:
            graph = self.capture.graph
            copy = lib.PYL_TAP_CAPTURE if self.capture.copy else lib.PYL_TAP_META
            sources.append((self.capture.nodes, copy, None))
            sources.append((self.capture.auto_inputs, lib.PYL_TAP_CAPTURE, None))
        for p in self.patches:
            graph = graph or p.graph
            sources.append((p.nodes, lib.PYL_TAP_PATCH, p))
        # one want per name; per occurrence its mode bits, its node and the patches there
        by_name: dict[str, dict[int, list]] = {}
        for nodes, bit, patch in sources:
            for n in nodes:
                occ = by_name.setdefault(n.name, {}).setdefault(n.occurrence, [n, 0, []])
                occ[1] |= bit
                if patch is not None:
                    occ[2].append(patch)
        n_wants = len(by_name)
        arr = ffi.new("pyl_tap_want[]", n_wants)
        size = 1 << max(4, math.ceil(math.log2(2 * n_wants + 1)))
        table = ffi.new("int32_t[]", size)
        self.want_nodes = {}
        self.want_patches = {}
        n_inputs = 0
        ops = _op_ids()
        for i, (name, occs) in enumerate(by_name.items()):
            raw = name.encode()
            if len(raw) >= lib.PYL_TAP_NAME:
                raise TapError(f"{name}: longer than ggml's {lib.PYL_TAP_NAME - 1}-byte names")
            w = arr[i]
            w.name = raw
            for k in range(lib.PYL_TAP_OCC):
                w.ops[k] = -1
            for k, (node, mode, pl) in occs.items():
                if k >= lib.PYL_TAP_OCC:
                    raise TapError(f"{name}: occurrence {k}: taps tell apart the first {lib.PYL_TAP_OCC} of a name")
                w.modes[k] = mode
                w.ops[k] = ops[node.op] if node.kind == "node" else -1
                w.input = node.kind == "input"
                n_inputs += node.kind == "input"
                self.want_nodes[(i, k)] = node
                self.want_patches[(i, k)] = pl
        s.wants, s.n_wants, s.n_input_wants = arr, n_wants, n_inputs
        s.table, s.table_mask = table, size - 1
        for i in range(n_wants):
            lib.pyl_tap_table_add(s, i)
        assert graph is not None
        first = graph.first.encode()
        s.pass_start = first
        s.pass_start_hash = lib.pyl_tap_hash(first)
        s.inputs_left = n_inputs
        s.pending = -1
        if self.capture is None:  # patches only: one call slot, reused
            s.calls, s.calls_cap, s.calls_ring = self._ring, 1, 1
        else:
            s.calls_ring = 0
        self._keep = [arr, table]
        s.abort_flag = ffi.addressof(ctx._abort_state, "abort_requested")
        s.armed = 1
        ctx._abort_state.taps = s

    def reset_counters(self) -> None:
        """Start counting calls, passes and records from zero (a new capture, or the first patch)."""
        s = self.state
        s.n_records = s.n_calls = s.n_calls_total = 0
        s.arena_used = s.arena_need = 0
        s.cur_pass = -1
        s.error = 0
        s.n_asked = 0
        self.calls = []
        self.error = None

    def before_call(self, batch) -> None:
        """A Context.decode is about to run: note its batch, and a new call in C."""
        n = len(batch)
        tokens = batch.token[:n].copy() if batch._token is not None else None
        nsid = batch.n_seq_id
        sid = batch.seq_id
        seq_ids = tuple(tuple(int(x) for x in sid[i, : nsid[i]]) for i in range(n))
        call = _Call(tokens, batch.pos[:n].copy(), seq_ids, batch.logits[:n] != 0)
        if self.capture is None:
            self.calls = [call]
        else:
            self.calls.append(call)
        lib.pyl_taps_begin_call(self.state, 0, 0, 0, 0)

    def failed(self) -> BaseException | None:
        """The failure kept during the last decode, as the exception to raise (cleared)."""
        s = self.state
        if not s.error and self.error is None:
            return None
        err, self.error = self.error, None
        code, name = int(s.error), ffi.string(s.error_name).decode("utf-8", "replace")
        s.error = 0
        if self.armed:
            s.armed = 1  # pyl_tap_fail disarmed it for the rest of the failed decode
        if err is not None:
            return err
        if code == lib.PYL_TAPERR_ARENA:
            return CaptureLimitError(
                f"capture: {name} did not fit: the copies need {int(s.arena_need):,} bytes, max_bytes is "
                f"{int(s.arena_cap):,} ({int(s.n_records)} tensors copied before it); raise max_bytes, or "
                "capture fewer nodes or layers"
            )
        if code in (lib.PYL_TAPERR_RECORDS, lib.PYL_TAPERR_CALLS):
            what = "tensor copies" if code == lib.PYL_TAPERR_RECORDS else "decode calls"
            return CaptureLimitError(f"capture: more {what} than max_records={int(s.records_cap)}; raise it")
        if code == lib.PYL_TAPERR_OP:
            return TapError(
                f"{name}: this pass's graph differs from the listing (a {_op_name(int(s.error_op))} node where "
                "the listing had another op): tap it with which='all'"
            )
        return TapError(f"taps: failure {code} at {name}")

    def current_call(self) -> tuple[int, _Call | None]:
        """The running decode call: its index (counted from when the taps were armed) and batch."""
        s = self.state
        i = int(s.n_calls) - 1
        if i < 0:
            return -1, None
        c = s.calls[i]
        index = int(s.n_calls_total) - 1
        if c.n_rows == 1:
            one = _Call(np.array([c.token], np.int32), np.array([c.pos], np.int32), ((int(c.seq_id),),), None)
            one.ubatches = [np.zeros(1, np.int64)]
            one.first_pass = int(c.first_pass)
            return index, one
        call = self.calls[-1] if self.calls else None
        if call is not None:
            call.first_pass = int(c.first_pass)
        return index, call

    def on_patch(self, t, want: int, occurrence: int, pass_index: int) -> bool:
        """C calls this (through the trampoline) for a patched node; False stops the decode."""
        try:
            self._patch(t, (want, occurrence), pass_index)
            return True
        except BaseException as e:  # noqa: BLE001 - raised by the decode once C has returned
            if self.error is None:
                self.error = e
            return False

    def _patch(self, t, want: tuple[int, int], pass_index: int) -> None:
        node = self.want_nodes[want]
        call_index, meta = self.current_call()
        ub = pass_index - (meta.first_pass if meta is not None else 0)
        rows = None
        if meta is not None:
            if meta.ubatches is None:
                meta.ubatches = _plan_ubatches(self.ctx(), meta)
            if 0 <= ub < len(meta.ubatches):
                rows = meta.ubatches[ub]
        ne = tuple(int(t.ne[k]) for k in range(4))
        nb = tuple(int(t.nb[k]) for k in range(4))
        ndim = max(node.ndim, _n_dims(ne))
        rows, seq_ids, pos, _ = _rows_along(node, ne, rows, meta)
        buf = t.view_src.buffer if t.view_src != ffi.NULL else t.buffer
        on_host = buf != ffi.NULL and bool(lib.ggml_backend_buffer_is_host(buf))
        dtype = _NUMPY.get(int(t.type))
        if dtype is None:
            raise TapError(f"{node.name}: patching a {_type_name(int(t.type))} tensor is not supported")
        nbytes = int(lib.ggml_nbytes(t))
        tmp = None
        if on_host:
            base = view(t.data, (nbytes,), np.uint8, self)
        else:
            base = tmp = np.empty(nbytes, np.uint8)
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(tmp), 0, nbytes)
        arr = np.ndarray(tuple(reversed(ne[:ndim])), dtype=dtype, buffer=base, strides=tuple(reversed(nb[:ndim])))
        info = TapInfo(
            name=node.name,
            site=node.site,
            layer=node.layer,
            op=_op_name(int(t.op)),
            call=call_index,
            ubatch=ub,
            token_axis=_token_axis(node, ne),
            rows=rows,
            seq_ids=seq_ids,
            pos=pos,
            on_host=on_host,
        )
        for p in self.want_patches[want]:
            p.n_calls += 1
            out = p.fn(arr, info)
            if out is not None:
                arr[...] = out
        if tmp is not None:
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(tmp), 0, nbytes)


@ffi.def_extern()
def _pyllamacpp_tap_patch(t, want, occurrence, pass_index, handle):
    try:
        return ffi.from_handle(handle).on_patch(t, want, occurrence, pass_index)
    except BaseException:  # noqa: BLE001 - never into C; the decode stops
        return False


_OP_IDS: dict[str, int] = {}


def _op_ids() -> dict[str, int]:
    if not _OP_IDS:
        for i in range(lib.GGML_OP_COUNT):
            _OP_IDS[_op_name(i)] = i
    return _OP_IDS


def _token_axis(node: GraphNode, ne: Sequence[int]) -> int | None:
    if node.token_axis is None:
        return None
    ndim = max(node.ndim, _n_dims(ne))
    return ndim - (node.ndim - node.token_axis)


def _rows_along(node: GraphNode, ne, rows, meta: _Call | None):
    """(rows, seq_ids, pos, outputs_only) for the entries along the node's token axis; with
    separate KV streams (ne[3] = n_stream) the rows run stream by stream over ne[3] and that axis."""
    if node.token_axis is None or rows is None or meta is None:
        return None, None, None, False
    dim = node.ndim - 1 - node.token_axis
    n = int(ne[dim])
    if dim < 3 and ne[3] > 1:
        n *= int(ne[3])
    outputs_only = False
    if n != len(rows) and meta.outputs is not None:
        out_rows = rows[meta.outputs[rows]]
        if n == len(out_rows):
            rows, outputs_only = out_rows, True
    if n != len(rows):
        return None, None, None, False
    return rows, tuple(meta.seq_ids[i] for i in rows), meta.pos[rows], outputs_only


@dataclasses.dataclass(frozen=True)
class _Splitting:
    """What llama.cpp's batch allocator splits with, read from the context once (records are
    built after the context may be gone)."""

    n_ubatch: int
    unified: bool
    recurrent: bool
    hybrid: bool

    @classmethod
    def of(cls, ctx: Context) -> _Splitting:
        m = ctx.model.ptr
        return cls(
            int(ctx.n_ubatch),
            bool(ctx.params.kv_unified) or ctx.n_seq_max == 1,
            bool(lib.llama_model_is_recurrent(m)),
            bool(lib.llama_model_is_hybrid(m)),
        )


def _plan_ubatches(ctx: Context | _Splitting, call: _Call) -> list[np.ndarray]:
    """Batch indices per ubatch, as llama.cpp's batch allocator splits this call's batch
    (``llama_kv_cache::init_batch`` and the recurrent / hybrid memories' equivalents)."""
    from .experiments.splits import BatchAllocr, PlanError, split_all

    f = ctx if isinstance(ctx, _Splitting) else _Splitting.of(ctx)
    all_out = call.outputs is not None and bool(call.outputs.all())
    if f.recurrent or f.hybrid:
        split, seq = ("seq", False) if all_out else ("equal", not f.unified or f.recurrent)
    else:
        split, seq = ("simple", False) if f.unified else ("equal", True)
    try:
        ubs = split_all(BatchAllocr(call.seq_ids), f.n_ubatch, split, seq)
    except PlanError:
        return []
    return [np.asarray(idxs, np.int64) for idxs, _, _ in ubs]


def taps_of(ctx: Context) -> Taps:
    """The context's :class:`Taps` (made on first use)."""
    t = ctx._taps
    if t is None:
        t = ctx._taps = Taps(ctx)
    return t


# -- capture ---------------------------------------------------------------------------------------


class Capture:
    """Tensors of the forward passes run while it is active (:meth:`Context.capture`).

    A context manager: the decodes inside the ``with`` block (``ctx.decode``, ``prefill``,
    ``generate``, ``generate_parallel``, a ``Scheduler``'s steps) are captured; leaving the block
    disarms it and leaves the records readable. Index it by ``"l_out-5"``, ``("l_out", 5)`` or a
    site (``"embd"``): the rows of every pass in batch order, concatenated (a view when there is
    one pass); :attr:`records` has each pass's copy.

    Attributes:
        graph: The listing the names were resolved against.
        nodes: The nodes and inputs captured.
        names: The filter asked for.
        copy: Whether the tensors are copied; False keeps only each record's shape, op and pass
            (the cost of the graph splits without the copies).
        auto_inputs: ``inp_tokens`` / ``inp_pos``, captured with every capture to check which
            batch rows each pass holds (left out of :attr:`records` unless asked for).
        max_bytes: The arena's size: a capture that needs more raises :class:`CaptureLimitError`
            from the decode (rolled back), before anything is overwritten.

    Args:
        ctx: The context (:meth:`Context.capture` makes captures).
        names: A :data:`NamesFilter`.
        layers: Only these layers of layered names.
        which: For names several nodes carry (see :func:`resolve`).
        max_bytes: The arena's size in bytes.
        max_records: The most tensor copies and decode calls it holds.
        copy: False: records without data.
        n_tokens: The listing's probe size.

    Raises:
        TapError: A name the pass does not produce, or a context that cannot be tapped.
        ValueError: A limit that is not positive.
    """

    def __init__(
        self,
        ctx: Context,
        names: NamesFilter,
        *,
        layers: Sequence[int] | None = None,
        which: int | str | None = None,
        max_bytes: int = 1 << 30,
        max_records: int = 1 << 16,
        copy: bool = True,
        n_tokens: int = 3,
    ) -> None:
        if max_bytes <= 0 or max_records <= 0:
            raise ValueError("max_bytes and max_records must be positive")
        self._taps = taps_of(ctx)
        self.graph = _listing(ctx, n_tokens)
        self.names = names
        nodes = resolve(self.graph, names, layers, which)
        auto = [i for i in self.graph.inputs if i.name in _AUTO_INPUTS and i not in nodes]
        self.nodes = nodes
        self.auto_inputs = auto
        self.copy = bool(copy)
        self._auto = {i.name for i in auto}
        self._all = [*nodes, *auto]
        self.max_bytes = int(max_bytes)
        self._arena = np.empty(self.max_bytes, np.uint8)  # untouched pages cost no memory
        self._records_c = ffi.new("pyl_tap_record[]", max_records)
        self._calls_c = ffi.new("pyl_tap_call[]", max_records)
        self._max_records = max_records
        self._records: list[TapRecord] = []
        self._built = 0
        self._active = False
        self._n_calls = 0
        self._py_calls: list[_Call] = []
        self._c_calls: list[tuple[int, int, int, int, int]] = []
        self._splitting = _Splitting.of(ctx)
        self._inputs_by_pass: dict[tuple[int, str], tuple[int, int]] = {}
        self._indexed = 0
        self._py_index: list[int] = []

    # lifetime
    def __enter__(self) -> Capture:
        t = self._taps
        if t.capture is not None:
            raise TapError("a capture is already active on this context; end it first")
        s = t.state
        t.capture = self
        t.reset_counters()
        s.arena = ffi.from_buffer(self._arena)
        s.arena_cap = self.max_bytes
        s.records, s.records_cap = self._records_c, self._max_records
        s.calls, s.calls_cap = self._calls_c, self._max_records
        try:
            t.rearm()
        except BaseException:
            t.capture = None
            raise
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop capturing (idempotent); the records stay readable."""
        if not self._active:
            return
        t = self._taps
        s = t.state
        self._snapshot()
        t.capture = None
        s.arena, s.arena_cap = ffi.NULL, 0
        s.records, s.records_cap = ffi.NULL, 0
        s.calls, s.calls_cap = ffi.NULL, 0
        s.n_records = s.n_calls = 0
        self._py_calls = list(t.calls)
        t.calls = []
        t.rearm()
        self._active = False

    def _snapshot(self) -> None:
        s = self._taps.state
        self._n_records = int(s.n_records)
        self._n_calls = int(s.n_calls)
        self._c_calls = [
            (
                int(s.calls[i].first_pass),
                int(s.calls[i].n_rows),
                int(s.calls[i].token),
                int(s.calls[i].pos),
                int(s.calls[i].seq_id),
            )
            for i in range(self._n_calls)
        ]
        self._py_calls = list(self._taps.calls)
        self.nbytes_used = int(s.arena_used)

    # results
    @property
    def nbytes(self) -> int:
        """Bytes the copies take in the arena (alignment included)."""
        if self._active:
            return int(self._taps.state.arena_used)
        return getattr(self, "nbytes_used", 0)

    @property
    def n_passes(self) -> int:
        """Forward passes captured."""
        recs = self.records
        return 1 + max(r.pass_index for r in recs) if recs else 0

    @property
    def records(self) -> list[TapRecord]:
        """One record per captured tensor per pass, in the order they were computed (the
        automatic ``inp_tokens`` / ``inp_pos`` inputs left out unless asked for)."""
        if self._active:
            self._snapshot()
        self._build()
        return [r for r in self._records if not (r.kind == "input" and r.name in self._auto)]

    def _meta(self, call_index: int) -> _Call | None:
        if call_index < 0 or call_index >= len(self._c_calls):
            return None
        first, n_rows, tok, pos, seq = self._c_calls[call_index]
        if n_rows == 1:
            one = _Call(np.array([tok], np.int32), np.array([pos], np.int32), ((seq,),), None)
            one.ubatches = [np.zeros(1, np.int64)]
            one.first_pass = first
            return one
        if len(self._py_index) != len(self._c_calls):  # call -> its Context.decode batch, in order
            k, self._py_index = 0, []
            for cc in self._c_calls:
                self._py_index.append(k)
                k += cc[1] == 0
        py = self._py_index[call_index]
        if py >= len(self._py_calls):
            return None
        c = self._py_calls[py]
        c.first_pass = first
        return c

    def _build(self) -> None:
        known = {(n.name, n.kind, n.occurrence): n for n in self._all}
        rc = self._records_c
        for i in range(self._built, self._n_records):
            r = rc[i]
            name = ffi.string(r.name).decode("utf-8", "replace")
            kind = "input" if r.flags & lib.PYL_TAPREC_INPUT else "node"
            node = known.get((name, kind, int(r.occurrence)))
            if node is None:  # not in the listing (cannot happen: C only copies what was resolved)
                node = GraphNode(
                    -1,
                    name,
                    *split_name(name),
                    int(r.occurrence),
                    True,
                    _op_name(int(r.op)),
                    _type_id_name(int(r.type)),
                    (),
                    (0, 0, 0, 0),
                    False,
                    None,
                    (),
                    kind,
                    None,
                    1,
                )
            ne = tuple(int(r.ne[k]) for k in range(4))
            nb = tuple(int(r.nb[k]) for k in range(4))
            ndim = max(node.ndim, _n_dims(ne))
            shape = tuple(reversed(ne[:ndim]))
            data = self._data_view(r, ne, nb, ndim)
            call_index, pass_index = int(r.call), int(r.pass_no)
            meta = self._meta(call_index)
            ub = pass_index - (meta.first_pass if meta is not None else 0)
            rows = None
            if meta is not None:
                if meta.ubatches is None:
                    meta.ubatches = _plan_ubatches(self._splitting, meta)
                if 0 <= ub < len(meta.ubatches):
                    rows = self._checked_rows(meta, ub, pass_index)
            rws, seq_ids, pos, outs = _rows_along(node, ne, rows, meta)
            self._records.append(
                TapRecord(
                    name=name,
                    site=node.site,
                    layer=node.layer,
                    occurrence=node.occurrence,
                    op=_op_name(int(r.op)),
                    type=_type_id_name(int(r.type)),
                    ne=ne,
                    nb=nb,
                    shape=shape,
                    call=call_index,
                    ubatch=ub,
                    pass_index=pass_index,
                    kind=kind,
                    token_axis=_token_axis(node, ne),
                    rows=rws,
                    tokens=None if rws is None or meta is None or meta.tokens is None else meta.tokens[rws],
                    pos=pos,
                    seq_ids=seq_ids,
                    outputs_only=outs,
                    data=data,
                    n_stream=int(ne[3]) if node.token_axis is not None and node.ndim - 1 - node.token_axis < 3 else 1,
                    offset=int(r.offset),
                    nbytes=int(r.nbytes),
                    buffer=ffi.string(r.buffer).decode("utf-8", "replace"),
                    buffer_offset=int(r.buffer_offset),
                    buffer_size=int(r.buffer_size),
                    buffer_usage=int(r.buffer_usage),
                    on_host=bool(r.is_host),
                )
            )
        self._built = self._n_records

    def _checked_rows(self, meta: _Call, ub: int, pass_index: int) -> np.ndarray | None:
        """The planner's rows for the pass, checked against the pass's own inp_tokens / inp_pos;
        when they disagree, rows matched by (token, position) in batch order instead."""
        assert meta.ubatches is not None
        rows = meta.ubatches[ub]
        got_pos = self._auto_input(pass_index, "inp_pos")
        got_tok = self._auto_input(pass_index, "inp_tokens")
        if got_pos is None and got_tok is None:
            return rows
        ok = True
        if got_pos is not None and (
            got_pos.size < rows.size or not np.array_equal(got_pos[: rows.size], meta.pos[rows])
        ):
            ok = False
        if ok and got_tok is not None and meta.tokens is not None:
            ok = got_tok.size == rows.size and np.array_equal(got_tok, meta.tokens[rows])
        if ok:
            return rows
        if got_pos is None or meta.tokens is None or got_tok is None:
            return None
        used = np.zeros(len(meta.pos), bool)
        out = []
        for tok, p in zip(got_tok.tolist(), got_pos[: got_tok.size].tolist()):
            cand = np.flatnonzero(~used & (meta.tokens == tok) & (meta.pos == p))
            if cand.size == 0:
                return None
            used[cand[0]] = True
            out.append(int(cand[0]))
        return np.asarray(out, np.int64)

    def _auto_input(self, pass_index: int, name: str) -> np.ndarray | None:
        """The pass's own ``inp_pos`` / ``inp_tokens`` (int32), from an index made once per record."""
        rc = self._records_c
        for i in range(self._indexed, self._n_records):  # records not indexed yet
            r = rc[i]
            if r.flags & lib.PYL_TAPREC_INPUT and not r.flags & lib.PYL_TAPREC_NO_DATA:
                key = (int(r.pass_no), ffi.string(r.name).decode("utf-8", "replace"))
                self._inputs_by_pass.setdefault(key, (int(r.offset), int(r.nbytes)))
        self._indexed = self._n_records
        where = self._inputs_by_pass.get((pass_index, name))
        if where is None:
            return None
        return self._arena[where[0] : where[0] + where[1]].view(np.int32)

    def _data_view(self, r, ne, nb, ndim) -> np.ndarray:
        t = int(r.type)
        shape = tuple(reversed(ne[:ndim]))
        off, n = int(r.offset), int(r.nbytes)
        dtype = _NUMPY.get(t)
        if r.flags & lib.PYL_TAPREC_NO_DATA or n == 0:  # nothing to copy (a pass with no output rows)
            return np.zeros(shape if 0 in shape else (0,), dtype or np.uint8)
        raw = self._arena[off : off + n]
        if dtype is None:  # quantized: raw rows of blocks
            row = int(lib.ggml_row_size(t, ne[0]))
            return np.lib.stride_tricks.as_strided(
                raw, shape=(*reversed(ne[1:ndim]), row), strides=(*reversed(nb[1:ndim]), 1), writeable=False
            )
        return np.ndarray(shape, dtype=dtype, buffer=raw, strides=tuple(reversed(nb[:ndim])))

    # lookup
    def _pick(self, key) -> list[TapRecord]:
        if isinstance(key, tuple):
            site, layer = key
            want = lambda r: r.site == site and r.layer == layer  # noqa: E731
        elif isinstance(key, str):
            want = lambda r: r.name == key or (r.site == key and r.layer is None)  # noqa: E731
        else:
            raise TypeError(f"a capture is indexed by a name or (site, layer), got {key!r}")
        recs = [r for r in self.records if want(r)]
        if not recs and isinstance(key, str) and any(r.site == key for r in self.records):
            layers = sorted({r.layer for r in self.records if r.site == key and r.layer is not None})
            raise KeyError(f"{key!r} is layered: index by ({key!r}, layer), layers captured: {layers}")
        if not recs:
            have = sorted({r.name for r in self.records})
            raise KeyError(f"{key!r}: nothing captured under that name (captured: {', '.join(have[:40])})")
        return recs

    def __getitem__(self, key: str | tuple[str, int]) -> np.ndarray:
        return self.get(key)

    def get(self, key: str | tuple[str, int], *, seq_id: int | None = None, call: int | None = None) -> np.ndarray:
        """The rows of a captured tensor, over every pass (or one decode call), in batch order.

        Args:
            key: ``"l_out-5"``, ``("l_out", 5)`` or an unlayered name (``"result_norm"``).
            seq_id: Only the rows of this sequence (a row belongs to every sequence it carries).
            call: Only the passes of this decode call (counted from the capture's start).

        Returns:
            The passes' arrays concatenated along their token axis, rows sorted by (call, batch
            index); a view of the record when one pass holds them all in order. Tensors without a
            token axis come stacked, one per pass, on a new first axis.

        Raises:
            KeyError: Nothing was captured under ``key``.
            TapError: Passes of different shapes (``n_kv`` grew) cannot be concatenated, or the
                rows of a pass are not known and ``seq_id`` was asked for.
        """
        recs = [r for r in self._pick(key) if call is None or r.call == call]
        if not recs:
            raise KeyError(f"{key!r}: nothing captured in call {call}")
        ax = recs[0].token_axis
        if ax is None or any(r.token_axis != ax for r in recs):
            if seq_id is not None:
                raise TapError(f"{key!r}: this tensor has no axis of batch rows to pick seq_id {seq_id} from")
            arrays = [r.array() for r in recs]
            if len({a.shape for a in arrays}) > 1:
                raise TapError(f"{key!r}: its passes have different shapes; read cap.records")
            return arrays[0][None] if len(arrays) == 1 else np.stack(arrays)
        parts = []
        for r in recs:
            a, ax = r.by_rows()
            if seq_id is not None:
                if r.seq_ids is None:
                    raise TapError(f"{r.name}: the rows of pass {r.pass_index} are not known; read cap.records")
                keep = np.array([i for i, s in enumerate(r.seq_ids) if seq_id in s], np.int64)
                if keep.size == 0:
                    continue
                if keep.size != a.shape[ax]:
                    a = np.take(a, keep, axis=ax)
                order = r.rows[keep] if r.rows is not None else None
            else:
                order = r.rows
            parts.append((r.call, order, a))
        if not parts:
            raise KeyError(f"{key!r}: no row of seq_id {seq_id} was captured")
        if len(parts) == 1 and (parts[0][1] is None or np.all(np.diff(parts[0][1]) > 0)):
            return parts[0][2]
        other = {tuple(np.delete(a.shape, ax)) for _, _, a in parts}
        if len(other) > 1:
            raise TapError(f"{key!r}: its passes have different shapes {sorted(other)}; read cap.records")
        keys = np.concatenate(
            [
                np.stack([np.full(a.shape[ax], c), o if o is not None else np.arange(a.shape[ax])], 1)
                for c, o, a in parts
            ]
        )
        cat = np.concatenate([a for _, _, a in parts], axis=ax)
        order = np.lexsort((keys[:, 1], keys[:, 0]))
        return np.take(cat, order, axis=ax)

    def rows(self, seq_id: int) -> _SeqView:
        """This capture seen through one sequence: ``cap.rows(seq_id=1)["l_out", 5]``.

        Args:
            seq_id: The sequence.

        Returns:
            An object indexed like the capture, giving only that sequence's rows.
        """
        return _SeqView(self, seq_id)

    def __repr__(self) -> str:
        return f"<Capture {self.names!r}: {len(self.records)} records, {self.nbytes:,} bytes>"


class _SeqView:
    def __init__(self, cap: Capture, seq_id: int) -> None:
        self.cap, self.seq_id = cap, seq_id

    def __getitem__(self, key) -> np.ndarray:
        return self.cap.get(key, seq_id=self.seq_id)


# -- patch -----------------------------------------------------------------------------------------


class Patch:
    """A Python function called at named nodes of every forward pass while active
    (:meth:`Context.patch`): it gets the tensor as a writable numpy array (numpy order) and a
    :class:`TapInfo`, and changes it in place or returns the new values; later nodes read what it
    left. An exception in it stops the decode (its ubatch rolled back) and the decode raises it.

    Attributes:
        nodes: The nodes it is called at.
        fn: The function.
        n_calls: How many times it was called.

    Args:
        ctx: The context (:meth:`Context.patch` makes patches).
        names: A :data:`NamesFilter`.
        fn: ``fn(array, info)``.
        layers: Only these layers of layered names.
        which: For names several nodes carry (see :func:`resolve`).
        n_tokens: The listing's probe size.

    Raises:
        TapError: A name the pass does not produce, or a context that cannot be tapped.
        TypeError: ``fn`` is not callable.
    """

    def __init__(
        self,
        ctx: Context,
        names: NamesFilter,
        fn: Callable[[np.ndarray, TapInfo], np.ndarray | None],
        *,
        layers: Sequence[int] | None = None,
        which: int | str | None = None,
        n_tokens: int = 3,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self._taps = taps_of(ctx)
        self.graph = _listing(ctx, n_tokens)
        self.nodes = resolve(self.graph, names, layers, which)
        self.fn = fn
        self.n_calls = 0
        self._active = False

    def __enter__(self) -> Patch:
        t = self._taps
        if t.capture is None and not t.patches:
            t.reset_counters()
        t.patches.append(self)
        t.rearm()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop patching (idempotent)."""
        if not self._active:
            return
        t = self._taps
        t.patches.remove(self)
        t.rearm()
        self._active = False
