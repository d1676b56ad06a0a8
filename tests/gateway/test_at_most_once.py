"""A request reaches an engine at most once; clients are told what not to retry.

Real sockets throughout: llmgw in front of simulated engines (``llmgw sim-engine``'s
engine, speaking vLLM's protocol) whose faults fail a request *after* it arrived
(a reset, an end of stream, a hang), and which count arrivals per ``X-Request-Id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from llmgw.config import load
from llmgw.engines import ENGINES
from llmgw.engines.sim import SimConfig, SimEngine
from llmgw.errors import ConfigError
from llmgw.gateway.app import GatewayRuntime


@contextlib.asynccontextmanager
async def fleet(n: int = 2, *, sim: dict[str, Any] | None = None, **extra: Any) -> AsyncIterator[
    tuple[GatewayRuntime, list[SimEngine]]
]:
    engines = [
        SimEngine(SimConfig(model="m", ttft_ms=0, tokens_per_second=1e6, count_arrivals=True, **(sim or {})))
        for _ in range(n)
    ]
    for e in engines:
        await e.start()
    upstream = {"first_byte_timeout": "1s", "read_timeout": "1s", "connect_timeout": "500ms"}
    upstream.update(extra.pop("upstream", {}))
    cfg = load(
        {
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "endpoints": [
                {"id": f"e{i}", "url": e.url, "model": "m", "engine": e.config.engine} for i, e in enumerate(engines)
            ],
            "routing": {"strategy": "round_robin"},
            "upstream": upstream,
            **extra,
        }
    )
    rt = GatewayRuntime(cfg)
    await rt.start()
    try:
        yield rt, engines
    finally:
        await rt.stop()
        for e in engines:
            await e.stop()


async def request(
    rt: GatewayRuntime, body: bytes, rid: bytes, path: bytes = b"/v1/chat/completions"
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request on a fresh client connection; returns (status, headers, body)."""
    assert rt.listen_addr is not None
    r, w = await asyncio.open_connection("127.0.0.1", rt.listen_addr[1])
    try:
        w.write(
            b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-request-id: %s\r\n"
            b"content-length: %d\r\n\r\n%s" % (path, rid, len(body), body)
        )
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode().split("\r\n")
        hdrs = {}
        for line in lines[1:]:
            if line:
                k, v = line.split(":", 1)
                hdrs[k.strip().lower().encode()] = v.strip().encode()
        data = await asyncio.wait_for(r.readexactly(int(hdrs.get(b"content-length", b"0"))), 10)
        return int(lines[0].split()[1]), hdrs, data
    finally:
        w.close()


def chat(model: str = "m") -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})


def arrivals(engines: list[SimEngine], rid: bytes) -> int:
    return sum(e.arrivals.get(rid, 0) for e in engines)


def pools(rt: GatewayRuntime) -> list[Any]:
    assert rt.registry is not None
    return [ep.pool for ep in rt.registry.endpoints.values()]


@pytest.mark.parametrize("how", ["reset", "eof"])
@pytest.mark.parametrize("reused", [False, True], ids=["fresh", "reused"])
async def test_a_failure_after_the_send_is_answered_not_resent(how: str, reused: bool) -> None:
    # (the first request waits for the first scrapes; a second one, at a random point of the interval, would
    # take the warmed connection or the engine's dropped answer: an hour, none in the test)
    async with fleet(2, scrape={"interval": "1h"}) as (rt, engines):
        if reused:
            # warm a pooled connection to each replica
            for i in range(2):
                assert (await request(rt, chat(), b"warm-%d" % i))[0] == 200
            assert all(p.idle_connections >= 1 for p in pools(rt))
        for e in engines:
            e.set_faults(drop_next=1, drop_how=how)
        status, _hdrs, body = await request(rt, chat(), b"once")
        assert status == 502, body
        assert orjson.loads(body)["error"]["code"] == "bad_gateway"
        assert arrivals(engines, b"once") == 1  # not to the same replica, not to the other
        assert sum(e.state.drops for e in engines) == 1
        for e in engines:
            e.set_faults(reset=True)
        assert (await request(rt, chat(), b"after"))[0] == 200


async def test_a_hang_before_the_head_is_a_504_not_resent() -> None:
    async with fleet(2, upstream={"first_byte_timeout": "300ms"}) as (rt, engines):
        for e in engines:
            e.set_faults(hang_next=1)
        status, hdrs, _body = await request(rt, chat(), b"stuck")
        assert status == 504
        assert hdrs[b"x-should-retry"] == b"false"
        assert arrivals(engines, b"stuck") == 1


