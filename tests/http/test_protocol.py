"""``HTTPProtocol`` against a fake transport and a recording loop, as uvicorn's
``tests/protocols/test_http.py`` tests its protocols: no sockets, every byte the
server writes and every flow-control call it makes is seen in order.

The protocol is driven only through what asyncio calls (``connection_made``,
``data_received``, ``eof_received``, ``pause_writing``/``resume_writing``,
``connection_lost``) and public attributes, so each test runs on both twins (the
compiled one hides its ``cdef`` methods and private fields).

Timers: ``HTTPServer`` takes ``asyncio.get_running_loop()``, so each test body
runs on a :class:`RecordingLoop` (a real selector loop) whose ``call_later``
hands the protocol a :class:`FakeTimer` instead of scheduling it: a test sees
which timers are armed and fires them itself. Deadlines are checked against the
real monotonic clock, so a test that fires a timer to make it act first sleeps
past the (tiny) limit; one fired early must re-arm for the rest.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Coroutine, Iterator
from types import ModuleType
from typing import Any

import orjson
import pytest

WAIT = 5.0  # bound on every wait: a hang is a failure, not a stuck run
PEER = ("127.0.0.1", 40001)
TEXT = ((b"content-type", b"text/plain"),)
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


# -- the fake loop ------------------------------------------------------------------


class FakeTimer:
    """What ``call_later`` returns for a protocol's timer: recorded, never scheduled."""

    def __init__(self, delay: float, callback: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.delay = delay
        self.callback = callback
        self.args = args
        self.cancelled = False
        self.fired = False

    @property
    def pending(self) -> bool:
        return not self.cancelled and not self.fired

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        assert self.pending, "fired a timer that is cancelled or already fired"
        self.fired = True
        self.callback(*self.args)


class RecordingLoop(asyncio.SelectorEventLoop):
    """A real event loop (tasks, futures, sleeps) whose ``call_later`` for an
    ``HTTPProtocol``'s timer is recorded instead of scheduled."""

    def __init__(self) -> None:
        super().__init__()
        self.timers: list[FakeTimer] = []

    def call_later(  # type: ignore[override]
        self, delay: float, callback: Callable[..., Any], *args: Any, context: Any = None
    ) -> Any:
        owner = getattr(callback, "__self__", None)
        if type(owner).__name__ == "HTTPProtocol":
            timer = FakeTimer(delay, callback, args)
            self.timers.append(timer)
            return timer
        return super().call_later(delay, callback, *args, context=context)


# -- the fake transport -------------------------------------------------------------


class FakeTransport:
    """Records what the protocol does to it, in order (``events``).

    ``get_extra_info("socket")`` is None, so the protocol's SocketWriter sends every
    byte through ``write``/``writelines``. ``close``/``abort`` call the protocol's
    ``connection_lost`` soon after, as asyncio's transports do; ``lose`` is the
    client going away.
    """

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        self.events: list[tuple[str, bytes] | tuple[str]] = []
        self.reading = True
        self.closing = False
        self.aborted = False
        self.eof = False
        self.lost = False
        self.late_writes: list[bytes] = []  # writes after close(): a server bug
        self._taken = 0

    # transport API
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return PEER if name == "peername" else default  # no "socket", no "sslcontext"

    def write(self, data: bytes | memoryview) -> None:
        if self.eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if self.closing:
            self.late_writes.append(bytes(data))
            return
        self.events.append(("write", bytes(data)))

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(bytes(p) for p in parts))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        self.events.append(("close",))
        asyncio.get_running_loop().call_soon(self._lost, None)

    def abort(self) -> None:
        if self.aborted:
            return
        self.aborted = True
        self.events.append(("abort",))
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self._lost, None)

    def pause_reading(self) -> None:
        self.reading = False
        self.events.append(("pause_reading",))

    def resume_reading(self) -> None:
        self.reading = True
        self.events.append(("resume_reading",))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True
        self.events.append(("write_eof",))

    def get_write_buffer_size(self) -> int:
        return 0

    # the test's side
    def _lost(self, exc: BaseException | None) -> None:
        if not self.lost:
            self.lost = True
            self.protocol.connection_lost(exc)

    def lose(self, exc: BaseException | None = None) -> None:
        """The client went away (reset, or its side closed)."""
        self.closing = True
        self._lost(exc)

    def feed_eof(self) -> None:
        """The client half-closed: as asyncio does, close unless the protocol keeps it."""
        if not self.protocol.eof_received():
            self.close()

    @property
    def data(self) -> bytes:
        return b"".join(e[1] for e in self.events if e[0] == "write")  # type: ignore[misc]

    def take(self) -> bytes:
        """What was written since the last take."""
        data = self.data
        new, self._taken = data[self._taken :], len(data)
        return new

    def calls(self) -> list[str]:
        return [e[0] for e in self.events if e[0] != "write"]


