"""The gateway process: registry, client listener and admin listener together."""

from __future__ import annotations

from typing import Any

from ..admin.app import AdminApp
from ..config import Config
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
        self.registry: Registry | None = None  # type: ignore[assignment]
        self.gateway: Gateway | None = None
        self.server: HTTPServer | None = None
        self.admin_server: HTTPServer | None = None
        self.listen_addr: tuple[str, int] | None = None
        self.admin_addr: tuple[str, int] | None = None

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
        self.admin_server = HTTPServer(AdminApp(self), ServerLimits(max_body=1024 * 1024), name="admin")
        try:
            self.listen_addr = await self.server.listen(*cfg.listen)
            self.admin_addr = await self.admin_server.listen(*cfg.admin)
        except OSError:
            await self.stop()
            raise
        log.info(
            "gateway listening on http://%s:%d (admin http://%s:%d), %d replicas of %d models",
            *self.listen_addr, *self.admin_addr, len(self.registry.endpoints), len(self.registry.by_model),
        )

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
        if self.server is not None:
            await self.server.close(timeout)
        if self.admin_server is not None:
            await self.admin_server.close(1.0)
        if self.registry is not None:
            self.registry.close()