async def test_after_send_restores_resending() -> None:
    async with fleet(2, retries={"after_send": True}) as (rt, engines):
        for e in engines:
            e.set_faults(drop_rate=1.0)
        status, _, body = await request(rt, chat(), b"again")
        assert status == 502, body
        # sent again: to the other replica (and, on a connection taken from the
        # pool, once more to the same one on a new connection), then no attempts left
        assert 2 <= arrivals(engines, b"again") <= 4
        assert all(e.arrivals[b"again"] for e in engines)


async def test_after_send_reused_connection_retried_fresh_on_the_same_replica() -> None:
    async with fleet(1, retries={"after_send": True}) as (rt, engines):
        assert (await request(rt, chat(), b"warm"))[0] == 200
        engines[0].set_faults(drop_next=1, drop_how="eof")
        status, _, _ = await request(rt, chat(), b"twice")
        assert status == 200
        assert engines[0].arrivals[b"twice"] == 2


async def test_connect_failures_are_still_retried_elsewhere() -> None:
    good = SimEngine(SimConfig(model="m", ttft_ms=0, tokens_per_second=1e6, count_arrivals=True))
    await good.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    cfg = load({
        "listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "routing": {"strategy": "round_robin"},
        "endpoints": [
            {"id": "dead", "url": f"http://127.0.0.1:{dead}", "model": "m"},
            {"id": "good", "url": good.url, "model": "m"},
        ],
    })
    rt = GatewayRuntime(cfg)
    await rt.start()
    try:
        for i in range(4):
            status, hdrs, _ = await request(rt, chat(), b"c%d" % i)
            assert status == 200 and hdrs[b"x-llmgw-replica"] == b"good"
            assert good.arrivals[b"c%d" % i] == 1
    finally:
        await rt.stop()
        await good.stop()


async def test_a_pooled_connection_is_never_used_past_idle_timeout() -> None:
    # The replica would keep it for 300s: llmgw's own idle_timeout closes it first,
    # and take_idle never hands it out even before the sweep has run.
    # (the first request waits for the first scrape; the second scrape comes at a random point
    # of the interval: an hour, none in the test, which would take the connection and give it
    # back younger)
    async with fleet(1, upstream={"idle_timeout": "150ms"}, scrape={"interval": "1h"}) as (rt, _engines):
        assert (await request(rt, chat(), b"a"))[0] == 200
        pool = pools(rt)[0]
        conn = pool.take_idle()
        assert conn is not None
        conn.release()  # (back to the pool, idle from now)
        await asyncio.sleep(0.2)  # (the thing under test is the passage of time)
        assert pool.take_idle() is None
        assert conn.transport is None or conn.transport.is_closing()
        assert (await request(rt, chat(), b"b"))[0] == 200


async def test_a_connection_the_engine_closed_while_idle_is_not_reused() -> None:
    # A misconfigured idle_timeout (longer than the engine's keep-alive): the
    # engine's close arrives first and the connection is never picked.
    async with fleet(1, sim={"keepalive_timeout": 0.1}, upstream={"idle_timeout": "30s"}) as (rt, engines):
        assert (await request(rt, chat(), b"a"))[0] == 200
        pool = pools(rt)[0]
        for _ in range(200):  # bounded: the engine closes after 0.1s
            if pool.open_connections == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.open_connections == 0
        assert (await request(rt, chat(), b"b"))[0] == 200
        assert engines[0].arrivals[b"b"] == 1


