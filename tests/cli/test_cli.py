"""The ``llmgw`` command as a user meets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from llmgw import __version__
from llmgw.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_commands() -> None:
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0
    for cmd in ("serve", "sim-engine", "check-config", "mirror"):
        assert cmd in res.output
    assert "llmgw serve" in res.output


def test_version() -> None:
    res = run("--version")
    assert res.returncode == 0
    assert res.stdout.startswith(f"llmgw {__version__} (Python ")
    expected = "pure Python" if os.environ.get("LLMGW_NO_EXTENSIONS") else "compiled extensions"
    assert expected in res.stdout


def test_serve_help() -> None:
    res = CliRunner().invoke(main, ["serve", "--help"])
    assert res.exit_code == 0
    assert "--listen HOST:PORT" in res.output
    assert "demo fleet" in res.output


def test_check_config_ok(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("GPU0_KEY", "x")
    monkeypatch.setenv("TEAM_A_KEY", "y")
    monkeypatch.setenv("LLMGW_ADMIN_TOKEN", "z")
    res = CliRunner().invoke(main, ["check-config", str(ROOT / "llmgw.example.yaml")])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output
    assert "model llama-3-8b: 2 endpoint(s): gpu0-llama, gpu1-llama" in res.output


def test_config_errors_are_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "llmgw.yaml"
    bad.write_text("endpoints:\n  - id: a\n    url: localhost\n    model: m\n")
    for args in (["check-config", str(bad)], ["serve", "-c", str(bad)]):
        res = run(*args)
        assert res.returncode == 1
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert lines[0] == f"llmgw: error: {bad}:3: endpoints[0].url: not a URL (expected http://host:port), got 'localhost'"
        assert "Traceback" not in res.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    res = run("serve", "-c", str(tmp_path / "nope.yaml"))
    assert res.returncode == 1
    assert "does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_bad_listen_flag() -> None:
    res = CliRunner().invoke(main, ["serve", "--listen", "nowhere"])
    # Usage errors are llmgw's one-line errors too: exit 1, naming the fix.
    assert res.exit_code == 1
    assert "HOST:PORT" in res.output
    assert len(res.stderr.strip().splitlines()) == 1 and res.stderr.startswith("llmgw: error: ")
    assert "serve --help')" in res.stderr


def test_ctl_help_overview_names_every_command_in_one_column() -> None:
    from llmgw.cli.ctl import ctl

    res = CliRunner().invoke(main, ["ctl", "--help"])
    assert res.exit_code == 0
    overview = [ln for ln in res.output.splitlines() if ln.lstrip().startswith("llmgw ctl ")]
    assert {len(ln) - len(ln.lstrip()) for ln in overview} == {4}, overview  # (one indentation: one column)
    named = {ln.split()[2] for ln in overview} | {w.strip("(),:") for ln in overview for w in ln.split()}
    assert set(ctl.commands) <= named, sorted(set(ctl.commands) - named)
