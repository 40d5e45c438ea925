"""Requests to tokens at lm-eval's boundary, and the trie over them, for :func:`~pyllamacpp.evaluation.loglikelihood`.

The requests are checked and tokenized as lm-eval's ``TemplateLM._encode_pair`` does, then laid into
a trie over their token ids (a radix tree: one node per run of tokens that the same requests share).
The module docstring of ``pyllamacpp.evaluation._engine`` tells the whole story.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..packing import common_prefix

if TYPE_CHECKING:
    from ..model import Model


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
