"""LoRA adapters: ``llama_adapter_lora_*`` and ``llama_set_adapters_lora``.

A :class:`LoraAdapter` is a LoRA GGUF loaded for one model (``llama_adapter_lora_init``): its
factors sit in buffers of their own beside the model's weights, which stay unchanged. A context
applies any set of its model's adapters, each with a scale (``llama_set_adapters_lora``); llama.cpp
then adds ``scale * alpha / rank * B @ (A @ x)`` to each adapted ``W @ x`` (``build_lora_mm`` in
``src/llama-graph.cpp``; the factor is the scale alone when the adapter's alpha is 0). Setting them
changes the graph, not the KV cache: what a sequence already holds was computed with the adapters
of that time.

Lifetimes, the same rules as everywhere in pyllamacpp:

- an adapter keeps its model's C object alive (``llama_model_free`` would free the adapter too:
  llama.cpp's model owns every adapter not yet freed);
- a context keeps alive every adapter it has applied, until the context itself is freed (llama.cpp
  keeps raw pointers to them);
- ``close()`` is idempotent and any use after it raises :class:`~pyllamacpp.errors.ClosedError`;
  closing the model first closes its contexts, and the adapter stays readable (``meta``) until it
  is closed or dropped.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import gguf
import numpy as np

from . import _log
from ._handle import Handle, Owner, view
from ._lib import ffi, lib
from .errors import ModelLoadError, check_ptr
from .model import c_string

if TYPE_CHECKING:
    from .context import Context
    from .model import Model

__all__ = ["LoraAdapter"]

# context -> {adapter: scale} as last set through pyllamacpp (llama.cpp has no getter)
_applied: weakref.WeakKeyDictionary[Context, dict[LoraAdapter, float]] = weakref.WeakKeyDictionary()


class LoraAdapter(Owner):
    """A LoRA adapter GGUF loaded for ``model`` (``llama_adapter_lora_init``).

    Apply it to a context of the same model with :meth:`Context.set_lora` (or
    :meth:`Context.set_loras`, :meth:`applied`). ``close()`` frees it (``llama_adapter_lora_free``)
    once no context that applied it is left. A context manager.

    Args:
        model: The model the adapter was made for (kept alive by the adapter).
        path: The adapter's GGUF file (``general.type = "adapter"``, ``adapter.type = "lora"``).

    Raises:
        ModelLoadError: No such file, or ``llama_adapter_lora_init`` returned NULL, with
            llama.cpp's reason: not an adapter, another architecture, a weight the model does not
            have or of another shape ("maybe wrong base model?").
        ValueError: The adapter has a ``token_embd.weight`` pair and the model ties its output
            projection to ``token_embd.weight`` (llama.cpp would abort at the first decode).
        ClosedError: The model is closed.
    """

    _what, _free = "LoRA adapter", "llama_adapter_lora_free"  # Owner: ptr, closed, with-statement

    def __init__(self, model: Model, path: str | os.PathLike) -> None:
        self.model = model
        self.path = Path(path)
        mptr = model.ptr  # raises ClosedError for a closed model
        if not self.path.is_file():
            raise ModelLoadError(f"cannot load {self.path}", func="llama_adapter_lora_init", reason="no such file")
        _refuse_tied_embd(self.path, model)
        with _log.capture() as cap:
            ptr = lib.llama_adapter_lora_init(mptr, os.fsencode(self.path))
        check_ptr(
            ptr,
            "llama_adapter_lora_init",
            error=ModelLoadError,
            reason=cap.reason(),
            what=f"for {self.path} on {model.path.name}",
        )
        rpc = cast(Handle, model._h).rpc
        self._h = Handle(
            ptr, lib.llama_adapter_lora_free, deps=(model._h,), rpc=rpc.child("LoRA adapter") if rpc else None
        )
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()  # contexts that applied it

    def close(self) -> None:
        """Take the adapter off every open context that applies it, then drop it; idempotent.

        The C adapter is freed (``llama_adapter_lora_free``) once no context that applied it is left.
        """
        if self._h is None:
            return
        for ctx in list(self._contexts):
            now = _applied.get(ctx)
            if not ctx.closed and now and self in now:
                set_loras(ctx, {a: s for a, s in now.items() if a is not self})
        self._h = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"alpha={self.alpha:g}"
        return f"<LoraAdapter {self.path.name}: {state}>"

    # -- metadata ------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """A scalar metadata value of the adapter's GGUF, as a string (``llama_adapter_meta_val_str``).

        Args:
            key: The key (``"adapter.lora.alpha"``, ``"general.name"``...).

        Returns:
            The value, or None when the file has no such key (or it is an array).

        Raises:
            ClosedError: The adapter is closed.
        """
        ptr = self.ptr
        if lib.llama_adapter_meta_val_str(ptr, key.encode(), ffi.NULL, 0) < 0:
            return None
        return c_string(lib.llama_adapter_meta_val_str, ptr, key.encode())

    @property
    def metadata(self) -> dict[str, str]:
        """Every scalar metadata key and value (``llama_adapter_meta_key_by_index`` / ``_val_str_by_index``).

        Raises:
            ClosedError: The adapter is closed.
        """
        ptr = self.ptr
        return {
            c_string(lib.llama_adapter_meta_key_by_index, ptr, i): c_string(
                lib.llama_adapter_meta_val_str_by_index, ptr, i
            )
            for i in range(lib.llama_adapter_meta_count(ptr))
        }

    @property
    def alpha(self) -> float:
        """``adapter.lora.alpha`` (0.0 when absent: llama.cpp then scales by the context scale alone).

        Raises:
            ClosedError: The adapter is closed.
        """
        v = self.meta("adapter.lora.alpha")
        return float(v) if v else 0.0

    @property
    def alora_invocation_tokens(self) -> np.ndarray:
        """The token ids of an activated LoRA (``llama_adapter_get_alora_invocation_tokens``).

        llama.cpp's server applies such an adapter only from these tokens on; libllama itself
        applies it like any other. Empty for a plain LoRA.

        Returns:
            A read-only int32 view over the adapter's own array (keeps the adapter alive).

        Raises:
            ClosedError: The adapter is closed.
        """
        ptr = self.ptr
        n = lib.llama_adapter_get_alora_n_invocation_tokens(ptr)
        if n == 0:
            return np.empty(0, np.int32)
        return view(lib.llama_adapter_get_alora_invocation_tokens(ptr), (n,), np.int32, self._h, readonly=True)

    # -- applying ------------------------------------------------------------------------------
    @contextmanager
    def applied(self, ctx: Context, scale: float = 1.0) -> Iterator[LoraAdapter]:
        """``with adapter.applied(ctx, scale):`` the adapter at ``scale`` inside the block only.

        The context's adapters are restored on the way out, as they were (this adapter's former
        scale, or none).

        Args:
            ctx: A context of the adapter's model.
            scale: The scale inside the block.

        Yields:
            The adapter.

        Raises:
            ValueError: ``ctx`` is a context of another model, or ``scale`` is not finite.
            ClosedError: The adapter or the context is closed.
        """
        before = applied(ctx)
        set_lora(ctx, self, scale)
        try:
            yield self
        finally:
            if not ctx.closed:
                set_loras(ctx, before)


def _refuse_tied_embd(path: Path, model: Model) -> None:
    """Raise for a ``token_embd.weight`` LoRA on a model whose output projection is that tensor.

    Without an ``output.weight``, llama.cpp's output projection is ``token_embd.weight`` itself
    (``TENSOR_DUPLICATED``, same name), so the graph applies the embedding LoRA, whose factors are
    laid out for the lookup, to the output matmul too: ``GGML_ASSERT(ggml_can_mul_mat(a, b))``
    aborts the process at the first decode (seen on a synthetic llama model)."""
    try:
        names = {t.name for t in gguf.GGUFReader(path).tensors}
    except (ValueError, OSError):
        return  # not a readable GGUF: llama_adapter_lora_init says why
    if "token_embd.weight.lora_a" not in names:
        return
    files = [model.path]
    n_split = int(model.meta("split.count") or 1)
    if n_split > 1:  # the output weight may be in any split
        buf = ffi.new("char[]", 4096)
        if lib.llama_split_prefix(buf, 4096, os.fsencode(model.path), 0, n_split) > 0:
            prefix = ffi.string(buf)
            files = []
            for i in range(n_split):
                lib.llama_split_path(buf, 4096, prefix, i, n_split)
                files.append(Path(os.fsdecode(ffi.string(buf))))
    if not any(any(t.name == "output.weight" for t in gguf.GGUFReader(f).tensors) for f in files):
        raise ValueError(
            f"{path.name} adapts token_embd.weight, and {model.path.name} has no output.weight: its output "
            "projection is token_embd.weight too, and llama.cpp would apply the embedding LoRA to it "
            "(an abort in ggml at the first decode)"
        )


def applied(ctx: Context) -> dict[LoraAdapter, float]:
    """The adapters ``ctx`` applies and their scales (a copy; what pyllamacpp last set).

    Args:
        ctx: The context.

    Returns:
        ``{adapter: scale}``; empty when none is applied.

    Raises:
        ClosedError: The context is closed.
    """
    ctx.ptr  # noqa: B018 (raises ClosedError for a closed context)
    return dict(_applied.get(ctx, {}))


def set_lora(ctx: Context, adapter: LoraAdapter, scale: float = 1.0) -> None:
    """Apply ``adapter`` at ``scale`` in ``ctx``, keeping the other adapters (0 removes it).

    Args:
        ctx: The context.
        adapter: An adapter of the context's model.
        scale: Its scale (negative subtracts it; 0 takes it off).

    Raises:
        TypeError: ``adapter`` is not a LoraAdapter.
        ValueError: An adapter of another model, or a scale that is not finite.
        RuntimeError: Another thread is decoding in the context.
        ClosedError: The adapter or the context is closed.
    """
    now = applied(ctx)
    now[adapter] = scale
    set_loras(ctx, now)


def set_loras(ctx: Context, adapters: Mapping[LoraAdapter, float]) -> None:
    """Apply exactly ``adapters`` in ``ctx`` (``llama_set_adapters_lora``); ``{}`` removes them all.

    Adapters at scale 0 are left out, as llama.cpp leaves them out. Scales are float32 in
    llama.cpp; :func:`applied` reports them as they were stored. Each adapter is kept alive by the
    context from here on.

    Args:
        ctx: The context.
        adapters: ``{adapter: scale}``.

    Raises:
        TypeError: A key that is not a LoraAdapter, or a scale that is not a number.
        ValueError: An adapter of another model, or a scale that is not finite.
        RuntimeError: Another thread is decoding in the context.
        ClosedError: An adapter or the context is closed.
    """
    cptr = ctx.ptr
    chosen: dict[LoraAdapter, float] = {}
    for a, s in dict(adapters).items():
        if not isinstance(a, LoraAdapter):
            raise TypeError(f"adapters: keys must be LoraAdapter, not {type(a).__name__}")
        if a.model is not ctx.model:
            # llama.cpp matches weights by name only: another model's factors would meet tensors of
            # other shapes in the graph (an abort in ggml)
            raise ValueError(f"{a!r} was loaded for {a.model!r}, not for this context's model {ctx.model!r}")
        a.ptr  # noqa: B018 (raises ClosedError for a closed adapter)
        if not isinstance(s, (int, float, np.floating, np.integer)) or isinstance(s, bool):
            raise TypeError(f"the scale of {a!r} must be a number, not {s!r}")
        with np.errstate(over="ignore"):  # too large for float32: inf, refused below
            s32 = float(np.float32(s))
        if not math.isfinite(s32):
            raise ValueError(f"the scale of {a!r} must be finite (in float32), not {s!r}")
        if s32 != 0.0:
            chosen[a] = s32
    n = len(chosen)
    ptrs = ffi.new("struct llama_adapter_lora *[]", [a.ptr for a in chosen]) if n else ffi.NULL
    scales = ffi.new("float[]", list(chosen.values())) if n else ffi.NULL
    if not ctx._lock.acquire(blocking=False):
        raise RuntimeError("this context is being used by another thread; use one context per thread")
    try:
        lib.llama_set_adapters_lora(cptr, ptrs, n, scales)  # returns 0 always at this pin
    finally:
        ctx._lock.release()
    h = cast(Handle, ctx._h)
    h.add_deps(tuple(a._h for a in chosen))  # freed after the context, in any order of the collector
    for a in chosen:
        a._contexts.add(ctx)
    if chosen:
        _applied[ctx] = chosen
    else:
        _applied.pop(ctx, None)
