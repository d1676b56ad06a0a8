"""``llmgw.http.client``: the upstream pool against real local servers.

Reuse and idling run against llmgw's own :class:`HTTPServer`; response framing
runs against a raw asyncio server that writes exactly the bytes a test gives it.
Each test runs on asyncio's loop and on uvloop's (the gateway's).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from llmgw.http.client import UpstreamConnection, UpstreamPool
from llmgw.http.parser import upstream_head
from llmgw.http.server import HTTPServer, ServerLimits

WAIT = 5.0


class Exchange:
    """A sink that records one exchange."""

    def __init__(self) -> None:
        self.head: Any = None
        self.body: list[bytes] = []
        self.done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def on_response_head(self, resp: Any) -> None:
        self.head = resp

    def on_response_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_response_end(self) -> None:
        if not self.done.done():
            self.done.set_result("end")

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(exc)

    async def result(self) -> Any:
        return await asyncio.wait_for(asyncio.shield(self.done), WAIT)


async def exchange(conn: UpstreamConnection, path: bytes = b"/", body: bytes = b"") -> Exchange:
    ex = Exchange()
    conn.send(ex, upstream_head(b"POST" if body else b"GET", path, b"up", b"", len(body) if body else -1), body)
    await ex.result()
    return ex


class Echo:
    def handle(self, req: Any, w: Any) -> None:
        if req.path == b"/close":
            w.keep_alive = False
        w.send(200, b"echo:" + req.target + b":" + req.body, ())


@contextlib.asynccontextmanager
async def http_server(**limits: Any) -> AsyncIterator[tuple[HTTPServer, int]]:
    server = HTTPServer(Echo(), ServerLimits(**limits), name="upstream")
    _, port = await server.listen("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await asyncio.wait_for(server.close(1.0), WAIT)


@contextlib.asynccontextmanager
async def raw_server(*replies: bytes, close_after: bool = False) -> AsyncIterator[int]:
    """Answers the n-th request head on each connection with ``replies[n]``, byte for byte."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        writers.append(w)
        try:
            for reply in replies:
                await r.readuntil(b"\r\n\r\n")
                w.write(reply)
                await w.drain()
            if close_after:
                w.close()
            else:
                await r.read()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for w in writers:
            w.close()
        server.close()
        await asyncio.wait_for(server.wait_closed(), WAIT)


@contextlib.asynccontextmanager
async def pool_to(port: int, **kw: Any) -> AsyncIterator[UpstreamPool]:
    pool = UpstreamPool("127.0.0.1", port, **kw)
    try:
        yield pool
    finally:
        pool.close()
        await asyncio.sleep(0.01)  # let the transports finish closing


async def until(cond: Callable[[], bool], within: float = WAIT) -> None:
    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(wait(), within)


# -- reuse and idling -----------------------------------------------------------------


async def test_keep_alive_connection_is_reused() -> None:
    async with http_server() as (server, port), pool_to(port) as pool:
        conn = await pool.acquire()
        ex = await exchange(conn, b"/a")
        assert ex.head.status == 200 and b"".join(ex.body) == b"echo:/a:"
        conn.release()
        assert pool.idle_connections == 1 and pool.open_connections == 1
        again = await pool.acquire()
        assert again is conn
        ex = await exchange(again, b"/b", b"xyz")
        assert b"".join(ex.body) == b"echo:/b:xyz"
        assert again.requests == 2
        again.release()
        assert len(server.connections) == 1


async def test_idle_connections_are_swept() -> None:
    async with http_server() as (server, port), pool_to(port, idle_timeout=0.2) as pool:
        conns = [await pool.acquire() for _ in range(2)]
        for c in conns:
            await exchange(c)
            c.release()
        assert pool.idle_connections == 2
        await until(lambda: pool.open_connections == 0, within=2.0)
        assert pool.idle_connections == 0
        await until(lambda: not server.connections, within=2.0)


