"""Few-shot multiple choice through ``pl.loglikelihood`` (shared prefixes) against each request
decoded on its own.

    python tools/bench/bench_evaluation.py [-q 200] [--shots 5] [-b 63] [-t 1] [-r 1] [-fa on] [--json out.json]

The workload is synthetic and deterministic (``--seed``): ``-q`` distinct questions (word
problems with names and numbers; capitals, opposites, plurals), each with 4 choices, after one
``--shots``-example header, in lm-eval's cloze form (context ``header + "Question: ...\\nAnswer:"``,
continuation ``" " + choice``, the way ARC or HellaSwag are scored). One process, the default model, two sides:

  shared      ``pl.loglikelihood(model, requests)``: the trie over all the requests, each node
              decoded once, ``--n-seq-max`` branches at once in one unified KV cache
  unshared    each request on its own in one context (its memory cleared before each), context
              plus continuation less the last token decoded, logits at the continuation's rows:
              what lm-eval's per-request backends (its llama.cpp route) decode

Each round runs both, the order swapped from round to round (shared first in round 0). The
report gives the tokens each side fed to ``llama_decode``, the wall time of each (medians over
the rounds) and their ratio, and what sharing changed in the results against the unshared side:
the largest |difference| of a request's log-probability, how many requests' ``is_greedy``
differ, and for how many questions the chosen answer differs (by summed log-probability, lm-eval's
``acc``, and by log-probability per byte, ``acc_norm``-style), with the accuracy of each side. It
measures; it asserts nothing. On a machine shared with other work, run it with ``-t 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

import pyllamacpp as pl
from pyllamacpp.batch import Batch
from pyllamacpp.evaluation._engine import encode_pair
from pyllamacpp.scoring import log_softmax

CAPITALS = [
    ("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"),
    ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Greece", "Athens"), ("Poland", "Warsaw"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Ireland", "Dublin"),
    ("Egypt", "Cairo"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Canada", "Ottawa"), ("Cuba", "Havana"), ("Hungary", "Budapest"),
]  # fmt: skip
OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("early", "late"), ("big", "small"), ("fast", "slow"),
    ("light", "dark"), ("open", "closed"), ("full", "empty"), ("wet", "dry"), ("old", "young"),
    ("hard", "soft"), ("rich", "poor"), ("high", "low"), ("loud", "quiet"), ("thick", "thin"),
]  # fmt: skip
PLURALS = [
    ("child", "children"), ("mouse", "mice"), ("goose", "geese"), ("tooth", "teeth"),
    ("foot", "feet"), ("man", "men"), ("woman", "women"), ("person", "people"),
    ("leaf", "leaves"), ("knife", "knives"), ("wolf", "wolves"), ("box", "boxes"),
]  # fmt: skip


NAMES = ["Tom", "Anna", "Ravi", "Mei", "Omar", "Lena", "Jack", "Sofia", "Kofi", "Ines", "Yuki", "Pablo"]
ITEMS = ["apples", "books", "coins", "stamps", "shells", "pencils", "marbles", "cards", "eggs", "cups"]


def question(rng: random.Random) -> tuple[str, list[str], int]:
    """One synthetic question: its text, 4 choices, the index of the right one."""
    kind = rng.randrange(5)
    if kind < 2:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randrange(10, 90), rng.randrange(2, 10)
        if kind == 0:
            q, right = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
        else:
            q, right = f"{name} had {a} {item} and gave {b} of them away. How many {item} are left?", a - b
        wrong = rng.sample([right + d for d in (-10, -2, -1, 1, 2, 10) if right + d > 0], 3)
        choices = [str(right)] + [str(w) for w in wrong]
    else:
        table = (CAPITALS, OPPOSITES, PLURALS)[kind - 2]
        k, v = rng.choice(table)
        q = ("what is the capital of {}?", "what is the opposite of '{}'?", "what is the plural of '{}'?")[kind - 2]
        q = f"{rng.choice(NAMES)} asks {rng.choice(NAMES)}: " + q.format(k)
        choices = [v] + rng.sample([w for _, w in table if w != v], 3)
    order = list(range(4))
    rng.shuffle(order)
    return q, [choices[i] for i in order], order.index(0)


def workload(n_questions: int, shots: int, seed: int) -> tuple[list[tuple[str, str]], list[int]]:
    """``(requests, answers)``: 4 requests per question (context, " " + choice), question by
    question, and the index of each question's right choice."""
    rng = random.Random(seed)
    header = "The following are questions with their answers.\n\n"
    for _ in range(shots):
        q, choices, right = question(rng)
        header += f"Question: {q}\nAnswer: {choices[right]}\n\n"
    requests, answers, seen = [], [], set()
    while len(answers) < n_questions:
        q, choices, right = question(rng)
        if q in seen:
            continue
        seen.add(q)
        ctx = f"{header}Question: {q}\nAnswer:"
        requests += [(ctx, " " + c) for c in choices]
        answers.append(right)
    return requests, answers


