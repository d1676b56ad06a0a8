# cython: annotation_typing=False
"""The data path: the HTTP/1.1 server, the upstream client and the proxy call.

This file is both the pure-Python implementation and, compiled by Cython with the
declarations in ``dataplane.pxd``, the extension module ``llmgw._fast.dataplane``
(the classes become extension types with C-level attributes and methods). One
source means the twins cannot drift apart. Import it through the facades
:mod:`llmgw.http.server`, :mod:`llmgw.http.client` and :mod:`llmgw.gateway.proxy`.

**The server.** One protocol object per client connection on uvloop. An *app* is any
object with ``handle(request, writer)``; it may answer at once (returning ``None``)
or return an awaitable, which runs as a task. The server owns everything else:
limits and timeouts, pipelining (answered in order), ``100 Continue``,
keep-alive, flow control in both directions, the connection limit, OpenAI-shaped
error answers, and a graceful shutdown.

**The upstream client.** Pooled keep-alive HTTP/1.1 connections to one replica, one
raw protocol per connection with httptools' response parser (through
:class:`~llmgw.http.parser.ResponseReader`). A connection serves one exchange at a
time. The exchange is a *sink* object with ``on_response_head(resp)``,
``on_response_body(data)``, ``on_response_end()`` and ``on_upstream_lost(exc)``;
bytes are passed to it as they arrive. The same client serves proxying and scraping.

**The proxy.** ``POST /v1/*`` with a JSON body naming a ``model`` is proxied to one of
that model's replicas; ``GET /v1/models`` lists the fleet's models. The body is
read only for ``model`` and forwarded byte for byte unless the model name must be
rewritten (an alias, or ``upstream_name``).

A request travels as one :class:`Call`: admission (straight through below pool
saturation 1.0, else a bounded priority-band queue), a replica chosen by the
model's picker, an attempt on a pooled keep-alive connection, and the answer
relayed back. Everything after parsing is driven by callbacks; a task is made
only to open a new upstream connection.

Failure semantics:

* before any byte reached the client (connect refused or timed out, reset,
  502/503 from the engine, a non-streamed answer cut short) the request is retried
  on another replica (``retries.attempts`` times, within ``retries.budget``), then
  answered with a clear error;
* after the first byte there is never a retry: a stream cut by the engine ends
  with an SSE ``data: {"error": ...}`` event and the connection is closed;
* a client that goes away aborts the upstream request at once; every counter
  returns to where it was.

NOTE (compiled build): classes declared in ``dataplane.pxd`` are extension types,
so they cannot grow attributes that are not declared there, and methods declared
``cpdef`` there may not hold closures (lambdas, generator expressions).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import hashlib
import hmac
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from ..errors import (
    BadGatewayError,
    BadRequestError,
    GatewayTimeoutError,
    HTTPError,
    InternalError,
    ModelNotFoundError,
    NotFoundError,
    OverloadedError,
    RateLimitedError,
    UnauthorizedError,
)
from ..gateway.jsonscan import JSONScanError, json_model, model_span
from ..gateway.observe import NullObserver
from ..http.parser import (
    Request,
    RequestReader,
    Response,
    ResponseReader,
    chunk,
    id_line,
    response_head,
    sse_cut,
    upstream_head,
    usage_counts,
    write_now,
)
from ..http.parser import monotonic as _monotonic
from ..log import access_logger, admin_logger, server_logger, upstream_logger
from ..routing import (
    AdmissionQueue,
    Breaker,
    EndpointState,
    Picker,
    RetryBudget,
    pool_saturation,
    retry_after,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..config import Config, EndpointConfig
    from ..fleet.registry import Registry
    from ..gateway.observe import Observer

__all__ = [
    "App",
    "Call",
    "Endpoint",
    "Gateway",
    "HTTPProtocol",
    "HTTPServer",
    "Hist",
    "ModelPool",
    "RequestSeries",
    "ResponseWriter",
    "ServerLimits",
    "TrafficCounters",
    "UpstreamConnection",
    "UpstreamPool",
    "error_body",
    "normalize_error",
]

log = server_logger



# ---------------------------------------------------------------- the server

# Below this, a head and its body go to the transport as one buffer: copying a
# small body costs less than the transport's bookkeeping for a second one.
_JOIN_BELOW = 64 * 1024


class SocketWriter:
    """One connection's writes: straight to its socket while its transport holds nothing.

    PERF: a transport's ``write`` tries the socket at once too, but its bookkeeping
    costs several times the system call for a small write (an SSE event, a head).
    Here the bytes go out with one ``sendmsg`` (a head and its body together, with
    no joined copy). Whatever the socket does not take goes to the transport, and
    so does every write after it until the transport's buffer is empty again, so
    bytes keep their order and the transport's flow control (``pause_writing``)
    works as before.

    NOTE: never used once the transport is closing: its file descriptor may then be
    closed already and reused by another connection. TLS transports (and any
    without a socket) always go through the transport.
    """

    __slots__ = ("_fd", "_is_closing", "queued", "transport")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self._is_closing = transport.is_closing
        self.queued = False  # the transport may hold unsent bytes: writes go through it
        self._fd = -1
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None and sock.type == socket.SOCK_STREAM:
            self._fd = sock.fileno()

    def write(self, a: bytes, b: bytes = b"") -> None:
        """Send ``a`` then ``b``."""
        n = 0
        if self._fd >= 0 and not self._is_closing():
            if self.queued:
                self.queued = self.transport.get_write_buffer_size() > 0
            if not self.queued:
                n = write_now(self._fd, a, b)
                if n == len(a) + len(b):
                    return
                # (n == -1: the transport meets the same error and reports it)
        self.queued = True
        t = self.transport
        na = len(a)
        if n <= 0:
            if not b:
                t.write(a)
            elif len(b) < _JOIN_BELOW:
                t.write(a + b)
            else:
                t.writelines((a, b))
        elif n < na:
            rest = memoryview(a)[n:] if na - n >= _JOIN_BELOW else a[n:]
            if b:
                t.writelines((rest, b))
            else:
                t.write(rest)
        else:  # (the rest of b: not copied when large)
            t.write(memoryview(b)[n - na :] if len(b) - (n - na) >= _JOIN_BELOW else b[n - na :])


_LAST_CHUNK = b"0\r\n\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Seconds a connection closed after an error answer keeps reading (and dropping)
# what the client still sends; see HTTPProtocol._linger_close.
_LINGER_S = 2.0
JSON = b"application/json"
_JSON_CT = ((b"content-type", JSON),)


def error_body(exc: HTTPError) -> bytes:
    """The OpenAI-shaped JSON body for ``exc``."""
    return orjson.dumps(
        {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}
    )


def _error_headers(exc: HTTPError, extra: tuple[tuple[bytes, bytes], ...] = ()) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", JSON), *extra]
    if exc.retry_after is not None:
        seconds = max(1, int(exc.retry_after + 0.999))
        headers.append((b"retry-after", b"%d" % seconds))
        headers.append((b"retry-after-ms", b"%d" % max(1, int(exc.retry_after * 1000))))
    return headers


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-listener limits; plain values the hot path reads.

    Attributes:
        max_head_bytes: request line plus headers (431 past it).
        max_headers: header lines per request (431 past it).
        max_body: request body bytes (413 past it).
        header_timeout: seconds from a request's first byte to its complete head (408).
        body_timeout: seconds from a complete head to a complete body (408).
        keepalive_timeout: seconds an idle keep-alive connection is kept.
        max_connections: open connections; more are answered 503 and closed at once.
        max_pipelined: requests read ahead of the one being answered before reading pauses.
        priority_header: lower-case name of the priority-band header.
    """

    max_head_bytes: int = 16 * 1024
    max_headers: int = 100
    max_body: int = 16 * 1024 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keepalive_timeout: float = 75.0
    max_connections: int = 10_000
    max_pipelined: int = 16
    priority_header: bytes = b"x-llmgw-priority"


class App(Protocol):
    """What the server calls for each request."""

    def handle(self, request: Request, writer: ResponseWriter) -> Awaitable[None] | None: ...


