"""A :class:`~pyllamacpp.context.Context`'s state methods: ``StateMethods``, the one class
between Context and ``Owner`` that gives them to it, and the values they deal in:
``StateFlags``, ``SeqState``, ``StateBuffer``. Users import them from
:mod:`pyllamacpp.context_state` (or ``pyllamacpp``).

Each method is a function of one of three modules, the context its ``self``:

- ``data.py``: the state in memory, ``seq_state`` / ``set_seq_state`` and ``state`` /
  ``set_state``; ``StateFlags``, ``SeqState``, ``StateBuffer``;
- ``checks.py``: what a dump does not say about itself (``flash_attn``, the memory and layer
  map, ``sidecar_facts``); ``check_state``, a blob against this context before C sees it; the
  room for a load, and the copy of a sequence kept aside when a load can fail;
- ``files.py``: seq and session files (``save_seq_state`` ... ``check_state_file``) and
  ``save_seq_dump``.

Not named like :mod:`pyllamacpp.state`, the dump parser, which reads dumps without a context."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import checks, data, files
from .checks import model_memory
from .data import SeqState, StateBuffer, StateFlags

__all__ = ["SeqState", "StateBuffer", "StateFlags", "StateMethods", "model_memory"]


class StateMethods:
    """State get/set/check/files for Context (see the module docstring)."""

    # the state in memory (data.py)
    seq_state = data.seq_state
    set_seq_state = data.set_seq_state
    state = data.state
    set_state = data.set_state

    # facts and checks (checks.py)
    if TYPE_CHECKING:

        @property
        def flash_attn(self) -> bool: ...

    else:
        flash_attn = property(checks.flash_attn)
    sidecar_facts = checks.sidecar_facts
    check_state = checks.check_state

    # files (files.py)
    save_seq_state = files.save_seq_state
    load_seq_state = files.load_seq_state
    check_state_file = files.check_state_file
    save_state = files.save_state
    load_state = files.load_state
    save_seq_dump = files.save_seq_dump

    # private, reached through the context: by data.py (which checks.py imports), memory.py, tests
    _memory_layers = checks._memory_layers
    _partial_differs = checks._partial_differs
    _check_no_pending_copy = checks._check_no_pending_copy
    _occupied = checks._occupied
    _own_stream_fits = checks._own_stream_fits
    _load_fits = checks._load_fits
    _cells_held = checks._cells_held
    _put_back = checks._put_back

    # n_seq_max, once a seq_id was checked against it (data._seq_checked): the fast paths compare with it
    _n_seq_max_seen = 0
    # filled on first use (Context.__init__ sets them to None): checks._memory_layers, _cells_held
    _memory_layers_cache: tuple[str | None, dict | None] | None
    _kv_row_bytes: tuple[int, int] | None
