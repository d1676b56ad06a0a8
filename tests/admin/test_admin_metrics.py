"""``GET /metrics`` on the admin port after real traffic through the gateway."""

from __future__ import annotations

import gzip
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from admin_helpers import (
    Engine,
    admin_of,
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
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily

from canary import secret
from llmgw.admin.metrics import FleetCollector, PrometheusObserver, status_class
from llmgw.config import load
from llmgw.fleet.registry import Registry

ROOT = Path(__file__).resolve().parents[2]


async def scrape(rt: Any, accept: str | None = None) -> tuple[dict[str, str], str]:
    status, hdrs, body = await http(admin_port(rt), "GET", "/metrics", headers={"accept": accept} if accept else None)
    assert status == 200
    return hdrs, body.decode()


async def test_streamed_usage_is_counted_once_per_answer() -> None:
    # Running totals in every event (and CRLF event framing) count as the last
    # totals, once: summing them would report 1+2+3 completion tokens.
    a = Engine("a")
    a.mode = "continuous_usage"
    async with running([a]) as rt:
        port = client_port(rt)
        status, hdrs, body = await http(
            port, "POST", "/v1/chat/completions", {"model": "m", "stream": True, "messages": []},
            headers={"content-type": "application/json"},
        )
        assert status == 200 and hdrs["content-type"] == "text/event-stream"
        assert body.count(b"\r\n\r\n") == 4 and body.endswith(b"data: [DONE]\r\n\r\n")
        _, text = await scrape(rt)
        fams = families(text)
        assert sample(fams, "llmgw_tokens_total", model="m", kind="completion") == 3
        assert sample(fams, "llmgw_tokens_total", model="m", kind="prompt") == 5


async def test_metrics_after_traffic() -> None:
    a, b, dark = Engine("a"), Engine("b"), Engine("dark", page=None)
    async with running([a, b, dark], retries={"attempts": 2}) as rt:
        assert rt.registry is not None
        eps = rt.registry.endpoints
        # (and "dark"'s first scrape answered, without numbers: blind, not stale as before any scrape)
        await wait_for(lambda: eps["a"].scrape_ok > 0 and eps["b"].scrape_ok > 0
                       and eps["dark"].state.scraped_at == eps["dark"].state.scraped_at)
        port = client_port(rt)
        for _ in range(4):
            assert await chat(port) == 200
        assert await chat(port, stream=True) == 200
        assert await chat(port, model="nope") == 404
        dark.mode = "503"
        for _ in range(10):
            # "dark" (blind: routed on this router's own requests there, none, while a and b show a
            # queue) is tried first and answers 503; the request is retried on a or b
            assert await chat(port) == 200
        hdrs, text = await scrape(rt)
        assert hdrs["content-type"].startswith("text/plain; version=0.0.4")
        fams = families(text)

        ok = sample(fams, "llmgw_requests_total", model="m", status_class="2xx")
        assert ok == 15
        assert sample(fams, "llmgw_requests_total", status_class="4xx") == 1
        assert sample(fams, "llmgw_request_duration_seconds_count", model="m") == 15
        assert sample(fams, "llmgw_time_to_first_byte_seconds_count", model="m") == 15
        assert sample(fams, "llmgw_upstream_duration_seconds_count", model="m") == 15
        inf = sample(fams, "llmgw_request_duration_seconds_bucket", model="m", le="+Inf")
        assert inf == 15
        # every bucket boundary LLM latencies need: 5 ms .. 10 min
        les = {s.labels["le"] for s in fams["llmgw_request_duration_seconds"].samples if s.name.endswith("_bucket")}
        assert {"0.005", "1.0", "60.0", "600.0", "+Inf"} <= les
        assert sample(fams, "llmgw_tokens_total", model="m", kind="prompt") == 15 * 5
        assert sample(fams, "llmgw_tokens_total", model="m", kind="completion") == 15 * 7
        errors = sample(fams, "llmgw_upstream_errors_total", kind="status_5xx") or 0
        retries = sample(fams, "llmgw_retries_total", model="m") or 0
        assert errors >= 1 and retries == errors
        assert (sample(fams, "llmgw_upstream_errors_total", replica="dark") or 0) == errors
        # (a count known to be zero is exported as 0: rate() panels read 0, not "No data")
        assert sample(fams, "llmgw_upstream_errors_total", replica="a") == 0
        assert sample(fams, "llmgw_breaker_transitions_total", replica="a", state="open") == 0

        # live state: fresh engine numbers for scraped replicas, omitted for the one that has none
        assert sample(fams, "llmgw_endpoint_waiting", replica="a", pool="gpu") == 2.0
        assert sample(fams, "llmgw_endpoint_running", replica="a") == 3.0
        assert sample(fams, "llmgw_endpoint_kv_cache_usage", replica="a") == 0.25
        for name in ("llmgw_endpoint_waiting", "llmgw_endpoint_running", "llmgw_endpoint_kv_cache_usage"):
            assert sample(fams, name, replica="dark") is None, name
        # "dark" answers but has no metrics page: blind, not stale
        assert sample(fams, "llmgw_endpoint_metrics_stale", replica="dark") == 0.0
        assert sample(fams, "llmgw_endpoint_metrics_stale", replica="a") == 0.0
        assert sample(fams, "llmgw_endpoint_inflight", replica="dark") == 0.0
        # routing's own numbers: the breaker, and drain rate and latency once a replica has finished requests
        for r in ("a", "b", "dark"):
            assert sample(fams, "llmgw_endpoint_breaker_open", replica=r) in (0.0, 0.5, 1.0)
        served = [r for r in ("a", "b", "dark") if sample(fams, "llmgw_requests_total", replica=r)]
        assert served
        for r in served:
            assert (sample(fams, "llmgw_endpoint_drain_rate", replica=r) or 0) > 0, r
            assert (sample(fams, "llmgw_endpoint_latency_seconds", replica=r) or 0) > 0, r
        assert sample(fams, "llmgw_endpoint_info", replica="a", model="m", engine="vllm") == 1.0
        # each request is admitted straight through, or queued (then dequeued) while the pool looked full
        admitted = sample(fams, "llmgw_admission_total", band="standard", outcome="admitted") or 0
        queued = sample(fams, "llmgw_admission_total", band="standard", outcome="queued") or 0
        assert admitted + queued == 15
        assert sample(fams, "llmgw_admission_queue_depth", band="standard") == 0.0
        assert sample(fams, "llmgw_pool_saturation", model="m") is not None

        # scrapes by result, and their duration
        assert (sample(fams, "llmgw_scrapes_total", replica="a", result="ok") or 0) >= 1
        assert (sample(fams, "llmgw_scrapes_total", replica="dark", result="failed") or 0) >= 1
        assert sample(fams, "llmgw_scrapes_total", replica="dark", result="ok") == 0
        assert (sample(fams, "llmgw_scrape_duration_seconds_count", replica="a") or 0) >= 1
        assert fams["llmgw_scrape_duration_seconds"].type == "summary"

        # process and runtime
        assert (sample(fams, "process_cpu_seconds_total") or 0) > 0
        assert sample(fams, "llmgw_build_info") == 1.0
        assert (sample(fams, "llmgw_asyncio_tasks") or 0) >= 1
        assert sample(fams, "llmgw_connections", listener="admin") == 1.0


async def test_unreachable_replica_is_stale_and_its_signals_omitted() -> None:
    a = Engine("a")
    async with running([a], more=[gone()]) as rt:
        assert rt.registry is not None
        await wait_for(lambda: rt.registry.endpoints["gone"].scrape_failures > 1)
        _, text = await scrape(rt)
    fams = families(text)
    assert sample(fams, "llmgw_endpoint_metrics_stale", replica="gone") == 1.0
    for name in ("llmgw_endpoint_waiting", "llmgw_endpoint_running", "llmgw_endpoint_kv_cache_usage",
                 "llmgw_endpoint_drain_rate", "llmgw_endpoint_latency_seconds"):
        assert sample(fams, name, replica="gone") is None, name
    assert sample(fams, "llmgw_scrapes_total", replica="gone", result="ok") == 0
    assert (sample(fams, "llmgw_scrapes_total", replica="gone", result="failed") or 0) >= 2


async def test_openmetrics_by_accept_and_gzip() -> None:
    a = Engine("a")
    async with running([a]) as rt:
        assert await chat(client_port(rt)) == 200
        hdrs, text = await scrape(rt, "application/openmetrics-text; version=1.0.0")
        assert hdrs["content-type"].startswith("application/openmetrics-text")
        assert text.endswith("# EOF\n")
        assert "# TYPE llmgw_requests counter" in text
        assert 'llmgw_requests_total{band="standard",model="m",replica="a",status_class="2xx"} 1.0' in text
        status, hdrs, body = await http(admin_port(rt), "GET", "/metrics", headers={"accept-encoding": "gzip"})
        assert status == 200 and hdrs.get("content-encoding") == "gzip"
        assert b"llmgw_requests_total" in gzip.decompress(body)


@pytest.mark.needs_tool("promtool", install="apt-get install prometheus")
async def test_promtool_check_metrics() -> None:
    a, dark = Engine("a"), Engine("dark", page=None)
    async with running([a, dark]) as rt:
        assert rt.registry is not None
        await wait_for(lambda: rt.registry.endpoints["a"].scrape_ok > 0)
        for stream in (False, True):
            assert await chat(client_port(rt), stream=stream) == 200
        obs = admin_of(rt).observer
        obs.admission("interactive", "queued")
        obs.admission("batch", "rejected", "queue_full")
        obs.breaker_transition("a", "open")
        _, text = await scrape(rt)
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr


async def test_runtime_wires_admin_observer() -> None:
    """The gateway reports to the admin app's observer without help (GatewayRuntime does the wiring)."""
    a = Engine("a")
    async with running([a], wire=False) as rt:
        assert rt.gateway is not None
        assert rt.gateway.observer is admin_of(rt).observer, (
            "GatewayRuntime.start must call gateway.set_observer(admin.observer)"
        )


async def test_register_collector() -> None:
    class Extra:
        def collect(self) -> Any:
            g = GaugeMetricFamily("llmgw_control_plane_nodes", "Nodes the control plane knows.")
            g.add_metric([], 3)
            yield g

    a = Engine("a")
    async with running([a]) as rt:
        extra = Extra()
        admin_of(rt).register_collector(extra)
        _, text = await scrape(rt)
        assert "llmgw_control_plane_nodes 3.0" in text
        admin_of(rt).unregister_collector(extra)
        _, text = await scrape(rt)
        assert "llmgw_control_plane_nodes" not in text


# -- the routing layer's live state, read off the real registry --


def _registry() -> Registry:
    """Real replicas (not started: nothing is scraped): two vLLM ones and an external provider."""
    return Registry(
        load(
            {
                "endpoints": [
                    {"id": "with", "url": "http://127.0.0.1:9", "model": "m"},
                    {"id": "half", "url": "http://127.0.0.1:9", "model": "m"},
                    {"id": "without", "url": "http://127.0.0.1:9", "model": "m", "engine": "external"},
                    {"id": "gone", "url": "http://127.0.0.1:9", "model": "n"},
                ],
                "breaker": {"failures": 1, "cooldown": "60s"},
            }
        )
    )


def _render(registry: Any, admission: Any = None) -> dict[str, Any]:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(registry, admission))
    return families(generate_latest(reg).decode())


