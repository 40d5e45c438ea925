"""``pyllamacpp perplexity``: :func:`pyllamacpp.scoring.perplexity` and
:func:`~pyllamacpp.scoring.kl_divergence`, and llama-perplexity's multiple-choice modes
(:mod:`pyllamacpp.evaluation.llama_perplexity`), from the command line, printed as llama-perplexity
prints them. Kept apart from :mod:`pyllamacpp.scoring` so that building the CLI's parser loads no
compiled extension."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .flags import add_cache_and_thread_flags, add_model_path_flag

_MODES = ("hellaswag", "winogrande", "multiple_choice")


def add_parser(sub: Any) -> None:
    """Add the ``perplexity`` subcommand to ``sub`` (the ``pyllamacpp`` parser's subparsers)."""
    import argparse

    p = sub.add_parser(
        "perplexity",
        help="perplexity, KL divergence and HellaSwag-style scores as llama-perplexity computes them",
        description=(
            "Perplexity of a text as llama-perplexity computes it (tools/perplexity): chunks of -c tokens, "
            "-b // -c chunks per batch, BOS first in each chunk when the model adds one, the second half of "
            "each chunk scored; prints [i]running estimate per chunk and 'Final estimate: PPL = x +/- y'. "
            "With --kl-divergence-base FILE it also writes the base logits; with --kl-divergence it reads "
            "them and prints llama-perplexity's KL divergence statistics instead. As there, -f drops one "
            "trailing newline of the file.\n\n"
            "With --hellaswag, --winogrande or --multiple-choice, -f is a task file in llama-perplexity's "
            "format for that mode (default: the 40 tasks shipped for it) and the lines printed are "
            "llama-perplexity's: each task's running accuracy (HellaSwag: with its 95% interval), then the "
            "final figures where it prints them. The context is made as there: n_seq_max = max(4, -np), "
            "n_ctx = n_seq_max * -c, a unified KV cache."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_path_flag(p)
    p.add_argument(
        "-f", "--file", type=Path, help="the text, or the task file (default: the shipped Shakespeare excerpt / tasks)"
    )
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk, or per sequence (n_ctx)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="n_batch")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="n_ubatch")
    p.add_argument("-fa", "--flash-attn", choices=["auto", "on", "off"], default="auto", help="flash_attn_type")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="n_gpu_layers")
    add_cache_and_thread_flags(p)
    p.add_argument("--chunks", type=int, default=-1, help="most chunks (-1: all)")
    p.add_argument("--kl-divergence-base", type=Path, default=None, help="the base-logits file to write (or read)")
    p.add_argument("--kl-divergence", action="store_true", help="KL divergence against --kl-divergence-base")
    mc = p.add_argument_group("multiple-choice modes (llama-perplexity's --hellaswag, --winogrande, --multiple-choice)")
    mc.add_argument("--hellaswag", action="store_true", help="HellaSwag score (acc_norm) of the tasks in -f")
    mc.add_argument("--hellaswag-tasks", type=int, default=400, metavar="N", help="tasks to score (default: 400)")
    mc.add_argument("--winogrande", action="store_true", help="Winogrande score of the tasks in -f (CSV)")
    mc.add_argument("--winogrande-tasks", type=int, default=None, metavar="N", help="tasks to score (default: all)")
    mc.add_argument(
        "--multiple-choice", action="store_true", help="multiple-choice score of the tasks in -f (binary format)"
    )
    mc.add_argument(
        "--multiple-choice-tasks", type=int, default=None, metavar="N", help="tasks to score (default: all)"
    )
    mc.add_argument(
        "-np", "--parallel", type=int, default=1, help="sequences per batch: n_seq_max = max(4, N) (default: 1)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_perplexity)


class Progress:
    """Progress lines on stderr that never interleave with the results on stdout.

    - stderr not a terminal (a log, a pipe): one line per step, as llama-perplexity writes them;
    - stderr a terminal and stdout elsewhere: one line, rewritten in place (``\\r``), ended by
      :meth:`done` with a newline;
    - both on a terminal: nothing; the results printed as they come are the progress (the running
      estimate per chunk), and a progress line between them would break their line.

    Args:
        enabled: False prints nothing at all.
    """

    def __init__(self, enabled: bool = True) -> None:
        err_tty = _isatty(sys.stderr)
        self.mode = "off" if not enabled or (err_tty and _isatty(sys.stdout)) else ("tty" if err_tty else "lines")
        self._open = False

    def __call__(self, text: str) -> None:
        """Show ``text`` as the current step."""
        if self.mode == "lines":
            print(text, file=sys.stderr, flush=True)
        elif self.mode == "tty":
            sys.stderr.write("\r\033[K" + text)
            sys.stderr.flush()
            self._open = True

    def done(self) -> None:
        """End the in-place line (a newline), so what comes next starts on a line of its own."""
        if self._open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._open = False


def _isatty(f: Any) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False


def _cmd_perplexity(args: Any) -> int:
    import json

    from ..model import Model
    from ..scoring import KL_HEADER, BaseLogits, kl_divergence, kl_row, perplexity, sample_text_path

    kw = dict(
        n_ubatch=args.ubatch_size,
        flash_attn=args.flash_attn,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        n_threads=args.threads,
        n_threads_batch=args.threads,
    )
    quiet = args.json
    modes = [m for m in _MODES if getattr(args, m)]
    if len(modes) > 1:
        raise ValueError("--hellaswag, --winogrande and --multiple-choice are one mode each: pick one")
    if modes and (args.kl_divergence or args.kl_divergence_base is not None or args.chunks != -1):
        raise ValueError(f"--{modes[0].replace('_', '-')} takes no --kl-divergence, --kl-divergence-base or --chunks")

    def say(text: str) -> None:
        if not quiet:
            print(text, end="", flush=True)

    progress = Progress(enabled=True)
    if modes:
        return _cmd_multiple_choice(args, modes[0], kw, say)
    with Model(args.model, n_gpu_layers=args.n_gpu_layers) as model:
        if args.kl_divergence:
            if args.kl_divergence_base is None:
                raise ValueError("--kl-divergence needs --kl-divergence-base FILE (the base logits to read)")
            base = BaseLogits(args.kl_divergence_base)
            say(KL_HEADER + "\n")

            def row(i: int, n: int, c: dict[str, float]) -> None:
                progress(f"perplexity: chunk {i + 1}/{n}")
                say(kl_row(i, c) + "\n")

            k = kl_divergence(model, base, args.batch_size, n_chunks=args.chunks, on_chunk=row, **kw)
            progress.done()
            if quiet:
                d = {f: getattr(k, f) for f in k.__dataclass_fields__ if not f.endswith("_values")}
                print(json.dumps(d, indent=2, default=str))
            else:
                print("\n" + k.summary() if k.count >= 100 else "")
            return 0
        path = args.file or sample_text_path()
        data = path.read_bytes()
        if data.endswith(b"\n"):
            data = data[:-1]  # as llama-perplexity's -f

        def chunk(i: int, n: int, v: float) -> None:
            progress(f"perplexity: chunk {i + 1}/{n}")
            say(f"[{i + 1}]{v:.4f},")

        r = perplexity(
            model,
            data,
            args.ctx_size,
            args.batch_size,
            n_chunks=args.chunks,
            save_base=args.kl_divergence_base,
            on_chunk=chunk,
            **kw,
        )
        progress.done()
        if quiet:
            d = {f: getattr(r, f) for f in r.__dataclass_fields__ if f != "nll"}
            print(json.dumps(d, indent=2, default=str))
        else:
            print(f"\nFinal estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}")
    return 0


def _cmd_multiple_choice(args: Any, mode: str, kw: dict, say: Any) -> int:
    """``--hellaswag``, ``--winogrande``, ``--multiple-choice``: llama-perplexity's lines on stdout
    as each task is scored (the final figures, which it writes to stderr, in place), what was read
    on stderr before them, a summary line on stderr after them; Ctrl-C says how many were scored
    (exit 130)."""
    import dataclasses
    import json
    import warnings

    from ..errors import TaskFileWarning
    from ..evaluation import llama_perplexity as mc
    from ..evaluation.llama_perplexity import hellaswag, multiple_choice, winogrande
    from ..model import Model

    flag = mode.replace("_", "-")
    n_tasks = getattr(args, f"{mode}_tasks")
    if n_tasks is not None and n_tasks <= 0:
        hint = "" if mode == "hellaswag" else f" (llama-perplexity reads 0 as all tasks: leave --{flag}-tasks out)"
        raise ValueError(f"--{flag}-tasks must be at least 1, not {n_tasks}{hint}")
    path = args.file or mc.sample_path(flag)
    fn = {"hellaswag": hellaswag, "winogrande": winogrande, "multiple_choice": multiple_choice}[mode]
    common = dict(n_ctx=args.ctx_size, n_batch=args.batch_size, n_parallel=args.parallel, **kw)
    if mode == "winogrande":
        tasks, skipped = mc.read_winogrande(path)  # checked before the model loads; said before the results
        for line, why in skipped:
            print(f"winogrande: line {line} skipped: {why}", file=sys.stderr)
        n_file = len(tasks)
    elif mode == "hellaswag":
        n_file = len(mc.read_hellaswag(path))
    else:
        n_file = mc.multiple_choice_count(path)
    n_used = n_file if n_tasks is None else min(n_tasks, n_file)
    # HellaSwag asks 400 by default: a smaller file is used whole, and that is said
    more = f", {n_file} in the file: all {n_file} used" if n_tasks is not None and n_tasks > n_file else ""
    n_seq = max(4, args.parallel)
    print(
        f"{flag}: {path.name}, {'all' if n_tasks is None else n_tasks} task(s) asked{more}, "
        f"n_ctx {n_seq * args.ctx_size} (n_seq_max {n_seq} x -c {args.ctx_size})",
        file=sys.stderr,
        flush=True,
    )
    n_done = 0

    def task_line(text: str) -> None:
        nonlocal n_done
        n_done += text[:1].isdigit()  # a task's line starts with its number
        say(text)

    try:
        with Model(args.model, n_gpu_layers=args.n_gpu_layers) as model, warnings.catch_warnings():
            warnings.simplefilter("ignore", TaskFileWarning)  # said above, when the file was first read
            r = fn(model, path, n_tasks, on_text=task_line, **common)
    except KeyboardInterrupt:
        print(f"{flag}: interrupted (Ctrl-C) after {n_done} of {n_used} task(s): the lines above are the tasks scored",
              file=sys.stderr)  # fmt: skip
        return 130
    if args.json:
        d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name not in ("tasks", "text")}
        d.update(n_tasks=r.n_tasks, n_correct=r.n_correct, accuracy=r.accuracy, interval=r.interval, stderr=r.stderr)
        d["tasks"] = [dataclasses.asdict(t) for t in r.tasks]
        print(json.dumps(d, indent=2, default=str))
    else:
        print()  # the blank line llama-perplexity's main() prints after every mode
    print(_summary(flag, r), file=sys.stderr)
    return 0


def _summary(flag: str, r: Any) -> str:
    """The run in one line, for stderr after llama-perplexity's lines (which stay its own)."""
    if r.mode == "hellaswag":
        lo, hi = r.interval
        score = f"acc_norm {100 * r.accuracy:.2f}% (95% interval [{100 * lo:.2f}%, {100 * hi:.2f}%])"
    else:
        score = f"accuracy {100 * r.accuracy:.2f}% +/- {100 * r.stderr:.2f}"
    return (
        f"{flag}: {r.n_tasks} task(s) scored, {score}; {r.n_tokens:,} tokens in {r.n_decodes:,} decodes, "
        f"{r.seconds:.1f} s ({r.tasks_per_second:.2f} tasks/s)"
    )
