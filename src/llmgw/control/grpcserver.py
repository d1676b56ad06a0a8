"""The control plane's gRPC server: gRPC over HTTP/2 on the control loop, with ``h2`` doing the framing.

Why not ``grpc.aio``'s server. The control plane's cost at scale is one message per
agent per heartbeat (1,000 agents: 200 a second, each on its own connection).
grpc.aio reads each one through its C core's completion queue, a poller thread, a
hop into the event loop and a future per read: 160-180 us of CPU a message here,
spread over threads of the process that runs the data path. This server reads a
message in one ``data_received`` on the control loop: the DATA frame of an open call
is cut out of the bytes here (``h2`` handles every other frame: HEADERS and HPACK,
SETTINGS, PING, RST_STREAM, GOAWAY, WINDOW_UPDATE) and handed to the handler that
waits for it: 60-70 us a message bare, a bit over a third of grpc.aio's
(docs/control-plane.md has the measurements). The clients (agents, routers that
follow) stay ``grpcio``: this speaks the same wire (the gRPC over HTTP/2 protocol:
length-prefixed messages, ``grpc-status`` in the trailers), and the handlers are the
same servicers, registered through the generated ``add_*Servicer_to_server``
functions (``control.grpc_server: grpcio`` runs them on grpc.aio's server instead).

What it serves: the four arities; coroutine handlers that read and write through
the context (``read``, ``write``, ``abort``, ``peer``, ``invocation_metadata``,
``send_initial_metadata``, ``set_trailing_metadata``, ``set_code``/``set_details``,
``time_remaining``, ``cancelled``) and async-generator ones; deadlines
(``grpc-timeout``); cancellation (a reset stream or a lost connection cancels the
handler's task); flow control both ways (a slow reader holds its writer, not the
loop); no compression (a compressed request is refused UNIMPLEMENTED, as a server
without that codec must); TLS with ALPN ``h2``, mutual TLS.

What protects it: at most ``max_concurrent_streams`` calls a connection (a call over
it is refused, RST_STREAM ``REFUSED_STREAM``: a client may retry it; the connection
goes on), headers
of at most ``max_header_list_size`` bytes, messages of at most
``max_receive_message_length`` (RESOURCE_EXHAUSTED, as gRPC says it), a TLS
handshake and HTTP/2 preface within ``handshake_timeout``, ping strikes as gRPC
counts them (a client pinging more often than ``min_ping_interval_without_data``
with nothing sent in between gets GOAWAY ``ENHANCE_YOUR_CALM`` "too_many_pings"
after ``max_ping_strikes``), streams reset faster than ``max_resets`` a
``reset_window`` (the HTTP/2 "rapid reset" flood) end the connection, and a
connection whose peer has sent nothing for ``keepalive_time`` is pinged and
closed when the ping is not answered within ``keepalive_timeout``.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import inspect
import logging
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from ..log import quiet_protocol_loggers

__all__ = ["Limits", "Server", "server_ssl_context"]

log = logging.getLogger("llmgw.control.grpc")
# SECURITY: hpack logs every header it decodes at DEBUG (the join token's authorization header among
# them), and h2 the frames: never below WARNING, whatever level the root logger or a --log-config sets.
quiet_protocol_loggers()

_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# Request headers that are the protocol's, not the call's metadata (invocation_metadata leaves them out).
_NOT_METADATA = frozenset((b"te", b"content-type", b"grpc-timeout", b"grpc-encoding", b"grpc-accept-encoding",
                           b"grpc-message-type"))
_EOF = grpc.aio.EOF
# How many complete messages a call keeps unread before it stops handing flow-control credit back
# (the peer then waits for the handler instead of filling the process's memory).
_READ_AHEAD = 8
# How long a closed connection may take to write what it has left before it is aborted.
_CLOSE_S = 2.0
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one server allows its peers (the defaults are gRPC's, or the control plane's own settings)."""

    max_receive_message_length: int = 16 * 1024 * 1024
    max_unfinished: int = 32 * 1024 * 1024
    """Bytes of messages begun and not finished yet, over a connection's calls (flow control hands
    their window back as they arrive: without it a connection could hold calls x messages)."""
    max_concurrent_streams: int = 1024
    max_header_list_size: int = 16 * 1024
    initial_window_size: int = 1024 * 1024
    """Per stream; the connection's window is 16 times that."""
    keepalive_time: float = 60.0
    keepalive_timeout: float = 20.0
    min_ping_interval_without_data: float = 10.0
    max_ping_strikes: int = 2
    handshake_timeout: float = 10.0
    max_resets: int = 400
    reset_window: float = 10.0


class _Details:
    """What a generic handler is asked (``grpc.HandlerCallDetails``)."""

    __slots__ = ("invocation_metadata", "method")

    def __init__(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


def server_ssl_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A TLS server context for gRPC: ALPN ``h2``, TLS 1.2 or later, AEAD ciphers (RFC 9113 §9.2.2).

    With ``client_ca`` a client certificate is required and checked against it (mutual TLS).

    Raises:
        OSError: a file cannot be read.
        ssl.SSLError: the files are not a certificate and its key.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # (@SECLEVEL=1: the keys gRPC's own server took, a 1024-bit RSA key among them, still load)
    ctx.set_ciphers("ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20:@SECLEVEL=1")
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=client_ca)
    return ctx


