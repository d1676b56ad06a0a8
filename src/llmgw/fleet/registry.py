"""The registry: what llmgw knows about each replica, right now.

One :class:`Endpoint` per replica holds its identity (from config), the engine
state its scrapes report (``waiting``, ``running``, ``kv_cache_usage``, each
``None`` when absent: never 0), and the router's own state (in flight,
completions, failures, draining). The poller writes engine state, the data path
writes router state, routing reads both, the admin collectors read it at scrape
time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable

from ..config import Config, EndpointConfig, UpstreamConfig
from ..engines import get as get_engine
from ..http.client import UpstreamPool

__all__ = ["Endpoint", "Registry"]


class Endpoint:
    """One replica's identity and live state."""

    __slots__ = (
        "auth_line",
        "cfg",
        "completed",
        "consecutive_failures",
        "draining",
        "engine",
        "failures",
        "host_header",
        "id",
        "inflight",
        "kv_cache_usage",
        "last_scrape",
        "models",
        "pool",
        "metrics_path",
        "running",
        "scrape_failures",
        "scrape_ok",
        "scrape_problem",
        "scrape_seconds",
        "stale_after",
        "waiting",
    )

    def __init__(self, cfg: EndpointConfig, upstream: UpstreamConfig, stale_after: float = 3.0) -> None:
        self.cfg = cfg
        self.id = cfg.id
        self.models = cfg.models
        self.engine = get_engine(cfg.engine)
        self.host_header = cfg.address.encode()
        # SECURITY: the replica's own key goes upstream; the client's never does.
        self.auth_line = b"authorization: Bearer %s\r\n" % cfg.api_key.encode() if cfg.api_key else b""
        self.pool = UpstreamPool(
            cfg.host,
            cfg.port,
            connect_timeout=upstream.connect_timeout,
            max_idle=upstream.max_idle_connections,
            idle_timeout=upstream.idle_timeout,
        )
        self.draining = cfg.draining
        # router-side state
        self.inflight = 0
        self.completed = 0
        self.failures = 0
        self.consecutive_failures = 0
        # engine state from scrapes (None: absent)
        self.waiting: float | None = None
        self.running: float | None = None
        self.kv_cache_usage: float | None = None
        self.last_scrape: float | None = None
        self.stale_after = stale_after
        self.metrics_path = cfg.metrics_path
        self.scrape_ok = 0
        self.scrape_failures = 0
        self.scrape_seconds = 0.0
        self.scrape_problem: str | None = None

    @property
    def stale(self) -> bool:
        """Whether the engine numbers are missing or too old to use as fresh."""
        if not self.engine.scraped:
            return False
        last = self.last_scrape
        return last is None or time.monotonic() - last > self.stale_after

    def fresh(self) -> tuple[float | None, float | None, float | None]:
        """(waiting, running, kv_cache_usage) if fresh, else all ``None`` (absent)."""
        if self.stale:
            return None, None, None
        return self.waiting, self.running, self.kv_cache_usage

    @property
    def usable(self) -> bool:
        """Whether new requests may go here."""
        return not self.draining

    def target(self, path: bytes) -> bytes:
        """The request target on this replica for a client path."""
        base = self.cfg.base_path
        return base.encode() + path if base else path

    def close(self) -> None:
        self.pool.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.id} {self.cfg.url} inflight={self.inflight}>"


class Registry:
    """Every replica, indexed by id and by model."""

    def __init__(self, config: Config) -> None:
        self._upstream = config.upstream
        self._stale_after = config.scrape.stale_after
        self.endpoints: dict[str, Endpoint] = {}
        self.by_model: dict[str, list[Endpoint]] = {}
        self._rng = random.Random()
        self.started = time.monotonic()
        for ep in config.endpoints:
            self.add(ep)

    def add(self, cfg: EndpointConfig) -> Endpoint:
        """Add a replica (``ValueError`` if its id exists)."""
        if cfg.id in self.endpoints:
            raise ValueError(f"endpoint {cfg.id!r} already exists")
        ep = Endpoint(cfg, self._upstream, self._stale_after)
        self.endpoints[cfg.id] = ep
        for m in cfg.models:
            self.by_model.setdefault(m, []).append(ep)
        return ep

    def remove(self, endpoint_id: str) -> Endpoint:
        """Remove a replica (``KeyError`` if unknown); in-flight exchanges finish."""
        ep = self.endpoints.pop(endpoint_id)
        for m in ep.models:
            lst = self.by_model.get(m, [])
            if ep in lst:
                lst.remove(ep)
            if not lst:
                self.by_model.pop(m, None)
        ep.draining = True
        return ep

    def models(self) -> list[str]:
        return list(self.by_model)

    def candidates(self, model: str) -> list[Endpoint]:
        return self.by_model.get(model, [])

    def pick(self, model: str, exclude: Iterable[Endpoint] = ()) -> Endpoint | None:
        """The usable replica of ``model`` with the fewest requests in flight.

        Ties are broken at random so several routers sharing a fleet don't herd.
        """
        best: Endpoint | None = None
        best_load = 0
        ties = 0
        excluded = tuple(exclude)
        for ep in self.by_model.get(model, ()):
            if ep.draining or ep in excluded:
                continue
            load = ep.inflight
            if best is None or load < best_load:
                best, best_load, ties = ep, load, 1
            elif load == best_load:
                ties += 1
                if self._rng.random() * ties < 1.0:
                    best = ep
        return best

    def close(self) -> None:
        for ep in self.endpoints.values():
            ep.close()
