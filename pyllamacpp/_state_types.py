"""Where ``SeqState`` and ``StateFlags`` lived until they moved to ``pyllamacpp._context_state``:
pickles made before name this module, so it stays, forwarding them."""

from ._context_state.data import SeqState as SeqState
from ._context_state.data import StateFlags as StateFlags

__all__ = ["SeqState", "StateFlags"]
