"""Shared fixtures: the real compiled library and the real default model (no mocks)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def llama_cpp_dir() -> Path:
    """The llama.cpp source the extension was built from (vendored, or LLAMA_CPP_DIR)."""
    import pyllamacpp

    source = pyllamacpp.build_info()["llama_cpp_source"]
    if source.startswith("LLAMA_CPP_DIR="):
        return Path(source.split("=", 1)[1])
    return ROOT / "vendor" / "llama.cpp"


@pytest.fixture(scope="session")
def model_path() -> Path:
    import pyllamacpp

    return pyllamacpp.default_model_path()


@pytest.fixture(scope="session")
def model(model_path):
    import pyllamacpp

    m = pyllamacpp.Model(model_path)
    yield m
    m.close()


@pytest.fixture
def ctx(model):
    """A small single-sequence context, 2 threads."""
    c = model.context(n_ctx=512, n_threads=2, n_threads_batch=2)
    yield c
    c.close()


PROMPT = "The cat sat on the mat."


@pytest.fixture
def raising_log_handler():
    """``with raising_log_handler(exc):`` a handler on logger ``pyllamacpp.llama`` raises ``exc``
    for every record at ``level`` (WARNING) or above: an exception inside llama.cpp's log callback,
    which pyllamacpp must keep and raise once C has returned."""

    @contextlib.contextmanager
    def install(exc: BaseException, level: int = logging.WARNING):
        class Boom(logging.Handler):
            def emit(self, record):
                raise exc

        h, lg = Boom(level=level), logging.getLogger("pyllamacpp.llama")
        lg.addHandler(h)
        try:
            yield h
        finally:
            lg.removeHandler(h)

    return install