def _peer(addr: Any) -> str:
    """gRPC's peer string: ``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:5``."""
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"ipv6:[{host}]:{port}" if ":" in str(host) else f"ipv4:{host}:{port}"
    return f"unix:{addr}" if addr else "unknown"


def _timeout(value: bytes) -> float | None:
    """A ``grpc-timeout`` value (``100m``, ``5S``: at most 8 digits and a unit) in seconds; None if malformed."""
    text = value.decode("ascii", "replace")
    digits, unit = text[:-1], text[-1:]
    if not digits.isdigit() or len(digits) > 8 or unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


def _percent(message: str) -> bytes:
    """``grpc-message``'s encoding: UTF-8, with ``%`` and bytes outside 0x20-0x7E percent-encoded."""
    out = bytearray()
    for b in message.encode("utf-8", "replace"):
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


def _metadata_headers(md: Iterable[tuple[str, str | bytes]]) -> list[tuple[bytes, bytes]]:
    out = []
    for key, value in md:
        k = key.lower().encode("ascii")
        if k.endswith(b"-bin"):
            raw = value if isinstance(value, bytes) else value.encode()
            out.append((k, base64.b64encode(raw).rstrip(b"=")))
        else:
            out.append((k, value.encode("ascii", "replace") if isinstance(value, str) else value))
    return out


class _Ended(Exception):
    """The call can send nothing more (its stream was reset or its connection lost)."""


