"""The admin listener: health, readiness and Prometheus metrics.

Served on its own port, never on the client port, so the client port can be
exposed without exposing operations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import NotFoundError
from ..http.parser import Request
from ..http.server import ResponseWriter

if TYPE_CHECKING:
    from ..gateway.app import GatewayRuntime

__all__ = ["AdminApp", "FleetCollector"]


class FleetCollector(Collector):
    """Live state read from the registry at scrape time.

    A signal that is absent for a replica (never scraped, or its engine does not
    report it) is omitted for that replica, never exported as 0.
    """

    def __init__(self, runtime: GatewayRuntime) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[Metric]:
        reg = self.runtime.registry
        labels = ["replica", "pool"]
        inflight = GaugeMetricFamily("llmgw_endpoint_inflight", "Requests this router has in flight to the replica.", labels=labels)
        waiting = GaugeMetricFamily("llmgw_endpoint_waiting", "Requests waiting in the replica's queue, as last scraped.", labels=labels)
        running = GaugeMetricFamily("llmgw_endpoint_running", "Requests the replica is running, as last scraped.", labels=labels)
        kv = GaugeMetricFamily("llmgw_endpoint_kv_cache_usage", "KV-cache usage of the replica (0..1), as last scraped.", labels=labels)
        draining = GaugeMetricFamily("llmgw_endpoint_draining", "1 when the replica takes no new requests.", labels=labels)
        for ep in reg.endpoints.values():
            lv = [ep.id, ep.cfg.pool or ""]
            inflight.add_metric(lv, ep.inflight)
            draining.add_metric(lv, 1.0 if ep.draining else 0.0)
            if ep.waiting is not None:
                waiting.add_metric(lv, ep.waiting)
            if ep.running is not None:
                running.add_metric(lv, ep.running)
            if ep.kv_cache_usage is not None:
                kv.add_metric(lv, ep.kv_cache_usage)
        yield from (inflight, waiting, running, kv, draining)


class AdminApp:
    """Routes of the admin port."""

    def __init__(self, runtime: GatewayRuntime) -> None:
        self.runtime = runtime
        self.metrics = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.metrics)
        PlatformCollector(registry=self.metrics)
        GCCollector(registry=self.metrics)
        self.metrics.register(FleetCollector(runtime))

    def register_collector(self, collector: Collector) -> None:
        """Add a collector to the admin ``/metrics`` (other parts of llmgw use this)."""
        self.metrics.register(collector)

    def handle(self, req: Request, w: ResponseWriter) -> Any:
        path = req.path
        if path == b"/health":
            w.send_json(200, {"status": "ok"})
        elif path == b"/ready":
            ready, body = self.runtime.readiness()
            w.send_json(200 if ready else 503, body)
        elif path == b"/metrics":
            encoder, content_type = choose_encoder((req.header(b"accept") or b"").decode("latin-1"))
            w.send(200, encoder(self.metrics), ((b"content-type", content_type.encode()),))
        else:
            raise NotFoundError(f"no admin route {path.decode('latin-1')[:200]}; try /health, /ready or /metrics")
        return None
