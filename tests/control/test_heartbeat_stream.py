"""Heartbeats on a stream (protocol 1.1), and the older peers that only know Heartbeat calls.

Real agents (:class:`AgentClient`) against a real control plane over gRPC on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from cp_helpers import (
    INTERVAL,
    TOKEN,
    control_config,
    control_plane,
    control_runtime,
    free_port,
    metrics,
    pick,
    running,
    wait_for,
)
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.client import AgentClient, AgentRefused
from llmgw.agent.model import Discovery
from llmgw.control.nodes import NodeMap
from llmgw.control.service import AgentService, ControlStats

pytestmark = pytest.mark.timeout(60)


class Source:
    def __init__(self, host: str) -> None:
        self.d = discovery_of({"hostname": host, "gpus": h100s(1, host[-1])})

    def read(self) -> Discovery:
        return self.d

    def close(self) -> None:
        pass


async def test_agents_heartbeat_on_one_stream_each() -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        cp = control_plane(rt)
        a = AgentClient(f"127.0.0.1:{port}", "node-s", TOKEN, Source("host-s"), rng=None)
        async with running(a):
            await wait_for(lambda: a.heartbeats >= 3, what="three beats")
            assert a.streaming and cp.stats.streams_open == 1
            assert pick(await metrics(rt), "llmgw_control_heartbeat_streams") == [1.0]
            # recorded on the main loop within control.thread.HOP_DELAY of arriving
            await wait_for(lambda: (n := cp.nodes.get("node-s")) is not None and n.heartbeats >= 3,
                           what="three beats recorded")
            st = cp.nodes.get("node-s")
            assert st is not None and cp.nodes.state(st) == "up"
            # the stream's answers carry the cordon like a Heartbeat call's
            await cp.set_cordoned("node-s", True)
            await wait_for(lambda: a.cordoned, what="the cordon reaching the agent")
        await wait_for(lambda: cp.stats.streams_open == 0, what="the stream closed")
        assert cp.nodes.get("node-s") is None  # deregistered on stop


async def test_an_older_agent_heartbeats_with_calls() -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        cp = control_plane(rt)
        old = AgentClient(f"127.0.0.1:{port}", "node-o", TOKEN, Source("host-o"), protocol=(1, 0))
        async with running(old):
            await wait_for(lambda: old.heartbeats >= 3, what="three beats")
            assert not old.streaming and cp.stats.streams_open == 0
            st = cp.nodes.get("node-o")
            assert st is not None and st.heartbeats >= 3 and st.protocol == (1, 0)


class _OlderService(AgentService):
    """A control plane from before protocol 1.1 that (wrongly) claims 1.1: only the fallback saves the agent."""

    StreamHeartbeats = agent_pb2_grpc.AgentServiceServicer.StreamHeartbeats  # type: ignore[assignment]


async def test_a_control_plane_without_the_stream_gets_heartbeat_calls() -> None:
    port = free_port()
    cfg = control_config(port)
    nodes = NodeMap(lambda: 3 * INTERVAL)
    server = grpc.aio.server()
    agent_pb2_grpc.add_AgentServiceServicer_to_server(_OlderService(nodes, lambda: cfg.control, ControlStats()), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        a = AgentClient(f"127.0.0.1:{port}", "node-f", TOKEN, Source("host-f"))
        async with running(a):
            await wait_for(lambda: a.heartbeats >= 2, what="beats after the fallback")
            assert not a.streaming
            st = nodes.get("node-f")
            assert st is not None and st.heartbeats >= 2
    finally:
        await server.stop(0)


async def test_a_reload_that_removes_the_token_ends_the_stream() -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        a = AgentClient(f"127.0.0.1:{port}", "node-t", TOKEN, Source("host-t"))
        stop = asyncio.Event()
        task = asyncio.create_task(a.run(stop))
        try:
            await wait_for(lambda: a.heartbeats >= 2 and a.streaming, what="beats on the stream")
            rt.reload(control_config(port, join_token="a-new-token-for-everyone"))
            with pytest.raises(AgentRefused) as exc:
                await asyncio.wait_for(task, 10)
            assert exc.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "a-new-token" not in str(exc.value) and TOKEN not in str(exc.value)
            stats = control_plane(rt).stats
            assert stats.refused.get("invalid_token") == 1
            # (the handler on the control thread ends just after the agent has its answer)
            await wait_for(lambda: stats.streams_open == 0, what="the stream closed on the control plane")
        finally:
            stop.set()
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@pytest.mark.parametrize("targets", [1, 2])
async def test_an_agent_whose_control_plane_is_away_backs_off(targets: int) -> None:
    """Before its first registration, with a poke pending (a node with replicas pokes as its
    supervisor adopts them): the backoff is slept in full, not cut short by the poke (it spun,
    a core's worth of calls and, with several addresses, hundreds of log lines a second)."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(targets)]
    a = AgentClient(addrs, "node-away", TOKEN, Source("host-w"))
    calls = 0
    register = a.register

    async def counted() -> object:
        nonlocal calls
        calls += 1
        return await register()

    a.register = counted  # type: ignore[method-assign]
    a.poke()
    async with running(a):
        await asyncio.sleep(2.0)
    # backoff from 0.1 s doubling, full jitter: at most ~6 rounds in 2 s, each one call an address
    assert 1 <= calls <= 7 * targets, calls


async def test_discovery_errors_are_logged_when_they_change(caplog: pytest.LogCaptureFixture) -> None:
    """NVML failing, a GPU fallen off the bus: in the agent's log when they appear and when they
    clear, not at every reading (and reported on the wire as errors, never readings)."""
    import dataclasses
    import logging

    caplog.set_level(logging.INFO, logger="llmgw")
    src = Source("host-e")
    a = AgentClient("127.0.0.1:1", "node-e", TOKEN, src)
    lost = dataclasses.replace(src.d.gpus[0], health="lost", errors=("GPU is lost",))
    bad = dataclasses.replace(src.d, gpus=(lost,), errors=("nvmlInit: Unknown Error",))
    good = src.d
    for d in (bad, bad, bad, good, good):
        src.d = d
        await a._read()
    said = [r.getMessage() for r in caplog.records if r.name.startswith("llmgw")]
    assert said == [
        "GPU discovery: nvmlInit: Unknown Error (reported to the control plane as an error, not as readings)",
        f"GPU discovery: GPU 0 ({lost.uuid}): GPU is lost (reported to the control plane as an error, not as readings)",
        "GPU discovery: no errors now",
    ], said


async def test_a_reload_says_which_control_keys_need_a_restart_and_applies_the_rest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """control.listen, its database (and TLS, lease, advertise) are read at start: a reload that changes
    them says a restart is needed, and keeps saying so (the process runs the old ones); join tokens and
    the heartbeat interval are applied (the agents hear the new interval in the next answer)."""
    port, other = free_port(), free_port()
    async with control_runtime(port) as rt:
        a = AgentClient(f"127.0.0.1:{port}", "node-r", TOKEN, Source("host-r"))
        async with running(a):
            await wait_for(lambda: a.heartbeats >= 2, what="beats")
            new = control_config(other, database=f"sqlite:///{tmp_path / 'other.sqlite3'}", heartbeat_interval="0.3s",
                                 heartbeat_grace="0.9s", grpc_server="grpcio")
            for _ in range(2):  # (and again: still not applied)
                summary = rt.reload(new)
                assert summary["restart_needed_for"] == ["control.listen", "control.database",
                                                         "control.grpc_server"], summary
            assert rt.config.control is not None and rt.config.control.listen == ("127.0.0.1", port)
            assert rt.config.control.grpc_server == "llmgw"
            assert rt.config.control.heartbeat_interval == 0.3
            await wait_for(lambda: a.interval == 0.3, what="the new interval reaching the agent")
            beats = a.heartbeats
            await wait_for(lambda: a.heartbeats >= beats + 2, what="beats on the old address")
