"""``llmgw.http.server`` on real sockets on 127.0.0.1, under asyncio and uvloop.

A small app on :class:`HTTPServer` answers by path; raw sockets speak to it so
that every byte on the wire is the test's choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import orjson
import pytest
import uvloop

from llmgw.errors import HTTPError, RateLimitedError
from llmgw.http.server import HTTPServer, ResponseWriter, ServerLimits

WAIT = 5.0  # bound on every wait: a hang is a failure, not a stuck run


# -- the app ------------------------------------------------------------------


class App:
    """Answers by path; records what happened for the test to check."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.events: list[str] = []
        self.release = asyncio.Event()
        self.writers: list[ResponseWriter] = []
        self.sockopts: list[int] = []

    def handle(self, req: Any, w: ResponseWriter) -> Any:
        self.seen.append(req.target)
        self.writers.append(w)
        path = req.path
        if path == b"/echo":
            w.send_json(200, {"method": req.method.decode(), "target": req.target.decode(),
                              "body": req.body.decode("latin-1"), "forward": req.forward.decode()})
            return None
        if path == b"/slow":
            return self._slow(w, float(req.target.split(b"?")[1]))
        if path == b"/stream":
            return self._stream(w, int(req.target.partition(b"?")[2] or b"5"))
        if path == b"/boom":
            raise RuntimeError("secret traceback detail")
        if path == b"/aboom":
            return self._aboom()
        if path == b"/limited":
            raise RateLimitedError("slow down", retry_after=2)
        if path == b"/ahttperror":
            return self._ahttperror()
        if path == b"/hang":
            return self._hang(w)
        if path == b"/noend":
            return self._noend(w)
        if path == b"/flood":
            return self._flood(w)
        if path == b"/ordered":
            return self._ordered(w)
        if path == b"/big":
            # a head and a large body in one send, into a small send buffer: the
            # socket takes part of it (the rest of the head, or of the body, queues)
            sock = w.transport.get_extra_info("socket")  # type: ignore[union-attr]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            w.send(200, BIG, ((b"content-type", b"application/octet-stream"),), raw=b"x-pad: " + b"p" * 6000 + b"\r\n")
            return None
        if path == b"/nodelay":
            sock = w.transport.get_extra_info("socket")  # type: ignore[union-attr]
            self.sockopts.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            w.send(200, b"ok")
            return None
        if path == b"/204":
            w.send(204, b"", ())
            return None
        if path == b"/wait":
            return self._wait(w)
        w.send(404, b'{"error":"no route"}')
        return None

    async def _slow(self, w: ResponseWriter, seconds: float) -> None:
        await asyncio.sleep(seconds)
        w.send(200, b"slow done", ())

    async def _stream(self, w: ResponseWriter, n: int) -> None:
        w.on_disconnect(lambda: self.events.append("disconnect"))
        w.start(200, [(b"content-type", b"text/event-stream")])
        try:
            for i in range(n):
                w.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.01)
            w.end()
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise

    async def _aboom(self) -> None:
        await asyncio.sleep(0)
        raise ValueError("secret async detail")

    async def _ahttperror(self) -> None:
        await asyncio.sleep(0)
        raise HTTPError("nope", status=403, type="permission_error", code="forbidden")

    async def _hang(self, w: ResponseWriter) -> None:
        w.on_disconnect(lambda: self.events.append("disconnect"))
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise

    async def _noend(self, w: ResponseWriter) -> None:
        await asyncio.sleep(0)

    async def _wait(self, w: ResponseWriter) -> None:
        await self.release.wait()
        w.send(200, b"released", ())

    # flow listener (what the proxy's upstream connection is)
    def pause_reading(self) -> None:
        self.events.append("listener paused")

    def resume_reading(self) -> None:
        self.events.append("listener resumed")

    async def _ordered(self, w: ResponseWriter) -> None:
        # Small numbered writes into a small send buffer, so the socket refuses some:
        # the writer goes from writing to the socket itself, to queueing behind the
        # transport, and back once the transport has drained.
        sock = w.transport.get_extra_info("socket")  # type: ignore[union-attr]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        assert not w.queued
        w.start(200, [(b"content-type", b"text/plain")])
        n = 0
        for _ in range(3):
            for _ in range(ORDERED_PER_ROUND):
                w.write(b"%07d\n" % n)
                n += 1
            self.events.append(f"queued={w.queued}")
            await asyncio.wait_for(w.drain(), WAIT)
            for _ in range(500):  # the transport's buffer empties
                if not w.transport.get_write_buffer_size():  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.01)
            self.events.append(f"left={w.transport.get_write_buffer_size()}")  # type: ignore[union-attr]
        w.write(b"last\n")
        self.events.append(f"queued={w.queued}")
        w.end()

    async def _flood(self, w: ResponseWriter) -> None:
        w.add_flow_listener(self)
        w.start(200, [(b"content-type", b"application/octet-stream")])
        block = b"x" * (1 << 20)
        for _ in range(256):  # until the client's slowness shows
            w.write(block)
            if w.write_paused:
                break
        self.events.append(f"paused={w.write_paused}")
        await asyncio.wait_for(w.drain(), WAIT)
        self.events.append(f"drained paused={w.write_paused}")
        w.end()


