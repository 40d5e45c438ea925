"""Model and context parameters: every field of ``llama_model_params`` / ``llama_context_params``.

The dataclasses are built from the C structs at import (``ffi.typeof(...).fields``), with defaults
from ``llama_model_default_params()`` / ``llama_context_default_params()`` at run time, so a
llama.cpp bump that adds a field adds it here with no edit. Values are checked and converted in
Python, naming the field, before anything reaches C:

- ``enum ggml_type`` fields (``type_k``, ``type_v``) take a ggml type name (``"f16"``, ``"q8_0"``,
  ``"bf16"``...) or value;
- ``flash_attn_type`` (alias ``flash_attn``) takes ``"auto"``, ``"on"``, ``"off"``, a bool or the value;
- any other enum takes its value or the tail of its C name (``pooling_type="mean"``);
- unsigned fields reject negatives, ``n_seq_max`` is checked against ``llama_max_parallel_sequences()``.

Three defaults differ from ``llama_context_default_params()``, to fit the machine and the model:

- ``n_threads`` and ``n_threads_batch`` default to :func:`default_n_threads`, the number of physical
  cores, as llama.cpp's own tools choose it (the C default is 4, whatever the machine: on a 2-core
  machine that decodes 3-4x slower than 2 threads);
- ``n_ctx`` defaults to ``None``: the Context resolves it with its model to
  ``min(n_ctx_train, 4096)`` (:func:`default_n_ctx`). ``n_ctx=0`` keeps llama.cpp's meaning, the
  model's whole ``n_ctx_train``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ._cpu import default_n_threads
from ._lib import ffi, lib

DEFAULT_N_CTX_MAX = 4096
"""The default ``n_ctx`` is the model's ``n_ctx_train``, at most this."""


def default_n_ctx(n_ctx_train: int) -> int:
    """``min(n_ctx_train, 4096)``: the ``n_ctx`` a Context takes when none is given.

    Args:
        n_ctx_train: The model's ``llama_model_n_ctx_train``; 0 or less when it does not say.

    Returns:
        The context size (4096 for a model that does not say its ``n_ctx_train``).
    """
    return min(n_ctx_train, DEFAULT_N_CTX_MAX) if n_ctx_train > 0 else DEFAULT_N_CTX_MAX


_U32 = {
    "uint32_t": (0, 2**32 - 1),
    "int32_t": (-(2**31), 2**31 - 1),
    "uint64_t": (0, 2**64 - 1),
    "int64_t": (-(2**63), 2**63 - 1),
    "size_t": (0, 2**64 - 1),
}


def ggml_type_names() -> dict[str, int]:
    """``{"f32": 0, "f16": 1, "q4_0": 2, ...}`` from ``ggml_type_name`` of this build.

    Returns:
        Lower-case name -> ``enum ggml_type`` value, deprecated and unnamed types left out.
    """
    names = {}
    for i in range(lib.GGML_TYPE_COUNT):
        p = lib.ggml_type_name(i)
        if p != ffi.NULL:
            name = ffi.string(p).decode()
            if name and " " not in name and not name.startswith("DEPRECATED"):
                names[name.lower()] = i
    return names