async def test_routing_signals_exported_when_present_and_omitted_when_absent() -> None:
    registry = _registry()
    try:
        now = time.monotonic()
        eps = registry.endpoints
        eps["with"].state.breaker.record_failure(now)  # open
        eps["with"].state.drain_rate = 4.5
        eps["with"].state.latency = 0.25
        half = eps["half"].state.breaker
        half.record_failure(now - 120.0)  # opened two minutes ago: the cooldown is over ...
        assert half.allow(now) and eps["half"].breaker_state == "half_open"  # ... a probe went
        eps["gone"].state.breaker.record_failure(now)  # model n: no usable replica
        queue = registry.pools["m"].queue
        items = [object() for _ in range(9)]
        for i, item in enumerate(items):
            queue.push(0 if i < 2 else 2, None, item, now)  # 2 critical, 7 batch
        fams = _render(registry)
        assert sample(fams, "llmgw_endpoint_breaker_open", replica="with") == 1.0
        # 1 only while open (an `== 1` alert must not fire, nor miss, on half-open), and the state family
        assert sample(fams, "llmgw_endpoint_breaker_open", replica="half") == 0.0
        assert sample(fams, "llmgw_endpoint_breaker_state", replica="half", state="half_open") == 1.0
        assert sample(fams, "llmgw_endpoint_breaker_state", replica="half", state="open") == 0.0
        assert sample(fams, "llmgw_endpoint_breaker_state", replica="with", state="open") == 1.0
        assert sample(fams, "llmgw_endpoint_breaker_state", replica="with") == 1.0  # one state at a time
        assert sample(fams, "llmgw_endpoint_breaker_state", replica="without", state="closed") == 1.0
        assert sample(fams, "llmgw_endpoint_breaker_open", replica="without") == 0.0
        # its cooldown over and nothing sent since: usable, so half-open (its next request probes), not open
        cooled = eps["without"].state.breaker
        cooled.record_failure(now - 120.0)
        assert cooled.state == "open" and eps["without"].usable
        cooled_fams = _render(registry)
        assert sample(cooled_fams, "llmgw_endpoint_breaker_open", replica="without") == 0.0
        assert sample(cooled_fams, "llmgw_endpoint_breaker_state", replica="without", state="half_open") == 1.0
        assert sample(cooled_fams, "llmgw_endpoint_breaker_state", replica="without", state="open") == 0.0
        cooled.record_success(now)
        assert sample(fams, "llmgw_endpoint_drain_rate", replica="with") == 4.5
        assert sample(fams, "llmgw_endpoint_latency_seconds", replica="with") == 0.25
        # never measured: absent, not 0
        assert sample(fams, "llmgw_endpoint_drain_rate", replica="without") is None
        assert sample(fams, "llmgw_endpoint_latency_seconds", replica="without") is None
        assert sample(fams, "llmgw_endpoint_waiting", replica="with") is None
        assert sample(fams, "llmgw_admission_queue_depth", band="critical") == 2.0
        assert sample(fams, "llmgw_admission_queue_depth", band="batch") == 7.0
        assert sample(fams, "llmgw_admission_queue_depth", band="standard") == 0.0
        assert sample(fams, "llmgw_pool_saturation", model="m") == registry.pool_saturation("m")
        assert sample(fams, "llmgw_pool_saturation", model="n") == math.inf  # no usable replica
        # never scraped yet: stale; not scraped at all (an external provider): no staleness, no scrape counters
        assert sample(fams, "llmgw_endpoint_metrics_stale", replica="with") == 1.0
        assert sample(fams, "llmgw_endpoint_metrics_stale", replica="without") is None
        assert sample(fams, "llmgw_scrapes_total", replica="without") is None
        for item in items:
            assert queue.remove(item)
    finally:
        registry.close()