@contextlib.asynccontextmanager
async def serve(app: Any = None, **limits: Any) -> AsyncIterator[tuple[HTTPServer, int, Any]]:
    app = app or App()
    server = HTTPServer(app, ServerLimits(**limits), name="test")
    _, port = await server.listen("127.0.0.1", 0)
    try:
        yield server, port, app
    finally:
        await asyncio.wait_for(server.close(1.0), WAIT)


# -- a raw client -------------------------------------------------------------


class Resp:
    def __init__(self, status: int, headers: dict[bytes, bytes], body: bytes, raw_head: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.raw_head = raw_head

    def json(self) -> Any:
        return orjson.loads(self.body)

    def __repr__(self) -> str:
        return f"Resp({self.status}, {self.headers!r}, {self.body[:200]!r})"


async def read_response(r: asyncio.StreamReader, head_only: bool = False) -> Resp:
    """One response, framed by Content-Length, chunked, or close."""
    raw = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), WAIT)
    lines = raw[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        assert name.lower() not in headers, f"duplicate header {name!r}"
        headers[name.lower()] = value.strip()
    if head_only or status < 200 or status in (204, 304):
        return Resp(status, headers, b"", raw)
    if b"content-length" in headers:
        body = await asyncio.wait_for(r.readexactly(int(headers[b"content-length"])), WAIT)
    elif headers.get(b"transfer-encoding") == b"chunked":
        parts = []
        while True:
            size = int((await asyncio.wait_for(r.readuntil(b"\r\n"), WAIT))[:-2], 16)
            parts.append(await asyncio.wait_for(r.readexactly(size + 2), WAIT))
            if size == 0:
                break
        body = b"".join(p[:-2] for p in parts)
    else:
        body = await asyncio.wait_for(r.read(), WAIT)
    return Resp(status, headers, body, raw)


async def assert_closed(r: asyncio.StreamReader, within: float = WAIT) -> None:
    """The server closed the connection, and sent nothing more."""
    try:
        rest = await asyncio.wait_for(r.read(), within)
    except ConnectionResetError:
        return
    assert rest == b"", rest


@contextlib.asynccontextmanager
async def connect(port: int, rcvbuf: int = 0) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    # The transport closes a socket it was handed; this one is also closed here (a no-op
    # by then) so that a failed connect or an abandoned transport cannot leave it open.
    sock = None
    try:
        if rcvbuf:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), WAIT)
            r, w = await asyncio.wait_for(asyncio.open_connection(sock=sock, limit=1 << 16), WAIT)
        else:
            r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT)
        try:
            yield r, w
        finally:
            w.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.wait_closed(), WAIT)
    finally:
        if sock is not None:
            sock.close()


