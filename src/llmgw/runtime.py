"""The composition root: the one place that builds the gateway process.

:class:`GatewayRuntime` makes every part of ``llmgw serve`` from the
configuration, wires them together and starts them, in this order:

1. the :class:`~llmgw.fleet.registry.Registry` (replicas and model pools),
2. the :class:`~llmgw.gateway.proxy.Gateway` (the client app) over it,
3. the client :class:`~llmgw.http.server.HTTPServer` (limits from
   :meth:`ServerLimits.from_config <llmgw.http.server.ServerLimits.from_config>`),
4. the :class:`~llmgw.admin.app.AdminApp`, given its collaborators explicitly
   (the registry, this runtime as its :class:`~llmgw.admin.ports.FleetControl`,
   a config getter, the listeners), and the gateway reports to its observer,
5. the admin listener; then both listeners are bound,
6. the scrape :class:`~llmgw.fleet.poller.Poller`,
7. the plugged-in :class:`Component` s (a control plane, another listener, a
   cluster collector), each made from the finished :class:`Parts`.

:meth:`GatewayRuntime.stop` takes them down in reverse (the client listener
drains before the admin one closes, so probes see "shutting down"), answering
every request: queued ones at once, running ones at ``server.shutdown_timeout``
(see its docstring). Reloads
(the admin API, SIGHUP through :meth:`GatewayRuntime.install_sighup`) go through
:meth:`GatewayRuntime.reload`.

Nothing below imports this module: parts are handed what they need, so calls and
imports go downward only (``tests/test_import_graph.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .admin.app import AdminApp
from .admin.ports import Listeners
from .admin.summary import reload_summary
from .config import Config, DeploymentConfig, EndpointConfig, load_file
from .engines.errors import normalize_error
from .errors import ConfigError
from .fleet.held import HeldModels
from .fleet.poller import Poller
from .fleet.registry import Registry
from .gateway.proxy import Gateway
from .http.server import HTTPServer, ServerLimits
from .log import server_logger as log

__all__ = [
    "ADMIN_LIMITS", "Component", "ComponentFactory", "GatewayRuntime", "Parts", "RouterPort", "components_for",
    "control_plane", "follower",
]

# The admin listener takes small JSON bodies only (an endpoint to add).
ADMIN_LIMITS = ServerLimits(max_body=1024 * 1024)


@dataclass(frozen=True)
class Parts:
    """What a plugged-in component may use: the process's parts, made and running.

    Attributes:
        config: the running configuration (call it each time: a reload swaps it).
        registry: the replicas and model pools.
        gateway: the client app.
        admin: the admin app (``admin.register_collector`` adds to ``/metrics``).
        fleet: the run-time operations (add, remove, drain, reload, readiness).
        listeners: the client and admin listeners.
    """

    config: Callable[[], Config]
    registry: Registry
    gateway: Gateway
    admin: AdminApp
    fleet: GatewayRuntime
    listeners: Listeners


class Component(Protocol):
    """A part plugged into the process: started after the built-in ones, stopped before them."""

    @property
    def name(self) -> str:
        """For logs."""

    async def start(self) -> None:
        """Start (bind, connect, schedule); raising stops the whole process start."""

    async def stop(self) -> None:
        """Stop; called once after :meth:`start`, also when that raised or a later component's did."""


ComponentFactory = Callable[[Parts], Component]


_NOT_LOADED_YET = "this gateway's control plane is starting (its deployments are not loaded yet): retry"


class RouterPort:
    """The router as the control plane's deployments change it (:class:`llmgw.control.deployments.Router`):
    replicas join and leave through the runtime's own operations, so the poller follows."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts

    @property
    def registry(self) -> Any:
        """The router's pools (``llmgw.fleet.registry.Registry``): routes shared between routers go there."""
        return self.parts.registry

    def add(self, ep: EndpointConfig) -> None:
        self.parts.fleet.add_endpoint(ep)

    def remove(self, endpoint_id: str) -> None:
        self.parts.fleet.remove_endpoint(endpoint_id)

    def set_draining(self, endpoint_id: str, draining: bool) -> None:
        self.parts.fleet.set_draining(endpoint_id, draining)

    def inflight(self, endpoint_id: str) -> int | None:
        ep = self.parts.registry.endpoints.get(endpoint_id)
        return None if ep is None else int(ep.inflight)

    def hold(self, models: frozenset[str], wanted: frozenset[str]) -> None:
        self.parts.gateway.held_models = models
        self.parts.fleet.wanted_models = wanted


