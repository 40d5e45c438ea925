"""Run a change of the trie's walk against the walk as it is, over random request sets.

    python tools/mutation/walk_diff.py OLD NEW [--runs 100] [--seed 0] [--deep | --tokens [--long]] [--max-requests 6]
    python tools/mutation/walk_diff.py --named [--functions _assign,run] --tokens --runs 20

OLD is text of ``pyllamacpp/evaluation/_walk.py`` (once, exactly) and NEW what replaces it: a
surviving mutant, say. Each run draws requests (a shared header, short sentences, questions and
continuations), settings (1 to 4 slots, n_batch 8 to 512, n_ctx 96 to 512) and a chunk size, fills
a prefix store with some of the requests, then scores all of them twice with a copy of that store:
once with the walk, once with the changed one. It prints each run whose results (bit for bit) or
counts (``Loglikelihoods.summary()`` without the time) differ, then how many did. None in many runs
supports a mutant's name as equivalent in ``targets.toml``; one is the test to write.
``--deep`` strings up to four sentences per request (tries up to five nodes deep). ``--tokens``
draws requests of token ids instead, built as a trie with runs of 1 to 40 tokens against an
``n_batch`` of 4 to 32 and 1 to 5 slots: nodes fed over several batches while other slots wait
for them or copy what lies before them, which the text requests seldom build (a survivor that 60
text runs passed failed the first token runs). ``--long`` adds nodes of 300 tokens: a count
compared with ``is`` holds below 257 only (``_restore``'s ``n_dec is n_feed`` differed in run 12
of seed 0, and its ``n_dec <= n_feed`` in run 19 of seed 1; the draws without it build no request
past 240 tokens).

``--named`` runs each mutant of ``_walk.py`` that ``targets.toml`` names equivalent (in the
evaluation-trie group, made with cosmic-ray's operators as a mutation run makes them; ``--functions``
narrows them) in place of OLD and NEW, and prints for each whether any run differed: a name whose
mutant differs is wrong (``deep - 1`` in ``_catch_up`` was, 4 of 20 runs).
"""

from __future__ import annotations

import argparse
import pathlib
import random
import shutil
import sys
import tempfile
import types
import warnings

HEADER = (
    "Answer each question with one word, as the examples do. The capital of France is Paris. "
    "The sky on a clear day is blue. Water at room temperature is wet. Snow is cold. "
)
MIDS = [
    "",
    "Grass is green. ",
    "Grass is green. Fire is hot. Ice",
    "The cat sat on the mat. ",
    "A dog ran in the park today, chasing a red ball across the wet grass while children laughed. ",
    "Numbers come in order: one, two, three, four, five, six, seven, eight, nine and ten. ",
]
SENTENCES = [
    "Grass is green. ",
    "Fire is hot. ",
    "Ice is cold and the wind blows over the hills. ",
    "Dogs bark. ",
    "The sheep sleep at night now, under the stars. ",
]
QUESTIONS = ["", "Where? ", "Who? ", " was", "When? "]
CONTINUATIONS = [" home", " Yes", " a cat", " No", " end of it"]


def _draw(rng: random.Random, deep: bool, max_requests: int):
    reqs = []
    for _ in range(rng.randint(2, max_requests)):
        head = rng.choice([HEADER, HEADER, HEADER, "The", "A"])
        mid = "".join(rng.choice(SENTENCES) for _ in range(rng.randint(0, 4))) if deep else rng.choice(MIDS)
        reqs.append((head + mid + rng.choice(QUESTIONS), rng.choice(CONTINUATIONS)))
    return _settings(rng, reqs, slots=[1, 2, 3, 4], n_batch=[8, 16, 32, 512], n_ctx=[96, 128, 192, 256, 512],
                     store=[8, 16])  # fmt: skip


def _settings(rng: random.Random, reqs: list, slots: list[int], n_batch: list[int], n_ctx: list[int], store: list[int]):
    """What both draws add to their requests: those scored first (a first call), the context's
    slots, batch and size, and the store's size, each drawn from the lists given."""
    first = rng.sample(reqs, rng.randint(1, len(reqs)))
    args = dict(n_threads=1, n_seq_max=rng.choice(slots), n_batch=rng.choice(n_batch), flash_attn="on",
                n_ctx=rng.choice(n_ctx))  # fmt: skip
    return reqs, first, args, rng.choice(store)