def assert_openai_error(resp: Resp, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status == status, resp
    assert resp.headers[b"content-type"] == b"application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and isinstance(err["message"], str) and isinstance(err["type"], str)
    if code is not None:
        assert err["code"] == code
    return err


GET = b"GET /echo HTTP/1.1\r\nHost: t\r\n\r\n"


# -- keep-alive, pipelining, bodies ---------------------------------------------


async def test_keep_alive_across_requests() -> None:
    async with serve() as (server, port, _), connect(port) as (r, w):
        for i in range(3):
            w.write(b"POST /echo?%d HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n\r\nabc" % i)
            resp = await read_response(r)
            assert resp.status == 200 and b"connection" not in resp.headers
            assert resp.json()["target"] == f"/echo?{i}" and resp.json()["body"] == "abc"
        assert len(server.connections) == 1


async def test_connection_close_requested() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        resp = await read_response(r)
        assert resp.status == 200 and resp.headers[b"connection"] == b"close"
        await assert_closed(r)


async def test_http10_closes() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /echo HTTP/1.0\r\n\r\n")
        resp = await read_response(r)
        assert resp.status == 200 and resp.headers[b"connection"] == b"close"
        await assert_closed(r)


async def test_an_http11_request_without_host_is_400_and_closes() -> None:
    # RFC 9112 §3.2: a server MUST answer 400 to an HTTP/1.1 request without Host (HTTP/1.0 needs none)
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"GET /echo HTTP/1.1\r\nX-A: 1\r\n\r\nGET /echo HTTP/1.1\r\nHost: t\r\n\r\n")
        resp = await read_response(r)
        assert resp.status == 400 and resp.headers[b"connection"] == b"close"
        assert resp.json()["error"]["code"] == "missing_host"
        await assert_closed(r)  # (the pipelined request after it is not served)
        assert app.seen == []
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /echo HTTP/1.0\r\n\r\n")
        assert (await read_response(r)).status == 200


async def test_http10_keep_alive_is_kept_and_said() -> None:
    # RFC 9112 §9.3: an HTTP/1.0 client closes unless the answer says keep-alive
    async with serve() as (_, port, _), connect(port) as (r, w):
        for _ in range(2):
            w.write(b"GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            resp = await read_response(r)
            assert resp.status == 200 and resp.headers[b"connection"] == b"keep-alive"


@pytest.mark.parametrize("host", [b"a b", b"a/b", b"a@b", b"a?b", b"h\x7f"])
async def test_an_invalid_host_is_400_and_closes(host: bytes) -> None:
    # RFC 9112 §3.2: 400 to a request whose Host is not a valid field value
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"GET /echo HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        resp = await read_response(r)
        assert resp.status == 400 and resp.headers[b"connection"] == b"close", resp.body
        assert resp.json()["error"]["code"] in ("invalid_host", "invalid_request")
        await assert_closed(r)
        assert app.seen == []


@pytest.mark.parametrize("host", [b"gw.example:8080", b"[::1]:80", b"10.0.0.1", b"", b"xn--bcher-kva.example"])
async def test_valid_hosts_are_served(host: bytes) -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /echo HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        assert (await read_response(r)).status == 200


async def test_http10_gets_a_stream_unframed_to_the_close() -> None:
    # RFC 9112 §6.1: never Transfer-Encoding to an HTTP/1.0 client; the body ends with the connection
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /stream?3 HTTP/1.0\r\n\r\n")
        raw = await asyncio.wait_for(r.read(), WAIT)  # (to EOF: the server closes)
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert lines[0] == b"http/1.1 200 ok"
    assert b"connection: close" in lines
    assert not any(ln.startswith((b"transfer-encoding", b"content-length")) for ln in lines), head
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_pipelining_answered_in_order() -> None:
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"GET /slow?0.2 HTTP/1.1\r\nHost: t\r\n\r\n" + GET + b"GET /slow?0 HTTP/1.1\r\nHost: t\r\n\r\n" + GET)
        t0 = time.monotonic()
        first = await read_response(r)
        assert (first.status, first.body) == (200, b"slow done")
        assert time.monotonic() - t0 >= 0.15
        second = await read_response(r)
        assert second.json()["target"] == "/echo"
        assert (await read_response(r)).body == b"slow done"
        assert (await read_response(r)).json()["target"] == "/echo"
        assert app.seen == [b"/slow?0.2", b"/echo", b"/slow?0", b"/echo"]


async def test_pipelining_past_the_read_ahead_limit() -> None:
    # More pipelined requests than max_pipelined: reading pauses, then resumes.
    async with serve(max_pipelined=4) as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /slow?0.05 HTTP/1.1\r\nHost: t\r\n\r\n" + b"".join(b"GET /echo?%d HTTP/1.1\r\nHost: t\r\n\r\n" % i for i in range(20)))
        assert (await read_response(r)).body == b"slow done"
        for i in range(20):
            assert (await read_response(r)).json()["target"] == f"/echo?{i}"


async def test_chunked_request_body() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n")
        await asyncio.sleep(0.05)
        w.write(b"5\r\npedia\r\n0\r\n\r\n")
        resp = await read_response(r)
        assert resp.json()["body"] == "Wikipedia"


