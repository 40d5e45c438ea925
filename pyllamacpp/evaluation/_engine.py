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
chunks up to its end; ``n_restored`` counts the tokens loaded. A slot whose path starts with nodes
another slot holds whole loads its own copy of them with the stored chunks past them, when the store
holds at least a chunk more, none of it in the cache, and the epoch has cells spare for the copy
(otherwise it copies them with ``seq_cp``): a rerun loads each request's own stored chunks too. A
restored cell holds the bytes a
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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._lib import lib
from ..packing import model_and_context, release

# encode_pair stays importable from here: lm_eval, the tests and tools/bench import it from _engine
from ._trie import _build, _finish_nodes, _mark, _Node, _prepare, _trie_tokens, encode_pair
from ._walk import _Walk

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model
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


# -- results ---------------------------------------------------------------------------------------
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
            context gets one more, the graveyard). At most ``n_batch - 1`` (llama.cpp reserves an
            output row per sequence); ``n_batch`` 1 decodes one branch in one sequence, without
            a graveyard.
        n_threads: ``n_threads`` and ``n_threads_batch`` of the context made (default: the
            physical cores).
        progress: A tqdm bar on stderr over the tokens to decode, the requests scored beside it,
            wiped when the run ends (None: for at least 100 requests or 2,048 tokens, when stderr
            is a terminal).
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
        ValueError: Before any decode: ``n_ctx``, ``n_batch``, ``n_seq_max`` or ``n_threads``
            below 1, an empty continuation (or one that has no tokens after the context's), a
            context without tokens, a token outside the vocabulary, a request longer
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
    for name, v in (("n_ctx", n_ctx), ("n_batch", n_batch), ("n_seq_max", n_seq_max), ("n_threads", n_threads)):
        if v is not None and int(v) < 1:
            raise ValueError(f"loglikelihood: {name} must be positive, not {v}")
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
        # a sequence per slot and one more, the graveyard that keeps finished branches' cells;
        # llama.cpp reserves an output row per sequence (min(n_ctx, n_batch) of them), so with
        # n_batch 1 the one sequence is the slot, without a graveyard (as a Context of one sequence)
        n_seq = 1 + min(16 if n_seq_max is None else int(n_seq_max), len(leaves), n_b - 1)
        kw: dict[str, Any] = {"n_ctx": max(cells, n_seq), "n_batch": n_b, "n_ubatch": n_b, "n_seq_max": n_seq}
        kw["kv_unified"] = True
        if n_threads is not None:
            kw["n_threads"] = kw["n_threads_batch"] = int(n_threads)
        kw.update(ctx_kwargs)
        ctx = model.context(**kw)
    if ctx.n_seq_max > 1 and ctx.params.kv_unified:
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
        if walk is not None:  # walk -> scored -> tick -> walk: a cycle that kept the bar and ctx until a GC
            walk.on_scored = None
        if bar is not None:
            bar.close()
            if own_decode:
                ctx.decode = real_decode  # type: ignore[method-assign]
            else:
                del ctx.decode
        release(ctx, own)
    for k in range(len(uniq)):
        if done[k] is None:
            seq, c, nb = uniq[k]
            done[k] = _result(seq, c, ends[k], nb)
    for i, k in enumerate(which):
        r = done[k]
        nb = prepared[i][2]
        out[i] = r if r is None or r.n_bytes == nb else dataclasses.replace(r, n_bytes=nb)
    return out
