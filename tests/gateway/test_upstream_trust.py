"""Engines that misbehave, over real sockets: a refused key, echoed secrets, huge answers.

* An engine's 401/403 refuses the key *llmgw* sends it: the client gets 502
  ``upstream_auth_failed`` (never a 401 about its own key) or, better, another
  replica's answer; the replica is held out of routing (``auth_failed``) with a
  probe each breaker cooldown and at once after a reload changes its key.
* Secrets an engine's error body or headers carry are redacted.
* A non-streamed answer above ``upstream.max_buffered_body`` is relayed with the
  engine's framing: a cut stays visible as an incomplete body.

The stand-in engine runs on llmgw's own HTTP core (as the other gateway tests'
do), so each misbehaviour happens exactly when a test needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from canary import MARK, MARK_BYTES, secret
from llmgw.config import load
from llmgw.gateway.proxy import config_secrets, redact
from llmgw.http.server import HTTPServer
from llmgw.runtime import GatewayRuntime

CLIENT_KEY = secret("client-key")
ADMIN_TOKEN = secret("admin-token")
MIB = 1024 * 1024


class Engine:
    """A vLLM-ish engine that checks ``Authorization: Bearer <key>`` and misbehaves on demand."""

    def __init__(self, name: str, key: str | None) -> None:
        self.name = name
        self.key = key
        self.refusal = 401
        self.mode = "ok"
        self.size = 3 * MIB
        self.hits = 0
        self.refused = 0
        self.server: HTTPServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = HTTPServer(self, name=self.name)
        _, self.port = await self.server.listen("127.0.0.1", 0)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close(1.0)

    def handle(self, req: Any, w: Any) -> Any:
        if req.path == b"/metrics":
            w.send(404, b"", ((b"content-type", b"text/plain"),))
            return None
        self.hits += 1
        got = req.authorization or b""
        if self.key is not None and got != b"Bearer " + self.key.encode():
            self.refused += 1
            # vLLM's refusal [engines.md V9]; a 403 as a key not allowed for the model
            w.send(self.refusal, b'{"error": "Unauthorized"}' if self.refusal == 401 else
                   b'{"error": {"message": "key not allowed", "type": "permission_error", "code": 403}}')
            return None
        body = orjson.loads(req.body) if req.body else {}
        mode = self.mode
        key = (self.key or "").encode()
        if mode == "error_words":
            # an ordinary error whose words happen to be inside the replica's key
            w.send(400, orjson.dumps({"error": {"message": "engine failure: the context length is 4096 tokens",
                                                "type": "BadRequestError", "code": 400}}))
            return None
        if mode == "echo_error":
            # an engine careless with what it holds and what it was sent
            msg = b"bad request from %s: key %s (starts %s...), user %s, token %s" % (
                got, key, key[:10], str(body.get("user")).encode(), ADMIN_TOKEN.encode()
            )
            w.send(400, orjson.dumps({"error": {"message": msg.decode(), "type": "BadRequestError", "code": 400}}))
            return None
        if mode == "echo_503":
            w.send(503, orjson.dumps({"error": {"message": f"overloaded ({key.decode()})", "code": 503}}))
            return None
        if mode == "echo_header":
            w.send(200, orjson.dumps({"served_by": self.name, "content": f"your key is {key.decode()}"}),
                   ((b"content-type", b"application/json"), (b"x-engine-key", b"k=" + key)))
            return None
        if mode in ("stream_echo", "stream_huge"):
            return self._stream(w, mode, key)
        if mode in ("big_cl", "cut_cl", "big_error"):
            return self._big_cl(w, mode)
        if mode in ("big_chunked", "cut_chunked"):
            return self._big_chunked(w, mode)
        w.send_json(200, {"object": "chat.completion", "served_by": self.name})
        return None

    def _payload(self) -> bytes:
        head = b'{"object":"list","data":['
        tail = b'],"usage":{"prompt_tokens":7,"completion_tokens":0,"total_tokens":7}}'
        fill = self.size - len(head) - len(tail)
        return head + b"1" + b",1" * ((fill - 1) // 2) + b" " * ((fill - 1) % 2) + tail

    async def _big_cl(self, w: Any, mode: str) -> None:
        data = self._payload()
        w.start(400 if mode == "big_error" else 200, [(b"content-type", b"application/json")], len(data))
        end = len(data) * 2 // 3 if mode == "cut_cl" else len(data)
        for i in range(0, end, 256 * 1024):
            w.write(data[i : min(i + 256 * 1024, end)])
            await w.drain()
        if mode == "cut_cl":
            w.abort()
            return
        w.end()

    async def _stream(self, w: Any, mode: str, key: bytes) -> None:
        w.start(200, [(b"content-type", b"text/event-stream")])
        w.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
        await w.drain()
        if mode == "stream_huge":  # one event that never ends: 256 KiB at a time
            w.write(b'data: {"choices":[{"delta":{"content":"')
            for _ in range(64):
                w.write(b"x" * (256 * 1024))
                await w.drain()
            w.end()
            return
        # an error event echoing the key, whole in one chunk; another split across three
        w.write(b'data: {"error":{"message":"bad auth header Bearer %s"}}\n\n' % key)
        await w.drain()
        event = b'data: {"error":{"message":"key %s refused","code":500}}\n\n' % key
        for part in (event[:20], event[20:30], event[30:]):
            w.write(part)
            await w.drain()
        for part in (b"data: [DONE]\n", b"\n"):  # (the blank line that ends it split between two reads)
            w.write(part)
            await w.drain()
        w.end()

    async def _big_chunked(self, w: Any, mode: str) -> None:
        data = self._payload()
        w.start(200, [(b"content-type", b"application/json")])
        end = len(data) * 2 // 3 if mode == "cut_chunked" else len(data)
        for i in range(0, end, 200 * 1024):
            w.write(data[i : min(i + 200 * 1024, end)])
            await w.drain()
        if mode == "cut_chunked":
            w.abort()
            return
        w.end()


def endpoint(e: Engine, key: str | None) -> dict[str, Any]:
    ep: dict[str, Any] = {"id": e.name, "url": f"http://127.0.0.1:{e.port}", "model": "m"}
    if key is not None:
        ep["api_key"] = key
    return ep


def config(engines: list[tuple[Engine, str | None]], **extra: Any) -> Any:
    return load(
        {
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "endpoints": [endpoint(e, k) for e, k in engines],
            "routing": {"strategy": "round_robin"},
            "upstream": {"first_byte_timeout": "2s", "read_timeout": "2s", "connect_timeout": "500ms"},
            "auth": {"api_keys": [{"name": "team", "key": CLIENT_KEY}]},
            "admin_token": ADMIN_TOKEN,
            **extra,
        }
    )


@contextlib.asynccontextmanager
async def running(engines: list[tuple[Engine, str | None]], **extra: Any) -> AsyncIterator[GatewayRuntime]:
    for e, _ in engines:
        await e.start()
    rt = GatewayRuntime(config(engines, **extra))
    await rt.start()
    try:
        yield rt
    finally:
        await rt.stop()
        for e, _ in engines:
            await e.stop()


async def fetch(
    port: int, body: bytes = b"", path: bytes = b"/v1/chat/completions", method: bytes = b"POST",
    headers: bytes = b"authorization: Bearer " + CLIENT_KEY.encode() + b"\r\n",
) -> tuple[int, dict[bytes, bytes], bytes, bool]:
    """One request on a fresh connection: (status, headers, body, whether the body was complete
    by its framing: the whole Content-Length, or the last chunk)."""
    if not body and method == b"POST":
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
    try:
        w.write(b"%s %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
                % (method, path, len(body), headers, body))
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {}
        for line in lines[1:]:
            if line:
                k, v = line.split(":", 1)
                hdrs[k.strip().lower().encode()] = v.strip().encode()
        if b"content-length" in hdrs:
            n = int(hdrs[b"content-length"])
            data = await asyncio.wait_for(r.read(n), 10)
            while len(data) < n:
                more = await asyncio.wait_for(r.read(n - len(data)), 10)
                if not more:
                    return status, hdrs, data, False
                data += more
            return status, hdrs, data, True
        assert hdrs.get(b"transfer-encoding") == b"chunked", hdrs
        parts: list[bytes] = []
        while True:
            size_line = await asyncio.wait_for(r.readline(), 10)
            if not size_line.endswith(b"\r\n"):
                return status, hdrs, b"".join(parts), False  # closed without the last chunk
            size = int(size_line.strip(), 16)
            if size == 0:
                await r.readline()
                return status, hdrs, b"".join(parts), True
            try:
                parts.append(await asyncio.wait_for(r.readexactly(size), 10))
                await r.readexactly(2)
            except asyncio.IncompleteReadError as exc:
                parts.append(exc.partial)
                return status, hdrs, b"".join(parts), False
    finally:
        w.close()


def admin(rt: GatewayRuntime) -> int:
    assert rt.admin_addr is not None
    return rt.admin_addr[1]


async def metric_value(rt: GatewayRuntime, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples with ``labels`` on the admin /metrics; None: no sample."""
    assert rt.admin_addr is not None
    _, _, text, _ = await fetch(rt.admin_addr[1], path=b"/metrics", method=b"GET", headers=b"")
    total = None
    for m in re.finditer(rb"^%s\{([^}]*)\} (\S+)$" % re.escape(name.encode()), text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1).decode()))
        if all(got.get(k) == v for k, v in labels.items()):
            total = (total or 0.0) + float(m.group(2))
    return total


