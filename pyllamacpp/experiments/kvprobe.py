"""``pyllamacpp kvprobe --ops '...'``: scripted sequence and state work in one line.

Ops, separated by ';' (each reports what it did):
  text:SEQ:TEXT        tokenize TEXT and decode it after what SEQ holds
  tokens:SEQ:ID,ID,..  decode these token ids after what SEQ holds
  gen:SEQ:N            greedy-generate N tokens into SEQ
  save:SEQ:FILE        write llama_state_seq_get_data_ext bytes of SEQ to FILE (+ FILE.json sidecar)
  load:SEQ:FILE        load FILE into SEQ: a sequence dump (save:'s, llama_state_seq_set_data_ext)
                       or a seq file (Context.save_seq_state's, llama_state_seq_load_file),
                       told apart by their magic
  cp:SRC:DST           llama_memory_seq_cp
  rm:SEQ[:P0:P1]       llama_memory_seq_rm (positions [P0, P1), -1 = open end)
  keep:SEQ             llama_memory_seq_keep
  shift:SEQ:DELTA      llama_memory_seq_add over all positions of SEQ
  clear                llama_memory_clear
  show:SEQ             positions, cell count and bytes of SEQ's state
A bad op is refused before anything runs, naming the op and why.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import LlamaError
from .common import Command, Interrupted, add_model_flags, context_kwargs, load_model

if TYPE_CHECKING:
    from ..context import Context
    from ..model import Model

_ARITY = {
    "text": (2, 2),
    "tokens": (2, 2),
    "gen": (2, 2),
    "save": (2, 2),
    "load": (2, 2),
    "cp": (2, 2),
    "rm": (1, 3),
    "keep": (1, 1),
    "shift": (2, 2),
    "clear": (0, 0),
    "show": (1, 1),
}


def _flags(p: argparse.ArgumentParser) -> None:
    add_model_flags(p, ctx=4096)
    p.add_argument("--ops", required=True, help="ops separated by ';' (see above)")


@dataclasses.dataclass
class Op:
    """One parsed op.

    Attributes:
        index: Its place in the spec, from 1.
        text: The op as written.
        name: The op's name (``text``, ``gen``, ``save``...).
        args: Its fields, converted (seq ids as ints, files as paths...).
    """

    index: int
    text: str
    name: str
    args: list


class OpError(ValueError):
    """A bad op, refused before anything runs; the message names the op and why."""


def parse_ops(spec: str, n_seq_max: int) -> list[Op]:
    """Parse the ops of ``--ops``, checking every op before any runs.

    Args:
        spec: The ops, separated by ``;`` (see the module's docstring).
        n_seq_max: The context's ``n_seq_max``: seq ids must be in ``[0, n_seq_max)``.

    Returns:
        The ops, in order.

    Raises:
        OpError: An unknown op, a wrong number of fields, a bad seq id, number or file, or no ops
            at all; the message names the op and why.
    """
    ops = []
    saved: set[Path] = set()  # files an earlier save op will have written
    for i, raw in enumerate(s for s in spec.split(";") if s.strip()):
        raw = raw.strip()
        name, _, rest = raw.partition(":")
        if name not in _ARITY:
            raise OpError(f"op {i + 1} {raw!r}: unknown op {name!r} (known: {', '.join(_ARITY)})")
        # text keeps its colons: split only as far as the op has fields
        lo, hi = _ARITY[name]
        parts = rest.split(":", hi - 1) if rest else []
        if not lo <= len(parts) <= hi or (name == "rm" and len(parts) == 2):
            raise OpError(f"op {i + 1} {raw!r}: {name} takes {lo if lo == hi else f'{lo} or {hi}'} field(s)")
        args: list = []
        try:
            if name in ("text", "tokens", "gen", "save", "load", "rm", "keep", "shift", "show"):
                args.append(_seq(parts[0], n_seq_max))
            if name == "text":
                if not parts[1]:
                    raise OpError("empty text")
                args.append(parts[1])
            elif name == "tokens":
                toks = [int(x) for x in parts[1].split(",") if x.strip()]
                if not toks:
                    raise OpError("no token ids")
                args.append(toks)
            elif name == "gen":
                n = int(parts[1])
                if n <= 0:
                    raise OpError(f"N must be positive, got {n}")
                args.append(n)
            elif name in ("save", "load"):
                path = Path(parts[1])
                if name == "load" and not path.is_file() and path not in saved:
                    raise OpError(f"no such file {path} (and no earlier save: op writes it)")
                if name == "save":
                    saved.add(path)
                if name == "save" and not path.parent.exists():
                    raise OpError(f"folder {path.parent} does not exist")
                args.append(path)
            elif name == "cp":
                args = [_seq(parts[0], n_seq_max), _seq(parts[1], n_seq_max)]
            elif name == "rm" and len(parts) == 3:
                args += [int(parts[1]), int(parts[2])]
            elif name == "shift":
                args.append(int(parts[1]))
        except OpError as e:
            raise OpError(f"op {i + 1} {raw!r}: {e}") from None
        except ValueError as e:
            raise OpError(f"op {i + 1} {raw!r}: {e}") from None
        ops.append(Op(i + 1, raw, name, args))
    if not ops:
        raise OpError("no ops given")
    return ops


def _is_seq_file(path: Path) -> bool:
    """Whether the file starts with ``LLAMA_STATE_SEQ_MAGIC`` ('ggsq', a seq file)."""
    from .._lib import lib

    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int.from_bytes(head, "little") == lib.LLAMA_STATE_SEQ_MAGIC


def _seq(text: str, n_seq_max: int) -> int:
    s = int(text)
    if not 0 <= s < n_seq_max:
        raise OpError(f"sequence {s} is outside [0, {n_seq_max}) (-np {n_seq_max})")
    return s


class Probe:
    """Runs ops on one context, remembering the tokens each sequence holds where it knows them.

    Args:
        model: The :class:`~pyllamacpp.Model`.
        ctx: The :class:`~pyllamacpp.Context` the ops work on.
    """

    def __init__(self, model: Model, ctx: Context) -> None:
        from ..batch import Batch

        self.model, self.ctx = model, ctx
        self.batch = Batch(max(ctx.n_batch, 1), ctx.n_seq_max, model=model)
        self.history: dict[int, list[int]] = {}  # tokens each sequence holds, when known
        self.fresh: int | None = None  # the sequence whose last token has logits now

    def _feed(self, seq: int, toks) -> str:
        mem = self.ctx.memory
        p0 = mem.seq_pos_max(seq) + 1
        self.ctx.prefill(np.asarray(toks, np.int32), seq, p0)
        self.history.setdefault(seq, []).extend(int(t) for t in toks)
        self.fresh = seq
        return f"seq {seq}: decoded {len(toks)} tokens at pos {p0}..{p0 + len(toks) - 1}"

    def run(self, op: Op) -> dict:
        """Run one op (``llama_decode``, ``llama_memory_*``, ``llama_state_seq_*_data_ext``...).

        Args:
            op: The op, from :func:`parse_ops`.

        Returns:
            ``op`` (its text), ``did`` (what it did, in words) and what it produced (``tokens``,
            ``bytes``, positions and cells for ``show``).

        Raises:
            OpError: ``gen`` on a sequence whose last token is unknown.
            ValueError: A bad argument caught by the library (a seq id, a token).
            LlamaError: llama.cpp failed: ``DecodeError`` (``KVCacheFullError``...), ``StateError``
                on a save or load, a memory that cannot shift.
            OSError: A file cannot be read or written.
        """
        ctx, mem, model = self.ctx, self.ctx.memory, self.model
        name, a = op.name, op.args
        info: dict = {"op": op.text}
        if name == "text":
            seq, text = a
            toks = model.tokenize(text, add_special=mem.seq_pos_max(seq) < 0)
            info["tokens"] = toks.tolist()
            info["did"] = self._feed(seq, toks)
        elif name == "tokens":
            info["did"] = self._feed(a[0], a[1])
        elif name == "gen":
            seq, n = a
            if self.fresh != seq:
                hist = self.history.get(seq)
                if not hist:
                    raise OpError(
                        f"op {op.index} {op.text!r}: sequence {seq} has no known last token to "
                        "continue from (feed it with text:/tokens: first)"
                    )
                last = mem.seq_pos_max(seq)
                mem.seq_rm(seq, last, -1)  # decode the last token again, this time with logits
                self.batch.clear()
                self.batch.add(hist[-1], last, seq, logits=True)
                ctx.decode(self.batch)
            out = []
            pos = mem.seq_pos_max(seq) + 1
            for _ in range(n):
                tok = int(np.argmax(ctx.logits(-1)))
                out.append(tok)
                self.batch.clear()
                self.batch.add(tok, pos, seq, logits=True)
                ctx.decode(self.batch)
                pos += 1
            self.history.setdefault(seq, []).extend(out)
            self.fresh = seq
            info["tokens"] = out
            info["did"] = f"seq {seq}: generated {n} tokens {model.detokenize(out)!r}"
        elif name == "save":
            seq, path = a
            n = ctx.save_seq_dump(path, seq, tokens=self.history.get(seq))
            info["bytes"] = n
            info["did"] = f"seq {seq}: wrote {n:,} bytes to {path} (+ {path.name}.json)"
        elif name == "load":
            seq, path = a
            from ..state import read_sidecar

            side = read_sidecar(path) or {}
            if _is_seq_file(path):  # llama_state_seq_save_file's: a header and its tokens, then the dump
                stored = ctx.load_seq_state(path, seq)
                n, what = path.stat().st_size, f"a seq file holding {stored.size} token ids"
                self.history[seq] = stored.tolist() or list(side.get("tokens") or [])
            else:  # a sequence dump (or a StateError saying what the file is)
                n = ctx.set_seq_state(seq, np.fromfile(path, dtype=np.uint8))
                what = "a sequence dump"
                self.history[seq] = list(side.get("tokens") or [])
            self.fresh = None
            info["bytes"] = n
            info["did"] = (
                f"seq {seq}: loaded {n:,} bytes from {path} ({what}), "
                f"pos {mem.seq_pos_min(seq)}..{mem.seq_pos_max(seq)}"
            )
        elif name == "cp":
            src, dst = a
            mem.seq_cp(src, dst)
            self.history[dst] = list(self.history.get(src, []))
            info["did"] = f"copied seq {src} -> {dst}"
        elif name == "rm":
            seq = a[0]
            p0, p1 = (a[1], a[2]) if len(a) == 3 else (-1, -1)
            ok = mem.seq_rm(seq, p0, p1)
            if ok and p1 < 0 and seq in self.history:
                keep = max(0, p0) if p0 >= 0 else 0
                self.history[seq] = self.history[seq][:keep]
            if self.fresh == seq:
                self.fresh = None
            info["did"] = f"seq {seq}: rm [{p0}, {p1}) -> {'ok' if ok else 'refused by llama.cpp'}"
        elif name == "keep":
            mem.seq_keep(a[0])
            self.history = {a[0]: self.history.get(a[0], [])}
            info["did"] = f"kept only seq {a[0]}"
        elif name == "shift":
            seq, delta = a
            mem.seq_add(seq, 0, -1, delta)
            info["did"] = f"seq {seq}: positions shifted by {delta:+d}"
        elif name == "clear":
            mem.clear()
            self.history.clear()
            self.fresh = None
            info["did"] = "memory cleared"
        elif name == "show":
            seq = a[0]
            info.update(self.show(seq))
            info["did"] = (
                f"seq {seq}: pos {info['pos_min']}..{info['pos_max']}, {info['cells']} cells, {info['bytes']:,} bytes"
            )
        return info

    def show(self, seq: int) -> dict:
        """Positions, cells and state bytes of ``seq`` (``llama_state_seq_get_data``, parsed).

        Args:
            seq: The sequence.

        Returns:
            ``pos_min``, ``pos_max``, ``cells`` and ``bytes``.

        Raises:
            StateError: llama.cpp could not write the sequence's state.
            StateFormatError: The state cannot be parsed.
        """
        from ..state import parse

        mem = self.ctx.memory
        state = self.ctx.seq_state(seq)
        # n_head_kv is layer 0's: 0 when layer 0 has no attention (hybrid models), then rows stay flat
        st = parse(state.data, n_head_kv=self.model.n_head_kv or None)
        cells = sum(s.cell_count for p in st.parts for s in p.streams)
        return {"pos_min": mem.seq_pos_min(seq), "pos_max": mem.seq_pos_max(seq), "cells": cells, "bytes": len(state)}


def run(args: argparse.Namespace) -> dict:
    """Parse ``--ops``, load the model, make a context and run the ops in order.

    An op that fails stops the run; what ran so far is returned with ``error`` and ``ok`` False.

    Args:
        args: The parsed flags: ``ops`` and those of
            :func:`~pyllamacpp.experiments.common.add_model_flags`.

    Returns:
        ``model``, ``n_ctx``, ``n_seq_max``, ``kv_unified``, ``flash_attn``, ``ops`` (one dict per
        op that ran) and, after a failure, ``error`` and ``ok``.

    Raises:
        OpError: A bad op (before the model is loaded).
        ModelLoadError: The model cannot be loaded.
        ContextError: llama.cpp cannot make a context with these settings.
        OSError: A file of a save or load op cannot be written or read.
        Interrupted: Ctrl-C; it carries the ops that ran before it.
    """
    ops = parse_ops(args.ops, args.parallel)  # refused before the model is even loaded
    with load_model(args) as model, model.context(**context_kwargs(args)) as ctx:
        out: dict[str, Any] = {"model": str(model.path), "ops": []}
        probe = Probe(model, ctx)
        out.update(
            n_ctx=ctx.n_ctx,
            n_seq_max=ctx.n_seq_max,
            kv_unified=bool(ctx.params.kv_unified),
            flash_attn=ctx.flash_attn,
        )
        for op in ops:
            try:
                out["ops"].append(probe.run(op))
            except (ValueError, LlamaError) as e:  # what ran so far is reported, then why it stopped
                out["error"] = f"op {op.index} {op.text!r}: {e}"
                out["ok"] = False
                break
            except KeyboardInterrupt:  # Ctrl-C: so is what ran before it
                n = len(out["ops"])
                raise Interrupted(out if n else None, n, len(ops), "ops") from None
    return out


def print_report(data: dict) -> None:
    """Print what :func:`run` returned: the context, then each op and what it did.

    Args:
        data: What :func:`run` returned.
    """
    print(
        f"model {data['model']}: n_ctx {data['n_ctx']}, -np {data['n_seq_max']}, "
        f"kv_unified {data['kv_unified']}, flash_attn {data['flash_attn']}"
    )
    for i, r in enumerate(data["ops"], 1):
        print(f"[{i}] {r['op']}\n    {r['did']}")
    if data.get("error"):
        print(f"stopped: {data['error']}")


COMMAND = Command("kvprobe", "scripted sequence and state ops", __name__, _flags)
add_parser, main = COMMAND.add_parser, COMMAND
