"""The gateway's data path over real sockets: routing, retries, streaming, cuts, errors.

The upstreams here are small programmable engines on llmgw's own HTTP core, so
each failure can be produced exactly when a test needs it (a reset before the
head, a cut after two events, a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from canary import secret
from llmgw.config import load
from llmgw.gateway.app import GatewayRuntime
from llmgw.http.server import HTTPServer

CLIENT_SECRET = secret("client-secret").encode()


# vLLM's error answers (engines.md §1.4): its exception classes as the type, the status as the code
VLLM_ERRORS = {
    "vllm_context": (400, b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, you '
                          b'requested 5000 tokens (4000 in the messages, 1000 in the completion).","type":'
                          b'"BadRequestError","param":null,"code":400}}'),
    "vllm_404": (404, b'{"error":{"message":"The model `m` does not exist.","type":"NotFoundError","param":"model",'
                      b'"code":404}}'),
    "vllm_422": (422, b'{"object":"error","message":"bad field","type":"BadRequestError","param":null,"code":422}'),
}


class FakeEngine:
    """An OpenAI-ish engine whose behaviour each test sets (``mode``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.seen: list[dict[str, Any]] = []
        self.active = 0
        self.cancelled = 0
        self.server: HTTPServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = HTTPServer(self, name=self.name)
        _, self.port = await self.server.listen("127.0.0.1", 0)

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.close(1.0)

    def handle(self, req: Any, w: Any) -> Any:
        if req.path == b"/metrics":
            w.send(
                200,
                b"vllm:num_requests_waiting{model_name=\"m\"} 0\nvllm:num_requests_running{model_name=\"m\"} %d\n"
                b"vllm:kv_cache_usage_perc{model_name=\"m\"} 0.1\n" % self.active,
                ((b"content-type", b"text/plain; version=0.0.4"),),
            )
            return None
        body = orjson.loads(req.body) if req.body[:1] == b"{" else {}  # (a form: not read)
        self.seen.append(
            {
                "path": req.target,
                "body": req.body,
                "auth": req.authorization,
                "rid": req.request_id,
                "headers": dict((k.lower(), v) for k, v in req.headers),
            }
        )
        mode = self.mode
        if mode == "reset":
            w.abort()
            return None
        if mode == "503":
            w.send(503, b'{"error":{"message":"overloaded","type":"unavailable_error","code":503}}')
            return None
        if mode == "401":
            w.send(401, b'{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}')
            return None
        if mode == "vllm401":
            w.send(401, b'{"error": "Unauthorized"}')
            return None
        if mode in VLLM_ERRORS:
            w.send(*VLLM_ERRORS[mode])
            return None
        if mode == "hang":
            return self._hang(w)
        if mode in USAGE_ANSWERS:
            if body.get("stream"):
                w.start(200, [(b"content-type", b"text/event-stream")])
                w.write(USAGE_ANSWERS[mode])
                w.end()
            else:
                w.send(200, USAGE_ANSWERS[mode], ((b"content-type", b"application/json"),))
            return None
        if body.get("stream"):
            return self._stream(w, mode)
        if mode == "hop_headers":
            # a field the engine names in Connection is for the hop to llmgw only
            payload = orjson.dumps({"object": "chat.completion", "served_by": self.name})
            w.start(200, [(b"content-type", b"application/json"), (b"connection", b"keep-alive, X-Engine-Hop"),
                          (b"x-engine-hop", b"slot=1"), (b"x-engine-kept", b"2")], len(payload))
            w.write(payload)
            return None
        if mode == "dated":  # (as vLLM answers: with its own Date)
            w.send(200, b'{"object": "chat.completion"}',
                   ((b"content-type", b"application/json"), (b"date", b"Tue, 01 Dec 2026 00:00:00 GMT")))
            return None
        if mode == "cut_body":
            w.start(200, [(b"content-type", b"application/json")], 1000)
            w.write(b'{"partial": ')
            w.abort()
            return None
        w.send_json(200, {"object": "chat.completion", "model": body.get("model"), "served_by": self.name})
        return None

    async def _hang(self, w: Any) -> None:
        self.active += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _stream(self, w: Any, mode: str) -> None:
        self.active += 1
        try:
            w.start(200, [(b"content-type", b"text/event-stream")])
            if mode == "burst":
                # every event its own chunk, all in one write: the gateway reads
                # several whole chunks at once
                w.write_raw(b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in BURST_EVENTS))
                w.end()
                return
            if mode == "raw_chunks":
                # chunk framing as other engines write it, straight to the transport
                for piece in RAW_CHUNKS:
                    w.write_raw(piece)
                    await asyncio.sleep(0.002)
                w.end()
                return
            n = 50 if mode == "slow_stream" else 3
            for i in range(n):
                w.write(b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i)
                await asyncio.sleep(0.05 if mode == "slow_stream" else 0.001)
                if mode == "cut_stream" and i == 1:
                    w.abort()
                    return
                if mode == "split_events" and i == 1:
                    w.write(b'data: {"choices":[{"delta":')  # half an event, then death
                    await asyncio.sleep(0.01)
                    w.abort()
                    return
            w.write(b"data: [DONE]\n\n")
            w.end()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


# Answers whose usage is not chat's shape: /v1/responses (input/output tokens; its stream's usage
# is in response.completed, after a response.created whose usage is null), /v1/embeddings (no completion)
USAGE_ANSWERS = {
    "responses": b'{"id":"resp_1","object":"response","output":[{"type":"message","content":[{"type":"output_text",'
                 b'"text":"hi"}]}],"usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":0},'
                 b'"output_tokens":87,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":123}}',
    "responses_stream": b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1",'
                        b'"status":"in_progress","usage":null}}\n\n'
                        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"hi"}\n\n'
                        b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1",'
                        b'"status":"completed","usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":0},'
                        b'"output_tokens":7,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":12}}}\n\n',
    "embeddings": b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"m",'
                  b'"usage":{"prompt_tokens":8,"total_tokens":8}}',
}

