"""Fixtures that run llama.cpp's real ``llama-server`` with llmgw in front.

The binary comes from :func:`llmgw.testing.llamacpp.find_llama_server`
(``$LLAMA_SERVER``, ``../shared/engines``, the cache, or a build from the PyPI
sdist). It is looked up once, after collection and outside any per-test timeout,
because a build takes minutes. If no engine can be had, every real-engine test
**fails** with a message saying how to provide one: these tests are part of the
normal run and are never skipped.

The model is a tiny random-weight llama written by
:func:`llmgw.testing.gguf_model.write_tiny_llama`; each generated token is one
visible character and generations always run to ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from canary import secret
from llmgw.config import load
from llmgw.gateway.app import GatewayRuntime
from llmgw.testing.gguf_model import write_tiny_llama
from llmgw.testing.llamacpp import EngineUnavailableError, LlamaServer, find_llama_server

# tests/real_engine/conftest.py: the repository is two levels up, ../shared next to it.
SHARED_DIR = Path(__file__).resolve().parents[2].parent / "shared"

KEY = secret("engine")
MODEL = "tiny"
# Per slot: CTX / PARALLEL tokens, room for a prompt plus the long generations below.
PARALLEL = 2
CTX = 8192
SLOT_CTX = CTX // PARALLEL
# One engine thread each: two replicas, the gateway and the client share two cores.
THREADS = 1
# A generation long enough to still be running seconds later (attention over a
# growing context makes late tokens slower): used to cut streams mid-way.
LONG_TOKENS = SLOT_CTX - 200

_ENGINE = pytest.StashKey[Any]()


def find_engine(
    *, shared: Path | None = None, cache: Path | None = None, build: bool = True, log: Any = None
) -> Path | str:
    """The ``llama-server`` to test with, or a message saying why there is none and how to provide one.

    ``shared`` defaults to ``$LLMGW_SHARED_DIR``, else ``../shared`` next to the repository.
    """
    if shared is None:
        env = os.environ.get("LLMGW_SHARED_DIR")
        shared = Path(env) if env else SHARED_DIR
    try:
        return find_llama_server(shared=shared, cache=cache, build=build, log=log)
    except EngineUnavailableError as exc:
        return f"the real-engine tests need llama.cpp's llama-server: {exc}"


def acquire_engine(**kw: Any) -> Path:
    """:func:`find_engine`, failing the calling test (never skipping it) when there is no engine."""
    found = find_engine(**kw)
    if isinstance(found, str):
        pytest.fail(found, pytrace=False)
    return found


def pytest_collection_finish(session: pytest.Session) -> None:
    # NOTE: looked up here, not in a fixture, so that a first-time build (minutes)
    # is not cut short by the per-test timeout.
    if not any(item.get_closest_marker("real_engine") for item in session.items):
        return
    # A first-time build takes minutes: its progress lines go to the terminal
    # reporter, which writes to the terminal whatever the capture mode (-s or not).
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    log = reporter.write_line if reporter is not None else _to_stderr
    session.config.stash[_ENGINE] = find_engine(log=log)


def _to_stderr(line: str) -> None:
    print(line, file=sys.__stderr__, flush=True)


@pytest.fixture(scope="session")
def llama_server_bin(pytestconfig: pytest.Config) -> Path:
    """The ``llama-server`` binary (fails the test when there is none)."""
    found = pytestconfig.stash.get(_ENGINE, None)
    if found is None:
        found = find_engine()
    if isinstance(found, str):
        pytest.fail(found, pytrace=False)
    return Path(found)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama GGUF, written once per session."""
    return write_tiny_llama(tmp_path_factory.mktemp("model") / "tiny.gguf", ctx=SLOT_CTX)


def replica(binary: Path, model: Path, **kw: Any) -> LlamaServer:
    """A replica configured like the suite's (``kw`` overrides)."""
    opts: dict[str, Any] = dict(api_key=KEY, metrics=True, parallel=PARALLEL, ctx=CTX, alias=MODEL, threads=THREADS)
    opts.update(kw)
    return LlamaServer(binary, model, **opts)


@pytest.fixture(scope="session")
def replicas(llama_server_bin: Path, tiny_model: Path) -> Iterator[list[LlamaServer]]:
    """Two replicas, ``--metrics --api-key KEY -np 2``, shared by the session (tests must not kill them)."""
    started: list[LlamaServer] = []
    try:
        for _ in range(2):
            started.append(replica(llama_server_bin, tiny_model).start())
        yield started
    finally:
        for r in started:
            r.stop()


@pytest.fixture
def make_replica(llama_server_bin: Path, tiny_model: Path) -> Iterator[Any]:
    """Start extra replicas that this test may kill or restart; all stopped afterwards."""
    made: list[LlamaServer] = []

    async def _make(**kw: Any) -> LlamaServer:
        r = replica(llama_server_bin, tiny_model, **kw)
        made.append(r)
        return await r.start_async()

    yield _make
    for r in made:
        r.stop()