def client(rt: GatewayRuntime) -> int:
    assert rt.listen_addr is not None
    return rt.listen_addr[1]


async def gauge(rt: GatewayRuntime, name: str, replica: str) -> float:
    _, _, text, _ = await fetch(admin(rt), path=b"/metrics", method=b"GET", headers=b"")
    m = re.search(rb"^%s\{[^}]*replica=\"%s\"[^}]*\} (\S+)$" % (name.encode(), replica.encode()), text, re.M)
    assert m is not None, (name, replica)
    return float(m.group(1))


async def replica_view(rt: GatewayRuntime, replica: str) -> dict[str, Any]:
    _, _, data, _ = await fetch(admin(rt), path=b"/admin/v1/endpoints", method=b"GET",
                                headers=b"authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n")
    doc = orjson.loads(data)
    eps = doc["endpoints"] if isinstance(doc, dict) else doc
    return next(e for e in eps if e["id"] == replica)


# -- a refused key --


@pytest.mark.parametrize("refusal", [401, 403])
async def test_refused_key_is_retried_elsewhere_and_the_replica_held(
    refusal: int, caplog: pytest.LogCaptureFixture
) -> None:
    bad, good = Engine("bad", secret("engine-key-bad")), Engine("good", secret("engine-key-good"))
    bad.refusal = refusal
    async with running([(bad, secret("stale-key-bad")), (good, secret("engine-key-good"))]) as rt:
        p = client(rt)
        assert await gauge(rt, "llmgw_endpoint_auth_failed", "bad") == 0  # seeded for every replica
        for _ in range(6):
            status, hdrs, body, _ = await fetch(p)
            assert status == 200, body
            assert hdrs[b"x-llmgw-replica"] == b"good"
        assert bad.hits == 1  # refused once, then out of routing (cooldown 5s)
        assert await gauge(rt, "llmgw_endpoint_auth_failed", "bad") == 1
        assert await gauge(rt, "llmgw_endpoint_auth_failed", "good") == 0
        # not the engine failing: its breaker counted nothing
        assert await gauge(rt, "llmgw_endpoint_breaker_open", "bad") == 0
        assert await gauge(rt, "llmgw_endpoint_consecutive_failures", "bad") == 0
        view = await replica_view(rt, "bad")
        assert view["state"] == "auth_failed" and view["auth_failed"] is True and view["breaker"] == "closed"
        assert view["usable"] is False
        status, _, data, _ = await fetch(admin(rt), path=b"/ready", method=b"GET", headers=b"")
        assert status == 200 and orjson.loads(data)["replicas_auth_failed"] == ["bad"]
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "refused the API key" in r.message]
        assert len(warnings) == 1 and "bad" in warnings[0].message


