"""The debug build's live-object counters (``llmgw._fast._live``) count for real.

``tests/conftest.py`` asserts after every test, in the debug build, that the test
left none of its connections, writers, calls or upstream connections alive; these
tests show that the counters it reads go up while such objects live and back down
when they are freed, so that check can fail. In a release build or the pure twins
nothing counts, and the counters must stay at zero whatever runs.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from llmgw._fast import _live
from llmgw.http.client import UpstreamPool
from llmgw.http.parser import upstream_head
from llmgw.http.server import HTTPServer, ServerLimits

WAIT = 5.0


class Hold:
    """Answers once ``release`` is set, so a connection and its writer stay alive meanwhile."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.seen = asyncio.Event()

    async def handle(self, req: Any, w: Any) -> None:
        self.seen.set()
        await self.release.wait()
        w.send(200, b"ok", ())


class Sink:
    def __init__(self) -> None:
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_response_head(self, resp: Any) -> None:
        pass

    def on_response_body(self, data: bytes) -> None:
        pass

    def on_response_end(self) -> None:
        self.done.set_result(None)

    def on_upstream_lost(self, exc: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError(str(exc)))


def _live_now() -> dict[str, int]:
    for _ in range(3):
        gc.collect()
    return _live.live()


async def test_counters_follow_connections_writers_and_upstream_connections() -> None:
    app = Hold()
    server = HTTPServer(app, ServerLimits(), name="live")
    _, port = await server.listen("127.0.0.1", 0)
    pool = UpstreamPool("127.0.0.1", port)
    before = _live_now()
    try:
        conn = await asyncio.wait_for(pool.acquire(), WAIT)
        sink = Sink()
        conn.send(sink, upstream_head(b"GET", b"/", b"live", b"", -1), b"")
        await asyncio.wait_for(app.seen.wait(), WAIT)
        during = _live_now()
        app.release.set()
        await asyncio.wait_for(sink.done, WAIT)
        del conn, sink
    finally:
        pool.close()
        await asyncio.wait_for(server.close(1.0), WAIT)
    await asyncio.sleep(0.05)  # (the transports let go of their protocols)
    after = _live_now()
    if _live.enabled:
        # one client connection with its writer, one upstream connection, while held
        assert during["connections"] == before["connections"] + 1
        assert during["writers"] >= before["writers"] + 1
        assert during["upstream_connections"] == before["upstream_connections"] + 1
        assert after == before
    else:
        assert before == during == after == dict.fromkeys(_live.KINDS, 0)
