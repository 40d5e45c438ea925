"""What the experiment commands share: their flags (llama.cpp's own short names; they live in
:mod:`pyllamacpp.cli.flags`, the command line's, and are re-exported here), the model and context
they ask for, the command itself (:class:`Command`: run, print or ``--json``, draw with ``-o``, the
exit status), progress, tables and figures."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from ..cli.flags import (
    MODEL_HELP,
    THREADS_HELP,
    add_cache_and_thread_flags,
    add_context_flags,
    add_flash_attn_flag,
    add_gpu_layers_flag,
    add_kv_unified_flags,
    add_model_flags,
    add_model_path_flag,
    add_threads_flag,
    cache_kwargs,
    context_kwargs,
)

if TYPE_CHECKING:
    import numpy as np

    from ..model import Model

__all__ = [
    # the shared flags, from pyllamacpp.cli.flags
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
    # the commands' model, output and figures
    "subcommand",
    "load_model",
    "run_on_model",
    "PROMPT_TEXT",
    "prompt_tokens",
    "median_time",
    "progress",
    "print_table",
    "emit",
    "Interrupted",
    "report_interrupted",
    "Command",
    "figure",
]

_T = TypeVar("_T")


def subcommand(sub: argparse._SubParsersAction, name: str, help: str, doc: str | None) -> argparse.ArgumentParser:
    """A subcommand's parser: ``help`` in ``pyllamacpp --help``, the module's docstring as it is
    written (line breaks kept) in ``pyllamacpp NAME --help``.

    Args:
        sub: The ``add_subparsers()`` object of the ``pyllamacpp`` parser.
        name: The subcommand.
        help: Its one line.
        doc: Its description (the module's ``__doc__``).

    Returns:
        The parser.
    """
    return sub.add_parser(name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def load_model(args: argparse.Namespace) -> Model:
    """Load ``-m`` (the default model when not given) with ``-ngl`` layers offloaded (none for a
    command without ``-ngl``).

    Args:
        args: The parsed flags of :func:`add_model_path_flag` (and :func:`add_gpu_layers_flag`).

    Returns:
        The :class:`~pyllamacpp.Model` (the caller closes it).

    Raises:
        ModelLoadError: The file is missing or llama.cpp cannot load it.
    """
    from ..model import Model

    return Model(args.model, n_gpu_layers=getattr(args, "n_gpu_layers", 0))


def run_on_model(args: argparse.Namespace, fn: Callable[..., dict], *a: Any, **kw: Any) -> dict:
    """Load ``-m``, call ``fn(model, *a, **kw)``, close the model; the result names the model and ``-t``.

    Args:
        args: The parsed flags (``-m``, ``-ngl``, ``-t``).
        fn: The experiment proper (it takes the model first).
        *a: Its further arguments.
        **kw: Its keywords.

    Returns:
        What ``fn`` returned, plus ``model`` (the file's path) and ``threads``.

    Raises:
        ModelLoadError: The model cannot be loaded.
        Exception: Whatever ``fn`` raised (the model is closed all the same).
    """
    with load_model(args) as model:
        data = fn(model, *a, **kw)
    data["model"] = str(model.path)
    data["threads"] = args.threads
    return data


PROMPT_TEXT = "The cat sat on the mat. The dog lay by the door and watched the rain. "


def prompt_tokens(model: Model, n: int) -> np.ndarray:
    """``n`` token ids of ordinary text for an experiment's batches: :data:`PROMPT_TEXT`'s
    tokens repeated (the same ids for every command that plans a shape).

    Args:
        model: The model whose tokenizer makes them.
        n: How many (at least 1 is returned).

    Returns:
        An int32 array of ``max(n, 1)`` ids.
    """
    import numpy as np

    base = model.tokenize(PROMPT_TEXT)
    return np.resize(base, max(n, 1)).astype(np.int32)


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """The median wall time of ``repeat`` calls of ``fn``, in seconds.

    Args:
        fn: A callable without arguments.
        repeat: How many calls (at least 1).

    Returns:
        The median, in seconds.

    Raises:
        statistics.StatisticsError: ``repeat`` is less than 1.
    """
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def progress(iterable: Iterable[_T], desc: str, total: int | None = None) -> Iterator[_T]:
    """Progress on stderr, so a long command never sits silent.

    A tqdm bar on a terminal, otherwise (piped, logged) one line per step, ``desc: step i/n (t s)``.

    Args:
        iterable: The steps.
        desc: What is running, the start of each line.
        total: How many steps; None: ``len(iterable)`` where it has one.

    Returns:
        An iterator over ``iterable``'s items.
    """
    if sys.stderr is not None and sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, file=sys.stderr, leave=False)
    return _progress_lines(iterable, desc, total)


def _progress_lines(iterable, desc: str, total: int | None):
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    of = f"/{total}" if total is not None else ""
    t0 = time.perf_counter()
    i = 0
    for i, item in enumerate(iterable, 1):
        print(f"{desc}: step {i}{of} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        yield item
    print(f"{desc}: done, {i} steps in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]], file: TextIO | None = None) -> None:
    """Print ``rows`` as a right-aligned text table, a dashed line under the headers.

    Args:
        rows: One dict per row; a missing or None value prints as ``-``.
        columns: ``(key, header, format spec)`` per column.
        file: Where to print; None: ``sys.stdout``.
    """
    file = file or sys.stdout  # looked up now: tests swap sys.stdout
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for j, line in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)), file=file)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=file)


def emit(args: argparse.Namespace, data: Any, printer: Callable[[Any], None]) -> None:
    """Print ``data`` as JSON with ``--json``, else with ``printer``.

    The text report names the model by its file name (``data["model"]`` keeps the path, as the
    JSON does): a report pasted anywhere carries no folder of the machine that made it.

    Args:
        args: The parsed flags (``args.json``).
        data: What the command's ``run`` returned.
        printer: The command's ``print_report``.
    """
    if getattr(args, "json", False):
        print(json.dumps(data, indent=2, default=str))
    else:
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            data = {**data, "model": Path(data["model"]).name}
        printer(data)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped an experiment: what its finished steps measured, to print.

    A ``KeyboardInterrupt``, so a caller that does not know it still stops as on Ctrl-C.

    Args:
        data: What the command's ``run`` returns, made from the steps that finished (None when
            there is nothing to print).
        done: The steps that finished.
        total: The steps planned.
        unit: What a step is, plural ("rows", "modes").
    """

    def __init__(self, data: Any, done: int, total: int, unit: str = "steps") -> None:
        super().__init__(f"interrupted after {done} of {total} {unit}")
        self.data, self.done, self.total, self.unit = data, done, total, unit


def report_interrupted(args: argparse.Namespace, command: str, e: Interrupted, printer: Callable[[Any], None]) -> int:
    """Print what an interrupted run measured (``emit``; with ``--json`` an ``interrupted`` key)
    and say on stderr that it was interrupted.

    Args:
        args: The parsed flags (``args.json``).
        command: The subcommand's name, for the message.
        e: The :class:`Interrupted` the command's ``run`` raised.
        printer: The command's ``print_report``.

    Returns:
        130, the shell's status for a command stopped by SIGINT.
    """
    note = f"interrupted (Ctrl-C) after {e.done} of {e.total} {e.unit}"
    if e.data is not None:
        as_json = getattr(args, "json", False)
        emit(args, {**e.data, "interrupted": note} if as_json else e.data, printer)
        if not as_json:
            print(f"{note}: the {e.unit} above are all that was measured", flush=True)
    print(f"pyllamacpp {command}: {note}" + ("" if e.data is not None else "; nothing to print"), file=sys.stderr)
    return 130


@dataclasses.dataclass(frozen=True)
class Command:
    """One experiment as a ``pyllamacpp`` subcommand: its flags, and what running it does.

    The experiment is its module: ``run(args)`` measures and returns the data, ``print_report(data)``
    prints it as text, ``plot(data, path)`` (where the command has ``-o``) draws it, and the module's
    docstring is the command's ``--help`` description. Calling the command runs it: ``run``, then
    the text report or, with ``--json``, the data as JSON (:func:`emit`), then the figure with
    ``-o``. Ctrl-C prints what the finished steps measured (:func:`report_interrupted`, exit 130).
    The exit status is 1 when the data's ``ok`` is false, else 0.

    Attributes:
        name: The subcommand (``kv-live``).
        help: Its line in ``pyllamacpp --help``.
        module: The experiment's module (its ``__name__``).
        flags: Adds the command's flags to its parser.
        printer: The parsed flags -> the printer to use instead of ``print_report`` (where flags
            shape the text report); None: ``print_report``.
        refused: Exceptions of ``run`` that are bad input: said on stderr as ``pyllamacpp NAME:
            <refused_as><message>``, exit 2.
        refused_as: The words before such a message.
        failure: The data -> what to say on stderr when its ``ok`` is false; None: nothing.
    """

    name: str
    help: str
    module: str
    flags: Callable[[argparse.ArgumentParser], None]
    printer: Callable[[argparse.Namespace], Callable[[Any], None]] | None = None
    refused: tuple[type[Exception], ...] = ()
    refused_as: str = ""
    failure: Callable[[Any], str] | None = None

    def add_parser(self, sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
        """Add the subcommand and its flags to ``sub``; its ``func`` is this command.

        Args:
            sub: The ``add_subparsers()`` object of the ``pyllamacpp`` parser.

        Returns:
            The subcommand's parser.
        """
        p = subcommand(sub, self.name, self.help, sys.modules[self.module].__doc__)
        self.flags(p)
        p.set_defaults(func=self)
        return p

    def __call__(self, args: argparse.Namespace) -> int:
        """Run the command.

        Args:
            args: The parsed flags of :meth:`add_parser`.

        Returns:
            The exit status: 0, 1 when the data's ``ok`` is false, 2 when ``run`` refused the
            input (``refused``), 130 on Ctrl-C.
        """
        mod = sys.modules[self.module]  # looked up now: what the module holds when the command runs
        printer = self.printer(args) if self.printer is not None else mod.print_report
        try:
            data = mod.run(args)
        except Interrupted as e:  # Ctrl-C: print what was measured, then exit 130
            return report_interrupted(args, self.name, e, printer)
        except self.refused as e:
            print(f"pyllamacpp {self.name}: {self.refused_as}{e}", file=sys.stderr)
            return 2
        emit(args, data, printer)
        if getattr(args, "output", None):
            mod.plot(data, args.output)
            print(f"wrote {args.output}", file=sys.stderr)
        sys.stdout.flush()  # the report before any word on stderr
        if isinstance(data, dict) and not data.get("ok", True):
            if self.failure is not None:
                print(f"pyllamacpp {self.name}: {self.failure(data)}", file=sys.stderr)
            return 1
        return 0


@contextlib.contextmanager
def figure(
    path: str | os.PathLike,
    *grid: int,
    dpi: float | None = 100,
    tight: bool = True,
    rect: tuple[float, float, float, float] | None = None,
    bbox_inches: str | None = None,
    **subplots: Any,
) -> Iterator[tuple[Any, Any]]:
    """A matplotlib figure to draw in, written to ``path`` when the block ends.

    ``pyplot.subplots(*grid, **subplots)`` on the Agg backend (files only, no display); when the
    block ends the figure is laid out (``tight_layout``), saved and closed, and closed all the same
    when drawing fails.

    Args:
        path: The file (its suffix picks the format).
        *grid: ``subplots``' rows and columns.
        dpi: Dots per inch; None: matplotlib's default (``savefig.dpi``).
        tight: Lay it out with ``tight_layout`` before saving.
        rect: The part of the figure ``tight_layout`` fills (left, bottom, right, top); None: all.
        bbox_inches: ``savefig``'s (``"tight"``: cropped to what is drawn).
        **subplots: ``subplots``' keywords (``figsize``, ``squeeze``, ``gridspec_kw``...).

    Returns:
        A context manager; ``with`` gives ``(fig, axes)``, as ``subplots`` returns them.

    Raises:
        ImportError: matplotlib is not installed.
        OSError: The file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **subplots)
    try:
        yield fig, axes
        if tight:
            fig.tight_layout(rect=rect)
        fig.savefig(path, dpi=dpi, bbox_inches=bbox_inches)
    finally:
        plt.close(fig)
