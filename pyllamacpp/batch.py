"""``Batch``: a ``llama_batch`` from ``llama_batch_init`` with numpy views over its arrays.

``llama_batch_init`` mallocs one small ``seq_id`` array per slot. To give a single 2-D numpy view
(capacity x n_seq_max), the batch points each slot's ``seq_id[i]`` at a row of one contiguous
array it owns, and puts llama.cpp's own pointers back before ``llama_batch_free``.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._handle import view
from ._lib import ffi, lib
from .errors import ClosedError

if TYPE_CHECKING:
    from .model import Model

_I32 = np.iinfo(np.int32)


def _as_int_array(values, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype == np.int32:
        return arr.reshape(-1)
    if arr.size == 0:
        return np.zeros(0, np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.min() < _I32.min or arr.max() > _I32.max:
        raise ValueError(f"{what} do not fit in int32")
    return arr.astype(np.int32).reshape(-1)


class _BatchMem:
    """Owns the ``llama_batch``: views hold it, so the arrays outlive ``close()`` while viewed."""

    __slots__ = ("p", "cap", "orig", "seq", "__weakref__")

    def __init__(self, p, cap):
        self.p, self.cap, self.orig, self.seq = p, cap, None, None

    # bound here: at interpreter exit a module's globals (np, ffi, lib) may already be None
    def __del__(self, _memmove=ffi.memmove, _free=lib.llama_batch_free):
        if self.orig is not None:
            # llama_batch_free frees llama.cpp's own per-slot seq_id arrays: put their pointers back
            _memmove(self.p.seq_id, self.orig, len(self.orig))
        _free(self.p[0])


class Batch:
    """A ``llama_batch`` with numpy views over its arrays.

    Wraps ``llama_batch_init(capacity, embd, n_seq_max)``; ``llama_batch_free`` frees it.

    As in llama.cpp, ``n_seq_max`` is how many seq ids ONE token may carry (the width of the
    ``seq_id`` array), not a bound on their values: ``Batch(512)`` holds tokens of sequences 0, 1,
    2... one id each (llama.cpp's server builds its batch with ``n_seq_max`` 1). The values are
    checked when the batch is decoded, against the context's ``n_seq_max``.

    Views (of the filled part, ``len(batch)`` slots): ``token``, ``pos``, ``n_seq_id``, ``seq_id``
    (2-D, ``len x n_seq_max``), ``logits`` (int8 flags); ``embd`` (2-D) for an embedding batch. Each
    is a numpy view over the memory ``llama_decode`` reads, valid as long as the view exists.
    Pass ``model=`` to have tokens checked against its vocabulary.

    Args:
        capacity: How many tokens (slots) the batch holds: ``n_tokens`` of ``llama_batch_init``.
        n_seq_max: How many seq ids one token may carry (the width of ``seq_id``).
        embd: 0 for a token batch; else the size of each embedding vector (an ``embd`` batch).
        model: If given, tokens added are checked against its vocabulary (``n_vocab``).

    Raises:
        ValueError: A non-positive ``capacity`` or ``n_seq_max``, or a negative ``embd``; from the
            ``add*`` methods: a full batch, more seq ids for a token than ``n_seq_max``, a negative or
            repeated seq id, a token outside the model's vocabulary.
    """

    def __init__(self, capacity: int, n_seq_max: int = 1, embd: int = 0, *, model: Model | None = None) -> None:
        if capacity <= 0 or n_seq_max <= 0 or embd < 0:
            raise ValueError(
                f"Batch(capacity={capacity}, n_seq_max={n_seq_max}, embd={embd}): "
                "capacity and n_seq_max must be positive, embd >= 0"
            )
        self.capacity, self.n_seq_max, self.n_embd = int(capacity), int(n_seq_max), int(embd)
        self._n_vocab = model.n_vocab if model is not None else None
        p = ffi.new("struct llama_batch *")
        p[0] = lib.llama_batch_init(self.capacity, self.n_embd, self.n_seq_max)
        self._p = p
        mem = _BatchMem(p, self.capacity)
        self._mem: _BatchMem | None = mem
        cap = self.capacity
        # numpy views over llama.cpp's arrays, full capacity; the public ones are sliced to n.
        self._token = view(p.token, (cap,), np.int32, mem) if not embd else None
        self._embd = view(p.embd, (cap, embd), np.float32, mem) if embd else None
        self._pos = view(p.pos, (cap,), np.int32, mem)
        self._n_seq_id = view(p.n_seq_id, (cap,), np.int32, mem)
        self._logits = view(p.logits, (cap,), np.int8, mem)
        # One contiguous seq_id block; the slot pointers are rewritten to point into it.
        self._seq = mem.seq = np.zeros((cap, self.n_seq_max), np.int32)
        ptrs = view(p.seq_id, (cap,), np.uintp, mem)
        mem.orig = ptrs.tobytes()
        ptrs[:] = self._seq.ctypes.data + np.arange(cap, dtype=np.uintp) * (self.n_seq_max * 4)
        p.n_tokens = 0

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the batch; ``llama_batch_free`` runs once no view of it is left. Idempotent."""
        self._mem = None

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._mem is None

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def struct(self) -> Any:
        """The ``struct llama_batch`` to pass to ``llama_decode`` (by value).

        Raises:
            ClosedError: The batch is closed.
        """
        if self._mem is None:
            raise ClosedError("the batch is closed", func="llama_batch_free")
        return self._p[0]

    # -- the filled part -----------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._p.n_tokens)

    @property
    def n_tokens(self) -> int:
        """``llama_batch.n_tokens``: how many slots are filled (``len(batch)``)."""
        return int(self._p.n_tokens)

    @property
    def token(self) -> np.ndarray:
        """View of ``llama_batch.token`` over the filled slots (int32).

        Raises:
            AttributeError: An embedding batch (``embd > 0``) has no token array.
        """
        if self._token is None:
            raise AttributeError("an embedding batch (embd > 0) has no token array")
        return self._token[: len(self)]

    @property
    def embd(self) -> np.ndarray:
        """View of ``llama_batch.embd`` over the filled slots (float32, ``len x embd``).

        Raises:
            AttributeError: A token batch (``embd == 0``) has no embd array.
        """
        if self._embd is None:
            raise AttributeError("a token batch (embd == 0) has no embd array")
        return self._embd[: len(self)]

    @property
    def pos(self) -> np.ndarray:
        """View of ``llama_batch.pos`` over the filled slots (int32)."""
        return self._pos[: len(self)]

    @property
    def n_seq_id(self) -> np.ndarray:
        """View of ``llama_batch.n_seq_id`` over the filled slots: how many seq ids each token carries."""
        return self._n_seq_id[: len(self)]

    @property
    def seq_id(self) -> np.ndarray:
        """The seq ids of the filled slots (int32, ``len x n_seq_max``; ``llama_batch.seq_id`` points into it)."""
        return self._seq[: len(self)]

    @property
    def logits(self) -> np.ndarray:
        """View of ``llama_batch.logits`` over the filled slots: int8 flags, 1 where an output is asked."""
        return self._logits[: len(self)]

    @property
    def n_outputs(self) -> int:
        """How many filled slots ask for an output (nonzero ``logits`` flags)."""
        return int(np.count_nonzero(self.logits))

    def clear(self) -> None:
        """Empty the batch (``n_tokens = 0``, as ``common_batch_clear``); capacity and views stay."""
        self._p.n_tokens = 0

    # -- filling -------------------------------------------------------------------------------
    def _check_room(self, n: int) -> int:
        if self._mem is None:
            raise ClosedError("the batch is closed", func="llama_batch_free")
        i0 = len(self)
        if i0 + n > self.capacity:
            raise ValueError(f"batch capacity exceeded: {i0} + {n} tokens > capacity {self.capacity}")
        return i0

    def _check_seq_ids(self, seq_ids) -> np.ndarray:
        ids = _as_int_array([seq_ids] if np.isscalar(seq_ids) else seq_ids, "seq_ids")
        if ids.size == 0 or ids.size > self.n_seq_max:
            raise ValueError(f"a token needs 1..{self.n_seq_max} seq ids, got {ids.size}")
        if ids.min() < 0:  # the upper bound is the context's n_seq_max, checked at decode
            raise ValueError(f"negative seq id: {ids.tolist()}")
        if np.unique(ids).size != ids.size:
            raise ValueError(f"duplicate seq ids for one token: {ids.tolist()}")
        return ids

    def _check_tokens(self, tokens: np.ndarray) -> None:
        if self._n_vocab is not None and tokens.size and (tokens.min() < 0 or tokens.max() >= self._n_vocab):
            bad = tokens[(tokens < 0) | (tokens >= self._n_vocab)][0]
            raise ValueError(f"token {int(bad)} is outside the vocabulary [0, {self._n_vocab})")

    def add(self, token: int, pos: int, seq_ids: npt.ArrayLike = 0, logits: bool = False) -> int:
        """Fill one slot of a token batch (as ``common_batch_add``).

        Args:
            token: The token id.
            pos: Its position in its sequence(s).
            seq_ids: One seq id, or several (the token is shared by each listed sequence).
            logits: Whether to ask for an output (logits or embeddings) at this token.

        Returns:
            The slot's index, which is the output index for ``ctx.logits`` when ``logits`` is set.

        Raises:
            TypeError: The batch is an embedding batch, or ``token``/``seq_ids`` are not integers.
            ValueError: The batch is full, the token is outside the model's vocabulary or does not fit
                in int32, or the seq ids are negative, repeated or more than ``n_seq_max``.
            ClosedError: The batch is closed.
        """
        if self._token is None:
            raise TypeError("an embedding batch takes add_embd(), not add()")
        if isinstance(token, (int, np.integer)) and isinstance(seq_ids, (int, np.integer)):
            return self._add_one(operator.index(token), operator.index(pos), operator.index(seq_ids), logits)
        tok = _as_int_array([token], "token")
        self._check_tokens(tok)
        return self._add_slot(self._token, tok[0], pos, seq_ids, logits)

    def _add_slot(self, col: np.ndarray, value: Any, pos: int, seq_ids: npt.ArrayLike, logits: bool) -> int:
        # One slot of add()'s general path and of add_embd(): ``value`` goes to ``col`` (token or embd).
        ids = self._check_seq_ids(seq_ids)
        i = self._check_room(1)
        col[i] = value
        self._pos[i] = int(pos)
        self._n_seq_id[i] = ids.size
        self._seq[i, : ids.size] = ids
        self._logits[i] = bool(logits)
        self._p.n_tokens = i + 1
        return i

    def _add_one(self, tok: int, pos: int, sid: int, logits) -> int:
        # One token, one sequence: the per-token call of every generation loop. Plain ints and
        # cffi writes; numpy temporaries here cost more than the rest of a step's Python work.
        if not _I32.min <= tok <= _I32.max:
            raise ValueError("token does not fit in int32")
        if self._n_vocab is not None and not 0 <= tok < self._n_vocab:
            raise ValueError(f"token {tok} is outside the vocabulary [0, {self._n_vocab})")
        if not 0 <= sid <= _I32.max:  # the upper bound is the context's n_seq_max, checked at decode
            raise ValueError(f"seq id {sid} is negative or does not fit in int32")
        i = self._check_room(1)
        p = self._p
        p.token[i] = tok
        p.pos[i] = pos
        p.n_seq_id[i] = 1
        p.seq_id[i][0] = sid  # points into self._seq
        p.logits[i] = 1 if logits else 0
        p.n_tokens = i + 1
        return i

    def add_sequence(
        self,
        tokens: npt.ArrayLike,
        seq_ids: npt.ArrayLike = 0,
        start_pos: int = 0,
        logits: str | npt.ArrayLike = "last",
    ) -> slice:
        """Append ``tokens`` at positions ``start_pos, start_pos+1, ...`` for ``seq_ids``.

        Fills the slots as a loop of ``common_batch_add`` would, but vectorized: no Python loop per
        token.

        Args:
            tokens: The token ids.
            seq_ids: One id or several (a shared prefix: each token stored once, in every listed
                sequence).
            start_pos: The position of the first token.
            logits: ``"last"``, ``"all"``, ``"none"`` or a boolean mask of ``len(tokens)``: which
                tokens ask for an output.

        Returns:
            The slice of slots filled.

        Raises:
            TypeError: The batch is an embedding batch, or ``tokens``/``seq_ids`` are not integers.
            ValueError: The tokens do not fit in the batch, a token is outside the model's vocabulary
                or does not fit in int32, the seq ids are negative, repeated or more than
                ``n_seq_max``, or ``logits`` is neither one of the three words nor a mask of the
                right shape.
            ClosedError: The batch is closed.
        """
        if self._token is None:
            raise TypeError("an embedding batch takes add_embd(), not add_sequence()")
        toks = _as_int_array(tokens, "tokens")
        n = toks.size
        self._check_tokens(toks)
        ids = self._check_seq_ids(seq_ids)
        i0 = self._check_room(n)
        i1 = i0 + n
        self._token[i0:i1] = toks
        self._pos[i0:i1] = np.arange(start_pos, start_pos + n, dtype=np.int32)
        self._n_seq_id[i0:i1] = ids.size
        self._seq[i0:i1, : ids.size] = ids
        out = self._logits[i0:i1]
        if isinstance(logits, str):
            if logits not in ("last", "all", "none"):
                raise ValueError(f"logits must be 'last', 'all', 'none' or a mask, got {logits!r}")
            out[:] = 1 if logits == "all" else 0
            if logits == "last" and n:
                out[-1] = 1
        else:
            mask = np.asarray(logits)
            if mask.shape != (n,):
                raise ValueError(f"logits mask has shape {mask.shape}, expected ({n},)")
            out[:] = mask.astype(bool)
        self._p.n_tokens = i1
        return slice(i0, i1)

    def add_embd(self, embd: npt.ArrayLike, pos: int, seq_ids: npt.ArrayLike = 0, logits: bool = False) -> int:
        """Fill one slot of an embedding batch with a vector of size ``embd``.

        Args:
            embd: The embedding vector, ``embd`` values (converted to float32).
            pos: Its position in its sequence(s).
            seq_ids: One seq id, or several.
            logits: Whether to ask for an output at this slot.

        Returns:
            The slot's index (the output index when ``logits`` is set).

        Raises:
            TypeError: The batch is a token batch (``embd == 0``), or ``seq_ids`` are not integers.
            ValueError: The vector has the wrong size, the batch is full, or the seq ids are negative,
                repeated or more than ``n_seq_max``.
            ClosedError: The batch is closed.
        """
        if self._embd is None:
            raise TypeError("a token batch (embd == 0) takes add(), not add_embd()")
        vec = np.asarray(embd, dtype=np.float32).reshape(-1)
        if vec.size != self.n_embd:
            raise ValueError(f"embedding has {vec.size} values, the batch takes {self.n_embd}")
        return self._add_slot(self._embd, vec, pos, seq_ids, logits)

    def __repr__(self) -> str:
        return f"<Batch {len(self)}/{self.capacity} tokens, n_seq_max={self.n_seq_max}>"
