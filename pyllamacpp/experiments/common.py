"""What the experiment commands share: their flags (llama.cpp's own short names), the model and
context they ask for, the command itself (:class:`Command`: run, print or ``--json``, draw with
``-o``, the exit status), progress, tables and figures."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

from .._cpu import default_n_threads

if TYPE_CHECKING:
    import numpy as np

    from ..model import Model

_T = TypeVar("_T")


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