async def test_expect_100_continue() -> None:
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        interim = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), WAIT)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert app.seen == []
        w.write(b"hello")
        resp = await read_response(r)
        assert resp.json()["body"] == "hello"
        assert "expect" not in resp.json()["forward"].lower()


async def test_expect_100_continue_from_an_http10_client_is_ignored() -> None:
    # RFC 9110 §10.1.1: an HTTP/1.0 client's 100-continue is ignored (it cannot read a 100)
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        await asyncio.sleep(0.1)
        w.write(b"hello")
        raw = await asyncio.wait_for(r.read(), WAIT)
        assert raw.startswith(b"HTTP/1.1 200 "), raw[:80]
        assert b"100 Continue" not in raw


async def test_expect_100_continue_behind_a_busy_connection() -> None:
    # The 100 is owed until the pipelined request before it is answered, then sent.
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /slow?0.1 HTTP/1.1\r\nHost: t\r\n\r\nPOST /echo HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        assert (await read_response(r)).body == b"slow done"
        interim = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), WAIT)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        w.write(b"ok")
        assert (await read_response(r)).json()["body"] == "ok"


async def test_on_disconnect_after_the_fact_runs_at_once() -> None:
    async with serve() as (_, port, app):
        async with connect(port) as (_r, w):
            w.write(b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n")
            for _ in range(100):
                if app.writers:
                    break
                await asyncio.sleep(0.01)
        for _ in range(100):
            if app.writers[0].disconnected:
                break
            await asyncio.sleep(0.01)
        late: list[int] = []
        app.writers[0].on_disconnect(lambda: late.append(1))
        assert late == [1]


async def test_expect_other_is_417() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nExpect: x-foo\r\nContent-Length: 5\r\n\r\nhello")
        assert_openai_error(await read_response(r), 417, "expectation_failed")
        await assert_closed(r)


async def test_tcp_nodelay() -> None:
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"GET /nodelay HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(r)).status == 200
        assert app.sockopts == [1]


async def test_head_gets_no_body() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n\r\nHEAD /stream HTTP/1.1\r\nHost: t\r\n\r\n" + GET)
        head = await read_response(r, head_only=True)
        assert head.status == 200 and int(head.headers[b"content-length"]) > 0
        stream = await read_response(r, head_only=True)
        assert stream.status == 200
        # the next bytes are the third response: no body leaked in between
        third = await read_response(r)
        assert third.json()["target"] == "/echo"


@pytest.mark.parametrize(
    ("extra", "status"),
    [(b"Expect: foo\r\n", 417), (b"Content-Length: 99999999\r\n", 413)],
    ids=["417", "413"],
)
async def test_a_refused_head_request_gets_no_body(extra: bytes, status: int) -> None:
    # RFC 9110 §9.3.2: no content in an answer to HEAD, errors refused on the head included
    # (their JSON body used to follow the head, read by the client as the next response)
    async with serve(max_body=1000) as (_, port, app), connect(port) as (r, w):
        w.write(b"HEAD /echo HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n" + GET)
        resp = await read_response(r, head_only=True)
        assert resp.status == status and resp.headers[b"content-type"] == b"application/json"
        assert int(resp.headers[b"content-length"]) > 0  # (the length a GET's answer would have)
        assert resp.headers[b"connection"] == b"close"
        await assert_closed(r)  # and nothing after the head: no body
        assert app.seen == []


async def test_transfer_encoding_in_http10_is_400_and_closes() -> None:
    # RFC 9112 §6.1 (a smuggling shape): it was de-chunked, the connection kept alive, and the
    # request behind it served
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"2\r\n{}\r\n0\r\n\r\n" + GET)
        err = assert_openai_error(await read_response(r), 400, "invalid_request")
        assert "HTTP/1.0" in err["message"]
        await assert_closed(r)
        assert app.seen == []


async def test_connect_is_405_with_allow() -> None:
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        resp = await read_response(r)
        assert_openai_error(resp, 405, "method_not_allowed")
        assert resp.headers[b"allow"] == b"GET, HEAD, POST"
        await assert_closed(r)
        assert app.seen == []


@pytest.mark.parametrize(
    ("size", "status"),
    [(b"7fffffffffffffff", 400), (b"ffffffff", 413), (b"3e9", 413)],
)
async def test_a_chunk_size_that_cannot_fit_is_answered_at_once(size: bytes, status: int) -> None:
    # The size line says the body cannot fit (413) or cannot be a size (400): answered before the
    # data (it waited for data that never comes, and the client got 408 after the body timeout)
    async with serve(max_body=1000, body_timeout=60.0) as (_, port, app), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\n{}")
        assert_openai_error(await read_response(r), status, "request_too_large" if status == 413 else "invalid_request")
        await assert_closed(r)
        assert app.seen == []