def _draw_tokens(rng: random.Random, max_requests: int, long: bool = False):
    """Requests of token ids built as a random trie (up to six nodes deep, 1 to 3 children a node,
    runs of 1 to 40 tokens, a request ending at an inner node now and then, continuations of 1 to
    3 tokens). Ids are given in the order the trie is grown, so its depth-first order is the order
    of growth: a first branch that is one long request keeps a slot busy while another feeds the
    next branch's shared nodes over several batches, and a third slot waits or copies what lies
    before them (what text requests seldom build)."""
    nxt = iter(range(100, 40_000))
    runs = [1, 3, 8, 21, 40, 300] if long else [1, 2, 3, 5, 8, 13, 21, 40]
    reqs: list[tuple[list[int], list[int]]] = []

    def cont() -> list[int]:
        return [next(nxt) for _ in range(rng.randint(1, 3))]

    def grow(prefix: list[int], depth: int) -> None:
        for _ in range(rng.choice([1, 2, 2, 3])):
            if len(reqs) >= max_requests:
                return
            path = prefix + [next(nxt) for _ in range(rng.choice(runs))]
            if depth < 5 and rng.random() < 0.7:
                if rng.random() < 0.3:
                    reqs.append((path, cont()))
                grow(path, depth + 1)
            else:
                reqs.append((path, cont()))

    if rng.random() < 0.5:  # a first request apart from the rest, long: a slot busy with it
        reqs.append(([next(nxt) for _ in range(rng.choice([21, 300] if long else [8, 21, 40]))], cont()))
    while len(reqs) < 2:
        grow([], 0)
    rng.shuffle(reqs)
    return _settings(rng, reqs, slots=[1, 2, 2, 3, 3, 4, 5], n_batch=[4, 8, 16, 32],
                     n_ctx=[512, 1024] if long else [128, 192, 256, 512], store=[4, 8, 16])  # fmt: skip


