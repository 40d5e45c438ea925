"""llama-perplexity's multiple-choice modes, number for number: ``--hellaswag``, ``--winogrande``,
``--multiple-choice`` (``hellaswag_score``, ``winogrande_score``, ``multiple_choice_score`` in
tools/perplexity/perplexity.cpp).

Each task's endings are tokenized whole (``context + " " + ending``, BOS first where the model adds
one, special-token text not parsed); the tokens all endings share go into the batch once, carrying
the seq ids of every ending, with logits at their last token only; then each ending's own tokens,
one sequence each, with logits where a next token is scored. Tasks are packed into a batch while
their tokens fit ``n_ctx`` and their endings ``n_seq_max`` (at most 32 HellaSwag tasks, 128
Winogrande tasks, 128 sequences of multiple-choice answers, as there); the batch goes to
``llama_decode`` in pieces of ``n_batch`` tokens, the memory cleared before each batch. What is
compared:

- HellaSwag (acc_norm): each ending's mean log-probability over its tokens; the first ending with
  the highest wins. Per task, the running accuracy and its Wilson 95% interval.
- Winogrande: each choice's mean log-probability over the tokens after the choice word (the
  "partial" scoring; over all tokens after the shared part when either sentence has 3 or fewer
  of them; and, as there, the second choice's first row is then the first sentence's last: its
  FIXME); without the last token when more than one remain. Per task, the running accuracy, both
  scores, the choice and the answer; the final score with 100 tasks or more.
- Multiple choice: as HellaSwag, for any number of answers (those labelled 1 are right); the
  final result and the random-chance rate.

Tasks are picked as llama-perplexity picks them: ``std::mt19937(1)`` with libstdc++'s
``uniform_int_distribution`` for HellaSwag (:mod:`._mc_random`), its float scaling for the others.
Log-probabilities are llama-perplexity's float arithmetic where it shows (:mod:`._mc_float`): on
every Winogrande row, and on the HellaSwag and multiple-choice tasks whose best two endings are
within float rounding of each other in the fast C path.

Everything is checked before the first decode: the file's format (the message names the line or
the byte offset), the task count, each task against ``n_ctx`` and ``n_seq_max``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _mc_float as F
from ._mc_data import (
    HellaswagTask,
    MultipleChoiceTask,
    WinograndeTask,
    multiple_choice_count,
    read_hellaswag,
    read_multiple_choice,
    read_winogrande,
    sample_path,
    write_multiple_choice,
)
from ._mc_random import hellaswag_order, pick_without_replacement

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model
    from ..packing import Segment

__all__ = [
    "hellaswag",
    "winogrande",
    "multiple_choice",
    "MultipleChoiceResult",
    "TaskResult",
    "HellaswagTask",
    "WinograndeTask",
    "MultipleChoiceTask",
    "read_hellaswag",
    "read_winogrande",
    "read_multiple_choice",
    "write_multiple_choice",
    "sample_path",
]

_ZA = 1.95996398454  # the z of a 95% interval, as perplexity.cpp writes it


def wilson_interval(n_correct: int, n: int) -> tuple[float, float]:
    """The Wilson score interval (95%) of ``n_correct`` out of ``n``, as ``hellaswag_score``
    computes it (double arithmetic, its order of operations).

    Args:
        n_correct: Right answers.
        n: Tasks.

    Returns:
        ``(low, high)``, as fractions.
    """
    freq = n_correct / n
    z = _ZA * _ZA / float(n)
    cnf = z * math.sqrt(float(n) * (4.0 * freq * (1 - freq) + z)) / (_ZA + _ZA)
    return (freq + z * 0.5 - cnf) / (1.0 + z), (freq + z * 0.5 + cnf) / (1.0 + z)


@dataclass(frozen=True)
class TaskResult:
    """How one task was scored.

    Attributes:
        task: The task's index among the file's tasks (0-based; Winogrande: among the lines read).
        pred: The ending picked (0-based, in every mode: Winogrande's printed line shows
            ``pred + 1``, its choice 1 or 2, as llama-perplexity numbers them).
        gold: The right ending(s) (0-based; Winogrande's line shows the file's answer, ``gold[0] + 1``).
        scores: What was compared, one per ending: its mean log-probability (float32 values in
            llama-perplexity's arithmetic for Winogrande and for near ties; else from double sums).
        correct: Whether ``pred`` is right.
        n_tokens: Tokens the task puts in the batch (the shared part once).
        exact: Whether ``scores`` are in llama-perplexity's float arithmetic.
    """

    task: int
    pred: int
    gold: tuple[int, ...]
    scores: tuple[float, ...]
    correct: bool
    n_tokens: int
    exact: bool


@dataclass
class MultipleChoiceResult:
    """What :func:`hellaswag`, :func:`winogrande` or :func:`multiple_choice` computed.

    Attributes:
        mode: ``"hellaswag"``, ``"winogrande"`` or ``"multiple-choice"``.
        tasks: One record per task, in the order scored.
        n_available: Tasks in the file.
        n_ctx: The context's cells (llama-perplexity's ``n_parallel * -c``).
        n_batch: Tokens per ``llama_decode``.
        n_seq_max: Sequences per batch.
        n_decodes: ``llama_decode`` calls.
        n_tokens: Tokens decoded.
        text: What llama-perplexity prints for it, as printed (see :meth:`report`).
        skipped: Winogrande lines skipped: ``(line, reason)``.
        seconds: Wall time of the tokenization, the decodes and the scoring.
    """

    mode: str
    tasks: list[TaskResult]
    n_available: int
    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_decodes: int = 0
    n_tokens: int = 0
    text: str = ""
    skipped: list[tuple[int, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def n_tasks(self) -> int:
        """Tasks scored."""
        return len(self.tasks)

    @property
    def n_correct(self) -> int:
        """Tasks answered right."""
        return sum(t.correct for t in self.tasks)

    @property
    def accuracy(self) -> float:
        """``n_correct / n_tasks`` (a fraction; llama-perplexity prints it in percent)."""
        return self.n_correct / self.n_tasks if self.tasks else math.nan

    @property
    def interval(self) -> tuple[float, float]:
        """The Wilson score interval (95%) of the accuracy: HellaSwag's last printed interval."""
        return wilson_interval(self.n_correct, self.n_tasks) if self.tasks else (math.nan, math.nan)

    @property
    def stderr(self) -> float:
        """``sqrt(p (1 - p) / (n - 1))``: the ``+/-`` of Winogrande's and the multiple-choice
        mode's final lines (a fraction; nan for one task)."""
        p, n = self.accuracy, self.n_tasks
        return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else math.nan

    @property
    def tasks_per_second(self) -> float:
        """Tasks scored per second of :attr:`seconds`."""
        return self.n_tasks / self.seconds if self.seconds > 0 else math.nan

    def report(self) -> str:
        """llama-perplexity's lines for this run, byte for byte: the header, one line per task, and
        the final figures where it prints them (it writes those two to stderr; here they are in
        place). Without the dots of its progress and without the blank line its ``main`` adds.

        Returns:
            The text.
        """
        return self.text

    def __repr__(self) -> str:
        return (
            f"<MultipleChoiceResult {self.mode}: {self.n_correct}/{self.n_tasks} = {100 * self.accuracy:.2f}%, "
            f"{self.n_decodes} decodes of {self.n_tokens} tokens in {self.seconds:.1f} s>"
        )


