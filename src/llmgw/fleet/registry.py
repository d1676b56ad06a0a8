"""The registry: what llmgw knows about each replica, right now.

One :class:`Endpoint` per replica (compiled, as the data path reads it per
request: :mod:`llmgw._fast.replica_py`) holds its identity (from config) and an
``EndpointState`` (compiled, ``llmgw.routing``) with what routing reads: the
engine's scraped numbers (NaN when absent: never 0), this router's own requests
(in flight, dispatched and completed since the last scrape, drain rate, latency),
draining, and the circuit breaker. Each model has a :class:`ModelPool`: its
replicas, their states as one list for the picker, the picker, and the admission
queue. The poller writes engine state, the data path writes router state,
routing reads both, the admin collectors read it at scrape time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .._accel import select
from ..config import Config, EndpointConfig
from ..engines import get as get_engine
from ..routing import Picker

if TYPE_CHECKING:
    from .._fast.replica_py import Endpoint, ModelPool
else:
    _impl = select("replica")
    Endpoint = _impl.Endpoint
    ModelPool = _impl.ModelPool

__all__ = ["ENGINE_UNAVAILABLE_STATES", "Endpoint", "EngineUnavailable", "ModelPool", "Registry"]

ENGINE_UNAVAILABLE_STATES = ("loading", "unavailable")
"""What ``Endpoint.unusable_reason`` says of a replica held down while its engine answers its scrape 503
(read from its :class:`EngineUnavailable` scrape problem): ``loading`` (llama-server loading its model),
``unavailable``."""


class EngineUnavailable(str):
    """The scrape problem of a replica whose engine answered its metrics path 503, as the poller
    keeps it in ``Endpoint.scrape_problem``: the text for people, and ``state``, one of
    :data:`ENGINE_UNAVAILABLE_STATES`.

    NOTE: a str, not a field of its own: ``Endpoint`` is compiled (``llmgw._fast.replica``) and
    has no slot for it; ``scrape_problem`` is the one place that is the poller's, goes with the
    replica object (a replica replaced in a reload starts without it) and is shown as text.
    """

    state: str

    def __new__(cls, text: str, state: str) -> EngineUnavailable:
        self = super().__new__(cls, text)
        self.state = state
        return self


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
            if pool.picker.strategy != strategy or pool.picker.settings != self._settings():
                self._set_picker(pool, strategy)

    def _strategy(self, model: str) -> str:
        m = self.config.models.get(model)
        return (m.strategy if m is not None and m.strategy else None) or self.config.routing.strategy

    def _settings(self) -> tuple[int, int, float, float]:
        p = self.config.routing.prefix
        return (p.index_entries, p.session_entries, p.load_bound, p.entry_ttl)

    def _set_picker(self, pool: ModelPool, strategy: str) -> None:
        # (a new picker starts with an empty index: a reload that changes the strategy
        # or the prefix knobs forgets where prefixes went)
        pool.picker = Picker(strategy, None, *self._settings())
        pool.keyed = strategy == "prefix"

    def add(self, cfg: EndpointConfig) -> Endpoint:
        """Add a replica (``ValueError`` if its id exists)."""
        if cfg.id in self.endpoints:
            raise ValueError(f"endpoint {cfg.id!r} already exists")
        ep = Endpoint(cfg, self.config, get_engine(cfg.engine))
        self.endpoints[cfg.id] = ep
        adm = self.config.admission
        for m in cfg.models:
            pool = self.pools.get(m)
            if pool is None:
                strategy = self._strategy(m)
                pool = self.pools[m] = ModelPool(m, strategy, len(adm.bands), adm.queue_size)
                if strategy == "prefix":
                    self._set_picker(pool, strategy)
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
