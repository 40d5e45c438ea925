"""Text in, text out: ``complete`` and ``chat`` over :func:`pyllamacpp.generate`, and the streaming
detokenizer under them.

A token is bytes, not always whole characters: this model writes "😀" as three tokens
(``f0 9f`` / ``98`` / ``80``). :class:`Detokenizer` holds back an incomplete UTF-8 sequence until
the token that completes it arrives, so no piece a stream yields ends inside a character; what is
left at the end (a character cut by ``n_predict``) becomes U+FFFD, as ``llama_detokenize`` output
decoded with ``errors="replace"`` does.

Contexts: without ``ctx=``, a call makes a context just large enough for the prompt and
``n_predict`` tokens (at most ``n_ctx_train``; with ``n_predict=-1`` the default ``n_ctx``) and
closes it when the text is done, when a stream is closed, or when an abandoned stream is
collected. With ``ctx=``, the call first clears sequence ``seq_id`` (0 by default,
``llama_memory_seq_rm(mem, seq_id, -1, -1)``), leaves the other sequences alone, and does not close
the context; afterwards the sequence holds the prompt and every sampled token but the last (the
convention of :mod:`pyllamacpp.generation`). To continue a sequence instead, use
:func:`pyllamacpp.generate`.

Stop strings (``stop=``, a str or a list of them): the text ends just before the first stop string
that appears in it, even one that spans tokens, and ``finish_reason`` is ``"stop"``. Generation
ends with the token that completed it: that token is not decoded (the sequence holds the prompt
and every sampled token but the last, as above) and no token after it is sampled. A stream holds
back only the longest end of its text that is still the beginning of some stop string, and
releases it as soon as the next text shows it is not one (or when generation ends).
"""

from __future__ import annotations

import codecs
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

from .generation import FinishReason, Generation, generate
from .sampling import Sampler

if TYPE_CHECKING:
    from .context import Context
    from .model import Model
    from .scoring import CompletionLogprobs, LogprobsRecorder

TextFinishReason = Literal[FinishReason, "stop"]
"""How a text ended: :mod:`pyllamacpp.generation`'s reasons, and ``"stop"`` for a stop string."""


class Detokenizer:
    """Token ids to text, one token at a time, never splitting a UTF-8 character.

    Each token's bytes come from ``llama_token_to_piece`` (:meth:`Model.token_to_bytes`); an
    incremental UTF-8 decoder keeps the bytes of a character not yet complete. A token's bytes
    (and its text, when they are whole characters) are kept per model, so a token is asked of
    llama.cpp once.
    Special (control) tokens give no text unless ``special=True``, as in llama.cpp's server by default.

    Args:
        model: The model whose vocabulary the tokens are from.
        special: Render special (control) tokens as their text.
    """

    def __init__(self, model: Model, special: bool = False) -> None:
        self.model, self.special = model, special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # token -> (bytes, is_eog, text), asked of llama.cpp once per model and token
        self._info = model._tokens[bool(special)]
        self._held = False  # the decoder holds the first bytes of a character

    def feed(self, token: int) -> str:
        """The text ``token`` completes (``llama_token_to_piece``).

        Args:
            token: The next token id.

        Returns:
            The text it completes; "" while a character is still incomplete.

        Raises:
            ValueError: The token is outside the vocabulary.
            ClosedError: The model is closed.
        """
        if self.model._h is None:
            self.model.ptr  # noqa: B018 (raises ClosedError: a cached token asks nothing of it)
        data, _, text = self._info[token]
        if text is not None and not self._held:  # whole characters by itself
            return text
        text = self._decoder.decode(data)  # part of a character, or after one held back
        self._held = bool(self._decoder.getstate()[0])
        return text

    def flush(self) -> str:
        """What is held back, as U+FFFD for an incomplete character (then ready for new text).

        Returns:
            The held-back text ("" when nothing is held back).
        """
        self._held = False
        return self._decoder.decode(b"", True)