async def test_the_trailer_section_is_bounded_431() -> None:
    # Trailer lines after the last chunk were taken without limit (50 MB of them)
    async with serve(max_head_bytes=1024, max_headers=10) as (_, port, app), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(64):
                w.write(b"X-T: " + b"a" * 1000 + b"\r\n")
                await w.drain()
        assert_openai_error(await read_response(r), 431, "request_header_fields_too_large")
        await assert_closed(r)
        assert app.seen == []


async def test_204_has_no_framing() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /204 HTTP/1.1\r\nHost: t\r\n\r\n" + GET)
        resp = await read_response(r)
        assert resp.status == 204
        assert b"content-length" not in resp.headers and b"transfer-encoding" not in resp.headers
        assert (await read_response(r)).status == 200


async def test_streamed_response_is_chunked() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /stream?20 HTTP/1.1\r\nHost: t\r\n\r\n")
        resp = await asyncio.wait_for(read_response(r), WAIT)
        assert resp.headers[b"transfer-encoding"] == b"chunked"
        assert resp.body == b"".join(b"data: %d\n\n" % i for i in range(20))


# -- limits and malformed input ---------------------------------------------------


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", 431, "request_header_fields_too_large"),
        (b"GET / HTTP/1.1\r\nHost: t\r\n" + b"X-A: b\r\n" * 11 + b"\r\n", 431, "request_header_fields_too_large"),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"v" * 2000 + b"\r\n\r\n", 431, "request_header_fields_too_large"),
        (b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 2000\r\n\r\n", 413, "request_too_large"),
        (b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"100\r\n" + b"x" * 256 + b"\r\n") * 5,
         413, "request_too_large"),
        (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, "invalid_request"),
        (b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400, "invalid_request"),
        (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400, "invalid_request"),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX-A: a\r\n b\r\n\r\n", 400, "invalid_request"),
        (b"GET / HTTP/2.0\r\n\r\n", 505, "http_version_not_supported"),
        (b"POST /echo HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 400, "invalid_request"),
        (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 400, "invalid_request"),
    ],
    ids=["long-line", "many-headers", "header-bytes", "413-cl", "413-chunked", "cl-te", "dup-cl",
         "bad-chunk", "obs-fold", "http2", "upgrade-chunked", "tls"],
)
async def test_bad_requests_answered_and_closed(data: bytes, status: int, code: str) -> None:
    async with serve(max_head_bytes=1024, max_headers=10, max_body=1000) as (_, port, app), connect(port) as (r, w):
        w.write(data)
        resp = await read_response(r)
        assert_openai_error(resp, status, code)
        assert resp.headers[b"connection"] == b"close"
        await assert_closed(r)
        assert app.seen == []


async def test_an_unsupported_transfer_coding_is_501_and_not_to_be_retried() -> None:
    # (the OpenAI SDKs retry every 5xx unless told not to; the same body would be refused again)
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
        resp = await read_response(r)
        assert_openai_error(resp, 501, "unsupported_transfer_coding")
        assert resp.headers[b"x-should-retry"] == b"false"
        await assert_closed(r)
        assert app.seen == []


@pytest.mark.parametrize("split", [False, True], ids=["one-read", "byte-by-byte"])
async def test_an_upgrade_offer_is_answered_on_http11_and_the_connection_closed(split: bool) -> None:
    # h2c from curl --http2 or Java's HttpClient (a POST with its body), a WebSocket offer: a server may
    # ignore Upgrade (RFC 9110 §7.8). The request is answered on HTTP/1.1 (no 101), its body read off its
    # Content-Length (llhttp ends such a message at its head), the Upgrade headers not forwarded; what
    # follows it would be the other protocol, and is never read as a request.
    data = (b"POST /echo HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\nContent-Length: 5\r\n\r\nhello"
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + GET)
    async with serve() as (_, port, app), connect(port) as (r, w):
        if split:
            for i in range(len(data)):
                w.write(data[i:i + 1])
                await w.drain()
        else:
            w.write(data)
        resp = await read_response(r)
        assert resp.status == 200 and resp.headers[b"connection"] == b"close"
        echo = resp.json()
        assert echo["method"] == "POST" and echo["body"] == "hello"
        assert "upgrade" not in echo["forward"].lower() and "http2-settings" not in echo["forward"].lower()
        await assert_closed(r)
        assert app.seen == [b"/echo"]  # (not the GET after it)


