"""What operators see: every answer counted, logged and traceable; local answers
kept out of latency; zero series; breaker state and transitions from the real
request path; replica names private on request; probes where clients look.

Real gateways over real sockets, the engines of ``admin_helpers``, the admin
``/metrics`` parsed as Prometheus reads it.
"""

from __future__ import annotations

import asyncio
import json
import logging

import orjson
import pytest
from admin_helpers import (
    Engine,
    admin_port,
    chat,
    client_port,
    families,
    gone,
    http,
    running,
    sample,
    wait_for,
)

from canary import secret

KEY = secret("sk-operator-4b1d")
WRONG = secret("sk-wrong-key-0000")


async def metrics(rt: object) -> dict[str, object]:
    _, _, body = await http(admin_port(rt), "GET", "/metrics")  # type: ignore[arg-type]
    return families(body.decode())


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "llmgw.access"]


async def test_answers_before_routing_are_counted_logged_and_carry_a_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.access")
    a = Engine("a")
    async with running(
        [a], auth={"api_keys": [{"name": "ops", "key": KEY}]}, server={"max_body_size": "2KiB"}, access_log=True
    ) as rt:
        port = client_port(rt)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        bad_key = {"authorization": f"Bearer {WRONG}", "content-type": "application/json"}
        for _ in range(3):  # a burst of bad keys
            status, h401, b401 = await http(port, "POST", "/v1/chat/completions", body, bad_key)
            assert status == 401 and h401["x-request-id"]
            assert WRONG.encode() not in b401
        status, h413, _ = await http(
            port, "POST", "/v1/chat/completions", b"x" * 4096, {"authorization": f"Bearer {KEY}"}
        )
        assert status == 413 and h413["x-request-id"]
        status, hm, models = await http(port, "GET", "/v1/models", headers={"authorization": f"Bearer {KEY}"})
        assert status == 200 and hm["x-request-id"] and orjson.loads(models)["data"][0]["id"] == "m"
        status, hok, _ = await http(port, "POST", "/v1/chat/completions", body,
                                    {"authorization": f"Bearer {KEY}", "x-request-id": "mine-1"})
        assert status == 200 and hok["x-request-id"] == "mine-1"

        fams = await metrics(rt)
        assert sample(fams, "llmgw_requests_total", model="(unknown)", status_class="4xx") == 4  # 3 x 401, 413
        assert sample(fams, "llmgw_requests_total", model="(unknown)", status_class="2xx") == 1  # /v1/models
        assert sample(fams, "llmgw_requests_total", model="m", status_class="2xx") == 1
        # local answers naming no model are out of the latency histograms: no (unknown) series
        for fam in ("llmgw_request_duration_seconds_count", "llmgw_time_to_first_byte_seconds_count"):
            assert sample(fams, fam, model="(unknown)") is None, fam
        assert sample(fams, "llmgw_time_to_first_byte_seconds_count", model="m") == 1

        lines = access_lines(caplog)
        statuses = sorted(int(line["status"]) for line in lines)  # type: ignore[call-overload]
        assert statuses == [200, 200, 401, 401, 401, 413]
        assert all(line["id"] for line in lines)
        assert {line["id"] for line in lines if line["status"] == 401} == {h401["x-request-id"]} | {
            line["id"] for line in lines if line["status"] == 401
        }
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert KEY not in text and WRONG not in text


async def test_a_refusal_naming_a_served_model_is_timed_under_it() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        port = client_port(rt)
        assert await chat(port, priority="nonsense") == 400  # names model m, an unknown band
        status, _, _ = await http(port, "POST", "/v1/chat/completions", {"model": "nope", "messages": []})
        assert status == 404
        fams = await metrics(rt)
        assert sample(fams, "llmgw_requests_total", model="m", status_class="4xx") == 1
        assert sample(fams, "llmgw_request_duration_seconds_count", model="m") == 1
        assert (sample(fams, "llmgw_request_duration_seconds_sum", model="m") or 0.0) > 0.0  # its real duration
        assert sample(fams, "llmgw_time_to_first_byte_seconds_count", model="m") is None  # no replica answered
        assert sample(fams, "llmgw_requests_total", model="(unknown)", status_class="4xx") == 1
        assert sample(fams, "llmgw_request_duration_seconds_count", model="(unknown)") is None


