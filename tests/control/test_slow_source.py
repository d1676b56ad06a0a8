"""A GPU source that stops answering (a hung driver, nvidia-smi stuck) does not make a live node look dead.

A real agent (:class:`AgentClient`) against a real control plane over gRPC on 127.0.0.1, heartbeat
every 0.2 s, grace 0.6 s; the source's reads block on an event the test holds. The beats go on (the
node stays up, beat by beat), with the last reading while it is recent and, past
``STALE_AFTER``, with the GPUs by identity only and an error saying why: absent, not an old number
shown as live. The source answering again brings the readings back.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
from cp_helpers import TOKEN, api, control_plane, control_runtime, free_port, metrics_text, running, wait_for
from scenario import discovery_of, h100s

from llmgw.agent import client as agent_client
from llmgw.agent.client import AgentClient
from llmgw.agent.model import Discovery

pytestmark = pytest.mark.timeout(60)


class HeldSource:
    """Reads answer at once until :meth:`hold`; then each waits (bounded) for :meth:`release`."""

    name = "nvml"

    def __init__(self) -> None:
        self.d = discovery_of({"hostname": "slow-host", "gpus": h100s(2, "s"), "source": "nvml",  # (GPU 1 degraded)
                               "facts": {"memory_total_bytes": 64 << 30, "memory_available_bytes": 40 << 30}})
        self.open = threading.Event()
        self.open.set()
        self.reads = 0
        self.closed = False

    def hold(self) -> None:
        self.open.clear()

    def release(self) -> None:
        self.open.set()

    def __enter__(self) -> HeldSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def read(self) -> Discovery:
        self.reads += 1
        self.open.wait(20)
        return self.d

    def close(self) -> None:
        self.closed = True


async def _node(rt) -> dict:  # type: ignore[no-untyped-def]
    status, body = await api(rt, "GET", "/admin/v1/nodes/node-slow")
    assert status == 200, body
    return body  # type: ignore[no-any-return]


async def test_a_held_source_keeps_the_node_up_and_its_numbers_go_absent_when_old(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw")
    monkeypatch.setattr(agent_client, "STALE_AFTER", 1.5)
    port = free_port()
    source = HeldSource()
    async with control_runtime(port) as rt:
        cp = control_plane(rt)
        a = AgentClient(f"127.0.0.1:{port}", "node-slow", TOKEN, source)
        async with running(a) as task:
            with source:  # (released before the agent stops: its last read ends)
                await wait_for(lambda: a.heartbeats >= 2, what="two beats")
                node = await _node(rt)
                assert node["state"] == "up" and [g["utilization_gpu_ratio"] for g in node["gpus"]] == [0.0, 0.5]

                source.hold()
                held_at, beats, reads = time.monotonic(), a.heartbeats, source.reads
                recent_seen = False
                while time.monotonic() - held_at < 3.0:  # (past the grace five times, past STALE_AFTER twice)
                    st = cp.nodes.get("node-slow")
                    assert st is not None and cp.nodes.state(st) == "up", "a live node went unhealthy: its source is slow"
                    node = await _node(rt)
                    if time.monotonic() - held_at < 1.0:
                        # the last reading, while recent, as it was
                        assert [g["utilization_gpu_ratio"] for g in node["gpus"]] == [0.0, 0.5]
                        recent_seen = True
                    await asyncio.sleep(0.05)
                assert recent_seen and a.heartbeats >= beats + 8, (beats, a.heartbeats)
                assert source.reads <= reads + 1  # (one read in flight at a time: no thread piled on a hung one)

                # past STALE_AFTER: the GPUs are still there (identity, memory size), their readings absent
                node = await _node(rt)
                gpus = node["gpus"]
                assert [g["uuid"] for g in gpus] == [g.uuid for g in source.d.gpus]
                assert [g["memory_total_bytes"] for g in gpus] == [85899345920, 85899345920]
                for g in gpus:
                    for k in ("utilization_gpu_ratio", "memory_used_bytes", "memory_free_bytes", "temperature_celsius",
                              "power_watts", "mig_mode"):
                        assert g.get(k) is None, (k, g)
                    # health is a reading too: unknown now, not the last one passed off as current
                    assert g["health"] == "unknown" and g["xid_errors"] == {}, g
                assert node["facts"]["memory_available_bytes"] is None and node["facts"]["memory_total_bytes"] == 64 << 30
                text = await metrics_text(rt)
                u1 = source.d.gpus[1].uuid
                assert f'llmgw_gpu_health_state{{node="node-slow",gpu_uuid="{u1}",gpu_index="1",state="unknown"}} 1.0' \
                    in text, text
                assert 'state="degraded"} 1.0' not in text and "llmgw_node_memory_available_bytes{" not in text
                assert any("has not answered for" in e and "without their readings" in e for e in node["errors"]), node

                source.release()  # answering again: the readings come back, the error goes
                await wait_for(lambda: _fresh(rt), 10, "the readings back")
                said = [r.getMessage() for r in caplog.records if "has not answered for" in r.getMessage()]
                assert len(said) == 1, said  # (once for the stall, not on every beat)
                assert any("answered again" in r.getMessage() for r in caplog.records)
    assert task.done() and source.closed


async def _fresh(rt) -> bool:  # type: ignore[no-untyped-def]
    node = await _node(rt)
    return [g.get("utilization_gpu_ratio") for g in node["gpus"]] == [0.0, 0.5] and node["errors"] == []


async def test_a_source_that_never_answers_still_registers_the_node_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_client, "FIRST_READ_WAIT", 0.5)
    port = free_port()
    source = HeldSource()
    source.hold()
    async with control_runtime(port) as rt:
        a = AgentClient(f"127.0.0.1:{port}", "node-slow", TOKEN, source)
        async with running(a):
            with source:  # (released before the agent stops: its last read ends)
                await wait_for(lambda: a.heartbeats >= 2, what="beats from a node whose source never answered")
                node = await _node(rt)
                # no GPUs read: none reported (not zero of anything), and why; the source is the one it reads
                assert node["state"] == "up" and node["gpus"] == [] and node["gpu_source"] == "nvml", node
                assert any("has not answered for" in e for e in node["errors"]), node
                source.release()
                await wait_for(lambda: _fresh(rt), 10, "the first readings")


class OddSource:
    """A source that breaks its contract (returns None, then raises), then reads properly."""

    def __init__(self) -> None:
        self.d = discovery_of({"hostname": "odd-host", "gpus": h100s(1, "o")})
        self.mode = "none"

    def read(self) -> Discovery:
        if self.mode == "none":
            return None  # type: ignore[return-value]
        if self.mode == "raise":
            raise RuntimeError("driver said no")
        return self.d

    def close(self) -> None:
        pass


async def test_a_source_that_returns_no_reading_or_raises_is_an_error_and_reads_go_on() -> None:
    port = free_port()
    source = OddSource()
    async with control_runtime(port) as rt:
        a = AgentClient(f"127.0.0.1:{port}", "node-odd", TOKEN, source)
        async with running(a):
            async def says(fragment: str) -> bool:
                status, body = await api(rt, "GET", "/admin/v1/nodes/node-odd")
                return status == 200 and any(fragment in e for e in body["errors"])

            await wait_for(lambda: says("returned NoneType, not a reading"), 10, "the None reported")
            source.mode = "raise"
            await wait_for(lambda: says("RuntimeError: driver said no"), 10, "the exception reported")
            source.mode = "ok"

            async def fine() -> bool:
                status, body = await api(rt, "GET", "/admin/v1/nodes/node-odd")
                return status == 200 and body["errors"] == [] and len(body["gpus"]) == 1

            await wait_for(fine, 10, "readings again")
