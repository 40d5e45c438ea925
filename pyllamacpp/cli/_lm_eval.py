"""``pyllamacpp lm-eval``: registers the pyllamacpp backend and hands the rest to lm-eval's CLI.

    pyllamacpp lm-eval --model_args model=PATH,n_ctx=2048 --tasks TASK[,TASK...] [lm-eval's options]

Every argument after ``lm-eval`` is lm-eval's (``lm-eval run --help`` lists them;
``pyllamacpp lm-eval --help`` prints that help). ``--model pyllamacpp`` is added when no
``--model`` is given, and ``run`` when no lm-eval subcommand (``run``, ``ls``, ``validate``) is.
The backend's model_args: ``model`` (a GGUF; default: the default model), ``n_ctx`` (2048),
``n_batch`` (63), ``n_seq_max`` (16), ``n_threads``, ``max_gen_toks`` (256), ``n_gpu_layers``,
and any context parameter (``flash_attn``, ``type_k``...). It needs lm-eval:
``pip install "pyllamacpp-cffi[eval]"``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# the extra's name once the package is on the index; until then, from a clone or beside a wheel
INSTALL = (
    'pip install "pyllamacpp-cffi[eval]" (from a clone: pip install ".[eval]"; beside a wheel: '
    'pip install "lm-eval>=0.4")'
)
SUBCOMMANDS = ("run", "ls", "list", "validate")


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``lm-eval`` subcommand to ``sub`` (the ``pyllamacpp`` parser's subparsers); lm-eval is not imported.

    Args:
        sub: The ``add_subparsers()`` object of the ``pyllamacpp`` parser.

    Returns:
        The subcommand's parser (its ``func`` is :func:`main`).
    """
    # '+' as the only prefix: every argument, --help and lm-eval's options too, is passed on
    p = sub.add_parser(
        "lm-eval",
        help="lm-evaluation-harness with the pyllamacpp backend (shared prefixes decoded once)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        prefix_chars="+",
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    p.set_defaults(func=main)
    return p


def lm_eval_argv(args: list[str]) -> list[str]:
    """lm-eval's ``sys.argv`` for ``pyllamacpp lm-eval ARGS``: ``run`` and ``--model pyllamacpp``
    put in where missing.

    Args:
        args: The arguments after ``lm-eval``.

    Returns:
        ``["lm-eval", subcommand, ...]``.
    """
    argv = list(args)
    if not argv or argv[0] not in SUBCOMMANDS:
        argv.insert(0, "run")
    if argv[0] == "run" and not any(a == "--model" or a.startswith("--model=") for a in argv):
        if not any(a in ("-h", "--help") for a in argv):
            argv[1:1] = ["--model", "pyllamacpp"]
    return ["lm-eval", *argv]


def main(args: argparse.Namespace) -> int:
    """Register the backend and run lm-eval's CLI (``lm_eval.__main__.cli_evaluate``).

    Args:
        args: The parsed command line (``args.args``: lm-eval's arguments).

    Returns:
        0, or lm-eval's exit status; 2 without lm-eval installed.
    """
    try:
        import lm_eval.__main__ as lm_main  # type: ignore[import-untyped, import-not-found]
    except ImportError as e:
        print(f"pyllamacpp lm-eval: lm-eval is not installed ({e}): {INSTALL}", file=sys.stderr)
        return 2
    from ..evaluation import lm_eval as _backend  # noqa: F401  (registers "pyllamacpp")

    saved = sys.argv
    sys.argv = lm_eval_argv(args.args)
    try:
        lm_main.cli_evaluate()
    except SystemExit as e:  # lm-eval's argparse and its own exits
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return 0