class Completion(str):
    """The text of :func:`complete` / :func:`chat`, a ``str`` that also says how it ended.

    Attributes:
        finish_reason: ``"eog"``, ``"n_predict"`` or ``"ctx_full"`` (see :mod:`pyllamacpp.generation`),
            or ``"stop"`` when a stop string ended the text.
        tokens: Every sampled token (an end-of-generation token included; it adds no text; with
            ``"stop"``, the last is the token that completed the stop string).
        n_prompt: The prompt's tokens.
        logprobs: With ``logprobs=k``, the generated tokens' log-probabilities as llama-cpp-python
            gives them (:class:`~pyllamacpp.scoring.CompletionLogprobs`); else None.
    """

    finish_reason: TextFinishReason
    tokens: list[int]
    n_prompt: int
    logprobs: CompletionLogprobs | None = None

    def __new__(cls, text: str, finish_reason: TextFinishReason, tokens: list[int], n_prompt: int) -> Completion:
        self = super().__new__(cls, text)
        self.finish_reason, self.tokens, self.n_prompt = finish_reason, tokens, n_prompt
        return self


@dataclass(slots=True)
class _StreamState:
    """What a TextStream's generator uses and writes (the stream object itself stays out of its
    reach, so dropping the stream closes the generator and frees the context at once)."""

    model: Model
    ctx: Context
    own_ctx: bool
    sampler: Sampler
    own_sampler: bool
    seq_id: int
    stop: tuple[str, ...] = ()
    logprobs: LogprobsRecorder | None = None
    pieces: list[str] = field(default_factory=list)
    generation: Generation | None = None
    finish_reason: TextFinishReason | None = None

    def release(self) -> None:
        if self.own_ctx:
            self.ctx.close()
        if self.own_sampler:
            self.sampler.close()


class TextStream:
    """Pieces of text as tokens are generated: what ``complete``/``chat`` return with ``stream=True``.

    Whole characters only: a token that ends inside a character yields nothing until the next one
    completes it. With stop strings, text that may be the start of one is held back until it is
    known not to be (no piece holds a stop string or text after one).

    ``close()`` (or leaving a ``with`` block, or dropping the stream) stops generation and closes
    the context when the call made it. Its attributes fill in as it runs.

    Attributes:
        ctx: The :class:`Context` it decodes in (its own, or the ``ctx=`` given).
        seq_id: The sequence it uses.
        n_prompt: The prompt's tokens.
        tokens: The tokens sampled so far.
        text: The text yielded so far.
        finish_reason: ``"eog"``, ``"n_predict"``, ``"ctx_full"`` or ``"stop"`` once exhausted, else None.
        generation: The underlying :class:`Generation` once started (its ``error`` says why
            the context was full).

    Args:
        model: The model.
        tokens: The prompt's token ids.
        n_predict: Most tokens to sample (-1: no limit).
        sampler: A :class:`Sampler` used as is; None: a greedy one, closed with the stream.
        ctx: A context to decode in; None: one is made for the prompt and ``n_predict`` tokens,
            and closed with the stream.
        seq_id: The sequence to use.
        stop: Stop strings: a str, a list of them, or None.
        logprobs: Record each generated token's log-probability and the ``logprobs`` most likely
            tokens' (``.logprobs``); None: not.

    Raises:
        ValueError: No tokens, a bad ``seq_id``, a ``ctx`` of another model, a prompt longer
            than the context (``n_ctx_seq``), or an empty stop string.
        TypeError: ``stop`` is not a str or a list of str.
        ContextError: A context could not be made.
        ClosedError: The model or ``ctx`` is closed.
    """

    def __init__(
        self,
        model: Model,
        tokens: np.ndarray,
        n_predict: int,
        sampler: Sampler | None,
        ctx: Context | None,
        seq_id: int,
        stop: str | Sequence[str] | None = None,
        logprobs: int | None = None,
    ) -> None:
        stops = _stop_strings(stop)
        rec = None
        if logprobs is not None:  # text offsets count the prompt's characters, as llama-cpp-python's
            from .scoring import LogprobsRecorder

            rec = LogprobsRecorder(model, logprobs, len(model.detokenize(tokens)))
        if tokens.size == 0:
            raise ValueError("the prompt gave no tokens")
        if not isinstance(seq_id, int) or seq_id < 0:
            raise ValueError(f"seq_id must be an int >= 0, not {seq_id!r}")
        own_ctx = ctx is None
        if ctx is None:
            n_ctx = None if n_predict < 0 else int(tokens.size) + n_predict
            if n_ctx is not None and model.n_ctx_train > 0:
                n_ctx = min(n_ctx, model.n_ctx_train)
            ctx = model.context(n_ctx=n_ctx)
        elif ctx.model is not model:
            raise ValueError("ctx= is a context of another model")
        if tokens.size > ctx.n_ctx_seq:
            if own_ctx:
                ctx.close()
            raise ValueError(
                f"the prompt is {tokens.size} tokens, more than the context holds (n_ctx_seq={ctx.n_ctx_seq})"
            )
        self._st = _StreamState(model, ctx, own_ctx, sampler or Sampler.greedy(), sampler is None, seq_id, stops, rec)
        self.n_prompt = int(tokens.size)
        self._it = _stream(self._st, tokens, n_predict)

    @property
    def ctx(self) -> Context:
        """The context the stream decodes in (its own, or the ``ctx`` passed)."""
        return self._st.ctx

    @property
    def seq_id(self) -> int:
        """The sequence the stream uses."""
        return self._st.seq_id

    @property
    def generation(self) -> Generation | None:
        """The underlying :class:`Generation` once started, else None."""
        return self._st.generation

    @property
    def finish_reason(self) -> TextFinishReason | None:
        """``"eog"``, ``"n_predict"``, ``"ctx_full"`` or ``"stop"`` once exhausted, else None."""
        return self._st.finish_reason

    @property
    def tokens(self) -> list[int]:
        """The tokens sampled so far."""
        g = self._st.generation
        return g.tokens if g is not None else []

    @property
    def text(self) -> str:
        """The text yielded so far."""
        return "".join(self._st.pieces)

    @property
    def logprobs(self) -> CompletionLogprobs | None:
        """With ``logprobs=k``: the log-probabilities of the tokens generated so far, else None."""
        return self._st.logprobs.data if self._st.logprobs is not None else None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._it)

    def close(self) -> None:
        """Stop generating; close the context and sampler this call made (idempotent)."""
        self._it.close()
        self._st.release()

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TextStream {len(self.tokens)} tokens, finish_reason={self.finish_reason!r}>"


