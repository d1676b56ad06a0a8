# cython: annotation_typing=False
"""The HTTP/1.1 server: one protocol object per client connection on uvloop.

This file is both the pure-Python implementation and, compiled by Cython with the
declarations in ``server.pxd``, the extension module ``llmgw._fast.server``. Import
it through :mod:`llmgw.http.server`.

An *app* answers requests: an :class:`App` (a C base class; the gateway is one,
called through C) or any object with ``handle(request, writer)``. It may answer at
once (returning ``None``) or return an awaitable, which runs as a task. The server
owns everything else: limits and timeouts, pipelining (answered in order),
``100 Continue``, keep-alive, flow control in both directions, the connection
limit, OpenAI-shaped error answers (any :class:`~llmgw.errors.HTTPError` an app
raises is turned into its response here, in ``HTTPProtocol._run``), and a
graceful shutdown.

Nothing here knows what the app does with a request: whatever answers on the
app's behalf and must hear that its client went away registers itself with
:meth:`ResponseWriter.watch` (an object with ``client_gone()``).

NOTE (compiled build): classes declared in ``server.pxd`` are extension types,
so they cannot grow attributes that are not declared there, and methods declared
``cpdef`` there may not hold closures (lambdas, generator expressions).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import socket
from asyncio.selector_events import BaseSelectorEventLoop
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.utils import formatdate
from typing import TYPE_CHECKING, Any

import orjson

from .._accel import select
from ..errors import BadRequestError, HTTPError, InternalError
from ..log import server_logger
from . import _live

try:
    import cython
except ImportError:  # a pure install: no Cython
    from . import _cy as cython

if TYPE_CHECKING:
    from ..config import Config
    from . import httpproto_py as _hp
else:
    _hp = select("httpproto")
if not cython.compiled:
    # (the compiled build takes these from server.pxd: C types, C calls, C enums)
    _hp = select("httpproto")
    Request = _hp.Request
    RequestReader = _hp.RequestReader
    RequestSink = _hp.RequestSink
    chunk = _hp.chunk
    monotonic = _hp.monotonic
    response_head = _hp.response_head
    write_now = _hp.write_now
    # What a connection's one timer is armed for (server.pxd: TimerKind).
    TIMER_NONE = 0
    TIMER_KEEPALIVE = 1
    TIMER_HEAD = 2
    TIMER_BODY = 3
    TIMER_LINGER = 4
    LLMGW_DEBUG = False  # (debug.h: the debug build's switch)

__all__ = [
    "App",
    "HTTPProtocol",
    "HTTPServer",
    "ResponseWriter",
    "ServerLimits",
    "SocketWriter",
    "error_body",
]

log = server_logger

DEBUG: bool = bool(LLMGW_DEBUG)  # a debug build (LLMGW_DEBUG_BUILD=1): live objects are counted
if LLMGW_DEBUG:
    _live.enabled = True


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
_KEEP_ALIVE = b"connection: keep-alive\r\n"
# Seconds a connection closed after an error answer keeps reading (and dropping)
# what the client still sends; see HTTPProtocol._linger_close.
_LINGER_S = 2.0
# Seconds the answers ended at shutdown (HTTPServer.close's ``cut``) get to reach
# their clients before the connections are cut.
_CUT_FLUSH_S = 1.0
JSON = b"application/json"
_JSON_CT = ((b"content-type", JSON),)


def error_body(exc: HTTPError) -> bytes:
    """The OpenAI-shaped JSON body for ``exc``."""
    return orjson.dumps(
        {"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}}
    )


def _error_headers(exc: HTTPError, extra: tuple[tuple[bytes, bytes], ...] = ()) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", JSON), *exc.headers, *extra]
    if exc.retry_after is not None:
        seconds = max(1, int(exc.retry_after + 0.999))
        headers.append((b"retry-after", b"%d" % seconds))
        headers.append((b"retry-after-ms", b"%d" % max(1, int(exc.retry_after * 1000))))
    if exc.should_retry is not None:
        # (the OpenAI SDKs' header: they skip their own retries on "false")
        headers.append((b"x-should-retry", b"true" if exc.should_retry else b"false"))
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

    @classmethod
    def from_config(cls, config: Config) -> ServerLimits:
        """The client listener's limits from ``config`` (``server:`` and ``admission.header``)."""
        s = config.server
        return cls(
            max_head_bytes=s.max_header_bytes,
            max_headers=s.max_headers,
            max_body=s.max_body_size,
            header_timeout=float(s.header_timeout),
            body_timeout=float(s.body_timeout),
            keepalive_timeout=float(s.keepalive_timeout),
            max_connections=s.max_connections,
            priority_header=config.admission.header.strip().lower().encode("ascii"),
        )


