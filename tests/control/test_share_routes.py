"""Conversation routes shared between routers (``routing.prefix.share``; docs/routing.md "Several routers").

Real gateways in this process, over real gRPC on loopback: a control plane whose own router routes three
simulated engines by prefix, and two routers following it (``follow:``) in front of the same three. A
conversation moved off its home replica at one router (the home drained there) is sent to where it moved
by the other router and by the control plane's own, which would otherwise send it home.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from cp_helpers import TOKEN, free_port, http, metrics_text, wait_for
from prometheus_client.parser import text_string_to_metric_families

from canary import secret
from llmgw.config import load
from llmgw.engines.sim import SimConfig, SimEngine
from llmgw.runtime import GatewayRuntime, components_for
from tools import need_tool

pytestmark = pytest.mark.timeout(90)

ROUTER_TOKEN = secret("router-token-share-5d2a")


async def _post(rt: GatewayRuntime, body: dict[str, Any], session: str) -> str:
    """One chat completion through ``rt`` with the ``x-session-id`` header: the replica that answered."""
    import orjson

    assert rt.listen_addr is not None
    data = orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", rt.listen_addr[1])
    try:
        sid = b"x-session-id: %s\r\n" % session.encode() if session else b""
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"%sconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (sid, len(data), data))
        raw = await asyncio.wait_for(r.read(), 20)
    finally:
        w.close()
    head = raw.partition(b"\r\n\r\n")[0].decode()
    assert head.split(" ", 2)[1] == "200", head
    for line in head.split("\r\n")[1:]:
        k, _, v = line.partition(":")
        if k.strip().lower() == "x-llmgw-replica":
            return v.strip()
    raise AssertionError(f"no x-llmgw-replica header: {head}")


async def _admin(rt: GatewayRuntime, method: str, path: str) -> tuple[int, str]:
    status, body = await http(rt, method, path)
    return status, body.decode()


def _sample(page: str, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(page):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


async def _metric(rt: GatewayRuntime, name: str, **labels: str) -> float | None:
    return _sample(await metrics_text(rt), name, **labels)


@contextlib.asynccontextmanager
async def _engines(n: int, **sim: Any) -> AsyncIterator[list[SimEngine]]:
    engines = [SimEngine(SimConfig(model="m", slots=4, **sim)) for _ in range(n)]
    for e in engines:
        await e.start("127.0.0.1", 0)
    try:
        yield engines
    finally:
        for e in engines:
            await e.stop()


@contextlib.asynccontextmanager
async def _runtime(doc: dict[str, Any]) -> AsyncIterator[GatewayRuntime]:
    cfg = load(doc)
    rt = GatewayRuntime(cfg, components=components_for(cfg))
    await rt.start()
    try:
        yield rt
    finally:
        await rt.stop()


def _control(common: dict[str, Any], tmp_path: Path, port: int) -> Any:
    """A control plane (router token set, SQLite) whose own router routes ``common``'s endpoints."""
    return _runtime({**common, "control": {"listen": f"127.0.0.1:{port}", "join_token": TOKEN,
                                           "router_token": ROUTER_TOKEN,
                                           "database": f"sqlite:///{tmp_path}/cp.sqlite3"}})


def _follower(common: dict[str, Any], port: int, **follow: Any) -> Any:
    return _runtime({**common, "follow": {"control": f"127.0.0.1:{port}", "token": ROUTER_TOKEN, **follow}})


