"""Cordons are an operator's decision: kept by node name across the agent's restart and, in the
control plane's database (SQLite by default), across the control plane's."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path

import pytest
from cp_helpers import AgentProc, api, control_runtime, free_port, metrics, pick, wait_for
from scenario import h100s, write_scenario

from llmgw.errors import ConfigError, StartupError

pytestmark = pytest.mark.timeout(60)


def _agent(tmp_path: Path, port: int, name: str) -> AgentProc:
    scenario = write_scenario(tmp_path / f"{name}.json", {"hostname": name, "gpus": h100s(1, name[-1])})
    return AgentProc(port, name, scenario, tmp_path / f"{name}.log").start()


async def _node(rt, name: str) -> dict | None:  # type: ignore[no-untyped-def]
    _, body = await api(rt, "GET", "/admin/v1/nodes")
    return next((n for n in body["nodes"] if n["name"] == name and n["state"] == "up" and n["heartbeats"]), None)


async def _gone(rt, name: str) -> bool:  # type: ignore[no-untyped-def]
    _, body = await api(rt, "GET", "/admin/v1/nodes")
    return all(n["name"] != name for n in body["nodes"])


async def test_a_cordon_outlives_the_agents_restart(tmp_path: Path) -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        a = _agent(tmp_path, port, "node-1")
        try:
            await wait_for(lambda: _node(rt, "node-1"), what="node up")
            status, body = await api(rt, "POST", "/admin/v1/nodes/node-1/cordon")
            assert status == 200 and body["cordoned"]
            a.signal(signal.SIGTERM)  # deregisters: the node is gone...
            assert await a.wait() == 0
            await wait_for(lambda: _gone(rt, "node-1"), what="node removed")
            a = _agent(tmp_path, port, "node-1")  # ...and comes back cordoned
            node = await wait_for(lambda: _node(rt, "node-1"), what="node back")
            assert node["cordoned"] is True
        finally:
            a.stop()


async def test_a_kept_cordon_is_managed_while_the_node_is_away(tmp_path: Path) -> None:
    """Kept by name, a cordon can be cleared while its node is deregistered; a name with no
    node and no cordon is no node."""
    port = free_port()
    async with control_runtime(port) as rt:
        a = _agent(tmp_path, port, "node-2")
        try:
            await wait_for(lambda: _node(rt, "node-2"), what="node up")
            status, _ = await api(rt, "POST", "/admin/v1/nodes/node-2/cordon")
            assert status == 200
            a.signal(signal.SIGTERM)
            assert await a.wait() == 0

            await wait_for(lambda: _gone(rt, "node-2"), what="node removed")
            status, body = await api(rt, "POST", "/admin/v1/nodes/node-2/cordon")
            assert status == 200 and body == {"name": "node-2", "state": "absent", "cordoned": True, "changed": False}
            status, body = await api(rt, "POST", "/admin/v1/nodes/node-2/uncordon")
            assert status == 200 and body == {"name": "node-2", "state": "absent", "cordoned": False, "changed": True}
            status, body = await api(rt, "POST", "/admin/v1/nodes/node-2/uncordon")
            assert status == 404 and body["error"]["code"] == "node_not_found"  # (nothing kept now)
            status, body = await api(rt, "POST", "/admin/v1/nodes/never-seen/cordon")
            assert status == 404 and body["error"]["code"] == "node_not_found"
            a = _agent(tmp_path, port, "node-2")  # back, and not cordoned
            node = await wait_for(lambda: _node(rt, "node-2"), what="node back")
            assert node["cordoned"] is False
        finally:
            a.stop()


async def test_cordons_survive_the_control_planes_restart_in_its_database(tmp_path: Path) -> None:
    """The default database (an SQLite file beside control.state_file) keeps cordons; an older
    release's state file is imported into it once, when the database is created, and never written."""
    port, state = free_port(), tmp_path / "state" / "control.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"version": 1, "cordoned": ["node-9"]}))
    a = _agent(tmp_path, port, "node-2")
    try:
        async with control_runtime(port, state_file=str(state)) as rt:
            await wait_for(lambda: _node(rt, "node-2"), what="node up")
            assert (await api(rt, "POST", "/admin/v1/nodes/node-2/cordon"))[0] == 200
        assert json.loads(state.read_text()) == {"version": 1, "cordoned": ["node-9"]}  # (not written)
        db = state.parent / "deployments.sqlite3"
        with sqlite3.connect(db) as conn:
            assert sorted(r[0] for r in conn.execute("SELECT node FROM llmgw_cordons")) == ["node-2", "node-9"]
        assert db.stat().st_mode & 0o077 == 0
        state.write_text(json.dumps({"version": 1, "cordoned": ["node-8"]}))  # imported once only
        async with control_runtime(port, state_file=str(state)) as rt2:
            node = await wait_for(lambda: _node(rt2, "node-2"), timeout=15, what="agent re-registered")
            assert node["cordoned"] is True
            assert pick(await metrics(rt2), "llmgw_node_cordoned", node="node-2") == [1.0]
            assert (await api(rt2, "POST", "/admin/v1/nodes/node-2/uncordon"))[1]["cordoned"] is False
        with sqlite3.connect(db) as conn:
            assert sorted(r[0] for r in conn.execute("SELECT node FROM llmgw_cordons")) == ["node-9"]
    finally:
        a.stop()


async def test_a_second_control_plane_on_one_sqlite_file_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/cp.sqlite3"
    async with control_runtime(free_port(), database=url):
        with pytest.raises(StartupError, match=r"another llmgw serve uses .*postgresql://"):
            async with control_runtime(free_port(), database=url):
                pass


@pytest.mark.parametrize("content", ["{not json", '{"version": 99, "cordoned": []}', '{"version": 1, "cordoned": [1]}'])
async def test_a_bad_state_file_stops_the_start_with_its_name(tmp_path: Path, content: str) -> None:
    state = tmp_path / "control.json"
    state.write_text(content)
    with pytest.raises(ConfigError) as e:
        async with control_runtime(free_port(), state_file=str(state)):
            pass
    assert "control.state_file" in str(e.value) and str(state) in str(e.value)
    assert state.read_text() == content  # never overwritten


def test_a_canary_in_an_agents_log_is_a_leak(tmp_path: Path, canary_leaks: list[str]) -> None:
    """The agents' logs are watched too: a join token written there fails the test that ran the agent."""
    from canary import secret

    a = AgentProc(1, "leaky", tmp_path / "none.json", tmp_path / "leaky.log")
    (tmp_path / "leaky.log").write_text(f"refused: token {secret('join')} was wrong\n")
    a.stop()
    assert len(canary_leaks) == 1 and "agent leaky's log" in canary_leaks[0]
