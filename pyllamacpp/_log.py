"""Route llama.cpp's and ggml's log into Python ``logging`` (logger ``pyllamacpp.llama``).

Installed at import, before any model or context exists, so llama.cpp never prints on its own.
Code that needs what llama.cpp said during one call (an error's reason, the buffer sizes logged
when a context is created) wraps the call in :func:`capture`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from ._lib import ffi, lib

logger = logging.getLogger("pyllamacpp.llama")
# A library does not print through logging's last-resort handler: configure logging to see it.
logging.getLogger("pyllamacpp").addHandler(logging.NullHandler())

# llama.cpp's DEBUG lines (~2000 per context: graph, tensor and buffer details), one step below
# logging.DEBUG: ``logging.getLogger("pyllamacpp.llama").setLevel(pyllamacpp._log.TRACE)`` shows them.
TRACE = 5

# llama.cpp's level -> logging's, one step down for INFO and DEBUG: llama.cpp's INFO lines (~140
# per model load and context: every GGUF key, tensor type counts, hparams, buffer sizes) are what a
# Python library logs at DEBUG, and an application run at INFO should not scroll them past. WARN
# and ERROR keep their level: they say something went or may go wrong.
_PY_LEVEL = {
    lib.GGML_LOG_LEVEL_NONE: logging.DEBUG,
    lib.GGML_LOG_LEVEL_DEBUG: TRACE,
    lib.GGML_LOG_LEVEL_INFO: logging.DEBUG,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}


def _joined(first: str, more: list[str]) -> str:
    """One llama.cpp message as one line: its first line, then each line that continued it
    (llama.cpp's " - X = 4" detail lines), without their indent and list dash, after "; "."""
    text = first.strip()
    for line in more:
        line = line.strip().removeprefix("- ").strip()
        if line:
            text = f"{text}{' ' if text.endswith(':') else '; '}{line}"
    return text


@dataclass
class Capture:
    """Log lines emitted on this thread while the ``capture()`` block ran: (level, text) pairs;
    ``follows`` holds the indexes of the lines that continue the line before them (one
    llama.cpp message of several lines, or a ``GGML_LOG_LEVEL_CONT`` call)."""

    lines: list[tuple[int, str]] = field(default_factory=list)
    follows: set[int] = field(default_factory=set)

    def reason(self) -> str | None:
        """The first ERROR message (llama.cpp logs the cause first, then each caller's "failed"),
        else the first WARNING one, else None: its first line with the lines that continue it."""
        for want in (logging.ERROR, logging.WARNING):
            for i, (level, text) in enumerate(self.lines):
                if level == want:
                    j = i + 1
                    while j in self.follows:
                        j += 1
                    return _joined(text, [t for _, t in self.lines[i + 1 : j]])
        return None

    def text(self) -> str:
        return "\n".join(t for _, t in self.lines)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.partial = ""  # text of a line not yet ended by "\n"
        self.level = logging.DEBUG  # for GGML_LOG_LEVEL_CONT
        self.captures: list[Capture] = []
        self.errors: list[BaseException] = []  # raised by a logging handler inside the callback
        self.partial_follows = False  # the partial line continues the line before it
        # the last few WARN/ERROR messages, each [first line, continuation lines...]: c_reason()
        # finds there the lines C did not keep
        self.messages: list[list[str]] = []
        self.message_open = False  # the last line emitted belongs to messages[-1]


_tls = _ThreadState()
# The idents of threads whose _tls holds a line without "\n" or a handler's exception: a set in
# one global, so the hot calls that run without a capture (seq_state, set_seq_state with a reused
# buffer) check ``if pending:`` instead of two thread-local lookups after a cache-cold copy.
pending: set[int] = set()
_ident = threading.get_ident


def _emit(level: int, line: str, follows: bool = False) -> None:
    t = _tls
    for cap in t.captures:
        if follows:
            cap.follows.add(len(cap.lines))
        cap.lines.append((level, line))
    if level >= logging.WARNING:
        if follows and t.message_open:
            t.messages[-1].append(line)
        else:
            t.messages.append([line])
            del t.messages[:-4]
        t.message_open = True
    else:
        t.message_open = False
    if logger.isEnabledFor(level):
        logger.log(level, line)


def _on_error(exc_type, exc, tb):
    # Never let an exception cross into C: keep it; the capture around the C call re-raises it.
    _tls.errors.append(exc)
    pending.add(_ident())


@ffi.def_extern(onerror=_on_error)
def _pyllamacpp_log_cb(level, text, user_data):
    s = ffi.string(text).decode("utf-8", "replace")
    t = _tls
    cont = level == lib.GGML_LOG_LEVEL_CONT
    if not cont:
        t.level = _PY_LEVEL.get(level, logging.DEBUG)
    # a line begun by an earlier call keeps what it was; else a CONT call continues the last line
    first_follows = t.partial_follows if t.partial else cont
    buf = t.partial + s
    *lines, t.partial = buf.split("\n")
    t.partial_follows = first_follows if not lines else True  # after a "\n": a line of the same message
    if t.partial:
        pending.add(_ident())
    for i, line in enumerate(lines):
        _emit(t.level, line, first_follows if i == 0 else True)


class capture:
    """``with capture() as cap``: collect the log lines this thread emits inside the block.

    A class, not a generator: it wraps every decode and sample, where a generator-based context
    manager's overhead shows in tokens/s."""

    __slots__ = ("cap",)

    def __enter__(self) -> Capture:
        lib.pyl_log_debug = logger.isEnabledFor(TRACE)  # follow the logger's level
        self.cap = Capture()
        _tls.captures.append(self.cap)
        return self.cap

    def __exit__(self, exc_type, exc, tb) -> None:
        if _tls.partial:  # a last line without "\n" belongs to this call
            _emit(_tls.level, _tls.partial, _tls.partial_follows)
            _tls.partial = ""
        _tls.captures.remove(self.cap)
        if _tls.errors and exc_type is None:  # a logging handler raised inside the C callback
            err = _tls.errors.pop(0)
            _tls.errors.clear()
            pending.discard(_ident())
            raise err
        if pending and not _tls.errors:
            pending.discard(_ident())


def c_reason() -> str | None:
    """The reason llama.cpp logged during the last pyl_decode_sample / pyl_state_seq_get /
    pyl_state_seq_set call on this thread (its first ERROR line, else its first WARN line, kept
    in C by build_support/helpers.h), or None. Those calls run without :func:`capture`.

    C keeps a message's first line only; the lines that continued it (llama.cpp's "X = 4" / "Y =
    9" detail under "inconsistent sequence positions:") reached the log callback too, and are
    taken from the last messages this thread logged when their first line is the one C kept."""
    kept = ffi.string(lib.pyl_reason_text()).decode("utf-8", "replace").strip()
    if not kept:
        return None
    for msg in reversed(_tls.messages):
        first = msg[0].strip()
        if first == kept or (len(kept) >= 500 and first.startswith(kept)):  # C keeps 511 bytes
            return _joined(msg[0], msg[1:])
    return kept


def raise_pending() -> None:
    """After a call made without :func:`capture` (generate's steps, the sequence-state calls, whose
    failure reason C keeps): emit a last log line that had no "\n", as ``capture`` does, and
    re-raise what a logging handler raised inside the C callback."""
    t = _tls
    if t.partial:
        line, t.partial = t.partial, ""
        _emit(t.level, line, t.partial_follows)
    if t.errors:
        err = t.errors.pop(0)
        t.errors.clear()
        pending.discard(_ident())
        raise err
    if pending:
        pending.discard(_ident())


def install() -> None:
    """Point llama.cpp's and ggml's loggers (``llama_log_set`` sets both) at Python, through
    ``pyl_log_cb`` (build_support/helpers.h): DEBUG lines stay in C unless logger
    ``pyllamacpp.llama`` is enabled for TRACE, as checked on entering each :class:`capture`, when
    ``generate`` starts, or by :func:`sync_log_level`. The hot calls that run without a capture
    (``generate``'s steps, ``seq_state``, ``set_seq_state``) follow the level as it was last checked."""
    sync_log_level()
    lib.llama_log_set(ffi.addressof(lib, "pyl_log_cb"), ffi.NULL)


def sync_log_level() -> None:
    """Let llama.cpp's DEBUG lines through to Python when logger ``pyllamacpp.llama`` is enabled
    for :data:`TRACE` (they log at TRACE): call it after changing the level, before raw ``lib``
    calls or ``seq_state`` / ``set_seq_state`` (pyllamacpp's captured calls and ``generate`` check
    it themselves)."""
    lib.pyl_log_debug = logger.isEnabledFor(TRACE)


install()
lib.llama_backend_init()
