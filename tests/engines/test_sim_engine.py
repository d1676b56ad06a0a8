"""The simulated engine on real sockets: API, streaming, scheduler, metrics, auth, faults."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from canary import secret
from llmgw import engines
from llmgw.engines import llamacpp, sglang, trtllm, vllm
from llmgw.engines.sim import SimConfig, SimEngine, SimFaults
from llmgw.errors import ConfigError

ENGINES = ("vllm", "llamacpp", "trtllm", "sglang")
CHAT = "/v1/chat/completions"


# -- a minimal HTTP/1.1 client -------------------------------------------------


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    def events(self) -> list[bytes]:
        """The ``data:`` payloads of an SSE body, in order."""
        assert self.body.endswith(b"\n\n"), self.body[-80:]
        out = []
        for block in self.body.split(b"\n\n")[:-1]:
            assert block.startswith(b"data: "), block
            out.append(block[6:])
        return out


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        line, _, rest = data.partition(b"\r\n")
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        data = rest[size + 2 :]


def parse_response(data: bytes) -> Resp:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    else:
        assert len(body) == int(headers["content-length"])
    return Resp(status, headers, body)


def build_request(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                  close: bool = True) -> bytes:
    data = b"" if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"host": "sim", "content-length": str(len(data)), **({"connection": "close"} if close else {}),
            **(headers or {})}
    if body is not None and not isinstance(body, bytes):
        hdrs["content-type"] = "application/json"
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items()) + "\r\n"
    return head.encode() + data


async def request(port: int, method: str, path: str, body: Any = None,
                  headers: dict[str, str] | None = None) -> Resp:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(build_request(method, path, body, headers))
        data = await reader.read()
    finally:
        writer.close()
    return parse_response(data)


def chat_body(max_tokens: int = 8, stream: bool = False, content: str = "Hello there, engine!",
              **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": stream, **extra}


# -- metrics helpers --


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.append((s.name, s.labels, s.value))
    return out


def value(text: str, name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples(text) if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


# -- fixtures --


@pytest.fixture
async def make_engine() -> AsyncIterator[Callable[..., Awaitable[SimEngine]]]:
    engines: list[SimEngine] = []

    async def make(**kw: Any) -> SimEngine:
        kw.setdefault("model", "m")
        eng = SimEngine(SimConfig(**kw))
        await eng.start("127.0.0.1", 0)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        await eng.stop(timeout=1.0)


def port(eng: SimEngine) -> int:
    assert eng.address is not None
    return eng.address[1]


async def wait_for(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


FAST = {"ttft_ms": 0.0, "tokens_per_second": 1e9}


# -- OpenAI API --------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
async def test_chat_whole_answer(make_engine, engine: str) -> None:
    eng = await make_engine(engine=engine, **FAST)
    r = await request(port(eng), "POST", CHAT, chat_body(max_tokens=7))
    assert r.status == 200, r.body
    assert r.headers["content-type"] == "application/json"
    obj = r.json()
    assert obj["object"] == "chat.completion"
    assert obj["model"] == "m"
    (choice,) = obj["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split(" ")) == 7
    # "Hello there, engine!" is 20 characters: 5 tokens at ~4 characters each.
    assert obj["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert eng.state.completed == 1
    assert eng.state.running == 0


async def test_max_completion_tokens_and_defaults(make_engine) -> None:
    eng = await make_engine(**FAST)
    p = port(eng)
    body = chat_body()
    del body["max_tokens"]
    assert (await request(p, "POST", CHAT, body)).json()["usage"]["completion_tokens"] == 64
    body["max_completion_tokens"] = 3
    body["max_tokens"] = 9  # max_completion_tokens wins
    assert (await request(p, "POST", CHAT, body)).json()["usage"]["completion_tokens"] == 3
    r = await request(p, "POST", "/v1/completions", {"model": "m", "prompt": "abcdefgh"})
    obj = r.json()
    assert obj["object"] == "text_completion"
    assert obj["usage"] == {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}
    assert isinstance(obj["choices"][0]["text"], str)
    # token ids, a batch of prompts, n
    r = await request(p, "POST", "/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 2, "n": 2})
    obj = r.json()
    assert [c["index"] for c in obj["choices"]] == [0, 1, 2, 3]
    assert obj["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}


async def test_stop_string_ends_early(make_engine) -> None:
    eng = await make_engine(**FAST)
    p = port(eng)
    text = (await request(p, "POST", CHAT, chat_body(max_tokens=200))).json()["choices"][0]["message"]["content"]
    words = text.split(" ")
    stop = words[5]
    assert stop not in words[:5]
    obj = (await request(p, "POST", CHAT, chat_body(max_tokens=200, stop=[stop]))).json()
    assert obj["choices"][0]["finish_reason"] == "stop"
    assert obj["choices"][0]["stop_reason"] == stop
    assert obj["choices"][0]["message"]["content"] == " ".join(words[:5])
    assert obj["usage"]["completion_tokens"] == 5


async def test_same_seed_same_text(make_engine) -> None:
    a = await make_engine(seed=7, **FAST)
    b = await make_engine(seed=7, **FAST)
    c = await make_engine(seed=8, **FAST)
    texts = [
        (await request(port(e), "POST", CHAT, chat_body(max_tokens=30))).json()["choices"][0]["message"]["content"]
        for e in (a, b, c)
    ]
    assert texts[0] == texts[1] != texts[2]
    other = (await request(port(a), "POST", CHAT, chat_body(max_tokens=30, content="different")))
    assert other.json()["choices"][0]["message"]["content"] != texts[0]


@pytest.mark.parametrize("engine", ENGINES)
async def test_stream_framing_with_usage(make_engine, engine: str) -> None:
    eng = await make_engine(engine=engine, ttft_ms=5.0, tokens_per_second=2000.0)
    p = port(eng)
    whole = (await request(p, "POST", CHAT, chat_body(max_tokens=6))).json()["choices"][0]["message"]["content"]
    r = await request(p, "POST", CHAT, chat_body(max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["transfer-encoding"] == "chunked"
    events = r.events()
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant" and not first["delta"].get("content")
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert all(c["usage"] is None for c in chunks[:-1])
    body = chunks[1:-1]
    finishing = [c for c in body if c["choices"][0]["finish_reason"] is not None]
    assert len(finishing) == 1 and finishing[0] is body[-1]
    assert finishing[0]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in body)
    assert text == whole
    tokens = [c for c in body if c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 6
    # vLLM puts the finish reason on the last token's event; the others send a separate one.
    assert len(body) == (6 if engine == "vllm" else 7)


async def test_stream_without_usage_and_completions(make_engine) -> None:
    eng = await make_engine(**FAST)
    p = port(eng)
    r = await request(p, "POST", CHAT, chat_body(max_tokens=4, stream=True))
    events = r.events()
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert len(chunks) == 1 + 4
    r = await request(p, "POST", "/v1/completions",
                      {"prompt": "hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [orjson.loads(e) for e in r.events()[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_trtllm_include_usage_defaults_on_with_stream_options(make_engine) -> None:
    eng = await make_engine(engine="trtllm", **FAST)
    r = await request(port(eng), "POST", CHAT, chat_body(max_tokens=2, stream=True, stream_options={}))
    last = orjson.loads(r.events()[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("engine", ENGINES)
async def test_models_card(make_engine, engine: str) -> None:
    eng = await make_engine(engine=engine, max_model_len=2048)
    obj = (await request(port(eng), "GET", "/v1/models")).json()
    assert obj["object"] == "list"
    (card,) = obj["data"]
    assert card["id"] == "m" and card["object"] == "model"
    assert card["owned_by"] == {"vllm": "vllm", "llamacpp": "llamacpp", "trtllm": "tensorrt_llm",
                                "sglang": "sglang"}[engine]
    if engine == "vllm":
        assert card["max_model_len"] == 2048 and card["root"] == "m"
    if engine == "llamacpp":
        assert card["meta"]["n_ctx_train"] == 2048
        assert obj["models"][0]["name"] == "m"


async def test_embeddings_float_and_base64(make_engine) -> None:
    eng = await make_engine(embedding_dim=64)
    p = port(eng)
    f = (await request(p, "POST", "/v1/embeddings", {"model": "m", "input": ["a cat", "a dog"]})).json()
    assert f["object"] == "list"
    assert [d["index"] for d in f["data"]] == [0, 1]
    assert f["usage"]["prompt_tokens"] == 4
    v0 = f["data"][0]["embedding"]
    assert len(v0) == 64
    assert math.isclose(math.sqrt(sum(x * x for x in v0)), 1.0, rel_tol=1e-5)
    assert v0 != f["data"][1]["embedding"]
    b = (await request(p, "POST", "/v1/embeddings",
                       {"input": "a cat", "encoding_format": "base64"})).json()
    raw = base64.b64decode(b["data"][0]["embedding"])
    assert list(struct.unpack("<64f", raw)) == v0
    again = (await request(p, "POST", "/v1/embeddings", {"input": "a cat", "dimensions": 8})).json()
    assert len(again["data"][0]["embedding"]) == 8
    ids = (await request(p, "POST", "/v1/embeddings", {"input": [1, 2, 3]})).json()
    assert ids["usage"]["prompt_tokens"] == 3
    bad = await request(p, "POST", "/v1/embeddings", {"input": 5})
    assert bad.status == 400


# -- errors ------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
async def test_error_bodies(make_engine, engine: str) -> None:
    eng = await make_engine(engine=engine, max_model_len=64, **FAST)
    p = port(eng)
    bad_json = await request(p, "POST", CHAT, b"{not json")
    missing = await request(p, "POST", CHAT, {"model": "m"})
    too_long = await request(p, "POST", CHAT, chat_body(max_tokens=8, content="x" * 400))
    for r in (bad_json, missing, too_long):
        assert r.status == 400, r.body
    body = too_long.json()
    if engine == "vllm":
        assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
        assert "maximum context length is 64 tokens" in body["error"]["message"]
        nf = await request(p, "POST", CHAT, {**chat_body(), "model": "nope"})
        assert nf.status == 404
        assert nf.json()["error"]["code"] == 404 and "`nope`" in nf.json()["error"]["message"]
    elif engine == "llamacpp":
        assert body == {"error": {"code": 400, "message": body["error"]["message"],
                                  "type": "exceed_context_size_error", "n_prompt_tokens": 100, "n_ctx": 64}}
        assert missing.json()["error"]["type"] == "invalid_request_error"
        other = await request(p, "POST", CHAT, {**chat_body(max_tokens=2), "model": "anything"})
        assert other.status == 200 and other.json()["model"] == "anything"
        # only the prompt must fit: the output stops at the context's end
        near = await request(p, "POST", CHAT, chat_body(max_tokens=50, content="x" * 200))
        assert near.json()["usage"]["completion_tokens"] == 14
    elif engine == "trtllm":
        assert body["object"] == "error" and body["code"] == 400
        assert set(missing.json()) == {"error"} and isinstance(missing.json()["error"], str)
    else:
        assert body["object"] == "error" and body["code"] == 400 and body["type"] == "BadRequestError"
    nf = await request(p, "GET", "/nope")
    assert nf.status == 404


# -- scheduler and metrics ----------------------------------------------------


def _expected(engine: str) -> tuple[str, str, str | None, str, dict[str, str]]:
    """(metrics path, waiting name, kv name, running name, labels) of each dialect."""
    if engine == "vllm":
        return "/metrics", vllm.WAITING, vllm.KV_CACHE_USAGE, vllm.RUNNING, {"model_name": "m", "engine": "0"}
    if engine == "llamacpp":
        return "/metrics", llamacpp.WAITING, None, llamacpp.RUNNING, {}
    if engine == "trtllm":
        return ("/prometheus/metrics", trtllm.WAITING, trtllm.KV_CACHE_USAGE, trtllm.RUNNING,
                {"model_name": "undefined", "engine_type": "undefined"})
    return ("/metrics", sglang.WAITING, sglang.KV_CACHE_USAGE, sglang.RUNNING,
            {"model_name": "m", "tp_rank": "0"})


@pytest.mark.parametrize("engine", ENGINES)
async def test_gauges_track_a_burst(make_engine, engine: str) -> None:
    eng = await make_engine(engine=engine, slots=2, ttft_ms=30_000, kv_tokens=8192)
    p = port(eng)
    tasks = [asyncio.create_task(request(p, "POST", CHAT, chat_body(max_tokens=100))) for _ in range(5)]
    try:
        await wait_for(lambda: eng.state.running == 2 and eng.state.waiting == 3)
        path, waiting, kv, running, labels = _expected(engine)
        r = await request(p, "GET", path)
        assert r.status == 200
        text = r.body.decode()
        assert value(text, running, **labels) == 2
        assert value(text, waiting, **labels) == 3
        if kv is None:
            assert "kv_cache" not in text
        else:
            # two running requests, 5 prompt tokens each, nothing generated yet
            assert value(text, kv, **labels) == pytest.approx(10 / 8192)
            assert eng.state.kv_usage == pytest.approx(10 / 8192)
        if engine == "trtllm":
            js = (await request(p, "GET", "/metrics")).json()
            assert js[0]["numActiveRequests"] == 2 and js[0]["numQueuedRequests"] == 3
            assert (await request(p, "GET", "/metrics")).json() == []  # read once, gone
        if engine == "llamacpp":
            slots = (await request(p, "GET", "/slots")).json()
            assert [s["is_processing"] for s in slots] == [True, True]
            assert (await request(p, "GET", "/slots?fail_on_no_slot=1")).status == 503
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await wait_for(lambda: eng.state.running == 0 and eng.state.waiting == 0)
    assert eng.state.finished["abort"] == 5


@pytest.mark.parametrize("engine", ENGINES)
async def test_counters_after_completion(make_engine, engine: str) -> None:
    eng = await make_engine(engine=engine, ttft_ms=0.0, tokens_per_second=1e9)
    p = port(eng)
    for _ in range(3):
        assert (await request(p, "POST", CHAT, chat_body(max_tokens=5))).status == 200
    path = _expected(engine)[0]
    text = (await request(p, "GET", path)).body.decode()
    if engine == "vllm":
        L = {"model_name": "m", "engine": "0"}
        assert value(text, "vllm:request_success_total", finished_reason="length", **L) == 3
        assert value(text, "vllm:request_success_total", finished_reason="stop", **L) == 0
        assert value(text, "vllm:prompt_tokens_total", **L) == 15
        assert value(text, "vllm:generation_tokens_total", **L) == 15
        assert value(text, vllm.TTFT + "_count", **L) == 3
        assert value(text, vllm.TTFT + "_bucket", le="0.001", **L) == 3  # admitted at once, ttft 0
        assert value(text, vllm.E2E + "_bucket", le="0.3", **L) == 3
        assert value(text, vllm.E2E + "_count", **L) == 3
        assert value(text, vllm.GENERATION_TOKENS_HIST + "_sum", **L) == 15
        assert value(text, vllm.ITL + "_count", **L) == 12
        assert value(text, "vllm:prompt_tokens_created", **L) > 1e9
        assert "# TYPE vllm:prompt_tokens_total counter" in text
        assert "python_gc_objects_collected_total" in text
    elif engine == "llamacpp":
        assert value(text, llamacpp.PROMPT_TOKENS_TOTAL) == 15
        assert value(text, llamacpp.TOKENS_PREDICTED_TOTAL) == 15
        assert value(text, llamacpp.RUNNING) == 0
        assert "_created" not in text
    elif engine == "trtllm":
        L = {"model_name": "undefined", "engine_type": "undefined"}
        assert value(text, trtllm.REQUEST_SUCCESS + "_total", finished_reason="length", **L) == 3
        assert value(text, trtllm.GENERATION_TOKENS + "_total", **L) == 15
        assert value(text, trtllm.TTFT + "_count", **L) == 3
    else:
        L = {"model_name": "m", "engine_type": "unified"}
        assert value(text, sglang.NUM_REQUESTS + "_total", **L) == 3
        assert value(text, sglang.GENERATION_TOKENS + "_total", **L) == 15
        assert value(text, sglang.PROMPT_TOKENS + "_total", **L) == 15
        assert value(text, sglang.TTFT + "_count", **L) == 3
        assert "_created" not in text  # multiprocess mode


async def test_openmetrics_negotiation(make_engine) -> None:
    eng = await make_engine()
    r = await request(port(eng), "GET", "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.body.endswith(b"# EOF\n")


async def test_queue_overflow(make_engine) -> None:
    eng = await make_engine(slots=1, max_queue=1, ttft_ms=30_000)
    p = port(eng)
    tasks = [asyncio.create_task(request(p, "POST", CHAT, chat_body())) for _ in range(2)]
    try:
        await wait_for(lambda: eng.state.running == 1 and eng.state.waiting == 1)
        r = await request(p, "POST", CHAT, chat_body())
        assert r.status == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert eng.state.rejected == 1
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_queue_overflow_429_llamacpp(make_engine) -> None:
    eng = await make_engine(engine="llamacpp", slots=1, max_queue=0, queue_full_status=429, ttft_ms=30_000)
    p = port(eng)
    task = asyncio.create_task(request(p, "POST", CHAT, chat_body()))
    try:
        await wait_for(lambda: eng.state.running == 1)
        r = await request(p, "POST", CHAT, chat_body())
        assert r.status == 429
        assert r.json()["error"]["code"] == 429
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_queued_requests_run_in_order(make_engine) -> None:
    # T long enough that all three arrive while the first is served, however loaded the machine: the
    # waits are then 0, T - a2 and 2T - a3 (a2, a3: how much later the others arrived), whose sum is at
    # least T for any arrivals within T. (With 20 ms, a loaded machine spread the arrivals enough to
    # make the old bound of 55 ms fail.)
    T = 0.2
    eng = await make_engine(slots=1, ttft_ms=T * 1000, tokens_per_second=1e9)
    p = port(eng)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    done: list[float] = []

    async def one() -> None:
        r = await request(p, "POST", CHAT, chat_body(max_tokens=1))
        assert r.status == 200
        done.append(loop.time() - t0)

    await asyncio.gather(*(one() for _ in range(3)))
    assert done[-1] >= 3 * T - 0.005  # three requests of T, one at a time (5 ms: the clocks' rounding)
    assert eng.state.completed == 3
    text = (await request(p, "GET", "/metrics")).body.decode()
    L = {"model_name": "m", "engine": "0"}
    assert value(text, vllm.QUEUE_TIME + "_sum", **L) >= T


async def test_disconnect_frees_the_slot(make_engine) -> None:
    eng = await make_engine(slots=1, ttft_ms=0.0, tokens_per_second=50.0)
    p = port(eng)
    reader, writer = await asyncio.open_connection("127.0.0.1", p)
    try:
        writer.write(build_request("POST", CHAT, chat_body(max_tokens=1000, stream=True), close=False))
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += await asyncio.wait_for(reader.read(65536), 2.0)
        assert eng.state.running == 1
        # a second request waits behind the first
        queued = asyncio.create_task(request(p, "POST", CHAT, chat_body(max_tokens=1)))
        await wait_for(lambda: eng.state.waiting == 1)
    finally:
        writer.close()
    await wait_for(lambda: eng.state.finished["abort"] == 1, timeout=0.5)
    r = await asyncio.wait_for(queued, 2.0)
    assert r.status == 200
    assert eng.state.running == 0


async def test_stream_respects_flow_control(make_engine) -> None:
    eng = await make_engine(**FAST)
    p = port(eng)
    reader, writer = await asyncio.open_connection("127.0.0.1", p, limit=1024)
    try:
        writer.transport.pause_reading()  # type: ignore[attr-defined]
        writer.write(build_request("POST", "/v1/completions",
                                   {"prompt": "x", "max_tokens": 4000, "stream": True}))
        await asyncio.sleep(0.2)
        writer.transport.resume_reading()  # type: ignore[attr-defined]
        data = await asyncio.wait_for(reader.read(), 5.0)
    finally:
        writer.close()
    r = parse_response(data)
    assert r.events()[-1] == b"[DONE]"
    assert len(r.events()) == 4001


# -- auth -----------------------------------------------------------------------


async def test_vllm_checks_only_v1(make_engine) -> None:
    eng = await make_engine(engine="vllm", api_key=secret("sekrit"), **FAST)
    p = port(eng)
    assert (await request(p, "GET", "/metrics")).status == 200
    assert (await request(p, "GET", "/health")).status == 200
    r = await request(p, "GET", "/v1/models")
    assert r.status == 401 and r.json() == {"error": "Unauthorized"}
    assert (await request(p, "GET", "/v1/models", headers={"x-api-key": secret("sekrit")})).status == 401
    ok = await request(p, "POST", CHAT, chat_body(), headers={"authorization": "Bearer " + secret("sekrit")})
    assert ok.status == 200


async def test_llamacpp_guards_metrics(make_engine) -> None:
    eng = await make_engine(engine="llamacpp", api_key=secret("k1") + "," + secret("k2"), **FAST)
    p = port(eng)
    r = await request(p, "GET", "/metrics")
    assert r.status == 401
    assert r.json() == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    assert (await request(p, "GET", "/metrics", headers={"authorization": "Bearer " + secret("k2")})).status == 200
    assert (await request(p, "GET", "/metrics", headers={"x-api-key": secret("k1")})).status == 200
    assert (await request(p, "GET", "/slots")).status == 401
    for public in ("/health", "/v1/health", "/v1/models", "/models"):
        assert (await request(p, "GET", public)).status == 200, public
    assert (await request(p, "GET", "/health")).json() == {"status": "ok"}
    assert (await request(p, "POST", CHAT, chat_body())).status == 401


async def test_llamacpp_without_metrics(make_engine) -> None:
    eng = await make_engine(engine="llamacpp", metrics=False)
    r = await request(port(eng), "GET", "/metrics")
    assert r.status == 404
    assert r.json()["error"]["type"] == "not_found_error"


async def test_sglang_exempts_health_and_metrics(make_engine) -> None:
    eng = await make_engine(engine="sglang", api_key=secret("k"))
    p = port(eng)
    assert (await request(p, "GET", "/metrics")).status == 200
    assert (await request(p, "GET", "/health_generate")).status == 200
    r = await request(p, "GET", "/v1/models")
    assert r.status == 401 and r.json() == {"error": "Unauthorized"}
    assert (await request(p, "GET", "/v1/models", headers={"authorization": "Bearer " + secret("k")})).status == 200


async def test_trtllm_ignores_api_key(make_engine, caplog) -> None:
    eng = await make_engine(engine="trtllm", api_key="k", **FAST)
    assert "no API-key support" in caplog.text
    assert (await request(port(eng), "POST", CHAT, chat_body())).status == 200


# -- faults and control ---------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
async def test_startup_delay(make_engine, engine: str) -> None:
    eng = await make_engine(engine=engine, startup_delay=0.5, **FAST)
    p = port(eng)
    metrics_path = engines.get(engine).metrics_path
    h = await request(p, "GET", "/health")
    assert h.status == 503
    m = await request(p, "GET", metrics_path)
    if engine == "llamacpp":
        # llama-server answers /metrics as /health while it loads (engines.md §2.2)
        loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert h.json() == loading
        assert m.status == 503 and m.json() == loading
    else:
        # the others' metrics pages are served while /health says 503
        assert m.status == 200
    assert (await request(p, "POST", CHAT, chat_body())).status == 503
    await wait_for(lambda: eng.ready, timeout=2.0)
    assert (await request(p, "GET", "/health")).status == 200
    assert (await request(p, "GET", metrics_path)).status == 200
    assert (await request(p, "POST", CHAT, chat_body())).status == 200


async def test_error_faults(make_engine) -> None:
    eng = await make_engine(faults=SimFaults(error_next=2, error_status=502), **FAST)
    p = port(eng)
    r1 = await request(p, "POST", CHAT, chat_body())
    assert r1.status == 502 and r1.json()["error"]["code"] == 502
    assert (await request(p, "POST", "/v1/embeddings", {"input": "x"})).status == 502
    assert (await request(p, "POST", CHAT, chat_body())).status == 200
    eng.set_faults(error_rate=1.0, error_status=500)
    assert (await request(p, "POST", CHAT, chat_body())).status == 500
    assert (await request(p, "GET", "/health")).status == 200  # only inference fails
    eng.set_faults(reset=True)
    assert (await request(p, "POST", CHAT, chat_body())).status == 200
    assert eng.state.errors == 3


@pytest.mark.parametrize("how", ["reset", "eof"])
async def test_drop_faults_close_after_the_request_arrived(make_engine, how: str) -> None:
    eng = await make_engine(count_arrivals=True, **FAST)
    p = port(eng)
    eng.set_faults(drop_next=1, drop_how=how)
    reader, writer = await asyncio.open_connection("127.0.0.1", p)
    try:
        writer.write(build_request("POST", CHAT, chat_body(), headers={"x-request-id": "d1"}))
        if how == "reset":
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(65536), 2.0)
        else:
            assert await asyncio.wait_for(reader.read(65536), 2.0) == b""  # an end of stream, no answer
    finally:
        writer.close()
    assert eng.state.drops == 1 and eng.arrivals == {b"d1": 1}
    assert (await request(p, "POST", CHAT, chat_body())).status == 200
    with pytest.raises(ConfigError):
        eng.set_faults(drop_how="later")


async def test_keepalive_timeout_closes_idle_connections(make_engine) -> None:
    eng = await make_engine(keepalive_timeout=0.1, **FAST)
    reader, writer = await asyncio.open_connection("127.0.0.1", port(eng))
    try:
        writer.write(build_request("GET", "/health", close=False))
        assert b" 200 " in await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2.0)
        # then nothing more: the engine closes the idle connection (bounded wait)
        while await asyncio.wait_for(reader.read(65536), 2.0):
            pass
    finally:
        writer.close()
    with pytest.raises(ConfigError):
        SimConfig(keepalive_timeout=0)


async def test_cut_after_chunks(make_engine) -> None:
    eng = await make_engine(**FAST)
    p = port(eng)
    eng.set_faults(cut_after_chunks=3)
    reader, writer = await asyncio.open_connection("127.0.0.1", p)
    try:
        writer.write(build_request("POST", CHAT, chat_body(max_tokens=50, stream=True)))
        data = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 2.0):
                data += chunk
        except ConnectionResetError:
            pass
    finally:
        writer.close()
    assert data.count(b"data: ") == 3
    assert not data.endswith(b"0\r\n\r\n")
    # non-streamed: cut instead of the answer
    with pytest.raises((ConnectionResetError, IndexError, ValueError)):
        await request(p, "POST", CHAT, chat_body())
    assert eng.state.cuts == 2
    assert eng.state.running == 0


async def test_hang_and_mid_stream_hang(make_engine) -> None:
    eng = await make_engine(slots=2, **FAST)
    p = port(eng)
    eng.set_faults(hang_next=1)
    hung = asyncio.create_task(request(p, "POST", CHAT, chat_body()))
    await wait_for(lambda: eng.state.hangs == 1)
    await asyncio.sleep(0.05)
    assert not hung.done()
    assert eng.state.running == 1
    eng.set_faults(hang_after_chunks=2)
    reader, writer = await asyncio.open_connection("127.0.0.1", p)
    try:
        writer.write(build_request("POST", CHAT, chat_body(max_tokens=50, stream=True)))
        data = b""
        while data.count(b"data: ") < 2:
            data += await asyncio.wait_for(reader.read(65536), 2.0)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(reader.read(65536), 0.1)
        assert eng.state.running == 2
        assert data.count(b"data: ") == 2
    finally:
        writer.close()
    await wait_for(lambda: eng.state.running == 1)
    hung.cancel()
    await asyncio.gather(hung, return_exceptions=True)
    await wait_for(lambda: eng.state.running == 0)


async def test_hung_request_is_cut_at_stop(make_engine) -> None:
    eng = await make_engine(faults=SimFaults(hang_rate=1.0), **FAST)
    task = asyncio.create_task(request(port(eng), "POST", CHAT, chat_body()))
    await wait_for(lambda: eng.state.hangs == 1)
    await asyncio.wait_for(eng.stop(timeout=5.0), 1.0)
    with pytest.raises((ConnectionResetError, IndexError, ValueError)):
        await asyncio.wait_for(task, 1.0)


async def test_extra_latency_and_runtime_speed(make_engine) -> None:
    eng = await make_engine(ttft_ms=0.0, tokens_per_second=200.0)
    p = port(eng)
    loop = asyncio.get_running_loop()

    async def timed() -> float:
        t0 = loop.time()
        assert (await request(p, "POST", CHAT, chat_body(max_tokens=21))).status == 200
        return loop.time() - t0

    base = await timed()  # 20 intervals at 5 ms
    assert 0.09 <= base < 0.3
    eng.set_speed(tokens_per_second=50.0)  # four times slower
    slow = await timed()
    assert slow >= 0.39 and slow - base > 0.2  # 400 ms against 100 ms of simulated decode
    eng.set_speed(tokens_per_second=1e9)
    eng.set_faults(extra_latency_ms=150)
    assert await timed() >= 0.15
    with pytest.raises(ConfigError):
        eng.set_speed(tokens_per_second=0)


async def test_control_endpoint(make_engine) -> None:
    eng = await make_engine(**FAST)
    p = port(eng)
    st = (await request(p, "GET", "/sim/state")).json()
    assert st["running"] == 0 and st["faults"]["error_rate"] == 0 and st["config"]["engine"] == "vllm"
    r = await request(p, "POST", "/sim/faults", {"error_next": 1, "error_status": 503, "tokens_per_second": 25})
    assert r.status == 200 and r.json()["faults"]["error_next"] == 1 and r.json()["tokens_per_second"] == 25
    assert (await request(p, "POST", CHAT, chat_body())).status == 503
    bad = await request(p, "POST", "/sim/faults", {"error_rate": 2})
    assert bad.status == 400 and "error_rate" in bad.json()["error"]["message"]
    bad = await request(p, "POST", "/sim/faults", {"nonsense": 1, "ttft_ms": 5})
    assert bad.status == 400
    assert eng.state.ttft_ms == 0  # all or nothing
    r = await request(p, "POST", "/sim/faults", {"ready": False})
    assert (await request(p, "GET", "/health")).status == 503
    await request(p, "POST", "/sim/faults", {"ready": True, "reset": True})
    assert (await request(p, "GET", "/health")).status == 200
    # the control endpoint is never behind the engine's key
    keyed = await make_engine(engine="llamacpp", api_key="k")
    assert (await request(port(keyed), "GET", "/sim/state")).status == 200


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="engine"):
        SimConfig(engine="ollama")
    with pytest.raises(ConfigError, match="slots"):
        SimConfig(slots=0)
    with pytest.raises(ConfigError, match="kv_tokens"):
        SimConfig(kv_tokens=10, max_model_len=100)
    assert SimConfig(slots=3, max_model_len=100).kv_tokens == 300
    f = SimFaults()
    with pytest.raises(ConfigError):
        f.update({"cut_next": -1})
    f.update({"hang_after_chunks": 4})
    assert f.hang_rate == 1.0
