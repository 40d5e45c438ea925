"""Sequence and whole-context state of a :class:`~pyllamacpp.context.Context`: ``StateMethods``
(a base of Context: seq_state, set_seq_state, check_state, the state files...), ``StateFlags``,
``SeqState`` and ``StateBuffer``, forwarded from ``pyllamacpp._context_state``, where they live
(its docstring says which of its three modules holds what)."""

from ._context_state import SeqState as SeqState
from ._context_state import StateBuffer as StateBuffer
from ._context_state import StateFlags as StateFlags
from ._context_state import StateMethods as StateMethods
from ._context_state import model_memory as _model_memory  # noqa: F401 (tests check it on stand-ins)