def gateway_config(servers: list[LlamaServer], **extra: Any) -> dict[str, Any]:
    """A gateway config with one ``engine: llamacpp`` endpoint per server (``ls0``, ``ls1``, ...)."""
    cfg: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin": "127.0.0.1:0",
        "endpoints": [
            {"id": f"ls{i}", "url": s.url, "model": MODEL, "engine": "llamacpp", "api_key": s.api_key or ""}
            for i, s in enumerate(servers)
        ],
    }
    for ep in cfg["endpoints"]:
        if not ep["api_key"]:
            del ep["api_key"]
    cfg.update(extra)
    return cfg


@dataclass
class Fleet:
    """llmgw running in this event loop in front of some replicas."""

    rt: GatewayRuntime
    servers: list[LlamaServer]
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    @property
    def addr(self) -> tuple[str, int]:
        assert self.rt.listen_addr is not None
        return self.rt.listen_addr

    @property
    def base_url(self) -> str:
        host, port = self.addr
        return f"http://{host}:{port}/v1"

    @property
    def admin_url(self) -> str:
        assert self.rt.admin_addr is not None
        host, port = self.rt.admin_addr
        return f"http://{host}:{port}"

    def server_of(self, replica_id: str) -> LlamaServer:
        return self.servers[int(replica_id.removeprefix("ls"))]

    def client(self, **kw: Any) -> openai.AsyncOpenAI:
        """An official OpenAI client pointed at the gateway (closed with the fleet)."""
        opts: dict[str, Any] = {"base_url": self.base_url, "api_key": "client-key-unused", "max_retries": 0,
                                "timeout": 30.0}
        opts.update(kw)
        c = openai.AsyncOpenAI(**opts)
        self.clients.append(c)
        return c

    async def admin_metrics(self) -> str:
        assert self.rt.admin_addr is not None
        status, _, body = await http_request(self.rt.admin_addr, "GET", "/metrics")
        assert status == 200
        return body.decode()

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
        await self.rt.stop()


@contextlib.asynccontextmanager
async def run_fleet(servers: list[LlamaServer], **extra: Any) -> AsyncIterator[Fleet]:
    """Start llmgw in front of ``servers``; stopped on exit."""
    rt = GatewayRuntime(load(gateway_config(servers, **extra)))
    await rt.start()
    fleet = Fleet(rt, servers)
    try:
        yield fleet
    finally:
        await fleet.close()


async def wait_idle(servers: list[LlamaServer], timeout: float = 10.0) -> None:
    """Wait until no replica is processing or queueing anything (left over from an earlier test)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = []
        for s in servers:
            m = await s.metrics_async()
            if m.get("llamacpp:requests_processing") or m.get("llamacpp:requests_deferred"):
                busy.append(s.url)
        if not busy:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas still busy after {timeout}s: {busy}")
        await asyncio.sleep(0.05)


async def wait_scraped(fleet: Fleet, timeout: float = 10.0) -> None:
    """Wait until the gateway has scraped every replica once.

    The poller spreads its first scrapes over one interval (``scrape.interval``, 1 s),
    and until a replica's first scrape lands the ``score`` strategy does not count it
    as a candidate (an unscraped replica is never taken for an idle one). A burst
    sent in that window goes to whichever replica was scraped first: that is what
    made ``test_burst_spreads_over_both_replicas`` see ``{'ls1': 3, 'ls0': 13}``.
    """
    assert fleet.rt.registry is not None
    eps = fleet.rt.registry.endpoints
    deadline = time.monotonic() + timeout
    while True:
        missing = [eid for eid, ep in eps.items() if math.isnan(ep.state.scraped_at)]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the gateway has not scraped {missing} after {timeout}s")
        await asyncio.sleep(0.01)


@pytest.fixture
async def fleet(replicas: list[LlamaServer]) -> AsyncIterator[Fleet]:
    """The session's two replicas, idle, with a fresh llmgw in front that has scraped both once."""
    await wait_idle(replicas)
    async with run_fleet(replicas) as f:
        await wait_scraped(f)
        yield f


# -- a minimal HTTP/1.1 client on asyncio streams, for what the OpenAI client hides --


async def http_request(
    addr: tuple[str, int], method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection (``Connection: close``), read to EOF."""
    reader, writer = await asyncio.open_connection(*addr)
    try:
        writer.write(request_bytes(addr, method, path, body, headers))
        raw = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    status, hdrs, rest = split_head(raw)
    if hdrs.get("transfer-encoding") == "chunked":
        rest = dechunk(rest)
    return status, hdrs, rest


def request_bytes(
    addr: tuple[str, int], method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {addr[0]}:{addr[1]}", "Connection: close"]
    if body or method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def split_head(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    return status, hdrs, rest


def dechunk(data: bytes) -> bytes:
    """The payload of a chunked body; a body cut mid-way yields what arrived."""
    out = bytearray()
    while data:
        size_line, sep, data = data.partition(b"\r\n")
        if not sep:
            break
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2:]
    return bytes(out)


def sse_events(payload: bytes) -> list[bytes]:
    """The ``data:`` values of an SSE payload, in order."""
    events = []
    for block in payload.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                events.append(line[5:].strip())
    return events


def prom_samples(text: str, name: str) -> dict[str, float]:
    """``{replica: value}`` for samples of ``name`` on the admin page."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1:].rpartition("}")
            rep = next((p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("replica=")), "")
            out[rep] = float(value)
    return out