def _stream(st: _StreamState, tokens: np.ndarray, n_predict: int) -> Generator[str, None, None]:
    try:
        ctx = st.ctx
        if not st.own_ctx:
            ctx.memory.seq_rm(st.seq_id)  # a fresh sequence, whatever it held
        gen = st.generation = generate(ctx, tokens, n_predict, st.sampler, st.seq_id)
        detok = Detokenizer(st.model)
        if st.logprobs is not None:  # each fed token's log-probability, from the logits it was sampled from
            detok.feed = st.logprobs.wrap(detok.feed, ctx)  # type: ignore[method-assign,assignment]
        feed, keep, info = detok.feed, st.pieces.append, st.model._tokens[0]
        if st.stop:
            yield from _until_stop(st, gen, detok)
            return
        for tok in gen:
            if info[tok][1]:  # is_eog
                continue  # the last token: it ends generation and writes nothing
            piece = feed(tok)
            if piece:
                keep(piece)
                yield piece
        tail = detok.flush()
        if tail:
            keep(tail)
            yield tail
        st.finish_reason = gen.finish_reason
    finally:
        if st.generation is not None:
            st.generation.close()
        st.release()


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop=`` as a tuple of non-empty strings."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop must be a str or a list of str, not {stop!r}")
    if not all(stops):
        raise ValueError("stop: an empty stop string would end every text before it starts")
    return tuple(dict.fromkeys(stops))  # once each, in the order given


def _until_stop(st: _StreamState, gen: Generation, detok: Detokenizer) -> Generator[str, None, None]:
    """The text of ``gen`` up to the first stop string; ``st.finish_reason`` set at the end.

    ``held`` is the longest end of the text that is the start of a stop string, not yet yielded:
    a stop string not seen yet cannot begin before it, so ``held + piece`` is all a search needs."""
    stops, keep, info, feed = st.stop, st.pieces.append, st.model._tokens[0], detok.feed
    starts = {s[:i] for s in stops for i in range(1, len(s))}  # every proper prefix of a stop string
    longest = max(map(len, stops)) - 1
    held = ""

    def first_stop(text: str) -> int:
        found = [i for i in map(text.find, stops) if i >= 0]
        return min(found) if found else -1

    for tok in gen:
        if info[tok][1]:  # is_eog: ends generation, writes nothing
            continue
        piece = feed(tok)
        if not piece:
            continue
        text = held + piece
        cut = first_stop(text)
        if cut >= 0:  # returning closes gen before it decodes this token (no wasted decode)
            if cut:
                keep(text[:cut])
                yield text[:cut]
            st.finish_reason = "stop"
            return
        n = min(len(text), longest)
        while n and text[-n:] not in starts:
            n -= 1
        held, out = (text[-n:], text[:-n]) if n else ("", text)
        if out:
            keep(out)
            yield out
    text = held + detok.flush()  # generation ended: what was held is no stop string
    cut = first_stop(text)
    if cut >= 0:
        text = text[:cut]
    if text:
        keep(text)
        yield text
    st.finish_reason = "stop" if cut >= 0 else gen.finish_reason


