"""The scrape poller against live metrics pages on 127.0.0.1."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from canary import secret
from llmgw.admin.manage import endpoint_state
from llmgw.config import load
from llmgw.fleet.poller import Poller
from llmgw.fleet.registry import EngineUnavailable, Registry
from llmgw.http.server import HTTPServer

VLLM_PAGE = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="other"} 50.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""

LLAMA_PAGE = b"""# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""


class MetricsServer:
    def __init__(self) -> None:
        self.page = VLLM_PAGE
        self.status = 200
        self.error_body = b"not found"  # what it answers with a status other than 200
        self.key: bytes | None = None
        self.hits = 0
        self.auth_seen: list[bytes | None] = []
        self.accept_seen: list[bytes | None] = []
        self.server: HTTPServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = HTTPServer(self)
        _, self.port = await self.server.listen("127.0.0.1", 0)

    def handle(self, req: Any, w: Any) -> None:
        self.hits += 1
        self.auth_seen.append(req.authorization)
        self.accept_seen.append(req.header(b"accept"))
        if self.key is not None and req.authorization != b"Bearer " + self.key:
            w.send(401, b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}')
            return
        w.send(self.status, self.page if self.status == 200 else self.error_body, ((b"content-type", b"text/plain"),))


async def _setup(server: MetricsServer, **ep: Any) -> tuple[Registry, Poller]:
    await server.start()
    cfg = load(
        {
            "scrape": {"interval": "50ms", "timeout": "40ms", "stale_after": "300ms"},
            "endpoints": [{"id": "r0", "url": f"http://127.0.0.1:{server.port}", "model": "m", **ep}],
        }
    )
    reg = Registry(cfg)
    poller = Poller(reg, cfg.scrape)
    poller.sync()
    return reg, poller


async def _teardown(srv: MetricsServer, reg: Registry, poller: Poller) -> None:
    await poller.close()
    reg.close()
    assert srv.server is not None
    await srv.server.close(1)