async def test_connection_closed_by_server_while_idle_is_not_reused() -> None:
    async with http_server(keepalive_timeout=0.1) as (_, port), pool_to(port) as pool:
        conn = await pool.acquire()
        await exchange(conn)
        conn.release()
        assert pool.idle_connections == 1
        await until(lambda: pool.open_connections == 0, within=2.0)
        assert pool.take_idle() is None
        fresh = await pool.acquire()
        assert fresh is not conn
        assert (await exchange(fresh)).head.status == 200


async def test_connection_close_response_is_not_pooled() -> None:
    async with http_server() as (_, port), pool_to(port) as pool:
        conn = await pool.acquire()
        ex = await exchange(conn, b"/close")
        assert ex.head.keep_alive is False
        conn.release()
        assert pool.idle_connections == 0
        await until(lambda: pool.open_connections == 0)


async def test_max_idle() -> None:
    async with http_server() as (_, port), pool_to(port, max_idle=1) as pool:
        a, b = await pool.acquire(), await pool.acquire()
        for c in (a, b):
            await exchange(c)
            c.release()
        assert pool.idle_connections == 1
        await until(lambda: pool.open_connections == 1)


async def test_most_recently_used_is_taken_first() -> None:
    async with http_server() as (_, port), pool_to(port) as pool:
        a, b = await pool.acquire(), await pool.acquire()
        for c in (a, b):
            await exchange(c)
            c.release()
        assert pool.take_idle() is b
        assert pool.take_idle() is a
        assert pool.take_idle() is None


# -- connect errors ------------------------------------------------------------------------


async def test_connect_refused() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    async with pool_to(port) as pool:
        with pytest.raises(OSError):
            await pool.connect()
        assert pool.open_connections == 0


async def test_connect_timeout() -> None:
    # A listener whose accept queue is full drops new SYNs: the connect hangs.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            fillers.append(c)
        await asyncio.sleep(0.05)
        async with pool_to(port, connect_timeout=0.2) as pool:
            with pytest.raises(TimeoutError, match="timed out"):
                await pool.connect()
    finally:
        for c in fillers:
            c.close()
        listener.close()


async def test_closed_pool_refuses_and_cuts_in_flight() -> None:
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc") as port:
        pool = UpstreamPool("127.0.0.1", port)
        conn = await pool.acquire()
        ex = Exchange()
        conn.send(ex, b"GET / HTTP/1.1\r\n\r\n", b"")
        await until(lambda: ex.head is not None)
        pool.close()
        assert isinstance(await ex.result(), ConnectionError)
        with pytest.raises(ConnectionError, match="closed"):
            await pool.connect()


async def test_send_after_the_replica_closed_is_a_lost_upstream() -> None:
    # Regression: an assertion failed when the replica closed between connect()
    # and send() (the proxy awaits in between).
    async with raw_server(close_after=True) as port, pool_to(port) as pool:
        conn = await pool.acquire()
        await until(lambda: conn.transport is None)
        ex = Exchange()
        conn.send(ex, b"GET / HTTP/1.1\r\n\r\n", b"")
        assert isinstance(await ex.result(), ConnectionResetError)
        assert conn.sink is None


# -- response framing -------------------------------------------------------------------------


async def test_content_length_response() -> None:
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello") as port, pool_to(port) as pool:
        conn = await pool.acquire()
        ex = await exchange(conn)
        assert await ex.result() == "end"
        assert (ex.head.status, ex.head.content_length, b"".join(ex.body)) == (200, 5, b"hello")
        assert ex.head.forward == b"X-A: 1\r\n"
        conn.release()
        assert pool.idle_connections == 1


async def test_chunked_response() -> None:
    reply = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n"
        b"7\r\ndata: 1\r\n2\r\n\n\n\r\n0\r\n\r\n"
    )
    async with raw_server(reply, reply) as port, pool_to(port) as pool:
        conn = await pool.acquire()
        for _ in range(2):  # and the connection is reusable after it
            ex = await exchange(conn)
            assert await ex.result() == "end"
            assert ex.head.chunked and ex.head.event_stream
            assert b"".join(ex.body) == b"data: 1\n\n"
            conn.release()
            assert pool.take_idle() is conn


