"""MkDocs hook: links to what only the build makes, written so they work in the repository too.

The reference pages and the figures (``generate.py`` beside this file) exist only in a built site,
so a relative link to them is broken when a page is read on the repository's host. The pages link
to them by the published site's address (``site_url`` + path, e.g.
``https://pyllamacpp.github.io/pyllamacpp-cffi/reference/cli/``); here each such link becomes a
relative link to the file again, so the built site stays self-contained and ``--strict`` checks
the link like any other. An address that names no file of the build is a warning (an error under
``--strict``).

The docstrings name other objects with Sphinx roles (``:func:`loglikelihood```,
``:class:`~pyllamacpp.Model```), which mkdocstrings' Google style leaves as text before the code
span: ``on_page_content`` drops the role and, as Sphinx does, shows only the last part of a name
written with ``~``.
"""

from __future__ import annotations

import logging
import posixpath
import re

log = logging.getLogger("mkdocs.hooks.site_links")


def site_target(path: str, files) -> str | None:
    """The file of the build a site path names (``reference/cli/`` -> ``reference/cli.md``), or None."""
    for candidate in (path, path.rstrip("/") + ".md", posixpath.join(path, "index.md")):
        if candidate and files.get_file_from_path(candidate) is not None:
            return candidate
    return None


def on_page_markdown(markdown, page, config, files):
    site = config["site_url"] or ""
    if not site:
        return markdown
    here = posixpath.dirname(page.file.src_uri)

    def relative(m: re.Match) -> str:
        path, anchor = m.group(1), m.group(2) or ""
        target = site_target(path, files)
        if target is None:
            log.warning(f"{page.file.src_uri}: {site}{path} names no page or file of this build")
            return m.group(0)
        return f"]({posixpath.relpath(target, here or '.')}{anchor})"

    return re.sub(r"\]\(" + re.escape(site) + r"([^)#\s]*)(#[^)\s]*)?\)", relative, markdown)


_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):<code>(~?)([^<]*)</code>")


def _role(m: re.Match) -> str:
    name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
    return f"<code>{name}</code>"


def on_page_content(html, page, config, files):
    return _ROLE.sub(_role, html)
