"""llmgw in front of two real llama.cpp ``llama-server`` replicas.

Chat and completions through the official OpenAI client (streamed and not, usage
included), load spreading under a burst, a disconnecting client freeing its slot,
a replica killed mid-stream, and the engine's own errors. The scrape and breaker
parts are in ``test_llamacpp_scrape.py``.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import openai
import orjson
import pytest

from canary import secret
from llmgw.testing.llamacpp import LlamaServer

from .conftest import (
    KEY,
    LONG_TOKENS,
    MODEL,
    PARALLEL,
    SLOT_CTX,
    Fleet,
    dechunk,
    http_request,
    prom_samples,
    request_bytes,
    run_fleet,
    split_head,
    sse_events,
    wait_idle,
)

pytestmark = pytest.mark.real_engine

MESSAGES: Any = [{"role": "user", "content": "Say something."}]
REPLICA_IDS = {"ls0", "ls1"}


# -- chat and completions through the official client --


async def test_chat_completion(fleet: Fleet) -> None:
    client = fleet.client()
    raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=24)
    assert raw.headers["x-llmgw-replica"] in REPLICA_IDS
    resp = raw.parse()
    assert resp.object == "chat.completion"
    assert resp.model == MODEL
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 24
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 24


async def test_chat_completion_stream_with_usage(fleet: Fleet) -> None:
    client = fleet.client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=32, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    # A role-only first chunk, content chunks, one with finish_reason, then the usage chunk.
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 32
    assert last.usage.total_tokens == last.usage.prompt_tokens + 32
    assert all(c.usage is None for c in chunks[:-1])


async def test_completion(fleet: Fleet) -> None:
    client = fleet.client()
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=20)
    assert raw.headers["x-llmgw-replica"] in REPLICA_IDS
    resp = raw.parse()
    assert resp.object == "text_completion"
    assert resp.model == MODEL
    assert resp.choices[0].finish_reason == "length"
    assert resp.choices[0].text
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 20
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 20


async def test_completion_stream_with_usage(fleet: Fleet) -> None:
    client = fleet.client()
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=25, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(text) >= 20  # one visible character (or space) per token
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    # NOTE: llama-server puts the completions stream's usage on the finish chunk
    # (chat streams get a separate ``choices: []`` chunk); llmgw relays either as is.
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 25
    assert usage.total_tokens == usage.prompt_tokens + 25


async def test_stream_ends_with_done_on_the_wire(fleet: Fleet) -> None:
    body = orjson.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True})
    status, headers, payload = await http_request(fleet.addr, "POST", "/v1/chat/completions", body)
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-llmgw-replica"] in REPLICA_IDS
    events = sse_events(payload)
    assert events[-1] == b"[DONE]"
    assert b"error" not in b"".join(events)


# -- load --


async def test_burst_spreads_over_both_replicas(fleet: Fleet, replicas: list[LlamaServer]) -> None:
    """16 concurrent long streams: 8 per replica, and each engine really queues (2 slots each)."""
    client = fleet.client()
    n, tokens = 16, 600
    seen: dict[str, dict[str, float]] = {s.url: {"processing": 0.0, "deferred": 0.0} for s in replicas}
    inflight: dict[str, int] = dict.fromkeys(REPLICA_IDS, 0)
    admin_inflight: dict[str, float] = {}
    eps = fleet.rt.registry.endpoints  # type: ignore[union-attr]
    # The fixture waited for the first scrape of both: before it, score routing sees one replica only.
    assert not any(math.isnan(ep.state.scraped_at) for ep in eps.values())
    stop = asyncio.Event()

    async def watch_engine(s: LlamaServer) -> None:
        # One sampler per engine, so a slow read of one page never hides the other.
        while not stop.is_set():
            m = await s.metrics_async()
            for k in ("processing", "deferred"):
                seen[s.url][k] = max(seen[s.url][k], m.get(f"llamacpp:requests_{k}", 0.0))
            await asyncio.sleep(0.01)

    async def watch_admin() -> None:
        while not stop.is_set():
            for rep, v in prom_samples(await fleet.admin_metrics(), "llmgw_endpoint_inflight").items():
                admin_inflight[rep] = max(admin_inflight.get(rep, 0.0), v)
            await asyncio.sleep(0.02)

    async def watch_router() -> None:
        while not stop.is_set():
            for rid in REPLICA_IDS:
                inflight[rid] = max(inflight[rid], eps[rid].inflight)
            await asyncio.sleep(0.005)

    async def one() -> tuple[str, int]:
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt="tell a long story", max_tokens=tokens, stream=True,
            stream_options={"include_usage": True},
        )
        stream = raw.parse()
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return raw.headers["x-llmgw-replica"], usage.completion_tokens

    watchers = [
        *(asyncio.create_task(watch_engine(s)) for s in replicas),
        asyncio.create_task(watch_admin()),
        asyncio.create_task(watch_router()),
    ]
    try:
        results = await asyncio.gather(*(one() for _ in range(n)))
    finally:
        stop.set()
        await asyncio.gather(*watchers)
    per_replica = {rid: sum(1 for r, _ in results if r == rid) for rid in REPLICA_IDS}
    assert all(t == tokens for _, t in results)
    # Both replicas take a fair share (the scorer weighs measured latency, so not exactly half).
    assert min(per_replica.values()) >= n // 4, per_replica
    # Each engine ran its 2 slots and queued the rest: the queue is real, not the router's.
    for s in replicas:
        assert seen[s.url]["processing"] == PARALLEL, seen
        assert seen[s.url]["deferred"] >= 1, seen
    # The router's own view: more in flight to each replica than it has slots, and
    # the admin page exports it.
    assert min(inflight.values()) > PARALLEL, inflight
    assert set(admin_inflight) == REPLICA_IDS and max(admin_inflight.values()) >= 1, admin_inflight
    assert all(ep.inflight == 0 for ep in eps.values())


# -- a client that goes away --


async def _open_stream(addr: tuple[str, int], body: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict[str, str], bytes]:
    """Start a streamed request on a raw connection; return after the head and the first events."""
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(request_bytes(addr, "POST", "/v1/chat/completions", orjson.dumps(body)))
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, f"connection closed before a response head: {buf!r}"
        buf += data
    status, headers, rest = split_head(buf)
    assert status == 200, buf
    while rest.count(b"data:") < 3:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, rest
        rest += data
    return reader, writer, headers, rest


async def test_client_disconnect_frees_the_slot(fleet: Fleet) -> None:
    rt = fleet.rt
    assert rt.registry is not None
    idle = {s.url: (await s.metrics_async())["llamacpp:requests_processing"] for s in fleet.servers}
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LONG_TOKENS, "stream": True}
    _, writer, headers, _ = await _open_stream(fleet.addr, body)
    server = fleet.server_of(headers["x-llmgw-replica"])
    before = await server.metrics_async()
    assert before["llamacpp:requests_processing"] == idle[server.url] + 1
    # Hang up mid-stream, then watch the engine's own slot count return to its earlier value.
    writer.transport.abort()
    t0 = time.monotonic()
    while True:
        now = await server.metrics_async()
        if now["llamacpp:requests_processing"] == idle[server.url]:
            break
        assert time.monotonic() - t0 < 1.0, "the engine still generates for a client that left"
        await asyncio.sleep(0.02)
    # It was cut short, not finished: a finished generation takes seconds.
    assert now["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < LONG_TOKENS / 2
    ep = rt.registry.endpoints[headers["x-llmgw-replica"]]
    for _ in range(50):
        if ep.inflight == 0:
            break
        await asyncio.sleep(0.01)
    assert ep.inflight == 0


async def test_client_disconnect_through_the_openai_client(fleet: Fleet) -> None:
    """Closing an OpenAI client stream early frees the slot as well."""
    client = fleet.client()
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=LONG_TOKENS, stream=True
    )
    server = fleet.server_of(raw.headers["x-llmgw-replica"])
    stream = raw.parse()
    got = 0
    async for _chunk in stream:
        got += 1
        if got == 5:
            break
    assert (await server.metrics_async())["llamacpp:requests_processing"] == 1
    await stream.close()
    t0 = time.monotonic()
    while (await server.metrics_async())["llamacpp:requests_processing"] != 0:
        assert time.monotonic() - t0 < 1.0, "the slot was not freed after the client closed its stream"
        await asyncio.sleep(0.02)


# -- a replica that dies --


async def test_replica_killed_mid_stream(make_replica: Any) -> None:
    servers = [await make_replica(), await make_replica()]
    async with run_fleet(servers) as fleet:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": LONG_TOKENS, "stream": True}
        reader, writer, headers, rest = await _open_stream(fleet.addr, body)
        victim_id = headers["x-llmgw-replica"]
        survivor_id = ({"ls0", "ls1"} - {victim_id}).pop()
        fleet.server_of(victim_id).kill()
        try:
            rest += await asyncio.wait_for(reader.read(-1), 10)  # the gateway closes the connection
        finally:
            writer.close()
        events = sse_events(dechunk(rest) if headers.get("transfer-encoding") == "chunked" else rest)
        last = orjson.loads(events[-1])
        assert "error" in last, events[-3:]
        assert isinstance(last["error"]["message"], str) and isinstance(last["error"]["code"], str)
        # Nothing invented: no [DONE], no finish_reason.
        assert b"[DONE]" not in events
        assert all(b'"finish_reason":"' not in e for e in events)

        client = fleet.client()
        for _ in range(4):
            raw = await client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
            assert raw.headers["x-llmgw-replica"] == survivor_id
            assert raw.parse().usage.completion_tokens == 4  # type: ignore[union-attr]


async def test_replica_killed_mid_stream_openai_client(make_replica: Any) -> None:
    """The official client sees the cut as an error, never as a normal end."""
    servers = [await make_replica(), await make_replica()]
    async with run_fleet(servers) as fleet:
        client = fleet.client(timeout=10.0)
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=LONG_TOKENS, stream=True
        )
        stream = raw.parse()
        got = 0
        t0 = time.monotonic()
        with pytest.raises(openai.APIError) as info:
            async for _chunk in stream:
                got += 1
                if got == 3:
                    fleet.server_of(raw.headers["x-llmgw-replica"]).kill()
        assert not isinstance(info.value, openai.APITimeoutError), (
            f"the client waited {time.monotonic() - t0:.1f}s after {got} chunks: the cut never reached it"
        )
        assert "interrupted" in str(info.value.message)


# -- the engine's own errors --


async def test_engine_401_is_the_gateways_problem(replicas: list[LlamaServer]) -> None:
    """A wrong engine key: llama-server answers 401; the client gets 502 ``upstream_auth_failed``
    (its own key was fine), OpenAI-shaped, with no key in it."""
    await wait_idle(replicas)
    status, _, raw_body = await http_request(
        (replicas[0].host, replicas[0].port), "POST", "/v1/chat/completions",
        orjson.dumps({"model": MODEL, "messages": MESSAGES}), {"Authorization": "Bearer wrong"},
    )
    assert status == 401 and isinstance(orjson.loads(raw_body)["error"]["code"], int)

    cfg_servers = [LlamaServer(r.binary, r.model, port=r.port, api_key=secret("wrong")) for r in replicas[:1]]
    async with run_fleet(cfg_servers) as fleet:
        body = orjson.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
        status, headers, payload = await http_request(fleet.addr, "POST", "/v1/chat/completions", body)
        assert status == 502
        assert headers["content-type"].startswith("application/json")
        err = orjson.loads(payload)["error"]
        assert set(err) >= {"message", "type", "param", "code"}
        assert err["code"] == "upstream_auth_failed"
        assert KEY not in payload.decode() and secret("wrong") not in payload.decode()

        client = fleet.client()
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert info.value.status_code == 502
        assert isinstance(info.value.body, dict) and info.value.body["code"] == "upstream_auth_failed"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_engine_400_prompt_too_long(fleet: Fleet, stream: bool) -> None:
    """A prompt longer than a slot's context: llama-server's 400 reaches the client with a string code."""
    prompt = "a" * (SLOT_CTX + 500)  # one token per character
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
    status, headers, payload = await http_request(fleet.addr, "POST", "/v1/completions", orjson.dumps(body))
    assert status == 400, payload[:500]
    assert headers["x-llmgw-replica"] in REPLICA_IDS
    err = orjson.loads(payload)["error"]
    assert err["code"] == "context_length_exceeded"
    assert isinstance(err["type"], str) and isinstance(err["message"], str)
    assert err["n_ctx"] == SLOT_CTX and err["n_prompt_tokens"] > SLOT_CTX
    assert err["param"] is None or isinstance(err["param"], str)

    client = fleet.client()
    with pytest.raises(openai.BadRequestError) as info:
        if stream:
            s = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
            async for _ in s:
                pass
        else:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert info.value.status_code == 400
    assert isinstance(info.value.body, dict) and isinstance(info.value.body["code"], str)