async def test_refused_key_without_another_replica_is_a_502() -> None:
    a = Engine("a", secret("engine-key-a"))
    async with running([(a, secret("stale-key-a"))]) as rt:
        status, hdrs, data, _ = await fetch(client(rt))
        assert status == 502
        err = orjson.loads(data)["error"]
        assert err["code"] == "upstream_auth_failed" and err["type"] == "server_error"
        assert "refused the API key" in err["message"] and MARK not in err["message"]
        assert hdrs[b"x-request-id"]
        assert hdrs[b"x-should-retry"] == b"false"  # the same request gets the same answer until the config changes
        status, _, data, _ = await fetch(admin(rt), path=b"/ready", method=b"GET", headers=b"")
        body = orjson.loads(data)
        assert status == 503 and body["models_unavailable"] == ["m"] and body["unavailable"] == {"m": {"a": "auth_failed"}}
        # held until its probe: the next request is told at once why (not queued), as one a retry cannot fix
        status, hdrs, data, _ = await fetch(client(rt))
        err = orjson.loads(data)["error"]
        assert status == 502 and err["code"] == "upstream_auth_failed" and hdrs[b"x-should-retry"] == b"false"
        assert "refuses the API key" in err["message"] and MARK not in err["message"]


async def test_refused_key_is_probed_each_cooldown_and_at_once_after_a_reload() -> None:
    a, b = Engine("a", secret("engine-key-a")), Engine("b", None)
    engines: list[tuple[Engine, str | None]] = [(a, secret("stale-key-a")), (b, None)]
    brk = {"cooldown": "1s", "max_cooldown": "1s"}
    async with running(engines, breaker=brk) as rt:
        p = client(rt)
        for _ in range(5):
            assert (await fetch(p))[0] == 200
        assert a.hits == 1 and a.refused == 1
        await asyncio.sleep(1.05)  # (the cooldown is what is tested: one probe when it has passed)
        for _ in range(5):
            assert (await fetch(p))[0] == 200
        assert a.hits == 2 and a.refused == 2  # one probe, refused again: still held
        assert await gauge(rt, "llmgw_endpoint_auth_failed", "a") == 1
        # a reload that leaves the key alone keeps the hold
        rt.reload(config(engines, breaker={**brk, "failures": 3}))
        for _ in range(3):
            assert (await fetch(p))[0] == 200
        assert a.hits == 2 and await gauge(rt, "llmgw_endpoint_auth_failed", "a") == 1
        # a reload that changes the key: probed at once, accepted, back in routing
        fixed: list[tuple[Engine, str | None]] = [(a, secret("engine-key-a")), (b, None)]
        rt.reload(config(fixed, breaker={**brk, "failures": 3}))
        served = set()
        for _ in range(4):
            status, hdrs, _, _ = await fetch(p)
            assert status == 200
            served.add(hdrs[b"x-llmgw-replica"])
        assert served == {b"a", b"b"} and a.refused == 2
        assert await gauge(rt, "llmgw_endpoint_auth_failed", "a") == 0