# -- preparing the tasks -----------------------------------------------------------------------
@dataclass
class _Prep:
    """A task's token sequences and what its batch layout needs."""

    seqs: list[np.ndarray]
    cp: int  # tokens all endings share
    required: int  # tokens it puts in the batch
    what: str  # how errors name it
    n_base: tuple[int, ...] = ()  # Winogrande: tokens of first + choice

    def rows(self, out_last: bool) -> int:
        return 1 + sum(len(s) - self.cp - (0 if out_last else 1) for s in self.seqs)


def _prep(model: Model, texts: list[str], what: str) -> _Prep:
    from ..packing import common_prefix  # lazy: the task readers here import without the extension

    seqs = [model.tokenize(t.encode("utf-8", "surrogateescape"), True, False) for t in texts]
    cp = common_prefix(*seqs)
    if cp == 0:
        raise ValueError(f"{what}: its endings share no token (llama-perplexity needs a shared first token)")
    for k, s in enumerate(seqs):
        if len(s) == cp:
            raise ValueError(
                f"{what}: ending {k} adds no token to what all endings share ({cp} tokens): there is nothing to score"
            )
    return _Prep(seqs, cp, cp + sum(len(s) - cp for s in seqs), what)


def _check_fits(preps: list[_Prep], n_ctx: int) -> None:
    for p in preps:
        if p.required > n_ctx:
            raise ValueError(
                f"{p.what} needs {p.required} tokens, {p.required - n_ctx} more than n_ctx {n_ctx} "
                "(llama-perplexity: 'does not fit in the context window'; raise -c or --parallel)"
            )


