"""What the admin listener is given: the operations and the listeners of the running process.

The admin app never reaches into the process that built it; the composition
root (:mod:`llmgw.runtime`) hands it these, typed, so that a renamed field fails
loudly (at type-check time, else as an ``AttributeError``) instead of silently
switching a check off.
"""

from __future__ import annotations

from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..config import Config, EndpointConfig
    from ..http.parser import Request
    from ..http.server import ResponseWriter

__all__ = ["DeploymentControl", "FleetControl", "Listener", "Listeners", "MirrorBlobs", "NodeControl", "TokenControl"]


class FleetControl(Protocol):
    """The run-time changes the management API makes (:class:`llmgw.runtime.GatewayRuntime` implements them).

    Each keeps the registry, the data path and the scrape poller together, and
    never drops a connection in flight.
    """

    def add_endpoint(self, ep: EndpointConfig) -> None:
        """Add a replica (``ValueError``: the id exists)."""

    def remove_endpoint(self, endpoint_id: str) -> None:
        """Remove a replica (``KeyError``: no such id); requests in flight finish."""

    def set_draining(self, endpoint_id: str, draining: bool) -> None:
        """Stop (or resume) sending it new requests (``KeyError``: no such id)."""

    def reload(self, config: Config | None = None, *, trigger: str = "call") -> dict[str, Any]:
        """Apply a new configuration (default: re-read the file); a summary of what changed.

        Raises ``ConfigError`` (invalid, nothing changed), ``ValueError`` (a
        conflict with endpoints added at run time) or ``RuntimeError`` (not
        running). Counted in :attr:`reloads`.
        """

    @property
    def reloads(self) -> Mapping[str, int]:
        """Reloads so far by result: ``{"ok": n, "failed": m}``."""

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether every configured model has a usable replica, and the body for ``/ready``."""


class NodeControl(Protocol):
    """The control plane's nodes, as the management API reads and changes them
    (:class:`llmgw.control.service.ControlPlane` implements it and attaches itself with
    :meth:`llmgw.admin.app.AdminApp.attach_nodes`)."""

    def list_nodes(self) -> list[dict[str, Any]]:
        """Every node without its GPUs (``gpu_count`` instead)."""

    def list_gpus(self) -> list[dict[str, Any]]:
        """Every GPU of every node, each with ``node`` and ``node_state``."""

    def node(self, name: str) -> dict[str, Any] | None:
        """One node with its GPUs; ``None`` when there is no such node."""

    def set_cordoned(self, name: str, cordoned: bool) -> Awaitable[dict[str, Any] | None]:
        """Cordon or uncordon; the node with ``changed``; ``None`` when there is no such node.
        (Awaited: with a database the change is written, fenced, before it is made.)"""

    def forget_node(self, name: str) -> Awaitable[dict[str, Any] | None]:
        """Remove a node that is not up; the node as it was; ``None`` when there is no such node.
        (Raises an HTTPError 409 while it is up.)"""

    def not_leader(self) -> str | None:
        """``None`` where this control plane acts; on a standby, the message naming the leader."""

    def leader_admin(self) -> str | None:
        """The leader's admin URL when another process leads (``llmgw-leader`` header), else ``None``."""

    def node_of_replica(self, replica_id: str) -> str | None:
        """The node whose latest heartbeat reported the replica; ``None``: none did."""

    async def engine_check(self, node: str, engine: str, *, model: str | None = None, static_only: bool = False,
                           timeout: float = 600.0) -> list[dict[str, Any]]:
        """``llmgw ctl engine-check ENGINE`` run by ``node``'s agent; the checks. Raises like :meth:`replica_logs`."""

    async def replica_logs(self, replica_id: str, lines: int = 100) -> str:
        """The last ``lines`` lines of the replica's log, from its node.

        Raises :class:`llmgw.control.service.ReplicaLogsError` (``status``, ``code``) when they cannot be had.
        """


class DeploymentControl(Protocol):
    """The control plane's deployments (:class:`llmgw.control.deployments.DeploymentController`).

    Each change raises :class:`llmgw.control.deployments.DeploymentError` (a ``ValueError`` with
    ``status``, ``code`` and ``param``) when refused.
    """

    def list_views(self, *, show_secrets: bool = False) -> list[dict[str, Any]]:
        """Every deployment: desired and ready replicas, where each runs, why one is missing."""

    def view(self, name: str, *, show_secrets: bool = False) -> dict[str, Any]:
        """One deployment (``DeploymentError`` 404 when there is none)."""

    def create(self, cfg: Any) -> dict[str, Any]:
        """Add a deployment (a :class:`~llmgw.config.DeploymentConfig`); its view."""

    def update(self, cfg: Any) -> dict[str, Any]:
        """Give a deployment made through the API a new entry (a rolling update when its replicas' form
        changes); its view."""

    def scale(self, name: str, replicas: int) -> dict[str, Any]:
        """Set its replica count; its view."""

    def delete(self, name: str) -> dict[str, Any]:
        """Undeploy it: its replicas drain, then stop."""

    async def committed(self) -> None:
        """Wait until the changes made so far are in the control plane's database (raises when they cannot be)."""


class TokenControl(Protocol):
    """Join tokens made through the API (:class:`llmgw.control.service.ControlPlane`; attached with
    :meth:`llmgw.admin.app.AdminApp.attach_tokens`). Changes raise ``HTTPError`` 503 off the leader."""

    async def list_tokens(self) -> dict[str, Any]:
        """``{"tokens": [...], "config_tokens": N}``: never a secret or its digest."""

    async def create_token(self, name: str | None, expires_in: float | None) -> dict[str, Any]:
        """A new token's view with ``token``, its secret (shown this once)."""

    async def revoke_token(self, token_id: str) -> dict[str, Any] | None:
        """Its view with ``changed``; ``None``: no such token."""


class MirrorBlobs(Protocol):
    """The mirror's blobs for node agents (:class:`llmgw.mirror.serve.BlobServer`; the control plane
    attaches it with :meth:`llmgw.admin.app.AdminApp.attach_mirror`)."""

    def handle(self, req: Request, w: ResponseWriter) -> Awaitable[None] | None:
        """Answer a request under ``/mirror/v1/`` (it checks the node's credential itself)."""


class Listener(Protocol):
    """What the admin app reads off a listener (an :class:`llmgw.http.server.HTTPServer`)."""

    @property
    def closing(self) -> bool:
        """Shutting down: no new connections, in-flight requests finishing."""

    @property
    def connections(self) -> Collection[Any]:
        """Open connections."""

    @property
    def rejected(self) -> int:
        """Connections refused (at the limit or while closing)."""

    @property
    def sockets(self) -> list[Any]:
        """The bound sockets (where it listens)."""


@dataclass
class Listeners:
    """The process's listeners; the composition root fills them in as it makes them.

    (The admin listener is made after the admin app it serves, so it is set
    after the app exists.)
    """

    client: Listener | None = None
    admin: Listener | None = None

    def items(self) -> list[tuple[str, Listener]]:
        """``(name, listener)`` for those that exist: ``client``, then ``admin``."""
        return [(name, srv) for name, srv in (("client", self.client), ("admin", self.admin)) if srv is not None]

    def client_closing(self) -> bool:
        return self.client is not None and self.client.closing

    def admin_closing(self) -> bool:
        return self.admin is not None and self.admin.closing
