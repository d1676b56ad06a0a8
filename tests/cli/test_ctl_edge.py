"""``llmgw ctl`` (and ``llmgw console``) at the edges: a pool with no usable replica, an admin token
that cannot go in a header, a float option given ``nan`` or ``inf``. Each is one line naming the fix
(or a shown state), never a traceback, never the token."""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "admin"))
from admin_helpers import admin_port, closed_port, gone, running, wait_for

from canary import secret
from llmgw.cli import main
from llmgw.cli.console import console
from llmgw.cli.ctl import ctl
from llmgw.console.client import AdminClient

pytestmark = pytest.mark.timeout(60)

# (where a check happens before anything is sent: nothing listens here)
NOWHERE = f"http://127.0.0.1:{closed_port()}"


async def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
    # The gateway runs on this loop; the command's blocking HTTP runs in a thread.
    return await asyncio.to_thread(CliRunner().invoke, ctl, list(args), env=env, catch_exceptions=False)


def llmgw(*args: str, env: dict[str, str] | None = None) -> Result:
    """The whole ``llmgw`` command, so usage errors are rendered as users see them."""
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False, prog_name="llmgw")


def url(rt: Any) -> str:
    return f"http://127.0.0.1:{admin_port(rt)}"


def one_error(res: Result) -> str:
    assert res.exit_code == 1, res.output
    lines = res.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmgw: error: "), res.output
    return lines[0]


# -- a pool without a usable replica: +Inf saturation, null in the JSON --


async def test_queues_shows_a_pool_without_a_usable_replica() -> None:
    async with running([], more=[gone()]) as rt:
        assert rt.registry is not None
        registry = rt.registry
        await wait_for(lambda: registry.pool_saturation("m") == math.inf)
        res = await invoke("--admin", url(rt), "queues", "--json")
        assert res.exit_code == 0, res.output
        assert '"m": null' in res.output  # (JSON has no +Inf)
        res = await invoke("--admin", url(rt), "queues")
        assert res.exit_code == 0, res.output
        lines = res.output.splitlines()
        assert lines[0].split() == ["BAND", "DEPTH", "ADMITTED", "QUEUED", "REJECTED"]
        assert lines[-1] == "saturation: m no usable replica"


# -- an admin token no header can carry --


@pytest.mark.parametrize("value", ["\n", "\r\n", "\x1b"])
async def test_a_token_with_a_line_break_from_the_environment_is_refused(value: str) -> None:
    tok = secret("adm-1")
    async with running([], more=[gone()], admin_token=tok) as rt:
        res = await invoke("--admin", url(rt), "endpoints", env={"LLMGW_ADMIN_TOKEN": tok + value})
        assert one_error(res) == (
            "llmgw: error: LLMGW_ADMIN_TOKEN holds a line break or another control character "
            "(a trailing newline from a file?): remove it"
        )
        assert "adm-1" not in res.output
        # the right one, on the subcommand, still works past the bad one in the environment
        res = await invoke("--admin", url(rt), "endpoints", "--token", tok, env={"LLMGW_ADMIN_TOKEN": tok + value})
        assert res.exit_code == 0, res.output
        assert res.output.split()[0] == "ID"


@pytest.mark.parametrize("where", ["group", "command"])
@pytest.mark.parametrize("value", [" {}", "{} ", "{}\t", "a\n{}"])
def test_a_bad_token_option_is_refused_naming_the_option(where: str, value: str) -> None:
    tok = value.format(secret("adm-2"))
    args = ["--token", tok, "endpoints"] if where == "group" else ["endpoints", "--token", tok]
    res = CliRunner().invoke(ctl, ["--admin", NOWHERE, *args], env={"LLMGW_ADMIN_TOKEN": None})
    line = one_error(res)
    assert line.startswith("llmgw: error: --token ") and line.endswith(": remove it"), line
    assert "adm-2" not in res.output


def test_a_bad_token_is_not_checked_where_none_is_sent() -> None:
    # (engine-check without --node runs here: the environment's token is no business of it)
    res = CliRunner().invoke(ctl, ["engine-check", "llamacpp", "--static", "--json", "--binary", "/nonexistent",
                                   "--gpu-source", "none"],
                             env={"LLMGW_ADMIN_TOKEN": secret("adm-3") + "\n"})
    assert "LLMGW_ADMIN_TOKEN" not in res.output, res.output