async def test_a_probe_that_is_answered_clears_the_hold(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.upstream")
    a, b = Engine("a", secret("engine-key-a")), Engine("b", None)
    async with running([(a, secret("engine-key-a")), (b, None)], breaker={"cooldown": "200ms"}) as rt:
        p = client(rt)
        a.key = secret("rotated-key-a")  # the engine's key changed under the gateway
        for _ in range(4):
            assert (await fetch(p))[0] == 200
        assert a.refused >= 1 and await gauge(rt, "llmgw_endpoint_auth_failed", "a") == 1
        a.key = secret("engine-key-a")  # ... and back
        await asyncio.sleep(0.25)
        served = set()
        for _ in range(4):
            served.add((await fetch(p))[1][b"x-llmgw-replica"])
        assert b"a" in served
        assert await gauge(rt, "llmgw_endpoint_auth_failed", "a") == 0
        view = await replica_view(rt, "a")
        assert view["state"] != "auth_failed" and view["auth_failed"] is False and view["breaker"] == "closed"
        assert any("accepts the gateway's API key again" in r.message for r in caplog.records)


# -- secrets an engine would leak --


async def test_secrets_in_an_engine_error_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="llmgw")
    key = secret("engine-key-a")
    a = Engine("a", key)
    a.mode = "echo_error"
    async with running([(a, key)]) as rt:
        body = orjson.dumps({"model": "m", "messages": [], "user": CLIENT_KEY})
        status, _, data, _ = await fetch(client(rt), body)
        assert status == 400
        message = orjson.loads(data)["error"]["message"]
        assert MARK not in message and "canary" not in message
        assert message.count("[redacted]") >= 5, message  # the key, twice; its first 10 bytes; the client key; the token
        a.mode = "echo_503"  # retried, logged at debug with the engine's message, then answered
        status, _, data, _ = await fetch(client(rt))
        assert status == 503 and "[redacted]" in orjson.loads(data)["error"]["message"]
        assert any("[redacted]" in r.getMessage() for r in caplog.records if r.name == "llmgw.upstream")
        a.mode = "echo_header"
        status, hdrs, data, _ = await fetch(client(rt))
        assert status == 200 and hdrs[b"x-engine-key"] == b"k=[redacted]"
        assert orjson.loads(data)["content"] == "your key is [redacted]"  # (an answer's body too)


