"""The registry: what llmgw knows about each replica, right now.

One :class:`Endpoint` per replica holds its identity (from config) and an
``EndpointState`` (compiled, ``llmgw.routing``) with what routing reads: the
engine's scraped numbers (NaN when absent: never 0), this router's own requests
(in flight, dispatched and completed since the last scrape, drain rate, latency),
draining, and the circuit breaker. Each model has a :class:`ModelPool`: its
replicas, their states as one list for the picker, the picker, and the admission
queue. The poller writes engine state, the data path writes router state,
routing reads both, the admin collectors read it at scrape time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from ..config import Config, EndpointConfig, UpstreamConfig
from ..engines import get as get_engine
from ..http.client import UpstreamPool
from ..routing import AdmissionQueue, Breaker, EndpointState, Picker, pool_saturation

__all__ = ["Endpoint", "ModelPool", "Registry"]


def _opt(x: float) -> float | None:
    return None if math.isnan(x) else x


class Endpoint:
    """One replica's identity and live state."""

    __slots__ = (
        "auth_line",
        "cfg",
        "completed",
        "engine",
        "failures",
        "host_header",
        "id",
        "metrics_path",
        "models",
        "pool",
        "replica_line",
        "scrape_failures",
        "scrape_ok",
        "scrape_problem",
        "scrape_seconds",
        "stale_after",
        "state",
    )

    def __init__(self, cfg: EndpointConfig, config: Config) -> None:
        upstream: UpstreamConfig = config.upstream
        self.cfg = cfg
        self.id = cfg.id
        self.models = cfg.models
        self.engine = get_engine(cfg.engine)
        self.host_header = cfg.address.encode()
        # SECURITY: the replica's own key goes upstream; the client's never does.
        self.auth_line = b"authorization: Bearer %s\r\n" % cfg.api_key.encode() if cfg.api_key else b""
        self.replica_line = b"x-llmgw-replica: %s\r\n" % cfg.id.encode()
        self.pool = UpstreamPool(
            cfg.host,
            cfg.port,
            connect_timeout=upstream.connect_timeout,
            max_idle=upstream.max_idle_connections,
            idle_timeout=upstream.idle_timeout,
        )
        b = config.breaker
        self.state = EndpointState(0, Breaker(b.failures, b.cooldown, b.max_cooldown))
        self.state.draining = cfg.draining
        if cfg.slots:
            self.state.slots = float(cfg.slots)
        if not self.engine.scraped:
            # Never scraped: always "fresh" but blind (no gauges); routing knows.
            self.state.scraped_at = math.inf
        self.stale_after = config.scrape.stale_after
        self.metrics_path = cfg.metrics_path
        self.completed = 0
        self.failures = 0
        self.scrape_ok = 0
        self.scrape_failures = 0
        self.scrape_seconds = 0.0
        self.scrape_problem: str | None = None

    # -- views for the admin API and metrics (absent is None, never 0) --

    @property
    def inflight(self) -> int:
        return int(self.state.inflight)

    @property
    def draining(self) -> bool:
        return bool(self.state.draining)

    @draining.setter
    def draining(self, value: bool) -> None:
        self.state.draining = value

    @property
    def waiting(self) -> float | None:
        return _opt(self.state.waiting)

    @property
    def running(self) -> float | None:
        return _opt(self.state.running)

    @property
    def kv_cache_usage(self) -> float | None:
        return _opt(self.state.kv_cache_usage)

    @property
    def drain_rate(self) -> float | None:
        return _opt(self.state.drain_rate)

    @property
    def latency(self) -> float | None:
        return _opt(self.state.latency)

    @property
    def last_scrape(self) -> float | None:
        at = self.state.scraped_at
        return None if math.isnan(at) or math.isinf(at) else at

    @property
    def breaker_state(self) -> str:
        return str(self.state.breaker.state)

    @property
    def breaker_open(self) -> bool:
        return self.state.breaker.state == "open"

    @property
    def consecutive_failures(self) -> int:
        return int(self.state.breaker.consecutive_failures)

    @property
    def stale(self) -> bool:
        """Whether the engine numbers are missing or too old to use as fresh."""
        return bool(self.state.stale(time.monotonic(), self.stale_after))

    def fresh(self) -> tuple[float | None, float | None, float | None]:
        """(waiting, running, kv_cache_usage) if fresh, else all ``None`` (absent)."""
        if self.stale:
            return None, None, None
        return self.waiting, self.running, self.kv_cache_usage

    @property
    def usable(self) -> bool:
        """Whether new requests may go here (not draining, breaker not open)."""
        return bool(self.state.usable(time.monotonic()))

    def target(self, path: bytes) -> bytes:
        """The request target on this replica for a client path."""
        base = self.cfg.base_path
        return base.encode() + path if base else path

    def close(self) -> None:
        self.pool.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.id} {self.cfg.url} inflight={self.inflight}>"


