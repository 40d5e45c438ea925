"""The parser every ``pyllamacpp`` (sub)command is made with, and ``--version``."""

from __future__ import annotations

import argparse
import re

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
        from .._version import __version__

        try:
            from .._lib import EXTENSION_INFO

            llama = f"llama.cpp {EXTENSION_INFO.get('llama_cpp_commit', 'unknown')}"
            if EXTENSION_INFO.get("llama_cpp_source"):
                llama += f", {EXTENSION_INFO['llama_cpp_source']}"
        except ImportError as e:
            llama = f"llama.cpp unknown: {e}"
        print(f"pyllamacpp {__version__} ({llama})")
        parser.exit()
