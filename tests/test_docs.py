"""The docs cannot rot: every example in README.md and docs/ runs, and the site builds strictly.

- Each ```python block runs; the blocks of one page share a namespace, in page order, in a
  temporary folder (so a page may write a file in one block and read it in the next).
- Each ```console block runs its ``$ pyllamacpp ...`` lines (the same page's temporary folder);
  output lines shown under a command that hold no digit must appear in what it printed.
- ``<!-- docs: skip REASON -->`` on the line before a fence skips that block, with the reason
  (a GPU, a network, an API not landed yet). Other fences (```bash, ```text) are not run.
- ``<!-- docs: exact -->`` on the line before a console fence: what each command prints on stdout
  must be exactly the lines shown under it, digits included (blanks at line ends aside).
- A table in a console block, shown or printed (a line of dash runs under its header), names
  every column; no page and no printed output holds a path of the machine that made it.
- ``mkdocs build --strict`` must pass: a broken link, a missing reference or a docstring warning
  fails, and the generated API pages must hold every public name.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(p for p in (ROOT / "docs").rglob("*.md") if "hooks" not in p.parts)])
FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
SKIP = re.compile(r"^<!--\s*docs:\s*skip\s+(.+?)\s*-->\s*$")
EXACT = re.compile(r"^<!--\s*docs:\s*exact\s*-->\s*$")
# a folder of the machine that wrote the page or made the output: a home, the workspace, a venv
MACHINE_PATH = re.compile(r"/root/|/work/|/home/|[\w.~-]*/\.?venv/(?:bin|lib)\b")
RULE = re.compile(r"^ *-+( +-+)+ *$")  # the dash line under a printed table's headers


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the reason, when marked
    exact: bool = False  # marked <!-- docs: exact -->


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, with their skip marks."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        start, fence, lang = i, m.group(1), m.group(2)
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"{path}:{start + 1}: fence never closed")
        prev = lines[start - 1].strip() if start else ""
        skip = SKIP.match(prev)
        indent = len(lines[start]) - len(lines[start].lstrip())
        code = "\n".join(b[indent:] for b in body)
        out.append(Block(path, start + 1, lang, code, skip and skip.group(1), bool(EXACT.match(prev))))
        i += 1
    return out


def _id(p: Path) -> str:
    return str(p.relative_to(ROOT))


RUNNABLE = [p for p in PAGES if any(b.lang in ("python", "console") for b in blocks(p))]


def unnamed_columns(text: str) -> list[str]:
    """The tables in ``text`` (a header line, then dash runs under it) with a column whose dashes
    have no header text above them: ``"<header line>"`` for each."""
    bad = []
    lines = text.splitlines()
    for i in range(1, len(lines)):
        if RULE.match(lines[i]):
            head = lines[i - 1]
            if any(not head[m.start() : m.end()].strip() for m in re.finditer(r"-+", lines[i])):
                bad.append(head)
    return bad


def run_console(block: Block, cwd: Path) -> None:
    """Run each ``$ pyllamacpp ...`` line; shown output lines without digits must be printed
    (with ``exact``: stdout must be the shown lines), and what it printed names every table
    column and holds no machine path."""
    cmds: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            cmds.append((line[2:], []))
        elif cmds:
            cmds[-1][1].append(line)
    for cmd, shown in cmds:
        argv = shlex.split(cmd, comments=True)
        if not argv or argv[0] != "pyllamacpp":
            continue  # pip, python ...: setup lines, not examples
        r = subprocess.run(
            [sys.executable, "-m", "pyllamacpp.cli", *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=300
        )
        where = f"{_id(block.path)}:{block.line}: `{cmd}`"
        assert r.returncode == 0, f"{where} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
        if block.exact:  # line by line, trailing blanks aside (an editor may strip them from the page)
            want = "\n".join(line.rstrip() for line in shown).rstrip("\n")
            got = "\n".join(line.rstrip() for line in r.stdout.splitlines()).rstrip("\n")
            assert got == want, f"{where} printed\n{r.stdout}\nnot what the page shows:\n{want}"
        assert not unnamed_columns(r.stdout), f"{where}: a table column without a header: {unnamed_columns(r.stdout)}"
        paths = MACHINE_PATH.findall(r.stdout + r.stderr)
        assert not paths, f"{where} printed a path of this machine ({paths[0]}):\n{r.stdout}{r.stderr}"
        printed = " ".join((r.stdout + r.stderr).split())
        for want in shown:
            if want.strip() and not re.search(r"\d", want) and want.strip() != "...":
                assert " ".join(want.split()) in printed, f"{where}: no line {want!r} in\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize("page", RUNNABLE, ids=_id)
def test_examples(page: Path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__docs__"}
    skipped = []
    for b in blocks(page):
        if b.lang not in ("python", "console"):
            continue
        if b.skip:
            skipped.append(f"line {b.line}: {b.skip}")
            continue
        if b.lang == "console":
            run_console(b, tmp_path)
            continue
        code = compile("\n" * (b.line) + b.code, str(page), "exec")  # tracebacks point at the page's lines
        exec(code, ns)
    if skipped:
        pytest.skip(f"{_id(page)}: ran the rest; skipped " + "; ".join(skipped))


def test_every_python_block_is_run_or_marked():
    # a typo in the fence (```py, ```Python) would silently skip an example
    for page in PAGES:
        for b in blocks(page):
            assert b.lang not in ("py", "Python", "python3", "pycon", "shell-session"), (
                f"{_id(page)}:{b.line}: use ```python or ```console"
            )


def test_shown_outputs_name_every_column():
    # a console block's sample output is what the command printed: its tables say what each column is
    for page in PAGES:
        for b in blocks(page):
            if b.lang == "console":
                assert not unnamed_columns(b.code), f"{_id(page)}:{b.line}: unnamed column in {unnamed_columns(b.code)}"


def test_no_page_shows_a_path_of_this_machine():
    # commands as a user types them, outputs as anyone would see them: no home, workspace or venv
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            m = MACHINE_PATH.search(line)
            assert not m, f"{_id(page)}:{n}: {m.group(0)!r} is a path of the machine that wrote it: {line.strip()}"


def test_build_time_quoted_is_the_measured_one():
    # the install pages quote the source build's time; it must be one that docs/building.md says
    # how it was measured
    measured = (ROOT / "docs/building.md").read_text()
    for page in ("README.md", "docs/index.md", "docs/getting-started.md"):
        text = (ROOT / page).read_text()
        for figure in re.findall(r"\b(?:about \d+ s|\d+ min \d+ s)\b", text):
            assert figure in measured, f"{page} says the build takes {figure!r}, which docs/building.md never measured"


def test_readme_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (front page: at most 150)"
    head = "\n".join(lines[:12])
    # -v: without it pip shows nothing of a build that takes minutes (stages, ninja's [n/N])
    assert "pip install -v . && pyllamacpp demo" in head
    test_cmd = 'pip install -v ".[test]" && pytest'
    assert test_cmd in head
    assert (ROOT / ".ci/run").read_text().rstrip().splitlines()[-1] == test_cmd, (
        ".ci/run must run exactly the README's test command"
    )


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs tools come with the test extra")
    site = tmp_path / "site"
    # run from tmp: from the repository root, `python -m` would put the source folder (no compiled
    # extension) first on sys.path and the hook's import of pyllamacpp would fail
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"

    import pyllamacpp
    import pyllamacpp.state

    api = (site / "reference/api/pyllamacpp/index.html").read_text()
    for name in pyllamacpp.__all__:
        if name in ("ffi", "lib", "__version__"):
            assert f"<code>{name}</code>" in api, name
            continue
        ident = f"{getattr(pyllamacpp, name).__module__}.{name}"
        assert f'id="{ident}"' in api, f"API reference lacks {ident}"
    state = (site / "reference/api/state/index.html").read_text()
    for name in pyllamacpp.state.__all__:
        assert f'id="pyllamacpp.state.{name}"' in state, f"API reference lacks pyllamacpp.state.{name}"
    testing = (site / "reference/api/testing/index.html").read_text()
    for name in ("make_model", "ARCHS"):
        assert f'id="pyllamacpp.testing.{name}"' in testing
    sys.path.insert(0, str(ROOT / "docs/hooks"))
    try:
        import generate

        mods = generate.experiment_modules()
    finally:
        sys.path.remove(str(ROOT / "docs/hooks"))
    experiments = (site / "reference/api/experiments/index.html").read_text()
    for mod in mods:
        assert f'id="pyllamacpp.experiments.{mod}"' in experiments, mod
    cli = (site / "reference/cli/index.html").read_text()
    assert "pyllamacpp kvprobe" in cli and "--ubatch-list" in cli
    for png in ("heads.png", "file-layout.png", "streams.png"):
        assert (site / "assets/kv" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # the pages link to generated pages and figures by the site's address (so the links work in
    # the repository); the build turns them into relative links (docs/hooks/site_links.py)
    site_url = "https://pyllamacpp.github.io/pyllamacpp-cffi/"
    for html in site.rglob("*.html"):
        text = html.read_text()
        assert f'src="{site_url}' not in text and f'<a href="{site_url}' not in text, html
        # the docstrings' Sphinx roles render as plain code (site_links.on_page_content)
        assert not re.search(r":(func|class|meth|attr|mod|data|exc|obj):<code>", text), html
    evaluation = (site / "reference/api/evaluation/index.html").read_text()
    import pyllamacpp.evaluation

    for name in pyllamacpp.evaluation.__all__:
        assert f'id="pyllamacpp.evaluation.{name}"' in evaluation, f"API reference lacks pyllamacpp.evaluation.{name}"
    assert 'id="pyllamacpp.evaluation.lm_eval.PyllamacppLM"' in evaluation
    assert "One request's result (<code>loglikelihood</code>)" in evaluation
    experiments_page = (site / "guide/experiments/index.html").read_text()
    assert 'href="../../reference/cli/"' in experiments_page
    assert 'src="../../assets/experiments/sweep.png"' in experiments_page


def test_readme_links_exist():
    # the README is not part of the site, so mkdocs --strict does not check its relative links
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(((?!https?:)[^)#\s]+)", text):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_links_work_when_read_in_the_repository():
    # mkdocs checks links against the built site, where the reference pages and the figures are
    # made; read on the repository's host, a relative link must find a file there too (pages
    # made by the build are linked by their site address, which the site_links hook turns back
    # into a relative, checked link)
    for page in PAGES:
        for target in re.findall(r"\]\(((?!https?:|mailto:)[^)#\s]+)", page.read_text()):
            assert (page.parent / target).exists(), f"{_id(page)} links to {target}, which is not in the repository"
