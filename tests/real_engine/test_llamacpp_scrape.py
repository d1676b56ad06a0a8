"""The scrape poller and the circuit breaker against real llama.cpp replicas.

What these tests take as the poller's and breaker's contract (the registry's
documented state, ``fleet/registry.py``):

* the poller fills ``Endpoint.waiting`` / ``running`` from ``llamacpp:requests_deferred``
  / ``llamacpp:requests_processing`` (read with the replica's key) and leaves
  ``kv_cache_usage`` at ``None`` (llama-server has no KV gauge); a failed scrape
  sets ``Endpoint.scrape_problem`` (and warns once); the admin page exports what the registry holds;
* it polls at its default interval (``scrape.interval``, 1 s);
* the breaker (``Endpoint.breaker_state``: closed, open, half-open) opens after
  ``breaker.failures`` consecutive failures, stops the router from trying that
  replica, and closes when a probe after ``breaker.cooldown`` succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from llmgw.fleet.registry import Endpoint
from llmgw.testing.llamacpp import LlamaServer

from .conftest import MODEL, PARALLEL, Fleet, http_request, prom_samples, run_fleet, wait_idle

pytestmark = pytest.mark.real_engine

MESSAGES: Any = [{"role": "user", "content": "Say something."}]
# Generous bounds: the poller's interval is its own default.
SCRAPED_WITHIN = 5.0
BREAKER_OPENS_WITHIN = 5.0
BREAKER_CLOSES_WITHIN = 15.0


async def wait_for(cond: Callable[[], bool], timeout: float, what: str, poke: Any = None) -> float:
    """Poll ``cond`` until true (``AssertionError`` naming ``what`` after ``timeout``); returns the wait."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        if poke is not None:
            await poke()
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def endpoints(fleet: Fleet) -> dict[str, Endpoint]:
    assert fleet.rt.registry is not None
    return fleet.rt.registry.endpoints


async def test_scrape_reads_llamacpp_queue_with_the_key(fleet: Fleet) -> None:
    eps = endpoints(fleet)
    await wait_for(
        lambda: all(ep.running is not None and ep.waiting is not None for ep in eps.values()),
        SCRAPED_WITHIN,
        "the poller read llamacpp:requests_processing/requests_deferred from both replicas "
        f"(state: {[(ep.id, ep.running, ep.waiting, ep.scrape_problem) for ep in eps.values()]})",
    )
    for ep in eps.values():
        assert ep.running == 0 and ep.waiting == 0
        assert ep.scrape_problem is None
        # llama-server has no KV-cache gauge: absent, never 0.
        assert ep.kv_cache_usage is None
        assert ep.last_scrape is not None
    page = await fleet.admin_metrics()
    assert set(prom_samples(page, "llmgw_endpoint_running")) == {"ls0", "ls1"}
    assert set(prom_samples(page, "llmgw_endpoint_waiting")) == {"ls0", "ls1"}
    assert prom_samples(page, "llmgw_endpoint_kv_cache_usage") == {}


async def test_scrape_with_a_wrong_key_is_an_error_not_zero(replicas: list[LlamaServer]) -> None:
    """llama-server's /metrics is behind --api-key: a wrong key gives no numbers, and says so."""
    wrong = [LlamaServer(r.binary, r.model, port=r.port, api_key="wrong") for r in replicas[:1]]
    async with run_fleet(wrong) as fleet:
        ep = endpoints(fleet)["ls0"]
        await wait_for(lambda: ep.scrape_problem is not None, SCRAPED_WITHIN, "a scrape error for a wrong key")
        assert ep.running is None and ep.waiting is None
        assert "wrong" not in (ep.scrape_problem or "")
        page = await fleet.admin_metrics()
        assert prom_samples(page, "llmgw_endpoint_running") == {}


async def test_scrape_warns_once_when_metrics_are_off(make_replica: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="llmgw.scrape")
    server = await make_replica(metrics=False)
    async with run_fleet([server]) as fleet:
        ep = endpoints(fleet)["ls0"]

        def warnings() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name.startswith("llmgw.scrape") and r.levelno >= logging.WARNING]

        await wait_for(lambda: bool(warnings()), SCRAPED_WITHIN, "a warning about the missing metrics")
        await asyncio.sleep(2.5)  # several more scrapes: still one warning
        found = warnings()
        assert len(found) == 1, [r.getMessage() for r in found]
        message = found[0].getMessage()
        assert "llamacpp:requests_processing" in message and "llamacpp:requests_deferred" in message, message
        assert "--metrics" in message, message
        assert ep.running is None and ep.waiting is None and ep.kv_cache_usage is None
        # Requests are still served: the replica is routed to blind.
        status, headers, _ = await http_request(
            fleet.addr, "POST", "/v1/chat/completions",
            orjson.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4}),
        )
        assert status == 200 and headers["x-llmgw-replica"] == "ls0"