def unshared(ctx, pairs: list[tuple[np.ndarray, int]]) -> tuple[list[tuple[float, bool]], int]:
    """Each ``(tokens, n_context)`` decoded on its own; ``([(logprob, is_greedy)], tokens fed)``."""
    n_batch = ctx.n_batch
    batch = Batch(n_batch, 1, model=ctx.model)
    out, fed = [], 0
    for seq, c in pairs:
        ctx.memory.clear()  # cells from 0 again, as in a fresh context
        feed = seq[:-1]
        lp, greedy = 0.0, True
        for b0 in range(0, feed.size, n_batch):
            chunk = feed[b0 : b0 + n_batch]
            j = np.arange(b0, b0 + chunk.size)
            mask = j >= c - 1
            batch.clear()
            batch.add_sequence(chunk, 0, b0, logits=mask)
            ctx.decode(batch)
            fed += chunk.size
            if mask.any():
                t = seq[j[mask] + 1]
                r = log_softmax(ctx.logits_all(), t, argmax=True, n_threads=ctx.params.n_threads_batch)
                lp += float(r.target.sum())
                greedy = greedy and bool((r.argmax == t).all())
        out.append((lp, greedy))
    return out, fed


def choose(lps: np.ndarray, n_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per question (rows of 4): the index chosen by log-probability and by log-probability per byte."""
    return lps.argmax(axis=1), (lps / n_bytes).argmax(axis=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-q", "--questions", type=int, default=200, help="questions, 4 choices each (200)")
    ap.add_argument("--shots", type=int, default=5, help="examples in the shared header (5)")
    ap.add_argument("--seed", type=int, default=1, help="the workload's seed (1)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads (1)")
    ap.add_argument("-b", "--batch-size", type=int, default=63, help="n_batch = n_ubatch of both sides (63)")
    ap.add_argument("--n-seq-max", type=int, default=16, help="branches at once, shared side (16)")
    ap.add_argument("-fa", "--flash-attn", default="on", choices=["on", "off", "auto"], help="flash attention (on)")
    ap.add_argument("-r", "--rounds", type=int, default=1, help="rounds, each runs both sides (1)")
    ap.add_argument("-m", "--model", help="a GGUF (default: the default test model)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()

    model = pl.Model(a.model) if a.model else pl.Model()
    requests, answers = workload(a.questions, a.shots, a.seed)
    pairs = []
    for c, x in requests:
        ct, xt = encode_pair(model, c, x)
        pairs.append((np.concatenate([ct, xt]), int(ct.size)))
    n_bytes = np.array([len(x.encode()) for _, x in requests], float).reshape(-1, 4)
    longest = max(s.size for s, _ in pairs)
    threads = {"n_threads": a.threads, "n_threads_batch": a.threads}
    kw = dict(n_batch=a.batch_size, n_ubatch=min(a.batch_size, 512), flash_attn=a.flash_attn, **threads)
    solo = model.context(n_ctx=longest, n_seq_max=1, **kw)
    first, last = pairs[0][0], pairs[-1][0]
    n_header = int(np.argmin(first[: last.size] == last[: first.size]))  # tokens every request shares
    print(
        f"{os.path.basename(model.path)}: {a.questions} questions x 4 choices, a {a.shots}-shot header of "
        f"{n_header} tokens, {len(pairs)} requests of {np.mean([s.size for s, _ in pairs]):.1f} tokens on "
        f"average, -b {a.batch_size}, {a.threads} thread(s), -fa {a.flash_attn}",
        file=sys.stderr,
    )
    times: dict[str, list[float]] = {"shared": [], "unshared": []}
    shared_res = unshared_res = None
    shared_stats: dict = {}
    fed_unshared = 0
    for rnd in range(a.rounds):
        for side in ("shared", "unshared") if rnd % 2 == 0 else ("unshared", "shared"):
            t0 = time.perf_counter()
            if side == "shared":
                res = pl.loglikelihood(
                    model, requests, n_batch=a.batch_size, n_seq_max=a.n_seq_max, n_threads=a.threads,
                    n_threads_batch=a.threads, flash_attn=a.flash_attn, progress=False,
                )  # fmt: skip
                shared_res, shared_stats = res, res.summary()
            else:
                unshared_res, fed_unshared = unshared(solo, pairs)
            times[side].append(time.perf_counter() - t0)
            print(f"round {rnd}: {side} {times[side][-1]:.2f} s", file=sys.stderr)
    assert shared_res is not None and unshared_res is not None
    lp_s = np.array([r.logprob for r in shared_res])
    lp_u = np.array([r[0] for r in unshared_res])
    g_s = np.array([r.is_greedy for r in shared_res])
    g_u = np.array([r[1] for r in unshared_res])
    acc_s, norm_s = choose(lp_s.reshape(-1, 4), n_bytes)
    acc_u, norm_u = choose(lp_u.reshape(-1, 4), n_bytes)
    ans = np.array(answers)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {
        "model": os.path.basename(model.path),
        "args": vars(a),
        "requests": len(pairs),
        "tokens": {"shared": shared_stats["n_decoded"], "unshared": fed_unshared},
        "decodes": {
            "shared": shared_stats["n_decodes"],
            "unshared": sum(-(-(p.size - 1) // a.batch_size) for p, _ in pairs),
        },
        "header_tokens": n_header,
        "seconds": times,
        "median_s": med,
        "speedup": med["unshared"] / med["shared"],
        "shared_stats": shared_stats,
        "max_abs_diff_logprob": float(np.abs(lp_s - lp_u).max()),
        "median_abs_diff_logprob": float(np.median(np.abs(lp_s - lp_u))),
        "requests_differing": int((lp_s != lp_u).sum()),
        "is_greedy_flips": int((g_s != g_u).sum()),
        "choice_flips": {"acc": int((acc_s != acc_u).sum()), "acc_bytes": int((norm_s != norm_u).sum())},
        "accuracy": {
            "shared": {"acc": float((acc_s == ans).mean()), "acc_bytes": float((norm_s == ans).mean())},
            "unshared": {"acc": float((acc_u == ans).mean()), "acc_bytes": float((norm_u == ans).mean())},
        },
        "loadavg_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    t = out["tokens"]
    print(
        f"tokens decoded: shared {t['shared']:,} / unshared {t['unshared']:,} "
        f"({t['unshared'] / t['shared']:.1f}x fewer); "
        f"wall: shared {med['shared']:.2f} s, unshared {med['unshared']:.2f} s, {out['speedup']:.2f}x faster shared"
    )
    print(
        f"results: max |dlogprob| {out['max_abs_diff_logprob']:.4g} (median {out['median_abs_diff_logprob']:.3g}, "
        f"{out['requests_differing']} of {len(pairs)} requests differ at all), is_greedy flips "
        f"{out['is_greedy_flips']}, chosen answer flips {out['choice_flips']['acc']} (acc) / "
        f"{out['choice_flips']['acc_bytes']} (per byte) of {a.questions}; accuracy shared "
        f"{out['accuracy']['shared']['acc']:.3f} / unshared {out['accuracy']['unshared']['acc']:.3f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