async def _until(pred: Any, timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_vllm_scrape_sums_engines_and_filters_model() -> None:
    srv = MetricsServer()
    reg, poller = await _setup(srv, engine="vllm")
    ep = reg.endpoints["r0"]
    try:
        assert ep.stale and ep.fresh() == (None, None, None)  # before any scrape: absent
        await _until(lambda: ep.last_scrape is not None)
        assert ep.fresh() == (2.0, 4.0, 0.25)
        assert not ep.stale
        assert b"text/plain;version=0.0.4" in (srv.accept_seen[-1] or b"")
        # keep-alive: many scrapes, one connection
        await _until(lambda: srv.hits >= 4)
        assert ep.pool.open_connections == 1
    finally:
        await _teardown(srv, reg, poller)


async def test_llamacpp_scrape_uses_key_and_kv_is_absent() -> None:
    srv = MetricsServer()
    srv.page = LLAMA_PAGE
    srv.key = secret("sekret").encode()
    reg, poller = await _setup(srv, engine="llamacpp", api_key=secret("sekret"))
    ep = reg.endpoints["r0"]
    try:
        await _until(lambda: ep.last_scrape is not None)
        assert ep.fresh() == (5.0, 2.0, None)  # no KV gauge on llama.cpp: absent, never 0
        assert srv.auth_seen[-1] == b"Bearer " + secret("sekret").encode()
    finally:
        await _teardown(srv, reg, poller)


@pytest.mark.parametrize("status", [404, 500, 501])
async def test_a_404_warns_once_and_leaves_the_replica_blind(caplog: pytest.LogCaptureFixture, status: int) -> None:
    # (501: llama-server without --metrics; blind, routed on the router's own counts)
    srv = MetricsServer()
    reg, poller = await _setup(srv, engine="vllm")
    ep = reg.endpoints["r0"]
    caplog.set_level(logging.DEBUG, logger="llmgw.scrape")
    try:
        await _until(lambda: ep.last_scrape is not None)
        srv.status = status
        hits = srv.hits
        await _until(lambda: srv.hits >= hits + 5)
        # up but telling nothing: fresh and blind, never 0s and never "full"
        assert not ep.stale
        assert ep.fresh() == (None, None, None)
        assert ep.usable and not ep.down and endpoint_state(ep) == "ok"
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "r0" in warnings[0].getMessage() and f"HTTP {status}" in warnings[0].getMessage()
        srv.status = 200
        await _until(lambda: ep.fresh() == (2.0, 4.0, 0.25))
        infos = [r for r in caplog.records if r.levelno == logging.INFO and "readable again" in r.getMessage()]
        assert len(infos) == 1
    finally:
        await _teardown(srv, reg, poller)


async def test_goes_stale_when_the_replica_is_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    srv = MetricsServer()
    reg, poller = await _setup(srv, engine="vllm")
    ep = reg.endpoints["r0"]
    caplog.set_level(logging.DEBUG, logger="llmgw.scrape")
    try:
        await _until(lambda: ep.last_scrape is not None)
        assert srv.server is not None
        await srv.server.close(1)
        await _until(lambda: ep.stale)
        assert ep.fresh() == (None, None, None)  # stale numbers are never used as fresh
        assert ep.scrape_failures > 0
        # an ordinary outage stays at debug
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        await poller.close()
        reg.close()


async def test_missing_metrics_are_named_once(caplog: pytest.LogCaptureFixture) -> None:
    srv = MetricsServer()
    srv.page = b"# TYPE something_else gauge\nsomething_else 1\n"
    caplog.set_level(logging.WARNING, logger="llmgw.scrape")
    reg, poller = await _setup(srv, engine="llamacpp")
    ep = reg.endpoints["r0"]
    try:
        await _until(lambda: srv.hits >= 5)
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(msgs) == 1, msgs
        assert "llamacpp:requests_deferred" in msgs[0] and "llamacpp:requests_processing" in msgs[0]
        assert ep.fresh() == (None, None, None)
    finally:
        await _teardown(srv, reg, poller)


LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


async def test_a_loading_llama_server_takes_nothing_until_its_scrape_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # llama-server answers /metrics (and everything) 503 "Loading model" while it loads its model
    # (engines.md §2.2): not usable, "loading" where people look, logged once each way
    srv = MetricsServer()
    srv.page = LLAMA_PAGE
    srv.status = 503
    srv.error_body = LOADING
    caplog.set_level(logging.DEBUG, logger="llmgw.scrape")
    reg, poller = await _setup(srv, engine="llamacpp")
    ep = reg.endpoints["r0"]
    pool = reg.pools["m"]
    try:
        await _until(lambda: srv.hits >= 1 and ep.down)
        hits = srv.hits
        await _until(lambda: srv.hits >= hits + 5)  # (it says so for good: still out, logged once)
        now = time.monotonic()
        assert ep.down and not ep.unreachable and not ep.usable
        assert ep.unusable_reason(now) == "loading" and endpoint_state(ep) == "loading"
        assert isinstance(ep.scrape_problem, EngineUnavailable) and "Loading model" in ep.scrape_problem
        assert pool.pick(now, 0.3) is None
        why = pool.unavailable(now)  # every replica loading: the pool is down (503 model_unavailable)
        assert why is not None and sum(why[0].values()) == 1 and 0 < why[1] <= 0.05
        msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert len(msgs) == 1 and "r0" in msgs[0] and "is loading" in msgs[0] and "Loading model" in msgs[0], msgs
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        # loaded: the first good scrape routes to it again
        srv.status = 200
        await _until(lambda: ep.usable)
        assert ep.fresh() == (5.0, 2.0, None) and ep.scrape_problem is None
        assert ep.unusable_reason(time.monotonic()) is None and endpoint_state(ep) == "ok"
        assert pool.pick(time.monotonic(), 0.3) is ep
        msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        assert len(msgs) == 2 and "ready" in msgs[1] and "was loading" in msgs[1], msgs
        # and when it answers 503 again (a restart that loads again), out again
        srv.status = 503
        await _until(lambda: not ep.usable)
        assert endpoint_state(ep) == "loading"
    finally:
        await _teardown(srv, reg, poller)


async def test_a_503_that_is_not_loading_is_unavailable_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    srv = MetricsServer()
    caplog.set_level(logging.DEBUG, logger="llmgw.scrape")
    reg, poller = await _setup(srv, engine="vllm")
    ep = reg.endpoints["r0"]
    try:
        await _until(lambda: ep.last_scrape is not None)
        srv.status = 503
        srv.error_body = b"Service Unavailable"
        await _until(lambda: not ep.usable)
        hits = srv.hits
        await _until(lambda: srv.hits >= hits + 5)
        assert endpoint_state(ep) == "unavailable"
        assert ep.unusable_reason(time.monotonic()) == "unavailable"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "HTTP 503" in warnings[0] and "Service Unavailable" in warnings[0], warnings
        srv.status = 200
        await _until(lambda: ep.usable)
        assert ep.fresh() == (2.0, 4.0, 0.25)
    finally:
        await _teardown(srv, reg, poller)


async def test_a_scrape_timing_out_while_loading_keeps_it_out() -> None:
    # a loading engine whose scrape then times out has not said it is ready
    srv = MetricsServer()
    srv.page = LLAMA_PAGE
    srv.status = 503
    srv.error_body = LOADING
    reg, poller = await _setup(srv, engine="llamacpp")
    ep = reg.endpoints["r0"]
    try:
        await _until(lambda: ep.down)
        assert srv.server is not None
        hang = asyncio.Event()
        answer = srv.handle

        def slow(req: Any, w: Any) -> Any:
            async def later() -> None:
                await hang.wait()
                answer(req, w)
            return later()

        srv.handle = slow  # type: ignore[method-assign]
        fails = ep.scrape_failures
        await _until(lambda: ep.scrape_failures >= fails + 2)
        assert ep.down and not ep.usable and endpoint_state(ep) == "loading"
        hang.set()
    finally:
        await _teardown(srv, reg, poller)


async def test_metrics_for_another_model_name_say_so(caplog: pytest.LogCaptureFixture) -> None:
    # vLLM served under another --served-model-name: the gauges are there, for "m", not for "chat"
    srv = MetricsServer()
    caplog.set_level(logging.WARNING, logger="llmgw.scrape")
    await srv.start()
    cfg = load({
        "scrape": {"interval": "50ms", "timeout": "40ms", "stale_after": "300ms"},
        "endpoints": [{"id": "r0", "url": f"http://127.0.0.1:{srv.port}", "model": "chat", "engine": "vllm"}],
    })
    reg = Registry(cfg)
    poller = Poller(reg, cfg.scrape)
    poller.sync()
    try:
        await _until(lambda: srv.hits >= 5)
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(msgs) == 1, msgs
        msg = msgs[0]
        assert "lacks" not in msg
        assert "vllm:num_requests_running" in msg and "model_name 'm', 'other'" in msg and "'chat'" in msg, msg
        assert "models.chat.upstream_name" in msg and "--served-model-name chat" in msg, msg
        assert "--disable-log-stats" not in msg
    finally:
        await _teardown(srv, reg, poller)


async def test_missing_gauges_say_what_the_engine_needs(caplog: pytest.LogCaptureFixture) -> None:
    # trtllm-serve with return_perf_metrics but not enable_iter_perf_stats: histograms, no gauges
    srv = MetricsServer()
    srv.page = (b'# TYPE trtllm_time_to_first_token_seconds histogram\n'
                b'trtllm_time_to_first_token_seconds_count{engine_type="undefined",model_name="undefined"} 4.0\n')
    caplog.set_level(logging.WARNING, logger="llmgw.scrape")
    reg, poller = await _setup(srv, engine="trtllm")
    try:
        await _until(lambda: srv.hits >= 3)
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(msgs) == 1, msgs
        assert "lacks trtllm_kv_cache_utilization, trtllm_num_requests_running, trtllm_num_requests_waiting" in msgs[0]
        assert "enable_iter_perf_stats: true" in msgs[0], msgs[0]
    finally:
        await _teardown(srv, reg, poller)


async def test_metric_name_overrides() -> None:
    srv = MetricsServer()
    srv.page = b"my_queue 7\nmy_running 1\n"
    reg, poller = await _setup(
        srv, engine="generic", metric_names={"waiting": "my_queue", "running": ["my_running"]}
    )
    ep = reg.endpoints["r0"]
    try:
        await _until(lambda: ep.last_scrape is not None)
        assert ep.fresh() == (7.0, 1.0, None)
    finally:
        await _teardown(srv, reg, poller)


async def test_sync_follows_the_endpoint_list() -> None:
    srv = MetricsServer()
    reg, poller = await _setup(srv, engine="vllm")
    try:
        assert poller.task_count == 1
        reg.remove("r0")
        poller.sync()
        assert poller.task_count == 0
    finally:
        await _teardown(srv, reg, poller)


async def test_external_endpoints_are_not_scraped() -> None:
    cfg = load({"endpoints": [{"id": "x", "url": "http://127.0.0.1:9", "model": "m", "engine": "external"}]})
    reg = Registry(cfg)
    poller = Poller(reg, cfg.scrape)
    poller.sync()
    assert poller.task_count == 0
    assert not reg.endpoints["x"].stale
    await poller.close()
    reg.close()


# -- a pooled connection the replica closed: llmgw.http.keepalive's rule -----------


class ClosingServer:
    """Answers each connection's first request; what it does with the second is ``then``."""

    def __init__(self, then: str) -> None:
        self.then = then  # "close" (unanswered), "garbage" (a malformed answer), "answer"
        self.connections = 0
        self.requests = 0
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                n += 1
                if n == 2 and self.then == "close":
                    break
                if n == 2 and self.then == "garbage":
                    writer.write(b"HTTP/1.1 2x0 what\r\n\r\n")
                    await writer.drain()
                    break
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(VLLM_PAGE), VLLM_PAGE))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def _closing_endpoint(then: str) -> tuple[ClosingServer, Registry]:
    srv = ClosingServer(then)
    await srv.start()
    cfg = load({"endpoints": [{"id": "r0", "url": f"http://127.0.0.1:{srv.port}", "model": "m"}]})
    return srv, Registry(cfg)