async def test_a_moved_conversation_is_followed_by_every_router(tmp_path: Path) -> None:
    # (answers of ~20 ms: a replica's first connection does not make it look 3x slower than the others,
    # which would keep the picker off it whatever it knows)
    async with contextlib.AsyncExitStack() as stack:
        engines = await stack.enter_async_context(_engines(3, ttft_ms=10, tokens_per_second=400))
        common: dict[str, Any] = {
            "listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
            "scrape": {"interval": "100ms", "timeout": "80ms", "stale_after": "2s"},
            "routing": {"strategy": "prefix"},
            # (slots known: a replica running another router's request does not look full to this one)
            "endpoints": [{"id": f"r{i}", "url": e.url, "model": "m", "engine": "vllm", "slots": 4}
                          for i, e in enumerate(engines)],
        }
        cp_port = free_port()
        cp = await stack.enter_async_context(_control(common, tmp_path, cp_port))
        routers = [await stack.enter_async_context(_follower(common, cp_port, name=name))
                   for name in ("router-a", "router-b")]
        a, b = routers
        for rt in (cp, a, b):
            assert rt.registry is not None
            reg = rt.registry
            await wait_for(lambda reg=reg: all(ep.scrape_ok > 0 for ep in reg.endpoints.values()), 10,
                           "every replica scraped")
        for rt in (cp, a, b):
            await wait_for(lambda rt=rt: _metric(rt, "llmgw_routing_route_sharing"), 10, "sharing live")
        assert await _metric(cp, "llmgw_control_route_sharers") == 2.0

        body = {"model": "m", "messages": [{"role": "system", "content": "Answer briefly. " * 8},
                                           {"role": "user", "content": "Which way to the station?"}],
                "max_tokens": 4}
        home = await _post(a, body, "conv-1")
        # the home replica drained at router A only: A moves the conversation and keeps it moved
        status, _ = await _admin(a, "POST", f"/admin/v1/endpoints/{home}/drain")
        assert status == 200
        moved = await _post(a, body, "conv-1")
        assert moved != home
        assert await _post(a, body, "conv-1") == moved

        # the others learn it within a flush or two, and send the conversation where it moved
        async def learnt(rt: GatewayRuntime) -> bool:
            got = await _metric(rt, "llmgw_routing_shared_routes_total", direction="received")
            return got is not None and got >= 3

        for rt in (b, cp):
            await wait_for(lambda rt=rt: learnt(rt), 10, "the moved conversation's routes received")
        assert await _post(b, body, "conv-1") == moved
        assert await _post(cp, body, "conv-1") == moved
        assert await _metric(b, "llmgw_routing_decisions_total", model="m", reason="session") == 1.0
        # without a session: the moved turn's key (a later turn) is learnt, and the next turn follows it
        def turn(n: int) -> dict[str, Any]:
            msgs: list[dict[str, str]] = [{"role": "system", "content": "You plan walks through old towns. " * 6}]
            for k in range(n):
                msgs.append({"role": "user", "content": f"Day {k}: where should I walk next, and why there?"})
                if k < n - 1:
                    msgs.append({"role": "assistant", "content": f"On day {k} walk along the river to the bridge."})
            return {"model": "m", "messages": msgs, "max_tokens": 4}

        first = await _post(a, turn(1), "")
        if first != home:  # (its home at A is drained already when it is conv-1's)
            status, _ = await _admin(a, "POST", f"/admin/v1/endpoints/{first}/drain")
            assert status == 200
        a_sent = await _metric(a, "llmgw_routing_shared_routes_total", direction="sent")
        assert a_sent is not None
        moved2 = await _post(a, turn(2), "")
        assert moved2 != first

        async def all_at_b() -> bool:  # (A sent the moved turn's route, and B has every route A and cp sent)
            got = await _metric(b, "llmgw_routing_shared_routes_total", direction="received")
            want = [await _metric(rt, "llmgw_routing_shared_routes_total", direction="sent") for rt in (a, cp)]
            if got is None or want[0] is None or want[1] is None:
                return False
            return want[0] > a_sent and got >= want[0] + want[1]

        await wait_for(all_at_b, 10, "the moved turn's route at B")
        assert await _post(b, turn(3), "") == moved2  # (B never saw the conversation: it would go home)
        # a conversation nobody moved goes home at every router, as before
        fresh = await _post(b, body, "conv-2")
        assert await _post(cp, body, "conv-2") == fresh
        sent = await _metric(a, "llmgw_routing_shared_routes_total", direction="sent")
        assert sent is not None and sent >= 3
        relayed = await _metric(cp, "llmgw_control_shared_routes_total", outcome="relayed")
        assert relayed is not None and relayed >= 6  # (A's three to B and to the control plane's router)

        promtool = need_tool("promtool", install="apt-get install -y prometheus")
        for rt in (cp, b):
            status, page = await _admin(rt, "GET", "/metrics")
            import subprocess

            res = subprocess.run([promtool, "check", "metrics"], input=page.encode(), capture_output=True, timeout=30)
            assert res.returncode == 0, res.stdout + res.stderr


