"""The upstream client: pooled keep-alive HTTP/1.1 connections to one replica.

One raw ``asyncio.Protocol`` per connection, with httptools' response parser
through :class:`~llmgw.http.parser.ResponseReader`; no aiohttp/httpx on the
request path. The same client serves proxying and scraping.

A connection serves one exchange at a time. The exchange is a *sink* object with
``on_response_head(resp)``, ``on_response_body(data)``, ``on_response_end()`` and
``on_upstream_lost(exc)``; bytes are passed to it as they arrive.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import Any

from ..log import upstream_logger as log
from .parser import ResponseReader

__all__ = ["UpstreamConnection", "UpstreamPool"]


class UpstreamConnection(asyncio.Protocol):
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

    # -- asyncio callbacks --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
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
                log.exception("error while handling a response from %s:%d", self.pool.host, self.pool.port)
            self.reusable = False
            sink, self.sink = self.sink, None
            if self.transport is not None:
                self.transport.abort()
            if sink is not None:
                sink.on_upstream_lost(exc)

    def eof_received(self) -> bool | None:
        self.reusable = False
        if self.sink is not None:
            self.reader.feed_eof()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.reusable = False
        self.pool._forget(self)
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_upstream_lost(exc or ConnectionResetError("the replica closed the connection"))

    # -- used by the exchange --

    # ResponseReader sink: forwards to the current exchange.
    def on_response_head(self, resp: Any) -> None:
        if not resp.keep_alive:
            self.reusable = False
        self.sink.on_response_head(resp)

    def on_response_body(self, data: bytes) -> None:
        self.sink.on_response_body(data)

    def on_response_end(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
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
        if body:
            t.writelines((head, body))
        else:
            t.write(head)

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
        if self.reusable and self.transport is not None and not self.reader.in_message:
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
                self._loop.create_connection(lambda: UpstreamConnection(self), self.host, self.port),
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
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(self.idle_timeout, self._sweep)

    def _sweep(self) -> None:
        self._sweeper = None
        cutoff = time.monotonic() - self.idle_timeout
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
        log.debug("closed pool to %s:%d", self.host, self.port)