# -- the context, the batches ------------------------------------------------------------------
def _context(
    model_or_ctx: Model | Context, n_ctx: int, n_batch: int, n_parallel: int, ctx_kwargs: dict
) -> tuple[Model, Context, bool]:
    from ..packing import model_and_context

    model, ctx = model_and_context(model_or_ctx)
    if ctx is not None:
        if ctx_kwargs:
            raise ValueError("context keywords are for a Model; this Context has its own")
        if ctx.n_seq_max > 1 and not ctx.params.kv_unified:
            raise ValueError(
                "this Context has n_seq_max > 1 without kv_unified: the endings' shared tokens carry several seq ids, "
                "which llama.cpp decodes only in a unified KV cache (llama-perplexity sets kv_unified for these modes)"
            )
        return model, ctx, False
    if n_ctx <= 0 or n_batch <= 0 or n_parallel <= 0:
        raise ValueError(f"n_ctx ({n_ctx}), n_batch ({n_batch}) and n_parallel ({n_parallel}) must be positive")
    n_seq = max(4, int(n_parallel))  # as llama-perplexity's main() for these modes
    kw: dict[str, Any] = {
        "n_ctx": n_seq * n_ctx,
        "n_batch": min(n_batch, n_seq * n_ctx),
        "n_seq_max": n_seq,
        "kv_unified": True,
    }
    kw.update(ctx_kwargs)
    return model, model.context(**kw), True


def _release(ctx: Context, own: bool) -> None:
    """A mode's end, done or not: packing.release (the context made here closed, a caller's cleared)."""
    from ..packing import release

    release(ctx, own)


def _groups(preps: list[_Prep], n_ctx: int, max_seq: int, per_task: int | None) -> list[tuple[int, int]]:
    """The tasks of each batch, ``[i0, i1)``, as the scorers' packing loops choose them: while the
    next task's tokens fit ``n_ctx`` and its sequences ``max_seq`` (``per_task`` seq ids per task
    for HellaSwag and Winogrande, the answers' count for the multiple-choice mode)."""
    out = []
    i0, n = 0, len(preps)
    while i0 < n:
        n_cur = s0 = 0
        i1 = i0
        while n_cur + preps[i1].required <= n_ctx:
            k = per_task if per_task is not None else len(preps[i1].seqs)
            if s0 + k > max_seq:
                if s0 == 0:
                    raise ValueError(
                        f"{preps[i1].what} has {k} endings, more than the {max_seq} sequences a batch may hold "
                        f"(llama-perplexity: 'requires a higher -np|--parallel value (at least {k})')"
                    )
                break
            s0 += k
            n_cur += preps[i1].required
            i1 += 1
            if i1 == n:
                break
        if i1 == i0:  # _check_fits refused it already; kept for a Context smaller than the check saw
            raise ValueError(f"{preps[i0].what} does not fit in the context window (requires {preps[i0].required})")
        out.append((i0, i1))
        i0 = i1
    return out


def _segments(preps: list[_Prep], i0: int, i1: int, out_last: bool) -> list[Segment]:
    """The batch of tasks ``[i0, i1)`` in llama-perplexity's order, each segment tagged with its
    task: the endings' shared tokens once, in every ending's sequence, a row at their last; then
    each ending's own tokens, rows where a next token is scored."""
    from ..packing import Segment

    segs = []
    s0 = 0
    for i, p in enumerate(preps[i0:i1], i0):
        k = len(p.seqs)
        segs.append(Segment(p.seqs[0][: p.cp], tuple(range(s0, s0 + k)), 0, "last", tag=i))
        for s, seq in enumerate(p.seqs):
            rest = seq[p.cp :]
            if out_last:
                segs.append(Segment(rest, s0 + s, p.cp, "all", tag=i))
            else:
                m = np.ones(rest.size, bool)
                m[-1] = False  # its last token predicts nothing
                segs.append(Segment(rest, s0 + s, p.cp, m, tag=i))
        s0 += k
    return segs


