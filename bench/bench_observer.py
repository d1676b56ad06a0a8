"""Per-request cost of the metrics hooks the data path calls.

One request's worth of hooks is what a proxied, non-streamed request that
reports usage costs: ``request_done`` (a counter and three histograms),
``tokens`` and ``admission``. Each benchmark round runs 100 requests, spread
over 4 replicas, 2 status codes and latencies across the buckets, so divide the
reported time by 100 for one request.

Implementations:

* ``null``: :class:`~llmgw.gateway.observe.NullObserver` (metrics off: the call overhead alone);
* ``llmgw``: :class:`~llmgw.admin.metrics.PrometheusObserver` (plain dicts, rendered at scrape time);
* ``prom_children``: prometheus-client metrics with the labelled children cached per label tuple;
* ``prom_labels``: prometheus-client calling ``.labels(...)`` on every hook (the naive way).

    .venv/bin/python -m pytest bench/bench_observer.py --benchmark-only
"""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from llmgw.admin.metrics import LATENCY_BUCKETS, PrometheusObserver
from llmgw.gateway.observe import NullObserver

REPLICAS = ("gpu0", "gpu1", "gpu2", "gpu3")
# (replica, status, duration, ttfb, upstream) for 100 requests
REQUESTS = [
    (REPLICAS[i % 4], 200 if i % 10 else 503, 0.05 * (i % 37) + 0.01, 0.02 * (i % 11) + 0.005, 0.05 * (i % 37))
    for i in range(100)
]


class PromClientObserver:
    """The Observer hooks on prometheus-client metrics (the baseline)."""

    def __init__(self, cache: bool) -> None:
        reg = CollectorRegistry()
        self.cache = cache
        self.req = Counter("llmgw_requests", "", ["model", "replica", "status_class", "band"], registry=reg)
        self.dur = Histogram("llmgw_request_duration_seconds", "", ["model", "band"], buckets=LATENCY_BUCKETS,
                             registry=reg)
        self.ttfb = Histogram("llmgw_time_to_first_byte_seconds", "", ["model", "band"], buckets=LATENCY_BUCKETS,
                              registry=reg)
        self.up = Histogram("llmgw_upstream_duration_seconds", "", ["model", "replica"], buckets=LATENCY_BUCKETS,
                            registry=reg)
        self.tok = Counter("llmgw_tokens", "", ["model", "kind"], registry=reg)
        self.adm = Counter("llmgw_admission", "", ["band", "outcome", "reason"], registry=reg)
        self._children: dict[tuple[Any, ...], tuple[Any, ...]] = {}

    def _kids(self, model: str, replica: str, status: int, band: str) -> tuple[Any, ...]:
        key = (model, replica, status, band)
        kids = self._children.get(key) if self.cache else None
        if kids is None:
            kids = (
                self.req.labels(model, replica, f"{status // 100}xx", band),
                self.dur.labels(model, band),
                self.ttfb.labels(model, band),
                self.up.labels(model, replica),
            )
            if self.cache:
                self._children[key] = kids
        return kids

    def request_done(self, model: str, replica: str, status: int, band: str, duration: float,
                     ttfb: float | None, upstream: float | None) -> None:
        c, d, t, u = self._kids(model, replica, status, band)
        c.inc()
        d.observe(duration)
        if ttfb is not None:
            t.observe(ttfb)
        if upstream is not None:
            u.observe(upstream)

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        if self.cache:
            kids = self._children.get((model,))
            if kids is None:
                kids = self._children[(model,)] = (self.tok.labels(model, "prompt"), self.tok.labels(model, "completion"))
        else:
            kids = (self.tok.labels(model, "prompt"), self.tok.labels(model, "completion"))
        kids[0].inc(prompt)
        kids[1].inc(completion)

    def admission(self, band: str, outcome: str, reason: str = "") -> None:
        if self.cache:
            key = ("adm", band, outcome, reason)
            kids = self._children.get(key)
            if kids is None:
                kids = self._children[key] = (self.adm.labels(band, outcome, reason),)
            kids[0].inc()
        else:
            self.adm.labels(band, outcome, reason).inc()


def make(kind: str) -> Any:
    if kind == "null":
        return NullObserver()
    if kind == "llmgw":
        return PrometheusObserver()
    return PromClientObserver(cache=kind == "prom_children")


@pytest.mark.parametrize("kind", ["null", "llmgw", "prom_children", "prom_labels"])
def test_hooks_per_request(benchmark: Any, kind: str) -> None:
    """100 requests' hooks: request_done + tokens + admission each."""
    obs = make(kind)
    done, tokens, admission = obs.request_done, obs.tokens, obs.admission

    def run() -> None:
        for replica, status, dur, ttfb, up in REQUESTS:
            admission("standard", "admitted")
            done("llama-3.1-8b", replica, status, "standard", dur, ttfb, up)
            tokens("llama-3.1-8b", 120, 340)

    run()  # label sets exist: measure the steady state
    benchmark(run)


def test_scrape_render(benchmark: Any) -> None:
    """Rendering the observer's families for 4 replicas x 2 statuses (what one /metrics scrape adds)."""
    from prometheus_client.exposition import generate_latest

    obs = PrometheusObserver()
    for replica, status, dur, ttfb, up in REQUESTS:
        obs.request_done("llama-3.1-8b", replica, status, "standard", dur, ttfb, up)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(obs)
    benchmark(generate_latest, reg)
