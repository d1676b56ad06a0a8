"""CLI conventions, through the real ``llmgw`` entry point in a subprocess.

* a bare ``llmgw`` (or a bare command group) prints help on stdout and exits 0;
* every error is one line per error on stderr, ``llmgw: error: <what; what to do>``, exit 1,
  with nothing on stdout;
* ``--json`` output is on stdout alone: one JSON document and nothing else, nothing on stderr
  when the command succeeds;
* ``llmgw.example.yaml``'s comments say what ``check-config`` really does with it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.testing.gguf_model import write_tiny_llama
from ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "llmgw.example.yaml"
EXAMPLE_ENV = {"GPU0_KEY": "x", "TEAM_A_KEY": "y", "LLMGW_ADMIN_TOKEN": "z"}


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
        unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in unset and not k.startswith("LLMGW_LOG")}
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=60, cwd=cwd,
        env={**full, **(env or {})},
    )


def one_error(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The single ``llmgw: error:`` line of a failed command (asserts the conventions)."""
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("llmgw: error: "), lines[0]
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def only_json(res: subprocess.CompletedProcess[str], rc: int = 0) -> object:
    """stdout is exactly one JSON document; stderr is empty."""
    assert res.returncode == rc, (res.stdout, res.stderr)
    assert res.stderr == "", res.stderr
    return json.loads(res.stdout)


# -- help --


@pytest.mark.parametrize("args", [(), ("ctl",), ("mirror",), ("config",)])
def test_bare_command_prints_help_and_succeeds(args: tuple[str, ...]) -> None:
    res = run(*args)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert res.stdout.startswith(f"Usage: {' '.join(('python -m llmgw', *args))} [OPTIONS] COMMAND")
    assert "Commands:" in res.stdout


# -- the example config's comments --


def _env_vars_in(path: Path) -> list[str]:
    return re.findall(r"^\s*-?\s*\w*_env:\s*(\w+)", path.read_text(), flags=re.M)


def test_example_config_comment_tells_the_truth() -> None:
    text = EXAMPLE.read_text()
    head = "".join(ln for ln in text.splitlines(keepends=True)[:12] if ln.startswith("#"))
    env_vars = _env_vars_in(EXAMPLE)
    assert sorted(env_vars) == sorted(EXAMPLE_ENV)
    # Without them: every unset variable named, one line each, in one pass; exit 1.
    res = run("check-config", str(EXAMPLE), unset=tuple(EXAMPLE_ENV))
    assert res.returncode == 1 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == len(env_vars), res.stderr
    for var, line in zip(env_vars, lines, strict=True):
        assert line.startswith("llmgw: error: ") and f"environment variable {var} is not set" in line
        assert "export it" in line
        assert var in head, f"the example's header comment should name {var}"
    assert "exit 1" in head and "every problem in one pass" in head
    # With them: OK, exit 0, as the comment's own command line says.
    cmd = re.search(r"^#\s+(GPU0_KEY=\S+ .*llmgw check-config llmgw\.example\.yaml)$", head, flags=re.M)
    assert cmd is not None, head
    env = dict(kv.split("=", 1) for kv in cmd.group(1).split()[:3])
    res = run("check-config", str(EXAMPLE), env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"{EXAMPLE}: OK") and res.stderr == ""
    assert '"llmgw.example.yaml: OK"' in head
    # --json: one document on stdout alone, either way.
    doc = only_json(run("check-config", "--json", str(EXAMPLE), unset=tuple(EXAMPLE_ENV)), rc=1)
    assert isinstance(doc, dict) and len(doc["problems"]) == 3
    doc = only_json(run("check-config", "--json", str(EXAMPLE), env=EXAMPLE_ENV))
    assert isinstance(doc, dict) and doc["ok"] is True


