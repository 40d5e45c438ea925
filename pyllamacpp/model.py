"""``Model``: a loaded GGUF (``llama_model``) with its vocabulary."""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _log
from ._handle import Handle, Owner
from ._lib import ffi, lib
from .errors import ClosedError, ModelLoadError, check_ptr
from .params import ggml_type, model_params

if TYPE_CHECKING:
    from .context import Context
    from .params import ContextParams
    from .sampling import Sampler
    from .scoring import Scores
    from .text import Completion, TextStream


class _TokenTable(dict):
    """``token -> (bytes, is_eog, text)``, each asked of llama.cpp once per model and distinct token
    (``llama_token_to_piece``, ``llama_vocab_is_eog``): a dict hit costs less than those calls, or
    than ``Model.is_eog``'s property chain, for every sampled token. ``text`` is the bytes decoded
    when they are whole UTF-8 characters by themselves, else None (part of a character: an
    incremental decoder takes the bytes). One per model and ``special`` setting
    (:meth:`Model._tokens`), shared by ``generate``, ``generate_parallel``, :class:`Detokenizer`,
    the text streams and the :class:`Scheduler`. A miss on a closed model raises ``ClosedError``,
    on a token outside the vocabulary ``ValueError``; a hit asks nothing of the model."""

    __slots__ = ("_model", "_special")

    def __init__(self, model: Model, special: bool) -> None:
        super().__init__()
        # weak: the model holds its tables, and a cycle would keep it (and its C model) until the
        # garbage collector runs instead of freeing it with its last reference
        self._model, self._special = weakref.ref(model), special

    def __missing__(self, token: int) -> tuple[bytes, bool, str | None]:
        m = self._model()
        if m is None:
            raise ClosedError("the model is gone")
        data = m.token_to_bytes(token, self._special)  # checks the token and the model
        try:
            text: str | None = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None  # part of a character, or invalid bytes
        v = self[token] = (data, bool(lib.llama_vocab_is_eog(m._vocab_ptr(), token)), text)
        return v


_BUFFER_LINE = re.compile(
    r"([\w\[\]:.\-]+)\s+(model|KV|compute|output|RS|compute_meta)\s+buffer size\s*=\s*([\d.]+)\s*MiB"
)


def parse_buffer_sizes(lines: Iterable[tuple[int, str]]) -> dict[str, dict[str, float]]:
    """Buffer sizes from llama.cpp's ``... buffer size = N MiB`` log lines.

    Kinds are llama.cpp's words: ``model`` (weights), ``KV`` (KV cache), ``RS`` (recurrent state),
    ``compute`` (scheduler's compute buffer), ``output`` (logits/embeddings).

    Args:
        lines: Captured log lines, ``(level, text)`` pairs.

    Returns:
        ``{backend buffer name: {kind: MiB}}``, sizes of one name and kind summed.
    """
    out: dict[str, dict[str, float]] = {}
    for _, text in lines:
        m = _BUFFER_LINE.search(text)
        if m:
            backend, kind, mib = m.group(1), m.group(2), float(m.group(3))
            out.setdefault(backend, {})
            out[backend][kind] = out[backend].get(kind, 0.0) + mib
    return out


def c_string(fn: Callable[..., int], *args: Any, size: int = 256) -> str:
    """The string a llama.cpp ``(..., char *buf, size_t buf_size)`` function writes, snprintf-style.

    Such functions (``llama_model_desc``, ``llama_model_meta_val_str``,
    ``llama_adapter_meta_val_str``...) return the length the whole string needs: when it did not
    fit, the call is made again with a buffer that size.

    Args:
        fn: The llama.cpp function (from ``lib``).
        *args: Its arguments before the buffer.
        size: The first buffer's size.

    Returns:
        The string (UTF-8, undecodable bytes replaced); ``""`` when the function returns < 0.
    """
    buf = ffi.new("char[]", size)
    n = fn(*args, buf, size)
    if n < 0:
        return ""
    if n >= size:
        buf = ffi.new("char[]", n + 1)
        n = fn(*args, buf, n + 1)
    return ffi.string(buf, n).decode("utf-8", "replace")


