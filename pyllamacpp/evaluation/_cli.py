"""``pyllamacpp lm-eval``: registers the pyllamacpp backend and hands the rest to lm-eval's CLI."""

from __future__ import annotations

from typing import Any


def add_parser(sub: Any) -> None:
    """Add the ``lm-eval`` subcommand to ``sub`` (cli.py's subparsers)."""
