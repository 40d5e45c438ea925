"""The shape flags of the commands that plan a batch (``split-plan``, ``trace-ubatches``,
``mask``): ``--tokens``, ``--seqs``, ``--past``, ``--layout``, ``--mode`` (:func:`add_plan_flags`,
:func:`shape_from_args`) and a plan's one-line summary (:func:`summary_line`).

llama.cpp's batch split replayed, which used to live here, is the library module
``pyllamacpp.ubatch``; its names are re-exported from this module, so older imports keep working.
"""

from __future__ import annotations

import argparse

# the planner's names, re-exported: the commands and older code import them from here
from ..ubatch import LAYOUTS as LAYOUTS
from ..ubatch import MODES as MODES
from ..ubatch import N_PAD as N_PAD
from ..ubatch import BatchAllocr as BatchAllocr
from ..ubatch import DecodeCall as DecodeCall
from ..ubatch import Plan as Plan
from ..ubatch import PlanError as PlanError
from ..ubatch import Row as Row
from ..ubatch import UBatch as UBatch
from ..ubatch import choose_split as choose_split
from ..ubatch import layout_rows as layout_rows
from ..ubatch import pad as pad
from ..ubatch import per_seq as per_seq
from ..ubatch import plan as plan
from ..ubatch import runs as runs
from ..ubatch import split_all as split_all

# -- the shape flags -------------------------------------------------------------------------


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """Add the shape flags split-plan and trace-ubatches share (``--tokens``, ``--seqs``, ``--past``...).

    Args:
        p: The subcommand's parser.
    """
    p.add_argument(
        "--tokens", required=True, help="tokens per sequence: N for every sequence, or N0,N1,... one per sequence"
    )
    p.add_argument("--seqs", type=int, default=None, help="number of sequences (default: 1, or the length of --tokens)")
    p.add_argument("--past", default="0", help="tokens already in the cache per sequence: P or P0,P1,...")
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="seq",
        help="seq: each sequence's tokens together; interleave: round-robin (default %(default)s)",
    )
    p.add_argument(
        "--mode", choices=MODES, default="auto", help="auto: as llama_kv_cache::init_batch picks (default %(default)s)"
    )


def shape_from_args(args: argparse.Namespace) -> dict:
    """The :func:`plan` keywords of the shape flags.

    Args:
        args: The parsed flags of :func:`add_plan_flags`.

    Returns:
        ``tokens``, ``n_seqs``, ``n_past``, ``layout`` and ``mode``.

    Raises:
        ValueError: ``--tokens`` is not a list of integers.
        IndexError: ``--tokens`` is empty.
    """
    toks = [int(x) for x in str(args.tokens).split(",") if x.strip()]
    n_seqs = args.seqs or len(toks)
    return dict(
        tokens=toks if len(toks) > 1 else toks[0], n_seqs=n_seqs, n_past=args.past, layout=args.layout, mode=args.mode
    )


def summary_line(data: dict) -> str:
    """The plan in one line: shape, sizes, split, how many decode calls and ubatches.

    Args:
        data: A plan as :meth:`Plan.to_dict` gives it.

    Returns:
        The line.
    """
    n_ub = sum(len(c["ubatches"]) for c in data["calls"])
    return (
        f"tokens {list(data['tokens'])} past {list(data['n_past'])}, layout {data['layout']}; "
        f"n_ctx {data['n_ctx']}, "
        f"n_batch {data['n_batch']}, n_ubatch {data['n_ubatch']}, n_seq_max {data['n_seq_max']}, kv_unified "
        f"{data['kv_unified']}; split_{data['split']}: {len(data['calls'])} decode call(s), {n_ub} ubatch(es)"
    )
