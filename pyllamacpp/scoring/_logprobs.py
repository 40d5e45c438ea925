"""``Completion.logprobs``: llama-cpp-python's ``logprobs=k`` of a completion, recorded token by
token from the logits each token was sampled from."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from ._rows import log_softmax

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model


class CompletionLogprobs(TypedDict):
    """``Completion.logprobs``: what llama-cpp-python's ``create_completion(logprobs=k)`` returns
    in ``choices[0]["logprobs"]``, for the generated tokens (an end-of-generation token left out).

    ``tokens[i]`` is the token's own text (its bytes decoded, an incomplete character dropped, as
    there); ``text_offset[i]`` the length of the prompt plus the text generated before it;
    ``token_logprobs[i]`` its log-probability under the model's logits (the raw logits, not the
    sampler's distribution); ``top_logprobs[i]`` the ``k`` most likely tokens' texts with their
    log-probabilities, and the token's own. ``token_ids`` (not in llama-cpp-python) keeps the ids,
    which texts may not tell apart.
    """

    tokens: list[str]
    text_offset: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    token_ids: list[int]


class LogprobsRecorder:
    """Fills a :class:`CompletionLogprobs` token by token from the logits the token was sampled
    from (``ctx.logits(-1)``, read in place, before the next decode overwrites it).

    Args:
        model: The model (its vocabulary gives the top tokens' text).
        top_k: How many most likely tokens to keep per position (0: none, the chosen one only).
        offset: ``text_offset`` of the first generated token (the prompt's length in characters).

    Raises:
        ValueError: ``top_k`` is not an int in ``[0, n_vocab]``.
    """

    def __init__(self, model: Model, top_k: int, offset: int) -> None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= model.n_vocab:
            raise ValueError(f"logprobs must be an int in [0, n_vocab={model.n_vocab}] or None, not {top_k!r}")
        self.model, self.k, self.offset = model, top_k, offset
        self.data: CompletionLogprobs = {
            "tokens": [],
            "text_offset": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "token_ids": [],
        }

    def _text(self, token: int) -> str:
        return self.model.token_to_bytes(token).decode("utf-8", "ignore")

    def wrap(self, feed: Callable[[int], str], ctx: Context) -> Callable[[int], str]:
        """``feed`` (a Detokenizer's) that also records each token it is given."""

        def recording_feed(token: int) -> str:
            piece = feed(token)
            self.add(ctx, token, piece)
            return piece

        return recording_feed

    def add(self, ctx: Context, token: int, piece: str) -> None:
        r = log_softmax(ctx.logits(-1), [token], top_k=self.k, n_threads=1)
        assert r.target is not None
        lp, text = float(r.target[0]), self._text(token)
        top: dict[str, float] = {}
        if self.k:
            assert r.top_ids is not None and r.top_logprobs is not None
            top = {self._text(int(i)): float(v) for i, v in zip(r.top_ids[0], r.top_logprobs[0])}
        top[text] = lp
        d = self.data
        d["tokens"].append(text)
        d["text_offset"].append(self.offset)
        d["token_logprobs"].append(lp)
        d["top_logprobs"].append(top)
        d["token_ids"].append(int(token))
        self.offset += len(piece)