async def test_413_while_the_client_is_still_sending() -> None:
    # The server refuses by Content-Length while body bytes keep coming: the
    # client must still read the 413 (not a reset that destroys it).
    async with serve(max_body=1000) as (_, port, _), connect(port) as (r, w):
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 200_000)
        assert_openai_error(await read_response(r), 413, "request_too_large")


async def test_valid_pipelined_requests_answered_before_the_400() -> None:
    async with serve() as (_, port, app), connect(port) as (r, w):
        w.write(b"GET /slow?0.05 HTTP/1.1\r\nHost: t\r\n\r\n" + GET + b"GET /bad HTTP/1.1\r\nHost: t\r\nX A: b\r\n\r\n")
        assert (await read_response(r)).body == b"slow done"
        assert (await read_response(r)).json()["target"] == "/echo"
        assert_openai_error(await read_response(r), 400, "invalid_request")
        await assert_closed(r)
        assert app.seen == [b"/slow?0.05", b"/echo"]


# -- timeouts ---------------------------------------------------------------------


async def test_header_timeout_slowloris() -> None:
    async with serve(header_timeout=0.3) as (server, port, _), connect(port) as (r, w):
        t0 = time.monotonic()
        w.write(b"GET / HTTP/1.1\r\nHost: t\r\n")
        # trickling bytes does not extend the deadline
        for _ in range(3):
            await asyncio.sleep(0.05)
            w.write(b"X")
        resp = await read_response(r)
        assert_openai_error(resp, 408, "request_timeout")
        assert 0.25 <= time.monotonic() - t0 < 2.0
        await assert_closed(r)
        w.close()  # the server lingers (reading and dropping) until the client closes
        for _ in range(100):
            if not server.connections:
                break
            await asyncio.sleep(0.01)
        assert not server.connections


async def test_body_timeout() -> None:
    async with serve(body_timeout=0.3) as (_, port, app), connect(port) as (r, w):
        t0 = time.monotonic()
        w.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
        assert_openai_error(await read_response(r), 408, "request_timeout")
        assert 0.25 <= time.monotonic() - t0 < 2.0
        await assert_closed(r)
        assert app.seen == []


async def test_idle_keep_alive_timeout_closes() -> None:
    async with serve(keepalive_timeout=0.3) as (server, port, _), connect(port) as (r, w):
        w.write(GET)
        assert (await read_response(r)).status == 200
        t0 = time.monotonic()
        await assert_closed(r)
        assert 0.25 <= time.monotonic() - t0 < 2.0
        await asyncio.sleep(0.05)
        assert not server.connections


async def test_idle_before_first_request_closes() -> None:
    async with serve(keepalive_timeout=0.3) as (_, port, _), connect(port) as (r, _w):
        await assert_closed(r, within=2.0)


async def test_partial_head_behind_a_slow_response_still_times_out() -> None:
    # Regression: a head timer that fired while an earlier pipelined request was
    # being answered was dropped, and none was armed after: the connection was
    # held forever by a head that never completes.
    async with serve(header_timeout=0.2) as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /slow?0.4 HTTP/1.1\r\nHost: t\r\n\r\nGET / HTTP/1.1\r\nHost: t\r\nX-Never: ")
        assert (await read_response(r)).body == b"slow done"
        t0 = time.monotonic()
        assert_openai_error(await read_response(r), 408, "request_timeout")
        assert time.monotonic() - t0 < 1.5
        await assert_closed(r)


# -- connection limit ---------------------------------------------------------------


async def test_max_connections_answered_503_at_once() -> None:
    async with serve(max_connections=2) as (server, port, _), connect(port) as (r1, w1), \
            connect(port) as (r2, w2):
        for r, w in ((r1, w1), (r2, w2)):
            w.write(GET)
            assert (await read_response(r)).status == 200
        async with connect(port) as (r3, w3):
            w3.write(GET)  # already sent when the 503 comes: must not turn into a reset
            t0 = time.monotonic()
            resp = await read_response(r3)
            assert time.monotonic() - t0 < 1.0
            assert_openai_error(resp, 503, "service_unavailable")
            assert resp.headers[b"retry-after"] == b"1"
            assert resp.headers[b"connection"] == b"close"
            assert resp.headers[b"date"].endswith(b" GMT")  # (RFC 9110 §6.6.1)
            await assert_closed(r3)
        assert server.rejected == 1
        # the accepted ones still work
        w1.write(GET)
        assert (await read_response(r1)).status == 200


