"""The three task files of llama-perplexity's multiple-choice modes: readers, and a writer for the
binary one (tools/perplexity/perplexity.cpp).

- HellaSwag (``--hellaswag``): text, 6 lines per task: ``activity_label: context``, the gold
  ending's index (0-3), the 4 endings.
- Winogrande (``--winogrande``): CSV lines ``index,sentence,choice1,choice2,answer``, the sentence
  with one ``_`` where a choice goes, the answer 1 or 2; a quoted sentence loses its quotes.
- Multiple choice (``--multiple-choice``): binary, little-endian: ``u32 n_task``, ``u32
  offset[n_task]`` (each task's byte offset from the start of the file), then the tasks: a string
  (``u32 length`` + bytes) for the question, then twice (``mc1``: one right answer, ``mc2``: several,
  unused) ``u32 n`` (at most 100), n strings, ``n`` int32 labels (1: right).

Each reader takes the bytes as ``-f FILE`` gives them to llama-perplexity: one trailing newline of
the file dropped. Strings are kept byte for byte (decoded with ``surrogateescape``).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import TaskFileWarning

__all__ = [
    "HellaswagTask",
    "WinograndeTask",
    "MultipleChoiceTask",
    "read_hellaswag",
    "read_winogrande",
    "read_multiple_choice",
    "write_multiple_choice",
    "sample_path",
]

_SAMPLES = {"hellaswag": "hellaswag.txt", "winogrande": "winogrande.csv", "multiple-choice": "multiple_choice.jsonl"}


def sample_path(mode: str) -> Path:
    """The small task file shipped for a mode (``pyllamacpp/data/``; written for the package, see
    its README.md): 40 HellaSwag tasks, 40 Winogrande tasks, 40 multiple-choice questions.

    Args:
        mode: ``"hellaswag"``, ``"winogrande"`` or ``"multiple-choice"``.

    Returns:
        The file's path.

    Raises:
        ValueError: Another mode.
    """
    if mode not in _SAMPLES:
        raise ValueError(f"mode must be one of {sorted(_SAMPLES)}, not {mode!r}")
    path = Path(__file__).resolve().parent.parent / "data" / _SAMPLES[mode]
    return _binary_of(path) if mode == "multiple-choice" else path


def _binary_of(jsonl: Path) -> Path:
    """The binary file of the shipped multiple-choice questions (JSON lines, so that the package
    ships text only), written once into the cache (``$PYLLAMACPP_CACHE/data``), named by the
    source's hash, atomically."""
    import hashlib
    import json
    import uuid

    from .._fetch import cache_dir

    raw = jsonl.read_bytes()
    out = cache_dir() / "data" / f"multiple_choice-{hashlib.sha256(raw).hexdigest()[:16]}.bin"
    if not out.is_file():
        tasks = [
            MultipleChoiceTask(d["question"], tuple(d["answers"]), tuple(d["labels"]))
            for d in map(json.loads, raw.decode().splitlines())
        ]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
        try:
            write_multiple_choice(tasks, tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return out


def _read(data: str | bytes | os.PathLike) -> bytes:
    """The bytes of a task file as ``-f`` reads them: a path (str or PathLike) is read; a str with a
    newline, or bytes, is the content itself; one trailing newline is dropped."""
    if isinstance(data, bytes):
        raw = data
    elif isinstance(data, str) and "\n" in data:
        raw = data.encode("utf-8", "surrogateescape")
    elif isinstance(data, (str, os.PathLike)):
        raw = Path(data).read_bytes()
    else:
        raise TypeError(f"expected a path, a str or bytes, not {type(data).__name__}")
    return raw[:-1] if raw.endswith(b"\n") else raw


def _warn(message: str) -> None:
    """A :class:`TaskFileWarning` pointing at the caller's line outside the package."""
    import sys
    import types
    import warnings

    # the first frame outside pyllamacpp/ (as context.py's BusyCoresWarning does)
    level, here = 2, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    f: types.FrameType | None = sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(here + os.sep):
        level, f = level + 1, f.f_back
    warnings.warn(message, TaskFileWarning, stacklevel=level)


def _lines(raw: bytes) -> list[str]:
    """``std::getline`` over the text: no empty last line after a final newline."""
    lines = raw.decode("utf-8", "surrogateescape").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


# -- HellaSwag ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class HellaswagTask:
    """One HellaSwag task.

    Attributes:
        context: ``activity_label: context``, the text the endings continue.
        gold: The right ending's index (0-3).
        endings: The 4 endings (llama-perplexity scores ``context + " " + ending``).
        line: The context's line in the file (1-based).
    """

    context: str
    gold: int
    endings: tuple[str, str, str, str]
    line: int


def read_hellaswag(data: str | bytes | os.PathLike) -> list[HellaswagTask]:
    """The tasks of a HellaSwag file, in file order (``hellaswag_score``'s format).

    Args:
        data: The file's path, or its content (bytes, or a str with newlines); one trailing newline
            is dropped, as ``-f`` does.

    Returns:
        The tasks.

    Raises:
        ValueError: No lines, a line count that is not a multiple of 6, or a gold line that is not
            0, 1, 2 or 3 (the message names the line).
        OSError: The file cannot be read.
    """
    lines = _lines(_read(data))
    if not lines:
        raise ValueError("HellaSwag data: no lines")
    if len(lines) % 6:
        n = len(lines)
        raise ValueError(
            f"HellaSwag data: {n} lines, not a multiple of 6 (a context, the gold index, 4 endings per task): "
            f"the last task, from line {n - n % 6 + 1}, has {n % 6} line(s)"
        )
    tasks = []
    for i in range(0, len(lines), 6):
        g = lines[i + 1].strip()
        if g not in ("0", "1", "2", "3"):
            raise ValueError(
                f"HellaSwag data, line {i + 2}: the gold ending's index must be 0, 1, 2 or 3, not {lines[i + 1]!r} "
                f"(the task starting at line {i + 1}; is this a HellaSwag file?)"
            )
        tasks.append(HellaswagTask(lines[i], int(g), (lines[i + 2], lines[i + 3], lines[i + 4], lines[i + 5]), i + 1))
    return tasks


# -- Winogrande --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WinograndeTask:
    """One Winogrande task: ``first + choice + second`` for each of the two choices.

    Attributes:
        first: The sentence up to the ``_``.
        second: The sentence after it.
        choices: The two words or phrases for the blank.
        answer: The right choice, 1 or 2.
        index: The line's first field.
        line: The line in the file (1-based).
    """

    first: str
    second: str
    choices: tuple[str, str]
    answer: int
    index: str
    line: int


_INT = re.compile(r"\s*([+-]?\d+)")


def _winogrande_line(line: str) -> tuple[WinograndeTask | None, str]:
    """``load_winogrande_from_csv`` on one line: the task, or None and llama-perplexity's complaint."""
    commas: list[int] = []
    quote_open = False
    for i, ch in enumerate(line):
        if not quote_open:
            if ch == ",":
                commas.append(i)
                if len(commas) == 4:
                    break
            elif ch == '"':
                quote_open = True
        elif ch == '"':
            quote_open = False
    if len(commas) != 4:
        return None, f"failed to find comma separators in <{line}>"
    c0, c1, c2, c3 = commas
    if line[c0 + 1] == '"':
        sentence = line[c0 + 2 : c0 + 2 + max(0, c1 - c0 - 3)]
    else:
        sentence = line[c0 + 1 : c1]
    where = sentence.find("_")
    if where < 0:
        return None, f"no _ in <{sentence}>"
    m = _INT.match(line[c3 + 1 :])  # `stream >> i_answer`: leading blanks, a sign, digits
    if m is None or int(m.group(1)) not in (1, 2):
        return None, f"failed to parse answer <{line[c3 + 1 :]}>"
    choices = (line[c1 + 1 : c2], line[c2 + 1 : c3])
    return WinograndeTask(sentence[:where], sentence[where + 1 :], choices, int(m.group(1)), line[:c0], 0), ""


def read_winogrande(
    data: str | bytes | os.PathLike, *, strict: bool = False
) -> tuple[list[WinograndeTask], list[tuple[int, str]]]:
    """The tasks of a Winogrande CSV file, as ``load_winogrande_from_csv`` reads it.

    As there: a line whose commas, ``_`` or answer cannot be found is skipped; and the text's last
    line is not read when no newline ends it (its ``getline`` loop stops at the end of the text
    before using what it read), which, after ``-f`` has dropped the file's final newline, is the
    last line of any file that does not end with an empty line. llama-perplexity says nothing of
    that line; here a :class:`~pyllamacpp.errors.TaskFileWarning` names it.

    Args:
        data: The file's path, or its content; one trailing newline is dropped, as ``-f`` does.
        strict: Raise at the first line that would be skipped.

    Returns:
        ``(tasks, skipped)``: the tasks in file order, and ``(line number, reason)`` for each line
        skipped (the reason in llama-perplexity's words).

    Warns:
        TaskFileWarning: The last line has no newline after it, so it is not read (its number,
            why, and its start).

    Raises:
        ValueError: ``strict`` and a line that would be skipped, or no task at all (the message
            names the first line skipped).
        OSError: The file cannot be read.
    """
    # each line is used only once a newline ends it: the piece after the text's last newline is not
    lines = _read(data).decode("utf-8", "surrogateescape").split("\n")
    if lines[-1]:
        short = lines[-1] if len(lines[-1]) <= 60 else lines[-1][:57] + "..."
        _warn(
            f"Winogrande data, line {len(lines)}: not read, as llama-perplexity does not read it: no newline "
            f"ends it (its reader uses a line once a newline follows, and -f drops the file's last newline); "
            f"end the file with an empty line to score it: <{short}>"
        )
    lines.pop()
    tasks: list[WinograndeTask] = []
    skipped: list[tuple[int, str]] = []
    for n, line in enumerate(lines, 1):
        task, why = _winogrande_line(line)
        if task is None:
            if strict:
                raise ValueError(f"Winogrande data, line {n}: {why}")
            skipped.append((n, why))
            continue
        tasks.append(WinograndeTask(task.first, task.second, task.choices, task.answer, task.index, n))
    if not tasks:
        first = f": line {skipped[0][0]}: {skipped[0][1]}" if skipped else " (no line read)"
        raise ValueError(f"Winogrande data: no tasks{first}")
    return tasks, skipped


# -- the multiple-choice binary format ---------------------------------------------------------
@dataclass(frozen=True)
class MultipleChoiceTask:
    """One task of the multiple-choice binary format.

    Attributes:
        question: The question (or the context the answers continue; llama-perplexity scores
            ``question + " " + answer``).
        answers: The answers with one right one (``mc1``).
        labels: One per answer, 1 for the right one(s), else 0.
        mc2_answers: The answers with several right ones (``mc2``; read and written, not scored).
        mc2_labels: Their labels.
        offset: Where the task starts in the file (-1 for a task built in Python).
    """

    question: str
    answers: tuple[str, ...]
    labels: tuple[int, ...]
    mc2_answers: tuple[str, ...] = ()
    mc2_labels: tuple[int, ...] = ()
    offset: int = -1


class _Reader:
    """Bounds-checked reads at an offset of the file's bytes; every short read says what it was
    reading, where, how many bytes it needed and how many were left."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def take(self, off: int, n: int, what: str) -> bytes:
        left = len(self.raw) - off
        if n > left:
            raise ValueError(
                f"multiple-choice data: {what} at byte {off}: needs {n} bytes, {max(left, 0)} left "
                f"(file of {len(self.raw)} bytes)"
            )
        return self.raw[off : off + n]

    def u32(self, off: int, what: str) -> int:
        return int(struct.unpack_from("<I", self.take(off, 4, what))[0])

    def string(self, off: int, what: str) -> tuple[str, int]:
        n = self.u32(off, f"{what}'s length")
        return self.take(off + 4, n, what).decode("utf-8", "surrogateescape"), off + 4 + n

    def answers(self, off: int, what: str) -> tuple[tuple[str, ...], tuple[int, ...], int]:
        n = self.u32(off, f"{what}'s count")
        if n > 100:  # llama-perplexity's limit
            raise ValueError(f"multiple-choice data: {what} at byte {off}: {n} answers, more than 100")
        off += 4
        out = []
        for k in range(n):
            s, off = self.string(off, f"{what} answer {k}")
            out.append(s)
        labels = struct.unpack_from(f"<{n}i", self.take(off, 4 * n, f"{what}'s {n} labels"))
        return tuple(out), tuple(int(v) for v in labels), off + 4 * n

    def task(self, off: int, what: str) -> tuple[MultipleChoiceTask, int]:
        start = off
        q, off = self.string(off, f"{what}: the question")
        a1, l1, off = self.answers(off, f"{what}: mc1")
        a2, l2, off = self.answers(off, f"{what}: mc2")
        return MultipleChoiceTask(q, a1, l1, a2, l2, start), off


def _mc_header(raw: bytes) -> tuple[_Reader, list[int]]:
    r = _Reader(raw)
    if len(raw) < 4 or r.u32(0, "the task count") == 0:
        raise ValueError(
            "multiple-choice data: no tasks (the file's first 4 bytes, a u32 task count, are 0 or missing)"
        )
    n = r.u32(0, "the task count")
    pos = list(struct.unpack_from(f"<{n}I", r.take(4, 4 * n, f"the {n} task offsets")))
    return r, pos


def read_multiple_choice(
    data: str | bytes | os.PathLike, order: Iterable[int] | None = None
) -> list[MultipleChoiceTask]:
    """Tasks of a multiple-choice binary file, read as ``multiple_choice_score`` reads them.

    All tasks (``order`` None) are read one after the other from the end of the offset table, as
    llama-perplexity does when it uses them all; a selection is read at the offsets the table gives.
    Bytes after the last task are not read there, and nothing is said; here a
    :class:`~pyllamacpp.errors.TaskFileWarning` says how many (a task count smaller than the tasks
    written loses the rest).

    Args:
        data: The file's path, or its bytes; one trailing newline byte is dropped, as ``-f`` does.
        order: Indices of the tasks to read, in this order (None: all, in file order).

    Returns:
        The tasks.

    Warns:
        TaskFileWarning: All tasks read and bytes left after the last one.

    Raises:
        ValueError: No tasks, a short read (what, where, the bytes needed and left), more than 100
            answers, an index outside the table.
        OSError: The file cannot be read.
    """
    r, pos = _mc_header(_read(data))
    out = []
    if order is None:
        off = 4 + 4 * len(pos)
        for i in range(len(pos)):
            t, off = r.task(off, f"task {i} of {len(pos)}")
            out.append(t)
        if off < len(r.raw):
            _warn(
                f"multiple-choice data: {len(r.raw) - off} byte(s) after the last of its {len(pos)} task(s) "
                f"(bytes {off} to {len(r.raw)}) are not read, as llama-perplexity does not read them: it reads "
                "the task count the file's first u32 gives"
            )
        return out
    for i in order:
        if not 0 <= i < len(pos):
            raise ValueError(f"multiple-choice data: task {i} is outside the file's {len(pos)} tasks")
        out.append(r.task(pos[i], f"task {i} (at the offset the table gives, {pos[i]})")[0])
    return out


def multiple_choice_count(data: str | bytes | os.PathLike) -> int:
    """The task count of a multiple-choice binary file (its first u32).

    Args:
        data: The file's path, or its bytes.

    Returns:
        The count.

    Raises:
        ValueError: No tasks, or an offset table shorter than the count.
    """
    return len(_mc_header(_read(data))[1])


def _pack_string(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode("utf-8", "surrogateescape")
    return struct.pack("<I", len(b)) + b


def _pack_answers(answers: Iterable[str], labels: Iterable[int], what: str) -> bytes:
    a, lab = list(answers), [int(v) for v in labels]
    if len(a) != len(lab):
        raise ValueError(f"{what}: {len(a)} answers but {len(lab)} labels")
    if len(a) > 100:
        raise ValueError(f"{what}: {len(a)} answers, more than the 100 llama-perplexity reads")
    return struct.pack("<I", len(a)) + b"".join(_pack_string(s) for s in a) + struct.pack(f"<{len(lab)}i", *lab)


def write_multiple_choice(tasks: Iterable[MultipleChoiceTask], path: str | os.PathLike | None = None) -> bytes:
    """The multiple-choice binary file of ``tasks``, as ``multiple_choice_score`` reads it.

    Args:
        tasks: The tasks (``offset`` is ignored: the file's own offsets are written).
        path: Also write the bytes there.

    Returns:
        The file's bytes.

    Raises:
        ValueError: No tasks, answers and labels of different lengths, more than 100 answers, an
            empty question or answer (llama-perplexity refuses them), a file past 4 GiB.
        OSError: ``path`` cannot be written.
    """
    body = []
    for i, t in enumerate(tasks):
        if not t.question or not t.answers or any(not a for a in t.answers):
            raise ValueError(
                f"task {i}: an empty question, no answers or an empty answer (llama-perplexity refuses it)"
            )
        body.append(
            _pack_string(t.question)
            + _pack_answers(t.answers, t.labels, f"task {i} (mc1)")
            + _pack_answers(t.mc2_answers, t.mc2_labels, f"task {i} (mc2)")
        )
    if not body:
        raise ValueError("no tasks")
    off = 4 + 4 * len(body)
    pos = []
    for b in body:
        pos.append(off)
        off += len(b)
    if off >= 2**32:
        raise ValueError(f"{off} bytes: the format's u32 offsets end at 4 GiB")
    raw = struct.pack(f"<I{len(pos)}I", len(pos), *pos) + b"".join(body)
    if path is not None:
        Path(path).write_bytes(raw)
    return raw
