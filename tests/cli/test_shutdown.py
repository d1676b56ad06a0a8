"""``llmgw serve`` stopped by signals: every request gets an answer.

A real ``llmgw serve`` process in front of an engine in this test (llmgw's HTTP
core on a real socket: a stream that never ends, an answer that never comes, a
metrics page that says how busy it is), and raw HTTP clients that check the bytes:
on SIGTERM the queued request gets 503 ``shutting_down`` at once; at
``server.shutdown_timeout`` the stream still running ends with an SSE error event
and the chunked body's end (never a bare cut), the answer still awaited gets 503;
a second SIGINT ends them at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import yaml

from llmgw.http.server import HTTPServer
from ports import free_port as _free_port


class Engine:
    """Streams an event every 20 ms for as long as the client stays; never answers a
    non-streamed request; its vLLM metrics page counts what it holds (one slot)."""

    def __init__(self) -> None:
        self.active = 0
        self.server: HTTPServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = HTTPServer(self, name="engine")
        _, self.port = await self.server.listen("127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close(0.5)

    def handle(self, req: Any, w: Any) -> Any:
        if req.path == b"/metrics":
            running, waiting = min(self.active, 1), max(self.active - 1, 0)
            page = (
                b'vllm:num_requests_running{model_name="m"} %d\n'
                b'vllm:num_requests_waiting{model_name="m"} %d\n' % (running, waiting)
            )
            w.send(200, page, ((b"content-type", b"text/plain; version=0.0.4"),))
            return None
        body = orjson.loads(req.body)
        return self._stream(w) if body.get("stream") else self._hang()

    async def _stream(self, w: Any) -> None:
        self.active += 1
        try:
            w.start(200, [(b"content-type", b"text/event-stream")])
            for i in range(100_000):  # (bounded: ~30 min; the gateway ends it long before)
                w.write(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i)
                await asyncio.sleep(0.02)
        finally:
            self.active -= 1

    async def _hang(self) -> None:
        self.active += 1
        try:
            await asyncio.sleep(1800)
        finally:
            self.active -= 1


class Serve:
    """``llmgw serve -c FILE`` as a child process; its stderr lines are collected."""

    def __init__(self, tmp: Path, engine: Engine, shutdown_timeout: str) -> None:
        self.port, self.admin = _free_port(), _free_port()
        cfg = {
            "listen": f"127.0.0.1:{self.port}",
            "admin": f"127.0.0.1:{self.admin}",
            "endpoints": [{"id": "v0", "url": f"http://127.0.0.1:{engine.port}", "model": "m", "slots": 1}],
            "scrape": {"interval": "100ms", "timeout": "90ms"},
            "saturation": {"max_waiting": 1},
            "upstream": {"first_byte_timeout": "60s", "read_timeout": "60s"},
            "server": {"shutdown_timeout": shutdown_timeout},
        }
        self.path = tmp / "llmgw.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.proc: asyncio.subprocess.Process | None = None
        self.err: list[str] = []
        self.shutting_down = asyncio.Event()
        self._readers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmgw", "serve", "-c", str(self.path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers.append(asyncio.ensure_future(self._read_err(self.proc.stderr)))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 30)
            if not line:
                raise AssertionError(f"serve did not start: {self.err}")
            if line.startswith(b"  curl "):
                break
        self._readers.append(asyncio.ensure_future(self._drain(self.proc.stdout)))

    async def _read_err(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.err.append(line.decode())
            if "shutting down" in self.err[-1]:
                self.shutting_down.set()

    async def _drain(self, stream: asyncio.StreamReader) -> None:
        while await stream.readline():
            pass

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def wait(self, timeout: float) -> int:
        assert self.proc is not None
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.gather(*self._readers)
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()


async def _send(port: int, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body)
    w.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (path.encode(), len(data), data))
    return r, w


async def _head(r: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 30)
    lines = raw.decode("latin-1").split("\r\n")
    return int(lines[0].split()[1]), {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}


async def _answer(r: asyncio.StreamReader) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, hdrs = await _head(r)
    body = await asyncio.wait_for(r.readexactly(int(hdrs["content-length"])), 30)
    return status, hdrs, orjson.loads(body)


async def _chunks(r: asyncio.StreamReader, first: asyncio.Event) -> tuple[list[bytes], bool]:
    """A chunked body's pieces, and whether it ended with its last chunk (not a cut)."""
    pieces: list[bytes] = []
    try:
        for _ in range(1_000_000):
            size = int((await asyncio.wait_for(r.readline(), 30)).strip(), 16)
            if size == 0:
                return pieces, (await r.readline()) == b"\r\n"
            pieces.append(await r.readexactly(size))
            await r.readexactly(2)
            first.set()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        return pieces, False
    return pieces, False


