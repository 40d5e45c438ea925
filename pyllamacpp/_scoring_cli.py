"""``pyllamacpp perplexity``: :func:`pyllamacpp.scoring.perplexity` and
:func:`~pyllamacpp.scoring.kl_divergence` from the command line, printed as llama-perplexity prints
them. Kept apart from scoring.py so that building the CLI's parser loads no compiled extension."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from .experiments.common import add_model_path_flag


def add_parser(sub: Any) -> None:
    """Add the ``perplexity`` subcommand to ``sub`` (cli.py's subparsers)."""
    import argparse

    from .experiments.common import add_cache_and_thread_flags

    p = sub.add_parser(
        "perplexity",
        help="perplexity and KL divergence of a text file, as llama-perplexity computes them",
        description=(
            "Perplexity of a text as llama-perplexity computes it (tools/perplexity): chunks of -c tokens, "
            "-b // -c chunks per batch, BOS first in each chunk when the model adds one, the second half of "
            "each chunk scored; prints [i]running estimate per chunk and 'Final estimate: PPL = x +/- y'. "
            "With --kl-divergence-base FILE it also writes the base logits; with --kl-divergence it reads "
            "them and prints llama-perplexity's KL divergence statistics instead. As there, -f drops one "
            "trailing newline of the file."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_path_flag(p)
    p.add_argument("-f", "--file", type=Path, help="the text (default: the shipped Shakespeare excerpt)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per chunk (n_ctx)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="n_batch")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="n_ubatch")
    p.add_argument("-fa", "--flash-attn", choices=["auto", "on", "off"], default="auto", help="flash_attn_type")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="n_gpu_layers")
    add_cache_and_thread_flags(p)
    p.add_argument("--chunks", type=int, default=-1, help="most chunks (-1: all)")
    p.add_argument("--kl-divergence-base", type=Path, default=None, help="the base-logits file to write (or read)")
    p.add_argument("--kl-divergence", action="store_true", help="KL divergence against --kl-divergence-base")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_perplexity)


def _cmd_perplexity(args: Any) -> int:
    import json

    from .model import Model
    from .scoring import KL_HEADER, BaseLogits, _kl_row, kl_divergence, perplexity, sample_text_path

    kw = dict(
        n_ubatch=args.ubatch_size,
        flash_attn=args.flash_attn,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        n_threads=args.threads,
        n_threads_batch=args.threads,
    )
    quiet = args.json

    def say(text: str) -> None:
        if not quiet:
            print(text, end="", flush=True)

    with Model(args.model, n_gpu_layers=args.n_gpu_layers) as model:
        if args.kl_divergence:
            if args.kl_divergence_base is None:
                raise ValueError("--kl-divergence needs --kl-divergence-base FILE (the base logits to read)")
            base = BaseLogits(args.kl_divergence_base)
            say(KL_HEADER + "\n")

            def row(i: int, n: int, c: dict[str, float]) -> None:
                print(f"perplexity: chunk {i + 1}/{n}", file=sys.stderr, flush=True)
                say(_kl_row(i, c) + "\n")

            k = kl_divergence(model, base, args.batch_size, n_chunks=args.chunks, on_chunk=row, **kw)
            if quiet:
                d = {f: getattr(k, f) for f in k.__dataclass_fields__ if not f.endswith("_values")}
                print(json.dumps(d, indent=2, default=str))
            else:
                print("\n" + k.summary() if k.count >= 100 else "")
            return 0
        path = args.file or sample_text_path()
        data = path.read_bytes()
        if data.endswith(b"\n"):
            data = data[:-1]  # as llama-perplexity's -f

        def chunk(i: int, n: int, v: float) -> None:
            print(f"perplexity: chunk {i + 1}/{n}", file=sys.stderr, flush=True)
            say(f"[{i + 1}]{v:.4f},")

        r = perplexity(
            model,
            data,
            args.ctx_size,
            args.batch_size,
            n_chunks=args.chunks,
            save_base=args.kl_divergence_base,
            on_chunk=chunk,
            **kw,
        )
        if quiet:
            d = {f: getattr(r, f) for f in r.__dataclass_fields__ if f != "nll"}
            print(json.dumps(d, indent=2, default=str))
        else:
            print(f"\nFinal estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}")
    return 0