RAW_EVENTS = [b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(6)] + [b"data: [DONE]\n\n"]
RAW_CHUNKS = [
    b"%04X\r\n%s\r\n" % (len(RAW_EVENTS[0]), RAW_EVENTS[0]),  # upper-case size with leading zeros
    b"%x\r\n%s\r\n" % (len(RAW_EVENTS[1] + RAW_EVENTS[2]), RAW_EVENTS[1] + RAW_EVENTS[2]),  # two events
    b"%x\r\n%s\r\n" % (10, RAW_EVENTS[3][:10]),  # an event split over two chunks
    b"%x\r\n%s\r\n" % (len(RAW_EVENTS[3]) - 10, RAW_EVENTS[3][10:]),
    b"%x;ext=1\r\n%s\r\n" % (len(RAW_EVENTS[4]), RAW_EVENTS[4]),  # a chunk extension
    b"%x\r\n%s\r\n%x\r\n%s\r\n" % (len(RAW_EVENTS[5]), RAW_EVENTS[5], len(RAW_EVENTS[6]), RAW_EVENTS[6]),
]

BURST_EVENTS = [
    *(b'data: {"choices":[{"delta":{"content":"w%d "}}]}\n\n' % i for i in range(40)),
    b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":40,"total_tokens":51}}\n\n',
    b"data: [DONE]\n\n",
]


@contextlib.asynccontextmanager
async def gateway(engines: list[FakeEngine], **extra: Any) -> AsyncIterator[GatewayRuntime]:
    for e in engines:
        await e.start()
    cfg = load(
        {
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "endpoints": [
                {"id": e.name, "url": f"http://127.0.0.1:{e.port}", "model": "m", "api_key": secret(f"key-{e.name}")}
                for e in engines
            ],
            "models": {"m": {"aliases": ["m-alias"]}},
            "upstream": {"first_byte_timeout": "1s", "read_timeout": "1s", "connect_timeout": "500ms"},
            **extra,
        }
    )
    rt = GatewayRuntime(cfg)
    await rt.start()
    try:
        yield rt
    finally:
        await rt.stop()
        for e in engines:
            await e.stop()


async def request(
    port: int, body: bytes, path: bytes = b"/v1/chat/completions", headers: bytes = b"", method: bytes = b"POST"
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request on a fresh connection; returns (status, headers, de-chunked body)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await request_on(r, w, body, path, headers, method)
    finally:
        w.close()


async def request_on(
    r: asyncio.StreamReader, w: asyncio.StreamWriter, body: bytes, path: bytes = b"/v1/chat/completions",
    headers: bytes = b"", method: bytes = b"POST",
) -> tuple[int, dict[bytes, bytes], bytes]:
    """One request on an open connection (kept open)."""
    w.write(
        b"%s %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
        % (method, path, len(body), headers, body)
    )
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for line in lines[1:]:
        if line:
            k, v = line.split(":", 1)
            hdrs[k.strip().lower().encode()] = v.strip().encode()
    if b"content-length" in hdrs:
        data = await asyncio.wait_for(r.readexactly(int(hdrs[b"content-length"])), 5)
    else:
        data = b""
        while True:
            size_line = await asyncio.wait_for(r.readline(), 5)
            if not size_line:
                break  # connection closed without the last chunk
            size = int(size_line.strip(), 16)
            if size == 0:
                await r.readline()
                break
            data += await r.readexactly(size)
            await r.readexactly(2)
    return status, hdrs, data


def chat(stream: bool = False, model: str = "m") -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream})


def port_of(rt: GatewayRuntime) -> int:
    assert rt.listen_addr is not None
    return rt.listen_addr[1]


def inflight_zero(rt: GatewayRuntime) -> bool:
    assert rt.registry is not None
    return all(ep.inflight == 0 for ep in rt.registry.endpoints.values())


async def test_proxies_and_rewrites_credentials() -> None:
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        status, hdrs, body = await request(
            port_of(rt), chat(), headers=b"authorization: Bearer " + CLIENT_SECRET + b"\r\nx-request-id: abc-123\r\nx-custom: 1\r\n"
        )
        assert status == 200
        assert orjson.loads(body)["served_by"] == "a"
        assert hdrs[b"x-request-id"] == b"abc-123"
        assert hdrs[b"x-llmgw-replica"] == b"a"
        seen = a.seen[-1]
        assert seen["auth"] == b"Bearer " + secret("key-a").encode()  # the replica's key, never the client's
        assert CLIENT_SECRET not in b"".join(k + v for k, v in seen["headers"].items())
        assert seen["rid"] == b"abc-123"
        assert seen["headers"][b"x-custom"] == b"1"
        assert seen["body"] == chat()  # byte for byte
        assert inflight_zero(rt)


async def test_hop_by_hop_fields_go_no_further_either_way() -> None:
    # RFC 9110 §7.6.1: the fixed hop-by-hop fields and the ones a Connection header
    # names are consumed by the hop that receives them, in both directions
    a = FakeEngine("a")
    a.mode = "hop_headers"
    async with gateway([a]) as rt:
        status, hdrs, body = await request(
            port_of(rt), chat(),
            headers=b"Connection: keep-alive, X-Client-Hop\r\nX-Client-Hop: 1\r\nKeep-Alive: timeout=5\r\n"
            b"TE: trailers\r\nProxy-Authorization: Basic eDp5\r\nx-custom: 1\r\n",
        )
        assert status == 200, body
        seen = a.seen[-1]["headers"]
        assert seen[b"x-custom"] == b"1"
        for name in (b"x-client-hop", b"keep-alive", b"te", b"proxy-authorization"):
            assert name not in seen, name
        assert seen.get(b"connection", b"keep-alive").lower() == b"keep-alive"  # (llmgw's own, if any)
        assert hdrs[b"x-engine-kept"] == b"2"
        assert b"x-engine-hop" not in hdrs
        assert b"x-engine-hop" not in hdrs.get(b"connection", b"").lower()
        assert inflight_zero(rt)


async def test_the_engine_is_asked_for_an_uncoded_body_whatever_the_client_accepts() -> None:
    # llmgw reads the replica's answer (usage, error messages, events): a client's
    # "Accept-Encoding: gzip" passed on would bring back bytes it cannot read.
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        status, hdrs, body = await request(port_of(rt), chat(), headers=b"Accept-Encoding: gzip, br\r\n")
        assert status == 200, body
        assert a.seen[-1]["headers"][b"accept-encoding"] == b"identity"
        assert b"content-encoding" not in hdrs
        assert orjson.loads(body)["served_by"] == "a"


