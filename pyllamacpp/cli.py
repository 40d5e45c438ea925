"""The ``pyllamacpp`` command."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_demo(args) -> int:
    """Tokenize, decode, print the top next tokens and the sequence's state size."""
    import numpy as np

    from . import default_model_path
    from .model import Model

    path = args.model or default_model_path()
    with Model(path) as model, model.context(n_ctx=args.n_ctx, n_threads=args.threads) as ctx:
        tokens = model.tokenize(args.prompt)
        ctx.prefill(tokens)
        logits = ctx.logits()
        top = np.argsort(logits)[::-1][: args.top]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        state = ctx.seq_state(0)
        if args.json:
            print(json.dumps({"model": str(path), "tokens": tokens.tolist(),
                              "top": [{"token": int(t), "piece": model.token_to_piece(int(t)),
                                       "logit": float(logits[t]), "p": float(probs[t])} for t in top],
                              "seq_state_bytes": len(state)}))
            return 0
        print(f"model   {path.name}: {model.description}, {model.n_layer} layers, n_vocab {model.n_vocab}")
        print(f"prompt  {args.prompt!r} -> {len(tokens)} tokens {tokens.tolist()}")
        print("top next tokens:")
        for t in top:
            print(f"  {int(t):6d} {model.token_to_piece(int(t))!r:16} logit {logits[t]:8.3f}  p {probs[t]:.4f}")
        print(f"sequence 0 state: {len(state):,} bytes (llama_state_seq_get_data_ext, {len(tokens)} cells)")
    return 0


def _cmd_info(args) -> int:
    from . import build_info
    print(json.dumps(build_info(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pyllamacpp", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help=_cmd_demo.__doc__)
    p.add_argument("-m", "--model", type=lambda s: __import__("pathlib").Path(s),
                   help="GGUF file (default: $PYLLAMACPP_MODEL or the default model)")
    p.add_argument("-p", "--prompt", default="The cat sat on the mat.")
    p.add_argument("-c", "--n-ctx", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("info", help="print build_info() as JSON")
    p.set_defaults(func=_cmd_info)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
