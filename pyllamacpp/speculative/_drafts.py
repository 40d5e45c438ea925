"""Where draft tokens come from: the :class:`Draft` interface, and :class:`NgramDraft` (lookup, no model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._closing import _Closing

if TYPE_CHECKING:
    from ..model import Model


class Draft(_Closing):
    """Where draft tokens come from. Subclass it and override :meth:`draft`.

    :func:`generate_speculative` calls :meth:`bind` with the target model before any decode,
    :meth:`begin` once with the prompt, then :meth:`draft` before each verify. ``history`` is
    the whole text so far as token ids, the prompt then every token yielded, and ends with the
    token the next verify decodes first; it only grows within one generation.
    """

    def bind(self, model: Model) -> None:
        """Check that this draft can serve ``model`` (called before any decode).

        Args:
            model: The target model.

        Raises:
            ValueError: It cannot (e.g. another vocabulary).
        """

    def begin(self, history: list[int]) -> None:
        """A generation starts from ``history`` (the prompt).

        Args:
            history: The prompt's token ids.
        """

    def draft(self, history: list[int], n_max: int) -> list[int]:
        """Propose up to ``n_max`` tokens to follow ``history``.

        Args:
            history: The text so far; its last token is decoded first by the verify.
            n_max: The most tokens to propose (at least 1).

        Returns:
            The proposed token ids (may be empty).

        Raises:
            NotImplementedError: The base class proposes nothing of its own.
        """
        raise NotImplementedError

    def reset(self) -> None:
        """Forget what is kept between generations (a draft model's cached prompt)."""

    def close(self) -> None:
        """Free what the draft owns (idempotent)."""


class NgramDraft(Draft):
    """Lookup decoding: the tokens that followed the same n-gram earlier in the text (no model).

    llama.cpp's n-gram cache (``common/ngram-cache.cpp``, ``examples/lookup``) over the prompt
    and the text so far: for each n-gram of ``n_min..n_max`` tokens, how often each token
    followed it. A draft extends the text one token at a time: the longest n-gram ending the
    text (drafts included) whose most frequent follower was seen at least ``min_samples[n-1]``
    times and makes at least ``min_percent[n-1]`` percent of them gives the next token; none: the
    draft stops. The defaults are llama.cpp's ``LLAMA_NGRAM_MIN/MAX`` and its "lax" thresholds
    for the context cache. Only that cache: no corpus-wide static or dynamic cache. The table
    sees every n-gram of the text, as ``examples/lookup`` updates it (not only those inside one
    round's new tokens, as ``common/speculative.cpp``'s ngram-cache path does).

    Args:
        n_min: The shortest n-gram looked up.
        n_max: The longest n-gram looked up.
        min_samples: Per n-gram length (index ``n - 1``), the times the n-gram must have been seen.
        min_percent: Per n-gram length, the share (percent) its most frequent follower must have.

    Raises:
        ValueError: ``n_min < 1``, ``n_max < n_min``, or a threshold list shorter than ``n_max``.
    """

    def __init__(
        self,
        n_min: int = 1,
        n_max: int = 4,
        *,
        min_samples: Sequence[int] = (2, 2, 1, 1),
        min_percent: Sequence[int] = (66, 50, 50, 50),
    ) -> None:
        if n_min < 1 or n_max < n_min:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min} n_max={n_max}")
        if len(min_samples) < n_max or len(min_percent) < n_max:
            raise ValueError(f"min_samples and min_percent need {n_max} entries (one per n-gram length)")
        self.n_min, self.n_max = int(n_min), int(n_max)
        self.min_samples = [int(x) for x in min_samples]
        self.min_percent = [int(x) for x in min_percent]
        # n-gram -> [times seen, most frequent follower, its count, {follower: count}]
        self._table: dict[tuple[int, ...], list] = {}
        self._seen = 0  # history[:_seen] is in the table

    def begin(self, history: list[int]) -> None:
        """Start a new table for this generation.

        Args:
            history: The prompt's token ids.
        """
        self._table.clear()
        self._seen = 0

    def reset(self) -> None:
        """Forget the table."""
        self.begin([])

    def _update(self, h: list[int]) -> None:
        table, n_min, n_max = self._table, self.n_min, self.n_max
        for i in range(max(self._seen, 1), len(h)):  # h[i] follows the n-grams ending at i - 1
            tok = h[i]
            for n in range(n_min, min(n_max, i) + 1):
                key = tuple(h[i - n : i])
                e = table.get(key)
                if e is None:
                    table[key] = [1, tok, 1, {tok: 1}]
                    continue
                e[0] += 1
                c = e[3][tok] = e[3].get(tok, 0) + 1
                if c > e[2]:
                    e[1], e[2] = tok, c
        self._seen = len(h)

    def draft(self, history: list[int], n_max: int) -> list[int]:
        """The longest-n-gram lookup, one token at a time (see the class).

        Args:
            history: The text so far.
            n_max: The most tokens to propose.

        Returns:
            The proposed token ids (empty when no n-gram qualifies).
        """
        if len(history) < self._seen:  # not the history this table was made from
            self.begin(history)
        self._update(history)
        table, samples, percent = self._table, self.min_samples, self.min_percent
        tail = history[-self.n_max :]
        out: list[int] = []
        while len(out) < n_max:
            tok = -1
            for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
                e = table.get(tuple(tail[-n:]))
                if e is not None and e[0] >= samples[n - 1] and 100 * e[2] >= percent[n - 1] * e[0]:
                    tok = e[1]
                    break
            if tok < 0:
                break
            out.append(tok)
            tail.append(tok)
        return out

    def __repr__(self) -> str:
        return f"<NgramDraft n={self.n_min}..{self.n_max}, {len(self._table)} n-grams>"
