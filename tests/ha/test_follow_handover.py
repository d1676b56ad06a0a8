"""A router (``llmgw serve`` with ``follow:``) across a handover of real control planes on a real PostgreSQL.

**Paused leader.** A leader paused with SIGSTOP (a frozen VM, a host cut off without a reset) keeps its
TCP connections and ends no stream, and the table's stream is silent while nothing changes: the router
stayed on it (on a table nobody updated) until it resumed; gRPC's keepalive did not end the stream. Now
the control plane writes a keepalive every 3 s (protocol 1.2) and the router leaves one silent for 9 s.

**Handover.**
The router had to wait for its first control plane (its rounds backed off to the longest wait meanwhile);
once it follows one, a SIGTERM of that leader (a clean handover: the standby leads within a campaign
period) must find the router on the new leader within about a second, not after the longest wait of
the rounds before it ever connected (the leader's stream ends with an error, not EOF: the backoff was
reset only on EOF, so the router came back 2.5-5 s late).

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
from cp_helpers import TOKEN
from serve_helpers import ROUTER_TOKEN_ENV, Router, Serve, the_leader, wait_until

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

LEASE = 1.5
ROUTER_TOKEN = "router-token-for-the-handover-test"


async def test_router_follows_the_next_leader_at_once_after_a_handover(tmp_path: Path, pg_dsn: str) -> None:
    env = {ROUTER_TOKEN_ENV: ROUTER_TOKEN}
    procs = [Serve(tmp_path, f"cp{i}", pg_dsn, TOKEN, lease=LEASE, env=env, router_token_env=ROUTER_TOKEN_ENV)
             for i in range(2)]
    router = Router(tmp_path, [p.address for p in procs], ROUTER_TOKEN)
    try:
        # no control plane yet: the router's rounds back off (0.1 s doubling, 5 s at most) meanwhile
        await asyncio.sleep(7.0)
        for p in procs:
            p.start()
        leader = await the_leader(procs, 30)
        standby = next(p for p in procs if p is not leader)
        await wait_until(lambda: _follows(router, leader.address), 20, "the router following the leader")

        killed = time.monotonic()
        leader.stop()  # SIGTERM: the lease is released, the standby leads within a campaign period
        await wait_until(standby.leading, LEASE * 2, "the standby leading")
        led = time.monotonic() - killed
        await wait_until(lambda: _follows(router, standby.address), 10, "the router following the new leader")
        took = time.monotonic() - killed
        assert took < 2.2, (f"the router followed the new leader {took:.2f}s after the handover (it led after "
                            f"{led:.2f}s)\n{router.log.read_text(errors='replace')[-3000:]}")
    finally:
        router.stop()
        for p in procs:
            p.stop()


async def _follows(router: Router, address: str) -> bool:
    return await router.following() == address



async def test_router_leaves_a_paused_leader_for_the_next(tmp_path: Path, pg_dsn: str) -> None:
    env = {ROUTER_TOKEN_ENV: ROUTER_TOKEN}
    procs = [Serve(tmp_path, f"cp{i}", pg_dsn, TOKEN, lease=LEASE, env=env, router_token_env=ROUTER_TOKEN_ENV).start()
             for i in range(2)]
    router: Router | None = None
    try:
        leader = await the_leader(procs, 30)
        standby = next(p for p in procs if p is not leader)
        router = Router(tmp_path, [p.address for p in procs], ROUTER_TOKEN)
        await wait_until(lambda: _follows(router, leader.address), 20, "the router following the leader")
        await asyncio.sleep(4.0)  # (a keepalive or more came: a live leader with nothing new is followed on)
        assert await router.following() == leader.address
        paused = time.monotonic()
        leader.signal(signal.SIGSTOP)
        await wait_until(standby.leading, LEASE * 3, "the standby leading")
        await wait_until(lambda: _follows(router, standby.address), 20, "the router following the new leader")
        took = time.monotonic() - paused
        assert took < 12.0, f"the router left the paused leader after {took:.1f}s"
        assert "paused, or cut off" in router.log.read_text(errors="replace")
    finally:
        if router is not None:
            router.stop()
        for p in procs:
            p.stop()
