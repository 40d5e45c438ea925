"""The package as Python's tools see it: dir(), help() and pkgutil show the public API only."""

from __future__ import annotations

import pkgutil
import pydoc

import pyllamacpp


def test_dir_shows_the_public_api_and_dunders_only():
    pyllamacpp.Model  # noqa: B018 (a lazy name imported: its modules become attributes)
    names = dir(pyllamacpp)
    assert "annotations" not in names and "importlib" not in names
    private = [n for n in names if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))]
    assert private == []
    assert not {"batch", "context", "context_state", "params", "errors"} & set(names)  # implementation modules
    assert set(pyllamacpp.__all__) <= set(names) and {"state", "testing"} <= set(names)
    assert len(names) == len(set(names))
    for n in names:  # everything listed is there
        getattr(pyllamacpp, n)


def test_package_contents_list_no_shared_library():
    # help(pyllamacpp) lists pkgutil.iter_modules(__path__) as PACKAGE CONTENTS
    names = [m.name for m in pkgutil.iter_modules(pyllamacpp.__path__)]
    assert "state" in names
    assert [n for n in names if n.startswith("lib")] == []
    contents = pydoc.render_doc(pyllamacpp, renderer=pydoc.plaintext).split("PACKAGE CONTENTS")[1].split("\n\n")[0]
    assert "libggml" not in contents and "libllama" not in contents
    # they live in _libs, a folder with no __init__.py, so pkgutil does not take it for a package
    assert "_libs" not in names and (pyllamacpp._lib.LIB_DIR / "__init__.py").exists() is False
