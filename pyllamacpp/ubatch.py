"""What llama.cpp's ``llama_batch_allocr`` makes of a batch, replayed in Python: decode calls,
ubatches (forward passes) and their rows, and the KV length each ubatch attends over. No model
and no compiled extension needed.

The vendored llama.cpp (``src/llama-batch.cpp``, ``src/llama-kv-cache.cpp``) is followed step by step:

- decode calls: ``llama_decode`` refuses more than ``n_batch`` tokens (it asserts), so the
  submitter cuts the token stream into ``n_batch``-sized calls (as ``Context.prefill`` does);
- ubatches: :class:`BatchAllocr` holds what ``llama_batch_allocr`` reads (per-token sequence
  sets, the ``used`` marks) and replays ``split_simple`` / ``split_equal`` / ``split_seq``;
  :func:`choose_split` picks one as ``llama_kv_cache::init_batch`` does: one KV stream
  (``kv_unified``, or one sequence) -> ``split_simple``; one stream per sequence ->
  ``split_equal(n_ubatch, sequential=true)`` (``split_seq`` is what recurrent/hybrid memories
  use when every token is an output); :func:`split_all` is ``init_batch``'s loop;
- per ubatch, the padded KV length the graph attends over, ``n_kv`` =
  ``min(kv_size, max(256, GGML_PAD(used_max_p1, 256)))`` over the ubatch's streams
  (``llama_kv_cache::get_n_kv``), and the KQ mask shape ``[n_kv, n_tokens/n_stream, 1, n_stream]``
  (``build_attn_inp_kq_mask``), for a cache that starts empty except ``n_past`` tokens per
  sequence: :func:`plan` returns all of it as a :class:`Plan`.

Used by the graph taps (which batch rows a forward pass holds) and by the commands that plan a
batch's shape (``split-plan``, ``trace-ubatches``, ``mask``), whose shared shape flags live in
``pyllamacpp.experiments.ubatch_plan``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = [
    "MODES",
    "LAYOUTS",
    "N_PAD",
    "PlanError",
    "pad",
    "Row",
    "UBatch",
    "DecodeCall",
    "Plan",
    "runs",
    "BatchAllocr",
    "choose_split",
    "split_all",
    "per_seq",
    "layout_rows",
    "plan",
]

MODES = ("auto", "simple", "equal", "seq")
LAYOUTS = ("seq", "interleave")
N_PAD = 256  # llama_kv_cache::get_n_kv pads n_kv to max(n_pad, 256); n_pad is 1 for the usual caches


class PlanError(ValueError):
    """The batch cannot be split or placed; the message says what llama.cpp would do."""


def pad(x: int, n: int) -> int:
    """``x`` rounded up to a multiple of ``n``, as ``GGML_PAD``.

    Args:
        x: The value.
        n: The multiple.

    Returns:
        The smallest multiple of ``n`` that is ``>= x``.
    """
    return (x + n - 1) // n * n


# -- records ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One token slot of a decode call's batch.

    Attributes:
        slot: Its index in the decode call's batch.
        seq_id: Its sequence.
        token: Its index among that sequence's submitted tokens.
        pos: Its position.
        output: Whether logits are asked for it.
    """

    slot: int
    seq_id: int
    token: int
    pos: int
    output: bool