async def test_no_sharing_when_switched_off(tmp_path: Path) -> None:
    """``routing.prefix.share: false``: no route stream, nothing counted, the data path keeps no outbox."""
    async with _engines(2, ttft_ms=1, tokens_per_second=2000) as engines:
        common: dict[str, Any] = {
            "listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
            "routing": {"strategy": "prefix", "prefix": {"share": False}},
            "endpoints": [{"id": f"r{i}", "url": e.url, "model": "m", "engine": "vllm"}
                          for i, e in enumerate(engines)],
        }
        cp_port = free_port()
        async with _control(common, tmp_path, cp_port) as cp, _follower(common, cp_port) as rt:
            follower: Any = rt.components[0]
            await wait_for(lambda: follower.state.connected, 10, "the router following")
            assert follower.routes is None and cp.components[0].route_share is None
            assert await _metric(rt, "llmgw_routing_route_sharing") is None
            assert await _metric(cp, "llmgw_control_route_sharers") == 0.0
            assert rt.registry is not None and all(p.outbox is None for p in rt.registry.pools.values())


async def test_a_control_plane_older_than_1_1_is_followed_without_sharing(tmp_path: Path) -> None:
    """A control plane without ShareRoutes (router protocol 1.0: the method unknown, UNIMPLEMENTED): the router
    follows its table, says once that it routes without shared routes, and routes."""
    import grpc

    from llmgw._proto.router.v1 import router_pb2 as rpb

    engines = [SimEngine(SimConfig(model="m", slots=4, ttft_ms=1, tokens_per_second=2000))]
    await engines[0].start("127.0.0.1", 0)
    table = rpb.WatchReplicasResponse(table=rpb.ReplicaTable(version=1, source="old", replicas=[]))
    calls: list[str] = []

    async def watch(request: rpb.WatchReplicasRequest, context: Any) -> None:
        calls.append(request.router_name)
        await context.write(table)
        await asyncio.sleep(60)  # (the stream stays open, as a control plane's does)

    handler = grpc.method_handlers_generic_handler("llmgw.router.v1.RouterService", {
        "WatchReplicas": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=rpb.WatchReplicasRequest.FromString,
            response_serializer=rpb.WatchReplicasResponse.SerializeToString),
    })
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    rt: GatewayRuntime | None = None
    try:
        rcfg = load({"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "routing": {"strategy": "prefix"},
                     "endpoints": [{"id": "r0", "url": engines[0].url, "model": "m", "engine": "vllm"}],
                     "follow": {"control": f"127.0.0.1:{port}", "token": ROUTER_TOKEN, "name": "router-old"}})
        rt = GatewayRuntime(rcfg, components=components_for(rcfg))
        await rt.start()
        follower: Any = rt.components[0]
        await wait_for(lambda: follower.state.connected and follower._share_said, 10, "the refusal of ShareRoutes")
        assert calls == ["router-old"] and follower.state.version == 1
        assert await _metric(rt, "llmgw_routing_route_sharing") == 0.0
        assert rt.registry is not None and rt.registry.pools["m"].outbox is None
        reg = rt.registry
        await wait_for(lambda: all(ep.scrape_ok > 0 for ep in reg.endpoints.values()), 10, "the replica scraped")
        assert await _post(rt, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                           "conv-9") == "r0"
    finally:
        if rt is not None:
            await rt.stop()
        await server.stop(0)
        await engines[0].stop()


async def test_a_router_without_prefix_pools_opens_no_route_stream(tmp_path: Path) -> None:
    """Sharing is on by default, but a router whose pools all route by ``score`` has nothing to share or learn:
    it opens no stream (the control plane counts no sharer, its own router does not share)."""
    async with _engines(1, ttft_ms=1, tokens_per_second=2000) as engines:
        common: dict[str, Any] = {"listen": "127.0.0.1:0", "admin": "127.0.0.1:0",
                                  "endpoints": [{"id": "r0", "url": engines[0].url, "model": "m", "engine": "vllm"}]}
        cp_port = free_port()
        async with _control({**common, "routing": {"strategy": "prefix"}}, tmp_path, cp_port) as cp, \
                _follower(common, cp_port) as rt:
            follower: Any = rt.components[0]
            await wait_for(lambda: follower.state.connected, 10, "the router following")
            await asyncio.sleep(1.5)  # (longer than the check for a prefix pool)
            assert follower.routes is not None and not follower.routes.wanted
            assert await _metric(rt, "llmgw_routing_route_sharing") == 0.0
            assert await _metric(cp, "llmgw_control_route_sharers") == 0.0
            assert await _metric(cp, "llmgw_routing_route_sharing") == 0.0