async def test_words_inside_a_replica_key_stay_in_its_errors() -> None:
    key = secret("engine-key-a")  # ("engine" is inside it: not a piece an engine shows of a key)
    a = Engine("a", key)
    a.mode = "error_words"
    async with running([(a, key)]) as rt:
        status, _, data, _ = await fetch(client(rt))
        assert status == 400
        assert orjson.loads(data)["error"]["message"] == "engine failure: the context length is 4096 tokens"


async def test_a_streamed_error_event_echoing_the_replicas_key_is_redacted() -> None:
    key = secret("engine-key-a")
    a = Engine("a", key)
    a.mode = "stream_echo"
    async with running([(a, key)]) as rt:
        for _ in range(2):  # (and on the reused connection)
            status, hdrs, data, complete = await fetch(client(rt), orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}))
            assert status == 200 and complete and hdrs[b"content-type"] == b"text/event-stream"
            assert MARK_BYTES not in data and data.count(b"[redacted]") == 2, data
            assert data.startswith(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
            assert data.endswith(b'"code":500}}\n\ndata: [DONE]\n\n')


async def test_an_sse_event_that_never_ends_is_cut_at_the_buffer_limit() -> None:
    """Memory per stream stays bounded (upstream.max_buffered_body), and each read is scanned once."""
    a = Engine("a", None)
    a.mode = "stream_huge"
    async with running([(a, None)], upstream={"max_buffered_body": "1MiB"}) as rt:
        t0 = time.monotonic()
        status, _, data, complete = await fetch(client(rt), orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}))
        assert status == 200 and complete  # (the stream's framing ended cleanly)
        assert time.monotonic() - t0 < 5.0
        first, _, rest = data.partition(b"\n\n")
        assert first == b'data: {"choices":[{"delta":{"content":"hi"}}]}'
        err = orjson.loads(rest.strip()[len(b"data: "):])["error"]
        assert err["code"] == "upstream_bad_response" and "max_buffered_body" in err["message"], err
        assert len(data) < 4096  # (the event's start never reached the client)
        assert await metric_value(rt, "llmgw_upstream_errors_total", replica="a", kind="bad_response") == 1
        assert all(ep.inflight == 0 for ep in rt.registry.endpoints.values())  # type: ignore[union-attr]
        a.mode = "ok"
        assert (await fetch(client(rt)))[0] == 200


def test_redact_whole_pieces_and_digests() -> None:
    import hashlib

    k = b"sk-abcdef0123456789"
    digests = {hashlib.sha256(b"client-xyz").digest()}
    out = redact(b'{"m": "key sk-abcdef0123456789, %s..., url ?key=client-xyz, ok"}' % k[:8], [k], digests)
    assert out == b'{"m": "key [redacted], [redacted]..., url ?key=[redacted], ok"}'
    assert redact(b"nothing here", [k], digests) == b"nothing here"
    assert redact(b"a b", [b"b"]) == b"a [redacted]"  # a short secret: as a whole token only
    assert redact(b"abc", [b"b"]) == b"abc"
    # pieces: those that begin or end the key (a key shown in part), or from inside it when
    # long or with a digit; never a word that happens to be inside a key made of words
    words = b"maximum-context-length-2025"
    text = b"This model's maximum context length is 4096 tokens; reduce the length of the messages"
    assert redact(text, [words], (), [words]) == text.replace(b"maximum", b"[redacted]")
    assert redact(text, [words], (), ()) == text  # another replica's key: whole only
    assert redact(b"simulated engine failure", [b"enginesecret"], (), ()) == b"simulated engine failure"
    assert redact(b"bad key sk-abcd...456789 (ef0123)", [k], (), [k]) == b"bad key [redacted]...[redacted] ([redacted])"
    assert redact(b"x abcdef0123456 y", [k], (), [k]) == b"x [redacted] y"