# -- errors: one line, exit 1, stderr --


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("nosuch",), ("No such command 'nosuch'", "--help')")),
        (("serve", "--bogus"), ("No such option '--bogus'", "serve --help')")),
        (("serve", "--listen", "nowhere"), ("HOST:PORT",)),
        (("serve", "-c", "MISSING"), ("does not exist",)),
        (("check-config", "MISSING"), ("does not exist",)),
        (("sim-engine",), ("Missing option '--model'", "sim-engine --help')")),
        (("sim-engine", "--model", "m", "--engine", "ollama"), ("--engine",)),
        (("ctl", "endpoints", "--admin", "http://127.0.0.1:1"), ("cannot reach the admin API", "--admin URL")),
        (("ctl", "--json", "endpoints", "--admin", "http://127.0.0.1:1"), ("cannot reach the admin API",)),
        (("ctl", "queues", "--admin", "not a url"), ("--admin",)),
        (("ctl", "drain"), ("Missing argument 'ID'", "ctl drain --help')")),
        (("mirror", "import", "MISSING", "--root", "ROOT"), ("MISSING",)),
        (("mirror", "import", "MISSING", "--root", "ROOT", "--json"), ("MISSING",)),
        (("mirror", "show", "nothing", "--root", "ROOT"), ("nothing",)),
        (("mirror", "rm", "nothing", "--root", "ROOT", "--json"), ("nothing",)),
        (("config", "schema", "--bogus"), ("No such option",)),
        (("--log-level", "loud", "serve"), ("--log-level",)),
    ],
)
def test_errors_are_one_line_exit_1(tmp_path: Path, args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    missing = str(tmp_path / "nope.yaml")
    args = tuple(a.replace("MISSING", missing).replace("ROOT", str(tmp_path / "mirror")) for a in args)
    needles = tuple(n.replace("MISSING", missing) for n in needles)
    one_error(run(*args, cwd=tmp_path), *needles)


# -- --json on stdout alone --


@pytest.fixture(scope="module")
def admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``llmgw serve`` on the demo fleet; its admin URL."""
    port, admin = _free_port(), _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "serve", "--listen", f"127.0.0.1:{port}", "--admin", f"127.0.0.1:{admin}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path_factory.mktemp("serve"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "curl" not in (proc.stdout.readline() or "curl"):
        pass
    try:
        yield f"http://127.0.0.1:{admin}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)


def test_ctl_json_is_stdout_alone(admin_url: str) -> None:
    doc = only_json(run("ctl", "--admin", admin_url, "endpoints", "--json"))
    assert isinstance(doc, dict)
    ids = [ep["id"] for ep in doc["endpoints"]]
    assert "demo-vllm-0" in ids
    for cmd in (("drain", "demo-vllm-0"), ("undrain", "demo-vllm-0"), ("queues",)):
        only_json(run("ctl", "--json", *cmd, "--admin", admin_url))
    one_error(run("ctl", "--json", "drain", "no-such-replica", "--admin", admin_url), "no-such-replica")
    # The demo has no config file to re-read: an error, still one line and nothing on stdout.
    res = run("ctl", "--json", "reload", "--admin", admin_url)
    if res.returncode == 0:
        only_json(res)
    else:
        one_error(res)


def test_mirror_json_is_stdout_alone(tmp_path: Path) -> None:
    root = str(tmp_path / "mirror")
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    assert only_json(run("mirror", "ls", "--json", "--root", root)) == []
    doc = only_json(run("mirror", "import", str(model), "--name", "tiny:v1", "--json", "--root", root))
    assert isinstance(doc, dict)
    for args in (("ls",), ("show", "tiny:v1"), ("verify",), ("gc", "--dry-run")):
        only_json(run("mirror", *args, "--json", "--root", root))
    only_json(run("mirror", "rm", "tiny:v1", "--json", "--root", root))
    only_json(run("mirror", "gc", "--json", "--root", root))


def test_config_schema_is_stdout_alone() -> None:
    doc = only_json(run("config", "schema"))
    assert isinstance(doc, dict) and "$schema" in doc
