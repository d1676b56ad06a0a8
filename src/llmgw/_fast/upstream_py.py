# cython: annotation_typing=False
"""The upstream client: pooled keep-alive HTTP/1.1 connections to one replica.

This file is both the pure-Python implementation and, compiled by Cython with the
declarations in ``upstream.pxd``, the extension module ``llmgw._fast.upstream``.
Import it through :mod:`llmgw.http.client`.

One raw protocol per connection, with the compiled response reader
(``httpproto.ResponseReader``); no aiohttp/httpx on the request path. A
connection serves one :class:`Exchange` at a time: the object that sent the
request hears about the answer as it arrives (``on_response_head``,
``on_response_body`` or, for whole chunks as they came, ``on_response_chunk``,
``on_response_end``), that all of one read has been delivered
(``on_read_end``), or that the connection was lost first (``on_upstream_lost``).
The proxy's call is an exchange (called through C); so is a scrape.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from typing import TYPE_CHECKING, Any

from .._accel import select
from ..log import upstream_logger
from . import _live

try:
    import cython
except ImportError:  # a pure install: no Cython
    from . import _cy as cython

if TYPE_CHECKING:
    from . import httpproto_py as _hp
    from . import server_py as _srv
else:
    _hp = select("httpproto")
    _srv = select("server")
if not cython.compiled:
    # (the compiled build takes these from upstream.pxd: C types and C calls)
    Response = _hp.Response
    ResponseReader = _hp.ResponseReader
    ResponseSink = _hp.ResponseSink
    monotonic = _hp.monotonic
    SocketWriter = _srv.SocketWriter
    LLMGW_DEBUG = False  # (debug.h: the debug build's switch)

__all__ = ["Exchange", "UpstreamConnection", "UpstreamPool", "should_retry_fresh"]


# The rule for exchanges that may be sent twice: scrapes (GET, idempotent:
# llmgw.fleet.poller.scrape_once), and proxied calls only with
# ``retries.after_send: true`` (the proxy's Call; by default a request whose bytes
# were written is never sent again, see UpstreamConnection.written).
def should_retry_fresh(reused: bool, got_response_head: bool, exc: BaseException | None) -> bool:
    """Whether an exchange lost with ``exc`` is sent once more, on a new connection.

    A connection that sat idle in the pool may have been closed by the replica in
    the meantime (its keep-alive timeout ran out just as the request was written:
    the pool closes idle connections before the engine's timeout and never hands
    out one whose close has arrived, so this is a narrow race). The request
    written to it then meets a reset or an end of stream, and the replica most
    likely never saw it -- but a replica that crashed after reading it looks the
    same, which is why the proxy does not resend by default. Each condition says why:

    * ``reused``: only a connection taken from the pool can be stale. A new one that
      fails is the replica's own answer (down, refusing, overloaded), for the
      caller's ordinary failure path (another replica, a breaker outcome). This also
      makes the retry happen at most once: it runs on a new connection.
    * not ``got_response_head``: once an answer began, the replica had the request
      and may have acted on it (generated tokens); a second send would do the work
      twice, and a proxy could not take back what it relayed.
    * ``exc`` is a lost connection: ``None`` (closed, no error) or a
      :class:`ConnectionError` (reset, broken pipe, aborted), which is what a stale
      connection gives. Not a malformed answer (a ``ValueError``: the replica
      answered, badly), not a timeout (it may be working on the request: sending
      it again doubles the load), not another ``OSError`` (an unreachable host: a
      new connection to it fares no better than the old one).

    Args:
        reused: the exchange ran on a connection taken from the pool.
        got_response_head: a response head had been read when it was lost.
        exc: why it was lost (the sink's ``on_upstream_lost`` argument).

    Returns:
        ``True``: send the request again, on a new connection to the same replica.
    """
    if not reused or got_response_head:
        return False
    return exc is None or isinstance(exc, ConnectionError)


class Exchange:
    """One request on an upstream connection, and what it hears of the answer.

    Subclass it (the proxy's call does, and is then called through C) or pass any
    object with these methods to :meth:`UpstreamConnection.send` (it is wrapped).
    Call order: ``on_response_head`` once, then ``on_response_body`` /
    ``on_response_chunk`` any number of times with ``on_read_end`` after each
    read's share, then ``on_response_end``; or ``on_upstream_lost`` at any point
    before the end (and nothing after it).
    """

    __slots__ = ()

    def on_response_head(self, resp: Response) -> None:
        raise NotImplementedError

    def on_response_body(self, data: bytes) -> None:
        raise NotImplementedError

    def on_response_chunk(self, buf: bytes, chunk_start: int, start: int, end: int) -> None:
        """A whole chunk of a chunked body as it came: ``buf[chunk_start:end + 2]``
        (size line, data, CRLF) in the read ``buf``; its data is ``buf[start:end]``
        (by default passed to :meth:`on_response_body`)."""
        self.on_response_body(buf[start:end])

    def on_response_end(self) -> None:
        raise NotImplementedError

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        raise NotImplementedError

    def on_read_end(self) -> None:
        """What one read held has been delivered (an exchange batching writes flushes)."""


class _ObjectExchange(Exchange):
    """An exchange that is not an :class:`Exchange`: any object with its methods."""

    __slots__ = ("_x",)

    def __init__(self, x: Any) -> None:
        self._x = x

    def on_response_head(self, resp: Response) -> None:
        self._x.on_response_head(resp)

    def on_response_body(self, data: bytes) -> None:
        self._x.on_response_body(data)

    def on_response_end(self) -> None:
        self._x.on_response_end()

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        self._x.on_upstream_lost(exc)


class UpstreamConnection(ResponseSink):
    """One connection to a replica (an asyncio protocol; its reader's sink)."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.sink: Exchange | None = None  # the exchange in progress
        self.reader = ResponseReader(self)
        self.reusable = True
        self.written = False
        self.idle_since = 0.0
        self.requests = 0
        self._connected: asyncio.Future[None] | None = None
        self._read_paused = False
        self._out: SocketWriter | None = None
        if LLMGW_DEBUG:
            _live.made("upstream_connections")

    def __dealloc__(self) -> None:
        if LLMGW_DEBUG:
            _live.freed("upstream_connections")

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
        if sink is not None:
            sink.on_read_end()  # (the proxy's call: the whole chunks of this read, in one write)

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

    # The reader's sink: forwards to the exchange in progress (through C when compiled).
    def on_response_head(self, resp: Response) -> None:
        if not resp.keep_alive:
            self.reusable = False
        sink = self.sink
        if sink is not None:
            sink.on_response_head(resp)

    def on_response_body(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None:
            sink.on_response_body(data)

    def on_response_chunk(self, buf: bytes, chunk_start: int, start: int, end: int) -> None:
        # (the compiled ResponseReader's: a whole chunk as it came, in the read buf)
        sink = self.sink
        if sink is not None:
            sink.on_response_chunk(buf, chunk_start, start, end)

    def on_response_end(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_response_end()

    def send(self, sink: Any, head: bytes, body: bytes) -> None:
        """Start an exchange: ``sink`` (an :class:`Exchange`, or any object with its
        methods) will hear about the response.

        :attr:`written` says afterwards whether the request was handed to the
        transport; when it was not (the connection was closed, or its close had
        already arrived), ``sink.on_upstream_lost`` has been called, before this
        returns, and the replica has seen nothing of the request.
        """
        if not isinstance(sink, Exchange):
            sink = _ObjectExchange(sink)
        self.sink = sink
        self.requests += 1
        self.written = False
        t = self.transport
        if t is None or not self.reusable:
            # NOTE: the replica can close between connect() returning and this
            # call (the exchange awaited in between), or its end of stream can
            # have arrived: a lost upstream that never saw a byte, which the sink
            # may safely send again, not an assertion failure.
            self.sink = None
            sink.on_upstream_lost(ConnectionResetError("the replica closed the connection"))
            return
        out = self._out  # (set with the transport, in connection_made)
        assert out is not None
        self.written = True
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

    def release(self, reuse: bool = True) -> None:
        """The exchange is over: back to the pool if reusable, else closed.

        ``reuse=False``: closed even so (the replica is known to close it now,
        whatever its answer said: see ``EngineInfo.closes_after_stream``).
        """
        self.sink = None
        if self._read_paused:
            self.resume_reading()
        if reuse and self.reusable and self.transport is not None and self.reader.where() == 0:
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
        idle_timeout: seconds an idle connection is kept: shorter than the
            replica's own keep-alive timeout, so that llmgw, not the replica, closes
            it (a request written just as the replica closes would be lost; see
            ``llmgw.engines.base.EngineInfo.keep_alive``). A connection idle longer
            is never handed out, even before the sweep closes it.
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
        """A connected idle connection, if there is one (no await).

        Never one whose close (an end of stream, a reset) has already arrived, nor
        one idle for ``idle_timeout`` or longer (the sweep may not have run yet).
        """
        idle = self._idle
        if not idle:
            return None
        cutoff = monotonic() - self.idle_timeout
        while idle:
            conn = idle.pop()  # most recently used: warmest, least likely closed by the peer
            t = conn.transport
            if t is None or not conn.reusable or t.is_closing():
                continue  # (closing: connection_lost forgets it)
            if conn.idle_since <= cutoff:
                # (the newest is too old, so the rest are too: the loop closes them all)
                conn.reusable = False
                t.close()
                continue
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
        conn.idle_since = monotonic()
        self._idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(self.idle_timeout, self._sweep)

    def _sweep(self) -> None:
        """Close connections idle for ``idle_timeout``; run again when the oldest left is due."""
        self._sweeper = None
        cutoff = monotonic() - self.idle_timeout
        idle = self._idle
        # (oldest first: connections are appended as they are released)
        while idle:
            conn = idle[0]
            if conn.idle_since > cutoff:
                break
            idle.popleft()
            conn.reusable = False
            if conn.transport is not None:
                conn.transport.close()
        if idle:
            conn = idle[0]
            # NOTE: on the dot, not every idle_timeout / 2: the close must come
            # before the replica's own keep-alive timeout, a fixed margin later.
            self._sweeper = self._loop.call_later(max(conn.idle_since - cutoff, 0.001), self._sweep)

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


