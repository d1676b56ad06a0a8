"""README.md's two commands are real: CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(python3 -m venv .venv && [^\n]+)\n```", text)


def test_readme_gives_both_commands() -> None:
    cmds = _commands()
    assert any(c.endswith("llmgw serve") for c in cmds), cmds
    assert any("pytest" in c for c in cmds), cmds


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_cmd = next(c for c in _commands() if "pytest" in c)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, "the README test command must appear verbatim as a line of .ci/run"
