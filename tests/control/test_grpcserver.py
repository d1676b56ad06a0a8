"""The control plane's gRPC server (llmgw.control.grpcserver) against grpcio's own clients, and hostile peers.

Real sockets on 127.0.0.1: grpc.aio channels (what agents and routers use) for the protocol, and raw
HTTP/2 (h2 as the client) or raw bytes for what no grpcio client would send.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest

from llmgw.control.grpcserver import Limits, Server, server_ssl_context

pytestmark = pytest.mark.timeout(60)

SERVICE = "test.v1.Echo"


def _ident(x: bytes) -> bytes:
    return x


class Echo:
    """Handlers of every arity over raw bytes (no serializers: the wire's bytes as they are)."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()
        self.seen_metadata: tuple[tuple[str, Any], ...] = ()
        self.peers: list[str] = []

    async def unary(self, request: bytes, context: Any) -> bytes:
        self.seen_metadata = context.invocation_metadata()
        self.peers.append(context.peer())
        if request == b"abort":
            context.set_trailing_metadata((("x-leader", "10.0.0.1:7000"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "standby — the leader is elsewhere")
        if request == b"boom":
            raise RuntimeError("secret internal detail")
        if request == b"hang":
            self.started.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request == b"big":
            return b"x" * (5 * 1024 * 1024)
        if request == b"code":
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details("no such thing")
            return b""
        return b"echo:" + request

    async def server_stream(self, request: bytes, context: Any) -> Any:
        for i in range(int(request)):
            yield b"%d" % i

    async def written(self, request: bytes, context: Any) -> None:
        await context.send_initial_metadata((("x-lease-ms", "15000"),))
        for i in range(int(request)):
            await context.write(b"w%d" % i)

    async def client_stream(self, request_iterator: Any, context: Any) -> bytes:
        total = 0
        async for m in request_iterator:
            total += len(m)
        return str(total).encode()

    async def bidi(self, request_iterator: Any, context: Any) -> None:
        self.started.set()
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    return
                await context.write(b"re:" + msg)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary, _ident, _ident),
            "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream, _ident, _ident),
            "Written": grpc.unary_stream_rpc_method_handler(self.written, _ident, _ident),
            "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream, _ident, _ident),
            "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi, _ident, _ident),
        })


@contextlib.asynccontextmanager
async def serving(limits: Limits | None = None, ssl_context: ssl.SSLContext | None = None,
                  registered: bool = False) -> AsyncIterator[tuple[Server, Echo, int]]:
    echo = Echo()
    server = Server(limits)
    if registered:  # (as the generated add_*_to_server does it too)
        h = echo.handler()
        server.add_registered_method_handlers(SERVICE, {
            name: h._method_handlers[f"/{SERVICE}/{name}"]  # type: ignore[attr-defined]
            for name in ("Unary", "ServerStream", "Written", "ClientStream", "Bidi")})
    else:
        server.add_generic_rpc_handlers((echo.handler(),))
    port = await server.bind("127.0.0.1", 0, ssl_context)
    await server.start()
    try:
        yield server, echo, port
    finally:
        await server.stop(0)


def _channel(port: int, creds: grpc.ChannelCredentials | None = None, **opts: Any) -> grpc.aio.Channel:
    target = f"127.0.0.1:{port}"
    options = list(opts.items())
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, creds, options=options)


def _m(ch: grpc.aio.Channel, kind: str, name: str) -> Any:
    return getattr(ch, kind)(f"/{SERVICE}/{name}")


