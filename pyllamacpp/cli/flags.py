"""The flags the ``pyllamacpp`` commands share, under llama.cpp's own short names (``-m``, ``-c``,
``-b``, ``-ub``, ``-np``, ``-fa``, ``-ngl``, ``-ctk``, ``-ctv``, ``-t``, ``--kv-unified``), and the
:class:`~pyllamacpp.Context` keywords they ask for.

The command line's own vocabulary: the commands here and the experiments
(``pyllamacpp.experiments.common`` re-exports it for them) add their flags with it. It imports
nothing above the library, so every command may use it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._cpu import default_n_threads

__all__ = [
    "THREADS_HELP",
    "MODEL_HELP",
    "add_threads_flag",
    "add_flash_attn_flag",
    "add_gpu_layers_flag",
    "add_cache_and_thread_flags",
    "add_context_flags",
    "add_model_path_flag",
    "add_model_flags",
    "add_kv_unified_flags",
    "cache_kwargs",
    "context_kwargs",
]

THREADS_HELP = "n_threads and n_threads_batch (default %(default)s: the physical cores)"


def add_threads_flag(p: argparse.ArgumentParser, *, default: int | None = None, help: str = THREADS_HELP) -> None:
    """Add ``-t/--threads`` to ``p``, as llama.cpp's tools name it.

    Args:
        p: The parser (a subcommand's).
        default: Its default; None: the physical core count (``default_n_threads()``).
        help: Its help text.
    """
    p.add_argument("-t", "--threads", type=int, default=default_n_threads() if default is None else default, help=help)


def add_flash_attn_flag(
    p: argparse.ArgumentParser,
    *,
    choices: Sequence[str] = ("auto", "on", "off"),
    default: str = "auto",
    help: str = "flash_attn_type (default %(default)s)",
) -> None:
    """Add ``-fa/--flash-attn`` (``flash_attn_type``) to ``p``.

    Args:
        p: The parser (a subcommand's).
        choices: The values it takes, in the order ``--help`` lists them.
        default: Its default.
        help: Its help text.
    """
    p.add_argument("-fa", "--flash-attn", choices=list(choices), default=default, help=help)


def add_gpu_layers_flag(p: argparse.ArgumentParser, *, help: str = "n_gpu_layers (default %(default)s)") -> None:
    """Add ``-ngl/--n-gpu-layers`` (default 0) to ``p``; :func:`load_model` reads it.

    Args:
        p: The parser (a subcommand's).
        help: Its help text.
    """
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help=help)


def add_cache_and_thread_flags(p: argparse.ArgumentParser, *, threads: int | None = None) -> None:
    """Add ``-ctk``, ``-ctv`` (KV cache types) and ``-t`` (threads) to ``p``, as llama.cpp names them.

    Args:
        p: The parser (a subcommand's).
        threads: The default of ``-t``; None: the physical core count (``default_n_threads()``).
    """
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="type_k (default %(default)s)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="type_v (default %(default)s)")
    add_threads_flag(p, default=threads)


def add_context_flags(
    p: argparse.ArgumentParser, *, flash_attn: bool = True, gpu_layers: bool = True, threads: int | None = None
) -> None:
    """Add llama.cpp's flags of how a context computes, in llama.cpp's order: ``-fa``
    (:func:`add_flash_attn_flag`), ``-ngl`` (:func:`add_gpu_layers_flag`), ``-ctk``, ``-ctv`` and ``-t``.

    Args:
        p: The parser (a subcommand's).
        flash_attn: Add ``-fa`` (auto, on, off; default auto).
        gpu_layers: Add ``-ngl``.
        threads: The default of ``-t``; None: the physical core count (``default_n_threads()``).
    """
    if flash_attn:
        add_flash_attn_flag(p)
    if gpu_layers:
        add_gpu_layers_flag(p)
    add_cache_and_thread_flags(p, threads=threads)


MODEL_HELP = "GGUF file (default: $PYLLAMACPP_MODEL or the default model)"


def add_model_path_flag(p: argparse.ArgumentParser) -> None:
    """Add ``-m/--model``: a GGUF path; None (not given) loads ``$PYLLAMACPP_MODEL`` or the default model.

    Args:
        p: The parser (a subcommand's).
    """
    p.add_argument("-m", "--model", type=Path, default=None, help=MODEL_HELP)


def add_model_flags(
    p: argparse.ArgumentParser,
    *,
    ctx: int = 4096,
    batch: int = 2048,
    ubatch: int = 512,
    n_parallel: int = 1,
    threads: int | None = None,
) -> None:
    """Add llama.cpp's model and context flags to ``p``, under llama.cpp's own short names.

    The flags: -m -c -b -ub -np -fa -ctk -ctv -ngl -t --kv-unified/--no-kv-unified --json.

    Args:
        p: The parser (a subcommand's).
        ctx: The default of ``-c`` (``n_ctx``).
        batch: The default of ``-b`` (``n_batch``).
        ubatch: The default of ``-ub`` (``n_ubatch``).
        n_parallel: The default of ``-np`` (``n_seq_max``).
        threads: The default of ``-t``; None: the physical core count (``default_n_threads()``, as
            llama.cpp's tools).
    """
    add_model_path_flag(p)
    p.add_argument("-c", "--ctx-size", type=int, default=ctx, help="n_ctx (default %(default)s)")
    p.add_argument("-b", "--batch-size", type=int, default=batch, help="n_batch (default %(default)s)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=ubatch, help="n_ubatch (default %(default)s)")
    p.add_argument("-np", "--parallel", type=int, default=n_parallel, help="n_seq_max (default %(default)s)")
    add_context_flags(p, threads=threads)
    add_kv_unified_flags(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def add_kv_unified_flags(p: argparse.ArgumentParser, *, default: bool | None = None) -> None:
    """Add ``--kv-unified`` / ``--no-kv-unified`` (``kv_unified``) to ``p``.

    Args:
        p: The parser (a subcommand's).
        default: ``kv_unified`` when neither is given; None: the library's (see :func:`context_kwargs`).
    """
    p.add_argument(
        "--kv-unified", dest="kv_unified", action="store_true", default=default, help="one KV stream for all sequences"
    )
    p.add_argument(
        "--no-kv-unified",
        dest="kv_unified",
        action="store_false",
        help="one KV stream per sequence (llama.cpp's default)",
    )


def cache_kwargs(args: argparse.Namespace) -> dict:
    """The :class:`~pyllamacpp.Context` keywords of ``-fa``, ``-ctk``, ``-ctv`` and ``-t``: what every
    context of a command shares, whatever sizes it is made with.

    Args:
        args: The parsed flags (those of :func:`add_flash_attn_flag` and :func:`add_cache_and_thread_flags`).

    Returns:
        ``flash_attn``, ``type_k``, ``type_v``, ``n_threads`` and ``n_threads_batch``.
    """
    return dict(
        flash_attn=args.flash_attn,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        n_threads=args.threads,
        n_threads_batch=args.threads,
    )


def context_kwargs(args: argparse.Namespace, **override: Any) -> dict:
    """The :class:`~pyllamacpp.Context` keywords the flags of :func:`add_model_flags` ask for.

    Args:
        args: The parsed flags.
        **override: Keywords that replace the flags' values.

    Returns:
        Keywords for ``model.context(**kw)``; ``kv_unified`` only when a flag set it.
    """
    kw = dict(
        n_ctx=args.ctx_size,
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        n_seq_max=args.parallel,
        **cache_kwargs(args),
    )
    if args.kv_unified is not None:
        kw["kv_unified"] = args.kv_unified
    kw.update(override)
    return kw
