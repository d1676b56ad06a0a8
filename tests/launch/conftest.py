"""Fixtures for the launch tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.testing import standins


@pytest.fixture
def standin_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The stand-ins first on PATH and PYTHONPATH (for this test and the engines it starts)."""
    bin_dir = standins.install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(standins.PYTHONPATH), os.environ.get("PYTHONPATH", "")) if p))
    yield {"bin": str(bin_dir)}
