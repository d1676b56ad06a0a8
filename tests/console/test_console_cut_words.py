"""A cell longer than its column is cut at a word boundary and marked ``…``, never mid-word.

The WHY NOT column of the Deployments view (``NOT PLACED BECAUSE``) holds the control plane's
reason, capped at the table's widest column: "... the largest free set is 0 ..." used to read
"the large…". The installed ``llmgw console`` in tmux against a recorded admin API.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.console.replay import ReplayAPI, fleet, serve_in_thread
from llmgw.console.table import MAX_WIDTH
from llmgw.console.views import cut_point

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.needs_tool("tmux", install="apt-get install tmux"),
]

LLMGW = Path(sys.executable).with_name("llmgw")
REASON = ("needs 2 GPUs with 70.0 GiB free each; the largest free set is 0 on node-a "
          "(others: 2 too little free memory (at most 30.4 GiB))")


@pytest.mark.parametrize(("text", "width", "shown"), [
    (REASON, 48, "needs 2 GPUs with 70.0 GiB free each; the"),
    ("needs 2 GPUs; the largest", 15, "needs 2 GPUs"),      # the separator before the cut is dropped
    ("abc def", 5, "abc"),
    ("tiny-very-long-deployment-name-for-the-console-width-test", 48,  # no space: cut where it must
     "tiny-very-long-deployment-name-for-the-console-"),
    ("a verylongwordthatfillsthecolumn", 20, "a verylongwordthatf"),  # a space too early: not used
    ("abcdef", 1, ""),
])
def test_cut_point(text: str, width: int, shown: str) -> None:
    cut = cut_point(text, width)
    assert text[:cut] == shown
    assert cut + 1 <= width


SOCKET = f"llmgw-cut-{uuid.uuid4().hex[:8]}"  # (a tmux server of its own: no other session's sizes)


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, "-f", "/dev/null", *args], check=True, capture_output=True,
                          text=True, timeout=10).stdout


@pytest.fixture
def session() -> Iterator[str]:
    name = f"llmgw-console-cut-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True, timeout=10)


def test_the_reason_column_is_cut_at_a_word_in_a_real_terminal(session: str) -> None:
    data = fleet(endpoints=2, nodes=2, gpus_per_node=1)
    data["/admin/v1/deployments"]["deployments"][0]["message"] = REASON
    with serve_in_thread(ReplayAPI(data)) as port:
        _tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "24",
              f"env -u COLUMNS -u LINES {LLMGW} console --admin http://127.0.0.1:{port} --view deployments --refresh 500ms")
        deadline = time.monotonic() + 20
        while True:
            text = _tmux("capture-pane", "-p", "-t", session)
            if any("needs 2 GPUs" in ln and ln.rstrip().endswith("…") for ln in text.splitlines()):
                break  # (the whole row drawn)
            width = _tmux("display-message", "-p", "-t", session, "#{window_width} #{pane_width} #{client_width}").strip()
            assert time.monotonic() < deadline, f"the reason never showed (width {width}):\n{text}"
            time.sleep(0.1)
    line = next(ln for ln in text.splitlines() if "needs 2 GPUs" in ln)
    shown = line[line.index("needs 2 GPUs"):].rstrip()
    assert len(shown) <= MAX_WIDTH, line
    kept = shown[:-1]
    # what is kept is whole words of the reason: the next character of the reason ends a word
    assert REASON.startswith(kept), line
    assert re.match(r"[ ,;:(]", REASON[len(kept)]), f"cut mid-word: {shown!r}"


TITLE = "Deployment chat: replicas and their log tails"


@pytest.mark.parametrize("width", [44, 47, 50])
def test_a_details_title_too_long_for_its_border_is_cut_at_a_word(session: str, width: int) -> None:
    with serve_in_thread(ReplayAPI(fleet(endpoints=2, nodes=2, gpus_per_node=1))) as port:
        _tmux("new-session", "-d", "-s", session, "-x", str(width), "-y", "20",
              f"env -u COLUMNS -u LINES {LLMGW} console --admin http://127.0.0.1:{port} --view deployments "
              "--refresh 500ms")
        deadline = time.monotonic() + 20
        while "chat" not in _tmux("capture-pane", "-p", "-t", session):
            assert time.monotonic() < deadline, _tmux("capture-pane", "-p", "-t", session)
            time.sleep(0.1)
        _tmux("send-keys", "-t", session, "Enter")  # the replicas and their log tails, "chat" first
        deadline = time.monotonic() + 20  # (its own: a loaded machine may have spent the first one starting)
        seen: list[str] = []
        while True:  # (the first frame may be drawn before the title is fitted: wait for the fitted one)
            text = _tmux("capture-pane", "-p", "-t", session)
            line = next((ln for ln in text.splitlines() if "Deployment chat" in ln and "…" in ln), None)
            if line is not None:
                shown = line[line.index("Deployment chat"):line.index("…")]
                seen.append(shown + "…")
                if TITLE.startswith(shown) and TITLE[len(shown)] == " ":
                    break
            assert time.monotonic() < deadline, f"title cut mid-word at {width} columns: {seen[-1:]}\n{text}"
            time.sleep(0.1)
