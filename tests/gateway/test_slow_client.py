"""A client that reads slower than its replica sends, over real sockets.

A slow client pauses the replica's connection (flow control: llmgw stops reading it
while the client's socket is full), so the replica goes unread, not silent. Its
``upstream.read_timeout`` must not then be blamed on the replica: no
``read_timeout`` upstream error, no failure towards its breaker (a few stalled
clients would otherwise open the breaker of a healthy replica for everyone). A
client that takes no bytes for that long is cut as gone, and the replica's
connection is closed so the engine stops generating.

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
from collections.abc import AsyncIterator, Callable

import orjson
import pytest

from llmgw.config import load
from llmgw.gateway.app import GatewayRuntime

EVENT = b'data: {"choices":[{"delta":{"content":"' + b"x" * 4000 + b'"}}]}\n\n'
# Far more than the sockets' buffers hold between the gateway and a client that reads nothing
# (loopback send buffers grow to a few MiB): the gateway's writes back up and it pauses the replica.
EVENTS = 6000  # ~24 MB
READ_TIMEOUT = 0.5


class FloodEngine:
    """Answers each POST with an SSE stream of ``EVENTS`` events written as fast as it can."""

    def __init__(self, stream: bool = True) -> None:
        self.stream = stream  # False: one large JSON answer with a Content-Length, relayed as it comes
        self.port = 0
        self.closed_by_gateway = asyncio.Event()
        self.finished = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    n = int(line[15:])
            if n:
                await r.readexactly(n)
            if head.split()[1] == b"/metrics":
                page = b'vllm:num_requests_waiting{model_name="m"} 0\nvllm:num_requests_running{model_name="m"} 0\n'
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (len(page), page))
                await w.drain()
                return
            if not self.stream:
                piece = b" " * 65536
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                        % (len(piece) * 400 + 2))
                for _ in range(400):  # ~26 MB, past upstream.max_buffered_body: relayed
                    w.write(piece)
                    await w.drain()
                w.write(b"{}")
                await w.drain()
                self.finished += 1
                return
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            chunk = b"%x\r\n%s\r\n" % (len(EVENT), EVENT)
            for _ in range(EVENTS):
                w.write(chunk)
                await w.drain()  # (blocks while the gateway has paused reading: the engine is not silent)
            done = b"data: [DONE]\n\n"
            w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await w.drain()
            self.finished += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_gateway.set()
        finally:
            w.close()


@contextlib.asynccontextmanager
async def gateway(port: int, read_timeout: float = READ_TIMEOUT) -> AsyncIterator[GatewayRuntime]:
    cfg = load({
        "listen": "127.0.0.1:0",
        "admin": "127.0.0.1:0",
        "endpoints": [{"id": "a", "url": f"http://127.0.0.1:{port}", "model": "m", "engine": "vllm"}],
        "scrape": {"interval": "100ms"},
        "upstream": {"read_timeout": f"{read_timeout}s", "first_byte_timeout": "2s"},
    })
    rt = GatewayRuntime(cfg)
    await rt.start()
    try:
        yield rt
        assert rt.gateway is not None and rt.registry is not None
        await until(lambda: rt.gateway.active_calls == 0 and all(  # type: ignore[union-attr]
            ep.inflight == 0 for ep in rt.registry.endpoints.values()))  # type: ignore[union-attr]
    finally:
        await rt.stop()


async def until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)


async def metric(rt: GatewayRuntime, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples with ``labels`` on the admin port (0 when none)."""
    assert rt.admin_addr is not None
    loop = asyncio.get_running_loop()

    def get() -> bytes:
        with socket.create_connection(("127.0.0.1", rt.admin_addr[1]), timeout=5) as s:  # type: ignore[index]
            s.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            out = b""
            for _ in range(10_000):
                d = s.recv(65536)
                if not d:
                    break
                out += d
            return out

    text = await loop.run_in_executor(None, get)
    total = 0.0
    for m in re.finditer(rb"^%s\{([^}]*)\} (\S+)$" % re.escape(name.encode()), text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1).decode()))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def slow_client(port: int, stall: float, rcvbuf: int = 4096) -> tuple[bytes, bool]:
    """Send a streamed chat request, read its head, take nothing for ``stall`` seconds, then read on
    (``rcvbuf``: the socket's receive buffer; 0 leaves the system's).

    Returns what came and whether the stream ended properly (the last chunk came).
    """
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(10)
    try:
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        out = s.recv(1024)
        time.sleep(stall)
        for _ in range(100_000):
            try:
                d = s.recv(1 << 20)
            except (ConnectionResetError, TimeoutError):
                break
            if not d:
                break
            out += d
            if out.endswith((b"\r\n0\r\n\r\n", b" {}")):
                return out, True
        return out, False
    finally:
        s.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "relayed"])
async def test_a_stalled_client_is_not_blamed_on_its_replica(stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.server")
    e = FloodEngine(stream)
    await e.start()
    try:
        async with gateway(e.port) as rt:
            loop = asyncio.get_running_loop()
            out, whole = await loop.run_in_executor(None, slow_client, rt.listen_addr[1], 4 * READ_TIMEOUT)  # type: ignore[index]
            assert out.startswith(b"HTTP/1.1 200 ")
            assert not whole  # (cut as gone: a client that took nothing for read_timeout)
            # said in the log, with the request's id (the access log's status is the 200 that began)
            rid = re.search(rb"x-request-id: (\S+)", out, re.I)
            assert rid is not None
            said = [r.getMessage() for r in caplog.records if "read nothing of the answer" in r.getMessage()]
            assert len(said) == 1 and rid.group(1).decode() in said[0], said
            # The replica kept sending: no "replica stopped sending" told to anyone or counted.
            assert b"upstream_timeout" not in out
            assert await metric(rt, "llmgw_upstream_errors_total", replica="a", kind="read_timeout") == 0
            assert await metric(rt, "llmgw_endpoint_consecutive_failures", replica="a") == 0
            ep = rt.registry.endpoints["a"]  # type: ignore[union-attr]
            assert ep.failures == 0
            # The engine's connection was closed, so it stops generating.
            await asyncio.wait_for(e.closed_by_gateway.wait(), 5)
            assert e.finished == 0
    finally:
        await e.stop()


async def test_a_client_that_pauses_less_than_read_timeout_gets_the_whole_stream() -> None:
    # (the replica is paused while the client takes nothing, and resumed when it reads on)
    e = FloodEngine()
    await e.start()
    try:
        async with gateway(e.port, read_timeout=4.0) as rt:
            loop = asyncio.get_running_loop()
            out, whole = await loop.run_in_executor(None, slow_client, rt.listen_addr[1], 1.0, 0)  # type: ignore[index]
            assert whole, out[-300:]
            assert out.count(b"data: {") == EVENTS and b"data: [DONE]" in out
            assert await metric(rt, "llmgw_upstream_errors_total", replica="a") == 0
    finally:
        await e.stop()

