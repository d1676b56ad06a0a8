"""An ``--admin`` that is no URL because it holds a space or a control character is refused at start, one
line naming ``--admin`` (as docs/console.md says), by ``llmgw console`` and ``llmgw ctl`` alike.

The console took ``--admin "not a url"`` for the host ``not a url`` and drew "✖ disconnected, retrying
(unknown host not a url)" for as long as it ran. A stray blank at either end (a paste) is dropped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

ENV = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=60,
                          env=ENV, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("admin", "shown"), [
    ("not a url", "'not a url'"),
    ("http://gw 1:9090", "'http://gw 1:9090'"),
    ("http://127.0.0.1:9090/\x1b[31m", "'http://127.0.0.1:9090/\\x1b[31m'"),
])
@pytest.mark.parametrize("command", [["console"], ["ctl", "nodes"]])
def test_an_admin_with_a_space_or_a_control_character_is_refused(command: list[str], admin: str, shown: str) -> None:
    res = run(*command[:1], "--admin", admin, *command[1:])
    assert res.returncode == 1 and res.stdout == "", res
    assert res.stderr.strip() == f"llmgw: error: --admin {shown} is not a URL like http://127.0.0.1:9090", res.stderr


def test_a_stray_blank_at_either_end_is_dropped() -> None:
    from llmgw.cli._common import admin_url

    assert admin_url(" http://127.0.0.1:9090\n").url == admin_url("http://127.0.0.1:9090").url
