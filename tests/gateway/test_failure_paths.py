"""The data path's failure branches, each produced on purpose over real sockets.

The engines here are tiny HTTP/1.1 servers on asyncio streams (:class:`RawEngine`):
each test scripts exactly which bytes go back and when, so a timeout after the
first byte, a hang, a 500 or a refused connection happen when the test needs them.
A replica that never accepts a connection is a listening socket whose accept queue
is full (:func:`blackhole`): the kernel drops further SYNs, on loopback.

Every test checks the answer, the counters the admin port exports and that
nothing is left behind (no request in flight, no upstream connection, no task).
These run in whichever build the session selected (compiled, or the pure twins
under ``LLMGW_NO_EXTENSIONS=1``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import orjson
import pytest

from llmgw.config import load
from llmgw.gateway.app import GatewayRuntime

# The gateway's deadline sweep runs every TICK seconds (llmgw._fast.proxy_py._TICK):
# a read deadline moves on at the first sweep after bytes came and fires at the
# first sweep after it passed, so a read timeout fires between read_timeout and
# read_timeout + 2 * TICK after the last byte (docs/config.md says so).
TICK = 0.05
# How late a loaded event loop may run the sweep on this shared machine, on top.
LOOP_SLACK = 0.25
# uvloop keeps time in whole milliseconds: a timer may fire up to 1 ms before loop.time() says it is due
# (0.2999999999992724 s measured for a 300 ms timeout), so "not before" is checked to within that
CLOCK_STEP = 0.002

Script = Callable[["RawEngine", asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


class RawEngine:
    """An OpenAI-ish engine answering each POST with ``script`` (keep-alive when it returns True).

    ``/metrics`` answers a vLLM page; ``waiting`` sets its queue length.
    ``requests`` counts POSTs, ``active`` the ones being answered, ``aborted`` the
    ones whose connection the gateway closed while they were being answered
    (seen as EOF, so a test awaits it instead of sleeping).
    """

    def __init__(self, script: Script | None = None) -> None:
        self.script: Script = script or ok
        self.requests = 0
        self.active = 0
        self.aborted = 0
        self.bodies: list[bytes] = []
        self.changed = asyncio.Event()  # set whenever active/aborted/requests change
        self.release = asyncio.Event()  # hold(): answer once set
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in list(self._writers):
            w.close()
        await self._server.wait_closed()

    def _bump(self) -> None:
        self.changed.set()

    async def wait(self, pred: Callable[[], bool], timeout: float = 5.0) -> None:
        """Until ``pred()`` holds (checked each time the engine's numbers change)."""
        async with asyncio.timeout(timeout):
            while not pred():
                self.changed.clear()
                await self.changed.wait()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self._writers.add(w)
        try:
            while True:
                try:
                    head = await r.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.split(b"\r\n")
                path = lines[0].split()[1]
                n = 0
                for line in lines[1:]:
                    if line[:15].lower() == b"content-length:":
                        n = int(line[15:])
                body = await r.readexactly(n) if n else b""
                if path == b"/metrics":
                    page = b'vllm:num_requests_waiting{model_name="m"} 0\nvllm:num_requests_running{model_name="m"} 0\n'
                    page += b'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page))
                    continue
                self.requests += 1
                self.bodies.append(body)
                self.active += 1
                self._bump()
                try:
                    keep = await self.script(self, r, w, body)
                finally:
                    self.active -= 1
                    self._bump()
                if not keep:
                    return
        except ConnectionError:
            return
        finally:
            self._writers.discard(w)
            w.close()

    async def until_closed(self, r: asyncio.StreamReader) -> bool:
        """Wait for the gateway to close the connection (counted in ``aborted``)."""
        with contextlib.suppress(ConnectionError):
            while await r.read(1024):
                pass
        self.aborted += 1
        self._bump()
        return False


ANSWER = b'{"object":"chat.completion","choices":[{"message":{"content":"ok"}}]}'
EVENT = b'data: {"choices":[{"delta":{"content":"t"}}]}\n\n'


async def ok(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER))
    return True