async def test_a_connection_whose_close_arrived_is_not_written() -> None:
    # The end of stream was read (eof_received) but the pool still holds the
    # connection: take_idle skips it; send() on it writes nothing.
    async with fleet(1, upstream={"idle_timeout": "30s"}) as (rt, _engines):
        assert (await request(rt, chat(), b"a"))[0] == 200
        pool = pools(rt)[0]
        conn = pool.take_idle()
        assert conn is not None
        conn.eof_received()  # what the loop calls when the engine's FIN is read

        class Sink:
            lost: list[Any] = []

            def on_response_head(self, resp: Any) -> None: ...
            def on_response_body(self, data: bytes) -> None: ...
            def on_response_end(self) -> None: ...
            def on_upstream_lost(self, exc: Any) -> None:
                self.lost.append(exc)

        sink = Sink()
        conn.send(sink, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", b"")
        assert not conn.written and len(sink.lost) == 1
        conn.abort()


def test_idle_timeout_defaults_per_engine_and_explicit_wins() -> None:
    base = {"endpoints": [
        {"id": "v", "url": "http://127.0.0.1:1", "model": "m", "engine": "vllm"},
        {"id": "l", "url": "http://127.0.0.1:2", "model": "m", "engine": "llamacpp"},
    ]}
    assert load(base).upstream.idle_timeout is None
    for name in ("vllm", "sglang", "trtllm", "llamacpp"):
        info = ENGINES[name]
        assert info.keep_alive == 5.0
        assert info.idle_timeout() == pytest.approx(4.0)
    assert ENGINES["generic"].idle_timeout() < 5.0
    assert load({**base, "upstream": {"idle_timeout": "2s"}}).upstream.idle_timeout == 2.0
    with pytest.raises(ConfigError) as exc:
        load({**base, "upstream": {"idle_timeout": 0}})
    assert "idle_timeout" in str(exc.value)


async def test_default_idle_timeout_reaches_the_pools() -> None:
    async with fleet(1, upstream={}) as (rt, _):
        assert [p.idle_timeout for p in pools(rt)] == [pytest.approx(4.0)]


# -- what clients are told not to retry --


@pytest.mark.parametrize(
    ("body", "path", "status"),
    [
        (b"{not json", b"/v1/chat/completions", 400),
        (b'{"model": "nope"}', b"/v1/chat/completions", 404),
        (b"{}", b"/nope", 404),
        (b"x" * 100_000, b"/v1/chat/completions", 413),
    ],
)
async def test_answers_a_retry_would_repeat_say_so(body: bytes, path: bytes, status: int) -> None:
    async with fleet(1, server={"max_body_size": 65536}) as (rt, engines):
        got, hdrs, _ = await request(rt, body, b"r", path)
        assert got == status
        assert hdrs[b"x-should-retry"] == b"false"
        assert engines[0].state.requests == 0


async def test_a_503_carries_retry_after() -> None:
    # (the 429 of a full queue carries Retry-After too: tests/gateway/test_routing.py)
    async with fleet(2) as (rt, engines):
        for e in engines:
            e.set_faults(error_rate=1.0, error_status=503)
        status, hdrs, _ = await request(rt, chat(), b"busy")
        assert status == 503
        assert int(hdrs[b"retry-after"]) >= 1 and b"x-should-retry" not in hdrs
        # an engine's 503 is an answer, not a failure after the send: retried elsewhere
        assert arrivals(engines, b"busy") == 2


async def test_openai_sdk_against_a_stuck_engine_sends_one_request() -> None:
    # The SDK's defaults (max_retries=2) retry a 504 unless told not to.
    from openai import APIStatusError, AsyncOpenAI

    async with fleet(1, upstream={"first_byte_timeout": "300ms"}) as (rt, engines):
        engines[0].set_faults(hang_rate=1.0)
        assert rt.listen_addr is not None
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{rt.listen_addr[1]}/v1", api_key="x")
        try:
            with pytest.raises(APIStatusError) as exc:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        finally:
            await client.close()
        assert exc.value.status_code == 504
        assert engines[0].state.requests == 1
        assert sum(engines[0].arrivals.values()) == 1


async def test_a_stream_from_an_engine_that_closes_after_it_is_not_pooled() -> None:
    # llama-server closes right after a streamed answer although it says keep-alive:
    # llmgw closes the connection too instead of handing it to the next request.
    assert ENGINES["llamacpp"].closes_after_stream and not ENGINES["vllm"].closes_after_stream
    for engine, pooled in (("llamacpp", False), ("vllm", True)):
        # (the first request waits for the first scrape; the next comes 2 s later)
        async with fleet(1, sim={"engine": engine}, scrape={"interval": "2s"}) as (rt, _engines):
            pool = pools(rt)[0]
            body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                                 "max_tokens": 4})
            assert (await request(rt, chat(), b"warm"))[0] == 200
            for _ in range(pool.idle_connections):  # (out of the way: only the stream's may be pooled)
                idle = pool.take_idle()
                if idle is not None:
                    idle.abort()
            assert rt.listen_addr is not None
            r, w = await asyncio.open_connection("127.0.0.1", rt.listen_addr[1])
            try:
                w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(body), body))
                data = b""
                while b"[DONE]" not in data or not data.endswith(b"\r\n\r\n"):  # (bounded by the timeout)
                    data += await asyncio.wait_for(r.read(65536), 5)
            finally:
                w.close()
            assert b"[DONE]" in data
            assert (pool.idle_connections > 0) == pooled, engine
