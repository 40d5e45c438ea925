"""The ``pyllamacpp`` command."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from pathlib import Path

DESCRIPTION = """\
pyllamacpp: llama.cpp's C API from Python (a compiled cffi binding with a numpy layer), and
commands that show what llama.cpp does with batches, ubatches, the KV cache and state dumps.
Each command has its own --help. Defaults fit this machine: -t is its physical core count."""

_RST = re.compile(r"``([^`]+)``|:[a-z]+:`~?([^`]+)`")


def _plain(text: str) -> str:
    """Help text without reStructuredText markup (docstrings double as help): ``x`` and :func:`x` -> x."""
    return _RST.sub(lambda m: m.group(1) or m.group(2), text)


class _Parser(argparse.ArgumentParser):
    """Every (sub)command's parser: descriptions as written, help text as plain text, and every
    option that takes a value shows its default."""

    def __init__(self, *args, **kwargs):
        kwargs["formatter_class"] = argparse.RawDescriptionHelpFormatter
        super().__init__(*args, **kwargs)

    def _add_action(self, action):
        help_ = action.help or ""
        if (
            action.option_strings
            and action.nargs != 0
            and action.default not in (None, argparse.SUPPRESS)
            and action.default != []
            and help_ is not argparse.SUPPRESS
            and "default" not in help_
        ):
            action.help = f"{help_} (default: %(default)s)" if help_ else "default: %(default)s"
        return super()._add_action(action)

    def format_help(self) -> str:
        return _plain(super().format_help())

    def format_usage(self) -> str:
        return _plain(super().format_usage())


class _Version(argparse.Action):
    """--version: the package and the llama.cpp commit its extension was built from (looked up only
    when asked: it loads the extension)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from ._version import __version__

        try:
            from ._lib import EXTENSION_INFO

            llama = f"llama.cpp {EXTENSION_INFO.get('llama_cpp_commit', 'unknown')}"
            if EXTENSION_INFO.get("llama_cpp_source"):
                llama += f", {EXTENSION_INFO['llama_cpp_source']}"
        except ImportError as e:
            llama = f"llama.cpp unknown: {e}"
        print(f"pyllamacpp {__version__} ({llama})")
        parser.exit()


_ESCAPES = str.maketrans({"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"})


def _cmd_demo(args) -> int:
    """Tokenize, decode, print the top next tokens and the sequence's state size, then generate."""
    import numpy as np

    from . import default_model_path
    from .model import Model

    path = args.model or default_model_path()
    kw = {"n_ctx": args.n_ctx, "n_threads": args.threads, "n_threads_batch": args.threads}  # as -t says
    with Model(path) as model, model.context(**kw) as ctx:
        if args.json:
            return _demo_json(args, path, model, ctx)

        # each line as soon as it is known, flushed: a reader that left (`| head -3`) shows as a
        # failed write here, and the command stops instead of computing what nobody reads
        def say(line: str) -> None:
            print(line, flush=True)

        say(
            f"model   {path.name}: {model.n_params / 1e6:.1f}M params, {model.n_layer} layers, "
            f"n_vocab {model.n_vocab} (llama.cpp's description: {model.description})"
        )
        tokens = model.tokenize(args.prompt)
        say(f"prompt  {args.prompt!r} -> {len(tokens)} tokens {tokens.tolist()}")
        ctx.prefill(tokens)
        logits = ctx.logits()
        top = np.argsort(logits)[::-1][: args.top]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        say("top next tokens:")
        for t in top:
            say(f"  {int(t):6d} {model.token_to_piece(int(t))!r:16} logit {logits[t]:8.3f}  p {probs[t]:.4f}")
        del logits  # a view of the output buffer: the generation below reuses it
        say(f"sequence 0 state: {len(ctx.seq_state(0)):,} bytes (llama_state_seq_get_data_ext, {len(tokens)} cells)")
        # streamed, escaped as repr() would (one line), so each token's piece is written as it comes
        sys.stdout.write("generated: '")
        with model.complete(args.prompt, args.n_predict, ctx=ctx, stream=True) as stream:  # greedy, seq 0 afresh
            for piece in stream:
                sys.stdout.write(piece.translate(_ESCAPES))
                sys.stdout.flush()
        say(f"' ({len(stream.tokens)} tokens, greedy, stopped by {stream.finish_reason})")
    return 0


def _demo_json(args, path: Path, model, ctx) -> int:
    """``demo --json``: the same facts as one JSON object, printed when all are known."""
    import numpy as np

    tokens = model.tokenize(args.prompt)
    ctx.prefill(tokens)
    logits = ctx.logits().copy()  # a view would show the generation's last logits below
    top = np.argsort(logits)[::-1][: args.top]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    state_bytes = len(ctx.seq_state(0))
    text = model.complete(args.prompt, args.n_predict, ctx=ctx)  # greedy, sequence 0 afresh
    print(
        json.dumps(
            {
                "model": str(path),
                "description": model.description,
                "n_params": model.n_params,
                "tokens": tokens.tolist(),
                "top": [
                    {
                        "token": int(t),
                        "piece": model.token_to_piece(int(t)),
                        "logit": float(logits[t]),
                        "p": float(probs[t]),
                    }
                    for t in top
                ],
                "seq_state_bytes": state_bytes,
                "generated": str(text),
                "generated_tokens": len(text.tokens),
                "finish_reason": text.finish_reason,
            }
        )
    )
    return 0


def _context_kwargs(args) -> dict:
    """The context flags given (-c, -t); the library's defaults for the others."""
    kw = {"n_ctx": args.ctx_size}
    if args.threads is not None:
        kw["n_threads"] = kw["n_threads_batch"] = args.threads
    return kw