async def hang(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
    """Never answer; return when the gateway closes the connection."""
    return await e.until_closed(r)


async def hold(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
    """Answer once ``e.release`` is set (or stop when the gateway closes the connection)."""
    closed = asyncio.ensure_future(e.until_closed(r))
    released = asyncio.ensure_future(e.release.wait())
    done, _ = await asyncio.wait({closed, released}, return_when=asyncio.FIRST_COMPLETED)
    if closed in done:
        released.cancel()
        return False
    closed.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await closed
    return await ok(e, r, w, body)


async def server_error(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
    err = b'{"error":{"message":"kernel panic in sampler","type":"server_error","code":500}}'
    w.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: %d\r\n\r\n%s" % (len(err), err))
    return True


@contextlib.contextmanager
def blackhole() -> Iterator[int]:
    """A loopback port that never completes a TCP handshake: a listener whose accept
    queue is full, so the kernel drops each further SYN (tcp_abort_on_overflow=0,
    Linux's default; the connect then only times out)."""
    ls = socket.socket()
    fill: list[socket.socket] = []
    try:
        ls.bind(("127.0.0.1", 0))
        ls.listen(0)
        port = ls.getsockname()[1]
        for _ in range(3):  # (backlog 0 holds one; the rest wait in SYN retries)
            s = socket.socket()
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(("127.0.0.1", port))
            fill.append(s)
        probe = socket.socket()
        probe.settimeout(0.2)
        try:
            probe.connect(("127.0.0.1", port))
        except TimeoutError:
            pass
        else:  # pragma: no cover - a kernel set to answer a full queue otherwise
            pytest.skip("this kernel completes handshakes on a full accept queue")
        finally:
            probe.close()
        yield port
    finally:
        for s in fill:
            s.close()
        ls.close()


def dead_port() -> int:
    """A loopback port nobody listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def gateway(replicas: list[tuple[str, int, str]], **extra: Any) -> AsyncIterator[GatewayRuntime]:
    """A gateway over ``(id, port, engine)`` replicas serving model ``m``."""
    upstream = {"first_byte_timeout": "2s", "read_timeout": "2s", "connect_timeout": "500ms", **extra.pop("upstream", {})}
    cfg = load(
        {
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "endpoints": [
                {"id": rid, "url": f"http://127.0.0.1:{port}", "model": "m", "engine": engine}
                for rid, port, engine in replicas
            ],
            "scrape": {"interval": "100ms"},
            "upstream": upstream,
            **extra,
        }
    )
    rt = GatewayRuntime(cfg)
    await rt.start()
    tasks = len(gateway_tasks())
    try:
        yield rt
        # nothing left behind: no request in flight, no call, no connect task
        assert rt.registry is not None and rt.gateway is not None
        await until(lambda: rt.gateway.active_calls == 0 and all(  # type: ignore[union-attr]
            ep.inflight == 0 for ep in rt.registry.endpoints.values()  # type: ignore[union-attr]
        ))
        await until(lambda: len(gateway_tasks()) <= tasks)
    finally:
        await rt.stop()


def gateway_tasks() -> set[asyncio.Task[Any]]:
    """The loop's tasks but the engines' (their connections outlive a request)."""
    return {t for t in asyncio.all_tasks() if "RawEngine" not in repr(t.get_coro())}


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll a condition of the gateway's own state (it has no event to await)."""
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)


def chat(stream: bool = False) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream})


async def send(
    port: int, body: bytes, headers: bytes = b""
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n%s\r\n%s" % (len(body), headers, body)
    )
    return r, w