class ResponseWriter:
    """Writes the response to one request, in order, on its connection.

    Use :meth:`send` for a whole response, or :meth:`start` then :meth:`write`
    (any number of times) then :meth:`end`. :meth:`drain` waits while the client
    reads slower than the app writes. ``disconnected`` turns true when the client
    goes away; ``on_disconnect`` callbacks run then (at most once).
    """

    __slots__ = (
        "_call",
        "_chunked",
        "_conn",
        "_head_only",
        "_listeners",
        "disconnected",
        "finished",
        "keep_alive",
        "request",
        "started",
        "status",
    )

    def __init__(self, conn: HTTPProtocol, request: Request) -> None:
        self._init(conn, request)

    def _init(self, conn: HTTPProtocol, request: Request) -> None:
        # (PERF: the server makes writers with __new__ and this, as Call's)
        # (read back through the typed attributes: C struct reads when compiled)
        self._conn = conn
        self.request = request
        self.keep_alive: bool = self.request.keep_alive and not self._conn._closing
        self.started = False
        self.finished = False
        self.disconnected = False
        self.status = 0
        self._chunked = False
        self._head_only = self.request.method == b"HEAD"
        self._listeners: list[Callable[[], Any]] | None = None
        self._call: Call | None = None  # the proxy call answering here (told when the client goes)

    # -- writing --

    def start(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...] = (),
        content_length: int = -1,
        raw: bytes = b"",
    ) -> None:
        """Send the status line and headers.

        ``content_length`` -1 streams the body chunked; ``raw`` is pre-built header lines.
        """
        if self.started:
            raise InternalError("response already started")
        self.started = True
        self.status = status
        no_body = status < 200 or status in (204, 304)
        if no_body:
            content_length = -2
        self._chunked = content_length == -1
        if self._conn._server.closing:
            # NOTE: a response that begins after shutdown began is the last on its
            # connection; saying so lets the client retry elsewhere instead of
            # reusing a connection about to close.
            self.keep_alive = False
        if not self.disconnected:
            self._conn._transport_write(
                response_head(status, headers, content_length, self.keep_alive, raw)
            )

    def write(self, data: bytes) -> None:
        """Send part of the body (framed as a chunk when streaming chunked)."""
        if not data or self.disconnected or self._head_only:
            return
        out = self._conn._out
        if out is None or self._conn.transport is None:
            return
        if self._chunked:
            # PERF: one buffer, not (size line, data, CRLF): a third of the work
            # for a small SSE event.
            out.write(chunk(data if type(data) is bytes else bytes(data)))
        else:
            out.write(data if type(data) is bytes else bytes(data))

    def write_chunk(self, chunk: bytes) -> bool:
        """Send ``chunk``, already framed as one chunk of a chunked body; false
        (nothing sent) when this response is not chunked."""
        if not self._chunked:
            return False
        if self.disconnected or self._head_only:
            return True
        out = self._conn._out
        if out is not None and self._conn.transport is not None:
            out.write(chunk)
        return True

    def end(self, trailer: bytes = b"") -> None:
        """Finish the response; the connection moves on to the next request."""
        if self.finished:
            return
        if not self.started:
            raise InternalError("response ended before it started")
        if trailer:
            self.write(trailer)
        if self._chunked and not self.disconnected and not self._head_only:
            self._conn._transport_write(_LAST_CHUNK)
        self.finished = True
        self._conn._response_done(self)

    def send(
        self,
        status: int,
        body: bytes = b"",
        headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...] = _JSON_CT,
        raw: bytes = b"",
    ) -> None:
        """Send a whole response with a Content-Length body."""
        if self.started:
            raise InternalError("response already started")
        self.started = True
        self.status = status
        if self._conn._server.closing:
            self.keep_alive = False  # see start()
        # RFC 9110 §8.6: no Content-Length in a 1xx or 204; a 304's would describe
        # the representation, not this empty body.
        no_body = status < 200 or status in (204, 304)
        if not self.disconnected:
            head = response_head(status, headers, -2 if no_body else len(body), self.keep_alive, raw)
            out = self._conn._out
            if out is not None and self._conn.transport is not None:
                if body and not self._head_only and not no_body:
                    out.write(head, body if type(body) is bytes else bytes(body))
                else:
                    out.write(head)
        self.finished = True
        self._conn._response_done(self)

    def send_json(self, status: int, obj: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """Send ``obj`` serialised as JSON."""
        self.send(status, orjson.dumps(obj), (*_JSON_CT, *headers))

    def send_error(self, exc: HTTPError, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """Answer ``exc`` as an OpenAI-shaped JSON error (closing if it says so)."""
        if exc.close:
            self.keep_alive = False
        self.send(exc.status, error_body(exc), _error_headers(exc, headers))

    def abort(self) -> None:
        """Cut the connection now (a response that cannot be finished honestly)."""
        self.keep_alive = False
        self.finished = True
        self._conn._abort()

    async def drain(self) -> None:
        """Wait until the client's socket buffer has room (flow control)."""
        conn = self._conn
        if conn._write_paused and not self.disconnected:
            await conn._drain()

    @property
    def write_paused(self) -> bool:
        """Whether the client reads slower than the response is written."""
        return self._conn._write_paused

    def add_flow_listener(self, listener: Any) -> None:
        """``listener.pause_reading()``/``resume_reading()`` follow the client's pace."""
        self._conn._flow_listener = listener
        if self._conn._write_paused:
            listener.pause_reading()

    def on_disconnect(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` if the client disconnects before the response ends."""
        if self.disconnected:
            callback()
            return
        if self._listeners is None:
            self._listeners = []
        self._listeners.append(callback)

    def _client_gone(self) -> None:
        if self.disconnected:
            return
        self.disconnected = True
        call, self._call = self._call, None
        if call is not None:
            try:
                call.client_gone()
            except Exception:
                log.exception("disconnect callback failed")
        listeners, self._listeners = self._listeners, None
        for cb in listeners or ():
            try:
                cb()
            except Exception:  # one listener's bug must not skip the others
                log.exception("disconnect callback failed")

    @property
    def peer(self) -> Any:
        return self._conn.peer


class HTTPProtocol:
    """One client connection."""

    def __init__(self, server: HTTPServer) -> None:
        # config and shared state
        self._server = server
        self._app = server.app
        self._limits = server.limits
        self._loop = server.loop
        # (read on every request: kept here as floats, not looked up on the limits)
        self._keepalive_timeout = float(server.limits.keepalive_timeout)
        self._header_timeout = float(server.limits.header_timeout)
        self._body_timeout = float(server.limits.body_timeout)
        # connection state
        self.transport: asyncio.Transport | None = None
        self._out: SocketWriter | None = None  # (all writes to the client go through it)
        self.peer: Any = None
        self._reader = RequestReader(
            self._on_request,
            self._on_head,
            server.limits.max_head_bytes,
            server.limits.max_headers,
            server.limits.max_body,
            server.limits.priority_header,
        )
        self._pipeline: collections.deque[Request] = collections.deque()
        self._current: ResponseWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = 0  # 0 none, 1 keep-alive, 2 head, 3 body, 4 linger
        self._timer_at = 0.0  # when the pending handle fires
        self._deadline = 0.0  # when the armed kind expires
        self._read_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._flow_listener: Any = None
        self._closing = False
        self._rejected = False
        self._lingering = False  # answered and half-closed: input is read and dropped
        self._lingering_due = False  # close by _linger_close: input was left unread
        self._failure: HTTPError | None = None  # answered after the requests read before it
        self._continue_due = False  # a 100 Continue owed once the connection is free

    # -- asyncio callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Called when a client connects."""
        self.transport = transport  # type: ignore[assignment]
        self._out = SocketWriter(transport)
        self.peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        server = self._server
        if len(server.connections) >= self._limits.max_connections or server.closing:
            self._rejected = True
            exc = HTTPError(
                "the gateway is at its connection limit; retry shortly"
                if not server.closing
                else "the gateway is shutting down",
                status=503,
                type="service_unavailable_error",
                code="service_unavailable",
                retry_after=1,
            )
            body = error_body(exc)
            self._transport_write(response_head(503, _error_headers(exc), len(body), False) + body)
            self._linger_close()
            server.rejected += 1
            return
        server.connections.add(self)
        self._arm(1, self._keepalive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        """Called when the connection closes, for any reason."""
        if self._rejected:
            self._drop_timer()
            self.transport = None
            return
        self._server.connections.discard(self)
        self._drop_timer()
        self.transport = None
        self._out = None
        self._pipeline.clear()
        cur = self._current
        if cur is not None and not cur.finished:
            cur._client_gone()
            task = self._task
            if task is not None and not task.done():
                task.cancel()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._drain_waiter = None
        self._server._maybe_closed()

    def data_received(self, data: bytes) -> None:
        """Called with bytes from the client."""
        if self._lingering:
            return
        if self._timer_kind == 1:
            self._cancel_timer()
        try:
            self._reader.feed(data)
        except HTTPError as exc:
            self._fail(exc)
            return
        kind = self._timer_kind
        if kind == 0 or kind == 2:
            where = self._reader.where()  # 0 between requests, 1 in a head, 2 in a body
            if kind == 0 and where == 1:
                self._arm(2, self._header_timeout)
            elif where == 2:
                self._arm(3, self._body_timeout)

    def eof_received(self) -> bool | None:
        """Called when the client half-closes: treated as gone, as uvicorn does.

        NOTE: HTTP clients do not half-close while waiting for an answer; a proxy
        that aborts a request closes its side, and that must cancel the work (an
        engine frees the slot), so the transport closes and ``connection_lost`` runs.
        """
        return None

    def pause_writing(self) -> None:
        """Called when the transport's write buffer passes its high-water mark."""
        self._write_paused = True
        if self._flow_listener is not None:
            self._flow_listener.pause_reading()

    def resume_writing(self) -> None:
        """Called when the write buffer drains below its low-water mark."""
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._drain_waiter = None
        if self._flow_listener is not None:
            self._flow_listener.resume_reading()

    # -- requests --

    def _on_head(self, request: Request) -> None:
        # The client waits for 100 Continue before sending the body.
        if self._current is None and not self._pipeline and self.transport is not None:
            self._transport_write(_CONTINUE)
        else:
            # NOTE: sent when the requests before it are answered (_response_done),
            # so a client that waits for it is not left to its own timeout.
            self._continue_due = True

    def _on_request(self, request: Request) -> None:
        self._continue_due = False
        if self._timer_kind in (2, 3):
            self._cancel_timer()
        if self._current is None:
            self._run(request)
        else:
            self._pipeline.append(request)
            if len(self._pipeline) >= self._limits.max_pipelined and not self._read_paused:
                self._read_paused = True
                if self.transport is not None:
                    self.transport.pause_reading()

    def _run(self, request: Request) -> None:
        writer = ResponseWriter.__new__(ResponseWriter)
        writer._init(self, request)
        self._current = writer
        app = self._app
        result = None
        try:
            if type(app) is Gateway:  # PERF: the gateway is called through C (it answers at once)
                gw = app
                gw.handle(request, writer)
            else:
                result = app.handle(request, writer)
        except HTTPError as exc:
            if not writer.started:
                writer.send_error(exc)
            else:
                writer.abort()
            return
        except Exception:
            log.exception("request handler failed")
            self._internal_error(writer)
            return
        if result is not None:
            self._task = self._loop.create_task(self._await(writer, result))

    async def _await(self, writer: ResponseWriter, result: Awaitable[None]) -> None:
        try:
            await result
        except asyncio.CancelledError:
            if not writer.disconnected and not writer.finished:
                self._internal_error(writer)
            raise
        except HTTPError as exc:
            if writer.finished or writer.disconnected:
                return
            if not writer.started:
                writer.send_error(exc)
            else:
                writer.abort()
        except Exception:
            if writer.disconnected:
                return
            log.exception("request handler failed")
            self._internal_error(writer)
        else:
            if not writer.finished and not writer.disconnected:
                log.error("request handler returned without finishing its response")
                self._internal_error(writer)

    def _internal_error(self, writer: ResponseWriter) -> None:
        if writer.finished:
            return
        if writer.started:
            writer.abort()
        else:
            writer.send_error(HTTPError("internal error in the gateway", close=True))

    def _response_done(self, writer: ResponseWriter) -> None:
        # PERF: drop the disconnect callbacks: they usually point back at the app's
        # request object, and that cycle would otherwise wait for the GC.
        writer._listeners = None
        writer._call = None
        if writer is not self._current:
            return
        self._current = None
        self._task = None
        self._flow_listener = None
        if self.transport is None:
            return
        if not writer.keep_alive:
            if self._lingering_due:
                self._linger_close()
            else:
                self._close()
            return
        if self._pipeline:
            nxt = self._pipeline.popleft()
            if (
                self._read_paused
                and self._failure is None
                and len(self._pipeline) < self._limits.max_pipelined // 2
            ):
                self._read_paused = False
                self.transport.resume_reading()
            self._run(nxt)
        elif self._failure is not None:
            exc, self._failure = self._failure, None
            self._send_failure(exc)
        elif self._closing or self._server.closing:
            self._close()
        else:
            where = self._reader.where()
            if where == 0:
                self._arm(1, self._keepalive_timeout)
                return
            # NOTE: a head or body timer that fired while the connection was busy
            # was dropped (the delay was ours); restart it now that only the client
            # can be slow, or a head that never ends would hold the slot forever.
            if self._continue_due:
                self._continue_due = False
                self._transport_write(_CONTINUE)
            if where == 1:
                self._arm(2, self._header_timeout)
            else:
                self._arm(3, self._body_timeout)

    # -- errors, timers, closing --

    def _fail(self, exc: HTTPError) -> None:
        """A protocol-level error: answer it (in order) and close."""
        self._cancel_timer()
        if self.transport is not None:
            self.transport.pause_reading()
        self._read_paused = True
        if self._current is None:
            self._send_failure(exc)
        else:
            # NOTE: the requests read before the bad one are valid and answered
            # first, in order (they used to be dropped, with no answer to the
            # error either); _response_done sends the error after the last.
            self._failure = exc

    def _send_failure(self, exc: HTTPError) -> None:
        self._lingering_due = True  # the client may still be sending what was refused
        writer = ResponseWriter(self, Request())
        writer.keep_alive = False
        self._current = writer
        writer.send_error(exc)

    # PERF: timers are lazy. Arming only records a deadline; one TimerHandle per
    # connection fires at the earliest deadline it was set for and, if the deadline
    # has since moved later, re-arms itself for the rest. A keep-alive connection
    # then costs no call_later/cancel pair per request (about 3.6 us each here).

    def _arm(self, kind: int, delay: float) -> None:
        when = _monotonic() + delay  # (the clock deadlines are kept in; call_later takes delays)
        self._timer_kind = kind
        self._deadline = when
        t = self._timer
        if t is not None:
            if self._timer_at <= when:
                return  # fires first, then re-arms for the rest
            t.cancel()
        self._timer_at = when
        self._timer = self._loop.call_later(delay, self._on_timer)

    def _cancel_timer(self) -> None:
        self._timer_kind = 0  # the pending handle, if any, will find nothing to do

    def _drop_timer(self) -> None:
        self._timer_kind = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        kind = self._timer_kind
        if kind == 0 or self.transport is None:
            return
        now = _monotonic()
        if now < self._deadline - 0.001:
            self._timer_at = self._deadline
            self._timer = self._loop.call_later(self._deadline - now, self._on_timer)
            return
        self._timer_kind = 0
        if kind == 1 or kind == 4:
            self._close()
        elif kind in (2, 3) and self._current is None:
            # (while a response is being written, _response_done restarts it)
            what = "headers" if kind == 2 else "body"
            self._fail(
                HTTPError(
                    f"timed out reading the request {what}",
                    status=408,
                    type="invalid_request_error",
                    code="request_timeout",
                    close=True,
                )
            )

    def _transport_write(self, data: bytes) -> None:
        if self.transport is not None and self._out is not None:
            self._out.write(data)

    async def _drain(self) -> None:
        if self._drain_waiter is None or self._drain_waiter.done():
            self._drain_waiter = self._loop.create_future()
        await self._drain_waiter

    def _close(self) -> None:
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()

    def _linger_close(self) -> None:
        """Close after a final answer without destroying it.

        NOTE: closing a socket with unread input makes the kernel send RST, which
        can overtake the answer: a 413 sent while the body is still arriving, or
        a 503 to a request already sent, reached the client as "connection reset".
        As nginx's lingering close does: half-close (the client reads the answer
        and EOF), drop whatever still arrives, and close when the client does or
        after ``_LINGER_S``.
        """
        t = self.transport
        if t is None or self._lingering:
            return
        self._cancel_timer()
        self._lingering = True
        if self._server.closing or not t.can_write_eof():  # shutdown does not wait on it
            t.close()
            return
        t.write_eof()
        t.resume_reading()
        self._arm(4, _LINGER_S)

    def _abort(self) -> None:
        self._cancel_timer()
        t = self.transport
        if t is not None:
            t.abort()

    def shutdown(self) -> None:
        """Finish the current response, then close (graceful shutdown)."""
        self._closing = True
        if self._current is None:
            self._close()


class HTTPServer:
    """A listening socket and its connections.

    Args:
        app: the request handler.
        limits: per-connection limits.
        name: for logs (``"gateway"``, ``"admin"``, ...).
    """

    def __init__(self, app: App, limits: ServerLimits | None = None, name: str = "http") -> None:
        self.app = app
        self.limits = limits or ServerLimits()
        self.name = name
        self.loop = asyncio.get_running_loop()
        self.connections: set[HTTPProtocol] = set()
        self.closing = False
        self.rejected = 0
        self._server: asyncio.Server | None = None
        self._idle: asyncio.Future[None] | None = None

    async def listen(self, host: str, port: int, *, backlog: int = 2048, reuse_port: bool = False) -> tuple[str, int]:
        """Bind and start accepting; returns the bound (host, port).

        Raises:
            OSError: the address cannot be bound (in use, not permitted, ...).
        """
        try:
            # NOTE: the protocols duck-type asyncio.Protocol (an extension type
            # cannot subclass it); uvloop and asyncio only call the methods.
            self._server = await self.loop.create_server(
                lambda: HTTPProtocol(self),  # type: ignore[arg-type, return-value]
                host,
                port,
                backlog=backlog,
                reuse_address=True,
                reuse_port=reuse_port or None,
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"{host}:{port} is already in use") from exc
            raise
        sock = self._server.sockets[0]
        addr = sock.getsockname()
        return addr[0], addr[1]

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._server.sockets) if self._server else []

    async def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight responses finish for ``timeout`` s, then cut."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.shutdown()
        if self.connections:
            self._idle = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._idle), timeout)
            except asyncio.TimeoutError:
                log.warning(
                    "%s: %d connection(s) still busy after %.1fs; closing them", self.name,
                    len(self.connections), timeout,
                )
            for conn in list(self.connections):
                conn._abort()
        if self._server is not None:
            await self._server.wait_closed()

    def _maybe_closed(self) -> None:
        if self._idle is not None and not self.connections and not self._idle.done():
            self._idle.set_result(None)


# ---------------------------------------------------------------- the upstream client

class UpstreamConnection:
    """One connection to a replica."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.sink: Any = None
        self.reader = ResponseReader(self)
        self.reusable = True
        self.idle_since = 0.0
        self.requests = 0
        self._connected: asyncio.Future[None] | None = None
        self._read_paused = False
        self._out: SocketWriter | None = None

    # -- asyncio callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._out = SocketWriter(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self.sink is None:
            # Bytes nobody asked for: the connection is out of step; drop it.
            self.reusable = False
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self.reader.feed(data)
        except Exception as exc:
            if not isinstance(exc, ValueError):
                upstream_logger.exception("error while handling a response from %s:%d", self.pool.host, self.pool.port)
            self.reusable = False
            sink, self.sink = self.sink, None
            if self.transport is not None:
                self.transport.abort()
            if sink is not None:
                sink.on_upstream_lost(exc)
            return
        sink = self.sink
        if type(sink) is Call:
            call = sink
            if call._run is not None:
                call.flush_chunks()  # the whole chunks of this read, in one write

    def eof_received(self) -> bool | None:
        self.reusable = False
        if self.sink is not None:
            self.reader.feed_eof()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._out = None
        self.reusable = False
        self.pool._forget(self)
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_upstream_lost(exc or ConnectionResetError("the replica closed the connection"))

    # -- used by the exchange --

    # ResponseReader sink: forwards to the current exchange.
    # PERF: a proxied call (the usual sink) is called through its C methods.
    def on_response_head(self, resp: Any) -> None:
        if not resp.keep_alive:
            self.reusable = False
        sink = self.sink
        if type(sink) is Call:
            call = sink
            call.on_response_head(resp)
        else:
            sink.on_response_head(resp)

    def on_response_body(self, data: bytes) -> None:
        sink = self.sink
        if type(sink) is Call:
            call = sink
            call.on_response_body(data)
        else:
            sink.on_response_body(data)

    def on_response_chunk(self, buf: bytes, chunk_start: int, start: int, end: int) -> None:
        # (the compiled ResponseReader's: a whole chunk as it came, in the read buf)
        sink = self.sink
        if type(sink) is Call:
            call = sink
            call.on_response_chunk(buf, chunk_start, start, end)
        else:
            sink.on_response_body(buf[start:end])

    def on_response_end(self) -> None:
        sink, self.sink = self.sink, None
        if type(sink) is Call:
            call = sink
            call.on_response_end()
        elif sink is not None:
            sink.on_response_end()

    def send(self, sink: Any, head: bytes, body: bytes) -> None:
        """Start an exchange: ``sink`` will hear about the response."""
        self.sink = sink
        self.requests += 1
        t = self.transport
        if t is None:
            # NOTE: the replica can close between connect() returning and this
            # call (the exchange awaited in between); that is a lost upstream,
            # which the sink knows how to retry, not an assertion failure.
            self.sink = None
            sink.on_upstream_lost(ConnectionResetError("the replica closed the connection"))
            return
        out = self._out  # (set with the transport, in connection_made)
        assert out is not None
        out.write(head, body)

    def pause_reading(self) -> None:
        """Stop reading from the replica (the client is slower than it)."""
        if not self._read_paused and self.transport is not None:
            self._read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Drop the connection now (the exchange was abandoned)."""
        self.reusable = False
        self.sink = None
        if self.transport is not None:
            self.transport.abort()

    def release(self) -> None:
        """The exchange is over: back to the pool if reusable, else closed."""
        self.sink = None
        if self._read_paused:
            self.resume_reading()
        if self.reusable and self.transport is not None and self.reader.where() == 0:
            self.pool._put_idle(self)
        else:
            self.reusable = False
            if self.transport is not None:
                self.transport.close()


class UpstreamPool:
    """Keep-alive connections to one ``host:port``.

    Args:
        host, port: the replica's address.
        connect_timeout: seconds to establish a TCP connection.
        max_idle: idle connections kept for reuse.
        idle_timeout: seconds an idle connection is kept.
    """

    def __init__(
        self, host: str, port: int, *, connect_timeout: float = 2.0, max_idle: int = 64, idle_timeout: float = 30.0
    ) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        self._idle: collections.deque[UpstreamConnection] = collections.deque()
        self._all: set[UpstreamConnection] = set()
        self._loop = asyncio.get_running_loop()
        self._sweeper: asyncio.TimerHandle | None = None
        self.closed = False

    @property
    def open_connections(self) -> int:
        return len(self._all)

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    def take_idle(self) -> UpstreamConnection | None:
        """A connected idle connection, if there is one (no await)."""
        idle = self._idle
        while idle:
            conn = idle.pop()  # most recently used: warmest, least likely closed by the peer
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def connect(self) -> UpstreamConnection:
        """Open a new connection.

        Raises:
            ConnectionError / OSError: refused or unreachable.
            TimeoutError: not connected within ``connect_timeout``.
        """
        if self.closed:
            raise ConnectionError("upstream pool is closed")
        try:
            _, conn = await asyncio.wait_for(
                self._loop.create_connection(  # type: ignore[type-var]
                    lambda: UpstreamConnection(self), self.host, self.port
                ),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise TimeoutError(f"connect to {self.host}:{self.port} timed out after {self.connect_timeout:g}s") from None
        if self.closed:
            conn.abort()
            raise ConnectionError("upstream pool is closed")
        self._all.add(conn)
        return conn

    async def acquire(self) -> UpstreamConnection:
        """An idle connection, or a new one."""
        conn = self.take_idle()
        if conn is not None:
            return conn
        return await self.connect()

    def _put_idle(self, conn: UpstreamConnection) -> None:
        if self.closed or len(self._idle) >= self.max_idle:
            conn.reusable = False
            if conn.transport is not None:
                conn.transport.close()
            return
        conn.idle_since = _monotonic()
        self._idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(self.idle_timeout, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        cutoff = _monotonic() - self.idle_timeout
        keep: collections.deque[UpstreamConnection] = collections.deque()
        for conn in self._idle:
            if conn.idle_since < cutoff:
                if conn.transport is not None:
                    conn.transport.close()
            else:
                keep.append(conn)
        self._idle = keep
        if keep:
            self._sweeper = self._loop.call_later(self.idle_timeout / 2, self._sweep)

    def _forget(self, conn: UpstreamConnection) -> None:
        self._all.discard(conn)
        try:
            self._idle.remove(conn)
        except ValueError:
            pass

    def close_idle(self) -> None:
        """Close idle connections and keep no more: busy ones close when their exchange ends."""
        self.closed = True
        for conn in list(self._idle):
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()

    def close(self) -> None:
        """Close every connection (in-flight exchanges see the loss)."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._all):
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
        upstream_logger.debug("closed pool to %s:%d", self.host, self.port)


# ---------------------------------------------------------------- replicas and pools

def _opt(x: float) -> float | None:
    return None if math.isnan(x) else x


class Endpoint:
    """One replica's identity and live state."""

    __slots__ = (
        "auth_line",
        "base_path",
        "cfg",
        "completed",
        "engine",
        "failures",
        "host_header",
        "id",
        "metrics_path",
        "models",
        "pool",
        "replica_line",
        "scrape_failures",
        "scrape_ok",
        "scrape_problem",
        "scrape_seconds",
        "stale_after",
        "state",
    )

    def __init__(self, cfg: EndpointConfig, config: Config) -> None:
        from ..engines import get as get_engine  # (the engines import the server: not at module import)

        upstream = config.upstream
        self.cfg = cfg
        self.id = cfg.id
        self.models = cfg.models
        self.engine = get_engine(cfg.engine)
        self.host_header = cfg.address.encode()
        self.base_path = cfg.base_path.encode() if cfg.base_path else b""
        # SECURITY: the replica's own key goes upstream; the client's never does.
        self.auth_line = b"authorization: Bearer %s\r\n" % cfg.api_key.encode() if cfg.api_key else b""
        self.replica_line = b"x-llmgw-replica: %s\r\n" % cfg.id.encode()
        self.pool = UpstreamPool(
            cfg.host,
            cfg.port,
            connect_timeout=upstream.connect_timeout,
            max_idle=upstream.max_idle_connections,
            idle_timeout=upstream.idle_timeout,
        )
        b = config.breaker
        self.state = EndpointState(0, Breaker(b.failures, b.cooldown, b.max_cooldown))
        self.state.draining = cfg.draining
        if cfg.slots:
            self.state.slots = float(cfg.slots)
        if not self.engine.scraped:
            # Never scraped: always "fresh" but blind (no gauges); routing knows.
            self.state.scraped_at = math.inf
        self.stale_after = config.scrape.stale_after
        self.metrics_path = cfg.metrics_path
        self.completed = 0
        self.failures = 0
        self.scrape_ok = 0
        self.scrape_failures = 0
        self.scrape_seconds = 0.0
        self.scrape_problem: str | None = None

    # -- views for the admin API and metrics (absent is None, never 0) --

    @property
    def inflight(self) -> int:
        return int(self.state.inflight)

    @property
    def draining(self) -> bool:
        return bool(self.state.draining)

    @draining.setter
    def draining(self, value: bool) -> None:
        self.state.draining = value

    @property
    def waiting(self) -> float | None:
        return _opt(self.state.waiting)

    @property
    def running(self) -> float | None:
        return _opt(self.state.running)

    @property
    def kv_cache_usage(self) -> float | None:
        return _opt(self.state.kv_cache_usage)

    @property
    def drain_rate(self) -> float | None:
        return _opt(self.state.drain_rate)

    @property
    def latency(self) -> float | None:
        return _opt(self.state.latency)

    @property
    def last_scrape(self) -> float | None:
        at = self.state.scraped_at
        return None if math.isnan(at) or math.isinf(at) else at

    @property
    def breaker_state(self) -> str:
        return str(self.state.breaker.state)

    @property
    def breaker_open(self) -> bool:
        return self.state.breaker.state == "open"

    @property
    def consecutive_failures(self) -> int:
        return int(self.state.breaker.consecutive_failures)

    @property
    def stale(self) -> bool:
        """Whether the engine numbers are missing or too old to use as fresh."""
        return bool(self.state.stale(_monotonic(), self.stale_after))

    def fresh(self) -> tuple[float | None, float | None, float | None]:
        """(waiting, running, kv_cache_usage) if fresh, else all ``None`` (absent)."""
        if self.stale:
            return None, None, None
        return self.waiting, self.running, self.kv_cache_usage

    @property
    def usable(self) -> bool:
        """Whether new requests may go here (not draining, breaker not open)."""
        return bool(self.state.usable(_monotonic()))

    def target(self, path: bytes) -> bytes:
        """The request target on this replica for a client path."""
        base = self.base_path
        return base + path if base else path

    def close(self) -> None:
        self.pool.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.id} {self.cfg.url} inflight={self.inflight}>"


class ModelPool:
    """One model's replicas, their states as one list, its picker and admission queue."""

    __slots__ = ("endpoints", "name", "picker", "queue", "states")

    def __init__(self, name: str, strategy: str, bands: int, queue_size: int) -> None:
        self.name = name
        self.endpoints: list[Endpoint] = []
        self.states: list[Any] = []
        self.picker = Picker(strategy)
        self.queue = AdmissionQueue(bands, queue_size)

    def add(self, ep: Endpoint) -> None:
        self.endpoints.append(ep)
        self.states = [e.state for e in self.endpoints]

    def remove(self, ep: Endpoint) -> None:
        if ep in self.endpoints:
            self.endpoints.remove(ep)
        self.states = [e.state for e in self.endpoints]

    def pick(self, now: float, stale_after: float, exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
        """The replica for the next request (taking a half-open breaker's probe), or ``None``."""
        excluded = tuple(exclude)
        if not excluded:
            i = self.picker.pick(self.states, now, stale_after)
            return self.endpoints[i] if i >= 0 else None
        # A retry: the same choice among the replicas not tried yet.
        eps = [e for e in self.endpoints if e not in excluded]
        i = self.picker.pick([e.state for e in eps], now, stale_after)
        return eps[i] if i >= 0 else None

    def saturation(self, now: float, stale_after: float, max_waiting: float, max_kv: float) -> float:
        return pool_saturation(self.states, now, stale_after, max_waiting, max_kv)



# ---------------------------------------------------------------- counting

# Label value for series past a family's limit.
OTHER = "(other)"


class Hist:
    """One histogram series: per-bucket (not cumulative) counts, the last one +Inf."""

    __slots__ = ("counts", "total")

    def __init__(self, n_bounds: int) -> None:
        self.counts: list[int] = [0] * (n_bounds + 1)
        self.total = 0.0


class RequestSeries:
    """One (model, replica, status, band) combination and the histograms it feeds."""

    __slots__ = ("dur", "n", "ttfb", "up")

    def __init__(self, dur: Hist, ttfb: Hist, up: Hist | None) -> None:
        self.n = 0
        self.dur = dur
        self.ttfb = ttfb
        self.up = up


class TrafficCounters:
    """The data path's observer hooks, counted in plain dicts keyed by label tuples.

    Implements :class:`llmgw.gateway.observe.Observer`. The gateway calls these
    directly from C when its observer is one of these (the admin app's
    ``PrometheusObserver`` is, and renders the dicts at scrape time); for a
    finished request it calls :meth:`record`, not :meth:`request_done`. Not
    thread-safe: hooks and reads happen on the event loop thread.

    Args:
        bounds: histogram upper bounds in seconds, ascending.
        max_series: distinct label sets kept per family before new ones are
            counted under ``(other)``.
    """

    def __init__(self, bounds: list[float], max_series: int) -> None:
        self.bounds = [float(b) for b in bounds]
        self.max_series = max_series
        self._requests: dict[tuple[str, str | None, int, str], RequestSeries] = {}
        self._duration: dict[tuple[str, str], Hist] = {}  # (model, band)
        self._ttfb: dict[tuple[str, str], Hist] = {}  # (model, band)
        self._upstream: dict[tuple[str, str], Hist] = {}  # (model, replica)
        self._tokens: dict[str, list[int]] = {}  # model -> [prompt, completion]
        self._errors: dict[tuple[str, str], int] = {}  # (replica, kind)
        self._retries: dict[str, int] = {}  # model
        self._admission: dict[tuple[str, str, str], int] = {}  # (band, outcome, reason)
        self._admitted: dict[str, int] = {}  # band -> admitted straight away (the common decision)
        self._breaker: dict[tuple[str, str], int] = {}  # (replica, state)
        self._overflowed: set[str] = set()

    def _bucket(self, value: float) -> int:
        """Index of the first bound >= ``value`` (``len(bounds)``: +Inf)."""
        bounds = self.bounds
        n = len(bounds)
        i = 0
        while i < n:
            b = bounds[i]
            if b >= value:
                break
            i += 1
        return i

    # -- the Observer hooks (hot path) --

    def request_done(
        self,
        model: str,
        replica: str | None,
        status: int,
        band: str,
        duration: float,
        ttfb: float | None,
        upstream: float | None,
    ) -> None:
        """A client request finished (any outcome). Times in seconds; ``None`` when not reached."""
        self.record(model, replica, status, band, duration, -1.0 if ttfb is None else ttfb,
                    -1.0 if upstream is None else upstream)

    def record(
        self, model: str, replica: str | None, status: int, band: str, duration: float, ttfb: float, upstream: float
    ) -> None:
        """:meth:`request_done` with ``-1.0`` for a time not reached (PERF: the gateway's
        call, with no float objects)."""
        s = self._requests.get((model, replica, status, band))
        if s is None:
            s = self._new_requests(model, replica, status, band)
        s.n += 1
        h = s.dur
        h.counts[self._bucket(duration)] += 1
        h.total += duration
        if ttfb >= 0.0:
            h = s.ttfb
            h.counts[self._bucket(ttfb)] += 1
            h.total += ttfb
        if upstream >= 0.0:
            u = s.up
            if u is not None:
                u.counts[self._bucket(upstream)] += 1
                u.total += upstream

    def upstream_error(self, replica: str, kind: str) -> None:
        """An attempt on ``replica`` failed (``kind``: see :mod:`llmgw.gateway.observe`)."""
        key = (replica, kind)
        n = self._errors.get(key)
        if n is None:
            self._first(self._errors, key, "llmgw_upstream_errors_total", (OTHER, kind))
        else:
            self._errors[key] = n + 1

    def retry(self, model: str, replica: str) -> None:
        """A request is retried on another replica (``replica`` failed)."""
        n = self._retries.get(model)
        if n is None:
            self._first(self._retries, model, "llmgw_retries_total", OTHER)
        else:
            self._retries[model] = n + 1

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        """A response reported its token usage."""
        t = self._tokens.get(model)
        if t is None:
            if len(self._tokens) >= self.max_series:
                self._overflow("llmgw_tokens_total")
                model = OTHER
            t = self._tokens.setdefault(model, [0, 0])
        t[0] += prompt
        t[1] += completion

    def admission(self, band: str, outcome: str, reason: str = "") -> None:
        """An admission decision."""
        if outcome == "admitted" and not reason:
            # PERF: one counter per band, no key tuple (see admission_totals)
            m = self._admitted.get(band)
            if m is None:
                self._first(self._admitted, band, "llmgw_admission_total", OTHER)
            else:
                self._admitted[band] = m + 1
            return
        key = (band, outcome, reason)
        n = self._admission.get(key)
        if n is None:
            self._first(self._admission, key, "llmgw_admission_total", (OTHER, outcome, reason))
        else:
            self._admission[key] = n + 1

    def breaker_transition(self, replica: str, state: str) -> None:
        """A replica's circuit breaker moved to ``state`` (closed, open, half_open)."""
        key = (replica, state)
        n = self._breaker.get(key)
        if n is None:
            self._first(self._breaker, key, "llmgw_breaker_transitions_total", (OTHER, state))
        else:
            self._breaker[key] = n + 1

    def admission_totals(self) -> dict[tuple[str, str, str], int]:
        """Admission decisions by (band, outcome, reason)."""
        out = dict(self._admission)
        for band, n in self._admitted.items():
            key = (band, "admitted", "")
            out[key] = out.get(key, 0) + n
        return out

    # -- first sight of a label set (cold path) --

    def _first(self, d: dict[Any, int], key: Any, family: str, other: Any) -> None:
        if len(d) >= self.max_series:
            self._overflow(family)
            key = other
        d[key] = d.get(key, 0) + 1

    def _overflow(self, family: str) -> None:
        if family not in self._overflowed:
            self._overflowed.add(family)
            admin_logger.warning(
                "%s has %d label sets; new ones are counted under %r (a label is probably unbounded)",
                family, self.max_series, OTHER,
            )

    def _new_requests(self, model: str, replica: str | None, status: int, band: str) -> RequestSeries:
        if len(self._requests) >= self.max_series:
            self._overflow("llmgw_requests_total")
            model, replica, band = OTHER, OTHER if replica is not None else None, OTHER
            s = self._requests.get((model, replica, status, band))
            if s is not None:
                return s
        n = len(self.bounds)
        mb = (model, band)
        dur = self._duration.get(mb) or self._duration.setdefault(mb, Hist(n))
        ttfb = self._ttfb.get(mb) or self._ttfb.setdefault(mb, Hist(n))
        up = None
        if replica is not None:
            mr = (model, replica)
            up = self._upstream.get(mr) or self._upstream.setdefault(mr, Hist(n))
        s = RequestSeries(dur, ttfb, up)
        # NOTE: not stored under the original key when overflowing, so the dict stays bounded.
        self._requests[(model, replica, status, band)] = s
        return s


# ---------------------------------------------------------------- the proxy

_SSE_SEP = b"\n\n"
_VISIBLE_ASCII = bytes(range(33, 127))
_MAX_BUFFERED = 64 * 1024 * 1024
_RETRYABLE_STATUS = (502, 503)
_UNKNOWN = "(unknown)"  # the model label for requests naming no served model (bounded cardinality)
_TICK = 0.05  # seconds between deadline sweeps

_CODE_BY_STATUS = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    409: "conflict",
    413: "request_too_large",
    422: "invalid_request",
    429: "rate_limit_exceeded",
    500: "internal_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
_TYPE_BY_STATUS = {401: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable_error"}
_CODE_BY_TYPE = {"exceed_context_size_error": "context_length_exceeded"}
_JSON_CT = ((b"content-type", b"application/json"),)


def normalize_error(status: int, body: bytes) -> bytes:
    """An engine's error body in OpenAI's shape, with a string ``code``.

    Engines put the HTTP status (an integer) in ``code`` (vLLM, llama.cpp,
    TensorRT-LLM), answer ``{"error": "Unauthorized"}`` (vLLM, SGLang), use the flat
    pre-0.10.1 vLLM shape, or send plain text; all become
    ``{"error": {"message", "type", "param", "code"}}``.
    """
    message: str | None = None
    etype: Any = None
    param: Any = None
    code: Any = None
    extra: dict[str, Any] = {}
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict):
            src = err
        elif isinstance(err, str):
            src = {"message": err}
        elif data.get("object") == "error" or "message" in data or "detail" in data:
            src = data
        else:
            src = {}
        msg = src.get("message", src.get("detail"))
        message = msg if isinstance(msg, str) else (orjson.dumps(msg).decode() if msg is not None else None)
        etype = src.get("type")
        param = src.get("param")
        code = src.get("code")
        for k in ("n_prompt_tokens", "n_ctx"):
            if k in src:
                extra[k] = src[k]
    elif body:
        message = body[:500].decode("utf-8", "replace").strip() or None
    if not isinstance(etype, str) or not etype:
        etype = _TYPE_BY_STATUS.get(status, "invalid_request_error" if status < 500 else "server_error")
    if not isinstance(code, str) or not code:
        code = _CODE_BY_TYPE.get(etype) or _CODE_BY_STATUS.get(status, f"http_{status}")
    if not isinstance(param, str):
        param = None
    if not message:
        message = f"the engine answered HTTP {status}"
    out: dict[str, Any] = {"message": message, "type": etype, "param": param, "code": code}
    out.update(extra)
    return orjson.dumps({"error": out})


def _last_events(data: bytes) -> bytes:
    """The end of ``data`` from the start of its last two SSE events (``\\n\\n``-ended;
    chunk framing may lie between them); all of it when it holds fewer, or when its
    events end in CRLF pairs. Usage is read off this: it is in the last events, and
    a write of several chunks (see ``Call.flush_chunks``) is not scanned whole."""
    end = data.rfind(b"\n\n")
    if end > 0:
        end = data.rfind(b"\n\n", 0, end)
        if end > 0:
            end = data.rfind(b"\n\n", 0, end)
            if end >= 0:
                return data[end + 2 :]
    return data


def _sse_error(message: str, code: str) -> bytes:
    return b"data: " + orjson.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    ) + _SSE_SEP


# Deadline kinds of a Call (checked by the gateway's sweep).
_D_NONE = 0
_D_QUEUE = 1
_D_FIRST_BYTE = 2
_D_READ = 3

# Call phases.
_P_NEW = 0
_P_QUEUED = 1
_P_CONNECTING = 2
_P_SENT = 3
_P_DONE = 4


class Call:
    """One client request, from admission to the last byte (and its attempts).

    It is the sink of the upstream connection carrying the current attempt.
    """

    __slots__ = (
        "_buf",
        "_pending",
        "_run",
        "_run_end",
        "_run_start",
        "_tail",
        "_tail_prev",
        "band",
        "band_name",
        "body",
        "client_model",
        "closed",
        "conn",
        "connect_task",
        "deadline",
        "dkind",
        "ep",
        "error",
        "gw",
        "head_tail",
        "model",
        "phase",
        "pool",
        "probe",
        "progress",
        "req",
        "resp",
        "retrying",
        "rid_line",
        "sent_at",
        "sent_bytes",
        "started",
        "streaming",
        "tenant",
        "tried",
        "tries",
        "ttfb",
        "usage",
        "w",
    )

    def __init__(
        self, gw: Gateway, req: Request, w: ResponseWriter, pool: ModelPool, model: str, body: bytes, rid_line: bytes
    ) -> None:
        self._init(gw, req, w, pool, model, body, rid_line)

    def _init(
        self, gw: Gateway, req: Request, w: ResponseWriter, pool: ModelPool, model: str, body: bytes, rid_line: bytes
    ) -> None:
        # PERF: the gateway makes calls with Call.__new__ and this (a C call when
        # compiled), not through the type's call with its argument parsing.
        # (read back through the typed attributes: C struct reads when compiled)
        self.gw = gw
        self.req = req
        self.w = w
        self.pool = pool
        self.model = self.pool.name
        self.client_model = model
        self.body = body
        self.rid_line = rid_line  # b"x-request-id: <id>\r\n"
        self.started = _monotonic()
        self.band = self.gw.default_band
        self.band_name = self.gw.bands[self.band]
        self.tenant: Any = None
        self.phase = _P_NEW
        self.closed = False
        self.tried: list[Endpoint] | None = None
        self.ep: Endpoint | None = None
        self.conn: UpstreamConnection | None = None
        self.connect_task: asyncio.Task[None] | None = None
        self.tries = 0
        self.probe = False
        self.retrying = False
        self.deadline = 0.0
        self.dkind = _D_NONE
        self.resp: Response | None = None
        self.streaming = False
        self._buf: list[bytes] = []
        self._pending = b""
        self.sent_bytes = 0
        self.ttfb = -1.0  # when the answer's head arrived (monotonic); -1: not yet
        self.sent_at = -1.0  # when the request went upstream; -1: not yet
        self.error: HTTPError | None = None
        self.head_tail = b""
        self.usage: tuple[int, int] | None = None  # the answer's token usage, reported once at the end
        self._tail = b""  # a stream's last write, and the one before it
        self._tail_prev = b""
        self._run: bytes | None = None  # a read holding whole chunks to relay as they came ...
        self._run_start = 0  # ... from here
        self._run_end = 0  # ... to here (see on_response_chunk)
        self.progress = False  # a stream's bytes arrived since the sweep last looked

    @property
    def rid(self) -> bytes:
        """The request id."""
        return self.rid_line[14 : len(self.rid_line) - 2]

    # -- admission --

    def admit(self) -> None:
        """Straight through below saturation 1.0 with nobody waiting; else queue (or shed)."""
        gw = self.gw
        pool = self.pool
        now = _monotonic()
        if not len(pool.queue) and pool.saturation(now, gw.stale_after, gw.max_waiting, gw.max_kv) < 1.0:
            counters = gw.counters
            if counters is not None:
                counters.admission(self.band_name, "admitted")
            else:
                gw.observer.admission(self.band_name, "admitted")
            self.dispatch()
            return
        evicted = pool.queue.push(self.band, self.tenant, self, now)
        if evicted is False:
            gw.observer.admission(self.band_name, "rejected", "queue_full")
            self.shed("queue_full", f"the {self.model} pool is saturated and its {self.band_name} queue is full")
            return
        self.phase = _P_QUEUED
        self._deadline(_D_QUEUE, now + gw.queue_timeout)
        gw.observer.admission(self.band_name, "queued")
        if evicted is not None:
            assert isinstance(evicted, Call)
            gw.observer.admission(evicted.band_name, "rejected", "evicted")
            evicted.shed("evicted", f"the {self.model} pool is saturated; a higher-priority request took this slot")
        # A pool that is saturated only because nothing is known yet still moves.
        gw.admit_next(pool)

    def shed(self, reason: str, message: str) -> None:
        """Answer 429 (with Retry-After from the pool's drain rate) and finish."""
        now = _monotonic()
        wait = retry_after(self.pool.states, len(self.pool.queue), now)
        self.phase = _P_DONE
        self._finish(RateLimitedError(f"{message}; retry after {math.ceil(wait)}s", retry_after=wait, code=reason))

    # -- attempts --

    def dispatch(self) -> None:
        """Choose a replica and send the request (now if a pooled connection is idle)."""
        gw = self.gw
        now = _monotonic()
        ep = self.pool.pick(now, gw.stale_after, self.tried or ())
        if ep is None:
            err = self.error or OverloadedError(
                f"no replica of model `{self.model}` is available (all draining or failing)", retry_after=1
            )
            self._finish(err)
            return
        self.ep = ep
        self.tries += 1
        state = ep.state
        self.probe = state.half_open()  # this request is the breaker's probe
        state.on_dispatch(now)
        head = upstream_head(
            self.req.method,
            ep.target(self.req.target),
            ep.host_header,
            self.req.forward,
            len(self.body),
            self.rid_line + ep.auth_line,
        )
        conn = ep.pool.take_idle()
        if conn is not None:
            self._send(conn, head, reused=True)
            return
        self.phase = _P_CONNECTING
        self.connect_task = gw.loop.create_task(self._connect(ep, head))

    async def _connect(self, ep: Endpoint, head: bytes) -> None:
        try:
            conn = await ep.pool.connect()
        except asyncio.CancelledError:
            return
        except TimeoutError:
            self._attempt_failed(
                GatewayTimeoutError(f"replica {ep.id} did not accept a connection in time"), "connect_timeout"
            )
            return
        except OSError as exc:
            self._attempt_failed(
                BadGatewayError(f"replica {ep.id} refused the connection ({exc.strerror or exc})"), "connect_refused"
            )
            return
        finally:
            self.connect_task = None
        if self.phase == _P_DONE or self.ep is not ep:
            conn.release()
            return
        self._send(conn, head, reused=False)

    def _send(self, conn: UpstreamConnection, head: bytes, reused: bool) -> None:
        self.phase = _P_SENT
        self.conn = conn
        self.resp = None
        self.head_tail = head if reused else b""
        now = _monotonic()
        self.sent_at = now
        self._deadline(_D_FIRST_BYTE, now + self.gw.first_byte_timeout)
        conn.send(self, head, self.body)

    def _deadline(self, kind: int, at: float) -> None:
        """Expire at ``at`` (the monotonic clock) unless moved on first."""
        self.dkind = kind
        self.deadline = at
        self.gw.watch(self)

    def _attempt_failed(self, error: HTTPError, kind: str, counts: bool = True) -> None:
        """This attempt failed before any byte reached the client: retry or answer."""
        gw = self.gw
        ep = self.ep
        assert ep is not None
        now = _monotonic()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.abort()
        ep.state.on_abort(now)
        ep.failures += 1
        if counts:
            gw.breaker_outcome(ep, False, now)
        elif self.probe:
            ep.state.breaker.release()
        gw.observer.upstream_error(ep.id, kind)
        self.error = error
        upstream_logger.debug("replica %s failed: %s", ep.id, error.message)
        if self.retrying:
            gw.budget.done_retry()
            self.retrying = False
        if self.w.disconnected:
            self._finish(None)
            return
        if self.tries <= gw.retry_attempts and gw.budget.can_retry(gw.active_calls):
            if self.tried is None:
                self.tried = []
            self.tried.append(ep)
            gw.budget.record_retry()
            self.retrying = True
            gw.observer.retry(self.model, ep.id)
            self.dispatch()
            return
        self._finish(error)

    def _fresh_retry(self) -> bool:
        """A reused keep-alive connection the replica had closed: try again on a new one."""
        if not self.head_tail or self.resp is not None:
            return False
        head, self.head_tail = self.head_tail, b""
        ep = self.ep
        assert ep is not None
        self.conn = None
        self.phase = _P_CONNECTING
        self.connect_task = self.gw.loop.create_task(self._connect(ep, head))
        return True

    # -- the ResponseReader sink (via the upstream connection) --

    def on_response_head(self, resp: Response) -> None:
        self.resp = resp
        self.ttfb = _monotonic()
        if resp.event_stream and resp.status < 300:
            self.streaming = True
            w = self.w
            w.start(resp.status, (), -1, resp.forward + self.rid_line + self.ep.replica_line)  # type: ignore[union-attr]
            conn = self.conn
            if conn is not None:
                w.add_flow_listener(conn)
        self._deadline(_D_READ, self.ttfb + self.gw.read_timeout)

    def on_response_body(self, data: bytes) -> None:
        if self.streaming:
            if self._run is not None:
                self.flush_chunks()  # (what came before this goes first)
            # PERF: no clock read per event; the sweep moves the read deadline on.
            self.progress = True
            # Relay whole SSE events only, so a cut never leaves half an event.
            if self._pending:
                data = self._pending + data
            cut = sse_cut(data)
            if cut == 0:
                self._pending = data
                return
            if cut == len(data):
                self._pending = b""
                out = data
            else:
                self._pending = data[cut:]
                out = data[:cut]
            self.sent_bytes += len(out)
            self.w.write(out)
            # Usage comes in the last events (with vLLM's continuous usage stats every
            # event carries the running totals, and the last counts, once): keep the
            # last two writes, read at the end instead of searching every event.
            self._tail_prev = self._tail
            self._tail = out
        else:
            self._buf.append(data)
            self.sent_bytes += len(data)
            if self.sent_bytes > _MAX_BUFFERED:
                self._attempt_failed(
                    BadGatewayError(f"replica {self.ep.id} sent an answer larger than {_MAX_BUFFERED} bytes"),  # type: ignore[union-attr]
                    "bad_response",
                )

    def on_response_chunk(self, buf: bytes, chunk_start: int, start: int, end: int) -> None:
        """A whole chunk as the replica framed it: ``buf[chunk_start:end + 2]`` (size
        line, data, CRLF) in the read ``buf``; its data is ``buf[start:end]``.

        PERF: a stream's chunk that holds whole SSE events, with nothing pending,
        goes to the client as it came: its framing is valid chunked encoding, so
        the data is neither copied out nor framed again. Such chunks that follow
        one another in a read go out together, in one write, when the read has
        been parsed (:meth:`flush_chunks`), or before anything else is written.
        """
        if (
            self.streaming
            and not self._pending
            and end - start >= 2
            and buf[end - 1] == 10
            and (buf[end - 2] == 10 or (buf[end - 2] == 13 and end - start >= 3 and buf[end - 3] == 10))
            and self.w._chunked
        ):
            self.progress = True
            self.sent_bytes += end - start
            if self._run is buf and self._run_end == chunk_start:
                self._run_end = end + 2
                return
            if self._run is not None:
                self.flush_chunks()
            self._run = buf
            self._run_start = chunk_start
            self._run_end = end + 2
            return
        if self._run is not None:
            self.flush_chunks()
        self.on_response_body(buf[start:end])

    def flush_chunks(self) -> None:
        """Send the whole chunks noted by :meth:`on_response_chunk` (one write)."""
        buf = self._run
        if buf is None:
            return
        self._run = None
        if self._run_start == 0 and self._run_end == len(buf):
            out = buf
        else:
            out = buf[self._run_start : self._run_end]
        self.w.write_chunk(out)
        self._tail_prev = self._tail
        self._tail = out  # (usage is read off it at the end; the framing does not matter)

    def on_response_end(self) -> None:
        conn, self.conn = self.conn, None
        resp = self.resp
        ep = self.ep
        assert resp is not None and ep is not None
        w = self.w
        if self.streaming:
            if self._run is not None:
                self.flush_chunks()
            if self._pending:
                w.write(self._pending)
                self.sent_bytes += len(self._pending)
                self._pending = b""
            if conn is not None:
                conn.release()
            w.end()
            self._completed(True)
            return
        buf = self._buf
        body = buf[0] if len(buf) == 1 else b"".join(buf)
        self._buf = []
        if conn is not None:
            conn.release()
        status = resp.status
        if status >= 400:
            normalized = normalize_error(status, body)
            if status >= 500:
                if status in _RETRYABLE_STATUS:
                    message = orjson.loads(normalized)["error"]["message"]
                    err = HTTPError(
                        f"replica {ep.id} answered {status}: {message}",
                        status=status,
                        type="service_unavailable_error" if status == 503 else "server_error",
                        code=_CODE_BY_STATUS[status],
                        retry_after=1 if status == 503 else None,
                    )
                    self._attempt_failed(err, "status_5xx")
                    return
                self.gw.observer.upstream_error(ep.id, "status_5xx")
            w.send(status, normalized, _JSON_CT, self.rid_line + ep.replica_line)
            self._completed(status < 500)
            return
        w.send(status, body, (), resp.forward + self.rid_line + ep.replica_line)
        if self.gw.count_tokens:
            self.usage = usage_counts(body)
        self._completed(True)

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        self.conn = None
        if self._run is not None:
            self.flush_chunks()  # (whole events that arrived before the loss)
        if self.phase != _P_SENT:
            return
        kind = "bad_response" if isinstance(exc, ValueError) else "reset"
        if self.streaming:
            ep = self.ep
            assert ep is not None
            self.gw.observer.upstream_error(ep.id, kind)
            self._cut_stream("the replica closed the connection", "upstream_disconnected")
            self._completed(False)
            return
        if kind == "reset" and self._fresh_retry():
            return
        ep = self.ep
        assert ep is not None
        self._attempt_failed(
            BadGatewayError(f"replica {ep.id} closed the connection before a complete answer"), kind
        )

    def _cut_stream(self, why: str, code: str) -> None:
        w = self.w
        if w.finished:
            return
        w.keep_alive = False
        if not w.disconnected:
            # Never a fabricated [DONE] or finish_reason: the client learns the truth.
            w.write(_sse_error(f"stream interrupted: {why}", code))
        w.end()

    # -- deadlines (from the gateway's sweep) --

    def expired(self) -> None:
        kind = self.dkind
        self.dkind = _D_NONE
        gw = self.gw
        if kind == _D_QUEUE:
            if self.phase == _P_QUEUED and self.pool.queue.remove(self):
                gw.observer.admission(self.band_name, "rejected", "queue_timeout")
                self.shed("queue_timeout", f"the {self.model} pool stayed saturated for {gw.queue_timeout:g}s")
            return
        if self.phase != _P_SENT:
            return
        ep = self.ep
        assert ep is not None
        if kind == _D_FIRST_BYTE and self.resp is None:
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.abort()
            now = _monotonic()
            ep.state.on_abort(now)
            ep.failures += 1
            gw.breaker_outcome(ep, False, now)
            gw.observer.upstream_error(ep.id, "first_byte_timeout")
            # Not retried: the engine may be working on it.
            self._finish(GatewayTimeoutError(f"replica {ep.id} did not answer within {gw.first_byte_timeout:g}s"))
        elif kind == _D_READ:
            conn, self.conn = self.conn, None
            if conn is not None:
                conn.abort()
            gw.observer.upstream_error(ep.id, "read_timeout")
            if self.streaming:
                self._cut_stream("the replica stopped sending", "upstream_timeout")
                self._completed(False)
            else:
                self._attempt_failed(BadGatewayError(f"replica {ep.id} stopped sending its answer"), "read_timeout")

    # -- endings --

    def client_gone(self) -> None:
        """The client disconnected: abort whatever is in progress, release everything."""
        phase = self.phase
        if phase == _P_DONE:
            return
        gw = self.gw
        if phase == _P_QUEUED:
            self.pool.queue.remove(self)
            gw.observer.admission(self.band_name, "rejected", "client_gone")
        task = self.connect_task
        if task is not None:
            task.cancel()
            self.connect_task = None
        conn, self.conn = self.conn, None
        if conn is not None:
            # NOTE: closing the upstream connection is how an engine learns to stop
            # generating; the slot frees at once.
            conn.abort()
        ep = self.ep
        if ep is not None and phase in (_P_CONNECTING, _P_SENT):
            ep.state.on_abort(_monotonic())
            if self.probe:
                ep.state.breaker.release()
        self._done(None)

    def _completed(self, success: bool) -> None:
        """The replica answered (fully, or a stream that was then cut)."""
        ep = self.ep
        assert ep is not None
        now = _monotonic()
        state = ep.state
        gw = self.gw
        if success:
            state.on_complete(now)
            ep.completed += 1
            gw.breaker_outcome(ep, True, now)
        else:
            state.on_abort(now)
            ep.failures += 1
            gw.breaker_outcome(ep, False, now)
        if self.retrying:
            gw.budget.done_retry()
            self.retrying = False
        self._done(None)

    def _finish(self, error: HTTPError | None) -> None:
        """Answer ``error`` (if the client is still there) and finish."""
        w = self.w
        if error is not None and not w.started and not w.disconnected:
            w.send_error(error, ((b"x-request-id", self.rid),))
        elif not w.finished and w.started:
            w.abort()
        if self.retrying:
            self.gw.budget.done_retry()
            self.retrying = False
        self._done(error)

    def _done(self, error: HTTPError | None) -> None:
        if self.closed:
            return
        self.closed = True
        self.phase = _P_DONE
        self.dkind = _D_NONE
        gw = self.gw
        gw.unwatch(self)
        gw.active_calls -= 1
        now = _monotonic()
        ep = self.ep
        w = self.w
        ttfb = self.ttfb - self.started if self.ttfb >= 0.0 else -1.0
        upstream = now - self.sent_at if self.sent_at >= 0.0 else -1.0
        replica = ep.id if ep is not None else None
        if self.streaming and gw.count_tokens:
            usage = usage_counts(_last_events(self._tail)) if self._tail else None
            if usage is None and self._tail_prev:
                usage = usage_counts(_last_events(self._tail_prev))
            self.usage = usage
        usage = self.usage
        counters = gw.counters
        if counters is not None:  # PERF: C calls, not Python method calls
            counters.record(self.model, replica, w.status, self.band_name, now - self.started, ttfb, upstream)
            if usage is not None:
                counters.tokens(self.model, usage[0], usage[1])
        else:
            observer = gw.observer
            observer.request_done(
                self.model, replica, w.status, self.band_name, now - self.started,
                ttfb if ttfb >= 0.0 else None, upstream if upstream >= 0.0 else None,
            )
            if usage is not None:
                observer.tokens(self.model, usage[0], usage[1])
        if gw.access_log:
            gw.log_access(self, now)
        gw.admit_next(self.pool)


class Gateway:
    """The client port's app (see the module docstring)."""

    def __init__(self, config: Config, registry: Registry) -> None:
        self.loop = asyncio.get_running_loop()
        self.registry = registry
        self.pools: dict[str, ModelPool] = registry.pools  # (the registry's own dict, kept up to date by it)
        self._rid_prefix = os.urandom(6).hex().encode() + b"-"
        self._rid_n = 0
        self.created = int(time.time())
        self.observer: Observer = NullObserver()
        self.counters: TrafficCounters | None = None
        self.count_tokens = False
        self.active_calls = 0
        self._admitting = False
        self._watched: set[Call] = set()
        self._sweep_handle: asyncio.TimerHandle | None = None
        self.reconfigure(config)

    def reconfigure(self, config: Config) -> None:
        """Adopt a new configuration (a reload): tables are rebuilt, connections kept."""
        self.config = config
        self.first_byte_timeout = config.upstream.first_byte_timeout
        self.read_timeout = config.upstream.read_timeout
        self.retry_attempts = config.retries.attempts
        self.budget = RetryBudget(config.retries.budget)
        self.stale_after = config.scrape.stale_after
        self.max_waiting = float(config.saturation.max_waiting)
        self.max_kv = config.saturation.max_kv_cache_usage
        adm = config.admission
        self.bands = adm.bands
        self.band_index = {b.encode(): i for i, b in enumerate(adm.bands)}
        self.default_band = adm.bands.index(adm.default_band)
        self.queue_timeout = adm.queue_timeout
        self.aliases = config.aliases()
        # model name as the client says it -> name to put in the upstream body
        rewrites: dict[str, str] = {}
        for m in config.models.values():
            if m.upstream_name:
                rewrites[m.name] = m.upstream_name
        for alias, real in self.aliases.items():
            rewrites[alias] = config.models[real].upstream_name or real
        self.rewrites = rewrites
        self.keys = {k.sha256: k for k in config.auth.keys}
        self.key_bands = {
            k.sha256: adm.bands.index(k.band) for k in config.auth.keys if k.band is not None and k.band in adm.bands
        }
        self.auth = bool(self.keys)
        self.access_log = config.access_log.enabled

    def set_observer(self, observer: Observer) -> None:
        """Report the data path's work to ``observer`` (metrics)."""
        self.observer = observer
        self.counters = observer if isinstance(observer, TrafficCounters) else None
        self.count_tokens = not isinstance(observer, NullObserver)

    # -- deadlines: one sweep for every call, instead of a timer per call --

    def watch(self, call: Call) -> None:
        self._watched.add(call)
        if self._sweep_handle is None:
            self._sweep_handle = self.loop.call_later(_TICK, self._sweep)

    def unwatch(self, call: Call) -> None:
        self._watched.discard(call)

    def _sweep(self) -> None:
        self._sweep_handle = None
        now = _monotonic()  # (deadlines are kept in this clock)
        read_timeout = self.read_timeout
        for c in self._watched:
            if c.progress:  # a stream moved since the last sweep: its read deadline too
                c.progress = False
                if c.dkind == _D_READ:
                    c.deadline = now + read_timeout
        expired = [c for c in self._watched if c.dkind != _D_NONE and c.deadline <= now]
        for c in expired:
            c.expired()
        self._watched = {c for c in self._watched if c.dkind != _D_NONE}
        if self._watched:
            self._sweep_handle = self.loop.call_later(_TICK, self._sweep)
        # Breakers reopen and scrapes move on with time: let queued requests re-check.
        for pool in self.registry.pools.values():
            if len(pool.queue):
                self.admit_next(pool)

    def admit_next(self, pool: ModelPool) -> None:
        """Dispatch queued requests while the pool is below saturation 1.0."""
        queue = pool.queue
        if not len(queue) or self._admitting:
            return
        self._admitting = True
        try:
            self._admit(pool)
        finally:
            self._admitting = False

    def _admit(self, pool: ModelPool) -> None:
        queue = pool.queue
        for _ in range(len(queue)):
            now = _monotonic()
            if pool.saturation(now, self.stale_after, self.max_waiting, self.max_kv) >= 1.0:
                # Nothing in flight and still "full": nothing will free capacity but
                # time; the sweep checks again.
                if not any(st.inflight for st in pool.states):
                    self._ensure_sweep()
                return
            call = queue.pop()
            if call is None:
                return
            assert isinstance(call, Call)
            call.dkind = _D_NONE
            self.observer.admission(call.band_name, "dequeued")
            call.dispatch()

    def breaker_outcome(self, ep: Endpoint, success: bool, now: float) -> None:
        """Tell ``ep``'s breaker how an attempt ended; report a state change."""
        if success and ep.state.breaker_settled():
            return  # PERF: the usual case; record_success would change nothing
        breaker = ep.state.breaker
        before = breaker.state_code
        if success:
            breaker.record_success(now)
        else:
            breaker.record_failure(now)
        if breaker.state_code != before:
            self.observer.breaker_transition(ep.id, breaker.state)

    def _ensure_sweep(self) -> None:
        if self._sweep_handle is None:
            self._sweep_handle = self.loop.call_later(_TICK, self._sweep)

    def on_scrape(self, ep: Endpoint) -> None:
        """A scrape of ``ep`` landed: queued requests of its models may go now."""
        pools = self.registry.pools
        for m in ep.models:
            pool = pools.get(m)
            if pool is not None and len(pool.queue):
                self.admit_next(pool)

    # -- routing --

    def handle(self, req: Request, w: ResponseWriter) -> None:
        target = req.target
        # PERF: the common case, a POST to /v1/... without a query string, skips
        # building the path.
        path = target if b"?" not in target else req.path
        if path[:4] != b"/v1/":
            raise NotFoundError(f"no route for {path.decode('latin-1')[:200]}; llmgw serves the OpenAI API under /v1/")
        key = self._authenticate(req) if self.auth else None
        method = req.method
        if method == b"POST":
            self._proxy(req, w, key)
            return None
        if method == b"GET" or method == b"HEAD":
            if path == b"/v1/models":
                w.send_json(200, {"object": "list", "data": self._model_cards()})
                return None
            if path.startswith(b"/v1/models/"):
                name = path[len(b"/v1/models/") :].decode("utf-8", "replace")
                for card in self._model_cards():
                    if card["id"] == name:
                        w.send_json(200, card)
                        return None
                raise ModelNotFoundError(f"The model `{name}` does not exist or you do not have access to it.")
        raise HTTPError(
            f"method {method.decode('latin-1')} is not allowed on {path.decode('latin-1')[:200]}",
            status=405,
            type="invalid_request_error",
            code="method_not_allowed",
        )

    def _authenticate(self, req: Request) -> bytes:
        key: bytes | None = None
        auth = req.authorization
        if auth is not None:
            if auth[:7].lower() == b"bearer ":
                key = auth[7:].strip()
        elif req.x_api_key is not None:
            key = req.x_api_key.strip()
        if not key:
            raise UnauthorizedError(
                "You didn't provide an API key. Send it as Authorization: Bearer <key>.", code="missing_api_key"
            )
        digest = hashlib.sha256(key).digest()
        found = self.keys.get(digest)
        # SECURITY: compare in constant time; never echo the key.
        if found is None or not hmac.compare_digest(found.sha256, digest):
            raise UnauthorizedError("Incorrect API key provided.")
        return digest

    def _model_cards(self) -> list[dict[str, Any]]:
        cards = [
            {"id": m, "object": "model", "created": self.created, "owned_by": "llmgw"} for m in self.registry.models()
        ]
        served = set(self.registry.models())
        for alias, real in self.aliases.items():
            if real in served:
                cards.append({"id": alias, "object": "model", "created": self.created, "owned_by": "llmgw", "root": real})
        return cards

    def _request_id(self, req: Request) -> bytes:
        """The request's ``x-request-id`` header line."""
        rid = req.request_id
        # Accept the client's id when it is a short token of visible ASCII.
        if rid is not None and 0 < len(rid) <= 128 and not rid.translate(None, _VISIBLE_ASCII):
            return id_line(rid)
        self._rid_n += 1
        return id_line(self._rid_prefix, self._rid_n)

    def _proxy(self, req: Request, w: ResponseWriter, key: bytes | None) -> None:
        rid_line = self._request_id(req)
        try:
            call = self._prepare(req, w, rid_line, key)
        except HTTPError as exc:
            rid = rid_line[14 : len(rid_line) - 2]
            w.send_error(exc, ((b"x-request-id", rid),))
            band = self.bands[self.default_band]
            self.observer.request_done(_UNKNOWN, None, w.status, band, 0.0, None, None)
            if self.access_log:
                self._access_line(req, rid, _UNKNOWN, band, None, 0, w, 0, None, 0.0)
            return
        self.active_calls += 1
        w._call = call  # (PERF: told directly, not through an on_disconnect callback)
        call.admit()

    def _prepare(self, req: Request, w: ResponseWriter, rid_line: bytes, key: bytes | None) -> Call:
        body = req.body
        # PERF: validated in one pass without building the document; only the
        # top-level "model" is read (see llmgw._fast.jsonscan_py).
        try:
            is_object, model = json_model(body)
        except JSONScanError as exc:
            raise BadRequestError(
                f"We could not parse the JSON body of your request ({exc}). Send a JSON object.",
                code="invalid_json",
            ) from None
        if not is_object:
            raise BadRequestError("The request body must be a JSON object.", code="invalid_json")
        if not model:
            raise BadRequestError("You must provide a model parameter.", param="model", code="missing_model")
        real = self.aliases.get(model, model)
        pool = self.pools.get(real)
        if pool is None or not pool.endpoints:
            raise ModelNotFoundError(
                f"The model `{model[:200]}` does not exist or you do not have access to it.", param="model"
            )
        rewrite = self.rewrites.get(model)
        if rewrite is not None and rewrite != model:
            # Only the name changes; every other byte goes upstream as the client sent it.
            start, end = model_span(body)
            body = body[:start] + orjson.dumps(rewrite) + body[end:]
        call = Call.__new__(Call)
        call._init(self, req, w, pool, model, body, rid_line)
        band = self.default_band
        if key is not None:
            band = self.key_bands.get(key, band)
            call.tenant = key
        prio = req.priority
        if prio is not None:
            idx = self.band_index.get(prio.strip().lower())
            if idx is None:
                raise BadRequestError(
                    f"unknown priority band {prio.decode('latin-1')[:64]!r}; use one of {', '.join(self.bands)}",
                    code="invalid_priority",
                )
            band = idx
        call.band = band
        call.band_name = self.bands[band]
        return call

    def log_access(self, call: Call, now: float) -> None:
        self._access_line(
            call.req,
            call.rid,
            call.model,
            call.band_name,
            call.ep.id if call.ep is not None else None,
            call.tries,
            call.w,
            call.sent_bytes,
            round((call.ttfb - call.started) * 1000, 3) if call.ttfb >= 0.0 else None,
            round((now - call.started) * 1000, 3),
        )

    def _access_line(
        self,
        req: Request,
        rid: bytes,
        model: str,
        band: str,
        replica: str | None,
        attempts: int,
        w: ResponseWriter,
        nbytes: int,
        ttfb_ms: float | None,
        duration_ms: float,
    ) -> None:
        access_logger.info(
            orjson.dumps(
                {
                    "ts": time.time(),
                    "id": rid.decode("latin-1"),
                    "method": req.method.decode("latin-1"),
                    "path": req.path.decode("latin-1"),
                    "model": model,
                    "band": band,
                    "replica": replica,
                    "attempts": attempts,
                    "status": w.status,
                    "bytes": nbytes,
                    "ttfb_ms": ttfb_ms,
                    "duration_ms": duration_ms,
                    "client_disconnected": w.disconnected,
                }
            ).decode()
        )

    def close(self) -> None:
        """Stop the deadline sweep."""
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
