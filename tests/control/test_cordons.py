"""Cordons are an operator's decision: kept by node name across the agent's restart and, with
``control.state_file``, across the control plane's; a file that cannot be saved changes nothing."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from cp_helpers import AgentProc, api, control_runtime, free_port, metrics, pick, wait_for
from scenario import h100s, write_scenario

from llmgw.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def _agent(tmp_path: Path, port: int, name: str) -> AgentProc:
    scenario = write_scenario(tmp_path / f"{name}.json", {"hostname": name, "gpus": h100s(1, name[-1])})
    return AgentProc(port, name, scenario, tmp_path / f"{name}.log").start()


async def _node(rt, name: str) -> dict | None:  # type: ignore[no-untyped-def]
    _, body = await api(rt, "GET", "/admin/v1/nodes")
    return next((n for n in body["nodes"] if n["name"] == name and n["state"] == "up" and n["heartbeats"]), None)


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
            async def gone() -> bool:
                _, body = await api(rt, "GET", "/admin/v1/nodes")
                return all(n["name"] != "node-1" for n in body["nodes"])

            await wait_for(gone, what="node removed")
            a = _agent(tmp_path, port, "node-1")  # ...and comes back cordoned
            node = await wait_for(lambda: _node(rt, "node-1"), what="node back")
            assert node["cordoned"] is True
        finally:
            a.stop()


async def test_with_a_state_file_cordons_survive_the_control_planes_restart(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "state" / "control.json"
    a = _agent(tmp_path, port, "node-2")
    try:
        async with control_runtime(port, state_file=str(state)) as rt:
            await wait_for(lambda: _node(rt, "node-2"), what="node up")
            assert (await api(rt, "POST", "/admin/v1/nodes/node-2/cordon"))[0] == 200
        assert json.loads(state.read_text()) == {"version": 1, "cordoned": ["node-2"]}
        # no temporary file left (the deployments' store lives beside the state file by default)
        assert sorted(p.name for p in state.parent.iterdir()) == ["control.json", "deployments.sqlite3"]
        async with control_runtime(port, state_file=str(state)) as rt2:
            node = await wait_for(lambda: _node(rt2, "node-2"), timeout=15, what="agent re-registered")
            assert node["cordoned"] is True
            assert pick(await metrics(rt2), "llmgw_node_cordoned", node="node-2") == [1.0]
            assert (await api(rt2, "POST", "/admin/v1/nodes/node-2/uncordon"))[1]["cordoned"] is False
        assert json.loads(state.read_text())["cordoned"] == []
    finally:
        a.stop()


async def test_a_state_file_that_cannot_be_saved_changes_nothing(tmp_path: Path) -> None:
    port = free_port()
    d = tmp_path / "state"
    a = _agent(tmp_path, port, "node-3")
    try:
        async with control_runtime(port, state_file=str(d / "control.json"), database="sqlite::memory:") as rt:
            await wait_for(lambda: _node(rt, "node-3"), what="node up")
            d.write_text("a file where the state file's directory was\n")  # the disk went away under us
            status, body = await api(rt, "POST", "/admin/v1/nodes/node-3/cordon")
            assert status == 500 and body["error"]["code"] == "state_not_saved"
            assert "left uncordoned" in body["error"]["message"]
            node = await _node(rt, "node-3")
            assert node is not None and node["cordoned"] is False
    finally:
        a.stop()


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