async def test_alias_is_rewritten_and_request_id_generated() -> None:
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        status, hdrs, _ = await request(port_of(rt), chat(model="m-alias"))
        assert status == 200
        assert orjson.loads(a.seen[-1]["body"])["model"] == "m"
        assert hdrs[b"x-request-id"] == a.seen[-1]["rid"]


async def test_alias_rewrite_changes_only_the_name() -> None:
    # The client's formatting, key order, number spellings and escapes reach the
    # engine untouched; only the value of the top-level "model" is replaced.
    a = FakeEngine("a")
    body = (
        b'{ "messages" : [ {"role":"user","content":"caf\\u00e9 \\"model\\": 1.50e2"} ],\n'
        b'  "model" :"m-alias", "temperature": 1.0, "x": {"model": "inner"} }'
    )
    async with gateway([a]) as rt:
        status, _, _ = await request(port_of(rt), body)
        assert status == 200
        assert a.seen[-1]["body"] == body.replace(b'"model" :"m-alias"', b'"model" :"m"')


async def test_models_list() -> None:
    async with gateway([FakeEngine("a")]) as rt:
        status, _, body = await request(port_of(rt), b"", path=b"/v1/models", method=b"GET")
        assert status == 200
        data = orjson.loads(body)
        assert data["object"] == "list"
        assert {c["id"] for c in data["data"]} == {"m", "m-alias"}
        status, _, body = await request(port_of(rt), b"", path=b"/v1/models/m", method=b"GET")
        assert status == 200 and orjson.loads(body)["id"] == "m"
        status, _, body = await request(port_of(rt), b"", path=b"/v1/models/zz", method=b"GET")
        assert status == 404 and orjson.loads(body)["error"]["code"] == "model_not_found"


async def test_model_not_found_names_the_model_param_on_every_route() -> None:
    # GET /v1/models/{model} and a POST naming an unknown model: the same error, param "model" (as OpenAI's)
    async with gateway([FakeEngine("a")]) as rt:
        _, _, listed = await request(port_of(rt), b"", path=b"/v1/models/zz", method=b"GET")
        _, _, posted = await request(port_of(rt), b'{"model": "zz", "messages": []}')
        got = [orjson.loads(b)["error"] for b in (listed, posted)]
        for err in got:
            assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error", err
            assert err["param"] == "model", err
        assert got[0] == got[1]


async def test_a_model_id_with_a_slash_is_found_percent_encoded_or_not() -> None:
    # The OpenAI SDKs' models.retrieve("org/name") sends /v1/models/org%2Fname.
    name = "meta-llama/Llama-3.1-8B"
    async with gateway([FakeEngine("a")], models={"m": {"aliases": [name]}}) as rt:
        for path in (b"/v1/models/meta-llama%2FLlama-3.1-8B", b"/v1/models/meta-llama%2fLlama-3.1-8B",
                     b"/v1/models/meta-llama/Llama-3.1-8B"):
            status, _, body = await request(port_of(rt), b"", path=path, method=b"GET")
            assert status == 200, (path, body)
            assert orjson.loads(body)["id"] == name
        status, _, body = await request(port_of(rt), b"", path=b"/v1/models/meta-llama%2FLlama-3.1-70B", method=b"GET")
        assert status == 404
        assert "meta-llama/Llama-3.1-70B" in orjson.loads(body)["error"]["message"]


async def test_an_absolute_form_target_is_served_as_its_path() -> None:
    # RFC 9112 §3.2.2: a server MUST accept the absolute-form (a client configured with llmgw as its proxy)
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        status, _, body = await request(port_of(rt), chat(), path=b"http://gw.example:8080/v1/chat/completions?x=1")
        assert status == 200 and orjson.loads(body)["served_by"] == "a"
        assert a.seen[-1]["path"] == b"/v1/chat/completions?x=1"  # sent on in origin-form
        status, _, body = await request(port_of(rt), b"", path=b"HTTPS://gw.example/v1/models", method=b"GET")
        assert status == 200 and orjson.loads(body)["object"] == "list"
        status, _, body = await request(port_of(rt), b"", path=b"http://gw.example", method=b"GET")
        assert status == 404 and "no route for /;" in orjson.loads(body)["error"]["message"]
        for other in (b"ftp://gw.example/v1/models", b"http:///v1/models"):
            status, _, _ = await request(port_of(rt), b"", path=other, method=b"GET")
            assert status == 404, other
        # the path is checked as any other: no dot segments through the absolute-form
        status, _, body = await request(port_of(rt), chat(), path=b"http://gw.example/v1/../admin")
        assert status == 400 and orjson.loads(body)["error"]["code"] == "invalid_path"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1,2]", 400, "invalid_json"),
        (b'{"messages": []}', 400, "missing_model"),
        (b'{"model": ""}', 400, "missing_model"),
        (b'{"model": null}', 400, "missing_model"),
        (b'{"model": 7, "messages": []}', 400, "invalid_type"),
        (b'{"model": ["m"]}', 400, "invalid_type"),
        (b'{"model": "nope"}', 404, "model_not_found"),
    ],
)
async def test_client_errors_are_openai_shaped(body: bytes, status: int, code: str) -> None:
    async with gateway([FakeEngine("a")]) as rt:
        got, _, data = await request(port_of(rt), body)
        assert got == status
        err = orjson.loads(data)["error"]
        assert err["code"] == code
        assert isinstance(err["message"], str) and err["message"]
        if code == "invalid_type":
            assert err["param"] == "model"
            assert "expected a string, but got an " in err["message"]
        assert set(err) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("coding", ["gzip", "zstd", "deflate"])