def _decode_groups(ctx, model, preps, groups, out_last: bool, finish, stats) -> None:
    """Decode each group in work orders of ``n_batch`` tokens (:func:`pyllamacpp.packing.decode`)
    and call ``finish(i, rows)`` for each task once its last row is out, with its output rows (a
    view valid until the next decode, or a copy for a task that straddles two orders)."""
    from ..batch import Batch
    from ..packing import decode

    n_batch = ctx.n_batch
    width = max(len(p.seqs) for p in preps)
    batch = Batch(n_batch, width, model=model)
    try:
        for i0, i1 in groups:
            ctx.memory.clear()
            left = {i: preps[i].rows(out_last) for i in range(i0, i1)}  # rows still to come, per task
            pending: dict[int, list[np.ndarray]] = {}
            for order in decode(ctx, _segments(preps, i0, i1, out_last), batch=batch, n_batch=n_batch):
                stats[0] += 1
                stats[1] += len(order)
                if order.n_outputs == 0:
                    continue
                logits = ctx.logits_all()
                pieces = order.pieces
                k, n = 0, len(pieces)
                while k < n:  # a task's pieces are consecutive, and so are their rows
                    i, r0 = pieces[k].tag, pieces[k].rows.start
                    while k + 1 < n and pieces[k + 1].tag == i:
                        k += 1
                    r1 = pieces[k].rows.stop
                    k += 1
                    if r1 == r0:
                        continue
                    here = logits[r0:r1]
                    left[i] -= r1 - r0
                    if left[i] == 0:  # the task's last row is here
                        rows = np.concatenate([*pending.pop(i), here]) if i in pending else here
                        finish(i, rows)
                        del rows
                    else:
                        pending.setdefault(i, []).append(here.copy())
                    del here
                del logits
    finally:
        batch.close()


# -- scoring -----------------------------------------------------------------------------------
def _hs_targets(p: _Prep) -> tuple[np.ndarray, list[slice]]:
    """For rows 1..: the token each predicts; per ending, its rows among them."""
    tg, segs, r = [], [], 0
    for s in p.seqs:
        t = s[p.cp + 1 :]
        tg.append(t)
        segs.append(slice(r, r + t.size))
        r += t.size
    return (np.concatenate(tg) if tg else np.zeros(0, np.int32)), segs


def _mean_scores(
    p: _Prep, rows: np.ndarray, n_threads: int, margin: float, in_float: bool
) -> tuple[tuple[float, ...], int, bool]:
    """HellaSwag's and the multiple-choice mode's scores of one task: ``(scores, pred, exact)``."""
    from ..scoring import log_softmax

    tg, segs = _hs_targets(p)
    firsts = np.array([s[p.cp] for s in p.seqs], np.int32)
    lse = log_softmax(rows, n_threads=n_threads).lse
    first = rows[0, firsts].astype(np.float64) - lse[0]
    lp = rows[np.arange(1, rows.shape[0]), tg].astype(np.float64) - lse[1:]
    fast = np.array([(first[s] + lp[seg].sum()) / (1 + seg.stop - seg.start) for s, seg in enumerate(segs)])
    top = np.sort(fast)[::-1]
    if np.all(np.isfinite(fast)) and (top.size < 2 or top[0] - top[1] > margin):
        return tuple(float(v) for v in fast), int(np.argmax(fast)), False
    # llama-perplexity's own arithmetic: float log-probabilities, HellaSwag sums them in double,
    # the multiple-choice mode in float; the first ending with the highest mean wins
    f_first = F.first_logprobs(rows[0], firsts)
    f_lp = F.eval_rows(rows[1:], tg)
    scores: list[Any] = []
    for s, seg in enumerate(segs):
        count = 1 + seg.stop - seg.start
        if in_float:
            v = np.float32(f_first[s])
            for x in f_lp[seg]:
                v = np.float32(v + x)
            scores.append(np.float32(v / np.float32(count)))
        else:
            d = float(f_first[s])
            for x in f_lp[seg]:
                d += float(x)
            scores.append(d / count)
    best = 0
    for s in range(1, len(scores)):
        if scores[s] > scores[best]:
            best = s
    return tuple(float(v) for v in scores), best, True


def _winogrande_pairs(p: _Prep) -> list[tuple[list[int], list[int]]]:
    """``winogrande_score``'s eval pairs of one task, per choice: (rows, tokens), its index
    arithmetic as written there (the second choice's rows start after all of the first's)."""
    len0, len1 = len(p.seqs[0]), len(p.seqs[1])
    cp = p.cp
    skip_choice = len0 - cp > 3 and len1 - cp > 3
    out = []
    li0 = 0
    for s, (n_seq, base) in enumerate(((len0, p.n_base[0]), (len1, p.n_base[1]))):
        n_base = base if skip_choice else cp
        last = 1 if n_seq - n_base > 1 else 0
        li = (n_base - cp) if s == 0 else (len0 - cp + n_base - cp)
        if li < 0 or n_base > n_seq:
            raise ValueError(
                f"{p.what}: choice {s + 1}'s first part tokenizes to {base} tokens, against {cp} shared and {n_seq} "
                "in its sentence: llama-perplexity would index outside its logits"
            )
        rows, toks = [], []
        for j in range(n_base - 1, n_seq - 1 - last):
            rows.append(li0 + li)
            toks.append(int(p.seqs[s][j + 1]))
            li += 1
        out.append((rows, toks))
    return out