class App:
    """What the server calls for each request (a C base class: the gateway is one).

    ``handle`` answers through ``writer`` at once (returning ``None``) or returns an
    awaitable, which the server runs as a task; an :class:`~llmgw.errors.HTTPError`
    it raises is answered in OpenAI's shape. Apps written in Python may subclass
    this or be any object with a ``handle`` method (the server wraps it).
    """

    def handle(self, request: Request, writer: ResponseWriter) -> Awaitable[None] | None:
        raise NotImplementedError

    def answer_error(self, writer: ResponseWriter, exc: HTTPError) -> None:
        """Answer ``exc`` on ``writer`` (not started): what the app raised, a 500 for a
        bug, or a refusal of the request itself (``writer.request`` then has no
        method: malformed, too large, too slow). The server calls this for every
        error answer, so an app that counts, logs or tags its answers (the gateway
        does) sees those too."""
        writer.send_error(exc)

    def precheck(self, request: Request) -> HTTPError | None:
        """A head that asks for ``100 Continue`` (its body not read yet): the error the head alone
        decides (no such route, a missing or wrong key), answered at once with a close, so the
        client does not send a body for nothing (RFC 9110 §10.1.1); ``None``: go on."""
        return None


class _ObjectApp(App):
    """An app that is not an :class:`App`: any object with ``handle``."""

    __slots__ = ("_app",)

    def __init__(self, app: Any) -> None:
        self._app = app

    def handle(self, request: Request, writer: ResponseWriter) -> Awaitable[None] | None:
        return self._app.handle(request, writer)