async def test_scrape_on_a_closed_pooled_connection_goes_again_on_a_new_one() -> None:
    from llmgw.fleet.poller import scrape_once

    srv, reg = await _closing_endpoint("close")
    try:
        ep = reg.endpoints["r0"]
        assert await scrape_once(ep, 2.0) == (200, VLLM_PAGE)
        # the second goes out on the pooled connection, which the replica drops unanswered
        assert await scrape_once(ep, 2.0) == (200, VLLM_PAGE)
        assert (srv.connections, srv.requests) == (2, 3)
    finally:
        reg.close()
        await srv.close()


async def test_scrape_a_malformed_answer_on_a_pooled_connection_is_not_sent_again() -> None:
    from llmgw.fleet.poller import scrape_once

    srv, reg = await _closing_endpoint("garbage")
    try:
        ep = reg.endpoints["r0"]
        assert await scrape_once(ep, 2.0) == (200, VLLM_PAGE)
        with pytest.raises(ConnectionError):
            await scrape_once(ep, 2.0)  # the replica answered (badly): it saw the request
        assert (srv.connections, srv.requests) == (1, 2)
    finally:
        reg.close()
        await srv.close()


async def test_the_first_scrapes_come_at_once_whatever_the_interval() -> None:
    """QA: with ``interval: 30s`` the first scrape came at a random point of the first 30 s; until then the
    replica was stale, its pool full to admission, and a request to a healthy idle engine waited for it
    (429 queue_timeout). Now each replica's first scrape comes within FIRST_SPREAD_S of a start, and the
    second one at a random point of the interval (the phases spread as before)."""
    servers = [MetricsServer() for _ in range(8)]
    for s in servers:
        await s.start()
    cfg = load({
        "scrape": {"interval": "30s", "timeout": "2s", "stale_after": "90s"},
        "endpoints": [{"id": f"r{i}", "url": f"http://127.0.0.1:{s.port}", "model": "m"} for i, s in enumerate(servers)],
    })
    reg = Registry(cfg)
    poller = Poller(reg, cfg.scrape)
    t0 = time.monotonic()
    poller.sync()
    try:
        deadline = t0 + 5.0
        # (a server counts the request as it arrives; the scrape is recorded once its answer is read)
        while time.monotonic() < deadline and not all(ep.last_scrape is not None for ep in reg.endpoints.values()):
            await asyncio.sleep(0.01)
        took = time.monotonic() - t0
        assert all(s.hits >= 1 for s in servers), [s.hits for s in servers]
        assert all(ep.last_scrape is not None for ep in reg.endpoints.values())
        assert took < 2.0, took
        assert not any(ep.state.stale(time.monotonic(), cfg.scrape.stale_after) for ep in reg.endpoints.values())
    finally:
        await poller.close()
        reg.close()
        for s in servers:
            assert s.server is not None
            await s.server.close(1)


