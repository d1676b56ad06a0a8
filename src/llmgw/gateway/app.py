"""The gateway process: registry, client listener and admin listener together."""

from __future__ import annotations

from typing import Any

from ..admin.app import AdminApp
from ..config import Config, EndpointConfig, load_file
from ..errors import ConfigError
from ..fleet.poller import Poller
from ..fleet.registry import Registry
from ..http.server import HTTPServer, ServerLimits
from ..log import server_logger as log
from .proxy import Gateway

__all__ = ["GatewayRuntime"]


class GatewayRuntime:
    """Starts and stops everything ``llmgw serve`` runs.

    Use inside a running event loop::

        rt = GatewayRuntime(config)
        await rt.start()
        ...
        await rt.stop()
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.registry: Registry | None = None
        self.gateway: Gateway | None = None
        self.server: HTTPServer | None = None
        self.admin_server: HTTPServer | None = None
        self.listen_addr: tuple[str, int] | None = None
        self.admin_addr: tuple[str, int] | None = None
        self.poller: Poller | None = None
        self.admin: AdminApp | None = None

    async def start(self) -> None:
        """Bind both listeners.

        Raises:
            OSError: an address cannot be bound (the message names it).
        """
        cfg = self.config
        self.registry = Registry(cfg)
        self.gateway = Gateway(cfg, self.registry)
        s = cfg.server
        limits = ServerLimits(
            max_head_bytes=s.max_header_bytes,
            max_headers=s.max_headers,
            max_body=s.max_body_size,
            header_timeout=s.header_timeout,
            body_timeout=s.body_timeout,
            keepalive_timeout=s.keepalive_timeout,
            max_connections=s.max_connections,
        )
        self.server = HTTPServer(self.gateway, limits, name="gateway")
        self.admin = AdminApp(self)
        self.gateway.set_observer(self.admin.observer)
        self.admin_server = HTTPServer(self.admin, ServerLimits(max_body=1024 * 1024), name="admin")
        try:
            self.listen_addr = await self.server.listen(*cfg.listen)
            self.admin_addr = await self.admin_server.listen(*cfg.admin)
        except OSError:
            await self.stop()
            raise
        rewrites = {m.name: m.upstream_name for m in cfg.models.values() if m.upstream_name}
        self.poller = Poller(self.registry, cfg.scrape, model_rewrites=rewrites, on_update=self.gateway.on_scrape)
        self.poller.sync()
        log.info(
            "gateway listening on http://%s:%d (admin http://%s:%d), %d replicas of %d models",
            *self.listen_addr, *self.admin_addr, len(self.registry.endpoints), len(self.registry.by_model),
        )

    # -- run-time changes (the management API and SIGHUP use these) --

    def _require(self) -> tuple[Registry, Gateway, Poller]:
        if self.registry is None or self.gateway is None or self.poller is None:
            raise RuntimeError("the gateway is not running")
        return self.registry, self.gateway, self.poller

    def add_endpoint(self, ep: EndpointConfig) -> None:
        """Add a replica at run time; the poller follows.

        Raises:
            ValueError: an endpoint with that id exists.
        """
        registry, _, poller = self._require()
        registry.add(ep)
        poller.sync()
        log.info("endpoint %s added (%s, model %s)", ep.id, ep.url, ", ".join(ep.models))

    def remove_endpoint(self, endpoint_id: str) -> None:
        """Remove a replica; requests in flight to it finish.

        Raises:
            KeyError: no such endpoint.
        """
        registry, _, poller = self._require()
        ep = registry.remove(endpoint_id)
        poller.sync()
        # Idle connections close now; busy ones close when their exchange ends.
        ep.pool.close_idle()
        log.info("endpoint %s removed", endpoint_id)

    def set_draining(self, endpoint_id: str, draining: bool) -> None:
        """Stop (or resume) sending new requests to a replica.

        Raises:
            KeyError: no such endpoint.
        """
        registry, _, _ = self._require()
        registry.endpoints[endpoint_id].draining = draining
        log.info("endpoint %s %s", endpoint_id, "draining" if draining else "undrained")

    def reload(self, config: Config | None = None) -> dict[str, Any]:
        """Apply a new configuration (default: re-read the config file) without dropping connections.

        Endpoints are added, removed or replaced by id; models, aliases, keys and
        limits that the request path reads are swapped in. ``listen``/``admin``
        changes need a restart and are reported, not applied.

        Raises:
            ConfigError: the new configuration is invalid (nothing is changed).
        """
        registry, gateway, poller = self._require()
        if config is None:
            if not self.config.source:
                raise ConfigError("", "the running configuration was not read from a file; nothing to reload")
            config = load_file(self.config.source)
        old = {ep.id: ep for ep in self.config.endpoints}
        new = {ep.id: ep for ep in config.endpoints}
        added = [i for i in new if i not in old]
        removed = [i for i in old if i not in new]
        changed = [i for i in new if i in old and new[i] != old[i]]
        # Check before changing anything: an id added at run time (API) that the
        # file now also names would fail half-way.
        clash = [i for i in added if i in registry.endpoints]
        if clash:
            raise ConfigError(
                "endpoints",
                f"{', '.join(clash)} already exist(s) (added at run time); remove them first or rename them in the file",
                source=config.source,
            )
        for i in removed:
            if i in registry.endpoints:
                registry.remove(i).pool.close_idle()
        for i in changed:
            if i in registry.endpoints:
                registry.remove(i).pool.close_idle()
            registry.add(new[i])
        for i in added:
            registry.add(new[i])
        registry.reconfigure(config)
        gateway.reconfigure(config)
        poller.sync()
        not_applied = [k for k in ("listen", "admin") if getattr(config, k) != getattr(self.config, k)]
        self.config = config
        summary = {"added": added, "removed": removed, "changed": changed, "restart_needed_for": not_applied}
        log.info("configuration reloaded: %s", summary)
        return summary

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether every configured model has a usable replica, and which do not."""
        reg = self.registry
        if reg is None or self.listen_addr is None:
            return False, {"ready": False, "reason": "starting"}
        missing = [m for m in self.config.model_names() if not any(ep.usable for ep in reg.candidates(m))]
        return not missing, {"ready": not missing, "models_unavailable": missing}

    async def stop(self) -> None:
        """Stop accepting, finish in-flight requests (``server.shutdown_timeout``), close."""
        timeout = self.config.server.shutdown_timeout
        if self.poller is not None:
            await self.poller.close()
        if self.gateway is not None:
            self.gateway.close()
        if self.server is not None:
            await self.server.close(timeout)
        if self.admin_server is not None:
            await self.admin_server.close(1.0)
        if self.admin is not None:
            self.admin.close()
        if self.registry is not None:
            self.registry.close()
