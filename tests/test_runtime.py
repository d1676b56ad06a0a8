"""The composition root (llmgw.runtime) over real sockets, against simulated engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from llmgw.config import load
from llmgw.engines.sim import SimConfig, SimEngine
from llmgw.errors import ConfigError
from llmgw.gateway.app import GatewayRuntime as ReExported
from llmgw.http.server import ServerLimits
from llmgw.runtime import ADMIN_LIMITS, GatewayRuntime, Parts


@contextlib.asynccontextmanager
async def gateway(components: Any = (), **extra: Any) -> AsyncIterator[tuple[GatewayRuntime, SimEngine]]:
    sim = SimEngine(SimConfig(model="m", engine="vllm", slots=4, ttft_ms=1, tokens_per_second=2000, seed=1))
    await sim.start("127.0.0.1", 0)
    rt = GatewayRuntime(
        load({
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "scrape": {"interval": "100ms", "timeout": "80ms", "stale_after": "5s"},
            "endpoints": [{"id": "r0", "url": sim.url, "model": "m", "engine": "vllm"}],
            **extra,
        }),
        components,
    )
    try:
        await rt.start()
        yield rt, sim
    finally:
        await rt.stop()
        await sim.stop()


async def post(port: int, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    data = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        w.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n{extra}\r\n".encode() + data
        )
        head = (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)).decode("latin-1").split("\r\n")
        hdrs = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in head[1:] if line)}
        body = await asyncio.wait_for(r.readexactly(int(hdrs.get("content-length", "0"))), 10)
        return int(head[0].split()[1]), orjson.loads(body) if body else {}
    finally:
        w.close()


def port(rt: GatewayRuntime) -> int:
    assert rt.listen_addr is not None
    return rt.listen_addr[1]


async def test_admission_header_reaches_the_client_listener() -> None:
    async with gateway(admission={"header": "X-Prio"}) as (rt, _):
        assert rt.server is not None and rt.server.limits.priority_header == b"x-prio"
        status, body = await post(port(rt), {"x-prio": "nonsense"})
        assert status == 400 and body["error"]["code"] == "invalid_priority", body
        status, body = await post(port(rt), {"x-prio": "batch"})
        assert status == 200, body
        # the default header name means nothing now
        status, body = await post(port(rt), {"x-llmgw-priority": "nonsense"})
        assert status == 200, body


async def test_default_admission_header() -> None:
    async with gateway() as (rt, _):
        status, body = await post(port(rt), {"x-llmgw-priority": "nonsense"})
        assert status == 400 and body["error"]["code"] == "invalid_priority", body
        assert (await post(port(rt), {"x-llmgw-priority": "critical"}))[0] == 200


def test_server_limits_from_config() -> None:
    cfg = load({
        "server": {"max_body_size": "1KiB", "max_header_bytes": 2048, "max_headers": 17, "header_timeout": "3s",
                   "body_timeout": "4s", "keepalive_timeout": "5s", "max_connections": 9},
        "admission": {"header": "X-Tenant-Priority"},
    })
    lim = ServerLimits.from_config(cfg)
    assert (lim.max_body, lim.max_head_bytes, lim.max_headers) == (1024, 2048, 17)
    assert (lim.header_timeout, lim.body_timeout, lim.keepalive_timeout, lim.max_connections) == (3.0, 4.0, 5.0, 9)
    assert lim.priority_header == b"x-tenant-priority"
    assert ADMIN_LIMITS.max_body == 1024 * 1024
    # Defaults are written once: the config's defaults are the limits' defaults.
    assert ServerLimits.from_config(load({})) == ServerLimits()


def test_gateway_app_re_exports_the_runtime() -> None:
    assert ReExported is GatewayRuntime


class Recorder:
    """A plugged-in component that records what it saw."""

    def __init__(self, name: str, events: list[str], parts: Parts, fail: bool = False) -> None:
        self.name = name
        self.events = events
        self.parts = parts
        self.fail = fail

    async def start(self) -> None:
        self.events.append(f"start {self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} cannot start")

    async def stop(self) -> None:
        self.events.append(f"stop {self.name}")


async def test_components_start_after_the_parts_and_stop_before_them() -> None:
    events: list[str] = []
    seen: list[Parts] = []

    def make(name: str) -> Any:
        def factory(parts: Parts) -> Recorder:
            seen.append(parts)
            # everything built-in is up when a component is made
            assert parts.listeners.client is not None and parts.listeners.admin is not None
            assert parts.fleet.poller is not None and parts.fleet.listen_addr is not None
            return Recorder(name, events, parts)

        return factory

    async with gateway(components=[make("control-plane"), make("collector")]) as (rt, _):
        assert events == ["start control-plane", "start collector"]
        assert [c.name for c in rt.components] == ["control-plane", "collector"]
        parts = seen[0]
        assert parts.registry is rt.registry and parts.gateway is rt.gateway and parts.admin is rt.admin
        assert parts.config() is rt.config
        assert (await post(port(rt), {}))[0] == 200
    assert events == ["start control-plane", "start collector", "stop collector", "stop control-plane"]
    assert rt.components == []


async def test_a_component_that_fails_to_start_stops_the_process() -> None:
    events: list[str] = []
    with pytest.raises(RuntimeError, match="broken cannot start"):
        async with gateway(components=[
            lambda p: Recorder("ok", events, p), lambda p: Recorder("broken", events, p, fail=True),
        ]):
            raise AssertionError("not reached")
    assert events == ["start ok", "start broken", "stop broken", "stop ok"]


async def test_reload_reports_a_new_admission_header_as_needing_a_restart() -> None:
    import dataclasses

    async with gateway() as (rt, _):
        new = dataclasses.replace(rt.config, admission=dataclasses.replace(rt.config.admission, header="x-other"))
        summary = rt.reload(new, trigger="test")
        assert summary["restart_needed_for"] == ["admission.header"]
        assert rt.reloads == {"ok": 1, "failed": 0}
        # the listener keeps the header it was started with
        status, body = await post(port(rt), {"x-llmgw-priority": "nonsense"})
        assert status == 400 and body["error"]["code"] == "invalid_priority"
        with pytest.raises(ConfigError, match="not read from a file"):
            rt.reload(trigger="test")
        assert rt.reloads == {"ok": 1, "failed": 1}


async def test_a_reload_serve_would_refuse_keeps_the_fleet_and_notes_only_what_differs_from_what_runs(
    tmp_path: Any,
) -> None:
    from llmgw.config import load_file

    sim = SimEngine(SimConfig(model="m", engine="vllm", slots=4, ttft_ms=1, tokens_per_second=2000, seed=1))
    await sim.start("127.0.0.1", 0)
    path = tmp_path / "llmgw.yaml"
    good = f"listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nendpoints:\n  - {{id: r0, url: '{sim.url}', model: m}}\n"
    path.write_text(good)
    rt = GatewayRuntime(load_file(path))
    try:
        await rt.start()
        path.write_text("listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\n")  # (every endpoint gone: serve refuses it)
        with pytest.raises(ConfigError, match="no endpoints configured"):
            rt.reload(trigger="test")
        assert rt.registry is not None and list(rt.registry.endpoints) == ["r0"]
        assert (await post(port(rt), {}))[0] == 200
        # a listener moved in the file: said once; the same file again says nothing more
        path.write_text(good.replace("listen: 127.0.0.1:0", "listen: 127.0.0.1:1"))
        assert rt.reload(trigger="test")["restart_needed_for"] == ["listen"]
        assert rt.reload(trigger="test")["restart_needed_for"] == ["listen"]
        path.write_text(good)
        assert rt.reload(trigger="test")["restart_needed_for"] == []
        assert rt.reloads == {"ok": 3, "failed": 1}
    finally:
        await rt.stop()
        await sim.stop()
