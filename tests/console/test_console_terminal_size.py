"""The console fills the terminal it runs in, whatever ``COLUMNS`` / ``LINES`` the environment holds.

rich (under Textual) takes those variables over the terminal's size and keeps them through
resizes: exported by a shell, a script or another terminal (``COLUMNS=80``), the console was drawn
80 columns wide in a terminal of 200, and stayed so when the window changed. The installed
``llmgw console`` in tmux, against a recorded admin API.
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
SOCKET = f"llmgw-size-{uuid.uuid4().hex[:8]}"  # (a tmux server of its own)


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, "-f", "/dev/null", *args], check=True, capture_output=True,
                          text=True, timeout=10).stdout


@pytest.fixture
def session() -> Iterator[str]:
    name = f"llmgw-console-size-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True, timeout=10)


def _screen_until(session: str, cond: Callable[[str], bool], timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = _tmux("capture-pane", "-p", "-t", session)
        if cond(text):
            return text
        assert time.monotonic() < deadline, f"the screen never showed what was expected:\n{text}"
        time.sleep(0.1)


def _footer_width(text: str) -> int:
    """How far the screen's last drawn line reaches (the key bar spans the console's width)."""
    return max(len(line.rstrip()) for line in text.splitlines())


def test_an_exported_columns_does_not_fix_the_console_s_size(session: str) -> None:
    with serve_in_thread(ReplayAPI(fleet(endpoints=2, nodes=2, gpus_per_node=1))) as port:
        _tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "24",
              f"env COLUMNS=80 LINES=24 {LLMGW} console --admin http://127.0.0.1:{port} --view deployments "
              "--refresh 500ms")
        # the Deployments view at 200 columns: every column, the reason last, on screen
        text = _screen_until(session, lambda t: "NOT PLACED BECAUSE" in t and "no node has" in t)
        assert "Deployments (2)" in text
        _tmux("resize-window", "-t", session, "-x", "60", "-y", "20")
        text = _screen_until(session, lambda t: "NOT PLACED" not in t and "Deployments (2)" in t)
        assert _footer_width(text) <= 60, text
