"""The listing of a forward pass (probe decodes in a throwaway context) and the name filter
resolved against it: :class:`GraphNode`, :class:`Graph`, :func:`resolve`."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._lib import ffi, lib
from ..errors import TapError

if TYPE_CHECKING:
    from ..context import Context

NamesFilter = str | Sequence[str] | Callable[[str], bool]
"""What to tap: a name, site or glob (``"l_out"``, ``"l_out-5"``, ``"ffn_*"``), several of them,
or a predicate on the full node name."""


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

    @property
    def n_layer(self) -> int:
        """The layers the pass names: one more than the highest layer of a node (0 when no node
        is layered). A negative ``layers=`` entry counts back from it, as a Python index does."""
        return 1 + max((n.layer for n in self.nodes if n.layer is not None), default=-1)

    def input_names(self) -> list[str]:
        """The inputs' names in order of first use, the KV cache tensors of every layer as one
        entry (``cache_k_l<0..29>``): what ``pyllamacpp graph --sites`` prints.

        Returns:
            One name per input leaf, one per KV cache tensor kind.
        """
        layers: dict[str, list[int]] = {}
        for i in self.inputs:
            key = i.name if i.layer is None else f"{i.site}_l"
            layers.setdefault(key, [])
            if i.layer is not None:
                layers[key].append(i.layer)
        return [k if not ls else f"{k}<{min(ls)}..{max(ls)}>" for k, ls in layers.items()]

    def table(self, *, views: bool = False, layers: Sequence[int] | None = None) -> str:
        """The listing as text: index, name, op, type, shape, token axis.

        Args:
            views: Also list view nodes (RESHAPE, VIEW, PERMUTE, TRANSPOSE: no compute).
            layers: Only these layers (and the unlayered nodes); negative ones count from
                :attr:`n_layer`, as Python indexes do.

        Returns:
            One line per node, then one per input.

        Raises:
            TapError: A layer the pass does not have.
        """
        lay = _layer_set(self, layers)
        lines = [f"{'#':>5}  {'name':<34} {'op':<15} {'type':<5} {'shape':<22} rows"]
        for n in [*self.nodes, *self.inputs]:
            if n.is_view and not views:
                continue
            if lay is not None and not _in_layers(n, lay):
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
    from ..batch import Batch
    from ..context import Context
    from ..packing import WorkOrder

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
    n_stream = _n_stream(ctx)
    probe = Context(
        model,
        dataclasses.replace(
            ctx.params,
            # as many KV streams as ctx (without kv_unified each sequence has its own, and the
            # cache's nodes are named after that), 256 cells each (llama.cpp's padding)
            n_ctx=256 * n_stream,
            n_batch=max(8, most, n_stream),
            n_ubatch=max(8, most),
            n_seq_max=n_stream,
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
        order = WorkOrder(Batch(most, 1, model=model))
        n_vocab = model.n_vocab
        for n_tokens, all_outputs in shapes:
            order.clear()
            toks = [(7 + 13 * i) % n_vocab for i in range(n_tokens)]
            order.add(toks, 0, 0, "all" if all_outputs else "last")
            probe.memory.clear()
            nodes = []
            order.decode(probe)
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
    skip.add("kv_unified")  # in _n_stream
    out = []
    for f in dataclasses.fields(ctx.params):
        if f.name in skip:
            continue
        v = getattr(ctx.params, f.name)
        if v is None or isinstance(v, (bool, int, float, str)):
            out.append((f.name, v))
    return (*out, ("flash_attn", ctx.flash_attn), ("n_stream", _n_stream(ctx)))


def _n_stream(ctx: Context) -> int:
    """KV streams of the context's cache: 1 with kv_unified, else one per sequence."""
    return 1 if ctx.params.kv_unified else int(ctx.n_seq_max)


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


def name_layer(node: GraphNode) -> int | None:
    """The layer a node's name says, a view's suffix aside: ``l_out-5`` and ``Qcur-0 (view)``
    give 5 and 0, ``cache_k_l3 (view) (permuted)`` 3, ``embd`` and ``node_21`` None. What
    ``layers=`` filters on (:attr:`GraphNode.layer` is None for suffixed names, which are their
    own site).

    Args:
        node: A node or input of a listing.

    Returns:
        The layer, or None.
    """
    if node.layer is not None:
        return node.layer
    return split_name(node.name.split(" (")[0])[1]


def _in_layers(node: GraphNode, layers: set[int]) -> bool:
    layer = name_layer(node)
    return layer is None or layer in layers


def _layer_set(graph: Graph, layers: Sequence[int] | None) -> set[int] | None:
    """``layers=`` as a set of layers of the pass, negative ones counted from ``n_layer``."""
    if layers is None:
        return None
    if isinstance(layers, (int, str)):
        raise TypeError(f"layers: a list of layers, e.g. [3] or [-1], got {layers!r}")
    asked = [int(x) for x in layers]
    n = graph.n_layer
    if n == 0:  # no layered node: nothing for the filter to keep or drop
        return set(asked)
    bad = [x for x in asked if not -n <= x < n]
    if bad:
        raise TapError(
            f"layers {bad}: the model's layers are 0..{n - 1} (negative layers count from the end: "
            f"-1 is layer {n - 1}, -{n} is layer 0)"
        )
    return {x % n for x in asked}


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
    return (
        f"{msg}. Sites of this pass: {', '.join(graph.sites())}. Inputs: "
        f"{', '.join(graph.input_names())}. See ctx.graph_nodes() for every node."
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
        layers: Keep only these layers of layered nodes (unlayered names that match stay). A
            view's name is layered by the name it carries (``cache_k_l3 (view)`` is layer 3,
            :func:`name_layer`); negative layers count from the pass's :attr:`Graph.n_layer`,
            as Python indexes do (``-1``: the last layer).
        which: For a name that several nodes carry: None (the last in graph order), an index
            among them (negative counts from the end), an op name (``"MUL_MAT"``), or ``"all"``
            (every node of the name but views, which hold their source's data).

    Returns:
        The nodes and inputs, in graph order (inputs last).

    Raises:
        TapError: Nothing matches (the message lists the sites and inputs the pass has, and says
            when flash attention hides the one asked for), a layer the pass does not have, or
            ``which`` fits no node of a name.
        TypeError: ``names`` is not a name, glob, list or predicate, or ``layers`` not a list.
    """
    match = _matcher(names)
    lay = _layer_set(graph, layers)
    picked: dict[str, GraphNode | list[GraphNode]] = {}
    for n in [*graph.nodes, *graph.inputs]:
        if n.name in picked or not match(n):
            continue
        if lay is not None and not _in_layers(n, lay):
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
