"""Embeddings of texts, as llama.cpp's ``examples/embedding`` (``llama-embedding``) computes them.

:func:`embed` (``Model.embed``): a context with ``embeddings=True``, the texts one sequence each
in work orders of the packing core (:class:`~pyllamacpp.packing.WorkOrder`), the memory cleared
before each decode, and each vector normalized as ``common_embd_normalize`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._lib import lib
from .batch import Batch
from .packing import Piece, WorkOrder

if TYPE_CHECKING:
    from .model import Model

__all__ = ["embed"]


def _embd_normalize(x: np.ndarray, p: int) -> np.ndarray:
    """Each row of ``x`` as ``common_embd_normalize(inp, out, n, p)`` (llama.cpp's common.cpp)
    writes it: divided by its max-abs / 32760 (p = 0), its p-norm (p >= 1), or unchanged (p = -1),
    the sum in float64 and the factor ``1 / sum`` cast to float32 (0 for a zero row)."""
    x = np.asarray(x, np.float32)
    if p < 0:
        return x.copy()
    a = np.abs(x.astype(np.float64))
    if p == 0:
        s = a.max(axis=-1, keepdims=True) / 32760.0
    elif p == 2:
        s = np.sqrt((x * x).astype(np.float64).sum(axis=-1, keepdims=True))  # float products, a double sum
    else:
        s = (a**p).sum(axis=-1, keepdims=True) ** (1.0 / p)
    with np.errstate(divide="ignore"):
        norm = np.where(s > 0.0, 1.0 / s, 0.0).astype(np.float32)
    return x * norm


def embed(
    model: Model,
    texts: str | Sequence[str],
    *,
    pooling: str | None = None,
    normalize: int = 2,
    add_special: bool = True,
    parse_special: bool = True,
    **context_params: Any,
) -> np.ndarray | list[np.ndarray]:
    """Embeddings of ``texts``, as llama.cpp's ``examples/embedding`` computes them.

    A context with ``embeddings=True``, ``pooling_type=pooling`` and a unified KV cache; the
    texts are tokenized (``llama_tokenize``, by default with ``parse_special`` as the example
    does), packed one sequence each into batches of up to ``n_batch`` tokens, the memory cleared
    before each ``llama_decode``; then each vector is normalized as ``common_embd_normalize``
    does with ``--embd-normalize`` (sums in float64). The context is closed afterwards.

    Args:
        model: The model.
        texts: A text, or a list of texts.
        pooling: ``"none"`` (one vector per token), ``"mean"``, ``"cls"`` (the first token),
            ``"last"``, ``"rank"`` (a reranker's score: only for models whose GGUF declares
            rank pooling), or None: the model's own (``<arch>.pooling_type``; none when absent).
        normalize: ``--embd-normalize``: -1 none, 0 max-absolute scaled to int16 range,
            1 taxicab, 2 Euclidean (llama.cpp's default), p > 2 the p-norm. Not applied to rank
            scores.
        add_special: ``llama_tokenize``'s ``add_special``.
        parse_special: ``llama_tokenize``'s ``parse_special``.
        **context_params: Fields of :class:`ContextParams` for the context (``n_threads``,
            ``n_batch``...); ``embeddings``, ``pooling_type``, ``kv_unified`` and ``n_ubatch``
            (= ``n_batch``, rounded up to a multiple of ``n_seq_max``) are set here.

    Returns:
        Pooled: a float32 array ``(len(texts), n_embd_out)`` (``(len(texts), n_cls_out)`` for
        rank), 1-D for a single str. ``"none"``: a list of ``(n_tokens_i, n_embd_out)``
        arrays, one per text (one array for a single str). Copies: the context's buffers
        are overwritten by each decode.

    Raises:
        ValueError: No texts, a text that gives no tokens or more than ``n_ctx_train``, an
            unknown pooling, ``"rank"`` for a model without rank pooling, or ``normalize`` < -1.
        TypeError: A text that is not a str.
        ContextError: The context could not be made.
        DecodeError: ``llama_decode`` failed.
        ClosedError: The model is closed.
    """
    single = isinstance(texts, str)
    items = [texts] if isinstance(texts, str) else list(texts)
    if not items:
        raise ValueError("embed: no texts")
    for i, text in enumerate(items):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] must be a str, not {type(text).__name__}")
    if int(normalize) < -1:
        raise ValueError(f"normalize must be -1 (none), 0, 1, 2 or a p > 2, not {normalize}")
    own = model.meta(f"{model.arch}.pooling_type")
    if pooling is None:
        pooling = {"1": "mean", "2": "cls", "3": "last", "4": "rank"}.get(own or "", "none")
    if pooling not in ("none", "mean", "cls", "last", "rank"):
        raise ValueError(f"pooling must be 'none', 'mean', 'cls', 'last', 'rank' or None, not {pooling!r}")
    if pooling == "rank" and own != "4":
        # without a classification head llama.cpp reads n_cls_out floats at offset
        # seq_idx * n_cls_out of the pooled rows: sequence s gets element s of sequence 0's row
        raise ValueError(f"pooling='rank' needs a reranker; {model.path.name} declares no rank pooling")
    toks = [model.tokenize(text, add_special, parse_special) for text in items]
    longest = max(t.size for t in toks)
    for i, t in enumerate(toks):
        if t.size == 0:
            raise ValueError(f"texts[{i}] gave no tokens")
    limit = model.n_ctx_train or longest
    if longest > limit:
        raise ValueError(f"a text of {longest} tokens is longer than the model's n_ctx_train {limit}")
    n_batch = int(context_params.pop("n_batch", 0)) or min(max(longest, 512), max(limit, longest))
    n_batch = max(n_batch, longest)
    n_seq = min(len(toks), int(lib.llama_max_parallel_sequences()))
    # llama.cpp's graph_reserve rounds n_ubatch up to a multiple of n_seq_max but not the outputs:
    # with mean pooling the two no longer fit and ggml aborts in llama_init_from_model
    n_batch = -(-n_batch // n_seq) * n_seq
    kw: dict[str, Any] = {"n_ctx": n_batch, "n_seq_max": n_seq, **context_params}
    kw.update(n_batch=n_batch, n_ubatch=n_batch, embeddings=True, pooling_type=pooling, kv_unified=True)
    norm = int(normalize)
    out: list[np.ndarray] = []
    with model.context(**kw) as ctx:
        order = WorkOrder(Batch(n_batch, 1, model=model))
        group: list[np.ndarray] = []

        def run() -> None:
            # one work order per group: text s of the group is sequence s, every token an output
            order.clear()
            pieces: list[Piece] = [order.add(t, s, 0, "all") for s, t in enumerate(group)]
            ctx.memory.clear()
            order.decode(ctx)
            for s, piece in enumerate(pieces):
                if pooling == "none":
                    slots = range(piece.slots.start, piece.slots.stop)  # llama_get_embeddings_ith takes a slot
                    v = np.stack([ctx.embeddings(i) for i in slots])
                else:
                    v = np.array(ctx.seq_embeddings(s))
                out.append(v if pooling == "rank" else _embd_normalize(v, norm))
            group.clear()

        used = 0
        for t in toks:
            if group and (used + t.size > n_batch or len(group) >= n_seq):
                run()
                used = 0
            group.append(t)
            used += t.size
        run()
    if pooling == "none":
        return out[0] if single else out
    return out[0] if single else np.stack(out)
