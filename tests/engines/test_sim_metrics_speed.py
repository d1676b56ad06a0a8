"""The simulated engines' fast ``/metrics`` text equals what ``prometheus_client`` renders.

vLLM, SGLang and TensorRT-LLM write text format 0.0.4 from precomputed templates
(``llmgw.engines.sim.promtext``); ``Dialect.registry_page`` is the old renderer (a
``prometheus_client`` registry over ``Dialect.families``), kept as the reference and for
OpenMetrics. After traffic of every kind, with requests running and waiting, after aborts
and with numbers past a million, both must agree line for line. Series of the process
(CPU, memory, GC) move between two renders, so only their values are masked.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from llmgw.engines.sim import SimConfig, SimEngine, promtext
from llmgw.engines.sim.dialects import Dialect

ENGINES = ("vllm", "sglang", "trtllm")


@pytest.fixture(autouse=True)
def _no_process_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compare against the collectors without the 50 ms process-block cache."""
    monkeypatch.setattr(promtext, "_PROCESS_TTL", 0.0)
# Percent and braces must pass through the templates untouched (the config refuses quotes,
# backslashes and newlines, which label values would escape).
MODEL = "org/m-%d{x}:1"
PLAIN = b"text/plain;version=0.0.4"
# Process series whose values move between two renders.
MOVING = ("process_cpu_seconds_total", "process_virtual_memory_bytes", "process_resident_memory_bytes",
          "python_gc_")


def _path(engine: str) -> str:
    return "/prometheus/metrics" if engine == "trtllm" else "/metrics"


def _mask(text: str, moving: tuple[str, ...] = MOVING) -> list[str]:
    out = []
    for line in text.split("\n"):
        if not line.startswith("#") and line.startswith(moving):
            line = line.rpartition(" ")[0] + " <value>"
        out.append(line)
    return out


def _compare(d: Dialect) -> str:
    gc.disable()  # no collection between the two renders
    try:
        fast = d.fast_text()
        ref = d.registry_page(PLAIN)[0].decode()
    finally:
        gc.enable()
    assert fast is not None
    assert _mask(fast) == _mask(ref)
    families = list(text_string_to_metric_families(fast))
    assert families
    return fast


