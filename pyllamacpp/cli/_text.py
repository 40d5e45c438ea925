"""``pyllamacpp demo``, ``generate`` and ``chat``: a model's text, streamed to stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

_ESCAPES = str.maketrans({"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"})


def _cmd_demo(args) -> int:
    """Tokenize, decode, print the top next tokens and the sequence's state size, then generate."""
    import numpy as np

    from .. import default_model_path
    from ..model import Model

    path = args.model or default_model_path()
    kw = {"n_ctx": args.n_ctx, "n_threads": args.threads, "n_threads_batch": args.threads}  # as -t says
    with Model(path) as model, model.context(**kw) as ctx:
        if args.json:
            return _demo_json(args, path, model, ctx)

        # each line as soon as it is known, flushed: a reader that left (`| head -3`) shows as a
        # failed write here, and the command stops instead of computing what nobody reads
        def say(line: str) -> None:
            print(line, flush=True)

        say(
            f"model   {path.name}: {model.n_params / 1e6:.1f}M params, {model.n_layer} layers, "
            f"n_vocab {model.n_vocab} (llama.cpp's description: {model.description})"
        )
        tokens = model.tokenize(args.prompt)
        say(f"prompt  {args.prompt!r} -> {len(tokens)} tokens {tokens.tolist()}")
        ctx.prefill(tokens)
        logits = ctx.logits()
        top = np.argsort(logits)[::-1][: args.top]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        say("top next tokens:")
        for t in top:
            say(f"  {int(t):6d} {model.token_to_piece(int(t))!r:16} logit {logits[t]:8.3f}  p {probs[t]:.4f}")
        del logits  # a view of the output buffer: the generation below reuses it
        say(f"sequence 0 state: {len(ctx.seq_state(0)):,} bytes (llama_state_seq_get_data_ext, {len(tokens)} cells)")
        # streamed, escaped as repr() would (one line), so each token's piece is written as it comes
        sys.stdout.write("generated: '")
        with model.complete(args.prompt, args.n_predict, ctx=ctx, stream=True) as stream:  # greedy, seq 0 afresh
            for piece in stream:
                sys.stdout.write(piece.translate(_ESCAPES))
                sys.stdout.flush()
        say(f"' ({len(stream.tokens)} tokens, greedy, stopped by {stream.finish_reason})")
    return 0


def _demo_json(args, path: Path, model, ctx) -> int:
    """``demo --json``: the same facts as one JSON object, printed when all are known."""
    import numpy as np

    tokens = model.tokenize(args.prompt)
    ctx.prefill(tokens)
    logits = ctx.logits().copy()  # a view would show the generation's last logits below
    top = np.argsort(logits)[::-1][: args.top]
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    state_bytes = len(ctx.seq_state(0))
    text = model.complete(args.prompt, args.n_predict, ctx=ctx)  # greedy, sequence 0 afresh
    print(
        json.dumps(
            {
                "model": str(path),
                "description": model.description,
                "n_params": model.n_params,
                "tokens": tokens.tolist(),
                "top": [
                    {
                        "token": int(t),
                        "piece": model.token_to_piece(int(t)),
                        "logit": float(logits[t]),
                        "p": float(probs[t]),
                    }
                    for t in top
                ],
                "seq_state_bytes": state_bytes,
                "generated": str(text),
                "generated_tokens": len(text.tokens),
                "finish_reason": text.finish_reason,
            }
        )
    )
    return 0


def _context_kwargs(args) -> dict:
    """The context flags given (-c, -t); the library's defaults for the others."""
    kw = {"n_ctx": args.ctx_size}
    if args.threads is not None:
        kw["n_threads"] = kw["n_threads_batch"] = args.threads
    return kw


def _sampler(model, args):
    """Greedy, or with --temp > 0 llama.cpp's chain: top-k, top-p, min-p, temperature, dist(seed)."""
    from ..sampling import Sampler

    if args.temp <= 0:
        return Sampler.greedy()
    s = Sampler(model).top_k(args.top_k).top_p(args.top_p).min_p(args.min_p).temp(args.temp)
    return s.dist(args.seed) if args.seed is not None else s.dist()


def _stream_out(stream) -> None:
    """Write a TextStream's pieces to stdout as they come; the end of generation on stderr."""
    with stream:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stream.finish_reason == "ctx_full":
        print(
            f"[context full after {len(stream.tokens)} tokens: n_ctx={stream.ctx.n_ctx}; give a larger -c]",
            file=sys.stderr,
        )


def _cmd_generate(args) -> int:
    """Generate text after a prompt, streamed to stdout as it comes (greedy unless --temp)."""
    from .. import default_model_path
    from ..model import Model

    with (
        Model(args.model or default_model_path()) as model,
        model.context(**_context_kwargs(args)) as ctx,
        _sampler(model, args) as sampler,
    ):
        stream = model.complete(
            args.prompt,
            args.n_predict,
            sampler=sampler,
            ctx=ctx,
            stream=True,
            parse_special=args.special,
            stop=args.stop,
        )
        if args.display_prompt:
            sys.stdout.write(args.prompt)
        _stream_out(stream)
    return 0


def _cmd_chat(args) -> int:
    """Chat through the model's chat template: each line of stdin is a user turn, each answer is
    streamed to stdout (the conversation is kept; end with EOF, Ctrl-D)."""
    from .. import default_model_path
    from ..model import Model

    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    with (
        Model(args.model or default_model_path()) as model,
        model.context(**_context_kwargs(args)) as ctx,
        _sampler(model, args) as sampler,
    ):
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            try:
                stream = model.chat(messages, args.n_predict, sampler=sampler, ctx=ctx, stream=True, stop=args.stop)
            except ValueError as e:
                if "more than the context holds" not in str(e):
                    raise
                print(f"pyllamacpp chat: the conversation no longer fits: {e}; give a larger -c", file=sys.stderr)
                return 1
            _stream_out(stream)
            messages.append({"role": "assistant", "content": stream.text})