async def test_known_counts_start_at_zero() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        fams = await metrics(rt)
        assert sample(fams, "llmgw_requests_total", model="m", status_class="5xx", band="standard") == 0
        assert sample(fams, "llmgw_requests_total", model="m", status_class="2xx", band="batch") == 0
        assert sample(fams, "llmgw_upstream_errors_total", replica="a", kind="connect_refused") == 0
        assert sample(fams, "llmgw_retries_total", model="m") == 0
        assert sample(fams, "llmgw_admission_total", band="critical", outcome="rejected", reason="queue_full") == 0
        assert sample(fams, "llmgw_breaker_transitions_total", replica="a", state="half_open") == 0
        # measurements nobody made stay absent
        assert sample(fams, "llmgw_endpoint_drain_rate", replica="a") is None


async def test_breaker_half_open_is_counted_from_the_request_path() -> None:
    a = Engine("a")
    async with running(
        [a], breaker={"failures": 1, "cooldown": "200ms", "max_cooldown": "1s"}, retries={"attempts": 0}
    ) as rt:
        port = client_port(rt)
        a.mode = "503"
        assert await chat(port) == 503  # one failure opens it
        fams = await metrics(rt)
        assert sample(fams, "llmgw_endpoint_breaker_open", replica="a") == 1.0
        assert sample(fams, "llmgw_endpoint_breaker_state", replica="a", state="open") == 1.0
        assert sample(fams, "llmgw_breaker_transitions_total", replica="a", state="open") == 1
        a.mode = "ok"
        await asyncio.sleep(0.3)  # past the cooldown: the next request is the probe
        assert await chat(port) == 200
        fams = await metrics(rt)
        assert sample(fams, "llmgw_breaker_transitions_total", replica="a", state="half_open") == 1
        assert sample(fams, "llmgw_breaker_transitions_total", replica="a", state="closed") == 1
        assert sample(fams, "llmgw_endpoint_breaker_open", replica="a") == 0.0
        assert sample(fams, "llmgw_endpoint_breaker_state", replica="a", state="closed") == 1.0


async def test_replica_names_private_when_asked(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.access")
    a = Engine("a")
    for expose in (True, False):
        async with running([a], server={"expose_replica": expose}, access_log=True) as rt:
            port = client_port(rt)
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            status, h, _ = await http(port, "POST", "/v1/chat/completions", body)
            assert status == 200
            assert (h.get("x-llmgw-replica") == "a") is expose
            status, h, _ = await http(port, "POST", "/v1/chat/completions", {**body, "stream": True})
            assert status == 200 and ("x-llmgw-replica" in h) is expose
            fams = await metrics(rt)
            assert sample(fams, "llmgw_requests_total", replica="a", status_class="2xx") == 2
        assert [line["replica"] for line in access_lines(caplog)][-2:] == ["a", "a"]  # the log names it anyway


async def test_health_on_the_client_port_and_allow_on_405() -> None:
    async with running([], more=[gone()]) as rt:
        port = client_port(rt)
        status, h, body = await http(port, "GET", "/health")
        assert status == 200 and body == b"" and h["x-request-id"]
        status, _, _ = await http(port, "HEAD", "/health")
        assert status == 200
        status, h, _ = await http(port, "POST", "/health")
        assert status == 405 and h["allow"] == "GET, HEAD"
        status, h, body = await http(port, "GET", "/v1/chat/completions")
        assert status == 405 and h["allow"] == "POST" and h["x-request-id"]
        assert orjson.loads(body)["error"]["code"] == "method_not_allowed"
        status, h, body = await http(port, "GET", "/v1/health")  # (no route: OpenAI's 404, not a 405)
        assert status == 404 and h["x-request-id"] and orjson.loads(body)["error"]["code"] == "not_found"
        status, h, _ = await http(port, "DELETE", "/v1/models")
        assert status == 405 and h["allow"] == "GET, HEAD, POST"
        await wait_for(lambda: True)
