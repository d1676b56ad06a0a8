"""A small engine, a running gateway and an HTTP client for the admin tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import orjson

from llmgw.admin.app import AdminApp
from llmgw.config import Config, load
from llmgw.http.server import HTTPServer
from llmgw.runtime import GatewayRuntime, components_for

VLLM_PAGE = b"""# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""

USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


class Engine:
    """An OpenAI-ish engine: answers with usage, serves a vLLM metrics page.

    With ``page=None`` its metrics endpoint answers 404: routing calls such a
    replica *blind* (fresh, but without engine gauges), not stale.
    """

    def __init__(self, name: str, page: bytes | None = VLLM_PAGE) -> None:
        self.name = name
        self.page = page
        self.mode = "ok"
        self.server: HTTPServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = HTTPServer(self, name=self.name)
        _, self.port = await self.server.listen("127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close(1.0)

    def handle(self, req: Any, w: Any) -> Any:
        if req.method == b"GET" and req.path == b"/metrics":
            if self.page is None:
                w.send(404, b"not found", ((b"content-type", b"text/plain"),))
            else:
                w.send(200, self.page, ((b"content-type", b"text/plain; version=0.0.4"),))
            return None
        if self.mode == "503":
            w.send(503, b'{"error":{"message":"overloaded","type":"unavailable_error","code":503}}')
            return None
        body = orjson.loads(req.body) if req.body else {}
        if body.get("stream"):
            return self._stream(w, body)
        w.send_json(
            200,
            {"object": "chat.completion", "model": body.get("model"), "choices": [], "usage": USAGE},
        )
        return None

    async def _stream(self, w: Any, body: dict[str, Any]) -> None:
        w.start(200, [(b"content-type", b"text/event-stream")])
        if self.mode == "continuous_usage":
            # vLLM's continuous usage stats: every event carries the running totals
            for i in range(1, 4):
                usage = {"prompt_tokens": 5, "completion_tokens": i, "total_tokens": 5 + i}
                w.write(b'data: {"choices":[{"delta":{"content":"t"}}],"usage":%s}\r\n\r\n' % orjson.dumps(usage))
                await asyncio.sleep(0.001)
            w.write(b"data: [DONE]\r\n\r\n")
            w.end()
            return
        for i in range(3):
            w.write(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i)
            await asyncio.sleep(0.001)
        w.write(b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n")
        w.write(b"data: [DONE]\n\n")
        w.end()


def closed_port() -> int:
    """A local port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gone(name: str = "gone") -> dict[str, Any]:
    """An endpoint entry for a replica that cannot be reached: its scrapes fail, so it is stale."""
    return {"id": name, "url": f"http://127.0.0.1:{closed_port()}", "model": "m", "engine": "vllm", "pool": "gpu"}


def config_for(engines: list[Engine], more: list[dict[str, Any]] = (), **extra: Any) -> dict[str, Any]:  # type: ignore[assignment]
    return {
        "listen": "127.0.0.1:0",
        "admin": "127.0.0.1:0",
        "endpoints": [
            *({"id": e.name, "url": e.url, "model": "m", "engine": "vllm", "pool": "gpu"} for e in engines),
            *more,
        ],
        # quick first scrapes, and slack for a loaded test machine
        "scrape": {"interval": "100ms", "timeout": "90ms", "stale_after": "5s"},
        "upstream": {"first_byte_timeout": "2s", "read_timeout": "2s", "connect_timeout": "500ms"},
        **extra,
    }


def admin_of(rt: GatewayRuntime) -> AdminApp:
    assert rt.admin_server is not None
    app = rt.admin_server.app
    assert isinstance(app, AdminApp) and app is rt.admin
    return app


@contextlib.asynccontextmanager
async def running(
    engines: list[Engine],
    *,
    config: Config | None = None,
    wire: bool = True,
    more: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> AsyncIterator[GatewayRuntime]:
    """Engines plus a gateway in front of them; ``wire``: make sure the data path reports to the admin observer."""
    rt: GatewayRuntime | None = None
    try:
        for e in engines:
            await e.start()
        cfg = config if config is not None else load(config_for(engines, more or [], **extra))
        rt = GatewayRuntime(cfg, components=components_for(cfg))
        await rt.start()
        admin = admin_of(rt)
        assert rt.gateway is not None
        if wire and rt.gateway.observer is not admin.observer:
            rt.gateway.set_observer(admin.observer)
        yield rt
    finally:
        # (also when the config or the start failed: no engine is left listening)
        if rt is not None:
            await rt.stop()
            if rt.admin_server is not None:
                admin_of(rt).close()
        for e in engines:
            await e.stop()


def admin_port(rt: GatewayRuntime) -> int:
    assert rt.admin_addr is not None
    return rt.admin_addr[1]


def client_port(rt: GatewayRuntime) -> int:
    assert rt.listen_addr is not None
    return rt.listen_addr[1]


async def http(
    port: int,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection; returns (status, lower-cased headers, body)."""
    data = b"" if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(data)}\r\n"
        for k, v in (headers or {}).items():
            head += f"{k}: {v}\r\n"
        w.write(head.encode() + b"\r\n" + data)
        raw = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                k, v = line.split(":", 1)
                hdrs[k.strip().lower()] = v.strip()
        if "content-length" in hdrs:
            payload = await asyncio.wait_for(r.readexactly(int(hdrs["content-length"])), timeout)
        else:
            payload = b""
            while True:
                size = int((await asyncio.wait_for(r.readline(), timeout)).strip(), 16)
                if size == 0:
                    await r.readline()
                    break
                payload += await r.readexactly(size)
                await r.readexactly(2)
        return status, hdrs, payload
    finally:
        w.close()


async def chat(port: int, *, stream: bool = False, model: str = "m", priority: str | None = None) -> int:
    headers = {"content-type": "application/json"}
    if priority:
        headers["x-llmgw-priority"] = priority
    status, _, _ = await http(
        port, "POST", "/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}, headers,
    )
    return status


async def wait_for(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def families(text: str) -> dict[str, Any]:
    """Parsed Prometheus text: family name -> prometheus_client Metric."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(fams: dict[str, Any], name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` whose labels include ``labels`` (summed over the rest)."""
    total = None
    for fam in fams.values():
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + s.value
    return total