def _winogrande_scores(p: _Prep, rows: np.ndarray) -> tuple[tuple[float, float], int]:
    pairs = _winogrande_pairs(p)
    all_rows = [r for rr, _ in pairs for r in rr]
    all_toks = [t for _, tt in pairs for t in tt]
    vals = F.eval_rows(rows[all_rows], np.array(all_toks, np.int32)) if all_rows else np.zeros(0, np.float32)
    scores = []
    k = 0
    for rr, _ in pairs:
        v = np.float32(0.0)
        for x in vals[k : k + len(rr)]:
            v = np.float32(v + x)
        k += len(rr)
        scores.append(np.float32(v / np.float32(len(rr))) if rr else np.float32(F.NEG_NAN))
    return (float(scores[0]), float(scores[1])), (0 if scores[0] > scores[1] else 1)


# -- the three modes ---------------------------------------------------------------------------
def _n_tasks(n_tasks: int | None, what: str) -> int | None:
    if n_tasks is None:
        return None
    n = int(n_tasks)
    if n <= 0:
        raise ValueError(f"{what} must be at least 1, not {n_tasks} (None: all tasks)")
    return n


def _finish_run(result: MultipleChoiceResult, stats: list[int], t0: float) -> MultipleChoiceResult:
    result.n_decodes, result.n_tokens = stats
    result.seconds = time.perf_counter() - t0
    return result


def hellaswag(
    model_or_ctx: Model | Context,
    data: str | bytes | os.PathLike | None = None,
    n_tasks: int | None = 400,
    *,
    n_ctx: int = 512,
    n_batch: int = 2048,
    n_parallel: int = 1,
    on_text: Callable[[str], None] | None = None,
    **ctx_kwargs: Any,
) -> MultipleChoiceResult:
    """HellaSwag's acc_norm as ``llama-perplexity --hellaswag -f FILE --hellaswag-tasks N`` computes it.

    ``n_tasks`` tasks (``--hellaswag-tasks``, 400 there too) are picked at random without repeats
    (``std::mt19937(1)``, libstdc++'s ``uniform_int_distribution``), even when all are asked for:
    the order is llama-perplexity's. Each ending is scored by its tokens' mean log-probability
    given the context and the ending's tokens before them.

    Args:
        model_or_ctx: A :class:`Model` (a context is made as llama-perplexity makes it:
            ``n_seq_max = max(4, n_parallel)``, ``n_ctx = n_seq_max * n_ctx``, ``kv_unified``) or a
            :class:`Context` (its ``n_ctx``, ``n_batch`` and ``n_seq_max`` are used; it needs 4
            sequences and ``kv_unified``; its memory is cleared before each batch and when the
            run ends or is stopped, and it is left open).
        data: The HellaSwag file (a path), or its content (bytes, or a str with newlines); None:
            the 40 tasks shipped (:func:`sample_path`). One trailing newline is dropped, as ``-f``.
        n_tasks: Tasks to score (None: all of the file's, in llama-perplexity's random order).
        n_ctx: ``-c``: tokens per sequence (a Model only).
        n_batch: ``-b``: tokens per ``llama_decode`` (a Model only).
        n_parallel: ``-np``: sequences, at least 4 (a Model only); 32 HellaSwag tasks per batch at most.
        on_text: Called with each piece of the report as it is made (the header, each task's line).
        **ctx_kwargs: :class:`ContextParams` fields for the context made (``n_ubatch``,
            ``flash_attn``, ``type_k``, ``n_threads``...).

    Returns:
        A :class:`MultipleChoiceResult`; ``report()`` is llama-perplexity's text.

    Raises:
        ValueError: A file in the wrong format (the line named), ``n_tasks`` below 1, a task longer
            than the context (by how much), a Context with fewer than 4 sequences or not
            ``kv_unified``, context keywords with a Context.
        OSError: The file cannot be read.
        DecodeError: A decode failed.
    """
    t0 = time.perf_counter()
    tasks = read_hellaswag(sample_path("hellaswag") if data is None else data)
    n = _n_tasks(n_tasks, "n_tasks")
    order = hellaswag_order(len(tasks), len(tasks) if n is None else n)
    model, ctx, own = _context(model_or_ctx, n_ctx, n_batch, n_parallel, ctx_kwargs)
    try:
        max_seq = min(4 * 32, ctx.n_seq_max)
        if max_seq < 4:
            raise ValueError(f"HellaSwag needs 4 sequences per task; this Context has n_seq_max {ctx.n_seq_max}")
        preps = []
        for i in order:
            t = tasks[i]
            preps.append(_prep(model, [t.context + " " + e for e in t.endings], f"HellaSwag task {i} (line {t.line})"))
        _check_fits(preps, ctx.n_ctx)
        groups = _groups(preps, ctx.n_ctx, max_seq, 4)
        result = MultipleChoiceResult("hellaswag", [], len(tasks), ctx.n_ctx, ctx.n_batch, ctx.n_seq_max)
        n_threads = ctx.params.n_threads_batch or 1
        margin = F.tie_margin(model.n_vocab)
        say = _Transcript(on_text)

        n_correct = 0

        def finish(i: int, rows: np.ndarray) -> None:
            nonlocal n_correct
            p, t = preps[i], tasks[order[i]]
            scores, pred, exact = _mean_scores(p, rows, n_threads, margin, in_float=False)
            r = TaskResult(order[i], pred, (t.gold,), scores, pred == t.gold, p.required, exact)
            result.tasks.append(r)
            n_correct += r.correct
            a, b = wilson_interval(n_correct, i + 1)
            say(f"{i + 1}\t{n_correct / (i + 1) * 100.0:3.8f}%\t[{a * 100.0:3.4f}%, {b * 100.0:3.4f}%]\n")

        say("\ntask\tacc_norm\t95% confidence interval\n")
        stats = [0, 0]
        _decode_groups(ctx, model, preps, groups, False, _in_order(finish), stats)
        say("\n")
        result.text = say.text
        return _finish_run(result, stats, t0)
    finally:
        _release(ctx, own)