async def test_what_an_engine_echoes_of_its_key_is_not_said(caplog: pytest.LogCaptureFixture) -> None:
    """An engine that echoes the Authorization it got, in its metrics' model label or in a 503's body: what
    llmgw says of the scrape (logged, and in the admin API's scrape problem) has the key redacted."""
    key = "sk-echoed-key-8c41f0a9"
    srv = MetricsServer()
    srv.key = key.encode()
    srv.page = VLLM_PAGE.replace(b'model_name="m"', b'model_name="Bearer ' + srv.key + b'"')
    caplog.set_level(logging.INFO, logger="llmgw.scrape")
    reg, poller = await _setup(srv, engine="vllm", api_key=key)
    ep = reg.endpoints["r0"]
    try:
        await _until(lambda: ep.scrape_problem is not None)
        assert "model_name 'Bearer [redacted]'" in ep.scrape_problem, ep.scrape_problem
        srv.status, srv.error_body = 503, b'{"error": "not ready, caller Bearer ' + srv.key + b'"}'
        await _until(lambda: isinstance(ep.scrape_problem, EngineUnavailable))
        assert "[redacted]" in ep.scrape_problem, ep.scrape_problem
        said = caplog.text + str(ep.scrape_problem)
        assert key not in said and "8c41f0a9" not in said, said
    finally:
        await _teardown(srv, reg, poller)
