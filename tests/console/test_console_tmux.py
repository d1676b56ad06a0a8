"""The installed ``llmgw console`` in a real terminal (tmux): keys in, the screen read back.

The gateway is a recorded admin API (fixed data over HTTP), so the screen can be checked
word for word; the console is the ``llmgw`` script of the interpreter running the tests.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmgw.console.replay import ReplayAPI, fleet, serve_in_thread

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.needs_tool("tmux", install="apt-get install tmux"),
]

LLMGW = Path(sys.executable).with_name("llmgw")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True, timeout=10).stdout


@pytest.fixture
def session() -> Iterator[str]:
    name = f"llmgw-console-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True, timeout=10)


def screen_until(session: str, cond: Callable[[str], bool], timeout: float = 20.0) -> str:
    """The screen once ``cond`` holds (bounded; the console draws asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        text = tmux("capture-pane", "-p", "-t", session)
        if cond(text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"the screen never showed what was expected:\n{text}")
        time.sleep(0.1)


def test_console_in_a_real_terminal(session: str) -> None:
    assert LLMGW.exists(), f"no installed llmgw script at {LLMGW}"
    api = ReplayAPI(fleet(endpoints=6, nodes=2, gpus_per_node=2))
    with serve_in_thread(api) as port:
        tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24",
             f"{LLMGW} console --admin http://127.0.0.1:{port} --refresh 500ms")
        text = screen_until(session, lambda t: "vllm-0000" in t)
        assert "● connected" in text and "Endpoints (6)" in text and "STATE" in text
        tmux("send-keys", "-t", session, ":gpus")
        screen_until(session, lambda t: ":gpus" in t)
        tmux("send-keys", "-t", session, "Enter")
        text = screen_until(session, lambda t: "GPUs (4)" in t)
        assert "node-000" in text and "%" in text
        tmux("send-keys", "-t", session, "/node-001")
        text = screen_until(session, lambda t: "GPUs (2/4)" in t)
        assert "node-000" not in text
        tmux("send-keys", "-t", session, "Enter")  # keeps the filter, closes the prompt
        screen_until(session, lambda t: not any(line.strip().startswith("/node-001") for line in t.splitlines()))
        tmux("send-keys", "-t", session, "?")
        text = screen_until(session, lambda t: "console: keys" in t and "command mode" in t)
        tmux("send-keys", "-t", session, "Escape")
        screen_until(session, lambda t: "GPUs (2/4)" in t)
        tmux("send-keys", "-t", session, ":mirror")
        screen_until(session, lambda t: ":mirror" in t)
        tmux("send-keys", "-t", session, "Enter")
        text = screen_until(session, lambda t: "Mirror (3)" in t)
        assert "llava:7b" in text and "Q4_0" in text
        tmux("send-keys", "-t", session, "I")  # shift-i, as a terminal sends it
        screen_until(session, lambda t: "Import from Ollama" in t and "no Ollama models found" in t)
        tmux("send-keys", "-t", session, "Escape")
        screen_until(session, lambda t: "Import from Ollama" not in t)
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("q did not quit the console")


CRASHING = """\
import sys

from llmgw.console.app import ConsoleApp


def crash(self: ConsoleApp) -> None:
    raise RuntimeError("a bug in the console")


ConsoleApp.action_help = crash  # (? runs it: an exception nothing in the app handles)
from llmgw.cli import main  # noqa: E402

main(["console", "--admin", sys.argv[1], "--refresh", "500ms"])
"""


def test_a_console_that_crashed_exits_non_zero(session: str, tmp_path: Path) -> None:
    """Textual ends the app on an unhandled exception and prints it; the console's exit status says so
    (it was 0: a script or a supervisor took the crash for a quit)."""
    script = tmp_path / "crashing.py"
    script.write_text(CRASHING)
    status = tmp_path / "status"
    with serve_in_thread(ReplayAPI(fleet(endpoints=2, nodes=1, gpus_per_node=1))) as port:
        tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24",
             f"{sys.executable} {script} http://127.0.0.1:{port}; echo $? > {status}; sleep 60")
        screen_until(session, lambda t: "vllm-0000" in t)
        tmux("send-keys", "-t", session, "?")
        deadline = time.monotonic() + 20
        while not (status.exists() and status.read_text().strip()):
            assert time.monotonic() < deadline, tmux("capture-pane", "-p", "-t", session)
            time.sleep(0.1)
        assert status.read_text().strip() == "1", tmux("capture-pane", "-p", "-t", session)
        assert "a bug in the console" in tmux("capture-pane", "-p", "-S", "-200", "-t", session)
