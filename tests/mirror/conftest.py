"""Fixtures for the mirror tests: an isolated environment, a mirror root, model files, an Ollama store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from mirror_helpers import OllamaStore, write_gguf, write_projector

from llmgw.mirror import MirrorStore


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Never look at the real ~/.ollama or write to the real ~/.local/share.
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("LLMGW_MIRROR", "OLLAMA_MODELS", "XDG_DATA_HOME"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A mirror root that does not exist yet."""
    return tmp_path / "mirror"


@pytest.fixture
def store(root: Path) -> Iterator[MirrorStore]:
    """An open, empty mirror."""
    s = MirrorStore(root)
    yield s
    s.close()


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """A small valid GGUF model."""
    (tmp_path / "src").mkdir(exist_ok=True)
    return write_gguf(tmp_path / "src" / "Tiny-Llama-F16.gguf")


@pytest.fixture
def projector_file(tmp_path: Path) -> Path:
    """A small valid projector GGUF."""
    (tmp_path / "src").mkdir(exist_ok=True)
    return write_projector(tmp_path / "src" / "mmproj-Tiny-F16.gguf")


@pytest.fixture
def ollama(tmp_path: Path) -> OllamaStore:
    """An empty Ollama models directory."""
    return OllamaStore(tmp_path / "ollama" / "models")
