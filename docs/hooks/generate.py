"""MkDocs hook: the pages and figures the build makes itself, so none of them can go stale.

- ``reference/cli.md``: every subcommand's ``--help``, from ``pyllamacpp.cli.build_parser()``.
- ``reference/api/*.md``: one mkdocstrings block per public name (``__all__`` of each package).
- ``assets/kv/*.png``: the KV walk-through's figures, drawn with matplotlib from a real dump of the
  default model made during the build (``kvwalk.py`` beside this file).
- ``assets/taps/*.png``: the taps guide's pictures, drawn by ``pyllamacpp.taps``' plotting helpers
  from the capture the guide's code block makes (``taps_figures``).
- ``assets/experiments/*``: what the commands of ``EXPERIMENT_OUTPUTS`` write with ``-o``.

Generated files live only in the build (``File.generated``): nothing is written under docs/.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os

from mkdocs.structure.files import File

HERE = os.path.dirname(os.path.abspath(__file__))


def _kvwalk():
    # kvwalk.py beside this file; mkdocs loads hooks by path, not as a package
    spec = importlib.util.spec_from_file_location("pyllamacpp_docs_kvwalk", os.path.join(HERE, "kvwalk.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def _columns(n: int):
    # argparse wraps help to the terminal width: fix it so the page does not depend on who builds it.
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def cli_page() -> str:
    """Markdown for every ``pyllamacpp`` subcommand's help, in the parser's order."""
    from pyllamacpp.cli import build_parser

    with _columns(100):
        ap = build_parser()
        out = [
            "# Command line",
            "",
            "Generated at build time from `pyllamacpp.cli.build_parser()`: what `--help` prints.",
            "",
            "```text",
            ap.format_help().rstrip(),
            "```",
            "",
        ]
        sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        for name, p in sub.choices.items():
            out += [f"## `pyllamacpp {name}`", ""]
            if helps.get(name):
                out += [helps[name].strip().split("\n")[0], ""]
            out += ["```text", p.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _api_block(ident: str, heading_level: int = 2) -> str:
    return f"::: {ident}\n    options:\n      heading_level: {heading_level}\n"


def api_pages() -> dict[str, str]:
    """One page per package, one mkdocstrings block per name of its ``__all__`` (or public module)."""
    import pyllamacpp
    import pyllamacpp.experiments
    import pyllamacpp.state
    import pyllamacpp.testing

    pages = {}
    top = [
        "# `pyllamacpp`",
        "",
        "Every name of `pyllamacpp.__all__`, generated from the docstrings.",
        "",
        "## `ffi`, `lib`",
        "",
        "The compiled cffi module (`pyllamacpp._lib`): every function, struct, enum and integer "
        "`#define` of `llama.h` and the ggml headers it includes, checked by the C compiler. "
        "Call them as llama.cpp documents them, e.g. `pl.lib.llama_max_parallel_sequences()`.",
        "",
        "## `__version__`",
        "",
        f"The package version, `{pyllamacpp.__version__}` in this build.",
        "",
    ]
    for name in pyllamacpp.__all__:
        if name in ("ffi", "lib", "__version__"):
            continue
        obj = getattr(pyllamacpp, name)
        top.append(_api_block(f"{obj.__module__}.{name}"))
    pages["reference/api/pyllamacpp.md"] = "\n".join(top)

    st = [
        "# `pyllamacpp.state`",
        "",
        _api_block("pyllamacpp.state", 1).replace(
            "heading_level: 1", "heading_level: 1\n      show_root_heading: false\n      members: false"
        ),
        "",
    ]
    st += [_api_block(f"pyllamacpp.state.{name}") for name in pyllamacpp.state.__all__]
    pages["reference/api/state.md"] = "\n".join(st)

    pages["reference/api/testing.md"] = "# `pyllamacpp.testing`\n\n" + _api_block("pyllamacpp.testing", 1).replace(
        "heading_level: 1", "heading_level: 2\n      show_root_heading: false"
    )

    pages["reference/api/taps.md"] = (
        "# `pyllamacpp.taps`\n\n"
        + _api_block("pyllamacpp.taps", 1).replace(
            "heading_level: 1", "heading_level: 2\n      show_root_heading: false"
        )
        + "\n# `pyllamacpp.cvec`\n\n"
        + _api_block("pyllamacpp.cvec", 1).replace(
            "heading_level: 1", "heading_level: 2\n      show_root_heading: false"
        )
    )

    pages["reference/api/ubatch.md"] = "# `pyllamacpp.ubatch`\n\n" + _api_block("pyllamacpp.ubatch", 1).replace(
        "heading_level: 1", "heading_level: 2\n      show_root_heading: false"
    )

    pages["reference/api/packing.md"] = "# `pyllamacpp.packing`\n\n" + _api_block("pyllamacpp.packing", 1).replace(
        "heading_level: 1", "heading_level: 2\n      show_root_heading: false"
    )

    import importlib.util

    if importlib.util.find_spec("pyllamacpp.text"):  # the text API's module, when present
        pages["reference/api/text.md"] = "# `pyllamacpp.text`\n\n" + _api_block("pyllamacpp.text", 1).replace(
            "heading_level: 1", "heading_level: 2\n      show_root_heading: false"
        )

    import pyllamacpp.evaluation

    ev = [
        "# `pyllamacpp.evaluation`",
        "",
        "Evaluation with shared prefixes ([the guide](../../guide/evaluation.md)): the loglikelihood "
        "engine, llama-perplexity's multiple-choice modes, and the lm-evaluation-harness backend "
        "(`pyllamacpp.evaluation.lm_eval`, which needs the `eval` extra and registers the model "
        "type `pyllamacpp` when imported).",
        "",
    ]
    ev += [_api_block(f"pyllamacpp.evaluation.{name}") for name in pyllamacpp.evaluation.__all__]
    ev.append(_api_block("pyllamacpp.evaluation.lm_eval.PyllamacppLM"))
    pages["reference/api/evaluation.md"] = "\n".join(ev)

    import pyllamacpp.prefix_store

    ps = [
        "# `pyllamacpp.prefix_store`",
        "",
        "Decoded prefixes kept across runs, processes and machines ([the guide](../../guide/prefix-store.md)): "
        "the store, its two backends (a directory, Redis) and the context identity its keys hold.",
        "",
    ]
    ps += [_api_block(f"pyllamacpp.prefix_store.{name}") for name in pyllamacpp.prefix_store.__all__]
    pages["reference/api/prefix_store.md"] = "\n".join(ps)

    ex = [
        "# `pyllamacpp.experiments`",
        "",
        "Each module is one `pyllamacpp` subcommand: `run(args)` returns the data, "
        "`print_report` prints it, `plot` draws it where the command has `-o`; but `common` "
        "(the commands' shared flags, model loading, progress and output) and `ubatch_plan` "
        "(the shape flags of the commands that plan a batch; the split itself is "
        "[`pyllamacpp.ubatch`](ubatch.md)), which several commands share.",
        "",
    ]
    for mod in experiment_modules():
        ex.append(_api_block(f"pyllamacpp.experiments.{mod}"))
    pages["reference/api/experiments.md"] = "\n".join(ex)
    return pages


def experiment_modules() -> list[str]:
    """The public modules of ``pyllamacpp.experiments`` (names without a leading underscore)."""
    import pkgutil

    import pyllamacpp.experiments

    return sorted(m.name for m in pkgutil.iter_modules(pyllamacpp.experiments.__path__) if not m.name.startswith("_"))


# Commands whose own -o output the Experiments page shows: (asset name, argv with {out}).
EXPERIMENT_OUTPUTS = [
    (
        "sweep.png",
        [
            "ubatch-sweep",
            "-t",
            "2",
            "-c",
            "1024",
            "-p",
            "128",
            "-n",
            "4",
            "-r",
            "1",
            "--ubatch-list",
            "256,128,64",
            "-o",
            "{out}",
        ],
    ),
    ("plot-state.png", ["plot-state", "{dump}", "-o", "{out}"]),
    (
        "split-plan.html",
        [
            "split-plan",
            "--tokens",
            "100,50,30,10",
            "-np",
            "4",
            "-b",
            "512",
            "-ub",
            "64",
            "--no-kv-unified",
            "-o",
            "{out}",
        ],
    ),
    (
        "prefix-workload.png",
        ["prefix-sharing", "--requests", "8", "-np", "4", "-n", "16", "-t", "1", "-fa", "off", "-o", "{out}"],
    ),
    (
        "mask.png",
        ["mask", "-t", "1", "--tokens", "4,3", "-np", "2", "--kv-unified", "--shared", "3", "--past", "2,3"]
        + ["-fa", "off", "-o", "{out}"],
    ),
    ("row-audit.png", ["row-audit", "-t", "1", "-o", "{out}"]),
    ("kv-live.png", ["kv-live", "-t", "1", "--modes", "unified:off,split:off", "-o", "{out}"]),
    (
        "prefill-profile.png",
        ["prefill-profile", "-t", "1", "-c", "512", "-p", "64", "-ub", "64,16,4", "-r", "1"]
        + ["--clock", "cpu", "-o", "{out}"],
    ),
]


def experiment_outputs(tmp: str) -> dict[str, bytes]:
    """Run the commands of EXPERIMENT_OUTPUTS (stdout discarded) and return the files they wrote."""
    import io

    from pyllamacpp.cli import main

    dump = os.path.join(tmp, "cat.bin")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        main(["kvprobe", "-t", "2", "-c", "512", "--ops", f"text:0:The cat sat on the mat.;save:0:{dump}"])
        out = {}
        for name, argv in EXPERIMENT_OUTPUTS:
            path = os.path.join(tmp, name)
            rc = main([a.format(out=path, dump=dump) for a in argv])
            if rc != 0:
                raise RuntimeError(f"pyllamacpp {' '.join(argv)} exited {rc}")
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def taps_figures() -> dict[str, bytes]:
    """The taps guide's pictures (docs/guide/taps.md, "Pictures"), by file name: the guide's
    capture of "The cat sat on the mat." on the default model, drawn by ``pyllamacpp.taps``."""
    import io

    import pyllamacpp as pl
    from pyllamacpp.taps import plot_attention, plot_mask, plot_residual_norms

    out = {}
    with pl.Model() as model, model.context(n_ctx=512, flash_attn="off", n_threads=1, n_threads_batch=1) as ctx:
        batch = pl.Batch(64, 1, model=model)
        batch.add_sequence(model.tokenize("The cat sat on the mat."), 0, 0, logits="last")
        with ctx.capture("l_out", "kq_soft_max", "attn_inp_kq_mask") as pic:
            ctx.decode(batch)
        figures = {
            "attention.png": plot_attention(pic, 5, head=3),
            "mask.png": plot_mask(pic),
            "residual-norms.png": plot_residual_norms(pic, log=True),
        }
        for name, fig in figures.items():  # labelled while the model lives
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
            out[name] = buf.getvalue()
    return out


def on_files(files, config):
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    for path, text in api_pages().items():
        files.append(File.generated(config, path, content=text))
    kvwalk = _kvwalk()
    for name, png in kvwalk.figures(kvwalk.run()).items():
        files.append(File.generated(config, f"assets/kv/{name}", content=png))
    for name, png in taps_figures().items():
        files.append(File.generated(config, f"assets/taps/{name}", content=png))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, data in experiment_outputs(tmp).items():
            files.append(File.generated(config, f"assets/experiments/{name}", content=data))
    return files