class ResponseWriter:
    """Writes the response to one request, in order, on its connection.

    Use :meth:`send` for a whole response, or :meth:`start` then :meth:`write`
    (any number of times) then :meth:`end`. :meth:`drain` waits while the client
    reads slower than the app writes. ``disconnected`` turns true when the client
    goes away; ``on_disconnect`` callbacks run then (at most once).
    """

    __slots__ = (
        "_conn",
        "_head_only",
        "_listeners",
        "_watcher",
        "chunked",
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
        # (PERF: the server makes writers with __new__ and this: a C call when compiled)
        # (read back through the typed attributes: C struct reads when compiled)
        self._conn = conn
        self.request = request
        self.keep_alive: bool = self.request.keep_alive and not self._conn._closing
        self.started = False
        self.finished = False
        self.disconnected = False
        self.status = 0
        self.chunked = False  # the body goes out in chunked encoding
        self._head_only = self.request.method == b"HEAD"
        self._listeners: list[Callable[[], Any]] | None = None
        self._watcher: Any = None  # what answers here for the app (see watch())
        if LLMGW_DEBUG:
            _live.made("writers")

    def __dealloc__(self) -> None:
        if LLMGW_DEBUG:
            _live.freed("writers")

    # -- writing --

    def start(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...] = (),
        content_length: int = -1,
        raw: bytes = b"",
    ) -> None:
        """Send the status line and headers.

        ``content_length`` -1 streams the body chunked (to an HTTP/1.0 client: unframed,
        ending with the connection); ``raw`` is pre-built header lines.
        """
        if self.started:
            raise InternalError("response already started")
        self.started = True
        self.status = status
        no_body = status < 200 or status in (204, 304)
        if no_body:
            content_length = -2
        self.chunked = content_length == -1
        if self.chunked and self.request.version == b"1.0":
            # RFC 9112 §6.1: no Transfer-Encoding to an HTTP/1.0 client (it would read the
            # size lines as the body); the body runs to the connection's close instead.
            self.chunked = False
            self.keep_alive = False
            content_length = -2
        if self._conn._server.closing:
            # NOTE: a response that begins after shutdown began is the last on its
            # connection; saying so lets the client retry elsewhere instead of
            # reusing a connection about to close.
            self.keep_alive = False
        if self.keep_alive and self.request.version == b"1.0":
            raw += _KEEP_ALIVE  # (an HTTP/1.0 client closes unless told: RFC 9112 §9.3)
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
        if self.chunked:
            # PERF: one buffer, not (size line, data, CRLF): a third of the work
            # for a small SSE event.
            out.write(chunk(data if type(data) is bytes else bytes(data)))
        else:
            out.write(data if type(data) is bytes else bytes(data))

    def write_raw(self, data: bytes) -> None:
        """Send ``data`` as it is, with no framing (the app frames the body itself:
        test and simulated engines that must send odd or exact chunk framing)."""
        if data and not self.disconnected:
            self._conn._transport_write(data)

    def write_chunk(self, chunk: bytes) -> bool:
        """Send ``chunk``, already framed as one chunk of a chunked body; false
        (nothing sent) when this response is not chunked."""
        if not self.chunked:
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
        if self.chunked and not self.disconnected and not self._head_only:
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
        if self.keep_alive and self.request.version == b"1.0":
            raw += _KEEP_ALIVE  # see start()
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

    def send_error(self, exc: HTTPError, headers: tuple[tuple[bytes, bytes], ...] = ()) -> int:
        """Answer ``exc`` as an OpenAI-shaped JSON error (closing if it says so); the body bytes sent
        (0 for a HEAD request)."""
        if exc.close:
            self.keep_alive = False
        body = error_body(exc)
        self.send(exc.status, body, _error_headers(exc, headers))
        return 0 if self._head_only else len(body)

    def abort(self) -> None:
        """Cut the connection now (a response that cannot be finished honestly)."""
        self.keep_alive = False
        self.finished = True
        self._conn._abort()

    async def drain(self) -> None:
        """Wait until the client's socket buffer has room (flow control)."""
        if self._conn._write_paused and not self.disconnected:
            await self._conn._drain()

    @property
    def write_paused(self) -> bool:
        """Whether the client reads slower than the response is written."""
        return self._conn._write_paused

    def add_flow_listener(self, listener: Any) -> None:
        """``listener.pause_reading()``/``resume_reading()`` follow the client's pace."""
        self._conn._flow_listener = listener
        if self._conn._write_paused:
            listener.pause_reading()

    def watch(self, watcher: Any) -> None:
        """``watcher.client_gone()`` runs if the client goes before the response ends.

        PERF: one slot, set with no allocation (the proxy's call, per request);
        :meth:`on_disconnect` keeps a list of callbacks.
        """
        self._watcher = watcher

    @property
    def watcher(self) -> Any:
        """What :meth:`watch` was given (``None`` once the client has gone)."""
        return self._watcher

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
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            try:
                watcher.client_gone()
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
        """The client's address (``transport.get_extra_info("peername")``)."""
        return self._conn.peer

    @property
    def queued(self) -> bool:
        """Whether writes now queue behind the transport's buffer (see :class:`SocketWriter`)."""
        out = self._conn._out
        return out is not None and out.queued

    @property
    def transport(self) -> Any:
        """The connection's transport (``None`` once it closed)."""
        return self._conn.transport