async def _send(port: int, path: str, body: Any, close: bool = True) -> tuple[asyncio.StreamReader,
                                                                               asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = orjson.dumps(body)
    writer.write(f"POST {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(data)}\r\n{'connection: close' if close else 'x: y'}\r\n\r\n".encode() + data)
    return reader, writer


async def _call(port: int, path: str, body: Any) -> bytes:
    reader, writer = await _send(port, path, body)
    try:
        data = await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()
    assert data.startswith(b"HTTP/1.1 200"), data[:300]
    return data


async def _get(port: int, path: str, accept: bytes = PLAIN) -> tuple[str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET %s HTTP/1.1\r\nhost: sim\r\naccept: %s\r\nconnection: close\r\n\r\n" % (path.encode(), accept))
        data = await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    ctype = next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-type"))
    return ctype.split(b":", 1)[1].strip().decode(), body


def _chat(max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello there, engine! " * (1 + max_tokens % 5)}],
            "max_tokens": max_tokens, "stream": stream, **extra}


async def _wait(cond: Any, timeout: float = 3.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
async def engines() -> AsyncIterator[list[SimEngine]]:
    made: list[SimEngine] = []
    yield made
    for e in made:
        await e.stop(timeout=1.0)


@pytest.mark.parametrize("engine", ENGINES)
async def test_fast_text_equals_prometheus_client(engines: list[SimEngine], engine: str) -> None:
    eng = SimEngine(SimConfig(model=MODEL, engine=engine, slots=2, ttft_ms=0.0, tokens_per_second=1e5))
    engines.append(eng)
    _, p = await eng.start("127.0.0.1", 0)
    d = eng.app.dialect
    st = eng.app.stats
    _compare(d)  # no traffic yet: empty histograms

    # Completions (whole and streamed, several choices, a stop string), all finished.
    for i in range(6):
        await _call(p, "/v1/chat/completions", _chat(1 + 3 * i))
    await _call(p, "/v1/chat/completions", _chat(12, stream=True, stream_options={"include_usage": True}))
    await _call(p, "/v1/completions", {"model": MODEL, "prompt": ["a b c", "d e"], "max_tokens": 5, "n": 2})
    await _call(p, "/v1/chat/completions", _chat(40, stop=["the"]))
    await _wait(lambda: eng.state.running == 0)
    _compare(d)

    # A stream cut by its client: an abort.
    eng.set_speed(tokens_per_second=100.0)
    reader, writer = await _send(p, "/v1/chat/completions", _chat(1000, stream=True), close=False)
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += await asyncio.wait_for(reader.read(65536), 3.0)
    writer.close()
    await _wait(lambda: eng.state.finished["abort"] == 1)

    # Two running (no token yet, so the page holds still) and one waiting.
    eng.set_speed(ttft_ms=60_000.0)
    held = [await _send(p, "/v1/chat/completions", _chat(8 + i), close=False) for i in range(3)]
    await _wait(lambda: eng.state.running == 2 and eng.state.waiting == 1)
    text = _compare(d)
    ctype, body = await _get(p, _path(engine))
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    # (the scrape's own socket is one more open fd)
    assert _mask(body.decode(), (*MOVING, "process_open_fds")) == _mask(text, (*MOVING, "process_open_fds"))
    assert st.hist["ttft"].count > 0 and st.hist["e2e"].count > 0
    for _, w in held:
        w.close()
    await _wait(lambda: eng.state.running == 0 and eng.state.waiting == 0)
    assert eng.state.finished["abort"] == 4
    _compare(d)

    # Past a million: Go's exponent form for counters and bucket counts.
    st.prompt_tokens += 123_456_789
    st.generation_tokens += 10**12
    for h in st.hist.values():
        h.observe(h.bounds[len(h.bounds) // 2], 1_234_567)
        h.observe(h.bounds[-1] * 10, 3)
    text = _compare(d)
    assert "e+06" in text and "e+08" in text


async def test_openmetrics_stays_on_prometheus_client(engines: list[SimEngine]) -> None:
    eng = SimEngine(SimConfig(model="m", engine="vllm", ttft_ms=0.0, tokens_per_second=1e5))
    engines.append(eng)
    _, p = await eng.start("127.0.0.1", 0)
    ctype, body = await _get(p, "/metrics", b"application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    ctype, body = await _get(p, "/metrics", b"*/*")
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    assert b"vllm:num_requests_running" in body


def test_fgo_matches_float_to_go_string() -> None:
    rnd = random.Random(7)
    ints = [0, 1, 999_999, 1_000_000, 1_000_001, 140_075_008, 2**53 - 1, 2**53, 2**60, -1, -10**7]
    ints += [rnd.randrange(10 ** rnd.randrange(1, 17)) for _ in range(2000)]
    floats = [0.0, -0.0, 1e-5, 0.1, 1.7959832204811018e9, 1e6, 999_999.99, 1e16, 1e22, float("inf"),
              float("-inf"), float("nan"), -1e7, 5e-324]
    floats += [rnd.random() * 10 ** rnd.randrange(-8, 18) for _ in range(2000)]
    for v in [*ints, *floats]:
        assert promtext.fgo(v) == floatToGoString(v), v


def test_process_text_matches_collectors() -> None:
    from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
    from prometheus_client.exposition import generate_latest

    if not promtext.process_text_available():
        pytest.skip("no /proc here")
    reg = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    gc.disable()
    try:
        fast = promtext.process_text()
        ref = generate_latest(reg).decode()
    finally:
        gc.enable()
    assert _mask(fast) == _mask(ref)
    # The fd kept open on /proc/self/stat belongs to this process.
    assert promtext._get_proc().pid == os.getpid()
