"""A model whose every replica is down is answered 503 at once; a saturated one still queues.

Over real sockets: a small vLLM-dialect engine on llmgw's own HTTP core, which a
test stops (its port then refuses), restarts on the same port, or makes hang its
``/metrics`` or reset its requests; a gateway in front of it; raw HTTP and the
``openai`` SDK as clients. "Down" (``llmgw._fast.replica_py``): unreachable (a
scrape refused), stale (scrapes failing past ``scrape.stale_after``), breaker open;
a pool with no replica but such is ``model_unavailable`` (503 + ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest

from llmgw.config import load
from llmgw.engines.sim import SimConfig, SimEngine
from llmgw.http.server import HTTPServer
from llmgw.runtime import GatewayRuntime
from ports import free_port as _free_port

PAGE = (
    b'vllm:num_requests_running{model_name="m"} 0\n'
    b'vllm:num_requests_waiting{model_name="m"} %d\n'
    b'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
)


class Engine:
    """A vLLM-ish engine on a fixed port: ``waiting`` is what its metrics page shows
    (8 or more: the pool is saturated), ``hang_metrics`` makes its scrapes time out,
    ``mode = "reset"`` aborts every request (breaker failures)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.waiting = 0
        self.hang_metrics = False
        self.mode = "ok"
        self.server: HTTPServer | None = None
        self.requests = 0

    async def start(self) -> None:
        self.server = HTTPServer(self, name="engine")
        await self.server.listen("127.0.0.1", self.port)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close(0.5)
            self.server = None

    def handle(self, req: Any, w: Any) -> Any:
        if req.path == b"/metrics":
            if self.hang_metrics:
                return self._hang()
            w.send(200, PAGE % self.waiting, ((b"content-type", b"text/plain; version=0.0.4"),))
            return None
        self.requests += 1
        if self.mode == "reset":
            w.abort()
            return None
        w.send_json(200, {"object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1,
                                                                                "completion_tokens": 1,
                                                                                "total_tokens": 2}})
        return None

    async def _hang(self) -> None:
        await asyncio.sleep(3600)


def _config(engine: Engine, **extra: Any) -> Any:
    doc: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin": "127.0.0.1:0",
        "endpoints": [{"id": "v0", "url": f"http://127.0.0.1:{engine.port}", "model": "m", "engine": "vllm"}],
        "scrape": {"interval": "100ms", "timeout": "90ms", "stale_after": "400ms"},
        "upstream": {"first_byte_timeout": "2s", "read_timeout": "2s", "connect_timeout": "500ms"},
        # the default 30 s: an outage must never wait for it
        "admission": {"queue_timeout": "30s"},
    }
    doc.update(extra)
    return load(doc)


@contextlib.asynccontextmanager
async def gateway(engine: Engine, *, start_engine: bool = True, **extra: Any) -> AsyncIterator[GatewayRuntime]:
    if start_engine:
        await engine.start()
    rt = GatewayRuntime(_config(engine, **extra))
    await rt.start()
    try:
        yield rt
    finally:
        await rt.stop()
        await engine.stop()


def _port(rt: GatewayRuntime) -> int:
    assert rt.listen_addr is not None
    return rt.listen_addr[1]


def _admin(rt: GatewayRuntime) -> int:
    assert rt.admin_addr is not None
    return rt.admin_addr[1]


async def http(port: int, method: str, path: str, body: Any = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    data = b"" if body is None else orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(
            b"%s %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (method.encode(), path.encode(), len(data), data)
        )
        raw = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout)
        lines = raw.decode("latin-1").split("\r\n")
        hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
        payload = await asyncio.wait_for(r.readexactly(int(hdrs.get("content-length", "0"))), timeout)
        return int(lines[0].split()[1]), hdrs, payload
    finally:
        w.close()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def chat(port: int) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, hdrs, body = await http(port, "POST", "/v1/chat/completions", CHAT)
    return status, hdrs, orjson.loads(body)