def _named(src: str, functions: set[str]) -> list[tuple[str, str, int, str, str]]:
    """Each mutant of ``_walk.py`` (cosmic-ray's operators, made as a run makes them) that
    ``targets.toml`` names equivalent in the evaluation-trie group, in ``functions`` if any:
    (function, operator, line, its + lines, the mutated text)."""
    import difflib

    import tomllib
    from cosmic_ray.ast import ast_nodes, get_ast
    from cosmic_ray.ast.ast_query import ASTQuery
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator, operator_names

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import run  # beside this file: its test of a name

    named = tomllib.loads(run.TARGETS.read_text())["target"]["evaluation-trie"]["equivalent"]
    module = get_ast(src)
    out = []
    for op in operator_names():
        operator = get_operator(op)
        if operator.arguments():
            continue  # run.py gives no operator arguments: these make no mutants there
        spots = [(node, start) for node in ast_nodes(module) for start, _ in operator().mutation_positions(node)]
        for occurrence, (node, start) in enumerate(spots):
            where = ASTQuery(node).get_definition_name()
            if functions and where not in functions:
                continue
            text = mutate_code(src, operator(), occurrence)
            if text is None or text == src:
                continue
            diff = "\n".join(difflib.unified_diff(src.splitlines(), text.splitlines(), lineterm="", n=0))
            if run._is_equivalent(named, start[0], op, where, diff):
                plus = "\n".join(ln for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++"))
                out.append((where, op, start[0], plus, text))
    return sorted(out, key=lambda m: (m[2], m[1], m[3]))


def _compare(model, walks: tuple, args: argparse.Namespace, say) -> tuple[int, int]:
    """The walk and the changed one over ``args.runs`` request sets: (runs that differ, runs)."""
    import pyllamacpp as pl
    from pyllamacpp.evaluation import _engine
    from pyllamacpp.prefix_store import PrefixStore

    rng = random.Random(args.seed)
    n_diff = n_run = 0
    for k in range(args.runs):
        if args.tokens:
            reqs, first, kw, chunk = _draw_tokens(rng, args.max_requests, args.long)
        else:
            reqs, first, kw, chunk = _draw(rng, args.deep, args.max_requests)
        d = pathlib.Path(tempfile.mkdtemp())
        try:
            try:
                pl.loglikelihood(model, first, prefix_store=PrefixStore(d / "s", chunk_size=chunk), **kw)
            except ValueError:
                continue  # a request past n_ctx: not a run
            out = []
            for walk in walks:
                shutil.rmtree(d / "c", ignore_errors=True)
                shutil.copytree(d / "s", d / "c")
                _engine._Walk = walk
                try:
                    res = pl.loglikelihood(model, reqs, prefix_store=PrefixStore(d / "c", chunk_size=chunk), **kw)
                    counts = res.summary()
                    counts.pop("seconds")
                    out.append(([r.logprobs.tobytes() for r in res], [r.is_greedy for r in res], counts))
                except Exception as e:  # the changed walk may fail: that is a difference
                    out.append(repr(e))
                finally:
                    _engine._Walk = walks[0]
            n_run += 1
            if out[0] != out[1]:
                n_diff += 1
                said = [x if isinstance(x, str) else (x[0] == out[0][0], x[2]) for x in out]
                say(f"run {k}: {kw}, chunk {chunk}\n  walk:    {said[0]}\n  changed: {said[1]}")
                say(f"  requests: {reqs}\n  stored first: {first}")
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return n_diff, n_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", nargs="?", help="text of _walk.py to replace (found exactly once)")
    ap.add_argument("new", nargs="?", help="what replaces it")
    ap.add_argument(
        "--named",
        action="store_true",
        help="instead of OLD and NEW: each mutant of _walk.py that targets.toml names equivalent (needs cosmic-ray)",
    )
    ap.add_argument("--functions", default="", help="with --named: only these functions' (comma-separated)")
    ap.add_argument("--runs", type=int, default=100, help="request sets to draw (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="random.Random's seed (default 0)")
    ap.add_argument("--deep", action="store_true", help="up to four sentences per request (deeper tries)")
    ap.add_argument("--max-requests", type=int, default=6, help="requests per set, 2 to this (default 6)")
    ap.add_argument(
        "--tokens", action="store_true", help="requests of token ids built as a trie, long runs against n_batch"
    )
    ap.add_argument(
        "--long", action="store_true", help="with --tokens: nodes of 300 tokens too (counts past 256), n_ctx 512, 1024"
    )
    args = ap.parse_args(argv)
    if args.named == (args.old is not None and args.new is not None) or (args.old is None) != (args.new is None):
        ap.error("give OLD and NEW, or --named")
    if args.long and not args.tokens:
        ap.error("--long goes with --tokens")
    warnings.simplefilter("ignore")
    import pyllamacpp as pl
    from pyllamacpp.evaluation import _walk

    src = pathlib.Path(_walk.__file__).read_text()
    if args.named:
        changes = [((where, op, line, plus), text) for where, op, line, plus, text in
                   _named(src, {f for f in args.functions.split(",") if f})]  # fmt: skip
        print(f"{len(changes)} mutants of _walk.py named equivalent", flush=True)
    else:
        if src.count(args.old) != 1:
            sys.exit(f"the old text is found {src.count(args.old)} times in {_walk.__file__}, not once")
        changes = [(None, src.replace(args.old, args.new))]
    model = pl.Model(pl.default_model_path())
    differ = 0
    for what, text in changes:
        changed = types.ModuleType("pyllamacpp.evaluation._walk_changed")
        changed.__package__ = "pyllamacpp.evaluation"
        exec(compile(text, _walk.__file__, "exec"), changed.__dict__)
        said: list[str] = []
        n_diff, n_run = _compare(model, (_walk._Walk, changed._Walk), args, print if what is None else said.append)
        differ += n_diff > 0
        if what is None:
            print(f"{n_diff} of {n_run} runs differ")
        else:
            where, op, line, plus = what
            print(f"{'DIFFERS' if n_diff else 'same   '} {where}:{line} {op} {plus.strip()!r}: "
                  f"{n_diff} of {n_run} runs differ", flush=True)  # fmt: skip
            if n_diff:
                print("\n".join(said[:4]), flush=True)  # the first two runs that differ
    if args.named:
        print(f"{differ} of {len(changes)} named mutants differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