async def test_admin_metrics_show_the_engines_real_queues(replicas: list[LlamaServer]) -> None:
    """Under 16 concurrent long streams the admin page reports each engine's own queue.

    The load comes from raw connections (lighter than the OpenAI client, which
    shares this event loop with the gateway) and the poller runs every 250 ms.
    """
    await wait_idle(replicas)
    n = 16
    async with run_fleet(replicas, scrape={"interval": "250ms"}) as fleet:
        eps = endpoints(fleet)
        await wait_for(lambda: all(ep.running is not None for ep in eps.values()), SCRAPED_WITHIN, "a first scrape")
        admin_waiting: dict[str, float] = {}
        admin_running: dict[str, float] = {}
        engine_deferred: dict[str, float] = {}
        stop = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                page = await fleet.admin_metrics()
                for store, name in ((admin_waiting, "llmgw_endpoint_waiting"), (admin_running, "llmgw_endpoint_running")):
                    for rep, v in prom_samples(page, name).items():
                        store[rep] = max(store.get(rep, 0.0), v)
                for i, s in enumerate(replicas):
                    m = await s.metrics_async()
                    rep = f"ls{i}"
                    engine_deferred[rep] = max(engine_deferred.get(rep, 0.0), m.get("llamacpp:requests_deferred", 0.0))
                await asyncio.sleep(0.05)

        body = orjson.dumps({"model": MODEL, "prompt": "a long story", "max_tokens": 600, "stream": True})

        async def one() -> None:
            status, _, payload = await http_request(fleet.addr, "POST", "/v1/completions", body, timeout=60)
            assert status == 200 and payload.rstrip().endswith(b"data: [DONE]"), payload[-200:]

        watcher = asyncio.create_task(watch())
        try:
            await asyncio.gather(*(one() for _ in range(n)))
        finally:
            stop.set()
            await watcher
        failed = {ep.id: ep.scrape_failures for ep in eps.values()}
        for rep in ("ls0", "ls1"):
            assert engine_deferred[rep] >= 2, engine_deferred
            # The engine's queue (at most 8 - 2 here), not llmgw's 8 in flight.
            assert 1 <= admin_waiting.get(rep, 0) <= n // 2 - PARALLEL, (admin_waiting, engine_deferred, failed)
            assert admin_running.get(rep) == PARALLEL, (admin_running, failed)


async def test_scrapes_survive_streams_closing_connections(replicas: list[LlamaServer]) -> None:
    """llama-server closes its connection after every streamed answer; scrapes must not fail because of it.

    The gateway returns that connection to the pool when the last chunk arrives;
    the engine's FIN follows a moment later. A scrape that takes it in between
    must retry on a fresh connection (as the data path does), not fail. Scrapes
    run back to back here (``scrape_once``, the poller's single scrape) so that
    every such moment is hit.
    """
    from llmgw.fleet.poller import scrape_once

    await wait_idle(replicas)
    async with run_fleet(replicas[:1]) as fleet:
        ep = endpoints(fleet)["ls0"]
        body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 16, "stream": True})
        errors: list[str] = []
        scrapes = 0
        stop = asyncio.Event()

        async def hammer() -> None:
            nonlocal scrapes
            while not stop.is_set():
                try:
                    status, _ = await scrape_once(ep, 2.0)
                    assert status == 200
                except (OSError, asyncio.TimeoutError, ValueError) as exc:
                    errors.append(str(exc))
                scrapes += 1
                await asyncio.sleep(0)

        async def stream() -> None:
            status, _, _ = await http_request(fleet.addr, "POST", "/v1/completions", body)
            assert status == 200

        tasks = [asyncio.create_task(hammer()) for _ in range(4)]
        try:
            for _ in range(10):
                await asyncio.gather(*(stream() for _ in range(8)))
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        assert not errors, f"{len(errors)} of {scrapes} scrapes failed, e.g. {errors[0]!r}"


async def test_breaker_opens_on_a_dead_replica_and_closes_after_restart(make_replica: Any) -> None:
    """A killed replica is taken out, requests go to the survivor, and it is back once restarted.

    Round-robin routing and a 2-failure breaker with a 1 s cooldown make the
    sequence quick. Whichever sees the death first takes the replica out: the
    poller (a refused scrape: down, unreachable) or the breaker (refused
    requests); the default scorer would also avoid it once its metrics go stale.
    """
    servers = [await make_replica(), await make_replica()]
    extra = {"routing": {"strategy": "round_robin"}, "breaker": {"failures": 2, "cooldown": "1s", "max_cooldown": "2s"}}
    async with run_fleet(servers, **extra) as fleet:
        eps = endpoints(fleet)
        dead, alive = eps["ls0"], eps["ls1"]
        assert dead.breaker_state == "closed"
        servers[0].kill()
        body = orjson.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4})

        async def request() -> str:
            status, headers, payload = await http_request(fleet.addr, "POST", "/v1/chat/completions", body)
            assert status == 200, payload[:300]
            return headers["x-llmgw-replica"]

        # Every request is answered, by the survivor (a refused connection is retried).
        for _ in range(4):
            assert await request() == "ls1"
        await wait_for(lambda: not dead.usable, BREAKER_OPENS_WITHIN,
                       "the killed replica was taken out (breaker open or found down)", poke=request)
        assert dead.breaker_open or dead.unusable_reason(time.monotonic()) == "unreachable"
        assert alive.breaker_state == "closed" and alive.usable
        failures = dead.failures
        for _ in range(6):
            assert await request() == "ls1"
        assert dead.failures <= failures + 1, "an open breaker still sent requests to the dead replica"

        await servers[0].restart_async()
        await wait_for(lambda: dead.breaker_state == "closed" and dead.usable, BREAKER_CLOSES_WITHIN,
                       "the restarted replica is usable, its breaker closed", poke=request)
        served = [await request() for _ in range(6)]
        assert set(served) == {"ls0", "ls1"}, served
        assert prom_samples(await fleet.admin_metrics(), "llmgw_endpoint_breaker_open") == {"ls0": 0.0, "ls1": 0.0}