async def test_a_compressed_body_is_415_naming_its_coding(coding: str) -> None:
    """A body sent compressed (Content-Encoding: gzip from a client's middleware) is told so, with
    Accept-Encoding: identity (RFC 9110 §15.5.16), not "not JSON"; nothing reaches the engine."""
    import gzip
    import zlib

    plain = chat()
    body = {"gzip": gzip.compress, "deflate": zlib.compress,
            "zstd": lambda b: b"\x28\xb5\x2f\xfd" + b}[coding](plain)  # (the frame's magic is what is read)
    engine = FakeEngine("a")
    async with gateway([engine]) as rt:
        got, headers, data = await request(port_of(rt), body, headers=b"content-encoding: %s\r\n" % coding.encode())
        assert got == 415, data
        err = orjson.loads(data)["error"]
        assert err["code"] == "unsupported_content_encoding" and f"{coding}-compressed" in err["message"]
        assert headers[b"accept-encoding"] == b"identity" and headers[b"x-should-retry"] == b"false"
        assert engine.seen == []
        # text that merely starts like one is still "not JSON"
        got, _, data = await request(port_of(rt), b"x-ray of the request")
        assert got == 400 and orjson.loads(data)["error"]["code"] == "invalid_json"


async def test_every_answer_carries_one_date() -> None:
    """RFC 9110 §6.6.1: llmgw's own answers carry a Date, and so does a replica's answer forwarded
    without one (llama-server sends none); a replica's own Date is passed on, not doubled."""
    import email.utils

    engine = FakeEngine("a")  # (llmgw's HTTP server, as the engine here, sends no Date)
    async with gateway([engine]) as rt:

        async def dates(body: bytes, mode: str = "ok", path: bytes = b"/v1/chat/completions") -> list[bytes]:
            engine.mode = mode
            r, w = await asyncio.open_connection("127.0.0.1", port_of(rt))
            try:
                method = b"POST" if body else b"GET"
                w.write(b"%s %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\n\r\n%s" % (method, path, len(body), body))
                raw = await asyncio.wait_for(r.read(), 10)
            finally:
                w.close()
            head = raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
            return [line.split(b":", 1)[1].strip() for line in head[1:] if line.lower().startswith(b"date:")]

        def recent(value: bytes) -> bool:
            return abs(email.utils.parsedate_to_datetime(value.decode()).timestamp() - time.time()) < 5

        for body, mode in ((chat(), "ok"), (chat(stream=True), "ok"), (chat(), "vllm_context"), (chat(), "503"),
                           (b"{not json", "ok"), (chat(model="nope"), "ok")):
            got = await dates(body, mode)
            assert len(got) == 1 and recent(got[0]), (mode, body, got)
        assert await dates(chat(), "dated") == [b"Tue, 01 Dec 2026 00:00:00 GMT"]
        got = await dates(b"", path=b"/v1/models")
        assert len(got) == 1 and recent(got[0])


async def test_unknown_route_and_method() -> None:
    async with gateway([FakeEngine("a")]) as rt:
        status, _, data = await request(port_of(rt), b"", path=b"/nope", method=b"GET")
        assert status == 404 and orjson.loads(data)["error"]["code"] == "not_found"
        status, headers, data = await request(port_of(rt), b"", path=b"/v1/chat/completions", method=b"GET")
        assert status == 405 and headers[b"allow"] == b"POST"
        # a path that is no route: 404 as OpenAI answers it, not a 405 promising that a POST would do
        status, _, data = await request(port_of(rt), b"", path=b"/v1/nothing", method=b"GET")
        err = orjson.loads(data)["error"]
        assert status == 404 and err["code"] == "not_found", data
        assert err["message"].startswith("Invalid URL (GET /v1/nothing)")
        status, _, data = await request(port_of(rt), b"", path=b"/v1/embeddings", method=b"DELETE")
        assert status == 405 and orjson.loads(data)["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize(
    "path",
    [
        b"/v1/../admin",
        b"/v1/./chat/completions",
        b"/v1/chat/completions/../../metrics",
        b"/v1/%2e%2e/secret",
        b"/v1/%2E./secret",
        b"/v1/..%2fadmin",
        b"/v1/..\\admin",
        b"/v1/chat/..?x=1",
    ],
)
async def test_dot_segments_are_refused_not_forwarded(path: bytes) -> None:
    """An upstream (or a proxy in front of it) that resolves dot segments would serve these
    off /v1/, with the replica's own key: refused, and nothing reaches the engine."""
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        status, _, data = await request(port_of(rt), chat(), path=path)
        assert status == 400, data
        err = orjson.loads(data)["error"]
        assert err["code"] == "invalid_path" and err["type"] == "invalid_request_error"
        # paths with dots or escapes that are no dot segment still go through
        status, _, _ = await request(port_of(rt), chat(), path=b"/v1/chat/completions.v2")
        assert status == 200
        status, _, _ = await request(port_of(rt), chat(), path=b"/v1/chat/completions%20")
        assert status == 200
    assert [r["path"] for r in a.seen] == [b"/v1/chat/completions.v2", b"/v1/chat/completions%20"]


async def test_client_auth() -> None:
    a = FakeEngine("a")
    digest = hashlib.sha256(b"other").hexdigest()
    good = secret("good-key")
    async with gateway([a], auth={"api_keys": [{"name": "t", "key": good}, {"key_sha256": digest}]}) as rt:
        p = port_of(rt)
        status, hdrs, data = await request(p, chat())
        assert status == 401 and orjson.loads(data)["error"]["code"] == "missing_api_key"
        assert hdrs[b"www-authenticate"] == b"Bearer"  # RFC 9110 §11.6.1: a 401 names the scheme
        wrong = secret("wrong-key").encode()
        status, hdrs, data = await request(p, chat(), headers=b"authorization: Bearer " + wrong + b"\r\n")
        assert status == 401 and orjson.loads(data)["error"]["code"] == "invalid_api_key"
        assert hdrs[b"www-authenticate"] == b"Bearer"
        assert wrong not in data
        status, _, _ = await request(p, chat(), headers=b"authorization: Bearer %s\r\n" % good.encode())
        assert status == 200
        status, _, _ = await request(p, chat(), headers=b"x-api-key: other\r\n")
        assert status == 200
        assert a.seen[-1]["auth"] == b"Bearer " + secret("key-a").encode()


