"""What a speculative generation did: :class:`SpeculativeStats`, filled as it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..generation import GenerationOutcome


@dataclass
class SpeculativeStats:
    """What a speculative generation did, filled as it runs (:attr:`Speculation.stats`).

    Attributes:
        n_draft: The most tokens drafted per round, as asked.
        n_ubatch: The target context's ``n_ubatch``.
        n_tokens: Tokens yielded.
        n_rounds: Verify decodes of the target (rounds).
        n_drafted: Draft tokens verified.
        n_accepted: Draft tokens the target's sampler agreed with.
        drafted_at: Per draft position (index 0: the first draft token), rounds that drafted it.
        accepted_at: Per draft position, rounds that accepted it.
        verify_rows: Rows of each verify batch (replayed tokens, the last token, the draft).
        verify_passes: Forward passes counted for each verify batch (with a :class:`PassCounter`;
            else empty).
        n_replay_passes: Passes counted for decodes that only replay kept tokens (end of a
            generation after a checkpoint restore).
        n_checkpoints: ``PARTIAL_ONLY`` checkpoints taken (memory that cannot drop a suffix).
        n_restores: Checkpoints restored (partial acceptance with such a memory).
        n_replayed: Tokens decoded again after a restore.
        t_prefill: Seconds in the prompt's prefill.
        t_draft: Seconds in the draft (its decodes included).
        t_target: Seconds in the target's verify and replay decodes.
        t_sample: Seconds sampling and comparing the rows.
        t_rollback: Seconds cutting sequences (``seq_rm``, checkpoints saved and restored).
        t_total: Seconds from the call's first step to its end.
    """

    n_draft: int = 0
    n_ubatch: int = 0
    n_tokens: int = 0
    n_rounds: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    verify_rows: list[int] = field(default_factory=list)
    verify_passes: list[int] = field(default_factory=list)
    n_replay_passes: int = 0
    n_checkpoints: int = 0
    n_restores: int = 0
    n_replayed: int = 0
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_target: float = 0.0
    t_sample: float = 0.0
    t_rollback: float = 0.0
    t_total: float = 0.0

    @property
    def acceptance_rate(self) -> float | None:
        """Draft tokens accepted per draft token verified (None before any)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else None

    @property
    def acceptance_at(self) -> list[float]:
        """Per draft position: rounds that accepted it / rounds that drafted it."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def n_target_passes(self) -> int | None:
        """Forward passes counted in verify decodes (None without a :class:`PassCounter`)."""
        return sum(self.verify_passes) if self.verify_passes else None

    @property
    def passes_per_verify(self) -> float | None:
        """Mean forward passes per verify decode (None without a :class:`PassCounter`)."""
        return sum(self.verify_passes) / len(self.verify_passes) if self.verify_passes else None

    @property
    def tokens_per_pass(self) -> float | None:
        """Tokens yielded per target forward pass, replays included (None without a counter)."""
        n = self.n_target_passes
        return self.n_tokens / (n + self.n_replay_passes) if n else None

    @property
    def tokens_per_round(self) -> float | None:
        """Tokens yielded per verify decode."""
        return self.n_tokens / self.n_rounds if self.n_rounds else None

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens yielded per second of :attr:`t_total` (the prompt's prefill included)."""
        return self.n_tokens / self.t_total if self.t_total > 0 else None

    def passes_by_rows(self) -> dict[int, list[int]]:
        """The passes counted per verify batch width.

        Returns:
            ``{rows: sorted distinct pass counts seen for batches of that many rows}``.
        """
        out: dict[int, set[int]] = {}
        for r, p in zip(self.verify_rows, self.verify_passes):
            out.setdefault(r, set()).add(p)
        return {r: sorted(v) for r, v in sorted(out.items())}

    def report(self) -> dict[str, Any]:
        """Every figure as a JSON-ready dict.

        Returns:
            The fields, the properties, and ``passes_by_rows`` (keys as strings).
        """
        d: dict[str, Any] = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k in (
            "acceptance_rate",
            "acceptance_at",
            "n_target_passes",
            "passes_per_verify",
            "tokens_per_pass",
            "tokens_per_round",
            "tokens_per_s",
        ):
            d[k] = getattr(self, k)
        d["passes_by_rows"] = {str(k): v for k, v in self.passes_by_rows().items()}
        return d


class _Outcome(GenerationOutcome):
    """What a speculative generation did (a generation's outcome and its figures)."""

    __slots__ = ("stats",)

    def __init__(self, stats: SpeculativeStats) -> None:
        super().__init__()
        self.stats = stats
