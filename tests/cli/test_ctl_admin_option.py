"""``--admin`` given wrong, to ``llmgw ctl`` and ``llmgw console`` alike, and ``ctl scale``'s REPLICAS: each
is one line naming the option and the fix, never a traceback (a broken IPv6 address was one), never a
silent default (an empty ``--admin``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "admin"))
from admin_helpers import admin_port, closed_port, gone, running

from llmgw.cli import main
from llmgw.cli.console import console
from llmgw.console.client import AdminClient, Unreachable

pytestmark = pytest.mark.timeout(60)

NOWHERE = f"http://127.0.0.1:{closed_port()}"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    return subprocess.run([sys.executable, "-m", "llmgw", *args], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def one_error(res: subprocess.CompletedProcess[str] | Result) -> str:
    if isinstance(res, Result):
        code, out = res.exit_code, res.output
    else:
        code, out = res.returncode, res.stderr
        assert res.stdout == "", res.stdout
    assert code == 1, out
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmgw: error: "), out
    return lines[0]


@pytest.mark.parametrize("command", [("ctl", "--admin", "{}", "nodes"), ("ctl", "nodes", "--admin", "{}"),
                                     ("console", "--admin", "{}")])
def test_a_broken_ipv6_address_is_one_line_naming_admin(command: tuple[str, ...]) -> None:
    res = run(*(a.format("http://[::1") for a in command))
    assert one_error(res) == ("llmgw: error: --admin 'http://[::1' is not a URL like http://127.0.0.1:9090 "
                              "(an IPv6 address goes in brackets: http://[::1]:9090)")


@pytest.mark.parametrize("where", ["group", "command"])
def test_an_empty_admin_is_refused_as_the_console_refuses_it(where: str) -> None:
    args = ["--admin", "", "nodes"] if where == "group" else ["nodes", "--admin", ""]
    res = CliRunner().invoke(main, ["ctl", *args], prog_name="llmgw", env={"LLMGW_ADMIN": None})
    line = one_error(res)
    assert line == "llmgw: error: --admin '' is not a URL like http://127.0.0.1:9090"
    assert one_error(CliRunner().invoke(console, ["--admin", ""])) == line


@pytest.mark.parametrize("path", ["/admin/v1", "/admin/v1/", "/admin/v1/endpoints"])
def test_the_admin_apis_own_path_is_said_to_be_dropped(path: str) -> None:
    url = f"http://127.0.0.1:14999{path}"
    want = (f"llmgw: error: --admin '{url}' holds the admin API's path /admin/v1, which llmgw adds itself: drop it "
            "(--admin http://127.0.0.1:14999)")
    assert one_error(CliRunner().invoke(main, ["ctl", "--admin", url, "nodes"], prog_name="llmgw")) == want
    assert one_error(CliRunner().invoke(console, ["--admin", url])) == want


async def test_https_to_the_plain_http_admin_port_says_to_use_http() -> None:
    async with running([], more=[gone()]) as rt:
        port = admin_port(rt)
        # (the gateway in this process logs the replica down at its first scrape: before the CLI runs, whose
        # captured stderr would have that line too)
        for _ in range(200):
            if rt.registry.endpoints["gone"].state.down:
                break
            await asyncio.sleep(0.05)
        want = (f"the admin API at https://127.0.0.1:{port} speaks plain HTTP, not TLS: pass --admin "
                f"http://127.0.0.1:{port} (llmgw's admin listener has no TLS of its own; https:// is for a TLS "
                "proxy in front of it)")
        res = await asyncio.to_thread(CliRunner().invoke, main, ["ctl", "--admin", f"https://127.0.0.1:{port}",
                                                                 "endpoints"], catch_exceptions=False)
        assert one_error(res) == f"llmgw: error: {want}"
        with pytest.raises(Unreachable) as err:
            await AdminClient(f"https://127.0.0.1:{port}", timeout=5).get("/admin/v1/endpoints")
        assert str(err.value) == want


@pytest.mark.parametrize("value", ["-1", "1025", "99999", "٣", "x", "1_0"])
def test_scale_replicas_must_be_0_to_1024(value: str) -> None:
    res = CliRunner().invoke(main, ["ctl", "--admin", NOWHERE, "scale", "chat", value], prog_name="llmgw")
    assert one_error(res) == (f"llmgw: error: Invalid value for 'REPLICAS': {value!r} is not a replica count: a whole "
                              "number from 0 to 1024 (see 'llmgw ctl scale --help')")
    res = CliRunner().invoke(main, ["ctl", "--admin", NOWHERE, "deploy", "chat", "--model", "m", "--replicas", value],
                             prog_name="llmgw")
    assert "is not a replica count: a whole number from 0 to 1024" in one_error(res)


def test_scale_replicas_in_range_reach_the_api() -> None:
    res = CliRunner().invoke(main, ["ctl", "--admin", NOWHERE, "scale", "chat", "1024"], prog_name="llmgw")
    assert "cannot reach the admin API" in one_error(res)  # (valid: sent)


@pytest.mark.parametrize("url", ["http://ops:{}@127.0.0.1:notaport", "http://ops:{}@127.0.0.1:14999/admin/v1",
                                 "http://ops:{}@127.0.0.1:{port}"])
def test_a_password_in_admin_is_never_quoted(url: str) -> None:
    from canary import secret

    value = url.format(secret("admin-url-1"), port=closed_port())
    for res in (CliRunner().invoke(main, ["ctl", "--admin", value, "nodes"], prog_name="llmgw"),
                CliRunner().invoke(console, ["--admin", value])):
        if res.exit_code == 1 and "terminal" in res.output:  # (the console: a good URL, then no terminal)
            continue
        line = one_error(res)
        assert "admin-url-1" not in line and "ops" not in line, line