async def _admin_get(port: int, path: str) -> Any:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode())
        _, hdrs = await _head(r)
        return orjson.loads(await r.readexactly(int(hdrs["content-length"])))
    finally:
        w.close()


async def _until(cond: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


STREAM = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _sse_error(pieces: list[bytes]) -> dict[str, Any]:
    last = b"".join(pieces).rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"data: "), last
    return orjson.loads(last[6:])["error"]


async def _stream_and_queue(serve: Serve) -> tuple[Any, ...]:
    """A stream running, an answer awaited from the engine, a request queued at the gateway."""
    ra, wa = await _send(serve.port, STREAM)
    status, _ = await _head(ra)
    assert status == 200
    first = asyncio.Event()
    stream = asyncio.ensure_future(_chunks(ra, first))
    await asyncio.wait_for(first.wait(), 30)
    rb, wb = await _send(serve.port, CHAT)

    async def inflight() -> bool:
        eps = await _admin_get(serve.admin, "/admin/v1/endpoints")
        return bool(eps["endpoints"][0]["inflight"] == 2)

    await _until(inflight)
    rc, wc = await _send(serve.port, CHAT)

    async def queued() -> bool:
        q = await _admin_get(serve.admin, "/admin/v1/queues")
        return sum(b["depth"] for b in q["bands"]) == 1

    await _until(queued)
    return stream, (rb, wb), (rc, wc), (wa,)


async def test_sigterm_answers_the_queue_at_once_and_ends_streams_at_the_timeout(tmp_path: Path) -> None:
    engine = Engine()
    await engine.start()
    serve = Serve(tmp_path, engine, shutdown_timeout="2s")
    try:
        await serve.start()
        stream, (rb, wb), (rc, wc), (wa,) = await _stream_and_queue(serve)
        t0 = time.monotonic()
        serve.signal(signal.SIGTERM)
        status, hdrs, body = await _answer(rc)
        queued_took = time.monotonic() - t0
        assert status == 503 and body["error"]["code"] == "shutting_down", body
        assert int(hdrs["retry-after"]) >= 1
        assert queued_took < 1.0, queued_took  # at once, not at shutdown_timeout (2 s)
        status, _, body = await _answer(rb)
        assert status == 503 and body["error"]["code"] == "shutting_down", body
        pieces, ended = await stream
        took = time.monotonic() - t0
        assert ended, "the stream was cut without its last chunk"
        assert len(pieces) > 1
        err = _sse_error(pieces)
        assert err["code"] == "shutting_down" and "shutting down" in err["message"]
        assert 1.5 <= took < 6.0, took  # at shutdown_timeout
        assert await serve.wait(15) == 0, serve.err
        for w in (wb, wc, wa):
            w.close()
    finally:
        serve.kill()
        await engine.stop()


async def test_a_second_sigint_stops_at_once(tmp_path: Path) -> None:
    engine = Engine()
    await engine.start()
    serve = Serve(tmp_path, engine, shutdown_timeout="60s")
    try:
        await serve.start()
        stream, (rb, wb), (rc, wc), (wa,) = await _stream_and_queue(serve)
        serve.signal(signal.SIGINT)
        status, _, body = await _answer(rc)
        assert status == 503 and body["error"]["code"] == "shutting_down"
        await asyncio.wait_for(serve.shutting_down.wait(), 10)
        t0 = time.monotonic()
        serve.signal(signal.SIGINT)
        pieces, ended = await stream
        status, _, body = await _answer(rb)
        assert status == 503 and body["error"]["code"] == "shutting_down"
        assert ended and _sse_error(pieces)["code"] == "shutting_down"
        assert await serve.wait(15) == 0, serve.err
        took = time.monotonic() - t0
        assert took < 5.0, took  # not shutdown_timeout (60 s)
        assert any("stopping now" in line for line in serve.err), serve.err
        for w in (wb, wc, wa):
            w.close()
    finally:
        serve.kill()
        await engine.stop()
