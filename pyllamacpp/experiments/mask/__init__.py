"""``pyllamacpp mask``: the KQ mask llama.cpp built for each ubatch, shown, and checked entry by entry.

Decodes a batch you describe (``--tokens``, ``--seqs``, ``--past``, ``--layout`` as for split-plan;
``--shared N``: N tokens cached once and shared by every sequence, by ``llama_memory_seq_cp``;
``--couple``: each row also carries the other sequences' ids, after its own) with graph taps on the
inputs ``attn_inp_kq_mask`` (``[n_kv, n_tokens/n_stream, 1, n_stream]``; numpy: (n_stream, 1,
n_tokens/n_stream, n_kv)) and ``attn_inp_k_idxs`` (the cell each row of the ubatch is written to),
and shows which query row may see which cell: a text grid for small cases, a figure with ``-o``.

Every entry is then recomputed in Python, as ``set_input_kq_mask_impl`` (src/llama-kv-cache.cpp)
decides it, from the cells' metadata: the positions and sequence sets of the cells before the
decode, read from a whole-context state dump (``llama_state_get_data``, parsed by
``pyllamacpp.state``), plus the cells each ubatch writes (its rows, at the cells
``attn_inp_k_idxs`` names). A cell is visible to query row i (``0``) unless, in this order: it is
empty (the columns past the cells in use, up to n_kv, are such padding); it does not hold the
row's FIRST sequence id (``ubatch->seq_id[i][0]``: a row of several sequences masks against its
first only); its position is after the row's (causal); or it is outside the sliding window
(``llama_hparams::is_masked_swa``, in the SWA cache's mask of an iSWA model). Then ``-inf``. Any
entry that differs is a mismatch (exit 1).

The dump lists a stream's non-empty cells in order without their index (``state_write_meta``),
so cell indices are read as 0, 1, ... per stream: true for the caches this command fills (a fresh
context, filled front to back, no holes); a ubatch written over a cell that is not empty by that
reading is reported. ALiBi (a keep entry is ``-|p0 - p1|``), M-RoPE positions and non-causal
attention are not modelled.
"""

from __future__ import annotations

import argparse

from ...ubatch import PlanError, per_seq
from ..common import Command, add_model_flags, context_kwargs, run_on_model
from ..ubatch_plan import add_plan_flags, shape_from_args
from ._report import grid_text, plot, print_report
from ._rule import (
    EMPTY,
    FUTURE,
    GRID_CHARS,
    KEEP,
    OTHER_SEQ,
    PADDING,
    RULES,
    SWA_TYPES,
    WINDOW,
    KVCells,
    Mismatch,
    as_streams,
    check_mask,
    engine_seq_order,
    is_masked_swa,
    mask_rule,
)
from ._run import batch_rows, run_mask

__all__ = [
    "KEEP",
    "EMPTY",
    "PADDING",
    "OTHER_SEQ",
    "FUTURE",
    "WINDOW",
    "RULES",
    "GRID_CHARS",
    "SWA_TYPES",
    "KVCells",
    "Mismatch",
    "is_masked_swa",
    "engine_seq_order",
    "mask_rule",
    "as_streams",
    "check_mask",
    "batch_rows",
    "run_mask",
    "run",
    "print_report",
    "grid_text",
    "plot",
    "add_parser",
    "main",
]


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, ctx=512, batch=512, ubatch=512)
    add_plan_flags(p)
    p.add_argument("--shared", type=int, default=0, help="tokens cached once for every sequence (seq_cp from 0)")
    p.add_argument(
        "--couple",
        action="store_true",
        help="each row also carries the other sequences' ids after its own (needs --kv-unified, equal --past)",
    )
    p.add_argument("-o", "--output", help="write the masks as a figure (PNG)")


def run(args: argparse.Namespace) -> dict:
    """:func:`run_mask` for the shape and context the flags ask for.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        What :func:`run_mask` returns, plus ``model`` and ``threads``.

    Raises:
        ValueError: Bad flags (``--mode`` other than auto, sizes), or a shape llama.cpp refuses.
        ModelLoadError: The model cannot be loaded.
        DecodeError: A decode failed.
    """
    shape = shape_from_args(args)
    if shape["mode"] != "auto":
        raise ValueError("--mode: the engine picks its split (llama_kv_cache::init_batch); --mode is split-plan's")
    n_seqs = shape["n_seqs"]
    try:
        tokens = per_seq(shape["tokens"], n_seqs, "--tokens")
        past = per_seq(shape["n_past"], n_seqs, "--past")
    except PlanError as e:
        raise ValueError(str(e)) from None
    if any(t <= 0 for t in tokens) or any(p < 0 for p in past) or args.shared < 0:
        raise ValueError(f"--tokens must be > 0, --past and --shared >= 0: {tokens}, {past}, {args.shared}")
    return run_on_model(
        args,
        run_mask,
        tokens,
        past,
        n_shared=args.shared,
        layout=shape["layout"],
        couple=args.couple,
        **context_kwargs(args),
    )


COMMAND = Command("mask", "the KQ mask of each ubatch, shown and checked against llama.cpp's rule", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