def _finish(stream: TextStream) -> Completion:
    with stream:
        for _ in stream:
            pass
    assert stream.finish_reason is not None
    c = Completion(stream.text, stream.finish_reason, list(stream.tokens), stream.n_prompt)
    c.logprobs = stream.logprobs
    return c


@overload
def complete(
    model: Model,
    prompt: str,
    n_predict: int = ...,
    *,
    sampler: Sampler | None = ...,
    ctx: Context | None = ...,
    stream: Literal[False] = ...,
    add_special: bool = ...,
    parse_special: bool = ...,
    seq_id: int = ...,
    stop: str | Sequence[str] | None = ...,
    logprobs: int | None = ...,
) -> Completion: ...


@overload
def complete(
    model: Model,
    prompt: str,
    n_predict: int = ...,
    *,
    sampler: Sampler | None = ...,
    ctx: Context | None = ...,
    stream: Literal[True],
    add_special: bool = ...,
    parse_special: bool = ...,
    seq_id: int = ...,
    stop: str | Sequence[str] | None = ...,
    logprobs: int | None = ...,
) -> TextStream: ...


@overload
def complete(
    model: Model,
    prompt: str,
    n_predict: int = ...,
    *,
    sampler: Sampler | None = ...,
    ctx: Context | None = ...,
    stream: bool,
    add_special: bool = ...,
    parse_special: bool = ...,
    seq_id: int = ...,
    stop: str | Sequence[str] | None = ...,
    logprobs: int | None = ...,
) -> Completion | TextStream: ...