def test_config_secrets_cover_every_plain_secret() -> None:
    cfg = load(
        {
            "endpoints": [{"id": "a", "url": "http://127.0.0.1:1", "model": "m", "api_key": secret("ep")}],
            "admin_token": secret("admin"),
            "control": {"listen": "127.0.0.1:1", "join_token": [secret("join1"), secret("join2")],
                        "router_token": secret("router")},
        }
    )
    assert set(config_secrets(cfg)) == {secret(x).encode() for x in ("ep", "admin", "join1", "join2", "router")}
    followed = load({"follow": {"control": "127.0.0.1:1", "token": secret("follow")}})
    assert config_secrets(followed) == (secret("follow").encode(),)


def test_the_canary_watch_fails_a_leak(canary_leaks: list[str]) -> None:
    """The suite-wide watch (tests/conftest.py) is real: a leaked canary is noted."""
    logging.getLogger("llmgw.upstream").warning("oops %s", secret("leaked"))
    assert len(canary_leaks) == 1 and "llmgw.upstream" in canary_leaks[0]

    async def read() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"HTTP/1.1 200 OK\r\n\r\n" + secret("leaked").encode())
    asyncio.run(read())
    assert len(canary_leaks) == 2 and "test client read" in canary_leaks[1]


# -- answers too large to buffer --


@pytest.mark.parametrize("mode", ["big_cl", "big_chunked"])
async def test_a_large_answer_is_relayed_with_its_framing(mode: str) -> None:
    a = Engine("a", None)
    a.mode = mode
    async with running([(a, None)], upstream={"max_buffered_body": "1MiB"}) as rt:
        for _ in range(2):  # (and on the reused connection)
            status, hdrs, data, complete = await fetch(client(rt))
            assert status == 200 and complete
            assert data == a._payload()
            if mode == "big_cl":
                assert hdrs[b"content-length"] == b"%d" % a.size
            else:
                assert hdrs[b"transfer-encoding"] == b"chunked"
            assert hdrs[b"x-llmgw-replica"] == b"a"
        assert all(ep.inflight == 0 for ep in rt.registry.endpoints.values())  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["cut_cl", "cut_chunked"])
async def test_a_large_answer_cut_stays_visibly_incomplete(mode: str) -> None:
    a = Engine("a", None)
    a.mode = mode
    async with running([(a, None)], upstream={"max_buffered_body": "1MiB"}) as rt:
        status, hdrs, data, complete = await fetch(client(rt))
        assert status == 200 and not complete
        assert 1 * MIB < len(data) < a.size
        if mode == "cut_cl":
            assert hdrs[b"content-length"] == b"%d" % a.size  # the engine's promise, kept visible
        a.mode = "ok"
        assert (await fetch(client(rt)))[0] == 200  # the replica is still served after one cut


async def test_an_answer_under_the_limit_cut_is_a_502_never_a_short_200() -> None:
    a = Engine("a", None)
    a.mode = "cut_cl"
    a.size = 600 * 1024
    async with running([(a, None)], upstream={"max_buffered_body": "1MiB"}, retries={"attempts": 0}) as rt:
        status, hdrs, data, complete = await fetch(client(rt))
        assert status == 502 and complete and orjson.loads(data)["error"]["code"] == "bad_gateway"
        assert hdrs[b"x-llmgw-replica"] == b"a"  # (the gateway's answer about a replica's attempt names it)


async def test_an_error_answer_over_the_limit_is_a_502() -> None:
    a = Engine("a", None)
    a.mode = "big_error"
    async with running([(a, None)], upstream={"max_buffered_body": "1MiB"}, retries={"attempts": 0}) as rt:
        status, _, data, _ = await fetch(client(rt))
        assert status == 502 and "larger than" in orjson.loads(data)["error"]["message"]


def test_the_canary_watch_sees_what_processes_print(canary_leaks: list[str]) -> None:
    """Output a test captured from a process (llmgw's CLI, serve, an agent) is watched too."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", f"print({secret('printed')!r})"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0 and len(canary_leaks) == 1 and "output of" in canary_leaks[0]
    p = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stderr.write({secret('stderr')!r})"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.communicate(timeout=30)
    assert len(canary_leaks) == 2
