"""Join tokens made through the management API, on two real ``llmgw serve`` control planes and one real
PostgreSQL, with agents as real processes.

A token made on the leader (the secret in that one answer only) lets an agent join; the standby
lists it too (never the secret, nor its digest) and refuses to make one (503 ``not_leader``).
Revoked on the leader, the agent that joined with it is refused at its next heartbeat (its run
ends, the message names the token); after the leader's ``kill -9`` the new leader refuses the
revoked token at registration while the config file's token still joins. The secret is in no
log. Lease 2 s, heartbeats every 0.2 s; every wait is bounded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cp_helpers import TOKEN, AgentProc
from scenario import h100s, write_scenario
from serve_helpers import Serve, gauge, the_leader, wait_until

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

LEASE = 2.0


def _agent(tmp_path: Path, name: str, control: str, token: str) -> AgentProc:
    scenario = write_scenario(tmp_path / f"{name}.json", {"hostname": f"host-{name}", "source": "nvml",
                                                          "gpus": h100s(1, name[-1])})
    return AgentProc(control, name, scenario, tmp_path / f"{name}.log", token=token).start()


async def _up(p: Serve, name: str) -> bool:
    try:
        status, _, body = await p.api("GET", "/admin/v1/nodes")
    except OSError:
        return False
    return status == 200 and any(n["name"] == name and n["state"] == "up" for n in body["nodes"])


async def _names(p: Serve, leader: Serve) -> bool:
    """``p`` answers as a standby that knows the leader (it read the lease row)."""
    try:
        status, _, ready = await p.api("GET", "/ready")
    except OSError:
        return False
    return status == 503 and (ready.get("leader") or {}).get("admin") == f"http://127.0.0.1:{leader.admin}"


async def _listed(p: Serve) -> dict[str, Any]:
    status, _, body = await p.api("GET", "/admin/v1/join-tokens")
    assert status == 200, body
    return {t["id"]: t for t in body["tokens"]}


async def test_made_listed_revoked_everywhere_and_refused_after_a_takeover(tmp_path: Path, pg_dsn: str) -> None:
    procs = [Serve(tmp_path, f"cp{i}", pg_dsn, TOKEN, lease=LEASE).start() for i in range(2)]
    agents: list[AgentProc] = []
    try:
        leader = await the_leader(procs, 30)
        standby = next(p for p in procs if p is not leader)
        await wait_until(lambda: _names(standby, leader), 30, "the standby naming the leader")
        control = f"{leader.address},{standby.address}"

        status, headers, err = await standby.api("POST", "/admin/v1/join-tokens", {"name": "rack-1"})
        assert status == 503 and err["error"]["code"] == "not_leader"
        assert headers["llmgw-leader"] == f"http://127.0.0.1:{leader.admin}"
        status, _, err = await leader.api("POST", "/admin/v1/join-tokens", {"expires": "soon"})
        assert status == 400 and err["error"]["param"] == "expires"

        status, _, made = await leader.api("POST", "/admin/v1/join-tokens", {"name": "rack-1", "expires": "1h"})
        assert status == 201, made
        secret, tid = made["token"], made["id"]
        assert secret.startswith(f"llmgw-join-{tid}-") and len(secret) > 50
        assert made["state"] == "active" and made["name"] == "rack-1" and made["last_used_at"] is None
        assert 3590 < made["expires_at"] - made["created_at"] <= 3600

        # listed on both (the standby reads the database), never with the secret or its digest
        for p in (leader, standby):
            listed = await _listed(p)
            assert set(listed[tid]) == {"id", "name", "state", "created_at", "expires_at", "revoked_at",
                                        "last_used_at"}
            assert secret not in str(listed) and listed[tid]["state"] == "active"

        # an agent joins with it, another with the config file's token
        agents.append(_agent(tmp_path, "node-1", control, secret))
        agents.append(_agent(tmp_path, "node-2", control, TOKEN))
        await wait_until(lambda: _up(leader, "node-1"), 20, "node-1 (API token) up on the leader")
        await wait_until(lambda: _up(leader, "node-2"), 20, "node-2 (config token) up on the leader")

        # revoked (on the standby: refused, nothing changes), then on the leader
        status, _, err = await standby.api("DELETE", f"/admin/v1/join-tokens/{tid}")
        assert status == 503 and err["error"]["code"] == "not_leader"
        status, _, gone = await leader.api("DELETE", f"/admin/v1/join-tokens/{tid}")
        assert status == 200 and gone["changed"] is True and gone["state"] == "revoked"
        assert gone["nodes"] == ["node-1"] and gone["last_used_at"] is not None
        status, _, again = await leader.api("DELETE", f"/admin/v1/join-tokens/{tid}")
        assert status == 200 and again["changed"] is False
        status, _, err = await leader.api("DELETE", "/admin/v1/join-tokens/00000000")
        assert status == 404 and err["error"]["code"] == "token_not_found"

        # the agent with it is refused at its next heartbeat: its run ends, saying why
        rc = await agents[0].wait(10)
        assert rc != 0
        assert f"join token {tid} (rack-1) is revoked" in agents[0].stderr()
        text = await leader.metrics()
        assert text is not None and 'llmgw_control_joins_refused_total{reason="revoked_token"}' in text
        assert await _up(leader, "node-2")  # the config file's token keeps working
        assert (await _listed(standby))[tid]["state"] == "revoked"

        # a takeover: the new leader refuses the revoked token at registration, still takes the config one
        leader.kill()
        new = await the_leader([standby], 10 * LEASE)
        late = _agent(tmp_path, "node-3", new.address, secret)
        agents.append(late)
        assert await late.wait(15) != 0
        assert "revoked" in late.stderr()
        await wait_until(lambda: _up(new, "node-2"), 20, "node-2 on the new leader")
        listed = await _listed(new)
        assert listed[tid]["state"] == "revoked"
        assert gauge(await new.metrics() or "", "llmgw_control_leader") == 1.0

        for p in procs:
            assert secret not in p.stderr(), f"{p.name} logged a join token"
        for a in agents:
            assert secret not in a.stderr(), f"agent {a.name} logged a join token"
    finally:
        for a in agents:
            a.stop()
        for p in procs:
            p.stop()
