"""Log-likelihoods of (context, continuation) requests, every shared prefix decoded once.

:func:`loglikelihood` is what lm-evaluation-harness asks a model for (``LM.loglikelihood``): per
request the summed log-probability of the continuation's tokens given the context, and whether
greedy decoding would have produced it. The requests of a whole list are laid into a trie over
their token ids (a radix tree: one node per run of tokens that the same requests share), so a
few-shot header in front of every question is one node, a question in front of its four endings
another, and identical requests are one path. Each node is decoded once, with logits only at the
rows that predict a continuation token.

How the trie is decoded (multi-id tokens and ``seq_cp`` forks, both, in a unified KV cache):
``n_seq_max`` slots (sequences) walk the trie's leaves in depth-first order (the requests sorted
by token ids), each slot holding the path from the root to its leaf in its cells. A node is fed
by one slot; the other slots that need it in the same ``llama_decode`` join it (their seq ids are
added to its tokens, one cell each: llama.cpp's "coupled sequences", which need
``kv_unified=True``) and go on with their own nodes after it in the same batch, so a question and
its endings are one decode. A slot that reaches a node decoded in an earlier batch takes its cells
with ``llama_memory_seq_cp`` (in a unified cache a copy adds a seq id to the cells and moves no
data). Multi-id tokens alone cannot do it: a 5-shot header read by 800 requests would need 800
seq ids in one batch (llama.cpp allows 256 sequences), and deeper nodes would need every branch
below them known at once; forks alone would put every child one decode after its parent. A slot
that finishes keeps the part of its path its next leaf shares (the free slot that holds the most
of it takes it) and lets go of the rest.

Cells, epochs and exactness: the cells a slot lets go of are not freed but moved to one more
sequence, a graveyard nobody reads (``seq_cp`` to it, then ``seq_rm``), so that no cell is free
again before the cache is full: llama.cpp then places every new token above all the cells taken
before it, and each sequence's cells stay in position order, as they are when the request is
decoded alone. A leaf is taken only while the epoch's cells hold what every path in flight still
needs; when the next one does not fit, the walk finishes what it has, clears the memory (a new
epoch) and goes on, decoding again the shared nodes the next leaves need (the header:
``n_redecoded`` counts those tokens). So the cache never holds more than ``n_ctx`` cells and never
fills. The last token of a leaf is not decoded (it predicts nothing), as lm-eval's own backends
feed ``(context + continuation)[:-1]``. With flash attention off, attention is computed over every
cell of the epoch (flash attention skips the masked ones): keep it on, or ``n_ctx`` small.

On the CPU backend with flash attention on (llama.cpp's default there), each request's
log-probabilities are then bit-identical to the same request decoded alone in a context of the
same parameters when every ubatch has fewer than 64 tokens (the default ``n_batch`` is 63): ggml's
flash-attention kernel computes such a row on its own over the visible cells in cell order, and
their order is the same. From 64 query rows on (``GGML_FA_TILE_Q``) it switches to a tiled kernel
whose sums depend on where the cells fall in its 64-cell tiles; with flash attention off the
softmax's sum depends on the cells' indices too (see the row-audit experiment). Those are
last-bit differences, but this model's Q4_1 weights quantize each activation row to q8_1 before
every matrix product, and a last-bit change that moves a value across a rounding step of the
quantizer grows through the layers: with ``n_batch`` 512, a few-shot workload's requests moved
by up to 0.4 nats (tools/bench/bench_evaluation.py; docs/guide/evaluation.md gives the figures).

A prefix store (``prefix_store=``, :class:`~pyllamacpp.prefix_store.PrefixStore`): when a slot
starts a path none of whose first node is in the cache (the requests' common context prefixes, a
depth-0 node of the trie, and the nodes under it), the longest stored prefix of the path's tokens
is loaded into its empty sequence instead of decoded, up to the first row the path needs logits
for (a restored token has none); each node fed whole for the first time stores the path's new whole
chunks up to its end; ``n_restored`` counts the tokens loaded. A restored cell holds the bytes a
decode wrote, in the epoch's next cells in position order. The results are bit-identical to a run
without the store where the rows do not depend on which cells the others' tokens take: flash
attention on with ubatches under 64 rows (the default above), or one slot. With flash attention off
and several slots they are not: the other slots cannot join a node that is only partly restored,
so their nodes go into later batches and other cells, and the softmax's sums move in the last bits
(grown by the quantizer: up to 0.076 nats on tests/test_prefix_store_wiring.py's requests).

Tokenization at the boundary is lm-eval's (``TemplateLM._encode_pair``): trailing spaces of the
context move to the front of the continuation; the context is tokenized on its own and the whole
string ``context + continuation`` too, and the continuation's tokens are the whole string's tokens
after the first ``len(context tokens)``. When the whole string's tokenization does not start with
the context's tokens (a merge across the boundary), lm-eval still scores the context's own tokens
followed by that tail, and so does this function: the sequence scored is then not the
tokenization of the whole string, as in lm-eval. An empty context text is the model's BOS token
(lm-eval's ``prefix_token_id``): the continuation is scored after it, whether the request comes
alone or among others; a model without BOS refuses it (ValueError naming the request). Requests
given as token ids are used as they are (an empty token context is refused: give BOS yourself).

Ctrl-C: the KeyboardInterrupt (a :class:`~pyllamacpp.errors.DecodeInterrupted` when it stopped a
decode) propagates as it is, with ``results`` attached (as ``Context.prefill`` attaches
``resume_from``): a :class:`Loglikelihoods` of the requests' results so far, None where a request
was not scored yet, with the counts so far (``summary()``). Not a return: a caller that computes
a metric from what it gets back must not get a part of it by accident, and a Ctrl-C must still
stop a script; one that wants the part catches it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._lib import lib
from ..packing import WorkOrder, common_prefix, model_and_context
from ..scoring import log_softmax

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model
    from ..packing import Piece
    from ..prefix_store import PrefixStore

__all__ = ["Loglikelihood", "Loglikelihoods", "loglikelihood", "encode_pair"]

_PROGRESS_MIN = 100
"""With ``progress=None``, a bar for lists of at least this many requests (on a terminal)."""
_PROGRESS_TOKENS = 2048
"""... or for work of at least this many tokens to decode (one long request takes minutes too)."""


@dataclass(frozen=True, eq=False)
class Loglikelihood:
    """One request's result (:func:`loglikelihood`).

    Attributes:
        logprob: The summed log-probability of the continuation's tokens given the context (nats,
            float64 sums of the rows' log-softmax).
        is_greedy: Whether every continuation token is the argmax of the row that predicts it
            (lm-eval's ``is_greedy``: greedy decoding would have produced the continuation).
        n_tokens: The continuation's tokens.
        n_bytes: The UTF-8 length of the continuation as given (the text; for token ids, the
            bytes of their pieces): the divisor of byte-normalised accuracy.
        logprobs: float64 ``(n_tokens,)``: each continuation token's log-probability.
        tokens: int32 ``(n_tokens,)``: the continuation's tokens.
        n_context: The context's tokens.
    """

    logprob: float
    is_greedy: bool
    n_tokens: int
    n_bytes: int
    logprobs: np.ndarray
    tokens: np.ndarray
    n_context: int

    def __iter__(self) -> Iterator[Any]:
        """``(logprob, is_greedy)``, lm-eval's tuple: ``lp, greedy = result``."""
        return iter((self.logprob, self.is_greedy))

    def __repr__(self) -> str:
        return (
            f"<Loglikelihood {self.logprob:.4f} over {self.n_tokens} token(s), "
            f"{self.n_bytes} byte(s), is_greedy={self.is_greedy}>"
        )


class Loglikelihoods(list):
    """What :func:`loglikelihood` returns: a list of :class:`Loglikelihood` in request order,
    with the counts of the run.

    Attributes:
        n_requests: Requests asked (duplicates included).
        n_unique: Distinct requests (same tokens, same context length) scored.
        n_decoded: Tokens fed to ``llama_decode`` (each trie node's once).
        n_unshared: Tokens a decode of each request on its own would feed (context + continuation
            minus the last token, per request), what lm-eval's per-request backends decode.
        n_decodes: ``llama_decode`` calls.
        n_outputs: Rows with logits.
        n_redecoded: Tokens decoded again in a new epoch: shared nodes the next leaves need after
            the memory was cleared (their rows are not computed twice).
        n_epochs: Times the ``n_ctx`` cells were all taken and the memory cleared.
        n_restored: Tokens loaded from the prefix store instead of decoded (None without a store).
        n_nodes: Trie nodes (the root excluded).
        n_seq: Sequences (slots) used.
        n_ctx: KV cells the walk could use.
        seconds: Wall time of the decodes and scoring (tokenization and the trie excluded).
    """

    n_requests = n_unique = n_decoded = n_unshared = n_decodes = n_outputs = n_redecoded = 0
    n_nodes = n_seq = n_ctx = n_epochs = 0
    n_restored: int | None = None
    seconds = 0.0

    def summary(self) -> dict[str, Any]:
        """The counts as a dict (for JSON).

        Returns:
            ``{"n_requests": ..., "n_decoded": ..., ...}`` (``n_restored`` only with a store).
        """
        keys = "n_requests n_unique n_decoded n_unshared n_decodes n_outputs n_redecoded n_epochs"
        keys += " n_nodes n_seq n_ctx seconds"
        out = {k: getattr(self, k) for k in keys.split()}
        if self.n_restored is not None:
            out["n_restored"] = self.n_restored
        return out


# -- requests -> tokens -----------------------------------------------------------------------------
def _is_tokens(x: Any) -> bool:
    return isinstance(x, (list, tuple, np.ndarray)) and not isinstance(x, str)


def _token_array(model: Model, x: Any, i: int, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.size == 0:
        return np.zeros(0, np.int32)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise TypeError(f"request {i}: the {what} must be text or a 1-D array of token ids, got {a.dtype} {a.shape}")
    if int(a.min()) < 0 or int(a.max()) >= model.n_vocab:
        raise ValueError(f"request {i}: a {what} token is outside the vocabulary [0, {model.n_vocab})")
    return a.astype(np.int32)


_NO_BOS = (
    "the context is empty and the model has no BOS token: an empty context is scored after BOS "
    "(lm-eval's prefix token); give a context, or token ids"
)


def encode_pair(
    model: Model, context: str, continuation: str, *, parse_special: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize a (context, continuation) pair as lm-eval's ``TemplateLM._encode_pair`` does.

    Trailing spaces of the context go to the front of the continuation; the context is tokenized
    (``llama_tokenize`` with ``add_special``: BOS where the model adds one) and so is the whole
    string; the continuation is the whole string's tokens after the context's count. An empty
    context is the model's BOS, lm-eval's ``prefix_token_id``: the continuation is scored after it.

    Args:
        model: The model whose vocabulary tokenizes.
        context: The context text.
        continuation: The continuation text.
        parse_special: ``llama_tokenize``'s ``parse_special`` (special tokens written as text).

    Returns:
        ``(context tokens, continuation tokens)``, int32; the continuation may come out empty.

    Raises:
        ValueError: An empty context and a model without a BOS token (nothing to score the
            continuation's first token after).
    """
    if context == "":
        if model.bos < 0:
            raise ValueError(_NO_BOS)
        cont = model.tokenize(continuation, False, parse_special)
        prefix = model.bos
        if cont.size and int(cont[0]) == prefix:
            return cont[:1], cont[1:]
        return np.array([prefix], np.int32), cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = model.tokenize(context + continuation, True, parse_special)
    ctx = model.tokenize(context, True, parse_special)
    return ctx, whole[ctx.size :]


def _prepare(model: Model, requests: Iterable[Any], parse_special: bool) -> list[tuple[np.ndarray, int, int]]:
    """Per request ``(context + continuation tokens, context length, n_bytes)``, checked."""
    if isinstance(requests, (str, bytes)) or not isinstance(requests, Iterable):
        raise TypeError(f"requests must be a list of (context, continuation) pairs, not {type(requests).__name__}")
    out = []
    ctx_cache: dict[str, np.ndarray] = {}
    for i, r in enumerate(requests):
        if isinstance(r, (str, bytes)) or not isinstance(r, Sequence) or len(r) != 2:
            raise TypeError(f"request {i} is a {type(r).__name__}, not a (context, continuation) pair")
        c, x = r
        if isinstance(c, str) and isinstance(x, str):
            if x == "":
                raise ValueError(f"request {i}: the continuation is empty (nothing to score)")
            if c == "" and model.bos < 0:
                raise ValueError(f"request {i}: {_NO_BOS}")
            if c and not c[-1].isspace() and c in ctx_cache:  # the common case: one context, several endings
                ctx = ctx_cache[c]
                cont = model.tokenize(c + x, True, parse_special)[ctx.size :]
            else:
                ctx, cont = encode_pair(model, c, x, parse_special=parse_special)
                if c and not c[-1].isspace():
                    ctx_cache[c] = ctx
            n_bytes = len(x.encode("utf-8"))
        elif _is_tokens(c) and _is_tokens(x):
            ctx, cont = _token_array(model, c, i, "context"), _token_array(model, x, i, "continuation")
            if ctx.size == 0:
                raise ValueError(f"request {i}: the context has no tokens (give at least one, e.g. BOS)")
            n_bytes = sum(len(model.token_to_bytes(int(t))) for t in cont)
        else:
            raise TypeError(
                f"request {i}: context and continuation must both be str or both token ids, "
                f"got {type(c).__name__} and {type(x).__name__}"
            )
        if cont.size == 0:
            raise ValueError(f"request {i}: the continuation {x!r} has no tokens of its own (nothing to score)")
        if ctx.size == 0:
            raise ValueError(f"request {i}: the context has no tokens")
        out.append((np.concatenate([ctx, cont]), int(ctx.size), n_bytes))
    return out


# -- the trie ----------------------------------------------------------------------------------------
class _Node:
    """A run of tokens at positions [start, start + len) that the same requests share."""

    __slots__ = (
        "tokens",
        "start",
        "parent",
        "children",
        "ends",
        "want",
        "lp",
        "greedy",
        "out_children",
        "n_feed",
        "n_dec",
        "owner",
        "holders",
        "refs",
        "scored",
    )

    def __init__(self, tokens: np.ndarray, start: int, parent: _Node | None) -> None:
        self.tokens, self.start, self.parent = tokens, start, parent
        self.children: list[_Node] = []
        self.ends: list[int] = []  # unique requests whose tokens end here
        self.want: np.ndarray = np.zeros(0, bool)  # token j is a continuation token of some request
        self.lp: np.ndarray = np.zeros(0)  # log p(token j | everything before it), NaN until known
        self.greedy: np.ndarray = np.zeros(0, bool)
        self.out_children: list[_Node] = []  # children whose first token the last row predicts
        self.n_feed = 0  # tokens to decode: all, but a leaf's last (it predicts nothing)
        self.n_dec = 0  # tokens in the cache now (in every holder's sequence)
        self.owner = -1  # the slot decoding it, while it is not all in the cache
        self.holders: set[int] = set()  # slots whose sequence holds its cells
        self.refs = 0  # slots in flight whose path goes through it
        self.scored = False  # its rows have been computed (it was fed whole once)

    @property
    def end(self) -> int:
        return self.start + int(self.tokens.size)


def _build(seqs: list[np.ndarray]) -> tuple[_Node, list[_Node], list[_Node]]:
    """The trie of the unique sequences ``seqs`` (sorted): its root, the node where each sequence
    ends (in ``seqs`` order) and the leaves in depth-first order."""
    root = _Node(np.zeros(0, np.int32), 0, None)
    stack = [root]
    prev = np.zeros(0, np.int32)
    for k, seq in enumerate(seqs):
        n = common_prefix(prev, seq)
        while len(stack) > 1 and stack[-1].start >= n:
            stack.pop()
        top = stack[-1]
        if top.end > n:  # split top at n: its tail keeps its children and the requests ending there
            low = _Node(top.tokens[n - top.start :], n, top)
            low.children, low.ends = top.children, top.ends
            for ch in low.children:
                ch.parent = low
            top.tokens, top.children, top.ends = top.tokens[: n - top.start], [low], []
        node = _Node(seq[n:], n, top)
        node.ends.append(k)
        top.children.append(node)
        stack.append(node)
        prev = seq
    ends: list[_Node | None] = [None] * len(seqs)
    leaves: list[_Node] = []
    todo = [root]
    while todo:  # depth-first, children in sorted order
        node = todo.pop()
        for k in node.ends:
            ends[k] = node
        if node is not root and not node.children:
            leaves.append(node)
        todo.extend(reversed(node.children))
    return root, ends, leaves  # type: ignore[return-value]


def _path(node: _Node) -> list[_Node]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


# -- the walk ----------------------------------------------------------------------------------------
class _Seg:
    """The walk's tag on a piece of the work order (the piece's ``lo``/``hi`` are the node's tokens
    ``[j0, j1)``): the node, the slot that feeds it and the slots that joined it."""

    __slots__ = ("node", "slot", "joiners")

    def __init__(self, node: _Node, slot: int) -> None:
        self.node, self.slot = node, slot
        self.joiners: list[int] = []


class _Walk:
    """Decodes the trie in one context: slots, epochs, batches, rows (see the module docstring)."""

    def __init__(
        self,
        ctx: Context,
        leaves: list[_Node],
        n_seq: int,
        grave: int,
        n_ctx: int,
        stats: Loglikelihoods,
        store: PrefixStore | None = None,
    ) -> None:
        from ..batch import Batch

        self.ctx, self.leaves, self.stats = ctx, leaves, stats
        self.n_ctx, self.n_batch = n_ctx, ctx.n_batch
        self.grave = grave  # the sequence that keeps the cells of finished branches (-1: none)
        self.n_threads = ctx.params.n_threads_batch or 1
        self.paths: list[list[_Node] | None] = [None] * n_seq  # the path each slot works on
        self.held = [0] * n_seq  # nodes of its path (from the first) fully in the slot's sequence
        self.next_leaf = 0
        self.used = 0  # cells taken in this epoch (all of them stay taken until it ends)
        self.live: set[_Node] = set()  # nodes with cells in this epoch
        self.reserved: set[_Node] = set()  # nodes the paths in flight still have to feed
        self.order = WorkOrder(Batch(self.n_batch, max(1, n_seq), model=ctx.model))
        self.on_scored: Any = None  # called with each node whose last token's log-prob is known
        self.n_scored = self.n_scored_at_epoch = 0  # nodes scored (a guard: every epoch scores some)
        self.store = store
        self.n_restored_new = 0  # restored tokens of nodes not scored before (work the bar counts)

    # a slot's path is done when every node on it has been scored
    def _done(self, s: int) -> bool:
        path = self.paths[s]
        return path is None or all(n.scored for n in path)

    def _drop(self, s: int, keep: int) -> None:
        """Slot ``s`` lets go of its path past the first ``keep`` nodes: those cells move to the
        graveyard sequence (``llama_memory_seq_cp`` then ``llama_memory_seq_rm``), so that no cell
        is free again before the epoch ends and llama.cpp keeps placing new tokens above all the
        others. A node no slot holds any more has no cells to share."""
        path = self.paths[s]
        assert path is not None
        if any(s in n.holders for n in path[keep:]):
            p0 = path[keep - 1].end if keep else 0
            mem = self.ctx.memory
            if self.grave >= 0:
                mem.seq_cp(s, self.grave, p0, -1)
            mem.seq_rm(s, p0, -1)
            for node in path[keep:]:
                node.holders.discard(s)
                if not node.holders:
                    node.n_dec, node.owner = 0, -1
                    self.live.discard(node)
        self.held[s] = min(self.held[s], keep)

    def _new_epoch(self) -> None:
        """Every cell taken: clear the memory (llama.cpp's head back to cell 0) and start the
        paths in flight again from their first node not scored."""
        self.ctx.memory.clear()
        for node in self.live:
            node.n_dec, node.owner, node.holders = 0, -1, set()
        self.live.clear()
        self.reserved.clear()
        self.held = [0] * len(self.held)
        self.used = 0
        self.stats.n_epochs += 1

    def _assign(self) -> None:
        """Give the free slots the next leaves in depth-first order, each to the free slot that
        holds the most of its path, while the epoch's cells hold what the paths in flight still
        need (so no path is cut by the end of an epoch and decoded again)."""
        free = [s for s in range(len(self.paths)) if self._done(s)]
        new: dict[int, list[_Node]] = {}
        self.reserved = {n for n in self.reserved if n.n_dec < n.n_feed}
        owed = sum(n.n_feed - n.n_dec for n in self.reserved)  # cells the paths in flight will take
        while free and self.next_leaf < len(self.leaves):
            path = _path(self.leaves[self.next_leaf])
            more = [n for n in path if n.n_dec < n.n_feed and n not in self.reserved]
            need = sum(n.n_feed - n.n_dec for n in more)
            if self.used + owed + need > self.n_ctx:
                break  # the next epoch's
            owed += need
            self.reserved.update(more)
            best, best_k = free[0], -1
            for s in free:
                k = _shared(self.paths[s], self.held[s], path)
                if k > best_k:
                    best, best_k = s, k
            free.remove(best)
            new[best] = path
            self.next_leaf += 1
        # copies before cuts: the slots in flight take what they need from the cache first, then
        # each new path cuts its slot's old one and takes its own; last, the idle slots let go
        for s, p in enumerate(self.paths):
            if p is not None and s not in new and s not in free:
                if self.held[s] == 0 and self.store is not None:  # in flight into a new epoch
                    self._restore(s)
                self._catch_up(s)
        for s, path in new.items():
            k = _shared(self.paths[s], self.held[s], path)
            if self.paths[s] is not None:
                self._drop(s, k)
            self.paths[s], self.held[s] = path, k
            if k == 0 and self.store is not None:
                self._restore(s)
            self._catch_up(s)
        for s in free:
            if self.paths[s] is not None:
                self._drop(s, 0)
                self.paths[s] = None

    def _restore(self, s: int) -> None:
        """Load the longest stored prefix of slot ``s``'s path into its empty sequence when none of
        the path's first node is in the cache, up to the first row the path needs: the restored
        nodes are in the cache as if decoded (a node that needed no rows counts as scored)."""
        path = self.paths[s]
        assert path is not None and self.store is not None
        first = path[0]
        if first.n_dec or first.holders or first.owner != -1:
            return
        limit = 0
        for node in path:
            n = node.n_feed
            if not node.scored:  # a row it needs: the token before it is decoded, for its logits
                rows = node.want[1 : n + 1].copy()
                if n == node.tokens.size and node.out_children:
                    rows = np.append(rows, True)
                hit = np.flatnonzero(rows)
                if hit.size:
                    n = int(hit[0])
            limit = node.start + n
            if n < node.n_feed:
                break
        if limit < self.store.chunk_size:
            return
        toks = np.concatenate([node.tokens for node in path])[:limit]
        got = self.store.restore(self.ctx, s, toks, keep=0)
        if not got:
            return
        for i, node in enumerate(path):
            n = min(got - node.start, node.n_feed)
            if n <= 0:
                break
            node.n_dec = n
            node.holders.add(s)
            self.live.add(node)
            if not node.scored:
                self.n_restored_new += n
            if n < node.n_feed:
                node.owner = s  # the rest is this slot's to feed
                break
            node.owner = -1
            if not node.scored:
                node.scored = True
                self.n_scored += 1
            self.held[s] = i + 1
        self.used += got
        self.stats.n_restored = (self.stats.n_restored or 0) + got

    def _save(self, s: int, node: _Node) -> None:
        """Store the new whole chunks of slot ``s``'s path up to ``node``'s end (fed whole now)."""
        assert self.store is not None
        path = self.paths[s]
        assert path is not None
        end = node.start + node.n_feed
        if end // self.store.chunk_size == 0:
            return
        toks = np.concatenate([n.tokens for n in path[: _depth_index(path, node) + 1]])[:end]
        self.store.save(self.ctx, s, toks)

    def _catch_up(self, s: int) -> int:
        """Give slot ``s`` the nodes of its path that are in the cache (one ``seq_cp`` from a
        slot that holds the deepest of them: a holder of a node holds its ancestors), up to the
        last node it needs. Returns the index of that node (-1: its path is all scored)."""
        path = self.paths[s]
        if path is None:
            return -1
        last = max((i for i, n in enumerate(path) if not n.scored), default=-1)
        i = j = self.held[s]
        while j <= last and path[j].n_dec == path[j].n_feed and path[j].owner == -1:
            j += 1
        deep = max((k for k in range(i, j) if path[k].n_feed), default=-1)
        if deep >= 0:
            if not path[deep].holders:  # a node in the cache always has a holder
                raise AssertionError("a node in the cache without a holder")
            src = min(path[deep].holders)
            self.ctx.memory.seq_cp(src, s, path[i].start, path[deep].start + path[deep].n_feed)
            for n in path[i : deep + 1]:
                n.holders.add(s)
        self.held[s] = j
        return last

    def _fill(self) -> list[Piece]:
        """The next batch: per slot with work, its path's next tokens, up to ``n_batch`` and the
        cells the epoch has left.

        A node is fed by one slot (its owner); a slot that reaches a node another slot puts
        whole into this batch joins it (its seq id is added to those tokens: one cell each,
        kv_unified) and goes on with its own nodes after it in the same batch, so a question and
        its endings go in one decode. A node the owner feeds over several batches is waited for,
        then taken with ``seq_cp``. Slots fill in index order, so the first slot with work always
        finishes its path within an epoch."""
        wo = self.order
        wo.clear()
        room = min(wo.room, self.n_ctx - self.used)
        whole: dict[int, Piece] = {}  # id(node) -> its piece, for the nodes put whole in this order
        for s, path in enumerate(self.paths):
            if path is None or room == 0:
                continue
            last = self._catch_up(s)
            i = self.held[s]
            while i <= last and room > 0:
                node = path[i]
                if node.owner not in (-1, s):
                    piece = whole.get(id(node))
                    if piece is None:
                        break  # another slot feeds it over several batches: wait for its cells
                    wo.join(piece, s)
                    piece.tag.joiners.append(s)
                    i += 1
                    continue
                node.owner = s
                j0 = node.n_dec
                take = min(room, node.n_feed - j0)
                j1 = j0 + take
                flags: str | np.ndarray = "none"  # a node decoded again needs no rows
                if not node.scored:
                    flags = np.zeros(take, bool)
                    nxt = np.arange(j0 + 1, j1 + 1)
                    inside = nxt < node.tokens.size
                    flags[inside] = node.want[nxt[inside]]
                    if j1 == node.tokens.size and node.out_children:
                        flags[-1] = True
                else:
                    self.stats.n_redecoded += take
                piece = wo.add(node.tokens[j0:j1], s, node.start + j0, flags, tag=_Seg(node, s), lo=j0)
                room -= take
                if j1 < node.n_feed:
                    break  # the rest of it in the next batch
                if j0 == 0:
                    whole[id(node)] = piece
                i += 1  # this slot goes on in the same batch: same sequence, next positions
        return wo.pieces

    def _decoded(self, pieces: list[Piece]) -> None:
        """After the decode: the rows' log-probabilities (each piece's ``rows``), the nodes' state."""
        n_out, n_tok = self.order.n_outputs, len(self.order)
        self.used += n_tok
        self.stats.n_decodes += 1
        self.stats.n_decoded += n_tok
        self.stats.n_outputs += n_out
        scored_now: list[_Node] = []
        if n_out:
            # per output row the token it predicts: the node's next one, or (at the node's last
            # token) the first token of its first child that wants it
            targets = [0] * n_out
            fed: list[tuple[_Node, int, list[int]]] = []  # per piece with rows: node, first row, tokens predicted
            extra: list[tuple[int, _Node]] = []  # (row, child) for the other children of a last row
            for p in pieces:
                if p.rows.start == p.rows.stop:
                    continue
                node = p.tag.node
                size = node.tokens.size
                js = (p.at + 1).tolist()
                fed.append((node, p.rows.start, js))
                for row, j in enumerate(js, p.rows.start):
                    if j < size:
                        targets[row] = int(node.tokens[j])
                    else:
                        first, *others = node.out_children
                        targets[row] = int(first.tokens[0])
                        extra.extend((row, ch) for ch in others)
            logits = self.ctx.logits_all()
            r = log_softmax(logits, targets, argmax=True, n_threads=self.n_threads)
            assert r.target is not None and r.argmax is not None
            lps, argmax = r.target.tolist(), r.argmax.tolist()
            for node, r0, js in fed:
                size = node.tokens.size
                for row, j in enumerate(js, r0):
                    dst, jd = (node, j) if j < size else (node.out_children[0], 0)
                    dst.lp[jd] = lps[row]
                    dst.greedy[jd] = argmax[row] == targets[row]
                    if jd == dst.tokens.size - 1:
                        scored_now.append(dst)
            if extra:
                # the same rows again (a copy of those few), the other children as targets
                ex = log_softmax(logits[[k for k, _ in extra]], [int(ch.tokens[0]) for _, ch in extra])
                assert ex.target is not None
                for (k, ch), lp in zip(extra, ex.target.tolist()):
                    ch.lp[0] = lp
                    ch.greedy[0] = argmax[k] == int(ch.tokens[0])
                    if ch.tokens.size == 1:
                        scored_now.append(ch)
            del logits, r  # no view of the outputs outlives this decode
        for p in pieces:
            seg = p.tag
            node = seg.node
            node.n_dec = p.hi
            node.holders.add(seg.slot)
            node.holders.update(seg.joiners)
            self.live.add(node)
            if p.hi == node.n_feed:
                node.owner = -1
                if self.store is not None and not node.scored:
                    self._save(seg.slot, node)
                node.scored = True
                self.n_scored += 1
                for t in (seg.slot, *seg.joiners):
                    self.held[t] = max(self.held[t], _depth_index(self.paths[t], node) + 1)
                for ch in node.out_children:  # a leaf of one token: its parent's last row scored it
                    if ch.n_feed == 0:
                        ch.scored = True
        if self.on_scored is not None:
            for node in scored_now:
                self.on_scored(node)

    def run(self) -> None:
        """Decode the whole trie."""
        while True:
            self._assign()
            if all(p is None for p in self.paths):
                if self.next_leaf >= len(self.leaves):
                    return
                if self.used == 0:  # cannot be: every path fits in n_ctx (checked before the walk)
                    raise AssertionError("a path does not fit in an empty epoch")
                self._new_epoch()  # the next leaf does not fit in the cells left
                continue
            pieces = self._fill()
            if not pieces:
                if all(self._done(s) for s in range(len(self.paths))):
                    continue  # scored by other slots' rows: free them and go on
                if self.used >= self.n_ctx:
                    if self.n_scored == self.n_scored_at_epoch:  # a path longer than n_ctx: never
                        raise AssertionError("an epoch scored nothing: a path does not fit in n_ctx")
                    self.n_scored_at_epoch = self.n_scored
                    self._new_epoch()
                    continue
                raise AssertionError("the walk made no progress")  # a slot waits only on one that feeds
            self.order.decode(self.ctx)
            self._decoded(pieces)


def _shared(old: list[_Node] | None, held: int, path: list[_Node]) -> int:
    """How many first nodes of ``path`` a slot that holds ``held`` nodes of ``old`` has."""
    k = 0
    if old is not None:
        n = min(held, len(path))
        while k < n and old[k] is path[k]:
            k += 1
    return k


def _depth_index(path: list[_Node] | None, node: _Node) -> int:
    assert path is not None
    for i, n in enumerate(path):
        if n is node:
            return i
    raise AssertionError("node not on the slot's path")


def _mark(n_ctxs: list[int], ends: list[_Node]) -> None:
    """Mark the continuation tokens of each unique request on its path."""
    for c, end in zip(n_ctxs, ends):
        node: _Node | None = end
        while node is not None and node.parent is not None and node.end > c:
            if node.want.size != node.tokens.size:
                node.want = np.zeros(node.tokens.size, bool)
            node.want[max(c, node.start) - node.start :] = True
            node = node.parent


def _finish_nodes(root: _Node) -> int:
    n = 0
    todo = list(root.children)
    while todo:
        node = todo.pop()
        n += 1
        size = node.tokens.size
        if node.want.size != size:
            node.want = np.zeros(size, bool)
        node.lp = np.full(size, np.nan)
        node.greedy = np.zeros(size, bool)
        node.n_feed = size if node.children else size - 1
        todo.extend(node.children)
    todo = list(root.children)
    while todo:
        node = todo.pop()
        node.out_children = [ch for ch in node.children if ch.want[0]]
        todo.extend(node.children)
    return n


def _trie_tokens(root: _Node) -> int:
    n, todo = 0, list(root.children)
    while todo:
        node = todo.pop()
        n += node.n_feed
        todo.extend(node.children)
    return n


def _result(seq: np.ndarray, c: int, end: _Node, n_bytes: int) -> Loglikelihood | None:
    parts, greedy = [], []
    node: _Node | None = end
    while node is not None and node.parent is not None and node.end > c:
        lo = max(c, node.start) - node.start
        parts.append(node.lp[lo:])
        greedy.append(node.greedy[lo:])
        node = node.parent
    lp = np.concatenate(parts[::-1])
    if np.isnan(lp).any():
        return None
    return Loglikelihood(
        float(lp.sum()), bool(np.concatenate(greedy).all()), int(lp.size), n_bytes, lp, seq[c:].copy(), c
    )


def loglikelihood(
    model_or_ctx: Model | Context,
    requests: Iterable[tuple[str, str] | tuple[npt.ArrayLike, npt.ArrayLike]],
    *,
    n_ctx: int | None = None,
    n_batch: int | None = None,
    n_seq_max: int | None = None,
    n_threads: int | None = None,
    progress: bool | None = None,
    parse_special: bool = False,
    prefix_store: PrefixStore | None = None,
    **ctx_kwargs: Any,
) -> Loglikelihoods:
    """The log-likelihood of each request's continuation given its context, every shared prefix
    of the whole list decoded once (lm-eval's ``LM.loglikelihood``).

    The requests are laid into a trie over their token ids and decoded depth first, each node
    once, its cells given to the sequences below it with ``llama_memory_seq_cp``; logits only at
    the rows that predict a continuation token, scored in place with
    :func:`pyllamacpp.scoring.log_softmax`. See the module's docstring for the walk, the
    tokenization at the boundary (lm-eval's) and Ctrl-C.

    Args:
        model_or_ctx: A :class:`Model` (a context with ``kv_unified=True`` is made for the call
            and closed after) or a :class:`Context`: all of its sequences are used (the last as
            the graveyard) and its memory is cleared before and after; with one sequence, or
            ``kv_unified=False``, only sequence 0 is used and cells are freed as branches end
            (cells cannot be shared between streams).
        requests: ``(context, continuation)`` pairs, both text or both token ids.
        n_ctx: KV cells of one epoch, shared by every sequence (with a Model; default the
            trie's tokens, at most ``min(n_ctx_train, 4096)`` or the longest request when that
            is more). A request needs its context and continuation, less the last token, within it.
        n_batch: Tokens per ``llama_decode``, also ``n_ubatch`` (with a Model; default 63: below
            64 flash attention's CPU kernel keeps the results bit-identical to each request
            decoded alone, see the module docstring).
        n_seq_max: Branches decoded at once, one sequence each (with a Model; default 16; the
            context gets one more, the graveyard).
        n_threads: ``n_threads`` and ``n_threads_batch`` of the context made (default: the
            physical cores).
        progress: A tqdm bar on stderr over the tokens to decode, the requests scored beside it
            (None: for at least 100 requests or 2,048 tokens, when stderr is a terminal).
        parse_special: ``llama_tokenize``'s ``parse_special`` for text requests.
        prefix_store: A :class:`~pyllamacpp.prefix_store.PrefixStore`: the trie's first nodes
            (the requests' shared context prefixes) are loaded from it where it holds them, and
            what is decoded is stored (see the module docstring); ``n_restored`` counts the
            tokens loaded. None: no store.
        **ctx_kwargs: Other fields of :class:`ContextParams` for the context made (``flash_attn``,
            ``type_k``...).

    Returns:
        A :class:`Loglikelihoods`: a list with one :class:`Loglikelihood` per request, in request
        order (identical requests share one result), and the run's counts.

    Raises:
        TypeError: ``requests`` is not a list of pairs, or a pair mixes text and tokens.
        ValueError: Before any decode: an empty continuation (or one that has no tokens after the
            context's), a context without tokens, a token outside the vocabulary, a request longer
            than ``n_ctx`` (by how many tokens), context keywords with a Context, or a model whose
            memory cannot be cut at a position (recurrent, hybrid, sliding window).
        KeyboardInterrupt: Ctrl-C (:class:`DecodeInterrupted` during a decode), with ``results``:
            a :class:`Loglikelihoods` of what was scored, None for the requests not scored, and
            the run's counts so far (``summary()``).
        DecodeError: A decode failed.
    """
    from ..params import default_n_ctx

    model, ctx = model_and_context(model_or_ctx)
    if ctx is not None and (any(v is not None for v in (n_ctx, n_batch, n_seq_max, n_threads)) or ctx_kwargs):
        raise ValueError("loglikelihood: n_ctx, n_batch, n_seq_max, n_threads and context keywords are for a Model")
    if model.n_swa or lib.llama_model_is_recurrent(model.ptr) or lib.llama_model_is_hybrid(model.ptr):
        raise ValueError(
            "loglikelihood needs a plain KV cache: a sliding window or a recurrent state cannot be cut "
            "back to a shared prefix (llama_memory_seq_rm of a tail)"
        )
    prepared = _prepare(model, requests, parse_special)
    # unique requests: same tokens and same context length
    index: dict[tuple[bytes, int], int] = {}
    which: list[int] = []
    uniq: list[tuple[np.ndarray, int, int]] = []
    for seq, c, nb in prepared:
        key = (seq.tobytes(), c)
        k = index.get(key)
        if k is None:
            k = index[key] = len(uniq)
            uniq.append((seq, c, nb))
        which.append(k)
    longest = max((int(seq.size) - 1 for seq, _, _ in uniq), default=0)
    if ctx is not None:
        cells = ctx.n_ctx_seq
    elif n_ctx is not None:
        cells = int(n_ctx)
    else:
        cap = model.n_ctx_train if model.n_ctx_train > 0 else max(4096, longest)
        cells = min(max(default_n_ctx(model.n_ctx_train), longest), cap)
    for i, (seq, c, _) in enumerate(prepared):
        if seq.size - 1 > cells:
            what = f"n_ctx={cells}" if ctx is not None or n_ctx is not None else f"n_ctx_train={cells}"
            raise ValueError(
                f"request {i} needs {seq.size - 1} tokens in the cache ({c} of context, {seq.size - c} of "
                f"continuation, less the last), {seq.size - 1 - cells} more than {what}"
            )
    out = Loglikelihoods([None] * len(prepared))
    out.n_requests, out.n_unique = len(prepared), len(uniq)
    out.n_unshared = sum(int(seq.size) - 1 for seq, _, _ in prepared)
    if not uniq:
        return out
    # the trie over the sorted unique sequences (sorted: depth-first order)
    order = sorted(range(len(uniq)), key=lambda k: uniq[k][0].tolist())
    sorted_seqs: list[np.ndarray] = []
    pos_of: dict[bytes, int] = {}
    for k in order:
        b = uniq[k][0].tobytes()
        if b not in pos_of:
            pos_of[b] = len(sorted_seqs)
            sorted_seqs.append(uniq[k][0])
    root, ends_sorted, leaves = _build(sorted_seqs)
    ends = [ends_sorted[pos_of[seq.tobytes()]] for seq, _, _ in uniq]
    _mark([u[1] for u in uniq], ends)
    out.n_nodes = _finish_nodes(root)
    if ctx is None and n_ctx is None:  # no more cells than the whole trie holds
        cells = min(cells, max(longest, _trie_tokens(root)))

    own = ctx is None
    if ctx is None:
        n_b = 63 if n_batch is None else int(n_batch)
        n_s = max(1, min(16 if n_seq_max is None else int(n_seq_max), len(leaves), n_b - 1))
        # one more sequence than slots: the graveyard that keeps finished branches' cells
        # n_ctx at least n_seq_max: llama.cpp reserves an output row per sequence, min(n_ctx, n_batch) of them
        kw: dict[str, Any] = {"n_ctx": max(cells, n_s + 1), "n_batch": n_b, "n_ubatch": n_b, "n_seq_max": n_s + 1}
        kw["kv_unified"] = True
        if n_threads is not None:
            kw["n_threads"] = kw["n_threads_batch"] = int(n_threads)
        kw.update(ctx_kwargs)
        ctx = model.context(**kw)
        n_slots, grave = ctx.n_seq_max - 1, ctx.n_seq_max - 1
    elif ctx.n_seq_max > 1 and ctx.params.kv_unified:
        n_slots, grave = min(ctx.n_seq_max - 1, len(leaves)), ctx.n_seq_max - 1
    else:  # one sequence, or one stream per sequence (no cells to share between them)
        n_slots, grave = 1, -1
    out.n_seq, out.n_ctx = n_slots, cells

    # requests (unique) ending at each node, to report them as their last token is scored
    at_node: dict[int, list[int]] = {}
    for k, e in enumerate(ends):
        at_node.setdefault(id(e), []).append(k)
    mult = np.bincount(np.asarray(which, np.int64), minlength=len(uniq)) if which else np.zeros(0, np.int64)
    done: list[Loglikelihood | None] = [None] * len(uniq)
    n_feed = _trie_tokens(root)
    big = len(prepared) >= _PROGRESS_MIN or n_feed >= _PROGRESS_TOKENS
    show = progress if progress is not None else (big and sys.stderr.isatty())
    bar: Any = None
    walk: _Walk | None = None
    n_done = 0  # requests scored (duplicates counted)
    if show:
        from tqdm import tqdm

        # by tokens, the work itself (one request may be thousands), with the requests scored beside
        bar = tqdm(total=n_feed, desc="loglikelihood", unit="tok", unit_scale=True, file=sys.stderr, leave=False)
        bar.set_postfix_str(f"0/{len(prepared)} requests", refresh=False)

    def tick() -> None:
        # tokens decoded for the first time (a node decoded again in a new epoch is no new work)
        fresh = walk.n_restored_new if walk is not None else 0
        bar.update(out.n_decoded - out.n_redecoded + fresh - bar.n)

    def scored(node: _Node) -> None:
        nonlocal n_done
        n = 0
        for k in at_node.get(id(node), ()):
            if done[k] is None:
                seq, c, nb = uniq[k]
                done[k] = _result(seq, c, ends[k], nb)
                if done[k] is not None:
                    n += int(mult[k])
        n_done += n
        if bar is not None and n:
            bar.set_postfix_str(f"{n_done}/{len(prepared)} requests", refresh=False)
            tick()

    own_decode = "decode" in vars(ctx)  # a caller's own ctx.decode (a test's spy) is put back after
    real_decode = ctx.decode
    if bar is not None:  # the bar moves before each decode: one long node is many decodes

        def decode(batch: Any, *args: Any, **kwargs: Any) -> Any:
            tick()
            return real_decode(batch, *args, **kwargs)

        ctx.decode = decode  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        if prefix_store is not None:
            from ..prefix_store import PrefixStore

            if not isinstance(prefix_store, PrefixStore):
                raise TypeError(
                    f"prefix_store must be a pyllamacpp.prefix_store.PrefixStore, got {type(prefix_store).__name__}"
                )
            prefix_store.keys(ctx, np.zeros(0, np.int32))  # the context's identity, before any decode
            out.n_restored = 0
        ctx.memory.clear()
        walk = _Walk(ctx, leaves, n_slots, grave, cells, out, prefix_store)
        walk.on_scored = scored
        walk.run()
    except KeyboardInterrupt as e:
        for k in range(len(uniq)):  # what was scored, whether or not its node was reported
            if done[k] is None:
                seq, c, nb = uniq[k]
                done[k] = _result(seq, c, ends[k], nb)
        part = Loglikelihoods(done[k] for k in which)  # what was scored, with the run's counts so far
        part.__dict__.update(vars(out))
        part.seconds = time.perf_counter() - t0
        e.results = part  # type: ignore[attr-defined]
        raise
    finally:
        out.seconds = time.perf_counter() - t0
        if bar is not None:
            bar.close()
            if own_decode:
                ctx.decode = real_decode  # type: ignore[method-assign]
            else:
                del ctx.decode
        if own:
            ctx.close()
        elif not ctx.closed:
            ctx.memory.clear()
    for k in range(len(uniq)):
        if done[k] is None:
            seq, c, nb = uniq[k]
            done[k] = _result(seq, c, ends[k], nb)
    for i, k in enumerate(which):
        r = done[k]
        nb = prepared[i][2]
        out[i] = r if r is None or r.n_bytes == nb else dataclasses.replace(r, n_bytes=nb)
    return out