class ModelPool:
    """One model's replicas, their states as one list, its picker and admission queue."""

    __slots__ = ("endpoints", "name", "picker", "queue", "states")

    def __init__(self, name: str, strategy: str, bands: int, queue_size: int) -> None:
        self.name = name
        self.endpoints: list[Endpoint] = []
        self.states: list[Any] = []
        self.picker = Picker(strategy)
        self.queue = AdmissionQueue(bands, queue_size)

    def add(self, ep: Endpoint) -> None:
        self.endpoints.append(ep)
        self.states = [e.state for e in self.endpoints]

    def remove(self, ep: Endpoint) -> None:
        if ep in self.endpoints:
            self.endpoints.remove(ep)
        self.states = [e.state for e in self.endpoints]

    def pick(self, now: float, stale_after: float, exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
        """The replica for the next request (taking a half-open breaker's probe), or ``None``."""
        excluded = tuple(exclude)
        if not excluded:
            i = self.picker.pick(self.states, now, stale_after)
            return self.endpoints[i] if i >= 0 else None
        # A retry: the same choice among the replicas not tried yet.
        eps = [e for e in self.endpoints if e not in excluded]
        i = self.picker.pick([e.state for e in eps], now, stale_after)
        return eps[i] if i >= 0 else None

    def saturation(self, now: float, stale_after: float, max_waiting: float, max_kv: float) -> float:
        return float(pool_saturation(self.states, now, stale_after, max_waiting, max_kv))


class Registry:
    """Every replica, indexed by id, and every model's pool."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.endpoints: dict[str, Endpoint] = {}
        self.pools: dict[str, ModelPool] = {}
        self.started = time.monotonic()
        for ep in config.endpoints:
            self.add(ep)

    def reconfigure(self, config: Config) -> None:
        """Adopt new routing settings (strategy per model); endpoints are added/removed separately."""
        self.config = config
        for name, pool in self.pools.items():
            strategy = self._strategy(name)
            if pool.picker.strategy != strategy:
                pool.picker = Picker(strategy)

    def _strategy(self, model: str) -> str:
        m = self.config.models.get(model)
        return (m.strategy if m is not None and m.strategy else None) or self.config.routing.strategy

    def add(self, cfg: EndpointConfig) -> Endpoint:
        """Add a replica (``ValueError`` if its id exists)."""
        if cfg.id in self.endpoints:
            raise ValueError(f"endpoint {cfg.id!r} already exists")
        ep = Endpoint(cfg, self.config)
        self.endpoints[cfg.id] = ep
        adm = self.config.admission
        for m in cfg.models:
            pool = self.pools.get(m)
            if pool is None:
                pool = self.pools[m] = ModelPool(m, self._strategy(m), len(adm.bands), adm.queue_size)
            pool.add(ep)
        return ep

    def remove(self, endpoint_id: str) -> Endpoint:
        """Remove a replica (``KeyError`` if unknown); in-flight exchanges finish."""
        ep = self.endpoints.pop(endpoint_id)
        for m in ep.models:
            pool = self.pools.get(m)
            if pool is not None:
                pool.remove(ep)
        ep.draining = True
        return ep

    @property
    def by_model(self) -> dict[str, list[Endpoint]]:
        """Model -> its replicas (models with none are left out)."""
        return {m: list(p.endpoints) for m, p in self.pools.items() if p.endpoints}

    def models(self) -> list[str]:
        return [m for m, p in self.pools.items() if p.endpoints]

    def candidates(self, model: str) -> list[Endpoint]:
        pool = self.pools.get(model)
        return list(pool.endpoints) if pool is not None else []

    def pool_saturation(self, model: str) -> float | None:
        """The model pool's saturation now (1.0 is the healthy limit), or ``None`` without a pool."""
        pool = self.pools.get(model)
        if pool is None or not pool.endpoints:
            return None
        s = self.config.saturation
        return pool.saturation(time.monotonic(), self.config.scrape.stale_after, s.max_waiting, s.max_kv_cache_usage)

    def queue_depths(self) -> dict[str, int]:
        """Queued requests per priority band, over all models."""
        bands = self.config.admission.bands
        depth = dict.fromkeys(bands, 0)
        for pool in self.pools.values():
            for i, b in enumerate(bands):
                depth[b] += pool.queue.depth(i)
        return depth

    def close(self) -> None:
        for ep in self.endpoints.values():
            ep.close()