@pytest.mark.parametrize(("mode", "after_send"), [("503", False), ("reset", True), ("cut_body", True)])
async def test_failure_before_first_byte_is_retried_on_another_replica(mode: str, after_send: bool) -> None:
    bad, good = FakeEngine("bad"), FakeEngine("good")
    # round_robin: the failing replica is certainly tried (score would learn to avoid it)
    # (a reset or a cut after the send is resent only with retries.after_send:
    # tests/gateway/test_at_most_once.py)
    retries = {"retries": {"after_send": True}} if after_send else {}
    async with gateway([bad, good], routing={"strategy": "round_robin"}, **retries) as rt:
        bad.mode = mode
        for _ in range(6):
            status, hdrs, body = await request(port_of(rt), chat())
            assert status == 200, body
            assert hdrs[b"x-llmgw-replica"] == b"good"
        assert bad.seen, "the failing replica was never tried"
        assert inflight_zero(rt)


async def test_connect_refused_is_retried() -> None:
    good = FakeEngine("good")
    await good.start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    cfg = load(
        {
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "endpoints": [
                {"id": "dead", "url": f"http://127.0.0.1:{dead_port}", "model": "m"},
                {"id": "good", "url": f"http://127.0.0.1:{good.port}", "model": "m"},
            ],
        }
    )
    rt = GatewayRuntime(cfg)
    await rt.start()
    try:
        for _ in range(5):
            status, hdrs, _ = await request(port_of(rt), chat())
            assert status == 200 and hdrs[b"x-llmgw-replica"] == b"good"
    finally:
        await rt.stop()
        await good.stop()


async def test_all_replicas_failing_gives_a_clear_error() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    async with gateway([a, b]) as rt:
        a.mode = b.mode = "503"
        status, hdrs, data = await request(port_of(rt), chat())
        assert status == 503
        assert hdrs[b"retry-after"] == b"1"
        err = orjson.loads(data)["error"]
        assert err["code"] == "service_unavailable" and err["type"] == "service_unavailable_error"
        assert "overloaded" in err["message"]
        assert len(a.seen) + len(b.seen) == 2  # one try plus one retry, no more


async def test_retries_disabled() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    async with gateway([a, b], retries={"attempts": 0}) as rt:
        a.mode = b.mode = "reset"
        status, _, data = await request(port_of(rt), chat())
        assert status == 502
        assert orjson.loads(data)["error"]["code"] == "bad_gateway"
        # one replica only, once: the request was written before the reset
        assert len(a.seen) + len(b.seen) == 1


