"""HA end to end: real ``llmgw serve`` processes on one real PostgreSQL, agents as real processes.

Lease 2 s, heartbeats every 0.2 s; every wait is bounded.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import asyncpg
import pytest
from cp_helpers import TOKEN, AgentProc
from scenario import h100s, write_scenario
from serve_helpers import Serve, http, the_leader, wait_until

from canary import check_text

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

LEASE = 2.0


def _agent(tmp_path: Path, name: str, control: str) -> AgentProc:
    scenario = write_scenario(tmp_path / f"{name}.json", {"hostname": f"host-{name}", "source": "nvml",
                                                          "gpus": h100s(1, name[-1])})
    return AgentProc(control, name, scenario, tmp_path / f"{name}.log").start()


async def _nodes_up(p: Serve, names: set[str]) -> bool:
    try:
        status, _, body = await p.api("GET", "/admin/v1/nodes")
    except OSError:
        return False
    return status == 200 and {n["name"] for n in body["nodes"] if n["state"] == "up"} >= names


async def test_kill_the_leader_a_standby_takes_over_and_nothing_is_lost(tmp_path: Path, pg_dsn: str) -> None:
    procs = [Serve(tmp_path, f"cp{i}", pg_dsn, TOKEN, lease=LEASE).start() for i in range(2)]
    agents: list[AgentProc] = []
    try:
        leader = await the_leader(procs, 30)
        standby = next(p for p in procs if p is not leader)
        # the agents are given both addresses, the standby's first: it sends them to the leader
        control = f"{standby.address},{leader.address}"
        agents = [_agent(tmp_path, f"node-{i}", control) for i in (1, 2)]
        await wait_until(lambda: _nodes_up(leader, {"node-1", "node-2"}), 20, "both agents on the leader")

        # a standby: /ready says so and names the leader; the management API answers 503 naming it
        status, _, ready = await standby.api("GET", "/ready")
        assert status == 503 and ready["reason"] == "standby"
        assert (await standby.api("GET", "/ready?role=control"))[0] == 503  # (the management API's probe)
        assert (await leader.api("GET", "/ready?role=control"))[0] == 200
        assert ready["leader"]["admin"] == f"http://127.0.0.1:{leader.admin}" and ready["leader"]["grpc"] == leader.address
        status, headers, err = await standby.api("POST", "/admin/v1/nodes/node-1/cordon")
        assert status == 503 and err["error"]["code"] == "not_leader"
        assert headers["llmgw-leader"] == f"http://127.0.0.1:{leader.admin}"
        assert (await standby.api("GET", "/health"))[0] == 200
        # a standby's node map is not the cluster's: no node counts, no table version (absent, not 0)
        said = await standby.metrics()
        assert said is not None and 'llmgw_control_nodes{state="up"}' not in said, said
        assert "\nllmgw_control_replica_table_version " not in said
        said = await leader.metrics()
        assert said is not None and 'llmgw_control_nodes{state="up"} 2.0' in said
        assert "\nllmgw_control_replica_table_version " in said
        epoch = await leader.epoch()
        assert epoch is not None and await standby.epoch() == epoch

        # a cordon made just before the kill survives it (in the database, fenced)
        status, _, view = await leader.api("POST", "/admin/v1/nodes/node-1/cordon")
        assert status == 200 and view["cordoned"] is True
        killed_at = time.monotonic()
        leader.kill()
        await wait_until(standby.leading, LEASE * 3, "the standby leading")
        took = time.monotonic() - killed_at
        assert took <= LEASE + 1.0, took  # within the lease of the last renew, plus scheduling slack
        assert await standby.epoch() == epoch + 1
        led_at = time.monotonic()
        await wait_until(lambda: _nodes_up(standby, {"node-1", "node-2"}), 5, "the agents following the new leader")
        assert time.monotonic() - led_at < 5
        status, _, node = await standby.api("GET", "/admin/v1/nodes/node-1")
        assert status == 200 and node["cordoned"] is True and node["registrations"] >= 1
        status, _, nodes = await standby.api("GET", "/admin/v1/nodes")
        assert sorted(n["name"] for n in nodes["nodes"]) == ["node-1", "node-2"]  # re-registration: no duplicate
        conn = await asyncpg.connect(pg_dsn)
        try:
            assert await conn.fetchval("SELECT count(*) FROM llmgw_nodes") == 2
            assert [r[0] for r in await conn.fetch("SELECT node FROM llmgw_cordons")] == ["node-1"]
        finally:
            await conn.close()

        # the killed one comes back as a standby and keeps campaigning (no zombie)
        leader.start()
        await wait_until(lambda: _ready_standby(leader), 20, "the restarted process as a standby")
        assert await the_leader(procs, 5) is standby
    finally:
        for a in agents:
            a.stop()
        for p in procs:
            p.stop()
    for p in procs:
        check_text(f"{p.name}'s log", p.stderr())


async def _ready_standby(p: Serve) -> bool:
    try:
        status, _, body = await p.api("GET", "/ready")
    except OSError:
        return False
    return status == 503 and body.get("reason") == "standby"


async def test_a_paused_leader_acts_on_nothing_when_it_resumes(tmp_path: Path, pg_dsn: str) -> None:
    procs = [Serve(tmp_path, f"cp{i}", pg_dsn, TOKEN, lease=LEASE).start() for i in range(2)]
    agents: list[AgentProc] = []
    try:
        leader = await the_leader(procs, 30)
        standby = next(p for p in procs if p is not leader)
        agents = [_agent(tmp_path, "node-1", f"{leader.address},{standby.address}")]
        await wait_until(lambda: _nodes_up(leader, {"node-1"}), 20, "the agent on the leader")
        epoch = await leader.epoch()
        assert epoch is not None

        leader.signal(signal.SIGSTOP)
        # a cordon sent to the paused leader: the kernel takes the connection, nothing answers yet
        import asyncio

        pending = asyncio.create_task(http(leader.admin, "POST", "/admin/v1/nodes/node-1/cordon", timeout=30))
        await wait_until(standby.leading, LEASE * 6, "the standby leading")  # (a lease, and a loaded machine's slack)
        assert await standby.epoch() == epoch + 1
        # the agent notices the silence of the paused leader's stream and follows the new one
        await wait_until(lambda: _nodes_up(standby, {"node-1"}), 10, "the agent on the new leader")
        leader.signal(signal.SIGCONT)
        status, _, body = await pending
        assert status == 503 and b"not_leader" in body, body
        await wait_until(lambda: _ready_standby(leader), 10, "the resumed process a standby")
        assert await leader.leading() is False
        text = await leader.metrics()
        assert text is not None and "llmgw_control_leader_step_downs_total 1.0" in text
        status, _, node = await standby.api("GET", "/admin/v1/nodes/node-1")
        assert status == 200 and node["cordoned"] is False
        conn = await asyncpg.connect(pg_dsn)
        try:
            assert await conn.fetchval("SELECT count(*) FROM llmgw_cordons") == 0
            assert await conn.fetchval("SELECT epoch FROM llmgw_lease") == epoch + 1
        finally:
            await conn.close()
    finally:
        for a in agents:
            a.stop()
        for p in procs:
            p.stop()
    for p in procs:
        check_text(f"{p.name}'s log", p.stderr())


async def test_a_leader_cut_off_from_its_database_tells_clients_it_no_longer_leads(
    tmp_path: Path, postgres_server: object
) -> None:
    """The database goes away under the leader: it steps down at its lease. Its gateway said of a deployed model
    "its deployment has no ready replica (scaled to 0, or its replicas are starting)" for as long as the
    outage lasted (a standby's words are read from the database); it says what it is now: a standby."""
    import asyncio

    import orjson

    from llmgw.testing.postgres import PostgresServer

    pg = PostgresServer().start()  # (its own: this test stops it; the session's serves the others)
    p = Serve(tmp_path, "cp", pg.dsn, TOKEN, lease=LEASE)
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def answer() -> tuple[int, str]:
        status, _, raw = await http(p.gateway, "POST", "/v1/chat/completions", 10.0, body)
        err = orjson.loads(raw)["error"]
        return status, f"{err['code']}: {err['message']}"

    try:
        p.start()
        await the_leader([p], 30)
        status, _, made = await p.api("POST", "/admin/v1/deployments",
                                      {"name": "chat", "model": "stand-in/chat", "engine": "vllm"})
        assert status in (200, 201), made
        status, said = await answer()  # (no node: nothing can be placed)
        assert status == 503 and said.startswith("model_unavailable") and "placed" in said, said
        pg.stop()
        await wait_until(lambda: _ready_standby(p), LEASE * 5, "the leader stepping down")
        status, _, ready = await p.api("GET", "/ready")  # (why no leader is known: the database's error)
        assert status == 503 and ready.get("database_error"), ready
        for _ in range(100):  # (bounded: the term's controller stops on the loop)
            status, said = await answer()
            if "standby" in said:
                break
            await asyncio.sleep(0.05)
        assert status == 503 and said.startswith("model_unavailable") and "standby control plane" in said, said
        # listed as the model it is (a POST says it exists), not missing from the standby's list
        status, _, raw = await http(p.gateway, "GET", "/v1/models", 10.0, None)
        assert status == 200 and [c["id"] for c in orjson.loads(raw)["data"]] == ["chat"], raw
    finally:
        p.stop()
        pg.stop()
