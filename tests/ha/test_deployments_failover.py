"""Deployments across a failover: two real ``llmgw serve`` control planes on one real PostgreSQL, two
real ``llmgw agent`` processes running a deployment's replicas on the vLLM stand-in engine.

A router (``llmgw serve`` with ``follow:``, the other branch's) follows both control planes
and carries a client's requests all along: none fails.

A deployment created just before ``kill -9`` of the leader exists after it; a ``ctl scale`` in
flight is either answered (then it holds) or not (then the new leader may or may not have it, never
half of it); the standby leads within the lease, hands every node the same replicas again (each
replica id is launched once in all: counted in the engines' logs on the agents), and the replicas
keep serving: through the new leader's router too. Lease 2 s, heartbeats every 0.2 s; every wait
is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from cp_helpers import TOKEN
from serve_helpers import ROUTER_TOKEN_ENV, TOKEN_ENV, Router, Serve, http, the_leader, wait_until

from llmgw.testing import standins

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

LEASE = 2.0


ROUTER_TOKEN = "router-token-for-the-failover-test"


async def _ok(port: int, model: str) -> bool:
    return await _chat(port, model) == 200


class Load:
    """A client sending requests through the router without pause (two at a time) until stopped."""

    def __init__(self, port: int, model: str) -> None:
        self.port, self.model = port, model
        self.ok = 0
        self.failed: list[int] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.ensure_future(self._run()) for _ in range(2)]

    async def _run(self) -> None:
        while not self._stop.is_set():
            status = await _chat(self.port, self.model)
            if status == 200:
                self.ok += 1
            else:
                self.failed.append(status)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 30)

    def cancel(self) -> None:
        """(A test that failed before ``stop``: the clients go with it, not on into the teardown.)"""
        for t in self._tasks:
            t.cancel()


class Agent:
    """``llmgw agent`` with replicas (the stand-in engines first on PATH), following both control planes."""

    def __init__(self, tmp: Path, name: str, control: str, env: dict[str, str]) -> None:
        self.name, self.state = name, tmp / name
        self.log = tmp / f"{name}.log"
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "agent", "--control", control, "--token-env", TOKEN_ENV,
                 "--name", name, "--gpu-source", "simulated", "--state-dir", str(self.state)],
                env={**os.environ, **env, TOKEN_ENV: TOKEN}, stdout=subprocess.DEVNULL, stderr=err,
            )

    def launches(self) -> dict[str, int]:
        """Replica id -> how many times an engine was started for it on this node (the supervisor's
        ``starting`` line in each replica's log, rotated files too)."""
        out: dict[str, int] = {}
        for f in self.state.rglob("*.log*"):
            for m in re.finditer(r"^--- llmgw \S+: starting (\S+):", f.read_text(errors="replace"), re.M):
                out[m.group(1)] = out.get(m.group(1), 0) + 1
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def _deployment(p: Serve, name: str) -> dict[str, Any] | None:
    try:
        status, _, body = await p.api("GET", f"/admin/v1/deployments/{name}?show_secrets=1")
    except (OSError, asyncio.TimeoutError):
        return None
    return body if status == 200 else None


async def _ready(p: Serve, name: str, n: int) -> dict[str, Any] | None:
    d = await _deployment(p, name)
    return d if d is not None and d["desired"] == n and d["ready"] == n and d["placed"] == n else None


async def _chat(port: int, model: str, key: str | None = None) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    try:
        status, _, _ = await http(port, "POST", "/v1/chat/completions", 10.0, body, headers=auth)
    except (OSError, asyncio.TimeoutError):
        return 0
    return status


async def _standby_unavailable(p: Serve, model: str) -> bool:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        status, _, raw = await http(p.gateway, "POST", "/v1/chat/completions", 10.0, body)
    except (OSError, asyncio.TimeoutError):
        return False
    err = orjson.loads(raw)
    return status == 503 and err["error"]["code"] == "model_unavailable" and "standby" in err["error"]["message"]


async def _gateway_up(p: Serve) -> bool:
    try:
        status, _, _ = await http(p.admin, "GET", "/health", 2.0)
    except (OSError, asyncio.TimeoutError):
        return False
    return status == 200


async def _no_replicas(p: Serve) -> bool:
    """Whether ``p``'s own router has no replica of a deployment (it has no static endpoints)."""
    try:
        status, _, body = await p.api("GET", "/admin/v1/endpoints")
    except (OSError, asyncio.TimeoutError):
        return False
    return status == 200 and body["endpoints"] == []


async def test_kill_the_leader_while_scaling_nothing_is_lost_and_no_replica_launched_twice(
    tmp_path: Path, pg_dsn: str
) -> None:
    bin_dir = standins.install(tmp_path / "bin")
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(p for p in (str(standins.PYTHONPATH), os.environ.get("PYTHONPATH", "")) if p),
           "LLMGW_MIRROR": str(tmp_path / "mirror")}
    env[ROUTER_TOKEN_ENV] = ROUTER_TOKEN
    procs = [Serve(tmp_path, f"cp{i}", pg_dsn, TOKEN, lease=LEASE, env=env, router_token_env=ROUTER_TOKEN_ENV).start()
             for i in range(2)]
    agents: list[Agent] = []
    router: Router | None = None
    load: Load | None = None
    try:
        leader = await the_leader(procs, 30)
        standby = next(p for p in procs if p is not leader)
        control = f"{standby.address},{leader.address}"
        agents = [Agent(tmp_path, f"node-{i}", control, env) for i in (1, 2)]

        async def both_up() -> bool:
            status, _, body = await leader.api("GET", "/admin/v1/nodes")
            return status == 200 and len([n for n in body["nodes"] if n["state"] == "up"]) == 2

        await wait_until(both_up, 30, "both agents on the leader")
        spec = {"model": "stand-in/chat", "engine": "vllm", "gpu_memory": "1GiB"}
        status, _, d = await leader.api("POST", "/admin/v1/deployments", {"name": "chat", "replicas": 2, **spec})
        assert status == 201, d
        before = await wait_until(lambda: _ready(leader, "chat", 2), 60, "chat's two replicas ready")
        ports = {r["id"]: r["port"] for r in before["replicas"]}
        assert await _chat(leader.gateway, "chat") == 200
        router = Router(tmp_path, [standby.address, leader.address], ROUTER_TOKEN, env)
        await wait_until(lambda: _ok(router.port, "chat"), 30, "the router routing chat")
        load = Load(router.port, "chat")
        # a standby's own client port routes to no deployment's replicas: their models are unavailable
        # there (503, retry), not unknown (404); a model nobody serves is still 404
        await wait_until(lambda: _standby_unavailable(standby, "chat"), LEASE * 2, "the standby answering chat 503")
        assert await _chat(standby.gateway, "nope") == 404
        # a standby holds no deployments: it names the leader
        status, headers, err = await standby.api("POST", "/admin/v1/deployments/chat/scale", {"replicas": 1})
        assert status == 503 and err["error"]["code"] == "not_leader"
        assert headers["llmgw-leader"] == f"http://127.0.0.1:{leader.admin}"

        # just before the kill: a deployment created (answered: it is in the database) and a scale in flight
        status, _, d = await leader.api("POST", "/admin/v1/deployments", {"name": "late", "replicas": 1, **spec,
                                                                           "served_name": "late"})
        assert status == 201, d
        scale = asyncio.ensure_future(leader.api("POST", "/admin/v1/deployments/chat/scale", {"replicas": 3}))
        await asyncio.sleep(0.02)  # (sent; the answer may or may not come before the kill)
        killed_at = time.monotonic()
        leader.kill()
        answered: int | None = None
        with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError):
            answered = (await scale)[0]

        await wait_until(standby.leading, LEASE * 3, "the standby leading")
        assert time.monotonic() - killed_at <= LEASE + 1.0
        # everything on the new leader: late exists (and runs), chat at 3 when the scale was answered
        late = await wait_until(lambda: _ready(standby, "late", 1), 60, "late ready on the new leader")
        chat = await _deployment(standby, "chat")
        assert chat is not None
        want = 3 if answered == 200 else chat["desired"]
        assert want in (2, 3)
        chat = await wait_until(lambda: _ready(standby, "chat", want), 60, f"chat at {want} on the new leader")
        await load.stop()
        assert load.failed == [] and load.ok > 0, (load.ok, load.failed)  # not one request failed through it
        # the router follows the new leader: late (made just before the kill) is served through it too
        await wait_until(lambda: _ok(router.port, "late"), 30, "the router serving late")
        # the replicas that ran before the kill run on, the same engines (same ports: no relaunch)
        now = {r["id"]: r["port"] for r in chat["replicas"]}
        assert {rid: now.get(rid) for rid in ports} == ports
        # each replica id launched once, on one node, in all
        counts: dict[str, int] = {}
        for a in agents:
            for rid, n in a.launches().items():
                counts[rid] = counts.get(rid, 0) + n
        ids = {r["id"] for r in chat["replicas"]} | {r["id"] for r in late["replicas"]}
        assert ids <= set(counts) and all(n == 1 for n in counts.values()), counts
        # serving through the new leader's router, and straight from a replica (its key)
        assert await _chat(standby.gateway, "chat") == 200 and await _chat(standby.gateway, "late") == 200
        r0 = chat["replicas"][0]
        assert await _chat(r0["port"], "chat", r0["api_key"]) == 200

        conn = await asyncpg.connect(pg_dsn)
        try:
            rows = await conn.fetch("SELECT id, epoch FROM llmgw_replicas ORDER BY id")
            assert {r["id"] for r in rows} == ids
            assert await conn.fetchval("SELECT count(*) FROM llmgw_deployments") == 2
            # the join token's digest, never the token (written at the first election only: unchanged since)
            tokens = await conn.fetch("SELECT sha256, epoch FROM llmgw_join_tokens")
            assert [(r["sha256"], r["epoch"]) for r in tokens] == [(hashlib.sha256(TOKEN.encode()).hexdigest(), 1)]
        finally:
            await conn.close()
        assert "Traceback" not in standby.stderr(), standby.stderr()[-3000:]

        # the killed process back (a standby); the leader paused past its lease: the other one leads,
        # and the paused one, resumed, steps down; a lease later its own data path routes to none of
        # its last term's replicas (as a standby that never led), not to a copy frozen at that term
        leader.start()
        await wait_until(lambda: _gateway_up(leader), 30, "the restarted process answering")
        standby.signal(signal.SIGSTOP)
        await wait_until(leader.leading, LEASE * 4, "the restarted process leading")
        standby.signal(signal.SIGCONT)
        await wait_until(lambda: _no_replicas(standby), LEASE * 4, "the stepped-down process dropping its replicas")
        assert "stops routing to the" in standby.stderr()
        assert await _standby_unavailable(standby, "late")
        await wait_until(lambda: _ready(leader, "chat", want), 60, f"chat at {want} on the leader again")
        assert await _chat(leader.gateway, "chat") == 200
    finally:
        if load is not None:
            load.cancel()
        if router is not None:
            router.stop()
        for a in agents:
            a.stop()
        for p in procs:
            p.stop()
