"""Where the discovery stand-ins live (tests/agent/scenarios, tests/agent/bin)."""

from __future__ import annotations

from pathlib import Path

AGENT_TESTS = Path(__file__).resolve().parent.parent
SCENARIOS = AGENT_TESTS / "scenarios"
BIN = AGENT_TESTS / "bin"
FAKE_SMI = BIN / "nvidia-smi"