async def test_a_non_ascii_token_is_sent_as_utf8() -> None:
    # (the gateway compares the UTF-8 bytes of admin_token; http.client would encode latin-1, or fail)
    tok = secret("adm-4") + "-€ü"
    async with running([], more=[gone()], admin_token=tok) as rt:
        res = await invoke("--admin", url(rt), "endpoints", env={"LLMGW_ADMIN_TOKEN": tok})
        assert res.exit_code == 0, res.output
        assert res.output.split()[0] == "ID"
        client = AdminClient(url(rt), tok)
        data = await client.get("/admin/v1/endpoints")
        assert [e["id"] for e in data["endpoints"]] == ["gone"]


def test_console_refuses_a_token_with_a_line_break_at_start() -> None:
    tok = secret("adm-5")
    res = CliRunner().invoke(console, ["--admin", NOWHERE], env={"LLMGW_ADMIN_TOKEN": tok + "\n"})
    assert one_error(res) == (
        "llmgw: error: LLMGW_ADMIN_TOKEN holds a line break or another control character "
        "(a trailing newline from a file?): remove it"
    )
    res = CliRunner().invoke(console, ["--admin", NOWHERE, "--token", " " + tok], env={"LLMGW_ADMIN_TOKEN": None})
    assert one_error(res) == "llmgw: error: --token starts or ends with whitespace: remove it"
    assert "adm-5" not in res.output


# -- float options: nan and inf are no numbers JSON (or a timeout) can carry --


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_deploy_cpu_cores_must_be_a_finite_number(value: str) -> None:
    res = llmgw("ctl", "--admin", NOWHERE, "deploy", "chat", "--model", "tiny:1b", "--cpu-cores", value)
    line = one_error(res)
    assert line.startswith("llmgw: error: Invalid value for '--cpu-cores': "), line
    assert line.endswith("(see 'llmgw ctl deploy --help')"), line


@pytest.mark.parametrize("node", [True, False])
def test_engine_check_timeout_must_be_a_finite_number(node: bool) -> None:
    res = llmgw("ctl", "--admin", NOWHERE, "engine-check", "llamacpp", "--timeout", "nan",
                *(["--node", "n1"] if node else ["--static"]))
    assert one_error(res) == ("llmgw: error: Invalid value for '--timeout': 'nan' is not a finite number "
                              "(see 'llmgw ctl engine-check --help')")


async def test_deploy_cpu_cores_a_number_is_sent() -> None:
    async with running([], more=[gone()]) as rt:
        res = await asyncio.to_thread(llmgw, "ctl", "--admin", url(rt), "deploy", "chat", "--model", "tiny:1b",
                                      "--cpu-cores", "2.5")
        # (the body was JSON the gateway read: it answers that it runs no control plane)
        assert "no control plane" in one_error(res)


def test_the_console_shows_a_pool_without_a_usable_replica_as_ctl_does() -> None:
    """The API's null saturation (JSON has no +Inf) is a pool with no usable replica, not a number nobody
    measured: the Models view says so; a model the mapping leaves out has no estimate ("–")."""
    from llmgw.console.views import ABSENT, ModelsView

    data = {
        "/admin/v1/endpoints": {"endpoints": [
            {"id": "a", "models": ["down"], "state": "down", "usable": False},
            {"id": "b", "models": ["fine"], "state": "ok", "usable": True},
            {"id": "c", "models": ["new"], "state": "ok", "usable": True},
        ]},
        "/admin/v1/queues": {"pool_saturation": {"down": None, "fine": 0.25}, "admission": False, "bands": []},
    }
    rows = {r.key: r for r in ModelsView().rows(data)}
    assert "no usable replica" in str(rows["down"].cells[4])
    assert "25%" in str(rows["fine"].cells[4])
    assert ABSENT in str(rows["new"].cells[4]) and "no usable replica" not in str(rows["new"].cells[4])