_GGML_TYPES = ggml_type_names()
_FLASH_ATTN = {
    "auto": lib.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    "enabled": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "disabled": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


def ggml_type(value: str | int, field: str = "type") -> int:
    """A ggml type from its name or value, checked against this build (``ggml_type_name``).

    Args:
        value: A name (f16, q8_0 ..., any case) or an ``enum ggml_type`` value.
        field: The parameter being set, for the error message.

    Returns:
        The ``enum ggml_type`` value.

    Raises:
        ValueError: ``value`` names or is no ggml type of this build (the message names ``field``).
    """
    if isinstance(value, str):
        key = value.lower()
        if key not in _GGML_TYPES:
            raise ValueError(f"{field}: unknown ggml type {value!r}; known: {', '.join(sorted(_GGML_TYPES))}")
        return _GGML_TYPES[key]
    if isinstance(value, bool) or not isinstance(value, int) or value not in _GGML_TYPES.values():
        raise ValueError(f"{field}: {value!r} is not a ggml type of this build")
    return int(value)


def ggml_type_name(value: int) -> str:
    """The name ``ggml_type_name`` gives an ``enum ggml_type`` value (f16, q8_0 ...).

    Args:
        value: The ``enum ggml_type`` value.

    Returns:
        ggml's name for it.
    """
    return ffi.string(lib.ggml_type_name(value)).decode()


def _enum_value(ctype, value, field: str) -> int:
    if isinstance(value, str):
        by_name = {k.lower(): v for k, v in ctype.relements.items()}
        key = value.lower()
        for name, v in by_name.items():
            if name == key or name.endswith("_" + key):
                return v
        raise ValueError(f"{field}: {value!r} is not one of {sorted(ctype.relements)}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: expected an int or a name of {ctype.cname}, got {value!r}")
    if value not in ctype.elements:
        raise ValueError(f"{field}: {value} is not a value of {ctype.cname}")
    return int(value)


def _convert(name: str, ctype, value):
    """Check one field's value against its C type; return what to store."""
    if value is None and (ctype.kind in ("pointer", "function") or name in _RESOLVED_LATER):
        return None
    if name == "flash_attn_type":
        if isinstance(value, str):
            value = value.lower()
        if value in _FLASH_ATTN and (isinstance(value, (str, bool))):
            return _FLASH_ATTN[value]
        return _enum_value(ctype, value, name)
    if ctype.kind == "enum":
        if ctype.cname == "enum ggml_type":
            return ggml_type(value, name)
        return _enum_value(ctype, value, name)
    if ctype.kind == "primitive":
        if ctype.cname == "_Bool":
            if not isinstance(value, (bool, int)):
                raise ValueError(f"{name}: expected a bool, got {value!r}")
            return bool(value)
        if ctype.cname in ("float", "double"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name}: expected a number, got {value!r}")
            return float(value)
        bounds = _U32.get(ctype.cname)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
        if bounds is not None and not bounds[0] <= value <= bounds[1]:
            lo, hi = bounds
            raise ValueError(f"{name}: {value} is outside the range of {ctype.cname} [{lo}, {hi}]")
        return int(value)
    return value  # pointers and callbacks: cdata (or a Python object the owner converts)


_RESOLVED_LATER = {"n_ctx"}  # None: resolved when the Context knows its model (Context.__init__)


def _make(cls_name: str, struct: str, defaults_fn, doc: str, overrides: dict | None = None):
    c_defaults = defaults_fn()
    fields = []
    for name, f in ffi.typeof(struct).fields:
        if overrides and name in overrides:
            fields.append((name, object, overrides[name]))
            continue
        if f.type.kind in ("pointer", "function"):
            default = None  # NULL
        elif f.type.kind == "array":
            continue
        else:
            default = getattr(c_defaults, name)
        fields.append((name, object, dataclasses.field(default=default)))

    def __post_init__(self):
        for name, ctype in self._ctypes.items():
            setattr(self, name, _convert(name, ctype, getattr(self, name)))
        self._check()

    def _check(self):
        pass

    def to_c(self) -> Any:
        """A ``struct`` cdata (owned) holding these values; pointers left NULL where None.

        Returns:
            A ``struct llama_context_params *`` / ``struct llama_model_params *`` (``ffi.new``),
            filled from the ``llama_*_default_params()`` values, then these fields.

        Raises:
            ValueError: ``n_ctx`` is None (only the Context resolves it from its model).
        """
        p = ffi.new(f"{struct} *", defaults_fn())
        for name in self._ctypes:
            value = getattr(self, name)
            if value is None and name in _RESOLVED_LATER:
                raise ValueError(
                    f"{name}: None (the default) is resolved by the Context from its model; "
                    "give a value to build the C struct without one"
                )
            if value is None:
                setattr(p, name, ffi.NULL)
            else:
                setattr(p, name, value)
        return p

    cls = dataclasses.make_dataclass(
        cls_name,
        fields,
        namespace={
            "__post_init__": __post_init__,
            "_check": _check,
            "to_c": to_c,
            "_ctypes": {n: f.type for n, f in ffi.typeof(struct).fields if f.type.kind != "array"},
            "__doc__": doc,
        },
    )
    cls.__module__ = __name__
    return cls


if TYPE_CHECKING:
    # The fields come from the C structs at import: to mypy they are attributes of any type.
    class _Params:
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
        _ctypes: ClassVar[dict[str, Any]]
        _check: Callable[[Any], None]

        def __init__(self, **kwargs: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
        def __setattr__(self, name: str, value: Any) -> None: ...
        def to_c(self) -> Any: ...

    class ContextParams(_Params): ...

    class ModelParams(_Params): ...
else:
    ContextParams = _make(
        "ContextParams",
        "struct llama_context_params",
        lambda: lib.llama_context_default_params(),
        "Every field of ``llama_context_params``; defaults from ``llama_context_default_params()``,\n"
        "except ``n_threads`` / ``n_threads_batch`` (:func:`default_n_threads`, the physical cores) and\n"
        "``n_ctx`` (None: ``min(n_ctx_train, 4096)``, resolved by the Context; 0: ``n_ctx_train``).\n\n"
        "Raises:\n"
        "    ValueError: A value that does not fit its C field (type, range, enum name), or "
        "``n_seq_max`` outside [1, llama_max_parallel_sequences()], or threads <= 0.",
        overrides={
            "n_ctx": dataclasses.field(default=None),
            "n_threads": dataclasses.field(default_factory=default_n_threads),
            "n_threads_batch": dataclasses.field(default_factory=default_n_threads),
        },
    )
    ModelParams = _make(
        "ModelParams",
        "struct llama_model_params",
        lambda: lib.llama_model_default_params(),
        "Every field of ``llama_model_params``; defaults from ``llama_model_default_params()``.\n\n"
        "Raises:\n"
        "    ValueError: A value that does not fit its C field (type, range, enum name).",
    )


def _check_context(self):
    max_seq = lib.llama_max_parallel_sequences()
    if not 1 <= self.n_seq_max <= max_seq:
        raise ValueError(f"n_seq_max: {self.n_seq_max} is outside [1, {max_seq}] (llama_max_parallel_sequences)")
    for name in ("n_threads", "n_threads_batch"):
        if getattr(self, name) <= 0:
            raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")


ContextParams._check = _check_context

_ALIASES = {"flash_attn": "flash_attn_type"}


def _check_names(cls: type, kwargs: dict[str, Any], what: str) -> None:
    """TypeError naming the keywords that are no field of the params dataclass ``cls``."""
    unknown = set(kwargs) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"unknown {what} parameter(s): {', '.join(sorted(unknown))}")


def context_params(params: ContextParams | None = None, **kwargs: Any) -> ContextParams:
    """A ContextParams from an optional base and keyword overrides.

    Args:
        params: The base, by default ``ContextParams()``.
        **kwargs: Fields of ``llama_context_params`` to override (``flash_attn`` is an alias of
            ``flash_attn_type``).

    Returns:
        A new ContextParams.

    Raises:
        TypeError: A keyword that is no field of ``llama_context_params``.
        ValueError: A value that does not fit its field.
    """
    for alias, real in _ALIASES.items():
        if alias in kwargs:
            kwargs[real] = kwargs.pop(alias)
    _check_names(ContextParams, kwargs, "context")
    base = params if params is not None else ContextParams()
    return dataclasses.replace(base, **kwargs)


def model_params(**kwargs: Any) -> ModelParams:
    """A ModelParams from keywords.

    Args:
        **kwargs: Fields of ``llama_model_params``. ``use_mmap=True/False`` maps to
            ``load_mode`` MMAP/NONE (this llama.cpp replaced the ``use_mmap`` field by
            ``load_mode``).

    Returns:
        A new ModelParams.

    Raises:
        TypeError: A keyword that is no field of ``llama_model_params``.
        ValueError: A value that does not fit its field.
    """
    if "use_mmap" in kwargs:
        use_mmap = kwargs.pop("use_mmap")
        kwargs.setdefault("load_mode", lib.LLAMA_LOAD_MODE_MMAP if use_mmap else lib.LLAMA_LOAD_MODE_NONE)
    _check_names(ModelParams, kwargs, "model")
    return ModelParams(**kwargs)