class Model(Owner):
    """A loaded GGUF model (``llama_model``) and its vocabulary.

    Wraps ``llama_model_load_from_file``; ``close()`` frees it (``llama_model_free``).

    ``path=None`` loads the default model (``pyllamacpp.default_model_path()``). Every field of
    ``llama_model_params`` is a keyword (``n_gpu_layers``, ``vocab_only``, ``load_mode``...);
    ``use_mmap=False`` is kept as a shorthand for ``load_mode="none"``. ``rpc=["host:port", ...]``
    adds ggml RPC servers (see :mod:`pyllamacpp.rpc`) and offloads ``n_gpu_layers`` to them.

    Args:
        path: The GGUF file; None: the default model.
        rpc: One ``"host:port"`` or a list of them: ggml RPC servers to offload to.
        **params: Fields of ``llama_model_params`` (see :func:`pyllamacpp.params.model_params`).

    Raises:
        ModelLoadError: No such file, or ``llama_model_load_from_file`` returned NULL (llama.cpp's
            logged reason attached).
        ValueError: A bad parameter value, or an RPC endpoint that is not ``host:port``.
        TypeError: An unknown parameter.
        RPCError: An RPC server cannot be reached or reports no devices, or the build has no RPC
            backend.
    """

    _sha256_prefix: str  # set by Context.sidecar_facts on first use (_state_facts.py)

    def __init__(
        self, path: str | os.PathLike | None = None, *, rpc: str | list[str] | None = None, **params: Any
    ) -> None:
        if path is None:
            from .models import default_model_path

            path = default_model_path()
        self.path = Path(path)
        self._devices = None
        self._rpc = [rpc] if isinstance(rpc, str) else list(rpc or ())
        if rpc:
            # Layers offloaded with n_gpu_layers go to these RPC servers' devices (tensor_split
            # divides them); the rest stays on the local CPU.
            from .rpc import add_servers

            devs = add_servers(self._rpc)
            if "devices" not in params:
                self._devices = ffi.new("ggml_backend_dev_t[]", devs + [ffi.NULL])
                params["devices"] = self._devices
        self.params = model_params(**params)
        if not self.path.is_file():
            raise ModelLoadError(f"cannot load {self.path}", func="llama_model_load_from_file", reason="no such file")
        cparams = self.params.to_c()
        with _log.capture() as cap:
            ptr = lib.llama_model_load_from_file(os.fsencode(self.path), cparams[0])
        check_ptr(ptr, "llama_model_load_from_file", error=ModelLoadError, reason=cap.reason(), what=f"for {self.path}")
        rpc_link = None
        if self._rpc:  # ggml's connections to the servers, watched from here on
            from .rpc import link

            rpc_link = link(self._rpc, f"model {self.path.name}")
        self._h = Handle(ptr, lib.llama_model_free, rpc=rpc_link)
        self._vocab = lib.llama_model_get_vocab(ptr)
        self._contexts: weakref.WeakSet = weakref.WeakSet()
        # token -> (bytes, is_eog, text) for special=False and special=True (see _TokenTable)
        self._tokens: tuple[_TokenTable, _TokenTable] = (_TokenTable(self, False), _TokenTable(self, True))
        self.load_buffers = parse_buffer_sizes(cap.lines)
        self._metadata: dict[str, str] | None = None
        self._kv_head_counts: list[int] | None = None  # kv_head_counts(), read once

    # -- lifetime ------------------------------------------------------------------------------
    _what, _free = "model", "llama_model_free"  # Owner: ptr, closed, with-statement

    def close(self) -> None:
        """Close this model's contexts, then free the model (``llama_model_free``); idempotent.

        Memory still viewed by a numpy array stays valid until the view goes.
        """
        for ctx in list(self._contexts):
            ctx.close()
        self._h = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.description}, {self.n_layer} layers"
        return f"<Model {self.path.name}: {state}>"

    # -- properties, read from the library -------------------------------------------------------
    @property
    def description(self) -> str:
        """``llama_model_desc``: a short description (architecture, size, type).

        Raises:
            ClosedError: The model is closed.
        """
        return c_string(lib.llama_model_desc, self.ptr)

    @property
    def arch(self) -> str:
        """``general.architecture`` from the GGUF metadata (empty when absent).

        Raises:
            ClosedError: The model is closed.
        """
        return self.meta("general.architecture") or ""

    @property
    def n_params(self) -> int:
        """``llama_model_n_params``: the number of parameters.

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_n_params(self.ptr)

    @property
    def size(self) -> int:
        """Bytes of all tensors (``llama_model_size``).

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_size(self.ptr)

    @property
    def n_layer(self) -> int:
        """``llama_model_n_layer``: the number of layers.

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_n_layer(self.ptr)

    @property
    def n_embd(self) -> int:
        """``llama_model_n_embd``: the embedding size.

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_n_embd(self.ptr)

    @property
    def n_head(self) -> int:
        """``llama_model_n_head``: attention heads (layer 0's count).

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_n_head(self.ptr)

    @property
    def n_head_kv(self) -> int:
        """``llama_model_n_head_kv``: KV heads (layer 0's count; see :meth:`kv_head_counts`).

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_n_head_kv(self.ptr)

    @property
    def n_ctx_train(self) -> int:
        """``llama_model_n_ctx_train``: the context size the model was trained with.

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_n_ctx_train(self.ptr)

    @property
    def n_swa(self) -> int:
        """``llama_model_n_swa``: the sliding-window size (0: no sliding-window attention).

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_model_n_swa(self.ptr)

    @property
    def n_vocab(self) -> int:
        """``llama_vocab_n_tokens``: the vocabulary size.

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_vocab_n_tokens(self._vocab_ptr())

    def meta(self, key: str) -> str | None:
        """One GGUF metadata value as a string (``llama_model_meta_val_str``).

        Args:
            key: The GGUF key, e.g. ``"general.architecture"``.

        Returns:
            The value as llama.cpp renders it, or None when the key is absent (or an array, which
            llama.cpp leaves out).

        Raises:
            ClosedError: The model is closed.
        """
        buf = ffi.new("char[]", 512)
        n = lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, 512)
        if n < 0:
            return None
        if n >= 512:
            buf = ffi.new("char[]", n + 1)
            lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, n + 1)
        return ffi.string(buf).decode("utf-8", "replace")

    @property
    def metadata(self) -> dict[str, str]:
        """All GGUF key/values as llama.cpp renders them (``llama_model_meta_*_by_index``).

        Raises:
            ClosedError: The model is closed.
        """
        if self._metadata is None:
            ptr = self.ptr
            self._metadata = {
                c_string(lib.llama_model_meta_key_by_index, ptr, i): c_string(
                    lib.llama_model_meta_val_str_by_index, ptr, i, size=1024
                )
                for i in range(lib.llama_model_meta_count(ptr))
            }
        return dict(self._metadata)

    def _meta_list(self, key: str, default: int) -> list[int]:
        """A per-layer integer from metadata (a scalar or an array), expanded to n_layer values."""
        value = self.meta(f"{self.arch}.{key}")
        n = self.n_layer
        if value is None:  # llama_model_meta_val_str leaves arrays out: read the GGUF itself
            from .state import gguf_field

            arr = gguf_field(self.path, f"{self.arch}.{key}") if self.path is not None else None
            if isinstance(arr, list) and len(arr) == n:
                return [int(x) for x in arr]
            return [int(arr) if isinstance(arr, int) else default] * n
        nums = [int(x) for x in re.findall(r"-?\d+", value)]
        return nums if len(nums) == n else [nums[0]] * n

    def kv_head_counts(self) -> list[int]:
        """KV heads per layer, ``<arch>.attention.head_count_kv`` as llama.cpp's hparams read it.

        The key holds a number or one per layer; 0 for a layer without attention, as in hybrid
        models. ``n_head_kv`` is ``llama_model_n_head_kv``, layer 0's count only.

        Returns:
            One count per layer (``n_layer`` values).

        Raises:
            ClosedError: The model is closed.
            OSError: The GGUF file cannot be read (when llama.cpp's metadata leaves the array out).
        """
        if self._kv_head_counts is None:
            self._kv_head_counts = self._meta_list("attention.head_count_kv", self.n_head_kv)
        return list(self._kv_head_counts)

    def kv_head_sizes(self) -> tuple[int, int]:
        """K and V head sizes, as llama.cpp's hparams read them.

        ``<arch>.attention.key_length`` / ``value_length`` from the GGUF, default ``n_embd / n_head``.

        Returns:
            ``(key_length, value_length)``.

        Raises:
            ClosedError: The model is closed.
        """
        head_dim = self.n_embd // max(self.n_head, 1)
        return (
            int(self.meta(f"{self.arch}.attention.key_length") or head_dim),
            int(self.meta(f"{self.arch}.attention.value_length") or head_dim),
        )

    def kv_bytes_per_token(self, type_k: str | int = "f16", type_v: str | int = "f16") -> int:
        """Bytes of K and V cache one token takes, summed over layers.

        Per layer: ``ggml_row_size(type_k, n_embd_k_gqa) + ggml_row_size(type_v, n_embd_v_gqa)``
        with ``n_embd_k_gqa = key_length x head_count_kv[il]`` (and ``value_length`` for V), read
        from the GGUF metadata as llama.cpp's hparams do: ``<arch>.attention.head_count_kv`` (a
        number or one per layer; 0 for a layer without attention), ``<arch>.attention.key_length``
        / ``value_length`` (default ``n_embd / n_head``). Cell metadata is not included.

        Args:
            type_k: The K cache type, a ggml type name (``"f16"``, ``"q8_0"``...) or number.
            type_v: The V cache type, likewise.

        Returns:
            Bytes per token.

        Raises:
            ValueError: An unknown ggml type.
            ClosedError: The model is closed.
        """
        tk, tv = ggml_type(type_k, "type_k"), ggml_type(type_v, "type_v")
        k_len, v_len = self.kv_head_sizes()
        total = 0
        for n_kv in self.kv_head_counts():
            if n_kv > 0:
                total += lib.ggml_row_size(tk, k_len * n_kv) + lib.ggml_row_size(tv, v_len * n_kv)
        return int(total)

    # -- vocabulary ----------------------------------------------------------------------------
    def _vocab_ptr(self) -> Any:
        self.ptr  # raises when closed
        return self._vocab

    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> np.ndarray:
        """Text to token ids (``llama_tokenize``).

        Args:
            text: The text (str, encoded as UTF-8, or bytes).
            add_special: Add BOS/EOS where the model wants them (``add_special``).
            parse_special: Read special-token text such as ``<|im_start|>`` as one token
                (``parse_special``).

        Returns:
            An int32 array of token ids.

        Raises:
            ValueError: ``llama_tokenize`` failed.
            ClosedError: The model is closed.
        """
        raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        vocab = self._vocab_ptr()
        cap = len(raw) + 8
        out = np.empty(cap, dtype=np.int32)
        n = lib.llama_tokenize(
            vocab, raw, len(raw), ffi.from_buffer("llama_token[]", out), cap, add_special, parse_special
        )
        if n < 0:  # too small: -n is the size needed
            cap = -n
            out = np.empty(cap, dtype=np.int32)
            n = lib.llama_tokenize(
                vocab, raw, len(raw), ffi.from_buffer("llama_token[]", out), cap, add_special, parse_special
            )
        if n < 0:
            raise ValueError(f"llama_tokenize() failed with {n}")
        return out[:n]

    def _check_token(self, token: int) -> int:
        token = int(token)
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token {token} is outside the vocabulary [0, {self.n_vocab})")
        return token

    def token_to_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (``llama_token_to_piece``); they may be part of a UTF-8 character.

        Args:
            token: The token id.
            special: Render special (control) tokens as their text; else they give no bytes.

        Returns:
            The token's bytes.

        Raises:
            ValueError: The token is outside the vocabulary.
            ClosedError: The model is closed.
        """
        token = self._check_token(token)
        buf = ffi.new("char[]", 64)
        n = lib.llama_token_to_piece(self._vocab_ptr(), token, buf, 64, 0, special)
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = lib.llama_token_to_piece(self._vocab_ptr(), token, buf, -n, 0, special)
        return ffi.buffer(buf, n)[:]

    def token_to_piece(self, token: int, special: bool = False) -> str:
        """The text of one token (``llama_token_to_piece``), an incomplete UTF-8 character as U+FFFD.

        Args:
            token: The token id.
            special: Render special (control) tokens as their text.

        Returns:
            The token's text.

        Raises:
            ValueError: The token is outside the vocabulary.
            ClosedError: The model is closed.
        """
        return self.token_to_bytes(token, special).decode("utf-8", "replace")

    def detokenize(self, tokens: Any, remove_special: bool = False, unparse_special: bool = False) -> str:
        """Token ids to text (``llama_detokenize``).

        Args:
            tokens: The token ids.
            remove_special: Leave out BOS/EOS where the model adds them (``remove_special``).
            unparse_special: Render special tokens as their text (``unparse_special``).

        Returns:
            The text (invalid UTF-8 as U+FFFD).

        Raises:
            ValueError: A token outside the vocabulary, or ``llama_detokenize`` failed.
            ClosedError: The model is closed.
        """
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        n_vocab = self.n_vocab
        # np.min, not arr.min(): numpy 2.5's stubs, read for python_version 3.10, have no no-argument overload
        if arr.size and (np.min(arr) < 0 or np.max(arr) >= n_vocab):
            raise ValueError(f"tokens outside the vocabulary [0, {n_vocab})")
        cap = max(16, arr.size * 8)
        for _ in range(2):
            buf = ffi.new("char[]", cap)
            n = lib.llama_detokenize(
                self._vocab_ptr(),
                ffi.from_buffer("llama_token[]", arr),
                arr.size,
                buf,
                cap,
                remove_special,
                unparse_special,
            )
            if n >= 0:
                return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
            cap = -n
        raise ValueError("llama_detokenize() failed")

    @property
    def bos(self) -> int:
        """``llama_vocab_bos``: the beginning-of-sentence token (-1: none).

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_vocab_bos(self._vocab_ptr())

    @property
    def eos(self) -> int:
        """``llama_vocab_eos``: the end-of-sentence token (-1: none).

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_vocab_eos(self._vocab_ptr())

    @property
    def eot(self) -> int:
        """``llama_vocab_eot``: the end-of-turn token (-1: none).

        Raises:
            ClosedError: The model is closed.
        """
        return lib.llama_vocab_eot(self._vocab_ptr())

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (``llama_vocab_is_eog``: EOS, EOT and the like).

        Args:
            token: The token id.

        Returns:
            True for an end-of-generation token.

        Raises:
            ClosedError: The model is closed.
        """
        return bool(lib.llama_vocab_is_eog(self._vocab_ptr(), int(token)))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_assistant: bool = True, template: str | None = None
    ) -> str:
        """Format a conversation with a chat template (``llama_chat_apply_template``).

        The template is the model's (``llama_model_chat_template``) unless ``template`` is given.

        Args:
            messages: A list of ``{"role": ..., "content": ...}``.
            add_assistant: Open the assistant's turn at the end (``add_ass``).
            template: A template, or a built-in template's name (e.g. ``"chatml"``), instead of the
                model's.

        Returns:
            The formatted prompt.

        Raises:
            ValueError: The model has no chat template and none was given, or llama.cpp does not
                support the template.
            KeyError: A message without ``role`` or ``content``.
            ClosedError: The model is closed.
        """
        tmpl = template.encode() if template is not None else lib.llama_model_chat_template(self.ptr, ffi.NULL)
        if tmpl == ffi.NULL:
            raise ValueError("the model has no chat template; pass template=")
        keep = []
        chat = ffi.new("struct llama_chat_message[]", len(messages))
        for i, m in enumerate(messages):
            role, content = ffi.new("char[]", m["role"].encode()), ffi.new("char[]", m["content"].encode())
            keep += [role, content]
            chat[i].role, chat[i].content = role, content
        size = 2 * sum(len(m["content"]) + len(m["role"]) for m in messages) + 256
        for _ in range(2):
            buf = ffi.new("char[]", size)
            n = lib.llama_chat_apply_template(tmpl, chat, len(messages), add_assistant, buf, size)
            if n < 0:
                raise ValueError("llama_chat_apply_template() failed: template not supported")
            if n <= size:
                return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
            size = n
        raise ValueError("llama_chat_apply_template() kept growing")

    # -- text (pyllamacpp.text) -----------------------------------------------------------------
    def complete(
        self,
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
        """Text after ``prompt``, or with ``stream=True`` an iterator of UTF-8-safe pieces.

        Stops at an end-of-generation token, after ``n_predict`` tokens, when the context is full,
        or just before a stop string (``.finish_reason``). Greedy unless ``sampler``; ``ctx=None``
        makes and closes a context, a given ``ctx`` has ``seq_id`` cleared first. See
        :func:`pyllamacpp.text.complete`, which this calls (``llama_tokenize``, ``llama_decode``,
        ``llama_token_to_piece``).

        Args:
            prompt: The text to continue.
            n_predict: Most tokens to sample (-1: no limit).
            sampler: A :class:`Sampler` used as is; greedy when None.
            ctx: A :class:`Context` to decode in; None: one is made and closed after.
            stream: Return a :class:`~pyllamacpp.text.TextStream` instead of the whole text.
            add_special: ``llama_tokenize``'s ``add_special``.
            parse_special: ``llama_tokenize``'s ``parse_special``.
            seq_id: The sequence to use in ``ctx``.
            stop: A stop string or a list of them (``finish_reason`` ``"stop"``).
            logprobs: ``k``: each generated token's log-probability and the ``k`` most likely
                tokens' (``.logprobs``, as llama-cpp-python's ``logprobs=k``).

        Returns:
            A :class:`~pyllamacpp.text.Completion`, or with ``stream=True`` a
            :class:`~pyllamacpp.text.TextStream`.

        Raises:
            TypeError: ``prompt`` is not a str, or ``stop`` not a str or a list of str.
            ValueError: An empty prompt, a prompt longer than the context, a ``ctx`` of another
                model, a bad ``seq_id``, an empty stop string, a bad ``logprobs``.
            DecodeAborted: ``ctx.abort()`` stopped a decode.
            DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
            DecodeError: Another ``llama_decode`` failure.
            ClosedError: The model, context or sampler was closed.
        """
        from .text import complete

        return complete(
            self,
            prompt,
            n_predict,
            sampler=sampler,
            ctx=ctx,
            stream=stream,
            add_special=add_special,
            parse_special=parse_special,
            seq_id=seq_id,
            stop=stop,
            logprobs=logprobs,
        )

    def chat(
        self,
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
        """The assistant's answer to ``messages`` through the GGUF's chat template.

        ``llama_chat_apply_template``, special tokens parsed; same return forms and context rules as
        :meth:`complete`. See :func:`pyllamacpp.text.chat`, which this calls.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            n_predict: Most tokens to sample (-1: no limit).
            sampler: A :class:`Sampler` used as is; greedy when None.
            ctx: A :class:`Context` to decode in; None: one is made and closed after.
            stream: Return a :class:`~pyllamacpp.text.TextStream` instead of the whole answer.
            template: A template (or a built-in template's name) instead of the model's.
            seq_id: The sequence to use in ``ctx``.
            stop: A stop string or a list of them (``finish_reason`` ``"stop"``).

        Returns:
            A :class:`~pyllamacpp.text.Completion`, or with ``stream=True`` a
            :class:`~pyllamacpp.text.TextStream`.

        Raises:
            ValueError: No messages, no usable template, a prompt longer than the context, a
                ``ctx`` of another model, an empty stop string.
            TypeError: A message that is not a dict with ``role`` and ``content`` strings, or a
                ``stop`` that is not a str or a list of str.
            DecodeAborted: ``ctx.abort()`` stopped a decode.
            DecodeInterrupted: Ctrl-C stopped a decode (a KeyboardInterrupt).
            DecodeError: Another ``llama_decode`` failure.
            ClosedError: The model, context or sampler was closed.
        """
        from .text import chat

        return chat(
            self,
            messages,
            n_predict,
            sampler=sampler,
            ctx=ctx,
            stream=stream,
            template=template,
            seq_id=seq_id,
            stop=stop,
        )

    # -- embeddings ----------------------------------------------------------------------------
    def embed(
        self,
        texts: str | Sequence[str],
        *,
        pooling: str | None = None,
        normalize: int = 2,
        add_special: bool = True,
        parse_special: bool = True,
        **context_params: Any,
    ) -> np.ndarray | list[np.ndarray]:
        """Embeddings of ``texts``, as llama.cpp's ``examples/embedding`` computes them.

        A context with ``embeddings=True``, ``pooling_type=pooling`` and a unified KV cache; the
        texts are tokenized (``llama_tokenize``, by default with ``parse_special`` as the example
        does), packed one sequence each into batches of up to ``n_batch`` tokens, the memory cleared
        before each ``llama_decode``; then each vector is normalized as ``common_embd_normalize``
        does with ``--embd-normalize`` (sums in float64). The context is closed afterwards. See
        :func:`pyllamacpp.embeddings.embed`, which this calls.

        Args:
            texts: A text, or a list of texts.
            pooling: ``"none"`` (one vector per token), ``"mean"``, ``"cls"`` (the first token),
                ``"last"``, ``"rank"`` (a reranker's score: only for models whose GGUF declares
                rank pooling), or None: the model's own (``<arch>.pooling_type``; none when absent).
            normalize: ``--embd-normalize``: -1 none, 0 max-absolute scaled to int16 range,
                1 taxicab, 2 Euclidean (llama.cpp's default), p > 2 the p-norm. Not applied to rank
                scores.
            add_special: ``llama_tokenize``'s ``add_special``.
            parse_special: ``llama_tokenize``'s ``parse_special``.
            **context_params: Fields of :class:`ContextParams` for the context (``n_threads``,
                ``n_batch``...); ``embeddings``, ``pooling_type``, ``kv_unified`` and ``n_ubatch``
                (= ``n_batch``, rounded up to a multiple of ``n_seq_max``) are set here.

        Returns:
            Pooled: a float32 array ``(len(texts), n_embd_out)`` (``(len(texts), n_cls_out)`` for
            rank), 1-D for a single str. ``"none"``: a list of ``(n_tokens_i, n_embd_out)``
            arrays, one per text (one array for a single str). Copies: the context's buffers
            are overwritten by each decode.

        Raises:
            ValueError: No texts, a text that gives no tokens or more than ``n_ctx_train``, an
                unknown pooling, ``"rank"`` for a model without rank pooling, or ``normalize`` < -1.
            TypeError: A text that is not a str.
            ContextError: The context could not be made.
            DecodeError: ``llama_decode`` failed.
            ClosedError: The model is closed.
        """
        from .embeddings import embed

        return embed(
            self,
            texts,
            pooling=pooling,
            normalize=normalize,
            add_special=add_special,
            parse_special=parse_special,
            **context_params,
        )

    # -- scoring (pyllamacpp.scoring) -----------------------------------------------------------
    def score(self, text: str | bytes | Any, *, top_k: int = 0, **kwargs: Any) -> Scores:
        """The log-probability of every token of ``text`` given the ones before it.

        One pass with logits at the rows that predict a token, in windows when the text is longer
        than the context. See :func:`pyllamacpp.scoring.score`, which this calls (``llama_decode``,
        then a C log-softmax over the logits in place).

        Args:
            text: A str or bytes (``llama_tokenize``), or token ids.
            top_k: Also keep the ``top_k`` most likely tokens at each position.
            **kwargs: ``n_ctx``, ``n_batch``, ``keep``, ``add_special``, ``parse_special`` and
                fields of :class:`ContextParams` (see :func:`pyllamacpp.scoring.score`).

        Returns:
            A :class:`~pyllamacpp.scoring.Scores`.

        Raises:
            ValueError: Fewer than 2 tokens, tokens outside the vocabulary, a bad window.
            DecodeError: A decode failed.
            ClosedError: The model is closed.
        """
        from .scoring import score

        return score(self, text, top_k=top_k, **kwargs)

    # -- contexts ------------------------------------------------------------------------------
    def context(self, params: ContextParams | None = None, **kwargs: Any) -> Context:
        """A :class:`pyllamacpp.Context` over this model (``llama_init_from_model``).

        Args:
            params: A :class:`ContextParams`; ``kwargs`` override its fields.
            **kwargs: Fields of :class:`ContextParams` (``n_ctx``, ``n_batch``...).

        Returns:
            The new context (close it, or use it in a ``with`` block).

        Raises:
            ContextError: ``llama_init_from_model`` returned NULL.
            ValueError: A bad parameter value.
            TypeError: An unknown parameter.
            ClosedError: The model is closed.
        """
        from .context import Context

        return Context(self, params, **kwargs)
