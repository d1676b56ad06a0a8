"""The control plane's own thread: gRPC runs on an event loop of its own, off the data path's.

grpc.aio costs about 0.2 ms of CPU for every message it reads, most of it in
completion callbacks that run on the loop that created the server, and a burst
of heartbeats is drained in one callback. On the data path's loop that is time
every proxied request waits behind. So the gRPC server and its handlers run on
:class:`ControlThread`'s loop, and everything they know (the node map, the
deployments, the counters the scrape reads) stays on the main loop, reached
through :class:`MainHop`: handlers hand small, synchronous pieces of work over,
many per wake-up, and the main loop runs each in a few microseconds. No state is
shared between the threads; nothing on the main loop waits for the control thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["ControlThread", "MainHop"]

# The most hand-overs one main-loop callback runs before it yields (the rest run on the next
# iteration): a burst of a thousand heartbeats must not hold the data path's loop.
HOP_BATCH = 64
# How long work that wants no answer (a heartbeat) may wait for company before the main loop
# is woken for it. PERF: waking a loop from another thread costs it ~20 us (the self-pipe, an
# epoll return, a callback), as much as recording the heartbeat itself; 1,000 agents beat 200
# times a second, so they are taken over about 20 at a time.
HOP_DELAY = 0.1
# How long the control loop sleeps between its turns while it is busy (PACE_FROM connections or
# more; see ControlThread.pace). PERF: with a thousand agents each message woke the control loop on
# its own, ~200 times a second, each wake taking the GIL from the data path's thread and paying the
# loop's own turn (~half of the ~60 us a heartbeat cost); paced, the heartbeats that came in the
# nap are read in one turn. The price is up to PACE_S more for every step of a gRPC call (a
# registration, an answer to a router), which none of them notices.
PACE_S = 0.05
# Connections from which the control loop is paced (a cluster of a few nodes keeps its latency).
PACE_FROM = 64
# Nor is it paced for this long after a connection was accepted: the loop accepts one connection a
# turn (uvloop), so a thousand agents connecting at once (a start, a restart, a partition healed)
# would take 50 s to be accepted, past their connect timeout (20 s); a new node's registration too
# goes at the loop's speed.
PACE_AFTER_ACCEPT_S = 2.0
# How often an idle (not busy) control loop looks again whether it is.
PACE_CHECK_S = 1.0


def _name_os_thread(name: str) -> None:
    """Give the OS thread a name (``top -H``, ``/proc/PID/task/TID/comm``); Linux only, best effort."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the Python name still shows in tracebacks
        pass


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class ControlThread:
    """A daemon thread running an event loop of its own (``llmgw-control``)."""

    def __init__(self, name: str = "llmgw-control") -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 10.0) -> None:
        """Start the thread and wait until its loop runs.

        Raises:
            RuntimeError: the loop did not start within ``timeout``.
        """
        if self._thread is not None:
            return
        ready = threading.Event()
        loop = _new_loop()

        def run() -> None:
            _name_os_thread(self.name)
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            try:
                loop.run_forever()
            finally:
                try:
                    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                    for t in pending:
                        t.cancel()
                    if pending:
                        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()

        self.loop = loop
        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError(f"the {self.name} thread did not start within {timeout:g}s")

    def pace(self, busy: Callable[[], bool], nap: float = PACE_S) -> None:
        """While ``busy()`` (read on the control loop), end each of its turns with a nap of ``nap``
        seconds (the GIL released), so what arrives meanwhile is handled in one turn; when not busy,
        look again every :data:`PACE_CHECK_S`. Call it from any thread."""
        loop = self.loop
        assert loop is not None, "ControlThread.start() first"

        def turn() -> None:
            try:
                now_busy = busy()
            except Exception:  # (a bug in the test must not stop the loop)
                now_busy = False
            if now_busy:
                time.sleep(nap)
                loop.call_soon(turn)  # (after the I/O of the next turn: the loop polls before it runs it)
            else:
                loop.call_later(PACE_CHECK_S, turn)

        self.call(turn)

    def run(self, coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
        """Run ``coro`` on the control loop; await the result from the caller's loop."""
        assert self.loop is not None, "ControlThread.start() first"
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call ``fn(*args)`` on the control loop soon (from any thread)."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # closed in between: nothing listens any more
                pass

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop (its tasks are cancelled) and join the thread, for at most ``timeout``."""
        thread, loop = self._thread, self.loop
        if thread is None or loop is None:
            return
        self._thread = None
        if not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass
        thread.join(timeout)


class MainHop:
    """Work handed from the control thread to the main loop, many items per wake-up.

    The functions run on the main loop, in the order they were handed over, at most
    :data:`HOP_BATCH` per loop iteration. :meth:`call` wakes the main loop at once;
    :meth:`submit` (from the control loop) waits up to :data:`HOP_DELAY` for more.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, control: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.control = control
        """The control loop :meth:`submit` is called on (its timer batches); ``None``: no batching."""
        self._items: collections.deque[tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any] | None]]
        self._items = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False  # a drain is due on the main loop
        self._delayed = False  # (control loop only) a flush is due on the control loop

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the main loop within :data:`HOP_DELAY`; its result is dropped, its exception
        logged. Call it on the control loop."""
        self._items.append((fn, args, None))
        if self.control is None:
            self._wake()
        elif not self._delayed:
            self._delayed = True
            self.control.call_later(HOP_DELAY, self._flush)

    def _flush(self) -> None:  # on the control loop
        self._delayed = False
        self._wake()

    def call(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Run ``fn(*args)`` on the main loop; the future has its result or exception."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._items.append((fn, args, fut))
        self._wake()
        return fut

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`call`, awaited from the control loop."""
        return await asyncio.wrap_future(self.call(fn, *args))

    def _wake(self) -> None:
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the main loop is closed: the process is ending
            with self._lock:
                self._scheduled = False

    def _drain(self) -> None:
        items = self._items
        for _ in range(HOP_BATCH):
            if not items:
                break
            fn, args, fut = items.popleft()
            if fut is not None and not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                if fut is not None:
                    fut.set_exception(exc)
                else:
                    self.loop.call_exception_handler({"message": f"control hand-over {fn!r} failed", "exception": exc})
                if not isinstance(exc, Exception):
                    raise
            else:
                if fut is not None:
                    fut.set_result(result)
        with self._lock:
            if items:
                self.loop.call_soon(self._drain)  # the rest after the loop's other callbacks
            else:
                self._scheduled = False