class _Transcript:
    """The lines a run prints, kept in order and handed to ``on_text`` as they come."""

    def __init__(self, on_text: Callable[[str], None] | None) -> None:
        self.pieces: list[str] = []
        self.on_text = on_text

    def __call__(self, text: str) -> None:
        self.pieces.append(text)
        if self.on_text is not None:
            self.on_text(text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _in_order(fn: Callable[[int, np.ndarray], None]) -> Callable[[int, np.ndarray], None]:
    """``fn`` for tasks in index order: the decode hands tasks over in batch order already (a
    task's last row comes after the previous task's), which this checks."""
    state = {"next": 0}

    def call(i: int, rows: np.ndarray) -> None:
        assert i == state["next"], (i, state["next"])
        state["next"] += 1
        fn(i, rows)

    return call


def winogrande(
    model_or_ctx: Model | Context,
    data: str | bytes | os.PathLike | None = None,
    n_tasks: int | None = None,
    *,
    strict: bool = False,
    n_ctx: int = 512,
    n_batch: int = 2048,
    n_parallel: int = 1,
    on_text: Callable[[str], None] | None = None,
    **ctx_kwargs: Any,
) -> MultipleChoiceResult:
    """The Winogrande score as ``llama-perplexity --winogrande -f FILE --winogrande-tasks N`` computes it.

    Both sentences (``first + choice + second``) are scored by the mean log-probability of the
    tokens after the choice word, without the last token when more than one remain; when either
    has 3 or fewer tokens after the shared part, of all tokens after it (where llama-perplexity's
    index arithmetic gives the second sentence the first's last row, as its FIXME says: kept, to
    give its numbers). The higher wins, choice 2 on a tie. With ``n_tasks`` under the file's
    count, tasks are picked at random without repeats (``std::mt19937(1)``, float scaling), else
    all are scored in file order. The final score is printed for 100 tasks or more, as there.

    Args:
        model_or_ctx: A :class:`Model` or a :class:`Context` (as in :func:`hellaswag`; 2
            sequences per task, at most 128 tasks per batch).
        data: The CSV file (a path) or its content; None: the 40 tasks shipped.
        n_tasks: Tasks to score (None: all; ``--winogrande-tasks 0`` there).
        strict: Raise at a malformed line instead of skipping it (llama-perplexity skips it with an
            error message: the lines skipped are in ``result.skipped``).
        n_ctx: ``-c`` (a Model only).
        n_batch: ``-b`` (a Model only).
        n_parallel: ``-np`` (a Model only).
        on_text: Called with each piece of the report as it is made.
        **ctx_kwargs: :class:`ContextParams` fields for the context made.

    Returns:
        A :class:`MultipleChoiceResult`.

    Raises:
        ValueError: No task in the file (the first bad line named), a bad line with ``strict``,
            ``n_tasks`` below 1, a task longer than the context, a Context unfit for it.
        OSError: The file cannot be read.
        DecodeError: A decode failed.
    """
    t0 = time.perf_counter()
    tasks, skipped = read_winogrande(sample_path("winogrande") if data is None else data, strict=strict)
    n = _n_tasks(n_tasks, "n_tasks")
    order = pick_without_replacement(len(tasks), n) if n is not None and n < len(tasks) else list(range(len(tasks)))
    model, ctx, own = _context(model_or_ctx, n_ctx, n_batch, n_parallel, ctx_kwargs)
    try:
        max_seq = min(2 * 128, ctx.n_seq_max)
        if max_seq < 2:
            raise ValueError(f"Winogrande needs 2 sequences per task; this Context has n_seq_max {ctx.n_seq_max}")
        preps = []
        for i in order:
            t = tasks[i]
            what = f"Winogrande task {i} (line {t.line})"
            p = _prep(model, [t.first + t.choices[0] + t.second, t.first + t.choices[1] + t.second], what)
            p.n_base = tuple(len(model.tokenize((t.first + c).encode("utf-8", "surrogateescape"))) for c in t.choices)
            _winogrande_pairs(p)  # refuses what would index outside the logits, before any decode
            preps.append(p)
        _check_fits(preps, ctx.n_ctx)
        groups = _groups(preps, ctx.n_ctx, max_seq, 2)
        result = MultipleChoiceResult("winogrande", [], len(tasks), ctx.n_ctx, ctx.n_batch, ctx.n_seq_max)
        result.skipped = skipped
        say = _Transcript(on_text)

        n_correct = 0

        def finish(i: int, rows: np.ndarray) -> None:
            nonlocal n_correct
            p, t = preps[i], tasks[order[i]]
            scores, pred = _winogrande_scores(p, rows)
            r = TaskResult(order[i], pred, (t.answer - 1,), scores, pred == t.answer - 1, p.required, True)
            result.tasks.append(r)
            n_correct += r.correct
            s1, s2 = (F.c_format(v, "10.6") for v in scores)
            say(f"{i + 1}\t{100.0 * n_correct / (i + 1):.4f}\t{s1}  {s2}  {pred + 1}  {t.answer}\n")

        stats = [0, 0]
        _decode_groups(ctx, model, preps, groups, True, _in_order(finish), stats)
        say("\n")
        n_done = len(result.tasks)
        if n_done >= 100:
            p32 = np.float32(n_correct) / np.float32(n_done)
            sigma = np.float32(100.0 * math.sqrt(float(p32 * (np.float32(1) - p32) / np.float32(n_done - 1))))
            say(f"Final Winogrande score({n_done} tasks): {float(np.float32(100) * p32):.4f} +/- {float(sigma):.4f}\n")
        result.text = say.text
        return _finish_run(result, stats, t0)
    finally:
        _release(ctx, own)


def multiple_choice(
    model_or_ctx: Model | Context,
    data: str | bytes | os.PathLike | None = None,
    n_tasks: int | None = None,
    *,
    n_ctx: int = 512,
    n_batch: int = 2048,
    n_parallel: int = 1,
    on_text: Callable[[str], None] | None = None,
    **ctx_kwargs: Any,
) -> MultipleChoiceResult:
    """The multiple-choice score as ``llama-perplexity --multiple-choice -f FILE
    --multiple-choice-tasks N`` computes it (ARC, MMLU, TruthfulQA... in its binary format).

    Each answer is scored as a HellaSwag ending (``question + " " + answer``, its tokens' mean
    log-probability, summed in float as there); right when the answer picked is labelled 1. With
    ``n_tasks`` under the file's count, tasks are picked at random without repeats
    (``std::mt19937(1)``, float scaling) and read at the offsets the file gives, else all are read
    one after the other and scored in order. The final result and the random-chance rate (one
    right answer out of the answers given) close the report.

    Args:
        model_or_ctx: A :class:`Model` or a :class:`Context` (as in :func:`hellaswag`; one
            sequence per answer, 128 per batch at most: a task with more answers than
            ``n_seq_max`` needs a larger ``n_parallel``).
        data: The binary file (a path) or its bytes (a str with a newline is its content, the bytes
            decoded with ``surrogateescape``); None: the 40 questions shipped. One trailing
            newline byte is dropped, as ``-f``.
        n_tasks: Tasks to score (None: all; ``--multiple-choice-tasks 0`` there).
        n_ctx: ``-c`` (a Model only).
        n_batch: ``-b`` (a Model only).
        n_parallel: ``-np`` (a Model only).
        on_text: Called with each piece of the report as it is made.
        **ctx_kwargs: :class:`ContextParams` fields for the context made.

    Returns:
        A :class:`MultipleChoiceResult`.

    Raises:
        ValueError: A malformed file (what was being read, at which byte, the bytes needed and
            left), an empty question or answer, ``n_tasks`` below 1, a task longer than the context,
            a task with more answers than sequences.
        OSError: The file cannot be read.
        DecodeError: A decode failed.
    """
    t0 = time.perf_counter()
    src = sample_path("multiple-choice") if data is None else data
    if not isinstance(src, bytes) and not (isinstance(src, str) and "\n" in src):
        src = os.fspath(src)
        with open(src, "rb") as f:
            src = f.read()
    n_available = multiple_choice_count(src)
    n = _n_tasks(n_tasks, "n_tasks")
    order = pick_without_replacement(n_available, n) if n is not None and n < n_available else None
    tasks = read_multiple_choice(src, order)
    idx = order if order is not None else list(range(n_available))
    model, ctx, own = _context(model_or_ctx, n_ctx, n_batch, n_parallel, ctx_kwargs)
    try:
        max_seq = min(4 * 32, ctx.n_seq_max)
        preps = []
        for i, t in zip(idx, tasks):
            what = f"multiple-choice task {i} (at byte {t.offset})"
            if not t.question or not t.answers:
                raise ValueError(f"{what}: an empty question and/or no answers (llama-perplexity: 'found bad task')")
            if any(not a for a in t.answers):
                raise ValueError(f"{what}: an empty answer (llama-perplexity: 'found empty answer')")
            if len(t.labels) != len(t.answers):
                raise ValueError(f"{what}: {len(t.answers)} answers but {len(t.labels)} labels")
            preps.append(_prep(model, [t.question + " " + a for a in t.answers], what))
        _check_fits(preps, ctx.n_ctx)
        groups = _groups(preps, ctx.n_ctx, max_seq, None)
        result = MultipleChoiceResult("multiple-choice", [], n_available, ctx.n_ctx, ctx.n_batch, ctx.n_seq_max)
        n_threads = ctx.params.n_threads_batch or 1
        margin = F.tie_margin(model.n_vocab)
        say = _Transcript(on_text)

        n_correct = 0

        def finish(i: int, rows: np.ndarray) -> None:
            nonlocal n_correct
            p, t = preps[i], tasks[i]
            scores, pred, exact = _mean_scores(p, rows, n_threads, margin, in_float=True)
            gold = tuple(k for k, v in enumerate(t.labels) if v == 1)
            r = TaskResult(idx[i], pred, gold, scores, t.labels[pred] == 1, p.required, exact)
            result.tasks.append(r)
            n_correct += r.correct
            say(f"{i + 1}\t{100.0 * n_correct / (i + 1):.8f}\n")

        say("\ntask\tacc_norm\n")
        stats = [0, 0]
        _decode_groups(ctx, model, preps, groups, False, _in_order(finish), stats)
        n_done = len(result.tasks)
        n_answers = sum(len(p.seqs) for p in preps)
        lines = ["\n"]
        for k, (num, den) in enumerate(((n_correct, n_done), (n_done, n_answers))):
            p32 = np.float32(num) / np.float32(den)
            with np.errstate(all="ignore"):
                # one task divides by 0 as there: 0/0 for the final result (x86's -nan), the random
                # chance's p (1 - p) > 0 over 0 is inf
                var = p32 * (np.float32(1) - p32) / np.float32(n_done - 1)
                sigma = np.float32(np.sqrt(var))
            head = "Final result" if k == 0 else "Random chance"
            p100, s100 = float(np.float32(100) * p32), float(np.float32(100) * sigma)
            lines.append(f"{head}: {F.c_format(p100, '.4')} +/- {F.c_format(s100, '.4')}\n")
        for text in lines:
            say(text)
        result.text = say.text
        return _finish_run(result, stats, t0)
    finally:
        _release(ctx, own)