class _Call:
    """One RPC: the stream's state on the connection, and the ``context`` its handler is given."""

    def __init__(self, conn: _Connection, stream_id: int, method: str, metadata: tuple[tuple[str, str | bytes], ...],
                 handler: Any, deadline: float | None) -> None:
        self.conn = conn
        self.stream_id = stream_id
        self.method = method
        self.metadata = metadata
        self.handler = handler
        self.deadline = deadline
        self.task: asyncio.Task[None] | None = None
        # inbound
        self.buf = bytearray()
        self.messages: collections.deque[bytes] = collections.deque()
        self.unacked = 0  # flow-control credit of DATA h2 read, held back while the handler is behind (_READ_AHEAD)
        self.held = 0  # the same, of DATA taken past h2
        self.window = conn.limits.initial_window_size  # the stream's receive window, for DATA taken past h2
        self.used = 0
        self.half_closed = False
        self.waiter: asyncio.Future[None] | None = None
        self.failed: tuple[grpc.StatusCode, str] | None = None  # the input broke a rule: ended with this
        # outbound
        self.headers_sent = False
        self.initial_md: list[tuple[bytes, bytes]] = []
        self.trailing_md: Sequence[tuple[str, str | bytes]] = ()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.pending: collections.deque[memoryview] = collections.deque()  # DATA waiting for flow-control window
        self.trailers: list[tuple[bytes, bytes]] | None = None  # sent once pending is
        self.drained: asyncio.Future[None] | None = None
        self.ended = False  # trailers sent, or the stream reset / the connection lost
        self.why_cancelled: str | None = None  # "reset", "deadline", "shutdown", "lost"
        self.timer: asyncio.TimerHandle | None = None

    @property
    def open(self) -> bool:
        """Its input may still come: the client has not ended it, nor has the call ended."""
        return not self.half_closed and self.failed is None and self.trailers is None and not self.ended

    # -- the context (grpc.aio.ServicerContext's part the servicers use) --

    def peer(self) -> str:
        return self.conn.peer

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self.metadata

    def set_trailing_metadata(self, trailing_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing_md = tuple(trailing_metadata)

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str | bytes]]) -> None:
        if self.headers_sent:
            raise RuntimeError("initial metadata was already sent")
        self.initial_md = _metadata_headers(initial_metadata)
        self._send_headers()
        self.conn.flush()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def cancelled(self) -> bool:
        return self.why_cancelled is not None

    def done(self) -> bool:
        return self.ended

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Sequence[tuple[str, str | bytes]] = ()) -> None:
        """End the call with ``code`` now (raises; the handler's code after it does not run).

        From another task than the handler's too (a stream's writer): the status goes at once, and
        the handler's pending :meth:`read` returns ``grpc.aio.EOF``.
        """
        if code == grpc.StatusCode.OK:
            raise ValueError("abort with StatusCode.OK")
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing_md = tuple(trailing_metadata)
        self.finish(code, details)
        self.wake()
        raise grpc.aio.AbortError()

    async def read(self) -> Any:
        """The next request message, or ``grpc.aio.EOF`` once the client has sent its last (or the call ended)."""
        while True:
            if self.ended or self.trailers is not None or self.failed is not None:
                return _EOF
            if self.messages:
                break
            if self.half_closed:
                return _EOF
            fut = self.waiter = self.conn.loop.create_future()
            try:
                await fut
            finally:
                self.waiter = None
        data = self.messages.popleft()
        if (self.unacked or self.held) and len(self.messages) < _READ_AHEAD:
            self.conn.credit(self)
        try:
            return self.handler.request_deserializer(data) if self.handler.request_deserializer else data
        except Exception as exc:
            self.code, self.details = grpc.StatusCode.INTERNAL, f"failed to parse the request ({type(exc).__name__})"
            hook = self.conn.server.on_bad_request
            if hook is not None:  # (answered before any handler ran: the service's counters never see it)
                hook(self.method, self.code)
            raise grpc.aio.AbortError() from None

    async def write(self, message: Any) -> None:
        """Send one response message; returns once the peer's flow-control window took it."""
        if self.ended or self.trailers is not None:
            raise _Ended()
        ser = self.handler.response_serializer
        data = ser(message) if ser is not None else message
        self._send_headers()
        self.pending.append(memoryview(b"\x00" + len(data).to_bytes(4, "big") + data))
        self.conn.pump(self)
        self.conn.flush()
        if self.pending or self.conn.paused:
            fut = self.drained = self.conn.loop.create_future()
            try:
                await fut
            finally:
                self.drained = None
        if self.ended and self.why_cancelled is not None:
            raise _Ended()

    # -- the call's life --

    def _send_headers(self) -> None:
        if not self.headers_sent:
            self.headers_sent = True
            self.conn.h2.send_headers(self.stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc"),
                                                      *self.initial_md])
            self.conn.sent_something()

    def _requests(self) -> AsyncIterator[Any]:
        async def gen() -> AsyncIterator[Any]:
            while True:
                msg = await self.read()
                if msg is _EOF:
                    return
                yield msg
        return gen()

    async def _one(self) -> Any:
        """A unary call's request: its one message, once the client has ended its side."""
        while not self.half_closed and self.failed is None and not self.ended and len(self.messages) < 2:
            fut = self.waiter = self.conn.loop.create_future()
            try:
                await fut
            finally:
                self.waiter = None
        if self.failed is not None or self.ended:
            raise grpc.aio.AbortError()
        if len(self.messages) != 1:
            self.code, self.details = grpc.StatusCode.INTERNAL, "a unary call carries exactly one request message"
            raise grpc.aio.AbortError()
        return await self.read()

    async def run(self) -> None:
        h = self.handler
        code, details = grpc.StatusCode.OK, ""
        try:
            request = self._requests() if h.request_streaming else await self._one()
            fn = (h.stream_stream if h.response_streaming else h.stream_unary) if h.request_streaming else (
                h.unary_stream if h.response_streaming else h.unary_unary)
            result = fn(request, self)
            if h.response_streaming:
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        await self.write(item)
                elif inspect.isawaitable(result):
                    await result
                elif result is not None:  # a synchronous generator
                    for item in result:
                        await self.write(item)
            else:
                if inspect.isawaitable(result):
                    result = await result
                if result is not None:
                    await self.write(result)
                elif self.code in (None, grpc.StatusCode.OK):
                    self.code, self.details = grpc.StatusCode.INTERNAL, "the handler returned no response"
            if self.code is not None:
                code, details = self.code, self.details
            if self.failed is not None:  # (the input broke a rule while the handler ran on)
                code, details = self.failed
        except grpc.aio.AbortError:
            if self.failed is not None:
                code, details = self.failed
            else:
                code, details = self.code or grpc.StatusCode.UNKNOWN, self.details
        except _Ended:
            return
        except asyncio.CancelledError:
            why = self.why_cancelled
            if why in ("reset", "lost", "answered"):
                return  # nobody to tell, or already told
            if why == "deadline":
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            elif why == "shutdown":
                code, details = grpc.StatusCode.UNAVAILABLE, "the control plane is stopping"
            else:  # cancelled by the application (a handover to another leader, a closing service)
                code, details = grpc.StatusCode.CANCELLED, "the call was cancelled by the server"
        except NotImplementedError:
            code = self.code if self.code not in (None, grpc.StatusCode.OK) else grpc.StatusCode.UNIMPLEMENTED
            details = self.details or "Method not implemented!"
        except Exception:
            log.exception("gRPC %s from %s failed", self.method, self.conn.peer)
            code, details = grpc.StatusCode.UNKNOWN, "the control plane failed on this call (its log says why)"
        finally:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
        self.finish(code, details)

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        """Send the status (trailers, after whatever data is still waiting for window)."""
        if self.ended or self.trailers is not None:
            return
        trailers = [(b"grpc-status", str(code.value[0]).encode())]
        if details:
            trailers.append((b"grpc-message", _percent(details)))
        if self.trailing_md:
            trailers += _metadata_headers(self.trailing_md)
        if not self.headers_sent:  # trailers-only: one HEADERS frame
            self.headers_sent = True
            self.ended = True
            try:
                self.conn.h2.send_headers(self.stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc"),
                                                          *self.initial_md, *trailers], end_stream=True)
            except h2.exceptions.ProtocolError:  # the stream went meanwhile
                pass
            self.conn.sent_something()
            self.conn.forget(self)
            self.conn.flush()
            return
        self.trailers = trailers
        self.conn.pump(self)
        self.conn.flush()

    def ran(self, task: asyncio.Task[None]) -> None:
        """The handler's task is over (its end, however it came, even cancelled before its first step)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.ended and self.trailers is None:  # (run() never got to say it)
            why = self.why_cancelled
            if why == "deadline":
                self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            elif why == "shutdown":
                self.finish(grpc.StatusCode.UNAVAILABLE, "the control plane is stopping")
            elif why not in ("reset", "lost", "answered"):
                self.finish(grpc.StatusCode.CANCELLED, "the call was cancelled by the server")

    def cancel(self, why: str) -> None:
        if self.why_cancelled is None:
            self.why_cancelled = why
        if why in ("reset", "lost"):  # (the stream is gone: nothing more is sent on it)
            self.ended = True
        if why != "deadline" and self.timer is not None:
            self.timer.cancel()
            self.timer = None
        task = self.task
        if task is not None and not task.done():
            task.cancel()
        self.wake()

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)
        d = self.drained
        if d is not None and not d.done():
            d.set_result(None)


class _H2Connection(h2.connection.H2Connection):
    """h2's connection, less its count of open streams against ``max_concurrent_streams``:
    :meth:`_Connection._request` refuses a stream over the limit itself.

    RFC 9113 §5.1.2 makes such a stream a stream error (REFUSED_STREAM: the client may retry
    it). h2 raised a connection error before the header block was decoded, and an undecoded
    block leaves HPACK's state (the connection's) behind: the whole connection had to close.
    """

    _counting = True

    def _receive_headers_frame(self, frame: Any) -> Any:
        self._counting = False
        try:
            return super()._receive_headers_frame(frame)
        finally:
            self._counting = True

    @property
    def open_inbound_streams(self) -> int:
        n: int = super().open_inbound_streams  # (h2 also forgets its closed streams here)
        return n if self._counting else 0


class _Connection(asyncio.Protocol):
    """One client connection: HTTP/2 through ``h2``, its calls, its timers."""

    def __init__(self, server: Server, tls: ssl.SSLContext | None = None) -> None:
        self.server = server
        self.tls = tls
        self.sslobj: ssl.SSLObject | None = None
        self.bio_in = self.bio_out = ssl.MemoryBIO()
        self.handshaken = False
        self.limits = server.limits
        self.loop = server.loop
        self.transport: Any = None
        self.peer = "unknown"
        # (h2's own checks of header values refuse some grpc sends, a value with a space at either end,
        # as a protocol error of the whole connection; the call's checks are _request's)
        cfg = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=False)
        self.h2 = _H2Connection(config=cfg)
        self.calls: dict[int, _Call] = {}
        self.paused = False
        self.closed = False
        self.started = False  # the client's preface (its SETTINGS) arrived
        self.last_read = time.monotonic()
        self.last_ping: float | None = None
        self.strikes = 0
        self.resets: collections.deque[float] = collections.deque()
        self.ping_out: bytes | None = None  # a keepalive ping waiting for its ack
        self.timer: asyncio.TimerHandle | None = None
        self.inbuf = bytearray()  # the start of a frame not whole yet
        self.prefaced = False
        self.lost = False  # connection_lost came
        self.partial = 0  # bytes of messages not whole yet, over the connection's calls
        self.out: list[bytes] = []  # frames of our own (WINDOW_UPDATE) for the next flush
        self.window = 16 * self.limits.initial_window_size  # the connection's receive window, for DATA taken here
        self.used = 0  # bytes taken here and read, not yet handed back

    # -- asyncio.Protocol --

    def connection_made(self, transport: Any) -> None:  # (uvloop's transports are not asyncio.Transport's)
        self.transport = transport
        self.peer = _peer(transport.get_extra_info("peername"))
        self.server.connections.add(self)
        self.server.accepted_at = time.monotonic()
        self.timer = self.loop.call_later(self.limits.handshake_timeout, self._preface_due)
        if self.tls is None:
            self._start()
            return
        # TLS through memory BIOs on the TCP transport this server holds from the accept on: a
        # connection caught in its handshake is one stop() closes too, and the handshake's time is
        # the preface's (handshake_timeout, from the accept)
        self.bio_in, self.bio_out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.sslobj = self.tls.wrap_bio(self.bio_in, self.bio_out, server_side=True)

    def _start(self) -> None:
        lim = self.limits
        s = h2.settings.SettingCodes
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            s.MAX_CONCURRENT_STREAMS: lim.max_concurrent_streams,
            s.MAX_HEADER_LIST_SIZE: lim.max_header_list_size,
            s.INITIAL_WINDOW_SIZE: lim.initial_window_size,
            s.ENABLE_PUSH: 0,
        })
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(16 * lim.initial_window_size - 65_535)
        self.flush()

    def _tls_in(self, data: bytes) -> bytes | None:
        """TLS records in, plaintext out (None: nothing yet, or the connection is closed)."""
        sslobj = self.sslobj
        assert sslobj is not None
        self.bio_in.write(data)
        try:
            if not self.handshaken:
                sslobj.do_handshake()
                self.handshaken = True
                if sslobj.selected_alpn_protocol() != "h2":
                    log.debug("closing a TLS connection from %s that did not ask for h2 (ALPN)", self.peer)
                    self._tls_out()
                    self.close()
                    return None
                self._start()
            chunks = []
            while True:
                chunk = sslobj.read(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLZeroReturnError:  # the peer's close_notify
            self._tls_out()
            self.close()
            return None
        except ssl.SSLError as exc:
            log.debug("closing the TLS connection from %s: %s", self.peer, exc)
            self._tls_out()
            self.close()
            return None
        self._tls_out()  # (a handshake's answer, a session ticket)
        if not self.handshaken:
            return None
        return b"".join(chunks) if len(chunks) != 1 else chunks[0]

    def _tls_out(self) -> None:
        out = self.bio_out.read()
        if out and not self.closed:
            self.transport.write(out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()

    def _lost(self) -> None:
        self.lost = True
        self.closed = True
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        for call in list(self.calls.values()):
            call.cancel("lost")
        self.calls.clear()

    def pause_writing(self) -> None:
        # (a peer that does not read what it is sent is not read from either: whatever it sends that
        # asks for an answer, a SETTINGS, a PING, a call, would otherwise pile up answers here)
        self.paused = True
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
        for call in list(self.calls.values()):
            if call.drained is not None and not call.pending:
                call.wake()

    def data_received(self, data: bytes) -> None:
        """Split the bytes into frames: a DATA frame of an open call is taken here; the rest goes to ``h2``.

        PERF: a heartbeat is one DATA frame. Through h2 (a frame object, the stream's state machine, an
        event, the flow-control managers) it cost 40-60 us of CPU in a control plane with 1,000
        connections; taken here, a few. h2 only ever gets whole frames, in order, so its view of the
        connection stays exact; the DATA frames taken here are flow-controlled here (:meth:`_taken`).
        """
        if self.closed:
            return
        self.last_read = time.monotonic()
        if self.sslobj is not None:
            plain = self._tls_in(data)
            if not plain:
                return
            data = plain
        if self.inbuf:
            self.inbuf += data
            data = bytes(self.inbuf)
            self.inbuf.clear()
        n = len(data)
        pos = 0
        if not self.prefaced:
            if n < 24 and _PREFACE.startswith(data):
                self.inbuf += data
                return
            self.prefaced = True
            pos = 24  # (h2 gets the preface with what follows: it checks it)
        start = 0  # the first byte neither handed to h2 nor taken
        limit = self.h2.max_inbound_frame_size
        calls = self.calls
        while n - pos >= 9:
            length = (data[pos] << 16) | (data[pos + 1] << 8) | data[pos + 2]
            if length > limit:  # (h2 says FRAME_SIZE_ERROR)
                pos = n
                break
            end = pos + 9 + length
            if end > n:
                break
            if data[pos + 3] == 0 and not data[pos + 4] & 0x09:  # DATA, neither END_STREAM nor PADDED
                call = calls.get(int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF)
                if call is not None and call.open:
                    if start < pos and not self._h2(data[start:pos]):
                        return
                    self._taken(call, data[pos + 9:end])
                    start = end
                    if self.closed:
                        return
            pos = end
        if start < pos and not self._h2(data[start:pos]):
            return
        if pos < n:
            self.inbuf += data[pos:]
        self.flush()

    def _h2(self, data: bytes) -> bool:
        """Whole frames through h2, and its events; False if the connection is closed."""
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            # SECURITY: the exception's text may quote a header (the join token's): its kind only
            log.debug("closing the connection from %s: HTTP/2 protocol error (%s)", self.peer, type(exc).__name__)
            self.flush()
            self.close()
            return False
        for ev in events:
            if isinstance(ev, h2.events.DataReceived):
                self._data(ev)
            elif isinstance(ev, h2.events.RequestReceived):
                self._request(ev)
            elif isinstance(ev, h2.events.StreamEnded):
                call = self.calls.get(ev.stream_id)
                if call is not None:
                    self._end_input(call)
            elif isinstance(ev, h2.events.StreamReset):
                self._reset(ev.stream_id)
            elif isinstance(ev, h2.events.WindowUpdated):
                if ev.stream_id:
                    self._pump_one(ev.stream_id)
                else:
                    self._pump_all()
            elif isinstance(ev, h2.events.RemoteSettingsChanged):
                if not self.started:  # the client's preface
                    self.started = True
                    self._keepalive_arm()
                self._pump_all()
            elif isinstance(ev, h2.events.PingReceived):
                self._ping()
            elif isinstance(ev, h2.events.PingAckReceived):
                if ev.ping_data == self.ping_out:
                    self.ping_out = None
            elif isinstance(ev, h2.events.TrailersReceived):
                call = self.calls.get(ev.stream_id)
                if call is not None and ev.stream_ended:
                    self._end_input(call)
            elif isinstance(ev, h2.events.ConnectionTerminated):
                # (h2 sends nothing more once the peer said GOAWAY, not even on the streams it lets
                # finish: their handlers are cancelled and the connection closed; a grpcio client says
                # it only as its channel closes)
                self.close()
        return not self.closed

    # -- inbound --

    def _request(self, ev: h2.events.RequestReceived) -> None:
        sid = ev.stream_id
        if self._over_limit(sid):
            # (a client that opened it before our SETTINGS came, or one that ignores them: refused
            # streams count as resets do, so that refusing them cannot be a flood)
            log.debug("refused stream %d from %s: over max_concurrent_streams", sid, self.peer)
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            self._count_reset()
            return
        headers = ev.headers or []
        method = path = ctype = None
        encoding = b"identity"
        deadline = None
        md: list[tuple[str, str | bytes]] = []
        for k, v in headers:
            if k == b":path":
                path = v
            elif k == b":method":
                method = v
            elif k == b"content-type":
                ctype = v
            elif k == b"grpc-timeout":
                t = _timeout(v)
                if t is not None:
                    deadline = time.monotonic() + t
            elif k == b"grpc-encoding":
                encoding = v
            elif k[:1] != b":" and k not in _NOT_METADATA:
                key = k.decode("latin-1")
                if key.endswith("-bin"):
                    try:
                        md.append((key, base64.b64decode(v + b"=" * (-len(v) % 4))))
                    except ValueError:
                        md.append((key, v))
                else:
                    md.append((key, v.decode("latin-1")))
        if method != b"POST":
            self._http_error(sid, b"405")
            return
        if ctype is None or not (ctype == b"application/grpc" or ctype.startswith((b"application/grpc+",
                                                                                   b"application/grpc;"))):
            self._http_error(sid, b"415")
            return
        name = (path or b"").decode("latin-1")
        metadata = tuple(md)
        handler = self.server.lookup(name, metadata)
        call = _Call(self, sid, name, metadata, handler, deadline)
        self.calls[sid] = call
        if ev.stream_ended:
            call.half_closed = True
        if handler is None:
            call.finish(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        if encoding not in (b"identity", b""):
            call.initial_md = [(b"grpc-accept-encoding", b"identity")]
            call.finish(grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {encoding.decode('latin-1')!r} is not supported")
            return
        if self.server.stopping:
            call.finish(grpc.StatusCode.UNAVAILABLE, "the control plane is stopping")
            return
        if deadline is not None:
            call.timer = self.loop.call_later(max(0.0, deadline - time.monotonic()), call.cancel, "deadline")
        call.task = self.loop.create_task(call.run(), name=f"gRPC {name}")
        call.task.add_done_callback(call.ran)

    def _over_limit(self, sid: int) -> bool:
        """Whether stream ``sid`` is over ``max_concurrent_streams``: counted with the streams open
        before it (h2 has made every stream of the bytes read when the first one's event comes)."""
        n = 0
        for k, stream in self.h2.streams.items():
            if k <= sid and k & 1 and stream.open:
                n += 1
        return n > self.h2.local_settings.max_concurrent_streams

    def _take(self, call: _Call, chunk: bytes) -> bool:
        """A DATA frame's payload into its call's messages (and the handler woken); False if it broke a rule."""
        buf = call.buf
        messages = call.messages
        size = len(chunk)
        limit = self.limits.max_receive_message_length
        if not buf and size >= 5 and not chunk[0] and int.from_bytes(chunk[1:5], "big") == size - 5:
            if size - 5 > limit:
                return self._too_large(call, size - 5)
            messages.append(chunk[5:])  # (the common case: one message, one frame)
        else:
            buf += chunk
            self.partial += size  # (every byte in a call's buf is counted here, until cut out or dropped)
            while len(buf) >= 5:
                size = int.from_bytes(buf[1:5], "big")
                if size > limit:
                    return self._too_large(call, size)
                if buf[0]:
                    self._refuse_input(call, grpc.StatusCode.UNIMPLEMENTED,
                                       "a compressed message, and no grpc-encoding this server knows")
                    return False
                if len(buf) < 5 + size:
                    break
                messages.append(bytes(buf[5:5 + size]))
                del buf[:5 + size]
                self.partial -= 5 + size
            if self.partial > self.limits.max_unfinished:
                self._refuse_input(call, grpc.StatusCode.RESOURCE_EXHAUSTED, f"more than "
                                   f"{self.limits.max_unfinished} bytes of unfinished messages on this connection")
                return False
        w = call.waiter
        if messages and w is not None and not w.done():
            w.set_result(None)
        return True

    def _too_large(self, call: _Call, size: int) -> bool:
        limit = self.limits.max_receive_message_length
        self._refuse_input(call, grpc.StatusCode.RESOURCE_EXHAUSTED, f"Received message larger than max ({size} vs. "
                           f"{limit})")
        return False

    def _data(self, ev: h2.events.DataReceived) -> None:
        """A DATA frame h2 read (the first of a call, its last, a padded one)."""
        call = self.calls.get(ev.stream_id)
        n = ev.flow_controlled_length
        if call is None or not call.open or not self._take(call, ev.data) or len(call.messages) < _READ_AHEAD:
            if n:  # (for a call answered already: the bytes dropped, their credit handed back)
                self.h2.acknowledge_received_data(n, ev.stream_id)
        else:
            call.unacked += n

    def _taken(self, call: _Call, chunk: bytes) -> None:
        """A DATA frame taken past h2: its flow control (RFC 9113 §6.9) kept here."""
        n = len(chunk)
        if n > call.window or n > self.window:
            log.warning("closing the connection from %s: it sent past its flow-control window", self.peer)
            self.goaway(h2.errors.ErrorCodes.FLOW_CONTROL_ERROR, b"")
            return
        call.window -= n
        self.window -= n
        if not self._take(call, chunk) or len(call.messages) < _READ_AHEAD:
            self._consumed(call, n)
        else:
            call.held += n

    def _consumed(self, call: _Call, n: int) -> None:
        """``n`` bytes taken past h2 were read: the windows opened again once half of one is used."""
        call.used += n
        self.used += n
        if call.used >= self.limits.initial_window_size // 2 and call.open:
            call.window += call.used
            self.out.append(b"\x00\x00\x04\x08\x00" + call.stream_id.to_bytes(4, "big") + call.used.to_bytes(4, "big"))
            call.used = 0
        if self.used >= 8 * self.limits.initial_window_size:
            self.window += self.used
            self.out.append(b"\x00\x00\x04\x08\x00\x00\x00\x00\x00" + self.used.to_bytes(4, "big"))
            self.used = 0

    def _refuse_input(self, call: _Call, code: grpc.StatusCode, details: str) -> None:
        """The client's input broke a rule: the call is answered ``code`` now, its handler cancelled."""
        call.failed = (code, details)
        self.partial -= len(call.buf)
        call.buf.clear()
        call.messages.clear()
        self.credit(call)
        call.finish(code, details)
        call.cancel("answered")

    def credit(self, call: _Call) -> None:
        """Hand back the flow-control credit held while the call's handler was behind (the connection's
        only, for a call that has ended)."""
        n, call.unacked = call.unacked, 0
        held, call.held = call.held, 0
        if held:
            self._consumed(call, held)  # (a stream update only while the call is open)
        if n:
            try:
                self.h2.acknowledge_received_data(n, call.stream_id)  # (h2: the connection's alone once closed)
            except h2.exceptions.ProtocolError:
                pass
        if not self.closed:
            self.flush()

    def _end_input(self, call: _Call) -> None:
        call.half_closed = True
        if call.buf:  # a message cut short by the end of the stream
            self._refuse_input(call, grpc.StatusCode.INTERNAL, "the request ended inside a message")
            return
        w = call.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _reset(self, sid: int) -> None:
        call = self.calls.pop(sid, None)
        if call is None:
            return  # (a stream this server has answered: grpcio resets those it had not ended; no flood)
        call.cancel("reset")
        self._release(call)
        self._count_reset()

    def _count_reset(self) -> None:
        """A stream reset (by the client, or refused here): too many within ``reset_window`` end the connection."""
        now = time.monotonic()
        resets = self.resets
        resets.append(now)
        while resets and now - resets[0] > self.limits.reset_window:
            resets.popleft()
        if len(resets) > self.limits.max_resets:
            log.warning("closing the connection from %s: %d streams reset within %gs", self.peer, len(resets),
                        self.limits.reset_window)
            self.goaway(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_resets")

    def _ping(self) -> None:
        now = time.monotonic()
        last, self.last_ping = self.last_ping, now
        if last is not None and now - last < self.limits.min_ping_interval_without_data:
            self.strikes += 1
            if self.strikes > self.limits.max_ping_strikes:
                log.warning("closing the connection from %s: too many pings", self.peer)
                self.goaway(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, b"too_many_pings")

    def sent_something(self) -> None:
        """Headers or data went out: the ping strikes start again (as gRPC counts them)."""
        self.strikes = 0
        self.last_ping = None

    def _http_error(self, sid: int, status: bytes) -> None:
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.send_headers(sid, [(b":status", status)], end_stream=True)

    # -- outbound --

    def pump(self, call: _Call) -> None:
        """Send what the call has waiting, as far as the flow-control windows allow; then its trailers."""
        if call.ended or self.closed:
            call.pending.clear()
            call.wake()
            return
        sid = call.stream_id
        conn = self.h2
        pending = call.pending
        try:
            while pending:
                window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if window <= 0:
                    break
                chunk = pending[0]
                if len(chunk) <= window:
                    conn.send_data(sid, bytes(chunk))
                    pending.popleft()
                else:
                    conn.send_data(sid, bytes(chunk[:window]))
                    pending[0] = chunk[window:]
                self.sent_something()
            if not pending and call.trailers is not None:
                conn.send_headers(sid, call.trailers, end_stream=True)
                call.ended = True
                self.forget(call)
        except h2.exceptions.ProtocolError:  # (the stream was reset meanwhile)
            pending.clear()
            call.ended = True
            self.forget(call)
        if not pending and not self.paused:
            d = call.drained
            if d is not None and not d.done():
                d.set_result(None)

    def _pump_one(self, sid: int) -> None:
        call = self.calls.get(sid)
        if call is not None and (call.pending or call.trailers is not None):
            self.pump(call)

    def _pump_all(self) -> None:
        for call in list(self.calls.values()):
            if call.pending:
                self.pump(call)

    def _release(self, call: _Call) -> None:
        """A call that is done with: the bytes it still holds, and the credit for them, given back."""
        self.partial -= len(call.buf)
        call.buf.clear()
        call.messages.clear()
        if call.unacked or call.held:
            self.credit(call)

    def forget(self, call: _Call) -> None:
        if self.calls.get(call.stream_id) is call:
            del self.calls[call.stream_id]
            self._release(call)
        if self.server.stopping and not self.calls:
            self.goaway(h2.errors.ErrorCodes.NO_ERROR, b"")

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if self.out:
            data = b"".join((data, *self.out))
            self.out.clear()
        if data and self.transport is not None and not self.closed:
            if self.sslobj is not None:
                if not self.handshaken:  # (a GOAWAY for a connection still in its handshake: nothing to say it on)
                    return
                self.sslobj.write(data)
                self._tls_out()
            else:
                self.transport.write(data)

    def going_away(self) -> None:
        """The first GOAWAY of a graceful stop (RFC 9113 §6.8): NO_ERROR with the last stream this server
        took, and the calls open served on; the connection closes once they end (:meth:`forget`).

        Written past h2, which once told would send nothing more on the calls still open."""
        if self.closed:
            return
        if not self.calls or not self.started:
            self.goaway(h2.errors.ErrorCodes.NO_ERROR, b"")
            return
        last = self.h2.highest_inbound_stream_id
        self.out.append(b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + last.to_bytes(4, "big") + bytes(4))
        self.flush()

    def goaway(self, code: int, debug: bytes) -> None:
        """Say GOAWAY and close (the calls still open are ended: their handlers cancelled)."""
        if self.closed:
            return
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.close_connection(error_code=code, additional_data=debug or None)
        self.flush()
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            if self.sslobj is not None and self.handshaken:
                with contextlib.suppress(ssl.SSLError):
                    self.sslobj.unwrap()  # (close_notify; the peer's answer is not waited for)
                self._tls_out()
            self.closed = True
            self.transport.close()
            if self.paused:  # (its buffer would wait for a peer that does not read: not kept for it)
                self.transport.abort()
            else:
                self.loop.call_later(_CLOSE_S, self._abort)
        for call in list(self.calls.values()):
            call.cancel("lost")
            self._release(call)
        self.calls.clear()

    def _abort(self) -> None:
        if self.transport is not None and not self.lost:
            self.transport.abort()

    # -- timers --

    def _preface_due(self) -> None:
        self.timer = None
        if not self.started and not self.closed:
            log.debug("closing the connection from %s: no HTTP/2 preface within %gs", self.peer,
                      self.limits.handshake_timeout)
            self.close()

    def _keepalive_arm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = self.loop.call_later(self.limits.keepalive_time, self._keepalive)

    def _keepalive(self) -> None:
        self.timer = None
        if self.closed:
            return
        if self.ping_out is not None:  # the ping sent a keepalive_timeout ago was not answered
            log.info("closing the connection from %s: its keepalive ping was not answered within %gs", self.peer,
                     self.limits.keepalive_timeout)
            self.close()
            return
        idle = time.monotonic() - self.last_read
        if idle < self.limits.keepalive_time:
            self.timer = self.loop.call_later(self.limits.keepalive_time - idle, self._keepalive)
            return
        self.ping_out = self.ping_out or time.monotonic_ns().to_bytes(8, "big")
        with contextlib.suppress(h2.exceptions.ProtocolError):
            self.h2.ping(self.ping_out)
        self.flush()
        self.timer = self.loop.call_later(self.limits.keepalive_timeout, self._keepalive)


class Server:
    """A gRPC server on the running loop, for generated ``add_*Servicer_to_server`` functions."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.loop = asyncio.get_running_loop()
        self.methods: dict[str, Any] = {}
        self.generic: list[Any] = []
        self.listeners: list[Any] = []
        self.connections: set[_Connection] = set()
        self.accepted_at = 0.0
        """When the last connection was accepted (monotonic; 0: none yet)."""
        self.stopping = False
        self.on_bad_request: Callable[[str, grpc.StatusCode], None] | None = None
        """Called with the method (``/pkg.Service/Method``) and the status of a call answered for a request
        message that does not parse (before any handler runs)."""

    # the generated code's registration calls
    def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, h in handlers.items():
            self.methods[f"/{service}/{name}"] = h

    def lookup(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]) -> Any:
        h = self.methods.get(method)
        if h is None and self.generic:
            details = _Details(method, metadata)
            for g in self.generic:
                h = g.service(details)
                if h is not None:
                    break
        return h

    async def bind(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen on ``host:port`` (every address the host has, one port); the port bound.

        Raises:
            OSError: the address cannot be bound.
        """
        infos = await self.loop.getaddrinfo(host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM,
                                            flags=socket.AI_PASSIVE)
        seen: set[tuple[int, Any]] = set()
        socks: list[socket.socket] = []
        try:
            for family, kind, proto, _, addr in infos:
                if (family, addr[0]) in seen:
                    continue
                seen.add((family, addr[0]))
                sock = socket.socket(family, kind, proto)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(socks) > 1:  # the same port on every address
                    addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
                sock.bind(addr)
                sock.listen(1024)
                sock.setblocking(False)
        except OSError:
            for s in socks:
                s.close()
            raise
        if not socks:
            raise OSError(f"no address for {host!r}")
        bound = socks[0].getsockname()[1]
        for sock in socks:
            srv = await self.loop.create_server(lambda: _Connection(self, ssl_context), sock=sock)
            self.listeners.append(srv)
        return int(bound)

    async def start(self) -> None:
        for srv in self.listeners:
            await srv.start_serving()

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening; calls still open get ``grace`` seconds to end, then end UNAVAILABLE; connections close.

        Every connection is told at once (GOAWAY, NO_ERROR, naming the last call taken): its client sends
        new calls elsewhere while those open finish; one with no call open closes now.
        """
        self.stopping = True
        for srv in self.listeners:
            srv.close()
        for conn in list(self.connections):
            conn.going_away()
        if grace:
            deadline = time.monotonic() + grace
            while any(c.calls for c in self.connections) and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        tasks = []
        for conn in list(self.connections):
            for call in list(conn.calls.values()):
                if call.task is not None and not call.task.done():
                    tasks.append(call.task)
                call.cancel("shutdown")
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for conn in list(self.connections):
            conn.goaway(h2.errors.ErrorCodes.NO_ERROR, b"")
        for srv in self.listeners:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 1.0)
        self.listeners.clear()