@pytest.mark.parametrize(
    ("mode", "status", "code", "param"),
    [
        ("vllm_context", 400, "context_length_exceeded", None),
        ("vllm_404", 404, "not_found", "model"),
        ("vllm_422", 422, "invalid_request", None),
    ],
)
async def test_engine_error_types_reach_clients_as_openais(mode: str, status: int, code: str, param: str | None) -> None:
    # vLLM's "BadRequestError" / "NotFoundError" are not OpenAI's types: clients get OpenAI's for the
    # status (engines.md §8.3), the engine's status and message unchanged
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        a.mode = mode
        got, _, data = await request(port_of(rt), chat())
        assert got == status
        err = orjson.loads(data)["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == code and err["param"] == param, err
        assert err["message"] == orjson.loads(VLLM_ERRORS[mode][1]).get("error", {}).get("message", "bad field")


@pytest.mark.parametrize("mode", ["401", "vllm401"])
async def test_engine_key_refusals_are_the_gateways_problem(mode: str) -> None:
    # Either engine's 401 refuses the key llmgw sent: the client learns that the
    # gateway is misconfigured (502), not that its own key is bad (a 401).
    # (tests/gateway/test_upstream_trust.py: the hold, the probes, the metrics)
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        a.mode = mode
        got, _, data = await request(port_of(rt), chat())
        assert got == 502
        err = orjson.loads(data)["error"]
        assert err["code"] == "upstream_auth_failed" and err["type"] == "server_error"
        assert "refused the API key" in err["message"]


async def test_streaming_relays_events() -> None:
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        status, hdrs, data = await request(port_of(rt), chat(stream=True))
        assert status == 200
        assert hdrs[b"content-type"] == b"text/event-stream"
        events = [e for e in data.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert len(events) == 4


@pytest.mark.parametrize("mode", ["ok", "burst"])
async def test_a_stream_to_an_http10_client_is_unframed_and_ends_with_the_close(mode: str) -> None:
    # the engine's chunks (passed through as they came to HTTP/1.1 clients) are de-chunked
    a = FakeEngine("a")
    a.mode = mode
    async with gateway([a]) as rt:
        r, w = await asyncio.open_connection("127.0.0.1", port_of(rt))
        body = chat(stream=True)
        w.write(b"POST /v1/chat/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body))
        raw = await asyncio.wait_for(r.read(), 5)
        w.close()
        head, _, data = raw.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        assert lines[0].startswith(b"http/1.1 200") and b"connection: close" in lines, head
        assert not any(ln.startswith(b"transfer-encoding") for ln in lines), head
        events = [e for e in data.split(b"\n\n") if e]
        assert events and all(e.startswith(b"data: ") for e in events), data
        assert events[-1] == b"data: [DONE]"
        for _ in range(100):
            if inflight_zero(rt):
                break
            await asyncio.sleep(0.02)
        assert inflight_zero(rt)


async def test_streaming_relays_any_chunk_framing_as_whole_events() -> None:
    # The compiled reader relays an engine's plain chunks as they came when they
    # hold whole events; every other shape is re-framed. The client sees the same.
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        a.mode = "raw_chunks"
        for _ in range(2):  # (and again on the reused upstream connection)
            status, hdrs, data = await request(port_of(rt), chat(stream=True))
            assert status == 200 and hdrs[b"content-type"] == b"text/event-stream"
            assert data == b"".join(RAW_EVENTS)
        assert inflight_zero(rt)


async def test_whole_chunks_read_together_are_relayed_in_order_and_usage_counted() -> None:
    # The compiled relay sends the whole chunks of one read in one write; the usage
    # in the events before [DONE] is still found (it reads the last events only).
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        a.mode = "burst"
        for _ in range(3):
            status, hdrs, data = await request(port_of(rt), chat(stream=True))
            assert status == 200 and hdrs[b"content-type"] == b"text/event-stream"
            assert data == b"".join(BURST_EVENTS)
        assert rt.admin_addr is not None
        status, _, text = await request(rt.admin_addr[1], b"", path=b"/metrics", method=b"GET")
        assert status == 200
        tokens = {
            m.group(1): float(m.group(2))
            for m in re.finditer(rb'^llmgw_tokens_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', text, re.M)
        }
        assert tokens == {b"prompt": 33.0, b"completion": 120.0}, text
        assert inflight_zero(rt)


@pytest.mark.parametrize("mode", ["cut_stream", "split_events"])
async def test_stream_cut_by_engine_ends_with_an_error_event(mode: str) -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    async with gateway([a, b]) as rt:
        a.mode = b.mode = mode
        status, _, data = await request(port_of(rt), chat(stream=True))
        assert status == 200
        events = [e for e in data.split(b"\n\n") if e]
        assert events[-1].startswith(b"data: {\"error\"")
        err = orjson.loads(events[-1][6:])["error"]
        assert err["code"] == "upstream_disconnected"
        assert b"[DONE]" not in data and b"finish_reason" not in data
        # whole events only: every event but the error is a complete data line
        assert all(e.startswith(b"data: {\"choices\"") and e.endswith(b"}}]}") for e in events[:-1])
        assert len(a.seen) + len(b.seen) == 1  # never retried after the first byte
        assert inflight_zero(rt)


async def test_the_client_connection_outlives_a_cut_stream() -> None:
    """The cut stream's framing is complete (the error event, then the last chunk): the client's kept-alive
    connection serves its next request. Closing it instead would make a client that reuses it at once fail a
    request it cannot safely resend (seen in bench/soak.py)."""
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        r, w = await asyncio.open_connection("127.0.0.1", port_of(rt))
        try:
            a.mode = "cut_stream"
            status, hdrs, data = await request_on(r, w, chat(stream=True))
            assert status == 200 and b'"upstream_disconnected"' in data
            assert hdrs.get(b"connection") != b"close"
            a.mode = "ok"
            status, _, data = await request_on(r, w, chat())
            assert status == 200 and orjson.loads(data)["served_by"] == "a"
        finally:
            w.close()
        assert inflight_zero(rt)


async def test_first_byte_timeout_is_504_and_not_retried() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")
    async with gateway([a, b]) as rt:
        a.mode = b.mode = "hang"
        status, _, data = await request(port_of(rt), chat())
        assert status == 504
        assert orjson.loads(data)["error"]["code"] == "gateway_timeout"
        assert len(a.seen) + len(b.seen) == 1
        for _ in range(100):
            if a.active == b.active == 0:
                break
            await asyncio.sleep(0.02)
        assert a.active == b.active == 0, "the upstream request was not aborted"
        assert inflight_zero(rt)


async def test_client_disconnect_mid_stream_aborts_upstream() -> None:
    a = FakeEngine("a")
    # (the first request waits for the first scrape and takes its connection; the second scrape
    # comes at a random point of the interval: an hour, none in the test, whose connection
    # would be counted)
    async with gateway([a], scrape={"interval": "1h"}) as rt:
        assert rt.registry is not None
        pool = rt.registry.endpoints["a"].pool
        a.mode = "slow_stream"
        body = chat(stream=True)
        r, w = await asyncio.open_connection("127.0.0.1", port_of(rt))
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await asyncio.wait_for(r.readuntil(b"t1"), 5)
        assert a.active == 1
        assert rt.registry is not None and rt.registry.endpoints["a"].inflight == 1
        w.close()
        for _ in range(100):
            if a.active == 0 and inflight_zero(rt):
                break
            await asyncio.sleep(0.01)
        assert a.active == 0 and a.cancelled == 1, "upstream not aborted after the client left"
        assert inflight_zero(rt)
        assert pool.open_connections == 0  # (the stream's, the first scrape's before it, closed)


async def test_keepalive_upstream_connections_are_reused() -> None:
    a = FakeEngine("a")
    # (a scrape while a request holds the connection would open a second one: the second scrape
    # comes at a random point of an hour)
    async with gateway([a], scrape={"interval": "1h"}) as rt:
        for _ in range(10):
            status, _, _ = await request(port_of(rt), chat())
            assert status == 200
        assert rt.registry is not None
        pool = rt.registry.endpoints["a"].pool
        assert pool.open_connections == 1


async def test_admin_health_ready_metrics() -> None:
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        assert rt.admin_addr is not None
        ap = rt.admin_addr[1]
        status, _, data = await request(ap, b"", path=b"/health", method=b"GET")
        assert status == 200 and orjson.loads(data) == {"status": "ok"}
        status, _, data = await request(ap, b"", path=b"/ready", method=b"GET")
        assert status == 200 and orjson.loads(data)["ready"] is True
        status, _, data = await request(ap, b"", path=b"/metrics", method=b"GET")
        assert status == 200
        assert b'llmgw_endpoint_inflight{pool="",replica="a"} 0.0' in data
        # never scraped: absent, not 0
        assert b"llmgw_endpoint_waiting{" not in data
        # the admin port is not the client port
        status, _, _ = await request(port_of(rt), b"", path=b"/metrics", method=b"GET")
        assert status == 404


async def test_access_log_is_one_json_line_per_request(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    a = FakeEngine("a")
    caplog.set_level(logging.INFO, logger="llmgw.access")
    key = secret("sekrit-key").encode()
    async with gateway([a], access_log=True, auth={"api_keys": [{"key": key.decode()}]}) as rt:
        status, _, _ = await request(
            port_of(rt), chat(), headers=b"authorization: Bearer " + key + b"\r\nx-request-id: rid-9\r\n"
        )
        assert status == 200
        status, _, refused_body = await request(port_of(rt), b'{"model": "nope"}',
                                                headers=b"authorization: Bearer " + key + b"\r\n")
        assert status == 404
        # the gateway's own error answers: their body's bytes, not 0 (a 400 before routing, a 404 route)
        status, _, bad_body = await request(port_of(rt), b"not json", headers=b"authorization: Bearer " + key + b"\r\n")
        assert status == 400
        status, _, route_body = await request(port_of(rt), b"", path=b"/v1/nothing", method=b"GET",
                                              headers=b"authorization: Bearer " + key + b"\r\n")
        assert status == 404
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.access"]
    assert len(lines) == 4
    assert [orjson.loads(ln)["bytes"] for ln in lines[1:]] == [len(refused_body), len(bad_body), len(route_body)]
    assert all(len(b) > 50 for b in (refused_body, bad_body, route_body))
    entry = orjson.loads(lines[0])
    assert entry["id"] == "rid-9" and entry["model"] == "m" and entry["replica"] == "a"
    assert entry["status"] == 200 and entry["bytes"] > 0
    assert entry["ttfb_ms"] is not None and entry["duration_ms"] >= entry["ttfb_ms"]
    refused = orjson.loads(lines[1])
    assert refused["status"] == 404 and refused["model"] == "(unknown)" and refused["replica"] is None
    assert not any("sekrit" in line for line in lines)


async def test_no_access_log_by_default(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="llmgw.access")
    async with gateway([FakeEngine("a")]) as rt:
        status, _, _ = await request(port_of(rt), chat())
        assert status == 200
    assert not [r for r in caplog.records if r.name == "llmgw.access"]


async def test_the_gateways_own_answers_carry_date() -> None:
    # RFC 9110 §6.6.1: an origin with a clock sends Date (on answers no replica gave)
    from email.utils import parsedate_to_datetime
    async with gateway([FakeEngine("a")]) as rt:
        for path, method, want in ((b"/v1/models", b"GET", 200), (b"/v1/models/zz", b"GET", 404)):
            status, hdrs, _ = await request(port_of(rt), b"", path=path, method=method)
            assert status == want
            when = parsedate_to_datetime(hdrs[b"date"].decode())
            assert abs(when.timestamp() - time.time()) < 5


async def test_expect_100_continue_is_refused_on_the_head_when_the_head_decides() -> None:
    """RFC 9110 §10.1.1: a client that asks for 100 Continue waits before sending its body. A missing or
    wrong key, or no such route, is decided by the head: answered at once (and the connection closed,
    the body unread) rather than a 100 that makes the client upload a body for nothing."""
    key = secret("continue-key").encode()
    async with gateway([FakeEngine("a")], auth={"api_keys": [{"key": key.decode()}]}) as rt:
        body = chat()

        async def head(path: bytes, auth: bytes) -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
            r, w = await asyncio.open_connection("127.0.0.1", port_of(rt))
            w.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%sexpect: 100-continue\r\n"
                    b"content-length: %d\r\n\r\n" % (path, auth, len(body)))
            first = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            return first, r, w

        for path, auth, status in ((b"/v1/chat/completions", b"", b"401"),
                                   (b"/v1/chat/completions", b"authorization: Bearer wrong\r\n", b"401"),
                                   (b"/nope", b"authorization: Bearer " + key + b"\r\n", b"404"),
                                   (b"/v1/../admin", b"", b"400")):  # (handle's order: the path before the key)
            first, r, w = await head(path, auth)
            try:
                assert first.startswith(b"HTTP/1.1 " + status), first
                assert b"connection: close" in first.lower()
                rest = await asyncio.wait_for(r.read(), 5)  # the error's body, then the close
                err = orjson.loads(rest)["error"]
                assert err["type"] == "invalid_request_error" and key not in rest
            finally:
                w.close()
        # the right key: 100 Continue, then the answer
        first, r, w = await head(b"/v1/chat/completions", b"authorization: Bearer " + key + b"\r\n")
        try:
            assert first == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(body)
            answer = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert answer.startswith(b"HTTP/1.1 200"), answer
        finally:
            w.close()


# -- QA findings: admin endpoints, models/, expose_replica, usage shapes, forms ----------


@pytest.mark.parametrize(
    "path",
    [b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter", b"/v1/Load_LoRA_Adapter", b"/v1//unload_lora_adapter",
     b"/v1/load%5Flora%5Fadapter", b"/v1/%6coad_lora_adapter", b"/v1/unload_lora_adapter/", b"/v1/load_lora_adapter?x=1"],
)
async def test_engine_admin_endpoints_are_refused_not_forwarded(path: bytes) -> None:
    """vLLM's runtime LoRA routes would run with the gateway's key for the replica: any client
    of the gateway could load or unload adapters on every replica (they were forwarded as any
    POST naming a model is)."""
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        body = orjson.dumps({"model": "m", "lora_name": "x", "lora_path": "/tmp/evil"})
        for method in (b"POST", b"GET"):
            status, _, data = await request(port_of(rt), body, path=path, method=method)
            err = orjson.loads(data)["error"]
            assert status == 403 and err["code"] == "engine_admin_endpoint", (method, data)
            assert "administration endpoint" in err["message"]
        # a 100-continue head is refused on the head alike
        r, w = await asyncio.open_connection("127.0.0.1", port_of(rt))
        try:
            w.write(b"POST %s HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: %d\r\n\r\n"
                    % (path, len(body)))
            assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 403")
        finally:
            w.close()
        # other paths under /v1/ starting alike still go through
        status, _, _ = await request(port_of(rt), chat(), path=b"/v1/load_lora_adapters_list")
        assert status == 200
    assert [r["path"] for r in a.seen] == [b"/v1/load_lora_adapters_list"]


async def test_models_with_a_trailing_slash_is_the_list() -> None:
    # it was 404 model_not_found naming the model ""
    async with gateway([FakeEngine("a")]) as rt:
        status, _, body = await request(port_of(rt), b"", path=b"/v1/models/", method=b"GET")
        assert status == 200, body
        assert {c["id"] for c in orjson.loads(body)["data"]} == {"m", "m-alias"}


async def test_expose_replica_false_keeps_replica_names_out_of_error_messages() -> None:
    a, b = FakeEngine("gpu-one"), FakeEngine("gpu-two")
    async with gateway([a, b], server={"expose_replica": False}) as rt:
        for mode, status, says in (("503", 503, "a replica answered 503: overloaded"),
                                   ("reset", 502, "a replica closed the connection before a complete answer"),
                                   ("hang", 504, "a replica did not answer within 1s")):
            a.mode = b.mode = mode
            got, hdrs, data = await request(port_of(rt), chat())
            message = orjson.loads(data)["error"]["message"]
            assert got == status and message.startswith(says), (mode, message)
            assert b"gpu-" not in data and b"x-llmgw-replica" not in hdrs, (mode, data)
    # (and named, as before, with expose_replica true)
    a, b = FakeEngine("gpu-one"), FakeEngine("gpu-two")
    async with gateway([a, b]) as rt:
        a.mode = b.mode = "503"
        _, _, data = await request(port_of(rt), chat())
        assert b"replica gpu-" in data


@pytest.mark.parametrize(
    ("mode", "path", "stream", "tokens"),
    [
        ("responses", b"/v1/responses", False, {b"prompt": 36.0, b"completion": 87.0}),
        ("responses_stream", b"/v1/responses", True, {b"prompt": 5.0, b"completion": 7.0}),
        ("embeddings", b"/v1/embeddings", False, {b"prompt": 8.0, b"completion": 0.0}),
    ],
)
async def test_tokens_are_counted_for_responses_and_embeddings(mode: str, path: bytes, stream: bool,
                                                               tokens: dict[bytes, float]) -> None:
    # llmgw_tokens_total never counted /v1/responses (input/output tokens) or /v1/embeddings (no completion)
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        a.mode = mode
        status, _, data = await request(port_of(rt), orjson.dumps({"model": "m", "input": "hi", "stream": stream}),
                                        path=path)
        assert status == 200 and data == USAGE_ANSWERS[mode]
        assert rt.admin_addr is not None
        _, _, text = await request(rt.admin_addr[1], b"", path=b"/metrics", method=b"GET")
        got = {
            m.group(1): float(m.group(2))
            for m in re.finditer(rb'^llmgw_tokens_total\{[^}]*kind="(\w+)"[^}]*\} (\S+)$', text, re.M)
        }
        assert got == tokens, text


def form(fields: list[tuple[bytes, bytes]], boundary: bytes = b"----llmgw7MA4YWxk") -> bytes:
    """A multipart/form-data body as the OpenAI SDKs send one (each field a part)."""
    parts = [b"--%s\r\nContent-Disposition: form-data; %s\r\n\r\n%s\r\n" % (boundary, disp, value)
             for disp, value in fields]
    return b"".join(parts) + b"--%s--\r\n" % boundary


async def post_form(port: int, path: bytes, body: bytes, ctype: bytes) -> tuple[int, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                % (path, ctype, len(body), body))
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        n = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        return int(head.split()[1]), await asyncio.wait_for(r.readexactly(n), 5)
    finally:
        w.close()


async def test_a_multipart_form_names_its_model() -> None:
    # /v1/audio/transcriptions and /v1/audio/translations take multipart/form-data (OpenAI API): the
    # model was read from JSON only, and the client got 400 "could not parse the JSON body"
    a = FakeEngine("a")
    ctype = b"multipart/form-data; boundary=----llmgw7MA4YWxk"
    audio = (b'name="file"; filename="a;name=\\"model\\".wav"\r\nContent-Type: audio/wav', b"RIFF\x00\x01--")
    async with gateway([a]) as rt:
        body = form([audio, (b'name="model"', b"m-alias"), (b'name="language"', b"en")])
        status, data = await post_form(port_of(rt), b"/v1/audio/transcriptions", body, ctype)
        assert status == 200 and orjson.loads(data)["served_by"] == "a"
        # the alias is rewritten in place; every other byte as the client sent it
        assert a.seen[-1]["body"] == body.replace(b"\r\n\r\nm-alias\r\n", b"\r\n\r\nm\r\n")
        quoted = body.replace(b"----llmgw7MA4YWxk", b"x y")
        status, _ = await post_form(port_of(rt), b"/v1/audio/translations", quoted, b'multipart/form-data; boundary="x y"')
        assert status == 200 and a.seen[-1]["body"] == quoted.replace(b"\r\n\r\nm-alias\r\n", b"\r\n\r\nm\r\n")
        for bad, code in (
            (form([audio]), "missing_model"),
            (form([(b'name="model"', b"m"), (b'name="model"', b"other")]), "invalid_multipart"),
            (body[: len(body) // 2], "invalid_multipart"),
        ):
            status, data = await post_form(port_of(rt), b"/v1/audio/transcriptions", bad, ctype)
            assert status == 400 and orjson.loads(data)["error"]["code"] == code, data
        status, data = await post_form(port_of(rt), b"/v1/audio/transcriptions", body, b"multipart/form-data")
        assert status == 400 and "boundary" in orjson.loads(data)["error"]["message"]
        status, data = await post_form(port_of(rt), b"/v1/audio/transcriptions", body, b"text/plain")
        assert status == 400 and orjson.loads(data)["error"]["code"] == "invalid_json"
        status, data = await post_form(port_of(rt), b"/v1/audio/transcriptions", form([(b'name="model"', b"zz")]), ctype)
        assert status == 404 and orjson.loads(data)["error"]["code"] == "model_not_found"
    assert len(a.seen) == 2


async def test_a_java_style_h2c_upgrade_offer_is_proxied_on_http11() -> None:
    """Java's HttpClient (HTTP/2 by default) sends a plain-http POST with Connection: Upgrade, HTTP2-Settings
    and Upgrade: h2c, its body with it; curl --http2 does the same. llmgw answered 400 'protocol upgrade is
    not supported'; a server may ignore Upgrade: the request is proxied, answered on HTTP/1.1, then the
    connection closes. The replica sees no Upgrade."""
    a = FakeEngine("a")
    async with gateway([a]) as rt:
        body = chat()
        r, w = await asyncio.open_connection("127.0.0.1", port_of(rt))
        try:
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
                    b"HTTP2-Settings: AAEAAEAAAAIAAAABAAMAAABkAAQBAAAAAAUAAEAA\r\nUpgrade: h2c\r\n"
                    b"User-Agent: Java-http-client/21\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            raw = await asyncio.wait_for(r.read(), 10)  # (to the end: the connection closes after the answer)
        finally:
            w.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"\r\nconnection: close" in head.lower(), head
        assert orjson.loads(payload)["served_by"] == "a", payload
        (seen,) = a.seen
        assert not {"upgrade", "http2-settings"} & set(seen["headers"]), seen["headers"]
