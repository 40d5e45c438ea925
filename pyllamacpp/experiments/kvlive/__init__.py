"""``pyllamacpp kv-live``: the KV cache as it sits in its backend buffer, against the state file.

llama.cpp's KV cache (``llama_kv_cache``'s constructor) is two ggml tensors per layer,
``cache_k_l<il>`` and ``cache_v_l<il>``, each ``[n_embd_gqa, kv_size, n_stream]``, allocated in one
backend buffer per buffer type. This command decodes a few prompts while graph taps watch the
passes, and prints, from the tensors themselves (read through the ``src[]`` of the nodes that read
them): per layer the name, type, ``ne``, ``nb``, the buffer and the byte offset in it, sorted by
offset, so the order in memory is printed, not assumed. Which cells hold each sequence comes from
the engine too: ``attn_inp_k_idxs``, the row indices the graph's ``SET_ROWS`` writes K to
(``stream * kv_size + cell``), checked against the cells the sequence's state dump lists. Then each
sequence's rows, read from the live tensors (a numpy view of the buffer, not a copy), are compared
byte for byte with the same rows in its ``llama_state_seq_get_data_ext`` dump, parsed with
``pyllamacpp.state``: K row by row; V row by row with flash attention on, and with it off
(``v_trans = 1``) value by value, the tensor being used transposed (value j of cell c at
``j * kv_size + c``). Modes (``--modes``) are ``layout:fa``: ``unified`` (one stream) or
``split`` (``kv_unified=False``, one stream per sequence), flash attention ``on`` or ``off``.
Any byte that differs fails the command (exit 1), naming the layer, the cell and the offsets.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from ..common import Command, Interrupted, add_context_flags, add_model_path_flag, load_model, progress
from ._compare import compare, compare_seq, memory_order
from ._report import plot, print_report
from ._run import run_mode, schedule
from ._watch import KVTensor, KVWatch, watch

__all__ = [
    "KVTensor",
    "KVWatch",
    "watch",
    "memory_order",
    "compare",
    "compare_seq",
    "schedule",
    "run_mode",
    "run",
    "print_report",
    "plot",
    "add_parser",
    "main",
]

PROMPTS = ("The cat sat on the mat.", "A dog ran in the park, barking at the birds!")
MODES = "unified:on,unified:off,split:off"


# -- the command -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    """:func:`run_mode` for each mode of ``--modes``.

    Args:
        args: The parsed flags of :func:`add_parser`.

    Returns:
        ``model``, ``prompts``, ``modes`` (one :func:`run_mode` result each) and ``ok``.

    Raises:
        ModelLoadError: The model cannot be loaded.
        ValueError: A bad mode, fewer than two prompts for a split mode, or cells that disagree.
        ContextError: llama.cpp cannot make a context.
        DecodeError: A decode failed.
        Interrupted: Ctrl-C; it carries the modes finished before it.
    """
    modes = [m.strip().split(":") for m in str(args.modes).split(",") if m.strip()]
    for m in modes:
        if len(m) != 2:
            raise ValueError(f"kv-live: a mode is layout:fa (unified:on, split:off), got {':'.join(m)!r}")
    prompts = list(args.prompt or PROMPTS)
    kw = dict(
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        n_threads=args.threads,
        n_threads_batch=args.threads,
    )
    with load_model(args) as model:
        data: dict[str, Any] = {"model": str(model.path), "prompts": prompts, "modes": []}
        try:
            for layout, fa in progress(modes, "kv-live"):
                data["modes"].append(
                    run_mode(model, layout=layout, flash_attn=fa, prompts=prompts, n_ctx=args.ctx_size, ctx_kwargs=kw)
                )
        except KeyboardInterrupt:
            data["ok"] = all(m["ok"] for m in data["modes"])
            raise Interrupted(data if data["modes"] else None, len(data["modes"]), len(modes), "modes") from None
    data["ok"] = all(m["ok"] for m in data["modes"])
    return data


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_path_flag(p)
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="n_ctx (default %(default)s)")
    add_context_flags(p, flash_attn=False)
    p.add_argument("--modes", default=MODES, help="layout:fa, comma-separated (default %(default)s)")
    p.add_argument("--prompt", action="append", help="one per sequence (repeat; default: two built-in prompts)")
    p.add_argument("--all", action="store_true", help="list every tensor, not the first six and the last two")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("-o", "--output", help="write a figure of the first mode (PNG)")


def _printer(args: argparse.Namespace) -> Callable[[dict], None]:
    return functools.partial(print_report, all_tensors=args.all)


COMMAND = Command(
    "kv-live",
    "the KV cache tensors in their buffer, against the state dump",
    __name__,
    _flags,
    printer=_printer,
    failure=lambda data: "the live cache and the dump DIFFER",
)
add_parser, main = COMMAND.add_parser, COMMAND