def complete(
    model: Model,
    prompt: str,
    n_predict: int = 128,
    *,
    sampler: Sampler | None = None,
    ctx: Context | None = None,
    stream: bool = False,
    add_special: bool = True,
    parse_special: bool = False,
    seq_id: int = 0,
    stop: str | Sequence[str] | None = None,
    logprobs: int | None = None,
) -> Completion | TextStream:
    """Generate text after ``prompt``.

    ``llama_tokenize``, then :func:`pyllamacpp.generate` (``llama_decode``, ``llama_sampler_sample``),
    then :class:`Detokenizer` (``llama_token_to_piece`` per token).

    Args:
        model: The :class:`Model`.
        prompt: The text to continue.
        n_predict: Most tokens to sample (-1: until an end-of-generation token or a full context).
        sampler: A :class:`Sampler`, used as is (not reset, not closed); greedy when None.
        ctx: A :class:`Context` to decode in; sequence ``seq_id`` is cleared first and the context
            stays open. None: a context of ``n_prompt + n_predict`` cells is made and closed after.
        stream: Return a :class:`TextStream` of pieces instead of the whole text.
        add_special: ``llama_tokenize``'s ``add_special`` (BOS where the model wants one).
        parse_special: ``llama_tokenize``'s ``parse_special`` (``<|im_start|>`` as one token).
        seq_id: The sequence to use in ``ctx``.
        stop: A stop string or a list of them: the text ends just before the first one that
            appears (``finish_reason`` ``"stop"``); see the module's docstring.
        logprobs: ``k``: also give each generated token's log-probability and the ``k`` most
            likely tokens' (``Completion.logprobs``, ``TextStream.logprobs``), as llama-cpp-python's
            ``logprobs=k``; from the model's logits, whatever the sampler. With ``stop``, the token
            that completed the stop string is included.

    Returns:
        A :class:`Completion` (a ``str`` with ``finish_reason``, ``tokens``, ``n_prompt``), or with
        ``stream=True`` a :class:`TextStream`.

    Raises:
        TypeError: ``prompt`` is not a str (token ids go to :func:`pyllamacpp.generate`), or
            ``stop`` is not a str or a list of str.
        ValueError: An empty prompt, a prompt longer than the context, a ``ctx`` of another model,
            a bad ``seq_id``, an empty stop string, ``logprobs`` outside ``[0, n_vocab]``.
        ContextError: The context could not be made.
        DecodeAborted: ``ctx.abort()`` stopped a decode.
        DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
        DecodeError: Another ``llama_decode`` failure.
        ClosedError: The model, context or sampler was closed.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, not {type(prompt).__name__} (use generate() for token ids)")
    tokens = model.tokenize(prompt, add_special, parse_special)
    s = TextStream(model, tokens, int(n_predict), sampler, ctx, seq_id, stop, logprobs)
    return s if stream else _finish(s)


def chat_tokens(model: Model, messages: list[dict[str, str]], template: str | None = None) -> np.ndarray:
    """The prompt :func:`chat` decodes, as token ids.

    ``llama_chat_apply_template`` with the assistant's turn opened, tokenized (``llama_tokenize``)
    with special tokens parsed (``<|im_start|>`` is one control token, not text), and BOS added
    where the model wants one but not twice when the template wrote it.

    Args:
        model: The :class:`Model`.
        messages: ``[{"role": ..., "content": ...}, ...]``.
        template: A template (or a built-in template's name) instead of the model's.

    Returns:
        An int32 array of token ids.

    Raises:
        ValueError: No messages, the model has no chat template and none was given, or llama.cpp
            does not support the template.
        TypeError: A message that is not a dict with ``role`` and ``content`` strings.
        ClosedError: The model is closed.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content' strings, not {m!r}")
    text = model.apply_chat_template(list(messages), add_assistant=True, template=template)
    toks = model.tokenize(text, add_special=True, parse_special=True)
    bos = model.bos
    if toks.size >= 2 and bos >= 0 and toks[0] == bos and toks[1] == bos:
        toks = toks[1:]  # the template wrote BOS itself
    return toks


@overload
def chat(
    model: Model,
    messages: list[dict[str, str]],
    n_predict: int = ...,
    *,
    sampler: Sampler | None = ...,
    ctx: Context | None = ...,
    stream: Literal[False] = ...,
    template: str | None = ...,
    seq_id: int = ...,
    stop: str | Sequence[str] | None = ...,
) -> Completion: ...


@overload
def chat(
    model: Model,
    messages: list[dict[str, str]],
    n_predict: int = ...,
    *,
    sampler: Sampler | None = ...,
    ctx: Context | None = ...,
    stream: Literal[True],
    template: str | None = ...,
    seq_id: int = ...,
    stop: str | Sequence[str] | None = ...,
) -> TextStream: ...


@overload
def chat(
    model: Model,
    messages: list[dict[str, str]],
    n_predict: int = ...,
    *,
    sampler: Sampler | None = ...,
    ctx: Context | None = ...,
    stream: bool,
    template: str | None = ...,
    seq_id: int = ...,
    stop: str | Sequence[str] | None = ...,
) -> Completion | TextStream: ...


def chat(
    model: Model,
    messages: list[dict[str, str]],
    n_predict: int = 256,
    *,
    sampler: Sampler | None = None,
    ctx: Context | None = None,
    stream: bool = False,
    template: str | None = None,
    seq_id: int = 0,
    stop: str | Sequence[str] | None = None,
) -> Completion | TextStream:
    """The assistant's answer to ``messages``, through the GGUF's chat template.

    ``llama_chat_apply_template`` (see :func:`chat_tokens`), then as :func:`complete`.

    The whole conversation is decoded each call (sequence ``seq_id`` of ``ctx`` is cleared first).

    Args:
        model: The :class:`Model`.
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        n_predict: Most tokens to sample (-1: no limit).
        sampler: A :class:`Sampler` used as is; greedy when None.
        ctx: A :class:`Context` to decode in (see :func:`complete`).
        stream: Return a :class:`TextStream` instead of the whole answer.
        template: A template (or a built-in template's name, e.g. ``"chatml"``) instead of the model's.
        seq_id: The sequence to use in ``ctx``.
        stop: A stop string or a list of them (see :func:`complete`).

    Returns:
        A :class:`Completion`, or with ``stream=True`` a :class:`TextStream`.

    Raises:
        ValueError: No messages, no usable template, a prompt longer than the context, a ``ctx``
            of another model, a bad ``seq_id``, an empty stop string.
        TypeError: A message that is not a dict with ``role`` and ``content`` strings, or a
            ``stop`` that is not a str or a list of str.
        ContextError: The context could not be made.
        DecodeAborted: ``ctx.abort()`` stopped a decode.
        DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
        DecodeError: Another ``llama_decode`` failure.
        ClosedError: The model, context or sampler was closed.
    """
    tokens = chat_tokens(model, messages, template)
    s = TextStream(model, tokens, int(n_predict), sampler, ctx, seq_id, stop)
    return s if stream else _finish(s)