@pytest.mark.parametrize("registered", [False, True])
async def test_every_arity(registered: bool) -> None:
    async with serving(registered=registered) as (_, echo, port), _channel(port) as ch:
        assert await _m(ch, "unary_unary", "Unary")(b"hi", metadata=[("authorization", "Bearer t")],
                                                    timeout=5) == b"echo:hi"
        assert ("authorization", "Bearer t") in echo.seen_metadata
        assert echo.peers[0].startswith("ipv4:127.0.0.1:")
        assert [m async for m in _m(ch, "unary_stream", "ServerStream")(b"4", timeout=5)] == [b"0", b"1", b"2", b"3"]
        call = _m(ch, "unary_stream", "Written")(b"3", timeout=5)
        assert [m async for m in call] == [b"w0", b"w1", b"w2"]
        assert ("x-lease-ms", "15000") in tuple(await call.initial_metadata())

        async def parts() -> AsyncIterator[bytes]:
            for n in (1, 10, 100, 100_000):
                yield b"a" * n
        assert await _m(ch, "stream_unary", "ClientStream")(parts(), timeout=5) == b"100111"
        bidi = _m(ch, "stream_stream", "Bidi")(timeout=5)
        for word in (b"one", b"two", b""):
            await bidi.write(word)
            assert await bidi.read() == b"re:" + word
        await bidi.done_writing()
        assert await bidi.read() is grpc.aio.EOF
        assert await bidi.code() == grpc.StatusCode.OK