def control_plane(parts: Parts) -> Component:
    """The control plane (:class:`llmgw.control.service.ControlPlane`) as a component:
    its collector on the admin ``/metrics``, its nodes and deployments on the management API,
    its deployments' replicas in the router."""
    from .control.service import ControlPlane

    cp = ControlPlane(parts.config, admin=parts.admin, admin_addr=parts.fleet.admin_addr, router=RouterPort(parts))
    # an operator's drain of a deployment's replica (ctl drain) reaches the routers that follow too
    parts.fleet.drain_listeners.append(cp.follow_hub.operator_drain)
    return cp


def _without_token(f: Any) -> Any:
    return dataclasses.replace(f, token=None) if f is not None else None


def _deployments_changed(old: Sequence[DeploymentConfig], new: Sequence[DeploymentConfig]) -> dict[str, Any]:
    """What a reload changes in the file's ``deployments:`` (the control plane applies it on its next pass):
    names ``added``, ``removed``, ``changed``, and ``replicas`` (name -> ``[before, after]``) for a changed
    entry whose count changed."""
    was = {d.name: d for d in old}
    now = {d.name: d for d in new}
    changed = [n for n in now if n in was and now[n] != was[n]]
    return {
        "added": [n for n in now if n not in was], "removed": [n for n in was if n not in now], "changed": changed,
        "replicas": {n: [was[n].replicas, now[n].replicas] for n in changed if was[n].replicas != now[n].replicas},
    }


def follower(parts: Parts) -> Component:
    """A router following control planes (:class:`llmgw.fleet.follow.Follower`, ``follow:``): their
    ready replicas in the router, its state on the admin ``/metrics`` and ``/ready``."""
    from .fleet.follow import Follower

    return Follower(parts.config, RouterPort(parts), admin=parts.admin)


def components_for(config: Config) -> list[ComponentFactory]:
    """The components a configuration asks for: the control plane when ``control:`` is set, the follower
    when ``follow:`` is (the configuration refuses both)."""
    if config.control is not None:
        return [control_plane]
    return [follower] if config.follow is not None else []


_SECTIONS = frozenset(f.name for f in dataclasses.fields(Config)) - {
    "listen", "admin", "endpoints", "models", "deployments", "source"}
"""The settings a reload names by their section when they changed (their values are not said: keys are secrets):
every key of the file but those its answer says otherwise (endpoints, models, deployments, restart_needed_for)."""

_CONTROL_AT_START = ("listen", "database", "lease", "advertise", "state_file", "tls_cert", "tls_key",
                     "tls_client_ca", "allow_insecure", "grpc_server")
"""``control:`` keys the control plane reads once, at start: a reload that changes one says a restart is needed."""


