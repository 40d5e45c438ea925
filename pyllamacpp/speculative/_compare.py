"""Plain ``generate`` against :func:`generate_speculative`, timed in turn: :func:`compare_speculative`."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..sampling import Sampler
from ._drafts import Draft, NgramDraft
from ._generate import generate_speculative
from ._passes import PassCounter
from ._stats import SpeculativeStats

if TYPE_CHECKING:
    from ..context import Context


class SpeculativeComparison(dict):
    """What :func:`compare_speculative` measured: a JSON-ready dict (its keys are described
    there) that prints as a short report.

    ``print(c)`` (or ``c.report()``) gives both sides' speeds, the speed-up, whether the tokens
    are the same, and the draft's figures; ``c["speedup"]``, ``c["speculative"]["stats"]`` and
    the other keys read the numbers; ``json.dumps(c)`` writes them all.
    """

    def report(self) -> str:
        """The comparison in a few lines of text.

        Returns:
            The report, without a trailing newline.
        """
        pl, sp, st = self["plain"], self["speculative"], self["speculative"]["stats"]

        def runs(side: dict) -> str:
            return " ".join(f"{t:.3f}" for t in side["runs_s"])

        n = self["n_tokens"]
        same = (
            "the same tokens on both sides"
            if self["same_tokens"]
            else f"the sides differ from token {self['first_difference']} on"
        )
        lines = [
            f"plain generate:       {pl['tokens_per_s']:8.1f} tokens/s  (runs: {runs(pl)} s)",
            f"generate_speculative: {sp['tokens_per_s']:8.1f} tokens/s  (runs: {runs(sp)} s)",
            f"speed-up: {self['speedup']:.2f}x wall time (pairs {' '.join(f'{x:.2f}' for x in self['speedups'])}), "
            f"{self['speedup_cpu']:.2f}x this thread's CPU time",
            f"{n} tokens per run, {self['repeat']} run(s) per side, n_draft {self['n_draft']}: {same}",
        ]
        acc = st["acceptance_rate"]
        draft = (
            f"draft (last run): {st['n_rounds']} verifies, {st['n_drafted']} tokens drafted, {st['n_accepted']} "
            f"accepted ({'-' if acc is None else f'{acc:.0%}'}), "
            f"{st['tokens_per_round'] or 0:.2f} tokens per verify"
        )
        if st["passes_per_verify"] is not None:
            draft += f", {st['passes_per_verify']:.2f} forward passes per verify"
        return "\n".join([*lines, draft])

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        return (
            f"<SpeculativeComparison {self['speedup']:.2f}x, {self['n_tokens']} tokens, "
            f"same_tokens={self['same_tokens']}>"
        )


def compare_speculative(
    ctx: Context,
    tokens: npt.ArrayLike,
    n_predict: int,
    draft: Draft | None = None,
    *,
    sampler: Callable[[], Sampler] | None = None,
    n_draft: int = 8,
    repeat: int = 3,
    seq_id: int = 0,
    passes: PassCounter | None = None,
) -> SpeculativeComparison:
    """Plain :func:`pyllamacpp.generate` against :func:`generate_speculative`, in one context, alternating.

    Each run clears ``seq_id`` first and the draft too (:meth:`Draft.reset`: a draft model
    decodes the prompt again), so every run starts cold; the sides alternate (plain, speculative,
    speculative, plain, ...) so that a machine getting slower or faster weighs on both. The
    prompt but its last token is prefilled first, untimed, the same for both; a run is timed from
    there to its last token: the prompt's last token is the first decode of both sides (``generate``
    of it; the first verify of the other, the prompt passed as ``history``), and a draft model's
    decode of the prompt is in the speculative side's time.

    Args:
        ctx: The target context.
        tokens: The prompt's token ids.
        n_predict: Tokens to sample per run.
        draft: The draft (None: a new :class:`NgramDraft`).
        sampler: Makes a fresh sampler per run (e.g. ``lambda: Sampler.common(seed=1)``, so both
            sides draw the same numbers); None: greedy.
        n_draft: Most tokens drafted per round.
        repeat: Runs per side.
        seq_id: The sequence to use.
        passes: A :class:`PassCounter` installed in ``ctx``.

    Returns:
        A ``SpeculativeComparison``: a dict that prints as a report (``print(c)``), of
        ``plain`` and ``speculative`` (``tokens_per_s``: the median over runs, ``runs_s`` and
        ``runs_cpu_s`` per run, and for the speculative side ``stats``, the last run's
        :meth:`SpeculativeStats.report`), ``speedup`` (the median over pairs of the speculative
        side's tokens/s over the plain side's; ``speedups`` per pair), ``speedup_cpu`` (the same
        in this thread's CPU time, ``time.thread_time``: with ``n_threads=1`` the decodes run in
        this thread, and time given to other processes does not count), ``same_tokens``,
        ``first_difference`` (the index of the first token where the sides differ, None when they
        agree), ``n_tokens`` and the ``tokens`` of each side.

    Raises:
        ValueError: As :func:`generate_speculative`, or ``repeat < 1``.
    """
    from ..generation import generate

    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    if draft is None:
        draft = NgramDraft()
    toks = np.asarray(tokens, dtype=np.int32)
    make = sampler or Sampler.greedy
    wall: dict[str, list[float]] = {"plain": [], "speculative": []}
    cpu: dict[str, list[float]] = {"plain": [], "speculative": []}
    out: dict[str, list[int]] = {}
    stats: SpeculativeStats | None = None
    order = ["plain", "speculative"]
    clock, cpu_clock = time.perf_counter, time.thread_time
    for r in range(repeat):
        for side in order if r % 2 == 0 else order[::-1]:
            ctx.memory.seq_rm(seq_id)
            if toks.size > 1:
                ctx.prefill(toks[:-1], seq_id, 0)  # untimed, the same for both sides
            with make() as smpl:
                if side == "speculative":
                    draft.reset()
                t, c = clock(), cpu_clock()
                if side == "plain":
                    got = list(generate(ctx, toks[-1:], n_predict, smpl, seq_id))
                else:
                    s = generate_speculative(
                        ctx,
                        toks[-1:],
                        n_predict,
                        draft,
                        smpl,
                        seq_id=seq_id,
                        n_draft=n_draft,
                        passes=passes,
                        history=toks[:-1],
                    )
                    got = list(s)
                    stats = s.stats
                wall[side].append(clock() - t)
                cpu[side].append(cpu_clock() - c)
            out.setdefault(side, got)
    ctx.memory.seq_rm(seq_id)
    a, b = out["plain"], out["speculative"]
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if diff is None and len(a) != len(b):
        diff = min(len(a), len(b))
    assert stats is not None

    def ratios(d: dict[str, list[float]]) -> list[float]:
        return [(len(b) / s) / (len(a) / p) for p, s in zip(d["plain"], d["speculative"])]

    return SpeculativeComparison(
        {
            "plain": {
                "tokens_per_s": len(a) / statistics.median(wall["plain"]),
                "runs_s": wall["plain"],
                "runs_cpu_s": cpu["plain"],
            },
            "speculative": {
                "tokens_per_s": len(b) / statistics.median(wall["speculative"]),
                "runs_s": wall["speculative"],
                "runs_cpu_s": cpu["speculative"],
                "stats": stats.report(),
            },
            "speedup": statistics.median(ratios(wall)),
            "speedups": ratios(wall),
            "speedup_cpu": statistics.median(ratios(cpu)),
            "speedups_cpu": ratios(cpu),
            "same_tokens": diff is None,
            "first_difference": diff,
            "n_tokens": len(b),
            "tokens": {"plain": a, "speculative": b},
            "n_draft": int(n_draft),
            "repeat": int(repeat),
        }
    )
