"""``llmgw ctl``'s tables in a terminal narrower than the table (tmux, 80 columns): each row whole on
one line that the terminal wraps, with no line of padding.

The WHY NOT column, the only one that may wrap, was wrapped at its longest word while the others kept
the table wider than the terminal anyway: the reason came one word a table line, each table line the
table's width of spaces, which the terminal wrapped into blank lines (a screenful for one reason).
Against a recorded admin API (:mod:`llmgw.console.replay`) on 127.0.0.1.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.console.replay import ReplayAPI, fleet, serve_in_thread

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.needs_tool("tmux", install="apt-get install tmux"),
]

LLMGW = Path(sys.executable).with_name("llmgw")
SOCKET = f"llmgw-ctl-tables-{uuid.uuid4().hex[:8]}"  # (a tmux server of its own)
REASON = ("needs 2 GPUs with 70.0 GiB free each; the largest free set is 0 on node-a "
          "(others: 2 too little free memory (at most 30.4 GiB))")


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, "-f", "/dev/null", *args], check=True, capture_output=True,
                          text=True, timeout=10).stdout


@pytest.fixture
def session() -> Iterator[str]:
    name = f"ctl-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["tmux", "-L", SOCKET, "kill-server"], capture_output=True, timeout=10)


def test_a_table_wider_than_the_terminal_keeps_each_row_on_one_line(session: str, tmp_path: Path) -> None:
    data = fleet(endpoints=2, nodes=2, gpus_per_node=1)
    deps = data["/admin/v1/deployments"]["deployments"]
    deps[0].update(name="a-deployment-with-a-rather-long-name-to-widen-the-table", message=REASON, source="api")
    done = tmp_path / "done"
    with serve_in_thread(ReplayAPI(data)) as port:
        _tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "50",
              f"sh -c 'env -u COLUMNS -u LINES {LLMGW} ctl --admin http://127.0.0.1:{port} deployments; "
              f"echo $? > {done}; sleep 60'")
        deadline = time.monotonic() + 30
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < deadline, _tmux("capture-pane", "-p", "-t", session)
            time.sleep(0.1)
    assert done.read_text().strip() == "0"
    screen = _tmux("capture-pane", "-p", "-t", session)
    joined = _tmux("capture-pane", "-p", "-J", "-t", session)  # (the terminal's wrapping undone)
    table = joined.split("\n\n")[0].splitlines()  # (the deployments table, before the replicas')
    assert table[0].startswith("DEPLOYMENT") and table[0].endswith("WHY NOT"), joined
    row = next(line for line in table if line.startswith("a-deployment-with"))
    assert row.endswith(REASON), f"the reason is not on its row's line:\n{joined}"
    assert len(table) == 1 + len(deps), joined  # (a line a row: no line of the reason alone)
    lines = screen.split("\n\n")[0].splitlines()
    assert all(line.strip() for line in lines), f"blank lines where padding wrapped:\n{screen}"