@dataclasses.dataclass(frozen=True)
class UBatch:
    """One forward pass (``llama_ubatch``) and what the graph built for it will look like.

    Attributes:
        index: The ubatch, counted over the whole plan.
        split: The split that made it: ``"simple"``, ``"equal"`` or ``"seq"``.
        equal_seqs: ``llama_ubatch.equal_seqs``: the same number of tokens from each sequence set.
        n_seq_tokens: Tokens per sequence set (``llama_ubatch.n_seq_tokens``).
        n_seqs: Sequence sets (equal split), else 1 (``llama_ubatch.n_seqs``).
        seq_ids: Its distinct sequence ids (``llama_ubatch.seq_id_unq``).
        rows: Its rows, in ubatch order.
        n_stream: Streams of the KQ mask: 1 with ``kv_unified``, else its distinct sequences.
        kv_used: Stream -> cells used after this ubatch is placed.
        n_kv: The padded KV length its graph attends over (``llama_kv_cache::get_n_kv``).
    """

    index: int
    split: str
    equal_seqs: bool
    n_seq_tokens: int
    n_seqs: int
    seq_ids: tuple[int, ...]
    rows: tuple[Row, ...]
    n_stream: int
    kv_used: dict
    n_kv: int

    @property
    def n_tokens(self) -> int:
        """Rows of the ubatch (``llama_ubatch.n_tokens``)."""
        return len(self.rows)

    @property
    def n_outputs(self) -> int:
        """Rows that ask for logits."""
        return sum(r.output for r in self.rows)

    @property
    def mask_shape(self) -> tuple[int, int, int, int]:
        """``attn_inp_kq_mask`` ne[0..3]."""
        return (self.n_kv, self.n_tokens // self.n_stream, 1, self.n_stream)


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """One ``llama_decode`` call: its batch and the ubatches ``init_batch`` cut it into.

    Attributes:
        index: The call, counted from the plan's start.
        rows: Its batch's rows, in slot order.
        ubatches: The ubatches, in the order they run.
    """

    index: int
    rows: tuple[Row, ...]
    ubatches: tuple[UBatch, ...]

    @property
    def n_tokens(self) -> int:
        """Tokens of the call's batch."""
        return len(self.rows)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A submission planned: the context's sizes after llama.cpp's clamps, and the decode calls.

    Made by :func:`plan`.

    Attributes:
        tokens: Submitted tokens per sequence.
        n_past: Tokens already in the cache per sequence.
        layout: ``"seq"`` or ``"interleave"`` (see :func:`layout_rows`).
        mode: The split as asked (``"auto"``, ``"simple"``, ``"equal"``, ``"seq"``).
        split: The split used.
        sequential: ``split_equal``'s sequential flag.
        n_ctx: ``n_ctx`` after llama.cpp's padding.
        n_ctx_seq: Cells per KV stream.
        n_batch: ``n_batch`` after the clamps.
        n_ubatch: ``n_ubatch`` after the clamps.
        n_batch_asked: ``n_batch`` as asked.
        n_ubatch_asked: ``n_ubatch`` as asked (0: ``n_batch``).
        n_seq_max: The context's ``n_seq_max``.
        kv_unified: One KV stream for all sequences.
        n_stream_kv: Streams of the KV cache.
        calls: The decode calls, in order.
        notes: What llama.cpp changed or would not do this way (clamps, an unusual split).
    """

    tokens: tuple[int, ...]
    n_past: tuple[int, ...]
    layout: str
    mode: str
    split: str
    sequential: bool
    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_ubatch: int
    n_batch_asked: int
    n_ubatch_asked: int
    n_seq_max: int
    kv_unified: bool
    n_stream_kv: int
    calls: tuple[DecodeCall, ...]
    notes: tuple[str, ...] = ()

    @property
    def ubatches(self) -> list[UBatch]:
        """Every ubatch of every decode call, in order."""
        return [u for c in self.calls for u in c.ubatches]

    def to_dict(self, rows: bool = True) -> dict:
        """The plan as plain data (``split-plan``'s ``--json`` and page, ``trace-ubatches``).

        Args:
            rows: Include each ubatch's rows (``[slot, seq_id, token, pos, output]``); the runs
                are always there.

        Returns:
            The plan's fields, ``row_fields`` and ``calls`` (each with its ``ubatches``).
        """
        d = {
            k: getattr(self, k)
            for k in (
                "tokens",
                "n_past",
                "layout",
                "mode",
                "split",
                "sequential",
                "n_ctx",
                "n_ctx_seq",
                "n_batch",
                "n_ubatch",
                "n_batch_asked",
                "n_ubatch_asked",
                "n_seq_max",
                "kv_unified",
                "n_stream_kv",
                "notes",
            )
        }
        d["row_fields"] = ["slot", "seq_id", "token", "pos", "output"]
        d["calls"] = []
        for c in self.calls:
            ubs = []
            for u in c.ubatches:
                ud = {
                    "index": u.index,
                    "split": u.split,
                    "equal_seqs": u.equal_seqs,
                    "n_tokens": u.n_tokens,
                    "n_seq_tokens": u.n_seq_tokens,
                    "n_seqs": u.n_seqs,
                    "seq_ids": list(u.seq_ids),
                    "n_stream": u.n_stream,
                    "n_kv": u.n_kv,
                    "kv_used": {str(k): v for k, v in u.kv_used.items()},
                    "mask_shape": list(u.mask_shape),
                    "n_outputs": u.n_outputs,
                    "runs": runs(u.rows),
                }
                if rows:
                    ud["rows"] = [[r.slot, r.seq_id, r.token, r.pos, int(r.output)] for r in u.rows]
                ubs.append(ud)
            d["calls"].append({"index": c.index, "n_tokens": c.n_tokens, "ubatches": ubs})
        return d


def runs(rows: Sequence[Row]) -> list[dict]:
    """Rows grouped into runs of consecutive tokens of one sequence.

    Args:
        rows: The rows, in ubatch order.

    Returns:
        One dict per run: ``seq_id``, ``token0``/``token1``, ``pos0``/``pos1``, ``slot0``/``slot1``
        and ``n``.
    """
    out: list[dict] = []
    for r in rows:
        last = out[-1] if out else None
        if last and last["seq_id"] == r.seq_id and last["token1"] + 1 == r.token and last["slot1"] + 1 == r.slot:
            last["token1"], last["pos1"], last["slot1"] = r.token, r.pos, r.slot
            last["n"] += 1
        else:
            out.append(
                {
                    "seq_id": r.seq_id,
                    "token0": r.token,
                    "token1": r.token,
                    "pos0": r.pos,
                    "pos1": r.pos,
                    "slot0": r.slot,
                    "slot1": r.slot,
                    "n": 1,
                }
            )
    return out


# -- llama_batch_allocr ----------------------------------------------------------------------


class BatchAllocr:
    """The part of ``llama_batch_allocr`` the splits read: per-token sequence sets, the map from
    a set to its tokens, the coupled-sequence flag and the ``used`` marks.

    ``seq_ids[i]`` lists token i's sequence ids in batch order (``seq_id[i][0]`` matters to
    ``split_equal``'s sequential rule).

    Args:
        seq_ids: Each token's sequence ids, in batch order.

    Raises:
        PlanError: No tokens (``llama_decode`` returns -1).
    """

    def __init__(self, seq_ids: Sequence[Sequence[int]]) -> None:
        if not seq_ids:
            raise PlanError("n_tokens == 0 (llama_decode returns -1)")
        self.seq_ids = [tuple(s) for s in seq_ids]
        self.seq_set = [frozenset(s) for s in self.seq_ids]
        self.seq_set_map: dict[frozenset, list[int]] = {}
        for i, s in enumerate(self.seq_set):
            self.seq_set_map.setdefault(s, []).append(i)
        self.has_cpl = any(len(s) > 1 for s in self.seq_ids)
        self.split_reset()

    @property
    def n_tokens(self) -> int:
        """Tokens of the batch."""
        return len(self.seq_ids)

    def split_reset(self) -> None:
        """Mark every token unused (``llama_batch_allocr::split_reset``)."""
        self.used = [False] * self.n_tokens
        self.n_used = 0

    def _take(self, i: int) -> None:
        self.used[i] = True
        self.n_used += 1

    def split_simple(self, n_ubatch: int) -> tuple[list[int], int, bool] | None:
        """The next ``n_ubatch`` unused tokens in batch order (``llama_batch_allocr::split_simple``).

        Args:
            n_ubatch: The most tokens of the ubatch.

        Returns:
            ``(idxs, n_seqs, equal_seqs)``, or None when every token is used.
        """
        cur = 0
        while cur < self.n_tokens and self.used[cur]:
            cur += 1
        if cur >= self.n_tokens:
            return None
        idxs = []
        while True:
            idxs.append(cur)
            self._take(cur)
            cur += 1
            if cur >= self.n_tokens or len(idxs) >= n_ubatch:
                break
        return idxs, len(idxs), False

    def split_equal(self, n_ubatch: int, sequential: bool, n_keep_tail: int = 0) -> tuple[list[int], int, bool] | None:
        """Non-overlapping sequence sets, the same number of tokens from each.

        As ``llama_batch_allocr::split_equal``.

        Args:
            n_ubatch: The most tokens of the ubatch.
            sequential: Accept only consecutive sequence ids (one KV stream per sequence).
            n_keep_tail: Leave at least this many tokens of a sequence for the last ubatch.

        Returns:
            ``(idxs, n_seqs, equal_seqs)``, or None when every token is used.

        Raises:
            PlanError: ``sequential`` with coupled sequences (tokens of several sequences), or
                ``n_ubatch <= n_keep_tail`` (llama.cpp's GGML_ASSERT).
        """
        if sequential and self.has_cpl:
            raise PlanError(
                "split_equal: sequential split is not supported when there are coupled sequences "
                "in the input batch (llama.cpp: 'you may need to use the -kvu flag'); decode fails"
            )
        cur_seq_set: list[frozenset] = []
        last_seq_id = -1
        for i in range(self.n_tokens):
            if self.used[i]:
                continue
            add = all(not (s & self.seq_set[i]) for s in cur_seq_set)
            if sequential:  # accept only increasing sequence ids
                add = add and (not cur_seq_set or self.seq_ids[i][0] == last_seq_id + 1)
            if add:
                cur_seq_set.append(self.seq_set[i])
                last_seq_id = self.seq_ids[i][0]
                if len(cur_seq_set) > n_ubatch:  # sic: llama.cpp stops one set past n_ubatch
                    break
        n_seqs = len(cur_seq_set)
        if n_seqs == 0:
            return None
        maps = [self.seq_set_map[s] for s in cur_seq_set]
        cur_idx = [0] * n_seqs
        for s in range(n_seqs):
            while self.used[maps[s][cur_idx[s]]]:
                cur_idx[s] += 1
        per_seq: list[list[int]] = [[] for _ in range(n_seqs)]
        while True:
            if any(cur_idx[s] >= len(maps[s]) for s in range(n_seqs)):
                break
            for s in range(n_seqs):
                idx = maps[s][cur_idx[s]]
                per_seq[s].append(idx)
                self._take(idx)
                cur_idx[s] += 1
            if (len(per_seq[0]) + 1) * n_seqs > n_ubatch:
                break
        if n_keep_tail > 0:
            if n_ubatch <= n_keep_tail:
                raise PlanError(f"split_equal: n_ubatch {n_ubatch} <= n_keep_tail {n_keep_tail} (GGML_ASSERT)")

            def remaining(s):
                return len(maps[s]) - cur_idx[s]

            n_keep = 0
            while n_keep < n_seqs:
                rem = remaining(n_keep)
                if rem != 0 and rem < n_keep_tail:
                    break
                n_keep += 1
            if n_keep == 0:
                idxs0 = per_seq[0]
                if len(idxs0) + remaining(0) <= n_ubatch:
                    while remaining(0) > 0:
                        idx = maps[0][cur_idx[0]]
                        idxs0.append(idx)
                        self._take(idx)
                        cur_idx[0] += 1
                else:
                    while remaining(0) < n_keep_tail:
                        self.used[idxs0.pop()] = False
                        self.n_used -= 1
                        cur_idx[0] -= 1
                n_keep = 1
            for s in range(n_keep, n_seqs):
                for idx in per_seq[s]:
                    self.used[idx] = False
                    self.n_used -= 1
            n_seqs = n_keep
        idxs = [i for s in range(n_seqs) for i in per_seq[s]]
        return idxs, n_seqs, True

    def split_seq(self, n_ubatch: int) -> tuple[list[int], int, bool] | None:
        """From the first unused token on, tokens whose sequence set is a subset of the current one.

        As ``llama_batch_allocr::split_seq``.

        Args:
            n_ubatch: The most tokens of the ubatch.

        Returns:
            ``(idxs, 1, True)``, or None when every token is used.
        """
        cur = 0
        while cur < self.n_tokens and self.used[cur]:
            cur += 1
        if cur >= self.n_tokens:
            return None
        cur_set = self.seq_set[cur]
        idxs = []
        while True:
            idxs.append(cur)
            self._take(cur)
            if len(idxs) >= n_ubatch:
                break
            cur += 1
            while cur < self.n_tokens and (self.used[cur] or not self.seq_set[cur] <= cur_set):
                cur += 1
            if cur == self.n_tokens:
                break
            cur_set = self.seq_set[cur]
        return idxs, 1, True


def choose_split(mode: str, n_stream_kv: int) -> tuple[str, bool]:
    """``(split, sequential)`` as ``llama_kv_cache::init_batch`` picks it for ``mode="auto"``.

    Args:
        mode: ``"auto"``, ``"simple"``, ``"equal"`` or ``"seq"``.
        n_stream_kv: Streams of the KV cache (1 with ``kv_unified``, else ``n_seq_max``).

    Returns:
        The split's name and ``split_equal``'s sequential flag.

    Raises:
        PlanError: An unknown mode.
    """
    if mode not in MODES:
        raise PlanError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return ("simple", False) if n_stream_kv == 1 else ("equal", True)
    return mode, mode == "equal" and n_stream_kv > 1  # split_equal(n_ubatch, !unified) elsewhere too


def split_all(
    balloc: BatchAllocr, n_ubatch: int, split: str, sequential: bool = False, n_keep_tail: int = 0
) -> list[tuple[list[int], int, bool]]:
    """``init_batch``'s loop: ubatches until the split returns none; all tokens must be used.

    Args:
        balloc: The batch (reset first).
        n_ubatch: The most tokens of a ubatch.
        split: ``"simple"``, ``"equal"`` or ``"seq"``.
        sequential: ``split_equal``'s sequential flag.
        n_keep_tail: ``split_equal``'s ``n_keep_tail``.

    Returns:
        One ``(idxs, n_seqs, equal_seqs)`` per ubatch.

    Raises:
        PlanError: An unknown split, a split that refuses the batch, or tokens left over
            ("failed to find a suitable split": ``llama_decode`` returns 1).
    """
    balloc.split_reset()
    out = []
    while True:
        if split == "simple":
            ub = balloc.split_simple(n_ubatch)
        elif split == "equal":
            ub = balloc.split_equal(n_ubatch, sequential, n_keep_tail)
        elif split == "seq":
            ub = balloc.split_seq(n_ubatch)
        else:
            raise PlanError(f"unknown split {split!r}")
        if ub is None:
            break
        out.append(ub)
    if balloc.n_used < balloc.n_tokens:
        raise PlanError(
            f"split_{split} used {balloc.n_used} of {balloc.n_tokens} tokens: 'failed to find a "
            "suitable split' (llama_decode returns 1)"
        )
    return out


# -- the plan --------------------------------------------------------------------------------


def per_seq(value: int | str | Sequence[int], n_seqs: int, what: str) -> list[int]:
    """One value per sequence from a flag or a keyword: ``N`` for every sequence, ``"N0,N1"``
    or a list (one value given: for every sequence).

    Args:
        value: An int, a comma-separated string or a sequence of ints.
        n_seqs: The number of sequences.
        what: What the values are, for the error (``tokens``, ``n_past``).

    Returns:
        ``n_seqs`` ints.

    Raises:
        PlanError: Another number of values than sequences.
        ValueError: A value that is not an integer.
    """
    if isinstance(value, str):
        value = [int(x) for x in value.split(",") if x.strip()]
    if isinstance(value, int):
        return [value] * n_seqs
    vals = [int(v) for v in value]
    if len(vals) == 1:
        return vals * n_seqs
    if len(vals) != n_seqs:
        raise PlanError(f"{what}: {len(vals)} values for {n_seqs} sequences")
    return vals


def layout_rows(tokens: Sequence[int], n_past: Sequence[int], layout: str) -> list[tuple[int, int, int, bool]]:
    """``(seq_id, token, pos, output)`` in submission order; output on each sequence's last token.

    Args:
        tokens: Tokens submitted per sequence.
        n_past: Tokens already in the cache per sequence (the first position).
        layout: ``"seq"`` (one sequence after the other) or ``"interleave"`` (round-robin).

    Returns:
        The rows, in submission order.

    Raises:
        PlanError: An unknown layout.
    """
    if layout == "seq":
        order = [(s, t) for s, n in enumerate(tokens) for t in range(n)]
    elif layout == "interleave":
        order = [(s, t) for t in range(max(tokens, default=0)) for s, n in enumerate(tokens) if t < n]
    else:
        raise PlanError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return [(s, t, n_past[s] + t, t == tokens[s] - 1) for s, t in order]


def plan(
    tokens: int | Sequence[int],
    n_batch: int = 2048,
    n_ubatch: int = 512,
    mode: str = "auto",
    *,
    n_seqs: int | None = None,
    n_past: int | Sequence[int] = 0,
    n_ctx: int = 4096,
    n_seq_max: int | None = None,
    kv_unified: bool = False,
    layout: str = "seq",
    n_keep_tail: int = 0,
) -> Plan:
    """Plan a submission: how llama.cpp cuts it into decode calls, ubatches and rows.

    ``tokens`` per sequence (an int for every one of ``n_seqs`` sequences, or a list of counts),
    after ``n_past`` tokens per sequence already in the cache.

    Context clamps as ``llama_context``'s constructor: ``n_batch = min(n_ctx, n_batch)``,
    ``n_ubatch = min(n_batch, n_ubatch)``, ``n_ctx`` padded to 256 and, without ``kv_unified``,
    ``n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256)``.

    Args:
        tokens: Tokens per sequence: one count for every sequence, a list of counts, or a string
            ``"N0,N1,..."`` (with ``n_seqs``).
        n_batch: ``n_batch`` asked for.
        n_ubatch: ``n_ubatch`` asked for (0: ``n_batch``).
        mode: The split: ``"auto"`` (as ``llama_kv_cache::init_batch``), ``"simple"``,
            ``"equal"`` or ``"seq"``.
        n_seqs: How many sequences; None: 1 for a count, else the length of ``tokens``.
        n_past: Tokens already in the cache: one count for every sequence, or one per sequence
            (a list, or a string ``"P0,P1,..."``).
        n_ctx: ``n_ctx`` asked for (0 is not allowed here: give the model's ``n_ctx_train``).
        n_seq_max: The context's ``n_seq_max``; None: ``n_seqs``.
        kv_unified: One KV stream for all sequences.
        layout: ``"seq"`` or ``"interleave"`` (see :func:`layout_rows`).
        n_keep_tail: ``split_equal``'s ``n_keep_tail``.

    Returns:
        The :class:`Plan`.

    Raises:
        PlanError: Where llama.cpp would refuse: KV cache full, no split, bad sizes, more
            sequences than ``n_seq_max``.
    """
    if isinstance(tokens, (int, str)):
        n_seqs = n_seqs or 1
    else:
        n_seqs = n_seqs or len(tokens)
    toks = per_seq(tokens, n_seqs, "tokens")
    past = per_seq(n_past, n_seqs, "n_past")
    if any(t < 0 for t in toks) or any(p < 0 for p in past) or sum(toks) == 0:
        raise PlanError(f"tokens must be >= 0 with at least one token, past >= 0: tokens {toks}, past {past}")
    n_seq_max = n_seq_max or n_seqs
    if n_seqs > n_seq_max:
        raise PlanError(f"{n_seqs} sequences but n_seq_max {n_seq_max} (seq ids must be < n_seq_max)")
    if n_ctx <= 0 or n_batch <= 0 or n_ubatch < 0:
        raise PlanError(
            f"n_ctx {n_ctx}, n_batch {n_batch} must be > 0 and n_ubatch >= 0 (here n_ctx 0 would mean "
            "the model's n_ctx_train: give it)"
        )
    nb = min(n_ctx, n_batch)
    nub = min(nb, n_ubatch or nb)
    ctx_pad = pad(n_ctx, 256)
    if kv_unified:
        n_ctx_seq, n_ctx_eff = ctx_pad, ctx_pad
    else:
        n_ctx_seq = pad(ctx_pad // n_seq_max, 256)
        if n_ctx_seq == 0:
            raise PlanError("n_ctx_seq == 0")
        n_ctx_eff = n_ctx_seq * n_seq_max
    n_stream_kv = 1 if kv_unified else n_seq_max
    split, sequential = choose_split(mode, n_stream_kv)
    notes = []
    if (nb, nub) != (n_batch, n_ubatch or n_batch):
        notes.append(
            f"clamped: -b {n_batch} -ub {n_ubatch} -> n_batch {nb}, n_ubatch {nub} "
            "(n_batch <= n_ctx, n_ubatch <= n_batch)"
        )
    if split == "simple" and n_stream_kv > 1:
        notes.append(
            "split_simple on a cache with one stream per sequence: llama_kv_cache never does this; "
            "find_slot assumes equal rows per sequence"
        )

    # the KV cache as get_n_kv sees it: a fresh cache holding only the past tokens, no holes
    used: dict[int, int] = {}
    for s, p in enumerate(past):
        st = 0 if kv_unified else s
        used[st] = used.get(st, 0) + p
    for st, u in used.items():
        if u > n_ctx_seq:
            raise PlanError(f"past tokens need {u} cells in stream {st}, which has {n_ctx_seq}")

    flat = layout_rows(toks, past, layout)
    calls = []
    ub_index = 0
    for ci, i0 in enumerate(range(0, len(flat), nb)):
        chunk = flat[i0 : i0 + nb]
        rows = tuple(Row(slot, s, t, p, o) for slot, (s, t, p, o) in enumerate(chunk))
        balloc = BatchAllocr([(r.seq_id,) for r in rows])
        try:
            parts = split_all(balloc, nub, split, sequential, n_keep_tail)
        except PlanError as e:
            raise PlanError(f"decode call {ci}: {e}") from None
        # prepare(): place every ubatch before any runs; a miss fails the whole call with 1
        ubs = []
        for idxs, n_seqs_ub, equal in parts:
            urows = tuple(rows[i] for i in idxs)
            seq_unq = tuple(sorted({r.seq_id for r in urows}))
            per_stream: dict[int, int] = {}
            for r in urows:
                st = 0 if kv_unified else r.seq_id
                per_stream[st] = per_stream.get(st, 0) + 1
            for st, n in per_stream.items():
                used[st] = used.get(st, 0) + n
                if used[st] > n_ctx_seq:
                    raise PlanError(
                        f"decode call {ci}: KV cache full: stream {st} needs {used[st]} cells, has "
                        f"{n_ctx_seq} (llama_decode returns 1, 'failed to find a memory slot')"
                    )
            n_kv = max(min(n_ctx_seq, max(N_PAD, pad(used[st], N_PAD))) for st in per_stream)
            n_stream = 1 if kv_unified else len(seq_unq)
            ubs.append(
                UBatch(
                    index=ub_index,
                    split=split,
                    equal_seqs=equal,
                    n_seq_tokens=len(idxs) // n_seqs_ub,
                    n_seqs=n_seqs_ub,
                    seq_ids=seq_unq,
                    rows=urows,
                    n_stream=n_stream,
                    kv_used={st: used[st] for st in sorted(per_stream)},
                    n_kv=n_kv,
                )
            )
            ub_index += 1
        calls.append(DecodeCall(ci, rows, tuple(ubs)))
    return Plan(
        tokens=tuple(toks),
        n_past=tuple(past),
        layout=layout,
        mode=mode,
        split=split,
        sequential=sequential,
        n_ctx=n_ctx_eff,
        n_ctx_seq=n_ctx_seq,
        n_batch=nb,
        n_ubatch=nub,
        n_batch_asked=n_batch,
        n_ubatch_asked=n_ubatch,
        n_seq_max=n_seq_max,
        kv_unified=kv_unified,
        n_stream_kv=n_stream_kv,
        calls=tuple(calls),
        notes=tuple(notes),
    )