class GatewayRuntime:
    """Builds, starts and stops everything ``llmgw serve`` runs (see the module docstring).

    Use inside a running event loop::

        rt = GatewayRuntime(config)
        await rt.start()
        ...
        await rt.stop()

    Args:
        config: the configuration to start with.
        components: factories of the parts to plug in (each is called once the
            built-in parts run, with them as :class:`Parts`), started in order
            and stopped in reverse.
    """

    def __init__(self, config: Config, components: Sequence[ComponentFactory] = ()) -> None:
        self.config = config
        self.component_factories = tuple(components)
        self.components: list[Component] = []
        self.registry: Registry | None = None
        self.gateway: Gateway | None = None
        self.server: HTTPServer | None = None
        self.admin_server: HTTPServer | None = None
        self.listeners = Listeners()
        self.listen_addr: tuple[str, int] | None = None
        self.admin_addr: tuple[str, int] | None = None
        self.poller: Poller | None = None
        self.admin: AdminApp | None = None
        self._reloads: dict[str, int] = {"ok": 0, "failed": 0}
        self.drain_listeners: list[Callable[[str, bool], None]] = []
        """Told of each :meth:`set_draining` (the control plane: its followers' table says it too)."""
        self.wanted_models: frozenset[str] = frozenset()
        """Models the control plane's deployments want a replica of (``/ready`` waits for one of each)."""

    def _config(self) -> Config:
        return self.config

    async def start(self) -> None:
        """Build everything, bind both listeners, start the poller and the components.

        Raises:
            OSError: an address cannot be bound (the message names it).
            Exception: whatever a component's ``start`` raised; everything started is stopped first.
        """
        cfg = self.config
        self.registry = registry = Registry(cfg)
        self.gateway = gateway = Gateway(cfg, registry, normalize_error)
        if cfg.control is not None:
            # (the deployments are not loaded before the control plane starts, after the listeners: a model
            # of theirs asked meanwhile is 503 and retried, not 404 as a model nobody serves)
            gateway.held_models = HeldModels(reason=_NOT_LOADED_YET, every=True)
        self.server = HTTPServer(gateway, ServerLimits.from_config(cfg), name="gateway")
        self.listeners.client = self.server
        self.admin = admin = AdminApp(registry=registry, fleet=self, config=self._config, listeners=self.listeners)
        gateway.set_observer(admin.observer)
        self.admin_server = HTTPServer(admin, ADMIN_LIMITS, name="admin")
        self.listeners.admin = self.admin_server
        try:
            self.listen_addr = await self.server.listen(*cfg.listen)
            self.admin_addr = await self.admin_server.listen(*cfg.admin)
        except OSError:
            await self.stop()
            raise
        rewrites = {m.name: m.upstream_name for m in cfg.models.values() if m.upstream_name}
        self.poller = Poller(registry, cfg.scrape, model_rewrites=rewrites, on_update=gateway.on_scrape)
        self.poller.sync()
        if self.component_factories:
            parts = Parts(
                config=self._config, registry=registry, gateway=gateway, admin=admin, fleet=self,
                listeners=self.listeners,
            )
            try:
                for factory in self.component_factories:
                    component = factory(parts)
                    self.components.append(component)
                    await component.start()
                    log.info("%s started", component.name)
            except BaseException:
                await self.stop()
                raise
        # (after the components: a control plane that cannot start must not read as a gateway that did)
        log.info(
            "gateway listening on http://%s:%d (admin http://%s:%d), %d replicas of %d models",
            *self.listen_addr, *self.admin_addr, len(registry.endpoints), len(registry.by_model),
        )

    # -- run-time changes (the management API and SIGHUP use these: admin.ports.FleetControl) --

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
        poller.sync(spread=False)  # scraped at once: no request goes to it before its first scrape
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
        for tell in self.drain_listeners:
            tell(endpoint_id, draining)

    @property
    def reloads(self) -> Mapping[str, int]:
        """Reloads so far by result (``ok``, ``failed``): ``llmgw_config_reloads_total``."""
        return self._reloads

    def reload(self, config: Config | None = None, *, trigger: str = "call") -> dict[str, Any]:
        """Apply a new configuration (default: re-read the config file) without dropping connections.

        Endpoints are added, removed or replaced by id; models, aliases, keys and
        limits that the request path reads are swapped in; the control plane applies
        the file's ``deployments:`` on its next pass. ``listen``/``admin``,
        ``admission.header``, ``follow`` and the ``control:`` keys read at start
        (:data:`_CONTROL_AT_START`; a ``control:`` section added or removed) need a
        restart and are reported, not applied. Counted in :attr:`reloads`, whatever the ``trigger`` (``api``,
        ``sighup``, ...: for the log).

        Returns:
            ``added``, ``removed``, ``changed`` (endpoint ids), ``deployments``
            (:func:`_deployments_changed`) and ``restart_needed_for``.

        Raises:
            ConfigError: the new configuration is invalid, or adds an endpoint id
                that was added at run time (nothing is changed).
            RuntimeError: the gateway is not running.
        """
        try:
            summary = self._reload(config)
        except (ConfigError, ValueError, RuntimeError) as exc:
            self._reloads["failed"] += 1
            # (logged whatever asked for it: an operator reads why in the journal, not only the caller)
            # (its text: the exception itself, kept by the record, would keep its traceback's frames alive,
            # the admin connection that asked among them)
            log.error("reload %s failed, keeping the running configuration: %s",
                      "on SIGHUP" if trigger == "sighup" else f"({trigger})", str(exc))
            raise
        self._reloads["ok"] += 1
        restart = summary["restart_needed_for"]
        log.info("%s (%s)%s", reload_summary(summary), trigger,
                 f"; needs a restart to apply: {', '.join(restart)}" if restart else "")
        return summary

    def _reload(self, config: Config | None) -> dict[str, Any]:
        registry, gateway, poller = self._require()
        if config is None:
            if not self.config.source:
                raise ConfigError("", "the running configuration was not read from a file; nothing to reload")
            config = load_file(self.config.source, serve=True)  # (what serve refuses: a file with no endpoints)
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
            gone = None
            if i in registry.endpoints:
                gone = registry.remove(i)
                gone.pool.close_idle()
            ep = registry.add(new[i])
            if gone is not None and new[i].api_key == old[i].api_key:
                ep.adopt_auth(gone)  # (a changed key is probed at once: the new replica starts unheld)
        for i in added:
            registry.add(new[i])
        registry.reconfigure(config)
        gateway.reconfigure(config)
        poller.sync()
        not_applied = [k for k in ("listen", "admin") if getattr(config, k) != getattr(self.config, k)]
        if config.admission.header.lower() != self.config.admission.header.lower():
            not_applied.append("admission.header")  # read by the client listener's connections
        if _without_token(config.follow) != _without_token(self.config.follow):
            not_applied.append("follow")  # (its token is read on every call: a new one is presented next time)
        control = config.control
        if (config.control is None) != (self.config.control is None):
            not_applied.append("control")  # (a control plane is started, or stopped, with the process)
            control = self.config.control
        elif config.control is not None and self.config.control is not None:
            # read once, at start: the listener, its TLS, the database and the lease (join and router
            # tokens, heartbeat_interval and heartbeat_grace are read on every call: applied)
            fixed = [f for f in _CONTROL_AT_START if getattr(config.control, f) != getattr(self.config.control, f)]
            not_applied.extend(f"control.{f}" for f in fixed)
            if fixed:
                control = dataclasses.replace(config.control, **{f: getattr(self.config.control, f) for f in fixed})
        # what was not applied stays as the process runs it: the next reload compares with that
        running: dict[str, Any] = {k: getattr(self.config, k) for k in ("listen", "admin") if k in not_applied}
        if control is not config.control:
            running["control"] = control
        if "admission.header" in not_applied:
            running["admission"] = dataclasses.replace(config.admission, header=self.config.admission.header)
        if "follow" in not_applied:  # (the follower runs the old one; a new token is presented from now on)
            old_follow = self.config.follow
            running["follow"] = (dataclasses.replace(old_follow, token=config.follow.token)
                                 if old_follow is not None and config.follow is not None else old_follow)
        deployments = _deployments_changed(self.config.deployments, config.deployments)
        applied = dataclasses.replace(config, **running) if running else config
        models = sorted(m for m in {*self.config.models, *applied.models}
                        if self.config.models.get(m) != applied.models.get(m))
        # (what is applied: a key that needs a restart is in restart_needed_for, not here, reload after reload)
        sections = [f.name for f in dataclasses.fields(applied) if f.name in _SECTIONS
                    and getattr(applied, f.name) != getattr(self.config, f.name)]
        self.config = applied
        return {"added": added, "removed": removed, "changed": changed, "deployments": deployments,
                "models": models, "settings": sections, "restart_needed_for": not_applied}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Whether every configured model, and every model a deployment wants replicas of (scaled
        above 0), has a usable replica, and which do not.

        The body names each model without one in ``models_unavailable`` and, in
        ``unavailable``, why each of its replicas takes nothing (``unreachable``,
        ``stale``, ``breaker_open``, ``breaker_probing``, ``draining``; a model with no
        replica at all maps to ``{}``). A router following control planes (``follow:``) asks
        it of the models of its replica table too, and one without endpoints of its own is not
        ready before its first table (reason ``no_replica_table``); its body has ``follow``.
        """
        reg = self.registry
        if reg is None or self.listen_addr is None:
            return False, {"ready": False, "reason": "starting"}
        now = time.monotonic()
        missing: list[str] = []
        why: dict[str, dict[str, str]] = {}
        names = dict.fromkeys([*self.config.model_names(), *sorted(self.wanted_models)])
        follow: dict[str, Any] | None = None
        for c in self.components:
            waiting = getattr(c, "readiness", None)
            if waiting is None:
                continue
            follow = c.status()  # type: ignore[attr-defined]
            not_yet = waiting()
            if not_yet is not None and not self.config.endpoints:
                return False, {"ready": False, **not_yet}
            names.update(dict.fromkeys(sorted(c.models())))  # type: ignore[attr-defined]
        for m in names:
            eps = reg.candidates(m)
            reasons = {ep.id: ep.unusable_reason(now) for ep in eps}
            if not any(r is None for r in reasons.values()):
                missing.append(m)
                why[m] = {i: r for i, r in reasons.items() if r is not None}
        body: dict[str, Any] = {"ready": not missing, "models_unavailable": missing, "unavailable": why}
        held = getattr(self.gateway, "held_models", None)
        said = getattr(held, "reasons", None) or {}
        deployed = {m: said[m] for m in missing if not why[m] and m in said}
        if deployed:  # (a deployed model without a replica: the control plane's reason, as its 503 says it)
            body["deployments"] = deployed
        if follow is not None:
            body["follow"] = follow
        refused = sorted(ep.id for ep in reg.endpoints.values() if ep.auth_failed)
        if refused:
            body["replicas_auth_failed"] = refused  # (they refuse the gateway's key: the config needs fixing)
        return not missing, body

    def hurry(self) -> None:
        """Make a running (or coming) :meth:`stop` wait no longer for requests in flight:
        they are ended at once, as at ``server.shutdown_timeout`` (a second Ctrl-C)."""
        if self.server is not None:
            self.server.hurry()

    # -- signals --

    def install_sighup(self) -> Callable[[], None]:
        """Reload the configuration file on SIGHUP (needs the running loop); returns the uninstaller.

        A failed reload is logged and the running configuration kept; both are
        counted in ``llmgw_config_reloads_total`` like reloads through the admin API.
        """
        loop = asyncio.get_running_loop()

        def on_hup() -> None:
            with contextlib.suppress(ConfigError, ValueError, RuntimeError):  # (reload logged why)
                self.reload(trigger="sighup")

        loop.add_signal_handler(signal.SIGHUP, on_hup)

        def uninstall() -> None:
            loop.remove_signal_handler(signal.SIGHUP)

        return uninstall

    async def stop(self) -> None:
        """Shut down gracefully; every request gets an answer.

        In order: requests waiting in the admission queue get 503 ``shutting_down`` at
        once (and so would any that would wait from now on); the components stop; the
        client listener stops accepting and requests in flight get
        ``server.shutdown_timeout`` to finish (or until :meth:`hurry`); then each
        still running is ended honestly (:meth:`Gateway.cut`: an SSE error event and
        the end of the chunked body for a stream, a 503 for an answer not begun), and
        only what is still open after that is cut; then the rest closes.
        """
        timeout = self.config.server.shutdown_timeout
        if self.gateway is not None:
            self.gateway.shutdown()
        while self.components:
            component = self.components.pop()
            try:
                await component.stop()
            except Exception:
                log.exception("stopping %s failed; going on with the shutdown", component.name)
        if self.poller is not None:
            await self.poller.close()
        if self.server is not None:
            # (the gateway's deadline sweep keeps running meanwhile: a stream that
            # stalls is still cut at read_timeout)
            await self.server.close(timeout, cut=self.gateway.cut if self.gateway is not None else None)
        if self.gateway is not None:
            self.gateway.close()
        if self.admin_server is not None:
            await self.admin_server.close(1.0)
        if self.admin is not None:
            self.admin.close()
        if self.registry is not None:
            self.registry.close()
