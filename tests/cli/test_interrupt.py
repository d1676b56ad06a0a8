"""Ctrl-C at any point of a command: one line on stderr and exit status 130, never a traceback.

The windows that matter are the imports: ``llmgw.cli`` itself (before click runs) and a
subcommand's modules (before click would turn the interrupt into ``Abort``). A
``KeyboardInterrupt`` is raised there deterministically by an import hook in the child
process, the way a SIGINT landing in that import raises it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(60)

_HOOK = """
import sys
class Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise KeyboardInterrupt
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["llmgw", *{args!r}]
import llmgw.__main__
llmgw.__main__.main()
"""


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("llmgw.cli", ["ctl", "nodes"]),  # the command's own package, before click
        ("llmgw.cli._common", ["ctl", "nodes"]),  # what the group imports first
        ("llmgw.cli.ctl", ["ctl", "nodes"]),  # the subcommand's module
        ("llmgw.cli.mirror", ["mirror", "ls"]),
    ],
)
def test_an_interrupt_while_importing_is_one_line_and_130(module: str, args: list[str]) -> None:
    p = subprocess.run([sys.executable, "-c", _HOOK.format(module=module, args=args)],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 130, p.stderr
    assert p.stderr.strip() == "llmgw: interrupted", p.stderr
    assert p.stdout == ""


def test_sigint_while_a_ctl_call_waits_is_one_line_and_130() -> None:
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        p = subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "--admin", f"http://127.0.0.1:{port}", "nodes"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "LLMGW_ADMIN_TOKEN": ""})
        try:
            deadline = time.monotonic() + 20
            silent.settimeout(0.2)
            while time.monotonic() < deadline:  # until the call is on the wire
                try:
                    conn, _ = silent.accept()
                    break
                except TimeoutError:
                    assert p.poll() is None, p.communicate()
            else:
                pytest.fail("ctl never connected")
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=15)
            conn.close()
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "llmgw: interrupted", err