async def read_head(r: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    lines = head.split(b"\r\n")
    hdrs = {}
    for line in lines[1:]:
        if line:
            k, v = line.split(b":", 1)
            hdrs[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), hdrs


async def read_chunk(r: asyncio.StreamReader) -> bytes | None:
    """One chunk's data; ``None`` for the last (zero) chunk."""
    size = int((await asyncio.wait_for(r.readline(), 10)).strip(), 16)
    if size == 0:
        await r.readline()
        return None
    data = await r.readexactly(size)
    await r.readexactly(2)
    return data


async def answer(r: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    status, hdrs = await read_head(r)
    if b"content-length" in hdrs:
        return status, hdrs, await asyncio.wait_for(r.readexactly(int(hdrs[b"content-length"])), 10)
    data = b""
    for _ in range(10_000):
        chunk = await read_chunk(r)
        if chunk is None:
            break
        data += chunk
    return status, hdrs, data


async def post(port: int, body: bytes, headers: bytes = b"") -> tuple[int, dict[bytes, bytes], bytes]:
    r, w = await send(port, body, headers)
    try:
        return await answer(r)
    finally:
        w.close()


async def metric(rt: GatewayRuntime, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples whose labels include ``labels``, as the admin port
    exports them; ``None`` when it exports none (absent is not zero)."""
    assert rt.admin_addr is not None
    r, w = await asyncio.open_connection("127.0.0.1", rt.admin_addr[1])
    try:
        w.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        _, _, text = await answer(r)
    finally:
        w.close()
    total: float | None = None
    for m in re.finditer(rb"^%s\{([^}]*)\} (\S+)$" % re.escape(name.encode()), text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1).decode()))
        if all(got.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(2))
    return total


# -- read timeout after the first byte (and the sweep's precision) --


async def test_stream_read_timeout_after_the_first_byte_fires_within_two_sweeps() -> None:
    read_timeout = 0.4

    async def one_event_then_silence(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, b: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        w.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
        return await e.until_closed(r)

    e = RawEngine(one_event_then_silence)
    await e.start()
    try:
        async with gateway([("a", e.port, "vllm")], upstream={"read_timeout": f"{read_timeout}s"}) as rt:
            loop = asyncio.get_running_loop()
            r, w = await send(rt.listen_addr[1], chat(stream=True))  # type: ignore[index]
            try:
                status, hdrs = await read_head(r)
                assert status == 200 and hdrs[b"content-type"] == b"text/event-stream"
                assert await read_chunk(r) == EVENT
                first = loop.time()
                cut = await read_chunk(r)
                waited = loop.time() - first
                assert await read_chunk(r) is None  # the stream ends properly after the error event
            finally:
                w.close()
            assert cut is not None and b'"code":"upstream_timeout"' in cut and b"[DONE]" not in cut
            # The documented precision: [read_timeout, read_timeout + 2 ticks] after the last byte
            # (the client saw the byte a little after the gateway did, hence the small lower margin).
            assert read_timeout - 0.03 <= waited <= read_timeout + 2 * TICK + LOOP_SLACK, waited
            await e.wait(lambda: e.aborted == 1)  # the engine learnt to stop
            assert await metric(rt, "llmgw_upstream_errors_total", replica="a", kind="read_timeout") == 1
            assert await metric(rt, "llmgw_retries_total") == 0
    finally:
        await e.stop()


async def test_stream_that_keeps_sending_outlives_its_read_timeout() -> None:
    read_timeout = 0.25

    async def slow_events(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, b: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(8):  # 8 x 0.1 s: three read timeouts long, never silent for one
            w.write(b"%x\r\n%s\r\n" % (len(EVENT), EVENT))
            await asyncio.sleep(0.1)
        done = b"data: [DONE]\n\n"
        w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        return True

    e = RawEngine(slow_events)
    await e.start()
    try:
        async with gateway([("a", e.port, "vllm")], upstream={"read_timeout": f"{read_timeout}s"}) as rt:
            status, _, data = await post(rt.listen_addr[1], chat(stream=True))  # type: ignore[index]
            assert status == 200
            assert data == EVENT * 8 + b"data: [DONE]\n\n"
            assert await metric(rt, "llmgw_upstream_errors_total") == 0
    finally:
        await e.stop()


async def test_buffered_answer_read_timeout_after_the_first_byte_is_502() -> None:
    read_timeout = 0.3

    async def half_then_silence(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, b: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER))
        w.write(ANSWER[:10])
        return await e.until_closed(r)

    e = RawEngine(half_then_silence)
    await e.start()
    try:
        async with gateway([("a", e.port, "vllm")], upstream={"read_timeout": f"{read_timeout}s"}) as rt:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            status, hdrs, data = await post(rt.listen_addr[1], chat())  # type: ignore[index]
            waited = loop.time() - t0
            assert status == 502, data
            err = orjson.loads(data)["error"]
            assert err["code"] == "bad_gateway" and "stopped sending" in err["message"]
            assert hdrs[b"x-request-id"]
            # (measured from the request, so it includes the engine's answer time: small)
            assert read_timeout - CLOCK_STEP <= waited <= read_timeout + 2 * TICK + LOOP_SLACK, waited
            await e.wait(lambda: e.aborted == 1)
            assert await metric(rt, "llmgw_upstream_errors_total", replica="a", kind="read_timeout") == 1
            assert await metric(rt, "llmgw_requests_total", status_class="5xx") == 1
    finally:
        await e.stop()


async def test_buffered_answer_that_trickles_in_outlives_its_read_timeout() -> None:
    """read_timeout is the longest *silence*: body bytes of a non-streamed answer move it on too."""
    read_timeout = 0.25

    async def trickle(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, b: bytes) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(ANSWER))
        step = len(ANSWER) // 6 + 1
        for i in range(0, len(ANSWER), step):  # ~6 x 0.1 s: longer than a read timeout in all
            w.write(ANSWER[i : i + step])
            await asyncio.sleep(0.1)
        return True

    e = RawEngine(trickle)
    await e.start()
    try:
        async with gateway([("a", e.port, "vllm")], upstream={"read_timeout": f"{read_timeout}s"}) as rt:
            status, _, data = await post(rt.listen_addr[1], chat())  # type: ignore[index]
            assert status == 200, data
            assert data == ANSWER
            assert await metric(rt, "llmgw_upstream_errors_total") == 0
    finally:
        await e.stop()


# -- connect timeout through the gateway --


async def test_connect_timeout_alone_is_504_after_connect_timeout() -> None:
    with blackhole() as port:
        async with gateway([("bh", port, "external")], upstream={"connect_timeout": "300ms"}) as rt:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            status, _hdrs, data = await post(rt.listen_addr[1], chat())  # type: ignore[index]
            waited = loop.time() - t0
            assert status == 504, data
            err = orjson.loads(data)["error"]
            assert err["code"] == "gateway_timeout" and "did not accept a connection" in err["message"]
            assert 0.3 - CLOCK_STEP <= waited <= 0.3 + LOOP_SLACK + 0.2, waited
            assert await metric(rt, "llmgw_upstream_errors_total", replica="bh", kind="connect_timeout") == 1
            assert await metric(rt, "llmgw_requests_total", status_class="5xx") == 1
            assert rt.registry is not None and rt.registry.endpoints["bh"].pool.open_connections == 0


async def test_connect_timeout_is_retried_on_another_replica() -> None:
    good = RawEngine()
    await good.start()
    try:
        with blackhole() as port:
            replicas = [("bh", port, "external"), ("good", good.port, "external")]
            async with gateway(replicas, routing={"strategy": "round_robin"}, upstream={"connect_timeout": "200ms"}) as rt:
                for _ in range(2):  # round robin: one of the two goes to the black hole first
                    status, hdrs, data = await post(rt.listen_addr[1], chat())  # type: ignore[index]
                    assert status == 200, data
                    assert hdrs[b"x-llmgw-replica"] == b"good"
                assert good.requests == 2
                assert await metric(rt, "llmgw_upstream_errors_total", replica="bh", kind="connect_timeout") == 1
                assert await metric(rt, "llmgw_retries_total", model="m") == 1
                assert await metric(rt, "llmgw_requests_total", status_class="2xx") == 2
    finally:
        await good.stop()


# -- a client leaving during connect, during a retry --


async def test_client_leaving_during_connect_cancels_it() -> None:
    with blackhole() as port:
        async with gateway([("bh", port, "external")], upstream={"connect_timeout": "10s"}) as rt:
            assert rt.registry is not None
            ep = rt.registry.endpoints["bh"]
            _r, w = await send(rt.listen_addr[1], chat())  # type: ignore[index]
            await until(lambda: ep.inflight == 1)  # dispatched: connecting
            w.close()
            await until(lambda: ep.inflight == 0)  # long before the 10 s connect timeout
            assert ep.pool.open_connections == 0
            # Not the replica's fault: no error, the breaker untouched.
            assert await metric(rt, "llmgw_upstream_errors_total") == 0
            assert ep.breaker_state == "closed"
            assert await metric(rt, "llmgw_endpoint_consecutive_failures", replica="bh") == 0
            assert await metric(rt, "llmgw_requests_total", model="m") == 1


async def test_client_leaving_during_a_retry_frees_its_retry_budget() -> None:
    """Each retry in flight holds a slot of the retry budget (3 at least); a client
    leaving while its retry runs must give the slot back, or retries stop for good."""
    held = RawEngine(hang)
    await held.start()
    try:
        # (a connect that times out: a refused one marks its replica down and retries off the budget)
        bh = contextlib.ExitStack()
        replicas = [("dead", bh.enter_context(blackhole()), "external"), ("held", held.port, "external")]
        extra: dict[str, Any] = {
            "routing": {"strategy": "round_robin"},
            "retries": {"attempts": 1, "budget": 0.0},  # the budget's floor alone: 3 in flight
            "breaker": {"failures": 1000},
            "upstream": {"connect_timeout": "50ms"},
        }
        async with gateway(replicas, **extra) as rt:
            port = rt.listen_addr[1]  # type: ignore[index]
            retried = 0
            for i in range(12):
                _r, w = await send(port, chat())
                await held.wait(lambda: held.active == 1)  # (a 502 instead would hang here: no retry)
                w.close()
                await held.wait(lambda n=i + 1: held.aborted == n)  # type: ignore[misc]
                retried = int(await metric(rt, "llmgw_retries_total", model="m") or 0)
                if retried > 4:
                    break
            assert retried > 4, retried  # more clients left mid-retry than the budget holds
            assert await metric(rt, "llmgw_upstream_errors_total", replica="dead", kind="connect_timeout") == retried
            assert await metric(rt, "llmgw_upstream_errors_total", replica="held") == 0
    finally:
        bh.close()
        await held.stop()


# -- the retry budget running out --


async def test_retry_budget_exhausted_answers_the_failure() -> None:
    held = RawEngine(hold)
    await held.start()
    bh = contextlib.ExitStack()
    try:
        # (connects that time out: a refused one marks its replica down and retries off the budget)
        replicas = [("dead", bh.enter_context(blackhole()), "external"), ("held", held.port, "external")]
        extra: dict[str, Any] = {
            "routing": {"strategy": "round_robin"},
            "retries": {"attempts": 1, "budget": 0.0},  # 3 retries in flight at most
            "breaker": {"failures": 1000},
            "upstream": {"connect_timeout": "50ms"},
        }
        async with gateway(replicas, **extra) as rt:
            port = rt.listen_addr[1]  # type: ignore[index]
            waiting: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
            refused: tuple[int, dict[bytes, bytes], bytes] | None = None
            try:
                for _ in range(12):
                    r, w = await send(port, chat())
                    waiting.append((r, w))
                    # either it reaches the held replica (straight, or retried there) ...
                    n = len(waiting)
                    reached = asyncio.ensure_future(held.wait(lambda n=n: held.requests >= n))  # type: ignore[misc]
                    answered = asyncio.ensure_future(answer(r))
                    done, _ = await asyncio.wait({reached, answered}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
                    if answered in done:  # ... or it was answered at once: its retry was refused
                        reached.cancel()
                        refused = answered.result()
                        waiting.pop()
                        w.close()
                        break
                    answered.cancel()
                    assert reached in done
                assert refused is not None, "the retry budget never ran out"
                assert await metric(rt, "llmgw_retries_total", model="m") == 3  # the budget's floor
                status, hdrs, data = refused
                assert status == 504
                err = orjson.loads(data)["error"]
                assert "did not accept a connection in time" in err["message"]
                assert hdrs[b"x-request-id"]
                # The held ones finish; the budget is free again: the next failure is retried.
                held.release.set()
                for r, w in waiting:
                    status, _, _ = await answer(r)
                    assert status == 200
                    w.close()
                waiting.clear()
                statuses = [(await post(port, chat()))[0] for _ in range(2)]  # (one goes to dead first)
                assert statuses == [200, 200]
                assert await metric(rt, "llmgw_retries_total", model="m") == 4
            finally:
                for _, w in waiting:
                    w.close()
    finally:
        bh.close()
        await held.stop()


async def test_a_refused_connection_marks_the_replica_down_and_its_retry_is_free() -> None:
    """A replica that just died, with requests connecting to it: each refused one goes on to
    another replica (the budget's floor of 3 would have answered the rest 502), and the replica
    is down at once, so the requests after them go straight to the living."""
    held = RawEngine(hold)
    await held.start()
    try:
        replicas = [("dead", dead_port(), "external"), ("held", held.port, "external")]
        extra: dict[str, Any] = {
            "routing": {"strategy": "round_robin"},
            "retries": {"attempts": 1, "budget": 0.0},
            "breaker": {"failures": 1000},
            # (a first byte not waited for here: a loaded machine may take seconds to bring all 8 in)
            "upstream": {"first_byte_timeout": "30s", "read_timeout": "30s"},
        }
        async with gateway(replicas, **extra) as rt:
            assert rt.registry is not None
            port = rt.listen_addr[1]  # type: ignore[index]
            # (8: within what one blind replica takes before the pool counts as saturated and queues)
            clients = [await send(port, chat()) for _ in range(8)]
            try:
                await held.wait(lambda: held.requests == 8, timeout=15)
                dead = rt.registry.endpoints["dead"]
                assert dead.state.down and dead.unusable_reason(time.monotonic()) == "unreachable"
                held.release.set()
                assert [(await answer(r))[0] for r, _ in clients] == [200] * 8
            finally:
                for _, w in clients:
                    w.close()
            retried = await metric(rt, "llmgw_retries_total", model="m")
            assert retried == await metric(rt, "llmgw_upstream_errors_total", replica="dead", kind="connect_refused")
            assert 1 <= retried <= 8
    finally:
        await held.stop()


# -- a non-retryable 5xx --


async def test_non_retryable_5xx_is_relayed_normalised_and_not_retried() -> None:
    bad, good = RawEngine(server_error), RawEngine()
    await bad.start()
    await good.start()
    try:
        replicas = [("bad", bad.port, "vllm"), ("good", good.port, "vllm")]
        async with gateway(replicas, routing={"strategy": "round_robin"}) as rt:
            status, hdrs, data = await post(rt.listen_addr[1], chat())  # type: ignore[index]
            assert status == 500
            assert hdrs[b"content-type"] == b"application/json"
            err = orjson.loads(data)["error"]
            assert err["message"] == "kernel panic in sampler"
            assert isinstance(err["code"], str)
            assert bad.requests == 1 and good.requests == 0  # not resent
            assert await metric(rt, "llmgw_upstream_errors_total", replica="bad", kind="status_5xx") == 1
            assert await metric(rt, "llmgw_retries_total") == 0
            assert await metric(rt, "llmgw_requests_total", replica="bad", status_class="5xx") == 1
            # no other replica had answered since: no verdict on the replica yet
            assert await metric(rt, "llmgw_endpoint_consecutive_failures", replica="bad") == 0
            status, hdrs, _ = await post(rt.listen_addr[1], chat())  # type: ignore[index]
            assert status == 200 and hdrs[b"x-llmgw-replica"] == b"good"
            # bad fails what good serves: now a replica failure for its breaker
            assert (await post(rt.listen_addr[1], chat()))[0] == 500  # type: ignore[index]
            assert await metric(rt, "llmgw_endpoint_consecutive_failures", replica="bad") == 1
    finally:
        await bad.stop()
        await good.stop()


def answers(raw: bytes) -> Script:
    async def script(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
        w.write(raw)
        return await e.until_closed(r)  # (the gateway drops a connection that sent it this)

    return script


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"HTTP/1.1 999 Weird\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
         "status code 999 is outside 100-599"),
        (b"HTTP/1.1 600 Weird\r\ncontent-length: 2\r\n\r\n{}", "status code 600 is outside 100-599"),
        (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n", "(101)"),
    ],
    ids=["999", "600", "101"],
)
async def test_a_malformed_answer_is_502_upstream_bad_response(raw: bytes, why: str) -> None:
    # A status outside 100-599 was relayed to the client as it came ("HTTP/1.1 999 Status"); every
    # malformed answer said "closed the connection before a complete answer", code bad_gateway
    bad = RawEngine(answers(raw))
    await bad.start()
    try:
        async with gateway([("bad", bad.port, "vllm")]) as rt:
            status, _, data = await post(rt.listen_addr[1], chat())  # type: ignore[index]
            assert status == 502, data
            err = orjson.loads(data)["error"]
            assert err["code"] == "upstream_bad_response" and err["type"] == "server_error", err
            assert err["message"].startswith("replica bad sent a malformed answer (") and why in err["message"], err
            assert bad.requests == 1  # (sent: never resent)
            assert await metric(rt, "llmgw_upstream_errors_total", replica="bad", kind="bad_response") == 1
    finally:
        await bad.stop()


async def poisoned(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
    """A healthy engine that answers 500 to a request it cannot take (as llama-server answers an
    image sent to a text model), 501 to one it does not implement, and 200 to the rest."""
    if b"poison" in body or b"unimplemented" in body:
        status = b"500 Internal Server Error" if b"poison" in body else b"501 Not Implemented"
        err = b'{"error":{"code":500,"message":"image input is not supported","type":"server_error"}}'
        w.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (status, len(err), err))
        return True
    return await ok(e, r, w, body)


def poison(what: str = "poison") -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": what}]})


async def test_one_clients_bad_requests_open_no_healthy_replicas_breaker() -> None:
    """Requests every replica answers 500 (the requests' fault: the replicas serve the rest) open no
    breaker however many come, and a 501 counts for nothing; a replica answering 500 to what its
    siblings serve still opens its breaker."""
    a, b = RawEngine(poisoned), RawEngine(poisoned)
    await a.start()
    await b.start()
    try:
        replicas = [("a", a.port, "vllm"), ("b", b.port, "vllm")]
        async with gateway(replicas, routing={"strategy": "round_robin"}, breaker={"failures": 3}) as rt:
            port = rt.listen_addr[1]  # type: ignore[index]
            assert [(await post(port, chat()))[0] for _ in range(4)] == [200] * 4  # (both have answered)
            for _ in range(12):  # (four breakers' worth each)
                status, hdrs, _ = await post(port, poison())
                assert status == 500 and b"x-should-retry" not in hdrs  # (a 500 may be the replica's: retried)
            status, hdrs, _ = await post(port, poison("unimplemented"))
            assert status == 501 and hdrs[b"x-should-retry"] == b"false"
            for rid in ("a", "b"):
                assert await metric(rt, "llmgw_endpoint_breaker_open", replica=rid) == 0
                assert await metric(rt, "llmgw_endpoint_consecutive_failures", replica=rid) == 0
                assert await metric(rt, "llmgw_upstream_errors_total", replica=rid, kind="status_5xx") >= 6
            assert [(await post(port, chat()))[0] for _ in range(4)] == [200] * 4
            # b turns bad (500 to everything) while a serves: b's breaker opens, a takes the model
            b.script = server_error
            statuses = [(await post(port, chat()))[0] for _ in range(16)]
            # (no verdict until a has answered since b's first 500 and errs at most half as often as b,
            # whose last answers were the poisoned ones too: then three, and it opens)
            assert 3 <= statuses.count(500) <= 8, statuses
            assert await metric(rt, "llmgw_endpoint_breaker_open", replica="b") == 1
            assert statuses[-4:] == [200] * 4
    finally:
        await a.stop()
        await b.stop()


async def engine_waits(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
    """429 with retry-after: 7, 500 with retry-after-ms: 2500, by the request."""
    err = b'{"error":{"message":"slow down","type":"rate_limit","code":429}}'
    head = (b"429 Too Many Requests\r\nretry-after: 7" if b"limit" in body
            else b"400 Bad Request" if b"bad" in body
            else b"500 Internal Server Error\r\nRetry-After-Ms: 2500")
    w.write(b"HTTP/1.1 %s\r\ncontent-length: %d\r\n\r\n%s" % (head, len(err), err))
    return True


async def test_the_engines_retry_after_reaches_the_client(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.access")
    e = RawEngine(engine_waits)
    await e.start()
    try:
        async with gateway([("a", e.port, "vllm")], access_log=True) as rt:
            port = rt.listen_addr[1]  # type: ignore[index]
            status, hdrs, _ = await post(port, poison("limit"))
            assert status == 429 and hdrs[b"retry-after"] == b"7" and hdrs[b"retry-after-ms"] == b"7000"
            assert b"x-should-retry" not in hdrs  # (the SDK waits the 7 s, then retries)
            status, hdrs, _ = await post(port, poison("other"))
            assert status == 500 and hdrs[b"retry-after"] == b"3" and hdrs[b"retry-after-ms"] == b"2500"
            # an engine's 400 would be refused again: not to be retried (the SDKs obey the header)
            status, hdrs, data = await post(port, poison("bad"))
            assert status == 400 and hdrs[b"x-should-retry"] == b"false" and b"retry-after" not in hdrs
            # the access log's bytes are what the client got (the normalized error), not the engine's
            logged = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "llmgw.access"]
            assert logged[-1]["status"] == 400 and logged[-1]["bytes"] == len(data) == int(hdrs[b"content-length"])
    finally:
        await e.stop()


# -- eviction of a lower band by a higher one --


async def test_higher_band_evicts_the_newest_of_a_lower_band() -> None:
    e = RawEngine(hold)
    await e.start()
    try:
        # Never scraped (external), one slot: two requests in flight saturate the pool.
        extra: dict[str, Any] = {
            "saturation": {"max_waiting": 1},
            "admission": {"queue_size": 1, "queue_timeout": "10s"},
        }
        cfg_replicas = [("a", e.port, "external")]
        async with gateway(cfg_replicas, **extra) as rt:
            port = rt.listen_addr[1]  # type: ignore[index]
            busy = [await send(port, chat()) for _ in range(2)]
            await e.wait(lambda: e.requests == 2)
            batch = await send(port, chat(), b"x-llmgw-priority: batch\r\n")
            await until_metric(rt, "llmgw_admission_queue_depth", 1.0, band="batch")
            crit = [await send(port, chat(), b"x-llmgw-priority: critical\r\n")]
            await until_metric(rt, "llmgw_admission_queue_depth", 1.0, band="critical")
            # The critical band is full: the next critical takes the batch request's place.
            crit.append(await send(port, chat(), b"x-llmgw-priority: critical\r\n"))
            status, hdrs, data = await answer(batch[0])
            batch[1].close()
            assert status == 429
            assert int(hdrs[b"retry-after"]) >= 1
            err = orjson.loads(data)["error"]
            assert err["code"] == "evicted" and "higher-priority" in err["message"]
            assert await metric(rt, "llmgw_admission_total", band="batch", outcome="rejected", reason="evicted") == 1
            assert await metric(rt, "llmgw_admission_queue_depth", band="batch") == 0
            assert await metric(rt, "llmgw_admission_queue_depth", band="critical") == 2
            assert e.requests == 2  # nothing of the queue went upstream yet
            e.release.set()
            for r, w in busy + crit:
                status, _, _ = await answer(r)
                assert status == 200
                w.close()
            assert e.requests == 4
            assert await metric(rt, "llmgw_admission_total", band="critical", outcome="dequeued") == 2
            assert await metric(rt, "llmgw_requests_total", status_class="4xx", band="batch") == 1
    finally:
        await e.stop()


async def until_metric(rt: GatewayRuntime, name: str, value: float, **labels: str) -> None:
    async with asyncio.timeout(5):
        while await metric(rt, name, **labels) != value:
            await asyncio.sleep(0.01)


# -- a half-open breaker's probe, released --


@pytest.mark.parametrize("how", ["client_leaves", "probe_answers_4xx"])
async def test_half_open_probe_is_released(how: str) -> None:
    """The probe request ends without a verdict on the replica: the probe slot is
    freed at once, so the next request probes (instead of waiting max_cooldown)."""
    mode = {"v": "fail"}

    async def scripted(e: RawEngine, r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes) -> bool:
        if mode["v"] == "fail":  # (a 502: a lone replica's answered 500 is no verdict on it)
            err = b'{"error":{"message":"upstream of the engine failed","type":"server_error","code":502}}'
            w.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: %d\r\n\r\n%s" % (len(err), err))
            return True
        if mode["v"] == "hang":
            return await e.until_closed(r)
        if mode["v"] == "4xx":
            err = b'{"error":{"message":"bad sampling params","type":"invalid_request_error","code":400}}'
            w.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(err), err))
            return True
        return await ok(e, r, w, body)

    e = RawEngine(scripted)
    await e.start()
    try:
        extra: dict[str, Any] = {"breaker": {"failures": 1, "cooldown": "200ms", "max_cooldown": "60s"}}
        async with gateway([("a", e.port, "external")], **extra) as rt:
            assert rt.registry is not None
            ep = rt.registry.endpoints["a"]
            port = rt.listen_addr[1]  # type: ignore[index]
            status, _, _ = await post(port, chat())
            assert status == 502 and ep.breaker_state == "open"
            await until(lambda: ep.state.breaker.available(time.monotonic()), 3)
            if how == "client_leaves":
                mode["v"] = "hang"
                _r, w = await send(port, chat())  # the probe
                await e.wait(lambda: e.requests == 2)
                assert ep.breaker_state == "half_open"
                w.close()
                await e.wait(lambda: e.aborted == 1)
                await until(lambda: ep.inflight == 0)
                assert ep.breaker_state == "half_open"  # no verdict ...
            else:
                mode["v"] = "4xx"
                status, _, _ = await post(port, chat())  # the probe: the replica answered
                assert status == 400
            mode["v"] = "ok"
            # ... and the slot is free: the next request probes now, not after max_cooldown
            status, _, _ = await post(port, chat())
            assert status == 200
            assert ep.breaker_state == "closed"
            assert await metric(rt, "llmgw_breaker_transitions_total", replica="a", state="half_open") == 1
            assert await metric(rt, "llmgw_breaker_transitions_total", replica="a", state="closed") == 1
            assert await metric(rt, "llmgw_upstream_errors_total", replica="a") == 1  # the 502 alone
    finally:
        await e.stop()