# -- the app ------------------------------------------------------------------------


class App:
    """Answers ``200 text/plain`` with the target (or the body) at once; a target
    under ``/wait`` answers once the test releases it (``release``)."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.writers: list[Any] = []
        self.gates: list[asyncio.Event] = []
        self.cancelled: list[bytes] = []

    @property
    def targets(self) -> list[bytes]:
        return [r.target for r in self.requests]

    def handle(self, req: Any, w: Any) -> Any:
        self.requests.append(req)
        self.writers.append(w)
        if req.path.startswith(b"/wait"):
            gate = asyncio.Event()
            self.gates.append(gate)
            return self._wait(req, w, gate)
        w.send(200, req.body or req.target, TEXT)
        return None

    async def _wait(self, req: Any, w: Any, gate: asyncio.Event) -> None:
        try:
            await gate.wait()
        except asyncio.CancelledError:
            self.cancelled.append(req.target)
            raise
        w.send(200, req.body or req.target, TEXT)

    async def release(self, i: int) -> None:
        """Let the ``i``-th waiting request answer; wait until its task ran."""
        self.gates[i].set()
        await until(lambda: self.writers[self._waiting_index(i)].finished)

    def _waiting_index(self, i: int) -> int:
        waiting = [k for k, r in enumerate(self.requests) if r.path.startswith(b"/wait")]
        return waiting[i]


async def until(cond: Callable[[], bool]) -> None:
    """Run the loop until ``cond()`` (bounded)."""
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.001)


async def turns(n: int = 5) -> None:
    """Let the loop run a few times (pending callbacks and task steps)."""
    for _ in range(n):
        await asyncio.sleep(0)


# -- the harness --------------------------------------------------------------------


class Conn:
    """One server and one connection on a fake transport."""

    def __init__(self, mod: ModuleType, app: Any = None, server: Any = None, **limits: Any) -> None:
        self.loop: RecordingLoop = asyncio.get_running_loop()  # type: ignore[assignment]
        assert isinstance(self.loop, RecordingLoop)
        self.app = app if app is not None else App()
        self.server = server if server is not None else mod.HTTPServer(self.app, mod.ServerLimits(**limits))
        self.proto = mod.HTTPProtocol(self.server)
        self.t = FakeTransport(self.proto)
        _made.append(self.t)
        self.proto.connection_made(self.t)

    def feed(self, data: bytes) -> None:
        self.proto.data_received(data)

    def timers(self) -> list[FakeTimer]:
        """Every timer this connection asked ``call_later`` for."""
        return [t for t in self.loop.timers if getattr(t.callback, "__self__", None) is self.proto]

    def pending(self) -> list[FakeTimer]:
        return [t for t in self.timers() if t.pending]

    def timer(self) -> FakeTimer:
        """The one pending timer."""
        pending = self.pending()
        assert len(pending) == 1, f"expected one pending timer, got {len(pending)}"
        return pending[0]


_made: list[FakeTransport] = []
_runs: list[int] = [0]


@pytest.fixture(autouse=True)
def _ran() -> Iterator[None]:
    """Each test here runs its body (a test that forgot ``run(body)`` fails)."""
    _runs[0] = 0
    yield
    assert _runs[0] == 1, "the test body never ran"


def run(body: Callable[..., Coroutine[Any, Any, None]], *args: Any) -> None:
    """Run ``body(*args)`` on a RecordingLoop; then check that no connection was
    written to after it closed."""
    _runs[0] += 1
    _made.clear()
    with asyncio.Runner(loop_factory=RecordingLoop) as runner:
        runner.run(asyncio.wait_for(body(*args), WAIT * 4))
    for t in _made:
        assert not t.late_writes, f"written after close: {t.late_writes!r}"
    _made.clear()


def ok(body: bytes, close: bool = False) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n%s\r\n%s"
        % (len(body), b"connection: close\r\n" if close else b"", body)
    )


def error(status: int, reason: bytes, message: str, code: str, type: str = "invalid_request_error",
          extra: bytes = b"") -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n%scontent-length: %d\r\nconnection: close\r\n\r\n%s"
        % (status, reason, extra, len(body), body)
    )


def get(target: bytes, *headers: bytes) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: t\r\n%s\r\n" % (target, b"".join(h + b"\r\n" for h in headers))


def post(target: bytes, body: bytes, *headers: bytes) -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n%s\r\n%s"
        % (target, len(body), b"".join(h + b"\r\n" for h in headers), body)
    )


# -- requests and responses ---------------------------------------------------------


def test_simple_request_response(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        assert c.proto.transport is c.t and c.proto.peer == PEER
        c.feed(b"GET /hello?x=1 HTTP/1.1\r\nHost: example\r\nX-Other: 1\r\n\r\n")
        assert c.t.data == b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 10\r\n\r\n/hello?x=1"
        (req,) = c.app.requests
        assert (req.method, req.target, req.path, req.host) == (b"GET", b"/hello?x=1", b"/hello", b"example")
        assert req.header(b"x-other") == b"1"
        assert c.app.writers[0].peer == PEER and c.app.writers[0].finished
        assert c.t.calls() == []  # kept open, reading on
        assert c.t.reading and not c.t.closing

    run(body)


def test_default_json_send_and_head_only(server: ModuleType) -> None:
    class JsonApp:
        def handle(self, req: Any, w: Any) -> None:
            w.send(200, b'{"a":1}')

    async def body() -> None:
        c = Conn(server, JsonApp())
        c.feed(get(b"/"))
        assert c.t.take() == b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{\"a\":1}"
        c.feed(b"HEAD / HTTP/1.1\r\nHost: t\r\n\r\n")  # the length of the body, none of its bytes
        assert c.t.take() == b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n"

    run(body)


def test_keep_alive_serves_the_next_request(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(get(b"/a"))
        assert c.t.take() == ok(b"/a")
        c.feed(get(b"/b"))
        assert c.t.take() == ok(b"/b")
        assert not c.t.closing and c.app.targets == [b"/a", b"/b"]

    run(body)


@pytest.mark.parametrize(
    "head",
    [b"GET /a HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", b"GET /a HTTP/1.0\r\n\r\n"],
    ids=["connection-close", "http10"],
)
def test_connection_close_closes_after_the_answer(server: ModuleType, head: bytes) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(head)
        assert c.t.data == ok(b"/a", close=True)
        assert c.t.calls() == ["close"]
        await until(lambda: c.t.lost)
        assert c.proto.transport is None and c.server.connections == set()

    run(body)


def test_connection_close_with_an_async_answer(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(b"GET /wait HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert c.t.data == b"" and not c.t.closing
        await c.app.release(0)
        assert c.t.data == ok(b"/wait", close=True) and c.t.calls() == ["close"]

    run(body)


def test_no_request_is_served_after_connection_close(server: ModuleType) -> None:
    """RFC 9112 §9.6: after a request with ``Connection: close`` the server MUST NOT
    process further requests on the connection (here: pipelined in the same read,
    answered at once)."""

    async def body() -> None:
        c = Conn(server)
        c.feed(b"GET /a HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n" + get(b"/b") + b"GET /c HTTP/1.1\r\nHo")
        assert c.app.targets == [b"/a"]
        assert c.t.data == ok(b"/a", close=True)
        assert c.t.calls() == ["close"]
        await until(lambda: c.t.lost)
        assert c.pending() == []

    run(body)


def test_no_request_is_served_after_the_server_chose_to_close(server: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    """An answer at once that closes the connection (here a 500, which closes) ends
    it: the requests pipelined behind it in the same read are not served."""

    class App2(App):
        def handle(self, req: Any, w: Any) -> Any:
            if req.path == b"/boom":
                self.requests.append(req)
                raise RuntimeError("boom")
            return super().handle(req, w)

    async def body() -> None:
        c = Conn(server, App2())
        c.feed(get(b"/boom") + get(b"/b") + b"POST /c HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        assert c.app.targets == [b"/boom"]
        assert c.t.data.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert c.t.data.count(b"HTTP/1.1") == 1  # no 100 Continue either
        assert c.t.calls() == ["close"]
        c.feed(get(b"/d"))  # (bytes read before the close took effect)
        assert c.app.targets == [b"/boom"] and c.t.calls() == ["close"]
        await until(lambda: c.t.lost)
        assert c.pending() == []

    run(body)


# -- pipelining ---------------------------------------------------------------------


def test_pipelined_requests_answered_in_order(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(get(b"/wait1") + get(b"/two") + get(b"/wait3") + get(b"/four"))
        assert c.app.targets == [b"/wait1"]  # the others wait their turn
        assert c.t.data == b""
        await c.app.release(0)
        assert c.app.targets == [b"/wait1", b"/two", b"/wait3"]
        assert c.t.take() == ok(b"/wait1") + ok(b"/two")
        await c.app.release(1)
        assert c.app.targets == [b"/wait1", b"/two", b"/wait3", b"/four"]
        assert c.t.take() == ok(b"/wait3") + ok(b"/four")
        assert c.t.calls() == [] and not c.t.closing

    run(body)


def test_reading_pauses_at_max_pipelined_and_resumes_as_they_drain(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server, max_pipelined=4)
        c.feed(b"".join(get(b"/wait%d" % i) for i in range(6)))
        # one answered, five read ahead: reading paused once the fourth was queued
        assert c.t.calls() == ["pause_reading"] and not c.t.reading
        await c.app.release(0)  # four queued
        await c.app.release(1)  # three
        await c.app.release(2)  # two
        assert not c.t.reading
        await c.app.release(3)  # fewer than half of max_pipelined left: reading again
        assert c.t.calls() == ["pause_reading", "resume_reading"] and c.t.reading
        for i in range(4, 6):
            await c.app.release(i)
        assert c.t.data == b"".join(ok(b"/wait%d" % i) for i in range(6))
        assert c.t.calls() == ["pause_reading", "resume_reading"]

    run(body)


def test_reading_resumes_with_max_pipelined_one(server: ModuleType) -> None:
    """With ``max_pipelined=1`` (half of it is 0), reading paused for the one request
    read ahead must resume once it is taken, or the connection stalls."""

    async def body() -> None:
        c = Conn(server, max_pipelined=1)
        c.feed(get(b"/wait0") + get(b"/wait1"))
        assert c.t.calls() == ["pause_reading"]
        await c.app.release(0)
        await c.app.release(1)
        assert c.t.reading, "reading never resumed"
        assert c.t.calls() == ["pause_reading", "resume_reading"]
        c.feed(get(b"/c"))
        assert c.t.data == ok(b"/wait0") + ok(b"/wait1") + ok(b"/c")

    run(body)


def test_request_split_byte_by_byte(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        raw = post(b"/echo", b"hello world", b"Content-Type: text/plain", b"X-A: b")
        for i in range(len(raw)):
            assert c.app.requests == []
            c.feed(raw[i : i + 1])
        (req,) = c.app.requests
        assert (req.method, req.target, req.body, req.content_type) == (b"POST", b"/echo", b"hello world", b"text/plain")
        assert c.t.data == ok(b"hello world")
        # the head timer, the body timer and the keep-alive timer after it: no call_later per byte
        assert len(c.timers()) <= 2

    run(body)


def test_chunked_request_body(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        assert c.app.requests == []
        c.feed(b"6\r\n world\r\n0\r\n\r\n")
        assert c.t.data == ok(b"hello world")

    run(body)


# -- 100 Continue -------------------------------------------------------------------


def test_expect_100_continue_before_the_body(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert c.t.take() == CONTINUE and c.app.requests == []
        c.feed(b"hello")
        assert c.t.take() == ok(b"hello")

    run(body)


def test_expect_100_continue_waits_for_a_busy_connection(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(get(b"/wait"))
        c.feed(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert c.t.data == b""  # no 100 ahead of the answer before it
        await c.app.release(0)
        assert c.t.take() == ok(b"/wait") + CONTINUE
        c.feed(b"hello")
        assert c.t.take() == ok(b"hello")

    run(body)


def test_expect_100_continue_not_sent_for_an_empty_body(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\nExpect: 100-continue\r\n\r\n")
        assert c.t.data == ok(b"/up")

    run(body)


# -- flow control -------------------------------------------------------------------


class Streamer:
    """Starts a chunked answer, writes ``a``, then (told to) drains and writes ``b``."""

    def __init__(self, listener: Any = None) -> None:
        self.listener = listener
        self.go = asyncio.Event()
        self.drained = False
        self.writer: Any = None

    def handle(self, req: Any, w: Any) -> Any:
        self.writer = w
        if self.listener is not None:
            w.add_flow_listener(self.listener)
        return self._run(w)

    async def _run(self, w: Any) -> None:
        w.start(200, TEXT)
        w.write(b"a")
        await self.go.wait()
        await w.drain()
        self.drained = True
        w.write(b"b")
        w.end()


class Listener:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_reading(self) -> None:
        self.calls.append("pause")

    def resume_reading(self) -> None:
        self.calls.append("resume")


def test_drain_blocks_while_writing_is_paused(server: ModuleType) -> None:
    async def body() -> None:
        app = Streamer()
        c = Conn(server, app)
        c.feed(get(b"/s"))
        await until(lambda: c.t.data != b"")
        assert c.t.take() == b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n"
        c.proto.pause_writing()
        assert app.writer.write_paused
        app.go.set()
        await turns(10)
        assert not app.drained and c.t.take() == b""
        c.proto.resume_writing()
        await until(lambda: app.drained)
        assert not app.writer.write_paused
        assert c.t.take() == b"1\r\nb\r\n0\r\n\r\n"

    run(body)


def test_drain_returns_at_once_when_not_paused(server: ModuleType) -> None:
    async def body() -> None:
        app = Streamer()
        c = Conn(server, app)
        c.feed(get(b"/s"))
        app.go.set()
        await until(lambda: app.drained)
        assert c.t.data.endswith(b"1\r\nb\r\n0\r\n\r\n")

    run(body)


def test_drain_ends_when_the_client_goes(server: ModuleType) -> None:
    async def body() -> None:
        app = Streamer()
        c = Conn(server, app)
        c.feed(get(b"/s"))
        await until(lambda: c.t.data != b"")
        c.proto.pause_writing()
        app.go.set()
        await turns(10)
        c.t.lose(ConnectionResetError())
        assert app.writer.disconnected
        await turns(10)  # the app's task was cancelled, nothing more written
        assert not app.drained and c.t.data.endswith(b"1\r\na\r\n")

    run(body)


def test_flow_listener_follows_the_client(server: ModuleType) -> None:
    async def body() -> None:
        listener = Listener()
        app = Streamer(listener)
        c = Conn(server, app)
        c.feed(get(b"/s"))
        c.proto.pause_writing()
        assert listener.calls == ["pause"]
        c.proto.resume_writing()
        assert listener.calls == ["pause", "resume"]
        c.proto.pause_writing()
        app.go.set()
        await turns(10)
        c.proto.resume_writing()
        await until(lambda: app.writer.finished)
        assert listener.calls == ["pause", "resume", "pause", "resume"]
        c.proto.pause_writing()  # the response ended: the listener is no longer told
        c.proto.resume_writing()
        assert listener.calls == ["pause", "resume", "pause", "resume"]

    run(body)


def test_flow_listener_added_while_paused_is_paused_at_once(server: ModuleType) -> None:
    async def body() -> None:
        listener = Listener()
        c = Conn(server, Streamer(listener))
        c.proto.pause_writing()
        c.feed(get(b"/s"))
        assert listener.calls == ["pause"]
        c.proto.resume_writing()
        assert listener.calls == ["pause", "resume"]
        await turns()  # (the app's task runs)
        c.t.lose()

    run(body)


# -- timers -------------------------------------------------------------------------


def test_keep_alive_timer_closes_an_idle_connection(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server, keepalive_timeout=0.05)
        assert c.timer().delay == pytest.approx(0.05)  # idle from the start
        c.feed(get(b"/a"))
        assert c.t.take() == ok(b"/a")
        timer = c.timer()  # the same handle: it covers the keep-alive after the answer
        assert len(c.timers()) == 1
        await asyncio.sleep(0.1)
        timer.fire()
        assert c.t.calls() == ["close"]
        await until(lambda: c.t.lost)
        assert c.server.connections == set() and c.pending() == []

    run(body)


def test_timer_fired_early_rearms_for_the_rest(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server, keepalive_timeout=0.6)
        first = c.timer()
        first.fire()  # well before the deadline: nothing done, the rest re-armed
        assert c.t.calls() == []
        second = c.timer()
        assert second is not first and 0.3 < second.delay <= 0.6
        armed = time.monotonic()
        await asyncio.sleep(0.3)
        c.feed(get(b"/a"))  # the deadline moves later; the pending handle is kept
        assert c.timer() is second
        await asyncio.sleep(max(0.0, armed + second.delay + 0.02 - time.monotonic()))
        second.fire()  # the handle's time, but not the moved deadline's
        assert c.t.calls() == []
        third = c.timer()
        assert 0 < third.delay < 0.6
        await asyncio.sleep(third.delay + 0.02)
        third.fire()
        assert c.t.calls() == ["close"]

    run(body)


def test_no_call_later_per_request_on_keep_alive(server: ModuleType) -> None:
    """PERF: timers are lazy: 20 requests on one connection cost no call_later of their own."""

    async def body() -> None:
        c = Conn(server)
        for i in range(20):
            c.feed(get(b"/r%d" % i))
        assert c.t.data == b"".join(ok(b"/r%d" % i) for i in range(20))
        assert len(c.timers()) == 1
        for i in range(20):  # split heads: the head timer shares the handle too
            c.feed(b"GET /s%d HTTP/1.1\r\n" % i)
            c.feed(b"Host: t\r\n\r\n")
        assert len(c.timers()) <= 2

    run(body)


def test_head_timeout_is_408_then_a_lingering_close(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server, header_timeout=0.05)
        idle = c.timer()
        c.feed(b"GET / HTTP/1.1\r\nHo")  # a head begun: its (earlier) deadline replaces the idle one
        assert idle.cancelled
        head = c.timer()
        assert head.delay == pytest.approx(0.05)
        c.feed(b"st: t\r\n")  # more of the same head: the deadline does not move
        assert c.timer() is head
        await asyncio.sleep(0.1)
        head.fire()
        assert c.t.data == error(408, b"Request Timeout", "timed out reading the request headers", "request_timeout")
        assert c.t.calls() == ["pause_reading", "write_eof", "resume_reading"]
        assert c.app.requests == []
        c.feed(b"X: y\r\n\r\n")  # dropped while lingering
        assert c.app.requests == [] and c.t.calls()[-1] == "resume_reading"
        c.t.feed_eof()  # the client read the answer and closed
        assert c.t.calls()[-1] == "close"
        await until(lambda: c.t.lost)
        assert c.pending() == []

    run(body)


def test_body_timeout_is_408(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server, body_timeout=0.05)
        c.feed(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
        timer = c.timer()
        assert timer.delay == pytest.approx(0.05)
        c.feed(b"def")
        assert c.timer() is timer
        await asyncio.sleep(0.1)
        timer.fire()
        assert c.t.data == error(408, b"Request Timeout", "timed out reading the request body", "request_timeout")
        assert c.t.calls() == ["pause_reading", "write_eof", "resume_reading"]

    run(body)


def test_head_timeout_while_busy_waits_for_the_answer(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server, header_timeout=0.05)
        c.feed(get(b"/wait") + b"GET /next HTTP/1.1\r\n")
        head = c.timer()
        await asyncio.sleep(0.1)
        head.fire()  # the delay is the server's: dropped, not answered
        assert c.t.data == b"" and c.pending() == []
        await c.app.release(0)
        assert c.t.take() == ok(b"/wait")
        again = c.timer()  # restarted now that only the client can be slow
        await asyncio.sleep(0.1)
        again.fire()
        assert c.t.take() == error(408, b"Request Timeout", "timed out reading the request headers", "request_timeout")

    run(body)


def test_head_begun_after_an_answer_in_the_same_read_is_timed(server: ModuleType) -> None:
    """A request answered at once and the start of the next one in one read: the
    head must be under the head timeout, not the (longer) keep-alive one."""

    async def body() -> None:
        c = Conn(server, header_timeout=0.05, keepalive_timeout=30.0)
        c.feed(get(b"/a") + b"GET /b HTTP/1.1\r\nHo")
        assert c.t.take() == ok(b"/a")
        timer = c.timer()
        assert timer.delay <= 0.05
        await asyncio.sleep(0.1)
        timer.fire()
        assert c.t.take() == error(408, b"Request Timeout", "timed out reading the request headers", "request_timeout")

    run(body)


def test_blank_lines_do_not_stop_the_keep_alive_timer(server: ModuleType) -> None:
    """Empty lines between requests (allowed by RFC 9112 §2.2) begin no request: the
    idle connection must still be closed when its keep-alive time runs out."""

    async def body() -> None:
        c = Conn(server, keepalive_timeout=0.05)
        c.feed(b"\r\n")
        await asyncio.sleep(0.1)
        for _ in range(3):
            pending = c.pending()
            assert pending, "an idle connection with no timer is never closed"
            pending[0].fire()
            if c.t.closing:
                break
            await asyncio.sleep(0.1)
        assert c.t.calls() == ["close"]

    run(body)


# -- errors -------------------------------------------------------------------------


def test_bad_header_answered_after_the_pipelined_requests_before_it(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(get(b"/wait") + get(b"/two") + b"GET /bad HTTP/1.1\r\nBad Header\r\n\r\n")
        assert c.t.calls() == ["pause_reading"]
        assert c.t.data == b""
        await c.app.release(0)
        assert c.app.targets == [b"/wait", b"/two"]
        data = c.t.data
        assert data.startswith(ok(b"/wait") + ok(b"/two") + b"HTTP/1.1 400 Bad Request\r\n")
        assert b"connection: close\r\n" in data and b'"code":"invalid_request"' in data
        assert c.t.calls() == ["pause_reading", "write_eof", "resume_reading"]
        linger = c.timer()
        assert linger.delay == pytest.approx(2.0)
        linger.fire()  # early: re-armed, not closed
        assert not c.t.closing and 0 < c.timer().delay <= 2.0
        c.t.lose()  # the client closed
        assert c.proto.transport is None and c.pending() == []

    run(body)


def test_oversize_body_is_413_then_a_lingering_close(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server, max_body=10)
        c.feed(b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123")
        assert c.t.data == error(413, b"Content Too Large", "request body is 100 bytes; the limit is 10",
                                 "request_too_large", extra=b"x-should-retry: false\r\n")
        assert c.t.calls() == ["pause_reading", "write_eof", "resume_reading"]
        c.feed(b"4567890" * 10)  # the rest of the refused body: dropped
        assert c.app.requests == [] and c.t.calls() == ["pause_reading", "write_eof", "resume_reading"]
        c.t.feed_eof()
        assert c.t.calls()[-1] == "close"

    run(body)


def test_linger_timer_closes(server: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "_LINGER_S", 0.05)

    async def body() -> None:
        c = Conn(server)
        c.feed(b"GET / HTTP/1.1\r\nBad Header\r\n\r\n")
        assert c.t.calls() == ["pause_reading", "write_eof", "resume_reading"]
        linger = c.timer()
        await asyncio.sleep(0.1)
        linger.fire()
        assert c.t.calls()[-1] == "close"

    run(body)


def test_handler_exception_is_500(server: ModuleType, caplog: pytest.LogCaptureFixture) -> None:
    class Boom:
        def handle(self, req: Any, w: Any) -> None:
            raise RuntimeError("secret")

    async def body() -> None:
        c = Conn(server, Boom())
        c.feed(get(b"/"))
        assert c.t.data == error(500, b"Internal Server Error", "internal error in the gateway", "internal_error",
                                 type="server_error")
        assert c.t.calls() == ["close"]
        assert b"secret" not in c.t.data

    run(body)


# -- the client going away ----------------------------------------------------------


def test_client_disconnect_mid_response(server: ModuleType) -> None:
    class Watcher:
        gone = 0

        def client_gone(self) -> None:
            self.gone += 1

    watcher = Watcher()
    events: list[str] = []

    class Hang:
        writer: Any = None
        cancelled = False

        def handle(self, req: Any, w: Any) -> Any:
            self.writer = w
            w.watch(watcher)
            w.on_disconnect(lambda: events.append("cb"))
            return self._run(w)

        async def _run(self, w: Any) -> None:
            w.start(200, TEXT, 100)
            w.write(b"part")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled = True
                w.write(b"more")  # too late: dropped
                raise

    async def body() -> None:
        app = Hang()
        c = Conn(server, app)
        c.feed(get(b"/"))
        await until(lambda: c.t.data.endswith(b"part"))
        c.t.lose(ConnectionResetError())
        w = app.writer
        assert w.disconnected and watcher.gone == 1 and events == ["cb"]
        assert c.proto.transport is None and w.transport is None and c.server.connections == set()
        await until(lambda: app.cancelled)
        await turns()
        assert c.t.data == b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 100\r\n\r\npart"
        w.on_disconnect(lambda: events.append("late"))  # after the fact: runs at once
        assert events == ["cb", "late"] and watcher.gone == 1

    run(body)


def test_client_gone_after_the_answer_calls_nothing(server: ModuleType) -> None:
    class Watcher:
        gone = 0

        def client_gone(self) -> None:
            self.gone += 1

    watcher = Watcher()

    class Quick:
        def handle(self, req: Any, w: Any) -> None:
            w.watch(watcher)
            w.send(200, b"x", TEXT)

    async def body() -> None:
        c = Conn(server, Quick())
        c.feed(get(b"/"))
        c.t.lose()
        assert watcher.gone == 0

    run(body)


# -- connection limit and shutdown --------------------------------------------------


def test_max_connections_is_503_at_once(server: ModuleType) -> None:
    async def body() -> None:
        first = Conn(server, max_connections=1)
        second = Conn(server, server=first.server)
        assert first.server.connections == {first.proto} and first.server.rejected == 1
        # (dated, as every answer is: RFC 9110 §6.6.1)
        date = re.compile(rb"date: \w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} GMT\r\n")
        assert date.search(second.t.data), second.t.data
        assert date.sub(b"", second.t.data, count=1) == error(
            503, b"Service Unavailable", "the gateway is at its connection limit; retry shortly",
            "service_unavailable", type="service_unavailable_error",
            extra=b"retry-after: 1\r\nretry-after-ms: 1000\r\n",
        )
        assert second.t.calls() == ["write_eof", "resume_reading"]
        second.feed(get(b"/"))  # dropped
        assert first.app.requests == []
        second.t.feed_eof()
        await until(lambda: second.t.lost)
        assert second.pending() == []
        first.feed(get(b"/a"))  # the first is served as ever
        assert first.t.data == ok(b"/a")

    run(body)


def test_shutdown_closes_an_idle_connection(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(get(b"/a"))
        c.proto.shutdown()
        assert c.t.calls() == ["close"]
        await until(lambda: c.t.lost)
        assert c.server.connections == set()

    run(body)


def test_shutdown_lets_the_current_response_finish(server: ModuleType) -> None:
    async def body() -> None:
        c = Conn(server)
        c.feed(get(b"/wait"))
        c.proto.shutdown()
        assert c.t.calls() == []
        await c.app.release(0)
        assert c.t.data == ok(b"/wait")
        assert c.t.calls() == ["close"]

    run(body)


def test_server_close_finishes_in_flight_then_refuses(server: ModuleType) -> None:
    async def body() -> None:
        busy = Conn(server)
        idle = Conn(server, server=busy.server)
        busy.feed(get(b"/wait"))
        closing = asyncio.ensure_future(busy.server.close(timeout=WAIT))
        await until(lambda: idle.t.lost)
        assert idle.t.calls() == ["close"] and not busy.t.closing
        late = Conn(server, server=busy.server)  # accepted while closing: refused, closed at once
        assert b"the gateway is shutting down" in late.t.data and late.t.calls() == ["close"]
        await busy.app.release(0)
        assert busy.t.data == ok(b"/wait", close=True)  # the last answer says so
        await asyncio.wait_for(closing, WAIT)
        assert busy.server.connections == set()

    run(body)