async def test_broken_admission_source_does_not_break_metrics(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:  # another admission controller (AdminApp's ``admission``) with a bug
        def queue_depths(self) -> dict[str, int]:
            raise RuntimeError("bug")

    registry = _registry()
    try:
        fams = _render(registry, Broken())
        assert sample(fams, "llmgw_admission_queue_depth") is None
        assert sample(fams, "llmgw_endpoint_inflight", replica="with") == 0.0
        assert "queue_depths" in caplog.text
    finally:
        registry.close()


def test_status_classes() -> None:
    assert [status_class(s) for s in (0, 101, 200, 302, 404, 503, 999)] == [
        "none", "1xx", "2xx", "3xx", "4xx", "5xx", "none"
    ]


def test_observer_caps_label_sets(caplog: pytest.LogCaptureFixture) -> None:
    obs = PrometheusObserver(max_series=3)
    for i in range(10):
        obs.request_done(f"m{i}", "r", 200, "b", 0.1, 0.05, 0.09)
        obs.upstream_error(f"r{i}", "reset")
    reg = CollectorRegistry(auto_describe=False)
    reg.register(obs)
    fams = families(generate_latest(reg).decode())
    models = {s.labels["model"] for s in fams["llmgw_requests"].samples}
    assert models == {"m0", "m1", "m2", "(other)"}
    assert sample(fams, "llmgw_requests_total", model="(other)") == 7
    assert sample(fams, "llmgw_request_duration_seconds_count") == 10
    assert sample(fams, "llmgw_upstream_errors_total", replica="(other)") == 7
    assert "label sets" in caplog.text


def test_histogram_buckets_are_le() -> None:
    obs = PrometheusObserver(buckets=(0.1, 1.0))
    for v in (0.1, 0.5, 1.0, 3.0):
        obs.request_done("m", None, 200, "b", v, None, None)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(obs)
    fams = families(generate_latest(reg).decode())
    got = {s.labels["le"]: s.value for s in fams["llmgw_request_duration_seconds"].samples if "le" in s.labels}
    assert got == {"0.1": 1, "1.0": 3, "+Inf": 4}
    assert sample(fams, "llmgw_request_duration_seconds_sum") == pytest.approx(4.6)
    # never reached a replica: no upstream series, replica label empty
    assert "llmgw_upstream_duration_seconds_count" not in str(fams["llmgw_upstream_duration_seconds"].samples)
    assert sample(fams, "llmgw_requests_total", replica="") == 4


async def test_docs_list_every_family() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(llmgw_[a-z0-9_]+)` \|", doc, re.M))
    a = Engine("a")
    import socket

    with socket.socket() as sock:  # a control plane too: the cluster families are on the same page
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with running([a], control={"listen": f"127.0.0.1:{port}", "join_token": secret("join")}) as rt:
        _, text = await scrape(rt)
    # the text format names counters with their _total, as the docs do
    exported = set(re.findall(r"^# TYPE (llmgw_[a-z0-9_]+) ", text, re.M))
    from llmgw.fleet.follow import FollowCollector, FollowState

    # a router with follow: exports the follower's families (and no control plane's)
    follower = {m.name + ("_total" if m.type == "counter" else "") for m in FollowCollector(FollowState()).collect()}
    exported |= follower
    assert exported - documented == set(), "undocumented families"
    # (exported only with control.database: tests/ha/test_failover.py reads them)
    ha_only = {"llmgw_control_leader_epoch", "llmgw_control_leader_terms_total", "llmgw_control_leader_step_downs_total"}
    assert documented - exported - ha_only == set(), "documented but not exported"


def test_a_replica_gone_for_an_hour_leaves_the_page() -> None:
    """Deployments' rolling updates make new replica ids each time: the series of those gone stayed on the page
    until a restart. They stay while a rate() window may still read their last requests, then go."""
    from prometheus_client import CollectorRegistry, generate_latest

    from llmgw.admin.metrics import Known

    clock = [1000.0]
    obs = PrometheusObserver(forget_s=3600.0, clock=lambda: clock[0])
    live = ["old-1a2b3c", "new-4d5e6f"]
    obs.know(lambda: Known(models=("m",), replicas=tuple(live), bands=("standard",),
                           serving=tuple(("m", r) for r in live)))
    for r in live:
        obs.record("m", r, 200, "standard", 0.5, 0.1, 0.4)
        obs.upstream_error(r, "reset")
    reg = CollectorRegistry(auto_describe=False)
    reg.register(obs)

    def page() -> str:
        return generate_latest(reg).decode()

    assert 'replica="old-1a2b3c"' in page()
    live.remove("old-1a2b3c")  # (out of the registry: the next scrape sees it gone)
    assert 'replica="old-1a2b3c"' in page()
    clock[0] += 3599.0
    text = page()
    assert 'llmgw_requests_total{band="standard",model="m",replica="old-1a2b3c",status_class="2xx"} 1.0' in text
    assert 'llmgw_upstream_errors_total{kind="reset",replica="old-1a2b3c"} 1.0' in text
    clock[0] += 2.0
    text = page()
    assert "old-1a2b3c" not in text
    assert 'llmgw_requests_total{band="standard",model="m",replica="new-4d5e6f",status_class="2xx"} 1.0' in text
    # the same id back later starts again at 0 (its own new series)
    live.append("old-1a2b3c")
    assert 'llmgw_requests_total{band="standard",model="m",replica="old-1a2b3c",status_class="2xx"} 0.0' in page()
