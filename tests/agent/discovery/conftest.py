"""Fixtures for GPU discovery: the stand-in pynvml, the stand-in nvidia-smi, their scenarios."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from discovery_helpers import SCENARIOS

from llmgw.testing.fake_nvml import FakeNvml


@pytest.fixture
def fake_nvml() -> Callable[[str], FakeNvml]:
    """``fake_nvml("h100x8")``: a stand-in pynvml over ``scenarios/h100x8.yaml``."""
    return lambda name: FakeNvml(SCENARIOS / f"{name}.yaml")


@pytest.fixture
def smi_scenario(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], Path]:
    """``smi_scenario("smi_h100x8")``: the stand-in nvidia-smi answers from that scenario.

    The stand-in's ``#!/usr/bin/env python3`` finds this interpreter first on PATH.
    """
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")

    def use(name: str) -> Path:
        path = SCENARIOS / f"{name}.json"
        monkeypatch.setenv("LLMGW_FAKE_SMI_SCENARIO", str(path))
        return path

    return use