async def test_abort_carries_code_details_and_trailing_metadata() -> None:
    async with serving() as (_, _, port), _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _m(ch, "unary_unary", "Unary")(b"abort", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == "standby — the leader is elsewhere"  # (non-ASCII: percent-encoded on the wire)
        assert ("x-leader", "10.0.0.1:7000") in tuple(e.value.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _m(ch, "unary_unary", "Unary")(b"code", timeout=5)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.NOT_FOUND, "no such thing")


async def test_a_failing_handler_is_unknown_and_says_nothing_of_its_exception(caplog: pytest.LogCaptureFixture) -> None:
    async with serving() as (_, _, port), _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _m(ch, "unary_unary", "Unary")(b"boom", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNKNOWN
        assert "secret" not in (e.value.details() or "")
        assert "secret internal detail" in caplog.text  # (the server's log has it)
        assert await _m(ch, "unary_unary", "Unary")(b"again", timeout=5) == b"echo:again"  # the server goes on


async def test_unknown_method_is_unimplemented() -> None:
    async with serving() as (_, _, port), _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ch.unary_unary(f"/{SERVICE}/Nope")(b"x", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_message_over_the_limit_is_resource_exhausted() -> None:
    async with serving(Limits(max_receive_message_length=1000)) as (_, _, port), _channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _m(ch, "unary_unary", "Unary")(b"x" * 1001, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "1001" in (e.value.details() or "") and "1000" in (e.value.details() or "")
        assert await _m(ch, "unary_unary", "Unary")(b"x" * 990, timeout=5) == b"echo:" + b"x" * 990


async def test_a_response_larger_than_the_windows_arrives_whole() -> None:
    async with serving() as (_, _, port), _channel(port, **{"grpc.max_receive_message_length": 64 << 20}) as ch:
        got = await _m(ch, "unary_unary", "Unary")(b"big", timeout=10)
        assert got == b"x" * (5 * 1024 * 1024)


async def test_a_deadline_cancels_the_handler() -> None:
    async with serving() as (_, echo, port), _channel(port) as ch:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _m(ch, "unary_unary", "Unary")(b"hang", timeout=0.3)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(echo.cancelled.wait(), 5)
        assert time.monotonic() - t0 < 5


async def test_a_client_that_cancels_cancels_the_handler() -> None:
    async with serving() as (server, echo, port), _channel(port) as ch:
        call = _m(ch, "stream_stream", "Bidi")()
        await call.write(b"x")
        assert await call.read() == b"re:x"
        call.cancel()
        await asyncio.wait_for(echo.cancelled.wait(), 5)
        for _ in range(100):  # the call is forgotten
            if not any(c.calls for c in server.connections):
                break
            await asyncio.sleep(0.02)
        assert not any(c.calls for c in server.connections)


async def test_a_lost_connection_cancels_its_calls() -> None:
    async with serving() as (_, echo, port):
        ch = _channel(port)
        call = _m(ch, "stream_stream", "Bidi")()
        await call.write(b"x")
        assert await call.read() == b"re:x"
        await ch.close()
        await asyncio.wait_for(echo.cancelled.wait(), 5)


async def test_stop_ends_open_calls_unavailable() -> None:
    echo = Echo()
    server = Server()
    server.add_generic_rpc_handlers((echo.handler(),))
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    async with _channel(port) as ch:
        call = _m(ch, "stream_stream", "Bidi")()
        await call.write(b"x")
        assert await call.read() == b"re:x"
        await server.stop(0.1)
        assert await call.code() == grpc.StatusCode.UNAVAILABLE
        assert echo.cancelled.is_set()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        pass


async def test_stop_says_goaway_first_and_serves_the_open_calls_through_the_grace() -> None:
    """A graceful stop tells each client at once (GOAWAY NO_ERROR naming the last call taken), serves
    the calls open until they end, then closes; a connection with no call closes at once."""
    echo = Echo()
    server = Server()
    server.add_generic_rpc_handlers((echo.handler(),))
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    busy, idle = RawClient(port), RawClient(port)
    stopping: asyncio.Task[None] | None = None
    try:
        sid = busy.headers("Bidi")
        busy.conn.send_data(sid, b"\x00\x00\x00\x00\x02hi")
        busy.send()
        await asyncio.wait_for(echo.started.wait(), 5)
        ev = await asyncio.to_thread(busy.events, 0.5)
        assert any(isinstance(e, h2.events.DataReceived) for e in ev)
        await asyncio.to_thread(idle.events, 0.2)  # (its SETTINGS in and out)
        t0 = time.monotonic()
        stopping = asyncio.create_task(server.stop(10.0))
        ev = await asyncio.to_thread(busy.events, 0.5)
        said = _goaway(ev)
        assert said is not None and said.error_code == h2.errors.ErrorCodes.NO_ERROR
        assert said.last_stream_id == sid
        assert "closed" not in ev
        assert "closed" in await asyncio.to_thread(idle.events, 2.0)  # nothing open: closed at once
        # the open call goes on (h2's client neither sends nor reads after a GOAWAY: frames by hand)
        busy.sock.sendall(b"\x00\x00\x07\x00\x00" + sid.to_bytes(4, "big") + b"\x00\x00\x00\x00\x02yo")
        got = await asyncio.to_thread(_frames, busy.sock, 1.0)
        assert (0, 0, sid, b"\x00\x00\x00\x00\x05re:yo") in got
        busy.sock.sendall(b"\x00\x00\x00\x00\x01" + sid.to_bytes(4, "big"))  # END_STREAM: the client is done
        got = await asyncio.to_thread(_frames, busy.sock, 3.0)
        trailers = [f[3] for f in got if f != "closed" and f[0] == 1 and f[2] == sid and f[1] & 0x01]
        assert trailers and (b"grpc-status", b"0") in busy.conn.decoder.decode(trailers[0], raw=True)
        assert got[-1] == "closed"
        await asyncio.wait_for(stopping, 5)
        assert time.monotonic() - t0 < 5.0  # (not the grace: the call ended)
        assert not server.connections
        assert not echo.cancelled.is_set()
    finally:
        busy.close()
        idle.close()
        if stopping is None:
            await server.stop(0)
        elif not stopping.done():
            await stopping


async def test_a_port_in_use_is_an_oserror() -> None:
    async with serving() as (_, _, port):
        with pytest.raises(OSError):
            await Server().bind("127.0.0.1", port)


# -- TLS --

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=test CA", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=test {name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    return {k: d / k for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.mark.needs_tool("openssl", install="apt-get install openssl: it makes the certificates")
async def test_tls_and_mutual_tls(pki: dict[str, Path]) -> None:
    ca = pki["ca.pem"].read_bytes()
    tls = server_ssl_context(str(pki["server.pem"]), str(pki["server.key"]))
    async with serving(ssl_context=tls) as (_, _, port):
        async with _channel(port, grpc.ssl_channel_credentials(ca)) as ch:
            assert await _m(ch, "unary_unary", "Unary")(b"tls", timeout=5) == b"echo:tls"
        async with _channel(port) as ch:  # plaintext to a TLS port
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _m(ch, "unary_unary", "Unary")(b"x", timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    mtls = server_ssl_context(str(pki["server.pem"]), str(pki["server.key"]), str(pki["ca.pem"]))
    async with serving(ssl_context=mtls) as (_, _, port):
        async with _channel(port, grpc.ssl_channel_credentials(ca)) as ch:  # no client certificate
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _m(ch, "unary_unary", "Unary")(b"x", timeout=3)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        creds = grpc.ssl_channel_credentials(ca, pki["client.key"].read_bytes(), pki["client.pem"].read_bytes())
        async with _channel(port, creds) as ch:
            assert await _m(ch, "unary_unary", "Unary")(b"mtls", timeout=5) == b"echo:mtls"


@pytest.mark.needs_tool("openssl", install="apt-get install openssl: it makes the certificates")
async def test_a_tls_client_without_h2_is_closed(pki: dict[str, Path]) -> None:
    tls = server_ssl_context(str(pki["server.pem"]), str(pki["server.key"]))
    async with serving(ssl_context=tls) as (_, _, port):
        ctx = ssl.create_default_context(cafile=str(pki["ca.pem"]))
        ctx.set_alpn_protocols(["http/1.1"])
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


# -- hostile peers: raw HTTP/2 --

class RawClient:
    """An HTTP/2 client made of h2 and a socket: it sends what it is told, acknowledges nothing it is not told to."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.conn.initiate_connection()
        self.send()

    def send(self) -> None:
        self.sock.sendall(self.conn.data_to_send())

    def events(self, timeout: float = 5.0) -> list[Any]:
        """Everything that arrives within ``timeout`` or until the server closes."""
        out: list[Any] = []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.sock.settimeout(max(0.01, end - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                out.append("closed")
                break
            if not data:
                out.append("closed")
                break
            out += self.conn.receive_data(data)
            if any(isinstance(e, h2.events.ConnectionTerminated) for e in out):
                with contextlib.suppress(OSError):
                    if not self.sock.recv(65536):
                        out.append("closed")
                break
        return out

    def headers(self, method: str = "Unary", content_type: bytes = b"application/grpc",
                extra: tuple[tuple[bytes, bytes], ...] = ()) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"x"),
                                     (b":path", f"/{SERVICE}/{method}".encode()), (b"te", b"trailers"),
                                     (b"content-type", content_type), *extra])
        return sid

    def close(self) -> None:
        self.sock.close()


def _frames(sock: socket.socket, timeout: float) -> list[Any]:
    """The raw frames (kind, flags, stream, payload) that arrive within ``timeout``; "closed" last if it closed."""
    out: list[Any] = []
    buf = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        sock.settimeout(max(0.01, end - time.monotonic()))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            data = b""
        if not data:
            out.append("closed")
            break
        buf += data
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            n = int.from_bytes(buf[:3], "big")
            out.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + n]))
            buf = buf[9 + n:]
    return out


def _goaway(events: list[Any]) -> Any:
    return next((e for e in events if isinstance(e, h2.events.ConnectionTerminated)), None)


async def test_too_many_pings_is_goaway_enhance_your_calm() -> None:
    async with serving(Limits(min_ping_interval_without_data=10.0, max_ping_strikes=2)) as (_, _, port):
        c = RawClient(port)
        try:
            for i in range(5):
                c.conn.ping(b"%08d" % i)
            c.send()
            ev = await asyncio.to_thread(c.events)
            g = _goaway(ev)
            assert g is not None and g.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
            assert g.additional_data == b"too_many_pings"
        finally:
            c.close()


async def test_an_unanswered_keepalive_ping_closes_the_connection() -> None:
    async with serving(Limits(keepalive_time=0.2, keepalive_timeout=0.2)) as (_, _, port):
        c = RawClient(port)  # (h2 would ack a ping itself: this client never reads until the end)
        try:
            t0 = time.monotonic()
            await asyncio.sleep(0.1)
            ev = await asyncio.to_thread(c.events, 5.0)
            assert "closed" in ev
            assert any(isinstance(e, h2.events.PingReceived) for e in ev)
            assert time.monotonic() - t0 < 3
        finally:
            c.close()


async def test_an_answered_keepalive_ping_keeps_an_idle_connection() -> None:
    async with serving(Limits(keepalive_time=0.2, keepalive_timeout=0.2)) as (_, _, port), _channel(port) as ch:
        assert await _m(ch, "unary_unary", "Unary")(b"1", timeout=5) == b"echo:1"
        await asyncio.sleep(1.0)  # idle: pinged several times, grpc answers each
        assert ch.get_state() == grpc.ChannelConnectivity.READY
        assert await _m(ch, "unary_unary", "Unary")(b"2", timeout=5) == b"echo:2"


async def test_a_connection_that_sends_no_preface_is_closed() -> None:
    async with serving(Limits(handshake_timeout=0.3)) as (server, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        await asyncio.wait_for(reader.read(), 5)  # (the server's SETTINGS, then the end)
        assert time.monotonic() - t0 < 3
        writer.close()
        await asyncio.sleep(0.05)
        assert not server.connections


async def test_an_http1_request_is_closed_and_the_server_goes_on() -> None:
    async with serving() as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)
        assert data[3:4] == b"\x04"  # an HTTP/2 SETTINGS frame first, then a GOAWAY and the end
        writer.close()
        async with _channel(port) as ch:
            assert await _m(ch, "unary_unary", "Unary")(b"ok", timeout=5) == b"echo:ok"


async def test_rapid_resets_end_the_connection() -> None:
    async with serving(Limits(max_resets=50, reset_window=10.0)) as (_, _, port):
        c = RawClient(port)
        try:
            for _ in range(60):
                sid = c.headers("Bidi")
                c.conn.reset_stream(sid)
            c.send()
            g = _goaway(await asyncio.to_thread(c.events))
            assert g is not None and g.error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        finally:
            c.close()


async def test_a_stream_over_the_limit_is_refused_and_the_connection_goes_on() -> None:
    """RFC 9113 §5.1.2: a stream over MAX_CONCURRENT_STREAMS is a stream error. The client opens
    three calls before it has read the server's SETTINGS (limit 2): the third is reset
    REFUSED_STREAM, the first two are served, the header blocks after it still decode (HPACK
    in step), and a call opened once one has ended is served too."""
    async with serving(Limits(max_concurrent_streams=2, max_resets=50)) as (_, _, port):
        c = RawClient(port)
        try:
            sids = [c.headers("Bidi") for _ in range(3)]
            for sid in sids:
                c.conn.send_data(sid, b"\x00\x00\x00\x00\x02m%d" % (sid % 10))
            c.send()
            ev = await asyncio.to_thread(c.events, 1.0)
            assert "closed" not in ev and _goaway(ev) is None
            reset = [e for e in ev if isinstance(e, h2.events.StreamReset)]
            assert [(e.stream_id, e.error_code) for e in reset] == [(sids[2], h2.errors.ErrorCodes.REFUSED_STREAM)]
            echoed = {e.stream_id for e in ev if isinstance(e, h2.events.DataReceived)}
            assert echoed == set(sids[:2])
            # one call ends; a new one is taken (and answered) on the same connection
            c.conn.end_stream(sids[0])
            c.send()
            ev = await asyncio.to_thread(c.events, 1.0)
            assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sids[0] for e in ev)
            sid = c.headers("Unary", extra=((b"x-after", b"refused"),))
            c.conn.send_data(sid, b"\x00\x00\x00\x00\x02ok", end_stream=True)
            c.send()
            ev = await asyncio.to_thread(c.events, 1.0)
            got = [e.data for e in ev if isinstance(e, h2.events.DataReceived) and e.stream_id == sid]
            assert got == [b"\x00\x00\x00\x00\x07echo:ok"]
        finally:
            c.close()


async def test_a_compressed_message_or_encoding_is_unimplemented() -> None:
    async with serving() as (_, _, port):
        c = RawClient(port)
        try:
            sid = c.headers()
            c.conn.send_data(sid, b"\x01\x00\x00\x00\x01x", end_stream=True)
            sid2 = c.headers(extra=((b"grpc-encoding", b"gzip"),))
            c.conn.send_data(sid2, b"\x00\x00\x00\x00\x01x", end_stream=True)
            c.send()
            ev = await asyncio.to_thread(c.events, 1.0)
            status = {e.stream_id: dict(e.headers).get(b"grpc-status") for e in ev
                      if isinstance(e, h2.events.TrailersReceived | h2.events.ResponseReceived)
                      and b"grpc-status" in dict(e.headers)}
            assert status == {sid: b"12", sid2: b"12"}
        finally:
            c.close()


async def test_not_grpc_is_415_and_not_post_405() -> None:
    async with serving() as (_, _, port):
        c = RawClient(port)
        try:
            sid = c.headers(content_type=b"application/json")
            c.conn.end_stream(sid)
            sid2 = c.conn.get_next_available_stream_id()
            c.conn.send_headers(sid2, [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x"),
                                       (b":path", f"/{SERVICE}/Unary".encode())], end_stream=True)
            c.send()
            ev = await asyncio.to_thread(c.events, 1.0)
            got = {e.stream_id: dict(e.headers)[b":status"] for e in ev if isinstance(e, h2.events.ResponseReceived)}
            assert got == {sid: b"415", sid2: b"405"}
        finally:
            c.close()


async def test_a_request_cut_inside_a_message_is_internal() -> None:
    async with serving() as (_, _, port):
        c = RawClient(port)
        try:
            sid = c.headers()
            c.conn.send_data(sid, b"\x00\x00\x00\x00\x10abc", end_stream=True)  # says 16 bytes, has 3
            sid2 = c.headers()
            c.conn.end_stream(sid2)  # a unary call with no message
            c.send()
            ev = await asyncio.to_thread(c.events, 1.0)
            status = {e.stream_id: dict(e.headers).get(b"grpc-status") for e in ev
                      if isinstance(e, h2.events.TrailersReceived | h2.events.ResponseReceived)
                      and b"grpc-status" in dict(e.headers)}
            assert status == {sid: b"13", sid2: b"13"}
        finally:
            c.close()


async def test_a_slow_reader_holds_its_writer_not_the_server() -> None:
    """A client that reads nothing: the handler's writes wait for window; other calls are served meanwhile."""
    async with serving(Limits(initial_window_size=65_535)) as (server, _, port):
        c = RawClient(port)  # it never acknowledges data: the server's windows run out
        try:
            sid = c.headers("Written")
            c.conn.send_data(sid, b"\x00\x00\x00\x00\x071000000", end_stream=True)
            c.send()
            await asyncio.sleep(0.5)
            call = next(iter(next(iter(server.connections)).calls.values()))
            assert call.pending  # waiting for window, not buffered without bound
            assert sum(map(len, call.pending)) < 100
            async with _channel(port) as ch:
                assert await _m(ch, "unary_unary", "Unary")(b"meanwhile", timeout=5) == b"echo:meanwhile"
        finally:
            c.close()


def test_limits_are_a_frozen_dataclass() -> None:
    lim = Limits()
    assert dataclasses.replace(lim, max_resets=1).max_resets == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        lim.max_resets = 2  # type: ignore[misc]


async def test_many_calls_share_one_connection() -> None:
    """grpc clients in one process share a connection per target: 300 streams at once on it all get served."""
    async with serving() as (server, _, port), _channel(port) as ch:
        calls = [_m(ch, "stream_stream", "Bidi")() for _ in range(300)]
        for i, call in enumerate(calls):
            await call.write(b"%d" % i)
        got = await asyncio.wait_for(asyncio.gather(*(call.read() for call in calls)), 20)
        assert got == [b"re:%d" % i for i in range(300)]
        assert len(server.connections) == 1
        for call in calls:
            await call.done_writing()
        assert {await call.code() for call in calls} == {grpc.StatusCode.OK}


async def test_a_client_goaway_closes_the_connection_and_cancels_its_calls() -> None:
    async with serving() as (server, echo, port):
        c = RawClient(port)
        try:
            sid = c.headers("Bidi")
            c.conn.send_data(sid, b"\x00\x00\x00\x00\x02hi")
            c.send()
            await asyncio.wait_for(echo.started.wait(), 5)
            c.sock.sendall(b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + bytes(8))  # GOAWAY, last stream 0
            ev = await asyncio.to_thread(c.events, 3.0)
            assert "closed" in ev
            await asyncio.wait_for(echo.cancelled.wait(), 5)
            assert not server.connections
        finally:
            c.close()


# -- flow control, bounds and leaks (found by a review of the server) --

async def test_a_handler_behind_its_client_gets_every_message_once_it_reads() -> None:
    """More than the read-ahead queued on a call holds its credit back; reading gives it back, so a burst
    larger than the windows arrives whole (it stalled for good when held credit was never returned)."""
    got: list[int] = []

    async def late_reader(request_iterator: Any, context: Any) -> bytes:
        await asyncio.sleep(0.5)  # (the client's burst queues meanwhile)
        n = 0
        async for m in request_iterator:
            n += len(m)
            got.append(len(m))
        return str(n).encode()

    server = Server(Limits(initial_window_size=65_535))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Late": grpc.stream_unary_rpc_method_handler(late_reader, _ident, _ident)}),))
    port = await server.bind("127.0.0.1", 0)
    await server.start()
    try:
        async with _channel(port) as ch:
            async def burst() -> AsyncIterator[bytes]:
                for _ in range(400):
                    yield b"m" * 4000  # 1.6 MB: 25 times the stream's window
            assert await ch.stream_unary(f"/{SERVICE}/Late")(burst(), timeout=20) == b"1600000"
        assert len(got) == 400
    finally:
        await server.stop(0)


async def test_calls_reset_before_they_start_leave_nothing_behind() -> None:
    """HEADERS with a long grpc-timeout and RST_STREAM in one write: the call's deadline timer went with it
    (it kept the call and its connection alive until the deadline)."""
    import gc

    from llmgw.control import grpcserver

    async with serving() as (server, _, port):
        for _ in range(3):
            c = RawClient(port)
            for _ in range(100):
                sid = c.headers("Bidi", extra=((b"grpc-timeout", b"99999999H"),))
                c.conn.reset_stream(sid)
            c.send()
            await asyncio.sleep(0.2)
            c.close()
        for _ in range(100):
            if not server.connections:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        gc.collect()
        assert not server.connections
        assert [o for o in gc.get_objects() if isinstance(o, grpcserver._Call)] == []


async def test_a_peer_that_does_not_read_is_not_read_from() -> None:
    """SETTINGS frames each ask for an ACK: a peer that sends them without reading stops being read once the
    answers fill its connection's buffer, instead of the buffer growing with what it sends."""
    async with serving() as (server, _, port):
        sock = socket.create_connection(("127.0.0.1", port))
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            t0 = time.monotonic()
            while not server.connections and time.monotonic() - t0 < 5:
                await asyncio.sleep(0.01)
            conn = next(iter(server.connections))
            # (the server's kernel buffer small too: the ACKs back up into its transport within a few
            # hundred kB whatever the machine's speed; with the default 4 MiB a slow machine took longer
            # than the bound below to parse that many SETTINGS)
            conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            frame = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" * 1000  # 1,000 empty SETTINGS
            sock.setblocking(False)
            sent = 0
            t0 = time.monotonic()
            while sent < 30_000_000 and time.monotonic() - t0 < 20 and not conn.paused:
                try:
                    sent += sock.send(frame)
                except BlockingIOError:
                    await asyncio.sleep(0.05)
                    try:
                        sent += sock.send(frame)
                    except BlockingIOError:
                        break  # the server stopped reading: the kernel buffers are full
                await asyncio.sleep(0)
            await asyncio.sleep(0.2)
            assert conn.paused, sent
            assert conn.transport.get_write_buffer_size() < 4 * 1024 * 1024
            assert sent < 30_000_000
        finally:
            sock.close()


async def test_unfinished_messages_have_a_budget_per_connection() -> None:
    async with serving(Limits(max_unfinished=1_000_000)) as (_, _, port):
        c = RawClient(port)
        try:
            await asyncio.to_thread(c.events, 0.3)  # (the server's SETTINGS and window: 1 MiB a stream)
            sids = []
            for _ in range(3):  # each says 900 kB and sends 400 kB of it
                sid = c.headers("Bidi")
                c.conn.send_data(sid, b"\x00" + (900_000).to_bytes(4, "big") + b"x" * 16_379)
                for _ in range(24):
                    c.conn.send_data(sid, b"x" * 16_384)
                sids.append(sid)
            c.send()
            ev = await asyncio.to_thread(c.events, 1.5)
            status = {e.stream_id: dict(e.headers).get(b"grpc-status") for e in ev
                      if isinstance(e, h2.events.TrailersReceived | h2.events.ResponseReceived)
                      and b"grpc-status" in dict(e.headers)}
            assert status.get(sids[2]) == b"8"  # RESOURCE_EXHAUSTED: the third is over the budget
            assert sids[0] not in status and sids[1] not in status  # the first two are within it, waiting
        finally:
            c.close()


async def test_a_header_value_with_spaces_at_its_end_is_a_value_not_a_protocol_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """grpc sends metadata values with surrounding spaces (a token read from a file with a trailing blank):
    the call is served, and nothing of the value reaches the log."""
    caplog.set_level("DEBUG")
    async with serving() as (_, echo, port), _channel(port) as ch:
        got = await _m(ch, "unary_unary", "Unary")(b"sp", metadata=[("authorization", "Bearer s3cr3t-token ")],
                                                   timeout=5)
        assert got == b"echo:sp"
        assert ("authorization", "Bearer s3cr3t-token ") in echo.seen_metadata
    assert "s3cr3t" not in caplog.text


async def test_resets_of_answered_calls_do_not_count_as_a_flood() -> None:
    """A client resets a stream it had not ended once its status has come (grpcio does): no rapid reset."""
    async with serving(Limits(max_resets=20)) as (server, _, port):
        c = RawClient(port)
        try:
            for _ in range(60):
                sid = c.headers("Nope")  # (answered UNIMPLEMENTED at once, trailers-only)
                c.send()
                ev: list[Any] = []
                for _ in range(100):  # (its answer within 5 s: 50 ms reads, on a loaded machine too)
                    ev += await asyncio.to_thread(c.events, 0.05)
                    if any(isinstance(e, h2.events.ResponseReceived) for e in ev):
                        break
                assert any(isinstance(e, h2.events.ResponseReceived) for e in ev), ev
                c.conn.reset_stream(sid)
                c.send()
            assert _goaway(await asyncio.to_thread(c.events, 0.3)) is None
            assert len(server.connections) == 1
        finally:
            c.close()