class HTTPProtocol(RequestSink):
    """One client connection (an asyncio protocol; its reader's request sink)."""

    def __init__(self, server: HTTPServer) -> None:
        # config and shared state
        self._server = server
        self._app = self._server._handler  # (through the typed field: a C read)
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
            self,
            None,
            server.limits.max_head_bytes,
            server.limits.max_headers,
            server.limits.max_body,
            server.limits.priority_header,
        )
        self._pipeline: collections.deque[Request] = collections.deque()
        self._current: ResponseWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = TIMER_NONE
        self._timer_at = 0.0  # when the pending handle fires
        self._deadline = 0.0  # when the armed kind expires
        self._read_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._flow_listener: Any = None
        self._closing = False
        self._rejected = False
        self._closed = False  # closing (close, abort or a lingering close): input is dropped
        self._lingering_due = False  # close by _linger_close: input was left unread
        self._failure: HTTPError | None = None  # answered after the requests read before it
        self._continue_due = False  # a 100 Continue owed once the connection is free
        self._refused_head: Request | None = None  # a head precheck refused (answered by _send_failure)
        if LLMGW_DEBUG:
            _live.made("connections")

    def __dealloc__(self) -> None:
        if LLMGW_DEBUG:
            _live.freed("connections")

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
            date = (b"date", formatdate(usegmt=True).encode("ascii"))  # (RFC 9110 §6.6.1; a refusal: cold)
            self._transport_write(response_head(503, _error_headers(exc, (date,)), len(body), False) + body)
            server._refusing.add(self)
            self._linger_close()
            server.rejected += 1
            return
        server.connections.add(self)
        self._arm(TIMER_KEEPALIVE, self._keepalive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        """Called when the connection closes, for any reason."""
        if self._rejected:
            self._drop_timer()
            self.transport = None
            self._server._refusing.discard(self)
            self._server._maybe_closed()
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
        if self._closed:
            return
        idle = 0.0
        if self._timer_kind == TIMER_KEEPALIVE:
            idle = self._deadline  # (still the deadline if these bytes begin no request)
            self._cancel_timer()
        try:
            self._reader.feed(data)
        except HTTPError as exc:
            if not self._closed:
                # (the bytes after a final answer, such as a request after one
                # with "Connection: close", are dropped, not answered)
                self._fail(exc)
            return
        kind = self._timer_kind
        if kind == TIMER_BODY or self._closed:
            return
        where = self._reader.where()  # 0 between requests, 1 in a head, 2 in a body
        if where == 1:
            if kind != TIMER_HEAD:
                # NOTE: TIMER_KEEPALIVE here when a request before this head, in the
                # same bytes, was answered at once: the head is timed as a head, not
                # covered by the (longer) keep-alive timeout.
                self._arm(TIMER_HEAD, self._header_timeout)
        elif where == 2:
            self._arm(TIMER_BODY, self._body_timeout)
        elif kind == TIMER_NONE and idle > 0.0 and self._current is None:
            # NOTE: bytes that begin no request (empty lines between requests,
            # which llhttp skips) leave the connection idle: it keeps its keep-alive
            # deadline, or it would have no timer at all and never be closed.
            self._arm(TIMER_KEEPALIVE, idle - monotonic())

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

    def on_head(self, request: Request) -> None:
        """Called by the reader when a head asks for ``100 Continue``: the client
        waits for it before sending the body."""
        if self._closed:
            return
        if self._current is None and not self._pipeline and self.transport is not None:
            refused = self._app.precheck(request)
            if refused is not None:
                self._refused_head = request
                raise refused  # (through the reader: _fail answers it and closes; the body is not read)
            self._transport_write(_CONTINUE)
        else:
            # NOTE: sent when the requests before it are answered (_response_done),
            # so a client that waits for it is not left to its own timeout.
            self._continue_due = True

    def on_request(self, request: Request) -> None:
        """Called by the reader with each complete request, in order."""
        if self._closed:
            # NOTE: read in the same bytes as a request answered at once with a
            # close (a 500, an app clearing keep_alive): not served on a
            # connection that is closing (RFC 9112 §9.6).
            return
        self._continue_due = False
        if self._timer_kind in (TIMER_HEAD, TIMER_BODY):
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
        result = None
        # (a Host with an invalid value is refused by the reader: RFC 9112 §3.2)
        if request.host is None and request.version == b"1.1":
            # RFC 9112 §3.2: a server MUST answer 400 to an HTTP/1.1 request without Host
            self._app.answer_error(writer, BadRequestError(
                "an HTTP/1.1 request needs a Host header", code="missing_host", close=True,
            ))
            return
        try:
            # PERF: a C call when the app is a C one (the gateway, which answers at once)
            result = self._app.handle(request, writer)
        except HTTPError as exc:
            if not writer.started:
                self._app.answer_error(writer, exc)
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
                self._app.answer_error(writer, exc)
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
            self._app.answer_error(writer, HTTPError("internal error in the gateway", close=True))

    def _response_done(self, writer: ResponseWriter) -> None:
        # PERF: drop the disconnect callbacks: they usually point back at the app's
        # request object, and that cycle would otherwise wait for the GC.
        writer._listeners = None
        writer._watcher = None
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
            # (resumed at half the read-ahead, and always once it is empty: with
            # max_pipelined 1, half is 0 and reading stayed paused for good)
            if (
                self._read_paused
                and self._failure is None
                and (not self._pipeline or len(self._pipeline) < self._limits.max_pipelined // 2)
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
                self._arm(TIMER_KEEPALIVE, self._keepalive_timeout)
                return
            # NOTE: a head or body timer that fired while the connection was busy
            # was dropped (the delay was ours); restart it now that only the client
            # can be slow, or a head that never ends would hold the slot forever.
            if self._continue_due:
                self._continue_due = False
                self._transport_write(_CONTINUE)
            if where == 1:
                self._arm(TIMER_HEAD, self._header_timeout)
            else:
                self._arm(TIMER_BODY, self._body_timeout)

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
        writer = ResponseWriter.__new__(ResponseWriter)
        head, self._refused_head = self._refused_head, None
        if head is None:
            # a head the reader refused (or whose body it did not finish) once llhttp had
            # accepted it: its method is known, and a HEAD is answered without a body
            # (RFC 9110 §9.3.2); before that, no request (its method empty)
            head = self._reader.current()
        writer._init(self, head if head is not None else Request())
        writer.keep_alive = False
        self._current = writer
        self._app.answer_error(writer, exc)

    # PERF: timers are lazy. Arming only records a deadline; one TimerHandle per
    # connection fires at the earliest deadline it was set for and, if the deadline
    # has since moved later, re-arms itself for the rest. A keep-alive connection
    # then costs no call_later/cancel pair per request (about 3.6 us each here).

    def _arm(self, kind: int, delay: float) -> None:
        when = monotonic() + delay  # (the clock deadlines are kept in; call_later takes delays)
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
        self._timer_kind = TIMER_NONE  # the pending handle, if any, will find nothing to do

    def _drop_timer(self) -> None:
        self._timer_kind = TIMER_NONE
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        kind = self._timer_kind
        if kind == TIMER_NONE or self.transport is None:
            return
        now = monotonic()
        if now < self._deadline - 0.001:
            self._timer_at = self._deadline
            self._timer = self._loop.call_later(self._deadline - now, self._on_timer)
            return
        self._timer_kind = TIMER_NONE
        if kind in (TIMER_KEEPALIVE, TIMER_LINGER):
            self._close()
        elif kind in (TIMER_HEAD, TIMER_BODY) and self._current is None:
            # (while a response is being written, _response_done restarts it)
            what = "headers" if kind == TIMER_HEAD else "body"
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
        self._closed = True
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
        if t is None or self._closed:
            return
        self._cancel_timer()
        self._closed = True
        if self._server.closing or not t.can_write_eof():  # shutdown does not wait on it
            t.close()
            return
        t.write_eof()
        t.resume_reading()
        self._arm(TIMER_LINGER, _LINGER_S)

    def _abort(self) -> None:
        self._cancel_timer()
        self._closed = True
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

    def __init__(self, app: Any, limits: ServerLimits | None = None, name: str = "http") -> None:
        self.app = app
        self._handler: App = app if isinstance(app, App) else _ObjectApp(app)
        self.limits = limits or ServerLimits()
        self.name = name
        self.loop = asyncio.get_running_loop()
        self.connections: set[HTTPProtocol] = set()
        self.closing = False
        self.rejected = 0
        self._refusing: set[HTTPProtocol] = set()
        self._server: asyncio.Server | None = None
        self._idle: asyncio.Future[None] | None = None
        self._hurry: asyncio.Future[None] | None = None
        self._hurried = False

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

    async def close(self, timeout: float = 10.0, cut: Callable[[ResponseWriter], bool] | None = None) -> None:
        """Stop accepting, let in-flight responses finish for ``timeout`` s (or until
        :meth:`hurry`), then end the rest.

        ``cut(writer)`` is offered each response still running then, to end it
        honestly (an SSE error event and the end of the chunked body, a 503) rather
        than by cutting the connection; it returns whether it did. What is written
        gets :data:`_CUT_FLUSH_S` to reach the clients; every connection still open
        after that is cut.
        """
        self.closing = True
        if self._server is not None:
            if isinstance(self.loop, BaseSelectorEventLoop):
                # NOTE: asyncio's own loop makes an accepted connection's transport
                # in a task; run after Server.close(), that task fails (the server
                # takes no more connections) and leaves the socket open, never
                # closed (CPython 3.11). So: stop accepting, give the connections
                # already accepted one turn to be made (and refused: closing), and
                # only then close the asyncio.Server. (uvloop makes them at once.)
                for sock in self._server.sockets:
                    self.loop.remove_reader(sock.fileno())
                await asyncio.sleep(0)
            self._server.close()
        self._shutdown_all(False)
        if self.connections:
            self._idle = self.loop.create_future()
            began = self.loop.time()
            if not self._hurried:
                self._hurry = self.loop.create_future()
                await asyncio.wait((self._idle, self._hurry), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if self.connections:
                log.warning(
                    "%s: %d connection(s) still busy after %.1fs%s; %s", self.name, len(self.connections),
                    self.loop.time() - began, " (asked to stop now)" if self._hurried else "",
                    "ending their answers" if cut is not None else "closing them",
                )
                if cut is not None and self._cut_all(cut) and self.connections:
                    # (a connection whose answer was ended closes by itself once written)
                    await asyncio.wait((self._idle,), timeout=_CUT_FLUSH_S)
            self._shutdown_all(True)
        if self._refusing:
            # (the refused ones: their 503 written, their close on its way)
            self._idle = self.loop.create_future()
            await asyncio.wait((self._idle,), timeout=_CUT_FLUSH_S)
            for conn in list(self._refusing):
                conn._abort()
            if self._refusing:
                self._idle = self.loop.create_future()
                await asyncio.wait((self._idle,), timeout=_CUT_FLUSH_S)
        if self._server is not None:
            await self._server.wait_closed()

    def hurry(self) -> None:
        """Wait no longer in :meth:`close` (a second Ctrl-C): end what runs now."""
        self._hurried = True
        if self._hurry is not None and not self._hurry.done():
            self._hurry.set_result(None)

    def _cut_all(self, cut: Callable[[ResponseWriter], bool]) -> bool:
        """Offer each running response to ``cut``; whether it ended any."""
        ended = False
        for conn in list(self.connections):
            w = conn._current
            if w is None or w.finished:
                continue
            try:
                ended = cut(w) or ended
            except Exception:  # one bad ending must not keep the others from theirs
                log.exception("%s: ending a response at shutdown failed", self.name)
        return ended

    def _shutdown_all(self, now: bool) -> None:
        """Ask every connection to close after its response (``now``: cut them)."""
        for conn in list(self.connections):
            if now:
                conn._abort()
            else:
                conn.shutdown()

    def _maybe_closed(self) -> None:
        if self._idle is not None and not self.connections and not self._refusing and not self._idle.done():
            self._idle.set_result(None)


# ---------------------------------------------------------------- the upstream client