def _sampler(model, args):
    """Greedy, or with --temp > 0 llama.cpp's chain: top-k, top-p, min-p, temperature, dist(seed)."""
    from .sampling import Sampler

    if args.temp <= 0:
        return Sampler.greedy()
    s = Sampler(model).top_k(args.top_k).top_p(args.top_p).min_p(args.min_p).temp(args.temp)
    return s.dist(args.seed) if args.seed is not None else s.dist()


def _stream_out(stream) -> None:
    """Write a TextStream's pieces to stdout as they come; the end of generation on stderr."""
    with stream:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stream.finish_reason == "ctx_full":
        print(
            f"[context full after {len(stream.tokens)} tokens: n_ctx={stream.ctx.n_ctx}; give a larger -c]",
            file=sys.stderr,
        )


def _cmd_generate(args) -> int:
    """Generate text after a prompt, streamed to stdout as it comes (greedy unless --temp)."""
    from . import default_model_path
    from .model import Model

    with (
        Model(args.model or default_model_path()) as model,
        model.context(**_context_kwargs(args)) as ctx,
        _sampler(model, args) as sampler,
    ):
        stream = model.complete(
            args.prompt,
            args.n_predict,
            sampler=sampler,
            ctx=ctx,
            stream=True,
            parse_special=args.special,
            stop=args.stop,
        )
        if args.display_prompt:
            sys.stdout.write(args.prompt)
        _stream_out(stream)
    return 0


def _cmd_chat(args) -> int:
    """Chat through the model's chat template: each line of stdin is a user turn, each answer is
    streamed to stdout (the conversation is kept; end with EOF, Ctrl-D)."""
    from . import default_model_path
    from .model import Model

    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with (
        Model(args.model or default_model_path()) as model,
        model.context(**_context_kwargs(args)) as ctx,
        _sampler(model, args) as sampler,
    ):
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                stream = model.chat(messages, args.n_predict, sampler=sampler, ctx=ctx, stream=True, stop=args.stop)
            except ValueError as e:
                if "more than the context holds" not in str(e):
                    raise
                print(f"pyllamacpp chat: the conversation no longer fits: {e}; give a larger -c", file=sys.stderr)
                return 1
            _stream_out(stream)
            messages.append({"role": "assistant", "content": stream.text})


def _cmd_rpc_server(args) -> int:
    import ipaddress

    from .rpc import start_server

    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback:
        if not args.allow_remote:
            print(
                f"pyllamacpp rpc-server: refusing to bind {args.host}: pass --allow-remote "
                "(the RPC protocol has no authentication)",
                file=sys.stderr,
            )
            return 2
        print(
            f"WARNING: serving on {args.host}:{args.port} without authentication: anyone who can reach "
            "it can run computations and read or write its memory buffers",
            file=sys.stderr,
        )
    sys.stdout.flush()
    # ggml's server never returns, and a SIGINT may land on one of its compute threads and leave
    # accept() blocked: serve from a daemon thread, and wait here, where Ctrl-C is seen
    import threading

    failed: list[BaseException] = []

    def serve() -> None:
        try:
            start_server(args.host, args.port, threads=args.threads, cache_dir=args.cache)
        except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
            failed.append(e)

    server = threading.Thread(target=serve, name="rpc-server", daemon=True)
    server.start()
    while server.is_alive():
        server.join(0.25)
    if failed:
        raise failed[0]
    return 0


def _cmd_devices(args) -> int:
    from .rpc import add_servers, devices

    if args.rpc:
        add_servers(args.rpc)
    for d in devices():
        print(
            f"{d['index']}: {d['name']:10} {d['type']:5} {d['backend']:5} {d['description']}  "
            f"{d['memory_free'] / 2**20:,.0f} MiB free of {d['memory_total'] / 2**20:,.0f} MiB"
        )
    return 0


def _cmd_info(args) -> int:
    from . import build_info

    print(json.dumps(build_info(), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``pyllamacpp`` command's parser, every subcommand included (the docs render it).

    Returns:
        The parser ``main()`` parses with.
    """
    from .experiments.common import add_model_path_flag, add_threads_flag

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
    p.set_defaults(func=lambda a: importlib.import_module(".state._cli", __package__).parse_state(a))

    p = sub.add_parser("plot-state", help="a picture of one layer's K and V, and bytes per layer")
    p.add_argument("file")
    p.add_argument("-o", "--output", required=True, help="PNG to write")
    p.add_argument("--layer", type=int, default=0)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model")
    g.add_argument("--heads", type=int)
    p.set_defaults(func=lambda a: importlib.import_module(".state._cli", __package__).plot_state(a))

    from . import _scoring_cli
    from .evaluation import _cli as _evaluation_cli
    from .experiments import (
        graph,
        isolation,
        kvlive,
        kvprobe,
        kvtypes,
        mask,
        placement,
        prefix,
        profile,
        rowaudit,
        speculative,
        splits,
        sweep,
        trace,
    )

    for experiment in (kvprobe, sweep, prefix, isolation, splits, trace, placement, graph):
        experiment.add_parser(sub)
    _scoring_cli.add_parser(sub)
    for experiment in (kvtypes, speculative, mask, rowaudit, kvlive, profile):
        experiment.add_parser(sub)
    _evaluation_cli.add_parser(sub)
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

        from ._log import TRACE

        level = (logging.INFO, logging.DEBUG, TRACE)[min(args.verbose, 3) - 1]
        logging.basicConfig(level=level, format="%(name)s %(levelname)s %(message)s")
    import warnings

    from .errors import LlamaError

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


if __name__ == "__main__":
    sys.exit(main())