async def test_close_delimited_response() -> None:
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close", close_after=True) as port, \
            pool_to(port) as pool:
        conn = await pool.acquire()
        ex = await exchange(conn)
        assert await ex.result() == "end"
        assert b"".join(ex.body) == b"until close"
        assert not conn.reusable
        conn.release()
        assert pool.idle_connections == 0


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
        b"HTTP/1.1 200 OK\r\nX-Half: ",
        b"",
    ],
    ids=["short-cl", "short-chunk", "in-head", "nothing"],
)
async def test_truncated_response_is_a_lost_upstream(reply: bytes) -> None:
    async with raw_server(reply, close_after=True) as port, pool_to(port) as pool:
        conn = await pool.acquire()
        ex = Exchange()
        conn.send(ex, b"GET / HTTP/1.1\r\n\r\n", b"")
        assert isinstance(await ex.result(), ConnectionError)
        await until(lambda: pool.open_connections == 0)


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n",
    ],
    ids=["not-http", "cl-te", "101"],
)
async def test_malformed_response_is_a_lost_upstream(reply: bytes) -> None:
    async with raw_server(reply) as port, pool_to(port) as pool:
        conn = await pool.acquire()
        ex = Exchange()
        conn.send(ex, b"GET / HTTP/1.1\r\n\r\n", b"")
        err = await ex.result()
        assert isinstance(err, ValueError), err
        assert ex.head is None
        assert not conn.reusable
        await until(lambda: pool.open_connections == 0)


async def test_interim_response_is_skipped() -> None:
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with raw_server(reply) as port, pool_to(port) as pool:
        conn = await pool.acquire()
        ex = await exchange(conn)
        assert await ex.result() == "end"
        assert ex.head.status == 200 and b"".join(ex.body) == b"ok"


async def test_unsolicited_bytes_drop_an_idle_connection() -> None:
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as port, pool_to(port) as pool:
        conn = await pool.acquire()
        await exchange(conn)
        conn.release()
        assert pool.idle_connections == 1
        # bytes the replica sends later that nobody asked for: out of step
        conn.data_received(b"HTTP/1.1 200 OK\r\n")
        await until(lambda: pool.open_connections == 0)
        assert pool.take_idle() is None


async def test_reading_pauses_and_resumes() -> None:
    async with raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok") as port, pool_to(port) as pool:
        conn = await pool.acquire()
        conn.pause_reading()
        ex = Exchange()
        conn.send(ex, b"GET / HTTP/1.1\r\n\r\n", b"")
        await asyncio.sleep(0.1)
        assert not ex.done.done()  # nothing read while paused
        conn.resume_reading()
        assert await ex.result() == "end"
        conn.pause_reading()
        conn.release()  # a released connection reads again (to notice a close)
        assert pool.take_idle() is conn


async def test_runs_on_the_chosen_loop(loop_kind: str) -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop) == (loop_kind == "uvloop")


# -- both loops (as in test_server.py) ------------------------------------------------------

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def on_both_loops(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run the async test ``fn`` on asyncio's loop and on uvloop's (see test_server.py)."""
    sig = inspect.signature(fn)
    wants_kind = "loop_kind" in sig.parameters

    def test(loop_kind: str, **kwargs: Any) -> None:
        if wants_kind:
            kwargs["loop_kind"] = loop_kind
        with asyncio.Runner(loop_factory=LOOPS[loop_kind]) as runner:
            runner.run(asyncio.wait_for(fn(**kwargs), 60))

    params = [p for p in sig.parameters.values() if p.name != "loop_kind"]
    test.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=[inspect.Parameter("loop_kind", inspect.Parameter.POSITIONAL_OR_KEYWORD), *params]
    )
    test.__name__ = fn.__name__
    test.__qualname__ = fn.__qualname__
    test.__doc__ = fn.__doc__
    test.pytestmark = [*getattr(fn, "pytestmark", []), pytest.mark.parametrize("loop_kind", list(LOOPS))]  # type: ignore[attr-defined]
    return test


for _name, _fn in list(globals().items()):
    if _name.startswith("test_") and inspect.iscoroutinefunction(_fn):
        globals()[_name] = on_both_loops(_fn)