async def until(cond: Any, timeout: float = 10.0) -> None:
    """Poll ``cond`` (state another task changes) until true; bounded."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def _assert_unavailable(status: int, hdrs: dict[str, str], body: dict[str, Any], reason: str) -> None:
    assert status == 503, body
    err = body["error"]
    assert err["code"] == "model_unavailable" and err["type"] == "service_unavailable_error"
    assert reason in err["message"] and "`m`" in err["message"]
    assert "v0" not in err["message"]  # replicas are counted, never named to clients
    assert 1 <= int(hdrs["retry-after"]) <= 60 and int(hdrs["retry-after-ms"]) >= 1000


async def test_a_dead_replica_is_503_in_milliseconds_not_a_queue_timeout() -> None:
    engine = Engine()
    async with gateway(engine) as rt:
        assert rt.registry is not None
        ep = rt.registry.endpoints["v0"]
        status, _, _ = await chat(_port(rt))
        assert status == 200
        await engine.stop()  # the port now refuses: the next scrape finds it down
        await until(lambda: ep.down)
        assert ep.unreachable and not ep.usable
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            status, hdrs, body = await chat(_port(rt))
            times.append(time.perf_counter() - t0)
            _assert_unavailable(status, hdrs, body, "1 unreachable")
        median = statistics.median(times)
        print(f"\n503 model_unavailable over a real socket: median {median * 1000:.2f} ms, max {max(times) * 1000:.2f} ms")
        assert median < 0.1, times  # (queue_timeout is 30 s: this never waited for it)
        assert engine.requests == 1  # nothing was sent to the dead replica
        # /ready names the model and why; the admin view does not call it usable
        status, _, data = await http(_admin(rt), "GET", "/ready")
        ready = orjson.loads(data)
        assert status == 503 and ready["models_unavailable"] == ["m"]
        assert ready["unavailable"] == {"m": {"v0": "unreachable"}}
        status, _, data = await http(_admin(rt), "GET", "/admin/v1/endpoints/v0")
        view = orjson.loads(data)
        assert view["usable"] is False and view["down"] is True
        assert view["unusable_reason"] == "unreachable" and view["state"] == "unreachable"
        # back: the first scrape that reaches it routes new requests again
        await engine.start()
        await until(lambda: not ep.down)
        status, _, _ = await chat(_port(rt))
        assert status == 200
        status, _, data = await http(_admin(rt), "GET", "/ready")
        assert status == 200 and orjson.loads(data)["unavailable"] == {}


async def test_a_replica_down_before_its_first_scrape_is_answered_when_that_scrape_fails() -> None:
    # Before the first scrape nothing is known: the request waits for it (as ever);
    # the scrape is refused, so it is answered 503 then, not at queue_timeout.
    engine = Engine()
    async with gateway(engine, start_engine=False, scrape={"interval": "300ms", "timeout": "90ms"}) as rt:
        t0 = time.monotonic()
        status, hdrs, body = await chat(_port(rt))
        took = time.monotonic() - t0
        _assert_unavailable(status, hdrs, body, "unreachable")
        assert took < 5.0, took


async def test_a_live_replica_before_its_first_scrape_is_routed() -> None:
    # The first request after the start is not a 503: the replica was never found down.
    engine = Engine()
    async with gateway(engine, scrape={"interval": "500ms", "timeout": "200ms"}) as rt:
        assert rt.registry is not None
        status, _, _ = await chat(_port(rt))
        assert status == 200
        assert engine.requests == 1


async def test_scrapes_that_time_out_make_it_stale_then_down() -> None:
    engine = Engine()
    async with gateway(engine) as rt:
        assert rt.registry is not None
        ep = rt.registry.endpoints["v0"]
        await until(lambda: ep.last_scrape is not None)
        engine.hang_metrics = True  # the engine still listens; its scrapes time out
        await until(lambda: ep.down)
        assert not ep.unreachable and ep.stale and ep.scrape_failing >= 1
        status, hdrs, body = await chat(_port(rt))
        _assert_unavailable(status, hdrs, body, "failing its scrapes")
        status, _, data = await http(_admin(rt), "GET", "/admin/v1/endpoints/v0")
        assert orjson.loads(data)["unusable_reason"] == "stale"
        engine.hang_metrics = False
        await until(lambda: not ep.down and not ep.stale)
        status, _, _ = await chat(_port(rt))
        assert status == 200


async def test_an_open_breaker_is_503_with_retry_after_its_probe() -> None:
    engine = Engine()
    async with gateway(engine, breaker={"failures": 2, "cooldown": "5s"}, retries={"attempts": 0}) as rt:
        assert rt.registry is not None
        ep = rt.registry.endpoints["v0"]
        await until(lambda: ep.last_scrape is not None)
        engine.mode = "reset"
        for _ in range(2):
            status, _, _ = await chat(_port(rt))
            assert status == 502
        assert ep.breaker_open
        sent = engine.requests
        status, hdrs, body = await chat(_port(rt))
        _assert_unavailable(status, hdrs, body, "open circuit breaker")
        assert 3 <= int(hdrs["retry-after"]) <= 5  # the probe is due when the cooldown ends
        assert engine.requests == sent
        status, _, data = await http(_admin(rt), "GET", "/ready")
        assert status == 503 and orjson.loads(data)["unavailable"] == {"m": {"v0": "breaker_open"}}


async def test_after_the_cooldown_the_probe_goes_and_closes_the_breaker() -> None:
    engine = Engine()
    async with gateway(engine, breaker={"failures": 1, "cooldown": "300ms"}, retries={"attempts": 0}) as rt:
        assert rt.registry is not None
        ep = rt.registry.endpoints["v0"]
        await until(lambda: ep.last_scrape is not None)
        engine.mode = "reset"
        status, _, _ = await chat(_port(rt))
        assert status == 502 and ep.breaker_open
        status, _, body = await chat(_port(rt))
        assert status == 503 and body["error"]["code"] == "model_unavailable"
        engine.mode = "ok"
        await until(lambda: ep.state.breaker.available(time.monotonic()))
        status, _, _ = await chat(_port(rt))  # the half-open breaker's probe
        assert status == 200
        assert ep.breaker_state == "closed" and ep.usable


async def test_a_saturated_pool_still_queues() -> None:
    engine = Engine()
    engine.waiting = 100  # up, and full: saturation far above 1
    async with gateway(engine, admission={"queue_timeout": "300ms"}) as rt:
        assert rt.registry is not None
        ep = rt.registry.endpoints["v0"]
        await until(lambda: ep.last_scrape is not None)
        t0 = time.monotonic()
        status, _, body = await chat(_port(rt))
        assert status == 429 and body["error"]["code"] == "queue_timeout"
        assert time.monotonic() - t0 >= 0.25  # it waited in the queue
        # and it moves as soon as there is room
        task = asyncio.ensure_future(chat(_port(rt)))
        await until(lambda: len(rt.registry.pools["m"].queue) == 1)  # type: ignore[union-attr]
        engine.waiting = 0
        status, _, _ = await task
        assert status == 200


async def test_requests_queued_when_the_pool_goes_down_are_answered_at_once() -> None:
    engine = Engine()
    engine.waiting = 100  # saturated: requests queue (for up to 30 s)
    async with gateway(engine) as rt:
        assert rt.registry is not None
        pool = rt.registry.pools["m"]
        ep = rt.registry.endpoints["v0"]
        await until(lambda: ep.last_scrape is not None)
        tasks = [asyncio.ensure_future(chat(_port(rt))) for _ in range(3)]
        await until(lambda: len(pool.queue) == 3)
        t0 = time.monotonic()
        await engine.stop()
        results = await asyncio.gather(*tasks)
        took = time.monotonic() - t0
        for status, hdrs, body in results:
            _assert_unavailable(status, hdrs, body, "unreachable")
        assert took < 5.0, took  # a scrape interval or two, never queue_timeout
        assert len(pool.queue) == 0


async def test_the_openai_sdk_fails_in_seconds_on_a_dead_model() -> None:
    engine = Engine()
    async with gateway(engine) as rt:
        assert rt.registry is not None
        ep = rt.registry.endpoints["v0"]
        await until(lambda: ep.last_scrape is not None)
        await engine.stop()
        await until(lambda: ep.down)
        # default max_retries (2): it retries a 503, waiting what Retry-After says
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{_port(rt)}/v1", api_key="unused", timeout=60)
        try:
            t0 = time.monotonic()
            with pytest.raises(openai.InternalServerError) as ei:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            took = time.monotonic() - t0
        finally:
            await client.close()
        print(f"\nopenai SDK (max_retries=2) on a dead model: {took:.2f} s to fail")
        assert ei.value.status_code == 503 and ei.value.code == "model_unavailable"
        assert took < 10.0, took  # (three tries, Retry-After 1 s between: about 2 s; it was ~100 s)


async def test_a_loading_llama_server_is_not_routed_to() -> None:
    # llama-server answers /metrics 503 "Loading model" while it loads (engines.md §2.2): its pool
    # is down (503 model_unavailable with Retry-After, at once), nothing goes to it, and it serves
    # once a scrape succeeds; it comes back the same way whenever it loads again
    eng = SimEngine(SimConfig(model="m", engine="llamacpp", startup_delay=3600, ttft_ms=0, tokens_per_second=1e6))
    await eng.start("127.0.0.1", 0)
    assert eng.address is not None
    cfg = load({
        "listen": "127.0.0.1:0",
        "admin": "127.0.0.1:0",
        "endpoints": [{"id": "v0", "url": f"http://127.0.0.1:{eng.address[1]}", "model": "m", "engine": "llamacpp"}],
        "scrape": {"interval": "100ms", "timeout": "90ms", "stale_after": "400ms"},
        "admission": {"queue_timeout": "30s"},
    })
    rt = GatewayRuntime(cfg)
    await rt.start()
    try:
        assert rt.registry is not None
        ep = rt.registry.endpoints["v0"]
        served = []
        for _ in range(2):
            await until(lambda: ep.down)
            for _ in range(5):
                t0 = time.monotonic()
                # (the gateway's own 503, model_unavailable: not the engine's "Loading model" passed on)
                status, hdrs, body = await chat(_port(rt))
                _assert_unavailable(status, hdrs, body, "1 ")
                assert "1 loading its model" in body["error"]["message"], body
                assert time.monotonic() - t0 < 1.0  # never the queue's 30 s
            status, _, data = await http(_admin(rt), "GET", "/ready")
            assert status == 503 and orjson.loads(data)["unavailable"] == {"m": {"v0": "loading"}}
            status, _, data = await http(_admin(rt), "GET", "/admin/v1/endpoints/v0")
            view = orjson.loads(data)
            assert view["usable"] is False and view["state"] == "loading" and view["unusable_reason"] == "loading"
            assert "Loading model" in view["scrape"]["problem"]
            eng.set_ready(True)  # loaded
            await until(lambda: ep.usable)
            status, _, _ = await chat(_port(rt))
            assert status == 200
            status, _, data = await http(_admin(rt), "GET", "/ready")
            assert status == 200
            served.append(eng.state.requests)
            eng.set_ready(False)  # loading again (a restart, a model swap)
        assert served == [1, 2]
    finally:
        await rt.stop()
        await eng.stop(timeout=1.0)
