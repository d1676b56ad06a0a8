"""A node the database knows does not vanish when the control plane restarts without it.

A real control plane (its default SQLite database beside ``control.state_file``), a real agent process
over gRPC, killed with SIGKILL (no deregistration) while the control plane is down. Restarted, the
control plane lists the node ``unhealthy`` with its heartbeat times absent (never heard from in this
term: ``null``, not 0), its GPUs by UUID with no readings, ``llmgw_node_up 0`` on /metrics and no
heartbeat timestamp; ``llmgw ctl forget`` removes it, for good. An agent that does come back registers
as the known node it is.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from cp_helpers import AgentProc, api, control_runtime, free_port, metrics, metrics_text, pick, wait_for
from scenario import h100s, write_scenario

pytestmark = pytest.mark.timeout(90)


def _agent(tmp_path: Path, port: int, name: str) -> AgentProc:
    scenario = write_scenario(tmp_path / f"{name}.json", {"hostname": f"host-{name}", "gpus": h100s(2, name[-1])})
    return AgentProc(port, name, scenario, tmp_path / f"{name}.log").start()


async def _nodes(rt) -> dict[str, dict]:  # type: ignore[no-untyped-def]
    status, body = await api(rt, "GET", "/admin/v1/nodes")
    assert status == 200
    return {n["name"]: n for n in body["nodes"]}


async def _up(rt, name: str) -> bool:  # type: ignore[no-untyped-def]
    n = (await _nodes(rt)).get(name)
    return n is not None and n["state"] == "up" and n["heartbeats"] > 0


async def test_a_node_whose_agent_died_with_the_control_plane_is_listed_unhealthy_and_can_be_forgotten(
    tmp_path: Path,
) -> None:
    port, state = free_port(), tmp_path / "state" / "control.json"
    state.parent.mkdir()
    dead, back = _agent(tmp_path, port, "node-d"), _agent(tmp_path, port, "node-b")
    try:
        async with control_runtime(port, state_file=str(state)) as rt:
            await wait_for(lambda: _up(rt, "node-d"), 20, "node-d up")
            await wait_for(lambda: _up(rt, "node-b"), 20, "node-b up")
            uuids = [g["uuid"] for g in (await api(rt, "GET", "/admin/v1/nodes/node-d"))[1]["gpus"]]
            dead.stop()  # SIGKILL: no deregistration
        back.stop()
        back = _agent(tmp_path, port, "node-b")  # (started before the control plane: it retries)

        async with control_runtime(port, state_file=str(state)) as rt:
            await wait_for(lambda: _up(rt, "node-b"), 20, "node-b registered again")
            nodes = await _nodes(rt)
            assert set(nodes) == {"node-d", "node-b"}
            d = nodes["node-d"]
            assert d["state"] == "unhealthy" and d["hostname"] == "host-node-d"
            assert d["last_heartbeat"] is None and d["heartbeat_age_s"] is None and d["registered_at"] is None
            assert d["heartbeats"] == 0 and d["gpu_count"] == 2
            # what its agent has not said is not known: no GPU source ("none" is a node without GPUs), no protocol
            assert d["gpu_source"] is None and d["protocol"] is None, d
            assert any("not heard from since this control plane took over" in e for e in d["errors"])
            status, one = await api(rt, "GET", "/admin/v1/nodes/node-d")
            assert status == 200 and [g["uuid"] for g in one["gpus"]] == uuids
            for g in one["gpus"]:  # no readings: absent, never 0
                assert g["memory_total_bytes"] is None and g["utilization_gpu_ratio"] is None, g
            # the one that came back is the known node again (re-registered, not new)
            b = nodes["node-b"]
            assert b["registrations"] == 1 and b["last_heartbeat"] is not None
            m = await metrics(rt)
            assert pick(m, "llmgw_node_up", node="node-d") == [0.0]
            assert pick(m, "llmgw_node_up", node="node-b") == [1.0]
            assert pick(m, "llmgw_node_last_heartbeat_timestamp_seconds", node="node-d") == []
            assert pick(m, "llmgw_node_heartbeat_age_seconds", node="node-d") == []
            assert pick(m, "llmgw_gpu_memory_used_bytes", node="node-d") == []
            text = await metrics_text(rt)
            assert 'llmgw_node_up{node="node-d"} 0.0' in text
            info = [ln for ln in text.splitlines() if ln.startswith('llmgw_node_info{node="node-d"')]
            assert len(info) == 1 and 'gpu_source=""' in info[0], info

            # llmgw ctl forget, as an operator runs it
            admin = rt.admin.listeners.admin.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            proc = await asyncio.create_subprocess_exec(  # (the control plane runs on this loop)
                sys.executable, "-m", "llmgw", "ctl", "--admin", f"http://127.0.0.1:{admin}", "forget", "node-d",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=os.environ.copy(),
            )
            out, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0, err
            assert b"node-d" in out
            assert set(await _nodes(rt)) == {"node-b"}

        async with control_runtime(port, state_file=str(state)) as rt:  # forgotten for good
            await wait_for(lambda: _up(rt, "node-b"), 20, "node-b registered again")
            assert set(await _nodes(rt)) == {"node-b"}
    finally:
        dead.stop()
        back.stop()
