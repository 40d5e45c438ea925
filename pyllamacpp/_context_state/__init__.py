"""The code of a :class:`~pyllamacpp.context.Context`'s state methods, whose public face is
:mod:`pyllamacpp.context_state` (``StateMethods``, ``SeqState``, ``StateFlags``, ``StateBuffer``):

- ``data.py``: ``StateFlags``, ``SeqState``, ``StateBuffer``;
- ``checks.py``: the facts a dump does not say about itself, ``check_state``, the room for a load;
- ``files.py``: seq and session files, ``check_state_file``.

Not named like :mod:`pyllamacpp.state`, the dump parser: that reads dumps without a context."""