# -- handler errors -----------------------------------------------------------------


@pytest.mark.parametrize("path", [b"/boom", b"/aboom"])
async def test_handler_exception_is_500_json(path: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET %s HTTP/1.1\r\nHost: t\r\n\r\n" % path)
        resp = await read_response(r)
        err = assert_openai_error(resp, 500, "internal_error")
        assert b"secret" not in resp.body and b"Traceback" not in resp.body
        assert err["type"] == "server_error"
        await assert_closed(r)
    assert "request handler failed" in caplog.text


async def test_handler_http_error_keeps_its_status() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /limited HTTP/1.1\r\nHost: t\r\n\r\n")
        resp = await read_response(r)
        assert_openai_error(resp, 429, "rate_limit_exceeded")
        assert resp.headers[b"retry-after"] == b"2" and resp.headers[b"retry-after-ms"] == b"2000"
        # not a connection-level error: keep-alive continues
        w.write(b"GET /ahttperror HTTP/1.1\r\nHost: t\r\n\r\n")
        err = assert_openai_error(await read_response(r), 403, "forbidden")
        assert err["type"] == "permission_error" and err["message"] == "nope"
        w.write(GET)
        assert (await read_response(r)).status == 200


async def test_handler_that_never_finishes_is_500(caplog: pytest.LogCaptureFixture) -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /noend HTTP/1.1\r\nHost: t\r\n\r\n")
        assert_openai_error(await read_response(r), 500)
    assert "without finishing" in caplog.text


async def test_unknown_route_from_app() -> None:
    async with serve() as (_, port, _), connect(port) as (r, w):
        w.write(b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n")
        assert (await read_response(r)).status == 404


# -- disconnects and flow control -----------------------------------------------------


async def test_client_disconnect_cancels_the_handler() -> None:
    async with serve() as (_, port, app):
        async with connect(port) as (r, w):
            w.write(b"GET /stream?1000 HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.wait_for(r.readuntil(b"data: 1\n\n"), WAIT)
        for _ in range(100):
            if "cancelled" in app.events:
                break
            await asyncio.sleep(0.02)
        assert app.events == ["disconnect", "cancelled"]
        assert app.writers[0].disconnected


async def test_disconnect_while_waiting_cancels_and_calls_back() -> None:
    async with serve() as (server, port, app):
        async with connect(port) as (_r, w):
            w.write(b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n")
            for _ in range(100):
                if app.seen:
                    break
                await asyncio.sleep(0.01)
        for _ in range(100):
            if "cancelled" in app.events:
                break
            await asyncio.sleep(0.02)
        assert app.events == ["disconnect", "cancelled"]
        assert not server.connections


ORDERED_PER_ROUND = 20000
BIG = bytes(range(251)) * 4000  # about 1 MB that shows any reordering or loss


async def test_large_answer_split_between_socket_and_transport_arrives_whole() -> None:
    async with serve() as (_, port, _app), connect(port, rcvbuf=4096) as (r, w):
        for _ in range(2):  # twice on one connection: the writer is back to direct writes
            w.write(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.sleep(0.2)
            resp = await asyncio.wait_for(read_response(r), 30)
            assert resp.status == 200 and resp.headers[b"x-pad"] == b"p" * 6000
            assert resp.body == BIG


async def test_writes_keep_their_order_between_socket_and_transport() -> None:
    async with serve() as (_, port, app), connect(port, rcvbuf=4096) as (r, w):
        w.write(b"GET /ordered HTTP/1.1\r\nHost: t\r\n\r\n")
        await asyncio.sleep(0.3)  # not reading yet: the socket fills
        resp = await asyncio.wait_for(read_response(r), 30)
        expect = b"".join(b"%07d\n" % i for i in range(3 * ORDERED_PER_ROUND)) + b"last\n"
        assert resp.status == 200
        assert resp.body == expect
        # Some writes queued behind the transport; the last one, after it drained,
        # went to the socket directly.
        assert app.events == ["queued=True", "left=0"] * 3 + ["queued=False"], app.events


async def test_flow_control_pauses_and_resumes() -> None:
    async with serve() as (_, port, app), connect(port, rcvbuf=4096) as (r, w):
        w.write(b"GET /flood HTTP/1.1\r\nHost: t\r\n\r\n")
        for _ in range(200):
            if app.events:
                break
            await asyncio.sleep(0.02)
        assert app.events == ["listener paused", "paused=True"]
        await asyncio.sleep(0.1)
        # drain() waits while the client does not read
        assert app.events == ["listener paused", "paused=True"]
        resp = await asyncio.wait_for(read_response(r), 20)
        assert resp.status == 200 and len(resp.body) % (1 << 20) == 0 and resp.body
        assert app.events == ["listener paused", "paused=True", "listener resumed", "drained paused=False"]


# -- graceful shutdown ------------------------------------------------------------------


async def test_graceful_shutdown_lets_in_flight_finish() -> None:
    app = App()
    server = HTTPServer(app, ServerLimits(), name="test")
    _, port = await server.listen("127.0.0.1", 0)
    async with connect(port) as (r, w), connect(port) as (r_idle, w_idle):
        w_idle.write(GET)
        assert (await read_response(r_idle)).status == 200
        w.write(b"GET /slow?0.3 HTTP/1.1\r\nHost: t\r\n\r\n")
        for _ in range(100):
            if app.seen[-1:] == [b"/slow?0.3"]:
                break
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        closing = asyncio.create_task(server.close(timeout=3.0))
        await asyncio.sleep(0.05)
        # no new connections
        with pytest.raises(OSError):
            async with connect(port) as (r_new, w_new):
                w_new.write(GET)
                await read_response(r_new)
        # the idle one is closed at once
        await assert_closed(r_idle, within=1.0)
        # the in-flight one completes, told the connection closes
        resp = await read_response(r)
        assert resp.body == b"slow done"
        assert resp.headers.get(b"connection") == b"close"
        await assert_closed(r)
        await asyncio.wait_for(closing, WAIT)
        assert time.monotonic() - t0 < 1.5
        assert not server.connections


async def test_graceful_shutdown_cuts_a_hung_handler() -> None:
    app = App()
    server = HTTPServer(app, ServerLimits(), name="test")
    _, port = await server.listen("127.0.0.1", 0)
    async with connect(port) as (r, w):
        w.write(b"GET /hang HTTP/1.1\r\nHost: t\r\n\r\n")
        for _ in range(100):
            if app.seen:
                break
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await asyncio.wait_for(server.close(timeout=0.3), WAIT)
        assert 0.25 <= time.monotonic() - t0 < 1.5
        await assert_closed(r)
        for _ in range(50):
            if "cancelled" in app.events:
                break
            await asyncio.sleep(0.02)
        assert "cancelled" in app.events and "disconnect" in app.events


async def test_close_ends_every_connection_accepted_meanwhile() -> None:
    # Connections that arrive as close() begins, at every point of their setup (the
    # kernel's backlog, accepted, being made): each ends (answered, refused or reset),
    # none is left open once close() returns (asyncio's loop makes a transport in a
    # task, and one made after its Server closed used to leave its socket open).
    for round_ in range(24):
        server = HTTPServer(App(), name="test")
        _, port = await server.listen("127.0.0.1", 0)
        clients = []
        for _ in range(3):
            c = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            c.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            clients.append(c)
        for _ in range(round_ % 4):
            await asyncio.sleep(0)
        await asyncio.wait_for(server.close(1.0), WAIT)
        assert not server.connections

        def ended(c: socket.socket) -> bool:
            try:
                while c.recv(65536):
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                return False
            return True

        try:
            assert all(await asyncio.gather(*(asyncio.to_thread(ended, c) for c in clients))), f"round {round_}"
        finally:
            for c in clients:
                c.close()


async def test_listen_on_a_busy_port() -> None:
    async with serve() as (_, port, _):
        other = HTTPServer(App(), name="other")
        with pytest.raises(OSError, match="already in use"):
            await other.listen("127.0.0.1", port)


async def test_runs_on_the_chosen_loop(loop_kind: str) -> None:
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop) == (loop_kind == "uvloop")


# -- both loops -----------------------------------------------------------------------

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def on_both_loops(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run the async test ``fn`` once on asyncio's loop and once on uvloop's.

    The gateway serves on uvloop; tools and tests often run on asyncio. NOTE:
    pytest-asyncio chooses loops only through a conftest hook, so each test here
    runs its own ``asyncio.Runner``; ``fn``'s parameters and marks carry over.
    """
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
