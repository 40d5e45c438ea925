"""One ``pyllamacpp kv-live`` mode: the decode calls of a run, the prompts decoded under a watch,
and each sequence compared with its dump.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ._compare import compare_seq, memory_order
from ._watch import watch

if TYPE_CHECKING:
    from ...model import Model


def schedule(model: Model, prompts: Sequence[str]) -> list[tuple[int, np.ndarray, int]]:
    """The decode calls of a run: ``(seq_id, tokens, start_pos)``, the first prompt split in two
    around the others, so in one stream its cells are not contiguous.

    Args:
        model: The model (to tokenize with).
        prompts: One prompt per sequence.

    Returns:
        The calls, in order.
    """
    toks = [model.tokenize(p) for p in prompts]
    half = max(1, len(toks[0]) // 2)
    calls = [(0, toks[0][:half], 0)]
    calls += [(s, t, 0) for s, t in enumerate(toks[1:], 1)]
    if len(toks[0]) > half:
        calls.append((0, toks[0][half:], half))
    return calls


def run_mode(
    model: Model,
    *,
    layout: str,
    flash_attn: str,
    prompts: Sequence[str],
    n_ctx: int,
    ctx_kwargs: dict,
) -> dict:
    """One mode: a context, the prompts decoded under a :class:`KVWatch`, each sequence compared.

    Args:
        model: The model.
        layout: ``"unified"`` (one stream) or ``"split"`` (one stream per sequence).
        flash_attn: ``"on"`` or ``"off"`` (V transposed).
        prompts: One prompt per sequence.
        n_ctx: ``n_ctx``.
        ctx_kwargs: Further context keywords (``type_k``, threads ...).

    Returns:
        ``layout``, ``flash_attn``, ``n_ctx``, ``n_seq_max``, ``calls`` (seq, tokens, start),
        ``tensors`` (dicts, memory order), ``memory`` (:func:`memory_order`), ``seqs`` (one
        :func:`compare_seq` result each) and ``ok``.

    Raises:
        ValueError: A bad layout or flash_attn value, or the cells disagree (see
            :func:`compare_seq`).
        ContextError: llama.cpp cannot make the context.
        DecodeError: A decode failed.
    """
    if layout not in ("unified", "split") or flash_attn not in ("on", "off"):
        raise ValueError(f"kv-live: a mode is unified|split:on|off, got {layout}:{flash_attn}")
    from ...batch import Batch

    calls = schedule(model, prompts)
    n_seq = len(prompts)
    with model.context(
        n_ctx=n_ctx,
        n_seq_max=n_seq,
        kv_unified=layout == "unified",
        flash_attn=flash_attn,
        **ctx_kwargs,
    ) as ctx:
        batch = Batch(max(len(t) for _, t, _ in calls), 1, model=model)
        with watch(ctx) as w:
            for seq, toks, start in calls:
                batch.clear()
                batch.add_sequence(toks, seq, start, logits="last")
                ctx.decode(batch)
        tensors = w.tensors()
        seqs = [compare_seq(ctx, w, s) for s in range(n_seq)]
        return {
            "layout": layout,
            "flash_attn": flash_attn,
            "v_trans": flash_attn == "off",
            "n_ctx": n_ctx,
            "n_seq_max": n_seq,
            "n_passes": w.n_passes,
            "calls": [{"seq_id": s, "n_tokens": len(t), "start": p} for s, t, p in calls],
            "tensors": [{k: v for k, v in dataclasses.asdict(t).items() if k != "data"} for t in tensors],
            "memory": memory_order(tensors),
            "seqs": seqs,
            "ok": all(s["ok"] for s in seqs),
        }
