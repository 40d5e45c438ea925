"""Pictures of a capture: an attention pattern, the KQ mask, per-layer residual norms.

Each function takes a :class:`~pyllamacpp.taps.Capture` and returns a matplotlib ``Figure``
(``matplotlib.figure.Figure``, made without pyplot: nothing is left in pyplot's global list of
figures; in a notebook it shows as the cell's value, elsewhere ``fig.savefig(path)``). The
image or line a function draws is the captured data itself (cropped to the KV cells in use), so
what the picture shows can be checked against ``cap[...]``. matplotlib is optional (the ``plot``
extra); without it these functions raise ``ImportError`` saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..model import Model
    from ._capture import Capture

_MASK = "attn_inp_kq_mask"


def _figure(**kw: Any) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError(
            "the plotting helpers of pyllamacpp.taps need matplotlib, which is not installed: "
            "pip install matplotlib (or the package's 'plot' extra)"
        ) from None
    return Figure(**kw)


def _records(cap: Capture, key: str | tuple[str, int], call: int | None) -> list:
    """The records ``cap.get(key)`` joins (the same selection)."""
    if isinstance(key, tuple):
        recs = [r for r in cap.records if (r.site, r.layer) == key]
    else:
        recs = [r for r in cap.records if r.name == key or (r.site == key and r.layer is None)]
    return [r for r in recs if call is None or r.call == call]


def _row_labels(
    cap: Capture, key: str | tuple[str, int], seq_id: int | None, call: int | None, model: Model | None
) -> list[str] | None:
    """One label per row of ``cap.get(key, seq_id=, call=)``, in its order (position, and the
    token's text when a model is at hand); None when the rows of a pass are not known."""
    keys: list[tuple[int, int]] = []
    labels: list[str] = []
    for r in _records(cap, key, call):
        if r.rows is None or r.pos is None:
            return None
        keep = range(len(r.rows)) if seq_id is None else [i for i, s in enumerate(r.seq_ids or ()) if seq_id in s]
        for i in keep:
            keys.append((r.call, int(r.rows[i])))
            tok = None if r.tokens is None else int(r.tokens[i])
            labels.append(_label(int(r.pos[i]), tok, model))
    order = sorted(range(len(keys)), key=keys.__getitem__)  # cap.get's order: (call, batch index)
    return [labels[i] for i in order]


def _row_keys(cap: Capture, key: tuple[str, int], seq_id: int | None, call: int | None) -> list[tuple[int, int]] | None:
    """(call, batch index) of each row of ``cap.get(key, ...)``, in its order; None when unknown."""
    keys: list[tuple[int, int]] = []
    for r in _records(cap, key, call):
        if r.rows is None:
            return None
        keep = range(len(r.rows)) if seq_id is None else [i for i, s in enumerate(r.seq_ids or ()) if seq_id in s]
        keys.extend((r.call, int(r.rows[i])) for i in keep)
    return sorted(keys)


def _label(pos: int, token: int | None, model: Model | None) -> str:
    if model is None or token is None:
        return f"pos {pos}"
    try:
        return f"{pos} {model.token_to_piece(token)!r}"
    except Exception:  # noqa: BLE001 - a label is not worth an error (a closed model)
        return f"pos {pos}"


def _model_of(cap: Capture, model: Model | None) -> Model | None:
    if model is not None:
        return model
    try:
        return cap._taps.ctx().model  # the captured context's, while it lives
    except Exception:  # noqa: BLE001 - the context is gone: positions only
        return None


def _cells_used(visible: np.ndarray) -> int:
    """One more than the last KV cell (last axis) any row sees; at least 1."""
    cols = np.flatnonzero(visible.reshape(-1, visible.shape[-1]).any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 1


def _ticks(ax, labels: list[str] | None, n: int, axis: str) -> None:
    if labels is None or len(labels) != n or n > 48:
        return
    if axis == "y":
        ax.set_yticks(range(n), labels, fontsize=7)
    else:
        ax.set_xticks(range(n), labels, fontsize=7, rotation=90)


def plot_attention(
    cap: Capture,
    layer: int,
    head: int | None = None,
    *,
    seq_id: int | None = None,
    call: int | None = None,
    cells: int | None = None,
    model: Model | None = None,
) -> Figure:
    """The attention probabilities of one layer (``kq_soft_max-<layer>``): one image per head,
    a row per query row of the batch, a column per KV cell.

    Capture ``kq_soft_max`` first (a context with ``flash_attn="off"``: flash attention has no
    such node). Each image is ``cap.get(("kq_soft_max", layer), seq_id=, call=)[head]``, its
    columns cut to ``cells``.

    Args:
        cap: A capture holding ``kq_soft_max`` at ``layer``.
        layer: The layer (negative counts from the end of the captured layers' pass,
            ``cap.graph.n_layer``).
        head: One head (negative counts from the last), or None: every head, in a grid.
        seq_id: Only this sequence's query rows.
        call: Only this decode call's passes (counted from the capture's start).
        cells: The KV cells shown (the first ``cells`` columns); None: up to the last cell any
            row attends to (the rest is the padding of ``n_kv`` to 256, all zero).
        model: Labels the rows with their tokens' text; None: the captured context's model
            while it lives, else positions only.

    Returns:
        A ``matplotlib.figure.Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        KeyError: The capture holds no ``kq_soft_max`` at that layer.
        IndexError: ``head`` is not a head of the layer.
        ValueError: The probabilities are split into several KV streams (a context without
            ``kv_unified`` decoding several sequences in one ubatch): pass ``seq_id``.
    """
    if layer < 0:
        layer += cap.graph.n_layer
    key = ("kq_soft_max", layer)
    p = np.asarray(cap.get(key, seq_id=seq_id, call=call), dtype=np.float32)
    while p.ndim > 3 and p.shape[0] == 1:
        p = p[0]
    if p.ndim != 3:
        raise ValueError(f"kq_soft_max-{layer} has shape {p.shape}, not (n_head, rows, n_kv); pass seq_id=")
    n_head = p.shape[0]
    if head is not None and not -n_head <= head < n_head:
        raise IndexError(f"head {head}: layer {layer} has {n_head} heads (0..{n_head - 1})")
    heads = list(range(n_head)) if head is None else [head % n_head]
    n_cells = cells if cells is not None else _cells_used(p > 0)
    labels = _row_labels(cap, key, seq_id, call, _model_of(cap, model))
    cols = min(len(heads), 3)
    rows = -(-len(heads) // cols)
    fig = _figure(figsize=(4.2 * cols, 0.6 + max(2.0, 0.22 * p.shape[1]) * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, h in enumerate(heads):
        ax = axes[i // cols][i % cols]
        im = ax.imshow(p[h, :, :n_cells], aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_title(f"layer {layer}, head {h}", fontsize=9)
        ax.set_xlabel("KV cell")
        _ticks(ax, labels, p.shape[1], "y")
    for j in range(len(heads), rows * cols):
        axes[j // cols][j % cols].set_axis_off()
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8, label="probability")
    fig.suptitle(f"kq_soft_max-{layer}: attention probabilities, a row per query", fontsize=10)
    return fig


def plot_mask(
    cap: Capture,
    *,
    seq_id: int | None = None,
    call: int | None = None,
    cells: int | None = None,
    model: Model | None = None,
) -> Figure:
    """The KQ mask (the input ``attn_inp_kq_mask``): which KV cells each query row may see.

    The image is ``np.isfinite(mask)``: 1 where the mask holds a finite value (0, or an ALiBi
    bias: the cell is attended to), 0 where it holds ``-inf``; the rows are the batch's query
    rows (``cap.get("attn_inp_kq_mask", seq_id=, call=)``), the columns KV cells.

    Args:
        cap: A capture holding ``attn_inp_kq_mask``.
        seq_id: Only this sequence's query rows.
        call: Only this decode call's passes.
        cells: The KV cells shown; None: up to the last cell any row may see.
        model: Labels the rows with their tokens' text (see :func:`plot_attention`).

    Returns:
        A ``matplotlib.figure.Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        KeyError: The capture holds no ``attn_inp_kq_mask``.
        ValueError: The capture holds two masks of that name (an iSWA model's full and
            sliding-window masks; read ``cap.records``), or a mask split into KV streams.
    """
    if len({r.occurrence for r in _records(cap, _MASK, call)}) > 1:
        raise ValueError(
            f"the capture holds {_MASK} twice per pass (an iSWA model's two masks): read cap.records, "
            "whose occurrence and GraphNode.read_by tell them apart"
        )
    m = np.asarray(cap.get(_MASK, seq_id=seq_id, call=call), dtype=np.float32)
    while m.ndim > 2 and m.shape[0] == 1:
        m = m[0]
    if m.ndim != 2:
        raise ValueError(f"{_MASK} has shape {m.shape}, not (rows, n_kv); pass seq_id=")
    visible = np.isfinite(m)
    n_cells = cells if cells is not None else _cells_used(visible)
    labels = _row_labels(cap, _MASK, seq_id, call, _model_of(cap, model))
    fig = _figure(figsize=(max(4.0, 0.25 * n_cells + 2.5), 0.9 + max(2.0, 0.25 * m.shape[0])), layout="constrained")
    ax = fig.subplots()
    ax.imshow(visible[:, :n_cells].astype(np.float32), aspect="auto", cmap="Greys", vmin=0.0, vmax=1.0)
    ax.set_xlabel("KV cell")
    ax.set_title(f"{_MASK}: black = seen (finite), white = -inf", fontsize=9)
    _ticks(ax, labels, m.shape[0], "y")
    return fig


def plot_residual_norms(
    cap: Capture,
    *,
    site: str = "l_out",
    seq_id: int | None = None,
    call: int | None = None,
    log: bool = False,
    model: Model | None = None,
) -> Figure:
    """The residual stream's L2 norm per layer: one line per batch row, the layers on the x axis.

    Each line is ``np.linalg.norm(cap.get((site, layer))[row], axis=-1)`` over the captured
    layers. A row that a layer does not hold (the last layer's ``l_out`` comes after
    ``inp_out_ids``: only output rows are left in a prompt's pass) has no point there (NaN).

    Args:
        cap: A capture holding ``site`` at one or more layers (``ctx.capture("l_out")``).
        site: The layered site whose rows are the residual stream (``l_out``, ``ffn_inp``...).
        seq_id: Only this sequence's rows.
        call: Only this decode call's passes.
        log: A logarithmic y axis (a model's first token often carries a norm many times the
            others', an "attention sink").
        model: Labels the lines with their tokens' text (see :func:`plot_attention`).

    Returns:
        A ``matplotlib.figure.Figure``.

    Raises:
        ImportError: matplotlib is not installed.
        KeyError: The capture holds no layer of ``site``.
    """
    layers = sorted({r.layer for r in cap.records if r.site == site and r.layer is not None})
    if not layers:
        have = sorted({r.site for r in cap.records})
        raise KeyError(f"{site!r}: no layer of it was captured (captured sites: {', '.join(have)})")
    per_layer = {}
    keys: set[tuple[int, int]] = set()
    for il in layers:
        a = np.asarray(cap.get((site, il), seq_id=seq_id, call=call), dtype=np.float32)
        k = _row_keys(cap, (site, il), seq_id, call)
        if k is None:  # rows not known: number them in order
            k = [(0, i) for i in range(a.shape[0])]
        per_layer[il] = dict(zip(k, np.linalg.norm(a.reshape(a.shape[0], -1), axis=-1)))
        keys.update(k)
    order = sorted(keys)
    norms = np.full((len(layers), len(order)), np.nan, np.float32)
    for i, il in enumerate(layers):
        for j, row in enumerate(order):
            if row in per_layer[il]:
                norms[i, j] = per_layer[il][row]
    labels = _line_labels(cap, site, layers, order, _model_of(cap, model))
    fig = _figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for j in range(len(order)):
        ax.plot(layers, norms[:, j], marker=".", lw=1.2, label=labels[j])
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel(f"‖{site}‖₂ of the row")
    ax.set_title(f"{site}: the residual stream's norm after each layer, a line per batch row", fontsize=9)
    if len(order) <= 16:
        ax.legend(fontsize=7, loc="upper left")
    return fig


def _line_labels(cap: Capture, site: str, layers: list[int], order: list, model: Model | None) -> list[str]:
    found: dict[tuple[int, int], str] = {}
    for r in cap.records:
        if r.site != site or r.layer not in layers or r.rows is None or r.pos is None:
            continue
        for i, b in enumerate(r.rows):
            tok = None if r.tokens is None else int(r.tokens[i])
            found.setdefault((r.call, int(b)), _label(int(r.pos[i]), tok, model))
    return [found.get(k, f"row {k[1]}") for k in order]
